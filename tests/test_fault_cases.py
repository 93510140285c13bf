"""Issue 40's remaining silent and unclear cases, each checked where it happens (fast) and, where that is
what it takes, in a real subprocess run (slow).

- planning ahead: a planner process killed or stopped does not fail the run: one warning naming the rank
  and the process, then in-line planning with each step's submitted cost model (the same plans); no
  multiprocessing semaphores (no resource tracker to kill, no leaked-semaphore warnings); a shared plan that
  never comes names the owner rank, not a store key;
- a signal sent to torchrun itself ends the job as one sent to the launcher (``launch._Pump``).
"""

from __future__ import annotations

import io
import logging
import os
import signal
import subprocess
import sys
import time

import numpy as np
import pytest

from dynmb.core.config import ModelConfig, PipelineConfig, RunConfig
from dynmb.costmodel import get_cost_model
from dynmb.memory.model import get_memory_model
from dynmb.planning import plan_step
from dynmb.runtime.planahead import PlanAhead
from dynmb.runtime.planshare import PlanShare
from dynmb.costmodel.loader import Models


def _cfg() -> RunConfig:
    return RunConfig(model=ModelConfig.preset("tiny"),
                     pipeline=PipelineConfig(num_stages=2, schedule="1f1b", memory_limit_bytes=24 * 2**20),
                     dataset="gsm8k", global_batch=8, method="dynamic", seed=5, steps=3, warmup=0,
                     backend="gloo", device="cpu", timeout_s=60.0, plan_ahead=1)


def _shapes(plan) -> list[tuple]:
    return [(mb.batch, mb.padded_len, tuple(mb.seq_ids.tolist())) for mb in plan.microbatches]


@pytest.mark.parametrize("sig, says", [(signal.SIGKILL, "died (killed by SIGKILL)"), (signal.SIGSTOP, "stopped")])
def test_a_planner_process_killed_or_stopped_plans_in_line_with_one_warning(sig, says, caplog, monkeypatch):
    monkeypatch.setenv("RANK", "3")
    cfg = _cfg()
    cm, mm = get_cost_model(None, cfg.model, 2), get_memory_model(None, cfg.model, 2)
    batches = [np.random.default_rng(k).integers(8, 200, size=8) for k in range(3)]
    ahead = PlanAhead(1, batches.__getitem__, 2, spec=cfg.plan_spec, model_cfg=cfg.model, memory_model=mm)
    pids = ahead._pool.pids
    try:
        for pid in pids:
            os.kill(pid, sig)
        with caplog.at_level(logging.WARNING, logger="dynmb.runtime.planahead"):
            got = [ahead.get(k, cm)[0][0] for k in range(3)]
    finally:
        ahead.close()
    for k, plan in enumerate(got):
        inline, _, _ = plan_step(batches[k], cfg.plan_spec, model_cfg=cfg.model, models=Models(cm, mm))
        assert _shapes(plan) == _shapes(inline)
    warned = [r.getMessage() for r in caplog.records]
    assert len(warned) == 1 and warned[0].startswith(f"rank 3: planner process {pids[0]} {says}"), warned
    assert "planning in line" in warned[0]
    for pid in pids:                       # reaped: no process left behind
        assert not os.path.exists(f"/proc/{pid}") or "Z" not in open(f"/proc/{pid}/stat").read().split(")")[1][:3]


def test_planning_ahead_uses_no_multiprocessing_semaphores():
    """No resource tracker (killing it left KeyError tracebacks) and nothing on stderr at exit."""
    code = ("import sys, numpy as np\n"
            "from tests.test_fault_cases import _cfg\n"
            "from dynmb.costmodel import get_cost_model\nfrom dynmb.memory.model import get_memory_model\n"
            "from dynmb.runtime.planahead import PlanAhead\n"
            "cfg = _cfg(); cm = get_cost_model(None, cfg.model, 2); mm = get_memory_model(None, cfg.model, 2)\n"
            "a = PlanAhead(1, lambda k: np.arange(8, 16), 1, spec=cfg.plan_spec, model_cfg=cfg.model, memory_model=mm)\n"
            "a.get(0, cm); a.get(1, cm); a.close()\n"
            "assert 'multiprocessing.resource_tracker' not in sys.modules, 'a resource tracker'\n")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300,
                          cwd=os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    assert done.returncode == 0, done.stderr[-2000:]
    assert "leaked" not in done.stderr and "Traceback" not in done.stderr, done.stderr[-2000:]


