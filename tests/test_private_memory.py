"""privatize / HFRuntime / TensorStoreRuntime: weights that lie in a private file mapping (a
memory-mapped checkpoint) get memory of their own, so that the bits a receiver serves never
follow the file on disk; shared mappings (share_memory_()) are left as they are."""

from __future__ import annotations

import os

import numpy as np
import pytest
import torch

from nemo_dcr.records import Op, Record
from nemo_dcr.runtimes.private_memory import mapped_file_ranges, privatize

pytestmark = pytest.mark.skipif(mapped_file_ranges() is None, reason="needs /proc/self/maps (Linux)")


def _in_a_file(t: torch.Tensor) -> bool:
    ptr, end = t.data_ptr(), t.data_ptr() + t.numel() * t.element_size()
    return any(lo < end and ptr < hi for lo, hi in mapped_file_ranges())


def _scribble(path, start: int, nbytes: int) -> None:
    """Rewrite bytes of a file in place, as a re-export to the same folder would."""
    with open(path, "r+b") as f:
        f.seek(start)
        f.write(bytes(range(256)) * (nbytes // 256) + b"\x55" * (nbytes % 256))


def test_privatize_copies_file_backed_storages_once_and_keeps_aliases(tmp_path):
    path = tmp_path / "weights.bin"
    n = 1 << 16
    np.arange(n, dtype=np.int16).tofile(path)
    mapped = torch.UntypedStorage.from_file(str(path), shared=False, nbytes=2 * n)  # copy on write
    base = torch.empty(0, dtype=torch.int16).set_(mapped)
    module = torch.nn.Module()
    module.a = torch.nn.Parameter(base[: n // 2].view(64, -1), requires_grad=False)
    module.b = torch.nn.Parameter(base[n // 2:], requires_grad=False)  # same storage, other half
    module.register_buffer("c", base[::2])  # an alias of both, strided
    module.child = torch.nn.Module()
    module.child.tied = module.a  # the same parameter under a second name
    module.register_buffer("own", torch.arange(8))  # ordinary memory: left alone
    module.register_buffer("sparse", torch.eye(3).to_sparse())  # no plain storage: left alone
    module.register_buffer("shared", torch.zeros(4096).share_memory_())  # a shared mapping, on purpose: left alone
    shared_ptr = module.shared.data_ptr()
    own_ptr, a_param = module.own.data_ptr(), module.a
    assert _in_a_file(module.a) and not _in_a_file(module.own)

    assert privatize(module) == 2 * n  # one copy of the one mapped storage
    assert not any(_in_a_file(t) for t in (module.a, module.b, module.c))
    assert module.own.data_ptr() == own_ptr and module.a is a_param and module.child.tied is module.a
    assert module.shared.data_ptr() == shared_ptr and module.shared.is_shared()
    np.testing.assert_array_equal(torch.cat([module.a.view(-1), module.b]).numpy(), np.arange(n, dtype=np.int16))
    _scribble(path, 0, 2 * n)
    np.testing.assert_array_equal(module.c.numpy(), np.arange(0, n, 2, dtype=np.int16))  # not the file's new bytes
    with torch.no_grad():
        module.a.view(-1)[2] = -7  # the copies still alias each other as the mapped tensors did
    assert int(module.c[1]) == -7 and module.a.untyped_storage().data_ptr() == module.b.untyped_storage().data_ptr()
    assert privatize(module) == 0  # nothing left in a file


def test_hf_runtime_serves_its_own_bits_whatever_happens_to_the_checkpoint(tmp_path):
    transformers = pytest.importorskip("transformers")
    from nemo_dcr.runtimes.hf import HFRuntime

    cfg = transformers.Qwen3Config(hidden_size=64, intermediate_size=128, num_hidden_layers=1, num_attention_heads=4,
                                   num_key_value_heads=2, head_dim=16, vocab_size=2048)
    torch.manual_seed(0)
    transformers.Qwen3ForCausalLM(cfg).to(torch.bfloat16).save_pretrained(tmp_path)
    model = transformers.AutoModelForCausalLM.from_pretrained(tmp_path, dtype=torch.bfloat16)
    # transformers memory-maps safetensors: the loaded weights are the file's pages
    assert any(_in_a_file(p) for p in model.parameters())
    rt = HFRuntime(model, checkpoint_dir=tmp_path)
    assert rt.privatized_bytes >= sum(p.numel() * p.element_size() for p in model.parameters())
    assert not any(_in_a_file(t) for t in list(model.parameters()) + list(model.buffers()))
    before = {n: t.detach().clone() for n, t in rt.canonical_state().items()}

    for f in tmp_path.glob("*.safetensors"):  # an in-place re-export: served bits must not change
        _scribble(f, 4096, os.path.getsize(f) - 8192)
    state = rt.canonical_state()
    assert all(torch.equal(state[n].view(torch.int16), before[n].view(torch.int16)) for n in before)

    name = "model.embed_tokens.weight"  # and refits still apply in place
    record = Record(name, "BF16", tuple(before[name].shape), Op.XOR, np.array([0, 5], np.uint64),
                    np.array([1, 0x8000], np.uint16))
    rt.apply([record])
    got = rt.canonical_state()[name].view(-1).view(torch.int16)
    want = before[name].view(-1).view(torch.int16)
    assert int(got[0]) == int(want[0]) ^ 1 and int(got[5]) == int(want[5]) ^ -0x8000
    assert torch.equal(got[6:], want[6:])


def test_tensor_store_holds_the_given_tensors_in_memory_of_their_own(tmp_path):
    from safetensors.torch import load_file, save_file

    from nemo_dcr.runtimes.store import TensorStoreRuntime

    path = tmp_path / "store.safetensors"
    save_file({"w": torch.arange(1 << 15, dtype=torch.int16).view(torch.bfloat16),
               "s": torch.ones(64, dtype=torch.float32)}, path)
    tensors = load_file(path)  # memory-mapped, as safetensors loads them
    assert all(_in_a_file(t) for t in tensors.values())
    rt = TensorStoreRuntime(tensors)
    assert rt.privatized_bytes >= (1 << 16) + 256 and not any(_in_a_file(t) for t in tensors.values())
    _scribble(path, 0, os.path.getsize(path))
    np.testing.assert_array_equal(rt.canonical_state()["w"].view(torch.int16).numpy(),
                                  np.arange(1 << 15, dtype=np.int16))
    rt.apply([Record("w", "BF16", (1 << 15,), Op.XOR, np.array([3], np.uint64), np.array([0x10], np.uint16))])
    assert int(tensors["w"].view(torch.int16)[3]) == 3 ^ 0x10  # held, not copied: the caller's tensor changed


def test_a_refused_tensor_store_leaves_the_given_tensors_in_their_file(tmp_path):
    """The store's checks come first: a store refused for aliased tensors copies nothing."""
    from safetensors.torch import load_file, save_file

    from nemo_dcr.errors import ApplyError
    from nemo_dcr.runtimes.store import TensorStoreRuntime

    path = tmp_path / "store.safetensors"
    save_file({"w": torch.ones(1 << 15, dtype=torch.bfloat16)}, path)
    tensors = load_file(path)
    tensors["alias"] = tensors["w"][:16]  # shares w's storage: refused
    with pytest.raises(ApplyError, match="shares its storage"):
        TensorStoreRuntime(tensors)
    assert _in_a_file(tensors["w"]) and _in_a_file(tensors["alias"])
