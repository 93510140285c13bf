"""Flag groups several verbs share, and what they select (the model, the global batch).

- ``add_data_flags``: ``--dataset``/``--lengths``, ``--global-batch``, ``--seed``; with ``corpus``
  (run, compare) also ``--corpus FILE --field F [--tokenizer T] [--eos-token E]`` (real tokens, ``corpus_source``);
- ``add_packing_flags``: ``--stages``, ``--memory-limit``, ``--method``, ``--mbs``, ``--dp``,
  ``--schedule``, ``--cost-model``, ``--memory-model``, ``--oversize``, ``--slice-fitting``, ``--recompute``
  and the shape flags;
- ``add_schedule_flag``: ``--schedule`` (the schedule kind) in every verb, with the older spellings
  ``--schedule-kind`` (plan) and ``--kind`` (schedule) as hidden aliases;
- ``spec_from_flags``: the ONE place a verb's flags become a ``PlanSpec`` (plan, run, compare, the split search);
- ``add_slice_fitting_flag``: ``--slice-fitting``; ``add_embedding_flag``: ``--embedding`` (``embedding_pending``
  resolves its default, ``with_embedding_choice`` chooses ``auto``'s place once, before anything runs, by
  ``dynmb.planning.embedding_choice``, as ``Planner(embedding="auto")`` does); ``add_offload_flag``:
  ``--offload`` (plan, run, compare); ``add_state_shards_flag``: ``--state-shards`` (plan; ``run --shard`` plans
  with its ``--dp``; compare runs one replica);
- ``add_recompute_flag``: ``--recompute``;
- ``add_shape_flags``: ``--pack-len``, ``--round-to``;
- ``add_run_shape_flags``: ``--prewarm``, ``--no-expandable-segments``;
- ``virtual_arg``, ``with_virtual_choice``: ``--virtual`` (chunks per GPU, or ``auto``: chosen once, before
  anything runs, by ``dynmb.planning.virtual_search.choose_virtual``, as ``Planner(virtual="auto")`` does);
- ``add_model_flags``: ``--model``, ``--attention``; ``factory_from_args`` resolves ``--model`` to a
  ``StageFactory`` (``dynmb.models.resolve_model``: a preset, a JSON file or ``package.module:factory``),
  ``model_from_args`` to the ``ModelConfig`` the planner and the cost/memory models use for it
  (``dynmb.models.contract.planning_config``).

Every flag has its help; defaults are the ones ``dynmb VERB --help`` shows.
"""

from __future__ import annotations

import argparse
import functools
from typing import TYPE_CHECKING, Any

import numpy as np

from dynmb.core.config import ModelConfig, model_config, parse_bytes
from dynmb.core.planspec import EMBEDDING_SETTINGS, OFFLOAD_MODES, PlanSpec, embedding_setting
from dynmb.core.contract import names_factory
from dynmb.data import CorpusSource, load_trace, sample_indices

if TYPE_CHECKING:
    from dynmb.planning.embedding_choice import Placement, Workload

__all__ = ["add_model_flags", "add_data_flags", "add_packing_flags", "add_shape_flags", "add_run_shape_flags",
           "add_recompute_flag", "add_model_file_flags", "positive_int", "nonnegative_int", "int_at_least",
           "global_batch_int", "MAX_GLOBAL_BATCH", "virtual_arg", "with_virtual_choice", "model_from_args", "split_search_of", "workload_of", "factory_from_args", "names_factory", "warn_own_model_stand_ins", "load_batch", "load_rows", "corpus_source",
           "OVERSIZE_CHOICES", "SLICE_FITTING", "add_slice_fitting_flag", "add_embedding_flag", "add_offload_flag",
           "embedding_pending", "with_embedding_choice",
           "add_state_shards_flag", "state_shards_of",
           "add_schedule_flag",
           "spec_from_flags",
           "SPEC_FLAG_DEFAULTS", "SCHEDULE_ALIASES"]

OVERSIZE_CHOICES = ("error", "truncate", "drop", "split")
SLICE_FITTING = ("never", "auto")


MAX_GLOBAL_BATCH = 2**24
"""The most sequences ``--global-batch`` takes: one planning step holds several arrays per sequence
and its packers sort and scan them, so a step far beyond this is minutes of planning and gigabytes
before the first microbatch runs (a typo such as ``1e12`` is refused at once instead)."""