class _SilentStore:
    """A store whose owner never publishes: ``get`` times out as ``torch.distributed``'s does."""

    def get(self, key: str) -> bytes:
        raise RuntimeError(f"wait timeout after 60000ms, keys: /{key}")

    def set(self, key, value): ...
    def add(self, key, amount): return 0
    def delete_key(self, key): return True


def test_a_plan_that_never_comes_names_the_owner_rank_not_a_store_key():
    share = PlanShare(_SilentStore(), rank=0, world=2, run_id="r")
    with pytest.raises(RuntimeError, match=r"^plan ahead: rank 0 got no plan of step 3 from rank 1, which plans it"):
        share.fetch(3)


class _FakeTorchrun:
    def __init__(self, lines: list[str]) -> None:
        self.stdout = io.StringIO("".join(lines))


def test_torchrun_s_own_death_signal_is_read_and_its_traceback_not_streamed(capsys):
    from dynmb.runtime.launch import _Pump
    from dynmb.runtime.processes import StopSignals

    lines = ["[dynmb step] r step 0: 0.03 s\n",
             "W1206 21:17:17.734000 15398 agent/server/api.py:753] Received 1 death signal, shutting down workers\n",
             "W1206 21:17:17.734000 15398 api.py:1028] Sending process 15403 closing signal SIGHUP\n",
             "W1206 21:17:17.735000 15398 api.py:1028] Sending process 15404 closing signal SIGHUP\n",
             "Traceback (most recent call last):\n", "  File \"run.py\", line 1\n",
             "torch.distributed.elastic.multiprocessing.api.SignalException: Process 15398 got signal: 1\n"]
    pump = _Pump(_FakeTorchrun(lines), None, False, StopSignals())
    pump.run()
    assert (pump.torchrun_signal, pump.closed_workers) == (signal.SIGHUP, 2)
    assert capsys.readouterr().out == lines[0]
    named = _Pump(_FakeTorchrun(["I... Received Signals.SIGTERM death signal, shutting down workers\n"]), None, True,
                  StopSignals())
    named.run()
    assert named.torchrun_signal == signal.SIGTERM


def test_the_planner_processes_die_with_their_rank():
    """A planner process is a plain child with the parent-death signal: killing the rank takes it along."""
    code = ("import os, time, numpy as np\nfrom tests.test_fault_cases import _cfg\n"
            "from dynmb.memory.model import get_memory_model\nfrom dynmb.runtime.planahead import PlanAhead\n"
            "cfg = _cfg(); mm = get_memory_model(None, cfg.model, 2)\n"
            "a = PlanAhead(1, lambda k: np.arange(8, 16), 1, spec=cfg.plan_spec, model_cfg=cfg.model, memory_model=mm)\n"
            "print(*a._pool.pids, flush=True); time.sleep(600)\n")
    proc = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True,
                            cwd=os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    try:
        pids = [int(p) for p in proc.stdout.readline().split()]
    finally:
        proc.kill()
        proc.wait()
    deadline = time.monotonic() + 10
    while any(os.path.exists(f"/proc/{p}") for p in pids) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert pids and not any(os.path.exists(f"/proc/{p}") for p in pids)


def test_a_late_rank_is_named_with_what_it_was_doing():
    import torch.distributed as dist

    from dynmb.runtime.ready import RanksLateError, wait_for_ranks

    store = dist.HashStore()
    store.set("dynmb/ready/r/stages/2", b"1")                  # rank 2 is there; rank 1 never comes
    store.add("dynmb/ready/r/stages/count", 1)
    with pytest.raises(RanksLateError, match=r"^rank 0 waited 0 s \(--timeout\) for rank\(s\) 1, still building"):
        wait_for_ranks(store, "r/stages", 0, 3, 0.2, "building its stages")
    wait_for_ranks(store, "r/stages", 1, 3, 0.2, "building its stages")      # the last to come: no wait


