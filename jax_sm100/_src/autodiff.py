"""Differentiation of the matmul primitive: forward and backward products on the kernels.

What a training step runs (value_and_grad of `act(x @ w1 + b1) @ w2`), and why:

* The forward under `grad` stays one fused kernel: `matmul_p` with `save_preact=True` writes
  `act(z)` and, as a second output of the same epilogue, `z` itself in the output dtype, the
  residual the activation's derivative needs (no float32 copy, no XLA activation pass).
* Tangent products are written in the output dtype, so their transposes (the backward
  products) take the cotangent in the operands' 16-bit dtype and write each gradient in its
  operand's dtype, with float32 accumulation in between, as XLA's dot transpose does for a
  16-bit dot. fp8 operands are differentiated in bfloat16 (the fp8 operand upcast exactly);
  float32 operands stay float32 (XLA's dot on SM90, which has no float32 kernel).
* The activation's derivative runs inside the kernel that produces the upstream gradient. The
  tangent of `h = act(z1)` is `act'(z1) * dz1` (`act_grad_mul_p`). When the next product's A
  tangent is exactly that value (the same object: `h` fed straight into `matmul`), its tangent
  product is bound as `gated_matmul_p(dz1, z1, w2)` = `(act'(z1) * dz1) @ w2`, whose transpose
  is one kernel: `ct @ w2^T` with the epilogue `act'(z1) * acc`, z1 read as C
  (`matmul_p(..., act_grad=act)`). The backward of `act(x @ w + b)` then costs its products and
  no elementwise pass over [tokens, features] besides the bias-gradient reduction. Anything
  between the two products (a reshape, a residual add feeding both, ...) makes a different
  tangent object: the unfused path runs, correct and one elementwise pass slower.
* Weight gradients of a weight shared by a batch (vmap, or [*B, m, k] @ [k, n]) fold the batch
  into the contraction (one GEMM, float32 accumulation), never a per-batch product summed in
  16 bits.

Higher-order AD (hessian-vector products, jacfwd of grad) runs through these same rules; the
backward epilogues differentiate by decomposing into plain products and XLA elementwise math.
"""

from __future__ import annotations

import math
import weakref

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax._src.interpreters import ad as _ad_internal
from jax.interpreters import ad, batching, mlir

from jax_sm100._src import constraints as C
from jax_sm100._src import primitive as P

# --- act_grad_mul_p: act'(z) * x, linear in x --------------------------------------------------

act_grad_mul_p = P.Primitive("jax_sm100_act_grad_mul")


def _act_grad_mul(x, z, *, activation):
    t = P.acc_dtype(x.dtype, z.dtype)
    return P.times_activation_grad(x.astype(t), z.astype(t), activation).astype(x.dtype)


def _act_grad_mul_abstract(x, z, *, activation):
    if x.shape != z.shape:
        raise ValueError(f"act_grad_mul: x.shape={x.shape} != z.shape={z.shape}")
    return x


def _act_grad_mul_jvp(primals, tangents, *, activation):
    tangents = tuple(ad.instantiate_zeros(t) for t in tangents)
    return jax.jvp(
        lambda x, z: _act_grad_mul(x, z, activation=activation), tuple(primals), tangents
    )


def _act_grad_mul_transpose(ct, x, z, *, activation):
    if ad.is_undefined_primal(z):
        raise NotImplementedError("act_grad_mul is not linear in z")
    if type(ct) is ad.Zero:
        return [None, None]
    return [act_grad_mul_p.bind(ct, z, activation=activation), None]


def _act_grad_mul_batch(args, dims, *, activation):
    x, z = args
    dx, dz = dims
    size = x.shape[dx] if dx is not None else z.shape[dz]
    x = batching.bdim_at_front(x, dx, size)
    z = batching.bdim_at_front(z, dz, size)
    return act_grad_mul_p.bind(x, z, activation=activation), 0


act_grad_mul_p.def_impl(lambda x, z, **p: _act_grad_mul(x, z, **p))
act_grad_mul_p.def_abstract_eval(_act_grad_mul_abstract)
ad.primitive_jvps[act_grad_mul_p] = _act_grad_mul_jvp
ad.primitive_transposes[act_grad_mul_p] = _act_grad_mul_transpose
batching.primitive_batchers[act_grad_mul_p] = _act_grad_mul_batch
mlir.register_lowering(act_grad_mul_p, mlir.lower_fun(_act_grad_mul, multiple_results=False))


