"""``studies/shortdoc/ramp_ends.py``'s re-orderings on hand-made microbatches, and its markdown row."""

from __future__ import annotations

import numpy as np
from studies.shortdoc import ramp_ends

from dynmb.core.microbatch import Microbatch


def _single(seq: int, length: int) -> Microbatch:
    return Microbatch([seq], [length], length, 1)


def _mbs() -> list[Microbatch]:
    # two single long documents, then two many-document microbatches of short ones
    return [_single(0, 1000), _single(1, 1200),
            ramp_ends.packed_row(np.arange(2, 12), np.array([10, 20, 30, 40, 50, 60, 70, 80, 90, 1550])),
            ramp_ends.packed_row(np.arange(12, 16), np.array([5, 15, 25, 1955]))]


def _docs(mbs: list[Microbatch]) -> list[int]:
    return sorted(int(s) for m in mbs for s in m.seq_ids)


def test_ramp_down_moves_the_k_smallest_after_start_to_the_end_largest_first():
    mbs = [_single(i, n) for i, n in enumerate((300, 100, 500, 200, 400))]
    assert ramp_ends.tokens(ramp_ends.ramp_down(mbs, 2)).tolist() == [300, 500, 400, 200, 100]
    # from start 2 on: 200 and 400 are the smallest, the first two stay in front
    assert ramp_ends.tokens(ramp_ends.ramp_down(mbs, 2, 2)).tolist() == [300, 100, 500, 400, 200]


def test_front_ramp_takes_the_shortest_documents_of_many_document_microbatches_growing():
    mbs = _mbs()
    ramp, rest = ramp_ends.front_ramp(mbs, 16, 16.0)
    sizes = ramp_ends.tokens(ramp)
    median = float(np.median(ramp_ends.tokens(mbs)))
    targets = median / 16 * (1 + 2 / 16) ** np.arange(len(ramp))
    assert len(ramp) >= 2 and np.all(sizes <= targets)                   # each at most its growing target
    assert sizes.max() < 1000                                             # below the smallest microbatch
    assert all(len(m.seq_ids) > 0 for m in ramp + rest)
    assert _docs(ramp + rest) == _docs(mbs)                               # every document once
    assert [int(s) for m in rest[:2] for s in m.seq_ids] == [0, 1]        # single documents untouched
    assert {int(s) for m in ramp for s in m.seq_ids} <= set(range(2, 16))


def test_the_markdown_row_has_the_header_s_columns():
    row = ramp_ends.EndsRow("sharegpt", "llama2-7b", 16, "24GiB", "first", "front 1/16 + down 4", 149, 1.933, 9.5,
                            3.5, 0.5, 2.0, 3.5, True)
    assert ramp_ends.markdown(row).count("|") == ramp_ends.HEADER.splitlines()[0].count("|")
    link = ramp_ends.EndsRow("sharegpt", "llama2-7b", 16, "24GiB", "first", "plan, P2P 0", 137, 1.8967, 7.4, 1.2,
                             float("nan"), float("nan"), float("nan"), True)
    assert "nan" not in ramp_ends.markdown(link) and "| +1.2 |  |  |  |" in ramp_ends.markdown(link)
