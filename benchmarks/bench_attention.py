"""Attention as trainers run it: packed rows (bucketed document attention) vs one document per row vs the dense mask.

Run::

    python benchmarks/bench_attention.py [--model small] [--repeats 7] [--threads 1] [--stages 2] [--alternatives]

Method. Forward + backward of one microbatch through stage 0 of a ``--stages`` split
and through the whole model (``GPT``), same weights, ``torch.set_num_threads(threads)``.
After one warm-up round the cases take turns ``repeats`` times (so that a change in the
machine's load hits them alike) and the median is kept; tokens/s = real tokens / median s. Cases (``dynmb.models``, ``cfg.attention``):

- ``packed``: one row of 4096 tokens holding 64 documents of 64 (``auto``: bucketed
  document-causal attention, work 64 * 64**2);
- ``sorted``: 64 rows of 64 tokens, one document each (``auto``: causal SDPA, no mask);
- ``packed-dense``: the packed row with ``dense`` (the (s, s) mask, work 4096**2);
- ``L=1024 k=4`` and ``L=8192 k=16``: one packed row of k equal documents, ``auto`` vs ``dense``.

The issue's target: ``packed`` >= 0.6x the tokens/s of ``sorted`` with the ``small``
preset (``dense`` reaches about a third). ``--alternatives`` also times, on the packed
cases, a per-document loop (one SDPA call per document, written here only for the
comparison) in place of the bucketed path. Prints a table and the ratios.
"""

from __future__ import annotations

import argparse
import statistics
import time
import types
from dataclasses import dataclass, replace
from typing import Callable

import numpy as np
import torch

from dynmb.core.config import ModelConfig
from dynmb.models import GPT, MicrobatchInputs, build_stage, full_microbatch, make_inputs, synthetic_tokens
from dynmb.models.gpt2 import Attention
from dynmb.core.types import Microbatch

__all__ = ["main"]


@dataclass(frozen=True)
class Case:
    name: str
    mb: Microbatch
    attention: str
    impl: str = "bucketed"


def _cases(alternatives: bool) -> list[Case]:
    sorted_mb = Microbatch(seq_ids=np.arange(64), lengths=np.full(64, 64), padded_len=64, batch=64)
    out = [Case("packed", full_microbatch(1, 4096, 64), "auto"), Case("sorted", sorted_mb, "auto"),
           Case("packed-dense", full_microbatch(1, 4096, 64), "dense")]
    for length, docs in ((1024, 4), (8192, 16)):
        mb = full_microbatch(1, length, docs)
        out += [Case(f"L={length} k={docs}", mb, "auto"), Case(f"L={length} k={docs} dense", mb, "dense")]
    if alternatives:
        out += [Case(f"{c.name} per-doc", c.mb, "auto", "per-document") for c in out
                if c.attention == "auto" and c.mb.is_packed]
    return out


def _per_document(attn: Attention, x: torch.Tensor, inputs: MicrobatchInputs, pos: object = None) -> torch.Tensor:
    """The alternative: one SDPA call per document, pieces concatenated in row order (GPT-2: no rotary ``pos``)."""
    b, s, d = x.shape
    doc = inputs.doc_ids.numpy()
    pieces = []
    for r in range(b):
        cuts = np.flatnonzero(np.diff(doc[r], prepend=-2, append=-2))   # segment boundaries in row r
        for a, e in zip(cuts[:-1], cuts[1:]):
            if doc[r, a] < 0:
                pieces.append(x.new_zeros(e - a, d))
            else:
                pieces.append(attn.output(attn._attend(x[r:r + 1, a:e], None, None).reshape(e - a, -1)))
    return torch.cat(pieces).view(b, s, d)


def _use_impl(impl: str, *modules: torch.nn.Module) -> None:
    """``per-document``: these modules' attention layers (these instances only) run ``_per_document``."""
    if impl == "bucketed":
        return
    for m in (a for mod in modules for a in mod.modules() if isinstance(a, Attention)):
        m.forward = types.MethodType(_per_document, m)  # type: ignore[method-assign]


def _steps(case: Case, base: ModelConfig, num_stages: int) -> dict[str, Callable[[], None]]:
    """Forward + backward of ``case`` through stage 0 and through the whole model."""
    cfg = replace(base, attention=case.attention)
    inputs = make_inputs(case.mb, synthetic_tokens(case.mb.lengths, cfg.vocab_size), cfg=cfg)
    stage, model = build_stage(cfg, 0, num_stages), GPT(cfg)
    _use_impl(case.impl, stage, model)
    grad = torch.randn(case.mb.batch, case.mb.padded_len, cfg.d_model) * 1e-3

    def stage_step() -> None:
        stage(None, inputs).backward(grad)

    def model_step() -> None:
        model(inputs).backward()

    return {"stage0": stage_step, "model": model_step}


def _measure(cases: list[Case], base: ModelConfig, num_stages: int, repeats: int) -> dict[str, dict[str, float]]:
    """Median seconds and tokens/s per case and part; the cases take turns in every
    repeat so that a change in machine load hits them alike."""
    steps = {c.name: _steps(c, base, num_stages) for c in cases}
    times: dict[tuple[str, str], list[float]] = {(n, part): [] for n, parts in steps.items() for part in parts}
    for rep in range(repeats + 1):                  # repeat 0 is the warm-up
        for (name, part), ts in times.items():
            t0 = time.perf_counter()
            steps[name][part]()
            if rep:
                ts.append(time.perf_counter() - t0)
    out = {}
    for c in cases:
        r = {f"{part}_s": statistics.median(times[c.name, part]) for part in ("stage0", "model")}
        out[c.name] = {**r, **{f"{part}_tok_s": c.mb.real_tokens / r[f"{part}_s"] for part in ("stage0", "model")}}
    return out


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="small", help="ModelConfig preset")
    p.add_argument("--repeats", type=int, default=7, help="timed repeats per case (median kept)")
    p.add_argument("--threads", type=int, default=1, help="torch.set_num_threads")
    p.add_argument("--stages", type=int, default=2, help="pipeline split whose stage 0 is timed")
    p.add_argument("--alternatives", action="store_true", help="also time a per-document SDPA loop")
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    base = ModelConfig.preset(args.model)
    res = _measure(_cases(args.alternatives), base, args.stages, args.repeats)
    print(f"model={args.model} threads={args.threads} stage 0 of {args.stages}, median of {args.repeats}, "
          f"torch {torch.__version__}")
    print(f"{'case':24s} {'stage0 s':>9s} {'stage0 tok/s':>13s} {'model s':>9s} {'model tok/s':>12s}")
    for name, r in res.items():
        print(f"{name:24s} {r['stage0_s']:9.4f} {r['stage0_tok_s']:13.0f} {r['model_s']:9.4f} {r['model_tok_s']:12.0f}")
    ratios = [("packed / sorted", "packed", "sorted"), ("packed-dense / sorted", "packed-dense", "sorted"),
              ("L=1024 k=4: auto / dense", "L=1024 k=4", "L=1024 k=4 dense"),
              ("L=8192 k=16: auto / dense", "L=8192 k=16", "L=8192 k=16 dense")]
    ratios += [(f"{n}: per-doc / bucketed", n, n.removesuffix(" per-doc")) for n in res if n.endswith(" per-doc")]
    print("tokens/s ratios (stage 0, whole model):")
    for label, a, b in ratios:
        print(f"  {label:34s} {res[a]['stage0_tok_s'] / res[b]['stage0_tok_s']:6.2f}x "
              f"{res[a]['model_tok_s'] / res[b]['model_tok_s']:6.2f}x")


if __name__ == "__main__":
    main()
