"""Zero bubble as published: fed the profiled times of Qi et al., "Zero Bubble Pipeline Parallelism"
(arXiv:2401.10241, Table 9), dynmb's 1F1B and ZB-H1 give the bubble rates of its Table 5 (theory, same
definition: 1 - m (T_F + T_B + T_W) / step)."""

from __future__ import annotations

import numpy as np
import pytest

from dynmb.schedule import build_schedule
from dynmb.schedule.zerobubble import ZBInputs
from dynmb.timing.simulate import simulate_costs

CELLS = [  # model, P, m, (T_F, T_B, T_W, T_comm) of Table 9 (ms), hidden, heads, (1F1B, ZB-H1) of Table 5
    ("1.5B", 8, 24, (18.522, 18.086, 9.337, 0.601), 2304, 24, (0.2431, 0.1585)),
    ("6.2B", 8, 64, (29.935, 29.621, 19.388, 0.535), 4096, 32, (0.1091, 0.0554)),
    ("28.3B", 32, 96, (10.419, 10.207, 7.715, 0.408), 6144, 48, (0.2646, 0.1421)),
]


@pytest.mark.parametrize("name,P,m,times,hidden,heads,published", CELLS)
def test_the_papers_times_give_its_table5_bubbles(name, P, m, times, hidden, heads, published) -> None:
    f, b, w, c = times
    one = np.ones((P, m))
    m_b, m_w = 34 * hidden + 5 * heads * 1024, 32 * hidden          # Table 1, per token
    inp = ZBInputs(f * one, (b + w) * one, b * one, w * one, np.full(m, c), np.ones((P, m), dtype=bool),
                   act=m_b * one, w=m_w * one, tr=0 * one)
    costs = {"F": inp.F, "B": inp.B, "I": inp.I, "W": inp.W}
    for kind, want in zip(("1f1b", "zb-h1"), published):
        sched = build_schedule(kind, P, m) if kind == "1f1b" else build_schedule(kind, P, m, zb_inputs=inp)
        step = simulate_costs(sched, costs, inp.comm).makespan_s
        assert 1 - m * (f + b + w) / step == pytest.approx(want, abs=1e-4), (name, kind)
