"""A plain PyTorch training loop over ``dynmb.DynamicBatchSampler``: your model, your loop.

What it shows, in order:

1. the sampler plans each global batch of the dataset for *your* model (its sizes in a
   ``ModelConfig``; pass ``--cost-model`` / ``--memory-model`` fitted for it, else dynmb warns
   once that it plans with stand-ins) and yields this rank's microbatches in execution order;
2. ``dynmb.api.collate`` turns each into token tensors (``--layout padded``: the plan's rows;
   ``packed``: one row, no padding), positions restarting per document, labels the ids each
   position predicts (IGNORE at pads), ``doc_ids`` for document-causal attention; a document
   of length n is n tokens then its end-of-text id, n trained tokens (docs/design.md "Lengths");
3. gradient accumulation with the token-weighted loss: each microbatch's summed
   cross-entropy divided by the global batch's loss tokens (``planned_loss_tokens``: known on
   every rank from the plan), backward per microbatch, so the accumulated gradient is the
   global batch's whatever its grouping;
4. the optimizer step after the record with ``is_last_in_batch``; with data parallelism
   (launched by torchrun: one replica per process, gloo) the gradients are summed over the
   replicas first (each already divided by the global count, so a sum, not a mean).

The model (``TinyLM``) is one pre-LN transformer block written only against the collate's
``TokenBatch``: token and learned position embeddings, SDPA under ``document_mask()``, an
MLP, an LM head. The data are random token sequences with lengths from a log-normal, each
ending with an end-of-text id (random here, as the tokens are).

    python experiments/train_loop.py --steps 2
    torchrun --nproc-per-node 2 experiments/train_loop.py --steps 2       # 2 data-parallel replicas
"""

from __future__ import annotations

import argparse
import os
import warnings
from typing import Any, Sequence

import numpy as np
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

import dynmb
from dynmb.api.collate import TokenBatch, collate, planned_loss_tokens, token_loss_sum


