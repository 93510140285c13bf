"""``Action`` and ``Schedule``: the single schedule representation (``dynmb.core.types`` re-exports them).

- ``Action``: ``(stage, op, mb)`` printed ``2F7`` like torch.distributed.pipelining's
  ``_Action`` (``F`` forward, ``B`` full backward; a split backward is ``I``, the input
  gradient, then ``W``, the weight gradients: torch's BACKWARD_INPUT / BACKWARD_WEIGHT).
- ``Schedule``: one tuple of Actions per rank; builders emit it, the validator, simulator,
  runtime and CSV I/O consume it.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import TYPE_CHECKING, Sequence

__all__ = ["Action", "Schedule", "OPS"]

OPS = ("F", "B", "I", "W")
"""Action ops, torch's ``_ComputationType`` letters: forward, full backward, backward input, backward weight."""

_ACTION_RE = re.compile(r"^\s*(\d+)([FBIW])(\d+)\s*$")


@dataclass(frozen=True, order=True)
class Action:
    """``(stage, op, mb)``; ``str(Action(2, 'F', 7)) == '2F7'`` as torch prints ``_Action``."""

    stage: int
    op: str
    mb: int

    def __post_init__(self) -> None:
        if self.op not in OPS:
            raise ValueError(f"unknown op {self.op!r}; expected one of {OPS}")
        if self.stage < 0 or self.mb < 0:
            raise ValueError(f"stage and mb must be >= 0, got {self.stage}, {self.mb}")

    def __str__(self) -> str:
        return f"{self.stage}{self.op}{self.mb}"

    __repr__ = __str__

    @classmethod
    def parse(cls, s: str) -> "Action":
        m = _ACTION_RE.match(s)
        if not m:
            raise ValueError(f"malformed action {s!r}; expected e.g. '2F7' (stage, F/B/I/W, microbatch)")
        return cls(int(m.group(1)), m.group(2), int(m.group(3)))


@dataclass(frozen=True, eq=False)
class Schedule:
    """One ordered tuple of Actions per rank.

    Stage ``s`` lives on the rank whose list holds its actions; the builders use
    torch's loop placement (stage ``s`` on rank ``s % num_ranks``) for
    interleaved schedules. ``kind`` names the builder (``gpipe``, ``1f1b``, ...).
    """

    ranks: tuple[tuple[Action, ...], ...]
    num_stages: int
    num_microbatches: int
    kind: str = ""

    if TYPE_CHECKING:  # the constructor takes any sequence of sequences; __post_init__ makes the tuples
        def __init__(self, ranks: Sequence[Sequence[Action]], num_stages: int, num_microbatches: int,
                     kind: str = "") -> None: ...

    def __post_init__(self) -> None:
        object.__setattr__(self, "ranks", tuple(tuple(r) for r in self.ranks))

    @property
    def num_ranks(self) -> int:
        return len(self.ranks)

    def stage_to_rank(self) -> dict[int, int]:
        """Map stage -> rank, read off the actions."""
        out: dict[int, int] = {}
        for r, acts in enumerate(self.ranks):
            for a in acts:
                out.setdefault(a.stage, r)
        return out

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Schedule) and self.ranks == other.ranks and self.num_stages == other.num_stages

    def __hash__(self) -> int:
        return hash(self.ranks)

    def __str__(self) -> str:
        return "\n".join(f"rank {r}: " + " ".join(str(a) for a in acts) for r, acts in enumerate(self.ranks))
