"""The plan's types: what a call computes (`GemmProblem`) and how it runs (`GemmPlan`), with the
resource arithmetic every plan is checked against (shared memory, TMEM, epilogue tiles, grid).

A `GemmPlan`'s init fields are choices; `__post_init__` derives the rest and checks every rule in
constraints.py, so an edit made with `dataclasses.replace` either holds or raises `PlanError`.
The planners that choose (sm90.py, sm100.py) and the entry points (`plan`, in __init__.py) are
beside it.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from typing import ClassVar

import numpy as np

from jax_sm100._src import constraints as C
from jax_sm100._src.constraints import (
    KERNEL_SM90,
    KERNEL_SM90_GROUPED,
    KERNEL_SM90_SCALED,
    KERNEL_SM90_SPLITK,
    KERNEL_SM100,
    KERNEL_SM100_BLOCKSCALED,
    KERNEL_SM100_GROUPED,
    KERNEL_XLA,
    KERNELS,
)

# A grouped problem's ragged mode: "m" (rows of A and D in groups, one B per group: ragged_dot
# and its d lhs) or "k" (the contraction in groups, one D per group: ragged_dot's d rhs).
RAGGED_MODES = ("", "m", "k")
# The kernels of grouped problems, one per arch (kernels/grouped.py holds what they share).
GROUPED_KERNELS = (KERNEL_SM90_GROUPED, KERNEL_SM100_GROUPED)
# The clusters each grouped kernel takes (kernels/grouped.py): CTAs paired along M inside one
# group (B multicast), with 1-CTA MMAs on sm_100a.
GROUPED_CLUSTERS = {KERNEL_SM90_GROUPED: ((1, 1), (2, 1)), KERNEL_SM100_GROUPED: ((1, 1), (2, 1))}
# Grouped problems: more groups than this keep the group table from leaving room for the stage
# ring, so they run on XLA's ragged dot; and the running row sums of the table (and the ragged
# TMA view's extent, kernels/grouped.py) hold fewer than 2^30 rows.
MAX_GROUPS = 4096
# Ragged-rows mode walks a group's work tiles along N first (every n tile of an m tile, then the
# next m tile) when one group's B is at most this many bytes: the clusters in flight then share
# a few m tiles' rows of A and the group's whole B in L2, each read from memory about once. Along
# M first (for larger B), the clusters in flight share one n tile of B, and a group of more rows
# than L2 holds is read again for every n tile.
GROUPED_N_FIRST_MAX_B_BYTES = 16 << 20
MAX_GROUPED_ROWS = 2**30

# SMs of the parts each arch is planned for by default: B200 (148) and H100/H200 SXM (132).
# Calls plan for their device's own count (dispatch.Target).
DEFAULT_NUM_SMS = {"sm_100a": 148, "sm_90a": 132}


def _dsl():
    """nvidia-cutlass-dsl's planning helpers (imported lazily: importing the DSL takes ~1 s)."""
    import cutlass.utils  # noqa: PLC0415

    return cutlass.utils


@functools.cache
def smem_capacity(arch: str) -> int:
    """Shared memory per CTA, from the DSL's capacity table."""
    from cutlass.cutlass_dsl.cutlass import SMEM_CAPACITY_MAP  # noqa: PLC0415

    return SMEM_CAPACITY_MAP[arch.rstrip("a")]


@functools.cache
def _sm90_epi_tile(cta_m: int, cta_n: int, out_dtype: str, pingpong: bool = False, epi_n: int = 0):
    """The rule of the DSL's `sm90.compute_tile_shape_or_override`, restated in plain ints, with
    the width cut to divide the tile's N (176-column tiles: 16; the DSL's rule takes 32).

    Calling the helper itself needs an MLIR context (it sizes tuples with cute.size); a context
    created outside the DSL's own compile corrupts the heap once the DSL later compiles in the
    same process (seen 2026-11-29: "malloc(): unaligned tcache chunk detected" in the next
    compile's context creation), so the planner must not create one.

    A ping-pong warp group holds all rows of its tile, in 64-row MMA blocks; its epilogue
    sub-tiles are 64 rows, one MMA block each (the kernel walks sub-tiles in register order, which
    for a 128-row tile in one warp group goes block by block).
    """
    bits = C.DTYPE_BITS.get(out_dtype, 32)
    if cta_m > 64 and not pingpong:  # cooperative: two consumer warp groups share the M extent
        rows, cols = min(128, cta_m), min(32, cta_n)
    else:
        rows, cols = 64, min(64 if bits == 8 else 32, cta_n)
    cols = math.gcd(cols, cta_n)  # 176-column tiles: sub-tiles of 16
    if epi_n:
        if epi_n % 16 or epi_n > cta_n or cta_n % epi_n:
            raise C.PlanError(
                f"epi_n={epi_n} must be a multiple of 16 that divides the tile's N ({cta_n})"
            )
        cols = epi_n
    return rows, cols


