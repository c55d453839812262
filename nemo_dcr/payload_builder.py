"""The producer's payloads before they are bytes: placed changes queued per canonical tensor
(`PayloadBuilder`), cut into one payload's batch (`PayloadBatch`), made into sorted records
(the op chosen per record for op "auto") and encoded (`PayloadEncoder`).

The parts keep the scan's order; records concatenate them in an `Arena` (memory reused
from payload to payload), or on their device for parts kept there (format v6)."""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import NamedTuple

import numpy as np
import torch

from nemo_dcr.arena import Arena
from nemo_dcr.dtypes import host_bits
from nemo_dcr.records import AUTO, BaseSpan, Op, Payload, PayloadHeader, Record, TransferInfo
from nemo_dcr.verify import region_digest
from nemo_dcr.wire import codec
from nemo_dcr.wire.positions import MAX_NUMEL, check_positions
from nemo_dcr.wire.values import choose_op_from_add


class AutoValues(NamedTuple):
    """A part's values for op "auto": the add values and the new bits, from which a record
    that codes smaller as xor computes its xor values (`xor_of`)."""

    add: np.ndarray | torch.Tensor
    new: np.ndarray | torch.Tensor


class PayloadPart(NamedTuple):
    """Placed changes of one canonical tensor, as one scan chunk gave them: numpy arrays, or
    tensors on their device (format v6's device coding)."""

    positions: np.ndarray | torch.Tensor  # canonical; uint32 / uint64 (int64 tensors on a device)
    values: np.ndarray | torch.Tensor | AutoValues  # what the record carries (op "auto": AutoValues)
    new: np.ndarray | torch.Tensor | None  # the new bits, kept for read-back digests (track_new)
    increasing: bool  # the positions are known to be strictly increasing
    span: CommittedSpan | None = None  # the committed bits the chunk was diffed against (conditioned coding)


@dataclass(frozen=True)
class CommittedSpan:
    """The committed bits `bits[lo:hi]` of one diffed chunk, which sit at canonical flat
    positions canonical_lo .. canonical_lo + hi - lo: what a conditioned record is coded
    against (nemo_dcr.wire.conditioned)."""

    bits: np.ndarray
    lo: int
    hi: int
    canonical_lo: int

    @staticmethod
    def joined(spans: list[CommittedSpan | None]) -> BaseSpan | None:
        """One span of a record's parts when they follow each other in one committed array
        and in canonical order (a view, no copy); else None."""
        if not spans or any(s is None for s in spans):
            return None
        first = spans[0]
        for a, b in zip(spans, spans[1:]):
            if b.bits is not first.bits or b.lo != a.hi or b.canonical_lo != a.canonical_lo + (a.hi - a.lo):
                return None
        return BaseSpan(first.canonical_lo, first.bits[first.lo:spans[-1].hi])


class PayloadBuilder:
    """Accumulates placed changes per canonical tensor until a payload is full.

    With `track_new`, the new bits of every placed element are kept beside the values
    (for each record's expected post-apply digest: `PayloadBatch.records`)."""

    def __init__(self, track_new: bool = False, arena: Arena | None = None):
        self.parts: dict[tuple[str, Op | str], list[PayloadPart]] = {}
        self.elements = 0
        self.track_new = track_new
        self.arena = arena if arena is not None else Arena()

    def add(self, name: str, op: Op | str, positions, values, new=None, increasing: bool = False,
            span: CommittedSpan | None = None) -> None:
        self.parts.setdefault((name, op), []).append(
            PayloadPart(positions, values, new if self.track_new else None, increasing, span))
        self.elements += len(positions)

    def clear(self) -> None:
        self.parts, self.elements = {}, 0

    def detach(self) -> PayloadBatch:
        """The queued changes as a batch of their own (to be made into records, maybe on
        another thread); the builder starts empty again."""
        batch = PayloadBatch(self.parts, self.track_new)
        self.clear()
        return batch

    def take(self, specs: dict) -> list[Record]:
        """The queued changes as one record per canonical tensor (and op), sorted
        (`PayloadBatch.records` in the builder's arena: valid until the next take())."""
        return self.detach().records(specs, self.arena)[0]


