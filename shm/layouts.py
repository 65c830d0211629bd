"""Record layouts of the pipeline's rings and stats blocks, defined once.

Page keys and root ids (16 bytes) travel as two little-endian u64 halves (``hi`` holds
the first 8 bytes) because records hold ints and floats only.
"""

from __future__ import annotations

import numpy as np
from sparkcache.shm.records import RecordLayout

# client -> capture: one record per page, one batch per publication.
PUBLISH = RecordLayout(
    "publish",
    1,
    np.dtype(
        [
            ("pub_id", "<u8"),
            ("root_hi", "<u8"),
            ("root_lo", "<u8"),
            ("key_hi", "<u8"),
            ("key_lo", "<u8"),
            ("block_id", "<i8"),
            ("deadline", "<f8"),  # time.monotonic() after which the engine reuses the blocks
            ("reg_gen", "<u4"),
            ("page_index", "<u4"),
            ("npages", "<u4"),
            ("pad", "<u4"),
        ]
    ),
)

# capture -> client: the blocks of ``pub_id`` may be reused.
COMPLETION = RecordLayout(
    "completion",
    1,
    np.dtype([("pub_id", "<u8"), ("status", "<i4"), ("pages_copied", "<u4")]),
)

# capture -> commit: slot ``slot`` (of ``generation``) holds a publication. The slot's own
# header carries everything else, so commit can redo a slot after its own crash.
FILLED = RecordLayout(
    "filled", 1, np.dtype([("slot", "<u4"), ("pad", "<u4"), ("generation", "<u8")])
)

# commit -> capture: slot ``slot`` is FREE again.
FREED = RecordLayout("freed", 1, np.dtype([("slot", "<u4"), ("pad", "<u4"), ("generation", "<u8")]))

# commit -> client: the root of ``pub_id`` is durable (status 0: its index transaction
# committed) or will not be (a DurableStatus naming why). The second acknowledgement:
# COMPLETION says only that the engine's blocks may be reused.
DURABLE = RecordLayout(
    "durable", 1, np.dtype([("pub_id", "<u8"), ("status", "<i4"), ("pad", "<u4")])
)

# client -> maintenance: requests the engine cannot carry out itself, since it only reads
# the index. ``kind`` (sparkcache.protocol.RequestKind) says what ``arg`` and ``seconds``
# mean: a touch (a restore read the prefix ending at page ``arg`` with key ``key``: renew
# its roots' lease and last access), a lease (a lookup counted that prefix: protect its
# roots as read lease ``lease`` for ``seconds`` at most), a release (the read of lease
# ``lease`` is over; key and arg unused), or a quarantine (object ``key`` of generation
# ``arg`` failed verification).
REQUEST = RecordLayout(
    "request",
    2,  # 1 had no lease id
    np.dtype(
        [
            ("kind", "<u4"),
            ("pad", "<u4"),
            ("key_hi", "<u8"),
            ("key_lo", "<u8"),
            ("arg", "<u8"),
            ("lease", "<u8"),  # a read lease's id (protocol.new_lease_id); 0: none
            ("when", "<f8"),  # time.time() of the access
            ("seconds", "<f8"),
        ]
    ),
)

# client -> restore: one record per page, one batch per load. Page ``page_index`` of load
# ``load_id`` (``npages`` pages) is the object ``key`` of the stored prefix, to be written
# into block ``block_id`` of registration ``reg_gen``. ``worker_pid`` and ``worker_start``
# name the restore worker the client expects to do it (its pid and start time from its
# stats slot): any other process drops the load as stale, so a restarted worker never
# writes into blocks the client already gave back to the engine when its predecessor died.
LOAD = RecordLayout(
    "load",
    2,  # 1 had worker_start in wall-clock time (psutil create_time)
    np.dtype(
        [
            ("load_id", "<u8"),
            ("key_hi", "<u8"),
            ("key_lo", "<u8"),
            ("block_id", "<i8"),
            ("worker_start", "<f8"),  # the addressed worker's process_start
            ("worker_pid", "<u4"),
            ("reg_gen", "<u4"),
            ("page_index", "<u4"),
            ("npages", "<u4"),
        ]
    ),
)

