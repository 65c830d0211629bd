"""KV cache tensors another process can open: the one descriptor format of both paths.

CPU: the engine allocates its layer tensors in one shared-memory segment
(``SharedKVCaches``); a descriptor names the segment and each tensor's byte offset,
dtype, shape and stride. CUDA: a descriptor carries each tensor's CUDA IPC handle
(``storage._share_cuda_()``), keyed by the device's UUID, with dtype, shape, stride and
storage offset. ``open_tensors`` turns either back into tensors in the capture process.
"""

from __future__ import annotations

import contextlib
import os
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from sparkcache.registry import (  # noqa: F401  (where callers have found them)
    read_registry,
    registry_path,
    write_registry,
)
from sparkcache.segments import engine_segment_role, is_engine_segment
from sparkcache.shm.segment import (
    Segment,
    SegmentSpec,
    segment_name,
    sweep,
)

KV_SPEC = SegmentSpec("kvcache", 1)
_ALIGN = 4096
# Payload address range -> segment name, for every SharedKVCaches alive in this process.
_LIVE: dict[tuple[int, int], str] = {}


def unlink_dead_engines(instance: str, rank: int) -> list[str]:
    """Unlink the KV segments of ``rank`` left by engine processes that died without
    unlinking them (SIGKILLed: the OOM killer, say), and return their names. Only a
    supervisor's start swept them, so while one ran each engine restart left its
    predecessor's KV cache (tens of GiB) in /dev/shm, and the new one's ``adopt`` could
    then find no room. ``shm.segment.sweep``'s rules, for this rank's engine segments
    only; a worker that still maps one keeps its mapping."""
    prefix = segment_name(instance, rank, "kv")[1:]  # engine_segment_role(pid): kv<pid>
    return sweep(instance, only=lambda name: name.startswith(prefix) and is_engine_segment(name))


def _dtype(name: str) -> torch.dtype:
    dt = getattr(torch, name.removeprefix("torch."), None)
    if not isinstance(dt, torch.dtype):
        raise ValueError(f"dtype {name!r}: not a torch dtype")
    return dt


class SharedKVCaches:
    """Layer tensors of one engine rank in one shared-memory segment (created 0600,
    unlinked by ``close``)."""

    def __init__(self, seg: Segment, tensors: list[torch.Tensor]) -> None:
        self._seg = seg
        self.tensors = tensors

    @classmethod
    def create(
        cls, instance: str, rank: int, shapes: list[tuple[int, ...]], dtype: torch.dtype
    ) -> SharedKVCaches:
        elsize = torch.empty(0, dtype=dtype).element_size()
        sizes = [int(np.prod(s)) * elsize for s in shapes]
        offsets, total = [], 0
        for size in sizes:
            offsets.append(total)
            total += (size + _ALIGN - 1) // _ALIGN * _ALIGN
        unlink_dead_engines(instance, rank)  # a dead predecessor's, before ours takes room
        seg = Segment.create(segment_name(instance, rank, engine_segment_role(os.getpid())),
                             KV_SPEC, total, reserve=True)
        try:
            base = seg.array(np.uint8, 0, total)
            tensors = [
                torch.from_numpy(base[off : off + size]).view(dtype).view(shape)
                for off, size, shape in zip(offsets, sizes, shapes, strict=True)
            ]
            addr = base.ctypes.data
            caches = cls(seg, tensors)
        except BaseException:
            # A SIGTERM's SystemExit lands here as readily as anywhere else: left in
            # /dev/shm, the segment would hold its memory until a sweep.
            seg.close()
            raise
        _LIVE[(addr, addr + total)] = seg.name  # no call from here on: no signal lands
        return caches

    @classmethod
    def adopt(cls, instance: str, rank: int, tensors: list[torch.Tensor]) -> SharedKVCaches:
        """Move the memory of ``tensors`` (private CPU memory: vLLM's CPU KV cache) into
        one new segment, in place. Each distinct storage's bytes are copied into the
        segment and the storage's data pointer is swapped with the copy's, so every
        tensor and view over it, wherever vLLM keeps them, reads and writes the segment
        from then on, and the private memory is freed. Capture and restore then reach
        the engine's blocks as they reach a GPU's through CUDA IPC: the engine copies
        nothing. OSError (ENOSPC) when /dev/shm cannot hold them, nothing changed."""
        if not can_adopt():
            raise RuntimeError("this torch cannot swap a storage's memory (_swap_data_ptr_)")
        storages: dict[int, torch.UntypedStorage] = {}
        for t in tensors:
            if t.is_cuda:
                raise ValueError("adopt takes CPU tensors")
            storages.setdefault(t.untyped_storage().data_ptr(), t.untyped_storage())
        offsets, total = [], 0
        for st in storages.values():
            offsets.append(total)
            total += (st.nbytes() + _ALIGN - 1) // _ALIGN * _ALIGN
        unlink_dead_engines(instance, rank)  # a dead predecessor's KV takes the room
        seg = Segment.create(segment_name(instance, rank, engine_segment_role(os.getpid())),
                             KV_SPEC, total, reserve=True)
        try:
            base = seg.array(np.uint8, 0, total)
            for st, off in zip(storages.values(), offsets, strict=True):
                copy = torch.from_numpy(base[off : off + st.nbytes()]).untyped_storage()
                copy.copy_(st)
                # The storage now owns the segment's bytes (and keeps its numpy view
                # alive); ``copy`` owns the private memory, freed when it goes.
                st._swap_data_ptr_(copy)
        except BaseException:
            # A signal's exit mid-way (the CPU engine's KV takes seconds to copy) left
            # the name in /dev/shm until a sweep. The storages swapped already keep the
            # mapping through their views, so only the name goes.
            seg.close()
            raise
        addr = base.ctypes.data
        _LIVE[(addr, addr + total)] = seg.name
        return cls(seg, list(tensors))

    def close(self) -> None:
        addr = [k for k, v in _LIVE.items() if v == self._seg.name]
        for k in addr:
            del _LIVE[k]
        self.tensors = []
        self._seg.close()


