"""Per-stage memory model: model states + activation bytes of (rows, padded_len) microbatches.

numpy only. One definition (DESIGN.md "Memory"): the peak on a stage is

    state_bytes[i] + sum(act_i(mb) for mb in flight on stage i) + transient_i(current op's mb)

- ``state_bytes[i]``: parameters + gradients (both at the model dtype, ``e`` bytes) +
  optimizer states (Adam: two fp32 states per parameter, 8 bytes; SGD: none), so
  ``n_params * (2e + 8)`` with Adam. A float64 model (exact-gradient checks) counts twice the
  float32 model's bytes, every term (``MemoryModel._doubled``).
- ``act_i(b, s) = a0 + a1*b*s + a2*b*s^2`` (bytes held for backward by one microbatch).
- ``transient_i(b, s) = t0 + t1*b*s + t2*b*s^2`` (buffers of the op being run that are
  not held: at a backward's start the incoming gradient and the input gradient, and on
  the last stage the fp32 logits gradient).

Analytic default (``MemoryModel.analytic``) counts the storages ``dynmb.models`` saves
for backward (checked against ``saved_tensors_hooks``, each storage once, parameters
excluded), keyed on ``cfg.attention``. Per block and token: the LN inputs and the
qkv/fc inputs (4d), the shared q/k/v storage (3d), the SDPA output (d, also the output
projection's input), the GELU input and MLP-proj input (2f) at ``e`` bytes, plus 4 fp32
LayerNorm statistics and the per-head fp32 logsumexp. ``dense`` adds, per block and row,
the additive (s, s) mask at ``e`` bytes (``a2``). ``auto`` saves no mask (``a2 = 0``); its
packed path runs the attention sublayer (qkv input, q/k/v, output, logsumexp) on the
documents gathered into length buckets, at most ``1 + BUCKET_PADDING`` times the real
tokens, and the model charges that factor on those terms for every microbatch (an
upper bound for packed rows; padded rows are over-counted by at most BUCKET_PADDING
times the attention share, about 2%), plus the two int64 bucket index tensors per
stage. The first stage adds the token and position ids (int64), the last the final
norm (2d + 2 stats), the fp32 log-softmax output (V) and the labels (int64); every stage
but the last holds its output (d) until its backward (the runtime keeps it to call
backward on). This is what ``dynmb.runtime.meter`` accounts on CPU (``tests/test_memory.py``:
within 5% over (rows, padded_len, documents per row) for both attention kinds); on
CUDA a fit to measurements replaces it.

``fit(samples)``: coefficients fitted to measurements (``dynmb.memory.fit``; samples from ``dynmb memory``, ``dynmb.measure.memory``); ``peak_bytes``:
the states plus the schedule kind's peak rule (``dynmb.memory.peak``).

Split backward and recomputation (the ``[P, 3]`` coefficients at the end of this module): ``w_matrix`` gives the bytes a
microbatch holds from its ``I`` to its ``W`` (the simulator charges them there); a microbatch
with ``recompute`` holds only its blocks' inputs from F to B (``act_matrix(..., recompute=)``,
``rc_act_coef``) and one block's activations on top of its backward's transient bytes
(``rc_transient_coef``); it runs its whole backward in ``I`` (``w`` = 0). Fitted models derive
these from the analytic count: ``rc_act_coef = act_coef - recompute_saved_coef`` (>= 0).

Recomputed leading blocks (``ModelConfig.recompute_blocks``, per stage; ``dynmb.memory.coef``'s section on them):
``analytic`` counts such a block as its input only (``block_recompute_saved_coef`` off the activations), adds the
largest one's re-created bytes to the transient (``block_recompute_transient_coef``) and holds nothing of it from I to
W (``w_coef``); ``rc_act_coef`` / ``rc_transient_coef`` stay the full-recompute counts of the layout without them.
The views compose (``as_planned``, ``embedding_last``, ``sharded``); ``offloading`` refuses such a layout.

Activation offload (``offloading``, ``PlanMeta.offload_blocks``): a view whose offloaded blocks' saved bytes leave
the held activations and count as transient bytes of the microbatch's own ops plus ``in_transit`` other
microbatches' (copies out and reloads in flight); every consumer reads them through the same queries.

Sharded states (``sharded``, ``PlanSpec.state_shards`` = k; ``dynmb run --dp k --shard``: FSDP2 with
``reshard_after_forward=False``, ``dynmb.runtime.fsdp``): between steps a rank holds its 1/k shard of the parameters
and of the optimizer's states. ``begin_step`` all-gathers every unit once, before the first forward, and the weights
stay whole until ``finish_step``; the backwards accumulate whole gradients, which ``finish_step`` reduce-scatters
into 1/k shards (each unit's whole weights are freed before its reduce-scatter input is made; the gradient shards
live from there to the optimizer step's ``zero_grad``). While any activation is held a stage so holds whole
weights ``n e`` + whole gradients ``n e`` (counted from the step's start, as whole states count theirs) + the
weight shards ``n e / k`` + the optimizer's shards ``n o / k``: ``n (2e + (e + o) / k)`` where whole states are
``n (2e + o)`` (``sharded_state_ratio``; Adam ``o = 2 max(4, e)``: 8 at bf16 / fp32, so bf16 at k = 8 holds
5.25 n bytes for 12 n; with SGD sharding holds more than whole). FSDP2's all-gather output at ``begin_step``
(one unit, before any gradient) stays under that count. Measured (2 gloo ranks, ``tiny`` stage 0, fp32, glibc's
allocated bytes around a step, n = 394,880): +4.03 n after ``begin_step``, +8.08 n after the backwards,
+2.11 n after ``finish_step`` (the gradient shards), +0.07 n after ``zero_grad``; the CPU meter counts the same
(``dynmb.runtime.meter``).

Slices of long sequences (``dynmb.models.prefix``): a continued slice holds its keys and values for later
slices (``slice_coef``: on top of its activations when recomputed) and their gradients from its chain's first
backward to its own (``slice_grad_coef``). A recomputed continued slice's backward also keeps each finished
block's recomputed keys and values until its whole backward ends, ``R = e (d + 2k [+ k rotated])`` per token
and layer, so while its stage's first block is recomputed ``(n - 1) R`` more than ``rc_transient_coef`` counts
sit beside that block's activations (``slice_recompute_coef``: the stage's ``n`` attention layers; on the
LM-head stage less the head phase's margin over the block phase). Measured with the CPU meter: the even-cut,
all-recomputed ``tiny`` plan of ``tests/test_slices_dp.py``'s batch held 25,647,040 B where the model without
the term predicted 25,165,073 B (its replica 0: 24,664,827 B).
"""

