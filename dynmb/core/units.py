"""Memory sizes as users write them (``2GiB``, ``512MiB``, ``1.5e9``) and as dynmb prints them."""

from __future__ import annotations

import re

__all__ = ["parse_bytes", "format_bytes"]

_UNITS = {"": 1, "b": 1, "k": 10**3, "kb": 10**3, "m": 10**6, "mb": 10**6, "g": 10**9, "gb": 10**9,
          "t": 10**12, "tb": 10**12, "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40}


def parse_bytes(x: str | int | float) -> int:
    """``'2GiB'`` -> 2147483648; ``'500MB'``, ``'1.5GiB'`` and plain integers also work."""
    if isinstance(x, (int, float)):
        if x <= 0:
            raise ValueError(f"a memory size must be positive, got {x}")
        return int(x)
    m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+(?:[eE][+-]?[0-9]+)?)\s*([a-zA-Z]*)\s*", str(x))
    if not m or m.group(2).lower() not in _UNITS:
        raise ValueError(f"cannot parse memory size {x!r}; use e.g. 2GiB, 512MiB, 3e9 or 1500000000")
    v = int(float(m.group(1)) * _UNITS[m.group(2).lower()])
    if v <= 0:
        raise ValueError(f"a memory size must be positive, got {x!r}")
    return v


def format_bytes(n: float) -> str:
    for unit, k in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if abs(n) >= k:
            return f"{n / k:.2f}{unit}"
    return f"{int(n)}B"
