"""Relative-error non-negative least squares: the one solver behind every cost-model fit.

``nnls_rel(x, t)`` is ``argmin_{c >= 0} sum(((x @ c - t) / t)^2)``: each row of the system is
scaled by ``1 / t`` (so a 1 ms op and a 1 s op weigh alike), the columns by their largest
magnitude (conditioning), and the problem is solved by ``scipy.optimize.nnls`` (Lawson-Hanson
active set). The P2P model (``base.CommModel.fit``), the polynomial fits (``poly``) and the
grid model's packing correction (``grid``) use it.
"""

from __future__ import annotations

import numpy as np
from scipy.optimize import nnls

__all__ = ["nnls_rel"]


def nnls_rel(x: np.ndarray, t: np.ndarray) -> np.ndarray:
    """argmin_{c >= 0} sum(((x @ c - t) / t)^2), columns rescaled for conditioning."""
    a = x / t[:, None]
    scale = np.abs(a).max(axis=0)
    scale[scale == 0] = 1.0
    c, _ = nnls(a / scale, np.ones(len(t)), maxiter=50 * a.shape[1] + 100)
    return c / scale