@pytest.mark.slow
def test_a_slow_factory_on_rank_1_gets_rank_1_named(tmp_path):
    """A real 2-rank run whose factory takes 40 s on rank 1, with a 5 s timeout: the one error line names
    rank 1 and its stage build, not rank 0's timed-out receive."""
    done = subprocess.run([sys.executable, "-m", "dynmb.cli", "run", "--model", "tests.bad_factories:slow_on_rank1",
                           "--global-batch", "4", "--memory-limit", "256MiB", "--steps", "2", "--warmup", "0",
                           "--device", "cpu", "--timeout", "5", "--out", str(tmp_path / "out")],
                          capture_output=True, text=True, timeout=300,
                          cwd=os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    assert done.returncode != 0
    errors = [ln for ln in done.stderr.splitlines() if ln.startswith("dynmb run: rank")]
    assert errors and "rank(s) 1, still building its stages" in errors[0], done.stderr[-3000:]
    assert "Traceback" not in done.stderr


def _sampler_rank(rank: int, seed: int, init: str, out: str) -> None:
    import torch.distributed as dist

    from dynmb.api.sampler import DynamicBatchSampler

    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=2)
    try:
        sampler = DynamicBatchSampler(np.arange(10, 42), 8, model="tiny", num_stages=1, memory_limit="64MiB",
                                      num_replicas=2, rank=rank, seed=seed)
        try:
            list(sampler)
            said = "ok"
        except ValueError as e:
            said = str(e)
        with open(f"{out}.{rank}", "w") as f:
            f.write(said)
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("seeds", [pytest.param((0, 0), marks=pytest.mark.slow), (0, 1)])   # ~15 s each, loaded box
def test_replicas_given_different_seeds_are_refused_on_every_rank(seeds, tmp_path):
    from tests.spawn_ranks import spawn_ranks

    init = f"file://{tmp_path / 'rdzv'}"
    codes = spawn_ranks(_sampler_rank, 2, lambda r: (r, seeds[r], init, str(tmp_path / "said")), 120)
    assert codes == [0, 0]
    said = [(tmp_path / f"said.{r}").read_text() for r in (0, 1)]
    if seeds[0] == seeds[1]:
        assert said == ["ok", "ok"]
    else:
        for line in said:
            assert line.startswith("DynamicBatchSampler: rank(s) 1 sample with other settings than rank 0 "
                                   "(rank 1: seed 1 (rank 0: 0))"), line


def _lone_sampler_rank(rank: int, init: str, out: str) -> None:
    """Rank 0 builds and iterates a sampler, rank 1 never does (it idles past rank 0's check timeout)."""
    import time

    import torch.distributed as dist

    from dynmb.api import sampler as sampler_module

    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=2)
    try:
        if rank == 1:
            time.sleep(8)
            return
        sampler_module.REPLICA_CHECK_TIMEOUT_S = 2.0
        sampler = sampler_module.DynamicBatchSampler(np.arange(10, 42), 8, model="tiny", num_stages=1,
                                                     memory_limit="64MiB", num_replicas=2, rank=0)
        try:
            list(sampler)
            said = "ok"
        except RuntimeError as e:
            said = str(e)
        with open(out, "w") as f:
            f.write(said)
    finally:
        dist.destroy_process_group()


def test_a_sampler_built_on_rank_0_only_names_rank_1_instead_of_hanging(tmp_path):
    """The replica check once waited in a collective until the group's timeout when a rank never built its
    sampler; now the waiting rank raises after ``REPLICA_CHECK_TIMEOUT_S``, naming the rank that did not check."""
    from tests.spawn_ranks import spawn_ranks

    init = f"file://{tmp_path / 'rdzv'}"
    codes = spawn_ranks(_lone_sampler_rank, 2, lambda r: (r, init, str(tmp_path / "said")), 120)
    assert codes == [0, 0]
    said = (tmp_path / "said").read_text()
    assert said.startswith("DynamicBatchSampler: rank(s) 1 did not check their sampler's settings within 2 s"), said


def test_the_sampler_refuses_a_rank_outside_its_replicas():
    from dynmb.api.sampler import DynamicBatchSampler

    for kwargs, says in (({"num_replicas": 2.5}, "num_replicas must be a whole number"),
                         ({"num_replicas": 2, "rank": 2}, "rank 2 out of range for 2 replicas"),
                         ({"num_replicas": 0}, "num_replicas must be >= 1")):
        with pytest.raises(ValueError, match=says):
            DynamicBatchSampler(np.full(16, 10), 8, model="tiny", num_stages=1, memory_limit="64MiB", **kwargs)


