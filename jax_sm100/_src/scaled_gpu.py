"""The CUDA lowering of `scaled_matmul_p`: the block-scaled kernel where the plan takes it.

    cuda_scaled_matmul(lhs, rhs, lhs_scales, rhs_scales, *, out_dtype) -> out

On sm_90a: lhs [B, m, k] and rhs [B, n, k] are K-major as the fp8 wgmma needs them, so they
go to the kernel as they are: a (m, k, B), b (n, k, B), d (m, n, B). The scales go transposed,
[B, k / 128, rows] with each leading dimension padded to 16 bytes (TMA loads a k-block's scales
of a tile's rows as one box, which needs the rows contiguous; an XLA transpose of m k / 32 bytes,
against the product's m n k); rhs scales per 128 x 128 tile as tiles, [B, k / 128,
ceil(n / 128)]; scales of another dtype per 128 (each exact in float32) converted to float32
first (`_widened`). The plan is `dispatch.plan_call`'s for the problem with its
`scale_dtype` and `scale_block` (planning/sm90_scaled.py); one `jax_sm100_gemm` custom call
runs it, through the FFI handler and checks every lowering uses (`gpu_lowering.launch`). On
sm_100a, mxfp8 and nvfp4 go to the block-scaled tcgen05 kernel (`_call_sm100`), their scales in
the blocked layout that kernel reads.

A shared rhs (B of 1 beside lhs's B, as `vmap` binds weights it leaves unmapped) runs as one
product with lhs's batches as rows: reshapes of lhs, the result and lhs's scales (made plain per
row first where a batch does not hold whole 128-row tiles or atoms: `_rows`).

Where no kernel takes the call (no sm_90a or sm_100a device or target, a recipe the arch's
kernel does not take, different blocks for lhs and rhs, misaligned n, dtypes the kernels do not
write, `jax.export`'s symbolic dims), the documented math runs in XLA ops (`scaled.reference`),
and the reason is recorded (`jax_sm100.last_lowering()`).
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np

from jax_sm100._src import constraints, dispatch, ffi, planning, scale_layout
from jax_sm100._src.ffi_checks import Tie, problem_ties


def _xla(why: str, plan, args, out_dtype):
    from jax_sm100._src import scaled  # noqa: PLC0415

    # A plan's reason names its path already ("XLA ops: ...", "XLA dot: ..."): said once.
    why = why.removeprefix("XLA ops: ").removeprefix("XLA dot: ")
    dispatch.record(dispatch.Lowered(plan, f"scaled_matmul: XLA ops ({why})"))
    return scaled.reference(*args, out_dtype=out_dtype)


def scaled_problem(lhs, rhs, lhs_scales, rhs_scales, out_dtype) -> planning.GemmProblem:
    """The GEMM problem of one bind (operands as avals or arrays): [m, k] x [n, k]^T per batch
    with both operands K-major, scaled per `k / blocks` of k.

    Raises:
      ValueError: lhs and rhs scaled per different blocks or by different scale dtypes (one
        plan holds one block and one scale dtype).
      TypeError: a data dtype the planner does not take (e.g. float4_e2m1fn).
    """
    batch, m, k = lhs.shape
    n = rhs.shape[1]
    blocks = {scale_layout.scale_block(x.shape, s.shape, s.dtype)
              for x, s in ((lhs, lhs_scales), (rhs, rhs_scales))}  # fmt: skip
    scale_dtypes = {np.dtype(lhs_scales.dtype).name, np.dtype(rhs_scales.dtype).name}
    if len(blocks) != 1 or len(scale_dtypes) != 1:
        raise ValueError(
            f"lhs and rhs scaled per blocks {sorted(blocks)} by {sorted(scale_dtypes)}: the "
            "kernel takes one block and one scale dtype for both"
        )
    if np.dtype(lhs.dtype).name in constraints.SCALED_DATA_BITS:
        # Data only block-scaled problems take (nvfp4's e2m1): the planner checks the rest.
        return planning.GemmProblem(
            m=m, n=n, k=k, a_dtype=np.dtype(lhs.dtype).name, b_dtype=np.dtype(rhs.dtype).name,
            out_dtype=np.dtype(out_dtype).name, batch=batch, a_major="k", b_major="k",
            scale_dtype=scale_dtypes.pop(), scale_block=blocks.pop(),
        )  # fmt: skip
    problem = planning.make_problem(
        m, n, k, a_dtype=lhs.dtype, b_dtype=rhs.dtype, out_dtype=out_dtype, batch=batch,
        a_major="k", b_major="k",
    )  # fmt: skip
    # rhs scales per 128 x 128 tile (DeepSeek-V3's weights) plan as such (one FMA per
    # accumulator on sm_90a); lhs scales per 128-row tile go to the kernel repeated per row.
    return dataclasses.replace(
        problem, scale_dtype=scale_dtypes.pop(), scale_block=blocks.pop(),
        b_scale_rows=scale_layout.row_block(rhs.shape, rhs_scales.shape),
    )  # fmt: skip


def cuda_scaled_matmul(lhs, rhs, lhs_scales, rhs_scales, *, out_dtype):
    """`scaled_matmul_p` on a CUDA device (see the module docstring)."""
    from jax_sm100._src import scaled  # noqa: PLC0415

    args = (lhs, rhs, lhs_scales, rhs_scales)
    target = dispatch.lowering_target()
    if target is None:
        return _xla("no sm_90a/sm_100a device", None, args, out_dtype)
    if dispatch.symbolic_dims(*args):
        return _xla(f"symbolic dims {lhs.shape} x {rhs.shape}", None, args, out_dtype)
    if scaled.shared_rhs(lhs, rhs) and lhs.shape[0] > 0:
        # One rhs for every batch (weights a vmap left unmapped): lhs's batches are its rows,
        # so that one product reads the weights once.
        b, m, k = lhs.shape
        out = _lowered(lhs.reshape(1, b * m, k), rhs, _rows(lhs.shape, lhs_scales), rhs_scales,
                       out_dtype, target, f"; lhs's {b} batches as rows against the one shared "
                       "rhs")  # fmt: skip
        return out.reshape(b, m, out.shape[-1])
    return _lowered(*args, out_dtype, target, "")


def _widened(arch, lhs, rhs, lhs_scales, rhs_scales):
    """(lhs_scales, rhs_scales, note): on an arch whose kernel reads one scale dtype per one
    block (sm_90a: float32 per 128 of k), fp8 data's scales of another dtype per that block
    converted to it, each scale dtype the API takes being exact in float32, with a note that
    says so; else the scales as they are and no note."""
    pairs = ((lhs, lhs_scales), (rhs, rhs_scales))
    if arch not in constraints.KERNEL_SCALE_DTYPES or any(
        np.dtype(x.dtype).name not in constraints.FP8_DTYPES
        or scale_layout.scale_block(x.shape, s.shape, s.dtype) != constraints.KERNEL_SCALE_BLOCK
        for x, s in pairs
    ):
        return lhs_scales, rhs_scales, ""
    (kernel,) = constraints.KERNEL_SCALE_DTYPES[arch]
    others = sorted({np.dtype(s.dtype).name for _, s in pairs} - {kernel})
    if not others:
        return lhs_scales, rhs_scales, ""
    note = f"; {' and '.join(others)} scales converted to {kernel} (exact)"
    return lhs_scales.astype(kernel), rhs_scales.astype(kernel), note


def _rows(data_shape, scales):
    """lhs's `scales` for its [B, m, k] data taken as [1, B m, k]: a reshape where each batch
    holds whole 128-row tiles or atoms (plain scales, or m a multiple of 128), else the plain
    layout's."""
    b, m, _ = data_shape
    per_row = scales.ndim == 3 and scales.shape[1] == m
    if m % scale_layout.ROW_BLOCK and not per_row:
        scales = scale_layout.plain(data_shape, scales)
    return scales.reshape(1, b * scales.shape[1], *scales.shape[2:])