# --- gated_matmul_p: alpha * ((act'(z) * a) @ b), linear in a and b ------------------------------

gated_matmul_p = P.Primitive("jax_sm100_gated_matmul")


def _gated(a, z, b, *, activation, transpose_a, transpose_b, alpha, out_dtype):
    gated = act_grad_mul_p.bind(a, z, activation=activation)
    params = _linear_params(transpose_a, transpose_b, alpha, out_dtype)
    return P.matmul_p.bind(gated, b, **params)[0]


def _gated_abstract(a, z, b, *, activation, transpose_a, transpose_b, alpha, out_dtype):
    if a.shape != z.shape:
        raise ValueError(f"gated_matmul: a.shape={a.shape} != z.shape={z.shape}")
    shape = P.shape_rule(a.shape, b.shape, None, None, transpose_a=transpose_a,
                         transpose_b=transpose_b)  # fmt: skip
    sharding = P.out_sharding(a, b, None, None, shape, transpose_a, transpose_b)
    if sharding is None:
        return jax.core.ShapedArray(shape, out_dtype)
    return jax.core.ShapedArray(shape, out_dtype, sharding=sharding)


def _gated_jvp(primals, tangents, **params):
    tangents = tuple(ad.instantiate_zeros(t) for t in tangents)
    return jax.jvp(lambda a, z, b: _gated(a, z, b, **params), tuple(primals), tangents)


def _gated_transpose(ct, a, z, b, *, activation, transpose_a, transpose_b, alpha, out_dtype):
    undef = ad.is_undefined_primal
    if undef(z):
        raise NotImplementedError("gated_matmul is not linear in z")
    if undef(a) and undef(b):
        raise NotImplementedError("gated_matmul is bilinear, not linear, in (a, b)")
    if type(ct) is ad.Zero:
        return [None, None, None]
    cd = compute_dtype(_aval_dtype(a), _aval_dtype(b))
    g = ct.astype(cd)
    ct_a = ct_b = None
    if undef(a):
        # act'(z) * (alpha * G @ B^T): the derivative is the product kernel's epilogue, z its C.
        x, y, ta, tb = _dgrad_operands(g, b.astype(cd), transpose_a, transpose_b)
        ct_a = _grad_product(x, y, ta, tb, alpha, a.aval, act_grad=(activation, z))
    if undef(b):
        gated = act_grad_mul_p.bind(a, z, activation=activation).astype(cd)
        x, y, ta, tb = _wgrad_operands(gated, g, transpose_a, transpose_b)
        ct_b = _grad_product(x, y, ta, tb, alpha, b.aval)
    # Typed as their primals under Explicit axes, as `_transpose`'s (ct_a took b's k split).
    return [
        None if t is None else P.cotangent_like(t, x) for t, x in ((ct_a, a), (None, z), (ct_b, b))
    ]


def _gated_batch(args, dims, **params):
    """A new leading batch dim: `a` and `z` (of one shape) get it, z broadcast where only the
    tangent is mapped (forward mode over a step); `b` as the matmul batching rule gives it."""
    (a, z, b), (da, dz, db) = args, dims
    size = next(x.shape[d] for x, d in zip(args, dims, strict=True) if d is not None)
    a = batching.bdim_at_front(a, da, size)
    z = batching.bdim_at_front(z, dz, size)
    b = jnp.expand_dims(b, 0) if db is None else jnp.moveaxis(b, db, 0)
    return gated_matmul_p.bind(a, z, b, **params), 0


gated_matmul_p.def_impl(lambda *args, **p: _gated(*args, **p))
gated_matmul_p.def_abstract_eval(_gated_abstract)
ad.primitive_jvps[gated_matmul_p] = _gated_jvp
ad.primitive_transposes[gated_matmul_p] = _gated_transpose
batching.primitive_batchers[gated_matmul_p] = _gated_batch
mlir.register_lowering(gated_matmul_p, mlir.lower_fun(_gated, multiple_results=False))


# --- which tangents are an activation's derivative times a pre-activation tangent ----------------

