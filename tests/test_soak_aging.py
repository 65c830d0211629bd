"""``soak.aging``: the inventory every read-write lane starts its soak from, written as
SparkCache and as the predecessor each leave it."""

from __future__ import annotations

import json
import stat
import time
from pathlib import Path

import numpy as np
import torch

from sparkcache.identity import KeyChain, Namespace
from sparkcache.kvmem import BlockViews
from sparkcache.soak import engine as engine_mod
from sparkcache.soak.aging import age_store, aged_conversations
from sparkcache.soak.inline import InlineStore
from sparkcache.soak.pages import matches
from sparkcache.soak.params import SoakParams
from sparkcache.soak.workload import first_context
from sparkcache.store import PageStore
from sparkcache.store.reader import StoreReader

NS = Namespace("soak", "float16", "pages", 1, 0, 16)
PAGE = engine_mod.page_bytes(16)
PARAMS = SoakParams(context_min=256, context_max=1024, tail_tokens=128,
                    max_bytes=96 * PAGE, low_watermark_bytes=80 * PAGE)


def test_aged_conversations_fill_up_to_the_low_watermark_with_pages_nobody_asks_for():
    convs = list(aged_conversations(PARAMS, NS))
    pages = sum(len(c.keys) for c in convs)
    assert len(convs) >= 2
    assert 80 - 1024 // 16 < pages <= 80  # up to the watermark, within one conversation
    for c in convs:
        assert c.turn_ends[0] == 256 // 16 and c.turn_ends[-1] == len(c.keys)
        assert all(b - a == 128 // 16 for a, b in zip(c.turn_ends, c.turn_ends[1:], strict=False))
        assert len(c.keys) * 16 <= PARAMS.context_max
    # The soak's own conversations open with other tokens: no page in common.
    live = KeyChain(NS)
    live.extend(first_context(PARAMS, 0, 0))
    assert not set(live.keys) & {k for c in convs for k in c.keys}
    assert [c.keys for c in aged_conversations(PARAMS, NS)] == [c.keys for c in convs]


def test_sparkcache_keeps_one_root_per_aged_conversation(tmp_path: Path):
    written = age_store(tmp_path, PARAMS, NS)
    convs = list(aged_conversations(PARAMS, NS))
    assert written == sum(len(c.keys) for c in convs) * PAGE
    with PageStore(tmp_path, 0) as store:
        usage = store.usage()
        # Ended before the soak: no lease keeps them from eviction.
        leased = store._wconn.execute(
            "SELECT count(*) FROM roots WHERE lease_until > ?", (time.time(),)).fetchone()[0]
    assert usage.entries == len(convs) and usage.used_bytes == written
    assert leased == 0
    reader = StoreReader(tmp_path, 0)
    try:
        keys = convs[-1].keys
        assert reader.lookup(keys) == len(keys)
        bufs = [bytearray(PAGE) for _ in keys]
        assert reader.restore(keys, bufs).pages == len(keys)
        assert all(matches(k, np.frombuffer(b, np.uint8)) for k, b in zip(keys, bufs, strict=True))
    finally:
        reader.close()


def test_the_inline_model_keeps_a_root_per_turn_and_each_page_once(tmp_path: Path):
    kv = torch.zeros(4, 2, 16, 64, dtype=torch.float16)
    views = BlockViews([kv], 0)
    store = InlineStore(tmp_path, views, PARAMS.max_bytes, PARAMS.low_watermark_bytes)
    try:
        convs = list(aged_conversations(PARAMS, NS))
        written = store.age(iter(convs))
    finally:
        store.close()
    assert written == sum(len(c.keys) for c in convs) * views.page_bytes
    roots = sorted((tmp_path / "roots").iterdir())
    assert len(roots) == sum(len(c.turn_ends) for c in convs)
    last = json.loads((tmp_path / "roots" / f"aged0t{len(convs[0].turn_ends) - 1}.json")
                      .read_text())
    assert last == convs[0].keys
    objects = list((tmp_path / "objects").iterdir())
    assert len(objects) == len({k for c in convs for k in c.keys})
    for path in [*roots, *objects]:
        assert stat.S_IMODE(path.stat().st_mode) == 0o600, path
