"""Roots without a conversation id: vLLM sends every turn of a conversation as a new
request (a new root id) re-sending the whole prefix. A commit supersedes the roots that are
prefixes of its root in the same transaction, so a conversation keeps one root, and a root
that a stored root already extends is not created."""

from __future__ import annotations

import itertools
import secrets
from pathlib import Path

import pytest
from eviction_util import evict
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, rule, run_state_machine_as_test

from sparkcache.identity import Namespace, sequence_keys
from sparkcache.store import PageStore
from sparkcache.store.fsck import fsck
from sparkcache.store.testing import make_root, page_bytes

SIZE = 1024
PAGE = 8
NS = Namespace("model-a", "bfloat16", "nhd", tp_size=1, rank=0, page_tokens=PAGE)
LEASE = 10.0


class Clock:
    def __init__(self) -> None:
        self.now = 1_000_000.0

    def __call__(self) -> float:
        return self.now


@pytest.fixture
def clock() -> Clock:
    return Clock()


@pytest.fixture
def store(tmp_path: Path, clock: Clock) -> PageStore:
    s = PageStore(tmp_path / "store", 0, lease_seconds=LEASE, clock=clock)
    yield s
    s.close()


def rid() -> str:
    return secrets.token_hex(16)


def keys_of(tokens: list[int]) -> list[str]:
    return list(sequence_keys(NS, tokens).all())


def commit(store: PageStore, tokens: list[int], root_id: str | None = None):
    return store.commit(make_root(root_id or rid(), keys_of(tokens), SIZE))


def turns(conv: int, n: int) -> list[list[int]]:
    """The prompts of ``n`` turns of conversation ``conv``: each re-sends the previous one
    and adds a whole number of pages (a turn ending mid-page is the tail case below)."""
    out, tokens = [], [conv] * PAGE
    for t in range(n):
        tokens = tokens + [1000 * conv + t] * (PAGE * (1 + t % 3))
        out.append(tokens)
    return out


def stored_roots(store: PageStore) -> dict[str, list[str]]:
    roots: dict[str, list[str]] = {}
    for root_id, key in store._rconn.execute(
        "SELECT root_id, key FROM root_pages ORDER BY root_id, pos"
    ):
        roots.setdefault(root_id, []).append(key)
    return roots


def prefix_pairs(roots: dict[str, list[str]]) -> list[tuple[str, str]]:
    """(a, b) for every root a that holds the first pages of another root b."""
    return [
        (a, b)
        for (a, ka), (b, kb) in itertools.permutations(roots.items(), 2)
        if kb[: len(ka)] == ka
    ]


def refcount_errors(store: PageStore) -> list[tuple]:
    return store._rconn.execute(
        "SELECT o.key, o.refcount, count(rp.key) FROM objects o "
        "LEFT JOIN root_pages rp ON rp.key = o.key GROUP BY o.key "
        "HAVING o.refcount != count(rp.key)"
    ).fetchall()


def root_of(store: PageStore, tokens: list[int]) -> str:
    keys = keys_of(tokens)
    (found,) = [r for r, k in stored_roots(store).items() if k == keys]
    return found


def test_conversations_keep_one_root_each_and_count_each_page_once(
    store: PageStore, clock: Clock
) -> None:
    convs, per_conv = 4, 6
    prompts = {c: turns(c, per_conv) for c in range(convs)}
    for t in range(per_conv):
        for c in range(convs):
            result = commit(store, prompts[c][t])  # a new request id every turn
            assert result.roots_superseded == (1 if t else 0)
            assert not result.covered
            clock.now += 1
    usage = store.usage()
    assert usage.entries == convs
    longest = sum(len(keys_of(p[-1])) for p in prompts.values())
    assert usage.used_bytes == longest * SIZE
    assert usage.objects == longest and usage.collectable_objects == 0
    assert store.counters.roots_superseded == convs * (per_conv - 1)
    assert prefix_pairs(stored_roots(store)) == []
    assert refcount_errors(store) == []
    for p in prompts.values():
        keys = keys_of(p[-1])
        bufs = [bytearray(SIZE) for _ in keys]
        assert store.restore(keys, bufs) == len(keys)
        assert [bytes(b) for b in bufs] == [page_bytes(k, SIZE) for k in keys]


