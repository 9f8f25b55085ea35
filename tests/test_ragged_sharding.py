"""Tests of the ragged primitives' partitioning (ragged_sharding.py) on the ("data", "model") mesh.

Every case runs one jitted function on sharded operands, compares it with `lax.ragged_dot` (or the
per-group outer product in jnp) on one device, and counts the collectives in the compiled HLO.
Group sizes are random, with empty groups, and leave trailing rows in no group unless a case says
otherwise. "data" carries tokens (rows), "model" experts (rhs and group sizes), k or n.

The mesh, its platform and the collective counting are test_sharding.py's (imported first: it
asks for the 8 host devices before JAX starts a backend); so are its variables
(JAX_SM100_SHARDING_PLATFORM=gpu, JAX_SM100_SHARDING_MESH=DxM) and, when another module has
started the backend with fewer devices, the fallback of running each class in a child process.
"""

from __future__ import annotations

from tests import test_sharding as ts  # isort: split

import functools
import re

import jax
import jax.numpy as jnp
import numpy as np
from absl.testing import absltest, parameterized
from jax import lax
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as PS

import jax_sm100
from jax_sm100._src import primitive as P
from jax_sm100._src import ragged
from tests import test_util as tu

counts, reduces, same_spec = ts.counts, ts.reduces, ts.same_spec
M, K, N, G = 64, 32, 24, 8  # every dim divides over either axis and over both
HIGHEST = lax.Precision.HIGHEST