from __future__ import annotations

import copy
import json
from dataclasses import replace
from pathlib import Path
from typing import Any, Protocol

import numpy as np

from dynmb.io.atomic import write_text_atomic
from dynmb.core.config import ModelConfig
from dynmb.costmodel.validate import check_memory_model, check_numbers, read_model_file
from dynmb.memory.coef import (BUCKET_PADDING, block_act_coef, block_recompute_saved_coef, block_recompute_transient_coef,
                          half_act_coef, head_act_per_token, recompute_saved_coef,
                          offload_coef, recompute_transient_coef, slice_recompute_coef, stage_act_per_token,
                          stage_block_count, stage_blocks_act, w_coef)
from dynmb.memory.fit import fit_memory_model
from dynmb.memory.peak import inflight_limit, peak_from_matrix, rank_state
from dynmb.schedule.kinds import SCHEDULE_KINDS, interleaved_inflight

__all__ = ["MemoryModelLike", "MemoryModel", "get_memory_model", "SCHEDULE_KINDS", "BUCKET_PADDING", "inflight_limit",
           "peak_from_matrix",
           "interleaved_inflight", "w_coef", "recompute_saved_coef", "recompute_transient_coef", "block_act_coef",
           "half_act_coef", "sharded_state_ratio"]




class MemoryModelLike(Protocol):
    """What consumers use of a memory model (the packers, builders, simulator, planner): per-stage
    state bytes and the bytes a microbatch holds and needs on each stage."""

    model_cfg: ModelConfig
    num_stages: int
    state_bytes: np.ndarray

    def act_matrix(self, rows: Any, padded_len: Any, recompute: Any = None) -> tuple[np.ndarray, np.ndarray]:
        """``(act[P, m], transient[P, m])`` bytes of microbatches (rows[m], padded_len[m])."""
        ...

    def peak_bytes(self, rows: Any, padded_len: Any, schedule_kind: str = "1f1b", order: Any = None,
                   virtual: int = 1, recompute: Any = None) -> np.ndarray:
        """Predicted peak bytes per stage of running these microbatches."""
        ...

    def activation_bytes(self, stage: int, rows: Any, padded_len: Any, recompute: bool = False) -> np.ndarray:
        """Bytes one microbatch holds on ``stage`` from its forward to its backward."""
        ...

    def max_rows(self, stage_caps: Any, padded_len: Any, inflight: Any, tight: bool = False,
                 recompute: bool = False) -> np.ndarray:
        """The most rows per padded length that fit ``stage_caps`` with ``inflight`` in flight (packing)."""
        ...

    def recomputing(self) -> Any:
        """This model as a microbatch that recomputes sees it (``--recompute``)."""
        ...

    def check(self, model_cfg: ModelConfig, num_stages: int) -> None:
        """Raise ValueError unless made for ``model_cfg`` over ``num_stages`` stages (``Planner``)."""
        ...