def test_a_request_saving_as_it_runs_grows_its_root_by_its_new_pages(
    store: PageStore, clock: Clock
) -> None:
    """A request publishes every few pages under its own id (saves while it runs): each
    publication's index work is its new pages, not the prefix its root already holds, so a
    300k-token prefill's ~290 saves do not rewrite its root ~290 times. Rows, references
    and bytes come out as one commit of the whole would leave them; a later turn (a new
    id, as vLLM sends every turn) grows the same root by its new pages too."""
    statements: list[str] = []
    store._wconn.set_trace_callback(statements.append)
    tokens = [7] * (PAGE * 400)
    root_id = rid()
    for end in (100, 200, 203, 400):
        statements.clear()
        result = commit(store, tokens[: end * PAGE], root_id)
        assert (result.pages, result.roots_superseded) == (end, 0)
        clock.now += 1
    # The last save: 197 new pages, a row each; nothing of the 203 held is rewritten.
    rows = [q for q in statements if q.startswith("INSERT INTO root_pages")]
    assert len(rows) == 197, len(rows)
    assert not [q for q in statements if q.startswith("DELETE FROM root_pages")]
    assert stored_roots(store) == {root_id: keys_of(tokens)}
    assert refcount_errors(store) == []
    usage = store.usage()
    assert (usage.entries, usage.objects, usage.used_bytes) == (1, 400, 400 * SIZE)
    (lease_until, last_access) = store._rconn.execute(
        "SELECT lease_until, last_access FROM roots").fetchone()
    assert (lease_until, last_access) == (clock.now - 1 + LEASE, clock.now - 1)
    # The next turn, a new request: the grown root grows again, under its own id, by
    # a row for its one new page; its 400 held keys are compared with the ones this
    # store committed, not read from the index again.
    longer = tokens + [8] * PAGE
    statements.clear()
    store._rconn.set_trace_callback(statements.append)
    assert commit(store, longer).roots_superseded == 1
    assert len([q for q in statements if q.startswith("INSERT INTO root_pages")]) == 1
    assert not [q for q in statements if q.startswith("DELETE FROM root_pages")]
    assert not [q for q in statements if "SELECT key FROM root_pages" in q]
    assert stored_roots(store) == {root_id: keys_of(longer)}
    # Another store (a restarted commit worker) reads them, and comes to the same.
    with PageStore(store.layout.store_dir, 0, lease_seconds=LEASE, clock=clock) as fresh:
        fresh._rconn.set_trace_callback(statements.append)
        statements.clear()
        result = commit(fresh, longer + [9] * PAGE)
        assert (result.pages_written, result.roots_superseded) == (1, 1)
        assert [q for q in statements if "SELECT key FROM root_pages" in q]
    assert refcount_errors(store) == []
    keys = keys_of(longer)
    bufs = [bytearray(SIZE) for _ in keys]
    assert store.restore(keys, bufs) == len(keys)
    assert [bytes(b) for b in bufs] == [page_bytes(k, SIZE) for k in keys]


def test_a_quarantined_page_inside_the_held_prefix_is_written_again(
    store: PageStore, clock: Clock
) -> None:
    """The prefix a root holds is taken as stored only up to a quarantined page: the
    next publication of the sequence writes that page and every one after it that is not
    live, and restores all of it."""
    tokens = [9] * (PAGE * 40)
    root_id = rid()
    commit(store, tokens[: 30 * PAGE], root_id)
    keys = keys_of(tokens)
    (generation,) = store._rconn.execute(
        "SELECT generation FROM objects WHERE key = ?", (keys[10],)).fetchone()
    store.quarantine(keys[10], generation, "test")
    assert store.lookup(keys) == 10
    result = commit(store, tokens, root_id)
    assert result.pages_written == 11  # the quarantined page and the 10 new ones
    bufs = [bytearray(SIZE) for _ in keys]
    assert store.restore(keys, bufs) == len(keys)
    assert [bytes(b) for b in bufs] == [page_bytes(k, SIZE) for k in keys]
    assert refcount_errors(store) == []


