"""The trace-time GEMM planner: problem sizes and dtypes in, a frozen `GemmPlan` out.

Pure Python over ints and dtype widths; it imports nvidia-cutlass-dsl only for its planning
helpers (`compute_epilogue_tile_size`, `compute_acc_tmem_cols_per_stage`, the SMEM capacity
table), which need no GPU. Legality is decided by `constraints.py`; this package chooses:
gemm_plan.py holds the plan's types and resource arithmetic, sm90.py and sm100.py each arch's
heuristics, and this module the entry points (`plan`, `make_problem`, the generic edits).

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
spreads K over idle SMs, and so do wider ones of few tiles over a long k (one GEMM of at least
`SM90_MIN_FLOPS`), re-tiled in 128 x 128 and split into about one wave (`sm90._wide_split`);
so are skinny ones of two full 128-row tiles (192 < m <= 256) of that size, where that runs
as many CTAs as the planner's 64-row tiles, split or not; the partial products are reduced in
float32 before the epilogue, by XLA (`split_reduce="xla"`, the planner's choice) or inside the
kernel by a (1, split_k) cluster (`split_reduce="cluster"`, `with_split(plan, s,
reduce="cluster")`; correct on the H200 but slower there and on the H100 so far:
benchmarks/RESULTS.md).

Small sm_90a problems (under `SM90_MIN_FLOPS`, or `SM90_SPLITK_MIN_FLOPS` for split-K) are planned
onto XLA's dot, which the H200 measurements put ahead there; `force_kernel=True` overrides.

Grouped problems (`groups`, `ragged`: ragged_dot) score the same wave model over the work tiles
of groups of equal size (`gemm_plan.grouped_work_tiles`; the sizes are known only on the
device): sm_90a's cooperative tiles in 1x1 or 2x1 clusters (a pair of CTAs inside one group),
and ping-pong ones where groups are long and they save waves (`plan_sm90_grouped`); sm_100a's
1-CTA 128x256 and 128x128 MMAs in 1x1 or 2x1 clusters, weighed as on sm_90a
(`plan_sm100_grouped`); each beside its group table in SMEM.
"""

from __future__ import annotations

import dataclasses
import functools
import os

import numpy as np

from jax_sm100._src import constraints as C
from jax_sm100._src.planning import sm90, sm90_scaled, sm100, sm100_blockscaled
from jax_sm100._src.planning.gemm_plan import (
    DEFAULT_NUM_SMS,
    KERNEL_SM90,
    KERNEL_SM90_GROUPED,
    KERNEL_SM90_SCALED,
    KERNEL_SM90_SPLITK,
    KERNEL_SM100,
    KERNEL_SM100_BLOCKSCALED,
    KERNEL_SM100_GROUPED,
    KERNEL_XLA,
    KERNELS,
    GemmPlan,
    GemmProblem,
    epi_smem_bytes,
    grid_clusters,
    grouped_b_k_major_only,
    mma_operand_dtype,
    plain_epilogue_kernels,
    resident_clusters,
    smem_capacity,
)
from jax_sm100._src.planning.sm90 import (
    GROUPED_DYNAMIC_ENV,
    SM90_MAX_EPI_STAGES,
    SM90_MIN_FLOPS,
    SM90_PINGPONG_8BIT_EPI_STAGES,
    SM90_PINGPONG_8BIT_MAX_KTILES,
    SM90_PINGPONG_EPI_STAGES,
    SM90_SPLITK_MIN_FLOPS,
    SM90_STREAM_K_MIN_AB_BITS,
    SM90_STREAM_K_MIN_WAVES,
    sm90_too_small,
    sm90_variant,
    swizzle_pads,
    with_split,
)
from jax_sm100._src.planning.sm90_scaled import with_scaled_overlap

