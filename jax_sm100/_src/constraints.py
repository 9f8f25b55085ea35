"""Every legality rule of a GEMM plan, stated once.

The planner only proposes plans these functions accept, `GemmPlan.__post_init__` calls them on
every plan (so a `dataclasses.replace` edit that breaks one raises at once), the lowering calls
`kernel_support` to decide between our kernels and XLA's dot, and the tests call them to state
the invariants. Each function raises `PlanError` naming the rule, or returns a reason string.
"""

from __future__ import annotations

import numbers

ARCHS = ("sm_100a", "sm_90a")

# Bits per element of the dtypes the primitive accepts (ml_dtypes names, as `np.dtype(x).name`).
# float64 runs on XLA's dot only (no tensor-core kernel takes it); it is there for float64
# programs and for numerically checked gradients.
DTYPE_BITS = {
    "float64": 64,
    "bfloat16": 16,
    "float16": 16,
    "float32": 32,
    "float8_e4m3fn": 8,
    "float8_e5m2": 8,
}
FP8_DTYPES = ("float8_e4m3fn", "float8_e5m2")
# Block-scaled data that only `scaled_matmul` takes (matmul does not), and every dtype a plan's
# operands may have.
SCALED_DATA_BITS = {"float4_e2m1fn": 4}
OPERAND_BITS = {**DTYPE_BITS, **SCALED_DATA_BITS}

# sm_100a's block-scaled MMAs (PTX ISA, tcgen05.mma.kind::block_scale): (data dtype, scale dtype,
# elements of k per scale) -> the MMA kind. mxfp8 (either fp8 format, e8m0 scales per 32) and
# nvfp4 (e2m1 data, e4m3 scales per 16), as `jax_sm100.quantize` makes them.
SM100_BLOCKSCALED_KINDS = {
    ("float8_e4m3fn", "float8_e8m0fnu", 32): "mxf8f6f4",
    ("float8_e5m2", "float8_e8m0fnu", 32): "mxf8f6f4",
    ("float4_e2m1fn", "float8_e4m3fn", 16): "mxf4nvf4",
}
# The MMA reads scale factors in 512-byte atoms: 128 rows (32 x 4) by 4 scales along k, the
# "blocked" layout of quantize's scales (scaled.py).
SCALE_ATOM_ROWS = 128
SCALE_ATOM_BLOCKS = 4

# The kernels a plan names (`GemmPlan.kernel`); planning re-exports them.
KERNEL_SM100 = "sm100_tcgen05"
# Block-scaled operands (scaled_matmul: mxfp8, nvfp4) on sm_100a: kernels/sm100_blockscaled.py.
KERNEL_SM100_BLOCKSCALED = "sm100_tcgen05_blockscaled"
KERNEL_SM90 = "sm90_wgmma"
KERNEL_SM90_SPLITK = "sm90_wgmma_splitk"
KERNEL_SM90_SCALED = "sm90_wgmma_scaled"
KERNEL_SM90_GROUPED = "sm90_wgmma_grouped"
# Grouped problems (ragged_dot) on sm_100a: kernels/sm100_grouped.py.
KERNEL_SM100_GROUPED = "sm100_tcgen05_grouped"
KERNEL_XLA = "xla_dot"
# Quantization along both dims in one pass (quantize_both: kernels/quantize.py); not a GEMM, so
# not among KERNELS (GemmPlan's).
KERNEL_QUANTIZE_BOTH = "quantize_both"
KERNELS = (
    KERNEL_SM100,
    KERNEL_SM100_BLOCKSCALED,
    KERNEL_SM100_GROUPED,
    KERNEL_SM90,
    KERNEL_SM90_SPLITK,
    KERNEL_SM90_GROUPED,
    KERNEL_SM90_SCALED,
    KERNEL_XLA,
)

# Operand dtypes each kernel family implements (A and B of one dtype), and the output dtypes
# its epilogue can write.
KERNEL_OPERAND_DTYPES = {
    "sm_100a": ("bfloat16", "float16", "float32", "float8_e4m3fn", "float8_e5m2"),
    "sm_90a": ("bfloat16", "float16", "float8_e4m3fn", "float8_e5m2"),
}
KERNEL_OUT_DTYPES = ("bfloat16", "float16", "float32")
# The dtypes a block-scaled product rounds to (`scaled_matmul`'s preferred_element_type; float64
# with x64 on, on XLA's ops); 8-bit and narrower outputs would lose too much (e8m0 has no sign).
SCALED_OUT_DTYPES = ("float32", "bfloat16", "float16", "float64")


def kernel_bias_dtype(name: str) -> str:
    """The dtype the kernels read a bias of dtype `name` in: its own where the epilogue reads
    it, else float32 (an fp8 or float64 bias is converted first; the epilogue adds it in
    float32 either way, as `primitive.epilogue_xla` does)."""
    return name if name in KERNEL_OUT_DTYPES else "float32"


# TMA moves rows whose contiguous extent is a multiple of 16 bytes.
TMA_ALIGN_BYTES = 16

