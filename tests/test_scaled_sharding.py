"""Tests of `scaled_matmul`'s partitioning (scaled_sharding.py) and of `quantize` on sharded
inputs, on the ("data", "model") mesh.

Every case runs one jitted function on sharded operands, compares it with the same function on
one device, and counts the collectives in the compiled HLO: b, m and n splits are local, a split
k is one reduction of float32 partials. Operands: [2, 512, 512] activations and weights,
quantized by each recipe (k holds 4 blocks of 128, 4 mxfp8 atoms of 128 and 8 nvfp4 atoms of
64; the rows 4 tiles or atoms of 128).

The mesh, its platform and the collective counting are test_sharding.py's (imported first: it
asks for the 8 host devices before JAX starts a backend), as are its variables and the fallback
of running each class in a child process.
"""

from __future__ import annotations

from tests import test_sharding as ts  # isort: split

import functools
import math
import re

import jax
import jax.numpy as jnp
import numpy as np
from absl.testing import absltest, parameterized
from jax.sharding import AxisType
from jax.sharding import PartitionSpec as PS

import jax_sm100

counts, reduces, same_spec = ts.counts, ts.reduces, ts.same_spec
B, M, N, K = 2, 512, 512, 512
# (lhs recipe, rhs recipe): DeepSeek-V3's activations and weights, and the two MX formats.
RECIPES = (
    ("fp8_block128", "fp8_block128"),
    ("fp8_block128", "fp8_block128x128"),
    ("mxfp8", "mxfp8"),
    ("nvfp4", "nvfp4"),
)
# Sharded against unsharded, relative to the largest element: float32 partials summed in
# another order (on a GPU, the local kernels' fp8 MMAs also accumulate per k-block).
RTOL = {"cpu": 2e-5, "gpu": 2e-3}[ts._PLATFORM]


def data(seed, rows=M, k=K):
    return jnp.asarray(np.random.default_rng(seed).standard_normal((B, rows, k)), jnp.float32)


def quantized(recipe_pair, lhs_rows=M, rhs_rows=N):
    """(lhs, rhs, lhs_scales, rhs_scales) of normal data quantized by `recipe_pair`."""
    lq, ls = jax_sm100.quantize(data(0, lhs_rows), recipe_pair[0])
    rq, rs = jax_sm100.quantize(data(1, rhs_rows), recipe_pair[1])
    return lq, rq, ls, rs


def product(lhs, rhs, lhs_scales, rhs_scales):
    return jax_sm100.scaled_matmul(lhs, rhs, lhs_scales, rhs_scales)


def loss(lhs, rhs, lhs_scales, rhs_scales):
    """A scalar of the product of float32 data (differentiable) with the scales."""
    return jnp.sum(jnp.sin(jax_sm100.scaled_matmul(lhs, rhs, lhs_scales, rhs_scales)))


# (x, w) splits of a training step: data parallel, tensor parallel (w's columns), FSDP (w's k
# over the rows' axis), and sequence-parallel rows beside w's columns over another axis.
TRAINING_LAYOUTS = (
    (PS("data"), PS()),
    (PS(), PS(None, "model")),
    (PS("data"), PS("data")),
    (PS("model"), PS(None, "data")),
)


def training_loss(x, w):
    """A loss of x [m, k] @ w [k, n] through scaled_dot_general (DeepSeek-V3's recipe)."""
    y = jax_sm100.scaled_dot_general(x, w, (((1,), (0,)), ((), ())), jnp.float32,
                                     jax_sm100.DEEPSEEK_V3)  # fmt: skip
    return jnp.sum(jnp.sin(y))


def assert_close(got, want, rtol=RTOL):
    for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
        w = np.asarray(w, np.float64)
        scale = max(float(np.max(np.abs(w))), 1e-6)
        np.testing.assert_allclose(np.asarray(g, np.float64), w, atol=rtol * scale, rtol=0)


class ScaledCase(ts.ShardedTestCase):
    def require_model_of_4(self):
        """Skips a case whose splits cut a block only over a "model" axis of 4 devices."""
        if ts.axis_size("model") != 4:
            self.skipTest(f"needs a 'model' axis of 4; the mesh is {ts.run_mesh_shape()}")

    def check(self, args, specs, want_counts, *, out_spec=None):
        """The product of sharded `args` equals the unsharded one; its collectives. The scales
        are split as their data (their first three dims: b, the rows or their tiles or atoms,
        k's blocks or atoms). Returns the result."""
        specs = (*specs, *specs)
        return super().check(product, args, specs, want_counts, out_spec=out_spec, rtol=RTOL)[0]


# --- Auto axes ---------------------------------------------------------------------------------


