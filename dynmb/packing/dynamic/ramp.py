"""Ramped candidates of the ``dynamic`` packer: a split whose first microbatches grow geometrically (the fill).

Why. The busiest GPU of a pipeline idles until the first microbatch has passed every stage before it (the fill;
``dynmb.timing.bounds``: the bound's ``head`` is the cheapest microbatch's forwards up to that GPU), so equal
microbatches trade the fill, ``(P - 1)`` forwards of one of them, against the per-op overhead and small GEMMs of
many small ones (issue 39: at P 16 on short documents these terms were most of dynamic's gap to the ideal).
A ramp breaks the trade. While the pipeline fills, stage 0 runs its forwards back to back, so microbatch
``j + 1`` reaches the last stage about ``F_{j+1} + (P - 1)(F_{j+1} - F_j)`` after ``j``, and the last stage is
busy about ``F_j + B_j ~ 3 F_j`` with ``j``: it never waits while ``F_{j+1} <= (1 + 2 / P) F_j``. A ramp of
microbatches growing by ``growth(P) = 1 + 2 / P`` from ``1 / RAMP_SPAN`` of the body's size up to it cuts the
fill to the ramp's first microbatch's, for a few more microbatches on the ramp's tokens only (about ``P / 2``
body microbatches' worth), and lets the body's microbatches grow where the fill bounded them.

Algorithm (``ramped``; one replica, documents that may share a row, i.e. a document-causal mask). The body is a
candidate's plan; its microbatches with the fewest tokens are emptied, fewest first, until their documents fill
the ramp and one more microbatch (targets ``s_k = s_0 g^k`` below the body's median tokens ``s``, ``s_0 = s / RAMP_SPAN``);
those documents, shortest first, fill the ramp's microbatches in turn (one packed row each, closed nearest its
target or before the longest admissible row; a microbatch holds at least one document; ``fill_runs``), and
what is left fills microbatches of at most ``s`` tokens the same way. The ramp runs first, growing; then the
body's other microbatches and the leftovers in the body's order. The candidate is ranked and chosen like every
other (``Ranker``: in its orders, by the kind's estimate): it is kept only where the estimate says it is faster.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import numpy as np

from dynmb.packing.dynamic.rank import Candidate
from dynmb.packing.rows import Flat, Group, flat_to_groups, groups_to_flat, round_up

__all__ = ["RAMP_SPAN", "Ramp", "growth", "ramp_targets", "ramp_of", "ramped", "fill_runs"]

RAMP_SPAN = 16.0
"""The ramp's first microbatch holds about ``1 / RAMP_SPAN`` of the body's median tokens."""


def growth(num_stages: int) -> float:
    """The ramp's growth per microbatch at P stages: ``1 + 2 / P`` (module doc)."""
    return 1.0 + 2.0 / max(int(num_stages), 1)


def ramp_targets(body_tokens: float, num_stages: int) -> np.ndarray:
    """The ramp's token targets ``s_0 g^k`` below ``body_tokens`` (module doc), growing."""
    g = growth(num_stages)
    k = int(np.floor(np.log(RAMP_SPAN) / np.log(g) - 1e-9)) + 1
    return body_tokens / RAMP_SPAN * g ** np.arange(k)


def fill_runs(docs: np.ndarray, lengths: np.ndarray, targets: list[float], row_cap: int) -> list[np.ndarray]:
    """``docs`` (item positions, in order) cut into runs of about ``targets[k]`` tokens each (the last target
    repeated): a run closes before a document that would take it past its target by more than half that document
    (the runs' tokens land on their targets on average), or past ``row_cap``."""
    runs: list[np.ndarray] = []
    cur: list[int] = []
    tok, k = 0, 0
    for d in docs.tolist():
        length = int(lengths[d])
        if cur and (tok + length > row_cap or tok + length / 2 > targets[min(k, len(targets) - 1)]):
            runs.append(np.array(cur, dtype=np.int64))
            cur, tok, k = [], 0, k + 1
        cur.append(d)
        tok += length
    if cur:
        runs.append(np.array(cur, dtype=np.int64))
    return runs


