"""Memory of its own for a model whose tensors still live in a memory-mapped checkpoint.

transformers loads safetensors checkpoints memory-mapped: on CPU a model's parameters
stay backed by the checkpoint files (a private, copy-on-write mapping) until written. A
receiver that applies refits in place cannot serve from such memory:
- the served bits follow the file: Linux shows the pages of a private mapping that were
  never written as the file holds them *now*, so a checkpoint rewritten in place (a
  re-export to the same folder) silently changes the weights being served, and one
  truncated makes reading them a SIGBUS;
- every page's first write is a fault that copies it: hundreds of thousands of faults on a
  1B-parameter model, spread over the first refits.
`privatize` copies such tensors once, at start-up (`HFRuntime` calls it; `TensorStoreRuntime`
calls `privatize_tensors` on the tensors it is given, e.g. by `safetensors.torch.load_file`,
which maps them the same way).
"""

from __future__ import annotations

import bisect

import torch

_MAPS = "/proc/self/maps"


def mapped_file_ranges() -> list[tuple[int, int]] | None:
    """Sorted [start, end) address ranges of this process's private (copy-on-write)
    file mappings; None where the process's mappings cannot be read (not Linux). Shared
    mappings are left out: writes to them reach the file, which is what a tensor placed
    there on purpose (`share_memory_()`, a /dev/shm segment) wants."""
    try:
        with open(_MAPS) as f:
            lines = f.read().splitlines()
    except OSError:
        return None
    ranges = []
    for line in lines:
        fields = line.split(maxsplit=5)
        # address perms offset dev inode [path]: a file has an inode ([heap], [stack] and
        # anonymous memory have 0); perms end in p (private) or s (shared)
        if len(fields) == 6 and fields[1].endswith("p") and fields[4] != "0" and fields[5].startswith("/"):
            lo, hi = (int(x, 16) for x in fields[0].split("-"))
            ranges.append((lo, hi))
    ranges.sort()
    return ranges


def _in_a_file(ptr: int, nbytes: int, ranges: list[tuple[int, int]]) -> bool:
    """Whether [ptr, ptr + nbytes) overlaps any of the sorted, disjoint `ranges`."""
    j = max(bisect.bisect_right(ranges, (ptr, float("inf"))) - 1, 0)  # the last one starting at or before ptr
    while j < len(ranges) and ranges[j][0] < ptr + nbytes:
        if ptr < ranges[j][1]:
            return True
        j += 1
    return False


class _Copies:
    """Copies of file-backed storages, one per storage, made as tensors ask for them."""

    def __init__(self):
        self.ranges = mapped_file_ranges()
        self.fresh: dict[int, torch.UntypedStorage] = {}  # old storage address -> its copy
        self.copied = 0

    def view(self, t: torch.Tensor) -> torch.Tensor | None:
        """`t` as a view of its storage's copy, or None where it needs none (not on the
        CPU, or not in a file; where the mappings cannot be read, every CPU storage is)."""
        if t.device.type != "cpu" or t.layout != torch.strided:
            return None
        try:
            storage = t.untyped_storage()
        except (RuntimeError, NotImplementedError):  # a tensor subclass without a plain storage
            return None
        ptr, nbytes = storage.data_ptr(), storage.nbytes()
        if nbytes == 0 or (self.ranges is not None and not _in_a_file(ptr, nbytes, self.ranges)):
            return None
        if ptr not in self.fresh:
            self.fresh[ptr] = storage.clone()
            self.copied += nbytes
        return torch.empty(0, dtype=t.dtype).set_(self.fresh[ptr], t.storage_offset(), t.size(), t.stride())


def privatize(module: torch.nn.Module) -> int:
    """Give every CPU parameter and buffer of `module` that lies in a file mapping memory
    of its own, in place: each storage is copied once, tensors that shared one share the
    copy (tied weights stay tied; parameters stay the same objects). Returns the bytes
    copied."""
    copies = _Copies()
    with torch.no_grad():
        for m in module.modules():
            for p in m._parameters.values():
                if p is not None and (view := copies.view(p.data)) is not None:
                    p.data = view
            for name, b in m._buffers.items():
                if b is not None and (view := copies.view(b)) is not None:
                    m._buffers[name] = view
    return copies.copied


def privatize_tensors(tensors) -> int:
    """`privatize` for plain tensors: each one in a file mapping is pointed, in place (the
    same tensor objects), at a copy of its storage. Returns the bytes copied."""
    copies = _Copies()
    with torch.no_grad():
        for t in tensors:
            if (view := copies.view(t)) is not None:
                t.set_(view.untyped_storage(), view.storage_offset(), view.size(), view.stride())
    return copies.copied
