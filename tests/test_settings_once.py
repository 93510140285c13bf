"""Settings declared once (issue 36, item 2): ``RunConfig`` holds a ``PlanSpec``; the compare settings are a
``RunConfig`` template plus the methods; ``Planner.from_spec``; the command line turns its flags into a
``PlanSpec`` in one function; one spelling of the schedule kind (``--schedule``) in every verb."""

from __future__ import annotations

import argparse
import ast
from dataclasses import fields, replace
from pathlib import Path

import numpy as np
import pytest

from dynmb.api.planner import Planner
from dynmb.cli.flags import SCHEDULE_ALIASES, spec_from_flags
from dynmb.cli.main import build_parser
from dynmb.core.config import ModelConfig, PipelineConfig, RunConfig
from dynmb.core.planspec import PlanSpec

ROOT = Path(__file__).resolve().parents[1]
TINY = ModelConfig.preset("tiny")
LIMIT = 64 * 2**20


def test_run_config_holds_one_plan_spec_and_repeats_none_of_its_fields() -> None:
    run_fields = {f.name: f for f in fields(RunConfig)}
    assert run_fields["spec"].type in (PlanSpec, "PlanSpec")
    assert not set(run_fields) & {f.name for f in fields(PlanSpec)}
    assert not set(run_fields) & {f.name for f in fields(PipelineConfig)} - {"optimizer"}
    assert "pipeline" not in run_fields                # a read-only view now, not a second record


def test_the_older_keywords_fold_into_the_spec_and_read_back() -> None:
    spec = PlanSpec(method="packed", num_stages=4, virtual=2, schedule_kind="interleaved", reorder="ends",
                    memory_limit_bytes=LIMIT, dp=2, mbs=2, pack_len=512, round_to=16, oversize="drop",
                    recompute="auto", slice_fitting="auto")
    new = RunConfig(model=TINY, spec=spec)
    old = RunConfig(model=TINY, pipeline=PipelineConfig(num_stages=4, virtual=2, schedule="interleaved",
                                                        reorder="ends", memory_limit_bytes=LIMIT),
                    method="packed", mbs=2, dp=2, pack_len=512, round_to=16, oversize="drop", recompute="auto",
                    slice_fitting="auto")
    assert old == new and old.spec == spec
    assert (new.method, new.mbs, new.dp, new.pack_len, new.round_to) == ("packed", 2, 2, 512, 16)
    assert new.pipeline == PipelineConfig(num_stages=4, virtual=2, schedule_kind="interleaved", reorder="ends",
                                          memory_limit_bytes=LIMIT)
    assert new.pipeline.schedule == "interleaved"                   # the older name, read
    assert new.plan_spec == spec.with_(attention=TINY.attention)
    assert replace(new, method="fixed").spec == spec.with_(method="fixed")
    assert new.with_(schedule="zb", steps=5).spec.schedule_kind == "zb"
    with pytest.raises(ValueError, match="mbs"):
        RunConfig(mbs=0)
    with pytest.raises(ValueError, match="differs from the model's attention"):
        RunConfig(model=TINY, spec=PlanSpec(attention="dense"))


OLDER_RUN_DICT = {     # the "run" of a spec.json written before RunConfig held a PlanSpec
    "model": {"name": "tiny", "vocab_size": 512, "d_model": 64, "n_layers": 4, "n_heads": 4, "d_ff": 256,
              "max_seq_len": 4096},
    "pipeline": {"num_stages": 2, "virtual": 1, "schedule": "zb-h1", "reorder": "ends",
                 "memory_limit_bytes": 67108864, "optimizer": "sgd"},
    "dataset": "gsm8k", "global_batch": 8, "method": "fixed", "mbs": 3, "dp": 1, "shard": False, "seed": 5,
    "steps": 2, "warmup": 0, "lr": 0.001, "backend": "gloo", "device": "cpu", "cost_model": None,
    "timeout_s": 60.0, "pack_len": None, "round_to": 8, "oversize": "truncate", "recompute": "auto",
    "slice_fitting": "never", "expandable_segments": True, "prewarm": False, "plan_ahead": 0,
    "checkpoint": None, "checkpoint_every": 0, "resume": None,
}