def _lowered(lhs, rhs, lhs_scales, rhs_scales, out_dtype, target, note):
    """`cuda_scaled_matmul` past its checks, for `target`, `note` added to the recorded
    path. Scales converted for a kernel (`_widened`) go to it only: XLA's ops take them as
    they are."""
    args = (lhs, rhs, lhs_scales, rhs_scales)
    *converted, widened = _widened(target.arch, *args)
    try:
        problem = scaled_problem(lhs, rhs, *converted, out_dtype)
        plan = dispatch.plan_call(problem, target).plan
    except (TypeError, ValueError) as e:
        return _xla(f"no plan: {e}{note}", None, args, out_dtype)
    if plan.kernel == planning.KERNEL_XLA:
        return _xla(plan.reason + note, plan, args, out_dtype)
    call = _KERNEL_CALLS.get(plan.kernel)
    if call is None:
        why = f"no scaled_matmul lowering for kernel {plan.kernel!r}{note}"
        return _xla(why, plan, args, out_dtype)
    dispatch.record(dispatch.Lowered(plan, "scaled_matmul: block-scaled kernel" + widened + note))
    ffi.register()
    return call(plan, lhs, rhs, *converted)


def _call_sm90(plan, lhs, rhs, lhs_scales, rhs_scales):
    """One `jax_sm100_gemm` call of the sm_90a block-scaled kernel (kernels/sm90_scaled.py)."""
    from jax_sm100._src import compile as compile_mod  # noqa: PLC0415

    rows = scale_layout.row_block(rhs.shape, rhs_scales.shape)
    if plan.b_scale_rows not in (1, rows):
        # A caller's plan (tests, benchmarks/scaled_probe.py) for tile scales given per-row
        # ones: the kernel would read row t's scales as tile t's.
        raise ValueError(
            f"the plan takes rhs scales per {plan.b_scale_rows} rows (b_scale_rows), these are "
            f"per {rows} ({tuple(rhs_scales.shape)} for rhs {tuple(rhs.shape)})"
        )
    compiled = compile_mod.compile_plan(plan)
    batch, m, k = plan.batch, plan.m, plan.k
    # A's scales of 128-row tiles go repeated per row (one XLA fusion with the transpose). B's
    # per 128 x 128 tile (the plan's b_scale_rows) go as they are, one per tile and k-block:
    # the kernel reads one B scale per k-tile.
    sfa, ld_a = _transposed(scale_layout.plain(lhs.shape, lhs_scales), plan.scale_dtype)
    if plan.b_scale_rows == 1:
        rhs_scales = scale_layout.plain(rhs.shape, rhs_scales)
    b_rows = rhs_scales.shape[1]  # n, or B's tiles
    sfb, ld_b = _transposed(rhs_scales, plan.scale_dtype)
    blocks = k // plan.scale_block
    # The kernel loads the scales by the tile and k-block it computes (TMA, bounded by the
    # scales' own extents, which fill zeros past them): their extents must be the problem's.
    ties = [
        Tie("sfa", 0, "a", 0), Tie("sfa", 1, "a", 1, plan.scale_block), Tie("sfa", 2, "a", 2),
        Tie("sfb", 0, "b", 0, plan.b_scale_rows, ceil=plan.b_scale_rows > 1),
        Tie("sfb", 1, "b", 1, plan.scale_block), Tie("sfb", 2, "b", 2),
    ]  # fmt: skip
    return launch(plan, compiled, lhs, rhs, sfa, sfb, {
        "sfa": ((m, blocks, batch), (1, ld_a, blocks * ld_a)),
        "sfb": ((b_rows, blocks, batch), (1, ld_b, blocks * ld_b)),
    }, ties)  # fmt: skip


