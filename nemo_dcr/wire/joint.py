"""A record's positions and values as one rANS stream (wire format v5: `gaps_joint` /
`symbols_joint`; docs/wire-format.md).

`gaps_rans` and `symbols_rans` code one symbol per change each, the gap's Rice quotient q
and the value's table symbol v, in two streams: two coding steps per change. Here the
pair is one symbol, j = q * A2 + v (A2 the values' alphabet), in one stream of four
interleaved states (`kernels.joint.rans_encode_joint`): one step per change, and four chains
for the decoder to overlap. Its model is not sent: it is the product of the two streams'
quantised models (`kernels.joint.rans_product_model`), which the sections carry as they would
(the quotients' in the positions section, the values' in the values section). So the
wire pays only the product model's rounding, estimated before coding
(`kernels.joint.joint_excess_bits`) and bounded by `MAX_EXCESS`; a record whose product has too
many cells, or whose rounding would cost more, keeps the two streams.

Sections (everything else as in `gaps_rans` / `symbols_rans`):

    gaps_joint     varint r | quotients' model (A1, A1 frequencies) | varint W |
                   W u16 words of the joint stream | low bits | escapes
    symbols_joint  varint L | varint E | table | values' model (A2 = L + E, A2
                   frequencies) | escaped values
"""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np

from .. import kernels
from .errors import PositionsError
from .gaps import GapsParts, GapsReader
from .rans import model_bytes, rans_stream_chunks, rans_table

# Cells (A1 * A2) a joint model may have: its tables stay small (the encoder's 32 bytes a
# cell, the decoder's 8), and a product over more cells than this rounds too coarsely
# to pay (every occurring cell takes at least 1 of the 2**16 slots).
MAX_CELLS = 1 << 14
# The product model's estimated extra bits, as a fraction of the two streams' bits, up to
# which the encoder takes the joint stream (measured: 0.06-0.09% on +-1-ULP refits).
MAX_EXCESS = 0.002


def _l2_bytes() -> int:
    """The first core's L2 in bytes (sysfs), 0 where it is not told."""
    try:
        for index in Path("/sys/devices/system/cpu/cpu0/cache").glob("index*"):
            if (index / "level").read_text().strip() == "2":
                size = (index / "size").read_text().strip().upper()
                scale = {"K": 1 << 10, "M": 1 << 20}.get(size[-1:], 1)
                return int(size.rstrip("KM")) * scale
    except (OSError, ValueError):
        pass
    return 0


def _per_slot_table() -> bool:
    """Whether joint streams decode through the per-slot table (one 512 KB load a step)
    rather than the indexed one (two loads, 64-128 KB): where an L2 of 1 MiB or more holds
    it. Measured: on a 512 KB L2 the indexed table decoded a 3% model refit's streams in
    about two thirds of the per-slot table's time; on a 2 MB L2 a two-load step was about a
    quarter slower than the per-slot one (benchmarks/results/history.md).
    NEMO_DCR_JOINT_TABLE=slot / indexed picks either; any other value is an error."""
    choice = os.environ.get("NEMO_DCR_JOINT_TABLE", "")
    if choice in ("slot", "indexed"):
        return choice == "slot"
    if choice:
        raise ValueError(f"NEMO_DCR_JOINT_TABLE={choice!r}: expected 'slot' or 'indexed' (or unset: by the L2)")
    return _l2_bytes() >= 1 << 20


PER_SLOT_TABLE = _per_slot_table()


def encode_joint(gp: GapsParts, vp, value_budget: int) -> tuple[list, list] | None:
    """(positions section, values section) of a record as chunks, the joint stream in the
    former; None when the record should keep two streams: a model of one symbol, more
    than MAX_CELLS cells, a product model estimated to cost more than MAX_EXCESS, or
    values that would take more than `value_budget` bytes (where the codec would try byte
    planes). gp / vp: the record's `gaps.gaps_parts` / `values.value_parts`."""
    c1 = np.asarray(gp.counts, dtype=np.int64)
    c2 = np.asarray(vp.counts, dtype=np.int64)
    cells = c1.size * c2.size  # the models have the counts' sizes: decided before they are made
    if cells > MAX_CELLS:
        return None
    t1, t2 = rans_table(c1), rans_table(c2)
    if isinstance(t1, bytes) or isinstance(t2, bytes):
        return None
    (f1, _), (f2, _) = t1, t2
    freq, cum = np.empty(cells, np.int64), np.empty(cells, np.int64)
    # A float estimate: a record on the threshold's very edge could go either way between
    # builds (compiled or not); both decode to the same record.
    value_bits = 8.0 * (value_budget - len(vp.head) - len(vp.tail))
    if not kernels.joint.joint_model(f1, f2, c1, c2, value_bits, MAX_EXCESS, freq, cum):
        return None
    lut = vp.lut if vp.lut is not None else np.arange(f2.size, dtype=np.int32)
    out = np.empty(gp.sym.size + 8, dtype="<u2")
    start = kernels.joint.rans_encode_joint(gp.sym, vp.sym, lut, f2.size, freq, cum, out)
    return gp.chunks(rans_stream_chunks(f1, out[start:])), vp.chunks([model_bytes(f2)])


