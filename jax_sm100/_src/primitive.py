"""The `jax_sm100_matmul` primitive: shape rule, reference math, JVP, transpose and batching.

Operands, in order: `a`, `b`, then `bias` when `has_bias`, then `c` when `has_c`.

    a     [*Ba, m, k]  ([*Ba, k, m] when transpose_a)
    b     [*Bb, k, n]  ([*Bb, n, k] when transpose_b)
    bias  [*Bbias, n]
    c     [*Bc, m, n]
    out   [*B, m, n]   B = broadcast(Ba, Bb, Bbias, Bc)

Every operand has the same number of batch dims, and each batch dim is either B's or 1 (a
broadcast that the kernels serve with batch stride 0, never a copy). The math is
`activation(alpha * (A @ B) + beta * c + bias)` with float32 accumulation and epilogue.

The public `matmul` (api.py) brings user inputs to this form. Lowerings live in lowering.py.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.extend import core as jex_core
from jax.interpreters import ad, batching

from jax_sm100._src import dtypes as D
from jax_sm100._src.kernels.spec import ACTIVATIONS

matmul_p = jex_core.Primitive("jax_sm100_matmul")


# --- shapes ------------------------------------------------------------------------------------


def _split(args, has_bias, has_c):
    a, b, *rest = args
    bias = rest.pop(0) if has_bias else None
    c = rest.pop(0) if has_c else None
    return a, b, bias, c


def problem_dims(a_shape, b_shape, transpose_a, transpose_b):
    """(m, n, k) of the logical product, before any validation."""
    m, ka = (a_shape[-1], a_shape[-2]) if transpose_a else (a_shape[-2], a_shape[-1])
    kb, n = (b_shape[-1], b_shape[-2]) if transpose_b else (b_shape[-2], b_shape[-1])
    return m, n, ka, kb


def shape_rule(a_shape, b_shape, bias_shape, c_shape, *, transpose_a, transpose_b):
    """The output shape `[*B, m, n]`; ValueError quoting the operands otherwise."""
    if len(a_shape) < 2 or len(b_shape) < 2:
        raise ValueError(
            f"jax_sm100.matmul needs operands of rank >= 2 ([..., m, k] and [..., k, n]); got "
            f"a.shape={tuple(a_shape)} and b.shape={tuple(b_shape)}. Add a unit dim, "
            "e.g. x[None, :], for a vector."
        )
    if len(a_shape) != len(b_shape):
        raise ValueError(
            f"primitive operands must have equal rank, got a.shape={a_shape}, b.shape={b_shape}"
        )
    m, n, ka, kb = problem_dims(a_shape, b_shape, transpose_a, transpose_b)
    if ka != kb:
        raise ValueError(
            f"jax_sm100.matmul: contracting dims differ: a.shape={tuple(a_shape)} has k={ka} "
            f"but b.shape={tuple(b_shape)} has k={kb}; a is [..., m, k] and b is [..., k, n]"
        )
    batches = [tuple(a_shape[:-2]), tuple(b_shape[:-2])]
    if bias_shape is not None:
        if tuple(bias_shape[-1:]) != (n,) or len(bias_shape) != len(a_shape) - 1:
            raise ValueError(
                f"bias must have shape [n] = [{n}] (as [*batch, n] inside the primitive); "
                f"got bias.shape={tuple(bias_shape)}"
            )
        batches.append(tuple(bias_shape[:-1]))
    if c_shape is not None:
        if tuple(c_shape[-2:]) != (m, n) or len(c_shape) != len(a_shape):
            raise ValueError(
                f"c must have shape [..., m, n] = [..., {m}, {n}]; got c.shape={tuple(c_shape)}"
            )
        batches.append(tuple(c_shape[:-2]))
    out_batch = []
    for sizes in zip(*batches, strict=True):
        big = {s for s in sizes if s != 1}
        if len(big) > 1:
            raise ValueError(
                f"batch dims do not broadcast: {batches} (each must be 1 or a common size)"
            )
        out_batch.append(big.pop() if big else 1)
    return (*out_batch, m, n)


def _abstract_eval(*args, transpose_a, transpose_b, alpha, beta, activation, out_dtype,
                   has_bias, has_c, plan):  # fmt: skip
    a, b, bias, c = _split(args, has_bias, has_c)
    for name, x in (("a", a), ("b", b), ("bias", bias), ("c", c)):
        if x is not None:
            D.operand_dtype_name(x.dtype, name)
    if activation not in ACTIVATIONS:
        raise ValueError(f"{activation=} must be one of {ACTIVATIONS}")
    shape = shape_rule(
        a.shape, b.shape, None if bias is None else bias.shape, None if c is None else c.shape,
        transpose_a=transpose_a, transpose_b=transpose_b,
    )  # fmt: skip
    sharding = _out_sharding(a, b, bias, c, shape, transpose_a, transpose_b)
    if sharding is None:
        return jax.core.ShapedArray(shape, out_dtype)
    return jax.core.ShapedArray(shape, out_dtype, sharding=sharding)


def _out_sharding(a, b, bias, c, out_shape, transpose_a, transpose_b):
    """The result's sharding type under Explicit mesh axes (None elsewhere).

    As for a dot: batch dims as the operands that are not broadcast along them have them, m as
    a's, n as b's; a sharded k is reduced (sharding.py sums the partial products), so the
    result is whole along k's axes.
    """
    ops = [x for x in (a, b, bias, c) if x is not None]
    meshes = {x.sharding.mesh for x in ops if getattr(x, "sharding", None) is not None
              and not x.sharding.mesh.empty}  # fmt: skip
    if len(meshes) > 1:
        raise ValueError(f"jax_sm100.matmul: operands are sharded over different meshes {meshes}")
    if not meshes:
        return None
    (mesh,) = meshes
    if not mesh._any_axis_explicit:
        return None

    def spec(x, i):
        return x.sharding.spec[i] if i < len(x.sharding.spec) else None

    nb = len(out_shape) - 2
    batch = []
    for i in range(nb):
        owners = [x for x in (a, b, c, bias) if x is not None and x.shape[i] != 1]
        specs = {spec(x, i) for x in owners} - {None}
        if len(specs) > 1:
            raise ValueError(
                f"jax_sm100.matmul: batch dim {i} is sharded differently across operands "
                f"({sorted(map(str, specs))}); reshard them to one sharding first"
            )
        batch.append(specs.pop() if specs else None)
    # m as a has it and n as b has it; where those are whole, as c has them (c is the result's
    # shape, and typing the result like c spares resharding c).
    m_spec = spec(a, nb + (1 if transpose_a else 0))
    n_spec = spec(b, nb + (0 if transpose_b else 1))
    if c is not None:
        m_spec = m_spec if m_spec is not None else spec(c, nb)
        n_spec = n_spec if n_spec is not None else spec(c, nb + 1)
    parts = [*batch, m_spec, n_spec]
    while parts and parts[-1] is None:
        parts.pop()
    return jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec(*parts))


# --- reference math (CPU lowering, XLA fallback) -----------------------------------------------


def apply_activation(z, activation):
    if activation is None:
        return z
    if activation == "relu":
        return jnp.maximum(z, 0)
    if activation == "gelu":
        return jax.nn.gelu(z, approximate=True)
    if activation == "silu":
        return z * jax.nn.sigmoid(z)
    raise ValueError(f"{activation=} must be one of {ACTIVATIONS}")


def _activation_grad(z, activation):
    """d activation / dz at z (float32), for the JVP."""
    if activation == "relu":
        return (z > 0).astype(z.dtype)
    if activation == "gelu":
        c = math.sqrt(2 / math.pi)
        inner = c * (z + 0.044715 * z**3)
        t = jnp.tanh(inner)
        return 0.5 * (1 + t) + 0.5 * z * (1 - t * t) * c * (1 + 3 * 0.044715 * z * z)
    if activation == "silu":
        s = jax.nn.sigmoid(z)
        return s * (1 + z * (1 - s))
    raise ValueError(f"{activation=} has no gradient rule")


def reference_matmul(a, b, bias, c, *, transpose_a, transpose_b, alpha, beta, activation,
                     out_dtype, upcast):  # fmt: skip
    """The primitive's math in XLA ops: a batched dot_general plus the float32 epilogue.

    `upcast` converts operands to float32 first (exact for every accepted dtype, and what the CPU
    backend needs for fp8); otherwise the dot runs natively with a float32 accumulator.
    """
    acc_t = acc_dtype(a.dtype, b.dtype, out_dtype)
    if upcast:
        a, b = a.astype(acc_t), b.astype(acc_t)
    nb = a.ndim - 2
    out_batch = shape_rule(
        a.shape, b.shape, None if bias is None else bias.shape, None if c is None else c.shape,
        transpose_a=transpose_a, transpose_b=transpose_b,
    )[:-2]  # fmt: skip
    # Broadcast batch dims to dot_general's batch form (free inside XLA's fusion of the dot).
    a = jnp.broadcast_to(a, (*out_batch, *a.shape[-2:]))
    b = jnp.broadcast_to(b, (*out_batch, *b.shape[-2:]))
    batch = tuple(range(nb))
    contract_a = nb if transpose_a else nb + 1
    contract_b = nb + 1 if transpose_b else nb
    acc = lax.dot_general(
        a, b, (((contract_a,), (contract_b,)), (batch, batch)),
        precision=lax.Precision.HIGHEST, preferred_element_type=acc_t,
    )  # fmt: skip
    z = acc if alpha == 1.0 else alpha * acc
    if c is not None:
        z = z + (c.astype(acc_t) if beta == 1.0 else beta * c.astype(acc_t))
    if bias is not None:
        z = z + jnp.expand_dims(bias.astype(acc_t), -2)
    return apply_activation(z, activation).astype(out_dtype)


# --- differentiation ---------------------------------------------------------------------------


def acc_dtype(*dtypes) -> np.dtype:
    """The accumulator/epilogue dtype: float32, or float64 when any dtype involved is float64."""
    wide = any(np.dtype(d) == np.float64 for d in dtypes)
    return np.dtype(np.float64 if wide else np.float32)


def _bind(*args, **params):
    return matmul_p.bind(*args, **params)


def _linear_params(transpose_a, transpose_b, alpha, out_dtype, *, has_c=False, beta=1.0):
    return dict(
        transpose_a=transpose_a, transpose_b=transpose_b, alpha=alpha, beta=beta,
        activation=None, out_dtype=np.dtype(out_dtype), has_bias=False, has_c=has_c, plan=None,
    )  # fmt: skip


def _jvp(primals, tangents, *, transpose_a, transpose_b, alpha, beta, activation, out_dtype,
         has_bias, has_c, plan):  # fmt: skip
    a, b, bias, c = _split(primals, has_bias, has_c)
    ta, tb, tbias, tc = _split(tangents, has_bias, has_c)
    params = dict(
        transpose_a=transpose_a, transpose_b=transpose_b, alpha=alpha, beta=beta,
        activation=activation, out_dtype=out_dtype, has_bias=has_bias, has_c=has_c, plan=plan,
    )  # fmt: skip
    acc = acc_dtype(out_dtype, a.dtype, b.dtype)
    if activation is None:
        out = _bind(*primals, **params)
    else:
        # The pre-activation z is needed for the activation's derivative; keep it in float32.
        # A user's plan was made for the fused call's output dtype, so z is planned afresh.
        z = _bind(*primals, **{**params, "activation": None, "out_dtype": acc, "plan": None})
        out = apply_activation(z, activation).astype(out_dtype)
    f32 = acc
    nonzero = lambda t: t is not None and type(t) is not ad.Zero  # noqa: E731
    tbias = tbias if nonzero(tbias) else None
    tc = tc if nonzero(tc) else None
    # d(alpha A @ B + beta c + bias) = alpha dA @ B + alpha A @ dB + beta dc + dbias, each term
    # through the primitive: the first product carries dbias and dc in its epilogue, the
    # second reads the first as C. (Broadcasting the epilogue tangents with jnp ops instead
    # would type them unsharded, and their transpose would all-gather under Explicit axes.)
    dz = None
    for x, y in ((ta, b), (a, tb)):
        if type(x) is ad.Zero or type(y) is ad.Zero:
            continue
        if dz is None:
            ops = [x, y] + [t for t in (tbias, tc) if t is not None]
            p = _linear_params(transpose_a, transpose_b, alpha, f32, has_c=tc is not None,
                               beta=beta)  # fmt: skip
            dz = _bind(*ops, **{**p, "has_bias": tbias is not None})
            tbias = tc = None
        else:
            dz = _bind(x, y, dz, **_linear_params(transpose_a, transpose_b, alpha, f32,
                                                   has_c=True))  # fmt: skip
    nb = out.ndim - 2
    if tc is not None:  # no product term carried it
        term = _broadcast_like(beta * tc.astype(f32), tuple(range(nb + 2)), out)
        dz = term if dz is None else dz + term
    if tbias is not None:
        term = _broadcast_like(tbias.astype(f32), (*range(nb), nb + 1), out)
        dz = term if dz is None else dz + term
    if dz is None:
        return out, ad.Zero.from_primal_value(out)
    if activation is not None:
        dz = _activation_grad(z, activation) * dz
    return out, dz.astype(out_dtype)


def _broadcast_like(x, dims, like):
    """`x` broadcast to `like`'s shape and, under Explicit mesh axes, typed with its sharding
    (so that the transpose sums the cotangent where it lies instead of gathering it)."""
    sharding = jax.typeof(like).sharding
    explicit = sharding is not None and not sharding.mesh.empty and sharding.mesh._any_axis_explicit
    return lax.broadcast_in_dim(x, like.shape, dims, out_sharding=sharding if explicit else None)


def _unbroadcast(x, shape):
    """Sums x over the dims where `shape` (same rank) has 1 and x does not."""
    axes = tuple(i for i, (s, t) in enumerate(zip(shape, x.shape, strict=True)) if s == 1 != t)
    return jnp.sum(x, axis=axes, keepdims=True) if axes else x


def _aval_dtype(x):
    return x.aval.dtype if ad.is_undefined_primal(x) else x.dtype


def _transpose(ct, *args, transpose_a, transpose_b, alpha, beta, activation, out_dtype,
               has_bias, has_c, plan):  # fmt: skip
    if activation is not None:
        raise NotImplementedError("jax_sm100_matmul is not linear with an activation")
    a, b, bias, c = _split(args, has_bias, has_c)
    undef = ad.is_undefined_primal
    if undef(a) and undef(b):
        raise NotImplementedError("jax_sm100_matmul is bilinear, not linear, in (a, b)")
    if type(ct) is ad.Zero:
        return [None] * len(args)
    f32 = acc_dtype(ct.dtype, _aval_dtype(a), _aval_dtype(b))
    ct_a = ct_b = ct_bias = ct_c = None
    if undef(a):
        aval = a.aval
        # dA = alpha * G @ B^T, in whichever storage order a has.
        if transpose_a:
            x, y, ta_, tb_ = b, ct, transpose_b, True
        else:
            x, y, ta_, tb_ = ct, b, False, not transpose_b
        full = _bind(x, y, **_linear_params(ta_, tb_, alpha, f32))
        ct_a = _unbroadcast(full, aval.shape).astype(aval.dtype)
    if undef(b):
        aval = b.aval
        # dB = alpha * A^T @ G, in whichever storage order b has.
        if transpose_b:
            x, y, ta_, tb_ = ct, a, True, transpose_a
        else:
            x, y, ta_, tb_ = a, ct, not transpose_a, False
        full = _bind(x, y, **_linear_params(ta_, tb_, alpha, f32))
        ct_b = _unbroadcast(full, aval.shape).astype(aval.dtype)
    if has_c and undef(c):
        g = ct.astype(f32) if beta == 1.0 else beta * ct.astype(f32)
        ct_c = _unbroadcast(g, c.aval.shape).astype(c.aval.dtype)
    if has_bias and undef(bias):
        g = jnp.sum(ct.astype(f32), axis=-2)
        ct_bias = _unbroadcast(g, bias.aval.shape).astype(bias.aval.dtype)
    out = [ct_a, ct_b]
    if has_bias:
        out.append(ct_bias)
    if has_c:
        out.append(ct_c)
    return out


# --- batching ----------------------------------------------------------------------------------


def _batch(args, dims, **params):
    """Folds a vmapped axis into the primitive's batch dims.

    The new batch dim goes where the first mapped operand already has it when that is among its
    batch dims (so `in_axes=0`, or any batch position, costs no transpose); other mapped operands
    move theirs there, and unmapped ones get a unit dim, which the kernels read with batch
    stride 0, so a shared weight is never copied per batch.
    """
    nb = args[0].ndim - 2
    first = next(d for d in dims if d is not None)
    at = first if first <= nb else 0
    moved = []
    for x, d in zip(args, dims, strict=True):
        if d is None:
            moved.append(jnp.expand_dims(x, at))
        else:
            moved.append(x if d == at else jnp.moveaxis(x, d, at))
    return _bind(*moved, **params), at


# --- registration ------------------------------------------------------------------------------


def _impl(*args, **params):
    from jax._src import dispatch  # noqa: PLC0415

    return dispatch.apply_primitive(matmul_p, *args, **params)


matmul_p.def_impl(_impl)
matmul_p.def_abstract_eval(_abstract_eval)
ad.primitive_jvps[matmul_p] = _jvp
ad.primitive_transposes[matmul_p] = _transpose
batching.primitive_batchers[matmul_p] = _batch


def plan_for_operands(a, b, bias, c, *, transpose_a, transpose_b, out_dtype, arch, **_):
    """The planner's plan for one bind of the primitive (operands given as avals or arrays)."""
    from jax_sm100._src import planning  # noqa: PLC0415

    out_shape = shape_rule(
        a.shape, b.shape, None if bias is None else bias.shape, None if c is None else c.shape,
        transpose_a=transpose_a, transpose_b=transpose_b,
    )  # fmt: skip
    m, n, k, _ = problem_dims(a.shape, b.shape, transpose_a, transpose_b)
    return planning.plan(
        m, n, k,
        a_dtype=a.dtype, b_dtype=b.dtype, out_dtype=out_dtype,
        c_dtype=None if c is None else c.dtype,
        batch=math.prod(out_shape[:-2]), arch=arch,
        a_major="m" if transpose_a else "k", b_major="k" if transpose_b else "n",
    )  # fmt: skip
