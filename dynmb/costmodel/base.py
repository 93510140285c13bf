"""The cost-model interface: one lookup of per-stage, per-op time shared by every consumer.

A cost model answers ``predict(stage, op, rows, padded_len, attn)`` -> seconds (vectorised) for
a microbatch of ``rows`` x ``padded_len`` tokens whose attention work is ``attn`` (the sum of
segment_length^2 over its attention segments, ``Microbatch.attention_work``: ``rows *
padded_len^2`` for one document per row, ``sum(s_i^2)`` over the documents of packed rows under
``attention="auto"``; None means one document per row), op ``F`` (forward), ``B`` (full
backward), or the split backward's ``I`` (input gradient) and ``W`` (weight gradients): fitted
when the samples have them, else derived from ``B`` (``dynmb.costmodel.split``). ``stage_costs(rows[m],
padded_len[m], attn[m])`` returns ``{"F": ndarray[P, m], "B": ndarray[P, m]}`` (``ops=`` for
others); ``plan_costs(plan)`` is the same for a whole plan with each microbatch's attention work
and its ``recompute`` flag (``dynmb.costmodel.split.apply_recompute``), and is what consumers call.
``comm`` (a ``CommModel``) gives the P2P time ``alpha_s + nbytes / bytes_per_s`` of the
activation sent between neighbouring stages; ``comm_s(rows, padded_len)`` that of a microbatch.
Its ``recv_latency_s`` (the runtime calibration's, ``with_recv_latency``) is added to every
receiving action's prediction: the wait for a message the receiver asked for late.

``CostModelLike`` is that interface as a ``typing.Protocol`` (what the packers, the reorderer, the
simulator and the runtime rely on). ``CostModel`` is the base class: the lookup (clipped at 0,
times the per-stage runtime scale of ``with_scale``, plus the per-action runtime overhead of
``with_overhead``, plus on a receiving action the ``recv_latency_s`` of ``with_recv_latency``), the check that a model was made
for a config and stage split, and the JSON form ``{"kind", "model", "num_stages", "comm",
"meta", "params"}``; ``load`` refuses a file whose numbers are not finite and non-negative or
whose predictions decrease as padded_len grows (``dynmb.costmodel.validate``). Every subclass with its own ``kind`` registers itself, so
``CostModel.from_dict`` / ``load`` build any kind without this module importing them (the
kinds: ``analytic``, ``poly``, ``grid``; ``dynmb.costmodel.registry``).
"""

from __future__ import annotations

import copy
from dataclasses import replace
import json
from pathlib import Path
from typing import Any, ClassVar, Mapping, Protocol, Sequence

import numpy as np

from dynmb.io.atomic import write_text_atomic
from dynmb.core.config import ModelConfig

from dynmb.costmodel.nnls import nnls_rel
from dynmb.costmodel.split import apply_block_recompute, apply_recompute, derived_split
from dynmb.costmodel.validate import check_cost_model, check_numbers, read_model_file

__all__ = ["CostModelLike", "CommModel", "CostModel"]


class CostModelLike(Protocol):
    """What consumers use of a cost model: the one lookup, per op, stage and microbatch."""

    model_cfg: ModelConfig
    num_stages: int
    runtime_overhead_s: dict[str, float]

    def predict(self, stage: int, op: str, rows: Any, padded_len: Any, attn: Any = None) -> np.ndarray:
        """Seconds of ``op`` on ``stage`` for microbatches (rows, padded_len, attention work)."""
        ...

    def scale_of(self, stage: int, op: str) -> float:
        """The runtime calibration factor of ``op`` on ``stage`` (1.0 when not calibrated)."""
        ...

    def stage_costs(self, rows: Any, padded_len: Any, attn: Any = None, ops: tuple[str, ...] = ("F", "B"),
                    recompute: Any = None) -> dict[str, np.ndarray]:
        """``{"F": [P, m], "B": [P, m]}`` seconds (``ops``: which ops)."""
        ...

    def plan_costs(self, plan: Any, ops: tuple[str, ...] = ("F", "B")) -> dict[str, np.ndarray]:
        """``stage_costs`` of a plan's microbatches with their attention work and recompute flags."""
        ...

    def comm_s(self, rows: Any, padded_len: Any) -> np.ndarray:
        """P2P seconds of a microbatch's hidden state between neighbouring stages."""
        ...

    def check(self, model_cfg: ModelConfig, num_stages: int) -> None:
        """Raise ValueError unless made for ``model_cfg`` over ``num_stages`` stages (``Planner``)."""
        ...


