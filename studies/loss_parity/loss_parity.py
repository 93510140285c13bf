"""Loss parity: fixed, packed and dynamic microbatches train one model to the same losses on real text.

One model (``--model``; default ``llama-small`` when this dynmb has it, else ``small``, its
vocabulary widened to the GPT-2 tokenizer's 50,257 ids) from one seed is trained for ``--steps``
optimizer steps (50) on 2 gloo ranks (2 pipeline stages), once per method, on the same global
batches of real text: ``dynmb.run(configs, corpus=...)`` tokenizes the corpus once and every run
draws batch k from the same records. A method only regroups the batch's documents into
microbatches (fixed rows of ``--mbs``, packed rows of ``--pack-len`` tokens, the dynamic
planner's shapes); the ``steps`` table's ``loss`` is the batch's token-weighted loss (sum of
cross-entropy over its real tokens / their count, summed over the pipeline's last stages), so the
curves may differ only by float32 rounding, carried forward by Adam. The script prints the largest
relative difference between methods at any step, ``(max - min) / min`` over the methods' losses
of that step, and exits 1 when it is over ``--tolerance`` (1e-3).

Measured on the default settings (``small:vocab_size=50257``, 8 AlpacaEval outputs per batch,
fixed at 4 microbatches of 2 rows, packed at 1-2 rows of 512 tokens, dynamic at 1-7
microbatches, a 2-core CPU shared with other jobs): the largest spread over 50 steps was
2.3e-7 at the default ``--lr 3e-4`` (float32 rounding, no growth over the steps), and 6.8e-4 at
``--lr 1e-3``, where the spread stays ~1e-7 for 24 steps and then grows to 1e-5-1e-4 with one
step at 6.8e-4 (under 1e-3, with little margin). Our reading, not checked further: Adam's
normalised update can turn a rounding-sized difference in a near-zero gradient into a full-size
step, so at the larger rate the runs drift apart slowly. 50 steps x 3 methods took
10-11 minutes of wall time there (mostly the 50k-wide LM head on one CPU thread per rank).

Corpus: ``--corpus FILE --field F [--tokenizer T]`` as given, or by default the outputs of
AlpacaEval (``alpaca_eval/text_davinci_003.model_outputs.json``, field ``output``) from
``../shared/datasets`` beside the repository (or ``$DYNMB_SHARED``), each record cut to
``--max-chars`` characters and the empty ones left out, so that 50 steps stay short on a CPU; that
cut corpus is written to ``OUT/corpus.jsonl`` and is what the runs read.

Writes ``OUT/loss_parity.csv`` (tidy: one row per method and step: loss, real tokens, microbatches,
step seconds, the step's relative spread), ``OUT/loss_parity.png`` (the loss curves and the spread
per step) and the runs' own tables. Only ``import dynmb`` names are used.

    python -m studies.loss_parity.loss_parity --out results/loss_parity
    python -m studies.loss_parity.loss_parity --corpus data.jsonl --field text --model small:vocab_size=50257 --out res
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

import pandas as pd

import dynmb

METHODS = ("fixed", "packed", "dynamic")
GPT2_VOCAB = 50257
DEFAULT_CORPUS = ("alpaca_eval", "text_davinci_003.model_outputs.json", "output")


def shared_datasets() -> Path | None:
    """``$DYNMB_SHARED`` (or its ``datasets``), else ``../shared/datasets`` beside the repository."""
    env = os.environ.get("DYNMB_SHARED")
    here = Path(__file__).resolve().parents[1]
    for c in ([Path(env), Path(env) / "datasets"] if env else []) + [here.parent / "shared" / "datasets",
                                                                      here.parents[1] / "shared" / "datasets"]:
        if (c / DEFAULT_CORPUS[0]).is_dir():
            return c
    return None


def cut_corpus(src: Path, field: str, max_chars: int, dst: Path) -> int:
    """Write the non-empty ``field`` texts of a .json list / .jsonl corpus, each cut to ``max_chars``
    characters, as ``dst`` (.jsonl, field ``text``); returns the number of records."""
    text = src.read_text(encoding="utf-8")
    records = json.loads(text) if src.suffix == ".json" else [json.loads(ln) for ln in text.splitlines() if ln.strip()]
    kept = [r[field][:max_chars] for r in records if str(r.get(field, "")).strip()]
    kept = [t for t in kept if t.strip()]
    dst.parent.mkdir(parents=True, exist_ok=True)
    dst.write_text("".join(json.dumps({"text": t}) + "\n" for t in kept), encoding="utf-8")
    return len(kept)


def default_model(tokenizer: str) -> tuple[str, str]:
    """``(model spec, note)``: llama-small if dynmb has it, else small; widened to GPT-2's ids."""
    try:
        base, note = "llama-small", ""
        cfg = dynmb.model_config(base)
    except ValueError:
        base, note = "small", "llama-small is not in this dynmb yet: using small (GPT-2 blocks)"
        cfg = dynmb.model_config(base)
    if tokenizer == "gpt2" and cfg.vocab_size < GPT2_VOCAB:
        return f"{base}:vocab_size={GPT2_VOCAB}", note
    return base, note


