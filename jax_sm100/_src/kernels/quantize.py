"""One pass that quantizes a matrix along both of its dims: DeepSeek-V3's recipes (fp8 data,
float32 scales per 1 x 128 block for activations, per 128 x 128 tile for weights) for a
training step's two products of one operand.

A training step contracts each activation along its k in the forward product and along its
rows in the weight's gradient, each weight along its k forward and along its n for the input's
gradient, and the cotangent along its n and along its rows: each operand is quantized twice,
once per orientation. As XLA fusions that is two reads of the operand and a reduction pass
each; this kernel reads each 128 x 128 tile once and writes

    q   [L, R, C]        fp8, blocks of 128 along C   (`scaled.quantize(x)`)
    s   [L, C / 128, R]  float32, their scales, R contiguous
    qt  [L, C, R]        fp8, blocks of 128 along R, transposed   (`scaled.quantize_transposed(x)`)
    st  [L, R / 128, C]  float32, their scales, C contiguous

or, per tile (fp8_block128x128), s [L, R / 128, C / 128] and st [L, C / 128, R / 128]: one
scale a tile, the same for both orientations. It computes `scaled.quantize`'s arithmetic
operation for operation (amax; amax times 1 / top rounded to float32, floored at float32's
least normal number, 1 for a zero block and NaN for a block holding a NaN or an infinity; x /
scale, clipped to the format's range and rounded to nearest). The scales are XLA's bit for
bit. The data is the correctly rounded quotient's (computed as a corrected reciprocal's
product, `_quantized`); XLA's division is not correctly rounded (div.full on GPUs, a
reciprocal's product on CPU), so XLA's data can be one fp8 unit away where a quotient lies at a
rounding boundary (about one element in 10^5 to 10^6 on the H100). Per 1 x 128 block the
scales are written with the rows contiguous because the sm_90a block-scaled kernel reads them
so (scaled_gpu.py's transposed scales): the caller's swapaxes and that lowering's cancel in
XLA.

Background / Algorithm. A CTA of 256 threads owns one 128 x 128 tile of one batch. Along C,
16 threads share a row, each loading 8 contiguous elements (16 bytes for 16-bit input) over 8
passes of 16 rows (the 8 loads issued before any is used); a row's largest magnitude is
reduced over its 16 threads by butterfly shuffles, its data stored as 8 fp8 bytes a thread.
The tile also goes to shared memory (rows padded by 16 bytes), from which the transposed pass
reads columns: 16 threads share a column, thread j taking rows j, j + 16, ... (2-way bank
conflicts at most, where contiguous rows per thread gave 16-way), and storing each byte of the
transposed row. Per tile, the rows' pass first takes each thread's largest magnitude of its 64
elements, its warp's by shuffles and the 8 warps' through shared memory behind the barrier
the transposed pass needs anyway, and both passes quantize under that one scale. Both passes
are bound by global memory; the reads of x are the one pass over it. (Staging the transposed
bytes in shared memory to store them 16 bytes a thread read no faster on an H100: 0.197-0.202
against 0.195 ms at 8192 x 14336, where one byte a store writes 32 bytes a warp instruction;
the L2 merges them.)
"""

from __future__ import annotations

import cuda.bindings.driver as cuda
import cutlass
import cutlass.memory
import ml_dtypes
import numpy as np
from cutlass import cute
from cutlass.cute.runtime import make_fake_compact_tensor

from jax_sm100._src import constraints
from jax_sm100._src.kernels import common
from jax_sm100._src.kernels.family import CompileInputs, KernelFamily

TILE = constraints.QUANTIZE_TILE  # the recipe's block, both ways
THREADS = 256
VEC = 8  # elements a thread loads at once along a row
LANES = TILE // VEC  # threads sharing a row (a column in the transposed pass)
GROUPS = THREADS // LANES  # rows (columns) one pass covers
PASSES = TILE // GROUPS
PAD_BYTES = 16  # shared rows padded by 16 bytes: vector stores stay aligned
WARPS = THREADS // 32


