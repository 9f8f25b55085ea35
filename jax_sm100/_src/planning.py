"""The trace-time GEMM planner: problem sizes and dtypes in, a frozen `GemmPlan` out.

Pure Python over ints and dtype widths; it imports nvidia-cutlass-dsl only for its planning
helpers (`compute_epilogue_tile_size`, `compute_acc_tmem_cols_per_stage`, the SMEM capacity
table), which need no GPU. Legality is decided by `constraints.py`; this module chooses.

Tile choice (both arches)
-------------------------
Every candidate tile is scored with a wave model: a persistent kernel runs
`ceil(tiles / ctas_per_wave)` waves, and each wave costs the time of one tile, which is the tile's
area divided by how efficiently that tile shape feeds the tensor cores. The efficiencies are the
usual ranking of CUTLASS's own defaults (its persistent examples default to the largest tile, and
smaller tiles lose to operand re-loads from L2): on SM100 a 2-CTA 256x256 MMA (one 128x256 tile
per SM) is best, a 1-CTA 128x256 close, then 128-wide N tiles, with 64-row tiles last; on SM90
128x256 with two consumer warp groups, then 128x128 and 64-row tiles. Big problems so
land on the biggest tiles, and problems with few tiles trade tile size for filled SMs.

Skinny problems (m <= 256 with large k and few output tiles) on sm_90a get a split-K plan, which
spreads K over idle SMs; the partial products are reduced in float32 before the epilogue, by XLA
(`split_reduce="xla"`, the planner's choice) or inside the kernel by a (1, split_k) cluster
(`split_reduce="cluster"`, `with_split(plan, s, reduce="cluster")`; correct on the H200 but
slower there so far: benchmarks/RESULTS.md).

Small sm_90a problems (under `SM90_MIN_FLOPS`, or `SM90_SPLITK_MIN_FLOPS` for split-K) are planned
onto XLA's dot, which the H200 measurements put ahead there; `force_kernel=True` overrides.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import os

import numpy as np

from jax_sm100._src import constraints as C

KERNEL_SM100 = "sm100_tcgen05"
KERNEL_SM90 = "sm90_wgmma"
KERNEL_SM90_SPLITK = "sm90_wgmma_splitk"
KERNEL_XLA = "xla_dot"
KERNELS = (KERNEL_SM100, KERNEL_SM90, KERNEL_SM90_SPLITK, KERNEL_XLA)

# SMs of the parts each arch is planned for by default: B200 (148) and H100/H200 SXM (132).
# The CUDA lowering replaces this with the device's own count.
DEFAULT_NUM_SMS = {"sm_100a": 148, "sm_90a": 132}

# Relative tensor-core efficiency of each tile (see the module docstring).
_SM100_CANDIDATES = (
    # (use_2cta, mma_m, mma_n, efficiency)
    (True, 256, 256, 1.00),
    (False, 128, 256, 0.96),
    (True, 256, 128, 0.92),
    (False, 128, 128, 0.86),
    (True, 128, 256, 0.80),
    (False, 64, 256, 0.70),
    (False, 64, 128, 0.62),
)
_SM90_CANDIDATES = (
    # (tile_m, tile_n, efficiency), cooperative. 256x128 and a cooperative 128x160 run
    # correctly on the H200 but were not faster than 128x256 there (benchmarks/RESULTS.md,
    # third session): plan options only.
    (128, 256, 1.00),
    (128, 128, 0.85),
    (64, 256, 0.72),
    (64, 128, 0.62),
)
# Ping-pong tiles (one warp group per tile, so its epilogue hides under the other group's main
# loop), walked along N in bands of 8 cluster rows. H200, device method, sixth session
# (benchmarks/RESULTS.md): 128x160 / 128x192 ping-pong with clusters of 2x1 beat the best
# cooperative 128x256 plan by 1-4 % at 16384x4096x4096, 8192^3 and 4096x14336x4096, the one of
# the two that wastes the least last wave winning each time; the efficiency below puts that
# per-tile gain into the wave model. Taken only for many waves of 16-bit tiles (measured there).
_SM90_PINGPONG_CANDIDATES = (
    (128, 160, 1.03),
    (128, 192, 1.03),
)
SM90_PINGPONG_MIN_WAVES = 8


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
    """The rule of the DSL's `sm90.compute_tile_shape_or_override`, restated in plain ints.

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

    @property
    def flops(self) -> int:
        return 2 * self.m * self.n * self.k * self.batch


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
    # sm_90a: the epilogue's C comes through a shared-memory ring that a producer warp fills by
    # TMA ahead of the epilogue (as on sm_100a), instead of global loads into registers. A plan
    # option, off in the planner: compiled and PTX-checked, not yet run on a GPU (2026-12-01).
    stage_c: bool = False
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
            if v is not None and v not in C.DTYPE_BITS:
                raise C.PlanError(f"{name}={v!r} must be one of {tuple(C.DTYPE_BITS)}")
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
        if self.kernel == KERNEL_SM100 and self.arch != "sm_100a":
            raise C.PlanError(f"kernel={self.kernel!r} runs on sm_100a only, plan is {self.arch}")
        if self.kernel in (KERNEL_SM90, KERNEL_SM90_SPLITK) and self.arch != "sm_90a":
            raise C.PlanError(f"kernel={self.kernel!r} runs on sm_90a only, plan is {self.arch}")
        if self.split_k < 1 or (self.split_k > 1) != (self.kernel == KERNEL_SM90_SPLITK):
            raise C.PlanError(
                f"split_k={self.split_k} needs kernel={KERNEL_SM90_SPLITK!r} (and 1 otherwise)"
            )
        C.check_split_k(self.split_k, self.cluster_shape_mn, self.pingpong, self.split_reduce)
        ab = self.a_dtype if self.a_dtype in C.KERNEL_OPERAND_DTYPES[self.arch] else "bfloat16"
        C.check_mma_tiler(self.arch, self.mma_tiler_mnk, self.use_2cta, ab, self.b_major)
        C.check_cluster(self.arch, self.cluster_shape_mn, self.use_2cta)
        C.check_pingpong(self.arch, self.pingpong, self.mma_tiler_mnk)
        C.check_stream_k(
            self.arch, self.stream_k, self.pingpong, self.split_k, self.cluster_shape_mn
        )
        C.check_stage_c(self.arch, self.stage_c, self.c_dtype, self.out_dtype, self.stream_k,
                        self.split_k)  # fmt: skip
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
            if self.num_acc_stages < 1:
                raise C.PlanError(f"{self.num_acc_stages=} must be >= 1")
            alloc = _pow2_ceil(max(C.TMEM_MIN_COLS, cols * self.num_acc_stages))
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
        ab_bits = C.DTYPE_BITS[ab]
        stage_bytes = _ab_stage_bytes(cta, b_rows, ab_bits)
        epi_bytes = self._epi_bytes
        setf("smem_bytes", C.SMEM_RESERVED_BYTES + epi_bytes + self.num_ab_stages * stage_bytes)
        C.check_ab_stages(self.num_ab_stages)
        C.check_smem(self.arch, self.smem_bytes, smem_capacity(self.arch))
        if self.arch == "sm_100a":
            threads = C.sm100_threads_per_cta(self.c_dtype is not None)
            C.check_tmem_residency(self.tmem_alloc_cols, self.smem_bytes, threads)
        if self.kernel != KERNEL_XLA:
            why = C.kernel_support(
                self.arch, self.m, self.n, self.k, self.a_dtype, self.b_dtype, self.out_dtype,
                self.c_dtype, self.a_major, self.b_major,
            )  # fmt: skip
            if why is not None:
                raise C.PlanError(f"kernel={self.kernel!r} cannot run this problem: {why}")

    @property
    def problem(self) -> GemmProblem:
        """The problem this plan was made for (its other fields are choices and their
        consequences)."""
        return GemmProblem(**{f.name: getattr(self, f.name) for f in _PROBLEM_FIELDS})

    @property
    def ab_stage_bytes(self) -> int:
        return (self.smem_bytes - C.SMEM_RESERVED_BYTES - self._epi_bytes) // self.num_ab_stages

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
        return math.ceil(self.m / cm) * math.ceil(self.n / cn) * self.batch

    def __str__(self) -> str:
        rows = [("problem", f"{self.batch} x [{self.m} x {self.k}] @ [{self.k} x {self.n}]")]
        dt = f"{self.a_dtype} x {self.b_dtype} -> {self.out_dtype}"
        if self.c_dtype:
            dt += f" (C: {self.c_dtype})"
        rows += [
            ("dtypes", dt),
            ("layouts", f"A {self.a_major}-major, B {self.b_major}-major, D n-major"),
            ("arch", f"{self.arch} ({self.num_sms} SMs)"),
            ("kernel", self.kernel),
            ("reason", self.reason),
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
            ("max_clusters", self._grid_text()),
            ("epi_n", self.epi_n or "auto"),
            ("raster", f"{'along M' if self.raster_along_m else 'along N'}, "
                       f"swizzle {self.swizzle_size}"),
            ("tiles", self.num_tiles),
        ]  # fmt: skip
        width = max(len(r[0]) for r in rows)
        return "\n".join(f"{name.ljust(width)}  {value}" for name, value in rows)


