"""Adapters that run dynmb plans and schedules on other frameworks' pipeline runtimes.

- ``torch_pipelining``: ``run_with_torch_pipelining`` runs one planned step with
  ``torch.distributed.pipelining``'s ``PipelineStage`` and its CSV schedule runtime, with
  receive buffers sized from the plan (variable microbatch shapes).
- ``static_rows``: the data path of engines with static shapes (``--method lockstep`` rows of ``[b, T]``
  tokens per microbatch, positions, labels, the step's valid tokens, THD fields).

Import-light: importing this package loads no torch; import the submodule where it is needed.
"""

__all__ = ["torch_pipelining", "static_rows"]