def epi_smem_bytes(
    arch, epi_tile, num_epi_stages, out_dtype, c_dtype, split_k, pingpong=False, cta_mn=None,
    split_reduce="xla", preact_out=False, stage_c=False,
) -> int:  # fmt: skip
    """Shared memory of the epilogue's staging buffers.

    D is staged through SMEM for its TMA store, in float32 for split-K partials; so is the
    pre-activation Z when the epilogue also writes it (`preact_out`, D's dtype). SM100 kernels
    also stage C through SMEM (a TMA load); SM90 kernels read C from global memory in registers,
    or stage it too with `stage_c`.
    A ping-pong SM90 kernel has one set of buffers per consumer warp group. An in-cluster split-K
    kernel instead holds its whole float32 partial tile (`cta_mn`, rows padded by
    `C.SPLITK_ROW_PAD`), which the cluster reads back (and writes D and Z from registers).
    """
    if split_k > 1 and split_reduce == "cluster":
        return cta_mn[0] * (cta_mn[1] + C.SPLITK_ROW_PAD) * 4
    d_bits = 32 if split_k > 1 else C.DTYPE_BITS[out_dtype] * (2 if preact_out else 1)
    c_bits = C.DTYPE_BITS[c_dtype] if (c_dtype and (arch == "sm_100a" or stage_c)) else 0
    groups = 2 if pingpong else 1
    return epi_tile[0] * epi_tile[1] * num_epi_stages * groups * (d_bits + c_bits) // 8


def group_table_bytes(groups: int) -> int:
    """Shared memory of a grouped kernel's group table: each group's first row and first work
    tile, plus the end and the rows past the last group (two int32 per entry)."""
    return 8 * (groups + 2) if groups else 0


def grouped_b_k_major_only(arch: str, ab_dtype: str) -> bool:
    """Whether the grouped kernel on `arch` reads `ab_dtype` experts only K-major ([g, n, k]):
    sm_90a's fp8 wgmma takes K-major operands only. ragged_dot's CUDA lowering then gives the
    kernel its [g, k, n] experts transposed by XLA (ragged_gpu.lower)."""
    return C.wgmma_k_major_only(arch, ab_dtype)


def grouped_layout_support(ragged: str, a_major: str, b_major: str) -> str | None:
    """Why the grouped kernels do not read operands in these layouts, or None (the one rule
    the planner and `GroupedGemm.why_not` both apply)."""
    if ragged == "m" and a_major != "k":
        return "ragged rows need a K-major A"
    if ragged == "k" and (a_major, b_major) != ("m", "n"):
        return "a ragged contraction takes A M-major and B N-major (rows outermost)"
    return None


def grouped_support(common) -> str | None:
    """Why no grouped kernel runs the grouped problem in `common` (GemmPlan's problem fields
    and arch), or None: the group table's and the ragged view's limits, the operand layouts
    the grouped kernels read (`grouped_layout_support`), and on sm_90a the weight gradient's M-
    and N-major operands, which fp8 wgmma does not take."""
    g, ragged = common["groups"], common["ragged"]
    rows = common["m"] if ragged == "m" else common["k"]
    if g > MAX_GROUPS:
        return f"XLA ragged dot: {g} groups (the grouped kernel takes up to {MAX_GROUPS})"
    layout = grouped_layout_support(ragged, common["a_major"], common["b_major"])
    if layout is not None:
        return f"XLA ragged dot: {layout}"
    if rows >= MAX_GROUPED_ROWS:
        return f"XLA ragged dot: {rows} rows (the grouped kernel takes fewer than 2^30)"
    if grouped_b_k_major_only(common["arch"], common["a_dtype"]) and ragged == "k":
        return (
            "XLA ragged dot: the weight gradient of fp8 operands would need M- and N-major "
            "fp8 wgmma, which sm_90a does not have"
        )
    if (grouped_b_k_major_only(common["arch"], common["a_dtype"]) and ragged == "m"
            and common["b_major"] != "k"):  # fmt: skip
        return (
            "XLA ragged dot: fp8 experts [g, k, n] are N-major and sm_90a fp8 wgmma needs them "
            "K-major ([g, n, k]; jax_sm100.ragged_dot transposes them so)"
        )
    return None


def grouped_raster_along_m(common) -> bool:
    """The order of a group's work tiles (GemmPlan.raster_along_m of a grouped plan): along M
    first, or along N first in ragged-rows mode when one group's B is small
    (GROUPED_N_FIRST_MAX_B_BYTES). The weight gradient's tiles keep M first."""
    if common["ragged"] != "m":
        return True
    b_bytes = common["k"] * common["n"] * C.DTYPE_BITS[common["b_dtype"]] // 8
    return b_bytes > GROUPED_N_FIRST_MAX_B_BYTES


def grouped_work_tiles(common, tile_m: int, tile_n: int) -> int:
    """The work tiles of the grouped problem in `common` for a tile_m x tile_n tile, scored
    for groups of equal size (the sizes are known only on the device): in ragged-rows mode
    each group's last m tile is partial, the waste a smaller tile_m saves (64-row tiles for
    groups of 64); in ragged-contraction mode every group has the whole [m, n] grid."""
    m, n, g = common["m"], common["n"], common["groups"]
    if common["ragged"] == "m":
        per_group = max(1, math.ceil(m / g))
        return min(g, m) * math.ceil(per_group / tile_m) * math.ceil(n / tile_n)
    return g * math.ceil(m / tile_m) * math.ceil(n / tile_n)


