"""The whole-state digest: a digest of a model's canonical bits that both ends keep up to
date in O(changes), so every refit can prove that a receiver started from the producers'
base and ended at their target.

Definition. For canonical tensor t and lane j in {0, 1}, a 64-bit key per element,
k_j(t, i) = fmix64(T_j(t) + i), where T_j(t) are two 64-bit words of BLAKE2b(name of t)
and fmix64 is MurmurHash3's 64-bit finaliser (a bijection). A tensor's digest is

    D_j(t) = sum over its elements i of k_j(t, i) * b_i   (mod 2**64)

with b_i the element's stored bits as an unsigned integer, and a model's digest is the
sum of its tensors' (lane by lane). So:

- an element that changes from `old` to `new` moves D_j by k_j(t, i) * (new - old): a
  refit's changes update the digest with no look at unchanged elements;
- disjoint shares of the elements (the producers' owned ranges) have digests that add up
  to the whole model's, with no gather;
- the layout a runtime stores a tensor in does not matter: only canonical coordinates do.

Collisions. Two states that differ are told apart unless sum_i k_j(t, i) * d_i = 0 in
both lanes, d_i = new_i - old_i, nonzero for at least one element. Taking the keys as
uniform and independent (they are fmix64 of distinct inputs), the element whose d_i has
the fewest trailing zero bits (at most width - 1 of them) makes a lane agree with
probability at most 2**(width - 1 - 64); the lanes' keys are independent, so both agree
with probability at most 2**(2 * (width - 65)) for any one wrong state: 2**-98 for
BF16 / FP16 tensors, 2**-114 for FP8, 2**-66 for FP32. The digest guards against
accidental differences (a wrong base, a lost write, memory corruption); forgery is the
payload HMAC's job, since the keys are public.
"""

from __future__ import annotations

import functools
import hashlib
import time
from collections.abc import Iterable, Mapping

import numpy as np
import torch

from nemo_dcr import dtypes
from nemo_dcr.kernels.common import jit, jit_inline
from nemo_dcr.kernels.scatter import SCATTER_PREFETCH, prefetch
from nemo_dcr.records import Op

_M1 = np.uint64(0xFF51AFD7ED558CCD)
_M2 = np.uint64(0xC4CEB9FE1A85EC53)
_S33 = np.uint64(33)
_PERSON = b"nemo-dcr-digest1"  # BLAKE2b personalisation: the digest's definition version
ZERO = (0, 0)
_MASK64 = (1 << 64) - 1
# op codes of the change kernel
_CHANGE = {Op.XOR: 0, Op.ADD: 1, Op.OVERWRITE: 2}


@functools.lru_cache(maxsize=1 << 16)
def tensor_keys(name: str) -> tuple[int, int]:
    """(T_0, T_1): the two lanes' 64-bit tensor keys of canonical tensor `name`."""
    h = hashlib.blake2b(name.encode(), digest_size=16, person=_PERSON).digest()
    return int.from_bytes(h[:8], "little"), int.from_bytes(h[8:], "little")


def kernel_keys(record) -> tuple[np.uint64, np.uint64, np.uint64]:
    """(mask, T_0, T_1) of a record's tensor: what `scatter_sums` takes before `out`."""
    return np.uint64((1 << (8 * dtypes.from_name(record.dtype).itemsize)) - 1), *_uint_keys(record.name)


def _uint_keys(name: str) -> tuple[np.uint64, np.uint64]:
    """`tensor_keys` as the kernels take them (a Python int above 2**63 does not pass)."""
    t0, t1 = tensor_keys(name)
    return np.uint64(t0), np.uint64(t1)


@jit_inline
def _fmix(z):
    z ^= z >> _S33
    z *= _M1
    z ^= z >> _S33
    z *= _M2
    z ^= z >> _S33
    return z


