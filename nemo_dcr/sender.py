"""Producer side of one refit: diff owned ranges against the committed baseline,
place the changes in canonical coordinates, encode payloads and stream them out
while later ranges are still being diffed.

Residual rules (`ResidualMap`) take a second path: the rank that produces a residual
recomputes its canonical outputs from the whole local parameter, diffs them against
the residual baseline (keyed by canonical slice, committed and aborted with the rest)
and sends the changes as overwrites, whatever the operation of the affine changes."""

from __future__ import annotations

import functools
import time
from collections import deque
from concurrent.futures import Future, ThreadPoolExecutor
from concurrent.futures import wait as futures_wait
from dataclasses import dataclass, field

import numpy as np
import torch

from nemo_dcr import digest, dtypes, kernels
from nemo_dcr.arena import Arena
from nemo_dcr.baseline import Baseline
from nemo_dcr.diff import DiffOutput, Rows, diff, diff_arrays
from nemo_dcr.errors import ConverterError
from nemo_dcr.layout import OwnedRange
from nemo_dcr.metrics import page_faults
from nemo_dcr.placement import AffineMap, ResidualMap, merge_placed, places_anything
from nemo_dcr.records import AUTO, BaseSpan, Op, Payload, PayloadHeader, Record
from nemo_dcr.transport import ProducerEnd, TransferInfo
from nemo_dcr.verify import region_digest
from nemo_dcr.wire import codec
from nemo_dcr.wire.values import choose_op_from_add
from nemo_dcr.wire.versions import FORMAT_VERSION, WRITABLE_VERSIONS, writable_versions_text
from nemo_dcr.wire.positions import MAX_NUMEL, check_positions

@dataclass
class ProducerReport:
    producer_id: str
    scanned_elements: int = 0
    scanned_bytes: int = 0
    changed_elements: int = 0
    residual_elements: int = 0  # changed canonical elements of residual outputs (sent as overwrites)
    placed_elements: int = 0
    payloads: int = 0
    wire_bytes: int = 0
    first_send_s: float | None = None  # seconds from refit start to the first payload leaving
    page_faults: int = 0  # minor page faults of the process during the refit (metrics.page_faults)
    # CPU time of the thread that ran the refit (time.thread_time; encode threads not included):
    # beside the stages' wall-clock times it tells waiting for a core from working
    cpu_s: float = 0.0
    times: dict[str, float] = field(default_factory=lambda: dict.fromkeys(
        ("residual", "diff", "place", "encode", "encode_wait", "send", "flush", "state_digest"), 0.0))
    rejected: dict[str, dict[str, str]] = field(default_factory=dict)
    payload_ids: list[str] = field(default_factory=list)  # what the manifest lists (sent this attempt)
    all_payload_ids: list[str] = field(default_factory=list)  # ... and those skipped as finished everywhere
    # transfer.readback: per payload id (all of them), each record's expected post-apply digest
    readback: dict[str, dict[str, str]] = field(default_factory=dict)
    # The whole-state digest of this producer's share at the target version, and how each
    # payload (all of them) moves it (`nemo_dcr.digest`): receivers' must match.
    state_digest: str = ""
    payload_digests: dict[str, str] = field(default_factory=dict)
    error: str | None = None

    def to_json(self) -> dict:
        return self.__dict__.copy()


class _PayloadBuilder:
    """Accumulates placed changes per canonical tensor until a payload is full.

    With `track_new`, the new bits of every placed element are kept beside the values
    (for each record's expected post-apply digest: `_Batch.records`)."""

    def __init__(self, track_new: bool = False, arena: Arena | None = None):
        # op "auto": values are (add, new bits) pairs; take() keeps add or computes xor per record.
        # Each part: (positions, values, new bits or None, positions known strictly increasing).
        self.parts: dict[tuple[str, Op | str], list[tuple[np.ndarray, object, np.ndarray | None, bool]]] = {}
        # Per (canonical tensor, op), with conditioned coding: the committed bits each part's
        # diff ran over, when that is one contiguous canonical span (None otherwise).
        self.spans: dict[tuple[str, Op | str], list[CommittedSpan | None]] = {}
        self.elements = 0
        self.track_new = track_new
        self.arena = arena if arena is not None else Arena()

    def add(self, name: str, op: Op | str, positions: np.ndarray, values, new: np.ndarray | None = None,
            increasing: bool = False, span: CommittedSpan | None = None) -> None:
        self.parts.setdefault((name, op), []).append(
            (positions, values, new if self.track_new else None, increasing))
        self.spans.setdefault((name, op), []).append(span)
        self.elements += len(positions)

    def clear(self) -> None:
        self.parts, self.spans, self.elements = {}, {}, 0

    def detach(self) -> _Batch:
        """The queued changes as a batch of their own (to be made into records, maybe on
        another thread); the builder starts empty again."""
        batch = _Batch(self.parts, self.track_new, self.spans)
        self.clear()
        return batch

    def take(self, specs: dict) -> list[Record]:
        """The queued changes as one record per canonical tensor (and op), sorted
        (`_Batch.records` in the builder's arena: valid until the next take())."""
        return self.detach().records(specs, self.arena)[0]


