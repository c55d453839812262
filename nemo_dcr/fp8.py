"""FP8 rollout checkpoints: BF16 training weights served as fine-grained FP8.

The format is the public "fine-grained FP8" one (DeepSeek-V3, Qwen3-FP8, transformers'
`FineGrainedFP8Config`, config `quantization_config = {"quant_method": "fp8", "fmt":
"e4m3", "weight_block_size": [128, 128]}`): a linear weight `<name>` of shape [out, in]
is stored as `torch.float8_e4m3fn`, next to `<name>_scale_inv` (`...weight_scale_inv`)
of shape [ceil(out/128), ceil(in/128)], and dequantises as `fp8 * scale_inv` per block.
Linear weights inside decoder layers are FP8; embeddings, norms, biases and lm_head
stay BF16 (transformers skips the output embedding by default, `modules_to_not_convert`).

Quantisation (`quantize_blocks`) is transformers' `Fp8Quantize` arithmetic, bit for bit
where that is finite; edge blocks smaller than the block size are quantised over the
elements they have. `FP8Block(inner)` is the residual mapping kind that produces, per
TP position, the FP8 slice and the scale slice of every canonical weight its shard
determines; a shard that does not fall on block boundaries is refused at plan time.
"""

from __future__ import annotations

import json
import os
import re
import shutil
from pathlib import Path

import torch
import torch.nn.functional as F

from nemo_dcr import dtypes
from nemo_dcr.checkpoint import CheckpointReader
from nemo_dcr.converter import Context, Mapping, Residual, Tied
from nemo_dcr.errors import ConverterError
from nemo_dcr.placement import AffineMap, Piece

FP8_DTYPE = torch.float8_e4m3fn
FP8_MAX = float(torch.finfo(FP8_DTYPE).max)  # 448
_F32_MAX = torch.finfo(torch.float32).max
SCALE_DTYPES = ("F32", "BF16")  # F32: DeepSeek-V3 / transformers' default; BF16: Qwen3-FP8
# Linear weights of the Llama / Qwen decoder layers (what transformers' FP8 quantizer converts
# in these models; lm_head is in its default modules_to_not_convert).
LINEAR_WEIGHTS = re.compile(r"^model\.layers\.\d+\.(self_attn\.[qkvo]_proj|mlp\.(gate|up|down)_proj)\.weight$")


def _block_shape(block) -> tuple[int, int]:
    bm, bn = (block, block) if isinstance(block, int) else tuple(block)
    if int(bm) != bm or int(bn) != bn or bm <= 0 or bn <= 0:
        raise ValueError(f"FP8 block size must be positive integers, got {block!r}")
    return int(bm), int(bn)


def scale_shape(shape: tuple[int, int], block=128) -> tuple[int, int]:
    """Shape of the `_scale_inv` tensor of a weight: one scale per (partial) block."""
    bm, bn = _block_shape(block)
    return -(-shape[0] // bm), -(-shape[1] // bn)


def quantize_blocks(w: torch.Tensor, block=128, scale_dtype: torch.dtype = torch.float32):
    """(fp8 weight, scale_inv) of a 2-D weight, per `block` (int or (rows, cols)).

    Per block, in float32, each operation rounded to nearest-even: amax = max |w|;
    scale = 448 * (1 / amax) (1 for an all-zero block, capped at FLT_MAX so a block
    with amax < ~1.3e-36 stays finite); q = e4m3fn(clamp(w * scale, -448, 448)), the
    cast rounding to nearest, ties to even; scale_inv = 1 / scale. That is
    transformers' `Fp8Quantize` bit for bit (wherever its result is finite; it writes
    `448 / amax`, which torch evaluates as 448 * (1 / amax), so a scale can be one ulp
    off the correctly rounded quotient), and an all-zero block stores scale_inv = 1.
    With a narrower `scale_dtype` (BF16) scale_inv is rounded to it first and the
    weights are multiplied by the float32 reciprocal of the stored value, so that
    dequantising multiplies by exactly what was divided out (as transformers does
    for its ue8m0 scales). Edge blocks (rows or columns not a multiple of the block)
    take their amax over the elements they hold. Non-finite weights have no e4m3fn
    value: ValueError naming the block.
    """
    if w.dim() != 2:
        raise ValueError(f"FP8 block quantisation needs a 2-D weight, got shape {tuple(w.shape)}")
    if scale_dtype not in (torch.float32, torch.bfloat16):
        raise ValueError(f"scale_inv dtype must be float32 or bfloat16, got {scale_dtype}")
    bm, bn = _block_shape(block)
    rows, cols = w.shape
    sr, sc = scale_shape((rows, cols), (bm, bn))
    x = w.to(torch.float32)
    if (sr * bm, sc * bn) != (rows, cols):  # zero padding: |0| never raises a block's amax
        x = F.pad(x, (0, sc * bn - cols, 0, sr * bm - rows))
    x = x.reshape(sr, bm, sc, bn)
    amax = x.abs().amax(dim=(1, 3))
    if amax.device.type != "meta" and not bool(torch.isfinite(amax).all()):
        r, c = (int(i) for i in torch.nonzero(~torch.isfinite(amax))[0])
        raise ValueError(f"block ({r}, {c}) (rows {r * bm}.., columns {c * bn}..) holds a non-finite weight: "
                         "FP8 e4m3fn cannot represent it")
    nonzero = amax > 0
    # 448 * (1 / amax), two roundings: what transformers' `448 / amax` computes (torch divides a
    # scalar by a tensor through its reciprocal), spelled out so it cannot drift with torch.
    scale = torch.where(nonzero, torch.where(nonzero, amax, 1.0).reciprocal() * FP8_MAX, 1.0).clamp(max=_F32_MAX)
    scale_inv = scale.reciprocal().to(scale_dtype)
    if scale_dtype != torch.float32:
        scale = scale_inv.to(torch.float32).reciprocal().clamp(max=_F32_MAX)
    q = (x * scale[:, None, :, None]).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)
    return q.reshape(sr * bm, sc * bn)[:rows, :cols].contiguous(), scale_inv