def int_at_least(low: int, high: int | None = None):
    """argparse type: an integer in ``[low, high]`` (``high`` None: no upper end); its error is one
    line naming the bound."""
    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected a whole number >= {low}, got {text!r}") from None
        if value < low:
            raise argparse.ArgumentTypeError(f"must be >= {low}, got {value}")
        if high is not None and value > high:
            raise argparse.ArgumentTypeError(f"must be at most {high}, got {value}")
        return value
    parse.__name__ = f"int >= {low}"
    return parse


positive_int = int_at_least(1)
"""argparse type: an integer >= 1."""
nonnegative_int = int_at_least(0)
"""argparse type: an integer >= 0."""
global_batch_int = int_at_least(1, MAX_GLOBAL_BATCH)
"""argparse type of ``--global-batch``: 1 to ``MAX_GLOBAL_BATCH`` sequences."""
VIRTUAL_ENABLE = ("give --cost-model a layout-free cost-model JSON (analytic or gpu kind), --dataset or --lengths, "
                  "and --global-batch")
"""What ``--virtual auto`` asks for where V cannot be chosen by simulated step."""


def virtual_enable(args: argparse.Namespace) -> str:
    """What ``--virtual auto`` asks for: ``VIRTUAL_ENABLE`` less the flags ``args`` already has (a verb with
    data flags always has a trace and a global batch, given or by default)."""
    given = getattr(args, "cost_model", None)
    model = ("give --cost-model a layout-free cost-model JSON (analytic or gpu kind)" if given is None else
             f"--cost-model {given} must be a layout-free cost model (analytic or gpu kind)")
    if hasattr(args, "global_batch") and hasattr(args, "dataset"):
        return model
    return VIRTUAL_ENABLE if given is None else f"{model}, --dataset or --lengths, and --global-batch"


def virtual_arg(text: str) -> int | str:
    """argparse type of ``--virtual``: model chunks per GPU, an integer >= 1, or ``auto``."""
    if text.strip() == "auto":
        return "auto"
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a whole number >= 1 or auto, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1 or auto, got {value}")
    return value


virtual_arg.__name__ = "int >= 1 or auto"


def with_virtual_choice(args: argparse.Namespace, *, model: str | None = None,
                        stages: int | None = None) -> argparse.Namespace:
    """``--virtual auto``: a copy of ``args`` with V chosen once (``choose_virtual``, the ``Planner``'s choice):
    ``--stages`` (``stages`` overrides it) counts the GPUs of one pipeline; the copy has ``stages`` P V,
    ``virtual`` V, ``virtual_choice`` (how) and, where the choice resolved it, ``virtual_layout`` (the model
    with its split, which ``model_from_args`` returns). Any other ``--virtual``: ``args`` as they are."""
    if getattr(args, "virtual", None) != "auto":
        return args
    if getattr(args, "plan", None):
        raise ValueError(f"--virtual auto chooses a layout; --plan {args.plan} runs its own (leave --virtual out)")
    from dynmb.planning.virtual_search import choose_virtual

    gpus, split, spec = int(stages or args.stages), getattr(args, "stage_split", None) or "even", model or args.model
    if names_factory(spec):                # a model of one's own splits its layers itself: refused in one line
        factory_from_args(argparse.Namespace(**{**vars(args), "model": spec}))
    base = argparse.Namespace(**{**vars(args), "model": spec, "stages": gpus, "virtual": 1, "stage_split": "even"})
    cfg = model_from_args(base)
    choice = choose_virtual(cfg, gpus, split, search=split_search_of(base, cfg, gpus), workload=workload_of(args),
                            cost_model=getattr(args, "cost_model", None), half_blocks=not names_factory(spec),
                            enable=virtual_enable(args))
    layout = {} if choice.layout is None else {"virtual_layout": choice.layout, "stage_split": "even"}
    return argparse.Namespace(**{**vars(args), "stages": gpus * choice.virtual, "virtual": choice.virtual,
                                 "virtual_choice": choice, **layout})


