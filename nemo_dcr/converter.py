"""Converters: declarative tables from Megatron parameters to canonical tensors.

A family's converter (one file in `converters/`) lists `Rule`s: a Megatron name
pattern with a `{L}` layer placeholder (global layer index), and a `Mapping` kind
that says how the tensor-parallel shard lands in canonical coordinates. Kinds
compile to `AffineMap`s once per layout; nothing here runs per refit. `Residual`
kinds (values that are not bit copies: `1 + w` norms, later FP8 weights and scales;
fused QKV may be declared either way) compile to `ResidualMap`s: their canonical
values are recomputed each refit and sent as overwrites.

Mistakes in a table are caught at start-up by `Converter.plan` (every local
parameter matched exactly once, shapes and dtypes consistent) and by
`check_exact_cover` over all ranks (every canonical element owned exactly once).
"""

from __future__ import annotations

import dataclasses
import re
from abc import ABC, abstractmethod
from dataclasses import dataclass

import numpy as np
import torch

from nemo_dcr import dtypes
from nemo_dcr.errors import ConverterError
from nemo_dcr.layout import LocalParam, OwnedRange, ParallelLayout
from nemo_dcr.placement import AffineMap, Piece, ResidualMap, check_exact_cover

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
        return _qkv_pieces(ctx, ctx.targets, (0, 0, 0), qkv_geometry(ctx))


class PackedQKV(Mapping):
    """Megatron's `linear_qkv` into one packed canonical tensor [q; k; v] (Phi-3's
    `qkv_proj`, vLLM's packed layout): q rows first, then k, then v, each in head order.

    One target. Works for weights and biases."""

    def pieces(self, ctx):
        (t,) = ctx.targets
        geometry = qkv_geometry(ctx, packed=True)
        _, _, d, cols = geometry
        q_rows, kv_rows = ctx.dims.num_heads * d, ctx.dims.num_query_groups * d
        return _qkv_pieces(ctx, (t, t, t), (0, q_rows * cols, (q_rows + kv_rows) * cols), geometry)


def _qkv_pieces(ctx: Context, targets, bases, geometry) -> list[Piece]:
    """Three pieces per local query group: its q heads, k and v, each landing in
    `targets[i]` at `bases[i]` plus the global group's offset within that part."""
    per_group, groups_local, d, cols = geometry
    widths = (per_group * d * cols, d * cols, d * cols)  # elements of q, k, v per query group
    out, start = [], 0
    for g in range(groups_local):
        gg = ctx.layout.tp_rank * groups_local + g  # global query group
        for name, base, n in zip(targets, bases, widths):
            out.append(Piece(name, start, 1, n, base + gg * n, 0))
            start += n
    return out


def qkv_geometry(ctx: Context, *, packed: bool = False) -> tuple[int, int, int, int]:
    """(query heads per group, local query groups, head dim, columns) of a fused
    `linear_qkv` shard, checked against the canonical targets: (q, k, v), or one
    tensor [q; k; v] when `packed`. Columns: the hidden size of a weight, 1 for a bias."""
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
    rows = ((heads + 2 * groups) * d,) if packed else (heads * d, groups * d, groups * d)
    for name, n in zip(ctx.targets, rows):
        if _numel(ctx.shape(name)) != n * cols:
            raise ctx.fail(f"canonical {name} has shape {ctx.shape(name)}, expected {n} rows of {cols}")
    return per_group, groups_local, d, cols


class GatedColumn(Mapping):
    """Megatron's `linear_fc1` with a gated unit: each TP rank holds [gate_r; up_r]."""

    n_targets = 2

    def pieces(self, ctx):
        gate, up = ctx.targets
        n = gated_half(ctx)
        off = ctx.layout.tp_rank * n
        return [Piece(gate, 0, 1, n, off, 0), Piece(up, n, 1, n, off, 0)]


class PackedGateUp(Mapping):
    """Megatron's gated `linear_fc1` into one packed canonical tensor [gate; up]
    (Phi-3's `gate_up_proj`): rank r's gate_r and up_r land in the gate and up halves."""

    def pieces(self, ctx):
        (t,) = ctx.targets
        n = gated_half(ctx, packed=True)
        off = ctx.layout.tp_rank * n
        return [Piece(t, 0, 1, n, off, 0), Piece(t, n, 1, n, n * ctx.layout.tp_size + off, 0)]


