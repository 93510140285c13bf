"""The runtime fit of what a pipeline pays between its actions (``dynmb.costmodel.p2pfit``) and
its use by ``job_calibration`` and ``CostModel``, on synthetic action tables with a known truth.

The synthetic steps come from a small executor of a 2-rank 1F1B schedule that behaves as the
recorded gloo runs do: every forward is preceded by a gap (building its inputs); a receive waits
``recv_s`` after the later of its posting and the sender's end plus the P2P time (the
rendezvous: the message moves once both ends are there); rank 1's clock starts ``offset_s``
after rank 0's.
"""

from __future__ import annotations

import numpy as np
import pandas as pd
import pytest

from dynmb.core.config import ModelConfig
from dynmb.costmodel import CalibrationStep, CommModel, CostModel, job_calibration
from dynmb.costmodel.p2pfit import LATENCY_MIN_RECEIVES, action_gaps, gap_per_op, p2p_latency, receive_waits
from dynmb.schedule.builders import one_f_one_b
from dynmb.timing.simulate import simulate_costs

F_S, B_S, COMM_S = 0.010, 0.020, 0.0002


class _PerRow(CostModel):
    """F and B take ``F_S`` and ``B_S`` per row on every stage; P2P ``COMM_S`` (no ``kind`` of its
    own: not registered)."""

    def _predict(self, stage, op, b, s, a):
        return (F_S if op == "F" else B_S) * b


def _model() -> CostModel:
    return _PerRow(ModelConfig.preset("tiny"), 2, comm=CommModel(alpha_s=COMM_S, bytes_per_s=1e30))


def _execute(m: int, recv_s: float, gap_s: float, offset_s: float = 0.0, run_id: str = "r",
             step: int = 0, rows: int = 1) -> tuple[pd.DataFrame, float]:
    """One step of 2-stage 1F1B with ``m`` microbatches of ``rows`` rows, as an actions table, and
    its makespan."""
    schedule = one_f_one_b(2, m)
    end: dict[tuple[int, str, int], float] = {}
    table, nxt, prev_end = [], [0, 0], [0.0, 0.0]
    while any(nxt[r] < len(schedule.ranks[r]) for r in range(2)):
        for r in range(2):
            if nxt[r] >= len(schedule.ranks[r]):
                continue
            a = schedule.ranks[r][nxt[r]]
            src = (a.stage - 1, "F", a.mb) if a.op == "F" and a.stage > 0 else \
                (a.stage + 1, "B", a.mb) if a.op == "B" and a.stage < 1 else None
            if src is not None and src not in end:
                continue                                  # its message is not sent yet
            posted = prev_end[r] + (gap_s if a.op == "F" else 0.0)
            start = posted if src is None else max(posted, end[src] + COMM_S) + recv_s
            finish = start + (F_S if a.op == "F" else B_S) * rows
            end[(a.stage, a.op, a.mb)], prev_end[r], nxt[r] = finish, finish, nxt[r] + 1
            clock = offset_s * r
            table.append(dict(run_id=run_id, step=step, rank=r, dp_rank=0, stage=a.stage, op=a.op, mb=a.mb,
                             batch=rows, padded_len=64, start_s=start - clock, end_s=finish - clock,
                             wait_s=start - posted, pred_s=(F_S if a.op == "F" else B_S) * rows, comm_s=COMM_S))
    return pd.DataFrame(table), max(end.values())


