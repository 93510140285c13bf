"""dynmb: dynamic microbatching for pipeline-parallel transformer training.

The loop: length traces (``dynmb.data``) -> packers (``dynmb.packing``) under a
per-GPU memory limit (``dynmb.memory.model``) and a fitted cost model
(``dynmb.costmodel``) -> schedules (``dynmb.schedule``) checked by a simulator
(``dynmb.timing``) -> real torch.distributed runs (``dynmb.runtime``) -> tidy
pandas tables (``dynmb.io.results``) and plots (``dynmb.report.plots``).

The public API (what scripts and notebooks use; see the README and docs/design.md):

- ``Planner(model=, num_stages=, memory_limit=, ...).plan(lengths, method=, reorder=)``
  -> ``PlannedStep(plan, schedule, sim)``; ``simulate(schedule, plan, cost_model, memory_model)``;
- ``DynamicBatchSampler``: the planner inside your own training loop, yielding ``SampledMicrobatch``
  records (``dynmb.api.collate`` turns them into token tensors and normalises the loss);
- ``run(config_or_configs, out=, corpus=) -> RunResult(returncode, tables, failures)``: real runs
  through torchrun, as ``dynmb run`` launches them; ``corpus=CorpusSource.create(file, field)``
  trains on real text (synthetic ids without it);
- ``load_results(dir)``, ``summarise(tables, by=)``: the tidy tables of runs;
- the core types ``Microbatch``, ``Plan``, ``Action``, ``Schedule`` and configs
  ``ModelConfig``, ``PipelineConfig``, ``RunConfig``; the model Protocols ``CostModelLike``,
  ``MemoryModelLike``;
- ``model_config(spec)`` (a preset such as ``small`` or ``llama-small``, with overrides, or a JSON
  file) and the stage contract: ``StageModule``, ``StageFactory``, ``resolve_model(spec)`` (a preset,
  a JSON file or ``package.module:factory`` -> a ``StageFactory``; docs/design.md "The stage contract").
"""

from dynmb.report.analysis import summarise
from dynmb.core.config import ModelConfig, PipelineConfig, RunConfig, model_config
from dynmb.costmodel.base import CostModelLike
from dynmb.data.tokens import CorpusSource
from dynmb.memory.model import MemoryModelLike
from dynmb.api.planner import PlannedStep, Planner
from dynmb.io.results import load_results
from dynmb.timing.simulate import SimResult, simulate
from dynmb.core.types import Action, Microbatch, Plan, Schedule

__version__ = "0.1.0"


def __getattr__(name: str) -> object:
    # ``DynamicBatchSampler`` subclasses torch's Sampler: importing it on first use keeps
    # ``import dynmb`` (and every command that needs no torch, e.g. ``dynmb datasets``) free of
    # torch's ~4 s import. Not a cycle: dynmb.api.sampler imports only layers above it.
    if name in ("DynamicBatchSampler", "SampledMicrobatch"):
        from dynmb.api import sampler

        return getattr(sampler, name)
    # ``run`` / ``RunResult`` bring the launcher and the results loader; loaded on first use like
    # the sampler, so that ``import dynmb`` stays light (dynmb.runtime.api imports no torch).
    # the stage contract lives with the torch workload (``dynmb.models``); loaded on first use
    if name in ("StageModule", "StageFactory", "resolve_model"):
        from dynmb.models import contract

        return getattr(contract, name)
    if name in ("run", "RunResult"):
        from dynmb.runtime import api

        return getattr(api, name)
    raise AttributeError(f"module 'dynmb' has no attribute {name!r}")

__all__ = [
    "Planner", "PlannedStep", "simulate", "SimResult", "DynamicBatchSampler", "SampledMicrobatch", "load_results", "summarise",
    "run", "RunResult", "CorpusSource",
    "Microbatch", "Plan", "Action", "Schedule", "ModelConfig", "PipelineConfig", "RunConfig", "model_config",
    "CostModelLike", "MemoryModelLike", "StageModule", "StageFactory", "resolve_model",
]
