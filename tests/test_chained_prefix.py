"""``chained_prefix`` (a binary search), capture's ``PageStore.lease_prefix`` (the
prefix one root holds) and a restore's ``StoreReader.plan`` (a root's run of pages)
answer what ``stored_prefix`` (a row per key) answers, for the key chains SparkCache
stores and, for the plan, for lists that are not one chain."""

from __future__ import annotations

from pathlib import Path

from hypothesis import given, settings
from hypothesis import strategies as st

from sparkcache.identity import Namespace, sequence_keys
from sparkcache.store import PageStore, index
from sparkcache.store.reader import StoreReader, chained_prefix
from sparkcache.store.testing import make_root

NS = Namespace("m", "float16", "pages", 1, 0, 4)


def stored_prefix(conn, keys: list[str]) -> int:
    """How many leading ``keys`` have a live, referenced object: a row per key."""
    rows = index.rows_for_keys(conn, "refcount, state", keys)
    n = 0
    for key in keys:
        row = rows.get(key)
        if row is None or row[0] == 0 or row[1] != "live":
            break
        n += 1
    return n


def chain(branch: int, length: int) -> list[str]:
    """Keys of a conversation: a shared system prompt, then its own turns."""
    tokens = [1, 2, 3, 4] * 2 + [branch] * 4 * (length - 2)
    return list(sequence_keys(NS, tokens[: 4 * length]).pages)


@settings(max_examples=25, deadline=None)
@given(roots=st.lists(st.tuples(st.integers(0, 3), st.integers(1, 9)), min_size=1,
                      max_size=6),
       removed=st.sets(st.integers(0, 5)),
       query=st.tuples(st.integers(0, 3), st.integers(1, 12)),
       beyond=st.integers(0, 13), hints=st.lists(st.integers(-1, 14), max_size=6))