def can_adopt() -> bool:
    """Whether this torch can move a CPU storage's memory in place (``adopt``)."""
    return hasattr(torch.UntypedStorage, "_swap_data_ptr_")


def describe(tensors: list[torch.Tensor]) -> dict[str, Any]:
    """The descriptor of ``tensors`` (all CPU in a SharedKVCaches, or all CUDA)."""
    if all(t.is_cuda for t in tensors):
        return {"kind": "cuda", "tensors": [_describe_cuda(t) for t in tensors]}
    out = []
    for t in tensors:
        ptr = t.untyped_storage().data_ptr()
        where = [(lo, name) for (lo, hi), name in _LIVE.items() if lo <= ptr < hi]
        if t.is_cuda or not where:
            raise ValueError("CPU KV tensors must come from SharedKVCaches (shared memory)")
        lo, name = where[0]
        out.append(
            {
                "segment": name, "offset": ptr - lo, "dtype": str(t.dtype),
                "shape": list(t.shape), "stride": list(t.stride()),
                "storage_offset": t.storage_offset(),
                "storage_bytes": t.untyped_storage().nbytes(),
            }
        )
    return {"kind": "cpu", "tensors": out}


def _describe_cuda(t: torch.Tensor) -> dict[str, Any]:
    share = t.untyped_storage()._share_cuda_()
    props = torch.cuda.get_device_properties(t.device)
    return {
        "device_uuid": str(props.uuid), "dtype": str(t.dtype), "shape": list(t.shape),
        "stride": list(t.stride()), "storage_offset": t.storage_offset(),
        "share": [x.hex() if isinstance(x, bytes) else x for x in share],
    }


@dataclass
class OpenedTensors:
    """Tensors opened from a descriptor; ``close`` drops the mappings."""

    tensors: list[torch.Tensor]
    _segments: list[Segment]

    def close(self) -> None:
        self.tensors = []
        for seg in self._segments:
            seg.close()
        self._segments = []


def open_tensors(desc: dict[str, Any]) -> OpenedTensors:
    if desc["kind"] == "cuda":
        return OpenedTensors([_open_cuda(d) for d in desc["tensors"]], [])
    segs: dict[str, Segment] = {}
    tensors = []
    try:
        for d in desc["tensors"]:
            seg = segs.get(d["segment"])
            if seg is None:
                seg = segs[d["segment"]] = Segment.attach(d["segment"], KV_SPEC)
                # Map every page now (one read per page): the first capture would
                # otherwise pay a fault per 4 KiB inside its deadline.
                int(seg.array(np.uint8, 0)[::4096].sum())
            offset, nbytes = int(d["offset"]), int(d["storage_bytes"])
            if offset < 0 or nbytes < 0:
                # Segment.array counts from the payload, and numpy only from the mapping's
                # start: a negative offset reached the segment's header, which capture
                # then stored as KV bytes and a restore overwrote (a count of -1 is
                # numpy's "the rest").
                raise ValueError(f"KV tensor at offset {offset} of {nbytes} bytes in "
                                 f"{d['segment']}: expected both at least 0")
            raw = seg.array(np.uint8, offset, nbytes)
            flat = torch.from_numpy(raw).view(_dtype(d["dtype"]))
            tensors.append(flat.as_strided(d["shape"], d["stride"], d["storage_offset"]))
    except BaseException:
        for seg in segs.values():
            seg.close()
        raise
    return OpenedTensors(tensors, list(segs.values()))