class MemoryModel:
    """Per-stage ``state_bytes`` and activation/transient coefficients ``[P, 3]`` (a0, a1, a2)."""

    def __init__(self, model_cfg: ModelConfig, num_stages: int, state_bytes: Any, act_coef: Any,
                 transient_coef: Any, *, optimizer: str = "adam", source: str = "analytic",
                 report: dict[str, Any] | None = None) -> None:
        model_cfg.stage_units(num_stages)              # validates the split
        self.model_cfg, self.num_stages, self.optimizer = model_cfg, int(num_stages), optimizer
        self.state_bytes = np.asarray(state_bytes, dtype=np.float64).reshape(self.num_stages)
        self.act_coef = np.asarray(act_coef, dtype=np.float64).reshape(self.num_stages, 3)
        self.transient_coef = np.asarray(transient_coef, dtype=np.float64).reshape(self.num_stages, 3)
        self.source, self.report = source, dict(report or {})
        self.w_coef = w_coef(model_cfg, self.num_stages)
        self.rc_act_coef = np.maximum(self.act_coef - recompute_saved_coef(model_cfg, self.num_stages), 0.0)
        self.rc_transient_coef = self.transient_coef + recompute_transient_coef(model_cfg, self.num_stages)
        self.transit_coef = np.zeros((self.num_stages, 3))
        """``offloading``: bytes per microbatch its offloaded blocks move to host memory (``rc_transit_coef``: a
        recomputed one's); 0 without offload."""
        self.rc_transit_coef = np.zeros((self.num_stages, 3))

    # --- construction -------------------------------------------------------
    @staticmethod
    def analytic_state_bytes(model_cfg: ModelConfig, num_stages: int, optimizer: str = "adam") -> np.ndarray:
        e = model_cfg.dtype_bytes
        per = 2 * e + (8 if optimizer == "adam" else 0)
        return np.array([model_cfg.stage_params(s, num_stages) * per for s in range(num_stages)], dtype=np.float64)

    @classmethod
    def analytic(cls, model_cfg: ModelConfig, num_stages: int, optimizer: str = "adam") -> "MemoryModel":
        """Coefficients counted from the tensors ``dynmb.models`` saves for backward."""
        if optimizer not in ("adam", "sgd"):
            raise ValueError(f"unknown optimizer {optimizer!r}; expected adam or sgd")
        if model_cfg.dtype_bytes > 4:
            return cls._doubled(model_cfg, cls.analytic(replace(model_cfg, dtype="float32"), num_stages, optimizer))
        c = model_cfg
        e = c.dtype_bytes
        act = np.zeros((num_stages, 3))
        tr = np.zeros((num_stages, 3))
        blocks = stage_blocks_act(c, num_stages)
        for i, ((na, nm), rows) in enumerate(zip(c.stage_parts(num_stages), c.stage_vocab(num_stages))):
            first, last = i == 0, i == num_stages - 1
            out_bytes = c.message_channels(i, num_stages) * e       # the message sent on
            act[i, 1:] = blocks[i]                                      # whole and half blocks, pieces of halves
            act[i, 1] += stage_act_per_token(c, first, attention=na > 0)          # ids, rotary tables
            if c.attention == "auto":
                act[i, 1] += 8 * (2 + BUCKET_PADDING)       # bucket gather + scatter indices (int64)
            act[i, 1] += head_act_per_token(c, i, num_stages)  # norm_f in/out, stats, log-softmax / logits, labels
            tr[i, 1] = 4 * len(rows)                        # logits gradient of its LM-head rows (fp32)
            if last:
                act[i, 0] += 4                              # the loss
            else:
                act[i, 1] += out_bytes                      # the stage output, kept for its backward
                tr[i, 1] += out_bytes                       # incoming gradient (beside a shard's logits gradient)
            if not first:
                tr[i, 1] += c.message_channels(i - 1, num_stages) * e    # input gradient produced
        act -= block_recompute_saved_coef(c, num_stages)     # the leading blocks a stage recomputes keep their inputs
        tr += block_recompute_transient_coef(c, num_stages)  # ... and re-create one at a time in the backward
        return cls(model_cfg, num_stages, cls.analytic_state_bytes(model_cfg, num_stages, optimizer), act, tr,
                   optimizer=optimizer, source="analytic")

    @classmethod
    def _doubled(cls, model_cfg: ModelConfig, fp32: "MemoryModel") -> "MemoryModel":
        """A float64 model's count: twice the float32 model's (``fp32``), since every tensor it stores in
        float32 (parameters, gradients, Adam states, activations, statistics, logits) is float64 there; the
        int64 ids and labels, counted twice too, make it a slight over-count."""
        model = cls(model_cfg, fp32.num_stages, 2 * fp32.state_bytes, 2 * fp32.act_coef, 2 * fp32.transient_coef,
                    optimizer=fp32.optimizer, source="analytic")
        model.w_coef, model.rc_act_coef = 2 * fp32.w_coef, 2 * fp32.rc_act_coef
        model.rc_transient_coef = 2 * fp32.rc_transient_coef
        return model

    def fit(self, samples: Any, *, holdout: Any = None, holdout_frac: float = 0.25, seed: int = 0) -> "MemoryModel":
        """A new model fitted to ``samples`` (``dynmb.memory.fit.fit_memory_model``: columns stage, rows,
        padded_len, act_bytes and optionally peak_bytes, state_bytes; ``report`` holds the held-out
        relative errors)."""
        return fit_memory_model(self, samples, holdout=holdout, holdout_frac=holdout_frac, seed=seed)

    def recomputing(self) -> "MemoryModel":
        """This model as seen by a microbatch that recomputes: its activation and transient
        coefficients are ``rc_act_coef`` / ``rc_transient_coef`` (for packing every microbatch
        under recomputation's admissibility)."""
        view = MemoryModel(self.model_cfg, self.num_stages, self.state_bytes, self.rc_act_coef,
                           self.rc_transient_coef, optimizer=self.optimizer, source=f"{self.source}+recompute",
                           report=self.report)
        view.rc_act_coef, view.rc_transient_coef, view.w_coef = self.rc_act_coef, self.rc_transient_coef, 0 * self.w_coef
        view.transit_coef = view.rc_transit_coef = self.rc_transit_coef
        view.in_transit, view.offload_blocks = self.in_transit, self.offload_blocks
        view.state_shards, view.embed_state_bytes = self.state_shards, self.embed_state_bytes
        return view

    offload_blocks: tuple[int, ...] | None = None
    """``offloading``'s blocks per stage (None: nothing offloaded)."""
    in_transit: int = 0
    """``offloading``: how many microbatches besides the running op's may hold their offloaded bytes on the device
    at once on a stage (copies out and reloads in flight)."""
    _before_offload: "MemoryModel | None" = None

    def offloading(self, blocks: Any, in_transit: int = 3) -> "MemoryModel":
        """This model with each stage's first ``blocks[i]`` blocks offloaded to host memory between a microbatch's
        forward and its backward (``PlanMeta.offload_blocks``; ``dynmb.timing.offload`` times the copies): what they
        save (``dynmb.memory.coef.offload_coef``, at most what the stage holds) leaves ``act_coef`` /
        ``rc_act_coef`` and comes back as transient bytes of the microbatch's own ops (its forward produces them, its
        backward reads them back), and ``in_transit`` other microbatches' offloaded bytes may be on the device
        beside any op (copies out and reloads in flight: ``dynmb.timing.offload.in_transit``, 3 by its rules):
        ``act_matrix`` adds ``in_transit`` times the batch's largest, ``max_rows`` and
        ``transient_bytes`` that many of the microbatch's own (equal microbatches). All zeros or None: the model
        before any offload. Applied to a view already offloading, it starts from the model before."""
        base = self._before_offload or self
        if blocks is not None and np.any(blocks) and base.model_cfg.recompute_blocks is not None:
            raise ValueError(f"offload_blocks {list(np.asarray(blocks).reshape(-1))}: model {base.model_cfg.name!r} "
                             f"recomputes blocks {list(base.model_cfg.recompute_blocks)}; offload counts plain blocks only")
        want = np.zeros(self.num_stages, dtype=np.int64) if blocks is None else \
            np.asarray(blocks, dtype=np.int64).reshape(-1)
        if want.shape != (self.num_stages,) or np.any(want < 0):
            raise ValueError(f"offload_blocks must hold one count >= 0 per stage ({self.num_stages}), got {blocks!r}")
        if not want.any():
            return base
        if self.offload_blocks == tuple(int(x) for x in want) and self.in_transit == in_transit:
            return self
        cfg = base.model_cfg
        plain, rc = offload_coef(replace(cfg, dtype="float32") if cfg.dtype_bytes > 4 else cfg, self.num_stages,
                                 np.minimum(want, stage_block_count(cfg, self.num_stages)))
        if cfg.dtype_bytes > 4:                       # the float64 count is twice the float32 one (``_doubled``)
            plain, rc = 2 * plain, 2 * rc
        plain, rc = np.minimum(plain, base.act_coef), np.minimum(rc, base.rc_act_coef)
        view = copy.copy(base)
        view.act_coef, view.transient_coef = base.act_coef - plain, base.transient_coef + plain
        view.rc_act_coef, view.rc_transient_coef = base.rc_act_coef - rc, base.rc_transient_coef + rc
        view.transit_coef, view.rc_transit_coef, view.in_transit = plain, rc, int(in_transit)
        view.offload_blocks, view._before_offload = tuple(int(x) for x in want), base
        view.source = f"{base.source}, offload {list(view.offload_blocks)}"
        return view

    def offload_matrix(self, rows: Any, padded_len: Any, recompute: Any = None) -> np.ndarray:
        """``[P, m]``: bytes each microbatch moves to host memory and back on each stage (0 without offload)."""
        b, s = _bs(rows, padded_len)
        out = _eval(self.transit_coef, b, s)
        rc = _mask(recompute, out.shape[1])
        if rc.any():
            out[:, rc] = _eval(self.rc_transit_coef, b[rc], s[rc])
        return out

    embed_state_bytes: float = 0.0
    """The token embedding's states (``embedding_last``: counted in the last stage's ``state_bytes``), else 0."""

    def embedding_last(self) -> "MemoryModel":
        """This model with the token embedding on the last rank (``PlanSpec.embedding = "last"``,
        ``dynmb.schedule.embedlast``): its states (the first stage's, in proportion of its parameters: exact for the
        analytic count) move to the last stage, whose rank holds them (``embed_state_bytes``), and the first stage
        adds the input gradient it now sends back to its transient bytes. The embeds keep nothing from their
        forward to their backward (the runtime redoes the lookup there): their bytes are the simulator's
        (``dynmb.timing.embedding``)."""
        if self.embed_state_bytes:
            return self
        cfg, P, e = self.model_cfg, self.num_stages, self.model_cfg.dtype_bytes
        table = cfg.vocab_size * cfg.d_model + (cfg.max_seq_len * cfg.d_model if cfg.learned_positions else 0)
        moved = float(self.state_bytes[0]) * table / cfg.stage_params(0, P)
        state, tr = self.state_bytes.copy(), self.transient_coef.copy()
        state[0] -= moved
        state[-1] += moved
        tr[0, 1] += cfg.d_model * e                    # the input gradient sent back to the embedding
        view = copy.copy(self)
        view.state_bytes, view.transient_coef = state, tr
        view.rc_transient_coef = self.rc_transient_coef + (tr - self.transient_coef)
        view.embed_state_bytes, view.source = moved, f"{self.source}, embedding last"
        return view

    state_shards: int = 1
    """``sharded``: the data-parallel ranks the states are sharded over (1: held whole)."""

    def as_planned(self, embedding: str = "first", state_shards: int = 1) -> "MemoryModel":
        """This model as a plan with these settings counts it (``PlanSpec.embedding``, ``PlanSpec.state_shards``):
        ``embedding_last`` where ``embedding`` is ``last`` (refused in one line for a model that ties its embedding
        to the LM head: the table is on the last stage already), then ``sharded(state_shards)``. The one place both
        views are applied (``costmodel.loader.spec_models``, ``planning.memory_split.step_proxy``). Idempotent:
        itself where it is that view already; ``first`` on a view with the embedding last is refused (no view
        moves it back)."""
        if embedding not in ("first", "last"):
            raise ValueError(f"embedding must be 'first' or 'last', got {embedding!r}")
        view = self
        if embedding == "last":
            if self.model_cfg.tie_embeddings:
                raise ValueError(f"embedding='last': model {self.model_cfg.name!r} ties its embedding to the LM head, "
                                 f"which is on the last stage already; use embedding='first'")
            view = view.embedding_last()
        elif self.embed_state_bytes:
            raise ValueError(f"embedding='first': this memory model ({self.source}) has the embedding on the last "
                             "stage; pass the model before its embedding_last() view")
        return view.sharded(state_shards)

    def sharded(self, shards: int) -> "MemoryModel":
        """This model with each stage's states sharded over ``shards`` data-parallel ranks by FSDP2 as dynmb's runtime
        runs it (``PlanSpec.state_shards``; module docstring, "Sharded states"): ``state_bytes`` (and
        ``embed_state_bytes``) times ``sharded_state_ratio``; the activations are unchanged. 1: the model with whole
        states. Applied to a sharded view, it starts from the whole count."""
        k = int(shards)
        if k < 1:
            raise ValueError(f"state_shards must be >= 1, got {shards!r}")
        if k == self.state_shards:
            return self
        e = self.model_cfg.dtype_bytes
        scale = sharded_state_ratio(e, self.optimizer, k) / sharded_state_ratio(e, self.optimizer, self.state_shards)
        view = copy.copy(self)
        view.state_bytes, view.embed_state_bytes = self.state_bytes * scale, self.embed_state_bytes * scale
        view.state_shards = k
        base = self.source.split(", states sharded")[0]
        view.source = base if k == 1 else f"{base}, states sharded over {k}"
        return view

    # --- queries ------------------------------------------------------------
    def activation_bytes(self, stage: int, rows: Any, padded_len: Any, recompute: bool = False) -> np.ndarray:
        """Bytes held for backward on ``stage`` by microbatches (rows, padded_len), vectorised."""
        b, s = _bs(rows, padded_len)
        a = (self.rc_act_coef if recompute else self.act_coef)[int(stage)]
        return a[0] + a[1] * b * s + a[2] * b * s * s

    def transient_bytes(self, stage: int, rows: Any, padded_len: Any, recompute: bool = False) -> np.ndarray:
        """Bytes of a microbatch's op on ``stage`` beyond what it holds (with ``offloading``, ``in_transit`` equal
        microbatches' offloaded bytes too)."""
        b, s = _bs(rows, padded_len)
        t = (self.rc_transient_coef if recompute else self.transient_coef)[int(stage)] + \
            self.in_transit * (self.rc_transit_coef if recompute else self.transit_coef)[int(stage)]
        return t[0] + t[1] * b * s + t[2] * b * s * s

    def act_matrix(self, rows: Any, padded_len: Any, recompute: Any = None) -> tuple[np.ndarray, np.ndarray]:
        """``(act[P, m], transient[P, m])`` for microbatches (rows[m], padded_len[m]); the
        microbatches flagged in ``recompute[m]`` (optional) run with full recomputation."""
        b, s = _bs(rows, padded_len)
        act, tr = _eval(self.act_coef, b, s), _eval(self.transient_coef, b, s)
        rc = _mask(recompute, act.shape[1])
        if rc.any():
            act[:, rc] = _eval(self.rc_act_coef, b[rc], s[rc])
            tr[:, rc] = _eval(self.rc_transient_coef, b[rc], s[rc])
        if self.in_transit and act.shape[1]:          # ``offloading``: the others' bytes in transit
            tr += self.in_transit * self.offload_matrix(b, s, rc).max(axis=1, keepdims=True)
        return act, tr

    def w_matrix(self, rows: Any, padded_len: Any, recompute: Any = None) -> np.ndarray:
        """``w[P, m]``: bytes each microbatch holds from its ``I`` to its ``W`` (0 when recomputed:
        its ``I`` runs the whole backward)."""
        b, s = _bs(rows, padded_len)
        w = _eval(self.w_coef, b, s)
        w[:, _mask(recompute, w.shape[1])] = 0.0
        return w

    def slice_coef(self, recompute: bool = False) -> np.ndarray:
        """``[P]`` bytes per token of a continued slice (``Microbatch.continued_tokens``) held on top
        of its activations from its forward to its backward (``dynmb.models.prefix``): when recomputed,
        the keys and values later slices attend to (2 n_kv_heads head_dim per layer of the stage at the model dtype;
        without recomputation its saved activations hold them already, 0)."""
        return self.slice_grad_coef() if recompute else np.zeros(self.num_stages)

    def slice_grad_coef(self) -> np.ndarray:
        """``[P]`` bytes per token of a continued slice's key and value gradients (2 n_kv_heads head_dim
        per layer of the stage: 2 d without grouped K/V), held from its chain's first backward to its
        own (``dynmb.timing.simulate.SliceGrads``)."""
        c = self.model_cfg
        layers = np.array([na for na, _ in c.stage_parts(self.num_stages)], dtype=np.float64)   # attention halves
        return layers * c.kv_heads * c.head_dim * c.dtype_bytes * 2.0

    def slice_recompute_coef(self) -> np.ndarray:
        """``[P]`` bytes per token of a recomputed continued slice held during its backward on top of its
        transient bytes: the recomputed keys and values each finished block keeps until the slice's entries are
        released (``dynmb.memory.coef.slice_recompute_coef``; ``dynmb.timing.simulate.SliceGrads.recomputed``)."""
        return slice_recompute_coef(self.model_cfg, self.num_stages)

    def slice_matrix(self, continued_tokens: Any, recompute: Any = None) -> np.ndarray:
        """``[P, m]``: the bytes ``slice_coef`` adds to each microbatch (``continued_tokens[m]``)."""
        n = np.asarray(continued_tokens, dtype=np.float64).reshape(-1)
        rc = _mask(recompute, n.size)
        return np.where(rc[None, :], self.slice_coef(True)[:, None], self.slice_coef(False)[:, None]) * n[None, :]

    def peak_bytes(self, rows: Any, padded_len: Any, schedule_kind: str = "1f1b", order: Any = None,
                   virtual: int = 1, recompute: Any = None) -> np.ndarray:
        """Predicted peak bytes per stage of running these microbatches (in ``order``;
        ``recompute[m]``, optional, flags recomputed ones, in the same order as ``rows``)."""
        b, s = _bs(rows, padded_len)
        rc = _mask(recompute, b.size)
        if order is not None:
            order = np.asarray(order, dtype=np.int64)
            b, s, rc = b[order], s[order], rc[order]
        state = self.rank_state_bytes(schedule_kind, virtual)
        return state if b.size == 0 else state + peak_from_matrix(*self.act_matrix(b, s, rc), schedule_kind, virtual)

    def rank_state_bytes(self, schedule_kind: str = "1f1b", virtual: int = 1) -> np.ndarray:
        """State bytes per stage of the GPU that holds it (``dynmb.memory.peak.rank_state``)."""
        return rank_state(self.state_bytes, schedule_kind, virtual)

    def max_rows(self, stage_caps: Any, padded_len: Any, inflight: Any, tight: bool = False,
                 recompute: bool = False) -> np.ndarray:
        """Largest b per padded_len with ``inflight[i] * (act_i(b, s) + tr_i(b, s)) <= stage_caps[i]``
        on every stage (0 where not even one row fits); vectorised over padded_len.

        This per-microbatch budget makes any order of such microbatches fit under a
        schedule holding at most ``inflight[i]`` on stage i: a window of k sums to at
        most k * max(act + tr). ``tight``: ``k * act + tr <= cap`` instead (exact for equal
        microbatches; a mix must then be checked with ``peak_bytes``); with ``offloading`` both add the
        ``in_transit`` microbatches' offloaded bytes. ``recompute``: the
        rows of microbatches that run with full recomputation.
        """
        s = np.asarray(padded_len, dtype=np.float64).reshape(1, -1)
        k = np.asarray(inflight, dtype=np.float64).reshape(-1, 1)
        act, tr = (self.rc_act_coef, self.rc_transient_coef) if recompute else (self.act_coef, self.transient_coef)
        w = k * act + (1.0 if tight else k) * tr + self.in_transit * (self.rc_transit_coef if recompute
                                                                         else self.transit_coef)
        room = np.asarray(stage_caps, dtype=np.float64).reshape(-1, 1) - w[:, :1]
        per_row = w[:, 1:2] * s + w[:, 2:3] * s * s
        with np.errstate(divide="ignore", invalid="ignore"):
            bmax = np.where(per_row > 0, np.floor(room / np.where(per_row > 0, per_row, 1.0)),
                            np.where(room >= 0, np.inf, -1.0))
        return np.clip(bmax.min(axis=0), 0, 2**40).astype(np.int64)

    # --- identity and I/O ---------------------------------------------------
    def check(self, model_cfg: ModelConfig, num_stages: int) -> None:
        mine, theirs = self.model_cfg.recompute_blocks, model_cfg.recompute_blocks
        if mine != theirs:
            raise ValueError(f"memory model was made for a layout recomputing blocks {None if mine is None else list(mine)}"
                             f" per stage, not {None if theirs is None else list(theirs)} (ModelConfig.recompute_blocks);"
                             f" measure one for that layout (`dynmb memory`) or use the analytic one")
        self.model_cfg.check_made_for(self.num_stages, model_cfg, num_stages, what="memory model",
                                      remedy=f"measure one with `dynmb memory --model ... --stages {num_stages} "
                                             "-o mem.json`")

    def to_dict(self) -> dict[str, Any]:
        return {"kind": "memory", "source": self.source, "model": self.model_cfg.to_dict(),
                "num_stages": self.num_stages, "optimizer": self.optimizer,
                "state_bytes": self.state_bytes.tolist(), "act_coef": self.act_coef.tolist(),
                "transient_coef": self.transient_coef.tolist(), "report": self.report,
                **({"state_shards": self.state_shards} if self.state_shards > 1 else {})}

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "MemoryModel":
        if d.get("kind") != "memory":
            raise ValueError("not a memory-model JSON (field kind != 'memory')")
        model = cls(ModelConfig.from_dict(d["model"]), d["num_stages"], d["state_bytes"], d["act_coef"],
                    d["transient_coef"], optimizer=d.get("optimizer", "adam"), source=d.get("source", "fitted"),
                    report=d.get("report"))
        model.state_shards = int(d.get("state_shards", 1))      # its state_bytes are sharded ones already
        return model

    def save(self, path: str | Path) -> None:
        write_text_atomic(path, json.dumps(self.to_dict(), indent=1))

    @classmethod
    def load(cls, path: str | Path) -> "MemoryModel":
        def build(d: dict[str, Any]) -> "MemoryModel":
            for key in ("state_bytes", "act_coef", "transient_coef"):
                check_numbers(d.get(key, []), key)
            return check_memory_model(cls.from_dict(d))

        return read_model_file(path, "memory-model", build)

    def __repr__(self) -> str:
        return f"MemoryModel({self.model_cfg.name!r}, P={self.num_stages}, {self.source})"