# The largest extent (m, n, k, batch) a kernel indexes: its argument structs hold int32s.
MAX_EXTENT = 2**31 - 1
# Hardware TMEM: 512 columns of 128 lanes per SM; allocations are powers of two >= 32.
TMEM_MAX_COLS = 512
TMEM_MIN_COLS = 32
# Bytes kept back from shared memory for mbarriers and the TMEM-pointer slot.
SMEM_RESERVED_BYTES = 1024
# The sm_90a kernels' mbarriers at most (A/B stages' two each, a split's two, staged C's two a
# store stage and group), within SMEM_RESERVED_BYTES: 16 A/B stages of the smallest sm_90a
# tile (64 x 128 x 64, 16-bit) would not fit its shared memory.
SM90_BARRIER_BYTES_MAX = 256
# `GemmPlan.dynamic_tiles`: the work tiles in flight between a grouped CTA's producer warp and
# its consumers (a ring of int32 indices, each with a full and an empty mbarrier), and its
# shared memory, counted beside the group table (here, in a kernel source: it shapes binaries).
# Counted, not left to SMEM_RESERVED_BYTES: on sm_90a the barriers, table and ring sit before
# A's stages, which start at the next 1024-byte boundary, and with a table just under a
# multiple of 1 KiB (245-254 groups) the ring can push that boundary past what the reserve
# covers (on sm_100a the table and ring follow the tiles).
GROUPED_WORK_RING = 4
GROUPED_WORK_RING_BYTES = GROUPED_WORK_RING * (4 + 2 * 8)
MIN_AB_STAGES = 2
# Largest cluster the hardware schedules: 8 CTAs portably; sm_100a parts also take 16, a
# non-portable size, which the DSL allows on every kernel it emits (the kernel op's
# `non_portable_cluster_size_allowed` attribute). The planner picks at most 2 on either.
MAX_CLUSTER_SIZE = {"sm_100a": 16, "sm_90a": 8}
# Per SM (CUDA C++ Programming Guide, compute capabilities 9.0 and 10.0): 228 KB of shared
# memory, of which the system keeps 1 KB per resident CTA; 2048 threads; 32 CTAs.
SMEM_PER_SM = 228 * 1024
SMEM_SYSTEM_PER_CTA = 1024
MAX_THREADS_PER_SM = 2048
MAX_CTAS_PER_SM = 32


def sm100_threads_per_cta(has_c: bool) -> int:
    """Threads of one SM100 GEMM CTA: 4 epilogue warps, the MMA warp, the A/B TMA warp, and a C
    TMA warp when the epilogue reads C (the warp roles of kernels/sm100_gemm.py)."""
    return 32 * (7 if has_c else 6)


class PlanError(ValueError):
    """A plan breaks a hardware or kernel constraint, or does not fit the problem it is used on."""


def mma_inst_k(dtype: str) -> int:
    """K of one tensor-core instruction: 32 bytes of K for every operand width."""
    return 256 // OPERAND_BITS[dtype]


def check_arch(arch: str) -> None:
    if arch not in ARCHS:
        raise PlanError(f"{arch=} is not supported; use one of {ARCHS}")


def check_mma_tiler(
    arch: str, mma_tiler_mnk: tuple, use_2cta: bool, ab_dtype: str, b_major: str = "k"
) -> None:
    """MMA tile shapes the tensor-core instructions implement (PTX ISA, tcgen05.mma / wgmma).

    On sm_100a an 8-bit B that is N-major needs N in steps of 16 (1-CTA) or 32 (2-CTA), the rule
    nvidia-cutlass-dsl's tcgen05 MMA op checks when it is built.
    """
    m, n, k = mma_tiler_mnk
    if arch == "sm_100a":
        allowed_m = (128, 256) if use_2cta else (64, 128)
        if m not in allowed_m:
            raise PlanError(
                f"sm_100a {'2-CTA' if use_2cta else '1-CTA'} MMA needs M in {allowed_m}, "
                f"got {mma_tiler_mnk=}"
            )
        n_step = 16 if (use_2cta or m == 128) else 8
        why = ""
        if OPERAND_BITS[ab_dtype] == 8 and b_major == "n":
            n_step = 32 if use_2cta else 16
            why = f" (an N-major {ab_dtype} B; a K-major B takes steps of 16)"
        if not (n_step <= n <= 256 and n % n_step == 0):
            raise PlanError(
                f"sm_100a MMA N must be a multiple of {n_step} in [{n_step}, 256]{why}; "
                f"got {mma_tiler_mnk=}"
            )
    else:
        if use_2cta:
            raise PlanError("sm_90a has no 2-CTA MMA; set use_2cta=False")
        if m not in (64, 128, 256):
            raise PlanError(f"sm_90a CTA tile M must be 64, 128 or 256; got {mma_tiler_mnk=}")
        if not (16 <= n <= 256 and n % 16 == 0):
            raise PlanError(f"sm_90a tile N must be a multiple of 16 in [16, 256]; got {n=}")
    if k * OPERAND_BITS[ab_dtype] != 128 * 8:
        raise PlanError(
            f"the K tile must span 128 bytes (one 128B-swizzle row) of {ab_dtype}: "
            f"K={1024 // OPERAND_BITS[ab_dtype]}, got {k=}"
        )