class CommModel:
    """Point-to-point time ``alpha_s + nbytes / bytes_per_s`` (one-way, one message), and
    ``recv_latency_s``, what the action that receives a message waits for it beyond that.

    ``alpha_s`` and ``bytes_per_s`` are the profile's (``dynmb.measure.pingpong``: two ranks
    doing nothing else): the simulator delays a receiving action to the sender's end plus that
    time. A running pipeline's receiver also waits when it asks late: the transport moves the
    message once both ends are there, competing with the sender's next compute for the cores,
    so the wait shows after the receive is posted, however long ago the sender finished.
    ``recv_latency_s`` is that wait, fitted at run time (``calibration.job_calibration``,
    ``dynmb.costmodel.p2pfit``; 0 until calibrated); ``CostModel.predict`` adds it to every
    receiving action (``F`` of a stage > 0, ``B``/``I`` of a stage before the last)."""

    def __init__(self, alpha_s: float = 5e-5, bytes_per_s: float = 2e9, recv_latency_s: float = 0.0) -> None:
        if alpha_s < 0 or bytes_per_s <= 0 or recv_latency_s < 0:
            raise ValueError(f"CommModel needs alpha_s >= 0, bytes_per_s > 0 and recv_latency_s >= 0, got "
                             f"{alpha_s}, {bytes_per_s}, {recv_latency_s}")
        self.alpha_s, self.bytes_per_s, self.recv_latency_s = float(alpha_s), float(bytes_per_s), float(recv_latency_s)

    def time(self, nbytes: Any) -> np.ndarray:
        return self.alpha_s + np.asarray(nbytes, dtype=np.float64) / self.bytes_per_s

    def with_recv_latency(self, recv_latency_s: float) -> "CommModel":
        """This profile with ``recv_latency_s`` per received message (replacing any earlier one)."""
        return CommModel(self.alpha_s, self.bytes_per_s, recv_latency_s)

    @classmethod
    def fit(cls, nbytes: Any, time_s: Any) -> "CommModel":
        """Non-negative relative-error least squares of t = alpha + nbytes * (1/beta)."""
        x = np.asarray(nbytes, dtype=np.float64)
        t = np.asarray(time_s, dtype=np.float64)
        coef = nnls_rel(np.stack([np.ones_like(x), x], axis=1), t)
        return cls(coef[0], 1.0 / max(coef[1], 1e-15))

    def to_dict(self) -> dict[str, float]:
        d = {"alpha_s": self.alpha_s, "bytes_per_s": self.bytes_per_s}
        return {**d, "recv_latency_s": self.recv_latency_s} if self.recv_latency_s else d

    def __repr__(self) -> str:
        extra = f", recv_latency_s={self.recv_latency_s:.3g}" if self.recv_latency_s else ""
        return f"CommModel(alpha_s={self.alpha_s:.3g}, bytes_per_s={self.bytes_per_s:.3g}{extra})"