@jit
def dense_sums(bits, start, t0, t1):
    """(D_0, D_1) of elements start, start+1, ... holding `bits` (unsigned ints)."""
    s0 = np.uint64(0)
    s1 = np.uint64(0)
    z0 = np.uint64(t0) + np.uint64(start)
    z1 = np.uint64(t1) + np.uint64(start)
    one = np.uint64(1)
    for i in range(bits.size):
        b = np.uint64(bits[i])
        s0 += _fmix(z0) * b
        s1 += _fmix(z1) * b
        z0 += one
        z1 += one
    return s0, s1


@jit
def sparse_sums(pos, bits, t0, t1):
    """(D_0, D_1) of the elements at `pos` (any integer dtype) holding `bits`."""
    s0 = np.uint64(0)
    s1 = np.uint64(0)
    u0 = np.uint64(t0)
    u1 = np.uint64(t1)
    for i in range(pos.size):
        p = np.uint64(pos[i])
        b = np.uint64(bits[i])
        s0 += _fmix(u0 + p) * b
        s1 += _fmix(u1 + p) * b
    return s0, s1


@jit
def change_sums(pos, new, vals, op, mask, t0, t1):
    """How (D_0, D_1) move when the elements at `pos` become `new` (unsigned ints of the
    dtype's width, `mask` = 2**width - 1) from old bits that `vals` tell: new ^ vals for
    op 0 (the xor), new - vals mod 2**width for op 1 (the add), `vals` itself for op 2
    (the old bits)."""
    s0 = np.uint64(0)
    s1 = np.uint64(0)
    u0 = np.uint64(t0)
    u1 = np.uint64(t1)
    m = np.uint64(mask)
    for i in range(pos.size):
        p = np.uint64(pos[i])
        n = np.uint64(new[i])
        v = np.uint64(vals[i])
        if op == 0:
            o = n ^ v
        elif op == 1:
            o = (n - v) & m
        else:
            o = v
        d = n - o
        s0 += _fmix(u0 + p) * d
        s1 += _fmix(u1 + p) * d
    return s0, s1


@jit
def scatter_sums(flat, pos, vals, op, mask, t0, t1, out):
    """`kernels.scatter.scatter_apply` that also adds to out[0], out[1] how the digest moves:
    flat[pos] ^= vals (op 0), += vals wrapping (op 1) or = vals (op 2), positions checked
    as they are written (strictly increasing, in [0, flat.size)). Returns 0, or 1 + the
    index of the first bad position (the changes before it are applied and in `out`).
    Prefetches as `kernels.scatter.scatter_apply` does: the scattered lines are its cost."""
    n = pos.size
    size = flat.size
    ahead = n - SCATTER_PREFETCH
    prev = -1
    u0 = np.uint64(t0)
    u1 = np.uint64(t1)
    m = np.uint64(mask)
    s0 = np.uint64(0)
    s1 = np.uint64(0)
    bad = 0
    for i in range(n):
        p = pos[i]
        if p <= prev or p >= size:
            bad = i + 1
            break
        prev = p
        if i < ahead:
            prefetch(flat, np.int64(pos[i + SCATTER_PREFETCH]))  # a hint: never faults
        old = flat[p]
        if op == 0:
            new = old ^ vals[i]
        elif op == 1:
            new = old + vals[i]
        else:
            new = vals[i]
        flat[p] = new
        d = (np.uint64(new) & m) - (np.uint64(old) & m)
        q = np.uint64(p)
        s0 += _fmix(u0 + q) * d
        s1 += _fmix(u1 + q) * d
    out[0] += s0
    out[1] += s1
    return bad


def _unsigned_np(a: np.ndarray) -> np.ndarray:
    return a.view(dtypes.unsigned(a.itemsize))