def dequantize_blocks(q: torch.Tensor, scale_inv: torch.Tensor, block=128) -> torch.Tensor:
    """float32 `q * scale_inv` per block (for inspection; not an inverse of quantize_blocks)."""
    bm, bn = _block_shape(block)
    s = scale_inv.to(torch.float32).repeat_interleave(bm, 0).repeat_interleave(bn, 1)
    return q.to(torch.float32) * s[: q.shape[0], : q.shape[1]]


def scale_name(weight_name: str) -> str:
    """`...weight` -> `...weight_scale_inv` (the public naming)."""
    return weight_name + "_scale_inv"


def fp8_targets(*weights: str) -> tuple[str, ...]:
    """An FP8Block rule's targets: the weights, then their scales in the same order."""
    return tuple(weights) + tuple(scale_name(w) for w in weights)


class _Region:
    """The rectangle [r0, r1) x [c0, c1) of one canonical weight that a TP shard holds,
    and the local pieces (local_start, rows, cols, rect origin) that tile it."""

    def __init__(self, target: str, scale: str, shape: tuple[int, int], parts: list[tuple[Piece, int, int, int, int]]):
        self.target, self.scale, self.shape = target, scale, shape
        self.parts = parts  # (piece, rect r0, rect c0, rect rows, rect cols)
        self.r0 = min(p[1] for p in parts)
        self.c0 = min(p[2] for p in parts)
        self.r1 = max(p[1] + p[3] for p in parts)
        self.c1 = max(p[2] + p[4] for p in parts)

    @property
    def rows(self) -> int:
        return self.r1 - self.r0

    @property
    def cols(self) -> int:
        return self.c1 - self.c0

    def assemble(self, flat: torch.Tensor) -> torch.Tensor:
        """The region's values from the flat local parameter (a view when one piece tiles it)."""
        if len(self.parts) == 1:
            p, _, _, rows, cols = self.parts[0]
            return flat[p.local_start:p.local_stop].view(rows, cols)
        out = torch.empty((self.rows, self.cols), dtype=flat.dtype, device=flat.device)
        for p, r, c, rows, cols in self.parts:
            out[r - self.r0:r - self.r0 + rows, c - self.c0:c - self.c0 + cols] = \
                flat[p.local_start:p.local_stop].view(rows, cols)
        return out


def _block_piece(name: str, r0: int, c0: int, rows: int, cols: int, width: int) -> tuple[Piece, ...]:
    """Output flat index (row-major rows x cols) -> canonical [r0.., c0..] of a `width`-wide tensor."""
    if rows * cols == 0:
        return ()
    if cols == width:  # whole rows: one contiguous run
        return (Piece(name, 0, 1, rows * cols, r0 * width, 0),)
    return (Piece(name, 0, rows, cols, r0 * width + c0, width),)