def mma_operand_dtype(arch: str, a_dtype: str, b_dtype: str) -> str:
    """The operand dtype a plan's MMA tile is sized for: the operands' when the arch's kernels
    take them at one width (two fp8 formats included), else bfloat16 (the problem then runs on
    XLA's dot and the tile only fills the plan's fields)."""
    ops = C.KERNEL_OPERAND_DTYPES[arch] + tuple(C.SCALED_DATA_BITS)
    if a_dtype in ops and b_dtype in ops and C.OPERAND_BITS[a_dtype] == C.OPERAND_BITS[b_dtype]:
        return a_dtype
    return "bfloat16"


def _pow2_ceil(x: int) -> int:
    return 1 << max(0, (x - 1).bit_length())


@dataclasses.dataclass(frozen=True)
class GemmProblem:
    """What one call computes, as the kernels see it: `batch` GEMMs of [m, k] @ [k, n] (the
    batch folded into m where B is shared), the dtypes by name, the operand layouts, and whether
    the epilogue also writes the pre-activation. A plan is made for a problem and a target
    (`GemmPlan.problem`); everything else in the plan is a choice."""

    m: int
    n: int
    k: int
    a_dtype: str
    b_dtype: str
    out_dtype: str
    c_dtype: str | None = None
    batch: int = 1
    a_major: str = "k"
    b_major: str = "n"
    preact_out: bool = False
    # A block-scaled problem (scaled_matmul): A's rows and B's rows (D's columns) each scaled
    # per `scale_block` elements of k by factors of `scale_dtype`; None and 0 when unscaled.
    scale_dtype: str | None = None
    scale_block: int = 0
    # The rows of B (columns of D) one of B's scales covers: 1, or 128 for weights scaled per
    # 128 x 128 tile (DeepSeek-V3's; `quantize(w, "fp8_block128x128")`). 1 when unscaled.
    b_scale_rows: int = 1
    # A grouped problem (ragged_dot): `groups` matrices, `ragged` says which extent the groups
    # partition (RAGGED_MODES); 0 and "" for a dense one. With "m", m is every group's rows
    # together and B holds one matrix per group; with "k", k is every group's rows together
    # and D holds one [m, n] matrix per group (batch stays 1).
    groups: int = 0
    ragged: str = ""


