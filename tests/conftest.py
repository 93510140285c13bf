"""Shared fixtures and the ``slow`` marker.

- ``gloo_job``: one torchrun job per rank count for the modules' gloo cases (``tests/gloo_jobs.py``).
- ``slow``: the default ``python -m pytest -q tests`` (the README's test command, about 5 min on
  a 2-core box) skips the tests marked ``slow``; ``--runslow`` or ``DYNMB_SLOW=1`` runs them too
  (before a merge). A test is slow when it is marked ``@pytest.mark.slow`` in its module or
  listed in ``SLOW`` below (node ids of the longest tests by ``pytest --durations``, kept here so
  that one list decides what the quick run leaves out).
"""

from __future__ import annotations

import gc
import os
from typing import Callable

import pytest

from dynmb.runtime.launch import launch_job
from dynmb.runtime.spec import JobSpec
from tests.gloo_jobs import PROVIDERS, GlooJob

SLOW: tuple[str, ...] = (
    "tests/test_torch_pipelining.py::test_data_parallel_pipelines_on_subgroups_equal_the_reference",  # dp: test_fsdp's
    "tests/test_data.py::test_unloadable_tokenizers",                        # a fresh import per tokenizer
    "tests/test_head_split.py::test_auto_shards_a_head_heavier_than_a_stage_and_only_then",
    "tests/test_costmodel.py::test_tiny_concurrent_profile",                 # a real 2-process profile
    "tests/test_run_api.py::test_run_returns_the_tables_of_this_run_only",   # real runs through torchrun
    "tests/test_run_api.py::test_a_failed_run_is_marked_failed_with_its_error",
    "tests/test_run_api.py::test_run_plan_runs_exactly_that_plan_every_step",
    "tests/test_runtime.py::test_divergent_plan_is_refused",                 # fault injection, one job each
    "tests/test_runtime.py::test_peak_over_the_limit_fails_the_run",
    "tests/test_runtime.py::test_killed_rank_fails_fast_and_is_named",
    "tests/test_stop.py::",                                                  # signals to torchrun and workers
    "tests/test_hostmem.py::test_retain_reuses_freed_pages",                 # host allocator in subprocesses
    "tests/test_hostmem.py::test_system_mode_turns_it_off",
    # measured at issue 36 (CPU seconds of the test and its waited-for children, the loaded box's proxy for
    # an idle one; each keeps a faster sibling in the quick run):
    "tests/test_own_model.py::test_own_model_profile_fit_plan_run_verify_on_two_gloo_ranks",   # 34 s: profile+fit+run
    "tests/test_own_model.py::test_hf_llama_runs_verified_on_two_gloo_ranks_with_packed_rows",  # 24 s
    "tests/test_torch_pipelining.py::test_gradients_equal_the_single_process_reference[4-",      # 21 s; 2 ranks stay
    "tests/test_head_split.py::test_the_search_s_other_arrangements_are_sharded_and_weighed_too",  # 17 s
    "tests/test_head_split.py::test_a_split_search_keeps_the_layout_that_simulates_fastest",     # 13 s
    "tests/test_virtual_cli.py::test_plan_virtual_auto_chooses_as_the_planner[auto]",            # 16 s; [even] stays
    "tests/test_balanced.py::test_compare_reports_both_budgets_and_the_gaps",                    # 13 s: a real compare
    "tests/test_corpus_runs.py::test_cli_run_on_a_corpus_end_to_end",                           # 12 s: torchrun
    "tests/test_train_loop.py::test_data_parallel_replicas_sum_to_the_global_batch_gradient",    # 11 s
    "tests/test_slices.py::test_sliced_document_gradients_equal_whole_document[splits2-",         # 8 s; splits0/1/4 stay
    "tests/test_slices.py::test_sliced_document_gradients_equal_whole_document[splits3-",         # 10 s
    "tests/test_slices.py::test_sliced_document_gradients_equal_whole_document[splits5-",         # 7 s
    "tests/test_slices.py::test_split_backward_of_slices_equals_whole_document[dtype0-splits2-",  # 6 s
    "tests/test_slices.py::test_split_backward_of_slices_equals_whole_document[dtype0-splits3-",  # 7 s
    "tests/test_slice_fitting.py::test_run_with_fitting_slices_verifies_on_gloo",                # 27 s: torchrun
    "tests/test_virtual_search.py::test_each_v_plans_its_own_split_search",                      # 12 s
    "tests/test_virtual_search.py::test_the_choice_is_deterministic",                            # 5 s
    "tests/test_split_search.py::test_the_choice_is_deterministic",                              # 10 s
    "tests/test_split_search.py::test_compare_chooses_as_the_planner",                           # 5 s
    "tests/test_split_work.py::test_the_command_line_and_the_sampler_balance_their_trace",       # 9 s
    "tests/test_split_work.py::test_the_split_is_deterministic",                                 # 4 s
    "tests/test_compare.py::test_compare_on_one_rank_with_virtual_stages",                       # 9 s; side by side stays
    "tests/test_planahead.py::test_planner_error_reaches_the_step_that_needs_the_plan",          # 6 s
    "tests/test_zerobubble.py::test_split_backward_equals_full_backward[4]",                     # 5 s; [2] stays
    # session 19, the idle box's `--durations` (the suite at 5 min 9 s):
    "tests/test_virtual_search.py::test_short_chats_take_zb_v_at_two_chunks_per_gpu",  # 8 s; long documents choosing V 2 stays
    "tests/test_scaling_planner.py::test_deep_pipeline_with_one_replica_regression",   # 4 s; the never-slower cases stay
    "tests/test_scaling_planner.py::test_dynamic_is_not_behind_dynapipe_after_the_reorder_on_a_large_interleaved",
    "tests/test_split_work.py::test_long_documents_get_the_split_the_workload_runs_fastest_with",  # 4 s; the other split cases stay
)
"""Node ids (a prefix matches: a module, a test, or one parametrization) of the slow tests."""


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption("--runslow", action="store_true", default=False,
                     help="also run the tests marked slow (DYNMB_SLOW=1 does the same)")