def sharded_state_ratio(dtype_bytes: int, optimizer: str, shards: int) -> float:
    """Bytes of a parameter's states at a sharded step's peak over ``2e + o`` (its whole count), ``shards`` ranks
    sharing them (module docstring, "Sharded states"): ``(2e + (e + o) / k) / (2e + o)``, ``o`` the optimizer's
    bytes per parameter (Adam: two states at ``max(4, e)``; SGD: 0); 1 at ``k`` 1."""
    e, k = float(dtype_bytes), int(shards)
    o = 2.0 * max(4.0, e) if optimizer == "adam" else 0.0
    return 1.0 if k == 1 else (2 * e + (e + o) / k) / (2 * e + o)


def _eval(coef: np.ndarray, b: np.ndarray, s: np.ndarray) -> np.ndarray:
    """``coef[P, 3]`` at microbatches (b[m], s[m]) -> ``[P, m]``."""
    return coef[:, :1] + coef[:, 1:2] * (b * s) + coef[:, 2:3] * (b * s * s)


def _mask(flags: Any, m: int) -> np.ndarray:
    """``flags`` (None, a bool, or one bool per microbatch) as a bool array of length m."""
    if flags is None:
        return np.zeros(m, dtype=bool)
    return np.broadcast_to(np.asarray(flags, dtype=bool), (m,)).copy()


def _bs(rows: Any, padded_len: Any) -> tuple[np.ndarray, np.ndarray]:
    b, s = np.broadcast_arrays(np.atleast_1d(np.asarray(rows, dtype=np.float64)),
                               np.atleast_1d(np.asarray(padded_len, dtype=np.float64)))
    return b, s


def get_memory_model(path_or_none: str | Path | None, model_cfg: ModelConfig, num_stages: int,
                     optimizer: str = "adam") -> MemoryModel:
    """The fitted model at ``path`` (checked against the config) or the analytic one."""
    if path_or_none is None:
        return MemoryModel.analytic(model_cfg, num_stages, optimizer)
    mm = MemoryModel.load(path_or_none)
    mm.check(model_cfg, num_stages)
    return mm