def decode_joint(f1: np.ndarray, f2: np.ndarray, words: np.ndarray, m: int,
                 values: np.ndarray | None = None) -> tuple[np.ndarray, np.ndarray]:
    """(m quotients as uint8, m value symbols as int16) of a joint stream, given the two
    models as read (`rans.read_model`, checked) and the stream's words. With
    `values`, the values' table of 8- or 16-bit values, one per value symbol (a section
    without escapes), the second array holds the values themselves (that table's dtype):
    the decoder writes them where it would write the symbols, and no lookup pass follows.
    Raises PositionsError for a stream that is not one."""
    slots, table = _decoding_table(f1, f2, values)
    q = np.empty(m, np.uint8)
    v = _value_fields(m, values)
    _check_stream(kernels.joint.rans_decode_joint(words, slots, table, q, v))
    return q, v


def decode_joint_gaps(gaps: GapsReader, f2: np.ndarray, numel: int,
                      values: np.ndarray | None = None) -> tuple[np.ndarray, np.ndarray]:
    """The record's positions (uint64, checked below numel) and its value fields (as
    `decode_joint`'s second array) from a `gaps_joint` section read up to its words and
    the values' model f2: `decode_joint` then `gaps.positions`, the same results and the
    same errors, in one pass where the gaps' shift allows it (`kernels.joint.rans_decode_joint_gaps`:
    each gap joined as its quotient decodes: 0.80-0.87x the two passes' time,
    benchmarks/results/history.md)."""
    m, r = gaps.count, gaps.shift
    low = gaps.low_bits()
    if low is None or r == 0 or m << (r + 8) >= 1 << 62:  # the one pass's bounds (its docstring)
        q, v = decode_joint(gaps.model, f2, gaps.words, m, values)
        return gaps.positions(q, numel), v
    slots, table = _decoding_table(gaps.model, f2, values)
    v = _value_fields(m, values)
    out = np.empty(m, np.int64)
    status, escapes = kernels.joint.rans_decode_joint_gaps(gaps.words, slots, table, v, gaps.escape, r, low, out)
    _check_stream(status)
    return gaps.joined(out, int(escapes), numel), v


def _decoding_table(f1: np.ndarray, f2: np.ndarray, values: np.ndarray | None) -> tuple[np.ndarray, np.ndarray]:
    """(slots, cells) of the joint model of f1 x f2 in the host's form (`rans_joint_table`);
    PositionsError for models that make no joint stream."""
    cells = f1.size * f2.size
    if cells > MAX_CELLS:
        raise PositionsError(f"joint stream: {f1.size} x {f2.size} symbols exceed {MAX_CELLS}")
    if values is not None and (values.size != f2.size or values.dtype.itemsize > 2):
        raise PositionsError(f"joint stream: {values.size} values of {values.dtype.itemsize} bytes for "
                             f"{f2.size} value symbols")
    f1 = f1.astype(np.int64)
    f2 = f2.astype(np.int64)
    freq = np.empty(cells, np.int64)
    used = kernels.joint.rans_product_model(f1, f2, freq)
    if used < 2:
        raise PositionsError("joint stream: its model has fewer than two symbols")
    if PER_SLOT_TABLE:
        slots, table = np.empty(0, np.uint8), np.empty(kernels.rans.PROB_SCALE, np.uint64)
    else:  # a byte a slot where it can: the smaller index stays nearer the core
        slots = np.empty(kernels.rans.PROB_SCALE, np.uint8 if used <= 256 else np.uint16)
        table = np.empty(used, np.uint64)
    vmap = np.arange(f2.size) if values is None else values
    if kernels.joint.rans_joint_table(freq, f2.size, vmap, slots, table):
        raise PositionsError("joint stream: its model does not cover the 2**16 slots")
    return slots, table


def _value_fields(m: int, values: np.ndarray | None) -> np.ndarray:
    """The array a decoder writes m value fields to: symbols (int16), or values (their table's dtype)."""
    return np.empty(m, np.int16 if values is None else values.dtype)


def _check_stream(status: int) -> None:
    """Raise the PositionsError of a joint decoder's status (0: nothing)."""
    if status:
        why = {-1: "bad initial states", -2: "words run out",
               -3: "stream does not end where its symbols do"}.get(status, "corrupt")
        raise PositionsError(f"corrupt joint rANS stream ({why})")
