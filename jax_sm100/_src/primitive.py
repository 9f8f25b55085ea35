"""The `jax_sm100_matmul` primitive: shape rule, reference math (the one XLA epilogue), batching.

Operands, in order: `a`, `b`, then `bias` when `has_bias`, then `c` when `has_c`.

    a     [*Ba, m, k]  ([*Ba, k, m] when transpose_a)
    b     [*Bb, k, n]  ([*Bb, n, k] when transpose_b)
    bias  [*Bbias, n]
    c     [*Bc, m, n]
    out   [*B, m, n]   B = broadcast(Ba, Bb, Bbias, Bc)

Every operand has the same number of batch dims, and each batch dim is either B's or 1 (a
broadcast that the kernels serve with batch stride 0, never a copy). The math, with float32
accumulation and epilogue, is one of two epilogues:

    z = alpha * (A @ B) + beta * c + bias       out = activation(z)
                                                 (and z itself too, when `save_preact`)
    out = act_grad'(c) * (alpha * (A @ B))      when `act_grad` names an activation: the
                                                 product times that activation's derivative at
                                                 the pre-activation c (a backward epilogue)

The primitive always has a list of results: `[out]`, or `[out, z]` with `save_preact` (z in
`preact_dtype(out_dtype)`: what the backward of the activation needs, saved by the forward kernel
itself).
Differentiation rules live in autodiff.py; lowerings in lowering.py. The public `matmul`
(api.py) brings user inputs to this form.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax._src import core as jax_core
from jax.extend import core as jex_core
from jax.interpreters import ad, batching

from jax_sm100._src import dtypes as D
from jax_sm100._src.kernels.spec import ACT_GRAD_CLAMP, ACTIVATIONS, GELU_K0, GELU_K1


class Primitive(jex_core.Primitive):
    """A primitive of this library: inside `shard_map` its operands are first cast to vary over
    the same manual mesh axes (as lax's ops cast theirs), and its results vary over those axes
    (its abstract eval's results are typed so), so that a product of device-varying operands is
    typed as device-varying: autodiff then gets its cotangents' types right (a `psum` of the
    varying result, transposed) and `shard_map` refuses `out_specs` that would claim such a
    result is replicated."""

    def bind(self, *args, **params):
        return super().bind(*jax_core.auto_insert_reshard(*args), **params)

    def def_abstract_eval(self, abstract_eval):
        def varying(*avals, **params):
            vma = jax_core.standard_vma_rule(self.name, *avals)
            out = abstract_eval(*avals, **params)
            if not vma:
                return out

            # The operands' (manual) mesh types the results, where the rule gave them none.
            mesh = next(a.sharding.mesh for a in avals if not a.sharding.mesh.empty)

            def vary(aval):
                sharding = aval.sharding
                if sharding.mesh.empty:
                    sharding = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec())
                return aval.update(sharding=sharding, manual_axis_type=aval.mat.update(varying=vma))

            return [vary(a) for a in out] if self.multiple_results else vary(out)

        return super().def_abstract_eval(varying)


matmul_p = Primitive("jax_sm100_matmul")
matmul_p.multiple_results = True


# --- shapes ------------------------------------------------------------------------------------


def _split(args, has_bias, has_c):
    a, b, *rest = args
    bias = rest.pop(0) if has_bias else None
    c = rest.pop(0) if has_c else None
    return a, b, bias, c


def num_results(params) -> int:
    return 2 if params["save_preact"] else 1


def preact_dtype(out_dtype) -> np.dtype:
    """The dtype the saved pre-activation takes: the output's, but bfloat16 for fp8 outputs
    (whose range would turn large pre-activations into NaN; the kernels write no fp8)."""
    out_dtype = np.dtype(out_dtype)
    return np.dtype(jnp.bfloat16) if out_dtype.itemsize == 1 else out_dtype


def problem_dims(a_shape, b_shape, transpose_a, transpose_b):
    """(m, n, ka, kb) of the logical product, before any validation: k as each operand has it."""
    m, ka = (a_shape[-1], a_shape[-2]) if transpose_a else (a_shape[-2], a_shape[-1])
    kb, n = (b_shape[-1], b_shape[-2]) if transpose_b else (b_shape[-2], b_shape[-1])
    return m, n, ka, kb


def shape_rule(a_shape, b_shape, bias_shape, c_shape, *, transpose_a, transpose_b):
    """The output shape `[*B, m, n]`; ValueError quoting the operands otherwise."""
    if len(a_shape) < 2 or len(b_shape) < 2:
        raise ValueError(
            f"jax_sm100.matmul needs operands of rank >= 2 ([..., m, k] and [..., k, n]); got "
            f"a.shape={tuple(a_shape)} and b.shape={tuple(b_shape)}; jax_sm100.matmul takes "
            "1-D operands and adds their unit dims itself."
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


def folds_batch(a_shape, b_shape, transpose_a, out_shape) -> bool:
    """Whether the kernels run this bind as one GEMM with the batch folded into m.

    When B is one matrix for the whole batch (a weight) and A is K-major with every batch dim
    its own, [*B, m, k] is a free reshape of [prod(B) * m, k]: one large GEMM runs instead of
    prod(B) small ones. The CUDA lowering and the plan a user's `plan=` is checked against both
    ask this, so they agree on the problem (m, batch) a plan is for.
    """
    nb = len(out_shape) - 2
    if math.prod(out_shape[:nb]) <= 1 or transpose_a:
        return False
    return all(d == 1 for d in b_shape[:nb]) and tuple(a_shape[:nb]) == tuple(out_shape[:nb])


def check_epilogue(*, activation, act_grad, save_preact, has_bias, has_c):
    """The epilogue params one bind may combine; ValueError naming the clash otherwise."""
    if activation not in ACTIVATIONS:
        raise ValueError(f"{activation=} must be one of {ACTIVATIONS}")
    if act_grad is not None:
        if act_grad not in ACTIVATIONS:
            raise ValueError(f"{act_grad=} must be one of {ACTIVATIONS}")
        if not has_c or has_bias or activation is not None or save_preact:
            raise ValueError(
                f"act_grad={act_grad!r} multiplies the product by the activation's derivative "
                "at c: it needs c, and no bias, activation or save_preact"
            )
    if save_preact and activation is None:
        raise ValueError("save_preact=True saves the pre-activation: it needs an activation")


def _abstract_eval(*args, transpose_a, transpose_b, alpha, beta, activation, out_dtype,
                   has_bias, has_c, plan, save_preact=False, act_grad=None):  # fmt: skip
    a, b, bias, c = _split(args, has_bias, has_c)
    for name, x in (("a", a), ("b", b), ("bias", bias), ("c", c)):
        if x is not None:
            D.operand_dtype_name(x.dtype, name)
    check_epilogue(activation=activation, act_grad=act_grad, save_preact=save_preact,
                   has_bias=has_bias, has_c=has_c)  # fmt: skip
    shape = shape_rule(
        a.shape, b.shape, None if bias is None else bias.shape, None if c is None else c.shape,
        transpose_a=transpose_a, transpose_b=transpose_b,
    )  # fmt: skip
    sharding = out_sharding(a, b, bias, c, shape, transpose_a, transpose_b)
    kw = {} if sharding is None else {"sharding": sharding}
    out = jax.core.ShapedArray(shape, out_dtype, **kw)
    if not save_preact:
        return [out]
    return [out, jax.core.ShapedArray(shape, preact_dtype(out_dtype), **kw)]


def out_sharding(a, b, bias, c, out_shape, transpose_a, transpose_b):
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
        # The first operand that splits the dim (a's where it does, as lax's lhs): the
        # partitioner reshards the others to it. Binds the autodiff makes can split one batch
        # dim two ways where jnp's vjp runs; a user's operands that do raise first
        # (`check_batch_shardings`).
        specs = [spec(x, i) for x in (a, b, c, bias) if x is not None and x.shape[i] != 1]
        batch.append(next((s for s in specs if s is not None), None))
    # m as a has it and n as b has it; where those are whole, as c has them (c is the result's
    # shape, and typing the result like c spares resharding c).
    m_spec = spec(a, nb + (1 if transpose_a else 0))
    n_spec = spec(b, nb + (0 if transpose_b else 1))
    if c is not None:
        m_spec = m_spec if m_spec is not None else spec(c, nb)
        n_spec = n_spec if n_spec is not None else spec(c, nb + 1)
    # A mesh axis types one dim at most: batch first, then m, then n (a backward product's
    # operands can name one axis on both, e.g. the input gradient of c split over rows beside
    # a weight split over k on the same axis); the dim that loses it is gathered.
    parts = [spec_entry(axes) for axes in first_use([*map(spec_axes, (*batch, m_spec, n_spec))])]
    while parts and parts[-1] is None:
        parts.pop()
    return jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec(*parts))


def check_batch_shardings(a, b, bias, c, nb: int):
    """A ValueError, as jnp.matmul raises, where two operands split one of the `nb` batch
    dims differently (under Explicit axes), naming the reshard that makes them agree."""
    typed = [(x, explicit_axes(x)) for x in (a, b, c, bias) if x is not None]
    typed = [(x, axes) for x, axes in typed if axes is not None]
    for i in range(nb):
        specs = {axes[i] for x, axes in typed if x.shape[i] != 1} - {()}
        if len(specs) > 1:
            raise ValueError(
                f"jax_sm100.matmul: batch dim {i} is sharded differently across operands "
                f"({sorted(map(str, specs))}); reshard them to one sharding first "
                "(jax.sharding.reshard), as jnp.matmul requires"
            )


def as_array(x, fn: str, position):
    """`x` as a jax array (jax arrays and tracers as they are), or the errors lax's products
    raise: a TypeError for values that are not arrays or scalars (a list or tuple: lax does not
    guess a dtype), a ShardingTypeError for an array typed unreduced (partial sums over a mesh
    axis, from an `out_sharding` with `unreduced=`). One typed `reduced=` is taken as lax takes
    it."""
    if not isinstance(x, jax.Array):
        if not isinstance(x, (np.ndarray, np.generic, bool, int, float, complex)) and not hasattr(
            x, "__jax_array__"
        ):
            raise TypeError(
                f"jax_sm100.{fn} requires ndarray or scalar arguments, got {type(x).__name__} "
                f"for {position}; wrap it in jnp.asarray (as for jax.lax's ops)"
            )
        x = jnp.asarray(x)
    sharding = getattr(jax.typeof(x), "sharding", None)
    spec = getattr(sharding, "spec", None)
    if getattr(spec, "reduced", None):
        # Replicated over those axes, its cotangent left unreduced: the products take it
        # plain, and the reshard's transpose gives the cotangent that type (from our result's
        # own sharding: `sharding.lower_partitioned`).
        x = jax.sharding.reshard(x, sharding.update(spec=spec.update(reduced=frozenset())))
        spec = jax.typeof(x).sharding.spec
    pending = getattr(spec, "unreduced", None)
    if pending:
        raise jax_core.ShardingTypeError(
            f"jax_sm100.{fn}: {position} is typed {jax.typeof(x).str_short()}, with partial "
            f"sums pending over {sorted(pending)} (as lax's products, ours take no unreduced "
            f"operand); reduce it first: jax.sharding.reshard({position}, "
            f"NamedSharding(mesh, {jax.sharding.PartitionSpec(*spec.partitions)}))"
        )
    return x


def spec_axes(entry) -> tuple[str, ...]:
    """The mesh axes of one PartitionSpec entry (None, a name or a tuple of names)."""
    if entry is None:
        return ()
    return tuple(entry) if isinstance(entry, tuple) else (entry,)


def spec_entry(axes):
    """The PartitionSpec entry of a sequence of mesh axes (`spec_axes`'s inverse)."""
    if not axes:
        return None
    return axes[0] if len(axes) == 1 else tuple(axes)


def first_use(parts) -> list[tuple[str, ...]]:
    """Each dim's mesh axes (a sequence per dim) with every axis kept at its first dim only: a
    sharding names an axis once, so a later dim that names it again is gathered along it."""
    used, out = set(), []
    for axes in parts:
        out.append(tuple(a for a in axes if a not in used))
        used.update(out[-1])
    return out


def typed_aval(x):
    """The abstract value of `x`: an array, a tracer, an undefined primal or an aval itself."""
    if isinstance(x, jax.core.AbstractValue):
        return x
    return x.aval if isinstance(x, ad.UndefinedPrimal) else jax.typeof(x)


def explicit_type(x):
    """The sharding in `x`'s type when its mesh has Explicit axes, else None."""
    aval = typed_aval(x)
    return aval.sharding if explicit_mesh(aval) else None


def explicit_axes(x) -> list[tuple[str, ...]] | None:
    """The mesh axes of each dim of `x`'s type under Explicit axes (None elsewhere)."""
    have = explicit_type(x)
    if have is None:
        return None
    spec = tuple(have.spec)
    return [spec_axes(spec[i] if i < len(spec) else None) for i in range(typed_aval(x).ndim)]


def typed_reshape(x, shape):
    """`x.reshape(shape)`, its result typed under Explicit axes where the reshape moves no data:
    each group of dims it merges or splits is split on its leading dims alone (each split dim
    before the last one of a device index each), and that split falls on whole blocks of the
    group's first result dim (heads split for tensor parallelism merged with the head dim, batch
    split merged with the sequence, a batch's and a sequence's blocks moved to the front and
    merged), or on its result dims major first, each but the last of a device index each (rows
    split over a batch's and a sequence's axes split back into the two). Elsewhere JAX's own
    rule decides (and raises a ShardingTypeError where it cannot type the result)."""
    out = reshape_in_place(x, shape)
    return x.reshape(tuple(shape)) if out is None else out


def reshape_in_place(x, shape):
    """`x.reshape(shape)` typed as `typed_reshape` types it, or None where, under Explicit axes,
    a split dim has no such type: the reshape would move data between devices."""
    shape = tuple(shape)
    axes = explicit_axes(x)
    if tuple(x.shape) == shape or axes is None:
        return x.reshape(shape)
    if not any(axes):
        # Whole: typed so. (JAX's own rule cannot type every such reshape under a `vmap` of a
        # split dim, e.g. a merge beside a new dim of 1.)
        whole = jax.sharding.PartitionSpec()
        return lax.reshape(x, shape, out_sharding=explicit_type(x).update(spec=whole))
    spec = _data_free_reshape_spec(x, shape)
    if spec is None:
        return None
    return lax.reshape(x, shape, out_sharding=explicit_type(x).update(spec=spec))


def _data_free_reshape_spec(x, shape: tuple):
    """The PartitionSpec that types `x.reshape(shape)` without moving data (`typed_reshape`'s
    rule), or None where x's type splits no dim or no such spec exists."""
    axes = explicit_axes(x)
    if tuple(x.shape) == shape or axes is None or not any(axes) or 0 in (*x.shape, *shape):
        return None
    sizes = explicit_type(x).mesh.shape
    new = [()] * len(shape)
    ins = [(d, n) for d, n in enumerate(x.shape) if n != 1]
    outs = [(d, n) for d, n in enumerate(shape) if n != 1]
    a = b = 0
    while a < len(ins):
        group, firsts = [ins[a]], []
        whole, got = ins[a][1], 1
        a += 1
        while whole != got:  # the smallest run of dims on each side with equal products
            if got < whole:
                firsts.append(outs[b])
                got *= outs[b][1]
                b += 1
            else:
                group.append(ins[a])
                whole *= ins[a][1]
                a += 1
        # The group's split dims must lead it, each but the last holding one index a device
        # (its size its block count): the group's flattened elements then fall in one
        # contiguous block a device, ordered as the split dims' axes read major to minor.
        # (An axis of size 1 splits nothing: it rides along on the group's first result dim.)
        split = [tuple(a for a in axes[d] if sizes[a] > 1) for d, _ in group]
        last = max((i for i, ax in enumerate(split) if ax), default=0)
        if any(not split[i] or group[i][1] != math.prod(sizes[a] for a in split[i])
               for i in range(last)):  # fmt: skip
            return None
        merged = tuple(a for ax in split[: last + 1] for a in ax)
        merged += tuple(a for d, _ in group for a in axes[d] if sizes[a] == 1)
        # The axes go to the group's result dims major first: each dim takes the next axes
        # while they divide it, and must be split whole (one index a device) before the
        # next dim takes any (a split [b * s] back into [b, s] over the batch's and the
        # sequence's axes; where the first dim takes them all, as for a merge, that is it).
        rest = list(merged)
        for d, n in firsts:
            take = []
            while rest and n % (math.prod(sizes[a] for a in take) * sizes[rest[0]]) == 0:
                take.append(rest.pop(0))
            new[d] = tuple(take)
            if not rest:
                break
            if math.prod(sizes[a] for a in take) != n:
                return None
        if rest:
            return None
    if any(axes[d] for d, n in enumerate(x.shape) if n == 1):
        return None
    return jax.sharding.PartitionSpec(*map(spec_entry, new))


def shards(x, dim: int) -> int:
    """How many blocks `x`'s type splits `dim` into under Explicit axes (1 elsewhere)."""
    axes = explicit_axes(x)
    if axes is None:
        return 1
    return math.prod(explicit_type(x).mesh.shape[a] for a in axes[dim])


def unsplit(x, *dims: int):
    """`x` with `dims` whole under Explicit axes (a gather of those dims where they are split;
    `x` itself elsewhere): for ops JAX cannot type on a split dim (a pad or slice of it)."""
    axes = explicit_axes(x)
    if axes is None or not any(axes[d] for d in dims):
        return x
    for d in dims:
        axes[d] = ()
    have = explicit_type(x)
    return jax.sharding.reshard(
        x, have.update(spec=jax.sharding.PartitionSpec(*map(spec_entry, axes)))
    )


def cotangent_like(ct, primal):
    """A transpose's cotangent `ct` typed as the undefined `primal` is, under Explicit axes.

    `out_sharding` types a result from its operands, and a transpose's operands are not the
    primal's: an input gradient takes its k's type from the other operand, a weight gradient
    its k's from the activations, a bias gradient its type from the cotangent. JAX requires a
    cotangent of the primal's type, so a mismatch is resharded (a local slice where the primal
    is split and the cotangent whole, else a gather).
    """
    return typed_as(ct, explicit_type(primal))


def typed_as(x, want):
    """`x` resharded to the sharding type `want` where its own differs (`x` where `want` is
    None: no Explicit axes)."""
    if want is None or jax.typeof(x).sharding == want:
        return x
    return jax.sharding.reshard(x, want)


def explicit_mesh(aval) -> bool:
    sh = getattr(aval, "sharding", None)
    return sh is not None and not sh.mesh.empty and sh.mesh._any_axis_explicit


# --- reference math (CPU lowering, XLA fallback) -----------------------------------------------


def apply_activation(z, activation):
    if activation is None:
        return z
    if activation == "relu":
        # jax.nn.relu, not jnp.maximum: its derivative at 0 is 0 (the kernels' select), where
        # jnp.maximum's splits a tie 50/50. It matters where JAX differentiates this function
        # itself (the lax fallbacks: a HIGHEST precision, the Flax layers').
        return jax.nn.relu(z)
    if activation == "gelu":
        return jax.nn.gelu(z, approximate=True)
    if activation == "silu":
        return z * jax.nn.sigmoid(z)
    raise ValueError(f"{activation=} must be one of {ACTIVATIONS}")


def activation_grad(z, activation):
    """d activation / dz at z, in z's dtype (the kernels' epilogue states the same formulas for
    gelu and silu; relu's derivative is applied as a select: `times_activation_grad`).

    z is clamped to +-ACT_GRAD_CLAMP first: beyond it every derivative is at its limit (0 or 1),
    and a saved pre-activation that overflowed its dtype (+-inf) gives 0 or 1, not NaN.
    """
    z = jnp.clip(z, -ACT_GRAD_CLAMP, ACT_GRAD_CLAMP)
    if activation == "relu":
        return (z > 0).astype(z.dtype)
    if activation == "gelu":
        t = jnp.tanh(GELU_K0 * (z + GELU_K1 * z**3))
        return 0.5 * (1 + t) + 0.5 * z * (1 - t * t) * GELU_K0 * (1 + 3 * GELU_K1 * z * z)
    if activation == "silu":
        s = jax.nn.sigmoid(z)
        return s * (1 + z * (1 - s))
    raise ValueError(f"{activation=} has no gradient rule")


def times_activation_grad(x, z, activation):
    """act'(z) * x (`activation_grad`); for relu a select, x where z > 0 and 0 elsewhere, as
    jax.nn.relu's derivative selects: a non-finite x where relu is flat gives 0, not 0 * x =
    NaN (the kernels' epilogue selects too: kernels/common.py `apply_epilogue`)."""
    if activation == "relu":
        return jnp.where(z > 0, x, jnp.zeros_like(x))
    return activation_grad(z, activation) * x


def acc_dtype(*dtypes) -> np.dtype:
    """The accumulator/epilogue dtype: float32, or float64 when any dtype involved is float64."""
    wide = any(np.dtype(d) == np.float64 for d in dtypes)
    return np.dtype(np.float64 if wide else np.float32)


def epilogue_xla(acc, c, bias, *, alpha, beta, activation, out_dtype, save_preact=False,
                 act_grad=None):  # fmt: skip
    """The primitive's epilogue in XLA ops on an accumulator `acc` [..., m, n] (float32/64).

    The one statement of the epilogue outside the kernels (common.apply_epilogue): the CPU
    lowering, the XLA fallback, the split-K reduction and the row-parallel sharded path all
    call it. `c` is [..., m, n] and `bias` [..., n], broadcasting against `acc`. Returns the
    primitive's list of results.
    """
    t = acc.dtype
    z = acc if alpha == 1.0 else alpha * acc
    if act_grad is not None:
        return [times_activation_grad(z, c.astype(t), act_grad).astype(out_dtype)]
    if c is not None and beta != 0.0:  # beta = 0 reads no c, as the kernels (and BLAS) do
        z = z + (c.astype(t) if beta == 1.0 else beta * c.astype(t))
    if bias is not None:
        z = z + jnp.expand_dims(bias.astype(t), -2)
    out = apply_activation(z, activation).astype(out_dtype)
    return [out, z.astype(preact_dtype(out_dtype))] if save_preact else [out]


def reference_matmul(a, b, bias, c, *, transpose_a, transpose_b, alpha, beta, activation,
                     out_dtype, upcast, save_preact=False, act_grad=None,
                     precision=lax.Precision.HIGHEST):  # fmt: skip
    """The primitive's math in XLA ops: a batched dot_general plus `epilogue_xla`.

    `upcast` converts operands to float32 first (exact for every accepted dtype, and what the CPU
    backend needs for fp8); otherwise the dot runs natively with a float32 accumulator.
    `precision` is the dot's: HIGHEST (exact float32 products), or the caller's where `matmul`
    runs here because the kernels do not meet it.
    """
    acc_t = acc_dtype(a.dtype, b.dtype, out_dtype)
    if upcast:
        a, b = a.astype(acc_t), b.astype(acc_t)
    nb = a.ndim - 2
    out_batch = shape_rule(
        a.shape, b.shape, None if bias is None else bias.shape, None if c is None else c.shape,
        transpose_a=transpose_a, transpose_b=transpose_b,
    )[:-2]  # fmt: skip
    contract_a = nb if transpose_a else nb + 1
    if all(d == 1 for d in b.shape[:nb]):
        # One B for every batch: a plain dot over a's batch dims, broadcast afterwards.
        b2 = b.reshape(b.shape[nb:])
        acc = lax.dot_general(
            a, b2, (((contract_a,), (1 if transpose_b else 0,)), ((), ())),
            precision=precision, preferred_element_type=acc_t,
        )  # fmt: skip
        acc = jnp.broadcast_to(acc, (*out_batch, *acc.shape[-2:]))
    else:
        a = jnp.broadcast_to(a, (*out_batch, *a.shape[-2:]))
        b = jnp.broadcast_to(b, (*out_batch, *b.shape[-2:]))
        batch = tuple(range(nb))
        contract_b = nb + 1 if transpose_b else nb
        acc = lax.dot_general(
            a, b, (((contract_a,), (contract_b,)), (batch, batch)),
            precision=precision, preferred_element_type=acc_t,
        )  # fmt: skip
    return epilogue_xla(
        acc, c, bias, alpha=alpha, beta=beta, activation=activation, out_dtype=out_dtype,
        save_preact=save_preact, act_grad=act_grad,
    )  # fmt: skip


# --- batching ----------------------------------------------------------------------------------


def batch_rule(prim, args, dims, **params):
    """Folds a vmapped axis into the primitive's batch dims (for `prim`, whose operands all have
    the same number of batch dims, as matmul_p's).

    The new batch dim goes where the first mapped operand already has it when that is among its
    batch dims (so `in_axes=0`, or any batch position, costs no transpose); other mapped operands
    move theirs there, and unmapped ones get a unit dim, which the kernels read with batch
    stride 0, so a shared weight is never copied per batch.
    """
    nb = args[0].ndim - 2 - (dims[0] is not None)  # the primitive's batch dims (a's, unmapped)
    first = next(d for d in dims if d is not None)
    at = first if first <= nb else 0
    moved = []
    for x, d in zip(args, dims, strict=True):
        if d is None:
            moved.append(jnp.expand_dims(x, at))
        else:
            moved.append(x if d == at else jnp.moveaxis(x, d, at))
    outs = prim.bind(*moved, **params)
    if prim.multiple_results:
        return outs, [at] * len(outs)
    return outs, at


# --- registration ------------------------------------------------------------------------------


def _impl(*args, **params):
    from jax._src import dispatch  # noqa: PLC0415

    return dispatch.apply_primitive(matmul_p, *args, **params)


matmul_p.def_impl(_impl)
matmul_p.def_abstract_eval(_abstract_eval)
batching.primitive_batchers[matmul_p] = lambda args, dims, **params: batch_rule(
    matmul_p, args, dims, **params
)


def problem_for_operands(a, b, bias, c, *, transpose_a, transpose_b, out_dtype,
                         save_preact=False, **_):  # fmt: skip
    """The GEMM the kernels run for one bind of the primitive (operands given as avals or
    arrays): the batch folded into m where `folds_batch` says so."""
    from jax_sm100._src import planning  # noqa: PLC0415

    out_shape = shape_rule(
        a.shape, b.shape, None if bias is None else bias.shape, None if c is None else c.shape,
        transpose_a=transpose_a, transpose_b=transpose_b,
    )  # fmt: skip
    m, n, k, _ = problem_dims(a.shape, b.shape, transpose_a, transpose_b)
    batch = math.prod(out_shape[:-2])
    if folds_batch(a.shape, b.shape, transpose_a, out_shape):
        m, batch = m * batch, 1
    return planning.GemmProblem(
        m=m, n=n, k=k, batch=batch,
        a_dtype=D.operand_dtype_name(a.dtype, "a"), b_dtype=D.operand_dtype_name(b.dtype, "b"),
        out_dtype=D.name(out_dtype),
        c_dtype=None if c is None else D.operand_dtype_name(c.dtype, "c"),
        a_major="m" if transpose_a else "k", b_major="k" if transpose_b else "n",
        preact_out=bool(save_preact),
    )  # fmt: skip