__all__ = [
    "DEFAULT_NUM_SMS", "KERNELS", "KERNEL_SM100", "KERNEL_SM100_BLOCKSCALED",
    "KERNEL_SM100_GROUPED", "KERNEL_SM90", "KERNEL_SM90_GROUPED", "KERNEL_SM90_SCALED",
    "KERNEL_SM90_SPLITK",
    "KERNEL_XLA", "SM90_MAX_EPI_STAGES", "SM90_MIN_FLOPS", "SM90_PINGPONG_8BIT_EPI_STAGES",
    "SM90_PINGPONG_8BIT_MAX_KTILES", "SM90_PINGPONG_EPI_STAGES",
    "SM90_SPLITK_MIN_FLOPS", "SM90_STREAM_K_MIN_AB_BITS", "SM90_STREAM_K_MIN_WAVES", "GemmPlan",
    "GemmProblem",
    "check_plan_fits", "cooperative", "epi_smem_bytes", "grid_clusters", "grouped_b_k_major_only",
    "make_problem", "plan",
    "replace_fitting", "resident_clusters", "sm90_too_small", "sm90_variant",
    "small_problems_on_kernels", "smem_capacity", "swizzle_pads", "with_preact",
    "with_scaled_overlap", "with_split",
]  # fmt: skip


