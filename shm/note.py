"""A note: one small JSON object in a segment, written once by its creator and never
changed, for processes that find a segment by its name and need to know whose it is
(which store a supervisor serves, say).

Payload layout, NOTE_LAYOUT_VERSION 1:

    0   4   length   bytes of the JSON text
    4   4   crc      CRC-32 of them
    8   ... the JSON text (UTF-8), at most NOTE_MAX_BYTES

Nothing orders the creator's stores for a reader that merely maps the segment (on arm64
another core may see the length before the text it describes), so a reader accepts a
copy only when its CRC matches; a note that does not check out reads as none yet. It is
written before any process is told of its segment's siblings, so a reader that found
those finds it whole.
"""

from __future__ import annotations

import json
import struct
import zlib
from typing import Any

from sparkcache.shm.segment import (
    PAYLOAD_OFFSET,
    LayoutMismatch,
    Segment,
    SegmentError,
    SegmentSpec,
)

NOTE_LAYOUT_VERSION = 1
NOTE_KIND = "note"
NOTE_MAX_BYTES = 4096
_HEAD = struct.Struct("<II")
_SPEC = SegmentSpec(NOTE_KIND, NOTE_LAYOUT_VERSION)


def create_note(name: str, content: dict[str, Any]) -> Segment:
    """Create segment ``name`` holding ``content`` (JSON-serialisable); its creator owns
    it and unlinks it with ``close``."""
    text = json.dumps(content, sort_keys=True).encode()
    if len(text) > NOTE_MAX_BYTES:
        raise ValueError(f"note of {len(text)} bytes: at most {NOTE_MAX_BYTES}")
    seg = Segment.create(name, _SPEC, _HEAD.size + NOTE_MAX_BYTES, reserve=True)
    seg.mm[PAYLOAD_OFFSET + _HEAD.size : PAYLOAD_OFFSET + _HEAD.size + len(text)] = text
    _HEAD.pack_into(seg.mm, PAYLOAD_OFFSET, len(text), zlib.crc32(text))
    return seg


def read_note(name: str) -> dict[str, Any] | None:
    """The note in segment ``name``, or None where there is none that checks out (no
    such segment, another kind, a copy torn by the creator's stores). Raises
    ``ForeignSegment`` for an entry of that name another user owns."""
    try:
        seg = Segment.attach(name, _SPEC)
    except LayoutMismatch:
        return None
    except SegmentError as exc:
        if type(exc) is SegmentError:  # does not exist
            return None
        raise
    try:
        length, crc = _HEAD.unpack_from(seg.mm, PAYLOAD_OFFSET)
        if length > NOTE_MAX_BYTES:
            return None
        start = PAYLOAD_OFFSET + _HEAD.size
        text = bytes(seg.mm[start : start + length])
    finally:
        seg.close()
    if zlib.crc32(text) != crc:
        return None
    try:
        content = json.loads(text)
    except ValueError:
        return None
    return content if isinstance(content, dict) else None
