"""``slice_fitting="auto"``: sequences that fit sliced too where the simulator predicts a shorter step
(``dynmb.planning.slice_fitting``): tokens, the choice, refusals and a real 2-rank gloo run with ``--verify``."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as hst

from dynmb.costmodel import AnalyticCostModel
from dynmb.core.config import ModelConfig, RunConfig, parse_bytes
from dynmb.planning.planner import plan_step
from dynmb.planning.slice_fitting import kept_lengths, plan_threshold, thresholds
from dynmb.planning.slicing import longest_row
from dynmb.core.planspec import PlanSpec
from dynmb.memory.model import MemoryModel
from dynmb.runtime.spec import RunSpec
from dynmb.schedule import get_kind, validate
from tests.gloo_jobs import register
from dynmb.costmodel.loader import Models

TINY = ModelConfig.preset("tiny")
TINY8 = replace(TINY, name="tiny-8", n_layers=8)
LIMIT = parse_bytes("16MiB")


def _plan(lengths, model=TINY, stages=2, **kw):
    kw = {"method": "dynamic", "memory_limit_bytes": LIMIT, "oversize": "truncate", **kw}
    return plan_step(np.asarray(lengths), PlanSpec(num_stages=stages, **kw), model_cfg=model)


@settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(hst.lists(hst.integers(1, 3000), min_size=2, max_size=10), hst.sampled_from(["1f1b", "zb-h1"]))
def test_every_kept_token_is_planned_once(lengths, kind):
    """With ``auto`` (whatever it keeps) and at every threshold it tries, each sequence is planned exactly
    once, whole or as one chain, with the tokens ``truncate`` keeps: the truncated batch's token count."""
    lengths = np.asarray(lengths, dtype=np.int64)
    never, _, _ = _plan(lengths, schedule_kind=kind)
    cap = never.meta["longest_fitting_length"]
    want = np.minimum(lengths, cap)
    assert (kept_lengths(never) == want).all()
    auto, sched, _ = _plan(lengths, schedule_kind=kind, slice_fitting="auto")
    auto.validate(lengths)
    validate(sched, auto)
    assert (kept_lengths(auto) == want).all() and auto.real_tokens == never.real_tokens
    spec = PlanSpec(num_stages=2, method="dynamic", memory_limit_bytes=LIMIT, oversize="truncate", schedule_kind=kind,
                    slice_fitting="auto")
    mm = MemoryModel.analytic(TINY, 2)
    for t in thresholds(longest_row(spec, TINY, mm), int(want.max()), 1):
        plan, _, _ = plan_threshold(lengths, want, never.meta, spec, t, kind=get_kind(kind), model_cfg=TINY,
                                    models=Models(AnalyticCostModel(TINY, 2), mm))
        assert (kept_lengths(plan) == want).all()              # every kept token once, no more
        assert set(plan.slice_groups()) == set(np.flatnonzero(want > t).tolist())
        assert sorted(plan.meta["truncated"]) == sorted(never.meta["truncated"])


DEEP_LIMIT = parse_bytes("64MiB")               # tiny-8 on 8 stages: the longest row is 1,699 tokens
DEEP_BATCH = [1500, *[50] * 12]
"""A long sequence that fits among short ones: on 8 stages its whole microbatch is fill and drain the others wait on."""


@pytest.mark.parametrize("oversize,recompute,extra", [("truncate", "never", []), ("split", "auto", [2700])])
def test_auto_slices_a_long_sequence_that_fits_on_a_deep_pipeline(oversize, recompute, extra):
    """Analytic costs: slicing the 1,500-token sequence (and, with ``split``, the 2,700-token one that does not
    fit) is predicted faster than the plan that runs it whole, and is kept."""
    lengths = np.asarray([*DEEP_BATCH, *extra])
    kw = dict(model=TINY8, stages=8, oversize=oversize, recompute=recompute, memory_limit_bytes=DEEP_LIMIT)
    never, _, _ = _plan(lengths, **kw)
    auto, sched, _ = _plan(lengths, **kw, slice_fitting="auto")
    spec = PlanSpec(num_stages=8, memory_limit_bytes=DEEP_LIMIT)
    assert lengths[0] <= longest_row(spec, TINY8, MemoryModel.analytic(TINY8, 8)) and 0 not in never.slice_groups()
    assert bool(extra) == bool(never.slice_groups())
    assert auto.meta["slice_threshold"] is not None and 0 in auto.slice_groups()
    assert auto.meta["slice_threshold"] < lengths[0]
    assert auto.predictions["pred_step_s"] < never.predictions["pred_step_s"]
    assert auto.meta["slice_fitting"]["none"] == pytest.approx(never.predictions["pred_step_s"])
    assert max(auto.predictions["pred_peak_bytes"]) <= DEEP_LIMIT
    assert auto.real_tokens == never.real_tokens == lengths.sum() and auto.meta["oversize"] == oversize
    auto.validate(lengths)
    validate(sched, auto)


