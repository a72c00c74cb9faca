"""Where each tensor of a model file is, from the file's header alone: safetensors and GGUF.

No tensor byte is read and nothing is mapped: the header is read through ``pread`` in pieces, so
a file that is not what its name says, or ends inside its header, is a ValueError naming it, never
a crash. What the offsets are for: disk streaming reads a unit's tensors in place (in_place.py).
"""
from __future__ import annotations

import json
import os

from ..alignment import align_up
from ..files.raw_io import read_at

MAX_HEADER = 100 << 20  # a larger safetensors header is a damaged file, not a model


def safetensors_tensors(path: str) -> dict[str, tuple[int, int, str]]:
    """Every tensor of a safetensors file by key, from its header alone (no tensor byte is
    read): (byte offset in the file, byte count, the file's dtype name). ValueError for a file
    that is not one."""
    fd = os.open(path, os.O_RDONLY | getattr(os, "O_CLOEXEC", 0))
    try:
        size = os.fstat(fd).st_size
        head = read_at(fd, 8, 0)
        if len(head) < 8:
            raise ValueError(f"{path} is not a safetensors file: shorter than its header")
        n = int.from_bytes(head, "little")
        if n > MAX_HEADER or 8 + n > size:
            raise ValueError(f"{path} is not a safetensors file: a header of {n} bytes")
        header = json.loads(read_at(fd, n, 8).decode("utf-8"))
    finally:
        os.close(fd)
    if not isinstance(header, dict):
        raise ValueError(f"{path} is not a safetensors file: its header is not an object")
    out = {}
    for key, info in header.items():
        if key == "__metadata__" or not isinstance(info, dict):
            continue
        start, end = info.get("data_offsets", (0, -1))
        if isinstance(start, int) and isinstance(end, int) and 0 <= start <= end and 8 + n + end <= size:
            out[key] = (8 + n + start, end - start, str(info.get("dtype")))
    return out


# GGML tensor types: id -> (name, values per block, bytes per block).
GGML_TYPES = {
    0: ("F32", 1, 4), 1: ("F16", 1, 2), 2: ("Q4_0", 32, 18), 3: ("Q4_1", 32, 20), 6: ("Q5_0", 32, 22),
    7: ("Q5_1", 32, 24), 8: ("Q8_0", 32, 34), 9: ("Q8_1", 32, 36), 10: ("Q2_K", 256, 84),
    11: ("Q3_K", 256, 110), 12: ("Q4_K", 256, 144), 13: ("Q5_K", 256, 176), 14: ("Q6_K", 256, 210),
    15: ("Q8_K", 256, 292), 20: ("IQ4_NL", 32, 18), 23: ("IQ4_XS", 256, 136), 24: ("I8", 1, 1),
    25: ("I16", 1, 2), 26: ("I32", 1, 4), 27: ("I64", 1, 8), 28: ("F64", 1, 8), 30: ("BF16", 1, 2),
}
_GGUF_SCALARS = {0: 1, 1: 1, 2: 2, 3: 2, 4: 4, 5: 4, 6: 4, 7: 1, 10: 8, 11: 8, 12: 8}  # value type -> bytes


class _Cursor:
    """Sequential reads of a file's header through pread, in pieces (no map of the file)."""

    def __init__(self, fd: int, size: int) -> None:
        self.fd, self.size, self.pos = fd, size, 0
        self._buf, self._at = b"", 0

    def take(self, n: int) -> bytes:
        if n < 0 or self.pos + n > self.size:
            raise ValueError("ends inside its header")
        if not self._at <= self.pos or self.pos + n > self._at + len(self._buf):
            self._at, self._buf = self.pos, read_at(self.fd, max(n, 1 << 20), self.pos)
        out = self._buf[self.pos - self._at : self.pos - self._at + n]
        self.pos += n
        return out

    def u32(self) -> int:
        return int.from_bytes(self.take(4), "little")

    def u64(self) -> int:
        return int.from_bytes(self.take(8), "little")

    def string(self) -> bytes:
        return self.take(self.u64())

    def skip_value(self, kind: int) -> None:
        if kind == 8:
            self.string()
        elif kind == 9:
            inner, count = self.u32(), self.u64()
            if inner in _GGUF_SCALARS:
                self.take(_GGUF_SCALARS[inner] * count)
            else:
                for _ in range(count):
                    self.skip_value(inner)
        elif kind in _GGUF_SCALARS:
            self.take(_GGUF_SCALARS[kind])
        else:
            raise ValueError(f"an unknown value type {kind}")


def gguf_tensors(path: str) -> dict[str, tuple[int, int | None, str]]:
    """Every tensor of a GGUF file by name, from its header alone: (byte offset in the file, byte
    count (None for a type not in GGML_TYPES), type name). ValueError for a file that is not one."""
    fd = os.open(path, os.O_RDONLY | getattr(os, "O_CLOEXEC", 0))
    try:
        cur = _Cursor(fd, os.fstat(fd).st_size)
        try:
            if cur.take(4) != b"GGUF":
                raise ValueError("no GGUF magic")
            version = cur.u32()
            if version < 2:
                raise ValueError(f"version {version} is not read here")
            count, kvs = cur.u64(), cur.u64()
            alignment = 32
            for _ in range(kvs):
                key, kind = cur.string(), cur.u32()
                if key == b"general.alignment" and kind == 4:
                    alignment = cur.u32() or 32
                else:
                    cur.skip_value(kind)
            infos = []
            for _ in range(count):
                name = cur.string().decode("utf-8")
                dims = [cur.u64() for _ in range(cur.u32())]
                kind, offset = cur.u32(), cur.u64()
                infos.append((name, dims, kind, offset))
        except ValueError as e:
            raise ValueError(f"{path} is not a GGUF file this can read: {e}") from None
        start = align_up(cur.pos, alignment)
    finally:
        os.close(fd)
    out = {}
    for name, dims, kind, offset in infos:
        values = 1
        for d in dims:
            values *= d
        known = GGML_TYPES.get(kind)
        nbytes = values // known[1] * known[2] if known is not None else None
        out[name] = (start + offset, nbytes, known[0] if known is not None else f"type {kind}")
    return out