# id(tangent) -> (weakref to it, dz, z, activation) for every `act'(z) * dz` tangent made by a
# fused-activation product while tracing. Entries leave with their tangent.
_GATED: dict[int, tuple] = {}


def _remember(tangent, dz, z, activation) -> None:
    if not isinstance(tangent, jax.core.Tracer):
        return  # eager forward mode: nothing is staged, so there is nothing to fuse
    key = id(tangent)
    ref = weakref.ref(tangent, lambda _, key=key: _GATED.pop(key, None))
    _GATED[key] = (ref, dz, z, activation)


def _recall(tangent):
    """(dz, z, activation) when `tangent` is exactly a remembered `act'(z) * dz`, else None."""
    entry = _GATED.get(id(tangent))
    if entry is None or entry[0]() is not tangent:
        return None
    return entry[1:]


# --- matmul_p: JVP, linearization, transpose ---------------------------------------------------


def _linear_params(transpose_a, transpose_b, alpha, out_dtype, *, has_c=False, has_bias=False,
                   beta=1.0, act_grad=None):  # fmt: skip
    return dict(
        transpose_a=transpose_a, transpose_b=transpose_b, alpha=alpha, beta=beta,
        activation=None, out_dtype=np.dtype(out_dtype), has_bias=has_bias, has_c=has_c,
        plan=None, save_preact=False, act_grad=act_grad,
    )  # fmt: skip


def _zero_to_none(t):
    return None if t is None or type(t) is ad.Zero else t


def _aval_dtype(x):
    return x.aval.dtype if ad.is_undefined_primal(x) else x.dtype


def _forward(primals, params):
    """The primal results, and the saved pre-activation (None without an activation)."""
    if params["activation"] is None:
        return P.matmul_p.bind(*primals, **params), None
    out, z = P.matmul_p.bind(*primals, **{**params, "save_preact": True})
    return ([out, z] if params["save_preact"] else [out]), z


def _tangents(primals, z, tangents, params, out_aval):
    """The tangents of one bind's results, linear in `tangents`, written in the output dtype."""
    a, b, bias, c = P._split(primals, params["has_bias"], params["has_c"])
    ta, tb, tbias, tc = map(_zero_to_none, P._split(tangents, params["has_bias"],
                                                     params["has_c"]))  # fmt: skip
    ta_, tb_, alpha = params["transpose_a"], params["transpose_b"], params["alpha"]
    td = np.dtype(params["out_dtype"])
    dz = None
    gated = None if ta is None else _recall(ta)
    if gated is not None:
        dz_in, z_in, act_in = gated
        dz = gated_matmul_p.bind(dz_in, z_in, b, activation=act_in, transpose_a=ta_,
                                 transpose_b=tb_, alpha=alpha, out_dtype=td)  # fmt: skip
        ta = None
    # d(alpha A @ B + beta c + bias) = alpha dA @ B + alpha A @ dB + beta dc + dbias, each term
    # through the primitive: the first product carries dbias and dc in its epilogue, a later
    # one reads the sum so far as C. (Broadcasting the epilogue tangents with jnp ops instead
    # would type them unsharded, and their transpose would all-gather under Explicit axes.)
    for x, y in ((ta, b), (a, tb)):
        if x is None or y is None:
            continue
        if dz is None:
            ops = [x, y] + [t for t in (tbias, tc) if t is not None]
            p = _linear_params(ta_, tb_, alpha, td, has_c=tc is not None,
                               has_bias=tbias is not None, beta=params["beta"])  # fmt: skip
            tbias = tc = None
        else:
            ops = [x, y, dz] if tbias is None else [x, y, tbias, dz]
            p = _linear_params(ta_, tb_, alpha, td, has_c=True, has_bias=tbias is not None)
            tbias = None
        dz = P.matmul_p.bind(*ops, **p)[0]
    nb = len(out_aval.shape) - 2
    if tc is not None:  # no product term carried it
        term = _broadcast_like(params["beta"] * tc.astype(P.acc_dtype(td)),
                               tuple(range(nb + 2)), out_aval)  # fmt: skip
        dz = term.astype(td) if dz is None else (dz + term).astype(td)
    if tbias is not None:
        term = _broadcast_like(tbias.astype(P.acc_dtype(td)), (*range(nb), nb + 1), out_aval)
        dz = term.astype(td) if dz is None else (dz + term).astype(td)
    activation = params["activation"]
    if activation is None:
        return [dz]
    dout = act_grad_mul_p.bind(dz, z, activation=activation)
    _remember(dout, dz, z, activation)
    return [dout, dz.astype(z.dtype)] if params["save_preact"] else [dout]