@dataclasses.dataclass(frozen=True)
class GemmPlan:
    """How one GEMM problem runs: which kernel, its tiles, cluster, TMEM and pipeline depths.

    The init fields are choices; `dataclasses.replace` may change them and `__post_init__`
    re-derives the dependent fields (`cta_tile_mnk`, `epi_tile`, TMEM columns, `smem_bytes`) and
    checks every constraint, so an illegal edit raises `PlanError` naming the rule it breaks.
    """

    arch: str
    m: int
    n: int
    k: int
    a_dtype: str
    b_dtype: str
    out_dtype: str
    kernel: str
    reason: str
    mma_tiler_mnk: tuple[int, int, int]
    cluster_shape_mn: tuple[int, int]
    use_2cta: bool
    num_ab_stages: int
    num_acc_stages: int
    num_epi_stages: int = 2
    batch: int = 1
    c_dtype: str | None = None
    a_major: str = "k"
    b_major: str = "n"
    split_k: int = 1
    split_reduce: str = "xla"
    raster_along_m: bool = True
    swizzle_size: int = 1
    pingpong: bool = False
    epi_n: int = 0
    num_sms: int = 0
    # sm_90a cooperative plans: when the output tiles do not fill the persistent clusters' last
    # wave evenly, the final (tiles mod clusters) + clusters tiles are shared out by k-blocks,
    # stream-K style, and the tiles split between two clusters meet in a float32 workspace.
    stream_k: bool = False
    # The epilogue also writes the pre-activation z = alpha * acc + beta * C + bias (a second
    # output in out_dtype, the residual of the activation's derivative under `grad`).
    preact_out: bool = False
    # sm_100a: the clusters the persistent grid launches; 0 for all that fit by the plan's own
    # resources (`resident_clusters`). The CUDA lowering sets the driver's occupancy count
    # where that is lower (clusters must fit whole GPCs).
    max_clusters: int = 0
    # sm_90a: the epilogue's C comes through a shared-memory ring per epilogue group that its
    # own producer warp fills by TMA ahead of the epilogue (as on sm_100a), instead of global
    # loads into registers. The planner takes it for ping-pong plans whose C has D's 16-bit
    # dtype (planning/sm90.py, `_sm90_pingpong_plan`).
    stage_c: bool = False
    # A block-scaled problem (GemmProblem.scale_dtype / .scale_block); its kernel is
    # KERNEL_SM90_SCALED (or XLA).
    scale_dtype: str | None = None
    scale_block: int = 0
    # GemmProblem.b_scale_rows: 128 for B scaled per 128 x 128 tile, which the block-scaled
    # kernel promotes with one FMA per accumulator (tiles of at most 128 columns, within one
    # scale tile).
    b_scale_rows: int = 1
    # KERNEL_SM90_SCALED only: each consumer warp group promotes k-tile i's fragment while its
    # wgmma batch of k-tile i + 1 runs (two fragments used in turn) instead of waiting for each
    # batch before promoting it (`tuning.with_scaled_overlap`, JAX_SM100_SCALED_OVERLAP; the
    # planner's choice for 128 x 64 tiles, and for 128 x 128 tiles of B scaled per tile; 128-row
    # tiles only).
    scaled_overlap: bool = False
    # A grouped problem (GemmProblem.groups / .ragged); its kernel is one of GROUPED_KERNELS.
    groups: int = 0
    ragged: str = ""
    # The grouped kernels (on sm_90a the cooperative schedule) in 1x1 clusters: after its first
    # work tile (its own index), each CTA takes the next from a counter in global memory (zeroed
    # every call) once its producer warp has issued the current tile's loads, instead of every
    # grid-th tile: work tiles of unequal cost (skewed group sizes) spread by when SMs are free.
    dynamic_tiles: bool = False
    # sm_90a dense plans (fp8, K-major A and B, a 16-bit result, no C; constraints.py's
    # `check_swap_ab`): the kernel runs D^T = B A^T, B as its A and A as its B, and stores D
    # M-major (`KernelSpec.d_major`), so its tiles, cluster and raster are over (n, m): a grid
    # that 128x192 tiles pad less that way round (16384 rows x 4096 columns: 0.8 % instead of
    # 3.1 %). `planning/sm90.py` says where it is taken; ignored on an XLA plan.
    swap_ab: bool = False
    cta_tile_mnk: tuple[int, int, int] = dataclasses.field(init=False)
    epi_tile: tuple[int, int] = dataclasses.field(init=False)
    acc_tmem_cols_per_stage: int = dataclasses.field(init=False)
    tmem_alloc_cols: int = dataclasses.field(init=False)
    smem_bytes: int = dataclasses.field(init=False)

    def __post_init__(self):
        setf = functools.partial(object.__setattr__, self)
        C.check_arch(self.arch)
        for name in ("m", "n", "k", "batch"):
            v = getattr(self, name)
            if not isinstance(v, (int, np.integer)) or v < 1:
                raise C.PlanError(f"{name}={v!r} must be a positive int")
        for name in ("a_dtype", "b_dtype", "out_dtype", "c_dtype"):
            v = getattr(self, name)
            bits = C.OPERAND_BITS if name in ("a_dtype", "b_dtype") else C.DTYPE_BITS
            if v is not None and v not in bits:
                raise C.PlanError(f"{name}={v!r} must be one of {tuple(bits)}")
        if not isinstance(self.max_clusters, (int, np.integer)) or self.max_clusters < 0:
            raise C.PlanError(f"max_clusters={self.max_clusters!r} must be an int >= 0")
        if self.max_clusters and self.arch != "sm_100a":
            raise C.PlanError(f"max_clusters={self.max_clusters} is an sm_100a choice; leave 0")
        if self.kernel not in KERNELS:
            raise C.PlanError(f"kernel={self.kernel!r} must be one of {KERNELS}")
        if self.a_major not in ("k", "m") or self.b_major not in ("k", "n"):
            raise C.PlanError(f"{self.a_major=} must be 'k' or 'm'; {self.b_major=}: 'k' or 'n'")
        setf("mma_tiler_mnk", tuple(int(x) for x in self.mma_tiler_mnk))
        setf("cluster_shape_mn", tuple(int(x) for x in self.cluster_shape_mn))
        if self.num_sms <= 0:
            setf("num_sms", DEFAULT_NUM_SMS[self.arch])
        sm100_kernels = (KERNEL_SM100, KERNEL_SM100_BLOCKSCALED, KERNEL_SM100_GROUPED)
        if self.kernel in sm100_kernels and self.arch != "sm_100a":
            raise C.PlanError(f"kernel={self.kernel!r} runs on sm_100a only, plan is {self.arch}")
        if self.ragged not in RAGGED_MODES or (self.groups > 0) != bool(self.ragged):
            raise C.PlanError(
                f"groups={self.groups}, ragged={self.ragged!r}: a grouped problem has groups > 0 "
                f"and ragged in {RAGGED_MODES[1:]}, a dense one 0 and ''"
            )
        if (self.kernel in GROUPED_KERNELS) != (self.groups > 0) and self.kernel != KERNEL_XLA:
            raise C.PlanError(
                f"kernel={self.kernel!r}: grouped problems run on one of {GROUPED_KERNELS} (or "
                f"{KERNEL_XLA!r}), dense ones never do"
            )
        # A grouped work tile's rows may end anywhere inside it, at a group boundary. The
        # grouped kernels pair CTAs along M inside one group (the two m tiles of a 2x1 cluster's
        # work tile share the group's B tile by multicast); the SM100 one with 1-CTA MMAs only.
        clusters = GROUPED_CLUSTERS.get(self.kernel, ((1, 1),))
        if self.groups and (self.batch != 1 or self.split_k != 1 or self.stream_k
                            or self.cluster_shape_mn not in clusters or self.use_2cta):  # fmt: skip
            raise C.PlanError(
                "a grouped plan has batch 1, no split-K or stream-K, a cluster in "
                f"{clusters} and 1-CTA MMAs; got {self.batch=}, {self.split_k=}, "
                f"{self.stream_k=}, {self.cluster_shape_mn=}, {self.use_2cta=}"
            )
        if not isinstance(self.dynamic_tiles, bool):
            raise C.PlanError(f"dynamic_tiles={self.dynamic_tiles!r} must be a bool")
        # Every edit is re-checked: a flag given as "no" or 1 would read as True, a depth of 0
        # or less reach the kernel (review helper-136).
        for name in ("use_2cta", "raster_along_m", "pingpong", "stream_k", "preact_out",
                     "stage_c", "scaled_overlap"):  # fmt: skip
            value = getattr(self, name)
            if not isinstance(value, (bool, np.bool_)):
                raise C.PlanError(f"{name}={value!r} must be a bool")
            setf(name, bool(value))
        for name, least in (("num_ab_stages", 1), ("num_acc_stages", 1), ("num_epi_stages", 1),
                            ("swizzle_size", 1), ("epi_n", 0)):  # fmt: skip
            value = getattr(self, name)
            if isinstance(value, (bool, np.bool_)) or not isinstance(value, (int, np.integer)) \
                    or value < least:  # fmt: skip
                raise C.PlanError(f"{name}={value!r} must be >= {least} (an int)")
        if self.dynamic_tiles and (self.kernel not in GROUPED_KERNELS or self.pingpong
                                   or tuple(self.cluster_shape_mn) != (1, 1)):  # fmt: skip
            raise C.PlanError(
                f"dynamic_tiles=True is a schedule of the grouped kernels {GROUPED_KERNELS} "
                f"(cooperative) in 1x1 clusters; got kernel={self.kernel!r}, {self.pingpong=}, "
                f"{self.cluster_shape_mn=}"
            )
        if self.kernel in (KERNEL_SM90, KERNEL_SM90_SPLITK, KERNEL_SM90_GROUPED) and (
            self.arch != "sm_90a"
        ):
            raise C.PlanError(f"kernel={self.kernel!r} runs on sm_90a only, plan is {self.arch}")
        _check_sm100_blockscaled(self)
        C.check_scaled(self.arch, self.kernel == KERNEL_SM90_SCALED,
                       self.kernel in (KERNEL_XLA, KERNEL_SM100_BLOCKSCALED),
                       self.scale_dtype, self.scale_block, self.mma_tiler_mnk[0], self.pingpong,
                       self.split_k, self.stream_k, self.stage_c,
                       self.mma_tiler_mnk[1])  # fmt: skip
        C.check_b_scale_rows(self.scale_dtype, self.b_scale_rows,
                             self.kernel == KERNEL_SM90_SCALED, self.mma_tiler_mnk[1])  # fmt: skip
        C.check_scaled_overlap(self.kernel == KERNEL_SM90_SCALED, self.scaled_overlap,
                               self.mma_tiler_mnk[1], self.mma_tiler_mnk[0])  # fmt: skip
        if kernels := plain_epilogue_kernels(self):
            C.check_plain_epilogue(kernels, self.c_dtype, self.preact_out)
        if self.split_k < 1 or (self.split_k > 1) != (self.kernel == KERNEL_SM90_SPLITK):
            raise C.PlanError(
                f"split_k={self.split_k} needs kernel={KERNEL_SM90_SPLITK!r} (and 1 otherwise)"
            )
        C.check_split_k(self.split_k, self.cluster_shape_mn, self.pingpong, self.split_reduce)
        ab = mma_operand_dtype(self.arch, self.a_dtype, self.b_dtype)
        C.check_mma_tiler(self.arch, self.mma_tiler_mnk, self.use_2cta, ab, self.b_major)
        C.check_cluster(self.arch, self.cluster_shape_mn, self.use_2cta)
        C.check_pingpong(self.arch, self.pingpong, self.mma_tiler_mnk)
        C.check_stream_k(
            self.arch, self.stream_k, self.pingpong, self.split_k, self.cluster_shape_mn
        )
        C.check_stage_c(self.arch, self.stage_c, self.c_dtype, self.out_dtype, self.stream_k,
                        self.split_k)  # fmt: skip
        if not isinstance(self.swap_ab, bool):
            raise C.PlanError(f"swap_ab={self.swap_ab!r} must be a bool")
        C.check_swap_ab(self.swap_ab, self.kernel, self.a_dtype, self.b_dtype, self.out_dtype,
                        self.a_major, self.b_major, self.c_dtype, self.split_k,
                        self.stream_k)  # fmt: skip
        mm, mn, mk = self.mma_tiler_mnk
        cta = (mm // 2 if self.use_2cta else mm, mn, mk)
        setf("cta_tile_mnk", cta)
        out_bits = C.DTYPE_BITS[self.out_dtype]
        c_bits = None if self.c_dtype is None else C.DTYPE_BITS[self.c_dtype]
        if self.arch == "sm_100a":
            # JAX's outputs are row-major: D and C are N-major.
            epi = _dsl().sm100.compute_epilogue_tile_size(
                cta[0], cta[1], self.use_2cta, out_bits, c_bits, False, False
            )
            cols = _dsl().sm100.compute_acc_tmem_cols_per_stage(
                cta[0], cta[1], self.use_2cta, mn, False
            )
            alloc = _pow2_ceil(
                max(C.TMEM_MIN_COLS, cols * self.num_acc_stages + scale_tmem_cols(self))
            )
            C.check_tmem(alloc)
            b_rows = mn // 2 if self.use_2cta else mn
            if self.epi_n:
                raise C.PlanError(
                    f"epi_n={self.epi_n} is an sm_90a choice; sm_100a plans take the DSL's "
                    "epilogue tile (leave epi_n=0)"
                )
        else:
            epi = _sm90_epi_tile(cta[0], cta[1], self.out_dtype, self.pingpong, self.epi_n)
            cols, alloc = 0, 0
            if self.num_acc_stages != 1:
                raise C.PlanError(f"sm_90a accumulates in registers: {self.num_acc_stages=} != 1")
            b_rows = mn
        setf("epi_tile", (int(epi[0]), int(epi[1])))
        setf("acc_tmem_cols_per_stage", int(cols))
        setf("tmem_alloc_cols", int(alloc))
        C.check_epi_tile(self.epi_tile, cta)
        ab_bits = C.OPERAND_BITS[ab]
        stage_bytes = _ab_stage_bytes(cta, b_rows, ab_bits) + scale_stage_bytes(cta, self)
        epi_bytes = self._epi_bytes
        setf(
            "smem_bytes",
            C.SMEM_RESERVED_BYTES + epi_bytes + self._table_bytes
            + self.num_ab_stages * stage_bytes,
        )  # fmt: skip
        C.check_ab_stages(self.num_ab_stages)
        C.check_smem(self.arch, self.smem_bytes, smem_capacity(self.arch))
        if self.arch == "sm_100a":
            threads = C.sm100_threads_per_cta(self.c_dtype is not None)
            C.check_tmem_residency(self.tmem_alloc_cols, self.smem_bytes, threads)
        if self.kernel != KERNEL_XLA:
            why = C.kernel_support(
                self.arch, self.m, self.n, self.k, self.a_dtype, self.b_dtype, self.out_dtype,
                self.c_dtype, self.a_major, self.b_major, self.batch, self.scale_dtype,
                self.scale_block,
            )  # fmt: skip
            if why is None and self.scale_dtype is not None and self.arch == "sm_90a":
                why = C.scaled_support(self.arch, self.k, self.a_dtype, self.b_dtype,
                                       self.scale_dtype, self.scale_block)  # fmt: skip
            if why is not None:
                raise C.PlanError(f"kernel={self.kernel!r} cannot run this problem: {why}")

    # What a compiled binary does not depend on: the problem's sizes (the kernels take them at
    # run time) and the prose reason. Plans that differ only in these share a binary.
    RUNTIME_FIELDS: ClassVar[tuple[str, ...]] = ("m", "n", "k", "batch", "reason")

    @property
    def problem(self) -> GemmProblem:
        """The problem this plan was made for (its other fields are choices and their
        consequences)."""
        return GemmProblem(**{f.name: getattr(self, f.name) for f in _PROBLEM_FIELDS})

    def for_problem(self, problem: GemmProblem) -> GemmPlan:
        """The same choices for another problem (e.g. one device's share of a sharded call),
        re-checked: PlanError where they do not fit it. A staged C (`stage_c`) is dropped where
        the problem has no C of the output's dtype (a k-sharded partial product)."""
        fields = dataclasses.asdict(problem)
        if self.stage_c and (problem.c_dtype is None or problem.c_dtype != problem.out_dtype):
            fields["stage_c"] = False
        return dataclasses.replace(self, **fields)

    def binary_fields(self) -> tuple[tuple[str, object], ...]:
        """(name, value) of every field a compiled binary depends on (all but
        `RUNTIME_FIELDS`), for cache keys."""
        return tuple(
            (f.name, getattr(self, f.name))
            for f in dataclasses.fields(self)
            if f.name not in self.RUNTIME_FIELDS
        )

    @property
    def ab_stage_bytes(self) -> int:
        rest = C.SMEM_RESERVED_BYTES + self._epi_bytes + self._table_bytes
        return (self.smem_bytes - rest) // self.num_ab_stages

    @property
    def _table_bytes(self) -> int:
        """The group table's SMEM, and the work ring's with `dynamic_tiles`: a grouped
        kernel's (an XLA plan's tile fields hold none)."""
        if self.kernel not in GROUPED_KERNELS:
            return 0
        ring = C.GROUPED_WORK_RING_BYTES if self.dynamic_tiles else 0
        table = group_table_bytes(self.groups) + ring
        if self.arch == "sm_90a":
            # The stage barriers, ring and table come first and A's stages start at the next
            # 1024-byte boundary: beyond the reserve, the whole KiBs they reach into.
            front = C.SM90_BARRIER_BYTES_MAX + table
            table = max(table, -(-front // 1024) * 1024 - C.SMEM_RESERVED_BYTES)
        return table

    @property
    def _epi_bytes(self) -> int:
        return epi_smem_bytes(
            self.arch, self.epi_tile, self.num_epi_stages, self.out_dtype, self.c_dtype,
            self.split_k, self.pingpong, self.cta_tile_mnk[:2], self.split_reduce,
            self.preact_out, self.stage_c,
        )  # fmt: skip

    def _grid_text(self) -> str:
        size = self.cluster_shape_mn[0] * self.cluster_shape_mn[1]
        if self.arch == "sm_90a":
            return f"auto ({max(1, self.num_sms // size)} clusters of {size})"
        how = "the driver's occupancy" if self.max_clusters else "from the plan's resources"
        return f"{grid_clusters(self)} clusters of {size} ({how})"

    @property
    def num_tiles(self) -> int:
        """Output tiles of the whole problem (per split), counting the batch."""
        cm, cn, _ = self.cta_tile_mnk
        m, n = self.kernel_mn
        return math.ceil(m / cm) * math.ceil(n / cn) * self.batch

    @property
    def kernel_mn(self) -> tuple[int, int]:
        """(m, n) as the kernel sees them: (n, m) for a swapped plan (`swap_ab`)."""
        return (self.n, self.m) if self.swap_ab else (self.m, self.n)

    def _grouped_tiles_text(self) -> str:
        """CTA tiles: a cluster's work tile is `cluster_shape_mn[0]` of them along M."""
        cm, cn, _ = self.cta_tile_mnk
        pair = self.cluster_shape_mn[0]
        tn = math.ceil(self.n / cn) * pair
        rows = math.ceil(self.m / (cm * pair))
        if self.ragged == "k":
            return f"{self.groups * rows * tn} ({self.groups} x the [m, n] grid)"
        low, high = rows * tn, (rows + self.groups + 1) * tn
        return f"{low} to {high} (by the group sizes, read on the device)"

    def __str__(self) -> str:
        rows = [("problem", f"{self.batch} x [{self.m} x {self.k}] @ [{self.k} x {self.n}]")]
        if self.groups:
            split = {"m": "m (rows of A and D)", "k": "k (one D per group)"}[self.ragged]
            rows = [
                ("problem", f"[{self.m} x {self.k}] @ [{self.k} x {self.n}] in groups"),
                ("groups", f"{self.groups}, ragged {split}"),
            ]
        else:
            rows.append(("groups", "none (dense; ragged: none)"))
        dt = f"{self.a_dtype} x {self.b_dtype} -> {self.out_dtype}"
        if self.c_dtype:
            dt += f" (C: {self.c_dtype})"
        rows += [
            ("dtypes", dt),
            ("layouts", f"A {self.a_major}-major, B {self.b_major}-major, D n-major (row-major "
                        "[m, n], as the caller reads it)"),
            ("swap_ab", "yes: the kernel runs D^T = B A^T (B as its A, A as its B) and stores "
                        "D^T M-major, i.e. D row-major; tiles, cluster and raster are over (n, m)"
                        if self.swap_ab else "no"),
            ("arch", f"{self.arch} ({self.num_sms} SMs)"),
            ("kernel", self.kernel),
            ("reason", self.reason),
        ]  # fmt: skip
        scales = "none (unscaled; scale_block 0, b_scale_rows 1)"
        if self.scale_dtype is not None:
            b_rows = (
                "each row of B (b_scale_rows 1)"
                if self.b_scale_rows == 1
                else f"each {self.b_scale_rows} rows of B (b_scale_rows)"
            )
            scales = (f"{self.scale_dtype} per {self.scale_block} of k (scale_block), for each "
                      f"row of A and {b_rows}")  # fmt: skip
        rows.insert(2, ("scale_dtype", scales))
        if self.kernel == KERNEL_XLA:
            # XLA's dot runs it: no arch's hardware is involved, and the tile fields are
            # placeholders, not what runs.
            rows = [r for r in rows if r[0] not in ("arch", "swap_ab")]
            width = max(len(r[0]) for r in rows)
            return "\n".join(f"{name.ljust(width)}  {value}" for name, value in rows)
        rows += [
            ("mma_tiler_mnk", self.mma_tiler_mnk),
            ("cta_tile_mnk", self.cta_tile_mnk),
            ("cluster_shape_mn", self.cluster_shape_mn),
            ("use_2cta", self.use_2cta),
            ("epi_tile", self.epi_tile),
            ("acc_tmem_cols_per_stage", self.acc_tmem_cols_per_stage),
            ("num_acc_stages", self.num_acc_stages),
            ("tmem_alloc_cols", self.tmem_alloc_cols),
            ("num_ab_stages", self.num_ab_stages),
            ("num_epi_stages", self.num_epi_stages),
            ("smem_bytes", f"{self.smem_bytes} of {smem_capacity(self.arch)}"),
            ("split_k", self.split_k),
            ("split_reduce", self.split_reduce),
            ("pingpong", self.pingpong),
            ("stream_k", self.stream_k),
            ("preact_out", self.preact_out),
            ("stage_c", self.stage_c),
            ("scaled_overlap", self.scaled_overlap),
            ("max_clusters", self._grid_text()),
            ("epi_n", self.epi_n or "auto"),
            ("raster", f"{'along M' if self.raster_along_m else 'along N'}, "
                       f"swizzle {self.swizzle_size}"),
            ("tiles", self.num_tiles if not self.groups else self._grouped_tiles_text()),
            ("dynamic_tiles", self.dynamic_tiles),
        ]  # fmt: skip
        width = max(len(r[0]) for r in rows)
        return "\n".join(f"{name.ljust(width)}  {value}" for name, value in rows)


_PROBLEM_FIELDS = dataclasses.fields(GemmProblem)


def _check_sm100_blockscaled(plan: GemmPlan) -> None:
    """The sm_100a block-scaled kernel runs block-scaled problems only, under constraints.py's
    `check_sm100_blockscaled`."""
    if plan.kernel != KERNEL_SM100_BLOCKSCALED:
        return
    if plan.scale_dtype is None:
        raise C.PlanError(f"kernel={plan.kernel!r} needs a block-scaled problem (scale_dtype)")
    C.check_sm100_blockscaled(
        plan.mma_tiler_mnk, plan.use_2cta, plan.a_dtype, plan.b_dtype, plan.scale_dtype,
        plan.scale_block, plan.a_major, plan.b_major,
    )  # fmt: skip


def plain_epilogue_kernels(plan: GemmPlan) -> str:
    """The kernels (block-scaled or grouped) whose epilogue is plain (`C.check_plain_epilogue`)
    that `plan` runs, or "" for a dense plan."""
    if plan.scale_dtype is not None:
        return "block-scaled kernels"
    return "grouped kernels" if plan.groups else ""


def scale_tmem_cols(plan: GemmPlan) -> int:
    """TMEM columns of one K tile's scale factors in an sm_100a block-scaled plan (else 0)."""
    if plan.kernel != KERNEL_SM100_BLOCKSCALED:
        return 0
    return blockscaled_tmem_cols(plan.mma_tiler_mnk, plan.use_2cta, plan.scale_block)


def blockscaled_tmem_cols(mma_tiler_mnk, use_2cta: bool, scale_block: int) -> int:
    """TMEM columns of one K tile's scale factors on sm_100a: every 512-byte atom (128 rows by 4
    blocks of k) of the CTA's A rows and of B's N (whole atoms) takes 4 columns of all 128
    lanes (its 32 lanes of 16 bytes copied to each lane quarter), as the DSL's
    `make_tmem_layout_sfa/sfb` lay them out; the kernel checks that the two agree."""
    mm, mn, mk = mma_tiler_mnk
    cta_m = mm // 2 if use_2cta else mm
    atoms_k = mk // (scale_block * C.SCALE_ATOM_BLOCKS)
    rows = _round_up(cta_m, C.SCALE_ATOM_ROWS) + _round_up(mn, C.SCALE_ATOM_ROWS)
    return 4 * atoms_k * rows // C.SCALE_ATOM_ROWS


def blockscaled_stage_bytes(mma_tiler_mnk, use_2cta, scale_dtype, scale_block) -> tuple[int, int]:
    """(A's, B's) scale-factor bytes in one A/B stage of the sm_100a block-scaled kernel: the
    CTA's rows of A and the whole N of B (rounded up to whole 128-row atoms), one factor per
    block of the K tile."""
    mm, mn, mk = mma_tiler_mnk
    cta_m = mm // 2 if use_2cta else mm
    per_row = mk // scale_block * C.SCALE_DTYPE_BITS[scale_dtype] // 8
    return (_round_up(cta_m, C.SCALE_ATOM_ROWS) * per_row,
            _round_up(mn, C.SCALE_ATOM_ROWS) * per_row)  # fmt: skip


def _round_up(x: int, q: int) -> int:
    return -(-x // q) * q


def _ab_stage_bytes(cta, b_rows, ab_bits) -> int:
    """Shared memory of one A/B pipeline stage: the CTA's A tile and its (share of the) B tile."""
    return (cta[0] + b_rows) * cta[2] * ab_bits // 8


def scale_stage_bytes(cta, problem) -> int:
    """Shared memory of one stage's scale factors (a block-scaled problem's; 0 otherwise): one
    per row of the stage's A tile and one per row of its B tile (column of D), for its k-block;
    B scaled per 128-row tile, a window of its tiles' (`C.B_SCALE_TILE_WINDOW`) at an aligned
    stride (kernels/sm90_scaled.py)."""
    if problem.scale_dtype is None:
        return 0
    if getattr(problem, "kernel", None) == KERNEL_SM100_BLOCKSCALED:
        return sum(blockscaled_stage_bytes(problem.mma_tiler_mnk, problem.use_2cta,
                                           problem.scale_dtype, problem.scale_block))  # fmt: skip
    bits = C.SCALE_DTYPE_BITS[problem.scale_dtype]
    if problem.b_scale_rows > 1:
        return cta[0] * bits // 8 + C.b_tile_scale_stage_bytes(bits)
    return (cta[0] + cta[1]) * bits // 8


def _max_ab_stages(arch, cta, b_rows, ab_bits, epi_bytes) -> int:
    stage = _ab_stage_bytes(cta, b_rows, ab_bits)
    return (smem_capacity(arch) - C.SMEM_RESERVED_BYTES - epi_bytes) // stage


def resident_clusters(plan: GemmPlan) -> int:
    """Clusters of `plan` that can be resident at once, from its resources alone: the SMs' CTA
    slots (`constraints.max_resident_ctas`, one per SM for every plan the planner makes, which
    fill shared memory) divided into clusters. sm_100a only (SM90 grids are `num_sms // size`)."""
    size = plan.cluster_shape_mn[0] * plan.cluster_shape_mn[1]
    threads = C.sm100_threads_per_cta(plan.c_dtype is not None)
    per_sm = C.max_resident_ctas(plan.smem_bytes, threads)
    return max(1, plan.num_sms * per_sm // size)


def grid_clusters(plan: GemmPlan) -> int:
    """The clusters an sm_100a plan's persistent grid launches."""
    return plan.max_clusters or resident_clusters(plan)


def _wave_cost(tiles: int, ctas_per_tile: int, num_sms: int, area: int, eff: float) -> float:
    # A 2-CTA tile is computed by two SMs: each wave costs half its area per SM.
    slots = max(1, num_sms // ctas_per_tile)
    return math.ceil(tiles / slots) * (area / ctas_per_tile) / eff
