"""Codec benchmark: bytes on the wire vs the empirical entropy bound vs a NeMo-RL-style
codec and other peers' encodings (dense xor + zstd-1; raw gaps + BF16 values), on synthetic
and real BF16 deltas; xor vs add; the sparse/dense crossover.

    python benchmarks/codec.py            # ~30 s on a quiet machine; results/codec.{json,png}
    python benchmarks/codec.py --smoke    # seconds; tiny sizes (CI smoke)

Entropy bound of one tensor's delta (k changed elements of n):
  positions: min(log2 C(n, k), k * H(gaps)) bits, where H(gaps) is the empirical entropy
             of the gap histogram (g_i = p_i - p_(i-1) - 1) -- the smaller of the two.
  values:    k * H(values) bits, the empirical order-0 entropy of the xor (or add)
             values' histogram, for the op this codec chose per tensor.
Neither term charges for describing the model (counts, tables); the codec pays those.
NeMo-RL-style reference: sorted positions as gaps (uint16 if all fit, else uint32) plus
the XOR values as uint16, concatenated, then zstd level 1 (one frame per tensor).
Every payload whose size is reported is decoded and checked against what was encoded.
The device coder: the same records handed to the codec as torch tensors, written as format
v6 (prefix codes, nemo_dcr.wire.prefix; here on the CPU, the same torch code a GPU runs), beside
format v5's joint rANS streams: bytes, and the receiver's decode time per change of each.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from pathlib import Path

import numpy as np
import torch
import zstandard

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from benchmarks.outputs import results_path  # noqa: E402
from benchmarks.machine import machine_info  # noqa: E402
from nemo_dcr.records import Op, Payload, PayloadHeader, Record  # noqa: E402
from nemo_dcr.wire import codec  # noqa: E402
from nemo_dcr.wire.values import choose_op, entropy_bits, values_entropy_bits  # noqa: E402

HDR = PayloadHeader("bench", 0, 1, "p0", "p0-0")


def log2_binom(n: int, k: int) -> float:
    return (math.lgamma(n + 1) - math.lgamma(k + 1) - math.lgamma(n - k + 1)) / math.log(2)


def gaps_of(pos: np.ndarray) -> np.ndarray:
    p = pos.astype(np.int64)
    return np.diff(p, prepend=-1) - 1


def position_bound_bits(pos: np.ndarray, n: int) -> tuple[float, float, float]:
    """(bound, log2 C(n,k), k * H(gaps)) in bits."""
    k = pos.size
    if k == 0:
        return 0.0, 0.0, 0.0
    binom = log2_binom(n, k)
    _, counts = np.unique(gaps_of(pos), return_counts=True)
    hg = entropy_bits(counts)
    return min(binom, hg), binom, hg


def nemo_rl_style_bytes(pos: np.ndarray, xor_vals: np.ndarray) -> int:
    """Sorted locations as uint16/uint32 gaps + XOR values, serialized, then zstd level 1."""
    if pos.size == 0:
        return 0
    gaps = np.diff(pos.astype(np.int64), prepend=0)
    gdt = np.uint16 if int(gaps.max()) < (1 << 16) else np.uint32
    header = np.array([pos.size, np.dtype(gdt).itemsize], dtype=np.int64).tobytes()
    blob = header + gaps.astype(gdt).tobytes() + xor_vals.astype(np.uint16).tobytes()
    return len(zstandard.ZstdCompressor(level=1).compress(blob))


def dense_xor_zstd_bytes(n: int, pos: np.ndarray, xor_vals: np.ndarray) -> int:
    """Dense XOR + zstd level 1 (SkyRL; slime's dense mode): the whole tensor's XOR with the
    previous bits, zeros where nothing changed, compressed as one frame."""
    dense = np.zeros(n, np.uint16)
    dense[pos] = xor_vals
    return len(zstandard.ZstdCompressor(level=1).compress(dense.tobytes()))


def sparse_raw_bytes(pos: np.ndarray) -> int:
    """TRL-style sparse overwrite, uncompressed: u16 gaps when every gap fits (else int32
    indices) + the new BF16 values, 2 bytes each."""
    if pos.size == 0:
        return 0
    gaps = np.diff(pos.astype(np.int64), prepend=0)
    return pos.size * ((2 if int(gaps.max()) < (1 << 16) else 4) + 2)


def encode_checked(payload: Payload, dense: str = "auto", version: int = codec.FORMAT_VERSION
                   ) -> tuple[bytes, float]:
    """(the encoded payload, seconds to encode it), after checking that it decodes to exactly
    its records (the decode is not timed): every size reported is of a payload that works.
    Records whose arrays are tensors are checked against their host copies."""
    t = time.perf_counter()
    data = codec.encode(payload, dense=dense, version=version)
    secs = time.perf_counter() - t
    back = codec.decode(data).records
    for want, got in zip(payload.records, back, strict=True):
        wpos, wval = (x.numpy() if isinstance(x, torch.Tensor) else x for x in (want.positions, want.values))
        if (got.name, Op(got.op)) != (want.name, Op(want.op)) or not (
                np.array_equal(got.positions, wpos.astype(np.uint64))
                and np.array_equal(got.values, wval.view(got.values.dtype))):
            raise SystemExit(f"codec benchmark: record {want.name!r} does not decode to what was encoded")
    return data, secs


def as_tensors(records: list[Record]) -> list[Record]:
    """BF16 records with their positions and value bits as (CPU) tensors: what the codec
    codes where they are, in format v6."""
    return [Record(r.name, r.dtype, r.shape, r.op, torch.from_numpy(np.asarray(r.positions, np.int64)),
                   torch.from_numpy(np.ascontiguousarray(r.values).view(np.int16))) for r in records]


def best_decode_s(data: bytes, repeats: int = 3) -> float:
    best = math.inf
    for _ in range(repeats):
        t = time.perf_counter()
        codec.decode(data)
        best = min(best, time.perf_counter() - t)
    return best


def device_coded(records: list[Record], host: bytes) -> dict:
    """The records coded as a GPU producer would (format v6, nemo_dcr.wire.prefix) beside `host`
    (their v5 payload): bytes, encode seconds (torch on this CPU) and decode ns a change of both."""
    data, secs = encode_checked(Payload(HDR, as_tensors(records)), version=6)
    changes = max(sum(len(r.positions) for r in records), 1)
    return {"prefix_bytes": len(data), "prefix_encode_s": secs,
            "prefix_decode_ns": best_decode_s(data) / changes * 1e9,
            "joint_decode_ns": best_decode_s(host) / changes * 1e9}


def encode_record(name, n, op, pos, vals, dense="auto", device_too=False) -> tuple:
    """(bytes, encode seconds) of one record; with device_too, and device_coded's dict."""
    rec = Record(name, "BF16", (n,), op, pos.astype(np.uint64), vals)
    data, secs = encode_checked(Payload(HDR, [rec]), dense)
    return (len(data), secs, device_coded([rec], data)) if device_too else (len(data), secs)


def ulp_delta(n: int, rate: float, rng) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """old BF16 bits (N(0, 0.02) weights) and new = old +- 1 ULP at uniform random positions."""
    old = (rng.normal(0, 0.02, n).astype(np.float32).view(np.uint32) >> 16).astype(np.uint16)
    pos = np.flatnonzero(rng.random(n) < rate)
    step = np.where(rng.random(pos.size) < 0.5, 1, -1).astype(np.int32)
    new = old.copy()
    new[pos] = (old[pos].astype(np.int32) + step).astype(np.uint16)
    return old, new, pos


def analyse(name: str, n: int, pos: np.ndarray, old_v: np.ndarray, new_v: np.ndarray,
            device_too: bool = False) -> dict:
    """Sizes for one tensor's delta: ours (auto op, xor, add), bound, NeMo-RL-style; with
    device_too, also the device coder's (device_coded) for the chosen op."""
    xv = (old_v ^ new_v).astype(np.uint16)
    av = (new_v.astype(np.int32) - old_v.astype(np.int32)).astype(np.uint16)
    op = choose_op(xv, av, 2)
    sx, tx, *dx = encode_record(name, n, Op.XOR, pos, xv, device_too=device_too and op is Op.XOR)
    sa, ta, *da = encode_record(name, n, Op.ADD, pos, av, device_too=device_too and op is Op.ADD)
    ours, secs = (sx, tx) if op is Op.XOR else (sa, ta)
    pb, binom, hg = position_bound_bits(pos, n)
    hx, ha = values_entropy_bits(xv, 2), values_entropy_bits(av, 2)
    vb = hx if op is Op.XOR else ha
    bound = (pb + vb) / 8
    return {"name": name, "numel": n, "changed": int(pos.size), "rate": pos.size / n, "op": op.value,
            "wire_bytes": ours, "wire_xor": sx, "wire_add": sa, "encode_s": secs,
            "bound_bytes": bound, "pos_bound_bits": pb, "pos_binom_bits": binom, "pos_gap_entropy_bits": hg,
            "val_entropy_xor_bits": hx, "val_entropy_add_bits": ha,
            "nemo_rl_bytes": nemo_rl_style_bytes(pos, xv), "dense_xor_zstd_bytes": dense_xor_zstd_bytes(n, pos, xv),
            "sparse_raw_bytes": sparse_raw_bytes(pos), **(dx or da or [{}])[0]}


def synthetic(args, rng) -> list[dict]:
    rows = []
    for rate in args.rates:
        old, new, pos = ulp_delta(args.n, rate, rng)
        row = analyse(f"synthetic-{rate:g}", args.n, pos, old[pos], new[pos], device_too=True)
        rows.append(row)
        print(f"  synthetic {rate:>6.1%}: wire {row['wire_bytes']:>10,} B  bound {row['bound_bytes']:>12,.0f} B  "
              f"x{row['wire_bytes'] / row['bound_bytes']:.3f}  NeMo-RL-style {row['nemo_rl_bytes']:>10,} B  "
              f"x{row['wire_bytes'] / row['nemo_rl_bytes']:.3f}  op={row['op']}", flush=True)
    return rows


def real_model(args) -> list[dict]:
    import torch
    from transformers import Qwen3Config, Qwen3ForCausalLM

    torch.set_num_threads(2)
    if args.smoke:
        cfg = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                   num_key_value_heads=2, head_dim=16, vocab_size=512)
        batch, seq = 2, 16
    else:
        cfg = dict(hidden_size=512, intermediate_size=1536, num_hidden_layers=8, num_attention_heads=8,
                   num_key_value_heads=4, head_dim=64, vocab_size=32000)
        batch, seq = 8, 128
    out = []
    for lr in args.lrs:
        torch.manual_seed(0)
        model = Qwen3ForCausalLM(Qwen3Config(**cfg, tie_word_embeddings=False))  # FP32 master weights
        nparams = sum(p.numel() for p in model.parameters())
        opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.01)
        gen = torch.Generator().manual_seed(1)

        def snapshot():
            return {k: v.detach().to(torch.bfloat16).view(torch.int16).numpy().view(np.uint16).reshape(-1).copy()
                    for k, v in model.state_dict().items()}

        before = None
        for step in range(args.steps):
            if step == args.steps - 1:
                before = snapshot()
            ids = torch.randint(0, cfg["vocab_size"], (batch, seq), generator=gen)
            loss = model(input_ids=ids, labels=ids).loss
            loss.backward()
            opt.step()
            opt.zero_grad()
        after = snapshot()
        rows = []
        for name in before:
            o, nw = before[name], after[name]
            pos = np.flatnonzero(o != nw)
            if pos.size:
                rows.append(analyse(name, o.size, pos, o[pos], nw[pos]))
        tot = {k: sum(r[k] for r in rows) for k in ("wire_bytes", "bound_bytes", "nemo_rl_bytes", "changed",
                                                   "wire_xor", "wire_add", "dense_xor_zstd_bytes",
                                                   "sparse_raw_bytes")}
        # The same records in one real payload (headers included), as a producer would send them.
        payload = Payload(HDR, [])
        for name in before:
            o, nw = before[name], after[name]
            pos = np.flatnonzero(o != nw)
            if pos.size:
                xv, av = (o[pos] ^ nw[pos]), (nw[pos] - o[pos]).astype(np.uint16)
                op = choose_op(xv, av, 2)
                payload.records.append(Record(name, "BF16", (o.size,), op, pos.astype(np.uint64),
                                              xv if op is Op.XOR else av))
        host = encode_checked(payload)[0]
        one = len(host)
        device = device_coded(payload.records, host)
        res = {"lr": lr, "params": nparams, "steps": args.steps, "changed": tot["changed"],
               "rate": tot["changed"] / nparams, "wire_bytes": tot["wire_bytes"], "one_payload_bytes": one,
               "bound_bytes": tot["bound_bytes"], "nemo_rl_bytes": tot["nemo_rl_bytes"],
               "dense_xor_zstd_bytes": tot["dense_xor_zstd_bytes"], "sparse_raw_bytes": tot["sparse_raw_bytes"],
               "wire_xor_only": tot["wire_xor"], "wire_add_only": tot["wire_add"],
               "ops": {op: sum(1 for r in rows if r["op"] == op) for op in ("xor", "add")}, "tensors": rows,
               **device}
        out.append(res)
        print(f"  real lr={lr:g} ({nparams / 1e6:.1f}M params, {res['rate']:.2%} changed): wire {one:,} B "
              f"(one payload)  bound {res['bound_bytes']:,.0f} B  x{one / res['bound_bytes']:.3f}  NeMo-RL-style "
              f"{res['nemo_rl_bytes']:,} B  x{one / res['nemo_rl_bytes']:.3f}", flush=True)
    return out