# restore -> client: load ``load_id`` is finished; the restore worker writes nothing more
# into its blocks. ``pages``: pages 0..pages-1 were verified and written (a prefix);
# ``status``: a sparkcache.protocol.LoadStatus. For a verification failure, ``bad_index``
# is the page that failed (== ``pages``) and ``bad_key``/``bad_generation`` name its
# object, for the client to ask maintenance to quarantine it; otherwise bad_index is -1.
LOADED = RecordLayout(
    "loaded",
    1,
    np.dtype(
        [
            ("load_id", "<u8"),
            ("status", "<i4"),
            ("pages", "<u4"),
            ("bad_index", "<i4"),
            ("pad", "<u4"),
            ("bad_key_hi", "<u8"),
            ("bad_key_lo", "<u8"),
            ("bad_generation", "<u8"),
        ]
    ),
)

# Why a worker dropped a record it popped as malformed; one stats counter each. Names
# are append-only: their order is the order of the stats fields.
DROP_REASONS = (
    "framing",  # a publication's records are not one whole batch of npages records
    "mixed",  # pub id, root, registration or npages differ within one publication
    "page_index",  # page_index is not exactly 0..npages-1
    "deadline",  # not finite, or further ahead than the release timeout allows
    "block",  # a block id outside the registered geometry
    "slot",  # a slot id outside the arena
    "request",  # a request of unknown kind, or a field out of range
    "stale",  # a load addressed to another restore worker (a predecessor, now dead)
)

# How the restore worker read the pages it restored; one stats counter of bytes each
# (``read_bytes_<path>``). Append-only, like every stats field:
READ_PATHS = (
    "direct",  # past the page cache (sparkcache.store.direct): the cold case
    "cached",  # through the page cache, for being mostly in it already
    # through the page cache, for a direct read being impossible there: a filesystem or
    # device refusing O_DIRECT, or an object file of its own (not a pack)
    "buffered",
    # fetched from the fleet's cluster, the local store lacking them (docs/fleet.md)
    "cluster",
)

# Upper bounds (seconds) of the buckets of each worker's item durations (capture: one
# publication; commit: one root; restore: one load; maintenance: one slice), defined once
# for the workers that count and the metrics that expose them. A worker counts each
# duration in the first bucket whose bound holds it (``dur_le_<i>``); longer ones are only
# in ``dur_count``, which is the +Inf bucket. Spans 1 ms (a small restore) to 30 s (a
# commit of a 300k-token root on a busy disk); append-only, like every stats field.
DURATION_BUCKETS_S = (
    0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0,
)
# Items handled, by the status each ended with: ``outcome_<n>`` counts status number n of
# the role's status enum (sparkcache.protocol: capture CaptureStatus, commit DurableStatus,
# restore LoadStatus). Enough for the largest of them.
OUTCOMES = 8

