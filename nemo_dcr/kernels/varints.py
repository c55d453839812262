"""Unsigned LEB128 varints: encoding, the `runs` position encoding's varints, canonical
parsing, and a rANS stream's model (docs/wire-format.md, "Varints", "rANS streams")."""

from __future__ import annotations

import numpy as np

from .common import _jit, _jit_inline


@_jit_inline
def _put_varint(out, n, v):
    """The unsigned LEB128 of the uint64 v into out from n; returns the next free index."""
    top = np.uint64(0x80)
    while v >= top:
        out[n] = np.uint8((v & np.uint64(0x7F)) | top)
        v = v >> np.uint64(7)
        n += 1
    out[n] = np.uint8(v)
    return n + 1


@_jit
def leb128(x, out):
    """Unsigned LEB128 of every uint64 of x into out (room for 10 bytes each); returns
    the bytes written (the same bytes as wire.varints.leb128_encode)."""
    n = 0
    for i in range(x.size):
        n = _put_varint(out, n, np.uint64(x[i]))
    return n


@_jit
def runs_leb128(p, out):
    """`wire.positions.encode_runs`' varints for strictly increasing uint64 (or uint32)
    positions p: for each run of consecutive positions, the gap from the end of the run
    before it (from 0 for the first), then its length; into out (room for 20 bytes a
    position). Returns the bytes written. One compiled pass instead of numpy's ten steps,
    whose call overhead dominated the records of a few changes for which runs are always
    tried."""
    n = 0
    i = 0
    end = np.uint64(0)  # one past the previous run
    one = np.uint64(1)
    while i < p.size:
        start = np.uint64(p[i])
        j = i + 1
        while j < p.size and np.uint64(p[j]) == np.uint64(p[j - 1]) + one:
            j += 1
        n = _put_varint(out, n, start - end)
        n = _put_varint(out, n, np.uint64(j - i))
        end = np.uint64(p[j - 1]) + one
        i = j
    return n


@_jit
def leb128_parse(buf, start, n, out):
    """Decode up to n canonical unsigned LEB128 varints from buf[start:] into uint64 out
    (size >= n); stops at n or at the end of buf. Returns (varints decoded, end offset),
    or (-1, offset of the bad varint) for one that is truncated, longer than 10 bytes,
    non-minimal or beyond 64 bits (wire.varints.leb128_decode names the reason)."""
    p = start
    k = 0
    size = buf.size
    while k < n and p < size:
        v = np.uint64(0)
        length = 0
        while True:
            if p + length >= size or length >= 10:
                return -1, p
            b = buf[p + length]
            v |= np.uint64(b & 0x7F) << np.uint64(7 * length)
            length += 1
            if b < 0x80:
                break
        if length > 1 and b == 0:
            return -1, p
        if length == 10 and b > 1:
            return -1, p
        out[k] = v
        k += 1
        p += length
    return k, p


@_jit
def model_parse(buf, start, max_alphabet, total, out):
    """A stream's model at buf[start:] as `wire.rans.read_model` reads it, in one compiled
    call instead of varint reads and numpy checks whose call overhead a small record felt
    (two models a joint record): the alphabet size, then that many frequencies into uint64
    out, all canonical varints, 1 <= alphabet <= min(max_alphabet, out.size), every
    frequency <= total and their sum == total. Returns (alphabet, end offset), or (0, start)
    for anything else: the caller's checked path then names what is wrong."""
    k, end = leb128_parse(buf, start, 1, out)
    if k != 1 or out[0] < 1 or out[0] > max_alphabet or out[0] > out.size:
        return 0, start
    alphabet = np.int64(out[0])
    k, end = leb128_parse(buf, end, alphabet, out)
    if k != alphabet:
        return 0, start
    s = np.uint64(0)
    for i in range(alphabet):
        if out[i] > np.uint64(total):
            return 0, start
        s += out[i]
    if s != np.uint64(total):
        return 0, start
    return alphabet, end
