"""Producer side of one refit: diff owned ranges against the committed baseline,
place the changes in canonical coordinates, encode payloads and stream them out
while later ranges are still being diffed."""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import numpy as np
import torch

from nemo_dcr import codec, dtypes
from nemo_dcr.baseline import Baseline
from nemo_dcr.diff import diff
from nemo_dcr.layout import OwnedRange
from nemo_dcr.placement import AffineMap, merge_placed
from nemo_dcr.records import Op, Payload, PayloadHeader, Record
from nemo_dcr.transport import ProducerEnd, TransferInfo


@dataclass
class ProducerReport:
    producer_id: str
    scanned_elements: int = 0
    scanned_bytes: int = 0
    changed_elements: int = 0
    placed_elements: int = 0
    payloads: int = 0
    wire_bytes: int = 0
    first_send_s: float | None = None  # seconds from refit start to the first payload leaving
    times: dict[str, float] = field(default_factory=lambda: dict.fromkeys(("diff", "place", "encode", "send", "flush"), 0.0))
    rejected: dict[str, dict[str, str]] = field(default_factory=dict)
    error: str | None = None

    def to_json(self) -> dict:
        return self.__dict__.copy()


class _PayloadBuilder:
    """Accumulates placed changes per canonical tensor until a payload is full."""

    def __init__(self):
        self.parts: dict[str, list[tuple[np.ndarray, np.ndarray]]] = {}
        self.elements = 0

    def add(self, name: str, positions: np.ndarray, values: np.ndarray) -> None:
        self.parts.setdefault(name, []).append((positions, values))
        self.elements += positions.size

    def take(self, specs: dict, op: Op) -> list[Record]:
        records = []
        for name, parts in self.parts.items():
            pos = np.concatenate([p for p, _ in parts])
            val = np.concatenate([v for _, v in parts])
            if pos.size > 1 and not np.all(pos[1:] > pos[:-1]):
                order = np.argsort(pos, kind="stable")
                pos, val = pos[order], val[order]
            dtype, shape = specs[name]
            records.append(Record(name, dtype, tuple(shape), op, pos.astype(np.uint64, copy=False), val))
        self.parts, self.elements = {}, 0
        return records


class Producer:
    """Owns some ranges of the trainer's parameters and refits them."""

    def __init__(
        self,
        producer_id: str,
        owned: list[OwnedRange],
        maps: dict[str, AffineMap],
        specs: dict,
        baseline: Baseline,
        end: ProducerEnd,
        *,
        op: Op = Op.XOR,
        max_payload_elements: int = 1 << 20,
        chunk_elements: int = 1 << 22,
        key: bytes | None = None,
        zstd_level: int = 1,
    ):
        if op not in (Op.XOR, Op.ADD, Op.OVERWRITE):
            raise ValueError(f"unknown operation {op!r}")
        self.id, self.maps, self.specs, self.baseline, self.end = producer_id, maps, specs, baseline, end
        self.op, self.max_payload_elements, self.chunk = Op(op), max_payload_elements, chunk_elements
        self.key, self.level = key, zstd_level
        # Ranges no piece touches (replicas, padding) are never diffed or kept.
        self.owned = [r for r in owned if _places_anything(maps[r.param.name], r)]
        for r in self.owned:
            if r.key not in baseline.keys():
                baseline.register(r.key, dtypes.bits_of(r.tensor))

    def refit(self, transfer: TransferInfo) -> ProducerReport:
        rep = ProducerReport(self.id)
        t0 = time.perf_counter()
        self.baseline.begin(transfer.target_version)
        builder, payload_ids = _PayloadBuilder(), []

        def emit():
            records = builder.take(self.specs, self.op)
            t = time.perf_counter()
            header = PayloadHeader(transfer.transfer_id, transfer.base_version, transfer.target_version,
                                   self.id, f"{self.id}-{len(payload_ids):06d}")
            data = codec.encode(Payload(header, records), key=self.key, level=self.level)
            rep.times["encode"] += time.perf_counter() - t
            t = time.perf_counter()
            if rep.first_send_s is None:
                rep.first_send_s = t - t0
            self.end.send(transfer, header.payload_id, data)
            rep.times["send"] += time.perf_counter() - t
            payload_ids.append(header.payload_id)
            rep.wire_bytes += len(data)

        for r in self.owned:
            current = dtypes.bits_of(r.tensor)
            committed = self.baseline.committed(r.key)
            amap = self.maps[r.param.name]
            rep.scanned_elements += len(r)
            rep.scanned_bytes += len(r) * current.element_size()
            for lo in range(0, len(r), self.chunk):
                hi = min(lo + self.chunk, len(r))
                t = time.perf_counter()
                delta = diff(current[lo:hi], committed[lo:hi].to(current.device))
                if len(delta) == 0:
                    rep.times["diff"] += time.perf_counter() - t
                    continue
                positions = delta.positions + lo
                self.baseline.stage(r.key, positions, delta.new)
                values = {Op.XOR: delta.xor, Op.ADD: delta.add, Op.OVERWRITE: lambda: delta.new}[self.op]()
                values = _unsigned(values)
                rep.changed_elements += len(delta)
                rep.times["diff"] += time.perf_counter() - t
                t = time.perf_counter()
                local = positions.cpu().numpy() + r.start
                for name, (cpos, src) in merge_placed(amap.place(local)).items():
                    builder.add(name, cpos, values[src])
                    rep.placed_elements += cpos.size
                rep.times["place"] += time.perf_counter() - t
                if builder.elements >= self.max_payload_elements:
                    emit()
        if builder.elements or not payload_ids:
            emit()  # an empty transfer still sends one (empty) payload: receivers see the producer
        t = time.perf_counter()
        rep.rejected = self.end.flush(transfer, payload_ids)
        rep.times["flush"] = time.perf_counter() - t
        rep.payloads = len(payload_ids)
        return rep


def _unsigned(t: torch.Tensor) -> np.ndarray:
    a = t.cpu().numpy()
    return a.view(np.dtype(f"<u{a.itemsize}"))


def _places_anything(amap: AffineMap, r: OwnedRange) -> bool:
    return any(p.local_start < r.stop and p.local_stop > r.start for p in amap.pieces)
