"""Packers: group a global batch of variable-length sequences into microbatches under a
per-GPU memory limit. Pure numpy; every method returns a validated ``Plan``.

Shapes: a microbatch runs at ``batch`` rows x ``padded_len``, its longest row rounded up to
a multiple of ``round_to`` (default 1), for every method; memory admissibility, costs and
the makespan estimate all see the rounded shape. The longest admissible length
(``meta["longest_fitting_length"]``) is the largest multiple of ``round_to`` up to the
model's ``max_seq_len`` whose one-row microbatch is admissible (rounded down).

Memory rule (shared by all methods, ``context``): stage i may spend ``cap_i = limit -
state_bytes_i`` on activations, with ``k_i`` the microbatches it holds in flight (``P - i``
under 1F1B / memory-aware / interleaved, ``1`` under GPipe, where the whole batch is then
checked). A microbatch (b rows x s) is admissible under the tight budget ``k_i * act_i(b,
s) + transient_i(b, s) <= cap_i`` (exact for equal microbatches). The plan's
``pred_peak_bytes`` is the exact ``MemoryModel.peak_bytes`` of the result; if a mix of
sizes exceeds the limit, the method is re-run under the safe budget ``k_i * (act_i +
transient_i) <= cap_i`` (a window of k such microbatches plus one op's buffers never
exceeds the cap, in any order); ``meta["budget"]`` says which was used.

Cost: every time estimate goes through the one lookup ``cost_model.stage_costs(rows,
padded_len, attn)`` with each microbatch's attention work
``Microbatch.attention_work(model_cfg.attention)`` (sum of s_i^2 over the documents of a
packed microbatch under ``auto``, rows x padded_len^2 for one document per row), and the
one fast makespan estimate ``dynmb.timing.makespan.makespan`` (``predictions["est_makespan_s"]``):
the simulator's recurrence over the GPipe / 1F1B op order ``dynmb.schedule.order.stage_order``
(which the schedule builders emit too) up to ``dynmb.timing.makespan.EXACT_OPS`` ops, the pipeline
bound above. It lives in the simulation layer, which sits above packing (DESIGN.md "Layout");
``dynmb.timing.simulate.estimate_makespan`` is the same function, as the simulator's fast path.

Methods (``METHODS``), one module per family:

- ``fixed`` / ``sorted`` (``fixed``): ``mbs`` sequences per microbatch in batch order /
  sorted longest first, padded to the longest; without ``mbs`` the largest whose worst case
  is admissible.
- ``packed`` (``packed``): rows of ``pack_len`` tokens filled best-fit-decreasing with whole
  documents, ``mbs`` rows per microbatch (default 1).
- ``token-budget`` (``token_budget``): fairseq ``batch_by_size``, length-ascending, a
  microbatch grows while rows x padded_len <= T.
- ``balanced`` (``balanced``): verl's dynamic batching, ceil(tokens / budget) packed rows
  balanced by Karmarkar-Karp over the workload, small ones at both ends, split when over the limit
  (``mbs`` divides the budget of ``token-budget`` and ``balanced``).
- ``lockstep`` (``lockstep``): rows of ``pack_len`` for engines with static shapes, balanced across the
  rows the replicas run together and the pipeline's microbatches, replica-major.
- ``dynapipe`` (``dynapipe``): DynaPipe's DP over the rounded lengths.
- ``dynamic`` (``dynamic``): this project's method.

``dispatch.pack`` runs them (checks, oversize policy, data-parallel balancing, estimate);
``rows`` holds the row, group and cut-point helpers they share.
"""

from __future__ import annotations

from dynmb.packing.context import PackingError, auto_mbs, max_fitting_length
from dynmb.packing.dispatch import METHODS, pack

__all__ = ["METHODS", "PackingError", "pack", "max_fitting_length", "auto_mbs"]