def _broadcast_like(x, dims, aval):
    """`x` broadcast to `aval`'s shape and, under Explicit mesh axes, typed with its sharding
    (so that the transpose sums the cotangent where it lies instead of gathering it)."""
    sharding = getattr(aval, "sharding", None)
    explicit = sharding is not None and not sharding.mesh.empty and sharding.mesh._any_axis_explicit
    return lax.broadcast_in_dim(x, aval.shape, dims, out_sharding=sharding if explicit else None)


def _jvp(primals, tangents, **params):
    if params["act_grad"] is not None:
        return _act_grad_jvp(primals, tangents, params)
    outs, z = _forward(primals, params)
    return outs, _tangents(primals, z, tangents, params, jax.typeof(outs[0]))


def _linearize(is_vjp, nonzeros, *primals, **params):
    """Direct linearization: the forward binds run now; the tangent function runs later on the
    actual tangent values, which is what lets `_recall` see the previous product's tangent."""
    if params["act_grad"] is not None:
        return _ad_internal.fallback_linearize_rule(P.matmul_p, is_vjp, nonzeros, *primals,
                                                    **params)  # fmt: skip
    outs, z = _forward(primals, params)
    out_aval = jax.typeof(outs[0])
    n = len(primals)
    residuals = [*primals] if z is None else [*primals, z]

    def linearized(res, *tangents):
        if _STRUCTURED_RESIDUALS:
            tangents = tangents[1:]  # the (unused) structured-residual binders
        return _tangents(res[:n], res[n] if len(res) > n else None, tangents, params, out_aval)

    if _STRUCTURED_RESIDUALS:
        return outs, [True] * len(outs), residuals, None, linearized
    return outs, [True] * len(outs), residuals, linearized


def _act_grad_fn(params):
    """A backward epilogue's bind as plain products and XLA math (for its derivatives)."""
    acc = P.acc_dtype(params["out_dtype"])
    plain = _linear_params(params["transpose_a"], params["transpose_b"], 1.0, acc)

    def f(a, b, c):
        p = P.matmul_p.bind(a, b, **plain)[0]
        return P.epilogue_xla(
            p, c, None, alpha=params["alpha"], beta=1.0, activation=None,
            out_dtype=params["out_dtype"], act_grad=params["act_grad"],
        )  # fmt: skip

    return f


def _act_grad_jvp(primals, tangents, params):
    a, b, _, c = P._split(primals, params["has_bias"], params["has_c"])
    ta, tb, _, tc = P._split(tangents, params["has_bias"], params["has_c"])
    ts = tuple(ad.instantiate_zeros(t) for t in (ta, tb, tc))
    return jax.jvp(_act_grad_fn(params), (a, b, c), ts)


def compute_dtype(a_dtype, b_dtype) -> np.dtype:
    """The dtype a backward product's operands take, given the primal operands' dtypes.

    16-bit pairs keep their dtype (the kernels' fast path, as XLA's transpose of a 16-bit dot);
    fp8 operands are upcast exactly to bfloat16, the dtype their cotangent arrives in; anything
    else is promoted (float32 and float64 stay themselves).
    """
    dts = [np.dtype(a_dtype), np.dtype(b_dtype)]
    wide = [d for d in dts if d.name not in C.FP8_DTYPES]
    if not wide:
        return np.dtype(jnp.bfloat16)
    out = np.dtype(jnp.promote_types(*wide)) if len(wide) == 2 else wide[0]
    return out


def _dgrad_operands(g, b, transpose_a, transpose_b):
    """(x, y, transpose_x, transpose_y) of dA = G @ B^T, in whichever storage order a has."""
    if transpose_a:
        return b, g, transpose_b, True
    return g, b, False, not transpose_b


def _wgrad_operands(a, g, transpose_a, transpose_b):
    """(x, y, transpose_x, transpose_y) of dB = A^T @ G, in whichever storage order b has."""
    if transpose_b:
        return g, a, True, transpose_a
    return a, g, not transpose_a, False


