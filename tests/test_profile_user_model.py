"""Profiling a model of your own: found as ``python -m`` finds it, the quick grid up to ``--max-len``,
and an ETA fitted on what ran (``dynmb.measure.eta``) that the order of the runs makes honest early."""

from __future__ import annotations

import os
import sys

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from dynmb.measure.eta import Eta
from dynmb.measure.grid import default_grid
from dynmb.models.contract import load_factory

MODULE = '''
from dynmb.core.config import ModelConfig
from dynmb.models.families import family_factory


def factory():
    return family_factory(ModelConfig.preset("tiny"))
'''


@pytest.fixture
def away_from_the_path(tmp_path, monkeypatch):
    """The working directory ``tmp_path``, not on ``sys.path`` (as under the ``dynmb`` console script)."""
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(sys, "path", [p for p in sys.path if p not in ("", str(tmp_path), os.getcwd())])
    return tmp_path


def test_a_local_module_is_found_as_python_m_would(away_from_the_path):
    (away_from_the_path / "my_local_model_37.py").write_text(MODULE)
    factory = load_factory("my_local_model_37:factory")
    assert factory.config.name == "tiny" and str(away_from_the_path) in sys.path
    sys.modules.pop("my_local_model_37", None)


def test_a_module_found_nowhere_says_how_in_one_line(away_from_the_path):
    with pytest.raises(ValueError) as e:
        load_factory("no_such_model_37:factory")
    msg = str(e.value)
    assert "\n" not in msg and str(away_from_the_path) in msg and "PYTHONPATH" in msg


@settings(max_examples=40, deadline=None)
@given(quick=st.booleans(), max_len=st.integers(8, 40000))
def test_the_grid_reaches_max_len_and_no_further(quick, max_len):
    lens = sorted({s for _, s, _ in default_grid(quick=quick, max_len=max_len)})
    assert lens[-1] == max_len and all(s <= max_len for s in lens)
    assert all(b / a <= (4 if quick else 2) for a, b in zip(lens, lens[1:]) if a >= (512 if quick else 8192))


def test_quick_with_max_len_beyond_its_grid_measures_the_long_rows():
    lens = {s for _, s, _ in default_grid(quick=True, max_len=1975)}
    assert lens == {32, 128, 512, 1975}


class _Clock:
    def __init__(self) -> None:
        self.t = 0.0

    def __call__(self) -> float:
        return self.t


def test_eta_fits_the_seconds_per_estimated_second_and_per_run():
    """Runs that take 3 x their compute estimate + 0.5 s each: the ETA after a few runs (of both small
    and large estimates) is the true remaining time, where a plain ratio over small runs is not."""
    rng = np.random.default_rng(0)
    est = list(rng.uniform(0.001, 0.01, size=40)) + list(rng.uniform(1.0, 3.0, size=10))
    order = [45, 0, 1, 2, 3] + [i for i in range(50) if i not in (45, 0, 1, 2, 3)]
    clock = _Clock()
    eta = Eta([est[i] for i in order], clock=clock, first_runs=3, first_s=0.0)
    true = [3 * est[i] + 0.5 for i in order]
    for k, i in enumerate(order[:8]):
        clock.t += true[k]
        eta.update(est[i])
    left = eta.remaining()
    assert left is not None and left == pytest.approx(sum(true[8:]), rel=0.05)
