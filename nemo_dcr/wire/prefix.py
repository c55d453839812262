"""A record's changes as one prefix-coded bit stream, coded with torch ops on whatever
device holds them (wire format v6: `gaps_prefix` / `symbols_prefix`; docs/wire-format.md).

Why: the rANS streams (nemo_dcr.wire.joint, nemo_dcr.kernels) code a record's changes one
after another, four chains at most, which is what a CPU core does well and a GPU does
not. With prefix codes every change's bits have a length known before anything is
written - its quotient's code, its value's code, its gap's r low bits - so the offsets of
all changes are one cumulative sum (per lane: change i goes to lane i % 4, so that the
decoder can follow four chains at once) and the stream is one scatter: a few dozen tensor
ops per record whatever its size, no per-change loop, no custom kernel. On +-1-ULP refits
the canonical Huffman codes cost 0.3-0.7% more than the joint rANS stream, up to 2.6% on
real deltas where one value dominates (BENCHMARKS.md): the quotients of well-chosen Rice
shifts are near-geometric with ratio about 1/2, where prefix codes lose almost nothing.

Sections (everything not named here as in `gaps_rans` / `symbols_rans`):

    gaps_prefix     varint r | varint A1 | A1 code lengths, 4 bits each |
                    4 varints: the lanes' byte lengths | the lanes | escapes
    symbols_prefix  varint L | varint E | table | varint A2 (= L + E) |
                    A2 code lengths, 4 bits each | escaped values

Coding runs on the device; what it needs on the host is small: the Rice shift's
histogram, the two symbol histograms (value histograms of 16-bit values as a 65536-bin
count), the code tables, the escapes, and the finished stream. Decoding is the host's
(`kernels.prefix.prefix_split`), as receivers decode on CPUs.
"""

from __future__ import annotations

import heapq

import numpy as np
import torch

from .. import kernels
from .errors import PositionsError
from .positions import MAX_NUMEL
from .varints import Reader, leb128_encode

# Code lengths are 4-bit fields (0: symbol absent), at most 13: the decoder looks a code
# up in one table of 2**13 slots at most (16 KiB; one of 2**15 would miss the L1 cache).
# Limiting the lengths to 13 instead of 15 costs 0.07-0.14% of the coded bits on +-1-ULP
# refits (to 12: 0.2-0.5%).
MAX_CODE_BITS = 13
QUOTIENT_ALPHABET = 256  # as gaps_rans: quotient symbols min(g >> r, 255); 255 escapes
_RICE_TOP = 4 * (QUOTIENT_ALPHABET - 1) + 3  # kernels.gaps.rice_pick's histogram bins - 1
_U64 = np.uint64
_NO_BYTES = np.empty(0, np.uint8)


# ---------------------------------------------------------------- code tables (host)


def code_lengths(counts: np.ndarray, limit: int = MAX_CODE_BITS) -> np.ndarray:
    """Huffman code lengths (uint8, 0 for absent symbols) of symbols with these counts,
    none longer than `limit`. One present symbol gets length 1 (it is coded with no bits).
    Deterministic: ties go to the lower symbol index."""
    counts = np.asarray(counts, dtype=np.int64)
    lengths = np.zeros(counts.size, np.uint8)
    present = np.flatnonzero(counts)
    if present.size == 0:
        raise ValueError("code_lengths: no symbol occurs")
    if present.size == 1:
        lengths[present[0]] = 1
        return lengths
    if present.size > 1 << limit:
        raise ValueError(f"code_lengths: {present.size} symbols do not fit codes of at most {limit} bits")
    # Huffman's merges; node k < present.size is leaf k, later nodes are merges.
    heap = [(int(counts[s]), k) for k, s in enumerate(present)]
    heapq.heapify(heap)
    parent = [0] * (2 * present.size - 1)
    nxt = present.size
    while len(heap) > 1:
        ca, a = heapq.heappop(heap)
        cb, b = heapq.heappop(heap)
        parent[a] = parent[b] = nxt
        heapq.heappush(heap, (ca + cb, nxt))
        nxt += 1
    depth = [0] * nxt
    for node in range(nxt - 2, -1, -1):  # parents are created after their children
        depth[node] = depth[parent[node]] + 1
    got = np.array(depth[:present.size], np.int64)
    if got.max() > limit:
        got = _limit_lengths(got, counts[present], limit)
    lengths[present] = got
    return lengths


