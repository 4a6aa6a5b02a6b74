"""The project's one percentile definition: linear interpolation between the nearest ranks, as
numpy's default and `vllm bench serve` (verify and loadtest both report with it)."""

from __future__ import annotations

from collections.abc import Iterable

import numpy as np


def percentiles(values: Iterable[float]) -> dict[str, float | None]:
    """p50, p99 and mean; None without data."""
    values = list(values)
    if not values:
        return {"p50": None, "p99": None, "mean": None}
    return {"p50": float(np.percentile(values, 50)), "p99": float(np.percentile(values, 99)), "mean": float(np.mean(values))}