def sweep(args, rng) -> dict:
    rows = []
    n = args.sweep_n
    for rate in args.sweep_rates:
        old, new, pos = ulp_delta(n, rate, rng)
        xv = (old[pos] ^ new[pos]).astype(np.uint16)
        av = (new[pos].astype(np.int32) - old[pos].astype(np.int32)).astype(np.uint16)
        op = choose_op(xv, av, 2)
        vals = xv if op is Op.XOR else av
        sp, tsp = encode_record("w", n, op, pos, vals, dense="never")
        de, tde = encode_record("w", n, op, pos, vals, dense="always")
        au, tau = encode_record("w", n, op, pos, vals, dense="auto")
        pb, _, _ = position_bound_bits(pos, n)
        bound = (pb + values_entropy_bits(vals, 2)) / 8
        rows.append({"rate": rate, "changed": int(pos.size), "sparse_bytes": sp, "dense_bytes": de, "auto_bytes": au,
                     "dense_raw_bf16_bytes": 2 * n, "bound_bytes": bound, "nemo_rl_bytes": nemo_rl_style_bytes(pos, xv),
                     "dense_xor_zstd_bytes": dense_xor_zstd_bytes(n, pos, xv),
                     "encode_s_sparse": tsp, "encode_s_dense": tde, "encode_s_auto": tau, "op": op.value})
        print(f"  sweep {rate:>6.1%}: sparse {sp:>10,} B  dense {de:>10,} B  auto {au:>10,} B  "
              f"bound {bound:>10,.0f} B  encode {tau * 1e3:7.1f} ms", flush=True)
    cross = next((r["rate"] for r in rows if r["dense_bytes"] < r["sparse_bytes"]), None)
    return {"numel": n, "rows": rows, "crossover_rate": cross}


