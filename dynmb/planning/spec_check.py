"""``check_plan_spec``: the settings no global batch can be planned with, refused before any planning.

``dynmb plan``, ``dynmb run`` (``RunSpec.check``, before torchrun starts) and ``dynmb compare``
(every case, before anything is written into its results folder) call this one function, so the
three refuse the same flag combinations with the same one line. ``PlanSpec`` itself checks the
numbers and the fixed option sets; this adds what needs a registry (no batch, no torch):

1. the method (registered in ``dynmb.packing.methods``), the schedule kind (``dynmb.schedule.kinds``, or
   ``auto``) and the reorder (``auto`` or ``dynmb.planning.REORDER_METHODS``) are known;
2. ``virtual`` > 1 needs a kind whose record takes virtual stages (``ScheduleKind.virtual_stages``;
   ``auto``: one of ``auto_kinds(virtual)``); a kind of a fixed chunk count (``ScheduleKind.chunks``:
   ``zb-v``, 2) needs exactly that ``virtual``;
3. ``oversize='split'`` needs a kind that runs slices of long sequences (``ScheduleKind.slices``;
   ``auto``: one of ``auto_kinds(virtual, slices=True)``), with any ``dp`` (each chain of slices
   runs whole on one replica); the kinds are read off the registry, so a kind that learns to run
   slices is admitted at once;
4. ``mbs`` only for the methods that take one (``MBS_METHODS``: the rows of ``fixed``, ``sorted``,
   ``packed``, the budget divisor of ``token-budget`` and ``balanced``); ``dynamic`` and
   ``dynapipe`` choose their own sizes;
5. ``pack_len`` only for the methods that build rows of it (``PACK_LEN_METHODS``: ``packed``);
   every other method would ignore it;
6. with a memory model: ``packed``'s ``pack_len`` is at most the longest row that fits
   (``slicing.longest_row``, the packer's own check, which raises ``PackingError`` naming both);
7. a method whose replicas run in lockstep (``MethodRecord.lockstep``: ``lockstep``) takes no ``split``
   (a static-shape engine attends within a row) and, with ``dp`` > 1, no reorder pass (it would reorder
   each replica alone).

Each refusal is a ``ValueError`` of one line naming the flag (``--schedule``, ``--virtual``, ...).
"""

from __future__ import annotations

from dynmb.memory.model import MemoryModelLike
from dynmb.core.config import ModelConfig
from dynmb.packing.dispatch import MBS_METHODS, mbs_refusal
from dynmb.packing.methods import get_method, method_names
from dynmb.core.planspec import PlanSpec
from dynmb.schedule.kinds import AUTO, auto_kinds, get_kind, kind_names, kinds_with, is_schedule_name, slice_kinds
from dynmb.planning.reorder import REORDER_METHODS

__all__ = ["check_plan_spec", "lockstep_refusal", "MBS_METHODS", "PACK_LEN_METHODS", "uses_pack_len"]

PACK_LEN_METHODS = tuple(m for m in method_names() if get_method(m).pack_len_rows)
"""Methods that build rows of ``pack_len`` tokens (the registry's ``MethodRecord.pack_len_rows``)."""


def uses_pack_len(method: str) -> bool:
    """Whether ``method`` reads ``pack_len``."""
    return method in method_names() and get_method(method).pack_len_rows


def lockstep_refusal(spec: PlanSpec) -> str | None:
    """The one-line refusal of item 7 (also checked by ``planning.planner.plan_step``, the API's path), else None."""
    if not get_method(spec.method).lockstep or not (spec.oversize == "split" or
                                                    spec.dp > 1 and spec.reorder not in ("auto", "none")):
        return None
    flag = "--oversize split" if spec.oversize == "split" else f"--reorder {spec.reorder}"
    return (f"{flag}: {spec.method} runs microbatch i of every replica together in its planned order and "
            f"a static-shape engine attends within a row only; use --oversize truncate or drop, --reorder auto")


def check_plan_spec(spec: PlanSpec, model_cfg: ModelConfig | None = None,
                    memory_model: MemoryModelLike | None = None) -> None:
    """Raise ``ValueError`` (one line) for settings of ``spec`` no batch can be planned with (module doc)."""
    if spec.method not in method_names():
        raise ValueError(f"unknown method {spec.method!r}; expected one of {', '.join(method_names())}")
    kind = spec.schedule_kind
    if not is_schedule_name(kind):
        raise ValueError(f"unknown schedule {kind!r}; expected auto or one of {', '.join(kind_names())}")
    rec = None if kind == AUTO else get_kind(kind)         # resolved once: its traits below
    if spec.reorder != "auto" and spec.reorder not in REORDER_METHODS:
        raise ValueError(f"unknown reorder {spec.reorder!r}; expected auto or one of {', '.join(REORDER_METHODS)}")
    if spec.virtual > 1:
        if not (auto_kinds(spec.virtual) if rec is None else rec.virtual_stages):
            raise ValueError(f"--virtual {spec.virtual}: the {kind} schedule runs one stage per rank; model chunks "
                             f"per rank run on {' or '.join(kinds_with('virtual_stages')) or 'no registered kind'}")
    chunks = None if rec is None else rec.chunks
    if chunks is not None and spec.virtual != chunks:
        raise ValueError(f"--schedule {kind} runs exactly {chunks} model chunks per rank: give --virtual {chunks} "
                         f"(got {spec.virtual})")
    if spec.oversize == "split":
        if not (auto_kinds(spec.virtual, slices=True) if rec is None else rec.slices):
            among = f" (auto with --virtual {spec.virtual}: none of the kinds it weighs)" if kind == AUTO else ""
            raise ValueError(f"--oversize split: the {kind} schedule{among} cannot run slices of long sequences; "
                             f"slices run on {' or '.join(slice_kinds()) or 'no registered kind'}")
    if spec.embedding == "last" and rec is not None and rec.placement != "loop":
        raise ValueError(f"--embedding last: the {kind} schedule's {rec.placement} placement holds the last stage on "
                         f"rank 0 with the first; the embedding is there already (use --embedding first)")
    if (refusal := mbs_refusal(spec)) is not None:
        raise ValueError(refusal)
    if (refusal := lockstep_refusal(spec)) is not None:
        raise ValueError(refusal)
    if spec.pack_len is not None and not uses_pack_len(spec.method):
        raise ValueError(f"--pack-len {spec.pack_len}: {spec.method} does not build rows of a fixed length "
                         f"(pack_len is the row length of {' and '.join(PACK_LEN_METHODS)}); leave it out")
    if model_cfg is not None and memory_model is not None and spec.pack_len is not None:
        from dynmb.planning.slicing import longest_row

        longest_row(spec, model_cfg, memory_model)      # PackingError: pack_len longer than any row that fits
