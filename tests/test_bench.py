"""The benchmark's device-method timer on CPU: real, dependent products, one per loop iteration."""

from __future__ import annotations

import contextlib
import io
import math
import os
import tempfile

import jax
import jax.numpy as jnp
import numpy as np
from absl.testing import absltest, parameterized

import jax_sm100
from jax_sm100 import bench
from tests import test_util as tu

PRODUCTS = (
    ("ours", lambda x, y: jax_sm100.matmul(x, y)),
    ("jnp_dot", lambda x, y: jnp.dot(x, y)),
)


def _operands(m, n, k, seed=0):
    rng = np.random.default_rng(seed)
    return tu.rand(rng, (m, k), "float32"), tu.rand(rng, (k, n), "float32")


def _compiled_text(fn, *args) -> str:
    return jax.jit(fn).lower(*args).compile().as_text()


class DeviceTimerTest(parameterized.TestCase):
    @parameterized.named_parameters(*PRODUCTS)
    def test_times_are_positive_and_finite(self, product):
        a, b = _operands(24, 40, 32)
        t = bench.time_device(product, a, b, min_seconds=2e-3, rounds=3)
        self.assertTrue(math.isfinite(t.seconds) and t.seconds > 0, t)
        self.assertGreaterEqual(t.reps, 4)
        self.assertEqual(t.check.problems(), [])

    def test_several_products_are_timed_alike(self):
        a, b = _operands(24, 40, 32)
        timings = bench.time_device([p for _, p in PRODUCTS], a, b, min_seconds=2e-3, rounds=3)
        self.assertLen(timings, len(PRODUCTS))
        for t in timings:
            self.assertTrue(math.isfinite(t.seconds) and t.seconds > 0, t)
            self.assertEqual(t.check.problems(), [])

    @parameterized.named_parameters(*PRODUCTS)
    def test_one_product_per_iteration(self, product):
        a, b = _operands(24, 40, 32)
        text = _compiled_text(bench.loop_fn(product, 5), a, b, jnp.float32(0))
        check = bench.LoopCheck.from_hlo(text, 5)
        self.assertEqual((check.whiles, check.trip_count), (1, 5))
        self.assertEqual((check.body_products, check.other_products), (1, 0))
        self.assertEqual(check.body_copies, 0)
        # The same facts read off the text without the parser: one loop of 5 iterations, one
        # dot in the module, and that dot's computation is called from the loop's body.
        self.assertEqual(text.count(" while("), 1)
        self.assertIn('"known_trip_count":{"n":"5"}', text)
        self.assertEqual(text.count(" dot("), 1)

    def test_check_flags_loops_that_are_not_one_product_per_iteration(self):
        a, b = _operands(32, 32, 32)
        s = jnp.float32(0)
        unrolled = lambda a, b, s: jax.lax.fori_loop(0, 6, lambda i, x: jnp.dot(x, b), a, unroll=2)
        check = bench.LoopCheck.from_hlo(_compiled_text(unrolled, a, b, s), 6)
        self.assertEqual(check.body_products, 2)
        self.assertIn("2 products per iteration, want 1", check.problems())
        self.assertIn("trip count 3, want 6 (partly unrolled)", check.problems())

        peeled = lambda a, b, s: bench.loop_fn(jnp.dot, 4)(a, b, s) + jnp.dot(a, b)
        check = bench.LoopCheck.from_hlo(_compiled_text(peeled, a, b, s), 4)
        self.assertEqual((check.body_products, check.other_products), (1, 1))
        self.assertIn("1 products outside the loop (hoisted or peeled)", check.problems())

        check = bench.LoopCheck.from_hlo(_compiled_text(jnp.dot, a, b), 4)
        self.assertEqual(check.whiles, 0)
        self.assertNotEqual(check.problems(), [])

    @parameterized.named_parameters(*PRODUCTS)
    def test_loop_computes_the_product(self, product):
        a, b = _operands(24, 40, 32, seed=1)
        single = np.asarray(jax.jit(product)(a, b))
        # scale 0, as the benchmark runs it: exactly one product, whatever R.
        out = jax.jit(bench.loop_fn(product, 7))(a, b, jnp.float32(0))
        np.testing.assert_array_equal(np.asarray(out), single)

        # scale 0.25: a[0, 0] moves every iteration, so only row 0 changes, as simulated.
        def simulate(reps):
            a64, b64 = np.asarray(a, np.float64), np.asarray(b, np.float64)
            for _ in range(reps):
                z = a64 @ b64
                a64[0, 0] = np.float32(a64[0, 0] + 0.25 * z[0, 0])
            return z

        out = np.asarray(jax.jit(bench.loop_fn(product, 3))(a, b, jnp.float32(0.25)))
        np.testing.assert_allclose(out[1:], single[1:], rtol=1e-6, atol=1e-6)
        np.testing.assert_allclose(out[0], simulate(3)[0], rtol=1e-4, atol=1e-4)
        for reps in (1, 2, 4):  # 3 iterations ran, not fewer and not more
            self.assertGreater(np.abs(simulate(reps)[0] - out[0]).max(), 1e-2)


class MainTest(absltest.TestCase):
    def test_cli_prints_both_methods(self):
        with tempfile.TemporaryDirectory() as tmp, contextlib.redirect_stdout(io.StringIO()) as f:
            argv = ["--shapes", "16x8x24,4096x8x8", "--dtypes", "float32", "--device-ms", "1",
                    "--no-compile-times", "--plot", os.path.join(tmp, "bench.png")]  # fmt: skip
            with contextlib.redirect_stderr(io.StringIO()):
                self.assertEqual(bench.main(argv), 0)
        text = f.getvalue()
        self.assertIn("| wall: ours", text)
        self.assertIn("| device: ours", text)
        self.assertIn("geomean ratio (wall) over shapes with m >= 4096", text)
        self.assertIn("geomean ratio (device) over shapes with m >= 4096", text)
        self.assertIn("loop overhead per iteration (float32", text)
        self.assertNotIn("check failed", text)


if __name__ == "__main__":
    absltest.main()