def check_sm100_blockscaled(
    mma_tiler_mnk: tuple, use_2cta: bool, a_dtype: str, b_dtype: str, scale_dtype, scale_block,
    a_major: str, b_major: str,
) -> None:  # fmt: skip
    """What sm_100a's block-scaled GEMM (kernels/sm100_blockscaled.py) takes beyond a dense plan:
    `blockscaled_operands`' formats and layouts, M of 128 rows per CTA (one scale atom's rows:
    128 1-CTA, 256 2-CTA) and N of 128 or 256 (whole scale atoms of B). Its plain epilogue is
    `check_plain_epilogue`'s rule."""
    why = blockscaled_operands(a_dtype, b_dtype, scale_dtype, scale_block, a_major, b_major)
    if why is not None:
        raise PlanError(why)
    m, n, _ = mma_tiler_mnk
    if m != (256 if use_2cta else 128) or n not in (128, 256):
        raise PlanError(
            f"block-scaled sm_100a MMA tiles are 128 rows per CTA (M=128 1-CTA, 256 2-CTA) by "
            f"N=128 or 256; got {mma_tiler_mnk=}, {use_2cta=}"
        )


def blockscaled_operands(a_dtype, b_dtype, scale_dtype, scale_block, a_major, b_major):
    """Why operands cannot feed sm_100a's block-scaled MMA, or None: each a format of
    `SM100_BLOCKSCALED_KINDS` under the one scale dtype and block (the MMA kind follows the
    scales, so both then share one, and fp4 never meets fp8), both K-major (the scales run
    along k)."""
    for name, dtype in (("a", a_dtype), ("b", b_dtype)):
        if (dtype, scale_dtype, scale_block) not in SM100_BLOCKSCALED_KINDS:
            return (
                f"{name}_dtype={dtype!r} with {scale_dtype=} per {scale_block=} is not an sm_100a "
                f"block-scaled format; one of {tuple(SM100_BLOCKSCALED_KINDS)}"
            )
    if a_major != "k" or b_major != "k":
        return (
            f"block-scaled operands are K-major ([m, k] and [n, k]; the scales run along k): "
            f"{a_major=}, {b_major=}"
        )
    return None


def check_plain_epilogue(
    kernels: str, c_dtype, preact_out: bool, fix: str = "keep c_dtype=None and preact_out=False"
) -> None:
    """The block-scaled and grouped kernels' epilogue is plain: it reads no C and writes D only
    (no pre-activation). `kernels` names them in the error, `fix` says what to do instead."""
    if c_dtype is not None or preact_out:
        raise PlanError(f"c_dtype={c_dtype!r}, preact_out={bool(preact_out)}: the {kernels} read "
                        f"no C and write D only; {fix}")  # fmt: skip


# A ping-pong SM90 consumer warp group (128 threads) holds a whole tile's float32 accumulators.
PINGPONG_MAX_TILE_ELEMS = 128 * 192


def check_pingpong(arch: str, pingpong: bool, mma_tiler_mnk: tuple) -> None:
    if not pingpong:
        return
    if arch != "sm_90a":
        raise PlanError(f"pingpong=True is an sm_90a (wgmma) schedule; the plan is {arch}")
    m, n, _ = mma_tiler_mnk
    if m > 128 or m * n > PINGPONG_MAX_TILE_ELEMS:
        raise PlanError(
            f"pingpong=True keeps a whole {m}x{n} tile in one warp group's registers; it needs "
            f"M <= 128 and M*N <= {PINGPONG_MAX_TILE_ELEMS} (e.g. 128x192, 128x128, 64x256)"
        )


def check_stage_c(
    arch: str, stage_c: bool, c_dtype, out_dtype: str, stream_k: bool, split_k: int
) -> None:
    """SM90's TMA-staged C (`GemmPlan.stage_c`): the epilogue reads C from a shared-memory ring a
    producer warp fills tile after tile, through the same register<->shared mapping as D's
    16-bit stores, which needs a C of D's 16-bit dtype and the data-parallel schedule."""
    if not stage_c:
        return
    if arch != "sm_90a":
        raise PlanError(f"stage_c=True is an sm_90a choice (sm_100a always stages C); {arch=}")
    if c_dtype is None:
        raise PlanError("stage_c=True stages the epilogue's C: the problem has no C (c_dtype)")
    if c_dtype != out_dtype or DTYPE_BITS[c_dtype] != 16:
        raise PlanError(
            f"stage_c=True reads C as D's 16-bit fragments: needs c_dtype == out_dtype, 16-bit; "
            f"got {c_dtype=}, {out_dtype=} (set stage_c=False)"
        )
    if stream_k or split_k > 1:
        raise PlanError(
            f"stage_c=True needs the data-parallel schedule: {stream_k=} and {split_k=} read C "
            "from global memory (set stage_c=False)"
        )