class TinyLM(nn.Module):
    """One pre-LN decoder block with document-causal attention over a ``TokenBatch``; returns logits."""

    def __init__(self, cfg: dynmb.ModelConfig, seed: int = 0, dtype: torch.dtype = torch.float32) -> None:
        super().__init__()
        torch.manual_seed(seed)
        d, self.heads = cfg.d_model, cfg.n_heads
        self.tok, self.pos = nn.Embedding(cfg.vocab_size, d), nn.Embedding(cfg.max_seq_len, d)
        self.norm1, self.norm2, self.norm_f = nn.LayerNorm(d), nn.LayerNorm(d), nn.LayerNorm(d)
        self.qkv, self.proj = nn.Linear(d, 3 * d), nn.Linear(d, d)
        self.mlp = nn.Sequential(nn.Linear(d, cfg.d_ff), nn.GELU(), nn.Linear(cfg.d_ff, d))
        self.head = nn.Linear(d, cfg.vocab_size)
        self.to(dtype)

    def forward(self, batch: TokenBatch) -> torch.Tensor:
        x = self.tok(batch.input_ids) + self.pos(batch.position_ids)
        b, s, d = x.shape
        q, k, v = self.qkv(self.norm1(x)).view(b, s, 3, self.heads, d // self.heads).permute(2, 0, 3, 1, 4)
        a = F.scaled_dot_product_attention(q, k, v, attn_mask=batch.document_mask())
        x = x + self.proj(a.transpose(1, 2).reshape(b, s, d))
        x = x + self.mlp(self.norm2(x))
        return self.head(self.norm_f(x))


def model_config(vocab: int = 64, d_model: int = 32, heads: int = 2, max_len: int = 256) -> dynmb.ModelConfig:
    """The sizes of ``TinyLM`` as the planner's ``ModelConfig`` (what its stand-in models are sized by)."""
    return dynmb.ModelConfig(name="train-loop-example", vocab_size=vocab, d_model=d_model, n_layers=1, n_heads=heads,
                             d_ff=4 * d_model, max_seq_len=max_len)


def dataset(n: int, cfg: dynmb.ModelConfig, seed: int = 0) -> list[torch.Tensor]:
    """``n`` random token sequences (the last id of each is its end-of-text), lengths log-normal in
    [1, max_seq_len] trained tokens: ``length + 1`` ids each."""
    rng = np.random.default_rng(seed)
    lengths = np.clip(np.rint(np.exp(rng.normal(3.2, 0.8, size=n))), 1, cfg.max_seq_len).astype(np.int64)
    return [torch.from_numpy(rng.integers(0, cfg.vocab_size, size=int(n_tok) + 1)) for n_tok in lengths]


def microbatch_backward(model: nn.Module, tokens: Sequence[Any], mb: dynmb.SampledMicrobatch,
                        layout: str = "padded") -> float:
    """Forward and backward one microbatch with its share of the token-weighted loss; returns that share."""
    batch = collate(tokens, mb, layout=layout)
    loss = token_loss_sum(model(batch), batch.labels) / planned_loss_tokens(mb)
    loss.backward()
    return float(loss.detach())


def train(model: nn.Module, tokens: Sequence[Any], sampler: dynmb.DynamicBatchSampler, optimizer: torch.optim.Optimizer,
          *, steps: int, layout: str = "padded", group: Any = None) -> list[float]:
    """Run ``steps`` optimizer steps (global batches); returns each step's global-batch loss."""
    losses: list[float] = []
    share, epoch = 0.0, 0
    while len(losses) < steps:
        sampler.set_epoch(epoch)
        for mb in sampler:
            share += microbatch_backward(model, tokens, mb, layout)
            if not mb.is_last_in_batch:
                continue
            total = torch.tensor([share], dtype=torch.float64)
            if group is not None:                       # data parallel: sum the replicas' gradients and losses
                for p in model.parameters():
                    if p.grad is not None:
                        dist.all_reduce(p.grad, group=group)
                dist.all_reduce(total, group=group)
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            losses.append(float(total))
            share = 0.0
            if len(losses) == steps:
                break
        epoch += 1
    return losses


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--steps", type=int, default=2, help="optimizer steps (global batches) to run (default 2)")
    ap.add_argument("--samples", type=int, default=64, help="dataset size (default 64)")
    ap.add_argument("--global-batch", type=int, default=16, help="documents per global batch (default 16)")
    ap.add_argument("--memory-limit", default="1500KiB", help="memory limit the plans keep (default 1500KiB)")
    ap.add_argument("--layout", default="padded", choices=("padded", "packed"), help="collate layout")
    ap.add_argument("--cost-model", default=None, help="cost-model JSON fitted for this model (dynmb fit)")
    ap.add_argument("--memory-model", default=None, help="memory-model JSON measured for this model (dynmb memory)")
    ap.add_argument("--lr", type=float, default=1e-2, help="AdamW learning rate (default 1e-2)")
    args = ap.parse_args(argv)

    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world > 1:
        dist.init_process_group("gloo")
    rank, group = (dist.get_rank(), dist.group.WORLD) if world > 1 else (0, None)
    cfg = model_config()
    tokens = dataset(args.samples, cfg)
    lengths = [len(t) - 1 for t in tokens]            # a length: the tokens trained (ids less the end-of-text)
    with warnings.catch_warnings():      # dynmb logs its stand-in line; the warning would say it a second time
        warnings.filterwarnings("ignore", message=r".*with stand-in\(s\)")
        sampler = dynmb.DynamicBatchSampler(lengths, args.global_batch, model=cfg, num_stages=1,
                                            memory_limit=args.memory_limit, cost_model=args.cost_model,
                                            memory_model=args.memory_model, num_replicas=world, rank=rank, seed=0)
    model = TinyLM(cfg)
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr)
    losses = train(model, tokens, sampler, optimizer, steps=args.steps, layout=args.layout, group=group)
    if rank == 0:
        print(f"{len(sampler)} microbatches per epoch on rank 0 over {sampler.num_global_batches()} global batches")
        for step, loss in enumerate(losses):
            print(f"step {step}: loss {loss:.4f}")
    if world > 1:
        dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