class QuantizeBothKernel(KernelFamily):
    """The kernel of the module docstring for a `planning.QuantizePlan` (its input and data
    dtypes; the sizes are runtime values)."""

    HOST_OPERANDS = constraints.QUANTIZE_TENSORS

    def __init__(self, plan, spec=None):
        super().__init__(plan, spec)
        self.in_dtype = common.cutlass_dtype(plan.in_dtype)
        self.data_dtype = common.cutlass_dtype(plan.data_dtype)
        # The data format's largest finite value, as `scaled.quantize` takes it.
        self.top = float(ml_dtypes.finfo(getattr(ml_dtypes, plan.data_dtype)).max)
        self.inv_top = float(np.float32(1.0 / self.top))
        self.pad = PAD_BYTES * 8 // self.in_dtype.width
        # fp8_block128x128 (weights): one scale a 128 x 128 tile, both orientations.
        self.tiles = plan.recipe == constraints.QUANTIZE_TILE_RECIPE

    @classmethod
    def why_not(cls, plan, spec=None) -> str | None:
        if getattr(plan, "kernel", None) != constraints.KERNEL_QUANTIZE_BOTH:
            return f"plan.kernel is {getattr(plan, 'kernel', None)!r}, not quantize_both"
        return constraints.quantize_both_support(
            plan.rows, plan.cols, plan.batch, plan.in_dtype, plan.data_dtype
        )

    @classmethod
    def compile_inputs(cls, plan, spec) -> CompileInputs:
        """Symbolic rows and cols (multiples of 128) and batch: x and q [L, R, C], s
        [L, C / 128, R], qt [L, C, R], st [L, R / 128, C], row-major, as (rows, cols, L)
        modes; for 128 x 128 tiles s [L, R / 128, C / 128] and st [L, C / 128, R / 128]."""
        rows, cols = (cute.sym_int(divisibility=TILE) for _ in range(2))
        batch = cute.sym_int()

        def tensor(dtype, shape, order):
            return make_fake_compact_tensor(common.cutlass_dtype(dtype), shape,
                                            stride_order=order, assumed_align=16)  # fmt: skip

        data, f32 = plan.data_dtype, "float32"
        if plan.recipe == constraints.QUANTIZE_TILE_RECIPE:
            s = tensor(f32, (rows // TILE, cols // TILE, batch), (1, 0, 2))
            st = tensor(f32, (cols // TILE, rows // TILE, batch), (1, 0, 2))
        else:
            s = tensor(f32, (rows, cols // TILE, batch), (0, 1, 2))
            st = tensor(f32, (cols, rows // TILE, batch), (0, 1, 2))
        operands = (
            tensor(plan.in_dtype, (rows, cols, batch), (1, 0, 2)),
            tensor(data, (rows, cols, batch), (1, 0, 2)),
            s,
            tensor(data, (cols, rows, batch), (1, 0, 2)),
            st,
        )
        return CompileInputs(plan, spec, operands)

    @cute.jit
    def __call__(self, mX: cute.Tensor, mQ: cute.Tensor, mS: cute.Tensor, mQT: cute.Tensor,
                 mST: cute.Tensor, stream: cuda.CUstream):  # fmt: skip
        # mX, mQ (R, C, L); mS (R, C / 128, L); mQT (C, R, L); mST (C, R / 128, L); for
        # tiles mS (R / 128, C / 128, L) and mST (C / 128, R / 128, L).
        rows, cols, batch = mX.shape
        grid = (cols // TILE, rows // TILE, batch)
        # The tile (rows padded); per tile, then one float32 a warp for its largest magnitude.
        smem = TILE * (TILE + self.pad) * self.in_dtype.width // 8
        if cutlass.const_expr(self.tiles):
            smem += WARPS * 4
        self.kernel(mX, mQ, mS, mQT, mST).launch(
            grid=grid, block=(THREADS, 1, 1), smem=smem, stream=stream
        )

    @cute.jit
    def _scale(self, amax: cutlass.Float32) -> cutlass.Float32:
        """`scaled._scale` for float32 scales: amax times 1 / top (rounded to float32),
        floored at float32's least normal number; 1 for a zero block; NaN where amax is not
        finite (a NaN read as one)."""
        f32 = cutlass.Float32
        scale = cute.arch.fmax(amax * f32(self.inv_top), f32(1.1754943508222875e-38))
        if amax == f32(0.0):
            scale = f32(1.0)
        if not amax < f32(float("inf")):
            scale = f32(float("nan"))
        return scale

    @cute.jit
    def _quantized(self, x, scale: cutlass.Float32):
        """The data of the Float32 TensorSSA `x` under `scale` (`scaled._data`): the correctly
        rounded x / scale clipped to the format's range, 0 where the scale is NaN (a block
        holding a NaN or an infinity).

        The quotient is the reciprocal's product corrected once (Markstein): with y = 1 / s
        correctly rounded (one IEEE reciprocal a block row), q0 = x y, r = q0 s - x (exact, an
        FMA) and q = q0 - r y (an FMA): five operations an element with x's rescaling below
        (the negations fold into the FMAs), where an IEEE division takes about ten and a range
        check. The correction holds while the remainder r is a normal number, so a block whose
        scale is below 2^-80 has x and s multiplied by 2^64 first (exact; the quotient is
        unchanged). Quotients below 2^-18, which every fp8 format rounds to zero, may still be
        a unit off in float32. The remainder's sign is taken so that a zero x keeps its sign.
        tests/test_quantize_both.py emulates this in numpy against IEEE division (every fp8
        byte, and every float32 quotient from 2^-18 up, equal: 300 million cases when written,
        8 million in the suite), and the GPU test checks the kernel's data against the exact
        quotient (H100: equal, and 0.19 against 0.23 ms for IEEE division at 8192 x 14336).
        """
        f32 = cutlass.Float32
        rn = cute.math.RoundingMode.NEAREST_EVEN  # mul.rn: ptxas may not fuse it into an FMA
        c = f32(1.0)
        if scale < f32(2.0**-80):
            c = f32(2.0**64)
        s = scale * c
        y = f32(1.0) / s
        r = cute.make_rmem_tensor(x.shape, f32)
        r.store(x)
        top = f32(self.top)
        for i in cutlass.range_constexpr(cute.size(r)):
            xs = cute.math.mul(r[i], c, rounding=rn)
            q0 = cute.math.mul(xs, y, rounding=rn)
            rem = cute.math.fma(q0, s, -xs)
            q = cute.math.fma(-rem, y, q0)
            r[i] = cute.arch.fmin(cute.arch.fmax(q, -top), top)
        if not scale > f32(0.0):
            r.store(cute.full_like(x, 0.0))
        return r.load().to(self.data_dtype)

    @cute.jit
    def _amax(self, r, amax: cutlass.Float32) -> cutlass.Float32:
        """The largest of `amax` and the magnitudes of the Float32 register tensor `r` (NaN if
        any is NaN)."""
        for i in cutlass.range_constexpr(cute.size(r)):
            amax = cute.arch.fmax(amax, cute.arch.fmax(r[i], -r[i], nan=True), nan=True)
        return amax

    @cute.jit
    def _block_amax(self, r) -> cutlass.Float32:
        """The largest magnitude of the Float32 register tensor `r` and the 15 other threads
        of its half warp (NaN if any is NaN)."""
        amax = self._amax(r, cutlass.Float32(0.0))
        for offset in (1, 2, 4, 8):
            amax = cute.arch.fmax(amax, cute.arch.shuffle_sync_bfly(amax, offset=offset), nan=True)
        return amax

    @cute.kernel
    def kernel(self, mX: cute.Tensor, mQ: cute.Tensor, mS: cute.Tensor, mQT: cute.Tensor,
               mST: cute.Tensor):  # fmt: skip
        tidx, _, _ = cute.arch.thread_idx()
        bx, by, bz = cute.arch.block_idx()
        allocator = cutlass.memory.SmemAllocator()
        sX = allocator.allocate_tensor(
            self.in_dtype, cute.make_layout((TILE, TILE), stride=(TILE + self.pad, 1)),
            byte_alignment=16,
        )  # fmt: skip
        gX = cute.local_tile(mX[None, None, bz], (TILE, TILE), (by, bx))
        gQ = cute.local_tile(mQ[None, None, bz], (TILE, TILE), (by, bx))
        gQT = cute.local_tile(mQT[None, None, bz], (TILE, TILE), (bx, by))
        lane = tidx % LANES
        group = tidx // LANES
        f32 = cutlass.Float32

        # The tile's 8 loads of each thread issued before any is used (each a register
        # fragment of its own): with the data stores between them, the compiler could not
        # move a later load above a store to q (it may alias x), and one 16-byte load in
        # flight per thread does not cover the memory's latency.
        loaded = []
        for p in cutlass.range_constexpr(PASSES):
            rx = cute.make_rmem_tensor((1, VEC), self.in_dtype)
            cute.autovec_copy(cute.local_tile(gX, (1, VEC), (group + GROUPS * p, lane)), rx)
            loaded.append(rx)

        tile_scale = None
        if cutlass.const_expr(self.tiles):
            # One scale for the tile: each thread's largest magnitude, then its warp's (by
            # shuffles), then the 8 warps' (through shared memory, after the barrier that
            # the transposed pass needs anyway).
            sAmax = allocator.allocate_tensor(cutlass.Float32, cute.make_layout(WARPS),
                                              byte_alignment=4)  # fmt: skip
            amax = f32(0.0)
            for p in cutlass.range_constexpr(PASSES):
                cute.autovec_copy(loaded[p], cute.local_tile(sX, (1, VEC), (group + GROUPS * p,
                                                                           lane)))  # fmt: skip
                rf = cute.make_rmem_tensor((1, VEC), f32)
                rf.store(loaded[p].load().to(f32))
                amax = self._amax(rf, amax)
            for offset in (1, 2, 4, 8, 16):
                amax = cute.arch.fmax(amax, cute.arch.shuffle_sync_bfly(amax, offset=offset),
                                      nan=True)  # fmt: skip
            if tidx % 32 == 0:
                sAmax[tidx // 32] = amax
            cute.arch.sync_threads()
            amax = sAmax[0]
            for w in cutlass.range_constexpr(1, WARPS):
                amax = cute.arch.fmax(amax, sAmax[w], nan=True)
            tile_scale = self._scale(amax)
            if tidx == 0:
                mS[by, bx, bz] = tile_scale
                mST[bx, by, bz] = tile_scale

        # Along C: row `r` of the tile, elements [8 lane, 8 lane + 8).
        for p in cutlass.range_constexpr(PASSES):
            r = group + GROUPS * p
            rx = loaded[p]
            if cutlass.const_expr(not self.tiles):
                cute.autovec_copy(rx, cute.local_tile(sX, (1, VEC), (r, lane)))
            rf = cute.make_rmem_tensor((1, VEC), f32)
            rf.store(rx.load().to(f32))
            if cutlass.const_expr(self.tiles):
                scale = tile_scale
            else:
                scale = self._scale(self._block_amax(rf))
                if lane == 0:
                    mS[by * TILE + r, bx, bz] = scale
            rq = cute.make_rmem_tensor((1, VEC), self.data_dtype)
            rq.store(self._quantized(rf.load(), scale))
            cute.autovec_copy(rq, cute.local_tile(gQ, (1, VEC), (r, lane)))

        if cutlass.const_expr(not self.tiles):
            cute.arch.sync_threads()

        # Along R, transposed: column `c` of the tile, rows lane, lane + 16, ...
        for p in cutlass.range_constexpr(PASSES):
            c = group + GROUPS * p
            rf = cute.make_rmem_tensor((VEC,), f32)
            for i in cutlass.range_constexpr(VEC):
                rf[i] = sX[lane + LANES * i, c].to(f32)
            if cutlass.const_expr(self.tiles):
                scale = tile_scale
            else:
                scale = self._scale(self._block_amax(rf))
                if lane == 0:
                    mST[bx * TILE + c, by, bz] = scale
            rq = cute.make_rmem_tensor((VEC,), self.data_dtype)
            rq.store(self._quantized(rf.load(), scale))
            for i in cutlass.range_constexpr(VEC):
                gQT[c, lane + LANES * i] = rq[i]
