"""Per-stage memory models: the ``MemoryModelLike`` protocol, the analytic model, its fitted
coefficients and the peak-in-flight rule used by the packers, the simulator and the runtime."""
