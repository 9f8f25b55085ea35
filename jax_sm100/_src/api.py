"""The public functions: `matmul` and `plan_for`."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np

from jax_sm100._src import (
    constraints,
    dispatch,
    lowering,  # noqa: F401  (registers the lowerings)
    planning,
)
from jax_sm100._src import dot_general as DG
from jax_sm100._src import dtypes as D
from jax_sm100._src import primitive as P
from jax_sm100._src.constraints import FP8_DTYPES
from jax_sm100._src.kernels.spec import ACTIVATIONS


def _weak(x) -> bool:
    return bool(getattr(jax.typeof(x), "weak_type", False))


def result_type(a, b, out_dtype):
    """(a, b, result dtype, weak): `jnp.matmul`'s result type for `a @ b`, and the operands.

    As jnp: weak types have no say (`weak float32 @ bfloat16` is bfloat16) and the result is
    weakly typed when both operands are. A weakly typed operand is converted to the result
    dtype, as jnp's elementwise ops do, so that the product has one operand dtype and can run
    on the kernels. fp8 operands, which jnp does not promote, follow `dtypes.default_out_dtype`
    (a weakly typed operand beside one: both taken as bfloat16, exactly for the fp8 one).
    With `out_dtype` the operands are converted alike.
    A weakly typed integer operand (a broadcast Python int) beside a float one is first the
    weakly typed float a Python float would be, so that it follows the same rules (an integer
    product stays refused).
    """
    weak_a, weak_b = _weak(a), _weak(b)
    inexact_a, inexact_b = (jnp.issubdtype(x.dtype, jnp.inexact) for x in (a, b))
    if weak_a and jnp.issubdtype(a.dtype, jnp.integer) and inexact_b:
        a = a + 0.0  # a weak float of the default float dtype, as jnp promotes it
    if weak_b and jnp.issubdtype(b.dtype, jnp.integer) and inexact_a:
        b = b + 0.0
    a_name = D.operand_dtype_name(a.dtype, "a")
    b_name = D.operand_dtype_name(b.dtype, "b")
    if a_name in FP8_DTYPES or b_name in FP8_DTYPES:
        # A weakly typed operand beside fp8 (it stayed float32, and the pair ran on XLA's
        # dot): both become bfloat16, which holds every fp8 value exactly and rounds the weak
        # one as it would beside a bfloat16 operand (narrowed to fp8, whose largest value is
        # 448, 1000 was a NaN), so the 16-bit kernel runs the pair; the result is bfloat16.
        if weak_a != weak_b:
            a, b = a.astype(jnp.bfloat16), b.astype(jnp.bfloat16)
            a_name = b_name = "bfloat16"
        out = np.dtype(D.default_out_dtype(a_name, b_name))  # (an fp8 operand is never weak)
    else:
        out = np.dtype(jnp.result_type(a, b))
        if weak_a and not weak_b and a.dtype != out:
            a = a.astype(out)
        if weak_b and not weak_a and b.dtype != out:
            b = b.astype(out)
    if out_dtype is not None:
        return a, b, D.requested(out_dtype, "out_dtype", "jax_sm100.matmul", stacklevel=5), False
    return a, b, out, weak_a and weak_b


def _prepare(a, b, bias, c, activation, out_dtype, alpha, beta):
    """Validates user inputs and brings them to the primitive's operand form.

    Returns the operands, the primitive params (without `plan`), the shape of the result and
    whether the result is weakly typed.
    """
    # jax arrays and tracers pass through as they are (see the batch comment below).
    a, b = P.as_array(a, "matmul", "a"), P.as_array(b, "matmul", "b")
    if activation not in ACTIVATIONS:
        raise ValueError(
            f"jax_sm100.matmul: unknown {activation=}; use one of {ACTIVATIONS} "
            "('gelu' is the tanh approximation)"
        )
    for name, v in (("alpha", alpha), ("beta", beta)):
        if not isinstance(v, (int, float, np.floating, np.integer)) or isinstance(v, bool):
            raise TypeError(
                f"jax_sm100.matmul: {name} must be a Python float (it is compiled into the "
                f"kernel's epilogue), got {type(v).__name__}; for a traced scale s, scale an "
                "operand (matmul(s * a, b)) or the result"
            )
    if a.ndim == 0 or b.ndim == 0:
        raise ValueError(
            f"jax_sm100.matmul: operands must have rank >= 1, as for jnp.matmul; got "
            f"a.shape={a.shape} and b.shape={b.shape}"
        )
    a, b, out_dt, weak = result_type(a, b, out_dtype)
    # 1-D operands as jnp.matmul takes them: a vector a is one row [1, k], a vector b one
    # K-major column (the same memory read as [n=1, k], so k stays the contiguous dim); the
    # unit dim leaves the result.
    a_vec, b_vec = a.ndim == 1, b.ndim == 1
    if a_vec:
        a = a.reshape(1, a.shape[0])
    if b_vec:
        b = b.reshape(1, b.shape[0])
    m, k = a.shape[-2:]
    kb, n = (b.shape[-1], 1) if b_vec else b.shape[-2:]
    a_shape, b_shape = a.shape[a_vec:], b.shape[b_vec:]
    shapes = f"a.shape={a_shape} and b.shape={b_shape}"
    if k != kb:
        raise ValueError(
            f"jax_sm100.matmul: contracting dims differ: a.shape={a_shape} has k={k} but "
            f"b.shape={b_shape} has k={kb}; a is [..., m, k] or [k], b is [..., k, n] or [k]"
        )
    try:
        batch = jnp.broadcast_shapes(a.shape[:-2], b.shape[:-2])
    except ValueError:
        raise ValueError(
            f"jax_sm100.matmul: batch dims of {shapes} do not broadcast (numpy rules, as "
            "jnp.matmul)"
        ) from None
    out_shape = (*batch, *((m,) if not a_vec else ()), *((n,) if not b_vec else ()))
    if bias is not None:
        bias = P.as_array(bias, "matmul", "bias")
        D.operand_dtype_name(bias.dtype, "bias")
        if bias.shape != (n,):
            raise ValueError(
                f"jax_sm100.matmul: bias must have shape [n] = ({n},)"
                f"{' (b is a vector: n = 1)' if b_vec else ''}, got bias.shape={bias.shape}; "
                "for a per-row or full-shape addend use c"
            )
    if c is not None:
        c = P.as_array(c, "matmul", "c")
        D.operand_dtype_name(c.dtype, "c")
        try:
            ok = jnp.broadcast_shapes(c.shape, out_shape) == out_shape
        except ValueError:
            ok = False
        if not ok:
            raise ValueError(
                f"jax_sm100.matmul: c.shape={c.shape} does not broadcast to the output shape "
                f"{out_shape} ({shapes})"
            )
        # To the result's rank, then the vectors' unit dims back in.
        c = c.reshape((1,) * (len(out_shape) - c.ndim) + c.shape)
        if b_vec:
            c = c[..., None]
        if a_vec:
            c = c[..., None, :]

    # Every operand to the primitive's rank: `a` as it is when it already has every batch dim
    # (it then reaches the primitive as the very value given, which autodiff.py relies on to
    # fuse an activation's derivative into the next product's backward), the rest with unit
    # dims, which the kernels read with batch stride 0. A 2-D weight shared by every batch
    # lets the kernels fold the batch into m (primitive.folds_batch): one large GEMM.
    nb = len(batch)
    a_op = a if a.ndim == nb + 2 else a.reshape((1,) * (nb + 2 - a.ndim) + a.shape)
    b_op = b if b.ndim == nb + 2 else b.reshape((1,) * (nb + 2 - b.ndim) + b.shape)
    operands = [a_op, b_op]
    c_op = None
    if c is not None:
        # The matrix dims must be full; batch dims stay 1 where c broadcasts (no copy).
        c_full = c.reshape((1,) * (nb + 2 - c.ndim) + c.shape)
        if c_full.shape[-2:] != (m, n):
            c_full = jnp.broadcast_to(c_full, c_full.shape[:-2] + (m, n))
        c_op = c_full
    if bias is not None:
        operands.append(bias.reshape((1,) * nb + (n,)))
    if c_op is not None:
        operands.append(c_op)
    P.check_batch_shardings(a_op, b_op, None, c_op, nb)
    params = dict(
        transpose_a=False, transpose_b=b_vec, alpha=float(alpha), beta=float(beta),
        activation=activation, out_dtype=out_dt, has_bias=bias is not None,
        has_c=c is not None, save_preact=False, act_grad=None,
    )  # fmt: skip
    return operands, params, out_shape, weak


def matmul(
    a,
    b,
    *,
    bias=None,
    c=None,
    alpha: float = 1.0,
    beta: float = 1.0,
    activation: str | None = None,
    out_dtype=None,
    plan: planning.GemmPlan | None = None,
    precision=None,
    preferred_element_type=None,
    out_sharding=None,
) -> jax.Array:
    """`activation(alpha * (a @ b) + beta * c + bias)` on CuTe DSL GEMM kernels.

    Operands follow `jnp.matmul`: 1-D operands are a row or a column whose unit dim leaves the
    result, leading batch dims broadcast, and the result dtype is jnp's (weak types included).
    Products accumulate in float32 and the epilogue runs in float32 before converting to
    `out_dtype`. Works under `jit`, `vmap`, `grad` (to any order), `jax.export` and sharding.

    Args:
      a: [..., m, k] or [k] array of bfloat16, float16, float32, float8_e4m3fn or float8_e5m2
        (float64 too, on XLA's dot).
      b: [..., k, n] or [k] array, same dtypes.
      bias: optional [n] array, added to every row.
      c: optional array broadcastable to the output, scaled by `beta`.
      alpha: Python float scaling the product.
      beta: Python float scaling `c`.
      activation: None, "relu", "gelu" (tanh form) or "silu".
      out_dtype: result dtype; defaults to jnp.matmul's result type (bfloat16 for two fp8s,
        the other operand's dtype for one fp8 beside a strongly typed one; bfloat16 beside a
        weakly typed one). A 64-bit dtype without `jax_enable_x64` is
        truncated with jnp's warning.
      plan: optional `GemmPlan` (from `jax_sm100.plan`, possibly edited with
        `dataclasses.replace`) to run instead of the planner's choice; it must be for this
        problem's sizes, dtypes and layouts, or for the form the lowering gives a call with
        fp8 in it (`plan_for`'s plan; `dispatch.kernel_form`).
      precision: as `jnp.matmul`. The kernels meet every `lax.Precision` for 16-bit operands,
        and the presets naming them (`lax.DotAlgorithmPreset.BF16_BF16_F32`, `F16_F16_F32`,
        and `ANY_F8_ANY_F8_F32_FAST_ACCUM` of two fp8 operands); two fp8 operands at HIGH,
        HIGHEST or `ANY_F8_ANY_F8_F32` (float32 accumulation, where the kernels accumulate as
        cuBLAS's fast mode, XLA's DEFAULT), `HIGHEST` with float32 operands, or another dot
        algorithm, run on XLA's dot.
        `jax.default_matmul_precision` is not consulted (`jax_sm100.dot_general` does).
      preferred_element_type: `jnp.matmul`'s name for `out_dtype`.
      out_sharding: as `jnp.matmul`; the result is resharded to it.

    Returns:
      The [..., m, n] result ([..., m] for a vector b, [..., n] for a vector a).

    Raises:
      ValueError: a scalar operand, mismatched k, non-broadcasting batch dims, a bias or c of
        the wrong shape, an unknown activation, two different out_dtype and
        preferred_element_type.
      TypeError: integer, complex or other unsupported dtypes; alpha or beta not a Python
        real number (a bool, string, complex or array); a plan that is not a GemmPlan.
      PlanError: a plan that does not fit the problem (a ValueError).
    """
    if preferred_element_type is not None:
        # Checked under its own name here; result_type checks (and truncates) it as out_dtype.
        D.dtype_argument_name(preferred_element_type, "preferred_element_type", "jax_sm100.matmul")
        if out_dtype is not None and D.name(out_dtype) != D.name(preferred_element_type):
            raise ValueError(
                f"jax_sm100.matmul: {out_dtype=} and {preferred_element_type=} differ; pass one"
            )
        out_dtype = preferred_element_type
    operands, params, out_shape, weak = _prepare(a, b, bias, c, activation, out_dtype, alpha, beta)
    split = P._split(operands, params["has_bias"], params["has_c"])
    if DG.unreduced_axes(out_sharding):
        # Partial sums of the product, as jnp.matmul gives them: the partitioned kernels reduce
        # k's partials, and an epilogue cannot apply to partial sums.
        epilogue = (bias, c, activation, plan)
        if any(v is not None for v in epilogue) or alpha != 1.0:
            raise ValueError(
                "jax_sm100.matmul: an unreduced out_sharding asks for partial sums, to which "
                "bias, c, an activation, alpha or a plan cannot apply; ask for the reduced "
                "result, or apply them after the reduction"
            )
        DG.record_fallback("jax_sm100.matmul", "an unreduced out_sharding", runs="jnp.matmul")
        out = jnp.matmul(
            P.as_array(a, "matmul", "a"), P.as_array(b, "matmul", "b"), precision=precision,
            preferred_element_type=params["out_dtype"], out_sharding=out_sharding,
        )  # fmt: skip
        return DG.with_result_type(out, weak, None)
    # Only a precision passed here counts, not `jax.default_matmul_precision`: the XLA path
    # below is jnp's math, without the primitive's sharding rules (see the README).
    reason = None
    if precision is not None:
        reason = DG.precision_reason(precision, split[0].dtype, split[1].dtype)
    if reason is not None:
        if plan is not None:
            raise ValueError(f"jax_sm100.matmul: plan= runs our kernels, but {reason}")
        DG.record_fallback("jax_sm100.matmul", reason, runs="XLA's dot and epilogue")
        kw = {k: v for k, v in params.items() if k not in ("has_bias", "has_c")}
        (out,) = P.reference_matmul(*split, upcast=False, precision=precision, **kw)
        return DG.with_result_type(out.reshape(out_shape), weak, out_sharding)
    if plan is not None:
        if not isinstance(plan, planning.GemmPlan):
            raise TypeError(
                f"jax_sm100.matmul: plan must be a jax_sm100.GemmPlan (from jax_sm100.plan), "
                f"got {type(plan).__name__}"
            )
        problem = P.problem_for_operands(*split, **params)
        try:
            planning.check_plan_fits(plan, problem, plan.arch)
        except constraints.PlanError as e:
            # A plan of the kernels' form of the call (`plan_for`'s, with fp8 in it) fits too.
            shaped, form = _kernel_form(split, params, plan.arch)
            if not form.notes:
                raise
            kernels = P.problem_for_operands(*shaped, **_form_params(params, form))
            try:
                planning.check_plan_fits(plan, kernels, plan.arch)
            except constraints.PlanError:
                raise e from None
    (out,) = P.matmul_p.bind(*operands, plan=plan, **params)
    return DG.with_result_type(out.reshape(out_shape), weak, out_sharding)


def _kernel_form(split, params, arch):
    """The kernels' form of one call (`dispatch.kernel_form_of`), and its operands (a, b,
    bias, c) as `jax.ShapeDtypeStruct`s."""
    a, b, bias, c = split
    form = dispatch.kernel_form_of(
        a, b, c, transpose_a=params["transpose_a"], transpose_b=params["transpose_b"],
        out_dtype=params["out_dtype"], arch=arch,
    )  # fmt: skip
    return (form.a, form.b, bias, form.c), form


def _form_params(params, form):
    """The primitive's params with the kernels' form's layouts and result dtype."""
    return {**params, "transpose_a": form.transpose_a, "transpose_b": form.transpose_b,
            "out_dtype": form.out_dtype}  # fmt: skip


