"""Projecting a refit at the paper's scale from per-byte costs measured here.

Nothing at 30B–1T scale runs on a development machine, so `nemo-dcr project` does the
arithmetic instead, in the open: it measures what this library costs per byte on this
machine (wire bytes per changed element with the real codec, trainer-side
diff + encode throughput on one core, receiver-side decode + apply throughput on one
core, memcpy beside them), takes a cluster description, and prints each stage's time
with every assumption that went into it. A projection is a model, not a measurement;
its job is to say which resource bounds a refit and by how much.

Model (every byte counted once; payloads stream while deltas are built, so stages overlap):

* dense bytes D = params × 2 (BF16); changed elements k = change_rate × params;
  wire bytes W = k × (measured wire bytes per changed element at that change rate).
* scan: each producer node scans D / producer_nodes bytes with its diff + encode
  throughput (measured per core × cores per node × an assumed device speed-up when
  the path runs on GPUs).
* cross-region: W crosses the region boundary once at `cross_gbps`, the aggregate rate
  across it. Default: the paper's own links, i.e. the rate its dense reference implies
  (a 1T BF16 checkpoint, 2 TB, in 87.5 min between two AWS regions: about 3 Gbit/s, one
  stream's worth, although its nodes have up to 5 Gbit/s each). The dense reference and
  the delta refit then cross the same links, like for like.
* fan-out (relay tree, inside the receiver region): every receiver node needs the part
  of W its shard holds (W / nodes per replica); a relay forwards it to `fanout`
  children at `intra_gbps`; the tree is ceil(log_fanout(replicas)) deep.
* apply: every worker of a receiver node (one per GPU, tensor parallel) decodes the
  node's whole share and applies its part, on its share of the node's cores (threads ×
  the measured per-core throughput × a per-thread efficiency).
* total ≈ the slowest stage + pipeline fill (one chunk through every stage) + a commit
  round trip; the serial sum is printed beside it as the no-overlap bound.
* dense reference: D over the same cross-region links.
"""

from __future__ import annotations

import dataclasses
import math
import time
from dataclasses import asdict, dataclass, field

import numpy as np
import torch

from nemo_dcr.diff import diff
from nemo_dcr.records import Op, Payload, PayloadHeader, Record
from nemo_dcr.runtimes.scatter import share_of_cores
from nemo_dcr.wire import codec
from nemo_dcr.wire.values import choose_op_from_add

PAPER_1T_3PCT_S = 150.0  # the paper's 1T relay-tree refit at a 3% change rate
PAPER_DENSE_1T_S = 87.5 * 60  # the paper's full 1T checkpoint between two AWS regions
PAPER_DENSE_1T_BYTES = 1e12 * 2  # 1T parameters in BF16
PAPER_DENSE_120B = (247.2e9, 750.0)  # the paper's 120B checkpoint: bytes, full-transfer seconds
# The rate across the region boundary that the paper's dense reference implies.
PAPER_LINK_GBPS = PAPER_DENSE_1T_BYTES * 8 / PAPER_DENSE_1T_S / 1e9
GOAL_1T_3PCT_S = PAPER_1T_3PCT_S / 2  # half the paper's refit time, on its own links


@dataclass(frozen=True)
class ConditionedCosts:
    """What baseline-conditioned coding (nemo_dcr.wire.conditioned) changes, measured on
    real pretrained AdamW deltas (benchmarks/real_deltas.py, the Qwen3-style 0.5B model at
    2.1% changed; benchmarks/results/real_deltas.json): the synthetic ±1-ULP changes this
    command measures have no baseline structure to exploit, so their ratio cannot be
    measured here."""

    wire_ratio: float = 0.709  # conditioned / plain wire bytes on those deltas
    encode_elements_per_s_per_core: float = 288e6  # the producer's extra pass and coding, per element scanned
    decode_elements_per_s_per_core: float = 437e6  # a receiver's pass over each record's universe