def stage_split_arg(text: str) -> str:
    """argparse type of ``--stage-split``: even, auto or a comma-separated list, never empty."""
    value = text.strip()
    if not value or not value.strip(","):
        raise argparse.ArgumentTypeError(f"empty ({text!r}); give even, auto or layers per stage such as 2,2")
    return value


stage_split_arg.__name__ = "even, auto or a list"


def add_model_flags(parser: argparse.ArgumentParser, *, default: str | None = "small") -> None:
    """``--model`` (``default`` None: a verb that reads the model from its plan), ``--attention``,
    ``--stage-split``."""
    parser.add_argument("--model", default=default,
                        help="model: a preset (GPT-2 family: tiny, small (CPU default), gpt2, gpt2-medium, gpt2-1b, "
                             "gpt2-7b, gpt2-deep-13b; Llama family: llama-tiny, llama-small, llama2-7b, llama3.2-1b, "
                             "llama3.1-8b), a preset with overrides (small:d_model=512,n_layers=8), a JSON file of "
                             "ModelConfig fields, or your own model: package.module:factory (factory() returns a "
                             "StageFactory; docs/design.md 'The stage contract')")
    parser.add_argument("--attention", default=None, choices=["auto", "dense"],
                        help="auto (default): causal attention without a mask for one document per row, "
                             "document-causal (sum of s_i^2) for packed rows; dense: the (s, s) mask on every row "
                             "(ablation)")
    parser.add_argument("--stage-split", default="even", type=stage_split_arg,
                        help="layers per pipeline stage: even (default), auto (balance the stages' work, embedding "
                             "and LM head included, in half-blocks or eighths of them (K/V-head groups, MLP "
                             "columns) where 1%% lighter: the forward + backward of every sequence of "
                             "--dataset/--lengths at its own length, priced by --cost-model where it prices any "
                             "split (analytic, gpu), else in FLOPs; dynmb.planning.stage_split; with such a cost "
                             "model plan / run / compare then take, among the near-optimal splits, the one whose "
                             "simulated step per real token is smallest: dynmb.planning.split_search) or a list such as "
                             "9,8,8,7 or, in half-blocks (a stage boundary between a block's attention and MLP), "
                             "2.5,2,2,1.5, or on the 1/16-layer grid inside a half-block, 2.75,1.25")


def add_model_file_flags(parser: argparse.ArgumentParser, *, from_plan: bool = False) -> None:
    """``--cost-model`` and ``--memory-model`` (``from_plan``: of the verbs that take a plan file, whose
    defaults are the files the plan was made with)."""
    default = "the plan's (the file it was planned with, or the analytic stand-in)" if from_plan else "analytic"
    parser.add_argument("--cost-model", default=None, help=f"fitted cost-model JSON; default {default}")
    parser.add_argument("--memory-model", default=None, help=f"fitted memory-model JSON; default {default}")


@functools.lru_cache(maxsize=4)
def _resolved(spec: str) -> Any:
    """``resolve_model(spec)`` once per command (a factory may build a whole model when called); a factory
    that raises anything is one ``ValueError`` line naming it, not a traceback."""
    from dynmb.models.contract import resolve_model

    try:
        return resolve_model(spec)
    except ValueError:
        raise
    except Exception as e:  # noqa: BLE001 - a user's factory may raise anything
        text = " ".join(str(e).split())[:300] or type(e).__name__
        raise ValueError(f"--model {spec}: the factory raised {type(e).__name__}: {text}") from None


def factory_from_args(args: argparse.Namespace, *, model: str | None = None, stages: int | None = None) -> Any:
    """The ``StageFactory`` of ``--model`` (``model`` overrides it), ``--attention`` and ``--stage-split``
    over ``--stages`` stages (``stages`` overrides it). A user's factory builds its own split: only
    ``--stage-split even`` applies to it."""
    from dynmb.models.families import family_factory

    spec = model or args.model
    if names_factory(spec):
        split = getattr(args, "stage_split", "even") or "even"
        if split != "even":
            raise ValueError(f"--stage-split {split}: a model of your own ({spec}) splits its layers itself; "
                             "use --stage-split even")
        return _resolved(spec)
    return family_factory(model_from_args(args, model=model, stages=stages))


