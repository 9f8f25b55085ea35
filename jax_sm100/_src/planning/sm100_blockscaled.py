"""The planner of block-scaled problems (`scaled_matmul`'s mxfp8 and nvfp4): sm_100a's
block-scaled tcgen05 kernel where `constraints.blockscaled_support` allows it, else XLA's ops.

The tile is sm100.py's wave-model choice among the tiles the block-scaled MMA takes (128 rows
of A per CTA, one scale atom; N of 128 or 256, whole atoms of B's scales). Beside the dense
plan's resources, each A/B stage holds its K tile's scale factors
(`gemm_plan.blockscaled_stage_bytes`) and TMEM holds them beside the accumulators
(`gemm_plan.blockscaled_tmem_cols`): with a 256-wide tile one accumulator stage fits, not two,
so there the epilogue of a tile does not overlap the next tile's MMAs. No SM100 device has
measured these choices.
"""

from __future__ import annotations

import dataclasses
import functools

import numpy as np

from jax_sm100._src import constraints as C
from jax_sm100._src.planning import sm100
from jax_sm100._src.planning.gemm_plan import (
    DEFAULT_NUM_SMS,
    KERNEL_SM100_BLOCKSCALED,
    KERNEL_XLA,
    GemmPlan,
    GemmProblem,
    _dsl,
    _pow2_ceil,
    _round_up,
    blockscaled_stage_bytes,
    blockscaled_tmem_cols,
    mma_operand_dtype,
    smem_capacity,
)

# The dense candidates (with sm100.py's tile efficiencies) the block-scaled MMA can take.
_CANDIDATES = tuple(
    c for c in sm100._SM100_CANDIDATES if c[1] == (256 if c[0] else 128) and c[2] in (128, 256)
)
# The scale-factor regions of the kernel's shared memory start on 1024-byte boundaries.
_SMEM_ALIGN = 1024
_MAX_AB_STAGES = 16


def scaled_problem(
    m, n, k, *, a_dtype, b_dtype, out_dtype=None, c_dtype=None, batch=1, a_major="k",
    b_major="k", preact_out=False, scale_dtype, scale_block, num_sms=None, b_scale_rows=1,
) -> GemmProblem:  # fmt: skip
    """The `GemmProblem` of a block-scaled product (`planning.plan`'s scale arguments), checked
    the same way for every arch: `batch` products of `[m, k]` and `[n, k]` (`b_major` "k", as
    `scaled_matmul` takes its rhs; "n", B as [k, n], is planned on XLA's ops), each row scaled
    per `scale_block` of k by `scale_dtype` factors. The output defaults to bfloat16.

    Raises:
      PlanError: non-positive sizes or `num_sms`, no scale dtype, a block that does not divide
        k, an M-major A, or C or the pre-activation asked for (a block-scaled product has no
        fused epilogue).
      TypeError: a dtype no block-scaled problem takes.
    """
    from jax_sm100._src import dtypes as D  # noqa: PLC0415

    if scale_dtype is None:
        raise C.PlanError(f"{scale_block=} without a scale_dtype: a block-scaled problem names "
                          f"both (one of {tuple(C.SCALE_DTYPE_BITS)})")  # fmt: skip
    names = {}
    for what, v, known in (("a_dtype", a_dtype, C.OPERAND_BITS),
                           ("b_dtype", b_dtype, C.OPERAND_BITS),
                           ("scale_dtype", scale_dtype, C.SCALE_DTYPE_BITS)):  # fmt: skip
        if v is None:  # np.dtype(None) is float64: never what a caller meant
            raise TypeError(f"jax_sm100.plan: {what} is None; pass one of {tuple(known)}")
        names[what] = D.name(v)
        if names[what] not in known:
            raise TypeError(f"a block-scaled problem's {what}={names[what]!r} is not one of "
                            f"{tuple(known)}")  # fmt: skip
    for what, v in (("m", m), ("n", n), ("k", k), ("batch", batch)):
        if not isinstance(v, (int, np.integer)) or v < 1:
            raise C.PlanError(f"{what}={v!r} must be a positive int")
    if (not isinstance(scale_block, (int, np.integer)) or isinstance(scale_block, bool)
            or scale_block < 1 or k % scale_block):  # fmt: skip
        raise C.PlanError(f"{scale_block=} must be a positive int dividing {k=}")
    if a_major != "k" or b_major not in ("k", "n"):
        raise C.PlanError(f"{a_major=}, {b_major=}: a block-scaled A is [m, k], K-major, and "
                          "B [n, k] (b_major='k') or [k, n] ('n')")  # fmt: skip
    C.check_plain_epilogue(
        "block-scaled kernels", None if c_dtype is None else D.name(c_dtype), preact_out,
        "a block-scaled product has no fused epilogue: drop c_dtype and preact_out",
    )  # fmt: skip
    if num_sms is not None and (not isinstance(num_sms, (int, np.integer)) or num_sms < 1):
        raise C.PlanError(f"num_sms={num_sms!r} must be a positive int (or None)")
    out = "bfloat16" if out_dtype is None else D.dtype_argument_name(out_dtype, "out_dtype",
                                                                     "jax_sm100.plan")  # fmt: skip
    if out not in C.SCALED_OUT_DTYPES:
        raise TypeError(
            f"a block-scaled problem's out_dtype={out!r} is not one of "
            f"{C.SCALED_OUT_DTYPES} (as scaled_matmul's preferred_element_type)"
        )
    return GemmProblem(
        m=int(m), n=int(n), k=int(k), a_dtype=names["a_dtype"], b_dtype=names["b_dtype"],
        out_dtype=out,
        batch=int(batch),
        a_major="k", b_major=b_major, scale_dtype=names["scale_dtype"],
        scale_block=int(scale_block), b_scale_rows=int(b_scale_rows),
    )  # fmt: skip