def gated_half(ctx: Context, *, packed: bool = False) -> int:
    """Elements in one half (gate_r or up_r) of a gated `linear_fc1` shard, checked
    against the canonical targets: (gate, up), or one tensor [gate; up] when `packed`."""
    local, tp = tuple(ctx.param.local_shape), ctx.layout.tp_size
    if local[0] % 2:
        raise ctx.fail("fused gate/up shard has an odd number of rows")
    half, blocks = (local[0] // 2,) + local[1:], tp * (2 if packed else 1)
    for name in ctx.targets:
        if ctx.shape(name) != (half[0] * blocks,) + half[1:]:
            raise ctx.fail(f"canonical {name} {ctx.shape(name)} is not {blocks} x {half}")
    return _numel(half)


class ExpertTP(Mapping):
    """`inner` applied with the expert-tensor-parallel coordinates (`ParallelLayout.etp_*`)
    as its TP coordinates: MoE expert weights split over the expert-TP group."""

    def __init__(self, inner: Mapping):
        self.inner, self.n_targets, self.dropped_reason = inner, inner.n_targets, inner.dropped_reason

    @staticmethod
    def _expert_ctx(ctx: Context) -> Context:
        lay = dataclasses.replace(ctx.layout, tp_size=ctx.layout.etp_size, tp_rank=ctx.layout.etp_rank)
        return dataclasses.replace(ctx, layout=lay)

    def pieces(self, ctx):
        return self.inner.pieces(self._expert_ctx(ctx))

    def load_pieces(self, ctx):
        return self.inner.load_pieces(self._expert_ctx(ctx))


class Tied(Mapping):
    """A copy of a tensor owned by another parameter (e.g. the output layer of a model
    with tied embeddings): owns nothing, but loads like `inner`."""

    def __init__(self, inner: Mapping):
        if isinstance(inner, Residual):
            raise ConverterError("a tied copy of a residual is not supported: tie the affine tensor instead")
        self.inner, self.n_targets = inner, inner.n_targets
        self.dropped_reason = "tied copy (owned by the parameter it is tied to)"

    def pieces(self, ctx):
        self.inner.load_pieces(ctx)  # still validates shapes at start-up
        return []

    def load_pieces(self, ctx):
        return self.inner.load_pieces(ctx)


class Residual(Mapping):
    """Canonical values that are not a bit copy of one training element.

    The rule recomputes, from the *whole* TP-local parameter (after the optimizer step
    every data-parallel replica holds it, so nothing is gathered), the canonical
    values of the slices of its targets that this TP rank's shard determines. One
    rank per TP/PP position computes them (the one whose owned range holds local
    element 0, see `ResidualMap.produced_by`), diffs them against a canonical residual
    baseline and sends the changes as overwrites. A subclass gives:

    * `outputs(ctx, loading)`: per output, (target name, `AffineMap` from the output's
      flat index to canonical coordinates). loading=False: the slices this TP/PP
      position produces (each canonical element by exactly one position); loading=True:
      every slice its shard holds (replicas included).
    * `forward(local, ctx)`: one tensor per output, in its target's canonical dtype.
    * optionally `inverse(outputs, ctx)`: the local shard from the canonical slices
      (zero where no output covers), to load a checkpoint into the trainer.

    Outputs may differ in dtype: an FP8 weight and its block scales are two outputs
    (two canonical targets) of one function. Pure functions of the local parameter
    only: the producer and the loader must get the same bits from the same input.
    """

    kind = "residual"
    dropped_reason = "recomputed as a residual"

    def pieces(self, ctx):
        return []  # nothing is placed by index: see compile()

    @abstractmethod
    def outputs(self, ctx: Context, loading: bool) -> list[tuple[str, AffineMap]]:
        """(target, output map) per output."""

    @abstractmethod
    def forward(self, local: torch.Tensor, ctx: Context) -> list[torch.Tensor]:
        """Canonical values of every output from the whole local parameter."""

    def inverse(self, outputs: list[torch.Tensor], ctx: Context) -> torch.Tensor:
        """Optional (see has_inverse): without it a checkpoint cannot be loaded through the rule."""
        raise ConverterError(f"{ctx.param.name}: {type(self).__name__} has no inverse, so a checkpoint "
                             "cannot be loaded into this parameter through the converter")

    def has_inverse(self) -> bool:
        return type(self).inverse is not Residual.inverse

    def compile(self, ctx: Context, *, loading: bool = False) -> ResidualMap:
        outs = list(self.outputs(ctx, loading))
        names = []
        for i, (target, omap) in enumerate(outs):
            if target not in ctx.targets:
                raise ctx.fail(f"{self.kind} output {i} targets {target!r}, not one of the rule's targets")
            for p in omap.pieces:
                if p.canonical not in ctx.targets or ctx.specs[p.canonical][0] != ctx.specs[target][0]:
                    raise ctx.fail(f"{self.kind} output {i} places into {p.canonical!r}: not a target of "
                                   f"dtype {ctx.specs[target][0]}")
                if p.offset < 0 or p.offset + (p.rows - 1) * p.row_stride + p.cols > _numel(ctx.shape(p.canonical)):
                    raise ctx.fail(f"{self.kind} output {i} reaches past the end of {p.canonical!r}")
            names.append(ctx.specs[target][0])
        self._dry_run(ctx, [m for _, m in outs], names)
        inverse = (lambda o, _ctx=ctx: self.inverse(o, _ctx)) if self.has_inverse() else None
        return ResidualMap(ctx.param.name, tuple(ctx.param.local_shape), tuple(m for _, m in outs), tuple(names),
                           lambda local, _ctx=ctx: self.forward(local, _ctx), inverse, self.kind)

    def _dry_run(self, ctx: Context, outs: list[AffineMap], names: list[str]) -> None:
        """Check output count, sizes and dtypes at start-up on a meta tensor (no memory)."""
        probe = torch.empty(tuple(ctx.param.local_shape), dtype=ctx.param.dtype, device="meta")
        try:
            got = list(self.forward(probe, ctx))
        except NotImplementedError:
            return  # an op without a meta kernel: the producer checks sizes on real values
        except RuntimeError as e:
            if "meta" in str(e):  # data-dependent (.item(), branches on values): same, checked later
                return
            raise ctx.fail(f"{self.kind} forward fails on the local shape: {type(e).__name__}: {e}") from e
        except Exception as e:  # name the rule, whatever went wrong
            raise ctx.fail(f"{self.kind} forward fails on the local shape: {type(e).__name__}: {e}") from e
        if len(got) != len(outs):
            raise ctx.fail(f"{self.kind} forward returns {len(got)} outputs, expected {len(outs)}")
        for i, (t, m, name) in enumerate(zip(got, outs, names)):
            if t.numel() != m.numel:
                raise ctx.fail(f"{self.kind} output {i} has {t.numel()} elements, expected {m.numel}")
            if t.dtype != dtypes.from_name(name).torch_dtype:
                raise ctx.fail(f"{self.kind} output {i} is {t.dtype}, canonical is {name}")


class ResidualQKV(Residual):
    """Megatron's fused `linear_qkv` as a residual: this TP rank's q, k and v rows,
    recomputed in canonical layout (its query groups are consecutive, so each is one
    contiguous block of the canonical q / k / v). The receiver ends with the same bits
    as with `FusedQKV`; the table switch exists to exercise the residual path on a
    real tensor (and for layouts an index map cannot express)."""

    n_targets = 3
    kind = "fused QKV (residual)"

    def outputs(self, ctx, loading):
        per_group, groups_local, d, cols = qkv_geometry(ctx)
        outs = []
        for name, rows in zip(ctx.targets, (per_group * d, d, d)):
            n = groups_local * rows * cols
            # The same slices whether producing or loading: TP ranks hold disjoint groups.
            outs.append((name, AffineMap(f"{ctx.param.name} -> {name}", n,
                                         (Piece(name, 0, 1, n, ctx.layout.tp_rank * n, 0),) if n else ())))
        return outs

    def forward(self, local, ctx):
        per_group, groups_local, _, _ = qkv_geometry(ctx)
        x = local.reshape(groups_local, per_group + 2, -1)
        return [x[:, :per_group], x[:, per_group], x[:, per_group + 1]]

    def inverse(self, outputs, ctx):
        per_group, groups_local, _, _ = qkv_geometry(ctx)
        q, k, v = (t.reshape(groups_local, n, -1) for t, n in zip(outputs, (per_group, 1, 1)))
        return torch.cat([q, k, v], dim=1).reshape(tuple(ctx.param.local_shape))


class ValueTransform(Residual):
    """An element-wise value transform over an affine geometry: local element i lands
    where `inner` places it, with value `fn(local)[i]` (not a bit copy, so it travels
    as a residual). `inverse_fn` maps canonical values back, for loading.

    Example: Megatron's zero-centred norm weight (`layernorm_zero_centered_gamma`)
    stores w where the checkpoint stores 1 + w: `ValueTransform(Replicated(), add_one,
    subtract_one)`, i.e. `ZeroCenteredNorm()`."""

    def __init__(self, inner: Mapping, fn, inverse_fn=None, kind: str = "value transform"):
        if isinstance(inner, (Residual, Tied)):
            raise ConverterError(f"{kind}: the inner mapping must be affine, not {type(inner).__name__}")
        self.inner, self.fn, self.inverse_fn, self.kind = inner, fn, inverse_fn, kind
        self.n_targets = inner.n_targets

    def has_inverse(self):
        return self.inverse_fn is not None

    def outputs(self, ctx, loading):
        pieces = self.inner.load_pieces(ctx) if loading else self.inner.pieces(ctx)
        return [(ctx.targets[0], AffineMap(f"{ctx.param.name} ({self.kind})", ctx.param.numel, tuple(pieces)))]

    def forward(self, local, ctx):
        return [self.fn(local)]

    def inverse(self, outputs, ctx):
        local = self.inverse_fn(outputs[0].reshape(tuple(ctx.param.local_shape)))
        pieces = self.inner.load_pieces(ctx)
        if sum(p.size for p in pieces) < ctx.param.numel:  # e.g. vocab padding: zero, as affine loading does
            keep = torch.zeros(ctx.param.numel, dtype=torch.bool)
            for p in pieces:
                keep[p.local_start:p.local_stop] = True
            local = local.reshape(-1).masked_fill(~keep, 0).reshape(local.shape)
        return local


def add_one(w: torch.Tensor) -> torch.Tensor:
    """1 + w in w's dtype, as torch computes it: this function defines the canonical bits."""
    return w + 1


def subtract_one(x: torch.Tensor) -> torch.Tensor:
    """x - 1: exact in bf16/fp16/fp32 for x in [0.5, 2] (Sterbenz), where norm weights live."""
    return x - 1


class ZeroCenteredNorm(ValueTransform):
    """A norm weight replicated over TP and stored zero-centred in training (Megatron's
    `layernorm_zero_centered_gamma=True`: the module applies 1 + w), while the
    checkpoint stores 1 + w. TP rank 0's position produces it."""

    def __init__(self):
        super().__init__(Replicated(), add_one, subtract_one, kind="zero-centred norm (1 + w)")


def plan_param(mapping: Mapping, ctx: Context, *, loading: bool = False) -> AffineMap | ResidualMap:
    """Compile one rule's mapping for one local parameter (checks targets and dtypes).

    Affine kinds must be bit copies (local dtype == canonical dtype); residual kinds
    check their outputs' dtypes instead. Usable by converters that are not tables."""
    for t in ctx.targets:
        if t not in ctx.specs:
            raise ctx.fail(f"canonical tensor {t!r} is not in the checkpoint")
        if not isinstance(mapping, Residual) and dtypes.from_name(ctx.specs[t][0]).torch_dtype != ctx.param.dtype:
            raise ctx.fail(f"local dtype {ctx.param.dtype} differs from canonical {ctx.specs[t][0]}: not a bit copy")
    if isinstance(mapping, Residual):
        return mapping.compile(ctx, loading=loading)
    pieces = mapping.load_pieces(ctx) if loading else mapping.pieces(ctx)
    return AffineMap(ctx.param.name, ctx.param.numel, tuple(pieces), mapping.dropped_reason)


@dataclass(frozen=True)
class Rule:
    pattern: str  # Megatron name, "{L}" = global layer index
    targets: tuple[str, ...]  # canonical names, may use "{L}"
    mapping: Mapping

    def compile(self) -> re.Pattern:
        """"{L}" (global layer) and "{E}" (EP-local expert index) become named groups."""
        rx = re.escape(self.pattern).replace(r"\{L\}", r"(?P<L>\d+)").replace(r"\{E\}", r"(?P<E>\d+)")
        return re.compile("^" + rx + "$")


class Converter(ABC):
    """Places one model family's local parameters in canonical coordinates."""

    family = "base"
    # Registry names (= Hugging Face model types) this converter can build a small demo
    # model of, for `nemo-dcr demo` and `make_checkpoint` (see demo_config).
    demo_model_types: tuple[str, ...] = ()

    def __init__(self, hf_config):
        self.hf_config = hf_config

    @classmethod
    def demo_config(cls, model_type: str, *, hidden: int, layers: int, heads: int, kv_heads: int, ffn: int,
                    vocab: int, tied: bool, experts: int):
        """A small transformers config of `model_type` (one of `demo_model_types`) with these
        sizes, for the demo; `experts` is for MoE families. None: this converter has no demo."""
        return None

    def has_rule(self, name: str) -> bool:
        """Whether this converter maps the trainer parameter `name` (how
        `registry.converter_for` tells which converter a model's names call for)."""
        return False

    @abstractmethod
    def plan(
        self, params: list[LocalParam], layout: ParallelLayout, specs: dict[str, Spec], *, loading: bool = False
    ) -> dict[str, AffineMap | ResidualMap]:
        """Maps for this rank's local parameters; raises ConverterError on any gap.

        An `AffineMap` per bit-copied parameter, a `ResidualMap` per parameter a
        residual rule recomputes. loading=False: the pieces this rank owns (what it
        sends). loading=True: every piece it holds (what loading a canonical checkpoint
        into it must fill).
        """


class TableConverter(Converter):
    """A converter given as a declarative table: subclasses define `rules()` and `dims()`."""

    def __init__(self, hf_config):
        super().__init__(hf_config)
        self._rules = [(r, r.compile()) for r in self.rules()]
        for r, _ in self._rules:
            if len(r.targets) != r.mapping.n_targets:
                raise ConverterError(
                    f"rule {r.pattern!r}: {type(r.mapping).__name__} takes {r.mapping.n_targets} targets")

    @abstractmethod
    def rules(self) -> list[Rule]:
        """The family's table."""

    @abstractmethod
    def dims(self) -> Dims:
        """Head counts and sizes the fused mappings need."""

    def match(self, name: str, layout: ParallelLayout | None = None) -> tuple[Rule, tuple[str, ...]]:
        """The rule for a Megatron name and its targets with placeholders filled in.

        "{E}" in a pattern is Megatron's EP-local expert index e (`local_experts.<e>`);
        in the targets it is the global expert index `layout.ep_rank * n + e`, with
        n = `self.num_experts // layout.ep_size` experts per EP rank (a converter with
        "{E}" rules defines `num_experts`)."""
        hits = [(r, m) for r, rx in self._rules if (m := rx.match(name))]
        if not hits:
            raise ConverterError(f"Megatron parameter {name!r} is not mapped by the {self.family} converter")
        if len(hits) > 1:
            raise ConverterError(
                f"Megatron parameter {name!r} matches {len(hits)} rules: {[r.pattern for r, _ in hits]}")
        rule, m = hits[0]
        fill = {k: v for k, v in m.groupdict().items() if v is not None}
        if "E" in fill:
            experts = getattr(self, "num_experts", None)
            if layout is None or not experts:
                raise ConverterError(f"Megatron parameter {name!r}: an expert rule needs the layout and the "
                                     f"{self.family} converter's num_experts")
            if experts % layout.ep_size:
                raise ConverterError(f"{experts} experts do not split over ep={layout.ep_size}")
            per_rank = experts // layout.ep_size
            if int(fill["E"]) >= per_rank:
                raise ConverterError(f"Megatron parameter {name!r}: local expert {fill['E']} out of range, "
                                     f"{per_rank} experts per EP rank ({experts} over ep={layout.ep_size})")
            fill["E"] = str(layout.ep_rank * per_rank + int(fill["E"]))
        targets = []
        for t in rule.targets:
            for k, v in fill.items():
                t = t.replace("{" + k + "}", v)
            targets.append(t)
        return rule, tuple(targets)

    def has_rule(self, name):
        try:
            self.match(name, ParallelLayout())  # EP 1: every EP-local expert index is in range
        except ConverterError:
            return False
        return True

    def plan(self, params, layout, specs, *, loading=False):
        dims, maps = self.dims(), {}
        for p in params:
            rule, targets = self.match(p.name, layout)  # the layout fills "{E}" (global expert index)
            maps[p.name] = plan_param(rule.mapping, Context(p, layout, targets, specs, dims), loading=loading)
        return maps


def _owned_runs(maps: dict, owned: list[OwnedRange]):
    """(canonical name, run starts, run lengths, local param, residual?) of everything
    the owned ranges send: affine pieces they overlap, and whole residual outputs of
    the parameters whose residual this rank produces."""
    for r in owned:
        m = maps[r.param.name]
        if isinstance(m, ResidualMap):
            if m.produced_by(r.start, r.stop):
                for out in m.outputs:
                    for p in out.pieces:
                        s, n = p.canonical_runs(0, out.numel)
                        yield p.canonical, s, n, r.param.name, True
            continue
        for p in m.pieces:
            s, n = p.canonical_runs(r.start, r.stop)
            if s.size:
                yield p.canonical, s, n, r.param.name, False


def coverage_runs(maps: dict, owned: list[OwnedRange], owner: str):
    """Canonical runs this rank owns: name -> [(starts, lengths, owner)], for check_exact_cover.
    Residual outputs count as owned by the rank that produces them."""
    runs: dict[str, list] = {}
    for name, s, n, param, residual in _owned_runs(maps, owned):
        runs.setdefault(name, []).append((s, n, f"{owner} via {param}" + (" (residual)" if residual else "")))
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


def owned_intervals(maps: dict, owned: list[OwnedRange]) -> dict[str, list[list[int]]]:
    """The canonical elements this rank's owned ranges place: name -> [starts, stops]
    of disjoint intervals placed by affine pieces, followed, where this rank also
    produces residual values of that tensor, by [starts, stops] of those. Plain ints,
    so ranks can gather them as JSON."""
    parts: dict[str, tuple[list, list]] = {}
    for name, s, n, _, residual in _owned_runs(maps, owned):
        parts.setdefault(name, ([], []))[int(residual)].append((s, n))
    out = {}
    for name, (affine, residual) in parts.items():
        out[name] = _interval_lists(affine) + (_interval_lists(residual) if residual else [])
    return out


def _interval_lists(runs: list[tuple[np.ndarray, np.ndarray]]) -> list[list[int]]:
    if not runs:
        return [[], []]
    starts = np.concatenate([s for s, _ in runs])
    lo, hi = _union(starts, starts + np.concatenate([n for _, n in runs]))
    return [lo.tolist(), hi.tolist()]


@dataclass(frozen=True)
class CoverageReport:
    """How the canonical checkpoint's bytes reach receivers, over all trainer ranks."""

    total_bytes: int
    affine_bytes: int  # placed by some rank's owned affine pieces (each element counted once)
    residual_bytes: int = 0  # recomputed by residual rules and placed by no affine piece
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
    rank's `owned_intervals`), affine and residual. An element claimed by two ranks counts
    once (as affine if any rank places it by index), intervals past a tensor's end or into
    tensors outside `specs` count not at all: whatever no piece or residual reaches is
    reported as unplaced, never assumed covered."""
    total = affine = residual = 0
    unplaced = []
    for name, (dtype, shape) in specs.items():
        numel, itemsize = _numel(shape), dtypes.from_name(dtype).itemsize
        parts = [r[name] for r in per_rank if name in r]
        by_index = _covered([(p[0], p[1]) for p in parts], numel)
        covered = _covered([(p[0], p[1]) for p in parts] + [(p[2], p[3]) for p in parts if len(p) >= 4], numel)
        total, affine = total + numel * itemsize, affine + by_index * itemsize
        residual += (covered - by_index) * itemsize
        if covered < numel:
            unplaced.append((name, (numel - covered) * itemsize))
    return CoverageReport(total, affine, residual, tuple(unplaced))


def _covered(intervals: list, numel: int) -> int:
    """Elements of [0, numel) inside the union of (starts, stops) interval lists."""
    if not intervals:
        return 0
    starts = np.clip(np.concatenate([np.asarray(s, np.int64) for s, _ in intervals]), 0, numel)
    stops = np.clip(np.concatenate([np.asarray(e, np.int64) for _, e in intervals]), 0, numel)
    lo, hi = _union(starts, stops)
    return int((hi - lo).sum())


__all__ = [
    "Converter", "TableConverter", "Rule", "Dims", "Context", "Mapping", "Replicated", "ColumnParallel", "RowParallel",
    "VocabParallel", "FusedQKV", "PackedQKV", "GatedColumn", "PackedGateUp", "ExpertTP", "qkv_geometry",
    "gated_half", "Tied", "Residual", "ResidualQKV", "ValueTransform",
    "ZeroCenteredNorm", "add_one", "subtract_one", "plan_param", "coverage_runs", "merge_runs",
    "check_exact_cover", "owned_intervals", "coverage_report", "CoverageReport",
]
