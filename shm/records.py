"""Record layouts: a numpy structured dtype with a name and a version, defined once.

Fields are little-endian ints and floats only. Single records travel as tuples packed
with ``struct`` (a numpy scalar copy costs ~1-2 us,
``struct`` ~0.15 us); batches travel as numpy structured arrays. Both views are derived
from the same dtype here, so they cannot drift apart.
"""

from __future__ import annotations

import struct
from collections import namedtuple
from dataclasses import dataclass, field

import numpy as np
from sparkcache.shm.segment import dtype_fingerprint

_INT_CODES = {1: "b", 2: "h", 4: "i", 8: "q"}
_FLOAT_CODES = {2: "e", 4: "f", 8: "d"}


def _struct_format(dtype: np.dtype) -> str:
    """The ``struct`` format with the same byte layout as ``dtype`` (padding included)."""
    if dtype.names is None:
        raise ValueError(f"record dtype {dtype}: expected a structured dtype with named fields")
    fmt = ["<"]
    pos = 0
    fields = sorted(((dtype.fields[n][1], n) for n in dtype.names), key=lambda x: x[0])
    for offset, name in fields:
        sub = dtype.fields[name][0]
        if offset < pos:
            raise ValueError(f"record field {name!r} overlaps another field")
        if offset > pos:
            fmt.append(f"{offset - pos}x")
        code = None
        if sub.shape == () and sub.byteorder in "<=|":
            if sub.kind == "i":
                code = _INT_CODES.get(sub.itemsize)
            elif sub.kind == "u":
                code = _INT_CODES.get(sub.itemsize, "").upper() or None
            elif sub.kind == "f":
                code = _FLOAT_CODES.get(sub.itemsize)
        if code is None:
            raise ValueError(
                f"record field {name!r} has type {sub}: expected a little-endian int or "
                "float (bytes fields would read back differently as tuples and as arrays)"
            )
        fmt.append(code)
        pos = offset + sub.itemsize
    if dtype.itemsize > pos:
        fmt.append(f"{dtype.itemsize - pos}x")
    return "".join(fmt)


@dataclass(frozen=True)
class RecordLayout:
    """A fixed-size record type carried by rings. Bump ``version`` on any change of
    meaning, even one that keeps the bytes the same; the dtype fingerprint catches the rest."""

    name: str
    version: int
    dtype: np.dtype
    packer: struct.Struct = field(init=False, repr=False, compare=False)
    # A named tuple of the fields, for readers that want names (stats); rings keep plain
    # tuples, which are cheaper to make.
    named: type = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        dt = np.dtype(self.dtype)
        object.__setattr__(self, "dtype", dt)
        if not self.name.isascii() or not 0 < len(self.name) <= 32:
            raise ValueError(f"record layout name {self.name!r}: expected 1-32 ASCII characters")
        if self.version < 1:
            raise ValueError(f"record layout version {self.version}: expected 1 or more")
        packer = struct.Struct(_struct_format(dt))
        assert packer.size == dt.itemsize
        object.__setattr__(self, "packer", packer)
        object.__setattr__(self, "named", namedtuple(self.name.replace("-", "_"), dt.names))

    @property
    def itemsize(self) -> int:
        return self.dtype.itemsize

    @property
    def fingerprint(self) -> int:
        return dtype_fingerprint(self.dtype)

    def array(self, rows: list[tuple]) -> np.ndarray:
        """Tuples -> a structured array of this layout."""
        return np.array(rows, dtype=self.dtype)

    def shared(self, *names: str) -> SharedFields:
        """Batches of this layout whose records share the values of the fields
        ``names`` (given in the layout's order); see ``SharedFields``."""
        return SharedFields(self, names)


class SharedFields:
    """Makes batches of ``layout``'s records that share the values of the fields ``names``,
    the other fields zero until the caller sets them: one record packed (the rest of its
    bytes zero pad) and its bytes repeated. Setting each shared field across an array
    instead costs a numpy call per field, ~2-3 µs apiece on an engine step's cold caches,
    which made up a third of a publication's cost there."""

    def __init__(self, layout: RecordLayout, names: tuple[str, ...]) -> None:
        dt = layout.dtype
        unknown = [n for n in names if n not in dt.names]
        if unknown or not names:
            raise ValueError(f"{layout.name} records: shared fields {list(names)}: expected "
                             f"one or more of {list(dt.names)}")
        offsets = [dt.fields[n][1] for n in names]
        if offsets != sorted(set(offsets)):
            raise ValueError(f"{layout.name} records: shared fields {list(names)}: expected "
                             f"them once each, in the layout's order {list(dt.names)}")
        fmt = ["<"]
        pos = 0
        for name, offset in zip(names, offsets, strict=True):
            if offset > pos:
                fmt.append(f"{offset - pos}x")
            fmt.append(_struct_format(np.dtype([(name, dt.fields[name][0])]))[1:])
            pos = offset + dt.fields[name][0].itemsize
        if dt.itemsize > pos:
            fmt.append(f"{dt.itemsize - pos}x")
        self.layout = layout
        self._row = struct.Struct("".join(fmt))

    def batch(self, n: int, *values: float) -> np.ndarray:
        """``n`` writable records holding ``values`` (of the shared fields, in order)."""
        return np.frombuffer(bytearray(self._row.pack(*values) * n), self.layout.dtype)