# ----------------------------------------------------------------------------- corpora
def test_a_corpus_with_a_bom_and_crlf_reads_as_the_plain_one(tmp_path):
    from dynmb.data.corpus import corpus_texts

    plain, odd = tmp_path / "plain.jsonl", tmp_path / "odd.jsonl"
    lines = ['{"text": "hello world"}', '{"text": "a second record"}']
    plain.write_text("\n".join(lines) + "\n", encoding="utf-8")
    odd.write_bytes(b"\xef\xbb\xbf" + "\r\n".join(lines).encode() + b"\r\n")
    assert corpus_texts(odd, ["text"])[0] == corpus_texts(plain, ["text"])[0] == ["hello world", "a second record"]
    txt = tmp_path / "odd.txt"
    txt.write_bytes(b"\xef\xbb\xbffirst paragraph\r\nstill first\r\n\r\nsecond\r\n")
    assert corpus_texts(txt, txt_split="blank")[0][0] == "first paragraph\nstill first"
    assert corpus_texts(txt, txt_split="line")[0] == ["first paragraph", "still first", "second"]


def test_a_field_holding_only_numbers_is_refused_naming_file_and_record(tmp_path):
    from dynmb.data.corpus import CorpusError, corpus_texts

    path = tmp_path / "c.jsonl"
    path.write_text('{"text": "hello", "id": 3}\n{"text": 42, "id": 4}\n')
    with pytest.raises(CorpusError, match=rf"^{path}: record 1 \(0-based\): field\(s\) 'text' is 42: a number, not text"):
        corpus_texts(path, ["text"])
    joined = tmp_path / "j.jsonl"
    joined.write_text('{"text": "hello", "id": 3}\n')
    assert corpus_texts(joined, ["text", "id"], join=" ")[0] == ["hello 3"]      # a number beside text: its digits


def _long_corpus(tmp_path):
    from tests.test_corpus_runs import write_corpus

    pytest.importorskip("tokenizers")
    first, tok = write_corpus(tmp_path / "data")
    second = tmp_path / "data" / "d.jsonl"
    words = first.read_text().split('"text": "')[1].split('"')[0]
    second.write_text("".join('{"text": "%s"}\n' % (words if i != 3 else " ".join([words] * 40)) for i in range(6)))
    return first, second, tok


def test_a_record_longer_than_any_row_stops_tokenizing_at_it_naming_file_and_record(tmp_path, monkeypatch):
    import dynmb.data.tokens as tokens_mod
    from dynmb.data.corpus import CorpusError
    from dynmb.data.tokens import CorpusSource, tokenize

    first, second, tok = _long_corpus(tmp_path)
    monkeypatch.setattr(tokens_mod, "_BATCH", 2)
    real = tokens_mod.get_tokenizer
    batches: list[int] = []

    def counting(*a, **k):
        t = real(*a, **k)
        encode = t.encode_batch
        t.encode_batch = lambda texts: (batches.append(len(texts)), encode(texts))[1]
        return t

    monkeypatch.setattr(tokens_mod, "get_tokenizer", counting)
    source = CorpusSource.create([first, second], "text", str(tok))
    n_first = len(first.read_text().splitlines())
    with pytest.raises(CorpusError, match=rf"^{second}: record 3 \(0-based\) has \d+ tokens, longer than any row "
                                          r"\(the model's max_seq_len 64\)"):
        tokenize(source, max_len=64)
    assert sum(batches) <= n_first + 4 < n_first + 6     # stopped at the batch holding it, not the whole corpus
    assert tokenize(source).num_documents == n_first + 6                                  # no limit: read whole


def test_run_refuses_a_record_no_row_holds_before_torchrun(tmp_path, capsys, monkeypatch):
    from dynmb.cli.main import main

    first, second, tok = _long_corpus(tmp_path)
    monkeypatch.setattr("dynmb.cli.run.run_job", lambda *a, **k: pytest.fail("torchrun started"))
    code = main(["run", "--corpus", str(second), "--field", "text", "--tokenizer", str(tok), "--model",
                 "tiny:max_seq_len=64", "--global-batch", "4", "--memory-limit", "256MiB", "--steps", "1",
                 "--device", "cpu", "--out", str(tmp_path / "out")])
    assert code == 2
    assert not list((tmp_path / "out").rglob("*.npz"))           # no token file of a corpus it refuses
    err = [ln for ln in capsys.readouterr().err.splitlines() if "record" in ln]
    assert len(err) == 1 and f"{second}: record 3 (0-based)" in err[0] and "max_seq_len 64" in err[0], err