def parity_table(steps: pd.DataFrame) -> tuple[pd.DataFrame, float, int]:
    """One row per method and step, with the step's relative spread ``(max - min) / min`` of the
    methods' losses; the largest spread and its step."""
    keep = ["label", "step", "loss", "real_tokens", "num_microbatches", "step_s"]
    rows = steps[keep].rename(columns={"label": "method"}).sort_values(["step", "method"]).reset_index(drop=True)
    per_step = rows.groupby("step")["loss"].agg(lambda x: (x.max() - x.min()) / x.min())
    rows["rel_spread"] = rows["step"].map(per_step)
    worst = int(per_step.idxmax())
    return rows, float(per_step.max()), worst


def plot(rows: pd.DataFrame, tolerance: float, path: Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (top, bottom) = plt.subplots(2, 1, figsize=(7, 6), sharex=True, height_ratios=[2, 1])
    styles = {"fixed": ("-", 3.5), "packed": ("--", 2.2), "dynamic": (":", 1.6)}
    for method, g in rows.groupby("method"):
        ls, lw = styles.get(method, ("-", 1.0))
        top.plot(g["step"], g["loss"], ls, lw=lw, label=method)
    top.set_ylabel("loss (token-weighted)")
    top.set_title(title, fontsize=9)
    top.legend()
    spread = rows.drop_duplicates("step")
    bottom.semilogy(spread["step"], spread["rel_spread"].clip(lower=1e-9), "k.-", lw=1)
    bottom.axhline(tolerance, color="r", ls="--", lw=1, label=f"tolerance {tolerance:g}")
    bottom.set_xlabel("optimizer step")
    bottom.set_ylabel("(max - min) / min\n(0 drawn at 1e-9)")
    bottom.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--corpus", default=None,
                    help="corpus file (.jsonl/.json/.txt); default: AlpacaEval outputs from ../shared/datasets, cut")
    ap.add_argument("--field", action="append", default=None, help="record field(s) with --corpus (default text)")
    ap.add_argument("--tokenizer", default="gpt2", help="gpt2 (default), a tokenizer.json path or HF name")
    ap.add_argument("--max-chars", type=int, default=400,
                    help="default corpus: cut every record to this many characters (default 400)")
    ap.add_argument("--model", default=None,
                    help="model spec (default llama-small if present, else small; widened to the gpt2 vocabulary)")
    ap.add_argument("--methods", default=",".join(METHODS), help="comma-separated methods (default fixed,packed,dynamic)")
    ap.add_argument("--steps", type=int, default=50, help="optimizer steps per method (default 50)")
    ap.add_argument("--global-batch", type=int, default=8, help="documents per global batch (default 8)")
    ap.add_argument("--mbs", type=int, default=2, help="rows per microbatch of fixed (default 2)")
    ap.add_argument("--pack-len", type=int, default=512, help="row length of packed (default 512)")
    ap.add_argument("--memory-limit", default="1GiB", help="per-rank memory limit (default 1GiB)")
    ap.add_argument("--seed", type=int, default=0, help="model init and batch sampling seed (default 0)")
    ap.add_argument("--lr", type=float, default=3e-4, help="Adam learning rate (default 3e-4; see the docstring)")
    ap.add_argument("--tolerance", type=float, default=1e-3, help="largest allowed relative spread (default 1e-3)")
    ap.add_argument("--out", default="results/loss_parity", help="results folder (default results/loss_parity)")
    args = ap.parse_args(argv)
    out = Path(args.out)

    if args.corpus is None:
        shared = shared_datasets()
        if shared is None:
            print("loss_parity: no ../shared/datasets (set DYNMB_SHARED) and no --corpus given", file=sys.stderr)
            return 2
        folder, name, field = DEFAULT_CORPUS
        n = cut_corpus(shared / folder / name, field, args.max_chars, out / "corpus.jsonl")
        corpus, fields = out / "corpus.jsonl", ["text"]
        print(f"corpus: {shared / folder / name} field {field!r}, {n} records cut to {args.max_chars} characters "
              f"-> {corpus}")
    else:
        corpus, fields = Path(args.corpus), args.field or ["text"]
    model, note = (args.model, "") if args.model else default_model(args.tokenizer)
    if note:
        print(f"model: {note}")
    methods = [m.strip() for m in args.methods.split(",") if m.strip()]
    cfgs = [dynmb.RunConfig(model=dynmb.model_config(model),
                            pipeline=dynmb.PipelineConfig(num_stages=2, memory_limit_bytes=_bytes(args.memory_limit)),
                            global_batch=args.global_batch, method=m, mbs=args.mbs if m == "fixed" else None,
                            pack_len=args.pack_len if m == "packed" else None, seed=args.seed, steps=args.steps,
                            warmup=0, lr=args.lr, backend="gloo", device="cpu", timeout_s=300.0) for m in methods]
    source = dynmb.CorpusSource.create(corpus, fields, args.tokenizer)
    print(f"training {model} on {source.name} ({args.tokenizer}): {', '.join(methods)} x {args.steps} steps, "
          f"global batch {args.global_batch}, 2 gloo ranks", flush=True)
    t0 = time.perf_counter()
    try:
        result = dynmb.run(cfgs, out=out, corpus=source, labels=methods, output="progress")
    except (ValueError, OSError) as e:
        print(f"loss_parity: error: {e}", file=sys.stderr)
        return 2
    wall_s = time.perf_counter() - t0
    if not result.ok:
        print("loss_parity: the runs failed: " + "; ".join(result.failures), file=sys.stderr)
        return result.returncode or 1
    rows, worst, at = parity_table(result.tables["steps"])
    rows.insert(0, "model", model)
    rows.to_csv(out / "loss_parity.csv", index=False)
    title = f"{model}, {source.name.split('/')[-1]}, {args.steps} steps, batch {args.global_batch}, seed {args.seed}"
    plot(rows, args.tolerance, out / "loss_parity.png", title)
    step_s = rows.groupby("method")["step_s"].sum()
    print(f"{len(methods)} x {args.steps} steps in {wall_s:.0f} s wall ({', '.join(f'{m} {s:.1f} s' for m, s in step_s.items())}"
          f" of steps); loss {rows['loss'].iloc[0]:.4f} -> {rows['loss'].iloc[-1]:.4f}")
    print(f"largest relative difference between methods: {worst:.2e} at step {at} (tolerance {args.tolerance:g}); "
          f"{out / 'loss_parity.csv'}, {out / 'loss_parity.png'}")
    return 0 if worst <= args.tolerance else 1


def _bytes(text: str) -> int:
    units = {"KiB": 2**10, "MiB": 2**20, "GiB": 2**30}
    for unit, scale in units.items():
        if text.endswith(unit):
            return int(float(text[:-len(unit)]) * scale)
    return int(text)


if __name__ == "__main__":
    sys.exit(main())
