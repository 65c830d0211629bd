"""Splitting a popped batch of ring records into the requests it carries (publications
for capture, loads for restore), each checked before a worker acts on it."""

from __future__ import annotations

from collections.abc import Callable, Sequence

import numpy as np


def split_batches(batch: np.ndarray, capacity: int, uniform: Sequence[str],
                  check: Callable[[np.ndarray], str | None] | None = None,
                  ) -> list[tuple[np.ndarray, str | None]]:
    """The requests in ``batch``, each with the reason it is malformed (one of
    ``DROP_REASONS``) or None. A request is the run of records from one with
    ``page_index`` 0 up to the next; records before the first such run are one malformed
    group of their own. A request is ``framing`` unless it has ``npages`` records
    (1..``capacity``); then ``check``'s reason, if any; ``mixed`` unless every field of
    ``uniform`` is the same in all its records (NaN compares unequal: mixed too);
    ``page_index`` unless those run 0..n-1."""
    starts = np.flatnonzero(batch["page_index"] == 0).tolist()
    out: list[tuple[np.ndarray, str | None]] = []
    if not starts or starts[0] > 0:
        out.append((batch[: starts[0] if starts else len(batch)], "framing"))
    for s, e in zip(starts, [*starts[1:], len(batch)][: len(starts)], strict=True):
        recs = batch[s:e]
        n = int(recs["npages"][0])
        reason = None
        if not 0 < n <= capacity or len(recs) != n:
            reason = "framing"
        elif check is not None and (why := check(recs)) is not None:
            reason = why
        elif any((recs[f] != recs[f][0]).any() for f in uniform):
            reason = "mixed"
        elif (recs["page_index"] != np.arange(n)).any():
            reason = "page_index"
        out.append((recs, reason))
    return out
