"""What a native loader writes, traced: the geometry of its copies into model storage.

`CopyInterceptor` is the dispatch mode under which `intercept.NativeLoaderAdapter` runs
a runtime's own loader on a scratch tensor: copies into model storage are recorded (a
`LoaderCopy` each, gathered per canonical tensor in a `LoaderPlan`), not run; other
writes into model storage are refused. `StorageView` is a tensor's strided geometry
inside its storage; `storage_key`, `module_storages` and `module_fingerprint` say which
storage belongs to which parameter and when plans must be made again.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from nemo_dcr import dtypes
from nemo_dcr.errors import ApplyError

_aten = torch.ops.aten


def storage_key(t: torch.Tensor) -> int | None:
    """Identity of the storage behind a tensor, shared by all its views (also on meta)."""
    try:
        return t.untyped_storage()._cdata
    except Exception:  # sparse / wrapper tensors have no plain storage
        return None


def module_storages(model: torch.nn.Module) -> dict[int, str]:
    """Storage identity -> the first name of a parameter or buffer on it, for a module."""
    out: dict[int, str] = {}
    for name, t in list(model.named_parameters(remove_duplicate=False)) + list(
        model.named_buffers(remove_duplicate=False)
    ):
        if t is not None:
            out.setdefault(storage_key(t), name)
    return out


def module_fingerprint(model: torch.nn.Module) -> tuple:
    """What a module tree's loader plans depend on, from one plain walk over it: per
    module reached, its identity, its children's, its load hooks, and the storage (and
    vLLM-style `weight_loader`) of each parameter and buffer. Equal fingerprints mean the
    same storage and loaders. About 10x cheaper than `module_storages` plus a `modules()`
    walk, which build every dotted name: it runs once per payload applied."""
    out, seen, stack = [], set(), [model]
    while stack:
        m = stack.pop()
        if id(m) in seen:
            continue
        seen.add(id(m))
        children = [c for c in m._modules.values() if c is not None]
        stack.extend(reversed(children))
        tensors = tuple((storage_key(t), getattr(t, "weight_loader", None))
                        for store in (m._parameters, m._buffers) for t in store.values() if t is not None)
        out.append((id(m), tuple(map(id, children)), tensors, tuple(m._load_state_dict_pre_hooks.values()),
                    tuple(m._load_state_dict_post_hooks.values())))
    return tuple(out)


def mutated_tensors(func, args, kwargs) -> list[torch.Tensor]:
    """Tensors an aten op mutates, read from its schema (`Tensor(a!)` arguments)."""
    out = []
    for i, arg in enumerate(func._schema.arguments):
        if arg.alias_info is None or not arg.alias_info.is_write:
            continue
        value = args[i] if i < len(args) else kwargs.get(arg.name)
        if isinstance(value, torch.Tensor):
            out.append(value)
        elif isinstance(value, (list, tuple)):
            out.extend(v for v in value if isinstance(v, torch.Tensor))
    return out


@dataclass(frozen=True)
class StorageView:
    """Strided geometry of a tensor inside its storage, in elements."""

    size: tuple[int, ...]
    stride: tuple[int, ...]
    offset: int

    @classmethod
    def of(cls, t: torch.Tensor) -> StorageView:
        return cls(tuple(t.size()), tuple(t.stride()), int(t.storage_offset()))

    @property
    def numel(self) -> int:
        return math.prod(self.size)

    def span(self) -> tuple[int, int]:
        """[first, last + 1) storage elements touched (empty when numel is 0)."""
        if self.numel == 0:
            return self.offset, self.offset
        return self.offset, self.offset + sum((s - 1) * st for s, st in zip(self.size, self.stride)) + 1

    def _dims(self) -> list[tuple[int, int]]:
        return sorted((st, s) for s, st in zip(self.size, self.stride) if s > 1)

    def distinct(self) -> bool:
        """No two elements share a storage element (sufficient test)."""
        reach = 0
        for st, s in self._dims():
            if st <= reach:
                return False
            reach += (s - 1) * st
        return True

    def dense(self) -> bool:
        """Elements fill [offset, offset + numel) exactly (a permutation of contiguous)."""
        expected = 1
        for st, s in self._dims():
            if st != expected:
                return False
            expected *= s
        return True

    def deduplicated(self) -> StorageView:
        """The same set of elements without broadcast (stride-0) dimensions."""
        keep = [(s, st) for s, st in zip(self.size, self.stride) if st != 0 or s <= 1]
        return StorageView(tuple(s for s, _ in keep), tuple(st for _, st in keep), self.offset)

    def indices(self) -> torch.Tensor:
        """Flat storage indices of every element (explicit; only for odd layouts)."""
        idx = torch.full((), self.offset, dtype=torch.int64)
        for d, (s, st) in enumerate(zip(self.size, self.stride)):
            shape = [1] * len(self.size)
            shape[d] = s
            idx = idx + (torch.arange(s, dtype=torch.int64) * st).view(shape)
        return idx.reshape(-1)


def mark_view(marks: torch.Tensor, view: StorageView, base: int) -> bool:
    """Set `view`'s elements in `marks` (index = storage element - base); True if any was set."""
    v = StorageView(view.size, view.stride, view.offset - base)
    if v.distinct():
        region = marks.as_strided(v.size, v.stride, v.offset)
        hit = bool(region.any())
        region.fill_(True)
    else:
        idx = v.indices()
        hit = bool(marks[idx].any()) or torch.unique(idx).numel() != idx.numel()
        marks[idx] = True
    return hit


