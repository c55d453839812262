"""Operations numba has no spelling for, as plain Python functions with compiled forms.

512-bit compares and compress-stores for the 16-bit diff (`_vmask32`, `_vstep_*`), mask
compares and bit counts (`_eq_mask`, `_ge_mask`, `_popcount`, `_ctz64`, `_drop_lowest`), the
high half of a 64 x 64-bit product for the rANS coder (`_mulhi`), unaligned byte-swapped
loads and stores for bit streams (`_be64`, `_store_be64`) and a cache prefetch for the
streaming kernels (`_prefetch`, a no-op in Python). With numba each function is overloaded
by an LLVM intrinsic (bottom of this module); without it the Python function runs, so the
fallback computes the same thing.
"""

from __future__ import annotations

import numpy as np

from .common import _numba


_LANES = 32  # 16-bit elements per 512-bit vector


def _value_py(x, y, kind):
    if kind == "old":
        return y
    if kind == "xor":
        return x ^ y
    return x - y  # numpy arrays wrap around


def _vmask32(a, b, i):
    """Bit k set where a[i + k] != b[i + k], k < 32."""
    return int(np.packbits(a[i:i + _LANES] != b[i:i + _LANES], bitorder="little").view("<u4")[0])


def _eq_mask(a, i, s):
    """Bit k set where a[i + k] == s, over the 512 bits from a[i]: 64 bytes of a uint8 array,
    32 elements of a 16-bit one (compiled: one vector compare)."""
    lanes = 64 // a.itemsize
    return int(np.packbits(a[i:i + lanes] == s, bitorder="little").view(f"<u{lanes // 8}")[0])


def _ge_mask(a, i, s):
    """`_eq_mask` for a[i + k] >= s."""
    lanes = 64 // a.itemsize
    return int(np.packbits(a[i:i + lanes] >= s, bitorder="little").view(f"<u{lanes // 8}")[0])


def _popcount(x):
    """Set bits of a uint64 (compiled: one `popcnt`)."""
    return int(x).bit_count()


def _store_be64(a, at, x):
    """a[at:at + 8] = the eight bytes of the uint64 x, most significant first (compiled: a
    byte swap and one unaligned store). Callers keep at + 8 <= a.size."""
    a[at:at + 8] = np.frombuffer(int(x).to_bytes(8, "big"), np.uint8)


def _be64(b, at):
    """Bytes at..at+7 of the uint8 array b as a big-endian uint64 (compiled: one unaligned
    load and a byte swap where b is contiguous). Callers keep at + 8 <= b.size."""
    w = np.uint64(0)
    for k in range(8):
        w = (w << np.uint64(8)) | np.uint64(b[at + k])
    return w


def _prefetch(a, i):
    """Hint the cache line holding a[i] into the cache (compiled: one `prefetcht0`; no-op in
    Python). Never faults, so it needs no bounds, but callers keep i inside a."""


def _vstep_py(a, b, i, base, pos, new, v, n, kind):
    x = a[i:i + _LANES]
    y = b[i:i + _LANES]
    hit = np.flatnonzero(x != y)
    m = n + hit.size
    pos[n:m] = hit + (base + i)
    new[n:m] = x[hit]
    if kind:
        v[n:m] = _value_py(x[hit], y[hit], kind)
    return m


def _vstep_old(a, b, i, mask, base, pos, new, v, n):
    return _vstep_py(a, b, i, base, pos, new, v, n, "old")


def _vstep_xor(a, b, i, mask, base, pos, new, v, n):
    return _vstep_py(a, b, i, base, pos, new, v, n, "xor")


def _vstep_add(a, b, i, mask, base, pos, new, v, n):
    return _vstep_py(a, b, i, base, pos, new, v, n, "add")


def _vstep_none(a, b, i, mask, base, pos, new, v, n):
    return _vstep_py(a, b, i, base, pos, new, v, n, "")


def _ctz64(m):
    """Trailing zero bits of a 64-bit mask, 64 for 0 (compiled: one `tzcnt`)."""
    m = int(m)
    return (m & -m).bit_length() - 1 if m else 64


def _drop_lowest(m):
    """The 64-bit mask m without its lowest set bit; 0 stays 0 (compiled: one `blsr`)."""
    m = int(m)
    return m & (m - 1) if m else 0


def _mulhi(a, b):
    """High 64 bits of the 128-bit product of two uint64 (compiled: one `mul`)."""
    return np.uint64((int(a) * int(b)) >> 64)


