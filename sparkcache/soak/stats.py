"""Percentiles of step times and of bucketed durations."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np


def percentile(values: Sequence[float], q: float) -> float:
    """The ``q``-th percentile of ``values`` (0.0 for none)."""
    return float(np.percentile(values, q)) if len(values) else 0.0


def bucket_quantile(counts: Sequence[int], bounds: Sequence[float], q: float,
                    total: int | None = None) -> float | None:
    """The upper bound of the bucket holding quantile ``q`` of a histogram whose buckets
    (not cumulative) end at ``bounds``; None when it lies past the last bound or nothing
    was counted. ``total``: items counted, those past the last bound included (default:
    the buckets' sum). A bucketed figure says "at most", so it is named ``..._le_s``."""
    total = sum(counts) if total is None else total
    if not total:
        return None
    need = q * total
    seen = 0
    for count, bound in zip(counts, bounds, strict=True):
        seen += count
        if seen >= need:
            return bound
    return None
