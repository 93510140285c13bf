"""The data path of engines with static shapes: every pipeline microbatch ``b`` rows of ``T`` tokens.

A static-shape engine (torchtitan's ``PipelineStage`` with receive buffers from microbatch 0 and a
schedule of a fixed microbatch count; Megatron-Core's THD rows of a fixed token count) calls
``next(data_iterator)`` once per microbatch and divides the summed loss by the step's global valid
tokens. ``static_rows(records, tokens, settings)`` is that iterator for one data-parallel rank, fed by
``DynamicBatchSampler(..., method="lockstep", num_replicas=D, rank=r, pack_len=T)`` (microbatch ``j``
of every replica runs together, balanced by ``dynmb.packing.lockstep``):

1. each sampled microbatch is collated by ``dynmb.api.collate.collate_padded`` (documents of a row
   back to back in the plan's order, ``positions`` restarting at 0 in every document, ``labels`` the
   id each position predicts -- the next id of its document, its end-of-text at its last token (the
   length convention of docs/design.md) -- and ``IGNORE_INDEX`` at pads), then padded to exactly ``rows_per_mb x pack_len`` (a row the plan left
   empty is all pad);
2. a step with fewer than ``settings.microbatches`` microbatches (the count the schedule was built
   for) is completed with all-pad microbatches (no loss tokens); a step with more is refused, naming it;
3. every ``StaticRowBatch`` (``input_ids``, ``positions``, ``labels``, ``doc_ids``) carries the step's global valid-token count (loss tokens of every replica:
   its real tokens, known from the plan with no communication), and ``thd()`` gives the
   same rows in the THD layout: Megatron's ``PackedSeqParams`` fields as plain tensors over the
   flattened ``[b * T]`` rows -- every document one segment, every row's pad tail one more, so
   ``cu_seqlens_q[-1] == b * T`` -- with no Megatron import.

``static_steps`` groups the microbatches of one global batch, stacked ``[M * b, T]``, the way
``schedule.step(input_ids, positions, target=labels)`` of torch.distributed.pipelining splits them.
The example: ``experiments/lockstep_pipelining.py`` (torchrun, 2x2 pp x dp).
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from dynmb.api.collate import IGNORE_INDEX, collate_padded, planned_loss_tokens
from dynmb.api.sampler import SampledMicrobatch

__all__ = ["StaticRowsSettings", "PackedSeqFields", "StaticRowBatch", "StaticStep", "static_rows", "static_steps",
           "thd_fields"]


@dataclass(frozen=True, kw_only=True)
class StaticRowsSettings:
    """The static shape an engine was built for."""

    pack_len: int
    """T: tokens per row (the plan's ``--pack-len``)."""
    rows_per_mb: int = 1
    """b: rows per microbatch (the plan's ``--mbs``)."""
    microbatches: int | None = None
    """M the schedule was built for: shorter steps are completed with all-pad microbatches; None: as planned."""
    pad_id: int = 0
    """Token id of pads."""

    def __post_init__(self) -> None:
        for name in ("pack_len", "rows_per_mb"):
            if int(getattr(self, name)) != getattr(self, name) or getattr(self, name) < 1:
                raise ValueError(f"StaticRowsSettings.{name} must be a whole number >= 1, got {getattr(self, name)!r}")
        if self.microbatches is not None and self.microbatches < 1:
            raise ValueError(f"StaticRowsSettings.microbatches must be >= 1 or None, got {self.microbatches!r}")


@dataclass(frozen=True, eq=False)
class PackedSeqFields:
    """Megatron-Core ``PackedSeqParams``' fields (THD layout) as plain tensors."""

    qkv_format: str
    cu_seqlens_q: torch.Tensor
    cu_seqlens_kv: torch.Tensor
    cu_seqlens_q_padded: torch.Tensor
    cu_seqlens_kv_padded: torch.Tensor
    max_seqlen_q: int
    max_seqlen_kv: int


@dataclass(frozen=True, eq=False)
class StaticRowBatch:
    """One pipeline microbatch: ``[b, T]`` int64 tensors and the step's global valid tokens."""

    input_ids: torch.Tensor
    positions: torch.Tensor
    labels: torch.Tensor
    doc_ids: torch.Tensor
    """Each token's entry in its sampled microbatch, -1 at pads (what tells segments apart)."""
    step_valid_tokens: int
    """Loss tokens of the whole global batch (every replica): the divisor of the summed loss."""
    global_batch: int
    local_index: int
    """Its place among this rank's microbatches of the step (padding ones included)."""

    def thd(self) -> PackedSeqFields:
        """These rows as THD fields (module doc, step 3)."""
        return thd_fields(self.doc_ids)


@dataclass(frozen=True, eq=False)
class StaticStep:
    """One step of one rank: ``M`` microbatches stacked ``[M * b, T]``."""

    input_ids: torch.Tensor
    positions: torch.Tensor
    labels: torch.Tensor
    step_valid_tokens: int
    microbatches: int


def thd_fields(doc_ids: torch.Tensor) -> PackedSeqFields:
    """THD fields of rows whose tokens carry their document (``doc_ids``, ``[b, T]``, -1 at pads): a
    segment starts at every row start and wherever the document changes (a row's pad tail is one)."""
    b, T = doc_ids.shape
    flat = doc_ids.reshape(-1)
    starts = torch.ones(b * T, dtype=torch.bool)
    starts[1:] = flat[1:] != flat[:-1]
    starts[::T] = True
    cu = torch.cat([torch.nonzero(starts).reshape(-1), torch.tensor([b * T])]).to(torch.int32)
    longest = int((cu[1:] - cu[:-1]).max())
    return PackedSeqFields("thd", cu, cu.clone(), cu.clone(), cu.clone(), longest, longest)


def _pad_rows(t: torch.Tensor, rows: int, cols: int, value: int) -> torch.Tensor:
    out = torch.full((rows, cols), value, dtype=torch.int64)
    out[: t.shape[0], : t.shape[1]] = t
    return out


def static_rows(records: Iterable[SampledMicrobatch], tokens: Sequence[Any],
                settings: StaticRowsSettings) -> Iterator[StaticRowBatch]:
    """This rank's microbatches, step by step, each ``[b, T]`` (module doc)."""
    b, T = settings.rows_per_mb, settings.pack_len
    step: list[SampledMicrobatch] = []
    for rec in records:
        if step and rec.global_batch != step[0].global_batch:
            yield from _step_rows(step, tokens, settings)
            step = []
        if rec.padded_len != T or rec.rows > b:
            raise ValueError(f"static_rows: global batch {rec.global_batch} microbatch {rec.microbatch} is "
                             f"{rec.rows} x {rec.padded_len}, not at most {b} x {T} (plan with --method lockstep "
                             f"--pack-len {T} --mbs {b})")
        step.append(rec)
    if step:
        yield from _step_rows(step, tokens, settings)


def _step_rows(step: list[SampledMicrobatch], tokens: Sequence[Any],
               settings: StaticRowsSettings) -> Iterator[StaticRowBatch]:
    b, T = settings.rows_per_mb, settings.pack_len
    M = settings.microbatches or len(step)
    if len(step) > M:
        raise ValueError(f"static_rows: global batch {step[0].global_batch} has {len(step)} microbatches on this "
                         f"rank, more than the {M} the schedule was built for")
    valid = planned_loss_tokens(step[0])
    for i in range(M):
        if i < len(step):
            tb = collate_padded(tokens, step[i], pad_id=settings.pad_id)
            parts = [tb.input_ids, tb.position_ids, tb.labels, tb.doc_ids]
        else:                                            # an all-pad microbatch: no loss tokens
            parts = [torch.empty((0, 0), dtype=torch.int64) for _ in range(4)]
        ids, pos, lab, doc = (_pad_rows(x, b, T, v) for x, v in zip(parts, (settings.pad_id, 0, IGNORE_INDEX, -1)))
        yield StaticRowBatch(ids, pos, lab, doc, valid, step[0].global_batch, i)


def static_steps(records: Iterable[SampledMicrobatch], tokens: Sequence[Any],
                 settings: StaticRowsSettings) -> Iterator[StaticStep]:
    """``static_rows`` grouped by global batch and stacked ``[M * b, T]``."""
    batch: list[StaticRowBatch] = []
    for row in static_rows(records, tokens, settings):
        if batch and row.global_batch != batch[0].global_batch:
            yield _stacked(batch)
            batch = []
        batch.append(row)
    if batch:
        yield _stacked(batch)


def _stacked(batch: list[StaticRowBatch]) -> StaticStep:
    return StaticStep(torch.cat([r.input_ids for r in batch]), torch.cat([r.positions for r in batch]),
                      torch.cat([r.labels for r in batch]), batch[0].step_valid_tokens, len(batch))