def launch(plan, compiled, lhs, rhs, sfa, sfb, scale_modes, ties=()):
    """The custom call of `plan`'s block-scaled kernel (`compiled`, either arch's), through
    `gpu_lowering.launch`: lhs [B, m, k] and rhs [B, n, k] as a (m, k, B) and b (n, k, B),
    K-major; the result [B, m, n] as d (m, n, B); the scales as the arch's kernel reads them
    (`scale_modes`: the modes of "sfa" and "sfb", `ties` theirs to a's and b's)."""
    from jax_sm100._src import gpu_lowering  # noqa: PLC0415

    batch, m, n, k = plan.batch, plan.m, plan.n, plan.k
    modes = {
        "a": ((m, k, batch), (k, 1, m * k)),
        "b": ((n, k, batch), (k, 1, n * k)),
        "d": ((m, n, batch), (n, 1, m * n)),
    } | scale_modes
    dtypes = {"a": plan.a_dtype, "b": plan.b_dtype, "d": plan.out_dtype,
              "sfa": plan.scale_dtype, "sfb": plan.scale_dtype}  # fmt: skip
    index = {"a": 0, "b": 1, "sfa": 2, "sfb": 3, "d": -1}
    out_type = jax.ShapeDtypeStruct((batch, m, n), np.dtype(plan.out_dtype))
    ties = [*problem_ties(), *ties]
    return gpu_lowering.launch(compiled, [lhs, rhs, sfa, sfb], index, [out_type], modes, dtypes,
                               ties=ties)[0]  # fmt: skip


def _transposed(scales, dtype):
    """[B, rows, blocks] -> ([B, blocks, ld], ld): the rows contiguous, ld >= rows a multiple
    of 16 bytes (TMA's stride rule; the padding is never read: rows past `rows` are out of the
    tensor's bounds, which TMA fills with zeros)."""
    rows = scales.shape[1]
    quantum = constraints.tma_quantum_bits(constraints.SCALE_DTYPE_BITS[dtype])
    ld = -(-rows // quantum) * quantum
    t = jnp.swapaxes(scales, 1, 2)
    if ld != rows:
        t = jnp.pad(t, ((0, 0), (0, 0), (0, ld - rows)))
    return t, ld


# The kernels scaled_matmul lowers to, by plan kernel: (plan, lhs, rhs, lhs_scales, rhs_scales)
# -> out [B, m, n].
def _call_sm100(plan, *args):
    """The sm_100a block-scaled kernel (mxfp8, nvfp4): scaled_sm100.py."""
    from jax_sm100._src import scaled_sm100  # noqa: PLC0415

    return scaled_sm100.call(plan, *args)


_KERNEL_CALLS = {
    planning.KERNEL_SM90_SCALED: _call_sm90,
    planning.KERNEL_SM100_BLOCKSCALED: _call_sm100,
}