# One slot per worker of a rank (see workers.lifecycle.Role), written by that worker.
WORKER_STATS = RecordLayout(
    "worker_stats",
    # 13 had no read_bytes_cluster or fleet_bad_pages; 12 had no disk_full or free_bytes;
    # 11 no read lease releases or yields; 10 no leased or yielded bytes; 9 no
    # read_bytes; 7 no index_sync; 6 no pooled_bytes; 5 no entries, outcomes or durations;
    # 4 no lock wait and no maintenance backlog; 3 no roots_superseded; 2 no pid_start and
    # no drop_stale; 8 had pid_start in
    # wall-clock time (psutil create_time)
    14,
    np.dtype(
        [
            ("pid", "<u4"),
            ("state", "<u4"),
            ("heartbeat", "<f8"),  # time.time() of the last loop iteration
            ("started", "<f8"),
            # publications captured / roots committed / slices run / loads answered
            ("processed", "<u8"),
            ("failed", "<u8"),  # items refused or failed (each also counted by its cause)
            ("item_errors", "<u8"),  # unexpected exceptions while handling one item
            ("backlog", "<u8"),  # bytes above the low watermark (maintenance)
            ("used_bytes", "<u8"),  # store bytes (maintenance)
            ("copy_bytes", "<u8"),  # capture: bytes copied into slots; restore: into blocks
            ("copy_seconds", "<f8"),  # capture: time spent copying them; restore: loading
            # capture: bytes of its slots faulted in so far, by the background prefault
            # (workers/prefault.py); slots x slot bytes once done.
            ("prefaulted_bytes", "<u8"),
            # The worker's start (shm.segment.process_start): with pid, tells it from a later
            # process given the same pid. A load is addressed to this pair.
            ("pid_start", "<f8"),
            # commit: roots its commits superseded (a later turn holding their pages)
            ("roots_superseded", "<u8"),
            # commit: seconds its commits waited for the index's write lock, in all and
            # the longest wait
            ("lock_wait_s", "<f8"),
            ("lock_wait_max_s", "<f8"),
            # maintenance (docs/maintenance.md), updated every slice and every second:
            ("over_max_bytes", "<u8"),  # used bytes above max_bytes
            ("episode_since", "<f8"),  # time.time() the pressure episode began; 0: none
            ("selected_roots", "<u8"),  # roots chosen for eviction, not yet removed
            ("selected_bytes", "<u8"),  # and their bytes
            ("collectable_objects", "<u8"),  # objects awaiting collection (refcount 0)
            ("collectable_bytes", "<u8"),
            ("slice_last_s", "<f8"),  # the last slice's duration
            ("slice_max_s", "<f8"),  # the longest since the worker started
            # fsyncs of the index after slices that collected, outside them: seconds in
            # all, and the longest (PageStore.sync_collected)
            ("index_sync_s", "<f8"),
            ("index_sync_max_s", "<f8"),
            ("evicted_roots", "<u8"),  # roots removed whole, in all
            ("cut_roots", "<u8"),  # times a root was left cut short by a slice's budget
            ("skipped_roots", "<u8"),  # LRU roots passed over: evicting them frees nothing
            ("reclaimed_bytes", "<u8"),  # bytes eviction made collectable, in all
            ("collected_objects", "<u8"),  # objects deleted and unlinked, in all
            ("collected_bytes", "<u8"),
            ("io_bytes", "<u8"),  # bytes unlinked and written to the index, in all
            ("duty", "<f8"),  # share of the last 10 s spent in slices
            ("refusing_since", "<f8"),  # time.time() used bytes reached the hard cap; 0: below
            ("refused_s", "<f8"),  # seconds at the hard cap (publications refused), in all
            *[(f"drop_{reason}", "<u8") for reason in DROP_REASONS],
            ("entries", "<u8"),  # maintenance: roots in the store
            *[(f"outcome_{n}", "<u8") for n in range(OUTCOMES)],
            ("dur_count", "<u8"),  # item durations counted, in all (the +Inf bucket)
            ("dur_sum_s", "<f8"),  # and their sum
            *[(f"dur_le_{i}", "<u8") for i in range(len(DURATION_BUCKETS_S))],
            # maintenance: bytes of collected files kept for commits to overwrite
            # (sparkcache/store/pool.py), on disk but not in used_bytes; read once a second
            ("pooled_bytes", "<u8"),
            # restore: bytes of the pages it restored, by how they were read
            *[(f"read_bytes_{path}", "<u8") for path in READ_PATHS],
            # maintenance (docs/maintenance.md, "Leases at the cap"): roots whose
            # conversation lease still runs and their bytes, counted once a second; roots
            # removed whole while theirs ran, and bytes eviction made collectable from
            # such roots, in all
            ("leased_roots", "<u8"),
            ("leased_bytes", "<u8"),
            ("yielded_roots", "<u8"),
            ("yielded_bytes", "<u8"),
            # maintenance: releases of read leases taken from the rings, and roots eviction
            # took whose read lease, past its grace, yielded (a release that never came)
            ("read_releases", "<u8"),
            ("read_yielded_roots", "<u8"),
            # commit and maintenance: items and slices that failed on a full filesystem
            # (sparkcache/store/space.py), in all; maintenance: the store filesystem's
            # free bytes, read every slice
            ("disk_full", "<u8"),
            ("free_bytes", "<u8"),
            # restore: pages fetched from the fleet's cluster that failed verification
            # (planted, damaged or cut short: a miss, recomputed), in all
            ("fleet_bad_pages", "<u8"),
        ]
    ),
)