@dataclass
class Costs:
    """Per-byte costs measured on this machine (one core)."""

    change_rate: float
    wire_bytes_per_change: float
    scan_gbps_per_core: float  # GB/s of BF16 bytes through diff + encode
    apply_gbps_per_core: float  # GB/s of changed-element bytes through decode + apply
    memcpy_gbps_per_core: float
    elements: int
    op: str = "add"  # what the measured records carry (op "auto" chose it)

    def describe(self) -> list[str]:
        return [
            f"measured here ({self.elements / 1e6:.0f}M BF16 elements, {self.change_rate:.1%} changed, one core):",
            f"  wire bytes per changed element  {self.wire_bytes_per_change:.3f} B (real codec, {self.op} records)",
            f"  diff + encode                   {self.scan_gbps_per_core:.2f} GB/s of BF16 scanned",
            f"  decode + apply                  {self.apply_gbps_per_core:.3f} GB/s of changed elements (2 B each)",
            f"  memcpy                          {self.memcpy_gbps_per_core:.2f} GB/s",
        ]


def measure_costs(change_rate: float, elements: int = 1 << 24, seed: int = 0) -> Costs:
    """Run the real diff, codec and an in-memory apply on synthetic ±1-ULP BF16 changes,
    with the producer's default op ("auto": xor or add, whichever codes smaller)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        rng = np.random.default_rng(seed)
        committed = torch.from_numpy(rng.integers(0x3C00, 0x3D00, elements, dtype=np.int16))
        current = committed.clone()
        k = max(1, int(change_rate * elements))
        pos = torch.from_numpy(np.sort(rng.choice(elements, size=k, replace=False)))
        step = torch.from_numpy(rng.choice(np.array([1, -1], dtype=np.int16), size=k))
        current[pos] += step
        scratch = torch.empty_like(committed)  # a copy into fresh memory would time its page faults too
        memcpy = _best(lambda: scratch.copy_(committed))
        holder: dict = {}

        def scan():  # as the producer's default op "auto": xor or add, whichever codes smaller
            d = diff(current, committed)
            add, new = d.add().numpy().view(np.uint16), d.new.numpy().view(np.uint16)
            op = choose_op_from_add(add, new, 2)
            values = add if op is Op.ADD else d.xor().numpy().view(np.uint16)
            rec = Record("w", "BF16", (elements,), op, d.positions.numpy().astype(np.uint64), values)
            holder["wire"] = codec.encode(Payload(PayloadHeader("t", 0, 1, "p0", "p0-0"), [rec]))
            holder["op"] = op.value

        scan_s = _best(scan)
        wire = holder["wire"]
        target = committed.clone()

        def apply():
            rec = codec.decode(wire).records[0]
            idx = torch.from_numpy(rec.positions.astype(np.int64))
            values = torch.from_numpy(rec.values.view(np.int16))
            if rec.op is Op.ADD:
                target[idx] += values  # int16 wraps around: (old + add) mod 2**16, as the receivers' apply
            else:
                target[idx] ^= values

        apply_s = _best(apply, reset=lambda: target.copy_(committed))
        if not torch.equal(target, current):  # a cost is only worth quoting for a bit-exact result
            raise AssertionError("decode + apply did not reproduce the new bits")
        nbytes = elements * 2
        return Costs(change_rate=change_rate, wire_bytes_per_change=len(wire) / k,
                     scan_gbps_per_core=nbytes / scan_s / 1e9, apply_gbps_per_core=2 * k / apply_s / 1e9,
                     memcpy_gbps_per_core=nbytes / memcpy / 1e9, elements=elements, op=holder["op"])
    finally:
        torch.set_num_threads(threads)


def _best(fn, repeats: int = 3, reset=None) -> float:
    times = []
    for _ in range(repeats):
        if reset is not None:
            reset()
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return min(times)


@dataclass
class Cluster:
    """A cluster description; the defaults are the paper's 1T setting (see `PAPER`)."""

    params: float = 1e12
    change_rate: float = 0.03
    producer_gpus: int = 32
    producer_gpus_per_node: int = 4  # GB300: four GPUs per compute tray
    producer_cores_per_node: int = 144  # two Grace CPUs of 72 cores
    producer_device_speedup: float = 50.0  # diff + encode on the GPUs vs the host cores (assumed)
    receiver_gpus: int = 64
    receiver_gpus_per_node: int = 8  # H100 nodes
    receiver_cores_per_node: int = 96
    receiver_memory_gb_per_node: float = 640.0  # 8 x 80 GB
    receiver_host_memory_gb_per_node: float = 2048.0  # host memory (DGX H100: 2 TB)
    # Decode on several threads per receiver (Receiver(decode_threads=)): throughput per
    # thread over one thread's, measured at 2 threads on 2 cores, conditioned records
    # (benchmarks/results/decode_threads.json: 0.78-0.81); assumed to hold at 12 threads.
    decode_thread_efficiency: float = 0.8
    cross_gbps: float = PAPER_LINK_GBPS  # aggregate across regions (default: the paper's links)
    intra_gbps: float = 100.0  # per node, inside the receiver region
    fanout: int = 2
    chunk_mb: float = 64.0  # payload size streamed through the stages
    commit_rtt_s: float = 0.2  # cross-region round trips of the joint commit

    @property
    def producer_nodes(self) -> int:
        return math.ceil(self.producer_gpus / self.producer_gpus_per_node)

    @property
    def receiver_nodes(self) -> int:
        return math.ceil(self.receiver_gpus / self.receiver_gpus_per_node)

    def nodes_per_replica(self, dense_bytes: float) -> int:
        """Smallest node count whose memory holds the BF16 weights with 25% headroom."""
        per_node = self.receiver_memory_gb_per_node * 1e9
        return min(self.receiver_nodes, max(1, math.ceil(dense_bytes * 1.25 / per_node)))

    @property
    def decode_threads(self) -> int:
        """Each receiver worker's decode threads, as a vLLM worker picks them: its GPU's
        share of the node's cores (`runtimes.scatter.default_threads(tp, cap=None)`)."""
        return share_of_cores(self.receiver_cores_per_node, self.receiver_gpus_per_node, cap=None)