class PayloadBatch:
    """One payload's queued changes: per (canonical tensor, op), the parts in scan order."""

    def __init__(self, parts: dict[tuple[str, Op | str], list[PayloadPart]], track_new: bool):
        self.parts, self.track_new = parts, track_new

    def records(self, specs: dict, arena: Arena) -> tuple[list[Record], dict[str, str], float]:
        """(records, digests, seconds the digests took): one record per canonical tensor
        (and op), sorted. With `track_new`, digests holds each record's expected
        post-apply digest. The records' arrays may live in `arena`: they are valid until
        its next use."""
        records, digests, digest_s = [], {}, 0.0
        arena.reset(sum(_arena_bytes(parts) for parts in self.parts.values()))
        cat = arena.concatenate
        for (name, op), parts in self.parts.items():
            if isinstance(parts[0].positions, torch.Tensor):  # kept on their device: coded there (v6)
                record, new = _device_record(name, op, parts, specs[name])
                records.append(record)
                if new is not None:
                    t = time.perf_counter()
                    digests[name] = region_digest(record.positions.cpu().numpy().view(np.uint64), new.cpu().numpy())
                    digest_s += time.perf_counter() - t
                continue
            # uint32 when every part is (in-place pieces: codec.encode takes them as they
            # are); else uint64, 32-bit parts widening on the way
            pos = cat([p.positions for p in parts],
                      np.uint32 if all(p.positions.dtype == np.uint32 for p in parts) else np.uint64)
            if op == AUTO:
                pairs = [p.values for p in parts]
                op = choose_op_sampled(pairs)
                val = cat([v.add for v in pairs]) if op is Op.ADD else xor_of(pairs, arena)
            else:
                val = cat([p.values for p in parts])
            new = cat([p.new for p in parts]) if self.track_new else None
            if pos.size > 1 and not _increasing(parts, pos):
                order = np.argsort(pos, kind="stable")
                pos, val = pos[order], val[order]
                new = None if new is None else new[order]
            dtype, shape = specs[name]
            records.append(Record(name, dtype, tuple(shape), op, pos, val,
                                  base=CommittedSpan.joined([p.span for p in parts])))
            if new is not None:
                t = time.perf_counter()
                digests[name] = region_digest(pos, new)
                digest_s += time.perf_counter() - t
        return records, digests, digest_s


class EncodedPayload(NamedTuple):
    """What `PayloadEncoder.encode` made of one batch."""

    data: bytes | np.ndarray | torch.Tensor | None  # None: skipped (finished on every receiver), not encoded
    digests: dict[str, str]  # each record's expected post-apply digest (read-back transfers)
    encode_s: float  # seconds making records and bytes
    digest_s: float  # seconds digesting


@dataclass(frozen=True)
class PayloadEncoder:
    """How one refit's batches become payload bytes: the same on any thread, so payloads
    encoded elsewhere (`encode_queue.EncodeQueue`) are the bytes this thread would write."""

    transfer: TransferInfo
    producer_id: str
    specs: dict
    key: bytes | None
    level: int
    wire_version: int
    skip: frozenset = frozenset()  # payload ids cut but not sent (finished on every receiver)
    device: torch.device | None = None  # sealed there (`codec.encode(on_device=)`); None: host bytes

    def encode(self, batch: PayloadBatch, payload_id: str, arena: Arena) -> EncodedPayload:
        t = time.perf_counter()
        records, digests, digest_s = batch.records(self.specs, arena)  # concatenation, op choice
        data = None
        if payload_id not in self.skip:
            tr = self.transfer
            header = PayloadHeader(tr.transfer_id, tr.base_version, tr.target_version, self.producer_id, payload_id)
            data = codec.encode(Payload(header, records), key=self.key, level=self.level, version=self.wire_version,
                                on_device=self.device)
            if isinstance(data, torch.Tensor) and data.device.type == "cpu":
                data = data.numpy()  # a frame sealed on the CPU travels as the host bytes it is
        return EncodedPayload(data, digests, time.perf_counter() - t - digest_s, digest_s)