def model_from_args(args: argparse.Namespace, *, model: str | None = None, stages: int | None = None) -> ModelConfig:
    """The ModelConfig of ``--model``, ``--attention`` and ``--stage-split`` over ``--stages`` stages
    (``model`` / ``stages`` override the flags where a verb resolves its own defaults; ``auto`` balances
    the verb's trace, ``workload_of``, priced by ``--cost-model`` where it prices any layout). For
    ``package.module:factory`` the sizes and attention kind of its factory (``planning_config``); after
    ``with_virtual_choice`` the layout it chose."""
    if getattr(args, "virtual_layout", None) is not None:
        return args.virtual_layout
    spec = model or args.model
    if spec.endswith(".py"):
        module = spec[:-3].replace("/", ".").replace("\\", ".").lstrip(".")
        raise ValueError(f"--model {spec}: a Python file is not a model; name the function in it that returns a "
                         f"StageFactory: --model {module}:<factory> (its folder on PYTHONPATH; docs/design.md "
                         f"'The stage contract')")
    if names_factory(spec):
        from dynmb.models.contract import planning_config

        return planning_config(factory_from_args(args, model=model, stages=stages))
    try:
        cfg = model_config(spec, attention=getattr(args, "attention", None))
    except ValueError as e:
        if spec.endswith(".json") and "unknown ModelConfig field" in str(e):
            raise ValueError(f"{e}; a model of your own (a transformers config too) enters as --model "
                             "package.module:factory, e.g. a function returning "
                             "dynmb.models.hf.HFStageFactory.from_config(config)") from None
        raise
    split = getattr(args, "stage_split", "even") or "even"
    if split == "even":
        return cfg
    stages = stages or getattr(args, "stages", None)
    if not stages:
        raise ValueError("--stage-split needs --stages (the number of pipeline stages, model chunks with --virtual)")
    from dynmb.planning.memory_split import ReliefInputs, relieved_layout
    from dynmb.schedule.kinds import is_schedule_name
    from dynmb.planning.stage_split import resolve_stage_split
    virtual = int(getattr(args, "virtual", None) or 1)
    out = resolve_stage_split(cfg, int(stages), split, workload=workload_of(args),
                              cost_model=getattr(args, "cost_model", None), search=split_search_of(args, cfg, int(stages)),
                              virtual=virtual)
    if split != "auto" or getattr(args, "memory_limit", None) is None:
        return out
    relief = ReliefInputs(memory_limit_bytes=parse_bytes(args.memory_limit), workload=workload_of(args),
                          schedule_kind=kind if is_schedule_name(kind := str(getattr(args, "schedule", None)
                                                                              or "1f1b")) else "1f1b",
                          cost_model=getattr(args, "cost_model", None),          # memory in the split, as Planner
                          state_shards=state_shards_of(args),
                          embedding=str(getattr(args, "embedding", None) or "first"))
    return relieved_layout(out, int(stages), relief, virtual=virtual, memory_model=getattr(args, "memory_model", None))[0]


def split_search_of(args: argparse.Namespace, cfg: ModelConfig, stages: int) -> Any:
    """The ``SplitSearch`` of a verb that plans global batches (``plan``, ``run``: ``--global-batch``, the
    limit, the schedule kind, dp, ...): ``--stage-split auto`` then takes the near-optimal split whose
    simulated step is fastest (``dynmb.planning.split_search``); None for the other verbs and for settings
    a plan cannot be made with (refused later by ``check_plan_spec``)."""
    if not hasattr(args, "global_batch") or not hasattr(args, "memory_limit"):
        return None
    from dynmb.planning.split_search import SplitSearch
    from dynmb.schedule.kinds import is_schedule_name

    if not is_schedule_name(str(getattr(args, "schedule", None) or SPEC_FLAG_DEFAULTS["schedule"])):
        return None                                 # a schedule file: the run replays a plan
    try:
        spec = spec_from_flags(args, cfg, stages=int(stages), mbs=None, pack_len=None)   # dynamic's search
    except ValueError:
        return None                                 # refused later, in one line
    return SplitSearch.of(spec.to_dict(), int(getattr(args, "global_batch", None) or 64),
                          seed=int(getattr(args, "seed", None) or 0), memory_model=getattr(args, "memory_model", None))


