"""torchrun worker: train a tiny Megatron GPT on CPU and check capture + export.

Launched by tests/test_megatron_cpu.py as
``python -m torch.distributed.run --nproc-per-node N tests/workers/capture_worker.py ...``.
Any failed check raises, the rank exits non-zero, and torchrun (and so pytest) fails.

Checks (rank 0 reports, every rank asserts its own part):
1. every optimizer step succeeds and the post-step hook fires once per step;
2. owned ranges are live views of the params (same storage) and, across the DP
   ranks of each TP/PP position, partition every trainable param exactly;
3. the slices captured in the hook, reassembled over DP, equal the trained params bit
   for bit (so owners saw the post-step bits);
4. normalized names carry global layer indices: every layer appears exactly once
   over the PP (and virtual PP) stages;
5. the dense reference export has exactly the HF model's names and shapes, bf16, and
   every matrix changed during training;
6. logits of the trained Megatron model (forward through the pipeline schedule)
   match the HF model loaded from the export (bf16 tolerance).
"""

from __future__ import annotations

import argparse
import math
import os
import sys
import warnings

warnings.filterwarnings("ignore")
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402


def tiny_config(kind: str, layers: int):
    common = dict(
        hidden_size=64,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        num_hidden_layers=layers,
        intermediate_size=128,
        vocab_size=500,  # padded to 128 * tp by Megatron
        max_position_embeddings=64,
        initializer_range=0.1,  # large enough that every layer shapes the logits
    )
    if kind == "qwen3":
        from transformers import Qwen3Config

        return Qwen3Config(tie_word_embeddings=False, **common)
    if kind == "qwen2":  # q/k/v biases, no QK-norm
        from transformers import Qwen2Config

        return Qwen2Config(tie_word_embeddings=False, **common)
    if kind == "llama-tied":
        from transformers import LlamaConfig

        return LlamaConfig(tie_word_embeddings=True, rope_theta=50000.0, **common)
    raise ValueError(kind)


def hf_model(hf_config):
    import transformers

    cls = {"qwen3": transformers.Qwen3ForCausalLM, "qwen2": transformers.Qwen2ForCausalLM,
           "llama": transformers.LlamaForCausalLM}
    return cls[hf_config.model_type](hf_config).to(torch.bfloat16)


