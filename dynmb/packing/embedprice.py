"""What the embedding on the last rank (``PlanSpec.embedding = "last"``, ``dynmb.schedule.embedlast``) adds to a
packer's fast estimate: the last rank also embeds every microbatch (and redoes the lookup in its backward) and two
more messages run per microbatch, so each pipeline's estimate gains ``dynmb.timing.makespan.embed_terms`` of its
microbatches' ``dynmb.timing.embedding.embed_seconds`` (its embed work plus two of its longest messages: with them
an exact estimate bounds the simulated step from above, ``dynmb.timing.estimators``). With the embedding first
(``EmbedPricing.of`` gives None) every estimate is left as it was, bit for bit.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from dynmb.costmodel.base import CostModelLike
from dynmb.timing.embedding import embed_seconds
from dynmb.timing.makespan import embed_terms

__all__ = ["EmbedPricing"]


@dataclass(frozen=True)
class EmbedPricing:
    """The embeds' prices under one cost model (only with the embedding on the last rank)."""

    cost_model: CostModelLike

    @classmethod
    def of(cls, embedding: str, cost_model: CostModelLike) -> "EmbedPricing | None":
        """The pricing where ``embedding`` (``PlanSpec.embedding``) is ``last``; None otherwise (nothing to add)."""
        return cls(cost_model) if embedding == "last" else None

    def seconds(self, rows: Any, padded_len: Any) -> np.ndarray:
        """Embed plus embedding-backward seconds of each microbatch of ``rows`` x ``padded_len`` tokens."""
        fwd, bwd = embed_seconds(self.cost_model, rows, padded_len)
        return np.asarray(fwd + bwd, dtype=np.float64).reshape(-1)

    def added(self, estimates: Any, seconds: np.ndarray, comm_s: Any, sizes: Any) -> np.ndarray:
        """``estimates`` (one per pipeline: the next ``sizes[k]`` microbatches of ``seconds`` / ``comm_s``, as the
        packers' ``makespans`` take them) with each pipeline's embed terms added."""
        seconds = np.asarray(seconds, dtype=np.float64)
        terms = embed_terms((seconds, np.zeros_like(seconds)), comm_s, sizes)
        return np.asarray(estimates, dtype=np.float64) + terms