class _Batch:
    """One payload's queued changes: per (canonical tensor, op), the parts in scan order."""

    def __init__(self, parts: dict, track_new: bool, spans: dict | None = None):
        self.parts, self.track_new, self.spans = parts, track_new, spans or {}

    def records(self, specs: dict, arena: Arena) -> tuple[list[Record], dict[str, str], float]:
        """(records, digests, seconds the digests took): one record per canonical tensor
        (and op), sorted. With `track_new`, digests holds each record's expected
        post-apply digest. The records' arrays may live in `arena`: they are valid until
        its next use."""
        records, digests, digest_s = [], {}, 0.0
        arena.reset(sum(_part_bytes(parts) for parts in self.parts.values()))
        cat = arena.concatenate
        for (name, op), parts in self.parts.items():
            spans = self.spans.get((name, op), ())
            if isinstance(parts[0][0], torch.Tensor):  # kept on their device: coded there (v6)
                record, new = _device_record(name, op, parts, specs[name])
                records.append(record)
                if new is not None:
                    t = time.perf_counter()
                    digests[name] = region_digest(record.positions.cpu().numpy().view(np.uint64), new.cpu().numpy())
                    digest_s += time.perf_counter() - t
                continue
            # uint32 when every part is (in-place pieces: codec.encode takes them as they
            # are); else uint64, 32-bit parts widening on the way
            pos = cat([p for p, _, _, _ in parts],
                      np.uint32 if all(p.dtype == np.uint32 for p, _, _, _ in parts) else np.uint64)
            if op == AUTO:
                pairs = [v for _, v, _, _ in parts]
                op = _choose_op_sampled(pairs)
                val = cat([a for a, _ in pairs]) if op is Op.ADD else _xor_of(pairs, arena)
            else:
                val = cat([v for _, v, _, _ in parts])
            new = cat([n for _, _, n, _ in parts]) if self.track_new else None
            if pos.size > 1 and not _increasing(parts, pos):
                order = np.argsort(pos, kind="stable")
                pos, val = pos[order], val[order]
                new = None if new is None else new[order]
            dtype, shape = specs[name]
            records.append(Record(name, dtype, tuple(shape), op, pos, val, base=CommittedSpan.joined(spans)))
            if new is not None:
                t = time.perf_counter()
                digests[name] = region_digest(pos, new)
                digest_s += time.perf_counter() - t
        return records, digests, digest_s


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
    def joined(spans) -> BaseSpan | None:
        """One span of the record's parts when they follow each other in one committed
        array and in canonical order (a view, no copy); else None."""
        if not spans or any(s is None for s in spans):
            return None
        first = spans[0]
        for a, b in zip(spans, spans[1:]):
            if b.bits is not first.bits or b.lo != a.hi or b.canonical_lo != a.canonical_lo + (a.hi - a.lo):
                return None
        return BaseSpan(first.canonical_lo, first.bits[first.lo:spans[-1].hi])


