"""Paired ratios of real 2x2 gloo runs (pp 2 x dp 2) of packed, lockstep and dynamic on the same global batches.

    OUT=studies/lockstep/results/real
    for m in packed lockstep dynamic packed:2 lockstep:2 dynamic:2 packed:3 lockstep:3 dynamic:3 packed:4; do
      meth=${m%%:*}
      dynmb run --nproc 4 --dp 2 --stages 2 --method $meth --dataset longtail --global-batch 64 \\
        $([ $meth = dynamic ] || echo --pack-len 1024) --oversize truncate --model llama-tiny:max_seq_len=1024 \\
        --memory-limit 2GiB --steps 8 --out $OUT/${m/:/_}
    done
    python studies/lockstep/real_runs.py $OUT

Every run draws the same global batches (same trace, seed and global batch; every method truncates documents at
1024 tokens, dynamic through the model's ``max_seq_len``). The runs go one after another in the order above
(A B C A B C ...), so drift of the shared box's load falls on both sides. Per measured step (step 0 warms up), each
run's ``step_s`` over each ``packed`` run's, and the same for the runtime's predictions ``pred_step_s`` (its cost
model is refit online from the run's own measurements, so it carries the load of the box as well); the medians
over every step of every pairing of a method's runs with the ``packed`` runs (a run never with itself), and over
the neighbour pairs only (each run with the ``packed`` run just before and just after it, by ``runs.csv``'s
``date``): on a box whose load drifts, the neighbours see the closest load.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pandas as pd


def main(argv: list[str] | None = None) -> int:
    root = Path((argv or sys.argv[1:])[0])
    runs = {d.name: pd.read_csv(d / "steps.csv").set_index("step") for d in sorted(root.iterdir())
            if (d / "steps.csv").is_file()}
    started = {name: pd.read_csv(root / name / "runs.csv")["date"].iloc[0] for name in runs}
    runs = {name: df[df.index > 0] for name, df in runs.items()}                 # step 0 warms up
    method = {name: name.split("_")[0] for name in runs}
    order = sorted(runs, key=started.__getitem__)
    rows = []
    for m in dict.fromkeys(method.values()):
        measured, predicted = [], []
        for name, df in runs.items():
            for base_name, base in runs.items():
                if method[name] != m or method[base_name] != "packed" or base_name == name:
                    continue
                both = df.index.intersection(base.index)
                measured.append(df.step_s[both] / base.step_s[both])
                predicted.append(df.pred_step_s[both] / base.pred_step_s[both])
        near = []
        for name in (n for n in order if method[n] == m and m != "packed"):
            k = order.index(name)
            before = [b for b in order[:k] if method[b] == "packed"][-1:]
            after = [b for b in order[k + 1:] if method[b] == "packed"][:1]
            for base_name in before + after:
                both = runs[name].index.intersection(runs[base_name].index)
                near.append(runs[name].step_s[both] / runs[base_name].step_s[both])
        mine = pd.concat([df for name, df in runs.items() if method[name] == m])
        rows.append({"method": m, "runs": sum(1 for x in method.values() if x == m), "pairs": len(measured),
                     "median step_s": mine.step_s.median(),
                     "step_s / packed": pd.concat(measured).median() if measured else float("nan"),
                     "pred_step_s / packed": pd.concat(predicted).median() if predicted else float("nan"),
                     "neighbour pairs": len(near),
                     "step_s / packed (neighbours)": pd.concat(near).median() if near else float("nan")})
    print("runs in time order: " + ", ".join(order))
    print(pd.DataFrame(rows).to_string(index=False, float_format=lambda v: f"{v:.3f}"))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
