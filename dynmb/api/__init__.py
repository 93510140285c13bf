"""The public planning API: ``Planner`` (one global batch -> plan, schedule, prediction),
``DynamicBatchSampler`` and collate helpers for your own training loop."""