def _limit_lengths(lengths: np.ndarray, counts: np.ndarray, limit: int) -> np.ndarray:
    """Lengths capped at `limit`, then codes shorter than it lengthened one bit at a time -
    the longest first, the rarest among equals - until Kraft's sum is at most 1."""
    lengths = np.minimum(lengths, limit)
    kraft = int((1 << (limit - lengths)).sum())
    order = np.lexsort((counts, -lengths))  # longest first, then rarest
    while kraft > 1 << limit:
        for k in order:
            if lengths[k] < limit:
                kraft -= 1 << (limit - int(lengths[k]) - 1)
                lengths[k] += 1
                break
        order = np.lexsort((counts, -lengths))
    return lengths


def canonical_codes(lengths: np.ndarray) -> np.ndarray:
    """Canonical codes (int64) of these lengths: symbols ordered by (length, index) take
    consecutive codes, each shifted left when the length grows. Absent symbols: 0."""
    lengths = np.asarray(lengths, dtype=np.int64)
    codes = np.zeros(lengths.size, np.int64)
    order = np.lexsort((np.arange(lengths.size), lengths))
    order = order[lengths[order] > 0]
    code, prev = 0, 0
    for s in order:
        code <<= int(lengths[s]) - prev
        prev = int(lengths[s])
        codes[s] = code
        code += 1
    return codes


def coded_lengths(lengths: np.ndarray) -> np.ndarray:
    """Bits each symbol takes in the stream: its length, or 0 for a lone symbol."""
    lengths = np.asarray(lengths, dtype=np.int64)
    return np.zeros_like(lengths) if np.count_nonzero(lengths) == 1 else lengths


def pack_lengths(lengths: np.ndarray) -> bytes:
    """Code lengths as 4-bit fields, two a byte, the first in the high half; an odd count
    ends with a zero half."""
    n = np.zeros(lengths.size + (lengths.size & 1), np.uint8)
    n[:lengths.size] = lengths
    return ((n[0::2] << 4) | n[1::2]).astype(np.uint8).tobytes()


