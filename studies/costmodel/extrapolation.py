"""Cost-model extrapolation: fit on short rows, predict long ones; poly vs grid side by side.

Algorithm: read a samples CSV (``dynmb profile``), fit the poly (``FittedCostModel``) and
grid (``GridCostModel``) models on the samples with ``padded_len <= --fit-max-len`` only,
then predict every measured point with padded_len in ``--eval-lens`` (one document per row
and packed rows, each with its attention work ``attn_work``) and compare with its median
over repeats. Prints one row per (stage, op, padded_len, packed) with the mean and max
absolute percentage error of each model and the points' noise floor (median |t_r - median|
/ median), then the per-point table with ``--points``. The grid model sees shapes only; its
packed predictions carry its linear attention-work correction (``dynmb.costmodel.grid``).

    dynmb profile --model small --stages 2 --concurrent -o samples.csv   # the full grid (~15 min)
    python -m studies.costmodel.extrapolation samples.csv \
        --model small --stages 2 --fit-max-len 512 --eval-lens 1024 2048
"""

from __future__ import annotations

import argparse
import sys

import numpy as np
import pandas as pd

from dynmb import ModelConfig
from dynmb.costmodel import fit_cost_model, point_medians, with_attention_work
from dynmb.measure import load_samples


def extrapolation_table(samples: pd.DataFrame, cfg: ModelConfig, num_stages: int, fit_max_len: int,
                        eval_lens: list[int]) -> tuple[pd.DataFrame, pd.DataFrame]:
    """(summary per stage/op/padded_len/packed, per-point table) of poly and grid errors."""
    fb = with_attention_work(samples)
    train = pd.concat([fb[fb["padded_len"] <= fit_max_len], samples[samples["op"] == "comm"]])
    models = {k: fit_cost_model(train, cfg, num_stages, kind=k) for k in ("poly", "grid")}
    test = fb[fb["padded_len"].isin(eval_lens)]
    if test.empty:
        raise SystemExit(f"no measured points at padded_len {eval_lens}; profile them first")
    med = point_medians(test)
    key = ["stage", "op", "rows", "padded_len", "attn_work"]
    dev = test.merge(med[key + ["time_s"]].rename(columns={"time_s": "med"}), on=key)
    dev["dev"] = (dev["time_s"] - dev["med"]).abs() / dev["med"]
    group = ["stage", "op", "padded_len", "packed"]
    noise = dev.groupby(group)["dev"].median().rename("noise")
    for k, m in models.items():
        med[f"{k}_pred_s"] = [float(m.predict(int(r.stage), r.op, r.rows, r.padded_len, r.attn_work))
                              for r in med.itertuples()]
        med[f"{k}_ape"] = np.abs(med[f"{k}_pred_s"] - med["time_s"]) / med["time_s"]
    summ = med.groupby(group).agg(
        n=("time_s", "size"), poly_mape=("poly_ape", "mean"), poly_max=("poly_ape", "max"),
        grid_mape=("grid_ape", "mean"), grid_max=("grid_ape", "max")).join(noise).reset_index()
    return summ, med


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("samples", nargs="+", help="samples CSV(s) from `dynmb profile`")
    ap.add_argument("--model", default="small", help="model preset the samples were measured for (default small)")
    ap.add_argument("--stages", type=int, default=2, help="pipeline stages of the samples (default 2)")
    ap.add_argument("--fit-max-len", type=int, default=512, help="fit only on padded_len <= this (default 512)")
    ap.add_argument("--eval-lens", type=int, nargs="+", default=[1024, 2048], help="padded_len values to predict (default 1024 2048)")
    ap.add_argument("--points", action="store_true", help="also print every evaluated point")
    ap.add_argument("--csv", default=None, help="write the per-point table here")
    args = ap.parse_args(argv)
    summ, pts = extrapolation_table(load_samples(args.samples), ModelConfig.preset(args.model), args.stages,
                                    args.fit_max_len, args.eval_lens)
    pct = lambda x: f"{100 * x:.1f}%"  # noqa: E731
    print(f"fit on padded_len <= {args.fit_max_len}; error on measured points at padded_len {args.eval_lens} "
          f"(vs median of repeats)")
    print(summ.to_string(index=False, formatters={c: pct for c in summ.columns if c.endswith(("mape", "max", "noise"))}))
    print(f"overall: poly MAPE {pct(pts['poly_ape'].mean())} (max {pct(pts['poly_ape'].max())}), "
          f"grid MAPE {pct(pts['grid_ape'].mean())} (max {pct(pts['grid_ape'].max())}) over {len(pts)} (stage, op, point)s")
    if args.points:
        print(pts.to_string(index=False, float_format=lambda x: f"{x:.4g}"))
    if args.csv:
        pts.to_csv(args.csv, index=False)
    return 0


if __name__ == "__main__":
    sys.exit(main())
