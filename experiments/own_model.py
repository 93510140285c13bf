"""A model of your own through dynmb: profile -> fit -> memory -> plan -> run --verify (issue 22).

The model here is written only against the documented stage contract (docs/design.md "The stage
contract"); it uses none of dynmb's model classes. ``OwnDecoder`` is a small pre-norm transformer:
a token embedding and a learned position table indexed by ``inputs.position_ids`` (which restart at 0
in every document of a packed row), blocks of LayerNorm -> its own multi-head attention -> residual,
LayerNorm -> GELU MLP -> residual, and a final LayerNorm and LM head on the last stage. The attention
is plain softmax attention under a mask it builds from the inputs' document ids: a token attends to
the earlier tokens of its own document (a pad attends to itself only, so no row is empty). That is a
masked kernel: it pays ``rows * padded_len**2`` for a packed row whatever the documents, so the
factory says ``attention_work = "masked"`` and the cost model is fitted and planned on that feature.

Parameters have global names (``blocks.3.attn.qkv.weight``) and are initialised from a generator
seeded by ``(seed, name)``, so every rank holds the same values for any split of the layers
(``config.stage_layers(num_stages)``). The last stage returns the summed cross-entropy over the
real tokens (``inputs.loss_mask``); the caller divides by the global batch's tokens.

The chain, each step the ``dynmb`` command as a user types it (``--model own_model:small_decoder``;
the ranks import ``own_model`` from this folder, put on ``PYTHONPATH``):

1. ``dynmb profile --quick`` (time per stage and op) and ``dynmb fit`` (the cost model);
2. ``dynmb memory --quick`` (the memory model, fitted on the bytes the runtime's accounting measures);
3. ``dynmb plan`` (one global batch under ``--memory-limit`` with those two models);
4. ``dynmb run --plan plan.json --verify`` on 2 gloo ranks: gradients equal a single-process
   reference built from the same factory, and the measured peak of every stage stays under the limit.

Usage: ``python experiments/own_model.py --out results/own_model`` (``--factory tiny`` for a quick
run); it prints each command and a last line with the measured peaks against the limit.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import subprocess
import sys
import zlib
from pathlib import Path

import pandas as pd
import torch
import torch.nn.functional as F
import torch.utils.checkpoint
from torch import nn

import dynmb

__all__ = ["OwnDecoderFactory", "OwnStage", "small_decoder", "tiny_decoder", "main"]

HERE = Path(__file__).resolve().parent


def _seeded_init(module: nn.Module, seed: int) -> None:
    """Every parameter from a generator seeded by (seed, its global name): equal on every rank."""
    with torch.no_grad():
        for name, p in module.named_parameters():
            g = torch.Generator().manual_seed(seed * 1_000_003 + zlib.crc32(name.encode()))
            if name.endswith("bias"):
                p.zero_()
            elif ".ln" in name or name.startswith("ln") or name.startswith("norm"):
                p.fill_(1.0)
            else:
                p.copy_(torch.randn(p.shape, generator=g, dtype=torch.float32).mul_(0.02).to(p.dtype))


class Attention(nn.Module):
    """Multi-head softmax attention, document-causal by a mask built from ``doc_ids``."""

    def __init__(self, d_model: int, n_heads: int) -> None:
        super().__init__()
        self.n_heads = n_heads
        self.qkv = nn.Linear(d_model, 3 * d_model)
        self.out = nn.Linear(d_model, d_model)

    def forward(self, x: torch.Tensor, allowed: torch.Tensor) -> torch.Tensor:
        b, s, d = x.shape
        q, k, v = self.qkv(x).view(b, s, 3, self.n_heads, d // self.n_heads).permute(2, 0, 3, 1, 4)
        scores = (q @ k.transpose(-1, -2)) / math.sqrt(d // self.n_heads)
        weights = scores.masked_fill(~allowed[:, None], float("-inf")).softmax(dim=-1)
        return self.out((weights @ v).transpose(1, 2).reshape(b, s, d))


class Block(nn.Module):
    def __init__(self, d_model: int, n_heads: int, d_ff: int) -> None:
        super().__init__()
        self.ln1, self.ln2 = nn.LayerNorm(d_model), nn.LayerNorm(d_model)
        self.attn = Attention(d_model, n_heads)
        self.fc, self.proj = nn.Linear(d_model, d_ff), nn.Linear(d_ff, d_model)

    def forward(self, x: torch.Tensor, allowed: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln1(x), allowed)
        return x + self.proj(F.gelu(self.fc(self.ln2(x))))


def document_causal(doc_ids: torch.Tensor) -> torch.Tensor:
    """``(rows, s, s)``: query i may attend key j (same document, j <= i); a pad attends to itself."""
    s = doc_ids.shape[1]
    causal = torch.ones(s, s, dtype=torch.bool, device=doc_ids.device).tril_()
    same = (doc_ids[:, :, None] == doc_ids[:, None, :]) & (doc_ids[:, None, :] >= 0) & causal
    return same | torch.eye(s, dtype=torch.bool, device=doc_ids.device)


class OwnStage(nn.Module):
    """Stage ``stage`` of ``num_stages`` (the stage contract's ``StageModule``)."""

    def __init__(self, cfg: dynmb.ModelConfig, stage: int, num_stages: int, seed: int = 0) -> None:
        super().__init__()
        self.stage, self.num_stages = stage, num_stages
        self.is_first, self.is_last = stage == 0, stage == num_stages - 1
        if self.is_first:
            self.embed = nn.Embedding(cfg.vocab_size, cfg.d_model)
            self.pos = nn.Embedding(cfg.max_seq_len, cfg.d_model)
        self.blocks = nn.ModuleDict({str(i): Block(cfg.d_model, cfg.n_heads, cfg.d_ff)
                                     for i in cfg.stage_layers(num_stages)[stage]})
        if self.is_last:
            self.norm = nn.LayerNorm(cfg.d_model)
            self.head = nn.Linear(cfg.d_model, cfg.vocab_size, bias=False)
        _seeded_init(self, seed)

    def forward(self, x: torch.Tensor | None, inputs, *, reduction: str = "sum",
                recompute: bool = False) -> torch.Tensor:
        if self.is_first:
            x = self.embed(inputs.input_ids) + self.pos(inputs.position_ids)
        allowed = document_causal(inputs.doc_ids)
        for block in self.blocks.values():
            if recompute:
                x = torch.utils.checkpoint.checkpoint(block, x, allowed, use_reentrant=False)
            else:
                x = block(x, allowed)
        if not self.is_last:
            return x
        logits = self.head(self.norm(x)).float()
        real = inputs.loss_mask & (inputs.labels >= 0)
        ce = F.cross_entropy(logits.flatten(0, 1), inputs.labels.clamp(min=0).flatten(), reduction="none")
        ce = ce.view(real.shape) * real
        if reduction == "sum":
            return ce.sum()
        if reduction == "none":
            return ce
        raise ValueError(f"reduction must be 'sum' or 'none', got {reduction!r}")


class OwnDecoderFactory:
    """The ``StageFactory`` of ``OwnDecoder`` (``config``, ``attention_work``, ``build_stage``)."""

    attention_work = "masked"

    def __init__(self, config: dynmb.ModelConfig) -> None:
        self.config = config

    def build_stage(self, stage: int, num_stages: int, *, seed: int = 0, dtype: torch.dtype | None = None,
                    device: torch.device | str | None = None) -> OwnStage:
        module = OwnStage(self.config, stage, num_stages, seed)
        return module.to(device=device, dtype=dtype) if (device is not None or dtype is not None) else module


def small_decoder() -> OwnDecoderFactory:
    """The script's default: 4 layers, d_model 128 (``--model own_model:small_decoder``)."""
    return OwnDecoderFactory(dynmb.ModelConfig(name="own-small", vocab_size=4096, d_model=128, n_layers=4,
                                               n_heads=4, d_ff=512, max_seq_len=4096))


def tiny_decoder() -> OwnDecoderFactory:
    """Test-sized: 2 layers, d_model 32 (``--model own_model:tiny_decoder``)."""
    return OwnDecoderFactory(dynmb.ModelConfig(name="own-tiny", vocab_size=512, d_model=32, n_layers=2,
                                               n_heads=2, d_ff=64, max_seq_len=4096))


def _dynmb(argv: list[str], env: dict[str, str]) -> str:
    """One ``dynmb`` command (as ``python -m dynmb.cli``), printed, its output returned; raises on failure."""
    cmd = [sys.executable, "-m", "dynmb.cli", *argv]
    print("$ dynmb " + " ".join(argv), flush=True)    # noqa: T201 (a script's output)
    done = subprocess.run(cmd, capture_output=True, text=True, env=env)
    if done.returncode != 0:
        raise RuntimeError(f"dynmb {argv[0]} failed ({done.returncode}):\n{done.stdout}\n{done.stderr}")
    return done.stdout


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--factory", default="small", choices=["small", "tiny"], help="model size (default small)")
    parser.add_argument("--stages", type=int, default=2, help="pipeline stages = gloo ranks (default 2)")
    parser.add_argument("--memory-limit", default="64MiB", help="per-rank memory limit (default 64MiB)")
    parser.add_argument("--dataset", default="gsm8k", help="length trace (default gsm8k)")
    parser.add_argument("--global-batch", type=int, default=16, help="sequences per global batch (default 16)")
    parser.add_argument("--method", default="dynamic", help="packing method (default dynamic)")
    parser.add_argument("--repeats", type=int, default=3, help="profile repeats per point (default 3)")
    parser.add_argument("--max-len", type=int, default=None, help="largest profiled padded_len")
    parser.add_argument("--steps", type=int, default=1, help="measured steps of the verified run (default 1)")
    parser.add_argument("--out", required=True, help="results folder")
    args = parser.parse_args(argv)

    out = Path(args.out).resolve()
    out.mkdir(parents=True, exist_ok=True)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in (str(HERE), os.environ.get("PYTHONPATH")) if p)}
    model = ["--model", f"own_model:{args.factory}_decoder", "--stages", str(args.stages)]
    samples, cost, memory, plan = (str(out / n) for n in ("samples.csv", "cost.json", "memory.json", "plan.json"))
    max_len = ["--max-len", str(args.max_len)] if args.max_len else []
    _dynmb(["-q", "profile", *model, "--quick", "--repeats", str(args.repeats), "--warmup", "1", "--no-memory",
            *max_len, "-o", samples], env)
    _dynmb(["fit", samples, *model, "--folds", "3", "-o", cost], env)
    _dynmb(["memory", *model, "--quick", "-o", memory], env)
    summary = json.loads(_dynmb(["plan", *model, "--dataset", args.dataset, "--global-batch", str(args.global_batch),
                                 "--memory-limit", args.memory_limit, "--method", args.method,
                                 "--cost-model", cost, "--memory-model", memory, "--json", "-o", plan], env))
    print(f"plan: {summary['num_microbatches']} microbatches, predicted peak {summary['pred_peak_bytes']} bytes "
          f"of {summary['memory_limit_bytes']}", flush=True)
    _dynmb(["run", "--plan", plan, "--cost-model", cost, "--memory-model", memory, "--verify", "--steps",
            str(args.steps), "--warmup", "0", "--device", "cpu", "--out", str(out / "run")], env)
    mem = pd.read_csv(out / "run" / "memory.csv")
    worst = mem.loc[(mem["peak_bytes"] / mem["limit_bytes"]).idxmax()]
    print(f"run --verify: gradients equal the single-process reference; measured peak {int(worst.peak_bytes)} "
          f"bytes (stage {int(worst.stage)}) <= limit {int(worst.limit_bytes)} bytes "
          f"({worst.peak_bytes / worst.limit_bytes:.2f} of it)", flush=True)
    return 0 if bool((mem["peak_bytes"] <= mem["limit_bytes"]).all()) else 1


if __name__ == "__main__":
    sys.exit(main())
