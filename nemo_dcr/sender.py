"""Producer side of one refit: diff owned ranges against the committed baseline,
place the changes in canonical coordinates, encode payloads and stream them out
while later ranges are still being diffed. The parts, each in a module of its own:
the scanners (`nemo_dcr.scan`: diff, stage, place), the payload builder and encoder
(`nemo_dcr.payload_builder`), the encoding threads (`nemo_dcr.encode_queue`) and their
memory (`nemo_dcr.arena`); here, the `Producer` that runs them top-down (`Producer.refit`).

Residual rules (`ResidualMap`) take a second path: the rank that produces a residual
recomputes its canonical outputs from the whole local parameter, diffs them against
the residual baseline (keyed by canonical slice, committed and aborted with the rest)
and sends the changes as overwrites, whatever the operation of the affine changes."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import NamedTuple

import numpy as np
import torch

from nemo_dcr import digest, dtypes
from nemo_dcr.arena import Arena
from nemo_dcr.baseline import Baseline
from nemo_dcr.dtypes import host_bits
from nemo_dcr.encode_queue import EncodeQueue
from nemo_dcr.errors import ConverterError
from nemo_dcr.layout import OwnedRange
from nemo_dcr.metrics import page_faults
from nemo_dcr.payload_builder import EncodedPayload, PayloadBuilder, PayloadEncoder
from nemo_dcr.placement import AffineMap, ResidualMap, place_by_tensor, places_anything
from nemo_dcr.records import AUTO, Op, Payload, PayloadHeader, TransferInfo
from nemo_dcr.scan import ScanTarget, chunk_step, scanner_for
from nemo_dcr.transport import ProducerEnd
from nemo_dcr.wire import codec
from nemo_dcr.wire.versions import DEVICE_FORMAT, FORMAT_VERSION, WRITABLE_VERSIONS, writable_versions_text


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


class ProducedResidual(NamedTuple):
    """A residual this rank produces: its map, and the whole local parameter its canonical
    outputs are recomputed from."""

    rmap: ResidualMap
    whole: torch.Tensor


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
        device_payloads: bool = False,
    ):
        """`params`: whole local parameters by name, for the residuals this rank produces;
        by default taken from the owned ranges' live views (see `_whole_param`).
        `op`: "auto" (default): per canonical tensor and payload, xor or add, whichever
        codes smaller (docs/design-notes.md, "Codec"); or xor, add, overwrite for every record.
        `encode_threads`: threads that build and encode full payloads while this one goes
        on diffing (`nemo_dcr.encode_queue`: the compiled kernels run without the GIL); 0:
        it encodes each payload itself before it diffs on. Either way the payloads and
        their bytes are the same, and they are sent from this thread, in order. With
        threads, the process should keep freed memory (`nemo_dcr.malloc.keep_freed_memory`):
        glibc's per-thread arenas otherwise fault in fresh pages for every payload
        (docs/design-notes.md).
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
        place (a Hugging Face model, a tensor store) or from a canonical mirror (vLLM).
        `device_payloads` (wire_version 6, no key, a transport whose producer end carries
        device tensors: the local one): each payload is sealed where the owned ranges live
        (`codec.encode(on_device=)`, the device checksum in its trailer) and sent as a uint8
        tensor there, so the device-coded streams never reach the host; the local transport
        hands it to receivers by CUDA IPC. On the CPU the same frames are sent as host bytes."""
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
        self.payload_device = _payload_device(owned, device_payloads, wire_version, key, end)
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
        # the encoding threads (started by the first refit) and their arenas, also kept
        self.encode_queue = EncodeQueue(encode_threads, f"dcr-encode-{producer_id}") if encode_threads else None
        # Ranges no piece touches (replicas, padding) are never diffed or kept.
        self.owned = [r for r in owned if places_anything(maps[r.param.name], r.start, r.stop)]
        self.affine = [r for r in self.owned if not isinstance(maps[r.param.name], ResidualMap)]
        # Residuals this rank produces (ProducedResidual). Their baselines are
        # the canonical outputs of the parameter as it is now (the committed version).
        self.residuals: list[ProducedResidual] = []
        for r in self.owned:
            rmap = maps[r.param.name]
            if isinstance(rmap, ResidualMap):
                whole = params[r.param.name] if params and r.param.name in params else _whole_param(r)
                if whole.numel() != rmap.numel:
                    raise ConverterError(f"{r.param.name}: whole parameter has {whole.numel()} elements, "
                                         f"the plan expects {rmap.numel}")
                self.residuals.append(ProducedResidual(rmap, whole))
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
        for r in self.affine:
            yield from self._committed_placed(r.key, self.maps[r.param.name], r.start)
        for rmap, _ in self.residuals:
            for i, out in enumerate(rmap.outputs):
                if out.pieces:
                    yield from self._committed_placed(rmap.key(i), out, 0)

    def _committed_placed(self, key: str, amap: AffineMap, offset: int):
        """`_committed_elements` of one range (or residual output), placed through `amap`."""
        bits = self.baseline.committed(key)
        for lo in range(0, bits.numel(), self.chunk):
            hi = min(lo + self.chunk, bits.numel())
            values = host_bits(bits[lo:hi])
            for name, cpos, src in place_by_tensor(amap, np.arange(offset + lo, offset + hi, dtype=np.int64)):
                yield name, cpos, values[src]

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
        (finished on every receiver), which are cut but not sent.

        Top-down: the baseline begins the transfer; each owned range, then each residual
        output this rank produces, is scanned chunk by chunk (`_scan`: diff, stage the
        changes in the baseline, place them in canonical coordinates into the payload
        builder); between chunks a full payload is cut, encoded (here or on the encode
        threads) and sent, in order (`_Outbox`); at the end the last payload leaves, then
        the manifest (`flush`). Receivers stage and apply; the coordinator's commit makes
        the staged changes the baseline's committed bits (`Baseline.commit`, `settle`)."""
        rep = ProducerReport(self.id)
        started, faults0, cpu0 = time.perf_counter(), page_faults(), time.thread_time()
        self.baseline.begin(transfer.target_version)
        if transfer.attempt == 0:
            self.sent = {}
        builder = PayloadBuilder(transfer.readback, self._arena)
        moves = digest.StateDigestMove(self.track_state_digest and self.digest is not None)
        target = ScanTarget(self.baseline, builder, moves, rep.times, self.conditioned)
        outbox = _Outbox(self, transfer, skip, rep, builder, moves, started)
        op = Op.OVERWRITE if transfer.attempt > 0 else self.op
        if self.encode_queue is not None:
            self.encode_queue.start()
        try:
            for r in self.affine:
                self._scan(target, outbox, r.key, dtypes.bits_of(r.tensor), self.maps[r.param.name], r.start, op)
            for rmap, whole in self.residuals:
                t = time.perf_counter()
                outputs = self._residual_outputs(rmap, whole)
                rep.times["residual"] += time.perf_counter() - t
                for i, current in enumerate(outputs):
                    if rmap.outputs[i].pieces:  # residual changes always travel as overwrites
                        rep.residual_elements += self._scan(target, outbox, rmap.key(i), current, rmap.outputs[i],
                                                            0, Op.OVERWRITE)
            outbox.close()
        finally:
            if self.encode_queue is not None:  # after an error: nothing of this refit left running
                self.encode_queue.cancel()
        rep.times["state_digest"] = moves.seconds
        t = time.perf_counter()
        rep.rejected = self.end.flush(transfer, outbox.payload_ids)
        rep.times["flush"] = time.perf_counter() - t
        self._target_digest = self.digest.copy().merge(moves.moved) if moves.tracking else None
        rep.state_digest = self._target_digest.hex() if moves.tracking else ""
        rep.page_faults = page_faults() - faults0
        rep.cpu_s = time.thread_time() - cpu0
        rep.payloads = len(outbox.payload_ids)
        rep.payload_ids = list(outbox.payload_ids)
        rep.all_payload_ids = outbox.all_ids
        return rep

    def _scan(self, target: ScanTarget, outbox: _Outbox, key: str, current: torch.Tensor, amap: AffineMap,
              offset: int, op: Op | str) -> int:
        """Diff `current` against the committed bits under `key`, stage the changes, place
        them through `amap` (local index = offset + position) and queue them, chunk by
        chunk (`nemo_dcr.scan`), full payloads leaving between chunks; returns the number
        of changed elements."""
        rep = outbox.report
        rep.scanned_elements += current.numel()
        rep.scanned_bytes += current.numel() * current.element_size()
        # Changes kept on their device and coded there (format v6): see device_coding.
        on_device = self.wire_version >= 6 and (
            self.device_coding == "always" or (self.device_coding == "gpu" and current.device.type != "cpu"))
        scanner = scanner_for(current, self.baseline.committed(key), on_device)
        changed = 0
        for chunk in scanner(target, key, current, amap, offset, op, chunk_step(current, self.chunk)):
            changed += chunk.changed
            rep.placed_elements += chunk.placed
            outbox.after_chunk()
        rep.changed_elements += changed
        return changed

    def anchor(self, version: int, put, transfer_id: str | None = None) -> dict[str, str]:
        """Every canonical element this producer places, at the committed `version`, as
        overwrite payloads; `put(payload_id, data)` stores each. Returns {payload id:
        transfer id} (the transfer id is `anchor-v<version>`, or `transfer_id`: a resync's)."""
        if self.baseline.version != version or (self.baseline.in_flight and transfer_id is None):
            raise ValueError(f"anchor of version {version}: the baseline is at {self.baseline.version}"
                             f"{' with a transfer in flight' if self.baseline.in_flight else ''}")
        tid, builder, ids = transfer_id or f"anchor-v{version}", PayloadBuilder(arena=self._arena), {}

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