def test_receive_waits_recover_the_injected_wait_whatever_the_clock_offset():
    for offset in (0.0, 0.003, -0.0025):
        acts, _ = _execute(12, recv_s=0.006, gap_s=0.0015, offset_s=offset)
        waits = receive_waits(acts)
        assert len(waits) == 2 * 12                                 # every F of stage 1, every B of stage 0
        assert waits.to_numpy() == pytest.approx(0.006, abs=1e-9)
        assert p2p_latency([waits]) == pytest.approx(0.006, abs=1e-9)
        gaps = gap_per_op([action_gaps(acts)])
        assert gaps["F"] == pytest.approx(0.0015, abs=1e-9) and gaps["B"] == pytest.approx(0.0, abs=1e-9)
    # two data-parallel replicas (ranks 2 and 3 hold replica 1's stages): each receive pairs with
    # its own replica's sender
    acts, _ = _execute(12, recv_s=0.006, gap_s=0.0015, offset_s=0.003)
    other, _ = _execute(12, recv_s=0.004, gap_s=0.0015)
    two = pd.concat([acts, other.assign(dp_rank=1, rank=other["rank"] + 2)], ignore_index=True)
    assert np.sort(receive_waits(two).to_numpy()) == pytest.approx([0.004] * 24 + [0.006] * 24, abs=1e-9)
    # no wait beyond the P2P model: nothing to add; too few receives: no estimate
    assert p2p_latency([receive_waits(_execute(12, recv_s=0.0, gap_s=0.0015)[0])]) == pytest.approx(0.0, abs=1e-9)
    few = receive_waits(_execute(2, recv_s=0.006, gap_s=0.0)[0])
    assert len(few) < LATENCY_MIN_RECEIVES and p2p_latency([few]) is None


def test_cost_model_adds_the_receive_latency_to_receiving_actions_only(tmp_path):
    cm = _model().with_recv_latency(0.004)
    assert float(cm.predict(0, "F", 1, 64)) == pytest.approx(F_S)            # stage 0 receives no forward
    assert float(cm.predict(1, "F", 1, 64)) == pytest.approx(F_S + 0.004)
    assert float(cm.predict(0, "B", 1, 64)) == pytest.approx(B_S + 0.004)
    assert float(cm.predict(1, "B", 1, 64)) == pytest.approx(B_S)            # the last stage's comes from the loss
    assert float(cm.comm_s(1, 64)) == pytest.approx(COMM_S)                   # the wire's time is the profile's
    d = cm.to_dict()
    assert d["comm"]["recv_latency_s"] == 0.004
    assert CommModel(**d["comm"]).recv_latency_s == 0.004
    with pytest.raises(ValueError, match="recv_latency_s"):
        CommModel(recv_latency_s=-1e-3)


def _predicted_step(cm: CostModel, m: int, rows: int) -> float:
    costs = cm.stage_costs(np.full(m, rows), np.full(m, 64))
    return simulate_costs(one_f_one_b(2, m), costs, cm.comm_s(np.full(m, rows), np.full(m, 64))).makespan_s


def test_job_calibration_predicts_a_step_of_many_microbatches_as_well_as_one_of_few():
    """The same 32 rows as 4 microbatches of 8 rows or 16 of 2 (6 ms of rendezvous wait per
    receive, 1.5 ms before every forward): calibrated on the job's history of both, the model
    predicts both splits within 1%. Without the P2P fit (scale and compute overhead only, the
    rule before) the 16 microbatches are predicted 11% too fast and the 4 only 3%: the split with
    more microbatches looks cheaper than it is, and a planner comparing them leans to it."""
    truth = dict(recv_s=0.006, gap_s=0.0015, offset_s=0.002)
    splits = {4: 8, 16: 2}                                   # microbatches: rows each
    history = [CalibrationStep(f"m{m}", _execute(m, run_id=f"m{m}", step=k, rows=rows, **truth)[0])
               for k in range(2) for m, rows in splits.items()]
    cal = job_calibration(history, "m16", 2)
    assert cal.latency_s == pytest.approx(0.006, rel=1e-6)
    assert cal.gap_s["F"] == pytest.approx(0.0015, rel=1e-6)
    assert all(v == pytest.approx(1.0) for per in cal.scale.values() for v in per)      # compute as profiled
    assert cal.overhead_s.get("F", 0.0) == pytest.approx(0.0) and cal.overhead_s.get("B", 0.0) == pytest.approx(0.0)
    calibrated = _model().with_scale(cal.scale).with_overhead(**cal.per_action_s).with_recv_latency(cal.latency_s)
    before = _model().with_scale(cal.scale).with_overhead(**cal.overhead_s)
    errors = {}
    for m, rows in splits.items():
        measured = _execute(m, rows=rows, **truth)[1]
        errors[m] = (_predicted_step(calibrated, m, rows) / measured - 1, _predicted_step(before, m, rows) / measured - 1)
        assert abs(errors[m][0]) < 0.03
    assert errors[16][1] < -0.08 and errors[4][1] > -0.04
