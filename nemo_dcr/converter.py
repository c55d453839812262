"""Converters: declarative tables from Megatron parameters to canonical tensors.

A family's converter (one file in `converters/`) lists `Rule`s: a Megatron name
pattern with a `{L}` layer placeholder (global layer index), and a `Mapping` kind
that says how the tensor-parallel shard lands in canonical coordinates. Kinds
compile to `AffineMap`s once per layout; nothing here runs per refit.

Mistakes in a table are caught at start-up by `Converter.plan` (every local
parameter matched exactly once, shapes and dtypes consistent) and by
`check_exact_cover` over all ranks (every canonical element owned exactly once).
"""

from __future__ import annotations

import re
from abc import ABC, abstractmethod
from dataclasses import dataclass

import numpy as np

from nemo_dcr import dtypes
from nemo_dcr.errors import ConverterError
from nemo_dcr.layout import LocalParam, OwnedRange, ParallelLayout
from nemo_dcr.placement import AffineMap, Piece, check_exact_cover

Spec = tuple[str, tuple[int, ...]]  # (dtype name, shape)


@dataclass(frozen=True)
class Dims:
    """Model dimensions a mapping may need beyond tensor shapes."""

    num_heads: int
    num_query_groups: int
    head_dim: int


@dataclass
class Context:
    param: LocalParam
    layout: ParallelLayout
    targets: tuple[str, ...]  # canonical names, layer placeholder filled in
    specs: dict[str, Spec]
    dims: Dims

    def shape(self, name: str) -> tuple[int, ...]:
        return tuple(self.specs[name][1])

    def fail(self, why: str) -> ConverterError:
        return ConverterError(
            f"Megatron parameter {self.param.name!r} (local shape {tuple(self.param.local_shape)}, "
            f"tp {self.layout.tp_rank}/{self.layout.tp_size}) -> {list(self.targets)}: {why}"
        )


def _numel(shape) -> int:
    return int(np.prod(shape, dtype=np.int64)) if len(shape) else 1


class Mapping(ABC):
    """How one Megatron shard maps into its canonical tensor(s)."""

    n_targets = 1
    dropped_reason = ""

    @abstractmethod
    def pieces(self, ctx: Context) -> list[Piece]:
        """The affine pieces this rank *owns* (each canonical element has one owner)."""

    def load_pieces(self, ctx: Context) -> list[Piece]:
        """Every piece this rank *holds*, owned or not: what loading a checkpoint fills."""
        return self.pieces(ctx)


class Replicated(Mapping):
    """Same full tensor on every TP rank (norms): TP rank 0 owns it."""

    dropped_reason = "replica of tensor-parallel rank 0"

    def pieces(self, ctx):
        (t,) = ctx.targets
        if tuple(ctx.param.local_shape) != ctx.shape(t):
            raise ctx.fail(f"replicated shape differs from canonical {ctx.shape(t)}")
        return self.load_pieces(ctx) if ctx.layout.tp_rank == 0 else []

    def load_pieces(self, ctx):
        (t,) = ctx.targets
        if tuple(ctx.param.local_shape) != ctx.shape(t):
            raise ctx.fail(f"replicated shape differs from canonical {ctx.shape(t)}")
        return [Piece(t, 0, 1, ctx.param.numel, 0, 0)]


class ColumnParallel(Mapping):
    """Split along dim 0: rank r holds canonical rows [r*n, (r+1)*n)."""

    def pieces(self, ctx):
        (t,) = ctx.targets
        local, canon, tp = tuple(ctx.param.local_shape), ctx.shape(t), ctx.layout.tp_size
        if canon != (local[0] * tp,) + local[1:]:
            raise ctx.fail(f"column-parallel shard does not tile canonical {canon}")
        n = ctx.param.numel
        return [Piece(t, 0, 1, n, ctx.layout.tp_rank * n, 0)]


