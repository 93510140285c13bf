"""Plots (matplotlib, Agg backend): pipeline timeline Gantt, method comparison, cost-model fit.

Each function takes tidy pandas tables and writes a PNG; none of them shows a window.
"""

from __future__ import annotations

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import pandas as pd  # noqa: E402

__all__: list[str] = []

# --- gantt (schedule helper) ---

# --- cost_fit (cost helper) ---

# --- compare (lead) ---