def _device_record(name: str, op: Op | str, parts: list, spec) -> tuple[Record, torch.Tensor | None]:
    """`_Batch.records` for parts kept as tensors on their device: (the record, its
    tensors concatenated there, sorted; the new bits, or None without them)."""
    pos = torch.cat([p for p, _, _, _ in parts])
    if op == AUTO:
        add = torch.cat([v[0] for _, v, _, _ in parts])
        newb = torch.cat([v[1] for _, v, _, _ in parts])
        step = max(1, len(add) // _CHOICE_SAMPLE)  # the choice on a sample, as for host parts
        op = _choose_op_sampled([(_unsigned(add[::step]), _unsigned(newb[::step]))])
        val = add if op is Op.ADD else torch.bitwise_xor(newb, newb - add)
    else:
        val = torch.cat([v for _, v, _, _ in parts])
    new = torch.cat([n for _, _, n, _ in parts]) if parts[0][2] is not None else None
    ordered = all(p[3] for p in parts) and all(int(a[0][-1]) < int(b[0][0]) for a, b in zip(parts, parts[1:]))
    if len(pos) > 1 and not ordered and not bool((pos[1:] > pos[:-1]).all()):
        order = torch.argsort(pos, stable=True)
        pos, val = pos[order], val[order]
        new = None if new is None else new[order]
    dtype, shape = spec
    return Record(name, dtype, tuple(shape), op, pos, val), new


def _part_bytes(parts: list) -> int:
    """Arena bytes one record's concatenations take at most (positions, values, new bits;
    op "auto": add, new bits and the xor computed from them); none for parts kept as
    tensors on their device."""
    first = parts[0]
    if isinstance(first[0], torch.Tensor):
        return 0
    auto = isinstance(first[1], tuple)
    values = (3 if auto else 1) * (first[1][0] if auto else first[1]).itemsize
    per = 8 + values + (first[2].itemsize if first[2] is not None else 0)  # positions as uint64
    return sum(p[0].size for p in parts) * per + 5 * Arena.ALIGN


def _cat(arrays: list[np.ndarray]) -> np.ndarray:
    return arrays[0] if len(arrays) == 1 else np.concatenate(arrays)


# op "auto" decides xor vs add on about this many values per record, evenly spread: the
# choice only affects the size, and two full histograms were a noticeable share of a
# change's coding. On
# real AdamW deltas (benchmarks/codec.py's model, three learning rates) samples of 2**11
# to 2**14 values chose as the full histograms did for every tensor.
_CHOICE_SAMPLE = 1 << 12


def _choose_op_sampled(pairs: list[tuple[np.ndarray, np.ndarray]]) -> Op:
    """values.choose_op on an even sample (every k-th value) of the (add, new bits) pairs."""
    total = sum(a.size for a, _ in pairs)
    step = max(1, total // _CHOICE_SAMPLE)
    ad = _cat([a[::step] for a, _ in pairs])
    new = _cat([n[::step] for _, n in pairs])
    return choose_op_from_add(ad, new, ad.dtype.itemsize)


def _xor_of(pairs: list[tuple[np.ndarray, np.ndarray]], arena: Arena) -> np.ndarray:
    """The xor values (new ^ old, old = new - add) of the (add, new bits) pairs, in the arena."""
    add = arena.concatenate([a for a, _ in pairs])
    new = arena.concatenate([n for _, n in pairs])
    out = arena.empty(add.size, add.dtype)
    np.subtract(new, add, out=out)
    return np.bitwise_xor(new, out, out=out)


def _increasing(parts: list, pos: np.ndarray) -> bool:
    """Whether the concatenated positions `pos` of `parts` are strictly increasing."""
    if all(p[3] for p in parts):  # each part is: check where they meet
        return all(int(a[0][-1]) < int(b[0][0]) for a, b in zip(parts, parts[1:]))
    return check_positions(pos, MAX_NUMEL) is None  # one compiled pass for uint32 / uint64 positions


class Producer:
    """Owns some ranges of the trainer's parameters and refits them."""

    def __init__(
        self,
        producer_id: str,
        owned: list[OwnedRange],
        maps: dict[str, AffineMap | ResidualMap],
        specs: dict,
        baseline: Baseline,
        end: ProducerEnd,
        *,
        op: Op | str = AUTO,
        max_payload_elements: int = 1 << 20,
        first_payload_elements: int | None = None,
        chunk_elements: int = 1 << 22,
        key: bytes | None = None,
        zstd_level: int = 1,
        params: dict[str, torch.Tensor] | None = None,
        encode_threads: int = 0,
        wire_version: int = FORMAT_VERSION,
        device_coding: str = "gpu",
        state_digest: bool = True,
        conditioned: bool = False,
    ):
        """`params`: whole local parameters by name, for the residuals this rank produces;
        by default taken from the owned ranges' live views (see `_whole_param`).
        `op`: "auto" (default): per canonical tensor and payload, xor or add, whichever
        codes smaller (docs/design-notes.md, "Codec"); or xor, add, overwrite for every record.
        `encode_threads`: threads that build and encode full payloads while this one goes
        on diffing (the compiled kernels run without the GIL); 0: it encodes each payload
        itself before it diffs on. Either way the payloads and their bytes are the same,
        and they are sent from this thread, in order. With threads, the process should keep
        freed memory (`nemo_dcr.malloc.keep_freed_memory`): glibc's per-thread arenas
        otherwise fault in fresh pages for every payload (docs/design-notes.md).
        `wire_version`: the format the payloads (and anchors) are written in: 5, the host
        format, or 6, the device format (experimental; docs/wire-format.md).
        `device_coding` (with wire_version 6): "gpu" (default): the changes of ranges that
        live on a GPU stay there - placed, gathered into records and coded there (format
        v6's prefix streams, `nemo_dcr.wire.prefix`); only the positions and new bits the
        baseline stages and the payloads' bytes reach the host. "always": the same torch
        code for ranges on the CPU too (slower than the compiled host path; for tests and
        benchmarks). "never": every range's changes are coded on the host.
        `state_digest`: keep the whole-state digest of this producer's share (read once
        here, moved by each refit's changes: `nemo_dcr.digest`). `track_state_digest`
        turns the per-refit part off and on: a refit that commits without it leaves the
        share's digest unknown (`digest` None) from then on.
        `first_payload_elements`: where the first payload of a refit is cut (default
        max_payload_elements // 16): a small first payload reaches the link after a
        sixteenth of the diffing a full one needs, and the link is the refit's bound.
        `conditioned`: code records against the committed bits where that is smaller
        (nemo_dcr.wire.conditioned; BF16/FP16 xor or add records of chunks that sit on one
        canonical span). Every receiver must then read its committed canonical bits: in
        place (a Hugging Face model, a tensor store) or from a canonical mirror (vLLM)."""
        if op != AUTO and op not in (Op.XOR, Op.ADD, Op.OVERWRITE):
            raise ValueError(f"unknown operation {op!r}")
        if type(encode_threads) is not int or encode_threads < 0:
            raise ValueError(f"encode_threads must be an int >= 0, got {encode_threads!r}")
        if type(wire_version) is not int or wire_version not in WRITABLE_VERSIONS:
            raise ValueError(f"wire_version must be {writable_versions_text()} (the formats payloads can "
                             f"be written in), got {wire_version!r}")
        if first_payload_elements is not None and (type(first_payload_elements) is not int
                                                   or first_payload_elements < 1):
            raise ValueError(f"first_payload_elements must be a positive int or None, got {first_payload_elements!r}")
        if device_coding not in ("gpu", "always", "never"):
            raise ValueError(f"device_coding must be 'gpu', 'always' or 'never', got {device_coding!r}")
        self.wire_version = wire_version
        self.device_coding = device_coding
        self.conditioned = conditioned
        self.encode_threads = encode_threads
        self.id, self.maps, self.specs, self.baseline, self.end = producer_id, maps, specs, baseline, end
        self.op = AUTO if op == AUTO else Op(op)
        self.max_payload_elements, self.chunk = max_payload_elements, chunk_elements
        self.first_payload_elements = first_payload_elements
        self.key, self.level = key, zstd_level
        # With a history, the encoded payloads of the transfer in flight, by id (the attempt
        # that last sent each): after the commit they are stored as that version's delta.
        self.keep_sent = False
        self.sent: dict[str, tuple[str, bytes]] = {}
        self._arena = Arena()  # the payload builders' concatenations, kept between refits
        self._spare_arenas: list[Arena] = []  # for payloads encoded on other threads, also kept
        self._pool: ThreadPoolExecutor | None = None  # the encoding threads, started by the first refit
        # Ranges no piece touches (replicas, padding) are never diffed or kept.
        self.owned = [r for r in owned if places_anything(maps[r.param.name], r.start, r.stop)]
        self.affine = [r for r in self.owned if not isinstance(maps[r.param.name], ResidualMap)]
        # Residuals this rank produces: (map, whole local parameter). Their baselines are
        # the canonical outputs of the parameter as it is now (the committed version).
        self.residuals = []
        for r in self.owned:
            rmap = maps[r.param.name]
            if isinstance(rmap, ResidualMap):
                whole = params[r.param.name] if params and r.param.name in params else _whole_param(r)
                if whole.numel() != rmap.numel:
                    raise ConverterError(f"{r.param.name}: whole parameter has {whole.numel()} elements, "
                                         f"the plan expects {rmap.numel}")
                self.residuals.append((rmap, whole))
        for r in self.affine:
            if r.key not in baseline.keys():
                baseline.register(r.key, dtypes.bits_of(r.tensor))
        for rmap, whole in self.residuals:
            for i, values in enumerate(self._residual_outputs(rmap, whole)):
                if rmap.outputs[i].pieces and rmap.key(i) not in baseline.keys():
                    baseline.register(rmap.key(i), values)
        # The whole-state digest of the committed bits this producer places (its share of the
        # model's), read once here, then moved by each refit's changes (`settle`).
        t = time.perf_counter()
        self.track_state_digest = state_digest
        self.digest: digest.StateDigest | None = None
        if state_digest:
            self.digest = digest.StateDigest()
            for name, cpos, bits in self._committed_elements():
                self.digest.add(name, digest.element_sums(name, cpos, bits))
        self.digest_load_s = time.perf_counter() - t
        self._target_digest: digest.StateDigest | None = None  # the last refit's, until it settles

    def _committed_elements(self):
        """(canonical name, positions, committed bits) of every element this producer
        places, chunk by chunk: what an anchor sends and the share digest sums."""
        def placed(key: str, amap: AffineMap, offset: int):
            bits = self.baseline.committed(key)
            for lo in range(0, bits.numel(), self.chunk):
                hi = min(lo + self.chunk, bits.numel())
                values = _unsigned(bits[lo:hi])
                for name, cpos, src in _placed(amap, np.arange(offset + lo, offset + hi, dtype=np.int64)):
                    yield name, cpos, values[src]

        for r in self.affine:
            yield from placed(r.key, self.maps[r.param.name], r.start)
        for rmap, _ in self.residuals:
            for i, out in enumerate(rmap.outputs):
                if out.pieces:
                    yield from placed(rmap.key(i), out, 0)

    def settle(self, committed: bool) -> None:
        """After the decision on the last refit: its target digest (None when it kept
        none) becomes the share's committed one, or is dropped."""
        if committed:
            self.digest = self._target_digest
        self._target_digest = None

    def _residual_outputs(self, rmap: ResidualMap, whole: torch.Tensor) -> list[torch.Tensor]:
        """Bit views of the residual's canonical outputs, checked against the plan."""
        with torch.no_grad():
            outs = rmap.compute(whole.detach().view(rmap.local_shape))
        bits = []
        for i, (t, dtype) in enumerate(zip(outs, rmap.dtypes)):
            if t.dtype != dtypes.from_name(dtype).torch_dtype:
                raise ConverterError(f"{rmap.local_name}: {rmap.kind} output {i} is {t.dtype}, canonical is {dtype}")
            bits.append(dtypes.bits_of(t.contiguous()))
        return bits

    def refit(self, transfer: TransferInfo, *, skip=frozenset()) -> ProducerReport:
        """Diff, place, encode and send one attempt of `transfer`.

        Payload ids are `<producer>-<n>`, numbered in scan order, and the scan is
        deterministic, so every attempt of a transfer cuts the same payloads. A retry
        (attempt > 0) sends them all as overwrites (new bits: a receiver may hold them
        half-applied, and a second delta would be wrong), except those in `skip`
        (finished on every receiver), which are cut but not sent."""
        rep = ProducerReport(self.id)
        t0, faults0, cpu0 = time.perf_counter(), page_faults(), time.thread_time()
        self.baseline.begin(transfer.target_version)
        builder, payload_ids, all_ids = _PayloadBuilder(transfer.readback, self._arena), [], []
        op_affine = Op.OVERWRITE if transfer.attempt > 0 else self.op
        if transfer.attempt == 0:
            self.sent = {}
        # With encode_threads, payloads being encoded elsewhere, in payload order: (id, arena, job, batch).
        in_flight: deque[tuple[str, Arena, Future, _Batch]] = deque()
        first_cut = self.first_payload_elements or max(1, self.max_payload_elements // 16)
        moved = digest.StateDigest()  # how this refit's changes move the share's state digest
        payload_moved = [0, 0]  # ... and how the payload being built moves it

        tracking = self.track_state_digest and self.digest is not None

        def account(name: str, op: Op, cpos, new, values) -> None:
            """The state digest's move by changes placed at `cpos` (see digest.change_delta)."""
            if not tracking:
                return
            t = time.perf_counter()
            sums = digest.change_delta(name, op, cpos, new, values)
            moved.add(name, sums)
            payload_moved[0] += sums[0]
            payload_moved[1] += sums[1]
            rep.times["state_digest"] += time.perf_counter() - t

        def full() -> bool:
            """Whether the payload being built is cut now (the first one early: see __init__)."""
            return builder.elements >= (self.max_payload_elements if all_ids else first_cut)

        def encode(batch: _Batch, pid: str, arena: Arena) -> tuple[bytes | None, dict, float, float]:
            """(the payload's bytes, None when it is skipped; its records' digests; seconds
            encoding; seconds digesting)."""
            t = time.perf_counter()
            records, digests, digest_s = batch.records(self.specs, arena)  # concatenation, op choice
            data = None
            if pid not in skip:
                header = PayloadHeader(transfer.transfer_id, transfer.base_version, transfer.target_version,
                                       self.id, pid)
                data = codec.encode(Payload(header, records), key=self.key, level=self.level,
                                    version=self.wire_version)
            return data, digests, time.perf_counter() - t - digest_s, digest_s

        def finish(pid: str, data: bytes | None, digests: dict, encode_s: float, digest_s: float) -> None:
            rep.times["encode"] += encode_s
            if transfer.readback:
                rep.readback[pid] = digests
                rep.times["digest"] = rep.times.get("digest", 0.0) + digest_s
            if data is None:
                return
            t = time.perf_counter()
            if rep.first_send_s is None:
                rep.first_send_s = t - t0
            self.end.send(transfer, pid, data)
            rep.times["send"] += time.perf_counter() - t
            if self.keep_sent:
                self.sent[pid] = (transfer.transfer_id, data)
            payload_ids.append(pid)
            rep.wire_bytes += len(data)

        def collect(keep: int) -> None:
            """Send the payloads encoded elsewhere, in order, until at most `keep` are left
            in flight (an encoding error is raised here). One that no thread has started
            yet is encoded here rather than waited for."""
            while in_flight and (len(in_flight) > keep or in_flight[0][2].done()):
                pid, arena, job, batch = in_flight.popleft()
                t = time.perf_counter()
                try:
                    result = encode(batch, pid, arena) if job.cancel() else job.result()
                finally:
                    self._spare_arenas.append(arena)
                rep.times["encode_wait"] += time.perf_counter() - t
                finish(pid, *result)

        def collect_last() -> None:
            """At the end: encode here, newest first, what no thread has started, while the
            threads finish the older ones; then send them all in order."""
            for k in reversed(range(len(in_flight))):
                pid, arena, job, batch = in_flight[k]
                if job.cancel():
                    in_flight[k] = (pid, arena, _run_now(encode, batch, pid, arena), batch)
            collect(keep=0)

        def emit(last: bool = False):
            pid = f"{self.id}-{len(all_ids):06d}"
            all_ids.append(pid)
            if tracking:
                rep.payload_digests[pid] = digest.to_hex(payload_moved)
            payload_moved[:] = [0, 0]
            if pid in skip and not transfer.readback:
                builder.clear()
                return
            if pool is None:
                finish(pid, *encode(builder.detach(), pid, self._arena))
                return
            arena = self._spare_arenas.pop() if self._spare_arenas else Arena()
            batch = builder.detach()
            # The last payload is encoded here: nothing is left to diff, and the hand-over would only cost.
            job = _run_now(encode, batch, pid, arena) if last else pool.submit(encode, batch, pid, arena)
            in_flight.append((pid, arena, job, batch))
            if not last:
                collect(keep=self.encode_threads)  # a queue no longer than the threads: bounded memory

        def scan(key: str, current: torch.Tensor, amap: AffineMap, offset: int, op: Op | str) -> int:
            """Diff `current` against the committed bits under `key`, place the changes
            through `amap` (local index = offset + position) and queue them; returns
            the number of changed elements."""
            committed = self.baseline.committed(key)
            rep.scanned_elements += current.numel()
            rep.scanned_bytes += current.numel() * current.element_size()
            changed = 0
            # Changes kept on their device and coded there (format v6): see device_coding.
            on_device = self.wire_version >= 6 and (
                self.device_coding == "always" or (self.device_coding == "gpu" and current.device.type != "cpu"))
            # CPU bit views with numba: one compiled pass per chunk gives the positions (range
            # relative), the new bits and the values to send; no torch op, no extra pass.
            fast = _compiled_diff(current, committed) and not on_device
            if fast:
                cur, com = current.detach().reshape(-1).numpy(), committed.detach().reshape(-1).numpy()
                sink = DiffOutput(current.numel())  # the chunks' changes end to end: records take them uncopied
                slots = _Slots(sink)  # and so the positions placed through strided pieces
            else:  # the committed bits where `current` is: the host copy, or a GPU mirror
                committed = self.baseline.committed_on(key, current.device)
                slots = None
            step = self.chunk if current.device.type == "cpu" else max(self.chunk, _DEVICE_CHUNK)
            for lo in range(0, current.numel(), step):
                hi = min(lo + step, current.numel())
                t = time.perf_counter()
                placed = None  # (canonical name, base, rows) when the diff gives canonical positions
                if fast:
                    # A 16-bit chunk inside one piece whose block rows end on diff blocks: the diff
                    # writes canonical positions (no placement pass over the changes), and the
                    # baseline maps them back to the range's at the commit.
                    placed = amap.diff_placement(offset + lo, offset + hi) if cur.itemsize == 2 else None
                    base, rows = (lo, None) if placed is None else placed[1:]
                    positions, new_bits, vals = diff_arrays(cur[lo:hi], com[lo:hi], _DIFF_VALUES[op], base=base,
                                                            narrow=True, out=sink, rows=rows)
                    if positions.size == 0:
                        rep.times["diff"] += time.perf_counter() - t
                        continue
                    moved = rows is not None or base != lo  # the positions are not the range's own
                    self.baseline.stage(key, torch.from_numpy(positions), torch.from_numpy(new_bits),
                                        local_of=functools.partial(_range_positions, lo, base, rows) if moved else None)
                    new = new_all = _bits_view(new_bits)
                    if op == AUTO:
                        both = (_bits_view(vals[0]), new)
                    else:
                        values = new if op == Op.OVERWRITE else _bits_view(vals[0])
                    told = (Op.XOR, _bits_view(vals[0])) if op == Op.OVERWRITE else None
                else:
                    delta = diff(current[lo:hi], committed[lo:hi])
                    if len(delta) == 0:
                        rep.times["diff"] += time.perf_counter() - t
                        continue
                    positions_t = delta.positions + lo if lo else delta.positions
                    positions_h, new_h = positions_t.cpu(), delta.new.cpu()  # to the host once each
                    self.baseline.stage(key, positions_h, new_h, on_device=(positions_t, delta.new))
                    if on_device:
                        changed += len(positions_t)
                        rep.times["diff"] += time.perf_counter() - t
                        t = time.perf_counter()
                        rep.placed_elements += _place_on_device(builder, amap, positions_t, offset, op, delta, account)
                        rep.times["place"] += time.perf_counter() - t
                        if full():
                            emit()
                        elif in_flight:
                            collect(keep=self.encode_threads)
                        continue
                    new = new_all = _bits_view(new_h.numpy())
                    if op == AUTO:
                        both = (_unsigned(delta.add()), new)
                    else:
                        pick = {Op.XOR: delta.xor, Op.ADD: delta.add, Op.OVERWRITE: lambda: new_h}[op]
                        values = _unsigned(pick())
                    told = (Op.XOR, _unsigned(delta.xor())) if op == Op.OVERWRITE else None
                    positions = positions_h.numpy()
                if not builder.track_new:
                    new = None
                # what tells the old bits, for the state digest: the add, or the xor
                dop, dvals = (Op.ADD, both[0]) if op == AUTO else told or (op, values)
                changed += positions.size
                rep.times["diff"] += time.perf_counter() - t
                t = time.perf_counter()
                spans = (_placed_spans(amap, positions, offset, slots) if placed is None
                         else [(placed[0], positions.view(_UNSIGNED[positions.dtype]), slice(None), True)])
                # Conditioned coding: a chunk whose diff gave canonical positions by one shift
                # sits on one canonical span, whose committed bits are com[lo:hi].
                span = (CommittedSpan(com, lo, hi, placed[1]) if self.conditioned and placed is not None
                        and placed[2] is None and op in (AUTO, Op.XOR, Op.ADD) else None)
                for name, cpos, src, increasing in spans:
                    builder.add(name, op, cpos, (both[0][src], both[1][src]) if op == AUTO else values[src],
                                None if new is None else new[src], increasing, span)
                    account(name, dop, cpos, new_all[src], dvals[src])
                    rep.placed_elements += cpos.size
                rep.times["place"] += time.perf_counter() - t
                if full():
                    emit()
                elif in_flight:
                    collect(keep=self.encode_threads)  # stream what is encoded without waiting for the next payload
            rep.changed_elements += changed
            return changed

        if self.encode_threads and self._pool is None:
            # Kept for the producer's life: fresh threads every refit would also start on fresh
            # malloc arenas (page faults); idle, they wait on a queue and exit with the producer.
            self._pool = ThreadPoolExecutor(self.encode_threads, f"dcr-encode-{self.id}")
        pool = self._pool
        try:
            for r in self.affine:
                scan(r.key, dtypes.bits_of(r.tensor), self.maps[r.param.name], r.start, op_affine)
            for rmap, whole in self.residuals:
                t = time.perf_counter()
                outputs = self._residual_outputs(rmap, whole)
                rep.times["residual"] += time.perf_counter() - t
                for i, current in enumerate(outputs):
                    if rmap.outputs[i].pieces:  # residual changes always travel as overwrites
                        rep.residual_elements += scan(rmap.key(i), current, rmap.outputs[i], 0, Op.OVERWRITE)
            if builder.elements or not all_ids:
                emit(last=True)  # an empty transfer still sends one (empty) payload: receivers see the producer
            collect_last()
        finally:
            if in_flight:  # an error: nothing of this refit left running, the arenas free again
                for _, _, job, _ in in_flight:
                    job.cancel()
                futures_wait([job for _, _, job, _ in in_flight])
                self._spare_arenas.extend(arena for _, arena, _, _ in in_flight)
        t = time.perf_counter()
        rep.rejected = self.end.flush(transfer, payload_ids)
        rep.times["flush"] = time.perf_counter() - t
        self._target_digest = self.digest.copy().merge(moved) if tracking else None
        rep.state_digest = self._target_digest.hex() if tracking else ""
        rep.page_faults = page_faults() - faults0
        rep.cpu_s = time.thread_time() - cpu0
        rep.payloads = len(payload_ids)
        rep.payload_ids = list(payload_ids)
        rep.all_payload_ids = all_ids
        return rep

    def anchor(self, version: int, put, transfer_id: str | None = None) -> dict[str, str]:
        """Every canonical element this producer places, at the committed `version`, as
        overwrite payloads; `put(payload_id, data)` stores each. Returns {payload id:
        transfer id} (the transfer id is `anchor-v<version>`, or `transfer_id`: a resync's)."""
        if self.baseline.version != version or (self.baseline.in_flight and transfer_id is None):
            raise ValueError(f"anchor of version {version}: the baseline is at {self.baseline.version}"
                             f"{' with a transfer in flight' if self.baseline.in_flight else ''}")
        tid, builder, ids = transfer_id or f"anchor-v{version}", _PayloadBuilder(arena=self._arena), {}

        def emit():
            pid = f"{self.id}-{len(ids):06d}"
            header = PayloadHeader(tid, version, version, self.id, pid)
            put(pid, codec.encode(Payload(header, builder.take(self.specs)), key=self.key, level=self.level,
                                  version=self.wire_version))
            ids[pid] = tid

        for name, cpos, values in self._committed_elements():
            builder.add(name, Op.OVERWRITE, cpos, values)
            if builder.elements >= self.max_payload_elements:
                emit()
        if builder.elements or not ids:
            emit()
        return ids

    def resync(self, transfer: TransferInfo) -> ProducerReport:
        """A dense resync (`transfer.resync`): every element this producer places, at the
        committed version, sent as overwrites; receivers that hold it take none of it."""
        rep = ProducerReport(self.id)
        t0 = time.perf_counter()

        def send(pid: str, data: bytes) -> None:
            t = time.perf_counter()
            self.end.send(transfer, pid, data)
            rep.times["send"] += time.perf_counter() - t
            rep.wire_bytes += len(data)

        ids = list(self.anchor(transfer.base_version, send, transfer.transfer_id))
        rep.times["encode"] = time.perf_counter() - t0 - rep.times["send"]
        t = time.perf_counter()
        rep.rejected = self.end.flush(transfer, ids)
        rep.times["flush"] = time.perf_counter() - t
        rep.payloads, rep.payload_ids, rep.all_payload_ids = len(ids), ids, list(ids)
        rep.state_digest = self.digest.hex() if self.digest is not None else ""
        return rep


def _run_now(fn, *args) -> Future:
    """fn(*args) run on this thread, as a finished Future (its result or its exception)."""
    done: Future = Future()
    try:
        done.set_result(fn(*args))
    except BaseException as e:  # raised again where the result is taken, in payload order
        done.set_exception(e)
    return done


def _place_on_device(builder: _PayloadBuilder, amap: AffineMap, positions: torch.Tensor, offset: int,
                     op: Op | str, delta, account) -> int:
    """Place a chunk's changes (`diff.Delta`, positions range-relative + chunk start, on
    their device) through `amap` (local index = offset + position) into the builder as
    tensors, values and all, where they are; `account(name, op, positions, new, values)`
    is told of each (the state digest, computed there too). Returns the elements placed."""
    if op == AUTO:
        values = (delta.add(), delta.new)
    else:
        values = {Op.XOR: delta.xor, Op.ADD: delta.add, Op.OVERWRITE: lambda: delta.new}[op]()
    # what tells the old bits, for the state digest: the add, or the xor
    dop, dvals = (Op.ADD, values[0]) if op == AUTO else (Op.XOR, delta.xor()) if op == Op.OVERWRITE else (op, values)
    new = delta.new if builder.track_new else None
    spans = amap.place_spans(positions, offset)
    groups: dict[str, list] = {}
    for name, cpos, lo, hi, increasing in spans:
        groups.setdefault(name, []).append((cpos, lo, hi, increasing))
    placed = 0
    for name, pieces in groups.items():
        if len(pieces) == 1:  # the usual case: one piece of this tensor, a contiguous slice
            cpos, lo, hi, increasing = pieces[0]
            src = slice(lo, hi)
        else:  # several pieces of one canonical tensor: merged in canonical order
            cpos = torch.cat([c for c, _, _, _ in pieces])
            src = torch.cat([torch.arange(lo, hi, device=cpos.device) for _, lo, hi, _ in pieces])
            order = torch.argsort(cpos, stable=True)
            cpos, src, increasing = cpos[order], src[order], True
        vals = (values[0][src], values[1][src]) if op == AUTO else values[src]
        builder.add(name, op, cpos, vals, None if new is None else new[src], increasing)
        account(name, dop, cpos, delta.new[src], dvals[src])
        placed += len(cpos)
    return placed


def _placed(amap: AffineMap, local: np.ndarray):
    """(canonical name, positions uint64, source index or slice) per touched canonical
    tensor. When every touched piece has its own tensor (the usual case) the sources are
    contiguous ranges of `local`, taken as slices (views), not gathered."""
    placed = amap.place(local)
    if len({name for name, _, _ in placed}) == len(placed):
        return [(name, cpos.view(np.uint64) if cpos.dtype == np.int64 else cpos.astype(np.uint64),
                 slice(int(src[0]), int(src[-1]) + 1)) for name, cpos, src in placed]
    return [(name, cpos, src) for name, (cpos, src) in merge_placed(placed).items()]


_UNSIGNED = {np.dtype(np.int64): np.uint64, np.dtype(np.int32): np.uint32}  # canonical_index gives these two


def _placed_spans(amap: AffineMap, positions: np.ndarray, offset: int, slots: _Slots | None = None):
    """`_placed` of local positions `positions + offset` (sorted int64 or int32), with a fourth
    field: whether the canonical positions are known strictly increasing. Every touched
    piece with its own tensor (the usual case) takes a contiguous range of `positions`,
    returned as a slice; the offset is folded into the pieces, not added to a copy.
    `slots`: where computed canonical positions go, piece by piece (see _Slots)."""
    spans = amap.place_spans(positions, offset, None if slots is None else slots.take)
    if len({name for name, *_ in spans}) == len(spans):
        # int32 positions stay 32-bit (as uint32): see _Batch.records
        return [(name, cpos.view(_UNSIGNED[cpos.dtype]), slice(lo, hi), increasing)
                for name, cpos, lo, hi, increasing in spans]
    placed = [(name, cpos, np.arange(lo, hi)) for name, cpos, lo, hi, _ in spans]
    return [(name, cpos, src, True) for name, (cpos, src) in merge_placed(placed).items()]


def _range_positions(lo: int, base: int, rows: Rows | None, positions: torch.Tensor) -> torch.Tensor:
    """Positions relative to the range of a chunk from `lo` that the diff gave as
    canonical ones (`base` and `rows` as it was given them): the baseline's coordinates."""
    pos = positions.numpy()
    index = pos.astype(np.int64) - base if rows is None else rows.index(pos, base)
    return torch.from_numpy(index + lo)


class _Slots:
    """Arrays handed out end to end in one growing buffer per key (a piece of a local tensor),
    so that the canonical positions a piece computes chunk after chunk can be taken as one
    view by the payload builder (`_end_to_end`), as the diff's own arrays are
    (`diff.DiffOutput`, whose capacity sizes a new buffer: about the rest of the range's
    changes). A request that does not fit starts a new buffer; views handed out stay valid."""

    def __init__(self, sink: DiffOutput):
        self.sink = sink
        self.bufs: dict[int, tuple[np.ndarray, int]] = {}

    def take(self, key: int, n: int, dtype) -> np.ndarray:
        buf, used = self.bufs.get(key, (None, 0))
        if buf is None or buf.dtype != dtype or used + n > buf.size:
            room = self.sink.bufs[0].size if self.sink.bufs is not None else 0
            buf, used = np.empty(max(n, room), dtype), 0
        self.bufs[key] = (buf, used + n)
        return buf[used:used + n]


# diff_arrays values per operation: what the records carry (overwrite: the new bits)
# op "auto": the add values (what the choice keeps in practice: +-1 ULP steps and AdamW
# deltas alike) and the new bits, from which the rarer xor records are computed.
# overwrite: the xor too, for the state digest (old = new ^ xor; the record carries the new bits)
_DIFF_VALUES = {Op.XOR: ("xor",), Op.ADD: ("add",), Op.OVERWRITE: ("xor",), AUTO: ("add",)}
# Elements per diff chunk on a GPU: each chunk costs a few synchronising copies (nonzero,
# then the changes to the host), so chunks are larger there; a chunk's mask is one byte
# per element, small beside the weights.
_DEVICE_CHUNK = 1 << 26
_NP_BITS = (torch.int8, torch.uint8, torch.int16, torch.int32)


def _compiled_diff(current: torch.Tensor, committed: torch.Tensor) -> bool:
    """Whether `diff_arrays` (compiled) can diff these bit views directly."""
    return (kernels.common.HAVE_NUMBA and current.device.type == "cpu" and committed.device.type == "cpu"
            and current.dtype == committed.dtype and current.dtype in _NP_BITS
            and current.shape == committed.shape and current.is_contiguous() and committed.is_contiguous())


def _bits_view(a: np.ndarray) -> np.ndarray:
    return a.view(dtypes.unsigned(a.itemsize))


def _unsigned(t: torch.Tensor) -> np.ndarray:
    a = t.cpu().numpy()
    return a.view(dtypes.unsigned(a.itemsize))


def _whole_param(r: OwnedRange) -> torch.Tensor:
    """The whole local parameter behind the owned range [0, stop) of it.

    Owned ranges are live 1-D views into the parameter's storage (`capture._owned`),
    so the range that starts at element 0 starts where the parameter does. Fails
    closed when the view does not reach the parameter's storage (a copy was captured):
    pass `params=` then."""
    t, numel = r.tensor, r.param.numel
    if t is None or r.start != 0 or t.dim() != 1 or (t.numel() > 1 and t.stride(0) != 1):
        raise ConverterError(f"{r.param.name}: the residual needs the whole local parameter; "
                             f"its owned range {r.key} is not a live view of it (pass params=)")
    if (t.storage_offset() + numel) * t.element_size() > t.untyped_storage().nbytes():
        raise ConverterError(f"{r.param.name}: owned range {r.key} is not a view into the parameter's "
                             f"storage, so the whole parameter cannot be read from it (pass params=)")
    return t.as_strided((numel,), (1,), t.storage_offset())
