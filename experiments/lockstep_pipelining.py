"""A torchtitan-style training loop on torch.distributed.pipelining with static shapes, fed by dynmb's lockstep rows.

    torchrun --nproc-per-node 4 experiments/lockstep_pipelining.py --pp 2 --steps 2 --out /tmp/lockstep_example

Mesh: ``world = pp x dp``; rank ``r`` is stage ``r % pp`` of replica ``r // pp``. Every rank:

1. plans the same global batches (``DynamicBatchSampler(method="lockstep", num_replicas=dp, rank=replica,
   pack_len=T, shuffle=False)``; planning is deterministic, no communication) and fixes the schedule's
   microbatch count ``M`` at the most any replica runs in a step (shorter steps get all-pad microbatches);
2. builds ONE ``PipelineStage`` as torchtitan does (no example tensors: torch infers the shapes at the first
   step and sizes every receive buffer from microbatch 0, so every microbatch must be ``[b, T]``: static
   shapes) and ``Schedule1F1B`` with ``M`` microbatches; the positions reach every stage as a
   keyword argument (torch splits ``step``'s keyword tensors into microbatches and hands them to each stage);
3. per step, the stacked ``[M * b, T]`` input_ids / positions / labels of ``dynmb.integrations.static_rows``
   go through ``schedule.step``; the loss is the summed next-token cross-entropy over the step's global
   valid-token count (``StaticStep.step_valid_tokens``, every replica), so summing the replicas' gradients
   (an all-reduce over the data-parallel group) gives the global batch's gradient.

The model here is a small pre-norm transformer (learned position embeddings indexed by the restarting
positions, document-causal attention from the positions: a document starts where its position is 0);
``--check`` compares every rank's accumulated gradients with one process running all rows of the step
(``reference_grads``), max abs error over max |gradient| per parameter. ``tests/test_lockstep_pipelining.py``
runs it on 4 gloo ranks (2x2).
"""

from __future__ import annotations

import argparse
import json
import os
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator

import numpy as np
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.pipelining import PipelineStage, Schedule1F1B

import dynmb
from dynmb.api.collate import token_loss_sum
from dynmb.integrations.static_rows import StaticRowsSettings, static_steps
from dynmb.models import synthetic_tokens

VOCAB, D_MODEL, HEADS, LAYERS = 64, 32, 4, 4