SPEC_FLAG_DEFAULTS: dict[str, Any] = dict(method="dynamic", stages=2, virtual=1, schedule="1f1b", reorder="none",
                                          memory_limit="1GiB", dp=1, mbs=None, pack_len=None, round_to=1,
                                          oversize="error", recompute="never", slice_fitting="never",
                                          embedding="first", offload="never", state_shards=1)
"""The default of each flag ``spec_from_flags`` reads, where a verb does not take the flag or leaves it None."""


def spec_from_flags(args: argparse.Namespace, model: ModelConfig | None = None, **given: Any) -> PlanSpec:
    """The ``PlanSpec`` of a verb's flags: the one place flags become planning settings (``dynmb plan``,
    ``run``, ``compare``, the stage-split search). Each field comes from ``given`` (what the verb fixed itself,
    by flag name: ``method=``, ``stages=``, ``schedule=``, ...), else the flag (``--stages`` -> ``num_stages``,
    ``--schedule`` -> ``schedule_kind``, ``--memory-limit`` parsed to bytes), else ``SPEC_FLAG_DEFAULTS``;
    ``model``'s attention is the spec's. ``run --shard`` (``args.shard``) plans with its ``--dp`` as
    ``state_shards`` (FSDP2 shares each stage's states over the replicas) unless ``given`` says otherwise. Bad values
    raise ``ValueError`` (one line naming the field)."""
    unknown = sorted(set(given) - set(SPEC_FLAG_DEFAULTS))
    if unknown:
        raise TypeError(f"spec_from_flags: unknown flag name(s) {unknown}")

    def flag(name: str) -> Any:
        value = given[name] if name in given else getattr(args, name, None)
        if value is None and name == "schedule":          # a namespace of the older dest (``--schedule-kind``)
            value = getattr(args, "schedule_kind", None)
        return SPEC_FLAG_DEFAULTS[name] if value is None else value

    return PlanSpec(method=flag("method"), num_stages=int(flag("stages")), virtual=int(flag("virtual")),
                    schedule_kind=flag("schedule"), reorder=flag("reorder"),
                    memory_limit_bytes=parse_bytes(flag("memory_limit")), dp=int(flag("dp")), mbs=flag("mbs"),
                    pack_len=flag("pack_len"), round_to=int(flag("round_to")), oversize=flag("oversize"),
                    recompute=flag("recompute"), slice_fitting=flag("slice_fitting"), embedding=flag("embedding"),
                    offload=flag("offload"), state_shards=given["state_shards"] if "state_shards" in given
                    else state_shards_of(args, flag("dp")),
                    attention=None if model is None else model.attention)


def state_shards_of(args: argparse.Namespace, dp: Any = None) -> int:
    """The ``state_shards`` a verb's flags plan with: ``--state-shards``, else ``--dp`` (``dp``: the verb's own)
    with ``run --shard``, else 1."""
    if getattr(args, "state_shards", None) is not None:
        return int(args.state_shards)
    return int(dp or getattr(args, "dp", None) or 1) if getattr(args, "shard", False) else 1


SCHEDULE_ALIASES = ("--schedule-kind", "--kind")
"""The older spellings of ``--schedule`` (``plan --schedule-kind``, ``schedule --kind``), taken by every verb
that takes ``--schedule`` as a kind, and hidden from its help."""


def add_schedule_flag(parser: argparse.ArgumentParser, *, default: str | None = "1f1b",
                      help: str | None = None) -> None:
    """``--schedule KIND`` (dest ``schedule``) and its hidden aliases ``SCHEDULE_ALIASES`` (same dest)."""
    text = help or ("schedule kind: gpipe, 1f1b, interleaved, memory-aware, zb-h1, zb, or auto (the fastest "
                    f"predicted kind that fits, chosen per step) (default {default})")
    parser.add_argument("--schedule", default=default, help=text)
    parser.add_argument(*SCHEDULE_ALIASES, dest="schedule", default=argparse.SUPPRESS, help=argparse.SUPPRESS)