@ts._delegated
class AutoAxesTest(ScaledCase):
    """Under Auto mesh axes, with Shardy and with GSPMD propagation."""

    axis_types = AxisType.Auto

    def run_with(self, shardy, fn):
        before = jax.config.jax_use_shardy_partitioner
        jax.config.update("jax_use_shardy_partitioner", shardy)
        try:
            fn()
        finally:
            jax.config.update("jax_use_shardy_partitioner", before)

    @parameterized.product(recipes=RECIPES, shardy=(True, False))
    def test_batch_rows_and_columns_are_local(self, recipes, shardy):
        args = quantized(recipes)
        for specs in (
            (PS("data"), PS("data")),
            (PS(None, "data"), PS(None, "model")),
            (PS("data", "model"), PS("data")),
        ):
            self.run_with(shardy, lambda specs=specs: self.check(args, specs, counts()))

    @parameterized.product(recipes=RECIPES, shardy=(True, False))
    def test_k_partial_sums_reduce_once(self, recipes, shardy):
        # k split over whole scale blocks: float32 partials, one all-reduce, rounded once.
        args = quantized(recipes)
        specs = (PS(None, "data", "model"), PS(None, None, "model"))
        want = counts(all_reduce=reduces("model"))
        self.run_with(shardy, lambda: self.check(args, specs, want))

    @parameterized.parameters(*RECIPES)
    def test_k_partials_reduce_scatter_onto_a_split_result(self, *recipes):
        self.require("model")
        args = quantized(recipes)
        specs = (PS(None, None, "model"), PS(None, None, "model"))
        self.check(args, specs, counts(reduce_scatter=1), out_spec=PS(None, None, "model"))

    def test_blocks_split_inside_an_atom_are_gathered(self):
        # 256 rows hold two 128-row atoms of mxfp8's blocked scales: a split over "model" (4)
        # would cut atoms, so the rows are gathered (and nothing is reduced).
        self.require_model_of_4()
        args = quantized(("mxfp8", "mxfp8"), lhs_rows=256)
        sharded = (self.put(args[0], PS(None, "model")), *args[1:])
        hlo = jax.jit(product).lower(*sharded).compile().as_text()
        found = ts.collectives(hlo)
        self.assertGreaterEqual(found["all-gather"], 1, found)
        self.assertEqual(found["all-reduce"] + found["reduce-scatter"], 0, found)
        assert_close(jax.jit(product)(*sharded), jax.jit(product)(*args))

    @parameterized.product(recipes=RECIPES, shardy=(True, False))
    def test_vmap_over_examples_with_shared_weights(self, recipes, shardy):
        # Per-example activations [V, 1, m, k] against one weight [1, n, k] that the vmap leaves
        # unmapped (read once, not copied per example): the examples split over "data" or
        # their rows over "model", the weight whole or its rows over "model". Under Shardy
        # each device computes its local product with no collective. GSPMD's propagation
        # (deprecated) moves lhs's "model" onto k beside the weight's split rows (an all-to-all
        # and a reduce-scatter); the values are the same.
        lq, ls = jax_sm100.quantize(data(0)[:, None], recipes[0])
        rq, rs = jax_sm100.quantize(data(1)[:1], recipes[1])
        f = jax.jit(jax.vmap(product, (0, None, 0, None)))
        want = f(lq, rq, ls, rs)
        layouts = ((PS("data"), PS()), (PS(None, None, "model"), PS()),
                   (PS("data"), PS(None, "model")))  # fmt: skip
        for lhs_spec, rhs_spec in layouts:
            args = ((lq, lhs_spec), (rq, rhs_spec), (ls, lhs_spec), (rs, rhs_spec))
            sharded = [self.put(x, spec) for x, spec in args]

            def run(sharded=sharded, layout=f"{lhs_spec}, {rhs_spec}"):
                if shardy:
                    hlo = f.lower(*sharded).compile().as_text()
                    self.assertEqual(ts.collectives(hlo), counts(), layout)
                assert_close(f(*sharded), want)

            self.run_with(shardy, run)

    @parameterized.product(recipes=RECIPES, shardy=(True, False))
    def test_vmap_with_fsdp_weights_gathers_them(self, recipes, shardy):
        # FSDP's layout under the same vmap: the examples and the shared weight's k (its
        # scales' too) over "data". Gathering the weight (and its scales) moves less than
        # moving the activations to a split of k and reduce-scattering float32 partials of
        # every example (sharding._gathers_less), so nothing is reduced.
        self.require("data")
        lq, ls = jax_sm100.quantize(data(0)[:, None], recipes[0])
        rq, rs = jax_sm100.quantize(data(1)[:1], recipes[1])
        f = jax.jit(jax.vmap(product, (0, None, 0, None)))
        want = f(lq, rq, ls, rs)
        specs = (PS("data"), PS(None, None, "data"), PS("data"), PS(None, None, "data"))
        sharded = [self.put(x, sp) for x, sp in zip((lq, rq, ls, rs), specs, strict=True)]

        def run():
            found = ts.collectives(f.lower(*sharded).compile().as_text())
            self.assertEqual(found["all-reduce"] + found["reduce-scatter"] + found["all-to-all"],
                             0, found)  # fmt: skip
            self.assertGreaterEqual(found["all-gather"], 1, found)
            assert_close(f(*sharded), want)

        self.run_with(shardy, run)

    @parameterized.parameters(*RECIPES)
    def test_k_not_in_whole_blocks_is_gathered(self, *recipes):
        # k = 256: two fp8 blocks of 128, two mxfp8 atoms, four nvfp4 atoms; over 4 devices
        # only nvfp4's split stays (reduced once), the others are gathered (nothing reduced).
        self.require_model_of_4()
        lq, ls = jax_sm100.quantize(data(0)[..., :256], recipes[0])
        rq, rs = jax_sm100.quantize(data(1)[..., :256], recipes[1])
        args = (lq, rq, ls, rs)
        sharded = (self.put(lq, PS(None, None, "model")), self.put(rq, PS(None, None, "model")),
                   ls, rs)  # fmt: skip
        hlo = jax.jit(product).lower(*sharded).compile().as_text()
        found = ts.collectives(hlo)
        if recipes[0] == "nvfp4":
            self.assertEqual(found["all-reduce"], 1, found)
        else:
            self.assertGreaterEqual(found["all-gather"], 1, found)
            self.assertEqual(found["all-reduce"] + found["reduce-scatter"], 0, found)
        assert_close(jax.jit(product)(*sharded), jax.jit(product)(*args))

    @parameterized.product(shardy=(True, False))
    def test_dims_of_one_quantum(self, shardy):
        # 128 rows of mxfp8 (one atom), k of one fp8 block, 128 rows of 128 x 128 tiles: such
        # a dim cannot be split, and its rule compiles with the batch split (Shardy refused
        # the rule's compound factor of size 1 before, whatever was split).
        cases = (
            (("mxfp8", "mxfp8"), 128, 512, 512),
            (("fp8_block128", "fp8_block128"), 512, 512, 128),
            (("fp8_block128", "fp8_block128x128"), 512, 128, 512),
            (("nvfp4", "nvfp4"), 512, 512, 64),
        )
        specs = (PS("data"), PS("data"))
        for recipes, m, n, k in cases:
            lq, ls = jax_sm100.quantize(data(0, m)[..., :k], recipes[0])
            rq, rs = jax_sm100.quantize(data(1, n)[..., :k], recipes[1])
            self.run_with(shardy, lambda a=(lq, rq, ls, rs): self.check(a, specs, counts()))

    @parameterized.product(recipes=RECIPES, shardy=(True, False))
    def test_quantize_in_the_same_jit_on_splits_inside_blocks(self, recipes, shardy):
        # 256 rows over "model" (4): each device holds half a 128-row tile or atom; k of 256
        # over 4: half an fp8 block or mxfp8 atom. The scales `quantize` makes inside the jit
        # then carry a part of the axis (a sub-axis), which JAX's decoding of custom
        # partitioning's shardings refused (the compile raised; under GSPMD XLA aborted).
        self.require_model_of_4()

        def f(a, b):
            lq, ls = jax_sm100.quantize(a, recipes[0])
            rq, rs = jax_sm100.quantize(b, recipes[1])
            return jax_sm100.scaled_matmul(lq, rq, ls, rs)

        for rows, k, spec in ((256, K, PS(None, "model")), (M, 256, PS(None, None, "model"))):
            a, b = data(0, rows)[..., :k], data(1, rows)[..., :k]
            sharded = [self.put(x, spec) for x in (a, b)]
            self.run_with(
                shardy, lambda s=sharded, a=a, b=b: assert_close(jax.jit(f)(*s), jax.jit(f)(a, b))
            )

    def test_k_partials_reduce_in_float32(self):
        # A bfloat16 result: the partials are reduced in float32 and rounded once, so (nearly)
        # every element is the float32 product rounded once. (XLA on a CPU reduces bfloat16
        # in float32 itself: the HLO's reductions alone do not show where the rounding is.)
        args = quantized(RECIPES[0])
        f = lambda *a: jax_sm100.scaled_matmul(*a, preferred_element_type=jnp.bfloat16)
        specs = (PS(None, None, "model"), PS(None, None, "model"))
        sharded = [self.put(x, s) for x, s in zip(args, (*specs, *specs), strict=True)]
        hlo = jax.jit(f).lower(*sharded).compile().as_text()
        reductions = [line for line in hlo.splitlines() if " all-reduce(" in line]
        if ts.axis_size("model") > 1:
            self.assertTrue(reductions and all("f32[" in line for line in reductions), reductions)
        got = jax.jit(f)(*sharded)
        self.assertEqual(got.dtype, jnp.bfloat16)
        ts.assert_rounded_once(self, got, jax.jit(product)(*args))

    def test_k_over_two_axes_scattered_over_one(self):
        # k of 8 blocks over both axes, the result asked split over "model": one bind both
        # reduce-scatters (over "model") and all-reduces (over "data").
        self.require("model")
        lq, ls = jax_sm100.quantize(data(0, 512, k=1024), "fp8_block128")
        rq, rs = jax_sm100.quantize(data(1, 256, k=1024), "fp8_block128")
        both = PS(None, None, ("data", "model"))
        want = counts(reduce_scatter=1, all_reduce=reduces("data"))
        self.check((lq, rq, ls, rs), (both, both), want, out_spec=PS(None, "model"))

    @parameterized.named_parameters(
        # (lhs recipe, rows, k), (rhs recipe, rows, k), (lhs spec, rhs spec)
        ("lhs_tiles_split_inside", ("fp8_block128x128", 256, 512), ("fp8_block128", 512, 512),
         (PS(None, "model"), PS())),
        ("rhs_tiles_split_inside", ("fp8_block128", 512, 512), ("fp8_block128x128", 256, 512),
         (PS(), PS(None, "model"))),
        ("lhs_tiles_rhs_rows", ("fp8_block128x128", 512, 512), ("fp8_block128", 64, 512),
         (PS(), PS(None, "model"))),
        ("k_quanta_of_both", ("nvfp4", 256, 256), ("fp8_block128", 256, 256),
         (PS(None, None, "model"), PS(None, None, "model"))),
        ("k_quanta_of_both_rhs", ("fp8_block128", 256, 256), ("nvfp4", 256, 256),
         (PS(None, None, "model"), PS(None, None, "model"))),
        ("tile_rows_not_whole", ("fp8_block128x128", 320, 512), ("fp8_block128", 512, 512),
         (PS(None, "data"), PS())),
        ("atom_rows_not_whole", ("mxfp8", 320, 512), ("mxfp8", 512, 512),
         (PS(None, "data"), PS())),
        ("atom_k_not_whole", ("mxfp8", 512, 192), ("mxfp8", 512, 192),
         (PS(None, None, "data"), PS(None, None, "data"))),
    )  # fmt: skip
    def test_splits_that_cut_a_quantum_are_gathered(self, lhs, rhs, specs):
        # A split that would cut a scale tile, an atom or either operand's k block (the larger
        # quantum of the two) is gathered, not cut: the product equals the unsharded one and
        # compiles (cut, it read another tile's scales or Shardy refused the rule's factors).
        self.require_model_of_4()
        lq, ls = jax_sm100.quantize(data(0, lhs[1], k=lhs[2]), lhs[0])
        rq, rs = jax_sm100.quantize(data(1, rhs[1], k=rhs[2]), rhs[0])
        sharded = (self.put(lq, specs[0]), self.put(rq, specs[1]), ls, rs)
        assert_close(jax.jit(product)(*sharded), jax.jit(product)(lq, rq, ls, rs))

    def test_scales_follow_their_data(self):
        # lhs split by rows, its scales split along k: the scales are resharded to the rows
        # (a move of the small scales), not the data to k with its partials reduced.
        self.require("model")
        args = quantized(RECIPES[0])
        specs = (PS(None, "model"), PS(), PS(None, None, "model"), PS())
        sharded = [self.put(x, s) for x, s in zip(args, specs, strict=True)]
        hlo = jax.jit(product).lower(*sharded).compile().as_text()
        found = ts.collectives(hlo)
        self.assertEqual(found["all-reduce"] + found["reduce-scatter"], 0, found)
        for line in hlo.splitlines():  # nothing as large as the data moves
            if any(f" {c}(" in line or f" {c}-start(" in line for c in ts.COLLECTIVES):
                for dims in re.findall(r"\[([\d,]+)\]", line):
                    self.assertLess(math.prod(map(int, dims.split(","))), B * M * K // 8, line)
        assert_close(jax.jit(product)(*sharded), jax.jit(product)(*args))

    def test_lowering_is_a_custom_partitioning_call(self):
        # XLA must not partition the product itself: on a GPU it would replicate the kernel's
        # custom call (every operand gathered, the whole product on every device).
        args = quantized(RECIPES[0])
        sharded = [self.put(x, PS(None, "data")) for x in args]
        text = jax.jit(product).lower(*sharded).as_text()
        self.assertIn("@CustomSPMDPartitioning", text)
        self.assertIn("sdy.sharding_rule", text)
        self.assertNotIn("CustomSPMDPartitioning", jax.jit(product).lower(*args).as_text())

    @parameterized.product(shardy=[True, False], recipe=["fp8_block128", "fp8_block128x128"])
    def test_quantize_both_is_local(self, shardy, recipe):
        # Each device quantizes its block of x both ways where the block holds whole
        # 128-blocks along R and C: no collective, the results split as x (the transposed
        # ones transposed). A split that would cut a block is dropped, x
        # gathered along it; R or C of one block is never split. Bit for bit the unsharded
        # values either way, and a custom_partitioning call (on a GPU, the kernel's custom call
        # would otherwise run whole on every device). Per 1 x 128 block and per 128 x 128 tile.
        f = jax.jit(lambda x: jax_sm100.quantize_both(x, recipe))

        def devices(entry):
            axes = () if entry is None else (entry,) if isinstance(entry, str) else entry
            return math.prod(ts.axis_size(a) for a in axes)

        for shape, spec in (
            ((2, 256, 512), PS("data", None, "model")),
            ((2, 256, 512), PS(None, "model", "data")),
            ((2, 256, 512), PS(None, "data", "model")),
            ((2, 256, 512), PS(None, ("data", "model"))),
            ((4, 128, 1024), PS("data", "model")),  # one block of rows
            ((3, 256, 256), PS(None, None, "model")),  # 4 devices on 2 blocks
        ):
            x = jnp.asarray(np.random.default_rng(3).standard_normal(shape), jnp.bfloat16)
            want = [np.asarray(w).view(np.uint8) for w in jax.tree.leaves(f(x))]
            lead, rows, cols = (*spec, None, None)[:3]
            blocks = (shape[0], shape[1] // 128, shape[2] // 128)
            splits = (lead, rows, cols)
            whole = all(n % devices(e) == 0 for n, e in zip(blocks, splits, strict=True))
            transposed = PS(lead, cols, rows)

            def check(x=x, want=want, spec=spec, whole=whole, transposed=transposed):
                xs = self.put(x, spec)
                got = f(xs)
                for g, w in zip(jax.tree.leaves(got), want, strict=True):
                    np.testing.assert_array_equal(np.asarray(g).view(np.uint8), w)
                if whole:
                    hlo = f.lower(xs).compile().as_text()
                    self.assertEqual(ts.collectives(hlo), counts(), spec)
                    (q, _), (qt, _) = got
                    self.assertEqual(same_spec(q.sharding.spec), same_spec(spec))
                    self.assertEqual(same_spec(qt.sharding.spec), same_spec(transposed))

            self.run_with(shardy, check)
        x = jnp.zeros((2, 256, 512), jnp.bfloat16)
        self.assertIn("@CustomSPMDPartitioning", f.lower(self.put(x, PS("data"))).as_text())

    @parameterized.parameters(*RECIPES)
    def test_grads(self, *recipes):
        lq, rq, ls, rs = quantized(recipes)
        args = (lq.astype(jnp.float32), rq.astype(jnp.float32), ls, rs)
        f = jax.grad(loss, (0, 1))
        specs = (PS(None, "data", "model"), PS(None, None, "model"))
        specs = (*specs, *specs)
        sharded = [self.put(x, s) for x, s in zip(args, specs, strict=True)]
        assert_close(jax.jit(f)(*sharded), jax.jit(f)(*args), rtol=10 * RTOL)

    @parameterized.parameters(*TRAINING_LAYOUTS)
    def test_scaled_dot_general_training_step(self, x_spec, w_spec):
        # value_and_grad through scaled_dot_general (every product quantized inside, the
        # gradients' along the rows and the columns too) equals the unsharded step.
        step = jax.jit(jax.value_and_grad(training_loss, (0, 1)))
        x, w = data(0)[0], data(1)[0]
        args = (self.put(x, x_spec), self.put(w, w_spec))
        assert_close(step(*args), step(x, w), rtol=10 * RTOL)
        # The collectives of the same step on jnp's float32 product, but for FSDP, where the
        # weight's quantized data is gathered in the forward and again for the input's
        # gradient (and their scales beside it) rather than the float32 weight once.
        found = ts.collectives(step.lower(*args).compile().as_text())
        plain = jax.jit(jax.value_and_grad(lambda x, w: jnp.sum(jnp.sin(x @ w)), (0, 1)))
        if (x_spec, w_spec) == (PS("data"), PS("data")):
            self.assertEqual(found["all-to-all"] + found["collective-permute"], 0, found)
            self.assertLessEqual(found["all-gather"], 4, found)
        else:
            self.assertEqual(found, ts.collectives(plain.lower(*args).compile().as_text()))


# --- Explicit axes -----------------------------------------------------------------------------


@ts._delegated
class ExplicitAxesTest(ScaledCase):
    """Under Explicit axes: quantize keeps its input's type, the product is typed as
    `scaled.out_spec` says, and every gradient is typed as its primal."""

    LAYOUTS = (
        (PS("data"), PS("data")),
        (PS(None, "data"), PS(None, "model")),
        (PS(None, None, "model"), PS(None, None, "model")),
        (PS(None, "data", "model"), PS(None, None, "model")),
        (PS(None, "model"), PS()),
    )

    @parameterized.parameters("fp8_block128", "fp8_block128x128", "mxfp8", "nvfp4")
    def test_quantize_split_inputs(self, recipe):
        # Rows and k split, alone and together: the same data and scales as on one device (the
        # 128 x 128 and blocked recipes' reshapes raised on a split before), the data typed as
        # x and the scales split as x is (every split here holds whole tiles, blocks and atoms).
        x = data(2)
        want = jax.jit(lambda x: jax_sm100.quantize(x, recipe))(x)
        for spec in (PS(None, "data"), PS(None, None, "model"), PS("data", "model", None)):
            with jax.sharding.set_mesh(self.mesh):
                xs = jax.device_put(x, spec)
                got = jax.jit(lambda x: jax_sm100.quantize(x, recipe))(xs)
                self.assertEqual(jax.typeof(got[0]).sharding.spec, jax.typeof(xs).sharding.spec)
                scales = tuple(jax.typeof(got[1]).sharding.spec)[:3]
                self.assertEqual(same_spec(scales), same_spec(spec))
            for g, w in zip(got, want, strict=True):
                np.testing.assert_array_equal(
                    np.asarray(g.astype(jnp.float32)), np.asarray(w.astype(jnp.float32))
                )

    @parameterized.parameters("fp8_block128", "fp8_block128x128", "mxfp8", "nvfp4")
    def test_quantize_splits_inside_blocks(self, recipe):
        # 256 rows (2 tiles or atoms) and k = 256 (2 fp8 blocks, 2 mxfp8 atoms) over 4
        # devices: the scales are gathered where a device would hold part of a block, the data
        # keeps x's type (quantize raised on these before).
        self.require_model_of_4()
        x = data(3)[:, :256, :256]
        want = jax.jit(lambda x: jax_sm100.quantize(x, recipe))(x)
        for spec in (PS(None, "model"), PS(None, None, "model")):
            with jax.sharding.set_mesh(self.mesh):
                xs = jax.device_put(x, spec)
                got = jax.jit(lambda x: jax_sm100.quantize(x, recipe))(xs)
                self.assertEqual(jax.typeof(got[0]).sharding.spec, jax.typeof(xs).sharding.spec)
                # The scales keep a split of rows or k where their dim divides over 4.
                want_spec = [e if e and got[1].shape[d] % 4 == 0 else None
                             for d, e in enumerate((tuple(spec) + (None,) * 3)[:3])]  # fmt: skip
                scales = tuple(jax.typeof(got[1]).sharding.spec)[:3]
                self.assertEqual(same_spec(scales), same_spec(want_spec))
            for g, w in zip(got, want, strict=True):
                np.testing.assert_array_equal(
                    np.asarray(g.astype(jnp.float32)), np.asarray(w.astype(jnp.float32))
                )

    @parameterized.parameters("fp8_block128", "fp8_block128x128")
    def test_quantize_both_typed_and_local(self, recipe):
        # quantize_both binds its primitive under Explicit axes too (it ran XLA's two
        # quantizations there): its results typed as the partitioned kernels write them (x's
        # split where it holds whole 128-blocks, else whole; the transposed results' last two
        # dims swapped; the scales split as the data), bit for bit the unsharded values, and
        # no collective where every split holds whole blocks.
        f = jax.jit(lambda x: jax_sm100.quantize_both(x, recipe))
        for shape, spec in (
            ((2, 256, 512), PS("data", None, "model")),
            ((2, 256, 512), PS(None, "model", "data")),
            ((4, 128, 1024), PS(None, None, "model")),
            ((2, 2, 256, 512), PS("data", None, None, "model")),
            ((256, 512), PS("data", "model")),
            ((3, 256, 256), PS(None, None, "model")),
        ):
            x = jnp.asarray(np.random.default_rng(3).standard_normal(shape), jnp.bfloat16)
            want = [np.asarray(w).view(np.uint8) for w in jax.tree.leaves(f(x))]
            # A dim keeps its split where its blocks (of 128 along the last two) divide evenly.
            entries = (*spec, *(None,) * len(shape))[: len(shape)]
            blocks = (*shape[:-2], shape[-2] // 128, shape[-1] // 128)
            kept = tuple(e if e is None or n % ts.axis_size(e) == 0 else None
                         for n, e in zip(blocks, entries, strict=True))  # fmt: skip
            swapped = (*kept[:-2], kept[-1], kept[-2])
            with jax.sharding.set_mesh(self.mesh):
                xs = jax.device_put(x, spec)
                got = f(xs)
                partitioned = "@CustomSPMDPartitioning" in f.lower(xs).as_text()
                self.assertTrue(partitioned, f"{shape} {spec}: the primitive, partitioned")
                if kept == entries:
                    hlo = f.lower(xs).compile().as_text()
                    self.assertEqual(ts.collectives(hlo), counts(), f"{shape} {spec}")
            for g, w in zip(jax.tree.leaves(got), want, strict=True):
                np.testing.assert_array_equal(np.asarray(g).view(np.uint8), w)
            (q, s), (qt, st) = got
            for result, spec_want in ((q, kept), (s, kept), (qt, swapped), (st, swapped)):
                typed = same_spec(jax.typeof(result).sharding.spec)
                self.assertEqual(typed, same_spec(spec_want), f"{shape} {spec}")

    def test_quantize_both_vmapped_and_beside_a_size_one_axis(self):
        # vmap's merge of its dim with x's leading one is typed where it moves no data, else
        # runs XLA's quantizations (it raised ShardingTypeError on a split leading dim); the
        # split back is typed from x's leading dims (JAX's rule asserted beside an axis of
        # size 1, which the merge moves last). Bit for bit the unsharded values, and typed as
        # x's leading dims.
        devices = ts.platform_devices()
        if len(devices) < 8:
            self.skipTest("needs 8 devices")
        mesh = jax.make_mesh((2, 1, 4), ("a", "b", "c"), devices=devices[:8],
                             axis_types=(AxisType.Explicit,) * 3)  # fmt: skip
        x = jnp.asarray(np.random.default_rng(6).standard_normal((2, 4, 256, 256)), jnp.bfloat16)
        for fn in (jax_sm100.quantize_both, jax.vmap(jax_sm100.quantize_both)):
            f = jax.jit(fn)
            want = [np.asarray(w).view(np.uint8) for w in jax.tree.leaves(f(x))]
            for spec in (PS(("a", "b"), "c"), PS("a", ("b", "c")), PS(("b", "a"), "c"),
                         PS(None, "c")):  # fmt: skip
                with jax.sharding.set_mesh(mesh):
                    got = f(jax.device_put(x, spec))
                for g, w in zip(jax.tree.leaves(got), want, strict=True):
                    np.testing.assert_array_equal(np.asarray(g).view(np.uint8), w)
                    self.assertEqual(tuple(jax.typeof(g).sharding.spec)[:2], tuple(spec)[:2])

    def test_scaled_dot_general_quantizes_both_ways_once(self):
        # Under Explicit axes too, each activation, weight and cotangent goes through
        # quantize_both (the fp8 residual kept), and a gradient of an operand kept quantized is
        # typed as the operand (it was untyped: a custom_vjp type error with rows split over
        # "model").
        x = jnp.asarray(np.random.default_rng(7).standard_normal((2, 256, 512)), jnp.float32)
        w = jnp.asarray(np.random.default_rng(8).standard_normal((512, 256)), jnp.float32)

        def loss(x, w):
            y = jax_sm100.scaled_dot_general(x, w, (((2,), (0,)), ((), ())), jnp.float32,
                                             jax_sm100.DEEPSEEK_V3)  # fmt: skip
            return jnp.sum(jnp.sin(y))

        step = jax.value_and_grad(loss, (0, 1))
        want = jax.jit(step)(x, w)
        # x, w and the cotangent; with the rows (2 x 256) split 8 ways, inside 128-blocks, each
        # product quantizes x and the cotangent itself (`_both`: quantize_both's results would
        # be typed whole).
        binds = 3 if 4 % (ts.axis_size("data") * ts.axis_size("model")) == 0 else 1
        for x_spec, want_binds in ((PS("data"), 3), (PS("data", "model"), binds)):
            with jax.sharding.set_mesh(self.mesh):
                typed = (jax.device_put(x, x_spec), jax.device_put(w, PS()))
                got = jax.jit(step)(*typed)
                jaxpr = str(jax.make_jaxpr(step)(*typed))
            self.assertEqual(jaxpr.count("jax_sm100_quantize_both["), want_binds, x_spec)
            assert_close(got, want, rtol=10 * RTOL)
            for g, t in zip(got[1], typed, strict=True):
                self.assertEqual(jax.typeof(g).sharding.spec, jax.typeof(t).sharding.spec)
        # Per-example gradients, the examples split (the fold of an unsplit operand under that
        # vmap raised ShardingTypeError in JAX's reshape rule).
        grads = jax.jit(jax.vmap(jax.grad(loss), in_axes=(0, None)))
        xb = jnp.stack([x, 2 * x])
        want = grads(xb, w)
        with jax.sharding.set_mesh(self.mesh):
            got = grads(jax.device_put(xb, PS("data")), jax.device_put(w, PS()))
        assert_close(got, want, rtol=10 * RTOL)
        self.assertEqual(same_spec(jax.typeof(got).sharding.spec), ("data",))

    def test_forward_typed_alike_with_and_without_a_gradient(self):
        # Rows split inside 128-blocks (384 over 2 devices): quantize_both would type its
        # results whole there, so the forward keeps quantizing per product, and its result is
        # typed as without a gradient (it was gathered under vjp, and jax.checkpoint raised a
        # custom_vjp type error).
        x = jnp.asarray(np.random.default_rng(9).standard_normal((384, 512)), jnp.float32)
        w = jnp.asarray(np.random.default_rng(10).standard_normal((512, 256)), jnp.float32)

        def f(x, w):
            return jax_sm100.scaled_dot_general(x, w, (((1,), (0,)), ((), ())), jnp.float32,
                                                jax_sm100.DEEPSEEK_V3)  # fmt: skip

        loss = jax.checkpoint(lambda x, w: jnp.sum(jnp.sin(f(x, w))))
        want = jax.jit(jax.grad(loss, (0, 1)))(x, w)
        with jax.sharding.set_mesh(self.mesh):
            typed = (jax.device_put(x, PS("data")), jax.device_put(w, PS()))
            plain = jax.eval_shape(f, *typed)
            under_vjp = jax.eval_shape(lambda x, w: jax.vjp(f, x, w)[0], *typed)
            got = jax.jit(jax.grad(loss, (0, 1)))(*typed)
        self.assertEqual(under_vjp.sharding.spec, plain.sharding.spec)
        self.assertEqual(same_spec(plain.sharding.spec), ("data",))
        assert_close(got, want, rtol=10 * RTOL)

    def test_nvfp4_gradients_typed(self):
        # nvfp4's gradients are plain products (JAX's rule) that contract a split m or n: lax
        # asked for an out_sharding there and raised ShardingTypeError.
        x = jnp.asarray(np.random.default_rng(11).standard_normal((256, 512)), jnp.float32)
        w = jnp.asarray(np.random.default_rng(12).standard_normal((512, 256)), jnp.float32)

        def loss(x, w):
            y = jax_sm100.scaled_dot_general(x, w, (((1,), (0,)), ((), ())), jnp.float32,
                                             ("nvfp4",) * 3)  # fmt: skip
            return jnp.sum(jnp.sin(y))

        grad = jax.jit(jax.grad(loss, (0, 1)))
        want = grad(x, w)
        for x_spec, w_spec in ((PS("data"), PS()), (PS(), PS(None, "model"))):
            with jax.sharding.set_mesh(self.mesh):
                typed = (jax.device_put(x, x_spec), jax.device_put(w, w_spec))
                got = grad(*typed)
            assert_close(got, want, rtol=10 * RTOL)
            for g, t in zip(got, typed, strict=True):
                self.assertEqual(jax.typeof(g).sharding.spec, jax.typeof(t).sharding.spec)

    @parameterized.parameters("fp8_block128", "mxfp8")
    def test_sequence_split_activations(self, recipe):
        # x [batch, seq, d] with the sequence split: folding batch and seq into rows would move
        # data, so seq is gathered first (it raised ShardingTypeError in the fold). With the
        # batch split too the fold moves no data, and the result's rows split back into batch
        # and seq, typed as x (the unfold raised ShardingTypeError).
        x = jnp.asarray(np.random.default_rng(13).standard_normal((2, 256, 512)), jnp.float32)
        w = jnp.asarray(np.random.default_rng(14).standard_normal((512, 256)), jnp.float32)

        def product(x, w):
            return jax_sm100.scaled_dot_general(x, w, (((2,), (0,)), ((), ())), jnp.float32,
                                                (recipe,) * 3)  # fmt: skip

        step = jax.jit(jax.value_and_grad(lambda x, w: jnp.sum(jnp.sin(product(x, w))), (0, 1)))
        want = step(x, w)
        for x_spec, out_spec in ((PS(None, "model"), ()), (PS(None, ("data", "model")), ()),
                                 (PS("data", "model"), ("data", "model"))):  # fmt: skip
            with jax.sharding.set_mesh(self.mesh):
                typed = (jax.device_put(x, x_spec), jax.device_put(w, PS()))
                got = step(*typed)
                out = jax.eval_shape(product, *typed)
            self.assertEqual(same_spec(out.sharding.spec), out_spec)
            assert_close(got, want, rtol=10 * RTOL)
            for g, t in zip(got[1], typed, strict=True):
                self.assertEqual(jax.typeof(g).sharding.spec, jax.typeof(t).sharding.spec)

    @parameterized.parameters(*RECIPES)
    def test_forward_typed(self, *recipes):
        args = quantized(recipes)
        want = jax.jit(product)(*args)
        for lhs_spec, rhs_spec in self.LAYOUTS:
            with jax.sharding.set_mesh(self.mesh):
                lq = jax.device_put(data(0), lhs_spec)
                rq = jax.device_put(data(1), rhs_spec)
                q = jax.jit(lambda a, b: (*jax_sm100.quantize(a, recipes[0]),
                                          *jax_sm100.quantize(b, recipes[1])))  # fmt: skip
                a, sa, b, sb = q(lq, rq)
                got = jax.jit(product)(a, b, sa, sb)
            assert_close(got, want)
            lhs, rhs = (ts.same_spec(s) + (None,) * 3 for s in (lhs_spec, rhs_spec))
            spec = [lhs[0] or rhs[0], lhs[1], rhs[1]]
            if spec[2] is not None and spec[2] in spec[:2]:
                spec[2] = None
            self.assertEqual(same_spec(jax.typeof(got).sharding.spec), same_spec(PS(*spec)))

    @parameterized.parameters(*RECIPES)
    def test_grads_typed_as_their_primals(self, *recipes):
        lq, rq, ls, rs = quantized(recipes)
        args = (lq.astype(jnp.float32), rq.astype(jnp.float32), ls, rs)
        # float32 scales are differentiable too; e8m0 (mxfp8) and e4m3 (nvfp4) ones are held.
        argnums = (0, 1, 2, 3) if recipes[0].startswith("fp8") else (0, 1)
        f = jax.jit(jax.grad(loss, argnums))
        want = f(*args)
        for lhs_spec, rhs_spec in self.LAYOUTS:
            with jax.sharding.set_mesh(self.mesh):
                q = jax.jit(lambda a, b: (jax_sm100.quantize(a, recipes[0])[1],
                                          jax_sm100.quantize(b, recipes[1])[1]))  # fmt: skip
                sa, sb = q(jax.device_put(data(0), lhs_spec), jax.device_put(data(1), rhs_spec))
                typed = (
                    jax.device_put(args[0], lhs_spec),
                    jax.device_put(args[1], rhs_spec),
                    sa,
                    sb,
                )
                got = f(*typed)
            assert_close(got, want, rtol=10 * RTOL)
            for g, i in zip(got, argnums, strict=True):
                self.assertEqual(jax.typeof(g).sharding.spec, jax.typeof(typed[i]).sharding.spec)

    def test_transposes_typed_as_their_primals(self):
        # jax.linear_transpose in each operand (scaled_matmul's transpose rule): equal to the
        # unsharded one, typed as the operand, in every layout.
        # (float32 data of fp8 values: a cotangent rounded to fp8 could round either way when
        # its partial sums are added in another order)
        lq, rq, ls, rs = quantized(("fp8_block128", "fp8_block128"))
        lq, rq = lq.astype(jnp.float32), rq.astype(jnp.float32)

        def transposed(i, *ops):
            ops = list(ops)
            f = functools.partial(lambda i, v: product(*ops[:i], v, *ops[i + 1 :]), i)
            ct = jnp.cos(f(ops[i]).astype(jnp.float32))  # typed as the product
            return jax.linear_transpose(f, ops[i])(ct)[0]

        for i in range(4):
            f = jax.jit(functools.partial(transposed, i))
            want = f(lq, rq, ls, rs)
            for lhs_spec, rhs_spec in self.LAYOUTS:
                with jax.sharding.set_mesh(self.mesh):
                    q = jax.jit(lambda a, b: (jax_sm100.quantize(a, "fp8_block128"),
                                              jax_sm100.quantize(b, "fp8_block128")))  # fmt: skip
                    (la, sa), (lb, sb) = q(jax.device_put(data(0), lhs_spec),
                                           jax.device_put(data(1), rhs_spec))  # fmt: skip
                    typed = (la.astype(jnp.float32), lb.astype(jnp.float32), sa, sb)
                    got = f(*typed)
                assert_close(got, want, rtol=10 * RTOL)
                self.assertEqual(jax.typeof(got).sharding.spec, jax.typeof(typed[i]).sharding.spec)

    @parameterized.parameters(*TRAINING_LAYOUTS)
    def test_scaled_dot_general_training_step_typed(self, x_spec, w_spec):
        step = jax.jit(jax.value_and_grad(training_loss, (0, 1)))
        x, w = data(0)[0], data(1)[0]
        want = step(x, w)
        with jax.sharding.set_mesh(self.mesh):
            typed = (jax.device_put(x, x_spec), jax.device_put(w, w_spec))
            got = step(*typed)
        assert_close(got, want, rtol=10 * RTOL)
        for g, t in zip(got[1], typed, strict=True):
            self.assertEqual(jax.typeof(g).sharding.spec, jax.typeof(t).sharding.spec)

    def test_scaled_dot_general_takes_out_sharding(self):
        # k split on both operands (row parallel): lax asks for an out_sharding, and it is
        # taken (scaled_dot_general's own shape check dropped it and raised lax's error).
        dn = (((1,), (0,)), ((), ()))
        x, w = data(0)[0], data(1)[0]

        def f(x, w, out_sharding=None):
            return jax_sm100.scaled_dot_general(x, w, dn, jnp.float32, jax_sm100.DEEPSEEK_V3,
                                                out_sharding=out_sharding)  # fmt: skip

        want = jax.jit(f)(x, w)
        with jax.sharding.set_mesh(self.mesh):
            xs = jax.device_put(x, PS("data", "model"))
            ws = jax.device_put(w, PS("model", None))
            split = functools.partial(f, out_sharding=PS("data", None))
            got = jax.jit(split)(xs, ws)
            grads = jax.jit(jax.grad(lambda x, w: jnp.sum(split(x, w)), (0, 1)))(xs, ws)
        assert_close(got, want)
        self.assertEqual(same_spec(jax.typeof(got).sharding.spec), same_spec(PS("data")))
        for g, t in zip(grads, (xs, ws), strict=True):
            self.assertEqual(jax.typeof(g).sharding.spec, jax.typeof(t).sharding.spec)

    def test_vmap_over_a_split_batch(self):
        # vmap merges the mapped dim into B: with B split and the mapped dim whole, B goes major
        # in the merge (the other order cannot be typed, and raised).
        x = jnp.asarray(np.random.default_rng(4).standard_normal((4, 2, 256, 256)), jnp.float32)
        a, sa = jax_sm100.quantize(x, "fp8_block128")
        f = jax.jit(jax.vmap(product))
        want = f(a, a, sa, sa)
        with jax.sharding.set_mesh(self.mesh):
            typed = [jax.device_put(v, PS(None, "data")) for v in (a, sa)]
            got = f(typed[0], typed[0], typed[1], typed[1])
        assert_close(got, want)
        self.assertEqual(same_spec(jax.typeof(got).sharding.spec), (None, "data"))
        # rhs unmapped with B split; and lhs's mapped dim split beside it (B gathered).
        g = jax.jit(jax.vmap(product, in_axes=(0, None, 0, None)))
        for lhs_spec, out_spec in ((PS(), (None, "data")), (PS("model"), ("model",))):
            want = g(a, a[0], sa, sa[0])
            with jax.sharding.set_mesh(self.mesh):
                lhs = [jax.device_put(v, lhs_spec) for v in (a, sa)]
                rhs = [jax.device_put(v, PS("data")) for v in (a[0], sa[0])]
                got = g(lhs[0], rhs[0], lhs[1], rhs[1])
            assert_close(got, want)
            self.assertEqual(same_spec(jax.typeof(got).sharding.spec), out_spec)
        # One weight for every example (rhs a B of 1, unmapped: read in place, not copied),
        # the examples split over "data", and their rows over "model" too.
        lhs1, rhs1 = [v[:, :1] for v in (a, sa)], [v[0, :1] for v in (a, sa)]
        want = g(lhs1[0], rhs1[0], lhs1[1], rhs1[1])
        split = (("data",), ("data", None, "model"))
        for out_spec in split:
            lhs_spec = PS(*out_spec)
            with jax.sharding.set_mesh(self.mesh):
                lhs = [jax.device_put(v, lhs_spec) for v in lhs1]
                rhs = [jax.device_put(v, PS()) for v in rhs1]
                got = g(lhs[0], rhs[0], lhs[1], rhs[1])
            assert_close(got, want)
            self.assertEqual(same_spec(jax.typeof(got).sharding.spec), out_spec)

    def test_vmap_with_weights_on_the_left(self):
        # An unmapped lhs (weights on the left) is the transposed product's shared rhs, except
        # where one mesh axis splits both operands' rows: the result's type gives that axis to
        # the product's m, which the transposed product's would take from rhs's rows (the
        # per-index result is typed (None, "model", None) below, and a typed op after it
        # raised). Either way the values are the per-index products.
        rng = np.random.default_rng(6)
        w, sw = jax_sm100.quantize(jnp.asarray(rng.standard_normal((1, 256, 256)), jnp.float32),
                                   "fp8_block128")  # fmt: skip
        x, sx = jax_sm100.quantize(
            jnp.asarray(rng.standard_normal((4, 1, 512, 256)), jnp.float32), "fp8_block128"
        )
        f = jax.jit(jax.vmap(product, in_axes=(None, 0, None, 0)))
        want = f(w, x, sw, sx)
        for w_spec, x_spec, out_spec in (
            (PS(None, "model"), PS(None, None, "model"), (None, None, "model")),
            (PS(None, "model"), PS("data"), ("data", None, "model")),
            (PS(), PS("data", None, "model"), ("data", None, None, "model")),
        ):  # fmt: skip
            with jax.sharding.set_mesh(self.mesh):
                ws = [jax.device_put(v, w_spec) for v in (w, sw)]
                xs = [jax.device_put(v, x_spec) for v in (x, sx)]
                got = f(ws[0], xs[0], ws[1], xs[1])
                y = jax.device_put(jnp.ones(want.shape, want.dtype), PS(*out_spec))
                jax.jit(lambda a, b: a + b)(got, y)  # typed alike
            assert_close(got, want)
            self.assertEqual(same_spec(jax.typeof(got).sharding.spec), out_spec)

    def test_vmap_of_blocked_quantize_over_a_split_dim(self):
        # vmap(quantize) of mxfp8 and nvfp4 over a dim split by Explicit axes: the blocked
        # layout's reshape splits one dim at a time (two at once raised ShardingTypeError once
        # the scales held more than one atom), its data and scales equal to the unsharded ones.
        x = jnp.asarray(np.random.default_rng(5).standard_normal((4, 256, 512)), jnp.float32)
        for recipe in ("mxfp8", "nvfp4"):
            q = jax.jit(jax.vmap(lambda t, r=recipe: jax_sm100.quantize(t, r)[:2]))
            (a, sa), (want_a, want_sa) = q(x), q(x)
            with jax.sharding.set_mesh(self.mesh):
                a, sa = q(jax.device_put(x, PS("data")))
                self.assertEqual(same_spec(jax.typeof(sa).sharding.spec), ("data",))
            np.testing.assert_array_equal(a.astype(jnp.float32), want_a.astype(jnp.float32))
            np.testing.assert_array_equal(sa.astype(jnp.float32), want_sa.astype(jnp.float32))

            # And a vmapped gradient through them (from_blocked's merge, one run at a time).
            def loss(a, sa):
                one = (a[None], a[None], sa[None], sa[None])
                return jnp.sum(jax_sm100.scaled_matmul(*one, preferred_element_type=jnp.float32))

            grad = jax.jit(jax.vmap(jax.grad(loss)))
            want = grad(want_a, want_sa)
            with jax.sharding.set_mesh(self.mesh):
                got = grad(a, sa)
            np.testing.assert_array_equal(got.astype(jnp.float32), want.astype(jnp.float32))

    def test_batch_split_differently_raises(self):
        self.require("model")
        x = jnp.ones((4, 128, 128), jnp.float32)
        (a, sa), (b, sb) = (jax_sm100.quantize(x, "fp8_block128"),) * 2
        with jax.sharding.set_mesh(self.mesh):
            a, b = jax.device_put(a, PS("data")), jax.device_put(b, PS("model"))
            with self.assertRaisesRegex(ValueError, "reshard"):
                jax.jit(product)(a, b, sa, sb)


class OneDeviceMeshTest(parameterized.TestCase):
    @parameterized.parameters(*RECIPES)
    def test_explicit_mesh_of_one_device(self, *recipes):
        # Operands typed over size-1 axes: nothing is partitioned, the types are kept.
        mesh = jax.make_mesh(
            (1, 1), ts.AXES, axis_types=(AxisType.Explicit,) * 2, devices=ts.platform_devices()[:1]
        )
        lq, rq, ls, rs = quantized(recipes)
        args = (lq.astype(jnp.float32), rq.astype(jnp.float32), ls, rs)
        f = jax.jit(jax.grad(loss, (0, 1)))
        want, want_g = jax.jit(product)(*args), f(*args)
        with jax.sharding.set_mesh(mesh):
            specs = (PS("data", "model"), PS(None, None, "model"))
            typed = [jax.device_put(x, s) for x, s in zip(args, (*specs, *specs), strict=True)]
            got, got_g = jax.jit(product)(*typed), f(*typed)
        assert_close(got, want)
        assert_close(got_g, want_g)
        # B as lhs's, m as lhs's; rhs's k is reduced.
        self.assertEqual(same_spec(jax.typeof(got).sharding.spec), ("data", "model"))
        for g, x in zip(got_g, typed[:2], strict=True):
            self.assertEqual(jax.typeof(g).sharding.spec, jax.typeof(x).sharding.spec)


if __name__ == "__main__":
    absltest.main()