def test_from_dict_reads_the_older_flat_spec_json_and_round_trips_the_new() -> None:
    cfg = RunConfig.from_dict(OLDER_RUN_DICT)
    assert cfg.spec == PlanSpec(method="fixed", num_stages=2, schedule_kind="zb-h1", reorder="ends",
                                memory_limit_bytes=LIMIT, mbs=3, round_to=8, oversize="truncate", recompute="auto")
    assert cfg.optimizer == "sgd" and cfg.model.name == "tiny" and cfg.seed == 5
    assert RunConfig.from_dict(cfg.to_dict()) == cfg
    assert "spec" in cfg.to_dict() and "pipeline" not in cfg.to_dict()


def test_the_runs_table_keeps_its_flattened_column_names() -> None:
    flat = RunConfig.from_dict(OLDER_RUN_DICT).flat()
    older = [f"model.{f.name}" for f in fields(ModelConfig)] + [f"pipeline.{k}" for k in OLDER_RUN_DICT["pipeline"]]
    older += [k for k in OLDER_RUN_DICT if k not in ("model", "pipeline")]
    assert list(flat) == older
    assert (flat["pipeline.schedule"], flat["method"], flat["mbs"], flat["pipeline.optimizer"]) == \
        ("zb-h1", "fixed", 3, "sgd")


def test_pipeline_config_has_one_name_for_the_schedule_kind() -> None:
    names = {f.name for f in fields(PipelineConfig)}
    assert "schedule_kind" in names and "schedule" not in names
    assert PipelineConfig(schedule="zb") == PipelineConfig(schedule_kind="zb")
    from dataclasses import replace
    assert replace(PipelineConfig(schedule_kind="zb"), schedule="auto").schedule_kind == "auto"   # the change wins


@pytest.mark.parametrize("verb,extra", [("plan", []), ("run", ["--out", "o"]), ("compare", []),
                                        ("schedule", ["--plan", "p.json", "-o", "s.csv"])])
def test_every_verb_spells_the_kind_schedule_and_takes_the_older_names(verb: str, extra: list[str]) -> None:
    for flag in ("--schedule", *SCHEDULE_ALIASES):
        args = build_parser([verb]).parse_args([verb, flag, "zb-h1", *extra])
        assert args.schedule == "zb-h1", (verb, flag)
        assert not hasattr(args, "schedule_kind") and not hasattr(args, "kind")
    helped = build_parser([verb])._subparsers._group_actions[0].choices[verb].format_help()  # type: ignore[union-attr]
    assert "--schedule" in helped and not any(alias in helped for alias in SCHEDULE_ALIASES)


def test_simulate_takes_its_schedule_as_schedule_too() -> None:
    args = build_parser(["simulate"]).parse_args(["simulate", "--plan", "p.json", "--schedule", "s.csv"])
    assert args.schedule == "s.csv"


def test_the_documented_schedule_command_still_parses() -> None:
    """DESIGN.md: ``dynmb schedule --plan plan.json --kind {gpipe,1f1b,...} --reorder {none,...} -o schedule.csv``."""
    args = build_parser(["schedule"]).parse_args(["schedule", "--plan", "plan.json", "--kind", "gpipe", "--reorder",
                                                  "none", "-o", "schedule.csv"])
    assert (args.schedule, args.reorder) == ("gpipe", "none")


def _plan_spec_calls(path: Path) -> list[tuple[str, int]]:
    """``(enclosing function, line)`` of every ``PlanSpec(...)`` call in ``path``."""
    found: list[tuple[str, int]] = []

    def visit(node: ast.AST, where: str) -> None:
        for child in ast.iter_child_nodes(node):
            inner = child.name if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef)) else where
            if isinstance(child, ast.Call) and isinstance(child.func, ast.Name) and child.func.id == "PlanSpec":
                found.append((where, child.lineno))
            visit(child, inner)

    visit(ast.parse(path.read_text()), "<module>")
    return found


