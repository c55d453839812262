"""The decoder of format v6's prefix stream: a `gaps_prefix` section's four lanes split into
quotient symbols, gaps and value symbols (docs/wire-format.md, "Prefix stream"). The encoder
is torch code (nemo_dcr.wire.prefix)."""

from __future__ import annotations

import numpy as np

from .common import _jit, _jit_inline
from .intrinsics import _be64


PREFIX_LANES = 4  # change i's bits are in lane i % 4: four chains for the decoder to overlap


@_jit_inline
def _prefix_code(a, na, table, bits):
    """(a, na, symbol, status) after the code at the top of the bit buffer a: looked up
    in a decode table of 2**bits slots (-1: no code starts there: status -2, symbol 0)."""
    e = np.int64(table[a >> np.uint64(64 - bits)])
    st = 0
    if e < 0:
        st = -2
        e = 0
    k = e & 15
    return a << np.uint64(k), na - k, e >> 4, st


@_jit_inline
def _prefix_change(buf, t, end, a, na, r, q_table, q_bits, v_table, v_bits):
    """One change of a lane (see prefix_split): the lane's state (next byte t, bits a, of
    which the top na are valid) in and out, with the change's quotient symbol, value
    symbol, r low bits and status (0, -1 the lane ends inside it, -2 an unknown code).
    Written for scalars so that four lanes' states stay in registers: inlined, and
    called four times in a row, their chains overlap. Errors set the status and go on
    with harmless values (the caller stops after the four): no early return."""
    st = 0
    if t > end + 8:  # past the lane's end and the zeros after it
        st = -1
        t = end
    # A refill without a branch, to >= 56 valid bits: a whole word, shifted (the bytes
    # only partly taken are taken again next time). Both codes (<= 13 bits each) and
    # low bits of up to 30 fit; wider ones refill again below.
    a |= _be64(buf, t) >> np.uint64(na)
    t += (63 - na) >> 3
    na |= 56
    a, na, q, sq = _prefix_code(a, na, q_table, q_bits)
    a, na, v, sv = _prefix_code(a, na, v_table, v_bits)
    if sq | sv:
        st = -2
    lowbits = np.uint64(0)
    if r > 30:  # the high r - 30 bits first, then a refill for the rest
        hi = r - 30
        lowbits = a >> np.uint64(64 - hi)
        a <<= np.uint64(hi)
        na -= hi
        if t > end + 8:
            st = -1
            t = end
        a |= _be64(buf, t) >> np.uint64(na)
        t += (63 - na) >> 3
        na |= 56
        lowbits = (lowbits << np.uint64(30)) | (a >> np.uint64(34))
        a <<= np.uint64(30)
        na -= 30
    elif r:
        lowbits = a >> np.uint64(64 - r)
        a <<= np.uint64(r)
        na -= r
    return t, a, na, q, v, lowbits, st


@_jit
def prefix_split(buf, starts, ends, r, q_table, q_bits, v_table, v_bits, qsym, gaps, vsym):
    """Split the PREFIX_LANES bit streams of a `gaps_prefix` section (docs/wire-format.md)
    of qsym.size changes. Change i is in lane i % PREFIX_LANES, MSB first: its quotient's
    code, its value symbol's code, its gap's r low bits. Lane l is buf[starts[l]:ends[l]],
    followed by 16 zero bytes (so that a whole word can always be read). Quotient symbols
    go to qsym, value symbols to vsym, and (q << r) | low bits to gaps (wrapping around
    where that overflows: gaps_join, which turns them into positions, checks q first).

    A code's decode table (prefix.decode_table) has 2**bits slots, indexed by the lane's
    next `bits` bits: (symbol << 4) | the code's length, or -1 where no code starts.

    Returns 0, or -1 a lane ends inside a change, -2 a code not in its table,
    -3 non-zero padding or bytes after a lane's last change."""
    m = qsym.size
    t0, t1, t2, t3 = starts[0], starts[1], starts[2], starts[3]
    e0, e1, e2, e3 = ends[0], ends[1], ends[2], ends[3]
    a0 = a1 = a2 = a3 = np.uint64(0)
    n0 = n1 = n2 = n3 = 0
    ur = np.uint64(r)
    for i in range(0, m, 4):
        t0, a0, n0, q, v, lo, st = _prefix_change(buf, t0, e0, np.uint64(a0), n0, r, q_table, q_bits, v_table, v_bits)
        qsym[i], vsym[i], gaps[i] = q, v, np.int64((np.uint64(q) << ur) | np.uint64(lo))
        if i + 1 < m:
            t1, a1, n1, q, v, lo, s1 = _prefix_change(buf, t1, e1, np.uint64(a1), n1, r, q_table, q_bits,
                                                             v_table, v_bits)
            qsym[i + 1], vsym[i + 1], gaps[i + 1] = q, v, np.int64((np.uint64(q) << ur) | np.uint64(lo))
            st |= s1
        if i + 2 < m:
            t2, a2, n2, q, v, lo, s2 = _prefix_change(buf, t2, e2, np.uint64(a2), n2, r, q_table, q_bits,
                                                             v_table, v_bits)
            qsym[i + 2], vsym[i + 2], gaps[i + 2] = q, v, np.int64((np.uint64(q) << ur) | np.uint64(lo))
            st |= s2
        if i + 3 < m:
            t3, a3, n3, q, v, lo, s3 = _prefix_change(buf, t3, e3, np.uint64(a3), n3, r, q_table, q_bits,
                                                             v_table, v_bits)
            qsym[i + 3], vsym[i + 3], gaps[i + 3] = q, v, np.int64((np.uint64(q) << ur) | np.uint64(lo))
            st |= s3
        if st:  # -1 | -2 is -1: a lane that ends early is reported first
            return st
    for ln, t, na in ((0, t0, n0), (1, t1, n1), (2, t2, n2), (3, t3, n3)):
        n = ends[ln] - starts[ln]
        used = 8 * (t - starts[ln]) - na  # bits read, zeros past the end included
        if used > 8 * n:
            return -1
        pad = 8 * n - used
        if pad >= 8 or (pad and (np.int64(buf[ends[ln] - 1]) & ((1 << pad) - 1)) != 0):
            return -3
    return 0
