"""The one GPipe / 1F1B op order of a stage: which (op, microbatch) it runs next.

``stage_order(stage, P, m, kind, backward_order)`` is what the GPipe and 1F1B builders emit
(``dynmb.schedule.builders``), what the zero-bubble list scheduler starts from
(``dynmb.schedule.zerobubble``) and what the fast makespan estimate sweeps (``dynmb.makespan``),
so the three see the same order. Pure Python.

- GPipe: every forward in microbatch order, then every backward in ``backward_order``.
- 1F1B: before its b-th backward a stage has run ``min(m, b + P - stage)`` forwards (warm-up
  ``P - 1 - stage``, then one forward per backward), and at least up to that backward's own
  microbatch: a chain of slices of a long sequence extends the warm-up until its last slice
  has gone forward.
"""

from __future__ import annotations

from typing import Sequence

__all__ = ["stage_order"]


def stage_order(stage: int, num_stages: int, m: int, kind: str,
                backward_order: Sequence[int] | None = None) -> list[tuple[str, int]]:
    """The (op, mb) sequence of ``stage`` under GPipe or 1F1B.

    Forwards run in microbatch order; backwards in ``backward_order`` (default the same
    order; ``Plan.backward_order`` reverses the slices of a long sequence). GPipe: every
    forward, then every backward. 1F1B: before its b-th backward a stage has run
    ``min(m, b + P - stage)`` forwards (warm-up ``P - 1 - stage``, then one forward per
    backward), and at least up to that backward's own microbatch: a chain of slices extends
    the warm-up until its last slice has gone forward.
    """
    order = list(range(m)) if backward_order is None else [int(j) for j in backward_order]
    if sorted(order) != list(range(m)):
        raise ValueError(f"backward_order must be a permutation of 0..{m - 1}, got {order}")
    if kind == "gpipe":
        return [("F", j) for j in range(m)] + [("B", j) for j in order]
    w = min(num_stages - 1 - stage, m)
    seq: list[tuple[str, int]] = []
    f = 0
    for b, j in enumerate(order):
        while f < min(m, max(b + w + 1, j + 1)):
            seq.append(("F", f))
            f += 1
        seq.append(("B", j))
    return seq
