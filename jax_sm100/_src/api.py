"""The public functions: `matmul` and `plan_for`."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np

from jax_sm100._src import (
    dispatch,
    lowering,  # noqa: F401  (registers the lowerings)
    planning,
)
from jax_sm100._src import dtypes as D
from jax_sm100._src import primitive as P
from jax_sm100._src.kernels.spec import ACTIVATIONS


def _prepare(a, b, bias, c, activation, out_dtype, alpha, beta):
    """Validates user inputs and brings them to the primitive's operand form.

    Returns the operands, the primitive params (without `plan`), and the shape of the result.
    """
    # jax arrays and tracers pass through as they are (see the batch comment below).
    a = a if isinstance(a, jax.Array) else jnp.asarray(a)
    b = b if isinstance(b, jax.Array) else jnp.asarray(b)
    a_name = D.operand_dtype_name(a.dtype, "a")
    b_name = D.operand_dtype_name(b.dtype, "b")
    if activation not in ACTIVATIONS:
        raise ValueError(
            f"jax_sm100.matmul: unknown {activation=}; use one of {ACTIVATIONS} "
            "('gelu' is the tanh approximation)"
        )
    for name, v in (("alpha", alpha), ("beta", beta)):
        if not isinstance(v, (int, float, np.floating, np.integer)) or isinstance(v, bool):
            raise TypeError(
                f"jax_sm100.matmul: {name} must be a Python float (it is compiled into the "
                f"kernel's epilogue), got {type(v).__name__}; pass a traced scale through c"
            )
    if a.ndim < 2 or b.ndim < 2:
        P.shape_rule(a.shape, b.shape, None, None, transpose_a=False, transpose_b=False)
    m, k = a.shape[-2:]
    kb, n = b.shape[-2:]
    if k != kb:
        raise ValueError(
            f"jax_sm100.matmul: contracting dims differ: a.shape={a.shape} has k={k} but "
            f"b.shape={b.shape} has k={kb}; a is [..., m, k] and b is [..., k, n]"
        )
    try:
        batch = np.broadcast_shapes(a.shape[:-2], b.shape[:-2])
    except ValueError:
        raise ValueError(
            f"jax_sm100.matmul: batch dims of a.shape={a.shape} and b.shape={b.shape} do not "
            "broadcast (numpy rules, as jnp.matmul)"
        ) from None
    out_shape = (*batch, m, n)
    out_name = D.default_out_dtype(a_name, b_name) if out_dtype is None else D.name(out_dtype)
    D.operand_dtype_name(out_name, "out_dtype")
    if bias is not None:
        bias = jnp.asarray(bias)
        D.operand_dtype_name(bias.dtype, "bias")
        if bias.shape != (n,):
            raise ValueError(
                f"jax_sm100.matmul: bias must have shape [n] = ({n},), got bias.shape="
                f"{bias.shape}; for a per-row or full-shape addend use c"
            )
    if c is not None:
        c = jnp.asarray(c)
        D.operand_dtype_name(c.dtype, "c")
        try:
            ok = np.broadcast_shapes(c.shape, out_shape) == out_shape
        except ValueError:
            ok = False
        if not ok:
            raise ValueError(
                f"jax_sm100.matmul: c.shape={c.shape} does not broadcast to the output shape "
                f"{out_shape} (a.shape={a.shape}, b.shape={b.shape})"
            )

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
    params = dict(
        transpose_a=False, transpose_b=False, alpha=float(alpha), beta=float(beta),
        activation=activation, out_dtype=np.dtype(out_name), has_bias=bias is not None,
        has_c=c is not None, save_preact=False, act_grad=None,
    )  # fmt: skip
    return operands, params, out_shape


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
) -> jax.Array:
    """`activation(alpha * (a @ b) + beta * c + bias)` on CuTe DSL GEMM kernels.

    Operands follow `jnp.matmul`: leading batch dims broadcast. Products accumulate in float32
    and the epilogue runs in float32 before converting to `out_dtype`. Works under `jit`,
    `vmap`, `grad` (to any order), `jax.export` and sharding.

    Args:
      a: [..., m, k] array of bfloat16, float16, float32, float8_e4m3fn or float8_e5m2.
      b: [..., k, n] array, same dtypes.
      bias: optional [n] array, added to every row.
      c: optional array broadcastable to the output [..., m, n], scaled by `beta`.
      alpha: Python float scaling the product.
      beta: Python float scaling `c`.
      activation: None, "relu", "gelu" (tanh form) or "silu".
      out_dtype: result dtype; defaults to the operands' result type (bfloat16 for two fp8s).
      plan: optional `GemmPlan` (from `jax_sm100.plan`, possibly edited with
        `dataclasses.replace`) to run instead of the planner's choice; it must be for this
        problem's sizes, dtypes and layouts.

    Returns:
      The [..., m, n] result.

    Raises:
      ValueError: rank < 2, mismatched k, non-broadcasting batch dims, a bias or c of the wrong
        shape, an unknown activation.
      TypeError: integer, complex or other unsupported dtypes; non-float alpha/beta.
      PlanError: a plan that does not fit the problem (a ValueError).
    """
    operands, params, out_shape = _prepare(a, b, bias, c, activation, out_dtype, alpha, beta)
    if plan is not None:
        if not isinstance(plan, planning.GemmPlan):
            raise TypeError(f"plan must be a jax_sm100.GemmPlan, got {type(plan).__name__}")
        problem = P.problem_for_operands(
            *P._split(operands, params["has_bias"], params["has_c"]), **params
        )
        planning.check_plan_fits(plan, problem, plan.arch)
    (out,) = P.matmul_p.bind(*operands, plan=plan, **params)
    return out.reshape(out_shape)


def plan_for(
    a, b, *, bias=None, c=None, activation=None, out_dtype=None, arch: str | None = None
) -> planning.GemmPlan:
    """The plan `matmul(a, b, ...)` runs with on this machine's default device, or on `arch`.

    `a`, `b`, `bias` and `c` may be arrays or `jax.ShapeDtypeStruct`s. On a machine without an
    SM90/SM100 GPU and no `arch`, the plan is the sm_100a one with `kernel="xla_dot"`, since
    the primitive lowers to XLA's dot there.
    """
    captured = {}

    def trace(a, b, bias, c):
        ops, captured["params"], _ = _prepare(a, b, bias, c, activation, out_dtype, 1.0, 1.0)
        return ops

    ops = jax.eval_shape(trace, a, b, bias, c)
    params = captured["params"]
    problem = P.problem_for_operands(*P._split(ops, params["has_bias"], params["has_c"]), **params)
    device = dispatch.device_target()
    target = device if device is not None and arch in (None, device.arch) else None
    if target is None:
        target = dispatch.Target(arch or "sm_100a")
    p = dispatch.plan_call(problem, target).plan
    if arch is None and device is None and p.kernel != planning.KERNEL_XLA:
        reason = (
            f"{jax.default_backend()} backend: the primitive lowers to XLA's dot here (the "
            "kernels need an SM90 or SM100 GPU)"
        )
        return dataclasses.replace(p, kernel=planning.KERNEL_XLA, reason=reason, split_k=1)
    return p