def test_evicting_a_conversation_frees_all_its_bytes(store: PageStore, clock: Clock) -> None:
    prompts = {c: turns(c, 4) for c in range(3)}
    for p in prompts.values():
        for tokens in p:
            commit(store, tokens)
            clock.now += 1
    before = store.usage().used_bytes
    clock.now += LEASE + 1
    victim = root_of(store, prompts[0][-1])
    assert store.select_victims(1) == [victim]  # the least recently used conversation
    removed = store.remove_roots([victim])
    assert removed.removed == (victim,)
    freed = store.collect(1000)
    own = len(keys_of(prompts[0][-1])) * SIZE
    assert (freed.bytes, removed.bytes) == (own, own)
    assert store.usage().used_bytes == before - own
    assert store.lookup(keys_of(prompts[0][-1])) == 0
    assert store.lookup(keys_of(prompts[1][-1])) == len(keys_of(prompts[1][-1]))
    assert fsck(store.layout.store_dir, grace_seconds=0).ok


def test_a_shorter_root_after_a_longer_one_creates_no_root(
    store: PageStore, clock: Clock
) -> None:
    older, newer = turns(0, 2)
    long_id = rid()
    commit(store, newer, long_id)
    clock.now += LEASE - 1
    result = commit(store, older)
    assert result.covered and result.roots_superseded == 0
    assert result.pages_written == 0
    assert stored_roots(store) == {long_id: keys_of(newer)}
    assert store.counters.commits_covered == 1
    # The commit of the prefix renewed the root holding it, like an access would.
    clock.now += 2
    assert store.select_victims(10) == []


def test_an_older_turn_redone_under_the_same_id_keeps_the_newer_turn(
    store: PageStore,
) -> None:
    older, newer = turns(0, 2)
    root_id = rid()
    commit(store, newer, root_id)
    assert commit(store, older, root_id).covered
    assert stored_roots(store) == {root_id: keys_of(newer)}


def test_the_same_pages_again_are_one_root(store: PageStore) -> None:
    (tokens,) = turns(0, 1)
    first, second = rid(), rid()
    commit(store, tokens, first)
    assert commit(store, tokens, second).roots_superseded == 1
    # The root keeps the id it was stored with: taking the new one rewrote its rows.
    assert stored_roots(store) == {first: keys_of(tokens)}
    # Its own id again is no supersession.
    assert commit(store, tokens, first).roots_superseded == 0
    assert store.usage().entries == 1
    assert refcount_errors(store) == []


def test_conversations_sharing_a_system_prompt_keep_a_root_each(
    store: PageStore,
) -> None:
    system = [7] * (3 * PAGE)
    a1, b1 = system + [1] * PAGE, system + [2] * PAGE
    a2, b2 = a1 + [3] * 2 * PAGE, b1 + [4] * PAGE
    for tokens in (a1, b1, a2, b2):
        commit(store, tokens)
    roots = stored_roots(store)
    assert sorted(roots.values()) == sorted([keys_of(a2), keys_of(b2)])
    refs = dict(store._rconn.execute("SELECT key, refcount FROM objects"))
    assert [refs[k] for k in keys_of(system)] == [2, 2, 2]
    # The system prompt alone is held by both: nothing new is stored.
    assert commit(store, system).covered
    assert store.usage().entries == 2
    assert store.usage().used_bytes == len(set(keys_of(a2)) | set(keys_of(b2))) * SIZE


def test_a_turn_ending_mid_page_keeps_its_root(store: PageStore) -> None:
    """The next turn holds a full page where this one had its tail page, under another
    key: the new root does not hold the tail, so superseding must not drop it."""
    first = [5] * (2 * PAGE + 3)
    second = first + [6] * (2 * PAGE - 3)
    commit(store, first)
    assert commit(store, second).roots_superseded == 0
    assert store.usage().entries == 2
    assert store.lookup(keys_of(first)) == len(keys_of(first))


def test_a_turn_growing_another_root_replaces_its_own_ids_root_with_a_tail(
    store: PageStore,
) -> None:
    """A request whose earlier publication ended in a tail page publishes again, and what
    it publishes extends another root: that root grows, the request's old root is
    replaced as it always was, and the pages both held keep a reference throughout (no
    removal logged for them, none for a page that is still held)."""
    held = [5] * (3 * PAGE)
    own_id, other_id = rid(), rid()
    commit(store, held[: 2 * PAGE] + [6] * 3, own_id)  # two full pages and a tail
    commit(store, held, other_id)
    before = store._rconn.execute("SELECT coalesce(max(seq), 0) FROM removals").fetchone()[0]
    longer = held + [7] * PAGE
    assert commit(store, longer, own_id).roots_superseded == 1
    assert stored_roots(store) == {other_id: keys_of(longer)}
    assert refcount_errors(store) == []
    removed = [k for (k,) in store._rconn.execute(
        "SELECT key FROM removals WHERE seq > ?", (before,))]
    tail = keys_of(held[: 2 * PAGE] + [6] * 3)[-1]
    assert removed == [tail]
    assert store.lookup(keys_of(longer)) == len(keys_of(longer))