def read_lengths(rd: Reader, alphabet: int, what: str) -> np.ndarray:
    """`alphabet` 4-bit code lengths, checked: a present last symbol, and Kraft's sum at most 1."""
    b = rd.take((alphabet + 1) // 2, f"{what} code lengths")
    lengths = np.empty(2 * b.size, np.uint8)
    lengths[0::2], lengths[1::2] = b >> 4, b & 15
    if alphabet & 1 and lengths[-1]:
        raise PositionsError(f"{what} code lengths: non-zero padding")
    lengths = lengths[:alphabet]
    if lengths[-1] == 0:
        raise PositionsError(f"{what} code lengths: the alphabet's last symbol is absent")
    used = lengths[lengths > 0].astype(np.int64)
    if used.size == 1 and used[0] != 1:
        raise PositionsError(f"{what} code lengths: a lone symbol must have length 1, got {used[0]}")
    if used.max() > MAX_CODE_BITS:
        raise PositionsError(f"{what} code lengths: {used.max()} bits, more than {MAX_CODE_BITS}")
    if int((1 << (MAX_CODE_BITS - used)).sum()) > 1 << MAX_CODE_BITS:
        raise PositionsError(f"{what} code lengths: more codes than fit (Kraft sum above 1)")
    return lengths


def decode_table(lengths: np.ndarray) -> tuple[np.ndarray, int]:
    """(table, bits), a code's decode table for kernels.prefix.prefix_split: 2**bits int16 slots
    indexed by the stream's next `bits` bits (the longest code's length; 1 for a lone
    symbol, coded with none), each (symbol << 4) | the code's length, or -1 where no code
    starts (an incomplete code)."""
    lengths = np.asarray(lengths)
    coded = coded_lengths(lengths)
    bits = max(int(coded.max()), 1)
    table = np.full(1 << bits, -1, np.int16)
    codes = canonical_codes(lengths)
    for s in np.flatnonzero(lengths):
        k = int(coded[s])
        start = int(codes[s]) << (bits - k)
        table[start:start + (1 << (bits - k))] = (int(s) << 4) | k
    return table, bits


# ---------------------------------------------------------------- coding (device)


def check_order(pos: torch.Tensor, numel: int) -> str | None:
    """Why int64 positions on any device are not strictly increasing in [0, numel), or None."""
    if pos.numel() == 0:
        return None
    first, last = int(pos[0]), int(pos[-1])
    if first < 0:
        return "negative position"
    if last >= numel:
        return f"position {last} >= numel {numel}"
    if pos.numel() > 1 and not bool((pos[1:] > pos[:-1]).all()):
        return "positions not strictly increasing"
    return None


def value_counts(vals: torch.Tensor, width: int) -> tuple[np.ndarray, np.ndarray]:
    """(distinct values ascending as <u{width}, their counts) of 1- or 2-byte bit views on
    any device: one bincount over every possible value there, the occupied bins here."""
    idx = vals.to(torch.int64) & ((1 << (8 * width)) - 1)
    hist = torch.bincount(idx, minlength=1 << (8 * width))
    distinct = torch.nonzero(hist).view(-1)
    counts = hist[distinct]
    return distinct.cpu().numpy().astype(f"<u{width}"), counts.cpu().numpy()


def encode_prefix(pos: torch.Tensor, vals: torch.Tensor, width: int, table: np.ndarray, escape: int
                  ) -> tuple[list, list]:
    """(`gaps_prefix` section, `symbols_prefix` section) as chunks (bytes; the bit stream a
    uint8 tensor on the record's device) of the record whose
    positions (int64, strictly increasing: see check_order) and value bits (width 1 or 2)
    are on one device; `table` (ascending, from value_counts) and `escape` (0/1) are the
    values' table, as `values.value_parts` chooses it."""
    dev = pos.device
    m = pos.numel()
    g = torch.diff(pos, prepend=pos.new_full((1,), -1)) - 1  # gaps >= 0

    # The Rice shift, by kernels.gaps.rice_shift's rule on every gap (the sum of the gaps is the
    # last position + 1 - m); it only decides the size.
    base = kernels.gaps.rice_base(int(pos[-1]) + 1 - m, m)
    r = 0
    if base >= 0:
        h0 = torch.bincount(torch.clamp(g >> base, max=_RICE_TOP), minlength=_RICE_TOP + 1)
        r = int(kernels.gaps.rice_pick(h0.cpu().numpy(), base, m, QUOTIENT_ALPHABET - 1))
    q = torch.clamp(g >> r, max=QUOTIENT_ALPHABET - 1)
    qcounts = torch.bincount(q, minlength=QUOTIENT_ALPHABET).cpu().numpy()
    a1 = int(np.flatnonzero(qcounts)[-1]) + 1
    qlen = code_lengths(qcounts[:a1])

    literal = table.size
    lut = torch.full((1 << (8 * width),), literal, dtype=torch.int64, device=dev)
    lut[torch.from_numpy(table.astype(np.int64)).to(dev)] = torch.arange(literal, device=dev)
    v = lut[vals.to(torch.int64) & ((1 << (8 * width)) - 1)]
    vcounts = torch.bincount(v, minlength=literal + escape).cpu().numpy()
    vlen = code_lengths(vcounts)

    def on_device(lengths):
        codes = torch.from_numpy(canonical_codes(lengths)).to(dev)
        return codes, torch.from_numpy(coded_lengths(lengths)).to(dev)

    qcode, qbits = on_device(qlen)
    vcode, vbits = on_device(vlen)
    lq, lv = qbits[q], vbits[v]
    low = g & ((1 << r) - 1)
    # Where each change's bits start: lanes are change i % LANES; in a lane, one after
    # another (a cumulative sum down each lane); the lanes one after another, whole bytes each.
    size = lq + lv + r
    rows = (m + kernels.prefix.PREFIX_LANES - 1) // kernels.prefix.PREFIX_LANES
    grid = torch.zeros(rows * kernels.prefix.PREFIX_LANES, dtype=torch.int64, device=dev)
    grid[:m] = size
    ends = grid.view(rows, kernels.prefix.PREFIX_LANES).cumsum(0)
    lane_bytes = ((ends[-1] + 7) >> 3).cpu().numpy()
    lane_at = torch.from_numpy(8 * (np.cumsum(lane_bytes) - lane_bytes)).to(dev)
    start = (ends + lane_at).view(-1)[:m] - size
    nbytes = int(lane_bytes.sum())
    words = torch.zeros((nbytes + 3) // 4 + 2, dtype=torch.int64, device=dev)
    _put(words, qcode[q], lq, start)
    _put(words, vcode[v], lv, start + lq)
    at = start + lq + lv
    if r > 32:
        _put(words, low >> 32, torch.full_like(lq, r - 32), at)
        at = at + (r - 32)
    if r:
        _put(words, low & 0xFFFFFFFF, torch.full_like(lq, min(r, 32)), at)
    stream = torch.stack([(words >> s) & 255 for s in (24, 16, 8, 0)], dim=1).to(torch.uint8).view(-1)
    stream = stream[:nbytes]  # stays on its device: the payload's frame takes it from there

    gsec = [leb128_encode(np.array([r, a1], _U64)).tobytes(), pack_lengths(qlen),
            leb128_encode(lane_bytes.astype(_U64)).tobytes(), stream]
    if a1 == QUOTIENT_ALPHABET:
        hit = q == QUOTIENT_ALPHABET - 1
        excess = ((g[hit] >> r) - (QUOTIENT_ALPHABET - 1)).cpu().numpy()
        gsec.append(leb128_encode(excess.astype(_U64)).tobytes())
    bits = np.dtype(f"<u{width}")
    vsec = [leb128_encode(np.array([literal, escape], _U64)).tobytes(), table.astype(bits).tobytes(),
            leb128_encode(np.array([literal + escape], _U64)).tobytes(), pack_lengths(vlen)]
    if escape:
        raw = vals[v == literal].to(torch.int64) & ((1 << (8 * width)) - 1)
        vsec.append(raw.cpu().numpy().astype(bits).tobytes())
    return gsec, vsec


def _put(words: torch.Tensor, code: torch.Tensor, length: torch.Tensor, at: torch.Tensor) -> None:
    """OR each `code` (length <= 32 bits) into the 32-bit big-endian words (int64 holders)
    at bit offset `at`, MSB first: into its word, and what spills into the next. The
    fields do not overlap, so adding them is OR-ing them, in any order."""
    w = at >> 5
    shift = 32 - (at & 31) - length  # < 0: the field spills -shift bits into word w + 1
    head = torch.where(shift >= 0, code << shift.clamp(min=0), code >> (-shift).clamp(min=0))
    tail = torch.where(shift < 0, (code << (32 + shift).clamp(min=0)) & 0xFFFFFFFF, torch.zeros_like(code))
    words.scatter_add_(0, w, head)
    words.scatter_add_(0, w + 1, tail)


# ---------------------------------------------------------------- decoding (host)


class PrefixGaps:
    """A `gaps_prefix` section read up to its bit stream; `split` decodes it with the
    values section's code (`PrefixValues`), `positions` joins the gaps."""

    __slots__ = ("rd", "count", "shift", "lengths", "buf", "starts", "ends")

    def __init__(self, raw, count: int):
        if count == 0:
            raise PositionsError("a 'gaps_prefix' section needs at least one position")
        self.rd = rd = Reader(raw)
        self.count = count
        self.shift = rd.varint("gaps shift", 63)
        alphabet = rd.varint("gaps quotients alphabet", QUOTIENT_ALPHABET)
        if alphabet == 0:
            raise PositionsError("gaps quotients alphabet is empty")
        self.lengths = read_lengths(rd, alphabet, "gaps quotients")
        lanes = rd.varints(kernels.prefix.PREFIX_LANES, "gaps bit stream lane lengths").astype(np.int64)
        if lanes.sum() > rd.left:
            raise PositionsError(f"gaps bit stream lanes of {lanes.sum()} bytes, {rd.left} left in the section")
        # Each lane with 16 zero bytes after it: the decoder reads whole words (kernels.prefix.prefix_split).
        self.starts = np.cumsum(lanes + 16) - (lanes + 16)
        self.ends = self.starts + lanes
        self.buf = np.zeros(int(lanes.sum()) + 16 * kernels.prefix.PREFIX_LANES, np.uint8)
        for lo, hi in zip(self.starts, self.ends):
            self.buf[lo:hi] = rd.take(int(hi - lo), "gaps bit stream")

    def split(self, value_lengths: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """(quotient symbols, gaps before their escapes, value symbols) of the stream."""
        m, r = self.count, self.shift
        qsym = np.empty(m, np.uint8)
        vsym = np.empty(m, np.int16)
        gaps = np.empty(m, np.int64)
        status = kernels.prefix.prefix_split(self.buf, self.starts, self.ends, r, *decode_table(self.lengths),
                                             *decode_table(value_lengths), qsym, gaps, vsym)
        if status:
            raise PositionsError({-1: "bit stream lane ends inside a change", -2: "bit stream holds an unknown code",
                                  -3: "bit stream lane: non-zero padding or bytes after its last change"}[status])
        return qsym, gaps, vsym

    def positions(self, qsym: np.ndarray, gaps: np.ndarray, numel: int) -> np.ndarray:
        """Positions (uint64) from the split stream (its gaps array becomes them) and the
        escapes after it; every check of gaps_rans."""
        rd, r = self.rd, self.shift
        esc = QUOTIENT_ALPHABET - 1 if self.lengths.size == QUOTIENT_ALPHABET else -1
        nesc = int(np.count_nonzero(qsym == esc)) if esc >= 0 else 0
        excess = rd.varints(nesc, "gaps escaped quotients")
        rd.done("gaps section")
        if np.any(excess > _U64(MAX_NUMEL)):
            raise PositionsError("gaps escaped quotient beyond 2**63")
        status = kernels.gaps.gaps_join(qsym, esc, r, _NO_BYTES, excess.astype(np.int64), numel - 1, gaps, False)
        if status:
            raise PositionsError({-3: "escape count mismatch", -4: "gap beyond 2**63"}.get(
                status, f"position >= numel {numel}"))
        return gaps.view(_U64)
