"""``dynmb lengths CORPUS... --field F -o trace.csv``: a length trace (token counts) from corpora."""

from __future__ import annotations

import argparse

from dynmb.data import build_trace, save_trace, trace_stats

__all__ = ["add_parser", "run"]


def add_parser(subparsers: argparse._SubParsersAction, help_text: str) -> None:
    parser = subparsers.add_parser("lengths", help=help_text)
    parser.add_argument("corpus", nargs="+",
                        help="path(s) to .jsonl, .json (a list of records), .txt (or .gz of them) corpora; several "
                             "are read in order into one trace")
    parser.add_argument("--field", action="append", default=None,
                        help="record field(s) to tokenize and concatenate; dotted paths like conversations.0.value; "
                             "repeat for several (txt: ignored)")
    parser.add_argument("--tokenizer", default="gpt2",
                        help="gpt2 (offline BPE), a Hugging Face tokenizer name or tokenizer.json path (default gpt2)")
    parser.add_argument("--txt-split", default="line", choices=["line", "article", "blank"],
                        help="txt corpora: one record per line, per top-level `= Title =` article, or per "
                             "blank-line paragraph")
    parser.add_argument("--join", default="\n",
                        help="separator between the --field values of a record (default newline; '' concatenates)")
    parser.add_argument("--normalize", default="none", choices=["none", "space", "wikitext"],
                        help="text clean-up before tokenizing: none (default), space (collapse whitespace), "
                             "wikitext (also undo ' @-@ ', ' @,@ ', ' @.@ ')")
    parser.add_argument("--skip-empty", action="store_true",
                        help="skip (and report) records of 0 tokens instead of failing")
    parser.add_argument("--no-progress", action="store_true", help="no progress bar on stderr")
    parser.add_argument("-o", "--output", required=True, help="output CSV path")
    parser.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    lengths = build_trace(args.corpus, args.field, args.tokenizer, join=args.join, txt_split=args.txt_split,
                          normalize=args.normalize, skip_empty=args.skip_empty, progress=not args.no_progress)
    path = save_trace(lengths, args.output)
    stats = trace_stats(lengths)
    print(f"wrote {path}: " + ", ".join(f"{k} {v:.1f}" if isinstance(v, float) else f"{k} {v}"
                                        for k, v in stats.items()))
    return 0