def plan_for(
    a, b, *, bias=None, c=None, activation=None, out_dtype=None, arch: str | None = None
) -> planning.GemmPlan:
    """The plan `matmul(a, b, ...)` runs with on this machine's default device, or on `arch`.

    `a`, `b`, `bias` and `c` may be arrays or `jax.ShapeDtypeStruct`s. On a machine without an
    SM90/SM100 GPU and no `arch`, the plan is the sm_100a one with `kernel="xla_dot"`, since
    the primitive lowers to XLA's dot there. An empty product (a zero dim in `a` or `b`) has
    no plan and raises `PlanError`: `matmul` computes it with XLA's dot. With fp8 in the call
    the plan is of the problem the kernels run (`dispatch.kernel_form`: fp8 results planned in
    float32, mixed operands widened, sm_90a's fp8 operands K-major), as `matmul` takes it back.
    """
    captured = {}
    device = dispatch.device_target()
    target = device if device is not None and arch in (None, device.arch) else None
    if target is None:
        target = dispatch.Target(arch or "sm_100a")

    if out_dtype is not None:
        # Checked and truncated (with jnp's warning, naming the caller's line) here, not inside
        # the trace below.
        out_dtype = D.requested(out_dtype, "out_dtype", "jax_sm100.plan_for")

    def trace(a, b, bias, c):
        ops, captured["params"], *_ = _prepare(a, b, bias, c, activation, out_dtype, 1.0, 1.0)
        return ops

    ops = jax.eval_shape(trace, a, b, bias, c)
    params = captured["params"]
    if any(d == 0 for x in ops[:2] for d in x.shape):
        raise constraints.PlanError(
            f"jax_sm100.plan_for: operands of shapes {ops[0].shape} and {ops[1].shape} make an "
            "empty product, which has no plan: matmul computes it with XLA's dot (zeros where "
            "k = 0)"
        )
    operands, form = _kernel_form(P._split(ops, params["has_bias"], params["has_c"]), params,
                                  target.arch)  # fmt: skip
    problem = P.problem_for_operands(*operands, **_form_params(params, form))
    p = dispatch.plan_call(problem, target).plan
    if arch is None and device is None and p.kernel != planning.KERNEL_XLA:
        reason = (
            f"{jax.default_backend()} backend: the primitive lowers to XLA's dot here (the "
            "kernels need a GPU of compute capability 9.0 or 10.0)"
        )
        return dataclasses.replace(p, kernel=planning.KERNEL_XLA, reason=reason, split_k=1)
    return p