def workload_of(args: argparse.Namespace) -> str | None:
    """What ``--stage-split auto`` balances: the trace a verb with data flags draws its batches from
    (``--lengths``, ``--dataset``, else sharegpt as they default); None for a verb without them and for
    ``--corpus`` (its token counts are known only once tokenized): the 1,024-token stand-in, said once."""
    if not hasattr(args, "dataset") or getattr(args, "corpus", None):
        return None
    return args.lengths or args.dataset or "sharegpt"


def warn_own_model_stand_ins(args: argparse.Namespace, model: ModelConfig, cost_file: str | None,
                             memory_file: str | None, stages: int, who: str) -> None:
    """For ``--model package.module:factory``: warn once (``dynmb.planning.defaults.warn_stand_ins``)
    when planning uses the analytic cost model (no ``--cost-model``) or the analytic memory model of
    dynmb's own GPT (no ``--memory-model``) instead of ones fitted to that model."""
    if not names_factory(str(args.model or "")):
        return
    import warnings

    from dynmb.planning.defaults import StandInModelWarning, warn_stand_ins

    kinds = (("cost",) if cost_file is None else ()) + (("memory",) if memory_file is None else ())
    with warnings.catch_warnings():                     # the command line shows the log line only
        warnings.simplefilter("ignore", StandInModelWarning)
        warn_stand_ins(model, stages, kinds, who=who)


def add_data_flags(parser: argparse.ArgumentParser, *, global_batch: int = 64, corpus: bool = False) -> None:
    source = parser.add_mutually_exclusive_group(required=False)
    source.add_argument("--dataset", default=None, help="shipped length trace name (see `dynmb datasets`)")
    source.add_argument("--lengths", default=None, help="a length-trace CSV (header + one column `length`)")
    if corpus:
        source.add_argument("--corpus", default=None,
                            help="train on real text: a .jsonl, .json (list of records) or .txt corpus (or .gz), "
                                 "tokenized as `dynmb lengths` does; the global batches are drawn from its records "
                                 "(default: synthetic token ids on a length trace)")
        parser.add_argument("--field", action="append", default=None,
                            help="with --corpus: the record field to train on (dotted paths like "
                                 "conversations.0.value; repeat to join several with a newline; txt: none)")
        parser.add_argument("--tokenizer", default=None,
                            help="with --corpus: gpt2 (offline BPE, default), a Hugging Face tokenizer name or a "
                                 "tokenizer.json path; its ids must fit the model's vocab_size")
        parser.add_argument("--eos-token", default=None,
                            help="with --corpus: the end-of-text token appended to every document (default: the "
                                 "tokenizer's own, from the tokenizer_config.json beside a tokenizer.json, else "
                                 "<|endoftext|>, </s>, ...)")
    parser.add_argument("--global-batch", type=global_batch_int, default=global_batch,
                        help=f"sequences per global batch (default {global_batch}; at most {MAX_GLOBAL_BATCH})")
    parser.add_argument("--seed", type=nonnegative_int, default=0, help="seed for sampling the global batch (default 0)")


def add_packing_flags(parser: argparse.ArgumentParser, *, schedule_default: str | None = "1f1b",
                      schedule_help: str | None = None) -> None:
    """The packing flags (module doc); ``--schedule`` with ``schedule_default`` and ``schedule_help``."""
    parser.add_argument("--stages", type=positive_int, default=2, help="pipeline stages (default 2)")
    parser.add_argument("--memory-limit", default="1GiB",
                        help="per-GPU memory limit, e.g. 2GiB, 512MiB (default 1GiB)")
    parser.add_argument("--method", default="dynamic",
                        help="fixed, sorted, packed, token-budget, balanced, dynapipe, dynamic (default dynamic); "
                             "token-budget / balanced: --mbs d divides their memory-maximum token budget by d")
    parser.add_argument("--mbs", type=positive_int, default=None,
                        help="microbatch size for fixed-size methods (default: the largest that fits)")
    parser.add_argument("--dp", type=positive_int, default=1,
                        help="data-parallel pipelines the global batch is split over (default 1)")
    add_schedule_flag(parser, default=schedule_default, help=schedule_help)
    parser.add_argument("--cost-model", default=None,
                        help="fitted cost-model JSON (`dynmb fit`); default: analytic stand-in")
    parser.add_argument("--memory-model", default=None,
                        help="fitted memory-model JSON (`dynmb memory`); default: analytic")
    parser.add_argument("--oversize", default="error", choices=OVERSIZE_CHOICES,
                        help="a sequence that cannot fit alone: error (default), truncate it to fit, or drop it "
                             "(both reported)")
    add_slice_fitting_flag(parser)
    add_embedding_flag(parser)
    add_offload_flag(parser)
    add_recompute_flag(parser)
    add_shape_flags(parser)


