"""Stand-in models: planning with the analytic cost model (FLOPs at an assumed throughput) or the
analytic memory model (the bytes dynmb's own GPT stages keep on CPU) instead of models fitted to the
model trained is said once per (stand-in, model config, stage count), by ``logging`` and
``warnings.warn`` (``StandInModelWarning``), naming the commands that fit the real ones
(``warn_stand_ins``). The one loader (``dynmb.costmodel.loader.load_models``) calls it."""

from __future__ import annotations

import contextlib
import contextvars
import logging
import warnings
from collections.abc import Iterable, Iterator
from typing import Any

from dynmb.core.config import MODEL_PRESETS

__all__ = ["StandInModelWarning", "stand_ins_of", "warn_stand_ins", "suppress_stand_in_warnings",
           "reset_stand_in_warnings"]

log = logging.getLogger(__name__)


class StandInModelWarning(UserWarning):
    """Planning with a stand-in cost or memory model instead of one fitted to the model trained."""


_WARNED: set[tuple[str, Any, int]] = set()
_SUPPRESSED: contextvars.ContextVar[bool] = contextvars.ContextVar("dynmb_stand_in_suppressed", default=False)
_WHAT = {"cost": "the analytic cost model (FLOPs at an assumed throughput, not your model's measured times)",
         "memory": "the analytic memory model (the bytes dynmb's own GPT stages keep on CPU, not your model's)"}


def stand_ins_of(models: Any) -> tuple[str, ...]:
    """Which of the two models of ``models`` (a ``loader.Models``) are stand-ins: ``"cost"`` (kind ``analytic``),
    ``"memory"`` (source ``analytic``)."""
    out = ("cost",) if getattr(models.cost, "kind", None) == "analytic" else ()
    return out + (("memory",) if str(getattr(models.memory, "source", "")).startswith("analytic") else ())


@contextlib.contextmanager
def suppress_stand_in_warnings() -> Iterator[None]:
    """Inside, ``warn_stand_ins`` neither warns nor records (a caller that warns for more at once)."""
    token = _SUPPRESSED.set(True)
    try:
        yield
    finally:
        _SUPPRESSED.reset(token)


def reset_stand_in_warnings() -> None:
    """Forget which stand-ins were warned about (tests)."""
    _WARNED.clear()


def warn_stand_ins(model_cfg: Any, num_stages: int, kinds: Iterable[str], *, who: str = "Planner",
                   stacklevel: int = 3) -> str | None:
    """Warn once per (stand-in, model config, stages) that planning uses ``kinds`` (``cost``,
    ``memory``) and how to fit the real models; returns the message, or None when nothing is new."""
    cfg_key: Any = model_cfg
    try:
        hash(cfg_key)
    except TypeError:                                   # an unhashable config: by its repr
        cfg_key = repr(model_cfg)
    new = [k for k in kinds if (k, cfg_key, int(num_stages)) not in _WARNED]
    if not new or _SUPPRESSED.get():
        return None
    _WARNED.update((k, cfg_key, int(num_stages)) for k in new)
    name = str(getattr(model_cfg, "name", model_cfg))
    spec = f"--model {name if name.split(':')[0] in MODEL_PRESETS else '<your model>'} --stages {num_stages}"
    fixes = []
    if "cost" in new:
        fixes.append(f"`dynmb profile {spec} -o samples.csv && dynmb fit samples.csv {spec} -o cost.json`, "
                     f"then cost_model='cost.json'")
    if "memory" in new:
        fixes.append(f"`dynmb memory {spec} -o memory.json`, then memory_model='memory.json'")
    msg = (f"{who}: planning model {name!r} on {num_stages} stage(s) with stand-in(s): "
           f"{' and '.join(_WHAT[k] for k in new)}; plans may run slow or over the memory limit. "
           f"Fit the real ones for your model: {'; '.join(fixes)} (a model of your own: --model pkg.module:factory)")
    log.warning(msg)
    warnings.warn(msg, StandInModelWarning, stacklevel=stacklevel)
    return msg