# ----------------------------------------------------------------------------- settings refused early
@pytest.mark.parametrize("verb", [["plan", "-o", "p.json"], ["run", "--device", "cpu", "--out", "o"]])
def test_a_global_batch_smaller_than_dp_names_that_not_the_limit(verb, tmp_path, capsys, monkeypatch):
    from dynmb.cli.main import main

    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr("dynmb.cli.run.run_job", lambda *a, **k: pytest.fail("torchrun started"))
    code = main([*verb, "--model", "tiny", "--global-batch", "1", "--dp", "2", "--memory-limit", "256MiB"])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(err) == 1, err
    assert err[0].endswith("error: --global-batch 1 is smaller than --dp 2: every data-parallel replica needs at least "
                           "one sequence of the global batch"), err
    assert not list(tmp_path.iterdir())


# ----------------------------------------------------------------------------- transformers under --recompute
@pytest.mark.parametrize("num_stages", [1, 2])
def test_transformers_stages_recompute_with_exact_gradients(num_stages):
    """A tiny HF Llama built from its config (no hub): loss and every gradient under full recomputation
    equal those without it, and a recomputed stage keeps only its layers' inputs for backward."""
    transformers = pytest.importorskip("transformers")
    import torch

    from dynmb.core.microbatch import Microbatch
    from dynmb.models.hf import HFStageFactory
    from dynmb.models.inputs import make_inputs

    cfg = transformers.LlamaConfig(vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=4,
                                   num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                                   tie_word_embeddings=False)
    factory = HFStageFactory.from_config(cfg, seed=1, dtype=torch.float64)
    stages = [factory.build_stage(s, num_stages) for s in range(num_stages)]
    rng = np.random.default_rng(0)
    lengths = [9, 17, 5]
    tokens = [torch.as_tensor(rng.integers(0, 128, n + 1)) for n in lengths]
    inputs = make_inputs(Microbatch(np.arange(3), lengths, 20, 3), tokens)

    def run(recompute: bool):
        saved: list[int] = []
        with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t.numel()) or t, lambda t: t):
            x = None
            for st in stages:
                x = st(x, inputs, recompute=recompute)
        x.backward()
        grads = {n: p.grad.clone() for st in stages for n, p in st.named_parameters()}
        for st in stages:
            st.zero_grad(set_to_none=True)
        return float(x.detach()), grads, sum(saved)

    loss, grads, held = run(False)
    loss_rc, grads_rc, held_rc = run(True)
    assert loss_rc == pytest.approx(loss, rel=1e-12)
    assert grads.keys() == grads_rc.keys()
    for n in grads:
        assert torch.allclose(grads_rc[n], grads[n], rtol=1e-10, atol=1e-12), n
    assert held_rc < held / 4


def test_a_job_that_does_not_pickle_is_its_own_error_not_a_hang():
    from dynmb.runtime.planahead_procs import PlannerPool

    pool = PlannerPool(1)
    try:
        assert pool.submit(lambda: 1).exception(timeout=60) is not None       # a lambda does not pickle
        assert pool.submit(sorted, [3, 1, 2]).result(timeout=120) == [1, 2, 3]  # the process still serves
    finally:
        pool.close()


def test_preflight_names_a_corpus_document_by_its_file_and_record(tmp_path):
    from dynmb.data.tokens import CorpusSource, CorpusTokens, tokenize
    from dynmb.runtime.preflight import _with_rows

    first, second, tok = _long_corpus(tmp_path)
    tokens = tokenize(CorpusSource.create([first, second], "text", str(tok)))
    n_first = len(first.read_text().splitlines())
    assert tokens.starts == (0, n_first)
    again = CorpusTokens.load(tokens.save(tmp_path / "t.npz"))
    assert again.record_name(n_first + 3) == "d.jsonl record 3" and again.record_name(1) == "c.jsonl record 1"
    rows = np.array([5, n_first + 3, 2])           # the batch's positions 0..2 hold these documents
    said = _with_rows("1 sequence(s) cannot fit even alone: ids [1] with lengths [120]", rows, again)
    assert said == "1 sequence(s) cannot fit even alone: corpus records [d.jsonl record 3] (0-based) with lengths [120]"
    assert _with_rows("ids [0, 2] too long", rows) == "trace rows [5, 2] too long"
