"""The torch workload: dynmb's model families as pipeline stages, and the stage contract.

- ``contract``: the ``StageModule`` / ``StageFactory`` Protocols and ``resolve_model``
  (preset, JSON file or ``package.module:factory`` -> a factory);
- ``families``: the registry ``ModelConfig.family`` -> stage class, ``build_stage(s)``,
  ``FamilyFactory``;
- ``gpt2``: the GPT-2 family (learned positions, LayerNorm, GELU MLP, biases);
- ``llama``: the Llama family (rotary positions, RMSNorm, SwiGLU, grouped-query attention);
- ``stage``: the ``DecoderStage`` base both families share; ``pieces``: a stage boundary inside a
  half-block (K/V head groups, MLP columns, the ``[y | h]`` message, ``full_weights``); ``attention``: attention on the
  microbatch's path (causal, bucketed document-causal, dense, slices with a prefix);
  ``recompute``: ``RecomputedBlock`` / ``RecomputedHead``; ``seeding``: per-name seeded init;
  ``reference``: the single-process reference (``reference_grads``, ``whole_documents``).

The model inputs (``make_inputs``, ``MicrobatchInputs``, ...) live in ``dynmb.models.inputs`` and are
re-exported here for convenience.
"""

from dynmb.models.inputs import (IGNORE_INDEX, INPUT_ATTENTION, DocumentBuckets, InputError, MicrobatchInputs, attention_mask,
                          bucket_documents, full_microbatch, hidden_shape, make_inputs, synthetic_tokens, torch_dtype)

from dynmb.models.contract import StageFactory, StageModule, planning_config, resolve_model
from dynmb.models.families import FAMILIES, FamilyFactory, build_stage, build_stages, family_factory
from dynmb.models.gpt2 import GPT, Block, GPTStage
from dynmb.models.llama import LlamaBlock, LlamaStage
from dynmb.models.recompute import RecomputedBlock, RecomputedHead
from dynmb.models.reference import count_params, global_named_parameters, reference_grads, reference_stages, whole_documents
from dynmb.models.stage import DecoderStage

__all__ = [
    "StageModule", "StageFactory", "resolve_model", "planning_config", "FAMILIES", "FamilyFactory", "family_factory", "DecoderStage",
    "GPT", "GPTStage", "Block", "LlamaStage", "LlamaBlock", "MicrobatchInputs", "DocumentBuckets", "InputError", "build_stage", "build_stages",
    "synthetic_tokens", "full_microbatch", "make_inputs", "attention_mask", "bucket_documents", "hidden_shape",
    "torch_dtype", "global_named_parameters", "count_params", "reference_grads", "IGNORE_INDEX", "INPUT_ATTENTION",
    "RecomputedBlock", "RecomputedHead", "whole_documents", "reference_stages",
]
