"""The one GPipe / 1F1B op order of a stage: which (op, microbatch) it runs next.

``stage_order(stage, P, m, kind, backward_order)`` is what the GPipe and 1F1B builders emit
(``dynmb.schedule.builders``), what the zero-bubble list scheduler starts from
(``dynmb.schedule.zerobubble``, through ``windowed_order`` with its own windows) and what the
fast makespan estimate sweeps (``dynmb.timing.makespan``), so the three see the same order. Pure Python.

- GPipe: every forward in microbatch order, then every backward in ``backward_order``.
- 1F1B: before its b-th backward a stage has run ``min(m, b + P - stage)`` forwards (warm-up
  ``P - 1 - stage``, then one forward per backward), and at least up to that backward's own
  microbatch: a chain of slices of a long sequence extends the warm-up until its last slice
  has gone forward.
- ``windowed_order(m, k, backward_order)``: the same rule for any in-flight window ``k``
  (1F1B is ``k = P - stage``): forward while fewer than ``k`` microbatches are in flight or
  while the next backward's own microbatch has not gone forward, else that backward.
- Chain lookahead (``ChainOrder(order, lookahead)``, a plan's ``slice_lookahead``): before a backward
  of microbatch ``j`` a stage may forward ``e = min(lookahead, k - 1)`` microbatches past ``j``, so a
  chain's last slice no longer goes backward right after its own forward (a full round trip the stage
  would wait) while later microbatches could go forward: forward while ``f < max(b + k, j + 1 + e)``
  (``lookahead >= k - 1``: ``max(b, j) + k``, the window counted from the chain's end). The extra
  forwards are held in flight: the simulator's peak counts them like any other.

Deadlock freedom with slices: the forwards a stage has run before its b-th backward,
``max(min(m, b + k), order[0..b] + 1 + e)`` (at most ``m``), never grow along the pipeline when the windows do
not (``k``, hence ``e``, non-increasing in the stage), so a stage waiting for a gradient has already sent
every activation its successor needs to produce it.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, overload

__all__ = ["stage_order", "windowed_order", "check_order", "ChainOrder", "lookahead_of"]


class ChainOrder(Sequence[int]):
    """A backward order (``Plan.backward_order``) with the chain lookahead the schedule takes (module doc):
    a sequence of microbatch ids, so every builder reads it as the order it is; ``lookahead`` travels with
    it to ``windowed_order``. Equal orders with different lookaheads differ (``key``)."""

    def __init__(self, order: Sequence[int], lookahead: int = 0) -> None:
        self.order = tuple(int(j) for j in order)
        self.lookahead = max(0, int(lookahead))

    @overload
    def __getitem__(self, i: int) -> int: ...

    @overload
    def __getitem__(self, i: slice) -> tuple[int, ...]: ...

    def __getitem__(self, i: Any) -> Any:
        return self.order[i]

    def __len__(self) -> int:
        return len(self.order)

    @property
    def key(self) -> tuple:
        """What a schedule built from this order depends on (for caches)."""
        return (self.order, self.lookahead)

    def __repr__(self) -> str:
        return f"ChainOrder({list(self.order)}, lookahead={self.lookahead})"


def lookahead_of(backward_order: Sequence[int] | None) -> int:
    """The chain lookahead a backward order carries (``ChainOrder``), else 0."""
    return backward_order.lookahead if isinstance(backward_order, ChainOrder) else 0


def check_order(m: int, backward_order: Sequence[int] | None) -> list[int]:
    """``backward_order`` as a list (default ``0..m-1``); ``ValueError`` unless a permutation of ``0..m-1``."""
    order = list(range(m)) if backward_order is None else [int(j) for j in backward_order]
    if sorted(order) != list(range(m)):
        raise ValueError(f"backward_order must be a permutation of 0..{m - 1}, got {order}")
    return order


def windowed_order(m: int, window: int, backward_order: Sequence[int] | None = None,
                   backward: str = "B") -> list[tuple[str, int]]:
    """One stage's forwards (in microbatch order) and backwards (in ``backward_order``, labelled
    ``backward``) with at most ``window`` microbatches in flight, except that a backward's own
    microbatch always goes forward before it, and with a ``ChainOrder`` ``min(lookahead, window - 1)``
    more (module doc)."""
    order = check_order(m, backward_order)
    k = max(1, int(window))
    extra = min(lookahead_of(backward_order), k - 1)
    seq: list[tuple[str, int]] = []
    f = 0
    for b, j in enumerate(order):
        while f < m and (f - b < k or f <= j + extra):
            seq.append(("F", f))
            f += 1
        seq.append((backward, j))
    return seq


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
    order = check_order(m, backward_order)
    if kind == "gpipe":
        return [("F", j) for j in range(m)] + [("B", j) for j in order]
    return windowed_order(m, num_stages - stage, backward_order)
