"""Checkpoints with torch.distributed.checkpoint (DCP): one name per weight, loadable at any layout.

Every stage names its parameters by the model's global names (dynmb's ``blocks.3.attn.qkv.weight``,
transformers' ``model.layers.3.self_attn.q_proj.weight``), so the model's state is one flat set of names
whatever the pipeline depth; each rank holds a subset (its stages), replicas hold the same subset.

- ``rank_module(stages)``: a rank's stage modules as one ``nn.Module`` for torch's state-dict helpers (one
  stage: itself; several, e.g. interleaved: a view whose module tree is the union of theirs, same names).
- ``save_checkpoint(directory, stages, optimizer, info)``: ``get_state_dict(module, optimizer)`` with the
  optimizer state flattened to FQN keys (``state.<name>.exp_avg``, ``param_groups.<name>.lr``: no integer
  ids that collide across stages), then ``dcp.save`` over the default process group (replicas write a
  name once; FSDP2/DTensor parameters are saved by their shards); rank 0 then writes ``dynmb.json``
  (``CheckpointInfo``: the step, the model, the layout it was saved at) -- a folder with it is complete.
- ``load_checkpoint(directory, stages, optimizer)``: the rank's names are checked against the
  checkpoint's (one line naming what is missing), then ``get_state_dict`` (templates; the optimizer's
  state is created), ``dcp.load`` (each rank reads only its names) and ``set_state_dict``. The layout is
  the run's: a checkpoint saved at pipeline depth 2 x dp 2 loads at depth 1, 4, any dp.
- ``model_weights(directory)``: the model's whole tensors in one process (to convert or inspect).
- ``dynmb run --checkpoint DIR [--checkpoint-every N]`` writes ``DIR/step-<k>`` (k optimizer steps done)
  every N steps and after the last step (``save_due``); ``--resume PATH`` (a step folder, or a folder of
  them: the latest complete one, ``find_checkpoint``) loads it after set-up and the run goes on from
  step k to its ``warmup + steps`` (``resume_run``): global batch k is drawn as in an uninterrupted run.

Pieces of a half-block (``blocks.3.mlp_c4...``) and shards of an LM head split by vocabulary
(``lm_head_200``) keep their own names, so a checkpoint of such a split loads only where the same names
exist (refused by name otherwise).
"""

from __future__ import annotations

import json
import logging
import warnings
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Sequence

from dynmb.core.config import RunConfig
from dynmb.io.atomic import write_text_atomic

if TYPE_CHECKING:
    import torch
    from torch import nn

    from dynmb.runtime.state import RunState

__all__ = ["CheckpointInfo", "rank_module", "save_checkpoint", "load_checkpoint", "find_checkpoint",
           "checkpoint_dir", "check_resume", "save_due", "resume_run", "model_weights", "INFO_FILE"]

logger = logging.getLogger(__name__)

INFO_FILE = "dynmb.json"
"""Written by rank 0 after every rank saved: marks a complete checkpoint and says what it holds."""



def _options() -> Any:
    """Optimizer state keyed by parameter names (``state.<name>.exp_avg``), not by integer ids."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions

    return StateDictOptions(flatten_optimizer_state_dict=True)


@dataclass(frozen=True)
class CheckpointInfo:
    """What ``dynmb.json`` records."""

    step: int
    """Optimizer steps done: a resumed run goes on with global batch ``step``."""
    model: str = ""
    """The model's name (a check, not a constraint)."""
    num_stages: int = 0
    """Pipeline depth it was saved at (information only: it loads at any)."""
    dp: int = 1
    """Data-parallel replicas it was saved with (information only)."""


def checkpoint_dir(root: str | Path, step: int) -> Path:
    """The folder of the checkpoint after ``step`` optimizer steps under ``root``."""
    return Path(root) / f"step-{step:08d}"


def find_checkpoint(path: str | Path) -> tuple[Path, CheckpointInfo]:
    """``path`` itself when it is a complete checkpoint, else its latest complete ``step-*`` folder."""
    path = Path(path)
    if (path / INFO_FILE).is_file():
        found = path
    else:
        done = sorted(p for p in path.glob("step-*") if (p / INFO_FILE).is_file()) if path.is_dir() else []
        if not done:
            raise ValueError(f"--resume {path}: no complete checkpoint there (a folder holding {INFO_FILE}, "
                             f"or step-* folders of them)")
        found = done[-1]
    try:
        info = CheckpointInfo(**json.loads((found / INFO_FILE).read_text()))
    except (TypeError, ValueError) as e:
        raise ValueError(f"--resume {found}: {INFO_FILE} is not a dynmb checkpoint record ({e})") from None
    return found, info


def _merge(modules: Sequence[nn.Module]) -> nn.Module:
    from torch import nn

    if all(m is modules[0] for m in modules):
        return modules[0]
    view = nn.Module()
    for m in modules:
        for name, p in m._parameters.items():
            if name in view._parameters and view._parameters[name] is not p:
                raise ValueError(f"two stages of this rank both hold a parameter named {name!r}")
            view._parameters[name] = p
        for name, b in m._buffers.items():
            view.register_buffer(name, b, persistent=name not in m._non_persistent_buffers_set)
    names = dict.fromkeys(n for m in modules for n in m._modules)
    for name in names:
        children = [c for m in modules if (c := m._modules.get(name)) is not None]
        view._modules[name] = _merge(children)
    return view


