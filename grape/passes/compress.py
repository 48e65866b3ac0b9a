"""Compact codings of argument deltas: what a shape keeps instead of a whole graph.

A shape's kernel arguments differ from its template's in a few bytes (a length, a pointer), so
the XOR of the two is mostly zero. Two codings of it, each a plain function pair:

- zero coding: a bitmap with one bit per byte, then the non-zero bytes;
- run-length coding: alternating varint lengths of a zero run and a literal run, each literal
  run followed by its bytes.

Examples
--------
>>> delta = xor(bytes(16), bytes(8) + b"\\x01" + bytes(7))
>>> decode(encode(delta, "rle"), "rle", len(delta)) == delta
True
>>> len(encode(delta, "zero")), len(encode(delta, "rle"))
(3, 5)
"""

from __future__ import annotations

import re
from collections.abc import Callable

import numpy as np

from grape.errors import GrapeError

__all__ = ["CODECS", "best", "decode", "encode", "xor"]


def xor(a: bytes, b: bytes) -> bytes:
    if len(a) != len(b):
        raise GrapeError(f"expected argument blocks of one length, found {len(a)} and {len(b)}")
    # As integers: a few hundred bytes XORed at C speed, with no arrays to make.
    return (int.from_bytes(a, "little") ^ int.from_bytes(b, "little")).to_bytes(len(a), "little")


def _varint_of(n: int) -> bytes:
    out = bytearray()
    while True:
        byte, n = n & 0x7F, n >> 7
        out.append(byte | (0x80 if n else 0))
        if not n:
            return bytes(out)


# Run lengths within one kernel's arguments (at most 4 KB before Hopper's 32 KB), looked up: a
# warm start codes tens of thousands of argument deltas, several runs each.
_VARINTS = [_varint_of(n) for n in range(1 << 14)]


def _varint(n: int) -> bytes:
    return _VARINTS[n] if n < len(_VARINTS) else _varint_of(n)


def _read_varint(data: bytes, i: int) -> tuple[int, int]:
    n = shift = 0
    while True:
        if i >= len(data):
            raise GrapeError("expected a complete varint in a run-length coded delta, found the "
                             "end of the data")
        byte = data[i]
        n |= (byte & 0x7F) << shift
        i, shift = i + 1, shift + 7
        if not byte & 0x80:
            return n, i


def _zero_encode(data: bytes) -> bytes:
    arr = np.frombuffer(data, np.uint8)
    return np.packbits(arr != 0).tobytes() + arr[arr != 0].tobytes()


def _zero_decode(blob: bytes, length: int) -> bytes:
    nbits = (length + 7) // 8
    mask = np.unpackbits(np.frombuffer(blob[:nbits], np.uint8))[:length].astype(bool)
    out = np.zeros(length, np.uint8)
    values = np.frombuffer(blob[nbits:], np.uint8)
    if len(values) != mask.sum():
        raise GrapeError(f"expected {int(mask.sum())} non-zero bytes in a zero-coded delta, "
                         f"found {len(values)}")
    out[mask] = values
    return out.tobytes()


_LITERALS = re.compile(rb"[^\x00]+")  # the runs of non-zero bytes


def _rle_encode(data: bytes) -> bytes:
    # Runs found by the regular-expression engine: a family's warm start codes tens of
    # thousands of argument deltas, each mostly zeros.
    out, end = bytearray(), 0
    for m in _LITERALS.finditer(data):
        start, stop = m.span()
        out += _varint(start - end)
        out += _varint(stop - start)
        out += m.group()
        end = stop
    if end < len(data):  # trailing zeros: a zero run with an empty literal
        out += _varint(len(data) - end) + _varint(0)
    return bytes(out)


def _rle_decode(blob: bytes, length: int) -> bytes:
    out, i = bytearray(), 0
    while i < len(blob):
        zeros, i = _read_varint(blob, i)
        literal, i = _read_varint(blob, i)
        out += bytes(zeros) + blob[i:i + literal]
        i += literal
    if len(out) != length:
        raise GrapeError(f"expected {length} bytes from a run-length coded delta, found "
                         f"{len(out)}")
    return bytes(out)


CODECS: dict[str, tuple[Callable[[bytes], bytes], Callable[[bytes, int], bytes]]] = {
    "raw": (bytes, lambda blob, length: blob),
    "zero": (_zero_encode, _zero_decode),
    "rle": (_rle_encode, _rle_decode),
}


def encode(data: bytes, codec: str) -> bytes:
    if codec not in CODECS:
        raise GrapeError(f"expected a codec among {sorted(CODECS)}, found {codec!r}")
    return CODECS[codec][0](data)


def decode(blob: bytes, codec: str, length: int) -> bytes:
    if codec not in CODECS:
        raise GrapeError(f"expected a codec among {sorted(CODECS)}, found {codec!r}")
    return CODECS[codec][1](blob, length)


def best(data: bytes) -> tuple[str, bytes]:
    """The codec that codes ``data`` smallest (the first in ``CODECS`` on a tie), and the
    coded bytes. The zero coding's size is counted, not coded, unless it wins."""
    rle = _rle_encode(data)
    sizes = {"raw": len(data),
             "zero": (len(data) + 7) // 8 + len(data) - data.count(0),
             "rle": len(rle)}
    name = min(sizes, key=sizes.__getitem__)
    return name, rle if name == "rle" else encode(data, name)