class RowParallel(Mapping):
    """Split along dim 1: each local row is a contiguous slice of a canonical row."""

    def pieces(self, ctx):
        (t,) = ctx.targets
        local, canon, tp = tuple(ctx.param.local_shape), ctx.shape(t), ctx.layout.tp_size
        if len(local) != 2 or canon != (local[0], local[1] * tp):
            raise ctx.fail(f"row-parallel shard does not tile canonical {canon}")
        rows, cols = local
        return [Piece(t, 0, rows, cols, ctx.layout.tp_rank * cols, cols * tp)]


class VocabParallel(Mapping):
    """Split along the (padded) vocab dim; padded rows past the vocab are dropped."""

    dropped_reason = "vocab padding"

    def pieces(self, ctx):
        (t,) = ctx.targets
        local, canon, tp = tuple(ctx.param.local_shape), ctx.shape(t), ctx.layout.tp_size
        if len(local) != 2 or local[1] != canon[1] or local[0] * tp < canon[0]:
            raise ctx.fail(f"vocab-parallel shard cannot hold canonical {canon}")
        first = ctx.layout.tp_rank * local[0]
        valid = max(0, min(canon[0] - first, local[0]))
        if valid == 0:
            return []
        return [Piece(t, 0, 1, valid * local[1], first * local[1], 0)]


class FusedQKV(Mapping):
    """Megatron's `linear_qkv`: per local query group, [q heads; k; v] rows.

    Targets (q, k, v). Works for weights ([rows, hidden]) and biases ([rows]).
    """

    n_targets = 3

    def pieces(self, ctx):
        q, k, v = ctx.targets
        d, heads, groups = ctx.dims.head_dim, ctx.dims.num_heads, ctx.dims.num_query_groups
        tp = ctx.layout.tp_size
        if heads % groups or groups % tp:
            raise ctx.fail(f"{heads} heads / {groups} query groups do not split over tp={tp}")
        per_group = heads // groups
        local = tuple(ctx.param.local_shape)
        cols = local[1] if len(local) == 2 else 1
        groups_local = groups // tp
        if local[0] != groups_local * (per_group + 2) * d:
            raise ctx.fail(f"expected {groups_local * (per_group + 2) * d} rows for {groups_local} local query groups")
        for name, rows in ((q, heads * d), (k, groups * d), (v, groups * d)):
            if _numel(ctx.shape(name)) != rows * cols:
                raise ctx.fail(f"canonical {name} has shape {ctx.shape(name)}, expected {rows} rows of {cols}")
        out, block = [], (per_group + 2) * d * cols
        for g in range(groups_local):
            gg = ctx.layout.tp_rank * groups_local + g
            start = g * block
            out.append(Piece(q, start, 1, per_group * d * cols, gg * per_group * d * cols, 0))
            start += per_group * d * cols
            out.append(Piece(k, start, 1, d * cols, gg * d * cols, 0))
            out.append(Piece(v, start + d * cols, 1, d * cols, gg * d * cols, 0))
        return out