class Block(nn.Module):
    """Pre-norm attention + MLP with document-causal attention."""

    def __init__(self) -> None:
        super().__init__()
        self.n1, self.n2 = nn.LayerNorm(D_MODEL), nn.LayerNorm(D_MODEL)
        self.qkv, self.out = nn.Linear(D_MODEL, 3 * D_MODEL), nn.Linear(D_MODEL, D_MODEL)
        self.mlp = nn.Sequential(nn.Linear(D_MODEL, 4 * D_MODEL), nn.GELU(), nn.Linear(4 * D_MODEL, D_MODEL))

    def forward(self, h: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        b, T, _ = h.shape
        q, k, v = self.qkv(self.n1(h)).view(b, T, 3, HEADS, -1).permute(2, 0, 3, 1, 4)
        a = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
        h = h + self.out(a.transpose(1, 2).reshape(b, T, D_MODEL))
        return h + self.mlp(self.n2(h))


def document_mask(positions: torch.Tensor) -> torch.Tensor:
    """``[b, 1, T, T]`` True where query i may attend key j: same document (a new one at every position 0) and j <= i."""
    doc = torch.cumsum((positions == 0).long(), dim=1)
    T = positions.shape[1]
    causal = torch.ones(T, T, dtype=torch.bool).tril()
    return ((doc[:, :, None] == doc[:, None, :]) & causal)[:, None]


class Model(nn.Module):
    """The whole model; ``stage(k, pp)`` is the part stage k runs (the same parameter objects)."""

    def __init__(self, max_len: int) -> None:
        super().__init__()
        self.tok, self.pos = nn.Embedding(VOCAB, D_MODEL), nn.Embedding(max_len, D_MODEL)
        self.blocks = nn.ModuleList(Block() for _ in range(LAYERS))
        self.norm, self.head = nn.LayerNorm(D_MODEL), nn.Linear(D_MODEL, VOCAB, bias=False)

    def stage(self, k: int, pp: int) -> "Stage":
        per = LAYERS // pp
        return Stage(self, k, pp, list(range(k * per, (k + 1) * per)))

    def forward(self, ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        h = self.tok(ids) + self.pos(positions)
        mask = document_mask(positions)
        for blk in self.blocks:
            h = blk(h, mask)
        return self.head(self.norm(h))


class Stage(nn.Module):
    """Stage k: ids (first) or hidden, and the positions -> hidden, the last one -> logits."""

    def __init__(self, model: Model, k: int, pp: int, layers: list[int]) -> None:
        super().__init__()
        self.first, self.last = k == 0, k == pp - 1
        self.tok = model.tok if self.first else None
        self.pos = model.pos if self.first else None
        self.blocks = nn.ModuleList(model.blocks[i] for i in layers)
        self.norm = model.norm if self.last else None
        self.head = model.head if self.last else None

    def forward(self, x: torch.Tensor, positions: torch.Tensor):
        h = self.tok(x) + self.pos(positions) if self.first else x
        mask = document_mask(positions)
        for blk in self.blocks:
            h = blk(h, mask)
        return self.head(self.norm(h)) if self.last else h


class StepLoss:
    """Summed next-token cross-entropy of a microbatch over the step's global valid tokens (set per step)."""

    valid_tokens = 1

    def __call__(self, logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        return token_loss_sum(logits, labels) / self.valid_tokens


def build_args() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--pp", type=int, default=2, help="pipeline stages (world size / pp replicas)")
    ap.add_argument("--pack-len", type=int, default=64, help="T: tokens per row")
    ap.add_argument("--docs", type=int, default=48, help="documents per global batch")
    ap.add_argument("--steps", type=int, default=2, help="global batches (optimizer steps) run")
    ap.add_argument("--seed", type=int, default=0, help="model and data seed")
    ap.add_argument("--check", action="store_true", help="compare gradients with a one-process reference")
    ap.add_argument("--out", type=Path, required=True, help="folder for each rank's result JSON")
    return ap


def batch_data(args: argparse.Namespace) -> tuple[np.ndarray, list[torch.Tensor]]:
    """A long-tail global batch stream: lengths in [1, T] and their token ids."""
    rng = np.random.default_rng(args.seed)
    lens = np.minimum(rng.pareto(1.0, args.docs * args.steps) * 6 + 1, args.pack_len).astype(np.int64)
    return lens, synthetic_tokens(lens, VOCAB, seed=args.seed)       # length + 1 ids: tokens, then end-of-text


def sampler_for(args: argparse.Namespace, lens: np.ndarray, dp: int, replica: int) -> dynmb.DynamicBatchSampler:
    return dynmb.DynamicBatchSampler(lens, args.docs, model="llama-tiny", num_stages=args.pp, memory_limit="2GiB",
                                     method="lockstep", num_replicas=dp, rank=replica, shuffle=False,
                                     pack_len=args.pack_len)


@contextmanager
def float64_default() -> Iterator[None]:
    """Tensors made without a dtype are float64 inside, as they were before after it (a test process calls
    ``check``; the spawned test ranks are reused by the next test)."""
    previous = torch.get_default_dtype()
    torch.set_default_dtype(torch.float64)
    try:
        yield
    finally:
        torch.set_default_dtype(previous)


def train(rank: int, world: int, args: argparse.Namespace) -> dict:
    """One rank of the loop (module doc); returns its stage's gradients of the last step and its losses."""
    torch.set_num_threads(1)
    with float64_default():
        return _train(rank, world, args)


def _train(rank: int, world: int, args: argparse.Namespace) -> dict:
    pp = args.pp
    dp, replica, k = world // pp, rank // pp, rank % pp
    pp_groups = [dist.new_group([r * pp + s for s in range(pp)]) for r in range(dp)]
    dp_groups = [dist.new_group([r * pp + s for r in range(dp)]) for s in range(pp)]
    lens, tokens = batch_data(args)
    sampler = sampler_for(args, lens, dp, replica)     # one per rank: its first planning all-gathers the
    plans = sampler.plans()                            # replicas' settings, a collective every rank joins here
    M = max(sum(1 for x in p.replica_ids if x == r) for r in range(dp) for p in plans)   # plans hold every replica
    settings = StaticRowsSettings(pack_len=args.pack_len, microbatches=M)
    torch.manual_seed(args.seed)
    model = Model(args.pack_len)
    stage_mod = model.stage(k, pp)
    stage = PipelineStage(stage_mod, k, pp, torch.device("cpu"), group=pp_groups[replica])
    loss = StepLoss()
    schedule = Schedule1F1B(stage, n_microbatches=M, loss_fn=loss, scale_grads=False)
    losses_out = []
    for step in static_steps(sampler, tokens, settings):
        stage_mod.zero_grad(set_to_none=True)
        loss.valid_tokens = step.step_valid_tokens
        losses: list[torch.Tensor] = []
        if k == 0:
            schedule.step(step.input_ids, positions=step.positions)
        elif k == pp - 1:
            schedule.step(positions=step.positions, target=step.labels, losses=losses)
        else:
            schedule.step(positions=step.positions)
        for p in stage_mod.parameters():
            dist.all_reduce(p.grad, group=dp_groups[k])
        losses_out.append(float(sum(x.item() for x in losses)))
    grads = {n: p.grad.tolist() for n, p in stage_mod.named_parameters()}
    return {"rank": rank, "stage": k, "replica": replica, "microbatches": M, "losses": losses_out, "grads": grads}


def reference_grads(args: argparse.Namespace, dp: int) -> dict[str, torch.Tensor]:
    """One process: every row of every replica in the last step, the same loss, one backward."""
    with float64_default():
        return _reference_grads(args, dp)


def _reference_grads(args: argparse.Namespace, dp: int) -> dict[str, torch.Tensor]:
    lens, tokens = batch_data(args)
    torch.manual_seed(args.seed)
    model = Model(args.pack_len)
    settings = StaticRowsSettings(pack_len=args.pack_len)
    steps = [list(static_steps(sampler_for(args, lens, dp, r), tokens, settings))[-1] for r in range(dp)]
    total = sum(token_loss_sum(model(s.input_ids, s.positions), s.labels) for s in steps)
    (total / steps[0].step_valid_tokens).backward()
    return {n: p.grad for n, p in model.named_parameters()}


def check(args: argparse.Namespace, results: list[dict]) -> float:
    """Worst (max abs error / max |reference|) over every stage parameter of every rank."""
    ref = reference_grads(args, len(results) // args.pp)
    worst = 0.0
    for res in results:
        for n, g in res["grads"].items():
            r = ref[_global_name(n, res["stage"], args.pp)]
            worst = max(worst, float((torch.tensor(g, dtype=torch.float64) - r).abs().max() / r.abs().max().clamp_min(1e-300)))
    return worst


def _global_name(name: str, k: int, pp: int) -> str:
    """A stage parameter's name in the whole model (its blocks renumbered)."""
    if name.startswith("blocks."):
        _, i, rest = name.split(".", 2)
        return f"blocks.{k * (LAYERS // pp) + int(i)}.{rest}"
    return name


def main(argv: list[str] | None = None) -> int:
    args = build_args().parse_args(argv)
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    dist.init_process_group("gloo")
    res = train(rank, world, args)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / f"rank{rank}.json").write_text(json.dumps(res))
    dist.barrier()
    if args.check and rank == 0:
        results = [json.loads((args.out / f"rank{r}.json").read_text()) for r in range(world)]
        print(json.dumps({"max_rel_grad_error": check(args, results), "microbatches": res["microbatches"]}))
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
