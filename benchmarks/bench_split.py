"""The split backward (I, W) and full recomputation against the full backward B, per stage role.

Run::

    python benchmarks/bench_split.py [--model small] [--repeats 5] [--stages 2 4] [--out results/bench_split.csv]

Method. For every stage of a ``--stages`` split and every shape of ``SHAPES`` (rows x
padded_len / documents per row), ``torch.set_num_threads(1)``, thread time: each repeat runs,
on fresh graphs of the same microbatch, (1) F then B, (2) F with the Linear calls recorded,
then I and W (``dynmb.runtime.splitbackward``), (3) F with recomputation then its B
(``GPTStage(..., recompute=True)``); the cases take turns and the median of ``--repeats``
(after one warm-up) is kept. Reported per stage role (first / middle / last; see
``dynmb.costmodel.split``), medians over the shapes:

- ``W_SHARE`` = W / B_tok, where B_tok is B without its attention term: the per-token and
  fixed part of a poly fit ``B = c0 + c1 b s + c2 a`` over the role's shapes;
- ``SPLIT_OVERHEAD`` = (I + W) / B - 1;
- ``RECOMPUTE_F_SHARE`` = (B_recompute - B) / F.

These are the constants ``dynmb.costmodel.split`` derives I, W and the recompute cost from when a
cost model was fitted without ``I``/``W`` samples.
"""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path

import numpy as np
import pandas as pd
import torch

from dynmb.core.config import model_config
from dynmb.models import build_stages, make_inputs, synthetic_tokens
from dynmb.measure import synthetic_microbatch
from dynmb.runtime.splitbackward import backward_input, backward_weight, record_linears
from dynmb.costmodel.split import stage_role

__all__ = ["main", "measure"]

SHAPES = ((1, 512, 1), (4, 256, 1), (8, 128, 1), (16, 64, 1), (2, 1024, 1), (1, 2048, 1), (1, 1024, 16), (4, 512, 1))


def _timed(fn) -> float:
    t = time.thread_time()
    fn()
    return time.thread_time() - t


def measure(model: str = "small", stages: tuple[int, ...] = (2, 4), repeats: int = 5) -> pd.DataFrame:
    """One row per (num_stages, stage, shape): median F, B, I, W, B_recompute seconds."""
    torch.set_num_threads(1)
    cfg = model_config(model)
    rows = []
    for P in stages:
        mods = build_stages(cfg, P, 0)
        for b, s, d in SHAPES:
            mb = synthetic_microbatch(b, s, d, 0)
            inp = make_inputs(mb, synthetic_tokens(mb.lengths, cfg.vocab_size), cfg=cfg)
            for st in mods:
                x0 = None if st.is_first else torch.randn(b, s, cfg.d_model)
                g = None if st.is_last else torch.randn(b, s, cfg.d_model) * 1e-3
                fresh = lambda: None if x0 is None else x0.clone().requires_grad_(True)  # noqa: E731
                t = {k: [] for k in ("F", "B", "I", "W", "Brc")}
                for rep in range(repeats + 1):
                    x = fresh()
                    out = {}
                    t_f = _timed(lambda: out.setdefault("y", st(x, inp)))
                    t_b = _timed(lambda: torch.autograd.backward(out.pop("y"), g))
                    x = fresh()
                    with record_linears(st) as tape:
                        y = st(x, inp)
                    t_i = _timed(lambda: backward_input(st, y, g, x, tape))
                    t_w = _timed(lambda: backward_weight(tape))
                    y = None          # frees the graph (a del would leave the lambdas a deleted name)
                    x = fresh()
                    y = st(x, inp, recompute=True)
                    t_rc = _timed(lambda: torch.autograd.backward(y, g))
                    y = None          # frees the graph (a del would leave the lambdas a deleted name)
                    if rep:
                        for k, v in zip(t, (t_f, t_b, t_i, t_w, t_rc)):
                            t[k].append(v)
                st.zero_grad(set_to_none=True)
                rows.append({"num_stages": P, "stage": st.stage, "role": stage_role(st.stage, P), "rows": b,
                             "padded_len": s, "docs_per_row": d, "attn_work": mb.attention_work(cfg.attention),
                             **{k: statistics.median(v) for k, v in t.items()}})
    return pd.DataFrame(rows)


def summarise(df: pd.DataFrame) -> pd.DataFrame:
    """Per role: W_SHARE, SPLIT_OVERHEAD, RECOMPUTE_F_SHARE (module doc)."""
    out = []
    for role, g in df.groupby("role"):
        bs, a, B = (g["rows"] * g["padded_len"]).to_numpy(float), g["attn_work"].to_numpy(float), g["B"].to_numpy()
        x = np.stack([np.ones_like(bs), bs, a], 1) / B[:, None]
        coef, *_ = np.linalg.lstsq(x, np.ones(len(B)), rcond=None)
        b_tok = coef[0] + coef[1] * bs
        out.append({"role": role, "W_SHARE": float(np.median(g["W"] / b_tok)),
                    "SPLIT_OVERHEAD": float(np.median((g["I"] + g["W"]) / g["B"] - 1)),
                    "RECOMPUTE_F_SHARE": float(np.median((g["Brc"] - g["B"]) / g["F"])), "n": len(g)})
    return pd.DataFrame(out)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="small", help="model preset (default small)")
    ap.add_argument("--stages", type=int, nargs="+", default=[2, 4], help="pipeline splits to measure (default 2 4)")
    ap.add_argument("--repeats", type=int, default=5, help="timed repeats per case (default 5)")
    ap.add_argument("--out", default=None, help="also write the per-shape table here (CSV)")
    args = ap.parse_args(argv)
    df = measure(args.model, tuple(args.stages), args.repeats)
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        df.to_csv(args.out, index=False)
    pd.set_option("display.width", 160)
    print(df.assign(**{"(I+W)/B": (df.I + df.W) / df.B, "W/B": df.W / df.B}).to_string(index=False, float_format=lambda v: f"{v:.4g}"))
    print(summarise(df).to_string(index=False, float_format=lambda v: f"{v:.3f}"))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