def check_swap_ab(swap_ab: bool, kernel: str, a_dtype: str, b_dtype: str, out_dtype: str,
                  a_major: str, b_major: str, c_dtype: str | None, split_k: int,
                  stream_k: bool) -> None:  # fmt: skip
    """`GemmPlan.swap_ab`: the SM90 dense kernel runs D^T = B A^T (B as its A, A as its B) and
    stores D M-major. As measured and tested on the H200: 8-bit operands, both K-major (each
    becomes the other's K-major operand), a 16-bit result (stmatrix's transposing form), no C
    (read transposed), split-K or stream-K. Ignored on an XLA plan (its tile fields hold
    nothing)."""
    if not swap_ab or kernel == KERNEL_XLA:
        return
    if kernel != KERNEL_SM90:
        raise PlanError(f"swap_ab=True is a choice of the sm_90a dense kernel (kernel="
                        f"{KERNEL_SM90!r}), not of {kernel=}; set swap_ab=False")  # fmt: skip
    if a_dtype not in FP8_DTYPES or b_dtype not in FP8_DTYPES or DTYPE_BITS[out_dtype] != 16:
        raise PlanError(f"swap_ab=True takes fp8 operands and a 16-bit result; got {a_dtype=}, "
                        f"{b_dtype=}, {out_dtype=} (set swap_ab=False)")  # fmt: skip
    if a_major != "k" or b_major != "k":
        raise PlanError(f"swap_ab=True needs K-major A and B (each becomes the other's operand); "
                        f"got {a_major=}, {b_major=} (set swap_ab=False)")  # fmt: skip
    if c_dtype is not None or split_k > 1 or stream_k:
        raise PlanError(f"swap_ab=True takes no C, split-K or stream-K; got {c_dtype=}, "
                        f"{split_k=}, {stream_k=} (set swap_ab=False)")  # fmt: skip


def check_stream_k(
    arch: str, stream_k: bool, pingpong: bool, split_k: int, cluster_shape_mn: tuple = (1, 1)
) -> None:
    if not stream_k:
        return
    if arch != "sm_90a":
        raise PlanError(f"stream_k=True is an sm_90a (wgmma) schedule; the plan is {arch}")
    if cluster_shape_mn[0] * cluster_shape_mn[1] > 2:
        # A stream-K cluster waits for the next cluster's partial tile, so every cluster of the
        # grid must be resident: on the H200 only 30 of 33 clusters of 4 are (and 15 of 16 of 8).
        raise PlanError(
            f"stream_k=True needs clusters of at most 2 CTAs (all of the persistent grid "
            f"resident); cluster_shape_mn={tuple(cluster_shape_mn)} (use (2, 1), (1, 2) or (1, 1))"
        )
    if pingpong:
        raise PlanError(
            "stream_k=True balances the cooperative schedule; ping-pong plans take whole tiles "
            "per warp group (set pingpong=False or stream_k=False)"
        )
    if split_k > 1:
        raise PlanError(
            f"stream_k=True already splits K where the waves need it; split_k={split_k} plans "
            "cannot also stream (set split_k=1 or stream_k=False)"
        )


# Float32 words of padding after each row of an in-cluster split-K partial tile in shared memory
# (spreads the accumulator fragments' stores over the banks).
SPLITK_ROW_PAD = 8
# Where a split-K plan sums its partials: "xla" (the kernel writes float32 partials, one XLA
# reduction fused with the epilogue sums them) or "cluster" (the split_k CTAs of a tile form a
# cluster and sum them through distributed shared memory, then run the epilogue themselves).
SPLIT_REDUCES = ("xla", "cluster")


def check_split_k(split_k: int, cluster_shape_mn: tuple, pingpong: bool, split_reduce: str) -> None:
    if split_reduce not in SPLIT_REDUCES:
        raise PlanError(f"split_reduce={split_reduce!r} must be one of {SPLIT_REDUCES}")
    if split_k == 1 or split_reduce == "xla":
        return
    if tuple(cluster_shape_mn) != (1, split_k):
        raise PlanError(
            f"split_k={split_k} runs each output tile's {split_k} K slices as one (1, {split_k}) "
            f"cluster that sums them in shared memory; got {cluster_shape_mn=}, "
            f"use cluster_shape_mn=(1, {split_k}) (planning.with_split does)"
        )
    if pingpong:
        raise PlanError("split-K plans are cooperative: pingpong=True needs split_k=1")


def check_cluster(arch: str, cluster_shape_mn: tuple, use_2cta: bool) -> None:
    cm, cn = cluster_shape_mn
    for v in (cm, cn):
        if v < 1 or v & (v - 1):
            raise PlanError(f"cluster dims must be powers of two >= 1, got {cluster_shape_mn=}")
    if cm * cn > MAX_CLUSTER_SIZE[arch]:
        raise PlanError(
            f"{arch} clusters hold at most {MAX_CLUSTER_SIZE[arch]} CTAs, got {cluster_shape_mn=}"
        )
    if use_2cta and cm % 2:
        raise PlanError(f"2-CTA MMA pairs CTAs along M: cluster M must be even, got {cm=}")


