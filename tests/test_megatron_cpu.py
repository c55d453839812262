"""Megatron-core training on CPU (gloo, torchrun) and capture of each rank's owned shard.

The multirank tests launch ``tests/workers/capture_worker.py`` under
``python -m torch.distributed.run --nproc-per-node 4``; the worker trains a tiny
Qwen3 / Llama model for two bf16 Adam steps and checks ownership, capture, naming,
the reference export and logits (see its docstring). The other tests are fast,
single-process checks of nemo_dcr.capture and the model helpers.
"""

from __future__ import annotations

import sys
import textwrap

import pytest
import torch

from nemo_dcr.capture import (
    attach_post_step_hook,
    even_split,
    megatron_owned_ranges,
    torch_owned_ranges,
)
from nemo_dcr.runtimes.megatron.model import padded_vocab_size
from tests.support.launch import REPO, TORCHRUN_TIMEOUT_S, run, torchrun

WORKER = REPO / "tests" / "workers" / "capture_worker.py"


def _torchrun(nproc: int, *args: str) -> str:
    return torchrun(nproc, WORKER, *args, ok_marker="[capture_worker] OK")


# ----------------------------------------------------------------- multirank (torchrun)

@pytest.mark.multirank
@pytest.mark.timeout(TORCHRUN_TIMEOUT_S + 30)
def test_tp2_dp2_distributed_optimizer_qwen3():
    _torchrun(4, "--tp", "2", "--pp", "1", "--model", "qwen3", "--layers", "2")


@pytest.mark.multirank
@pytest.mark.timeout(TORCHRUN_TIMEOUT_S + 30)
def test_tp2_pp2_1f1b_qwen3():
    _torchrun(4, "--tp", "2", "--pp", "2", "--model", "qwen3", "--layers", "4")


@pytest.mark.multirank
@pytest.mark.timeout(TORCHRUN_TIMEOUT_S + 30)
def test_pp2_virtual_pp2_dp2_llama_tied():
    # Tied embeddings under PP: the last stage's output-layer copy must stay equal to
    # the embedding; virtual PP interleaves layers 0,2 / 1,3 over the two stages.
    _torchrun(4, "--tp", "1", "--pp", "2", "--vpp", "2", "--model", "llama-tied", "--layers", "4")


@pytest.mark.multirank
@pytest.mark.timeout(TORCHRUN_TIMEOUT_S + 30)
def test_tp2_dp2_plain_optimizer_llama_tied():
    # Non-sharding Megatron optimizer: ownership is the even split over DP ranks.
    _torchrun(4, "--tp", "2", "--pp", "1", "--model", "llama-tied", "--no-dist-opt")


# ----------------------------------------------------------------- fast, single process

def test_even_split_partitions():
    for numel in (0, 1, 5, 7, 64, 1001):
        for size in (1, 2, 3, 4, 8):
            chunks = [even_split(numel, r, size) for r in range(size)]
            assert chunks[0][0] == 0 and chunks[-1][1] == numel
            assert all(a[1] == b[0] for a, b in zip(chunks, chunks[1:]))
            assert max(b - a for a, b in chunks) - min(b - a for a, b in chunks) <= 1
    with pytest.raises(ValueError):
        even_split(10, 2, 2)


def test_torch_owned_ranges_partition_and_live_views():
    model = torch.nn.Sequential(torch.nn.Linear(5, 3), torch.nn.Linear(3, 1)).to(torch.bfloat16)
    wrapped = torch.nn.Module()
    wrapped.module = model  # names as torch DDP would give them: "module.0.weight"
    dp = 4
    per_rank = [torch_owned_ranges(wrapped, r, dp) for r in range(dp)]
    params = dict(model.named_parameters())
    seen: dict[str, list] = {}
    for ranges in per_rank:
        for r in ranges:
            assert "module." not in r.param.name
            assert r.param.dtype == torch.bfloat16 and len(r) > 0
            seen.setdefault(r.param.name, []).append((r.start, r.stop))
            flat = params[r.param.name].detach().view(-1)
            assert r.tensor.data_ptr() == flat[r.start].data_ptr()
    for name, p in params.items():
        spans = sorted(seen[name])
        assert spans[0][0] == 0 and spans[-1][1] == p.numel()
        assert all(a[1] == b[0] for a, b in zip(spans, spans[1:]))
    # Live: an in-place update is visible through the owned view.
    r = per_rank[1][0]
    with torch.no_grad():
        params[r.param.name].add_(1.0)
    assert torch.equal(r.tensor, params[r.param.name].detach().view(-1)[r.start : r.stop])


def test_post_step_hook_torch_optimizer():
    p = torch.nn.Parameter(torch.zeros(3))
    opt = torch.optim.SGD([p], lr=0.1)
    calls = []
    handle = attach_post_step_hook(opt, lambda: calls.append(p.detach().clone()))
    p.grad = torch.ones(3)
    opt.step()
    assert len(calls) == 1 and torch.allclose(calls[0], torch.full((3,), -0.1))
    handle.remove()
    opt.step()
    assert len(calls) == 1