def hf_expected_shapes(hf_config) -> dict[str, tuple]:
    with torch.device("meta"):
        model = hf_model(hf_config)
    shapes = {k: tuple(v.shape) for k, v in model.state_dict().items()}
    if hf_config.tie_word_embeddings:
        for key in getattr(model, "_tied_weights_keys", None) or {"lm_head.weight": None}:
            shapes.pop(key, None)
    return shapes


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--tp", type=int, required=True)
    ap.add_argument("--pp", type=int, required=True)
    ap.add_argument("--vpp", type=int, default=None)
    ap.add_argument("--model", default="qwen3")
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--steps", type=int, default=2)
    ap.add_argument("--lr", type=float, default=1e-3)
    ap.add_argument("--no-dist-opt", action="store_true")
    args = ap.parse_args()

    from nemo_dcr.demo import harness as H
    from tests.support.reference_export import reference_export

    H.init_distributed(args.tp, args.pp, vpp=args.vpp, timeout_s=120)
    from megatron.core import parallel_state as ps

    from nemo_dcr.capture import attach_post_step_hook, megatron_owned_ranges
    from nemo_dcr.runtimes.megatron.model import megatron_param_name_map, padded_vocab_size

    rank = dist.get_rank()
    hf_config = tiny_config(args.model, args.layers)
    model, optimizer = H.build_trained_model(
        hf_config, args.tp, args.pp, lr=args.lr,
        use_distributed_optimizer=not args.no_dist_opt, vpp=args.vpp,
    )
    coords = dict(
        tp=ps.get_tensor_model_parallel_rank(),
        pp=ps.get_pipeline_model_parallel_rank(),
        dp=ps.get_data_parallel_rank(),
        dp_size=ps.get_data_parallel_world_size(),
    )
    names = megatron_param_name_map(model)
    ranges = megatron_owned_ranges(optimizer, model)

    # (2) live views into the params' own storage.
    for r in ranges:
        param = names[r.param.name]
        assert r.param.local_shape == tuple(param.shape) and r.param.dtype == param.dtype
        assert r.tensor.numel() == len(r)
        if len(r):
            assert r.tensor.data_ptr() == param.view(-1)[r.start].data_ptr(), r.key

    captured: dict[str, torch.Tensor] = {}
    steps_seen = []

    def on_step():
        steps_seen.append(1)
        for r in ranges:
            captured[r.key] = r.tensor.clone()

    handle = attach_post_step_hook(optimizer, on_step)

    before = reference_export(model, hf_config)
    losses = []
    batches = H.make_batches(
        hf_config.vocab_size, seq_len=16, micro_batch=2, num_micro=4,
        seed=1000 + coords["dp"], steps=args.steps,
    )
    for batch in batches:
        ok, loss = H.train_step(model, optimizer, batch)
        assert ok, "optimizer step was skipped"
        losses.append(loss)
    handle.remove()
    assert len(steps_seen) == args.steps, f"hook fired {len(steps_seen)}x for {args.steps} steps"
    assert "step" not in optimizer.__dict__, "hook removal did not restore optimizer.step"
    for loss in losses:
        if loss is not None:
            assert math.isfinite(loss) and 0.5 * math.log(500) < loss < 3 * math.log(500), loss

    after = reference_export(model, hf_config)

    # Gather what rank 0 needs to check ownership and naming globally.
    report = dict(
        coords=coords,
        losses=losses,
        params={n: (tuple(p.shape), p.requires_grad) for n, p in names.items()},
        ranges=[(r.param.name, r.start, r.stop, r.param.numel) for r in ranges],
        captured=captured,
        full=(
            {n: p.detach().clone() for n, p in names.items()} if coords["dp"] == 0 else {}
        ),
    )
    reports = [None] * dist.get_world_size() if rank == 0 else None
    dist.gather_object(report, reports, dst=0)

    logits_ok = check_logits(model, hf_config, after)

    if rank == 0:
        check_ownership(reports)
        check_layer_names(reports, hf_config.num_hidden_layers, args.tp)
        check_export(before, after, hf_config, args.tp, padded_vocab_size)
        print(
            f"[capture_worker] OK tp={args.tp} pp={args.pp} vpp={args.vpp} "
            f"dp={coords['dp_size']} model={args.model} losses="
            f"{[l for rep in reports for l in rep['losses'] if l is not None][:4]} "
            f"logits_rel_err={logits_ok}",
            flush=True,
        )
    H.shutdown()


def check_ownership(reports) -> None:
    """(2) + (3): exact partition over DP, and captured bits == trained params."""
    by_position: dict[tuple, list] = {}
    for rep in reports:
        c = rep["coords"]
        by_position.setdefault((c["tp"], c["pp"]), []).append(rep)
    total_owned = 0
    for (tp, pp), reps in by_position.items():
        assert len(reps) == reps[0]["coords"]["dp_size"], (tp, pp, len(reps))
        params = reps[0]["params"]
        for rep in reps:
            assert rep["params"] == params, f"DP replicas of tp={tp} pp={pp} differ in params"
        full = next(rep["full"] for rep in reps if rep["coords"]["dp"] == 0)
        pieces: dict[str, list] = {}
        for rep in reps:
            for name, start, stop, numel in rep["ranges"]:
                pieces.setdefault(name, []).append((start, stop, numel, rep))
        trainable = {n for n, (_, rg) in params.items() if rg}
        assert set(pieces) == trainable, (
            f"tp={tp} pp={pp}: owned names {sorted(set(pieces) ^ trainable)} mismatch"
        )
        for name, parts in pieces.items():
            parts.sort(key=lambda p: p[0])
            numel = math.prod(params[name][0])
            cursor = 0
            flat = full[name].reshape(-1)
            for start, stop, n, rep in parts:
                assert n == numel and start == cursor and stop > start, (
                    f"{name} tp={tp} pp={pp}: ranges {[(p[0], p[1]) for p in parts]} "
                    f"do not tile [0, {numel})"
                )
                got = rep["captured"][f"{name}[{start}:{stop}]"]
                want = flat[start:stop]
                assert torch.equal(got.view(torch.int16), want.view(torch.int16)), (
                    f"{name}[{start}:{stop}] captured bits differ from the trained param"
                )
                cursor = stop
            assert cursor == numel, f"{name} tp={tp} pp={pp}: owned {cursor} of {numel}"
            total_owned += numel
    assert total_owned > 0


