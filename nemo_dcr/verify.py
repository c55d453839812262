"""End-state checks: compare receivers' stored bits with a dense canonical export.

Digests are XXH3-128 (the wire format's checksum): both sides compute them with this
module, they guard against bugs and corruption, not forgery, and BLAKE2b made verifying a
whole model take far longer than the refit (XXH3 runs at memory speed)."""

from __future__ import annotations

import numpy as np
import torch
import xxhash


def tensor_digest(t: torch.Tensor) -> str:
    """XXH3-128 of a tensor's stored bits (dtype and shape are compared separately)."""
    flat = t.detach().contiguous().cpu().reshape(-1)
    return xxhash.xxh3_128_hexdigest(flat.view(torch.uint8).numpy())


def region_digest(positions: np.ndarray, bits: np.ndarray) -> str:
    """XXH3-128 of some elements' positions (uint64) and stored bits (unsigned ints of
    the dtype's width), little-endian: what a record should leave behind once applied."""
    h = xxhash.xxh3_128()
    h.update(np.ascontiguousarray(positions, dtype="<u8").tobytes())
    h.update(np.ascontiguousarray(bits).astype(bits.dtype.newbyteorder("<"), copy=False).tobytes())
    return h.hexdigest()


def read_back(state: dict[str, torch.Tensor], records) -> dict[str, str]:
    """`region_digest` of every record's positions as the runtime holds them now."""
    from nemo_dcr import dtypes

    out = {}
    for r in records:
        flat = dtypes.bits_of(state[r.name].detach().contiguous()).reshape(-1)
        idx = torch.from_numpy(r.positions.view(np.int64)).to(flat.device)
        got = flat.index_select(0, idx).cpu().numpy()
        out[r.name] = region_digest(r.positions, got.view(f"<u{got.itemsize}"))
    return out


def state_digests(state: dict[str, torch.Tensor]) -> dict[str, str]:
    return {name: tensor_digest(t) for name, t in state.items()}


def compare_digests(expected: dict[str, str], got: dict[str, str]) -> list[str]:
    """Names whose bits differ, or that only one side holds (empty list = bit-exact)."""
    bad = [n for n in expected if got.get(n) != expected[n]]
    bad += [f"{n} (unexpected)" for n in got if n not in expected]
    return sorted(bad)


def bit_mismatches(expected: dict[str, torch.Tensor], got: dict[str, torch.Tensor]) -> list[str]:
    """Element-level comparison for tests: names whose dtype, shape or bits differ."""
    bad = []
    for name, want in expected.items():
        have = got.get(name)
        if have is None or have.dtype != want.dtype or tuple(have.shape) != tuple(want.shape):
            bad.append(name)
        elif not torch.equal(tensor_bits(have), tensor_bits(want)):
            bad.append(name)
    bad += [f"{n} (unexpected)" for n in got if n not in expected]
    return sorted(bad)


def tensor_bits(t: torch.Tensor) -> torch.Tensor:
    return t.detach().contiguous().cpu().reshape(-1).view(torch.uint8)
