"""What the ranks would refuse, refused by the launcher before torchrun starts (one line, nothing written).

``preflight(spec)`` runs after ``RunSpec.check`` for every case of a job (``launch.launch_job``):

1. The model: the run's factory (``RunSpec.factory()``: a user's ``package.module:factory``, a
   transformers model or dynmb's family) builds every stage under ``torch.device("meta")`` (new tensors
   take no memory and get no values; modules a factory already holds, as transformers factories share
   their model's, are neither copied nor moved),
   as rank ``stage mod ranks`` will build it for real; a factory that raises, or a stage that is not a
   ``StageModule`` of the right index, is one ``ValueError`` naming the rank, the stage and the cause.
2. The data: the batches the ranks will plan first are planned here, the same way
   (``planning.plan_step`` with the run's ``PlanSpec``, cost and memory models, on the trace or the
   corpus's token counts): step 0, and the step holding the run's longest sequence when that is another
   (``slice_fitting`` off: slicing sequences that fit only adds options, and costs minutes at scale).
   What ``dynmb plan`` refuses for them (a limit below the model states, a sequence longer than any row,
   a position limit shorter than the data, data parallelism over too few sequences) is one line naming
   the step and the sequence's trace row (a corpus's file and record there), not its position in the batch.

   A plan of them that offloads blocks of a stage that recomputes blocks (``ModelConfig.recompute_blocks``) is
   refused in one line (``refuse_offload_with_recompute``). With ``offload="auto"`` every stage must take the
   offload's block hook (``DecoderStage.block_scope``,
   ``dynmb.runtime.offload``): a transformers model or a user's own stage module is refused here, in one line.

A plan-file run (``--plan``) was checked against its plan by ``load_plan_files``; step 2 is skipped (a plan whose
``offload_blocks`` a stage cannot take fails its first step in one line, ``OffloadSession.for_plan``).
"""

from __future__ import annotations

import re
from typing import Any

import numpy as np

from dynmb.data import load_trace, sample_indices
from dynmb.runtime.spec import RunSpec, refuse_offload_with_recompute

__all__ = ["preflight", "check_stages", "check_first_batches"]


def preflight(spec: RunSpec) -> None:
    """Refuse (``ValueError``, one line) what the ranks of ``spec`` would refuse (module docstring)."""
    check_stages(spec)
    if spec.plan is None:
        check_first_batches(spec)


def check_stages(spec: RunSpec) -> None:
    """Every stage of the run built on the meta device, checked against the stage contract."""
    import torch

    from dynmb.core.contract import StageModule

    run = spec.run
    what = f"--model {spec.model_factory or run.model.name}"
    stages, ranks = run.pipeline.num_stages, run.pipeline.num_ranks
    try:
        factory = spec.factory()
    except ValueError:
        raise
    except Exception as e:  # noqa: BLE001 - a user's factory may raise anything: one line, no traceback
        raise ValueError(f"{what}: the factory raised {type(e).__name__}: {_first_line(e)}") from None
    for k in range(stages):
        try:
            with torch.device("meta"):     # new tensors on meta; a factory's shared modules are left where they are
                module = factory.build_stage(k, stages, seed=run.seed, device="meta")
        except Exception as e:  # noqa: BLE001
            raise ValueError(f"{what}: rank {k % ranks} cannot build stage {k} of {stages}: {type(e).__name__}: "
                             f"{_first_line(e)}") from None
        if not isinstance(module, StageModule) or not isinstance(module, torch.nn.Module):
            raise ValueError(f"{what}: rank {k % ranks}: build_stage({k}, {stages}) returned a "
                             f"{type(module).__name__}, not a stage module (an nn.Module with stage, num_stages, "
                             "is_first, is_last and forward(x, inputs); docs/design.md 'The stage contract')")
        if int(module.stage) != k or int(module.num_stages) != stages:
            raise ValueError(f"{what}: rank {k % ranks}: build_stage({k}, {stages}) returned stage {module.stage} "
                             f"of {module.num_stages}")
        if run.plan_spec.offload != "never" and not hasattr(module, "block_scope"):
            raise ValueError(f"{what}: offload={run.plan_spec.offload!r} needs stages with a block_scope (dynmb's own "
                             f"families, dynmb.runtime.offload); stage {k} is a {type(module).__name__}")


def check_first_batches(spec: RunSpec) -> None:
    """Plan the run's first batch, and the batch holding its longest sequence, as the ranks will."""
    from dynmb.costmodel.standin import suppress_stand_in_warnings
    from dynmb.planning import plan_step

    run = spec.run
    corpus = spec.corpus.load() if spec.corpus is not None else None
    trace = corpus.lengths if corpus is not None else load_trace(run.dataset)
    steps = run.warmup + run.steps
    rows = [sample_indices(len(trace), run.global_batch, run.seed, step=k, note=False) for k in range(steps)]
    longest = int(np.argmax([trace[r].max() for r in rows]))
    with suppress_stand_in_warnings():                   # said once, where the run resolves its models
        models = spec.models()
    spec_of = run.plan_spec.with_(slice_fitting="never")      # slicing what fits only adds options, at a cost
    for k in dict.fromkeys((0, longest)):
        try:
            plan, _, _ = plan_step(trace[rows[k]], spec_of, model_cfg=run.model, models=models)
        except ValueError as e:
            raise ValueError(f"step {k}: {_with_rows(_first_line(e), rows[k], corpus)}") from None
        refuse_offload_with_recompute(plan.meta.get("offload_blocks"), run.model.stage_recompute_blocks(plan.num_stages),
                                      f"step {k}'s plan")


_IDS = re.compile(r"\bids \[([\d, ]+)\]")


def _with_rows(message: str, rows: np.ndarray, corpus: Any = None) -> str:
    """``message`` with the batch positions it names (``ids [1, 2]``) as the trace rows they hold, or for
    a corpus (``CorpusTokens``) as each record's file and number there (0-based)."""
    def rows_of(m: re.Match[str]) -> str:
        held = [int(rows[int(p)]) for p in m.group(1).split(",") if p.strip() and int(p) < len(rows)]
        if corpus is None:
            return f"trace rows {held}"
        return f"corpus records [{', '.join(corpus.record_name(r) for r in held)}] (0-based)"
    return _IDS.sub(rows_of, message, count=1)


def _first_line(err: Any) -> str:
    text = " ".join(str(err).split()) or type(err).__name__
    return text[:400] + (" ..." if len(text) > 400 else "")