def test_auto_keeps_the_plan_without_fitting_slices_where_slicing_is_slower():
    """Six 300-token sequences on 2 stages (the longest row 591): slicing them only adds work."""
    lengths = np.asarray([300] * 6)
    never, _, _ = _plan(lengths)
    auto, _, _ = _plan(lengths, slice_fitting="auto")
    tried = {k: v for k, v in auto.meta["slice_fitting"].items() if k != "none"}
    assert tried and all(v is None or v > never.predictions["pred_step_s"] for v in tried.values())
    assert auto.meta["slice_threshold"] is None and not auto.slice_groups()
    assert [mb.seq_ids.tolist() for mb in auto.microbatches] == [mb.seq_ids.tolist() for mb in never.microbatches]


def test_a_bad_slice_fitting_value_is_refused_in_one_line(capsys):
    from dynmb.cli.main import main

    with pytest.raises(ValueError, match=r"^slice_fitting must be never or auto, got 'always'$"):
        PlanSpec(slice_fitting="always")
    with pytest.raises(ValueError, match=r"^slice_fitting must be never or auto, got 'yes'$"):
        RunConfig(model=TINY, slice_fitting="yes")
    with pytest.raises(SystemExit):
        main(["plan", "--model", "tiny", "--slice-fitting", "sometimes"])
    err = capsys.readouterr().err
    assert "--slice-fitting" in err and "'sometimes'" in err


# --------------------------------------------------------------------------
# a real 2-rank gloo run with --verify: a truncated sequence sliced, and one that fits
# --------------------------------------------------------------------------
GLOO_BATCH = np.array([5000, 500, 40, 60, 30, 50, 70, 20], dtype=np.int64)
"""tiny, 2 stages, 16 MiB: the 5,000 tokens are cut to 1,724 (with recomputation) and then sliced; the 500 fit
the longest row (591) and are sliced too."""
GLOO_ARGS = ["--model", "tiny", "--stages", "2", "--memory-limit", "16MiB", "--oversize", "truncate",
             "--slice-fitting", "auto", "--recompute", "auto", "--global-batch", str(GLOO_BATCH.size)]


@register(2)
def _provider(out: Path) -> list[RunSpec]:
    """``dynmb run --slice-fitting auto --verify``'s spec, made as the verb makes it (``cli.run._spec``)."""
    from dynmb.cli.main import build_parser
    from dynmb.cli.run import _spec

    trace = out / "slicefit.csv"
    trace.parent.mkdir(parents=True, exist_ok=True)
    trace.write_text("length\n" + "\n".join(str(x) for x in GLOO_BATCH) + "\n")
    args = build_parser(["run"]).parse_args(["run", "--lengths", str(trace), *GLOO_ARGS, "--verify", "--steps", "1",
                                             "--warmup", "0", "--out", str(out / "slicefit")])
    return [_spec(args, "gloo", "cpu")]


@pytest.mark.dist
def test_run_with_fitting_slices_verifies_on_gloo(gloo_job, tmp_path):
    """The plan ``dynmb plan`` makes with these flags slices sequences that fit (and a truncated one);
    the run of the same flags trains every kept token with the whole documents' gradients."""
    from dynmb.cli.main import main
    from dynmb.io.results import load_results
    from dynmb.core.types import Plan

    trace = tmp_path / "slicefit.csv"
    trace.write_text("length\n" + "\n".join(str(x) for x in GLOO_BATCH) + "\n")
    assert main(["plan", "--lengths", str(trace), *GLOO_ARGS, "-o", str(tmp_path / "p.json")]) == 0
    plan = Plan.load(tmp_path / "p.json")
    cap = plan.meta["longest_fitting_length"]
    assert plan.meta["slice_threshold"] is not None and plan.meta["truncated"]
    assert set(plan.slice_groups()) >= set(plan.meta["truncated"])       # a truncated sequence runs sliced
    batch = GLOO_BATCH[np.asarray(plan.dataset_ids)]                     # the trace rows of its sequences
    assert any(batch[s] <= cap for s in plan.slice_groups())            # and one that fits
    job = gloo_job(2)
    assert job.returncode == 0, job.errors
    t = load_results(job.out / "slicefit")
    steps = t["steps"]
    assert steps["verified"].all() and (steps["sliced"] == len(plan.slice_groups())).all()
    assert (steps["slice_threshold"] == plan.meta["slice_threshold"]).all()
    assert (steps["real_tokens"] == np.minimum(GLOO_BATCH, cap).sum()).all()
    assert (t["runs"]["slice_fitting"] == "auto").all()
    assert (t["memory"]["peak_bytes"] <= t["memory"]["limit_bytes"]).all()