def groups(seed, total=None, *, g=G, m=M):
    """Random sizes of g groups summing to `total` (default: fewer than m rows), one of them
    empty."""
    rng = np.random.default_rng(seed)
    total = int(rng.integers(m // 2, m)) if total is None else total
    sizes = np.diff(np.concatenate([[0], np.sort(rng.integers(0, total + 1, g - 1)), [total]]))
    empty = int(rng.integers(0, g))
    sizes[(empty + 1) % g] += sizes[empty]
    sizes[empty] = 0
    return jnp.asarray(sizes.astype(np.int32))


def operands(seed, dtype="float32", batch=()):
    rng = np.random.default_rng(seed)
    return tu.rand(rng, (*batch, M, K), dtype), tu.rand(rng, (*batch, G, K, N), dtype)


def reference_dot(lhs, rhs, group_sizes):
    """lax.ragged_dot in float32 at full precision (vmapped over leading batch dims)."""
    f = lambda a, b, s: lax.ragged_dot(
        a.astype(jnp.float32), b.astype(jnp.float32), s, precision=HIGHEST
    )
    for _ in range(lhs.ndim - 2):
        f = jax.vmap(f)
    return f(lhs, rhs, group_sizes)


def reference_outer(lhs, rhs, group_sizes):
    """out[i] = lhs[rows of group i]^T @ rhs[rows of group i], in float32."""
    ends = jnp.cumsum(group_sizes)
    rows = jnp.arange(lhs.shape[0])[:, None]
    member = ((rows >= ends - group_sizes) & (rows < ends)).astype(jnp.float32)
    return jnp.einsum("mk,mn,mg->gkn", lhs, rhs, member, precision=HIGHEST)


def reference_biased(lhs, rhs, group_sizes, bias):
    """reference_dot plus each row's group's bias row (none past the last group)."""
    ends = jnp.cumsum(group_sizes)
    rows = jnp.arange(lhs.shape[0])[:, None]
    member = ((rows >= ends - group_sizes) & (rows < ends)).astype(jnp.float32)
    return reference_dot(lhs, rhs, group_sizes) + jnp.dot(member, bias, precision=HIGHEST)


def sin_loss(f):
    return lambda lhs, rhs, group_sizes: jnp.sum(jnp.sin(f(lhs, rhs, group_sizes)))


def grads(f):
    return jax.grad(sin_loss(f), argnums=(0, 1))


# float32 ragged products beside XLA's: on a gpu both run them as TF32 (different tiles and
# sums), so to the gradient tolerance of test_sharding's kernels.
F32_TOL = 1e-4 if ts._PLATFORM == "cpu" else ts.KERNEL_RTOL[1]


class RaggedCase(ts.ShardedTestCase):
    def check(self, f, args, specs, want_counts, *, reference, out_spec=None, grad=False):
        """f on sharded args equals `reference` on one device; its collectives. Returns the
        results and the compiled HLO text."""
        rtol = ts.rtol_for(args, grad=grad)
        dtype = np.dtype(args[0].dtype).name
        if dtype != "float32":  # a result rounded to 16 bits, the reference in float32
            rtol = max(rtol, tu.RTOL[dtype])
        return super().check(
            f, args, specs, want_counts, out_spec=out_spec, grad=grad, reference=reference,
            rtol=rtol,
        )  # fmt: skip

    def check_bias(self, specs):
        """ragged_dot's per-group bias (an operand of the sharded product, split as rhs's g
        and n; its gradient XLA's per-group sum) with a gelu, on (lhs, rhs, bias) laid out as
        `specs`: values and the three gradients equal the unsharded reference's."""
        lhs, rhs = operands(60)
        bias = tu.rand(np.random.default_rng(61), (G, N), "float32")
        sizes = groups(62)

        def ours(a, b, c):
            return jnp.sin(jax_sm100.ragged_dot(a, b, sizes, bias=c, activation="gelu")).sum()

        def reference(a, b, c):
            y = reference_biased(a, b, sizes, c)
            return jnp.sin(jax.nn.gelu(y, approximate=True)).sum()

        sharded = [self.put(x, sp) for x, sp in zip((lhs, rhs, bias), specs, strict=True)]
        for f, ref in ((ours, reference),
                       (jax.grad(ours, (0, 1, 2)), jax.grad(reference, (0, 1, 2)))):  # fmt: skip
            got = jax.jit(f)(*sharded)
            want = jax.jit(ref)(lhs, rhs, bias)
            for x, y in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
                y = np.asarray(y, np.float64)
                scale = max(float(np.max(np.abs(y))), 1e-6)
                np.testing.assert_allclose(np.asarray(x, np.float64), y, atol=F32_TOL * scale)
        # The bias's gradient alone: each device's rows times their one-hot groups, then the
        # [g, n] sums reduced; no device gathers the [m, n] cotangent.
        hlo = jax.jit(jax.grad(ours, 2)).lower(*sharded).compile().as_text()
        for line in hlo.splitlines():
            if re.search(r"\sall-gather(?:-start)?\(", line):
                for dims in re.findall(r"f32\[([\d,]*)\]", line):
                    self.assertLess(int(np.prod([int(d) for d in dims.split(",")])), M * N, line)


# --- forward -----------------------------------------------------------------------------------


@ts._delegated
class ForwardTest(RaggedCase):
    """ragged_dot's rules, one by one, under Explicit axes."""

    @parameterized.product(dtype=("float32", "bfloat16"), full=(False, True))
    def test_rows_are_local(self, dtype, full):
        lhs, rhs = operands(0, dtype)
        sizes = groups(1, M if full else None)
        specs = (PS("data"), PS(), PS())
        got, _ = self.check(
            jax_sm100.ragged_dot, (lhs, rhs, sizes), specs, counts(), reference=reference_dot
        )
        self.assertEqual(same_spec(got.sharding.spec), ("data",))

    def test_rows_over_both_axes_are_local(self):
        # Eight row blocks of 8 rows: most groups span blocks, some blocks hold no group.
        lhs, rhs = operands(2)
        specs = (PS(("data", "model")), PS(), PS())
        self.check(
            jax_sm100.ragged_dot, (lhs, rhs, groups(3)), specs, counts(), reference=reference_dot
        )

    @parameterized.product(dtype=("float32", "bfloat16"), full=(False, True))
    def test_experts_reduce_once(self, dtype, full):
        lhs, rhs = operands(4, dtype)
        sizes = groups(5, M if full else None)
        specs = (PS(), PS("model"), PS())
        want = counts(all_reduce=reduces("model"))
        self.check(jax_sm100.ragged_dot, (lhs, rhs, sizes), specs, want, reference=reference_dot)

    def test_experts_with_their_group_sizes_split(self):
        # The group sizes are gathered (g int32): every device needs the rows before its experts.
        lhs, rhs = operands(6)
        specs = (PS(), PS("model"), PS("model"))
        want = counts(all_reduce=reduces("model"), all_gather=reduces("model"))
        self.check(
            jax_sm100.ragged_dot, (lhs, rhs, groups(7)), specs, want, reference=reference_dot
        )

    @parameterized.named_parameters(
        ("random", None),
        ("one_expert_takes_all", [0, 0, 0, 0, 0, M, 0, 0]),
        ("last_experts_empty", [10, 20, 0, 30, 4, 0, 0, 0]),
        ("first_experts_empty", [0, 0, 0, 0, 0, 0, 33, 31]),
        ("no_rows", [0] * G),
    )
    def test_rows_and_experts(self, sizes):
        # Each device: its row block and its experts; `lead` rows skipped (or none, or all).
        lhs, rhs = operands(8)
        sizes = groups(9) if sizes is None else jnp.asarray(sizes, jnp.int32)
        specs = (PS("data"), PS("model"), PS())
        got, _ = self.check(
            jax_sm100.ragged_dot,
            (lhs, rhs, sizes),
            specs,
            counts(all_reduce=reduces("model")),
            reference=reference_dot,
        )
        self.assertEqual(same_spec(got.sharding.spec), ("data",))

    @parameterized.parameters("float32", "bfloat16")
    def test_k_partial_sums_reduce_once(self, dtype):
        lhs, rhs = operands(10, dtype)
        specs = (PS(None, "model"), PS(None, "model"), PS())
        self.check(
            jax_sm100.ragged_dot,
            (lhs, rhs, groups(11)),
            specs,
            counts(all_reduce=reduces("model")),
            reference=reference_dot,
        )

    def test_fsdp_gathers_the_weights_when_that_moves_less(self):
        # FSDP's layout: the tokens' rows and the experts' k over "data". With 512 rows and 2
        # small experts, gathering the weights moves less than reduce-scattering every
        # device's float32 partial product of all rows (sharding._gathers_less): nothing is
        # reduced. With 64 rows and 8 experts the partials are the smaller: k stays split.
        self.require("data")
        rng = np.random.default_rng(12)
        specs = (PS("data"), PS(None, "data"), PS())
        # Keeping k moves lhs's rows to a split of k: an all-to-all, or (JAX 0.12) an
        # all-gather and a slice.
        keep = [counts(reduce_scatter=1, all_to_all=1), counts(reduce_scatter=1, all_gather=1)]
        for m, g, want in ((512, 2, counts(all_gather=1)), (M, G, keep)):
            lhs, rhs = tu.rand(rng, (m, K), "float32"), tu.rand(rng, (g, K, N), "float32")
            self.check(jax_sm100.ragged_dot, (lhs, rhs, groups(13, g=g, m=m)), specs, want,
                       reference=reference_dot)  # fmt: skip

    def test_fsdp_beside_experts_keeps_k(self):
        # Experts over "model" and their k over "data", tokens' rows over "data": the result's
        # all-reduce over the experts is the same either way, so it weighs on neither side;
        # keeping k moves fewer bytes (review helper-104: counted for keep only, the experts
        # were gathered along k, 42 % more bytes).
        self.require("data")
        self.require("model")
        rng = np.random.default_rng(14)
        lhs, rhs = tu.rand(rng, (256, 64), "float32"), tu.rand(rng, (44, 64, 64), "float32")
        sizes = np.zeros(44, np.int32)
        sizes[:32] = 8
        keep = [counts(all_reduce=1, reduce_scatter=1, all_to_all=1),
                counts(all_reduce=1, reduce_scatter=1, all_gather=1)]  # fmt: skip
        specs = (PS("data"), PS("model", "data"), PS())
        self.check(jax_sm100.ragged_dot, (lhs, rhs, jnp.asarray(sizes)), specs, keep,
                   reference=reference_dot)  # fmt: skip

    @parameterized.parameters("complex64", "int8")
    def test_lax_paths_sum_partials_in_their_dtype(self, dtype):
        # Complex and integer operands take lax.ragged_dot's path (the primitive with lax's
        # precision): k split over "model", the partial products are summed in the result
        # dtype (the float32 accumulator would drop the imaginary parts), with their gradients.
        rng = np.random.default_rng(12)
        if dtype == "int8":
            draw = lambda *s: jnp.asarray(rng.integers(-9, 10, s), dtype)  # noqa: E731
        else:
            draw = lambda *s: jnp.asarray(  # noqa: E731
                rng.standard_normal(s) + 1j * rng.standard_normal(s), dtype
            )
        lhs, rhs, sizes = draw(M, K), draw(G, K, N), groups(13)
        a, b = self.put(lhs, PS(None, "model")), self.put(rhs, PS(None, "model"))
        got = jax.jit(jax_sm100.ragged_dot)(a, b, sizes)
        want = lax.ragged_dot(lhs, rhs, sizes, precision=HIGHEST)
        self.assertEqual(got.dtype, want.dtype)
        if dtype == "int8":
            np.testing.assert_array_equal(got, want)
            return
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5 * float(jnp.abs(want).max()))
        loss = lambda f: lambda x, y: (jnp.abs(f(x, y, sizes)) ** 2).sum()  # noqa: E731
        grads = jax.jit(jax.grad(loss(jax_sm100.ragged_dot), (0, 1)))(a, b)
        ref = functools.partial(lax.ragged_dot, precision=HIGHEST)
        for x, y in zip(grads, jax.grad(loss(ref), (0, 1))(lhs, rhs), strict=True):
            np.testing.assert_allclose(x, y, rtol=1e-5, atol=1e-5 * float(jnp.abs(y).max()))

    @parameterized.named_parameters(
        ("k_reduced", (PS(None, "model"), PS(None, "model"), PS()), ("model",)),
        ("experts_reduced", (PS(), PS("model"), PS()), ("model",)),
        ("rows_local", (PS("data"), PS(), PS()), ()),
    )
    def test_activation_after_the_reduction(self, specs, reduced):
        # An activated ragged_dot whose partials are summed across devices applies its
        # activation once, to the sum (applied to each device's partial, gelu would be wrong).
        lhs, rhs = operands(20)
        sizes = groups(21)
        f = lambda a, b, s: jax_sm100.ragged_dot(a, b, s, activation="gelu")  # noqa: E731
        ref = lambda a, b, s: P.apply_activation(reference_dot(a, b, s), "gelu")  # noqa: E731
        want = counts(all_reduce=reduces(*reduced)) if reduced else counts()
        self.check(f, (lhs, rhs, sizes), specs, want, reference=ref)

    def test_one_axis_on_rows_experts_and_columns(self):
        # "data" splits lhs's rows, rhs's columns and the group sizes: the experts take it (the
        # rows gathered, rhs moved from n to g, the group sizes gathered), and their partials
        # are scattered onto one result dim only (onto both, the result's spec named "data"
        # twice: an error under Explicit axes, an abort under GSPMD).
        self.require("data")
        lhs, rhs = operands(16)
        specs = (PS("data"), PS(None, None, "data"), PS("data"))
        got, _ = self.check(
            jax_sm100.ragged_dot,
            (lhs, rhs, groups(17)),
            specs,
            # rhs moved from n to g: an all-to-all (JAX 0.10), or gathered (JAX 0.12's XLA).
            [
                counts(all_gather=2, all_to_all=1, reduce_scatter=1),
                counts(all_gather=3, reduce_scatter=1),
            ],
            reference=reference_dot,
        )
        self.assertEqual(same_spec(got.sharding.spec), ("data",))

    def test_n_is_local(self):
        lhs, rhs = operands(12)
        specs = (PS("data"), PS(None, None, "model"), PS())
        got, _ = self.check(
            jax_sm100.ragged_dot, (lhs, rhs, groups(13)), specs, counts(), reference=reference_dot
        )
        self.assertEqual(same_spec(got.sharding.spec), ("data", "model"))

    @parameterized.named_parameters(("shardy", True), ("gspmd", False))
    def test_requested_split_of_n_beside_rows_over_its_axis(self, shardy):
        # Sequence-split tokens into column-split experts: lhs's rows over "model", rhs's n
        # over "model", the result asked split along n. The tokens are gathered (the smaller
        # move); the rows took the axis before, so the experts were gathered along n and the
        # result moved to the requested split by an all-to-all.
        self.require("model")
        lhs, rhs = operands(30)
        specs = (PS("model"), PS(None, None, "model"), PS())
        before = jax.config.jax_use_shardy_partitioner
        jax.config.update("jax_use_shardy_partitioner", shardy)
        try:
            got, _ = self.check(jax_sm100.ragged_dot, (lhs, rhs, groups(31)), specs,
                                counts(all_gather=1), reference=reference_dot,
                                out_spec=PS(None, "model"))  # fmt: skip
        finally:
            jax.config.update("jax_use_shardy_partitioner", before)
        self.assertEqual(same_spec(got.sharding.spec), (None, "model"))

    def test_requested_split_kept_where_the_rows_move_more(self):
        # Tokens' rows over "data" beside the experts' k over "model", the result asked split
        # along n over "data": XLA gathers the rows before it slices k, so taking n's requested
        # axis moves all of lhs, which the byte model counted as a quarter of it; the rows'
        # split is kept (review helper-112).
        self.require("model")
        self.require("data")
        m, k, n = 256, 32, 24
        rng = np.random.default_rng(32)
        lhs, rhs = tu.rand(rng, (m, k), "float32"), tu.rand(rng, (G, k, n), "float32")
        sizes = groups(33, g=G, m=m)
        out = NamedSharding(self.mesh, PS(None, "data"))
        f = jax.jit(jax_sm100.ragged_dot, out_shardings=out)
        args = (self.put(lhs, PS("data")), self.put(rhs, PS(None, "model", "data")), sizes)
        self.assertNotIn((m, k), ts.gathered(f.lower(*args).compile().as_text()))
        tu.assert_close(self, f(*args), reference_dot(lhs, rhs, sizes), "float32", k)

    def test_batch_under_vmap(self):
        # vmap puts the mapped dim first, in every operand: it is kept where it is sharded.
        lhs, rhs = operands(14, batch=(2,))
        sizes = jnp.stack([groups(15), groups(16, M)])
        specs = (PS("data"), PS("data", "model"), PS("data"))
        got, _ = self.check(
            jax.vmap(jax_sm100.ragged_dot),
            (lhs, rhs, sizes),
            specs,
            counts(all_reduce=reduces("model")),
            reference=reference_dot,
        )
        self.assertEqual(same_spec(got.sharding.spec), ("data",))

    def test_experts_transposed(self):
        # ragged_dot_p with rhs [g, n, k] (what the input gradient binds).
        lhs, rhs = operands(17)
        rhs_t = jnp.swapaxes(rhs, -1, -2)
        f = lambda a, b, s: ragged.ragged_dot_p.bind(
            a, b, s, transpose_rhs=True, out_dtype=np.dtype("float32")
        )
        specs = (PS("data"), PS("model"), PS())
        ref = lambda a, b, s: reference_dot(a, jnp.swapaxes(b, -1, -2), s)
        self.check(
            f, (lhs, rhs_t, groups(18)), specs, counts(all_reduce=reduces("model")), reference=ref
        )


@ts._delegated
class OuterTest(RaggedCase):
    """ragged_outer_p, the weight gradient's product, bound directly."""

    @staticmethod
    def outer(transpose_out=False, out_dtype="float32"):
        def f(lhs, rhs, group_sizes):
            return ragged.ragged_outer_p.bind(
                lhs, rhs, group_sizes, out_dtype=np.dtype(out_dtype), transpose_out=transpose_out
            )

        return f

    def args(self, seed):
        rng = np.random.default_rng(seed)
        return tu.rand(rng, (M, K), "float32"), tu.rand(rng, (M, N), "float32"), groups(seed)

    @parameterized.parameters(False, True)
    def test_rows_reduce_once(self, transpose_out):
        ref = reference_outer
        if transpose_out:
            ref = lambda a, b, s: jnp.swapaxes(reference_outer(a, b, s), -1, -2)
        self.check(
            self.outer(transpose_out),
            self.args(20),
            (PS("data"), PS("data"), PS()),
            counts(all_reduce=reduces("data")),
            reference=ref,
        )

    def test_experts_split_on_the_result(self):
        # The result's g takes the group sizes' split; each device its own groups, no reduction
        # (the sizes themselves are gathered).
        got, _ = self.check(
            self.outer(),
            self.args(21),
            (PS(), PS(), PS("model")),
            counts(all_gather=reduces("model")),
            reference=reference_outer,
        )
        self.assertEqual(same_spec(got.sharding.spec), ("model",))

    def test_rows_and_experts_and_n(self):
        args = self.args(22)
        specs = (PS("data"), PS("data", None), PS("model"))
        self.check(
            self.outer(),
            args,
            specs,
            counts(all_reduce=reduces("data"), all_gather=reduces("model")),
            reference=reference_outer,
        )


# --- gradients ---------------------------------------------------------------------------------


@ts._delegated
class GradTest(RaggedCase):
    """jax.grad through the sharded jit: the input gradient is a ragged_dot, the weight gradient
    a ragged_outer; each gradient comes typed as its primal."""

    def check_grads(self, specs, want, seed, sizes=None):
        lhs, rhs = operands(seed)
        sizes = groups(seed + 1) if sizes is None else sizes
        got, hlo = self.check(
            grads(jax_sm100.ragged_dot),
            (lhs, rhs, sizes),
            specs,
            want,
            reference=grads(reference_dot),
            grad=True,
        )
        for g, spec in zip(got, specs[:2], strict=True):
            self.assertEqual(same_spec(g.sharding.spec), same_spec(spec))
        return hlo

    @parameterized.parameters(
        (PS("data"), PS("model"), PS("model")),
        (PS(), PS("model"), PS("model")),
        (PS("data"), PS(), PS(None, "model")),
        (PS("data"), PS("model"), PS()),
        (PS(None, "model"), PS(None, "model"), PS()),
    )
    def test_bias(self, *specs):
        # The bias is an operand split as rhs's experts and n are (resharded when it comes
        # otherwise); its gradient gathers it whole under Explicit axes (it failed to type
        # before); with k split the bias joins one partial sum only.
        self.check_bias(specs)

    @parameterized.product(
        sizes=([10, -7, 20, 0, -3, 15, 9, 4], [10, 0, 20, 2**31 - 1, -3, 5, 9, 4]),
        specs=(
            (PS("data"), PS(), PS()),
            (PS(), PS("model"), PS()),
            (PS("data"), PS("model"), PS()),
        ),  # fmt: skip
    )
    def test_sizes_as_the_kernels_read_them(self, sizes, specs):
        # Negative sizes are empty groups and a running sum past int32 saturates at m on
        # every device too: each device's rows and experts are cut from the sizes as the
        # kernels read them (from the raw running sum before, which moved later groups' rows).
        lhs, rhs = operands(70)
        read = np.diff(np.minimum(np.cumsum(np.maximum(sizes, 0)), M), prepend=0)
        sizes, read = jnp.asarray(sizes, jnp.int32), jnp.asarray(read, jnp.int32)
        sharded = [self.put(x, sp) for x, sp in zip((lhs, rhs, sizes), specs, strict=True)]
        f = lambda a, b, s: (jax_sm100.ragged_dot(a, b, s), grads(jax_sm100.ragged_dot)(a, b, s))  # noqa: E731
        got = jax.jit(f)(*sharded)
        want = (reference_dot(lhs, rhs, read), grads(reference_dot)(lhs, rhs, read))
        for x, y in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
            tu.assert_close(self, x, y, "float32", K)

    def test_bias_gradient_with_group_sizes_split(self):
        # Group sizes split over experts as the weights and bias are: the bias tangent's
        # one-hot groups gather them (g int32s) for their running sum, which failed to type
        # on the split sizes before.
        lhs, rhs = operands(66)
        bias = tu.rand(np.random.default_rng(67), (G, N), "float32")
        sizes = groups(68)
        loss = lambda f: lambda a, b, s, c: jnp.sin(f(a, b, s, c)).sum()  # noqa: E731
        ours = lambda a, b, s, c: jax_sm100.ragged_dot(a, b, s, bias=c)  # noqa: E731
        args = (lhs, rhs, sizes, bias)
        specs = (PS("data"), PS("model"), PS("model"), PS("model"))
        sharded = [self.put(x, sp) for x, sp in zip(args, specs, strict=True)]
        got = jax.jit(jax.grad(loss(ours), (0, 1, 3)))(*sharded)
        want = jax.grad(loss(reference_biased), (0, 1, 3))(*args)
        for x, y in zip(got, want, strict=True):
            tu.assert_close(self, x, y, "float32", K)

    def test_bias_follows_the_weights(self):
        # Weights split along n and a bias split over experts: the bias is resharded to the
        # weights' split (the bias alone moves: JAX 0.10's XLA makes that an all-to-all,
        # 0.11's an all-gather), the weights stay put (it took an all-to-all of rhs and a
        # reduce-scatter when the bias's factors were rhs's).
        self.require("model")
        lhs, rhs = operands(63)
        bias = tu.rand(np.random.default_rng(64), (G, N), "float32")
        sizes = groups(65)
        f = lambda a, b, c: jax_sm100.ragged_dot(a, b, sizes, bias=c)  # noqa: E731

        def reference(a, b, c):
            return reference_biased(a, b, sizes, c)

        _, hlo = self.check(f, (lhs, rhs, bias), (PS(), PS(None, None, "model"), PS("model")),
                            [counts(all_to_all=1), counts(all_gather=1)],
                            reference=reference)  # fmt: skip
        for line in hlo.splitlines():
            if re.search(r"\s(?:all-to-all|all-gather)(?:-start)?\(", line):
                for dims in re.findall(r"f32\[([\d,]*)\]", line):
                    self.assertLessEqual(int(np.prod([int(d) for d in dims.split(",")])), G * N)

    def test_rows(self):
        # The weight gradient's sum over rows is the only reduction.
        self.check_grads((PS("data"), PS(), PS()), counts(all_reduce=reduces("data")), 30)

    def test_experts(self):
        # Forward and input gradient each reduce over the experts; the weight gradient is split
        # like the experts and needs none (its group sizes are gathered).
        want = counts(all_reduce=reduces("model", "model"), all_gather=reduces("model"))
        self.check_grads((PS(), PS("model"), PS()), want, 32)

    def test_rows_and_experts(self):
        want = counts(all_reduce=reduces("model", "model", "data"), all_gather=reduces("model"))
        hlo = self.check_grads((PS("data"), PS("model"), PS()), want, 34)
        if ts.axis_size("model") < 2:
            return  # one device holds every expert
        # The weight gradient is reduced over rows on each device's experts only.
        whole = f"f32[{G},{K},{N}]"
        reduced = [line for line in hlo.splitlines() if re.search(r"\sall-reduce(-start)?\(", line)]
        self.assertFalse([line for line in reduced if whole in line], reduced)

    def test_batched_experts_under_vmap(self):
        # vmap over batches, each with its own experts (split over "model" too) and group
        # sizes: the forward and the input gradient reduce over the experts; the weight
        # gradient is split like them, its batch's group sizes gathered over "model" only.
        lhs, rhs = operands(42, batch=(2,))
        sizes = jnp.stack([groups(43), groups(44)])
        f = jax.vmap(jax_sm100.ragged_dot)
        specs = (PS("data"), PS("data", "model"), PS("data"))
        want = counts(all_reduce=reduces("model", "model"), all_gather=reduces("model"))
        got, _ = self.check(grads(f), (lhs, rhs, sizes), specs, want,
                            reference=grads(jax.vmap(reference_dot)), grad=True)  # fmt: skip
        for g, spec in zip(got, specs[:2], strict=True):
            self.assertEqual(same_spec(g.sharding.spec), same_spec(spec))

    @parameterized.named_parameters(
        ("replicated", PS(), ("data",), ()),
        ("split", PS("model"), ("model", "model", "data"), ("model",)),
    )
    def test_experts_shared_under_vmap(self, rhs_spec, reduced, gathered):
        # vmap over batches of rows (split over "data") with one set of experts: the experts'
        # gradient is the batches' sum, one reduction over "data" (the batches a device holds
        # summed in its product); experts split over "model" reduce the forward and the input
        # gradient there too, and gather the group sizes for the gradient's split (as
        # `test_experts`).
        lhs, _ = operands(38, batch=(4,))
        _, rhs = operands(39)
        sizes = jnp.stack([groups(40 + i) for i in range(4)])
        shared = jax.vmap(jax_sm100.ragged_dot, (0, None, 0))

        def reference(a, b, s):
            return jnp.stack([reference_dot(a[i], b, s[i]) for i in range(4)])

        got, _ = self.check(grads(shared), (lhs, rhs, sizes), (PS("data"), rhs_spec, PS("data")),
                            counts(all_reduce=reduces(*reduced), all_gather=reduces(*gathered)),
                            reference=grads(reference),
                            grad=True)  # fmt: skip
        for g, spec in zip(got, (PS("data"), rhs_spec), strict=True):
            self.assertEqual(same_spec(g.sharding.spec), same_spec(spec))

    def test_k(self):
        # Only the forward reduces: both gradients keep k split.
        self.check_grads(
            (PS(None, "model"), PS(None, "model"), PS()), counts(all_reduce=reduces("model")), 36
        )

    def test_n(self):
        want = counts(all_reduce=reduces("model", "data"))
        self.check_grads((PS("data"), PS(None, None, "model"), PS()), want, 38)

    def test_k_split_in_lhs_only(self):
        # The weight gradient comes out split along k as lhs is; rhs is whole: it is gathered to
        # rhs's type.
        want = counts(all_reduce=reduces("model"), all_gather=reduces("model"))
        self.check_grads((PS(None, "model"), PS(), PS()), want, 40)


# --- the other partitioners and meshes ---------------------------------------------------------


@ts._delegated
class AutoAxesTest(RaggedCase):
    """The same rules under Auto mesh axes, with Shardy and with GSPMD propagation."""

    axis_types = AxisType.Auto

    @parameterized.named_parameters(("shardy", True), ("gspmd", False))
    def test_rows_and_experts_and_grads(self, shardy):
        lhs, rhs = operands(50)
        args, specs = (lhs, rhs, groups(51)), (PS("data"), PS("model"), PS())
        before = jax.config.jax_use_shardy_partitioner
        jax.config.update("jax_use_shardy_partitioner", shardy)
        try:
            self.check(
                jax_sm100.ragged_dot,
                args,
                specs,
                counts(all_reduce=reduces("model")),
                reference=reference_dot,
            )
            # Under Auto axes nothing asks for the weight gradient split over experts: it is
            # computed whole on each device, and no group sizes are gathered.
            want = counts(all_reduce=reduces("model", "model", "data"))
            self.check(
                grads(jax_sm100.ragged_dot),
                args,
                specs,
                want,
                reference=grads(reference_dot),
                grad=True,
            )
        finally:
            jax.config.update("jax_use_shardy_partitioner", before)

    def test_bias_with_rows_and_experts(self):
        self.check_bias((PS("data"), PS("model"), PS("model")))

    def test_experts_split_unevenly(self):
        # g experts over an axis that does not divide g, split on rhs or on the group sizes:
        # each row's group index (a scatter of a mark per group end, and a running sum) came
        # out one too high, XLA's partitioner scattering the uneven split's padding at row 0:
        # the bias gradient, and the forward on lax's path, were wrong (review helper-154).
        self.require("model")
        g = 2 * ts.axis_size("model") - 1
        rng = np.random.default_rng(69)
        lhs, rhs = tu.rand(rng, (M, K), "float32"), tu.rand(rng, (g, K, N), "float32")
        bias, cot = tu.rand(rng, (g, N), "float32"), tu.rand(rng, (M, N), "float32")
        sizes = groups(70, g=g)

        def value_and_grads(f):  # f(rhs, bias, sizes), and its gradients in rhs and bias
            loss = lambda b, c, s: jnp.sum(f(b, c, s) * cot)  # noqa: E731
            return lambda b, c, s: (f(b, c, s), jax.grad(loss, (0, 1))(b, c, s))

        want = value_and_grads(lambda b, c, s: reference_biased(lhs, b, s, c))(rhs, bias, sizes)
        split = lambda x: jax.lax.with_sharding_constraint(  # noqa: E731
            x, NamedSharding(self.mesh, PS("model"))
        )
        for which in ("rhs", "group sizes"):
            for kw in ({}, {"precision": HIGHEST}):

                def ours(b, c, s, kw=kw, which=which):
                    b, s = (split(b), s) if which == "rhs" else (b, split(s))
                    return jax_sm100.ragged_dot(lhs, b, s, bias=c, **kw)

                got = jax.jit(value_and_grads(ours))(rhs, bias, sizes)
                for x, y in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
                    tu.assert_close(self, x, y, "float32", K)

    def test_experts_reduce_scatter_onto_rows(self):
        self.require("model")
        lhs, rhs = operands(52)
        self.check(
            jax_sm100.ragged_dot,
            (lhs, rhs, groups(53)),
            (PS(), PS("model"), PS()),
            counts(reduce_scatter=1),
            out_spec=PS("model"),
            reference=reference_dot,
        )

    def test_experts_and_k_reduced_one_scattered(self):
        # Experts over "model", k over "data", the result asked split over "model": one bind
        # both reduce-scatters (over "model") and all-reduces (over "data").
        self.require("model")
        lhs, rhs = operands(56)
        want = counts(reduce_scatter=1, all_reduce=reduces("data"))
        self.check(jax_sm100.ragged_dot, (lhs, rhs, groups(57)), (PS(None, "data"),
                   PS("model", "data"), PS()), want, out_spec=PS("model"),
                   reference=reference_dot)  # fmt: skip

    def test_outer_rows_over_both_axes_one_scattered(self):
        # The weight gradient's rows over both axes, its result asked split over "model".
        self.require("model")
        rng = np.random.default_rng(58)
        args = tu.rand(rng, (M, K), "float32"), tu.rand(rng, (M, N), "float32"), groups(58)
        both = PS(("data", "model"))
        want = counts(reduce_scatter=1, all_reduce=reduces("data"))
        self.check(OuterTest.outer(), args, (both, both, PS()), want, out_spec=PS("model"),
                   reference=reference_outer)  # fmt: skip

    def test_outer_partials_reduce_in_float32(self):
        # A bfloat16 weight gradient of rows split over both axes: its partials are summed in
        # float32 and rounded once (each rounded to bfloat16 first moved 18-40 % of them).
        rng = np.random.default_rng(59)
        lhs, rhs = tu.rand(rng, (512, K), "bfloat16"), tu.rand(rng, (512, N), "bfloat16")
        sizes = jnp.asarray([60, 70, 0, 90, 100, 50, 80, 62], jnp.int32)
        both = PS(("data", "model"))
        f = OuterTest.outer(out_dtype="bfloat16")
        got = jax.jit(f)(self.put(lhs, both), self.put(rhs, both), sizes)
        self.assertEqual(got.dtype, jnp.bfloat16)
        want = reference_outer(lhs.astype(jnp.float32), rhs.astype(jnp.float32), sizes)
        ts.assert_rounded_once(self, got, want)

    def test_uneven_experts_are_gathered(self):
        # Six experts do not divide over "model": they are gathered, not split unevenly.
        self.require("model")
        rng = np.random.default_rng(54)
        lhs, rhs = tu.rand(rng, (M, K), "float32"), tu.rand(rng, (6, K, N), "float32")
        sizes = groups(55, g=6)

        def f(lhs, rhs, sizes):
            rhs = jax.lax.with_sharding_constraint(rhs, jax.NamedSharding(self.mesh, PS("model")))
            return jax_sm100.ragged_dot(lhs, rhs, sizes)

        sharded = [self.put(x, PS()) for x in (lhs, rhs, sizes)]
        got = jax.jit(f)(*sharded)
        tu.assert_close(self, got, reference_dot(lhs, rhs, sizes), "float32", K)


@ts._delegated
class ShardMapTest(RaggedCase):
    axis_types = AxisType.Explicit

    def test_inside_shard_map_the_product_is_local(self):
        # Every axis is manual inside: the primitive lowers to the local function, no partitioner
        # and no collective. Each device's rows, with the group sizes cut for its block.
        lhs, rhs = operands(60)
        shards = ts.axis_size("data") * ts.axis_size("model")
        sizes = jnp.tile(groups(61, M // shards), (shards, 1))  # [shards, g]: each block's

        def local(a, b, s):
            return jax_sm100.ragged_dot(a, b, s[0])

        f = jax.shard_map(
            local,
            mesh=self.mesh,
            in_specs=(PS(ts.AXES), PS(), PS(ts.AXES)),
            out_specs=PS(ts.AXES),
        )

        def reference(a, b, s):
            blocks = [reference_dot(x, b, y) for x, y in zip(jnp.split(a, shards), s, strict=True)]
            return jnp.concatenate(blocks)

        self.check(
            f, (lhs, rhs, sizes), (PS(ts.AXES), PS(), PS(ts.AXES)), counts(), reference=reference
        )


class OneDeviceMeshTest(absltest.TestCase):
    def test_explicit_mesh_of_one_device(self):
        # Operands typed over size-1 axes: nothing is partitioned, the types are kept.
        mesh = jax.make_mesh(
            (1, 1), ts.AXES, axis_types=(AxisType.Explicit,) * 2, devices=ts.platform_devices()[:1]
        )
        lhs, rhs = operands(70)
        sizes = groups(71)
        want = jax.jit(reference_dot)(lhs, rhs, sizes)
        want_g = jax.jit(grads(reference_dot))(lhs, rhs, sizes)
        with jax.sharding.set_mesh(mesh):
            specs = (PS("data", "model"), PS("model"), PS())
            args = [
                jax.device_put(x, jax.NamedSharding(mesh, s))
                for x, s in zip((lhs, rhs, sizes), specs, strict=True)
            ]
            got = jax.jit(jax_sm100.ragged_dot)(*args)
            got_g = jax.jit(grads(jax_sm100.ragged_dot))(*args)
        tu.assert_close(self, got, want, "float32", K)
        for g, w in zip(got_g, want_g, strict=True):
            tu.assert_close(self, g, w, "float32", M)


if __name__ == "__main__":
    absltest.main()