def plot(result: dict, path: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(12, 4.5))
    ax = axes[0]
    syn = result["synthetic"]
    x = np.arange(len(syn))
    bars = [("wire_bytes", f"NeMo-DCR v{codec.FORMAT_VERSION}"), ("bound_bytes", "entropy bound"),
            ("nemo_rl_bytes", "NeMo-RL-style (gaps+xor, zstd-1)"), ("dense_xor_zstd_bytes", "dense xor, zstd-1"),
            ("sparse_raw_bytes", "TRL-style (gaps/indices + bf16, raw)")]
    width = 0.8 / len(bars)
    for i, (key, label) in enumerate(bars):
        ax.bar(x + (i - (len(bars) - 1) / 2) * width, [r[key] / r["changed"] for r in syn], width, label=label)
    ax.set_xticks(x, [f"{r['rate']:.0%} synthetic" for r in syn])
    ax.set_ylabel("bytes per changed element")
    ax.set_title("Wire size, +-1 ULP BF16 deltas")
    ax.legend(fontsize=8)
    ax = axes[1]
    sw = result["sweep"]["rows"]
    rates = [r["rate"] for r in sw]
    for key, label in [("sparse_bytes", "sparse"), ("dense_bytes", "dense (coded)"), ("auto_bytes", "auto"),
                       ("bound_bytes", "entropy bound"), ("nemo_rl_bytes", "NeMo-RL-style"),
                       ("dense_xor_zstd_bytes", "dense xor, zstd-1"),
                       ("dense_raw_bf16_bytes", "dense raw BF16")]:
        ax.plot(rates, [r[key] / result["sweep"]["numel"] for r in sw], marker="o", label=label)
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlabel("change rate")
    ax.set_ylabel("wire bytes per tensor element")
    ax.set_title(f"Scaling at {result['sweep']['numel']:,} elements")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--smoke", action="store_true", help="tiny sizes, seconds (for CI)")
    ap.add_argument("--out", help="results JSON (default benchmarks/results/codec.json; with --smoke, the temp dir)")
    args = ap.parse_args()
    args.rates = [0.01, 0.03, 0.05]
    args.n = 1 << 18 if args.smoke else 16 << 20
    args.lrs = [1e-5] if args.smoke else [1e-6, 3e-6, 1e-5]
    args.steps = 2
    args.sweep_n = 1 << 16 if args.smoke else 4 << 20
    args.sweep_rates = ([0.01, 0.1, 0.5] if args.smoke else
                        [0.001, 0.003, 0.01, 0.03, 0.05, 0.1, 0.2, 0.3, 0.4, 0.5])
    rng = np.random.default_rng(0)
    t0 = time.perf_counter()
    print(f"[codec] synthetic deltas, {args.n:,} BF16 elements", flush=True)
    syn = synthetic(args, rng)
    print("[codec] real deltas: Qwen3-style model, AdamW, FP32 master weights, BF16 snapshots", flush=True)
    real = real_model(args)
    print(f"[codec] sweep 0.1%..50% at {args.sweep_n:,} elements", flush=True)
    sw = sweep(args, rng)
    result = {"benchmark": "codec", "smoke": args.smoke, "machine": machine_info(),
              "format_version": codec.FORMAT_VERSION, "synthetic": syn, "real": real, "sweep": sw,
              "wall_s": time.perf_counter() - t0}
    out = results_path("codec", args.out, args.smoke)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=1))
    try:
        plot(result, out.with_suffix(".png"))
    except ImportError:
        print("(matplotlib missing: no plot)")
    print("\n| data | change rate | wire bytes | entropy bound | wire/bound | NeMo-RL-style | wire/NeMo-RL | op |")
    print("|---|---|---|---|---|---|---|---|")
    for r in syn:
        print(f"| synthetic +-1 ULP, {args.n:,} elts | {r['rate']:.2%} | {r['wire_bytes']:,} | "
              f"{r['bound_bytes']:,.0f} | "
              f"{r['wire_bytes'] / r['bound_bytes']:.3f} | {r['nemo_rl_bytes']:,} | "
              f"{r['wire_bytes'] / r['nemo_rl_bytes']:.3f} | {r['op']} |")
    for r in real:
        print(f"| real, AdamW lr={r['lr']:g}, {r['params'] / 1e6:.1f}M params | {r['rate']:.2%} | "
              f"{r['one_payload_bytes']:,} | {r['bound_bytes']:,.0f} | "
              f"{r['one_payload_bytes'] / r['bound_bytes']:.3f} | "
              f"{r['nemo_rl_bytes']:,} | {r['one_payload_bytes'] / r['nemo_rl_bytes']:.3f} | "
              f"xor {r['ops']['xor']} / add {r['ops']['add']} tensors |")
    print("\nPeer encodings, bytes on the wire (and NeMo-DCR's share of each):")
    print("| data | change rate | NeMo-DCR | NeMo-RL-style | dense xor + zstd-1 | TRL-style raw |")
    print("|---|---|---|---|---|---|")
    for label, r, ours in ([(f"synthetic +-1 ULP, {args.n:,} elts", r, r["wire_bytes"]) for r in syn]
                           + [(f"real, AdamW lr={r['lr']:g}", r, r["one_payload_bytes"]) for r in real]):
        print(f"| {label} | {r['rate']:.2%} | {ours:,} | " + " | ".join(
            f"{r[k]:,} ({ours / r[k]:.2f})" for k in ("nemo_rl_bytes", "dense_xor_zstd_bytes", "sparse_raw_bytes"))
            + " |")
    print("\nThe device coder (format v6: prefix codes, coded where the tensors are; torch on this CPU) beside v5:")
    print("| data | change rate | v5 bytes | v6 bytes | v6/v5 | decode v5 ns/change | decode v6 ns/change |")
    print("|---|---|---|---|---|---|---|")
    for label, r, ours in ([(f"synthetic +-1 ULP, {args.n:,} elts", r, r["wire_bytes"]) for r in syn]
                           + [(f"real, AdamW lr={r['lr']:g}", r, r["one_payload_bytes"]) for r in real]):
        print(f"| {label} | {r['rate']:.2%} | {ours:,} | {r['prefix_bytes']:,} | {r['prefix_bytes'] / ours:.4f} | "
              f"{r['joint_decode_ns']:.1f} | {r['prefix_decode_ns']:.1f} |")
    print(f"\ndense crossover (coded dense < sparse) at change rate: {sw['crossover_rate']}")
    print(f"wrote {out} ({time.perf_counter() - t0:.0f} s)")


if __name__ == "__main__":
    main()
