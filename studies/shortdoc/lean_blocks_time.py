"""Are the lean Llama blocks free in time on CPU? One block's forward + backward, lean against unfused, paired.

The lean blocks (``dynmb.models.llama``: ``LeanRMSNorm``, ``SwiGLUProduct``, ``v`` copied out of the fused
q/k/v output) against the unfused forms they replaced, which autograd composes from torch's ops (``F.rms_norm``,
``F.silu(gate) * up``, ``v`` a view of the q/k/v output). Each round times one forward + backward of a
``LlamaBlock`` (one row of ``--tokens`` tokens, causal attention) in each form, the two in alternating order; the
result is the median over rounds of lean / unfused and the two medians. One thread unless ``--threads``.

    PYTHONPATH=$PWD nice -n 10 python3 -m studies.shortdoc.lean_blocks_time --preset llama-small --rounds 41
"""

from __future__ import annotations

import argparse
import statistics
import time
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Callable, Iterator

import torch
import torch.nn.functional as F

from dynmb.core.config import ModelConfig
from dynmb.models import full_microbatch, make_inputs, synthetic_tokens
from dynmb.models.llama import NORM_EPS, LlamaAttention, LlamaBlock, RMSNorm, SwiGLU, position_tables


def _unfused_norm(self: RMSNorm, x: torch.Tensor) -> torch.Tensor:
    return F.rms_norm(x, (x.shape[-1],), self.weight, NORM_EPS)


def _unfused_mlp(self: SwiGLU, x: torch.Tensor) -> torch.Tensor:
    gate, up = self.gate_up(x).chunk(2, dim=-1)
    return self.down(F.silu(gate) * up)


def _unfused_project(self: LlamaAttention, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    q, k, v = self.qkv(x).split(self._sizes, dim=-1)
    lead = x.shape[:-1]
    return (q.view(*lead, self.n_heads, self.head_dim), k.view(*lead, self.n_kv_heads, self.head_dim),
            v.view(*lead, self.n_kv_heads, self.head_dim))


@contextmanager
def unfused() -> Iterator[None]:
    """The blocks as they were before the lean forms (module docstring)."""
    saved = (RMSNorm.forward, SwiGLU.forward, LlamaAttention.project)
    RMSNorm.forward, SwiGLU.forward, LlamaAttention.project = (  # type: ignore[method-assign]
        _unfused_norm, _unfused_mlp, _unfused_project)
    try:
        yield
    finally:
        RMSNorm.forward, SwiGLU.forward, LlamaAttention.project = saved  # type: ignore[method-assign]


@dataclass(frozen=True)
class BlockTiming:
    """Medians over rounds: seconds of the lean and the unfused block, and of their per-round ratio."""

    lean_s: float
    unfused_s: float
    ratio: float


def time_block(preset: str, tokens: int, rounds: int) -> BlockTiming:
    """Paired, interleaved timing of one block's forward + backward (module docstring)."""
    cfg = ModelConfig.preset(preset)
    block = LlamaBlock(cfg, 0)
    mb = full_microbatch(1, tokens)
    inputs = make_inputs(mb, synthetic_tokens(mb.lengths, cfg.vocab_size), cfg=cfg)
    pos = position_tables(inputs, cfg, torch.float32)
    x = torch.randn(1, tokens, cfg.d_model, requires_grad=True)
    grad = torch.randn(1, tokens, cfg.d_model)

    def once() -> float:
        t0 = time.perf_counter()
        block(x, inputs, pos).backward(grad)
        return time.perf_counter() - t0

    def lean_then_unfused(lean_first: bool) -> tuple[float, float]:
        forms: list[Callable[[], float]] = [once, lambda: _in_unfused(once)]
        got = [f() for f in (forms if lean_first else forms[::-1])]
        return (got[0], got[1]) if lean_first else (got[1], got[0])

    for _ in range(3):                                   # warm both forms
        lean_then_unfused(True)
    pairs = [lean_then_unfused(r % 2 == 0) for r in range(rounds)]
    return BlockTiming(lean_s=statistics.median(a for a, _ in pairs), unfused_s=statistics.median(b for _, b in pairs),
                       ratio=statistics.median(a / b for a, b in pairs))


def _in_unfused(fn: Callable[[], float]) -> float:
    with unfused():
        return fn()


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--preset", default="llama-small")
    ap.add_argument("--tokens", type=int, default=512)
    ap.add_argument("--rounds", type=int, default=41)
    ap.add_argument("--threads", type=int, default=1)
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    t = time_block(args.preset, args.tokens, args.rounds)
    print(f"{args.preset} {args.tokens} tokens, {args.rounds} rounds, {args.threads} thread(s): lean {t.lean_s * 1e3:.2f} ms, "
          f"unfused {t.unfused_s * 1e3:.2f} ms, lean/unfused median {t.ratio:.3f}")


if __name__ == "__main__":
    main()