# Engine-side counters, per reason: the reasons the engine's code counts (sparkcache/
# client.py, sparkcache/prefix_lookup.py), each with its own field; a reason not listed
# (one added to the code later) is counted in ``other``, so nothing is lost. Append-only,
# like every stats field: their order is the order of the fields.
LOOKUP_MISS_REASONS = ("unavailable", "evicting", "not_stored", "no_lease", "error", "other")
SKIP_REASONS = (
    "register_failed", "mode_off", "restore_only", "unregistered", "supervisor_absent",
    "store_mismatch", "instance_mismatch", "page_too_large",
    "pending_limit", "capture_down", "store_full", "no_slot", "bad_request", "too_large",
    "ring_full", "error", "other",
)
# A reported load's status: sparkcache.protocol.LoadStatus in lower case, and the
# client's own: ``worker_gone`` (the worker died with it), ``supervisor_absent``,
# ``store_mismatch``, ``instance_mismatch`` and ``restore_down`` (none to hand it over to
# after it waited in the client's queue: ``sparkcache.attachment``).
LOAD_RESULTS = (
    "ok", "partial", "corrupt", "unregistered", "bad_block", "failed", "malformed", "stale",
    "worker_gone", "supervisor_absent", "store_mismatch", "instance_mismatch",
    "restore_down", "other",
)
# Why a load or a synchronous restore the engine asked for missed.
# No room (the load ring, the client's loads in flight) is none: such a load waits in the
# client's queue.
LOAD_MISS_REASONS = (
    "mode_off", "unregistered", "duplicate_load", "empty_load", "bad_block", "bad_request",
    "supervisor_absent", "store_mismatch", "instance_mismatch", "restore_down", "error",
    "not_stored", "corrupt", "worker_gone", "other",
)

# One slot per engine-side writer of a rank (sparkcache.engine_stats: slot 0 the rank's
# SparkCacheClient, slot 1 the prefix lookups of vLLM's scheduler, rank 0's block only),
# written by that process alone every 0.5 s at most; the supervisor serves them. Counters
# count from 0 in each engine process.
ENGINE_STATS = RecordLayout(
    "engine_stats",
    # 1 had pid_start in wall-clock time (psutil create_time); 2 had no load queue; 3 no
    # reasons for a supervisor of another store or instance, or a page too large
    4,
    np.dtype(
        [
            ("pid", "<u4"),
            ("pad", "<u4"),
            ("pid_start", "<f8"),  # the writer's process_start
            ("written", "<f8"),  # time.time() of this record
            ("lookups", "<u8"),  # prefix lookups asked
            ("lookup_tokens", "<u8"),  # tokens they asked about, beyond the caller's own
            ("lookup_hit_tokens", "<u8"),  # of those, tokens found (and leased)
            *[(f"lookup_miss_{reason}", "<u8") for reason in LOOKUP_MISS_REASONS],
            ("publications", "<u8"),  # publications taken (handed to capture)
            ("published_pages", "<u8"),
            *[(f"skip_{reason}", "<u8") for reason in SKIP_REASONS],
            ("expired", "<u8"),  # publications released at their deadline, unanswered
            ("loads", "<u8"),  # loads handed to the restore worker
            *[(f"load_{status}", "<u8") for status in LOAD_RESULTS],
            ("loaded_pages", "<u8"),  # pages the restore worker wrote for the engine
            ("restored_pages", "<u8"),  # pages read by the engine itself (restore)
            *[(f"load_miss_{reason}", "<u8") for reason in LOAD_MISS_REASONS],
            ("checksum_failures", "<u8"),  # pages the engine saw fail verification
            ("requests_dropped", "<u8"),  # requests to maintenance that found no room
            ("ring_errors", "<u8"),  # ring faults (the client reconnected)
            ("loads_queued", "<u8"),  # loads that waited in the client's queue for room
            ("load_queue_seconds", "<f8"),  # the time they waited there, summed
            ("load_queue_depth", "<u8"),  # a gauge: loads waiting there now
        ]
    ),
)


def split_key(hex_key: str) -> tuple[int, int]:
    raw = bytes.fromhex(hex_key)
    return int.from_bytes(raw[:8], "little"), int.from_bytes(raw[8:16], "little")


def join_key(hi: int, lo: int) -> str:
    return (int(hi).to_bytes(8, "little") + int(lo).to_bytes(8, "little")).hex()


def join_keys(hi: np.ndarray, lo: np.ndarray) -> list[str]:
    """``join_key`` of each pair, for a whole batch at once: one hex conversion, 0.25 us
    a key against ``join_key``'s 1.2 (a 300k-token publication has 18,750 keys, and each
    of capture, commit and restore joined them all)."""
    pairs = np.empty((len(hi), 2), "<u8")
    pairs[:, 0] = hi
    pairs[:, 1] = lo
    text = pairs.tobytes().hex()
    width = 2 * 2 * pairs.itemsize  # two halves a key, two hex digits a byte
    return [text[i : i + width] for i in range(0, len(text), width)]
