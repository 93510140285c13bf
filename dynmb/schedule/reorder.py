"""Moved to ``dynmb.planning.reorder`` (reordering is a planning pass scored by the simulator,
which this package never imports); this alias stays until every importer has switched
(RESHAPE_MOVES.md), then it goes."""

from __future__ import annotations

from dynmb.planning.reorder import (REORDER_METHODS, OrderEvaluator, default_max_evals, ends_order, reorder,
                                    reorder_order)

__all__ = ["REORDER_METHODS", "reorder", "reorder_order", "OrderEvaluator", "ends_order", "default_max_evals"]