def test_post_step_hook_megatron_style_only_on_success():
    class FakeMegatronOptimizer:  # step() -> (update_successful, grad_norm, num_zeros)
        def __init__(self):
            self.results = [(True, 1.0, 0), (False, None, None), (True, 2.0, 0)]

        def step(self):
            return self.results.pop(0)

    opt = FakeMegatronOptimizer()
    a, b = [], []
    ha = attach_post_step_hook(opt, lambda: a.append(1))
    hb = attach_post_step_hook(opt, lambda: b.append(1))
    assert opt.step()[0] is True
    assert opt.step()[0] is False  # skipped step: no callback
    ha.remove()
    assert opt.step() == (True, 2.0, 0)
    assert (len(a), len(b)) == (1, 2)
    hb.remove()
    hb.remove()  # idempotent
    assert "step" not in opt.__dict__  # the class's step is back


def test_megatron_owned_ranges_needs_no_process_group_for_sharded_optimizer():
    """A DistributedOptimizer-shaped object: ranges come from gbuf_ranges alone."""

    class R:
        def __init__(self, start, end):
            self.start, self.end = start, end

    class Chunk(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.embedding = torch.nn.Embedding(4, 3)

    chunk = torch.nn.Module()
    chunk.module = Chunk()
    w = chunk.module.embedding.weight
    leaf = type("Dist", (), {})()
    leaf.gbuf_ranges = [{(torch.float32, torch.float32): [{"param_map": {w: {"param": R(2, 9)}}}]}]
    chained = type("Chained", (), {})()
    chained.chained_optimizers = [leaf]
    (r,) = megatron_owned_ranges(chained, [chunk])
    assert (r.param.name, r.start, r.stop, r.param.local_shape) == (
        "embedding.weight", 2, 9, (4, 3),
    )
    assert r.tensor.data_ptr() == w.detach().view(-1)[2].data_ptr()


def test_padded_vocab_size():
    assert padded_vocab_size(500, 1) == 512
    assert padded_vocab_size(500, 2) == 512
    assert padded_vocab_size(513, 2) == 768
    assert padded_vocab_size(151936, 1, 128) == 151936  # Qwen: already a multiple of 128
    assert padded_vocab_size(151936, 4, 128) == 152064
    assert padded_vocab_size(32000, 8, 128) == 32768


def test_transformer_config_builds_without_megatron_warnings():
    """Every rank builds one; a deprecated default would warn once per rank in every run."""
    import warnings

    from transformers import Qwen3Config

    from nemo_dcr.runtimes.megatron.model import transformer_config_from_hf

    hf = Qwen3Config(hidden_size=64, num_attention_heads=4, num_key_value_heads=2, head_dim=16)
    transformer_config_from_hf(hf, tp=1, pp=1)  # imports megatron (its import-time warnings are not ours)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        config = transformer_config_from_hf(hf, tp=2, pp=1)
    assert [str(w.message) for w in caught] == []
    assert config.cuda_graph_scope == []


def test_shim_is_idempotent_and_redirects_cuda():
    """In a subprocess: installing the shim must not leak into this pytest process."""
    code = textwrap.dedent(
        """
        import torch
        from nemo_dcr.demo import megatron_cpu as shim
        if torch.cuda.is_available():
            assert shim.install() is False
            raise SystemExit(0)
        assert shim.install() is True and shim.install() is True
        from torch.overrides import _get_current_function_mode_stack
        modes = [m for m in _get_current_function_mode_stack()
                 if type(m).__name__ == "_CudaToCpuMode"]
        assert len(modes) == 1, modes
        t = torch.zeros(3, device="cuda")
        assert t.device.type == "cpu" and t.cuda() is t
        assert t.to("cuda:0").device.type == "cpu"
        assert t.bfloat16().type() == "torch.cuda.BFloat16Tensor"
        assert torch.empty(2, device=torch.cuda.current_device()).device.type == "cpu"
        torch.cuda.synchronize()
        s = torch.cuda.Stream(device=torch.cuda.current_device())
        s.wait_stream(torch.cuda.default_stream())
        with torch.cuda.stream(s):
            pass
        from megatron.core.tensor_parallel import random as mr
        tracker = mr.get_cuda_rng_tracker()
        tracker.add("a", 123)
        torch.manual_seed(0)
        outside = torch.get_rng_state()
        with tracker.fork("a"):
            x = torch.rand(4)
        assert torch.equal(torch.get_rng_state(), outside)
        torch.manual_seed(123)
        assert torch.equal(x, torch.rand(4))
        print("SHIM-OK")
        """
    )
    rc, out = run([sys.executable, "-c", code], timeout=120)
    assert rc == 0 and "SHIM-OK" in out, out[-4000:]
