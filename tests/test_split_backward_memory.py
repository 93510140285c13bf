"""What a split backward holds from ``I`` to ``W`` (``dynmb.runtime.splitbackward``): its tape's Linear inputs and
output gradients and nothing else. Before the tape recorded its inputs detached, an attached input kept the
forward's graph alive until ``W``, and through its ``AccumulateGrad`` nodes the stage input and, for a slice, the
earlier slices' key/value leaves with their gradients (their whole fused q/k/v storages), which their own
backwards had freed: the memory model does not count them, and the slow fp64 2-rank job measured a kept ``zb``
plan's last stage over its 40 MiB limit with the weighing of sliced alternatives on (issue 39).

Fast: one stage, a chain of slices run forward, then every ``I`` in reverse slice order with every ``W`` still
pending: nothing of the forwards may stay alive but the tapes' own tensors (weak references). Slow (real gloo ranks):
the fp64 case that broke the limit, planned with the weighing on, runs within its predicted peak and its limit.
"""

from __future__ import annotations

import gc
import weakref
from dataclasses import replace

import numpy as np
import torch

from dynmb.core.config import ModelConfig
from dynmb.core.types import Microbatch, Plan
from dynmb.models import build_stages, make_inputs, synthetic_tokens
from dynmb.models.prefix import PrefixStore
from dynmb.runtime.splitbackward import backward_input, backward_weight, record_linears

TINY = ModelConfig.preset("tiny")


def _chain(pieces: list[int]) -> tuple[Plan, np.ndarray]:
    """One document in ``len(pieces)`` slices, one single-row microbatch each."""
    offsets = np.cumsum([0, *pieces[:-1]])
    mbs = [Microbatch([0], [n], n, 1, offsets=[int(o)], continued=[j < len(pieces) - 1])
           for j, (n, o) in enumerate(zip(pieces, offsets))]
    lengths = np.array([sum(pieces)], dtype=np.int64)
    plan = Plan(tuple(mbs), "dynamic", 2, 1 << 30, 1)
    plan.validate(lengths)
    return plan, lengths


def test_between_i_and_w_a_slice_keeps_only_its_tape():
    """The last stage of two (its input a leaf, as the runtime makes it) runs a 3-slice chain: after every ``I``
    (reverse slice order, W pending) the stage inputs and the earlier slices' key/value leaves are gone."""
    plan, lengths = _chain([60, 50, 40])
    stage = build_stages(TINY, 2, 0, dtype=torch.float64)[1]
    tokens = synthetic_tokens(lengths, TINY.vocab_size, seed=2)
    store, layers, runs = PrefixStore(), list(stage.layers), []
    gen = torch.Generator().manual_seed(0)
    for i, mb in enumerate(plan.microbatches):
        inp = replace(make_inputs(mb, tokens, cfg=TINY), prefix=store, microbatch=i)
        x = torch.randn(mb.batch, mb.padded_len, TINY.d_model, generator=gen, dtype=torch.float64).requires_grad_()
        with record_linears(stage) as tape:
            out = stage(x, inp) / float(plan.real_tokens)
        runs.append([x, out, tape])
    gone = [weakref.ref(t) for t in store.read_leaves(layers, len(runs) - 1)] + [weakref.ref(r[0]) for r in runs]
    assert len(gone) == 2 * 2 * len(layers) + len(runs)         # k and v of 2 earlier slices per layer, 3 inputs
    for i in reversed(range(len(runs))):
        x, out, tape = runs[i]
        backward_input(stage, out, None, x, tape, store.backward_roots(layers, i), store.read_leaves(layers, i))
        store.release(layers, i)
        runs[i][:2] = [None, None]
        del x, out, tape
    gc.collect()
    alive = [r() for r in gone if r() is not None]
    assert not alive, [tuple(t.shape) for t in alive]
    for _, _, tape in runs:                                     # the tapes still give W everything it needs
        assert tape.calls and all(c.grad_output is not None for c in tape.calls)
        backward_weight(tape)
    assert all(p.grad is not None for p in stage.parameters())