def rank_module(stages: nn.Module | Sequence[nn.Module]) -> nn.Module:
    """This rank's stage(s) as one module with the stages' own (global) names (module docstring)."""
    from torch import nn

    modules = [stages] if isinstance(stages, nn.Module) else list(stages)
    return modules[0] if len(modules) == 1 else _merge(modules)


def save_checkpoint(directory: str | Path, stages: nn.Module | Sequence[nn.Module], optimizer: torch.optim.Optimizer,
                    info: CheckpointInfo) -> Path:
    """Save this rank's model and optimizer state into ``directory`` (collective; module docstring)."""
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict

    directory = Path(directory)
    model_state, optim_state = get_state_dict(rank_module(stages), optimizer, options=_options())
    dcp.save({"model": model_state, "optim": optim_state}, checkpoint_id=str(directory))
    dist.barrier()
    if dist.get_rank() == 0:
        write_text_atomic(directory / INFO_FILE, json.dumps(asdict(info), indent=1) + "\n")
    dist.barrier()
    logger.info("checkpoint of step %d saved in %s", info.step, directory)
    return directory


def _check_names(directory: Path, state: dict[str, Any]) -> None:
    """Every name this rank loads is in the checkpoint (one line naming the first missing ones)."""
    import torch.distributed.checkpoint as dcp

    saved = dcp.FileSystemReader(str(directory)).read_metadata().state_dict_metadata
    wanted = [f"model.{n}" for n in state["model"]] + [f"optim.{n}" for n in state["optim"]]
    missing = [n for n in wanted if n not in saved]
    if missing:
        raise ValueError(f"checkpoint {directory} lacks {len(missing)} tensor(s) this rank holds, e.g. "
                         f"{', '.join(missing[:3])} (another model, or a split whose pieces are named otherwise)")


def load_checkpoint(directory: str | Path, stages: nn.Module | Sequence[nn.Module],
                    optimizer: torch.optim.Optimizer) -> CheckpointInfo:
    """Load the checkpoint ``directory`` (a step folder or a folder of them) into this rank's stages and
    optimizer, at this run's layout (collective; module docstring)."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    found, info = find_checkpoint(directory)
    module = rank_module(stages)
    model_state, optim_state = get_state_dict(module, optimizer, options=_options())
    state: dict[str, Any] = {"model": model_state, "optim": optim_state}
    _check_names(found, state)
    dcp.load(state, checkpoint_id=str(found))
    set_state_dict(module, optimizer, model_state_dict=state["model"], optim_state_dict=state["optim"],
                   options=_options())
    logger.info("checkpoint of step %d loaded from %s", info.step, found)
    return info


def model_weights(directory: str | Path) -> "dict[str, torch.Tensor]":
    """The model's whole tensors of a checkpoint (a step folder or a folder of them), ``{global name: tensor}``,
    read in one process without a process group (``llama_state_dict_to_hf`` turns a dynmb Llama's into
    transformers' names)."""
    import torch
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    found, _ = find_checkpoint(directory)
    saved = dcp.FileSystemReader(str(found)).read_metadata().state_dict_metadata
    state = {k: torch.empty(tuple(m.size), dtype=m.properties.dtype) for k, m in saved.items()
             if k.startswith("model.") and isinstance(m, TensorStorageMetadata)}
    with warnings.catch_warnings():            # "assuming the intent is to load in a single process": it is
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        dcp.load(state, checkpoint_id=str(found), no_dist=True)
    return {k.removeprefix("model."): t for k, t in state.items()}


def save_due(state: "RunState", step: int) -> Path | None:
    """After step ``step`` of a run with ``RunConfig.checkpoint``: save ``step-<step + 1>`` when it is the
    run's last step or a multiple of ``checkpoint_every`` (module docstring)."""
    run = state.run
    done = step + 1
    if not run.checkpoint or not (done == run.warmup + run.steps or
                                  (run.checkpoint_every and done % run.checkpoint_every == 0)):
        return None
    info = CheckpointInfo(step=done, model=run.model.name, num_stages=run.spec.num_stages, dp=run.spec.dp)
    return save_checkpoint(checkpoint_dir(run.checkpoint, done), list(state.stages.values()), state.optimizer, info)


def check_resume(run: RunConfig) -> CheckpointInfo:
    """``run.resume``'s checkpoint record, refused in one line when missing or at or past the run's last step
    (what ``dynmb run`` checks before torchrun starts, and every rank again)."""
    assert run.resume
    _, info = find_checkpoint(run.resume)
    if info.step >= run.warmup + run.steps:
        raise ValueError(f"--resume {run.resume}: the checkpoint is at step {info.step} and the run ends at step "
                         f"{run.warmup + run.steps}: nothing left to run (raise --steps)")
    return info


def resume_run(state: "RunState") -> int:
    """Load ``RunConfig.resume`` into the run's stages and optimizer; the step the run goes on from."""
    run = state.run
    if not run.resume:
        return 0
    check_resume(run)
    return load_checkpoint(run.resume, list(state.stages.values()), state.optimizer).step
