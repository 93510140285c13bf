"""One process running a plan through a model's stages the way the runtime does, for exact-gradient tests.

Forwards in plan order, backwards in ``plan.backward_order()``, one ``PrefixStore`` for sliced sequences;
``split``: each stage's backward as the interpreter splits it (``I`` with a continued slice's roots and the
leaves it read, every ``W`` at the end). Every message is checked against its planned shape
(``hidden_shape``: per stage, wider after a head shard).
"""

from __future__ import annotations

from contextlib import nullcontext
from dataclasses import replace

import numpy as np
import torch

from dynmb.core.config import ModelConfig
from dynmb.models import build_stages, hidden_shape, make_inputs
from dynmb.models.prefix import PrefixStore
from dynmb.runtime.splitbackward import backward_input, backward_weight, record_linears
from dynmb.core.types import Microbatch, Plan

__all__ = ["run_plan", "packed_microbatch", "validated_plan", "mixed_plan", "sliced_plan"]


def validated_plan(mbs: list[Microbatch], n: int, lengths: np.ndarray | None = None) -> Plan:
    """A two-stage test plan of ``mbs`` over ``n`` sequences, checked against ``lengths`` when given."""
    plan = Plan(microbatches=tuple(mbs), method="test", num_stages=2, memory_limit_bytes=1 << 30, num_sequences=n)
    plan.validate(lengths)
    return plan


def mixed_plan() -> tuple[Plan, np.ndarray]:
    """A padded microbatch with extra padding and a packed one (document-causal attention)."""
    lengths = np.array([7, 19, 3, 12, 25, 9, 14])
    mbs = [Microbatch(seq_ids=[0, 1, 2], lengths=lengths[[0, 1, 2]], padded_len=21, batch=3),
           packed_microbatch([3, 4, 5, 6], lengths, rows=2, extra=2)]
    return validated_plan(mbs, len(lengths), lengths), lengths


def sliced_plan() -> tuple[Plan, np.ndarray]:
    """Sequence 0 in three slices of 20, each beside a short document of its own row."""
    lengths = np.array([60, 9, 12, 15], dtype=np.int64)
    mbs = [Microbatch([0, j + 1], [20, lengths[j + 1]], 20, 2, offsets=[20 * j, 0], continued=[j < 2, False])
           for j in range(3)]
    return validated_plan(mbs, 4, lengths), lengths


def packed_microbatch(ids, lengths, rows: int, extra: int = 0) -> Microbatch:
    """Sequences ``ids`` packed greedily, each into the currently shortest of ``rows`` rows."""
    ids = np.asarray(ids)
    fill, row_ids = np.zeros(rows, dtype=np.int64), []
    for i in ids:
        r = int(fill.argmin())
        row_ids.append(r)
        fill[r] += lengths[i]
    return Microbatch(seq_ids=ids, lengths=lengths[ids], padded_len=int(fill.max()) + extra, batch=rows, row_ids=row_ids)


def run_plan(plan: Plan, tokens, cfg: ModelConfig, num_stages: int, dtype=torch.float64, *, seed: int = 0,
             recompute: bool = False, split: bool = False) -> tuple[list, float]:
    """(the stages after the step's backwards, the token-weighted loss) of ``plan`` (module docstring);
    ``recompute``: every microbatch recomputes (else those the plan marks)."""
    stages = build_stages(cfg, num_stages, seed, dtype=dtype)
    store, total, saved, pending, loss = PrefixStore(), plan.real_tokens, [], [], 0.0
    for i, mb in enumerate(plan.microbatches):
        inp = make_inputs(mb, tokens, cfg=cfg)
        if inp.has_slices:
            inp = replace(inp, prefix=store, microbatch=i)
        chain, x = [], None
        for st in stages:
            x = None if x is None else x.detach().requires_grad_(True)
            with (record_linears(st) if split else nullcontext()) as tape:
                y = st(x, inp, recompute=recompute or mb.recompute)
            assert tuple(y.shape) == (() if st.is_last else hidden_shape(mb, cfg, st.stage, num_stages)), st.stage
            chain.append((st, x, y, tape))
            x = y
        loss += float(x.detach())
        saved.append(chain)
    for i in plan.backward_order():
        grad = None
        for st, x_in, out, tape in reversed(saved[i]):
            if st.is_last:
                out = out / total
            roots = store.backward_roots(list(st.layers), i)
            if split:            # as the runtime's interpreter: a continued slice's roots, the leaves it read
                grad = backward_input(st, out, grad, x_in, tape, roots, store.read_leaves(list(st.layers), i))
                pending.append(tape)
            else:
                g0 = torch.ones_like(out) if grad is None else grad
                torch.autograd.backward([out, *(t for t, _ in roots)], [g0, *(g for _, g in roots)])
                grad = None if x_in is None else x_in.grad
            store.release(list(st.layers), i)
    for tape in pending:
        backward_weight(tape)
    assert len(store) == 0
    return stages, loss / total