def _run_slow(config: pytest.Config) -> bool:
    return bool(config.getoption("--runslow")) or os.environ.get("DYNMB_SLOW", "") not in ("", "0")


def pytest_collection_finish(session: pytest.Session) -> None:
    """Move what collection left alive (torch, pandas, scipy, hypothesis and every test module: ~0.5 M
    objects) out of the cyclic collector's reach: its full collections during the run then scan only what
    the tests allocate (``gc.freeze``; about a third of collection's CPU was the collector)."""
    gc.collect()
    gc.freeze()


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    for item in items:
        if item.nodeid.startswith(SLOW):
            item.add_marker(pytest.mark.slow)
    if _run_slow(config):
        return
    skip = pytest.mark.skip(reason="slow: run with --runslow or DYNMB_SLOW=1")
    for item in items:
        if item.get_closest_marker("slow") is not None:
            item.add_marker(skip)


@pytest.fixture(scope="session")
def gloo_job(tmp_path_factory, pytestconfig) -> Callable[[int], GlooJob]:
    """``gloo_job(nproc)``: run (once per session) every case registered for ``nproc`` ranks in one job.
    The 4-rank job is slow: without ``--runslow`` / ``DYNMB_SLOW=1`` the tests that ask for it skip
    (the 2-rank job, which checks the same exactness on 2 ranks, always runs)."""
    done: dict[int, GlooJob] = {}

    def get(nproc: int) -> GlooJob:
        if nproc >= 4 and not _run_slow(pytestconfig):
            pytest.skip(f"slow: the {nproc}-rank gloo job; run with --runslow or DYNMB_SLOW=1")
        if nproc not in done:
            out = tmp_path_factory.mktemp(f"gloo{nproc}")
            specs = [spec for provider in PROVIDERS.get(nproc, []) for spec in provider(out)]
            rc = launch_job(JobSpec(out_dir=str(out.resolve()), cases=tuple(specs)), nproc, quiet=True).returncode
            errs = sorted((out / "errors").glob("*.txt")) if (out / "errors").exists() else []
            done[nproc] = GlooJob(rc, "\n".join(e.read_text() for e in errs), out)
        return done[nproc]

    return get