class GatedColumn(Mapping):
    """Megatron's `linear_fc1` with a gated unit: each TP rank holds [gate_r; up_r]."""

    n_targets = 2

    def pieces(self, ctx):
        gate, up = ctx.targets
        local, tp = tuple(ctx.param.local_shape), ctx.layout.tp_size
        if local[0] % 2:
            raise ctx.fail("fused gate/up shard has an odd number of rows")
        half = (local[0] // 2,) + local[1:]
        for name in (gate, up):
            if ctx.shape(name) != (half[0] * tp,) + half[1:]:
                raise ctx.fail(f"canonical {name} {ctx.shape(name)} is not {tp} x {half}")
        n = _numel(half)
        off = ctx.layout.tp_rank * n
        return [Piece(gate, 0, 1, n, off, 0), Piece(up, n, 1, n, off, 0)]


class Tied(Mapping):
    """A copy of a tensor owned by another parameter (e.g. the output layer of a model
    with tied embeddings): owns nothing, but loads like `inner`."""

    def __init__(self, inner: Mapping):
        self.inner, self.n_targets = inner, inner.n_targets
        self.dropped_reason = "tied copy (owned by the parameter it is tied to)"

    def pieces(self, ctx):
        self.inner.load_pieces(ctx)  # still validates shapes at start-up
        return []

    def load_pieces(self, ctx):
        return self.inner.load_pieces(ctx)


@dataclass(frozen=True)
class Rule:
    pattern: str  # Megatron name, "{L}" = global layer index
    targets: tuple[str, ...]  # canonical names, may use "{L}"
    mapping: Mapping

    def compile(self) -> re.Pattern:
        return re.compile("^" + re.escape(self.pattern).replace(r"\{L\}", r"(?P<L>\d+)") + "$")


class Converter(ABC):
    """Places one model family's local parameters in canonical coordinates."""

    family = "base"

    def __init__(self, hf_config):
        self.hf_config = hf_config

    @abstractmethod
    def plan(
        self, params: list[LocalParam], layout: ParallelLayout, specs: dict[str, Spec], *, loading: bool = False
    ) -> dict[str, AffineMap]:
        """Affine maps for this rank's local parameters; raises ConverterError on any gap.

        loading=False: the pieces this rank owns (what it sends). loading=True: every
        piece it holds (what loading a canonical checkpoint into it must fill).
        """


class TableConverter(Converter):
    """A converter given as a declarative table: subclasses define `rules()` and `dims()`."""

    def __init__(self, hf_config):
        super().__init__(hf_config)
        self._rules = [(r, r.compile()) for r in self.rules()]
        for r, _ in self._rules:
            if len(r.targets) != r.mapping.n_targets:
                raise ConverterError(f"rule {r.pattern!r}: {type(r.mapping).__name__} takes {r.mapping.n_targets} targets")

    @abstractmethod
    def rules(self) -> list[Rule]:
        """The family's table."""

    @abstractmethod
    def dims(self) -> Dims:
        """Head counts and sizes the fused mappings need."""

    def match(self, name: str) -> tuple[Rule, tuple[str, ...]]:
        hits = [(r, m) for r, rx in self._rules if (m := rx.match(name))]
        if not hits:
            raise ConverterError(f"Megatron parameter {name!r} is not mapped by the {self.family} converter")
        if len(hits) > 1:
            raise ConverterError(f"Megatron parameter {name!r} matches {len(hits)} rules: {[r.pattern for r, _ in hits]}")
        rule, m = hits[0]
        layer = m.groupdict().get("L")
        return rule, tuple(t.replace("{L}", layer) if layer is not None else t for t in rule.targets)

    def plan(self, params, layout, specs, *, loading=False):
        dims, maps = self.dims(), {}
        for p in params:
            rule, targets = self.match(p.name)
            ctx = Context(p, layout, targets, specs, dims)
            for t in targets:
                if t not in specs:
                    raise ctx.fail(f"canonical tensor {t!r} is not in the checkpoint")
                if dtypes.from_name(specs[t][0]).torch_dtype != p.dtype:
                    raise ctx.fail(f"local dtype {p.dtype} differs from canonical {specs[t][0]}: not a bit copy")
            pieces = rule.mapping.load_pieces(ctx) if loading else rule.mapping.pieces(ctx)
            maps[p.name] = AffineMap(p.name, p.numel, tuple(pieces), rule.mapping.dropped_reason)
        return maps


def coverage_runs(maps: dict[str, AffineMap], owned: list[OwnedRange], owner: str):
    """Canonical runs this rank owns: name -> [(starts, lengths, owner)], for check_exact_cover."""
    runs: dict[str, list] = {}
    for r in owned:
        for p in maps[r.param.name].pieces:
            s, n = p.canonical_runs(r.start, r.stop)
            if s.size:
                runs.setdefault(p.canonical, []).append((s, n, f"{owner} via {r.param.name}"))
    return runs


def merge_runs(per_rank: list[dict]) -> dict:
    merged: dict[str, list] = {}
    for runs in per_rank:
        for name, parts in runs.items():
            merged.setdefault(name, []).extend(parts)
    return merged


def _union(starts: np.ndarray, stops: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Disjoint, sorted [start, stop) intervals covering the same elements."""
    keep = stops > starts
    starts, stops = starts[keep], stops[keep]
    if starts.size == 0:
        return starts, stops
    order = np.argsort(starts, kind="stable")
    starts, reach = starts[order], np.maximum.accumulate(stops[order])
    new = np.flatnonzero(np.r_[True, starts[1:] > reach[:-1]])
    return starts[new], reach[np.r_[new[1:] - 1, starts.size - 1]]


def owned_intervals(maps: dict[str, AffineMap], owned: list[OwnedRange]) -> dict[str, list[list[int]]]:
    """The canonical elements this rank's owned ranges place: name -> [starts, stops]
    of disjoint intervals. Plain ints, so ranks can gather them as JSON."""
    out = {}
    for name, parts in coverage_runs(maps, owned, "").items():
        starts = np.concatenate([s for s, _, _ in parts])
        lo, hi = _union(starts, starts + np.concatenate([n for _, n, _ in parts]))
        out[name] = [lo.tolist(), hi.tolist()]
    return out


@dataclass(frozen=True)
class CoverageReport:
    """How the canonical checkpoint's bytes reach receivers, over all trainer ranks."""

    total_bytes: int
    affine_bytes: int  # placed by some rank's owned affine pieces (each element counted once)
    residual_bytes: int = 0  # recomputed by residual rules: no converter declares any yet
    unplaced: tuple[tuple[str, int], ...] = ()  # (canonical name, bytes no rank places)

    @property
    def unplaced_bytes(self) -> int:
        return self.total_bytes - self.affine_bytes - self.residual_bytes

    def __str__(self) -> str:
        pct = lambda n: 100.0 * n / max(self.total_bytes, 1)  # noqa: E731
        text = (f"placement: {pct(self.affine_bytes):.1f}% of canonical bytes affine, "
                f"{pct(self.residual_bytes):.1f}% residual")
        if self.unplaced_bytes:
            names = ", ".join(n for n, _ in self.unplaced[:3]) + (", ..." if len(self.unplaced) > 3 else "")
            text += f", {self.unplaced_bytes} bytes ({pct(self.unplaced_bytes):.2g}%) unplaced: {names}"
        return text


def coverage_report(specs: dict[str, Spec], per_rank: list[dict[str, list[list[int]]]]) -> CoverageReport:
    """Fraction of the canonical bytes that the ranks' owned maps place (`per_rank`: every
    rank's `owned_intervals`). An element claimed by two ranks counts once, intervals
    past a tensor's end or into tensors outside `specs` count not at all: whatever no
    piece reaches is reported as unplaced, never assumed covered."""
    total = affine = 0
    unplaced = []
    for name, (dtype, shape) in specs.items():
        numel, itemsize = _numel(shape), dtypes.from_name(dtype).itemsize
        parts = [r[name] for r in per_rank if name in r]
        covered = 0
        if parts:
            starts = np.clip(np.concatenate([np.asarray(p[0], np.int64) for p in parts]), 0, numel)
            stops = np.clip(np.concatenate([np.asarray(p[1], np.int64) for p in parts]), 0, numel)
            lo, hi = _union(starts, stops)
            covered = int((hi - lo).sum())
        total, affine = total + numel * itemsize, affine + covered * itemsize
        if covered < numel:
            unplaced.append((name, (numel - covered) * itemsize))
    return CoverageReport(total, affine, 0, tuple(unplaced))


__all__ = [
    "Converter", "TableConverter", "Rule", "Dims", "Mapping", "Replicated", "ColumnParallel", "RowParallel",
    "VocabParallel", "FusedQKV", "GatedColumn", "Tied", "coverage_runs", "merge_runs", "check_exact_cover",
    "owned_intervals", "coverage_report", "CoverageReport",
]