# The compiled forms of _vmask32, _vstep_* (diff16), _ctz64 (diff16_bitscan), _mulhi
# (rANS) and _be64 / _store_be64 (bit streams): LLVM vector, 128-bit integer and unaligned
# byte-swapped operations that numba has no spelling for.
# Without numba the plain Python functions above are called instead (same results).

if _numba is not None:
    from llvmlite import ir as _ir
    from numba.core import cgutils as _cg
    from numba.core import types as _nt
    from numba.extending import intrinsic as _intrinsic
    from numba.extending import overload as _overload

    def _is16(t):
        return isinstance(t, _nt.Array) and isinstance(t.dtype, _nt.Integer) and t.dtype.bitwidth == 16

    def _data(context, builder, ty, val, index):
        """Pointer to element `index` of a C-contiguous array."""
        return builder.gep(context.make_array(ty)(context, builder, val).data, [index])

    @_intrinsic
    def _vmask32_intr(typingctx, a, b, i):
        if not (_is16(a) and _is16(b)):
            return None
        sig = _nt.uint32(a, b, _nt.int64)

        def codegen(context, builder, signature, args):
            vt = _ir.VectorType(_ir.IntType(16), _LANES)
            ta, tb = signature.args[0], signature.args[1]
            va = builder.load(builder.bitcast(_data(context, builder, ta, args[0], args[2]), vt.as_pointer()), align=2)
            vb = builder.load(builder.bitcast(_data(context, builder, tb, args[1], args[2]), vt.as_pointer()), align=2)
            return builder.bitcast(builder.icmp_unsigned("!=", va, vb), _ir.IntType(_LANES))

        return sig, codegen

    @_intrinsic
    def _prefetch_intr(typingctx, a, i):
        if not isinstance(a, _nt.Array):
            return None
        sig = _nt.void(a, _nt.int64)

        def codegen(context, builder, signature, args):
            ptr = builder.bitcast(_data(context, builder, signature.args[0], args[0], args[1]),
                                  _ir.IntType(8).as_pointer())
            i32 = _ir.IntType(32)
            fn = _cg.get_or_insert_function(builder.module, _ir.FunctionType(_ir.VoidType(), [ptr.type, i32, i32, i32]),
                                            "llvm.prefetch.p0")
            # read, locality 3 (all cache levels: prefetcht0), data cache
            builder.call(fn, [ptr, _ir.Constant(i32, 0), _ir.Constant(i32, 3), _ir.Constant(i32, 1)])
            return context.get_dummy_value()

        return sig, codegen

    def _lanes_mask(builder, context, ty, a, i, s, pred):
        """a[i + k] `pred` s (unsigned) for the 512 bits from a[i], as an i64 of lane bits."""
        width = ty.dtype.bitwidth
        lanes = 512 // width
        vt = _ir.VectorType(_ir.IntType(width), lanes)
        v = builder.load(builder.bitcast(_data(context, builder, ty, a, i), vt.as_pointer()), align=1)
        splat = builder.insert_element(_ir.Constant(vt, _ir.Undefined), builder.trunc(s, _ir.IntType(width)),
                                       _ir.Constant(_ir.IntType(32), 0))
        splat = builder.shuffle_vector(splat, _ir.Constant(vt, _ir.Undefined),
                                       _ir.Constant(_ir.VectorType(_ir.IntType(32), lanes), [0] * lanes))
        bits = builder.bitcast(builder.icmp_unsigned(pred, v, splat), _ir.IntType(lanes))
        return bits if lanes == 64 else builder.zext(bits, _ir.IntType(64))

    def _make_lanes_mask(pred):
        @_intrinsic
        def mask(typingctx, a, i, s):
            if not (isinstance(a, _nt.Array) and isinstance(a.dtype, _nt.Integer) and a.dtype.bitwidth in (8, 16)):
                return None
            sig = _nt.uint64(a, _nt.int64, _nt.int64)

            def codegen(context, builder, signature, args):
                return _lanes_mask(builder, context, signature.args[0], args[0], args[1], args[2], pred)

            return sig, codegen

        return mask

    _eq_mask_intr, _ge_mask_intr = _make_lanes_mask("=="), _make_lanes_mask(">=")

    @_intrinsic
    def _popcount_intr(typingctx, x):
        sig = _nt.int64(_nt.uint64)

        def codegen(context, builder, signature, args):
            i64 = _ir.IntType(64)
            ctpop = _cg.get_or_insert_function(builder.module, _ir.FunctionType(i64, [i64]), "llvm.ctpop.i64")
            return builder.call(ctpop, [args[0]])

        return sig, codegen

    @_intrinsic
    def _store_be64_intr(typingctx, a, at, x):
        if not (isinstance(a, _nt.Array) and a.dtype == _nt.uint8):
            return None
        sig = _nt.void(a, _nt.int64, _nt.uint64)

        def codegen(context, builder, signature, args):
            i64 = _ir.IntType(64)
            ptr = builder.bitcast(_data(context, builder, signature.args[0], args[0], args[1]), i64.as_pointer())
            bswap = _cg.get_or_insert_function(builder.module, _ir.FunctionType(i64, [i64]), "llvm.bswap.i64")
            builder.store(builder.call(bswap, [args[2]]), ptr, align=1)
            return context.get_dummy_value()

        return sig, codegen

    @_intrinsic
    def _load_be64_intr(typingctx, a, at):
        if not (isinstance(a, _nt.Array) and a.dtype == _nt.uint8 and a.layout == "C"):
            return None
        sig = _nt.uint64(a, _nt.int64)

        def codegen(context, builder, signature, args):
            i64 = _ir.IntType(64)
            ptr = builder.bitcast(_data(context, builder, signature.args[0], args[0], args[1]), i64.as_pointer())
            bswap = _cg.get_or_insert_function(builder.module, _ir.FunctionType(i64, [i64]), "llvm.bswap.i64")
            return builder.call(bswap, [builder.load(ptr, align=1)])

        return sig, codegen

    def _make_vstep(kind):
        @_intrinsic
        def vstep(typingctx, a, b, i, mask, base, pos, new, v, n):
            if (not all(_is16(t) for t in (a, b, new, v)) or not isinstance(pos, _nt.Array)
                    or not isinstance(pos.dtype, _nt.Integer) or pos.dtype.bitwidth not in (32, 64)):
                return None
            sig = _nt.int64(a, b, _nt.int64, _nt.uint32, _nt.int64, pos, new, v, _nt.int64)

            def codegen(context, builder, signature, args):
                ta, tb, _, _, _, tpos, tnew, tv, _ = signature.args
                a_, b_, i_, mask_, base_, pos_, new_, v_, n_ = args
                i16, i64 = _ir.IntType(16), _ir.IntType(64)
                ipos = _ir.IntType(tpos.dtype.bitwidth)  # int32 positions: half the compress-stores
                v16, vpos = _ir.VectorType(i16, _LANES), _ir.VectorType(ipos, _LANES)
                vmask = _ir.VectorType(_ir.IntType(1), _LANES)
                mod = builder.module
                m = builder.bitcast(mask_, vmask)

                def compress_store(vec, ptr, mask=None, lanes=_LANES):
                    # Register-form compress + one full-width unaligned store: the memory
                    # form (llvm.masked.compressstore) is microcoded and several times slower.
                    # The lanes past the compressed ones land in slots the next step (or
                    # the caller's slack: the buffers have a block of room) overwrites.
                    vt = vec.type
                    mt = _ir.VectorType(_ir.IntType(1), lanes)
                    fnty = _ir.FunctionType(vt, [vt, vt, mt])
                    name = f"llvm.x86.avx512.mask.compress.v{lanes}i{vt.element.width}"
                    fn = _cg.get_or_insert_function(mod, fnty, name)
                    packed = builder.call(fn, [vec, _ir.Constant(vt, None), m if mask is None else mask])
                    builder.store(packed, builder.bitcast(ptr, vt.as_pointer()), align=1)

                va = builder.load(builder.bitcast(_data(context, builder, ta, a_, i_), v16.as_pointer()), align=2)
                vb = builder.load(builder.bitcast(_data(context, builder, tb, b_, i_), v16.as_pointer()), align=2)
                compress_store(va, _data(context, builder, tnew, new_, n_))
                if kind:
                    val = {"old": lambda: vb, "xor": lambda: builder.xor(va, vb),
                           "add": lambda: builder.sub(va, vb)}[kind]()
                    compress_store(val, _data(context, builder, tv, v_, n_))
                start = builder.add(base_, i_)
                if ipos.width < 64:
                    start = builder.trunc(start, ipos)
                undef = _ir.Constant(vpos, _ir.Undefined)
                splat = builder.insert_element(undef, start, _ir.Constant(_ir.IntType(32), 0))
                splat = builder.shuffle_vector(splat, _ir.Constant(vpos, _ir.Undefined),
                                               _ir.Constant(_ir.VectorType(_ir.IntType(32), _LANES), [0] * _LANES))
                iota = _ir.Constant(vpos, [_ir.Constant(ipos, k) for k in range(_LANES)])
                allpos = builder.add(splat, iota)
                # 32 positions are two 16-lane vectors of int32 (four of int64): compress
                # each quarter or half with its slice of the mask, one after the other.
                per = 512 // ipos.width
                lanes_i = _ir.IntType(_LANES)
                at = n_
                for q in range(_LANES // per):
                    part = builder.shuffle_vector(allpos, _ir.Constant(vpos, _ir.Undefined), _ir.Constant(
                        _ir.VectorType(_ir.IntType(32), per), list(range(q * per, (q + 1) * per))))
                    bits = builder.trunc(builder.lshr(mask_, _ir.Constant(lanes_i, q * per)), _ir.IntType(per))
                    compress_store(part, _data(context, builder, tpos, pos_, at),
                                   builder.bitcast(bits, _ir.VectorType(_ir.IntType(1), per)), per)
                    ctq = _cg.get_or_insert_function(mod, _ir.FunctionType(_ir.IntType(per), [_ir.IntType(per)]),
                                                     f"llvm.ctpop.i{per}")
                    at = builder.add(at, builder.zext(builder.call(ctq, [bits]), i64))
                ctpop = _cg.get_or_insert_function(mod, _ir.FunctionType(_ir.IntType(_LANES), [_ir.IntType(_LANES)]),
                                                   f"llvm.ctpop.i{_LANES}")
                return builder.add(n_, builder.zext(builder.call(ctpop, [mask_]), i64))

            return sig, codegen

        return vstep

    @_overload(_vmask32, jit_options={"nogil": True})
    def _ol_vmask32(a, b, i):
        return lambda a, b, i: _vmask32_intr(a, b, i)

    @_overload(_eq_mask, jit_options={"nogil": True})
    def _ol_eq_mask(a, i, s):
        return lambda a, i, s: _eq_mask_intr(a, i, s)

    @_overload(_ge_mask, jit_options={"nogil": True})
    def _ol_ge_mask(a, i, s):
        return lambda a, i, s: _ge_mask_intr(a, i, s)

    @_overload(_popcount, jit_options={"nogil": True})
    def _ol_popcount(x):
        return lambda x: _popcount_intr(np.uint64(x))

    @_overload(_store_be64, jit_options={"nogil": True})
    def _ol_store_be64(a, at, x):
        return lambda a, at, x: _store_be64_intr(a, at, x)

    @_overload(_be64, jit_options={"nogil": True})
    def _ol_be64(b, at):
        if isinstance(b, _nt.Array) and b.layout == "C":
            return lambda b, at: _load_be64_intr(b, np.int64(at))
        return _be64  # strided: byte by byte

    @_overload(_prefetch, jit_options={"nogil": True})
    def _ol_prefetch(a, i):
        return lambda a, i: _prefetch_intr(a, i)

    def _register_vstep(pyfunc, kind):
        intr = _make_vstep(kind)

        @_overload(pyfunc, jit_options={"nogil": True})
        def _ol(a, b, i, mask, base, pos, new, v, n):
            return lambda a, b, i, mask, base, pos, new, v, n: intr(a, b, i, mask, base, pos, new, v, n)

    for _f, _kind in ((_vstep_old, "old"), (_vstep_xor, "xor"), (_vstep_add, "add"), (_vstep_none, "")):
        _register_vstep(_f, _kind)

    @_intrinsic
    def _mulhi_intr(typingctx, a, b):
        sig = _nt.uint64(_nt.uint64, _nt.uint64)

        def codegen(context, builder, signature, args):
            i128 = _ir.IntType(128)
            prod = builder.mul(builder.zext(args[0], i128), builder.zext(args[1], i128))
            return builder.trunc(builder.lshr(prod, _ir.Constant(i128, 64)), _ir.IntType(64))

        return sig, codegen

    from numba.cpython.unsafe.numbers import trailing_zeros as _trailing_zeros

    @_overload(_ctz64, jit_options={"nogil": True})
    def _ol_ctz64(m):
        return lambda m: _trailing_zeros(m)

    @_overload(_drop_lowest, jit_options={"nogil": True})
    def _ol_drop_lowest(m):
        return lambda m: m & (m - np.uint64(1))

    @_overload(_mulhi, jit_options={"nogil": True})
    def _ol_mulhi(a, b):
        return lambda a, b: _mulhi_intr(a, b)
