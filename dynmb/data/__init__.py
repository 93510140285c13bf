"""Length traces: the shipped ones (package data), corpora -> traces, sampling, synthetic traces.

- ``lengths``: the trace format (a CSV with a ``length`` column), the shipped traces in
  ``dynmb/data/traces/`` read with ``importlib.resources`` (``DYNMB_DATA_DIR`` overrides
  the folder), loading, saving, statistics, ``sample_batch`` (global batch ``step`` of
  stream ``seed``) and lognormal-mixture synthetic traces.
- ``corpus``: jsonl/json/txt corpora tokenized (GPT-2 BPE offline, or a Hugging Face
  tokenizer) into a trace; the tokenizers' packages are imported only when used.
- ``tokens``: a corpus's token ids for real-text runs (``--corpus``): tokenized once into a
  token file the ranks read, each document followed by the end-of-text id.

The fitted cost models shipped with dynmb are package data here too
(``dynmb.planning.defaults.default_cost_model_path``).
"""

from __future__ import annotations

from dynmb.data.corpus import GPT2_HELLO_WORLD, CorpusError, TokenizerError, build_trace, get_tokenizer, read_records
from dynmb.data.lengths import (check_lengths, data_dir, datasets_table, fit_lognormal, fit_mixture, list_traces, load_trace,
                      lognormal, lognormal_mixture, sample_batch, sample_indices, save_trace, shipped_dir,
                      synthetic_like, trace_stats)
from dynmb.data.tokens import CorpusSource, CorpusTokens, TokenFile, check_vocab, prepare_tokens, tokenize

__all__ = [
    "CorpusError", "TokenizerError", "shipped_dir", "data_dir", "list_traces", "load_trace", "save_trace",
    "check_lengths", "trace_stats", "datasets_table", "sample_batch", "lognormal",
    "lognormal_mixture", "fit_lognormal", "fit_mixture", "synthetic_like", "read_records",
    "get_tokenizer", "build_trace", "GPT2_HELLO_WORLD", "sample_indices", "CorpusSource", "CorpusTokens", "TokenFile",
    "tokenize", "prepare_tokens", "check_vocab",
]