@dataclass
class Projection:
    cluster: Cluster
    costs: Costs
    stages_s: dict[str, float] = field(default_factory=dict)
    total_s: float = 0.0
    serial_s: float = 0.0
    dense_s: float = 0.0
    overhead_s: float = 0.0  # pipeline fill + commit, beside the slowest stage
    wire_bytes: float = 0.0
    dense_bytes: float = 0.0
    assumptions: list[str] = field(default_factory=list)

    def as_dict(self) -> dict:
        return {"cluster": asdict(self.cluster), "costs": asdict(self.costs), "stages_s": self.stages_s,
                "total_s": self.total_s, "serial_s": self.serial_s, "dense_s": self.dense_s,
                "overhead_s": self.overhead_s,
                "wire_bytes": self.wire_bytes, "dense_bytes": self.dense_bytes, "assumptions": self.assumptions}


def project(cluster: Cluster, costs: Costs, conditioned: ConditionedCosts | None = None) -> Projection:
    """The refit's stages on `cluster` from `costs`; with `conditioned`, coded against the
    baseline (fewer wire bytes, an extra pass over the model on each side)."""
    c = cluster
    if conditioned is not None:
        costs = dataclasses.replace(costs, wire_bytes_per_change=costs.wire_bytes_per_change * conditioned.wire_ratio,
                                    op=f"{costs.op}, conditioned")
    dense = c.params * 2
    changes = c.change_rate * c.params
    wire = changes * costs.wire_bytes_per_change
    per_replica = c.nodes_per_replica(dense)
    replicas = max(1, c.receiver_nodes // per_replica)
    depth = max(1, math.ceil(math.log(replicas, c.fanout))) if replicas > 1 else 0
    scan_rate = costs.scan_gbps_per_core * c.producer_cores_per_node * 1e9
    scan_rate_device = costs.scan_gbps_per_core * c.producer_device_speedup * c.producer_gpus_per_node * 1e9
    scan_rate = max(scan_rate, scan_rate_device)
    share = wire / per_replica  # what one receiver node needs
    # Every worker of a node (one per GPU, tensor parallel) receives and decodes the node's
    # whole share, each on its part of the node's cores.
    worker_cores = c.decode_threads * c.decode_thread_efficiency
    stages = {
        "scan (diff + encode)": dense / c.producer_nodes / scan_rate,
        "cross-region transfer": wire * 8 / (c.cross_gbps * 1e9),
        "relay fan-out": (c.fanout * share * 8 / (c.intra_gbps * 1e9)) if depth else 0.0,
        "decode + apply": (changes / per_replica) * 2 / (costs.apply_gbps_per_core * 1e9 * worker_cores),
    }
    if conditioned is not None:
        stages["conditioned encode"] = (c.params / c.producer_nodes
                                        / (conditioned.encode_elements_per_s_per_core * c.producer_cores_per_node))
        stages["conditioned decode"] = (c.params / per_replica
                                        / (conditioned.decode_elements_per_s_per_core * worker_cores))
    chunk = c.chunk_mb * 1e6
    fill = (chunk * 8 / (c.cross_gbps * 1e9) + depth * chunk * 8 / (c.intra_gbps * 1e9))
    p = Projection(cluster=c, costs=costs, stages_s=stages, wire_bytes=wire, dense_bytes=dense)
    p.total_s = max(stages.values()) + fill + c.commit_rtt_s
    p.serial_s = sum(stages.values()) + c.commit_rtt_s
    p.dense_s = dense * 8 / (c.cross_gbps * 1e9)
    p.overhead_s = fill + c.commit_rtt_s
    p.assumptions = [
        f"model: {c.params / 1e9:.0f}B params, BF16 ({dense / 1e12:.2f} TB dense), {c.change_rate:.1%} of elements "
        f"change per step",
        f"wire bytes per changed element: {costs.wire_bytes_per_change:.3f} (measured here on synthetic ±1-ULP "
        f"changes at {costs.change_rate:.1%}; AdamW steps on pretrained weights are not measured by this command "
        f"and may code larger)",
        f"producers: {c.producer_gpus} GPUs, {c.producer_gpus_per_node} per node -> {c.producer_nodes} nodes; "
        f"scan at max({c.producer_cores_per_node} host cores x measured per-core rate, "
        f"{c.producer_gpus_per_node} GPUs x {c.producer_device_speedup:g} x per-core rate (assumed device speed-up))",
        f"receivers: {c.receiver_gpus} GPUs, {c.receiver_gpus_per_node} per node -> {c.receiver_nodes} nodes; "
        f"{per_replica} node(s) per serving replica ({c.receiver_memory_gb_per_node:g} GB each, 25% headroom) -> "
        f"{replicas} replica(s); each node needs 1/{per_replica} of the delta",
        f"cross-region: {c.cross_gbps:.3g} Gbit/s in all"
        + (" (the paper's links: the rate its dense reference implies)" if c.cross_gbps == PAPER_LINK_GBPS else "")
        + "; every wire byte crosses once",
        f"inside the receiver region: relay tree fan-out {c.fanout}, depth {depth}, {c.intra_gbps:g} Gbit/s per node",
        f"decode + apply: each of a node's {c.receiver_gpus_per_node} workers decodes the node's whole share on "
        f"{c.decode_threads} threads ({c.receiver_cores_per_node} cores / {c.receiver_gpus_per_node}), at the "
        f"measured per-core rate x {c.decode_thread_efficiency:g} per thread (benchmarks/decode_threads.py)",
        f"pipelined: total = slowest stage + fill ({c.chunk_mb:g} MB chunk through every hop: {fill:.2f} s) "
        f"+ commit {c.commit_rtt_s:g} s",
        f"dense reference over the same links: {dense / 1e9:.0f} GB at {c.cross_gbps:.3g} Gbit/s",
    ]
    if conditioned is not None:
        p.assumptions += [
            f"baseline-conditioned coding: wire bytes x {conditioned.wire_ratio:.3f} (measured on real pretrained "
            "AdamW deltas, benchmarks/results/real_deltas.json); an extra pass over every element on each side, "
            f"{conditioned.encode_elements_per_s_per_core / 1e6:.0f}M elements/s per producer core and "
            f"{conditioned.decode_elements_per_s_per_core / 1e6:.0f}M per receiver core (measured there too), "
            "pipelined with the transfer; receivers without canonical layout keep a canonical host mirror "
            "(2 bytes per parameter)",
            mirror_memory(c, per_replica),
        ]
    return p


def mirror_memory(c: Cluster, per_replica: int) -> str:
    """What the vLLM workers' canonical mirrors take per node, against its host memory."""
    per_worker = c.params / per_replica * 2 / 1e9
    total = per_worker * c.receiver_gpus_per_node
    verdict = ("fits" if total <= c.receiver_host_memory_gb_per_node else
               "does NOT fit: at this size conditioned coding into vLLM needs one mirror shared by a node's "
               "workers, which is not implemented (canonical-layout receivers need no mirror)")
    return (f"mirrors (vLLM): each worker keeps the node's share whole, {per_worker:.0f} GB; x "
            f"{c.receiver_gpus_per_node} workers = {total / 1e3:.1f} TB per node against "
            f"{c.receiver_host_memory_gb_per_node / 1e3:.1f} TB of host memory: {verdict}")


def paper_links() -> list[str]:
    """The paper's dense references, reproduced from the one link rate they imply."""
    dense_120b, seconds_120b = PAPER_DENSE_120B
    return [
        "the paper's links, from its dense references:",
        f"  1T BF16 ({PAPER_DENSE_1T_BYTES / 1e12:.2f} TB) in {PAPER_DENSE_1T_S / 60:.1f} min between two AWS regions "
        f"-> {PAPER_LINK_GBPS:.2f} Gbit/s across the boundary",
        f"  at that rate: 1T dense {PAPER_DENSE_1T_BYTES * 8 / (PAPER_LINK_GBPS * 1e9) / 60:.1f} min (the paper: "
        f"{PAPER_DENSE_1T_S / 60:.1f} min); 120B dense ({dense_120b / 1e9:.1f} GB) "
        f"{dense_120b * 8 / (PAPER_LINK_GBPS * 1e9):.0f} s (the paper: {seconds_120b:.0f} s, "
        f"{dense_120b * 8 / seconds_120b / 1e9:.2f} Gbit/s)",
        f"  implied per-stream rate: {PAPER_LINK_GBPS:.2f} Gbit/s, one stream's worth, although the paper's nodes "
        "have up to 5 Gbit/s each: the delta below crosses the same links",
    ]


def wire_bytes_per_change_for(p: Projection, seconds: float) -> float:
    """The wire bytes per changed element at which the cross-region transfer, with the
    pipeline fill and the commit beside it, takes `seconds` on this cluster."""
    c = p.cluster
    return max(0.0, seconds - p.overhead_s) * c.cross_gbps * 1e9 / 8 / (c.change_rate * c.params)


def report(p: Projection, conditioned: Projection | None = None) -> str:
    """The projection, every stage and assumption; `conditioned`: the same with
    baseline-conditioned coding, reported after it."""
    c = p.cluster
    lines = [*(paper_links() if c.cross_gbps == PAPER_LINK_GBPS else []), "", *p.costs.describe(), "",
             "assumptions:"]
    lines += [f"  - {a}" for a in p.assumptions]
    lines += ["", f"projected refit, {c.params / 1e9:.0f}B at {c.change_rate:.1%}:"]
    lines += [f"  {name:<24} {s:9.2f} s" for name, s in p.stages_s.items()]
    lines += [
        f"  {'total (pipelined)':<24} {p.total_s:9.2f} s   (no overlap at all: {p.serial_s:.2f} s)",
        f"  wire {p.wire_bytes / 1e9:.1f} GB vs dense {p.dense_bytes / 1e9:.0f} GB "
        f"({p.dense_bytes / max(p.wire_bytes, 1):.0f}x smaller)",
        f"  dense refit over the same links: {p.dense_s:.0f} s -> {p.dense_s / p.total_s:.0f}x faster",
    ]
    if c.params == 1e12 and abs(c.change_rate - 0.03) < 1e-9:
        need = wire_bytes_per_change_for(p, GOAL_1T_3PCT_S)
        lines += [
            f"  the paper: {PAPER_1T_3PCT_S:.0f} s (1T, 3%, relay tree) vs {PAPER_DENSE_1T_S / 60:.1f} min "
            f"dense; this projection: {p.total_s:.0f} s",
            f"  goal {GOAL_1T_3PCT_S:.0f} s (half the paper's): {'met' if p.total_s <= GOAL_1T_3PCT_S else 'not met'}"
            f"; it needs at most {need:.3f} wire bytes per changed element on these links (measured: "
            f"{p.costs.wire_bytes_per_change:.3f}, the host format's codec on the synthetic changes above)",
        ]
    if conditioned is not None:
        q = conditioned
        lines += ["", "with baseline-conditioned coding:", *[f"  - {a}" for a in q.assumptions[-1:]]]
        lines += [f"  {name:<24} {s:9.2f} s" for name, s in q.stages_s.items()]
        lines += [f"  {'total (pipelined)':<24} {q.total_s:9.2f} s   (no overlap at all: {q.serial_s:.2f} s)",
                  f"  wire {q.wire_bytes / 1e9:.1f} GB; without conditioned coding {p.total_s:.2f} s, "
                  f"with it {q.total_s:.2f} s"]
    return "\n".join(lines)