class StateDigest:
    """Per canonical tensor, the two lanes' sums (mod 2**64); `total` is the model's.

    Mutable: `add` a change, `merge` another digest (a disjoint share, or a delta)."""

    __slots__ = ("tensors",)

    def __init__(self, tensors: Mapping[str, tuple[int, int]] | None = None):
        self.tensors: dict[str, tuple[int, int]] = dict(tensors or {})

    def copy(self) -> StateDigest:
        return StateDigest(self.tensors)

    def add(self, name: str, sums: tuple[int, int]) -> None:
        a = self.tensors.get(name, ZERO)
        self.tensors[name] = ((a[0] + int(sums[0])) & _MASK64, (a[1] + int(sums[1])) & _MASK64)

    def merge(self, other: StateDigest, sign: int = 1) -> StateDigest:
        """Add (sign 1) or subtract (sign -1) `other` tensor by tensor; returns self."""
        for name, (a, b) in other.tensors.items():
            self.add(name, (sign * a, sign * b))
        return self

    @property
    def total(self) -> tuple[int, int]:
        s0 = sum(a for a, _ in self.tensors.values()) & _MASK64
        s1 = sum(b for _, b in self.tensors.values()) & _MASK64
        return s0, s1

    def hex(self) -> str:
        """The model's digest, 32 hex digits (what control messages carry)."""
        return to_hex(self.total)

    def to_json(self) -> dict[str, str]:
        return {n: to_hex(s) for n, s in sorted(self.tensors.items())}

    @classmethod
    def from_json(cls, d: Mapping[str, str]) -> StateDigest:
        return cls({n: from_hex(h) for n, h in d.items()})

    def differing(self, other: StateDigest, limit: int = 8) -> list[str]:
        """Tensors whose sums differ (or that one side lacks), sorted, at most `limit`."""
        names = set(self.tensors) | set(other.tensors)
        return sorted(n for n in names if self.tensors.get(n, ZERO) != other.tensors.get(n, ZERO))[:limit]

    def __eq__(self, other) -> bool:
        return isinstance(other, StateDigest) and self.total == other.total

    def __repr__(self) -> str:
        return f"StateDigest({self.hex()}, {len(self.tensors)} tensors)"


class StateDigestMove:
    """How one refit's changes move a share's state digest: in all (`moved`) and per
    payload (`take_payload`, at each cut); nothing is computed when the share keeps no
    digest (`tracking` False). `seconds`: the time the sums took."""

    def __init__(self, tracking: bool):
        self.tracking = tracking
        self.moved = StateDigest()
        self.seconds = 0.0
        self._payload = [0, 0]  # the move of the payload being built

    def account(self, name: str, op: Op, positions, new, values) -> None:
        """The move by changes placed at canonical `positions` (see `change_delta`)."""
        if not self.tracking:
            return
        t = time.perf_counter()
        sums = change_delta(name, op, positions, new, values)
        self.moved.add(name, sums)
        self._payload[0] += sums[0]
        self._payload[1] += sums[1]
        self.seconds += time.perf_counter() - t

    def take_payload(self) -> str | None:
        """The move of the payload cut now (hex; None when not tracking); the next starts at zero."""
        moved = to_hex(self._payload) if self.tracking else None
        self._payload = [0, 0]
        return moved


def to_hex(sums: tuple[int, int]) -> str:
    return f"{int(sums[0]) & _MASK64:016x}{int(sums[1]) & _MASK64:016x}"


def from_hex(text: str) -> tuple[int, int]:
    if not isinstance(text, str) or len(text) != 32:
        raise ValueError(f"a state digest is 32 hex digits, got {text!r}")
    return int(text[:16], 16), int(text[16:], 16)


def add_hex(digests: Iterable[str]) -> str:
    """The digest of disjoint shares' union, from their hex digests."""
    s0 = s1 = 0
    for h in digests:
        a, b = from_hex(h)
        s0, s1 = s0 + a, s1 + b
    return to_hex((s0, s1))


# --- whole tensors, elements, changes: host arrays through the kernels, device tensors
#     through the same arithmetic in torch ops ------------------------------------------

_CHUNK = 1 << 24  # elements a dense kernel call reads (a GPU tensor is copied over this much at a time)


def tensor_sums(name: str, t: torch.Tensor, start: int = 0) -> tuple[int, int]:
    """(D_0, D_1) of tensor `t`'s elements, flat, the first at canonical index `start`."""
    t0, t1 = _uint_keys(name)
    flat = dtypes.bits_of(t.detach()).reshape(-1)
    s0 = s1 = 0
    for lo in range(0, flat.numel(), _CHUNK):
        part = flat[lo:lo + _CHUNK]
        if part.device.type != "cpu":
            a, b = _torch_dense(part, start + lo, t0, t1)
        else:
            a, b = dense_sums(_unsigned_np(part.contiguous().numpy()), start + lo, t0, t1)
        s0, s1 = s0 + int(a), s1 + int(b)
    return s0 & _MASK64, s1 & _MASK64