def test_binary_search_equals_the_full_scan(tmp_path_factory, roots, removed, query,
                                            beyond, hints) -> None:
    store = tmp_path_factory.mktemp("store")
    with PageStore(store, 0) as st_:
        ids = []
        for i, (branch, length) in enumerate(roots):
            root_id = f"{i:032x}"
            st_.commit(make_root(root_id, chain(branch, length), 16))
            ids.append(root_id)
        st_.remove_roots([ids[i] for i in removed if i < len(ids)])
    keys = chain(*query)
    # Not one chain: the query's first pages, then another branch's from there on.
    mixed = keys[: len(keys) // 2] + chain((query[0] + 1) % 4, query[1])[len(keys) // 2 :]
    reader = StoreReader(store, 0)
    try:
        full = stored_prefix(reader.conn, keys)
        assert chained_prefix(reader.conn, keys) == full
        # A restore's plan: the same pages, read by root runs or a row per key.
        assert [p.key for p in reader.plan(keys)] == keys[:full]
        assert [p.key for p in reader.plan(mixed)] == mixed[: stored_prefix(reader.conn, mixed)]
        assert reader.lookup(keys) == full
        # Beyond the pages the caller has: the same prefix, or 0 if it is not longer.
        assert reader.lookup(keys, beyond) == (full if full > beyond else 0)
        # Hints (answers expected) change the probes, never the answer; the right one
        # among wrong ones, in any place, is confirmed.
        assert reader.lookup(keys, beyond, hints) == (full if full > beyond else 0)
        assert reader.lookup(keys, 0, (full,)) == full
        for right in ((full,), (*hints, full), (full, *hints)):
            assert reader.lookup(keys, beyond, right) == (full if full > beyond else 0)
    finally:
        reader.close()
    with PageStore(store, 0) as st_:  # what capture leases and does not copy
        assert st_.lease_prefix(keys, 30) == full


def test_a_plan_of_keys_that_are_not_one_chain_reads_what_each_key_names(
        tmp_path: Path) -> None:
    """A list whose last key ends another root's run: the plan compares every key with
    that root's and reads the rest a row per key, never the root's pages in their place."""
    one, two = chain(1, 8), chain(2, 8)
    with PageStore(tmp_path, 0) as st_:
        st_.commit(make_root("a" * 32, one, 16))
        st_.commit(make_root("b" * 32, two, 16))
    mixed = one[:4] + two[4:]  # the system prompt's two pages are both branches'
    reader = StoreReader(tmp_path, 0)
    try:
        assert [p.key for p in reader.plan(mixed)] == mixed
        assert [p.key for p in reader.plan(two)] == two
        bufs = [bytearray(16) for _ in mixed]
        assert reader.restore(mixed, bufs).pages == 8
    finally:
        reader.close()


def test_a_quarantined_page_mid_chain_ends_the_prefix_there(tmp_path: Path) -> None:
    """Referenced but quarantined: the binary search alone would count it as stored."""
    keys = chain(1, 6)
    with PageStore(tmp_path, 0) as st_:
        st_.commit(make_root("a" * 32, keys, 16))
        generation = st_._wconn.execute(
            "SELECT generation FROM objects WHERE key = ?", (keys[2],)).fetchone()[0]
        st_.quarantine(keys[2], generation, "test")
    reader = StoreReader(tmp_path, 0)
    try:
        assert stored_prefix(reader.conn, keys) == 2
        assert chained_prefix(reader.conn, keys) == 2
        assert reader.lookup(keys) == 2
        # Among the pages the caller has already it is not read, and ends nothing.
        assert reader.lookup(keys, beyond=3) == 6
        assert reader.lookup(keys, beyond=2) == 0
        # The same where a hint is confirmed in one statement.
        assert reader.lookup(keys, hints=(6,)) == 2
        assert reader.lookup(keys, beyond=3, hints=(6,)) == 6
        assert reader.lookup(keys, beyond=2, hints=(6,)) == 0
        bufs = [bytearray(16) for _ in keys]
        assert reader.restore(keys, bufs).pages == 2
    finally:
        reader.close()
    with PageStore(tmp_path, 0) as st_:
        assert st_.lease_prefix(keys, 30) == 2


def test_a_writer_adds_the_quarantined_index_to_an_older_store(tmp_path: Path) -> None:
    """Stores created before the index existed get it when a writer opens them."""
    with PageStore(tmp_path, 0) as st_:
        st_._wconn.execute("DROP INDEX objects_quarantined")
    with PageStore(tmp_path, 0) as st_:
        plan = st_._wconn.execute(
            "EXPLAIN QUERY PLAN SELECT key FROM objects WHERE state = 'quarantined'").fetchall()
    assert "objects_quarantined" in str(plan)


def test_a_right_hint_is_confirmed_in_one_statement(tmp_path: Path) -> None:
    """vLLM's scheduler looks up every request it admits on its own thread: the answer
    the conversation's previous turn stored, or an earlier save's where that one is not
    committed yet, is confirmed by one SQL statement, not a transaction of a search's
    probes."""
    keys = chain(1, 64)
    with PageStore(tmp_path, 0) as st_:
        st_.commit(make_root("a" * 32, keys[:40], 16))
    reader = StoreReader(tmp_path, 0)
    statements: list[str] = []
    reader.conn.set_trace_callback(statements.append)
    try:
        assert reader.lookup(keys) == 40
        searched, statements[:] = len(statements), []
        assert reader.lookup(keys, hints=(40,)) == 40
        assert len(statements) == 1 < searched
        assert reader.lookup(keys, beyond=20, hints=(40,)) == 40
        assert reader.lookup(keys[:40], hints=(40,)) == 40  # the whole chain: no page after
        # The previous turn's 44 pages not committed yet: the save before it ended at 40.
        statements.clear()
        assert reader.lookup(keys, hints=(44, 40, 36)) == 40
        assert len(statements) == 1
        statements.clear()
        assert reader.lookup(keys, hints=(30,)) == 40  # wrong: the search goes on
        assert len(statements) > 1
        assert reader.lookup(keys, hints=(50,)) == 40
        assert reader.lookup(keys, beyond=40, hints=(40,)) == 0  # nothing beyond the caller's
    finally:
        reader.close()
