"""transformers models as ``--model package.module:factory`` factories for the tests
(``--model tests.hf_models:tiny_llama``; every rank imports this module and calls the function).

``tiny_llama()``: an HF ``LlamaForCausalLM`` (hidden 64, 2 layers, 4 query and 2 K/V heads, SwiGLU
172, untied head) built from its config with torch's generator seeded by 0, so every rank that calls
it holds the same weights (``HFStageFactory.from_config``). Importing this module needs no
transformers; calling the factory does.
"""

from __future__ import annotations

__all__ = ["tiny_llama", "TINY_VOCAB"]

TINY_VOCAB = 512
"""Its vocabulary (synthetic token ids are drawn below it)."""


def tiny_llama():
    """The factory of a tiny HF Llama (module docstring)."""
    from transformers import LlamaConfig

    from dynmb.models.hf import HFStageFactory

    config = LlamaConfig(vocab_size=TINY_VOCAB, hidden_size=64, intermediate_size=172, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=4096,
                         tie_word_embeddings=False)
    return HFStageFactory.from_config(config, seed=0, name="hf-tiny-llama")