def cotangent_product_dtype(want: np.dtype) -> np.dtype:
    """The dtype a backward product writes the cotangent of an operand of dtype `want` in:
    `want` itself where an epilogue writes it, else bfloat16 (an fp8 operand's cotangent,
    converted to fp8 after the product, as XLA's dot gives it). The fp8 cotangent is so
    rounded twice (float32 to bfloat16 to fp8): within one fp8 step of the float32 sum, and
    half the bytes of a float32 product."""
    want = np.dtype(want)
    return want if want.name in (*C.KERNEL_OUT_DTYPES, "float64") else np.dtype(jnp.bfloat16)


def _grad_product(x, y, tx, ty, alpha, target, act_grad=None):
    """`alpha * op(x) @ op(y)` as the cotangent of an operand of aval `target`: summed over the
    batch dims the operand was broadcast along, in its dtype. With `act_grad = (activation, z)`
    the result is also multiplied by activation'(z) (z of `target`'s shape)."""
    nb = x.ndim - 2
    out_shape = P.shape_rule(x.shape, y.shape, None, None, transpose_a=tx, transpose_b=ty)
    reduced = [i for i in range(nb) if target.shape[i] == 1 != out_shape[i]]
    want = np.dtype(target.dtype)
    kernel_out = cotangent_product_dtype(want)
    if not reduced:
        if act_grad is None:
            p = _linear_params(tx, ty, alpha, kernel_out)
            return P.matmul_p.bind(x, y, **p)[0].astype(want)
        activation, z = act_grad
        p = _linear_params(tx, ty, alpha, kernel_out, has_c=True, act_grad=activation)
        return P.matmul_p.bind(x, y, z, **p)[0].astype(want)
    full = tuple(out_shape[:nb])
    if (act_grad is None and len(reduced) == nb and tx and not ty
            and x.shape[:nb] == full and y.shape[:nb] == full):  # fmt: skip
        # Every batch dim is summed and both operands hold their contraction rows outermost:
        # fold the batch into k, one GEMM with float32 accumulation, rather than a float32
        # product per batch index summed after (batch x the weight's size).
        folded = _rows_folded(x, y, nb)
        if folded is not None:
            p = _linear_params(True, False, alpha, kernel_out)
            return P.matmul_p.bind(*folded, **p)[0].astype(want)
    acc = P.acc_dtype(x.dtype, y.dtype)
    full_product = P.matmul_p.bind(x, y, **_linear_params(tx, ty, alpha, acc))[0]
    summed = jnp.sum(full_product, axis=tuple(reduced), keepdims=True)
    if act_grad is not None:
        activation, z = act_grad
        summed = _act_grad_mul(summed, z, activation=activation)
    return summed.astype(want)


