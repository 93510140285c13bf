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
from pathlib import Path

import numpy as np
import pytest
import torch

from dynmb.core.config import ModelConfig
from dynmb.core.types import Microbatch, Plan
from dynmb.data import load_trace, sample_indices
from dynmb.io.results import load_results
from dynmb.models import build_stages, make_inputs, synthetic_tokens
from dynmb.models.prefix import PrefixStore
from dynmb.planning import plan_step
from dynmb.planning.slicing import weighing_alternatives
from dynmb.runtime.launch import launch_job
from dynmb.runtime.spec import JobSpec, RunSpec
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


WEIGHED = ("zb", "split", "tiny", 2)
"""``tests.test_fp64_grads.Case``: the slow fp64 2-rank case whose kept plan, with the weighing on, measured 42,266,064 B on its last stage at
40 MiB: ``balanced``'s shorts in one packed row beside the 1,200-token document in six equal-cost slices (392,
226, 177, 151, 133, 121), no recomputation, ``zb`` (every I of the chain before its Ws)."""


def _weighed_plan_case(out: Path) -> RunSpec:
    """``WEIGHED``'s run with the plan ``dynamic`` keeps within ``weighing_alternatives()`` (made here, run from
    its file as ``dynmb run --plan`` does, so the ranks need not weigh). Imports the fp64 module here, not at
    collection: its gloo cases join a shared job only where it is collected."""
    from tests.test_fp64_grads import SLICE_BATCH, Case, run_config

    trace = out / "fp64-slices.csv"
    trace.write_text("length\n" + "\n".join(str(x) for x in SLICE_BATCH) + "\n")
    cfg = run_config(Case(*WEIGHED), trace)
    spec = RunSpec.create(cfg, out / "plan", run_id="weighed")
    lengths = load_trace(str(trace))[sample_indices(SLICE_BATCH.size, cfg.global_batch, cfg.seed, step=0, note=False)]
    with weighing_alternatives():
        plan, _, _ = plan_step(lengths, cfg.plan_spec, model_cfg=cfg.model, models=spec.models())
    assert plan.has_slices and plan.schedule_kind == "zb"
    plan.save(out / "weighed.json")
    return RunSpec.create(cfg, out / "weighed", verify=True, run_id="weighed", plan=out / "weighed.json")


@pytest.mark.slow
@pytest.mark.dist
def test_the_weighed_fp64_zb_plan_runs_within_its_predicted_peak(tmp_path):
    """Real gloo ranks, fp64 ``--verify``: every stage's measured peak within the model's prediction (which is
    within the limit); before the tape kept no graph, stage 1 measured 44,905,936 B, 41,749,906 predicted."""
    spec = _weighed_plan_case(tmp_path)
    job = launch_job(JobSpec(out_dir=str(tmp_path.resolve()), cases=(spec,)), 2, quiet=True)
    assert job.returncode == 0, job.failures
    t = load_results(tmp_path / "weighed")
    assert t["steps"]["verified"].all()
    assert {"I", "W"} <= set(t["actions"]["op"])
    mem = t["memory"]
    assert (mem["peak_bytes"] <= mem["pred_peak_bytes"]).all(), mem[["stage", "peak_bytes", "pred_peak_bytes"]]
    assert (mem["pred_peak_bytes"] <= mem["limit_bytes"]).all()