_PROBLEM_FIELDS = dataclasses.fields(GemmProblem)


def _ab_stage_bytes(cta, b_rows, ab_bits) -> int:
    """Shared memory of one A/B pipeline stage: the CTA's A tile and its (share of the) B tile."""
    return (cta[0] + b_rows) * cta[2] * ab_bits // 8


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


def sm90_variant(plan: GemmPlan, *, tile_mn=None, cluster_mn=None, pingpong=None, **changes):
    """`plan` with another SM90 tile, cluster or schedule, its A/B stages refilled to the SMEM left.

    For tuning and tests: `dataclasses.replace` keeps `num_ab_stages`, which is rarely right for
    another tile. Other plan fields (swizzle_size, raster_along_m, ...) pass through `changes`.
    Asking for ping-pong, or clusters of more than 2 CTAs, turns stream-K off unless `stream_k`
    is given. A new tile or cluster keeps the plan's swizzle only where it still divides the
    cluster columns (rows for a raster along N; see `_sm90_swizzle`), unless `swizzle_size` is
    given.
    Raises PlanError for an illegal combination, like any plan edit.
    """
    if plan.arch != "sm_90a":
        raise C.PlanError(f"sm90_variant takes an sm_90a plan, got {plan.arch}")
    tm, tn = tile_mn or plan.cta_tile_mnk[:2]
    epi_stages = changes.pop("num_epi_stages", None)
    cluster = tuple(cluster_mn or plan.cluster_shape_mn)
    if pingpong or cluster[0] * cluster[1] > 2:
        changes.setdefault("stream_k", False)
    along_m = changes.get("raster_along_m", plan.raster_along_m)
    if _swizzled_extent(plan.m, plan.n, (tm, tn), cluster, along_m) % plan.swizzle_size:
        changes.setdefault("swizzle_size", 1)
    edited = dataclasses.replace(
        plan,
        mma_tiler_mnk=(tm, tn, plan.mma_tiler_mnk[2]),
        cluster_shape_mn=cluster,
        pingpong=plan.pingpong if pingpong is None else bool(pingpong),
        num_ab_stages=C.MIN_AB_STAGES,
        **changes,
    )
    # The edited plan has derived its epilogue and stage sizes; fill the SMEM that is left.
    return _fill_sm90_smem(edited, epi_stages)