def plan_sm100_scaled(problem: GemmProblem, num_sms=None) -> GemmPlan:
    """`planning.plan` of a block-scaled problem (`scaled_problem`) for sm_100a: the kernel
    reads both operands K-major, as `scaled_matmul` takes them (an N-major B plans XLA's ops);
    B scaled per 128 x 128 tile is planned as per-row scales, which its lowering repeats them
    to."""
    problem = dataclasses.replace(problem, b_scale_rows=1)
    return _plan(problem, int(num_sms or DEFAULT_NUM_SMS["sm_100a"]))


@functools.lru_cache(maxsize=1024)
def _plan(problem: GemmProblem, num_sms: int) -> GemmPlan:
    p = problem
    why_not = C.kernel_support(
        "sm_100a", p.m, p.n, p.k, p.a_dtype, p.b_dtype, p.out_dtype, None, p.a_major,
        p.b_major, p.batch, p.scale_dtype, p.scale_block,
    )  # fmt: skip
    common = dataclasses.asdict(p) | dict(arch="sm_100a", num_sms=num_sms)
    ktile = 1024 // C.OPERAND_BITS[mma_operand_dtype("sm_100a", p.a_dtype, p.b_dtype)]
    if why_not is not None:
        # XLA's ops compute it; the tile fields are placeholders.
        return GemmPlan(
            **common, kernel=KERNEL_XLA, reason=why_not, mma_tiler_mnk=(128, 128, ktile),
            cluster_shape_mn=(1, 1), use_2cta=False, num_ab_stages=C.MIN_AB_STAGES,
            num_acc_stages=1,
        )  # fmt: skip
    use_2cta, mm, mn, cluster = sm100._choose_sm100(p.m, p.n, p.k, p.batch, num_sms, _CANDIDATES)
    cta_m = mm // 2 if use_2cta else mm
    acc_cols = _dsl().sm100.compute_acc_tmem_cols_per_stage(cta_m, mn, use_2cta, mn, False)
    sf_cols = blockscaled_tmem_cols((mm, mn, ktile), use_2cta, p.scale_block)
    acc_stages = 2 if _pow2_ceil(2 * acc_cols + sf_cols) <= C.TMEM_MAX_COLS else 1
    kind = C.SM100_BLOCKSCALED_KINDS[(p.a_dtype, p.scale_dtype, p.scale_block)]
    reason = (
        f"tcgen05 block-scaled (kind::{kind}) {'2-CTA' if use_2cta else '1-CTA'} {mm}x{mn} MMA: "
        f"fewest weighted waves on {num_sms} SMs; {acc_stages} accumulator stage(s) beside "
        f"{sf_cols} TMEM columns of scale factors"
    )
    return _deepest(
        dict(
            common,
            kernel=KERNEL_SM100_BLOCKSCALED,
            reason=reason,
            mma_tiler_mnk=(mm, mn, ktile),
            cluster_shape_mn=cluster,
            use_2cta=use_2cta,
            num_acc_stages=acc_stages,
        )  # fmt: skip
    )


def _deepest(fields: dict) -> GemmPlan:
    """The plan with the deepest A/B pipeline whose shared memory, as the kernel lays it out,
    fits a CTA (the planner's rule: fill shared memory, one CTA per SM)."""
    best = None
    for stages in range(C.MIN_AB_STAGES, _MAX_AB_STAGES + 1):
        try:
            plan = GemmPlan(**fields, num_ab_stages=stages)
        except C.PlanError:
            continue  # too few stages to keep one CTA per SM, or past shared memory
        if kernel_smem_bytes(plan) <= smem_capacity(plan.arch):
            best = plan
    if best is None:
        raise C.PlanError(f"no A/B stage count fits the block-scaled tile {fields}")
    return best


def kernel_smem_bytes(plan: GemmPlan) -> int:
    """Shared memory the block-scaled kernel allocates for `plan`: the plan's estimate with its
    two scale-factor regions rounded up to the alignment of the kernel's tiles."""
    sfa, sfb = blockscaled_stage_bytes(
        plan.mma_tiler_mnk, plan.use_2cta, plan.scale_dtype, plan.scale_block
    )
    sfa, sfb = sfa * plan.num_ab_stages, sfb * plan.num_ab_stages
    return plan.smem_bytes - sfa - sfb + _round_up(sfa, _SMEM_ALIGN) + _round_up(sfb, _SMEM_ALIGN)