def test_the_flags_become_a_plan_spec_in_one_function() -> None:
    calls = {str(p.relative_to(ROOT)): _plan_spec_calls(p) for p in sorted((ROOT / "dynmb" / "cli").glob("*.py"))}
    made = [(path, where) for path, found in calls.items() for where, _ in found]
    assert made == [("dynmb/cli/flags.py", "spec_from_flags")], made


def test_spec_from_flags_reads_each_flag_and_its_defaults() -> None:
    args = argparse.Namespace(method="fixed", stages=4, virtual=2, schedule="interleaved", memory_limit="64MiB",
                              mbs=3, dp=2, reorder=None, oversize="truncate", pack_len=None, round_to=8)
    assert spec_from_flags(args, TINY) == PlanSpec(
        method="fixed", num_stages=4, virtual=2, schedule_kind="interleaved", memory_limit_bytes=LIMIT, mbs=3, dp=2,
        oversize="truncate", round_to=8, attention=TINY.attention)
    assert spec_from_flags(argparse.Namespace(), stages=3, memory_limit=LIMIT) == PlanSpec(
        num_stages=3, memory_limit_bytes=LIMIT)
    with pytest.raises(ValueError, match="oversize"):
        spec_from_flags(argparse.Namespace(oversize="sometimes"))


KEYWORDS = dict(num_stages=2, memory_limit=LIMIT, schedule="zb-h1", round_to=8, oversize="truncate", recompute="auto")


def test_planner_from_spec_plans_as_the_keywords() -> None:
    lengths = np.random.default_rng(3).integers(16, 900, size=12)
    by_keywords = Planner(model=TINY, **KEYWORDS)
    by_spec = Planner.from_spec(TINY, by_keywords.spec.with_(attention=None))
    assert by_spec.spec == by_keywords.spec
    for method in ("dynamic", "fixed"):
        a, b = by_keywords.plan(lengths, method=method), by_spec.plan(lengths, method=method)
        assert a.plan.digest() == b.plan.digest() and a.schedule == b.schedule
    assert by_spec.plan(lengths).plan.digest() == by_keywords.plan(lengths).plan.digest()
    fixed = Planner.from_spec(TINY, by_keywords.spec.with_(method="fixed", mbs=2, reorder="none"))
    assert fixed.plan(lengths).plan.method == "fixed" and fixed.plan(lengths).plan.meta["mbs"] == 2


def test_compare_settings_are_a_run_template_plus_the_methods() -> None:
    from dynmb.jobs.compare import CompareSettings

    own = {f.name for f in fields(CompareSettings)}
    assert {"template", "methods"} <= own and not own & {f.name for f in fields(PlanSpec)}
    assert not own & ({f.name for f in fields(RunConfig)} - {"model"})
    template = RunConfig(model=TINY, spec=PlanSpec(num_stages=2, memory_limit_bytes=LIMIT, mbs=2, reorder="auto",
                                                   pack_len=512), dataset="gsm8k", global_batch=8, device="cpu")
    settings = CompareSettings(template=template, methods=("fixed", "packed", "dynamic"), model="tiny")
    flat = CompareSettings(model="tiny", stages=2, memory_limit="64MiB", microbatch_size=2, pack_len=512,
                           dataset="gsm8k", global_batch=8, device="cpu", methods=("fixed", "packed", "dynamic"))
    assert flat == settings and (flat.stages, flat.memory_limit, flat.schedule) == (2, "64MiB", "1f1b")
    assert settings.case_config("dynamic") == template.with_(method="dynamic", mbs=None, reorder="search",
                                                            pack_len=None)
    assert settings.case_config("packed").spec.pack_len == 512
    assert settings.case_config("fixed").spec.mbs == 2 and settings.case_config("fixed", 4).spec.mbs == 4