def _rows_folded(x, y, nb: int):
    """x [*B, r, kx] and y [*B, r, ky], whose batch and row dims are all contracted, as
    [*1, rows, kx] and [*1, rows, ky] with the same row order, or None where that would move
    data between devices. Free reshapes where no row dim is split, or the first alone (a
    batch split becomes a split of k); under Explicit axes with other row dims split (a
    sequence split, for context parallelism), each split dim's device blocks are moved to the
    front first (a local transpose of both operands), so that the split of k is still one
    block a device, whose partial products the primitive reduces."""
    rows = nb + 1
    typed = P.explicit_type(x) or P.explicit_type(y)
    sizes = typed.mesh.shape if typed is not None else {}

    def row_splits(axes):  # (an axis of size 1 splits nothing)
        return None if axes is None else [tuple(a for a in d if sizes[a] > 1) for d in axes[:rows]]

    sx, sy = row_splits(P.explicit_axes(x)), row_splits(P.explicit_axes(y))
    split = sx if sx is not None else sy if sy is not None else [()] * rows
    if sx is not None and sy is not None and sx != sy:
        split = None  # rows split differently in the two: a fold as they are, if any
    if split is not None and any(split[1:]):
        blocks = [math.prod(sizes[a] for a in axes) for axes in split]
        expanded, fronts, backs = [], [], []
        for d in range(rows):
            if split[d]:
                fronts.append(len(expanded))
                expanded.append(blocks[d])
            backs.append(len(expanded))
            expanded.append(x.shape[d] // blocks[d])
        order = (*fronts, *backs, len(expanded))
        moved = []
        for z in (x, y):
            z = P.reshape_in_place(z, (*expanded, z.shape[-1]))
            if z is None:
                return None
            moved.append(lax.transpose(z, order))
        x, y = moved
    folded = [P.reshape_in_place(z, (*(1,) * nb, math.prod(z.shape[:-1]), z.shape[-1]))
              for z in (x, y)]  # fmt: skip
    return None if any(z is None for z in folded) else folded


def _unbroadcast(x, shape):
    """Sums x over the dims where `shape` (same rank) has 1 and x does not."""
    axes = tuple(i for i, (s, t) in enumerate(zip(shape, x.shape, strict=True)) if s == 1 != t)
    return jnp.sum(x, axis=axes, keepdims=True) if axes else x


def _transpose(cts, *args, transpose_a, transpose_b, alpha, beta, activation, out_dtype,
               has_bias, has_c, plan, save_preact, act_grad):  # fmt: skip
    del plan, out_dtype
    if activation is not None or save_preact:
        raise NotImplementedError("jax_sm100_matmul is not linear with an activation")
    (ct,) = cts
    a, b, bias, c = P._split(args, has_bias, has_c)
    undef = ad.is_undefined_primal
    if undef(a) and undef(b):
        raise NotImplementedError("jax_sm100_matmul is bilinear, not linear, in (a, b)")
    if type(ct) is ad.Zero:
        return [None] * len(args)
    acc = P.acc_dtype(ct.dtype, _aval_dtype(a), _aval_dtype(b))
    if act_grad is not None:
        if undef(c):
            raise NotImplementedError("a backward epilogue is not linear in its c")
        # Higher-order AD only: act'(c) * product, transposed as the plain product of act'(c) * G.
        ct = _act_grad_mul(ct.astype(acc), jnp.broadcast_to(c, ct.shape), activation=act_grad)
    cd = compute_dtype(_aval_dtype(a), _aval_dtype(b))
    g = ct.astype(cd)
    ct_a = ct_b = ct_bias = ct_c = None
    if undef(a):
        x, y, tx, ty = _dgrad_operands(g, b.astype(cd), transpose_a, transpose_b)
        ct_a = _grad_product(x, y, tx, ty, alpha, a.aval)
    if undef(b):
        x, y, tx, ty = _wgrad_operands(a.astype(cd), g, transpose_a, transpose_b)
        ct_b = _grad_product(x, y, tx, ty, alpha, b.aval)
    if act_grad is None and has_c and undef(c):
        gc = ct.astype(acc) if beta == 1.0 else beta * ct.astype(acc)
        ct_c = _unbroadcast(gc, c.aval.shape).astype(c.aval.dtype)
    if has_bias and undef(bias):
        # One sum over m and the batch dims the bias is broadcast along: over m first, a split
        # m (a sequence split) left a [batch, n] partial to reduce across devices, not [n].
        nb = ct.ndim - 2
        axes = (*(i for i in range(nb) if bias.aval.shape[i] == 1 != ct.shape[i]), nb)
        gb = jnp.sum(ct.astype(acc), axis=axes)
        ct_bias = gb.reshape(bias.aval.shape).astype(bias.aval.dtype)
    # Under Explicit axes each cotangent is typed by its own product or sum, not as its primal.
    out = [ct_a, ct_b, *([ct_bias] if has_bias else []), *([ct_c] if has_c else [])]
    return [None if t is None else P.cotangent_like(t, x) for t, x in zip(out, args, strict=True)]


ad.primitive_jvps[P.matmul_p] = _jvp
ad.primitive_transposes[P.matmul_p] = _transpose
# JAX 0.11 added "structured residuals" to the linearization-rule protocol: a rule returns five
# values (None for them) and its tangent function takes their binders after the residuals.
_STRUCTURED_RESIDUALS = "structured_residuals" in getattr(
    _ad_internal.LinearizeTrace, "__annotations__", {}
)

# Where JAX linearizes primitives directly (its default), its fallback would run the JVP rule on
# fresh tangent tracers, where `_recall` could not see the previous product's tangent. The
# registry is not re-exported by jax.interpreters.ad.
if hasattr(_ad_internal, "primitive_linearizations"):
    _ad_internal.primitive_linearizations[P.matmul_p] = _linearize