def max_resident_ctas(smem_bytes: int, threads: int) -> int:
    """How many CTAs of a kernel can share one SM, at most: by shared memory (with the system's
    1 KB per CTA), threads and the CTA limit. Registers can only lower it (their count is the
    compiler's), so this is the bound to size anything that must hold for all residents."""
    by_smem = SMEM_PER_SM // (smem_bytes + SMEM_SYSTEM_PER_CTA)
    return max(1, min(by_smem, MAX_THREADS_PER_SM // threads, MAX_CTAS_PER_SM))


def check_tmem_residency(tmem_alloc_cols: int, smem_bytes: int, threads: int) -> None:
    """The TMEM of every CTA that can be resident on an SM must fit its 512 columns together.

    A CTA's `tcgen05.alloc` waits until the columns are free. If a second CTA of the grid can
    share the SM and the two together ask for more than 512 columns, the second waits for the
    first to exit; with clusters that progress together, two clusters can then wait on each
    other forever. The planner fills shared memory, which keeps one CTA per SM; an edited plan
    (fewer A/B stages, say) can let two in.
    """
    resident = max_resident_ctas(smem_bytes, threads)
    if tmem_alloc_cols * resident > TMEM_MAX_COLS:
        need = SMEM_PER_SM // 2 - SMEM_SYSTEM_PER_CTA + 1
        raise PlanError(
            f"{resident} CTAs of this plan fit on one SM ({smem_bytes=} of shared memory each) "
            f"and each allocates {tmem_alloc_cols=} of the SM's {TMEM_MAX_COLS} TMEM columns: "
            "a CTA could wait forever for another's columns. Keep one CTA per SM with more A/B "
            f"stages (smem_bytes >= {need}; the planner fills shared memory), or allocate at most "
            f"{TMEM_MAX_COLS // resident} columns (fewer accumulator stages or a narrower tile)"
        )


def check_tmem(tmem_alloc_cols: int) -> None:
    c = tmem_alloc_cols
    if c < TMEM_MIN_COLS or c > TMEM_MAX_COLS or c & (c - 1):
        raise PlanError(
            f"TMEM allocation must be a power of two in [{TMEM_MIN_COLS}, {TMEM_MAX_COLS}] "
            f"columns, got {tmem_alloc_cols=}; use fewer accumulator stages or a smaller N tile"
        )


def check_smem(arch: str, smem_bytes: int, capacity: int) -> None:
    if smem_bytes > capacity:
        raise PlanError(
            f"{arch} plan needs {smem_bytes=} of shared memory but a CTA has {capacity}; "
            "use fewer A/B or epilogue stages or a smaller tile"
        )


def check_ab_stages(num_ab_stages: int) -> None:
    if num_ab_stages < MIN_AB_STAGES:
        raise PlanError(
            f"{num_ab_stages=}: the TMA/MMA pipeline needs at least {MIN_AB_STAGES} stages"
        )


def check_epi_tile(epi_tile: tuple, cta_tile_mnk: tuple) -> None:
    em, en = epi_tile
    if cta_tile_mnk[0] % em or cta_tile_mnk[1] % en:
        raise PlanError(f"{epi_tile=} must divide the CTA tile {cta_tile_mnk[:2]}")


def contiguous_extent(m: int, n: int, k: int, major: str) -> int:
    """Elements along the contiguous dim of an operand in the given major order."""
    return {"m": m, "n": n, "k": k}[major]


def tma_quantum(dtype: str) -> int:
    """Elements of `dtype` in one 16-byte TMA unit: what a contiguous dim must be a multiple of."""
    return tma_quantum_bits(OPERAND_BITS[dtype])


def wgmma_k_major_only(arch: str, dtype: str) -> bool:
    """Whether `arch`'s MMA reads `dtype` operands K-major only: sm_90a's fp8 wgmma (PTX ISA:
    only 16-bit wgmma operands may be transposed in shared memory)."""
    return arch == "sm_90a" and dtype in FP8_DTYPES


def extent_support(m: int, n: int, k: int, batch: int = 1) -> str | None:
    """Why the kernels cannot index a GEMM of these extents, or None: every extent a kernel
    sees (m with any folded batch in it, n, k, the batch) is an int32 of its argument struct,
    so at most `MAX_EXTENT` (a folded batch of short rows can pass that in an H200's memory).
    The FFI handler refuses such extents again."""
    for name, value in (("m", m), ("n", n), ("k", k), ("batch", batch)):
        if int(value) > MAX_EXTENT:
            return (
                f"{name}={int(value)} exceeds the kernels' int32 extent range (2**31 - 1 = "
                f"{MAX_EXTENT}): XLA's dot"
            )
    return None


# Block-scaled problems (scaled_matmul): the bits of each scale-factor dtype the API takes, and
# what the kernels read: float32 scales per 128 of k (DeepSeek-V3's recipe) on sm_90a, where a
# 128-byte fp8 k-tile is one scale block (kernels/sm90_scaled.py).
SCALE_DTYPE_BITS = {
    "float32": 32, "bfloat16": 16, "float16": 16,
    "float8_e8m0fnu": 8, "float8_e4m3fn": 8, "float8_e5m2": 8,
}  # fmt: skip
KERNEL_SCALE_DTYPES = {"sm_90a": ("float32",)}
KERNEL_SCALE_BLOCK = 128


def scaled_support(arch, k, a_dtype, b_dtype, scale_dtype, scale_block) -> str | None:
    """Why no kernel runs a block-scaled problem (beyond `kernel_support`'s reasons), or None."""
    if arch not in KERNEL_SCALE_DTYPES:
        # sm_100a's block-scaled formats are `blockscaled_support`'s.
        return f"XLA ops: no {arch} kernel for {scale_dtype} scales per {scale_block}"
    if a_dtype not in FP8_DTYPES or b_dtype not in FP8_DTYPES:
        return f"XLA ops: the {arch} block-scaled kernel takes fp8 data, not {a_dtype} x {b_dtype}"
    if scale_dtype not in KERNEL_SCALE_DTYPES[arch] or scale_block != KERNEL_SCALE_BLOCK:
        (kernel,) = KERNEL_SCALE_DTYPES[arch]
        why = (
            f"XLA ops: the {arch} block-scaled kernel reads {kernel} scales per "
            f"{KERNEL_SCALE_BLOCK} of k, not {scale_dtype} per {scale_block}"
        )
        if scale_block == KERNEL_SCALE_BLOCK:
            # (scaled_gpu._widened: every scale dtype the API takes is exact in float32)
            why += (
                f" (scaled_matmul converts scales of another dtype per {scale_block} to "
                f"{kernel} first: plan it with scale_dtype={kernel!r})"
            )
        return why
    if k % KERNEL_SCALE_BLOCK:
        return f"XLA ops: k={k} is not a multiple of the {KERNEL_SCALE_BLOCK}-element scale block"
    return None


# The widest tile of 256 rows the block-scaled kernel holds: each consumer warp group keeps
# 2 x 64 rows of main accumulators beside one 64-row k-block fragment (3 x N / 2 registers).
SCALED_256_MAX_TILE_N = 128


def check_scaled(arch, kernel_scaled, kernel_xla, scale_dtype, scale_block, tile_m, pingpong,
                 split_k, stream_k, stage_c, tile_n=0) -> None:  # fmt: skip
    """A block-scaled problem (scale_dtype set) runs on the block-scaled kernel or XLA, nothing
    else does; that kernel's schedule is cooperative tiles of 128 rows (two consumer warp groups
    of 64 rows, each holding its main and its k-block accumulators) or of 256 rows and at most
    `SCALED_256_MAX_TILE_N` columns (each warp group's 128 rows in two 64-row waves through one
    k-block fragment), unsplit, on sm_90a. Stream-K is allowed: its shared partial tiles are of
    promoted accumulators, which add."""
    if (scale_dtype is None) != (scale_block == 0) or (
        scale_dtype is not None and (scale_dtype not in SCALE_DTYPE_BITS or scale_block < 1)
    ):
        raise PlanError(
            f"{scale_dtype=}, {scale_block=}: a block-scaled problem has a scale dtype of "
            f"{tuple(SCALE_DTYPE_BITS)} and a block >= 1; an unscaled one None and 0"
        )
    if kernel_scaled and scale_dtype is None:
        raise PlanError("the block-scaled kernel runs block-scaled problems (set scale_dtype)")
    if scale_dtype is not None and not (kernel_scaled or kernel_xla):
        raise PlanError(
            f"a block-scaled problem ({scale_dtype} scales per {scale_block}) runs on the "
            "block-scaled kernel or on XLA, not on an unscaled kernel"
        )
    del stream_k  # either schedule
    if kernel_scaled and (arch != "sm_90a" or tile_m not in (128, 256) or pingpong
                          or split_k > 1 or stage_c):  # fmt: skip
        raise PlanError(
            f"the block-scaled kernel is sm_90a, cooperative with 128- or 256-row tiles, "
            f"unsplit, C not staged: got {arch=}, {tile_m=}, {pingpong=}, {split_k=}, {stage_c=}"
        )
    if kernel_scaled and tile_m == 256 and tile_n > SCALED_256_MAX_TILE_N:
        raise PlanError(
            f"the block-scaled kernel's 256-row tiles hold three 64 x N float32 fragments per "
            f"consumer warp group: tile N={tile_n} must be <= {SCALED_256_MAX_TILE_N}"
        )


# The rows of B one B scale may cover (GemmProblem.b_scale_rows): each row (jax.nn.scaled_matmul),
# or tiles of 128 (DeepSeek-V3's weights).
B_SCALE_ROWS = (1, 128)
# B scaled per 128-row tile on the sm_90a kernel: each A/B stage holds a k-block's scales of this
# many of B's tiles (TMA's narrowest box of float32, 16 bytes; the tile's own among them), at
# `SCALE_STAGE_ALIGN_BYTES` (TMA's shared-memory alignment) from the stage before.
B_SCALE_TILE_WINDOW = 4
SCALE_STAGE_ALIGN_BYTES = 128


def b_tile_scale_stage_bytes(scale_bits: int) -> int:
    """Shared memory a stage gives B's window of tile scales: `B_SCALE_TILE_WINDOW` scales of
    `scale_bits` bits, rounded up to `SCALE_STAGE_ALIGN_BYTES`."""
    window = B_SCALE_TILE_WINDOW * scale_bits // 8
    return -(-window // SCALE_STAGE_ALIGN_BYTES) * SCALE_STAGE_ALIGN_BYTES


def is_b_scale_rows(b_scale_rows) -> bool:
    """One of `B_SCALE_ROWS` as an int (not a bool or a float, which compare equal to them)."""
    return (isinstance(b_scale_rows, numbers.Integral) and not isinstance(b_scale_rows, bool)
            and b_scale_rows in B_SCALE_ROWS)  # fmt: skip


def check_b_scale_rows(scale_dtype, b_scale_rows, kernel_scaled: bool, tile_n: int) -> None:
    """B's scales cover 1 or 128 of its rows (`B_SCALE_ROWS`), 1 when unscaled; on the
    block-scaled kernel a tile of D's columns then lies within one scale tile (its width divides
    128), so each k-tile's promotion takes one B scale."""
    if not is_b_scale_rows(b_scale_rows) or (scale_dtype is None and b_scale_rows != 1):
        raise PlanError(
            f"b_scale_rows={b_scale_rows!r} must be one of {B_SCALE_ROWS} (1 when unscaled)"
        )
    if kernel_scaled and b_scale_rows > 1 and b_scale_rows % tile_n:
        raise PlanError(
            f"b_scale_rows={b_scale_rows}: the block-scaled kernel's tile_n={tile_n} must divide "
            "it (each tile within one scale tile of B)"
        )


# The block-scaled kernel's overlapped main loop holds three 64 x N float32 fragments per
# consumer warp group (the main accumulators and two k-tile fragments used in turn: 3 N / 2
# registers per thread): 192 at N = 128, leaving 40 of the 232 a consumer thread gets for the
# scales (read during each promotion) and addressing; ptxas fits that without spills. At
# N = 160 the fragments alone take 240.
SCALED_OVERLAP_MAX_TILE_N = 128


def check_scaled_overlap(kernel_scaled: bool, scaled_overlap, tile_n: int, tile_m: int = 128
                         ) -> None:  # fmt: skip
    """`GemmPlan.scaled_overlap`: the block-scaled kernel's main loop with k-tile i's promotion
    run while k-tile i + 1's wgmma batch is in flight (kernels/sm90_scaled.py). Only that kernel
    has it, only for 128-row tiles, and only tiles up to `SCALED_OVERLAP_MAX_TILE_N` columns fit
    its registers."""
    if not isinstance(scaled_overlap, bool):
        raise PlanError(f"scaled_overlap={scaled_overlap!r} must be a bool")
    if not scaled_overlap:
        return
    if not kernel_scaled:
        raise PlanError(
            "scaled_overlap=True is a choice of the sm_90a block-scaled kernel "
            "(kernel='sm90_wgmma_scaled') only; leave it False"
        )
    if tile_m != 128:
        raise PlanError(
            f"scaled_overlap=True runs 128-row tiles (a second fragment beside a 256-row tile's "
            f"two waves of accumulators would not fit the registers): got {tile_m=}"
        )
    if tile_n > SCALED_OVERLAP_MAX_TILE_N:
        raise PlanError(
            f"scaled_overlap=True holds three 64 x {tile_n} float32 fragments per consumer warp "
            f"group: {tile_n=} must be <= {SCALED_OVERLAP_MAX_TILE_N} to fit the 232 registers"
        )


def kernel_support(
    arch: str,
    m: int,
    n: int,
    k: int,
    a_dtype: str,
    b_dtype: str,
    out_dtype: str,
    c_dtype: str | None,
    a_major: str,
    b_major: str,
    batch: int = 1,
    scale_dtype: str | None = None,
    scale_block: int = 0,
) -> str | None:
    """Why our kernels cannot run this problem, or None when they can.

    The reason is a sentence for the plan's `reason` field: the problem then runs on XLA's dot.
    A block-scaled problem for sm_100a (`scale_dtype` set) is `blockscaled_support`'s.
    """
    why = extent_support(m, n, k, batch)
    if why is not None:
        return why
    if scale_dtype is not None and arch == "sm_100a":
        return blockscaled_support(
            arch, n, k, a_dtype, b_dtype, out_dtype, c_dtype, a_major, b_major, scale_dtype,
            scale_block,
        )  # fmt: skip
    if a_dtype != b_dtype:
        return f"XLA dot: mixed operand dtypes {a_dtype} x {b_dtype} (kernels take one dtype)"
    if a_dtype not in KERNEL_OPERAND_DTYPES[arch]:
        return f"XLA dot: no {arch} kernel for {a_dtype} operands"
    if out_dtype not in KERNEL_OUT_DTYPES:
        return f"XLA dot: the epilogue writes {KERNEL_OUT_DTYPES}, not {out_dtype}"
    if c_dtype is not None and c_dtype not in KERNEL_OUT_DTYPES:
        return f"XLA dot: the epilogue reads C as {KERNEL_OUT_DTYPES}, not {c_dtype}"
    if wgmma_k_major_only(arch, a_dtype) and (a_major != "k" or b_major != "k"):
        wrong = [f"{name} is {major}-major" for name, major in (("A", a_major), ("B", b_major))
                 if major != "k"]  # fmt: skip
        why = "XLA dot: sm_90a fp8 wgmma needs K-major A and B; here " + " and ".join(wrong)
        if scale_dtype is None:
            why += (" (matmul and dot_general transpose such operands by XLA first and run the "
                    "K-major problem's plan: plan that one, a_major='k', b_major='k')")  # fmt: skip
        return why
    checks = [
        ("a", a_major, a_dtype),
        ("b", b_major, b_dtype),
        ("out", "n", out_dtype),
    ]
    if c_dtype is not None:
        checks.append(("c", "n", c_dtype))
    for name, major, dtype in checks:
        extent = contiguous_extent(m, n, k, major)
        nbytes = extent * OPERAND_BITS[dtype] // 8
        quantum = tma_quantum(dtype)
        if extent % quantum:
            return (
                f"XLA dot: {name}'s contiguous dim {major}={extent} ({nbytes} bytes of {dtype}) "
                f"is not a multiple of {TMA_ALIGN_BYTES} bytes, which TMA needs; "
                f"pad {major} to a multiple of {quantum} to use the kernel"
            )
    return None


def blockscaled_support(
    arch, n, k, a_dtype, b_dtype, out_dtype, c_dtype, a_major, b_major, scale_dtype, scale_block
) -> str | None:
    """Why no kernel runs this block-scaled problem, or None (`kernel_support`'s half for
    `scaled_matmul`): an sm_100a format of `SM100_BLOCKSCALED_KINDS`, K-major operands, whole
    scale blocks and 16-byte rows along k, a 16-byte aligned N-major output."""
    if arch != "sm_100a":
        return f"XLA ops: no {arch} block-scaled kernel for {scale_dtype} scales"
    why = blockscaled_operands(a_dtype, b_dtype, scale_dtype, scale_block, a_major, b_major)
    if why is not None:
        return f"XLA ops: {why}"
    if out_dtype not in KERNEL_OUT_DTYPES or c_dtype is not None:
        return f"XLA ops: the block-scaled epilogue writes {KERNEL_OUT_DTYPES} and reads no C"
    quantum = max(tma_quantum_bits(OPERAND_BITS[a_dtype]), tma_quantum_bits(OPERAND_BITS[b_dtype]))
    if k % scale_block or k % quantum:
        return (
            f"XLA ops: k={k} must be a multiple of the scale block ({scale_block}) and of "
            f"{quantum} (16 bytes of {a_dtype} rows, for TMA)"
        )
    if n % tma_quantum(out_dtype):
        return f"XLA ops: n={n} of {out_dtype} rows is not a multiple of 16 bytes (TMA stores)"
    return None


# The input dtypes the quantize_both kernel reads and the block it quantizes (both dims).
QUANTIZE_IN_DTYPES = ("bfloat16", "float16", "float32")
QUANTIZE_TILE = 128
# The recipes the quantize_both kernel writes: scales per 1 x 128 block of each orientation
# (activations, cotangents), or one per 128 x 128 tile for both (weights).
QUANTIZE_ROW_RECIPE = "fp8_block128"
QUANTIZE_TILE_RECIPE = "fp8_block128x128"
QUANTIZE_RECIPES = (QUANTIZE_ROW_RECIPE, QUANTIZE_TILE_RECIPE)
# Its tensor arguments (input, data, scales, transposed data, their scales): the custom call's
# `names` attribute, by which a compiled module's quantizations are told from its products.
QUANTIZE_TENSORS = ("x", "q", "s", "qt", "st")
MAX_GRID_YZ = 65535


def quantize_both_support(rows: int, cols: int, batch: int, in_dtype: str, data_dtype: str
                          ) -> str | None:  # fmt: skip
    """None when the quantize_both kernel takes an [batch, rows, cols] input of `in_dtype`
    quantized to `data_dtype`, else why not (the call then runs XLA's quantizations)."""
    if in_dtype not in QUANTIZE_IN_DTYPES:
        return f"the kernel reads {QUANTIZE_IN_DTYPES}, not {in_dtype}"
    if data_dtype not in FP8_DTYPES:
        return f"the kernel writes {FP8_DTYPES} data, not {data_dtype}"
    if rows % QUANTIZE_TILE or cols % QUANTIZE_TILE or not rows * cols * batch:
        return (f"[{batch}, {rows}, {cols}] is not whole, non-empty {QUANTIZE_TILE} x "
                f"{QUANTIZE_TILE} tiles")  # fmt: skip
    if max(rows, cols, batch) > MAX_EXTENT:
        return f"an extent of [{batch}, {rows}, {cols}] is past the kernel's int32 range"
    if rows // QUANTIZE_TILE > MAX_GRID_YZ or batch > MAX_GRID_YZ:
        # The grid is (cols / 128, rows / 128, batch); CUDA's y and z extents stop at 65535.
        return f"[{batch}, {rows}, {cols}] needs a grid past CUDA's {MAX_GRID_YZ} y or z blocks"
    return None


def tma_quantum_bits(bits: int) -> int:
    """Elements of `bits` bits in one 16-byte TMA unit."""
    return TMA_ALIGN_BYTES * 8 // bits