class FP8Block(Residual):
    """Fine-grained FP8 of the canonical weights an affine `inner` geometry places.

    `inner` is the affine kind the BF16 weight would use (`ColumnParallel()`,
    `RowParallel()`, `GatedColumn()`, `FusedQKV()`, `Replicated()` ...). The rule's
    targets are inner's canonical weights followed by their `_scale_inv` tensors in
    the same order (`fp8_targets(...)`). For every weight, the rectangle of it that
    this TP shard determines is quantised from the whole TP-local parameter, giving
    two outputs: the FP8 slice and the scale_inv slice (outputs in target order:
    weight 0, scale 0, weight 1, scale 1, ...).

    A block's scale depends on every element of the block, so each block must lie
    inside one TP shard: a shard whose rows or columns start, or end before the
    tensor does, off a block boundary is refused at plan time (ConverterError naming
    the parameter and the sizes). There is no inverse: FP8 loses bits, so a trainer
    cannot be loaded from the FP8 checkpoint through this rule (load it from BF16).
    """

    def __init__(self, inner: Mapping, block=128):
        if isinstance(inner, (Residual, Tied)):
            raise ConverterError(f"FP8Block: the inner mapping must be affine, not {type(inner).__name__}")
        self.inner, self.block = inner, _block_shape(block)
        self.n_targets = 2 * inner.n_targets
        bm, bn = self.block
        self.kind = f"FP8 {bm}x{bn} blocks over {type(inner).__name__}"

    def _regions(self, ctx: Context, loading: bool) -> list[_Region | None]:
        n = self.inner.n_targets
        weights, scales = ctx.targets[:n], ctx.targets[n:]
        bm, bn = self.block
        for w, s in zip(weights, scales):
            wdt, shape = ctx.specs[w]
            if wdt != "F8_E4M3":
                raise ctx.fail(f"canonical {w!r} is {wdt}, not F8_E4M3: FP8Block needs an FP8 checkpoint")
            if len(shape) != 2:
                raise ctx.fail(f"canonical {w!r} has shape {tuple(shape)}: FP8 blocks need a 2-D weight")
            sdt, sshape = ctx.specs[s]
            if sdt not in SCALE_DTYPES:
                raise ctx.fail(f"canonical {s!r} is {sdt}: scale_inv must be one of {SCALE_DTYPES}")
            if tuple(sshape) != scale_shape(shape, self.block):
                raise ctx.fail(f"canonical {s!r} has shape {tuple(sshape)}, {bm}x{bn} blocks of {w!r} "
                               f"{tuple(shape)} need {scale_shape(shape, self.block)}")
        inner_ctx = Context(ctx.param, ctx.layout, weights, ctx.specs, ctx.dims)
        pieces = self.inner.load_pieces(inner_ctx) if loading else self.inner.pieces(inner_ctx)
        parts: dict[str, list] = {w: [] for w in weights}
        for p in pieces:
            parts[p.canonical].append((p, *self._rect(ctx, p)))
        regions = []
        for w, s in zip(weights, scales):
            if not parts[w]:
                regions.append(None)  # this position holds nothing of w (a replica, say)
                continue
            region = _Region(w, s, tuple(ctx.shape(w)), parts[w])
            self._check_tiling(ctx, region)
            regions.append(region)
        return regions

    @staticmethod
    def _rect(ctx: Context, p: Piece) -> tuple[int, int, int, int]:
        """(r0, c0, rows, cols) of the canonical rectangle a piece covers, or fail."""
        width = ctx.shape(p.canonical)[1]
        if p.offset % width == 0 and p.cols % width == 0 and (p.rows == 1 or p.row_stride == p.cols):
            return p.offset // width, 0, p.size // width, width  # whole canonical rows
        c0 = p.offset % width
        if (p.rows == 1 or p.row_stride == width) and c0 + p.cols <= width:
            return p.offset // width, c0, p.rows, p.cols
        raise ctx.fail(f"the shard's piece {p} is not a rectangle of canonical {p.canonical!r}")

    def _check_tiling(self, ctx: Context, g: _Region) -> None:
        area = sum(rows * cols for _, _, _, rows, cols in g.parts)
        rects = sorted((r, c, r + rows, c + cols) for _, r, c, rows, cols in g.parts)
        overlap = any(a[0] < b[2] and b[0] < a[2] and a[1] < b[3] and b[1] < a[3]
                      for i, a in enumerate(rects) for b in rects[i + 1:])
        if overlap or area != g.rows * g.cols:
            raise ctx.fail(f"the shard's pieces of {g.target!r} do not tile one rectangle")
        bm, bn = self.block
        (height, width) = g.shape
        rows_ok = g.r0 % bm == 0 and (g.r1 % bm == 0 or g.r1 == height)
        cols_ok = g.c0 % bn == 0 and (g.c1 % bn == 0 or g.c1 == width)
        if not (rows_ok and cols_ok):
            raise ctx.fail(
                f"this TP shard holds rows [{g.r0}, {g.r1}) x columns [{g.c0}, {g.c1}) of canonical "
                f"{g.target!r} {g.shape}, which do not fall on {bm}x{bn} FP8 block boundaries (a block's "
                f"scale would depend on two TP ranks); choose a TP size that splits "
                f"{'rows' if not rows_ok else 'columns'} into multiples of {bm if not rows_ok else bn}")

    def outputs(self, ctx, loading):
        bm, bn = self.block
        n = self.inner.n_targets
        outs = []
        for w, s, g in zip(ctx.targets[:n], ctx.targets[n:], self._regions(ctx, loading)):
            if g is None:
                outs += [(w, AffineMap(f"{ctx.param.name} -> {w}", 0, ())),
                         (s, AffineMap(f"{ctx.param.name} -> {s}", 0, ()))]
                continue
            sr0, sc0 = g.r0 // bm, g.c0 // bn
            srows, scols = -(-g.r1 // bm) - sr0, -(-g.c1 // bn) - sc0
            swidth = ctx.shape(s)[1]
            outs.append((w, AffineMap(f"{ctx.param.name} -> {w}", g.rows * g.cols,
                                      _block_piece(w, g.r0, g.c0, g.rows, g.cols, g.shape[1]))))
            outs.append((s, AffineMap(f"{ctx.param.name} -> {s}", srows * scols,
                                      _block_piece(s, sr0, sc0, srows, scols, swidth))))
        return outs

    def forward(self, local, ctx):
        flat = local.reshape(-1)
        out = []
        n = self.inner.n_targets
        for w, s, g in zip(ctx.targets[:n], ctx.targets[n:], self._regions(ctx, False)):
            if g is None:
                out += [torch.empty(0, dtype=FP8_DTYPE, device=local.device),
                        torch.empty(0, dtype=dtypes.from_name(ctx.specs[s][0]).torch_dtype, device=local.device)]
                continue
            try:
                q, scale_inv = quantize_blocks(g.assemble(flat), self.block,
                                               dtypes.from_name(ctx.specs[s][0]).torch_dtype)
            except ValueError as e:
                raise ValueError(f"{ctx.param.name} -> {w} (rows {g.r0}.., columns {g.c0}..): {e}") from None
            out += [q, scale_inv]
        return out


def quantize_state_dict(state: dict[str, torch.Tensor], *, block=128, scale_dtype: torch.dtype = torch.float32,
                        select=LINEAR_WEIGHTS.match) -> dict[str, torch.Tensor]:
    """A canonical BF16 state dict as a fine-grained FP8 one: every tensor `select`
    accepts becomes its FP8 weight plus `<name>_scale_inv`; the rest is kept as is."""
    out = {}
    for name, t in state.items():
        if select(name):
            try:
                out[name], out[scale_name(name)] = quantize_blocks(t, block, scale_dtype)
            except ValueError as e:
                raise ValueError(f"{name}: {e}") from None
        else:
            out[name] = t
    return out


def quantization_config(block=128) -> dict:
    """The `quantization_config` entry of config.json (transformers' FineGrainedFP8Config)."""
    return {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
            "weight_block_size": list(_block_shape(block))}


def write_fp8_checkpoint(src: str | os.PathLike, dst: str | os.PathLike, *, block=128,
                         scale_dtype: torch.dtype = torch.float32, select=LINEAR_WEIGHTS.match) -> Path:
    """Write the fine-grained FP8 version of a BF16 safetensors checkpoint folder: one
    safetensors file, config.json with `quantization_config`, other json files copied."""
    from safetensors.torch import save_file

    src, dst = Path(src), Path(dst)
    dst.mkdir(parents=True, exist_ok=True)
    state = CheckpointReader(src).state_dict()
    fp8 = quantize_state_dict(state, block=block, scale_dtype=scale_dtype, select=select)
    save_file({k: v.contiguous() for k, v in fp8.items()}, dst / "model.safetensors", metadata={"format": "pt"})
    for extra in src.glob("*.json"):
        if extra.name == "config.json":
            config = json.loads(extra.read_text())
            config["quantization_config"] = quantization_config(block)
            (dst / "config.json").write_text(json.dumps(config, indent=2))
        elif not extra.name.endswith(".safetensors.index.json"):
            shutil.copy(extra, dst / extra.name)
    return dst


__all__ = [
    "FP8_DTYPE",
    "FP8_MAX",
    "LINEAR_WEIGHTS",
    "FP8Block",
    "dequantize_blocks",
    "fp8_targets",
    "quantization_config",
    "quantize_blocks",
    "quantize_state_dict",
    "scale_name",
    "scale_shape",
    "write_fp8_checkpoint",
]