def add_embedding_flag(parser: argparse.ArgumentParser, *, default: str | None = None) -> None:
    """``--embedding``; ``default`` None: ``auto`` under ``--stage-split auto``, else ``first`` (``embedding_pending``);
    ``compare`` passes ``first``."""
    parser.add_argument("--embedding", default=default, choices=EMBEDDING_SETTINGS,
                        help="where the token embedding lives: first (with stage 0), last (on the last pipeline rank, "
                             "which embeds each microbatch and sends it to stage 0: stage 0's memory holds no "
                             "embedding table; dynmb.schedule.embedlast) or auto (chosen once, before anything runs: "
                             "the workload's sample batches planned both ways, each place with its own layout, and "
                             "the smaller mean simulated step per real token kept for the run; first where last "
                             "cannot run, said once; dynmb.planning.embedding_choice); default "
                             + ("auto with --stage-split auto, else first" if default is None else default))


def embedding_pending(args: argparse.Namespace) -> argparse.Namespace:
    """A copy of ``args`` with ``--embedding`` resolved (``embedding_setting``: auto by default under ``--stage-split
    auto``); ``auto`` stands as ``first`` with ``embedding_auto`` set until ``with_embedding_choice`` chooses."""
    setting = embedding_setting(getattr(args, "embedding", None), getattr(args, "stage_split", None) or "even")
    auto = setting == "auto" and not getattr(args, "plan", None)        # a plan file runs its own place
    return argparse.Namespace(**{**vars(args), "embedding": "first" if auto else setting, "embedding_auto": auto})


def _placement(args: argparse.Namespace, place: str, model: str | None, stages: int | None,
               device: str) -> "Placement":
    """One place's layout (``model_from_args``), settings (``spec_from_flags``) and models (the one loader, as the
    run's ranks load them)."""
    from dynmb.costmodel.loader import load_models, spec_models
    from dynmb.planning.embedding_choice import Placement

    from dynmb.planning.spec_check import check_plan_spec

    placed = argparse.Namespace(**{**vars(args), "embedding": place})
    cfg = model_from_args(placed, model=model, stages=stages)
    spec = spec_from_flags(placed, cfg, **({} if stages is None else {"stages": stages}))
    check_plan_spec(spec)                       # what the verb refuses, in its one line, before any planning
    models = load_models(cfg, spec.num_stages, cost=getattr(args, "cost_model", None),
                         memory=getattr(args, "memory_model", None), virtual=spec.virtual, device=device,
                         own_model=names_factory(model or args.model), who="--embedding auto")
    return Placement(spec=spec, model_cfg=cfg, models=spec_models(models, spec))


def with_embedding_choice(args: argparse.Namespace, workload: "Workload", *, model: str | None = None,
                          stages: int | None = None, device: str = "cpu") -> argparse.Namespace:
    """``--embedding auto`` (after ``embedding_pending``): a copy of ``args`` with the place chosen once, before
    anything runs, by ``dynmb.planning.embedding_choice.choose_on_samples`` (the ``Planner``'s choice given a
    workload and a global batch size) on the sample batches of ``workload`` (the verb's trace or corpus, its global
    batch and seed: whatever step a verb plans first, the same place): ``embedding`` the place, ``embedding_choice``
    the record, ``virtual_layout`` the winner's layout (``model_from_args`` returns it). Where ``last`` cannot run:
    ``first``, said once. Else ``args``."""
    if not getattr(args, "embedding_auto", False):
        return args
    from dynmb.planning.embedding_choice import choose_on_samples, fallback, last_refusal

    plain = argparse.Namespace(**{**vars(args), "stage_split": "even"})   # the architecture and settings only
    cfg = model_from_args(plain, model=model, stages=stages)
    why = last_refusal(spec_from_flags(plain, cfg, **({} if stages is None else {"stages": stages})), cfg,
                       own_model=names_factory(model or args.model),
                       memory_model_given=getattr(args, "memory_model", None) is not None)
    if why is not None:
        return argparse.Namespace(**{**vars(args), "embedding": "first", "embedding_auto": False,
                                     "embedding_choice": fallback(why)})
    places = [_placement(args, place, model, stages, device) for place in ("first", "last")]
    choice, won = choose_on_samples(workload, places)
    return argparse.Namespace(**{**vars(args), "embedding": choice.place, "embedding_auto": False,
                                 "embedding_choice": choice, "virtual_layout": won.model_cfg, "stage_split": "even"})