@functools.lru_cache(maxsize=4096)
def _plan_cached(
    m, n, k, a_dtype, b_dtype, out_dtype, c_dtype, batch, arch, a_major, b_major, force_kernel,
    allow_pingpong=True, preact_out=False, num_sms=0, groups=0, ragged="", grouped_schedule="",
    grouped_dynamic="",
):  # fmt: skip
    C.check_arch(arch)
    num_sms = num_sms or DEFAULT_NUM_SMS[arch]
    why_not = C.kernel_support(
        arch, m, n, k, a_dtype, b_dtype, out_dtype, c_dtype, a_major, b_major, batch
    )
    ab = mma_operand_dtype(arch, a_dtype, b_dtype)
    ab_bits = C.DTYPE_BITS[ab]
    ktile = 1024 // ab_bits
    out_bits = C.DTYPE_BITS[out_dtype]
    c_bits = C.DTYPE_BITS[c_dtype] if c_dtype else 0
    common = dict(
        arch=arch, m=m, n=n, k=k, batch=batch, a_dtype=a_dtype, b_dtype=b_dtype,
        out_dtype=out_dtype, c_dtype=c_dtype, a_major=a_major, b_major=b_major, num_sms=num_sms,
        preact_out=preact_out,
    )  # fmt: skip
    if groups:
        common |= dict(groups=groups, ragged=ragged)
        if arch == "sm_100a":
            return sm100.plan_sm100_grouped(
                common, why_not, ab_bits, ktile, out_bits, grouped_dynamic
            )
        return sm90.plan_sm90_grouped(common, why_not, ktile, grouped_schedule, grouped_dynamic)
    if arch == "sm_100a":
        return sm100.plan_sm100(common, why_not, ab_bits, ktile, out_bits, c_bits)
    return sm90.plan_sm90(
        common, why_not, ab_bits, ktile, out_bits, allow_pingpong, force_kernel
    )  # fmt: skip


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
    b_major: str | None = None,
    force_kernel: bool = False,
    preact_out: bool = False,
    num_sms: int | None = None,
    scale_dtype=None,
    scale_block: int = 0,
    b_scale_rows: int = 1,
    groups: int = 0,
    ragged: str = "",
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
        [k, n]) is contiguous in memory; B defaults to "n", or for a block-scaled problem to
        "k" (`scaled_matmul`'s rhs is [n, k]).
      force_kernel: plan the arch's kernel even for a problem small enough that XLA's dot is
        measured faster (sm_90a below `SM90_MIN_FLOPS`); for tests and benchmarks. Problems a
        kernel cannot take at all still go to XLA's dot. `JAX_SM100_SMALL_PROBLEMS=kernel` in
        the environment sets it for every plan of the process.
      preact_out: the epilogue also writes the pre-activation (what `matmul` under `grad`
        saves for the activation's derivative): its staging takes shared memory too.
      num_sms: the target device's SM count, which tile and split choices depend on; None
        plans for the arch's usual part (`DEFAULT_NUM_SMS`: 132 for sm_90a as on the H100 and
        H200, 148 for sm_100a as on the B200).
      scale_dtype, scale_block: a block-scaled problem (`scaled_matmul`): A's and B's rows
        scaled per `scale_block` elements of k by factors of `scale_dtype` (sm_90a runs float32
        per 128 on its block-scaled kernel, `planning/sm90_scaled.py`); None and 0 otherwise.
        The block must divide k, as `scaled_matmul` requires; data dtypes no kernel of the arch
        takes (nvfp4's float4_e2m1fn on sm_90a) plan XLA's ops, the reason saying why. The
        output defaults to bfloat16 (`scaled_matmul`'s own default is float32: pass
        `out_dtype` to plan what a call runs).
        sm_100a runs mxfp8 (float8_e8m0fnu per 32) and nvfp4 (float4_e2m1fn data,
        float8_e4m3fn per 16) on its block-scaled tcgen05 kernel (`planning/sm100_blockscaled.py`).
      b_scale_rows: with scales, the rows of B one B scale covers: 1 (each row, as
        `jax.nn.scaled_matmul`) or 128 (B scaled per 128 x 128 tile, DeepSeek-V3's weights,
        which sm_90a promotes with one FMA per accumulator instead of two; sm_100a plans them
        as per-row scales, which its lowering repeats them to).
      groups, ragged: a grouped problem (`ragged_dot`): `groups` matrices, and "m" when the
        groups partition m (rows of A and D; B holds one [k, n] matrix per group) or "k" when
        they partition k (D holds one [m, n] matrix per group). 0 and "" for a dense problem.

    Returns:
      A frozen `GemmPlan`; `str(plan)` prints it as a table.

    Raises:
      PlanError: for an unknown arch or non-positive sizes; for a block-scaled problem, a
        block that does not divide k or a block without a scale dtype; for a block-scaled or
        grouped problem, `c_dtype` or `preact_out` (their kernels read no C and write D only)
        or groups with scales; for a grouped one, `batch` other than 1.
      TypeError: for dtypes the primitive does not take.
    """
    if not C.is_b_scale_rows(b_scale_rows):
        raise C.PlanError(f"{b_scale_rows=} must be one of {C.B_SCALE_ROWS}")
    if scale_dtype is not None or scale_block:
        if groups or ragged:
            raise C.PlanError(f"{groups=}, {ragged=} with scales: no block-scaled grouped "
                              "product exists (plan the groups or the scales)")  # fmt: skip
        # One check of the problem for every arch; B defaults to K-major ([n, k]), as
        # `scaled_matmul` takes it.
        p = sm100_blockscaled.scaled_problem(
            m, n, k, a_dtype=a_dtype, b_dtype=b_dtype, out_dtype=out_dtype, c_dtype=c_dtype,
            batch=batch, a_major=a_major, b_major=b_major or "k", preact_out=preact_out,
            scale_dtype=scale_dtype, scale_block=scale_block, num_sms=num_sms,
            b_scale_rows=b_scale_rows,
        )  # fmt: skip
        return _plan_scaled(p, arch, num_sms)
    if b_scale_rows != 1:
        raise C.PlanError(f"{b_scale_rows=} needs a block-scaled problem (scale_dtype)")
    b_major = b_major or "n"
    p = make_problem(
        m, n, k, a_dtype=a_dtype, b_dtype=b_dtype, out_dtype=out_dtype, c_dtype=c_dtype,
        batch=batch, a_major=a_major, b_major=b_major, preact_out=preact_out, groups=groups,
        ragged=ragged,
    )  # fmt: skip
    if num_sms is not None and (not isinstance(num_sms, (int, np.integer)) or num_sms < 1):
        raise C.PlanError(f"num_sms={num_sms!r} must be a positive int (or None)")
    schedule = os.environ.get("JAX_SM100_GROUPED_SCHEDULE", "") if p.groups else ""
    if schedule not in sm90.GROUPED_SCHEDULES:  # checked for every arch (sm_100a ignores it)
        raise C.PlanError(f"JAX_SM100_GROUPED_SCHEDULE={schedule!r}: one of "
                          f"{sm90.GROUPED_SCHEDULES} ('' for the planner's choice)")  # fmt: skip
    return _plan_cached(
        p.m, p.n, p.k, p.a_dtype, p.b_dtype, p.out_dtype, p.c_dtype, p.batch, arch,
        p.a_major, p.b_major, bool(force_kernel) or small_problems_on_kernels(),
        preact_out=p.preact_out, num_sms=int(num_sms or 0), groups=p.groups, ragged=p.ragged,
        grouped_schedule=schedule,
        grouped_dynamic=os.environ.get(GROUPED_DYNAMIC_ENV, "") if p.groups else "",
    )  # fmt: skip


def _plan_scaled(problem: GemmProblem, arch: str, num_sms) -> GemmPlan:
    """The plan of a checked block-scaled `problem` (`sm100_blockscaled.scaled_problem`)."""
    if arch == "sm_100a":
        return sm100_blockscaled.plan_sm100_scaled(problem, num_sms=num_sms)
    return sm90_scaled.plan_scaled(problem, arch, num_sms=num_sms)


def make_problem(
    m, n, k, *, a_dtype, b_dtype, out_dtype=None, c_dtype=None, batch=1, a_major="k",
    b_major="n", preact_out=False, groups=0, ragged="",
) -> GemmProblem:  # fmt: skip
    """A `GemmProblem` from `plan`'s arguments: dtypes by name (the output's defaulted as
    `plan` says), sizes checked positive.

    Raises:
      PlanError: non-positive sizes or unknown layouts; `groups` without `ragged` (or the
        reverse); a grouped problem with `c_dtype`, `preact_out` or `batch` other than 1.
      TypeError: dtypes the primitive does not take.
    """
    from jax_sm100._src import dtypes as D  # noqa: PLC0415

    caller = "jax_sm100.plan"
    scaled = (
        "pass scale_dtype= and scale_block= too (nvfp4: scale_dtype=jnp.float8_e4m3fn, "
        "scale_block=16)"
    )
    a_name = D.dtype_argument_name(a_dtype, "a_dtype", caller, block_scaled_fix=scaled)
    b_name = D.dtype_argument_name(b_dtype, "b_dtype", caller, block_scaled_fix=scaled)
    out_name = (
        D.default_out_dtype(a_name, b_name)
        if out_dtype is None
        else D.dtype_argument_name(out_dtype, "out_dtype", caller)
    )
    c_name = None if c_dtype is None else D.dtype_argument_name(c_dtype, "c_dtype", caller)
    for name, v in (("m", m), ("n", n), ("k", k), ("batch", batch)):
        if not isinstance(v, (int, np.integer)) or v < 1:
            raise C.PlanError(f"{name}={v!r} must be a positive int")
    if a_major not in ("k", "m") or b_major not in ("k", "n"):
        raise C.PlanError(f"{a_major=} must be 'k' or 'm'; {b_major=}: 'k' or 'n'")
    if not isinstance(groups, (int, np.integer)) or groups < 0 or (groups > 0) != bool(ragged):
        raise C.PlanError(f"{groups=}, {ragged=}: a grouped problem has groups > 0 and ragged "
                          "'m' or 'k'; a dense one 0 and ''")  # fmt: skip
    if groups:
        C.check_plain_epilogue("grouped kernels", c_name, preact_out,
                               "drop c_dtype and preact_out (`ragged_dot` takes a per-group bias "
                               "instead)")  # fmt: skip
    if groups and batch != 1:
        raise C.PlanError(f"{batch=} with {groups=}: a grouped problem has batch=1 (`ragged_dot` "
                          "under vmap folds the batch into the groups); pass batch=1")  # fmt: skip
    return GemmProblem(
        m=int(m), n=int(n), k=int(k), a_dtype=a_name, b_dtype=b_name, out_dtype=out_name,
        c_dtype=c_name, batch=int(batch), a_major=a_major, b_major=b_major,
        preact_out=bool(preact_out), groups=int(groups), ragged=ragged,
    )  # fmt: skip


def cooperative(plan: GemmPlan) -> GemmPlan:
    """The planner's plan for `plan`'s problem with the ping-pong schedule ruled out: the
    cooperative tile, cluster and raster it picks for fewer waves, 32-bit outputs or fp8 at
    long k, with
    stream-K where the last wave is partial (16- and 32-bit operands). A grouped problem's is
    the grouped planner's with JAX_SM100_GROUPED_SCHEDULE=cooperative; a block-scaled problem's
    is the planner's own (its kernels have no ping-pong schedule). For tests and tuning."""
    if plan.scale_dtype is not None:
        return _plan_scaled(plan.problem, plan.arch, plan.num_sms)
    # A plan on a kernel keeps its problem on one (force_kernel, or the environment's).
    on_kernel = small_problems_on_kernels() or plan.kernel != KERNEL_XLA
    return _plan_cached(
        plan.m, plan.n, plan.k, plan.a_dtype, plan.b_dtype, plan.out_dtype, plan.c_dtype,
        plan.batch, plan.arch, plan.a_major, plan.b_major, on_kernel,
        allow_pingpong=False, preact_out=plan.preact_out, num_sms=plan.num_sms,
        groups=plan.groups, ragged=plan.ragged,
        grouped_schedule="cooperative" if plan.groups else "",
        grouped_dynamic=os.environ.get(GROUPED_DYNAMIC_ENV, "") if plan.groups else "",
    )  # fmt: skip


def with_preact(plan: GemmPlan) -> GemmPlan:
    """`plan` (a caller's) with the pre-activation output (`preact_out=True`) added to its
    epilogue: the same tiles, schedule and store stages, A/B stages reduced where the Z staging
    leaves fewer in SMEM. (The planner's own plans for the forward under `grad` are made with
    `preact_out` and choose their stages for it.)

    Raises:
      PlanError: a block-scaled or grouped plan (their kernels write D only), or a plan whose
        epilogue does not fit with the pre-activation at any A/B stage count.
    """
    if plan.preact_out:
        return plan
    if kernels := plain_epilogue_kernels(plan):
        C.check_plain_epilogue(kernels, plan.c_dtype, preact_out=True,
                               fix="they have no pre-activation output: apply the activation "
                               "after the product")  # fmt: skip
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


def check_plan_fits(plan: GemmPlan, problem: GemmProblem, arch: str, sizes: bool = True) -> None:
    """Raises PlanError unless a caller's plan was made for `problem` on `arch` (a plan without
    the pre-activation output fits a problem that needs it: `with_preact` adds it). With
    `sizes=False` only the arch, dtypes and layouts must agree (the lowering resizes a plan to
    the problem a transformation made of the call: `vmap` adds a batch, sharding divides it)."""
    if plan.arch != arch:
        raise C.PlanError(
            f"the plan passed to matmul(plan=...) is for {plan.arch}, but this call runs on "
            f"{arch}: {plan.arch} kernels cannot run there. Make the plan with "
            f"jax_sm100.plan(..., arch={arch!r}) or leave plan=None"
        )
    # A grouped or block-scaled plan is another kind of product (ragged_dot's, scaled_matmul's):
    # refused here, not resized to the dense problem or swapped for the planner's.
    for f in ("groups", "ragged", "scale_dtype", "scale_block", "b_scale_rows"):
        got, want = getattr(plan, f), getattr(problem, f)
        if got != want:
            kind = "grouped (ragged_dot's)" if plan.groups else "block-scaled (scaled_matmul's)"
            raise C.PlanError(
                f"the plan passed to matmul(plan=...) is a {kind} plan ({f}={got!r}); matmul "
                "takes a dense plan: make it with jax_sm100.plan(m, n, k, ...) without groups "
                "or scales, or leave plan=None"
            )
    fields = ("m", "n", "k", "batch") if sizes else ()
    for f in (*fields, "a_dtype", "b_dtype", "out_dtype", "c_dtype"):
        got, want = getattr(plan, f), getattr(problem, f)
        if got != want:
            raise C.PlanError(
                f"the plan passed to matmul(plan=...) was made for {f}={got!r}, but this call "
                f"has {f}={want!r}; make it with jax_sm100.plan(...) for this problem"
            )
    for f in ("a_major", "b_major"):
        if getattr(plan, f) != getattr(problem, f):
            raise C.PlanError(
                f"the plan passed to matmul(plan=...) has {f}={getattr(plan, f)!r}, but the "
                f"operand is {getattr(problem, f)}-major here; make the plan with "
                f"jax_sm100.plan(..., {f}={getattr(problem, f)!r}) or leave plan=None"
            )