class CostModel:
    """Base: the interface every consumer uses. Subclasses implement ``_predict``."""

    kind = "base"
    _kinds: ClassVar[dict[str, type["CostModel"]]] = {}
    """Every subclass that sets its own ``kind``, by kind (``from_dict`` builds from it)."""

    layout_free: ClassVar[bool] = False
    """Whether the model prices any layer split of its model from the config alone (the analytic
    kinds; a fitted model measured one split): ``for_layout`` rebuilds it for another."""

    def __init_subclass__(cls, **kw: Any) -> None:
        super().__init_subclass__(**kw)
        if "kind" in cls.__dict__:
            CostModel._kinds[cls.kind] = cls

    def __init__(self, model_cfg: ModelConfig, num_stages: int, comm: CommModel | None = None,
                 meta: dict[str, Any] | None = None) -> None:
        model_cfg.stage_units(num_stages)  # validates the split
        self.model_cfg, self.num_stages = model_cfg, int(num_stages)
        self.comm = comm if comm is not None else CommModel()
        self.meta = dict(meta or {})
        self.runtime_overhead_s: dict[str, float] = {"F": 0.0, "B": 0.0}
        self.runtime_scale: dict[str, tuple[float, ...]] = {}
        """Per op, one factor per stage (``with_scale``); empty: every factor 1."""
        self.prefix_scale: dict[str, float] = {"F": 1.0, "B": 1.0}
        """Seconds per unit of a slice's attention to its prefix (the ``2 n p`` part of
        ``Microbatch.prefix_work``; its own n tokens cost what a causal document's do) over seconds
        per unit of whole-document attention work, measured by ``benchmarks/bench_slices.py``
        (1.0 until measured)."""

    # --- the lookup ---------------------------------------------------------
    def predict(self, stage: int, op: str, rows: Any, padded_len: Any, attn: Any = None) -> np.ndarray:
        """Seconds for ``op`` on ``stage`` of microbatches (rows, padded_len), broadcast.

        ``attn`` is each microbatch's attention work ``Microbatch.attention_work`` (sum of
        segment_length^2); None means one document per row: ``rows * padded_len**2``."""
        if not 0 <= int(stage) < self.num_stages:
            raise ValueError(f"stage {stage} out of range for {self.num_stages} stages")
        b, s = np.broadcast_arrays(np.asarray(rows, dtype=np.float64), np.asarray(padded_len, dtype=np.float64))
        a = b * s * s if attn is None else np.broadcast_to(np.asarray(attn, dtype=np.float64), b.shape)
        if op not in ("F", "B", "I", "W"):
            raise ValueError(f"unknown op {op!r}; expected F, B, I or W")
        if op in ("I", "W") and not self.own_split(int(stage), op):
            raw = derived_split(self, int(stage), op, b, s, a)
        else:
            raw = np.maximum(self._predict(int(stage), op, b, s, a), 0.0)
        recv = self.comm.recv_latency_s if self.receives(int(stage), op) else 0.0
        return raw * self.scale_of(int(stage), op) + self.runtime_overhead_s.get(op, 0.0) + recv

    def own_split(self, stage: int, op: str) -> bool:
        """Whether ``op`` (``I`` or ``W``) on ``stage`` comes from this model's own fit or formula; else it is
        derived from ``B`` by ``dynmb.costmodel.split``'s measured shares."""
        return (int(stage), op) in getattr(self, "params", getattr(self, "grids", {}))

    def scale_of(self, stage: int, op: str) -> float:
        """The runtime scale of ``op`` on ``stage`` (``with_scale``; 1.0 when not calibrated). ``I`` and
        ``W`` without a scale of their own take ``B``'s, from which they are derived."""
        per_stage = self.runtime_scale.get(op) or (self.runtime_scale.get("B") if op in ("I", "W") else None)
        return float(per_stage[stage]) if per_stage else 1.0

    def with_overhead(self, F: float = 0.0, B: float = 0.0, I: float = 0.0, W: float = 0.0) -> "CostModel":  # noqa: E741
        """A copy whose every F / B (/ I / W) prediction adds ``F`` / ``B`` seconds: what the runtime
        spends per action beyond the op itself (posting sends, memory-meter hooks, the interpreter),
        measured on the steps a job ran so far (``calibration.job_calibration``)."""
        c = copy.copy(self)
        c.runtime_overhead_s = {"F": float(F), "B": float(B), **{k: float(v) for k, v in (("I", I), ("W", W)) if v}}
        return c

    def with_scale(self, scale: Mapping[str, Sequence[float]]) -> "CostModel":
        """A copy whose ``op`` predictions on stage p are multiplied by ``scale[op][p]`` (before the
        overhead is added): how much slower (or faster) this host runs each stage's ops in a real
        pipeline than the profile measured, fitted on the steps a job ran so far
        (``calibration.job_calibration``)."""
        for op, per_stage in scale.items():
            if len(per_stage) != self.num_stages or not all(np.isfinite(v) and v > 0 for v in per_stage):
                raise ValueError(f"runtime scale of {op} must be {self.num_stages} positive numbers, got {per_stage!r}")
        c = copy.copy(self)
        c.runtime_scale = {op: tuple(float(v) for v in per_stage) for op, per_stage in scale.items()}
        return c

    def with_recv_latency(self, recv_latency_s: float) -> "CostModel":
        """A copy whose every receiving action (``receives``) takes ``recv_latency_s`` seconds
        more: what a running pipeline's receives waited beyond the profile's P2P time, fitted on
        the steps a job ran so far (``calibration.job_calibration``; ``CommModel``)."""
        c = copy.copy(self)
        c.comm = self.comm.with_recv_latency(recv_latency_s)
        return c

    def without_block_recompute(self) -> "CostModel":
        """A copy (calibration kept) pricing the same layout with no leading blocks recomputed
        (``ModelConfig.recompute_blocks`` None): what the recomputation adds is its prices against these
        (``dynmb.timing.gap_terms``: ``passes``). This model itself where it recomputes none."""
        if self.model_cfg.recompute_blocks is None:
            return self
        c = copy.copy(self)
        c.model_cfg = replace(self.model_cfg, recompute_blocks=None)
        return c

    def for_layout(self, model_cfg: ModelConfig, num_stages: int) -> "CostModel":
        """This model's kind and constants for ``model_cfg`` (another layer split, say) over ``num_stages``
        stages; only a ``layout_free`` model (ValueError otherwise). The runtime calibration
        (``with_scale``, ``with_overhead``, per stage) is not carried over."""
        if not self.layout_free:
            raise ValueError(f"a {self.kind} cost model was fitted to one layer split; it cannot price another")
        return type(self)._from_parts(model_cfg, int(num_stages), self.comm, dict(self.meta), self._params())

    def receives(self, stage: int, op: str) -> bool:
        """Whether ``op`` on ``stage`` receives a message from a neighbouring stage (``F`` after
        the first stage, ``B``/``I`` before the last)."""
        return (op == "F" and stage > 0) or (op in ("B", "I") and stage < self.num_stages - 1)

    def _predict(self, stage: int, op: str, b: np.ndarray, s: np.ndarray, a: np.ndarray) -> np.ndarray:
        raise NotImplementedError

    @classmethod
    def _from_parts(cls, cfg: ModelConfig, p: int, comm: CommModel, meta: dict[str, Any],
                    params: Any) -> "CostModel":
        """A model of this kind from the parts of its JSON form (``from_dict``); each kind implements it."""
        raise NotImplementedError

    def stage_costs(self, rows: Any, padded_len: Any, attn: Any = None, ops: tuple[str, ...] = ("F", "B"),
                    recompute: Any = None) -> dict[str, np.ndarray]:
        """``{"F": ndarray[P, m], "B": ndarray[P, m]}`` seconds per stage and microbatch
        (``attn`` as in ``predict``; ``ops``: which ops; ``recompute[m]``: microbatches run with
        full recomputation, ``dynmb.costmodel.split.apply_recompute``); a layout recomputing some stages' leading
        blocks (``ModelConfig.recompute_blocks``) adds their price on the others (``split.apply_block_recompute``)."""
        b = np.atleast_1d(np.asarray(rows, dtype=np.float64))
        s = np.atleast_1d(np.asarray(padded_len, dtype=np.float64))
        b, s = np.broadcast_arrays(b, s)
        a = b * s * s if attn is None else np.broadcast_to(np.atleast_1d(np.asarray(attn, dtype=np.float64)), b.shape)
        need = tuple(dict.fromkeys(("F", "B", *ops) if recompute is not None else ops))
        out = {op: np.stack([self.predict(p, op, b, s, a) for p in range(self.num_stages)]).reshape(self.num_stages, -1)
               for op in need}
        if recompute is not None:
            out = apply_recompute(self, out, recompute)
        out = apply_block_recompute(self, out, (b.reshape(-1), s.reshape(-1), a.reshape(-1)), recompute)
        return {op: v for op, v in out.items() if op in ops}

    def plan_costs(self, plan: Any, ops: tuple[str, ...] = ("F", "B")) -> dict[str, np.ndarray]:
        """``stage_costs`` of every microbatch of ``plan`` with its attention work under
        this model's ``attention`` setting and its ``recompute`` flag: the lookup the
        simulator, reorderer and runtime use for a whole plan."""
        shapes = plan.shapes()
        rc = plan.recompute_mask() if hasattr(plan, "recompute_mask") else None
        attn = plan.attention_work(self.model_cfg.attention)
        recompute = rc if rc is not None and rc.any() else None
        if not getattr(plan, "has_slices", False) or set(self.prefix_scale.values()) == {1.0}:
            return self.stage_costs(shapes[:, 0], shapes[:, 1], attn, ops=ops, recompute=recompute)
        cross = plan.prefix_cross_work()
        out = {}
        for op in ops:                  # each op with its own price of the slices' prefix attention
            scale = self.prefix_scale.get(op, self.prefix_scale["B"])
            out[op] = self.stage_costs(shapes[:, 0], shapes[:, 1], attn + (scale - 1.0) * cross, ops=(op,),
                                       recompute=recompute)[op]
        return out

    def comm_s(self, rows: Any, padded_len: Any) -> np.ndarray:
        """P2P seconds of the message of microbatches (rows, padded_len) between stages, at the widest link's
        channels (``ModelConfig.link_bytes``)."""
        return self.comm.time(self.model_cfg.link_bytes(np.asarray(rows, dtype=np.float64),
                                                        np.asarray(padded_len, dtype=np.float64), self.num_stages))

    def check(self, model_cfg: ModelConfig, num_stages: int) -> None:
        """Raise ValueError unless this model was made for ``model_cfg`` split over ``num_stages`` (the recomputed
        blocks, ``recompute_blocks``, named first: a fitted model's samples hold its layout's recomputation)."""
        mine, theirs = self.model_cfg.recompute_blocks, model_cfg.recompute_blocks
        if mine != theirs:
            raise ValueError(f"{self.kind} cost model was made for a layout recomputing blocks "
                             f"{None if mine is None else list(mine)} per stage, not "
                             f"{None if theirs is None else list(theirs)} (ModelConfig.recompute_blocks); profile and "
                             f"fit one for that layout (`dynmb profile` + `dynmb fit`) or use a layout-free model")
        self.model_cfg.check_made_for(self.num_stages, model_cfg, num_stages, what=f"{self.kind} cost model",
                                      remedy="profile and fit one for this config (`dynmb profile` + `dynmb fit`)",
                                      ignore=("max_seq_len",))

    # --- I/O ----------------------------------------------------------------
    def _params(self) -> dict[str, Any]:
        return {}

    def to_dict(self) -> dict[str, Any]:
        d = {"kind": self.kind, "model": self.model_cfg.to_dict(), "num_stages": self.num_stages,
             "comm": self.comm.to_dict(), "meta": self.meta, "params": self._params()}
        if any(self.runtime_overhead_s.values()):
            d["runtime_overhead_s"] = dict(self.runtime_overhead_s)
        if self.runtime_scale:
            d["runtime_scale"] = {op: list(v) for op, v in self.runtime_scale.items()}
        if set(self.prefix_scale.values()) != {1.0}:
            d["prefix_scale"] = dict(self.prefix_scale)
        return d

    def save(self, path: str | Path) -> None:
        """Write the JSON form atomically (``dynmb.io.atomic``)."""
        write_text_atomic(path, json.dumps(self.to_dict(), indent=1,
                                           default=lambda o: o.tolist() if hasattr(o, "tolist") else str(o)))

    @staticmethod
    def from_dict(d: dict[str, Any]) -> "CostModel":
        kinds = CostModel._kinds
        if d.get("kind") not in kinds:
            raise ValueError(f"unknown cost model kind {d.get('kind')!r}; expected one of {list(kinds)}")
        cm = kinds[d["kind"]]._from_parts(ModelConfig.from_dict(d["model"]), int(d["num_stages"]),
                                          CommModel(**d.get("comm", {})), d.get("meta", {}), d.get("params", {}))
        cm = cm.with_overhead(**d["runtime_overhead_s"]) if d.get("runtime_overhead_s") else cm
        cm = cm.with_scale(d["runtime_scale"]) if d.get("runtime_scale") else cm
        raw = d.get("prefix_scale", 1.0)
        scale = {"F": raw, "B": raw} if isinstance(raw, (int, float)) else dict(raw)
        if set(scale) != {"F", "B"} or not all(isinstance(v, (int, float)) and np.isfinite(v) and v > 0
                                                for v in scale.values()):
            raise ValueError(f"prefix_scale must be a positive number or {{'F': .., 'B': ..}}, got {raw!r}")
        cm.prefix_scale = {op: float(v) for op, v in scale.items()}
        return cm

    @staticmethod
    def load(path: str | Path) -> "CostModel":
        def build(d: dict[str, Any]) -> "CostModel":
            check_numbers(d.get("params"), "params")
            check_numbers(d.get("comm"), "comm")
            check_numbers(d.get("runtime_overhead_s"), "runtime_overhead_s", negative_ok=True)
            check_numbers(d.get("runtime_scale"), "runtime_scale")
            return check_cost_model(CostModel.from_dict(d))   # finite, >= 0, non-decreasing in tokens

        return read_model_file(path, "cost-model", build)

    def __repr__(self) -> str:
        return f"{type(self).__name__}(model={self.model_cfg.name!r}, num_stages={self.num_stages}, comm={self.comm})"