def _row(docs: np.ndarray, lengths: np.ndarray, round_to: int) -> Group:
    """One packed row of ``docs``."""
    return Group(docs, np.zeros(len(docs), dtype=np.int64), int(round_up(int(lengths[docs].sum()), round_to)), 1)


def _attention(g: Group, lengths: np.ndarray) -> float:
    """``Microbatch.attention_work`` of a group under a document-causal mask: sum of its documents' squares when a
    row holds several, else rows x padded_len^2."""
    docs = np.bincount(g.local_row, minlength=g.batch)
    if np.any(docs > 1):
        return float(np.sum(lengths[g.items].astype(np.float64) ** 2))
    return float(g.batch) * float(g.padded_len) ** 2


@dataclass(frozen=True)
class Ramp:
    """A ramped fill of a body (module doc): the ramp's document runs (one packed row each, in order), the body's
    microbatches kept (their indices, in order) and the runs of the emptied microbatches' other documents."""

    ramp: list[np.ndarray]
    kept: np.ndarray
    rest: list[np.ndarray]


def ramp_of(body: list[np.ndarray], lengths: np.ndarray, num_stages: int, row_cap: int) -> Ramp | None:
    """The ramped fill of the body whose microbatch ``i`` holds the documents ``body[i]`` (item positions into
    ``lengths``; module doc), or None where there is nothing to ramp (a body of fewer microbatches than twice the
    ramp, or a ramp no shorter than two of the shortest documents)."""
    tokens = np.array([int(lengths[g].sum()) for g in body], dtype=np.int64)
    targets = ramp_targets(float(np.median(tokens)), num_stages)
    if len(body) < 2 * len(targets) or float(targets[-1]) < 2 * float(lengths.min()):
        return None
    emptied = np.argsort(tokens, kind="stable")
    n_emptied = int(np.searchsorted(np.cumsum(tokens[emptied]), targets.sum()))
    runs: list[np.ndarray] = []
    gone = np.zeros(0, dtype=np.int64)
    while len(runs) <= len(targets) and n_emptied < len(body):      # every ramp run closed by its target
        n_emptied += 1
        gone = np.sort(emptied[:n_emptied])
        docs = np.concatenate([body[i] for i in gone])
        docs = docs[np.argsort(lengths[docs], kind="stable")]
        runs = fill_runs(docs, lengths, [*targets.tolist(), float(np.median(tokens))], row_cap)
    if len(runs) <= len(targets):
        return None
    kept = np.setdiff1d(np.arange(len(body)), gone)
    return Ramp(runs[:len(targets)], kept, runs[len(targets):])


def ramped(body: Candidate, lengths: np.ndarray, num_stages: int, row_cap: int, round_to: int,
           admissible: Callable[[np.ndarray], np.ndarray]) -> Candidate | None:
    """The ramped candidate of the candidate ``body`` (``ramp_of``), or None (no ramp, or a ramp row no microbatch
    may hold: ``admissible(padded_lens)``, the most rows at each padded length)."""
    groups = flat_to_groups(body.emit(np.arange(len(body.rows))))
    r = ramp_of([g.items for g in groups], lengths, num_stages, row_cap)
    if r is None:
        return None
    new = [_row(d, lengths, round_to) for d in r.ramp + r.rest]
    if np.any(admissible(np.array([g.padded_len for g in new])) < 1):
        return None
    out = new[:len(r.ramp)] + [groups[i] for i in r.kept] + new[len(r.ramp):]

    def emit(order: np.ndarray) -> Flat:
        return groups_to_flat([out[i] for i in order])

    return Candidate(np.array([g.batch for g in out], dtype=np.int64), np.array([g.padded_len for g in out],
                                                                                 dtype=np.int64),
                     np.array([_attention(g, lengths) for g in out]), emit,
                     key=None if body.key is None else ("ramp", body.key))