def _open_cuda(d: dict[str, Any]) -> torch.Tensor:
    index = next(
        i for i in range(torch.cuda.device_count())
        if str(torch.cuda.get_device_properties(i).uuid) == d["device_uuid"]
    )
    share = list(d["share"])
    share[0] = index
    for i in (1, 4, 6):  # the handle fields travel as hex text
        if isinstance(share[i], str):
            share[i] = bytes.fromhex(share[i])
    with torch.cuda.device(index):
        storage = torch.UntypedStorage._new_shared_cuda(*share)
    flat = torch.empty(0, dtype=_dtype(d["dtype"]), device=f"cuda:{index}")
    flat.set_(storage.untyped() if hasattr(storage, "untyped") else storage)
    return flat.as_strided(d["shape"], d["stride"], d["storage_offset"])


def page_layout(tensors: list[torch.Tensor], block_dim: int) -> str:
    """What fixes the bytes of one page, and nothing else: per layer tensor in order, its
    dtype and its shape without the block dimension (K/V, block size = page tokens, heads,
    head size). A page's bytes are each tensor's block in logical order (``BlockViews``),
    so neither the number of blocks (sized by vLLM at every start) nor the strides (the
    attention backend's physical order) change them and neither is part of the layout.
    The one place a namespace's ``kv_layout`` comes from."""
    if not tensors:
        raise ValueError("no KV tensors")
    parts = []
    for t in tensors:
        if not 0 <= block_dim < t.dim():
            raise ValueError(f"block_dim {block_dim} out of range for shape {list(t.shape)}")
        per_page = [int(n) for i, n in enumerate(t.shape) if i != block_dim]
        parts.append(f"{str(t.dtype).removeprefix('torch.')}{per_page}")
    return f"pages/v1:{len(tensors)}:" + ";".join(parts)


# An integer type of each element size: a tensor seen through it moves the same bytes, by
# kernels every dtype's tensor has (a float8 tensor has no index_copy_ of its own; vLLM
# keeps fp8 caches as uint8, another engine may not).
_SAME_SIZE_INT = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def _blocks_first(t: torch.Tensor, block_dim: int) -> torch.Tensor:
    """``t`` with its block dimension first, as integers of its element size: a view,
    whatever its strides."""
    return t.movedim(block_dim, 0).view(_SAME_SIZE_INT[t.element_size()])