def add_state_shards_flag(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--state-shards", type=positive_int, default=None, metavar="N",
                        help="how many data-parallel ranks share each stage's model states (FSDP2 over the replicas, "
                             "`dynmb run --dp N --shard`); default 1: every rank holds them whole. The memory model "
                             "counts what the sharded run holds (dynmb.memory.model, MemoryModel.sharded)")


def add_offload_flag(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--offload", default="never", choices=OFFLOAD_MODES,
                        help="activation offload to host memory: never (default) or auto (the planner moves the saved "
                             "activations of each stage's leading blocks to host memory between a microbatch's forward "
                             "and backward where the copies hide behind compute and the plan is predicted faster; "
                             "dynmb.planning.offload)")


def add_slice_fitting_flag(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--slice-fitting", default="never", choices=SLICE_FITTING,
                        help="slice sequences that fit too: never (default; only --oversize split slices, what does "
                             "not fit), or auto (also try slicing every sequence longer than the longest row / 2 or / 4, "
                             "after --oversize truncate's cut, and keep the plan with the shortest predicted step that "
                             "fits; dynmb.planning.slice_fitting)")


def add_recompute_flag(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--recompute", default="never", choices=["never", "always", "auto"],
                        help="full activation recomputation per microbatch: never (default), always, or auto (the "
                             "packer recomputes the microbatches for which it pays; dynmb.packing.recompute)")


def add_shape_flags(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--pack-len", type=positive_int, default=None,
                        help="row length of the packed method (default: the longest row that fits under the limit)")
    parser.add_argument("--round-to", type=positive_int, default=1,
                        help="every microbatch's padded_len is a multiple of N (default 1; 64 suits GPUs)")


def add_run_shape_flags(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--prewarm", action="store_true",
                        help="run one forward+backward of every distinct microbatch shape of the planned steps first")
    parser.add_argument("--no-expandable-segments", action="store_true",
                        help="CUDA: do not set PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True (the default)")
    parser.add_argument("--plan-ahead", type=int, default=0, metavar="N",
                        help="N planner processes per rank plan N steps ahead of the step being trained "
                             "(default 0: each step is planned in line; steps.plan_wait_s says what it waited)")


def corpus_source(args: argparse.Namespace) -> CorpusSource | None:
    """The corpus of ``--corpus``/``--field``/``--tokenizer`` (None without ``--corpus``)."""
    corpus = getattr(args, "corpus", None)
    if corpus is None:
        given = [f for f in ("field", "tokenizer", "eos_token") if getattr(args, f, None) is not None]
        if given:
            raise ValueError(f"--{given[0].replace('_', '-')} is for --corpus runs; give --corpus FILE")
        return None
    return CorpusSource.create(corpus, args.field, args.tokenizer or "gpt2", getattr(args, "eos_token", None))


def load_batch(args: argparse.Namespace, step: int = 0) -> np.ndarray:
    """The global batch selected by ``--dataset``/``--lengths``, ``--global-batch``, ``--seed``
    (sharegpt when neither is given; ``args.dataset`` is set to it)."""
    return load_rows(args, step)[1]


def load_rows(args: argparse.Namespace, step: int = 0) -> tuple[np.ndarray, np.ndarray]:
    """``(rows of the trace, their lengths)`` of ``load_batch``'s global batch."""
    if args.dataset is None and args.lengths is None:
        args.dataset = "sharegpt"
    trace = load_trace(args.lengths if args.lengths is not None else args.dataset)
    rows = sample_indices(trace.size, args.global_batch, args.seed, step=step)
    return rows, trace[rows]