@dataclass
class LoaderCopy:
    """One intercepted `dst.copy_(src)`: canonical elements `src` land on `dst`."""

    dst: torch.Tensor
    src: StorageView  # in scratch (canonical, contiguous) elements, broadcast to dst's shape
    dst_view: StorageView
    dst_key: int
    where: str  # destination name, for messages

    @classmethod
    def into(cls, dst: torch.Tensor, src: StorageView, where: str) -> LoaderCopy:
        return cls(dst, src, StorageView.of(dst), storage_key(dst), where)


@dataclass
class LoaderPlan:
    """Where one canonical tensor's elements land, as the native loader put them."""

    name: str
    dtype: dtypes.DType
    shape: tuple[int, ...]
    copies: list[LoaderCopy] = field(default_factory=list)
    irregular: str | None = None  # why only a verified dense overwrite is exact
    identity: bool = False  # one plain copy of the whole tensor: apply sparsely

    @property
    def numel(self) -> int:
        return math.prod(self.shape)


class CopyInterceptor(TorchDispatchMode):
    """Records copies into model storage instead of running them; refuses other writes."""

    def __init__(self, scratch: dict[int, str], destinations: dict[int, str]):
        super().__init__()
        self.scratch = scratch
        self.destinations = destinations
        self.copies: list[tuple[torch.Tensor, torch.Tensor]] = []
        self.mutated: set[str] = set()
        self.errors: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        # A write of zero elements changes nothing (vLLM's embedding loader fills the
        # empty padding slice `param[n:]` with zeros): run it, it cannot matter.
        written = [t for t in mutated_tensors(func, args, kwargs) if t.numel() > 0]
        for t in written:
            name = self.scratch.get(storage_key(t))
            if name is not None:
                self.mutated.add(name)
        hits = [self.destinations[k] for k in map(storage_key, written) if k in self.destinations]
        if not hits:
            return func(*args, **kwargs)
        if func is _aten.copy_.default and len(written) == 1 and isinstance(args[1], torch.Tensor):
            self.copies.append((args[0], args[1]))
            return args[0]
        msg = f"the loader writes {hits[0]} with {func} (only copies can be intercepted)"
        self.errors.append(msg)
        raise ApplyError(msg)