def check_layer_names(reports, num_layers: int, tp: int) -> None:
    """(4): each global layer index is held by exactly one PP stage per (tp, dp)."""
    import re

    for t in range(tp):
        seen: dict[int, int] = {}
        for rep in reports:
            c = rep["coords"]
            if c["tp"] != t or c["dp"] != 0:
                continue
            layers = {
                int(m.group(1))
                for n in rep["params"]
                if (m := re.match(r"decoder\.layers\.(\d+)\.", n))
            }
            for i in layers:
                assert i not in seen, f"layer {i} on PP stages {seen[i]} and {c['pp']}"
                seen[i] = c["pp"]
        assert sorted(seen) == list(range(num_layers)), f"tp={t}: layers {sorted(seen)}"


def check_export(before, after, hf_config, tp, padded_vocab_size) -> None:
    """(5): HF names / shapes / dtype, and the weights really trained."""
    expected = hf_expected_shapes(hf_config)
    got = {k: tuple(v.shape) for k, v in after.items()}
    assert got == expected, (
        f"export names/shapes differ: missing {sorted(set(expected) - set(got))}, "
        f"extra {sorted(set(got) - set(expected))}, "
        f"shape diffs {[(k, got[k], expected[k]) for k in got if k in expected and got[k] != expected[k]]}"
    )
    assert padded_vocab_size(hf_config.vocab_size, tp, 128) > hf_config.vocab_size
    for name, tensor in after.items():
        assert tensor.dtype == torch.bfloat16 and tensor.is_contiguous(), name
        if tensor.dim() < 2:
            continue  # norms sit at 1.0, where a 1e-3 step is below half a bf16 ULP
        changed = float((tensor.view(torch.int16) != before[name].view(torch.int16)).float().mean())
        # An untied embedding only moves the rows of tokens seen in the batches.
        floor = 0.05 if name == "model.embed_tokens.weight" else 0.5
        assert changed > floor, f"{name}: only {changed:.1%} of elements changed"


@torch.no_grad()
def check_logits(model, hf_config, export):
    """(6): logits of the trained Megatron model (forward-only through the pipeline
    schedule, TP-gathered on the last stage) vs the HF model loaded from the export."""
    from megatron.core import parallel_state as ps
    from megatron.core.pipeline_parallel import get_forward_backward_func

    gen = torch.Generator().manual_seed(7)
    tokens = torch.randint(0, hf_config.vocab_size, (2, 16), generator=gen)
    micro = [tokens[i : i + 1] for i in range(tokens.shape[0])]
    position_ids = torch.arange(16).unsqueeze(0)

    def forward_step(data_iterator, chunk):
        logits = chunk(next(data_iterator), position_ids, None)  # [1, s, vocab / tp]

        def collect(output, non_loss_data=False):
            assert non_loss_data
            return output.detach().clone()

        return logits, collect

    data = get_forward_backward_func()(
        forward_step_func=forward_step,
        data_iterator=[iter(micro) for _ in model] if len(model) > 1 else iter(micro),
        model=model,
        num_microbatches=len(micro),
        seq_length=16,
        micro_batch_size=1,
        forward_only=True,
        collect_non_loss_data=True,
    )
    mine = None
    if ps.is_pipeline_last_stage(ignore_virtual=True):
        local = torch.cat(list(data), dim=0).contiguous()
        parts = [torch.empty_like(local) for _ in range(ps.get_tensor_model_parallel_world_size())]
        dist.all_gather(parts, local, group=ps.get_tensor_model_parallel_group())
        if ps.get_tensor_model_parallel_rank() == 0 and ps.get_data_parallel_rank() == 0:
            mine = torch.cat(parts, dim=-1)[..., : hf_config.vocab_size].float()
    found = [None] * dist.get_world_size() if dist.get_rank() == 0 else None
    dist.gather_object(mine, found, dst=0)
    if dist.get_rank() != 0:
        return None
    (mlogits,) = [x for x in found if x is not None]

    hf_config._attn_implementation = "eager"
    ref = hf_model(hf_config)
    missing, unexpected = ref.load_state_dict(export, strict=False)
    allowed = {"lm_head.weight"} if hf_config.tie_word_embeddings else set()
    assert not unexpected and set(missing) <= allowed, (missing, unexpected)
    ref.eval()
    hlogits = ref(input_ids=tokens).logits.float()
    # bf16 noise gives ~1e-2; a wrong q/k/v or gate/up placement gives > 0.5.
    rel = float((mlogits - hlogits).norm() / hlogits.norm())
    assert rel < 0.05, f"Megatron vs HF logits: relative error {rel:.3g}"
    return round(rel, 5)


if __name__ == "__main__":
    from tests.support.launch import run_worker

    run_worker(main)