class _Outbox:
    """One refit's payloads on their way out, in payload order: cut from the builder (the
    first one early: see Producer), encoded here or on the producer's encode queue, and
    sent from this thread. Either way the payloads and their bytes are the same."""

    def __init__(self, producer: Producer, transfer: TransferInfo, skip, report: ProducerReport,
                 builder: PayloadBuilder, moves: digest.StateDigestMove, started: float):
        self.producer, self.transfer, self.skip, self.report = producer, transfer, skip, report
        self.builder, self.moves, self.started = builder, moves, started
        self.queue = producer.encode_queue
        self.encoder = PayloadEncoder(transfer, producer.id, producer.specs, producer.key, producer.level,
                                      producer.wire_version, skip, producer.payload_device)
        self.first_cut = producer.first_payload_elements or max(1, producer.max_payload_elements // 16)
        self.payload_ids: list[str] = []  # sent this attempt: what the manifest lists
        self.all_ids: list[str] = []  # ... and those cut but skipped (finished everywhere)

    def after_chunk(self) -> None:
        """Between two scanned chunks: cut the payload when it is full, else send what the
        threads encoded meanwhile (without waiting for the next payload)."""
        if self.builder.elements >= (self.producer.max_payload_elements if self.all_ids else self.first_cut):
            self.cut()
        elif self.queue is not None and len(self.queue):
            self._send_collected(self.queue.collect(keep=self.queue.threads))

    def close(self) -> None:
        """The last payload (an empty transfer still sends one, empty: receivers see the
        producer), then every payload still being encoded, in order."""
        if self.builder.elements or not self.all_ids:
            self.cut(last=True)
        if self.queue is not None:
            self._send_collected(self.queue.collect_all())

    def cut(self, last: bool = False) -> None:
        """The payload built so far gets the next id; unless skipped, it is encoded and sent."""
        pid = f"{self.producer.id}-{len(self.all_ids):06d}"
        self.all_ids.append(pid)
        moved = self.moves.take_payload()
        if moved is not None:
            self.report.payload_digests[pid] = moved
        if pid in self.skip and not self.transfer.readback:
            self.builder.clear()
            return
        if self.queue is None:
            self._send(pid, self.encoder.encode(self.builder.detach(), pid, self.producer._arena))
            return
        # The last payload is encoded here: nothing is left to diff, and the hand-over would only cost.
        self.queue.submit(pid, self.builder.detach(), self.encoder, here=last)
        if not last:  # a queue no longer than the threads: bounded memory
            self._send_collected(self.queue.collect(keep=self.queue.threads))

    def _send_collected(self, collected) -> None:
        """Send what the encode queue hands back (`EncodeQueue.collect`), in order."""
        for payload_id, encoded, wait_s in collected:
            self.report.times["encode_wait"] += wait_s
            self._send(payload_id, encoded)

    def _send(self, pid: str, encoded: EncodedPayload) -> None:
        rep = self.report
        rep.times["encode"] += encoded.encode_s
        if self.transfer.readback:
            rep.readback[pid] = encoded.digests
            rep.times["digest"] = rep.times.get("digest", 0.0) + encoded.digest_s
        if encoded.data is None:
            return
        t = time.perf_counter()
        if rep.first_send_s is None:
            rep.first_send_s = t - self.started
        self.producer.end.send(self.transfer, pid, encoded.data)
        rep.times["send"] += time.perf_counter() - t
        if self.producer.keep_sent:
            self.producer.sent[pid] = (self.transfer.transfer_id, encoded.data)
        self.payload_ids.append(pid)
        rep.wire_bytes += len(encoded.data)


def _payload_device(owned: list[OwnedRange], device_payloads: bool, wire_version: int, key: bytes | None,
                    end: ProducerEnd) -> torch.device | None:
    """Where payloads are sealed (Producer's `device_payloads`): the owned ranges' one
    device, or None (host bytes). ValueError naming what rules it out."""
    if not device_payloads:
        return None
    if wire_version != DEVICE_FORMAT:
        raise ValueError(f"device_payloads needs wire_version {DEVICE_FORMAT}, got {wire_version}")
    if key is not None:
        raise ValueError("device_payloads cannot be signed: an HMAC needs the payload's bytes on the host "
                         "(leave key unset, or device_payloads off)")
    if not getattr(end, "carries_device_tensors", False):
        raise ValueError(f"device_payloads needs a transport that carries device tensors (the local one); "
                         f"{type(end).__name__} sends bytes")
    devices = {r.tensor.device for r in owned if r.tensor is not None}
    if len(devices) > 1:
        raise ValueError(f"device_payloads needs the owned ranges on one device, they are on {sorted(map(str, devices))}")
    return devices.pop() if devices else torch.device("cpu")


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