def _fill_sm90_smem(plan: GemmPlan, epi_stages: int | None = None) -> GemmPlan:
    """`plan` with its shared memory refilled: with `epi_stages` given, that epilogue depth and
    as many A/B stages as fit beside it; else as many A/B stages as fit beside a 2-deep epilogue
    ring, then, for a swizzled raster, the epilogue ring deepened with what is left (up to
    `SM90_MAX_EPI_STAGES`)."""
    free = smem_capacity(plan.arch) - C.SMEM_RESERVED_BYTES
    base = dataclasses.replace(plan, num_epi_stages=epi_stages or 2, num_ab_stages=C.MIN_AB_STAGES)
    stages = (free - base._epi_bytes) // base.ab_stage_bytes
    depth = base.num_epi_stages
    in_cluster = plan.split_k > 1 and plan.split_reduce == "cluster"
    if epi_stages is None and plan.swizzle_size > 1 and not in_cluster:
        # (An in-cluster split stages its whole partial tile, whatever the depth.)
        left = free - base._epi_bytes - stages * base.ab_stage_bytes
        depth = min(SM90_MAX_EPI_STAGES, depth + left // (base._epi_bytes // depth))
    return dataclasses.replace(base, num_ab_stages=stages, num_epi_stages=depth)


def _wave_cost(tiles: int, ctas_per_tile: int, num_sms: int, area: int, eff: float) -> float:
    # A 2-CTA tile is computed by two SMs: each wave costs half its area per SM.
    slots = max(1, num_sms // ctas_per_tile)
    return math.ceil(tiles / slots) * (area / ctas_per_tile) / eff


def _choose_sm100(m, n, k, batch, num_sms):
    best = None
    for use_2cta, mm, mn, eff in _SM100_CANDIDATES:
        cta_m = mm // 2 if use_2cta else mm
        if use_2cta and m <= 128 and mm > m:
            continue  # a 2-CTA pair would be mostly padding
        tiles = math.ceil(m / mm) * math.ceil(n / mn) * batch
        cost = _wave_cost(tiles, 2 if use_2cta else 1, num_sms, mm * mn, eff)
        cost *= (math.ceil(m / cta_m) * cta_m) / max(m, 1) if m < cta_m else 1.0
        if best is None or cost < best[0] - 1e-9:
            best = (cost, use_2cta, mm, mn)
    _, use_2cta, mm, mn = best
    tiles_m = math.ceil(m / mm)
    cluster = (2, 1) if use_2cta else ((2, 1) if tiles_m >= 2 else (1, 1))
    return use_2cta, mm, mn, cluster


def _choose_sm90(m, n, k, batch, num_sms, pingpong_ok=False):
    """(tile_m, tile_n, cluster, pingpong): the tile with the fewest weighted waves; ping-pong
    tiles compete only with `pingpong_ok` and when 128x256 tiles fill at least
    `SM90_PINGPONG_MIN_WAVES` waves."""
    candidates = [(tm, tn, False, eff) for tm, tn, eff in _SM90_CANDIDATES]
    if pingpong_ok and math.ceil(m / 128) * math.ceil(n / 256) * batch >= (
        SM90_PINGPONG_MIN_WAVES * num_sms
    ):
        candidates += [(tm, tn, True, eff) for tm, tn, eff in _SM90_PINGPONG_CANDIDATES]
    best = None
    for tm, tn, pingpong, eff in candidates:
        tiles = math.ceil(m / tm) * math.ceil(n / tn) * batch
        cost = _wave_cost(tiles, 1, num_sms, tm * tn, eff)
        if m < tm:
            cost *= tm / m  # rows of padding still cost MMA time
        if best is None or cost < best[0] - 1e-9:
            best = (cost, tm, tn, pingpong)
    _, tm, tn, pingpong = best
    if pingpong:
        # Measured best with CTAs paired along M (B multicast) in all three sweeps but one.
        return tm, tn, (2, 1), True
    tiles_m, tiles_n = math.ceil(m / tm), math.ceil(n / tn)
    # Multicast the operand that more CTAs share: pair CTAs along the longer tile dimension.
    cluster = (2, 1) if tiles_m >= 2 and tiles_m >= tiles_n else (1, 2) if tiles_n >= 2 else (1, 1)
    if tiles_n >= 2 and tiles_m >= 4 * tiles_n:
        # Very tall grids: A (m x k) is the big operand that does not stay in L2; pairing CTAs
        # along N multicasts it. Three H200 sweeps of 16384x4096x4096 (benchmarks/RESULTS.md)
        # put 1x2 ahead of 2x1 by 3-4% each time (0.96-1.0x against 0.95-0.96x jnp.dot).
        cluster = (1, 2)
    return tm, tn, cluster, False


def _split_k(m, n, k, batch, tm, tn, ktile, num_sms) -> int:
    """Split factor for skinny shapes whose output tiles leave most SMs idle."""
    tiles = math.ceil(m / tm) * math.ceil(n / tn) * batch
    if m > 256 or tiles * 2 > num_sms:
        return 1
    k_tiles = math.ceil(k / ktile)
    split = 1
    # Keep at least 4 K tiles per split so each CTA still pipelines.
    while tiles * split * 2 <= num_sms and k_tiles // (split * 2) >= 4:
        split *= 2
    return split


def with_split(plan: GemmPlan, split: int, reduce: str | None = None) -> GemmPlan:
    """`plan` (sm_90a) with split factor `split` (1: the unsplit SM90 kernel) and partials summed
    by `reduce` ("xla" or "cluster"; default: the plan's), A/B stages refilled to the shared
    memory its epilogue leaves. An in-cluster split takes the (1, split) cluster it reduces in.
    Raises PlanError if the combination is illegal or no stages fit."""
    reduce = reduce or plan.split_reduce
    kernel = KERNEL_SM90_SPLITK if split > 1 else KERNEL_SM90
    cluster = plan.cluster_shape_mn
    if reduce == "cluster":
        cluster = (1, split)
    edited = dataclasses.replace(
        plan, kernel=kernel, split_k=split, split_reduce=reduce, cluster_shape_mn=cluster,
        pingpong=False if split > 1 else plan.pingpong, num_ab_stages=C.MIN_AB_STAGES,
        num_epi_stages=2, stream_k=plan.stream_k and split == 1,
        stage_c=plan.stage_c and split == 1,
    )  # fmt: skip
    return _fill_sm90_smem(edited)


# Below these sizes (FLOPs of the whole batched problem) XLA's dot beats the SM90 kernels on
# the H200: the persistent kernel's start-up (barrier init, cluster sync, pipeline fill) costs
# ~1-1.6 us more than cuBLAS's kernels, measured by `python -m jax_sm100.bench --method device`
# on 2026-11-29 (benchmarks/RESULTS.md): 0.62-0.83x at 128^3, 256^3, 1024^3, 1024x1024x128 and
# 512x2048x512; 0.90x at 1024x4096x1024 (2^33 FLOPs) and 0.92-0.96x at 2048^3. Split-K plans
# win at 64x4096x4096 (1.2x, 2^31.0 FLOPs), tie at 256x256x4096 and 128x1024x1024 and lose at
# 64x64x4096 (0.72x).
# Epilogue store stages the SM90 planner gives from the shared memory the A/B ring leaves over,
# for swizzled rasters: with 4 (not 2) sub-tiles in flight the 128x256 tile's epilogue stalls
# less on its TMA stores. H200, device method, two sweeps: +0.2-7 % in all 16 swizzle-8 pairs
# (8192^3, 16384x4096x4096, 4096^3, 4096x14336x4096; both clusters), -5 to +2 % (mean -1 %)
# with swizzle 1, where the planner keeps 2 (benchmarks/RESULTS.md, fourth session).
SM90_MAX_EPI_STAGES = 4
SM90_MIN_FLOPS = 2**33
SM90_SPLITK_MIN_FLOPS = 2**30


def sm90_too_small(m, n, k, batch, split) -> str | None:
    """The planner's reason to send a small sm_90a problem to XLA's dot, or None."""
    flops = 2 * m * n * k * batch
    floor = SM90_SPLITK_MIN_FLOPS if split > 1 else SM90_MIN_FLOPS
    if flops >= floor:
        return None
    kind = f"split-K x{split}" if split > 1 else "wgmma"
    return (
        f"XLA dot: a small problem ({flops / 1e9:.3g} GFLOP < {floor / 1e9:.3g}), where the "
        f"persistent {kind} kernel's ~1.5 us start-up makes it slower than XLA's dot on the "
        "H200 (benchmarks/RESULTS.md); plan(..., force_kernel=True) plans the kernel anyway"
    )


@functools.lru_cache(maxsize=4096)
def _plan_cached(
    m, n, k, a_dtype, b_dtype, out_dtype, c_dtype, batch, arch, a_major, b_major, force_kernel,
    allow_pingpong=True, preact_out=False, num_sms=0,
):  # fmt: skip
    C.check_arch(arch)
    num_sms = num_sms or DEFAULT_NUM_SMS[arch]
    why_not = C.kernel_support(
        arch, m, n, k, a_dtype, b_dtype, out_dtype, c_dtype, a_major, b_major
    )
    ab = a_dtype if a_dtype in C.KERNEL_OPERAND_DTYPES[arch] and a_dtype == b_dtype else "bfloat16"
    ab_bits = C.DTYPE_BITS[ab]
    ktile = 1024 // ab_bits
    out_bits = C.DTYPE_BITS[out_dtype]
    c_bits = C.DTYPE_BITS[c_dtype] if c_dtype else 0
    common = dict(
        arch=arch, m=m, n=n, k=k, batch=batch, a_dtype=a_dtype, b_dtype=b_dtype,
        out_dtype=out_dtype, c_dtype=c_dtype, a_major=a_major, b_major=b_major, num_sms=num_sms,
        preact_out=preact_out,
    )  # fmt: skip
    if arch == "sm_100a":
        use_2cta, mm, mn, cluster = _choose_sm100(m, n, k, batch, num_sms)
        cta = (mm // 2 if use_2cta else mm, mn, ktile)
        cols = _dsl().sm100.compute_acc_tmem_cols_per_stage(cta[0], mn, use_2cta, mn, False)
        # Two accumulator stages let the epilogue of one tile overlap the MMAs of the next;
        # fall back to one when two do not fit in TMEM.
        acc_stages = 2 if _pow2_ceil(2 * cols) <= C.TMEM_MAX_COLS else 1
        epi = _dsl().sm100.compute_epilogue_tile_size(
            cta[0], mn, use_2cta, out_bits, c_dtype and c_bits, False, False
        )
        epi_bytes = epi_smem_bytes(arch, epi, 2, out_dtype, c_dtype, 1, preact_out=preact_out)
        stages = _max_ab_stages(arch, cta, mn // 2 if use_2cta else mn, ab_bits, epi_bytes)
        plan = GemmPlan(
            **common,
            kernel=KERNEL_SM100 if why_not is None else KERNEL_XLA,
            reason=why_not or _sm100_reason(use_2cta, mm, mn, num_sms),
            mma_tiler_mnk=(mm, mn, ktile),
            cluster_shape_mn=cluster,
            use_2cta=use_2cta,
            num_ab_stages=stages,
            num_acc_stages=acc_stages,
        )
        return plan
    pingpong_ok = allow_pingpong and why_not is None and a_dtype == b_dtype
    pingpong_ok = pingpong_ok and ab_bits == 16 and out_bits == 16
    tm, tn, cluster, pingpong = _choose_sm90(m, n, k, batch, num_sms, pingpong_ok)
    split = _split_k(m, n, k, batch, tm, tn, ktile, num_sms) if why_not is None else 1
    if why_not is None and not force_kernel:
        why_not = sm90_too_small(m, n, k, batch, split)
        split = 1 if why_not else split
    if why_not is not None:
        kernel = KERNEL_XLA
        reason = why_not
    elif split > 1:
        kernel = KERNEL_SM90_SPLITK
        reason = (
            f"split-K x{split}: only {math.ceil(m / tm) * math.ceil(n / tn) * batch} output "
            f"tiles for {num_sms} SMs, so K is spread over idle SMs"
        )
    else:
        kernel = KERNEL_SM90
        if pingpong:
            plan = _sm90_pingpong_plan(common, (tm, tn, ktile), cluster)
            if plan is not None:
                return plan
            tm, tn, cluster, _ = _choose_sm90(m, n, k, batch, num_sms)
        reason = f"wgmma {tm}x{tn} tile: fewest weighted waves on {num_sms} SMs"
    stream_k = kernel == KERNEL_SM90 and _sm90_stream_k(m, n, batch, tm, tn, cluster, num_sms)
    if stream_k:
        reason += "; stream-K over the last waves (they do not divide evenly)"
    plan = GemmPlan(
        **common,
        kernel=kernel,
        reason=reason,
        mma_tiler_mnk=(tm, tn, ktile),
        cluster_shape_mn=cluster,
        use_2cta=False,
        num_ab_stages=C.MIN_AB_STAGES,
        num_acc_stages=1,
        split_k=split,
        swizzle_size=_sm90_swizzle(m, n, batch, tm, tn, cluster),
        stream_k=stream_k,
    )
    # A/B stages as many as fit, then the SMEM left deepens the epilogue's TMA-store ring.
    return _fill_sm90_smem(plan)


def _sm90_pingpong_plan(common, tile, cluster) -> GemmPlan | None:
    """The ping-pong plan the planner chose, walked along N (swizzled in bands of 8 cluster rows
    where 8 divides them: the DSL scheduler pads the rows otherwise, see `_sm90_swizzle`) with
    the measured 4-deep epilogue store ring, or None where it does not fit (the caller then
    plans the cooperative tile). A C of D's 16-bit dtype (the backward's saved pre-activation,
    a residual) is staged by TMA (`GemmPlan.stage_c`), with a shallower store ring (measured
    below)."""
    rows = _swizzled_extent(common["m"], common["n"], tile, cluster, along_m=False)
    swizzle = 8 if rows % 8 == 0 else 1
    c_dtype = common["c_dtype"]
    stage_c = c_dtype == common["out_dtype"] and c_dtype is not None and C.DTYPE_BITS[c_dtype] == 16
    try:
        plan = GemmPlan(
            **common, kernel=KERNEL_SM90,
            reason=(f"wgmma {tile[0]}x{tile[1]} ping-pong tile (each warp group's epilogue "
                    "hidden under the other's main loop): fewest weighted waves on "
                    f"{common['num_sms']} SMs; raster along N"),
            mma_tiler_mnk=tile, cluster_shape_mn=cluster, use_2cta=False,
            num_ab_stages=C.MIN_AB_STAGES, num_acc_stages=1, raster_along_m=False,
            swizzle_size=swizzle, pingpong=True, stage_c=stage_c,
        )  # fmt: skip
        shallow = plan.preact_out or plan.stage_c
        depth = SM90_PINGPONG_SHALLOW_EPI_STAGES if shallow else SM90_PINGPONG_EPI_STAGES
        return _fill_sm90_smem(plan, depth)
    except C.PlanError:
        return None


SM90_PINGPONG_EPI_STAGES = 4
# Epilogues that stage a second tile in shared memory take 2 store stages, leaving room for one
# more A/B stage (H200, benchmarks/epilogue_probe.py, interleaved rounds, 2026-12-01,
# 8192x14336x4096 bf16, 128x160 ping-pong):
# - with the pre-activation Z also stored (the forward under `grad`, bias + gelu), 4 store
#   stages leave 4 A/B stages, 2 leave 5: 631 against 655 TF/s;
# - with C staged by TMA (`GemmPlan.stage_c`; gelu'(C) * acc): 617 TF/s with 4/4 stages, 627
#   with 5/2, against 608 with C loaded from global memory (5/4).
SM90_PINGPONG_SHALLOW_EPI_STAGES = 2


def _sm90_stream_k(m, n, batch, tm, tn, cluster, num_sms) -> bool:
    """Whether an SM90 plan shares its last waves out by k-blocks (`GemmPlan.stream_k`).

    When the persistent clusters' waves do not divide the tiles, the last wave leaves clusters
    idle (2048 tiles on 132 SMs: 15.5 waves, 3 % of the time). Stream-K costs each cluster one
    partial tile written and read back; on the H200 (benchmarks/RESULTS.md, fifth session) it
    gained 0.5-4.4 % at 15.5 waves, was even at 13.6 and lost 3 % at 3.9, so it is taken from
    `SM90_STREAM_K_MIN_WAVES` full waves on.
    """
    cm, cn = cluster
    cluster_tiles = math.ceil(math.ceil(m / tm) / cm) * math.ceil(math.ceil(n / tn) / cn) * batch
    clusters = max(1, num_sms // (cm * cn))
    return cluster_tiles // clusters >= SM90_STREAM_K_MIN_WAVES and cluster_tiles % clusters != 0


SM90_STREAM_K_MIN_WAVES = 8


def _sm90_swizzle(m, n, batch, tm, tn, cluster) -> int:
    """Raster swizzle for SM90 grids with many more tile rows than columns (and >= 8 of each).

    Rastering along M in 8-tile bands keeps the B tiles of the CTAs running at the same time in
    L2. Measured on the H200 (benchmarks/RESULTS.md, 2026-11-29, bf16 vs jnp.dot): 16384x4096x4096
    0.86-0.87x -> 0.93-0.95x, 8192^3 0.95-0.97x -> 0.98-1.0x, 4096^3 unchanged; on
    4096x14336x4096 (more tile columns than rows) it measured 0.83-0.94x against 0.97-1.1x
    without, so wide grids keep 1.

    The DSL's tile scheduler rounds the number of cluster columns up to a multiple of the
    swizzle, and the clusters it adds lie wholly outside the matrix yet run their main loops (on
    zero-filled tiles): 10 columns of clusters would run as 16. So the swizzle is taken only
    where it divides the cluster columns.
    """
    tiles_m, tiles_n = math.ceil(m / tm), math.ceil(n / tn)
    cluster_cols = _swizzled_extent(m, n, (tm, tn), cluster, along_m=True)
    tall = tiles_n >= 8 and tiles_m >= 2 * tiles_n
    return 8 if tall and cluster_cols % 8 == 0 else 1


def _swizzled_extent(m, n, tile_mn, cluster, along_m) -> int:
    """The cluster count the DSL's tile scheduler rounds up to a multiple of the swizzle: the
    cluster columns for a raster along M, the cluster rows along N."""
    if along_m:
        return math.ceil(math.ceil(n / tile_mn[1]) / cluster[1])
    return math.ceil(math.ceil(m / tile_mn[0]) / cluster[0])


def swizzle_pads(plan: GemmPlan) -> bool:
    """Whether `plan`'s swizzle makes the scheduler run clusters outside the matrix (correct,
    but each runs a full main loop on zero-filled tiles); the planner never plans one."""
    extent = _swizzled_extent(plan.m, plan.n, plan.cta_tile_mnk[:2], plan.cluster_shape_mn,
                              plan.raster_along_m)  # fmt: skip
    return extent % plan.swizzle_size != 0


def _sm100_reason(use_2cta, mm, mn, num_sms) -> str:
    kind = "2-CTA" if use_2cta else "1-CTA"
    return f"tcgen05 {kind} {mm}x{mn} MMA: fewest weighted waves on {num_sms} SMs"


def plan(
    m: int,
    n: int,
    k: int,
    *,
    a_dtype,
    b_dtype,
    out_dtype=None,
    c_dtype=None,
    batch: int = 1,
    arch: str = "sm_100a",
    a_major: str = "k",
    b_major: str = "n",
    force_kernel: bool = False,
    preact_out: bool = False,
    num_sms: int | None = None,
) -> GemmPlan:
    """Plans `batch` GEMMs of `[m, k] @ [k, n]` for `arch`.

    Args:
      m, n, k: problem sizes (positive ints).
      a_dtype, b_dtype: operand dtypes (anything `np.dtype` takes, e.g. `jnp.bfloat16`).
      out_dtype: output dtype; defaults to the operands' result type (bfloat16 for fp8 pairs).
      c_dtype: dtype of the source matrix C when the epilogue reads one, else None.
      batch: number of GEMMs in the batch (L) mode.
      arch: "sm_100a" (tcgen05 kernels) or "sm_90a" (wgmma kernels).
      a_major, b_major: which dim of A ("k" for a row-major [m, k]) and B ("n" for a row-major
        [k, n]) is contiguous in memory.
      force_kernel: plan the arch's kernel even for a problem small enough that XLA's dot is
        measured faster (sm_90a below `SM90_MIN_FLOPS`); for tests and benchmarks. Problems a
        kernel cannot take at all still go to XLA's dot. `JAX_SM100_SMALL_PROBLEMS=kernel` in
        the environment sets it for every plan of the process.
      preact_out: the epilogue also writes the pre-activation (what `matmul` under `grad`
        saves for the activation's derivative): its staging takes shared memory too.
      num_sms: the target device's SM count, which tile and split choices depend on; None
        plans for the arch's usual part (`DEFAULT_NUM_SMS`: 132 for sm_90a as on the H100 and
        H200, 148 for sm_100a as on the B200).

    Returns:
      A frozen `GemmPlan`; `str(plan)` prints it as a table.

    Raises:
      PlanError: for an unknown arch or non-positive sizes.
      TypeError: for dtypes the primitive does not take.
    """
    p = make_problem(
        m, n, k, a_dtype=a_dtype, b_dtype=b_dtype, out_dtype=out_dtype, c_dtype=c_dtype,
        batch=batch, a_major=a_major, b_major=b_major, preact_out=preact_out,
    )  # fmt: skip
    if num_sms is not None and (not isinstance(num_sms, (int, np.integer)) or num_sms < 1):
        raise C.PlanError(f"num_sms={num_sms!r} must be a positive int (or None)")
    return _plan_cached(
        p.m, p.n, p.k, p.a_dtype, p.b_dtype, p.out_dtype, p.c_dtype, p.batch, arch,
        p.a_major, p.b_major, bool(force_kernel) or small_problems_on_kernels(),
        preact_out=p.preact_out, num_sms=int(num_sms or 0),
    )  # fmt: skip


def make_problem(
    m, n, k, *, a_dtype, b_dtype, out_dtype=None, c_dtype=None, batch=1, a_major="k",
    b_major="n", preact_out=False,
) -> GemmProblem:  # fmt: skip
    """A `GemmProblem` from `plan`'s arguments: dtypes by name (the output's defaulted as
    `plan` says), sizes checked positive.

    Raises:
      PlanError: non-positive sizes or unknown layouts.
      TypeError: dtypes the primitive does not take.
    """
    from jax_sm100._src import dtypes as D  # noqa: PLC0415

    a_name, b_name = D.operand_dtype_name(a_dtype, "a"), D.operand_dtype_name(b_dtype, "b")
    out_name = D.default_out_dtype(a_name, b_name) if out_dtype is None else D.name(out_dtype)
    c_name = None if c_dtype is None else D.operand_dtype_name(c_dtype, "c")
    for name, v in (("m", m), ("n", n), ("k", k), ("batch", batch)):
        if not isinstance(v, (int, np.integer)) or v < 1:
            raise C.PlanError(f"{name}={v!r} must be a positive int")
    if a_major not in ("k", "m") or b_major not in ("k", "n"):
        raise C.PlanError(f"{a_major=} must be 'k' or 'm'; {b_major=}: 'k' or 'n'")
    return GemmProblem(
        m=int(m), n=int(n), k=int(k), a_dtype=a_name, b_dtype=b_name, out_dtype=out_name,
        c_dtype=c_name, batch=int(batch), a_major=a_major, b_major=b_major,
        preact_out=bool(preact_out),
    )  # fmt: skip


def cooperative(plan: GemmPlan) -> GemmPlan:
    """The planner's plan for `plan`'s problem with the ping-pong schedule ruled out: the
    cooperative tile, cluster and raster it picks for fewer waves or 32-bit outputs, with
    stream-K where the last wave is partial. For tests and tuning."""
    return _plan_cached(
        plan.m, plan.n, plan.k, plan.a_dtype, plan.b_dtype, plan.out_dtype, plan.c_dtype,
        plan.batch, plan.arch, plan.a_major, plan.b_major, small_problems_on_kernels(),
        allow_pingpong=False, preact_out=plan.preact_out, num_sms=plan.num_sms,
    )  # fmt: skip


def with_preact(plan: GemmPlan) -> GemmPlan:
    """`plan` (a caller's) with the pre-activation output (`preact_out=True`) added to its
    epilogue: the same tiles, schedule and store stages, A/B stages reduced where the Z staging
    leaves fewer in SMEM. (The planner's own plans for the forward under `grad` are made with
    `preact_out` and choose their stages for it.)"""
    if plan.preact_out:
        return plan
    return replace_fitting(plan, preact_out=True)


def replace_fitting(plan: GemmPlan, **fields) -> GemmPlan:
    """`dataclasses.replace(plan, **fields)` with the A/B stages lowered, one at a time, until
    the edited plan fits (its epilogue may need more shared memory); PlanError when none does."""
    stages = plan.num_ab_stages
    while True:
        try:
            return dataclasses.replace(plan, num_ab_stages=stages, **fields)
        except C.PlanError:
            if stages <= C.MIN_AB_STAGES:
                raise
            stages -= 1


def small_problems_on_kernels() -> bool:
    """True when `JAX_SM100_SMALL_PROBLEMS=kernel`: every plan behaves as `force_kernel=True`.

    For programs that want our kernels on small problems too (the measured ~1.5 us start-up cost
    accepted), without passing plans: e.g. where XLA's own GEMM for small shapes misbehaves
    (benchmarks/RESULTS.md: XLA's Triton GEMM gave inf in a small bf16 model on the H200).
    """
    value = os.environ.get("JAX_SM100_SMALL_PROBLEMS", "xla")
    if value not in ("xla", "kernel"):
        raise C.PlanError(f"JAX_SM100_SMALL_PROBLEMS={value!r} must be 'xla' or 'kernel'")
    return value == "kernel"


def check_plan_fits(plan: GemmPlan, problem: GemmProblem, arch: str) -> None:
    """Raises PlanError unless a caller's plan was made for `problem` on `arch` (a plan without
    the pre-activation output fits a problem that needs it: `with_preact` adds it)."""
    if plan.arch != arch:
        raise C.PlanError(
            f"the plan passed to matmul(plan=...) is for {plan.arch}, but this call runs on "
            f"{arch}: {plan.arch} kernels cannot run there. Make the plan with "
            f"jax_sm100.plan(..., arch={arch!r}) or leave plan=None"
        )
    for f in ("m", "n", "k", "batch", "a_dtype", "b_dtype", "out_dtype", "c_dtype"):
        got, want = getattr(plan, f), getattr(problem, f)
        if got != want:
            raise C.PlanError(
                f"the plan passed to matmul(plan=...) was made for {f}={got!r}, but this call "
                f"has {f}={want!r}; make it with jax_sm100.plan(...) for this problem"
            )
    for f in ("a_major", "b_major"):
        if getattr(plan, f) != getattr(problem, f):
            raise C.PlanError(
                f"the plan has {f}={getattr(plan, f)!r} but the operand is "
                f"{getattr(problem, f)}-major here"
            )