class BlockViews:
    """Block ``b`` of every layer tensor, as one page of bytes: for each tensor in turn,
    its ``outer`` runs of ``inner`` bytes (``outer`` = the product of the dimensions
    before the block dimension; for a [K/V, blocks, ...] layer, K then V).

    ``gather_runs`` copies many blocks run-major (every block's first run, then every
    block's second run...), which is what a capture slot holds: each run of each tensor is
    then one C-level gather over the blocks (``np.take``; ``index_select`` on a CUDA
    device) instead of a copy per block and run, whose per-call cost is a sixth of
    copying 32 KiB. A page's bytes are its runs in order, so one block gathered alone is
    its page. A tensor that is not contiguous is one run per block, in logical order: on a
    CUDA device gathered and placed with one ``index_select`` / ``index_copy_`` over its
    blocks like the others, in host memory through torch block by block. Callers
    bounds-check blocks."""

    def __init__(self, tensors: list[torch.Tensor], block_dim: int) -> None:
        self.tensors = tensors
        self.block_dim = block_dim
        self.num_blocks = min(t.shape[block_dim] for t in tensors)
        # Per tensor: a uint8 (outer, blocks, inner) view, or None where the tensor is not
        # contiguous; for a CPU tensor also as numpy (np.take, np.copyto).
        self._grids: list[torch.Tensor | None] = []
        self._host: list[np.ndarray | None] = []
        self.run_bytes: list[int] = []
        self._block_bytes: list[int] = []  # per tensor, one block's bytes (its runs')
        for t in tensors:
            per_block = t.select(block_dim, 0).numel() * t.element_size()
            self._block_bytes.append(per_block)
            if not t.is_contiguous():
                self._grids.append(None)
                self._host.append(None)
                self.run_bytes.append(per_block)
                continue
            outer = int(np.prod(t.shape[:block_dim]))
            grid = t.view(torch.uint8).view(outer, t.shape[block_dim], -1)
            self._grids.append(grid)
            self._host.append(None if t.is_cuda else grid.numpy())
            self.run_bytes += [per_block // outer] * outer
        self.page_bytes = sum(self.run_bytes)
        # Each host grid as one flat byte view and its (outer, blocks, inner): a run is a
        # slice of it (2.6 us a page of four runs), where indexing the array took ~6 us
        # (under a profiler); a restore's per-page CPU is what bounds it at small pages.
        self._flat = [(memoryview(h.reshape(-1)), *h.shape) for h in self._host
                      if h is not None]
        # On a CUDA device every tensor crosses in one transfer per call, whatever its
        # strides: a copy per block of a view that is not contiguous (vLLM 0.33's over
        # LBNHC memory, the FLASH_ATTN default on Hopper) was that many small synchronous
        # transfers per layer.
        self._device = all(t.is_cuda for t in tensors)
        odd = [t.dtype for t in tensors if t.element_size() not in _SAME_SIZE_INT]
        if self._device and odd:
            raise ValueError(f"KV tensors of {odd[0]}: elements of 1, 2, 4 or 8 bytes only")
        self._staging: torch.Tensor | None = None

    def page_layout(self) -> str:
        """``page_layout`` of the registered tensors: the namespace's ``kv_layout``."""
        return page_layout(self.tensors, self.block_dim)

    def _check(self, buf: np.ndarray, nbytes: int) -> None:
        if buf.dtype != np.uint8 or not buf.flags.c_contiguous or buf.size < nbytes:
            raise ValueError(f"page buffer: expected {nbytes} contiguous bytes")

    def gather(self, block: int, out: np.ndarray) -> None:
        """Copy block ``block`` of every tensor, in order, into the bytes ``out``."""
        self.gather_runs([block], out)

    def gather_runs(self, blocks: list[int], out: np.ndarray) -> None:
        """Copy ``blocks`` into ``out`` run-major: run ``r`` of block ``blocks[j]`` lands at
        ``sum(run_bytes[:r]) * n + j * run_bytes[r]`` (``n = len(blocks)``)."""
        n = len(blocks)
        self._check(out, n * self.page_bytes)
        if self._device:
            self._gather_device(blocks, out)
            return
        idx = np.asarray(blocks, dtype=np.intp)
        off = 0
        for t, grid, size in zip(self.tensors, self._host, self._block_bytes, strict=True):
            if grid is None:
                for j, block in enumerate(blocks):
                    at = off + j * size
                    dst = torch.from_numpy(out[at : at + size]).view(t.dtype)
                    src = t.select(self.block_dim, block)
                    dst.view(src.shape).copy_(src)
                off += n * size
                continue
            outer, _, inner = grid.shape
            for o in range(outer):
                # mode="clip" writes straight into ``out``; "raise" would buffer the copy.
                np.take(grid[o], idx, axis=0, out=out[off : off + n * inner].reshape(n, inner),
                        mode="clip")
                off += n * inner

    def _gather_device(self, blocks: list[int], out: np.ndarray) -> None:
        """Per tensor: one ``index_select`` into a device staging buffer laid out like
        ``out``'s share of that tensor, then one transfer to the host (a copy per block and
        run would be that many small synchronous transfers). Staging one tensor at a time
        keeps the capture process's device memory to a layer's share of a slot. A transfer
        to pageable memory returns once the bytes have landed, so the caller may hand the
        slot on at once."""
        n, device = len(blocks), self.tensors[0].device
        sizes = [n * size for size in self._block_bytes]
        if self._staging is None or self._staging.numel() < max(sizes):
            self._staging = torch.empty(max(sizes), dtype=torch.uint8, device=device)
        idx = torch.tensor(blocks, dtype=torch.long).to(device)
        host = torch.from_numpy(out)
        off = 0
        for t, grid, size in zip(self.tensors, self._grids, sizes, strict=True):
            staged = self._staging[:size]
            if grid is None:  # one run per block: the block in logical order
                first = _blocks_first(t, self.block_dim)
                torch.index_select(first, 0, idx,
                                   out=staged.view(first.dtype).view(n, *first.shape[1:]))
            else:
                outer, _, inner = grid.shape
                torch.index_select(grid, 1, idx, out=staged.view(outer, n, inner))
            host[off : off + size].copy_(staged)
            off += size

    def scatter_pages(self, blocks: list[int], pages: np.ndarray,
                      stream: torch.cuda.Stream | None = None) -> None:
        """Write ``pages`` (``len(blocks)`` rows of ``page_bytes``, each a page as
        ``gather`` gives it: the form a store object holds) into ``blocks``, and return
        once the bytes are in place. Each run of each contiguous CPU tensor is one C-level
        assignment over the blocks. On a CUDA device the pages cross in one host-to-device
        copy (asynchronous when ``pages`` is page-locked) and are placed with one
        ``index_copy_`` per tensor, all on ``stream`` (else the current stream), which is
        synchronised before returning. Callers bounds-check blocks."""
        n = len(blocks)
        if (pages.dtype != np.uint8 or pages.ndim != 2 or pages.shape[0] < n
                or pages.shape[1] != self.page_bytes or not pages.flags.c_contiguous):
            raise ValueError(f"pages: expected {n} contiguous rows of {self.page_bytes} bytes")
        if n == 0:
            return
        if self._device:
            self._scatter_device(blocks, pages[:n], stream)
            return
        idx = np.asarray(blocks, dtype=np.intp)
        off = 0
        for t, host, size in zip(self.tensors, self._host, self._block_bytes, strict=True):
            if host is None:  # not contiguous: through torch, block by block
                for j, block in enumerate(blocks):
                    dst = t.select(self.block_dim, block)
                    src = torch.from_numpy(pages[j, off : off + size])
                    dst.copy_(src.view(t.dtype).view(dst.shape))
                off += size
                continue
            outer, _, inner = host.shape
            for o in range(outer):
                host[o][idx] = pages[:n, off : off + inner]
                off += inner

    def _scatter_device(self, blocks: list[int], pages: np.ndarray,
                        stream: torch.cuda.Stream | None) -> None:
        n, device = len(blocks), self.tensors[0].device
        cuda = device.type == "cuda"  # (tests run this path on CPU tensors too)
        if cuda:
            stream = stream or torch.cuda.current_stream(device)
        with torch.cuda.stream(stream) if cuda else contextlib.nullcontext():
            size = n * self.page_bytes
            if self._staging is None or self._staging.numel() < size:
                self._staging = torch.empty(size, dtype=torch.uint8, device=device)
            staged = self._staging[:size].view(n, self.page_bytes)
            staged.copy_(torch.from_numpy(pages), non_blocking=True)
            idx = torch.tensor(blocks, dtype=torch.long).to(device, non_blocking=True)
            off = 0
            for t, grid, size in zip(self.tensors, self._grids, self._block_bytes, strict=True):
                if grid is None:  # one run per block: the block in logical order
                    first = _blocks_first(t, self.block_dim)
                    src = staged[:, off : off + size].view(first.dtype)
                    first.index_copy_(0, idx, src.view(n, *first.shape[1:]))
                else:
                    outer, _, inner = grid.shape
                    src = staged[:, off : off + size].view(n, outer, inner)
                    grid.index_copy_(1, idx, src.transpose(0, 1))
                off += size
        if cuda:  # the host rows may be reused, and the caller reports the blocks written
            stream.synchronize()

    @property
    def host_runs(self) -> bool:
        """Whether every tensor is contiguous host memory: then ``page_runs`` can hand a
        block's runs to a file read, which lands the page in place."""
        return all(h is not None for h in self._host)

    def page_runs(self, block: int) -> list[memoryview]:
        """Block ``block``'s runs, in page order, as writable byte views of the tensors
        themselves (``host_runs`` only): reading a page into them is its scatter."""
        runs = []
        for flat, outer, blocks, inner in self._flat:
            at = block * inner
            for _ in range(outer):
                runs.append(flat[at : at + inner])
                at += blocks * inner
        return runs

    def scatter(self, block: int, data: np.ndarray) -> None:
        """The inverse of ``gather``: write the page ``data`` into block ``block``."""
        self._check(data, self.page_bytes)
        off = 0
        for t, grid, host, size in zip(self.tensors, self._grids, self._host, self._block_bytes,
                                       strict=True):
            if grid is None:
                dst = t.select(self.block_dim, block)
                dst.copy_(torch.from_numpy(data[off : off + size]).view(t.dtype).view(dst.shape))
            else:
                outer, _, inner = grid.shape
                src = data[off : off + size].reshape(outer, inner)
                if host is None:
                    grid[:, block].copy_(torch.from_numpy(src))  # one transfer per tensor
                else:
                    host[:, block] = src
            off += size