def test_a_lease_on_the_old_prefix_protects_the_new_root(
    store: PageStore, clock: Clock
) -> None:
    older, newer = turns(0, 2)
    commit(store, older)
    # A lookup leases the stored prefix for longer than a root's own lease.
    assert store.lease_prefix(keys_of(older), 100) == len(keys_of(older))
    clock.now += LEASE + 1
    new_id = rid()
    assert commit(store, newer, new_id).roots_superseded == 1
    (held_id,) = stored_roots(store)
    clock.now += LEASE + 1  # past the new turn's own lease, inside the lookup's
    assert store.select_victims(10) == []
    assert store.remove_roots([held_id]).skipped == (held_id,)
    assert evict(store, 10).removed == ()
    clock.now += 100
    assert store.select_victims(10) == [held_id]


def test_random_turns_keep_no_root_a_prefix_of_another(tmp_path: Path) -> None:
    """Conversations that grow, fork at a page boundary (same system prompt, another
    continuation), end mid-page, re-commit older turns, under fresh or reused ids, among
    evictions: no root is ever a prefix of another, refcounts match the references, every
    page a root holds restores, and fsck is clean at the end."""
    counter = itertools.count()

    class Conversations(RuleBasedStateMachine):
        def __init__(self) -> None:
            super().__init__()
            self.clock = Clock()
            self.dir = tmp_path / f"s{next(counter)}"
            self.store = PageStore(self.dir, 0, lease_seconds=LEASE, clock=self.clock)
            self.convs: list[list[int]] = [[0] * PAGE]  # token lists; 0: the system prompt
            self.sent: list[list[int]] = []  # every prompt committed
            self.ids: list[str] = []

        @rule(conv=st.integers(0, 20), pages=st.integers(1, 3), tail=st.integers(0, PAGE - 1))
        def extend(self, conv: int, pages: int, tail: int) -> None:
            tokens = self.convs[conv % len(self.convs)]
            more = [len(self.sent) + 1] * (pages * PAGE + tail)
            self.convs.append(tokens[: len(tokens) // PAGE * PAGE] + more)

        @rule(conv=st.integers(0, 20), reuse=st.booleans())
        def commit_turn(self, conv: int, reuse: bool) -> None:
            tokens = self.convs[conv % len(self.convs)]
            root_id = self.ids[conv % len(self.ids)] if reuse and self.ids else rid()
            self.ids.append(root_id)
            commit(self.store, tokens, root_id)
            self.sent.append(tokens)

        @rule(turn=st.integers(0, 50))
        def commit_an_older_turn(self, turn: int) -> None:
            if self.sent:
                commit(self.store, self.sent[turn % len(self.sent)])

        @rule(seconds=st.floats(0, 2 * LEASE), k=st.integers(0, 3))
        def evict_and_collect(self, seconds: float, k: int) -> None:
            self.clock.now += seconds
            evict(self.store, k)
            self.store.collect(100)

        @invariant()
        def roots_are_maximal_and_whole(self) -> None:
            roots = stored_roots(self.store)
            assert prefix_pairs(roots) == []
            assert refcount_errors(self.store) == []
            assert self.store.usage().entries == len(roots)
            for keys in roots.values():
                bufs = [bytearray(SIZE) for _ in keys]
                assert self.store.restore(keys, bufs) == len(keys)
                assert [bytes(b) for b in bufs] == [page_bytes(k, SIZE) for k in keys]

        def teardown(self) -> None:
            self.store.close()
            report = fsck(self.dir, grace_seconds=0)
            assert report.ok, report.problems

    run_state_machine_as_test(
        Conversations,
        settings=settings(
            max_examples=60,
            stateful_step_count=40,
            deadline=None,
            suppress_health_check=[HealthCheck.too_slow],
        ),
    )