def state_digest(state: Mapping[str, torch.Tensor]) -> StateDigest:
    """The digest of a whole canonical state (name -> tensor): O(model), once at load."""
    return StateDigest({name: tensor_sums(name, t) for name, t in state.items()})


def element_sums(name: str, positions, bits) -> tuple[int, int]:
    """(D_0, D_1) of some elements: canonical `positions` holding `bits` (numpy arrays or
    tensors on one device)."""
    t0, t1 = _uint_keys(name)
    if isinstance(positions, torch.Tensor):
        return _torch_sums(positions, _torch_unsigned(bits), t0, t1)
    a, b = sparse_sums(np.asarray(positions), _unsigned_np(np.asarray(bits)), t0, t1)
    return int(a), int(b)


def change_delta(name: str, op: Op, positions, new, values) -> tuple[int, int]:
    """How (D_0, D_1) move when the elements at canonical `positions` take the bits `new`
    from old bits that `values` tell for `op` (xor: new ^ old; add: new - old mod 2**width;
    overwrite: the old bits themselves)."""
    t0, t1 = _uint_keys(name)
    code = _CHANGE[Op(op)]
    if isinstance(positions, torch.Tensor):
        newu, valu = _torch_unsigned(new), _torch_unsigned(values)
        old = newu ^ valu if code == 0 else (newu - valu) & _width_mask(new) if code == 1 else valu
        return _torch_sums(positions, newu - old, t0, t1)
    new = _unsigned_np(np.asarray(new))
    a, b = change_sums(np.asarray(positions), new, _unsigned_np(np.asarray(values)), code,
                       np.uint64((1 << (8 * new.itemsize)) - 1), t0, t1)
    return int(a), int(b)


# torch has no uint64 arithmetic: int64 wraps the same way mod 2**64, and a logical
# shift right is an arithmetic one with the sign bits masked off.
def _signed(c: int) -> int:
    return c - (1 << 64) if c >= 1 << 63 else c


_M1_S, _M2_S, _LOW31 = _signed(int(_M1)), _signed(int(_M2)), (1 << 31) - 1


def _torch_fmix(z: torch.Tensor) -> torch.Tensor:
    z = z ^ ((z >> 33) & _LOW31)
    z = z * _M1_S
    z = z ^ ((z >> 33) & _LOW31)
    z = z * _M2_S
    return z ^ ((z >> 33) & _LOW31)


def _torch_unsigned(bits) -> torch.Tensor:
    """Stored bits as non-negative int64 (torch views them signed)."""
    t = bits if isinstance(bits, torch.Tensor) else torch.from_numpy(np.ascontiguousarray(bits))
    if t.is_floating_point() or t.dtype == torch.bool:
        t = dtypes.bits_of(t)
    width = t.element_size() * 8
    return t.to(torch.int64) & ((1 << width) - 1) if width < 64 else t.to(torch.int64)


def _width_mask(bits) -> int:
    return (1 << (8 * bits.element_size())) - 1 if isinstance(bits, torch.Tensor) else (1 << (8 * bits.itemsize)) - 1


def _torch_sums(positions: torch.Tensor, factor: torch.Tensor, t0, t1) -> tuple[int, int]:
    pos = positions.to(torch.int64)
    out = []
    for t in (t0, t1):
        out.append(int((_torch_fmix(pos + _signed(int(t))) * factor).sum().item()) & _MASK64)
    return out[0], out[1]


def _torch_dense(bits: torch.Tensor, start: int, t0: int, t1: int) -> tuple[int, int]:
    idx = torch.arange(start, start + bits.numel(), dtype=torch.int64, device=bits.device)
    return _torch_sums(idx, _torch_unsigned(bits), t0, t1)