def _device_record(name: str, op: Op | str, parts: list[PayloadPart], spec) -> tuple[Record, torch.Tensor | None]:
    """`PayloadBatch.records` for parts kept as tensors on their device: (the record, its
    tensors concatenated there, sorted; the new bits, or None without them)."""
    pos = torch.cat([p.positions for p in parts])
    if op == AUTO:
        add = torch.cat([p.values.add for p in parts])
        newb = torch.cat([p.values.new for p in parts])
        step = max(1, len(add) // CHOICE_SAMPLE)  # the choice on a sample, as for host parts
        op = choose_op_sampled([AutoValues(host_bits(add[::step]), host_bits(newb[::step]))])
        val = add if op is Op.ADD else torch.bitwise_xor(newb, newb - add)
    else:
        val = torch.cat([p.values for p in parts])
    new = torch.cat([p.new for p in parts]) if parts[0].new is not None else None
    if len(pos) > 1 and not _meet_increasing(parts) and not bool((pos[1:] > pos[:-1]).all()):
        order = torch.argsort(pos, stable=True)
        pos, val = pos[order], val[order]
        new = None if new is None else new[order]
    dtype, shape = spec
    return Record(name, dtype, tuple(shape), op, pos, val), new


def _arena_bytes(parts: list[PayloadPart]) -> int:
    """Arena bytes one record's concatenations take at most (positions, values, new bits;
    op "auto": add, new bits and the xor computed from them); none for parts kept as
    tensors on their device."""
    first = parts[0]
    if isinstance(first.positions, torch.Tensor):
        return 0
    auto = isinstance(first.values, AutoValues)
    values = (3 if auto else 1) * (first.values.add if auto else first.values).itemsize
    per = 8 + values + (first.new.itemsize if first.new is not None else 0)  # positions as uint64
    return sum(p.positions.size for p in parts) * per + 5 * Arena.ALIGN


def _cat(arrays: list[np.ndarray]) -> np.ndarray:
    return arrays[0] if len(arrays) == 1 else np.concatenate(arrays)


# op "auto" decides xor vs add on about this many values per record, evenly spread: the
# choice only affects the size, and two full histograms were a noticeable share of a
# change's coding. On real AdamW deltas (benchmarks/codec.py's model, three learning
# rates) samples of 2**11 to 2**14 values chose as the full histograms did for every tensor.
CHOICE_SAMPLE = 1 << 12


def choose_op_sampled(pairs: list[AutoValues]) -> Op:
    """values.choose_op on an even sample (every k-th value) of the (add, new bits) pairs."""
    total = sum(a.size for a, _ in pairs)
    step = max(1, total // CHOICE_SAMPLE)
    ad = _cat([a[::step] for a, _ in pairs])
    new = _cat([n[::step] for _, n in pairs])
    return choose_op_from_add(ad, new, ad.dtype.itemsize)


def xor_of(pairs: list[AutoValues], arena: Arena) -> np.ndarray:
    """The xor values (new ^ old, old = new - add) of the (add, new bits) pairs, in the arena."""
    add = arena.concatenate([a for a, _ in pairs])
    new = arena.concatenate([n for _, n in pairs])
    out = arena.empty(add.size, add.dtype)
    np.subtract(new, add, out=out)
    return np.bitwise_xor(new, out, out=out)


def _meet_increasing(parts: list[PayloadPart]) -> bool:
    """Whether every part's positions are known increasing and each part starts after
    the one before it ends: the concatenation is then increasing without a look at it."""
    return all(p.increasing for p in parts) and all(
        int(a.positions[-1]) < int(b.positions[0]) for a, b in zip(parts, parts[1:]))


def _increasing(parts: list[PayloadPart], pos: np.ndarray) -> bool:
    """Whether the concatenated positions `pos` of `parts` are strictly increasing."""
    if all(p.increasing for p in parts):  # each part is: check where they meet
        return _meet_increasing(parts)
    return check_positions(pos, MAX_NUMEL) is None  # one compiled pass for uint32 / uint64 positions
