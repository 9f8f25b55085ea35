"""The benchmark's device-method timer on CPU: real, dependent products, U per loop iteration."""

from __future__ import annotations

import collections
import contextlib
import io
import math
import os
import re
import tempfile
import time
from unittest import mock

import jax
import jax.numpy as jnp
import numpy as np
from absl.testing import absltest, parameterized

import jax_sm100
from jax_sm100 import bench, bench_train
from jax_sm100._src import quantize_both
from jax_sm100._src.planning import sm90_scaled as scaled_planning
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
        self.assertGreaterEqual(t.reps, 4 * bench.DEFAULT_UNROLL)  # at least 4 iterations
        self.assertEqual(t.reps % bench.DEFAULT_UNROLL, 0)
        self.assertEqual((t.check.unroll, t.check.min_size), (bench.DEFAULT_UNROLL, 24 * 40))
        self.assertEqual(t.check.problems(), [])

    def test_products_with_a_second_result_write_it(self):
        # A product returning (out, z) (the forward that saves its pre-activation): z is carried
        # through the loop too, so it is written every product, as the kernel's second result.
        a, b = _operands(24, 40, 32)

        def both(a, b):
            y = jnp.dot(a, b)
            return jnp.tanh(y), y

        t = bench.time_device(both, a, b, min_seconds=2e-3, rounds=3)
        self.assertEqual((t.check.min_size, t.check.problems()), (24 * 40, []))
        self.assertEqual((t.check.results, t.check.carried), (2, 2 * bench.DEFAULT_UNROLL))
        text = _compiled_text(bench.loop_fn(both, 8, 4), a, b, jnp.float32(0))
        # The function returns both results of each of the 4 products of the last iteration.
        results = re.search(r"entry_computation_layout=\{\(.*?\)->\((.*?)\)\}", text)
        self.assertEqual(results.group(1).count("f32[24,40]"), 8, results.group(1))

    @parameterized.named_parameters(
        ("one_result", False, 96, 32),
        ("two_results", True, 96, 32),
        # Square: a and b have the output's size too, and must not count as results.
        ("square", False, 64, 64),
    )
    def test_an_xla_epilogue_is_computed_in_full_for_every_product(self, both, n, k):
        # gelu(y + b1) after an XLA dot: were only the iteration's last product's results kept,
        # XLA would compute the epilogue of the others on the one element the next update reads
        # (and drop their second result), so that side would do less work than a fused kernel.
        m, unroll = 64, 4
        a, b = (x.astype(jnp.bfloat16) for x in _operands(m, n, k))
        b1 = jnp.linspace(-1, 1, n, dtype=jnp.bfloat16)

        def product(a, b):
            y = jnp.dot(a, b) + b1
            out = jax.nn.gelu(y, approximate=True)
            return (out, y) if both else out

        text = _compiled_text(bench.loop_fn(product, 8, unroll), a, b, jnp.float32(0))
        results = 2 if both else 1
        check = bench.LoopCheck.from_hlo(text, 8, unroll, m * n, results)
        self.assertEqual((check.carried, check.problems()), (unroll * results, []))
        comps, _ = bench._parse_hlo(text)
        (loop,) = [i for c in comps.values() for i in c if i.opcode == "while"]
        body = bench._reachable(comps, bench._BODY.search(loop.text).group(1))
        full = [i for c in body for i in comps[c] if i.opcode == "fusion"
                and i.shape.startswith(f"bf16[{m},{n}]")]  # fmt: skip
        self.assertGreaterEqual(len(full), unroll * results)

        # A loop that keeps only the last product's result is flagged.
        def last_only(a, b, scale):
            def body(_, carry):
                a, out = carry
                for _ in range(unroll):
                    out = bench._first(product(a, b))
                    a = a.at[0, 0].add((scale * out[0, 0]).astype(a.dtype))
                return a, out

            return jax.lax.fori_loop(0, 2, body, (a, jnp.zeros((m, n), jnp.bfloat16)))[1]

        check = bench.LoopCheck.from_hlo(
            _compiled_text(last_only, a, b, jnp.float32(0)), 8, unroll, m * n, results
        )
        self.assertEqual(check.carried, 1)
        self.assertIn(
            f"1 full-size results returned by the loop, want {unroll * results} "
            "(of results not returned, XLA may compute only part)",
            check.problems(),
        )

    def test_the_timed_call_fills_no_slot(self):
        # time_device donates the slots and feeds each call's result to the next: the compiled
        # call aliases them to its results, and nothing outside the loop writes an [m, n] array
        # (made inside, every call would first write zeros over U outputs).
        m, n, k, unroll = 24, 40, 32, 4
        a, b = _operands(m, n, k)

        def both(a, b):
            y = jnp.dot(a, b)
            return jnp.tanh(y), y

        slots = bench.loop_slots(both, a, b, unroll)
        loop = jax.jit(bench.loop_fn(both, 8, unroll), donate_argnums=3)
        text = loop.lower(a, b, jnp.float32(0), slots).compile().as_text()
        header = text.splitlines()[0]
        self.assertEqual(header.count("-alias)"), 2 * unroll, header)  # every slot aliased
        comps, entry = bench._parse_hlo(text)
        views = ("parameter", "get-tuple-element", "bitcast", "tuple")
        outside = [i.text for i in comps[entry] if i.opcode not in views
                   and re.match(rf"f32\[{m},{n}\]", i.shape)]  # fmt: skip
        self.assertEqual(outside, [])
        # Fed back, the results are still exactly one product each, call after call.
        y = jnp.dot(a, b)
        for _ in range(3):
            slots = loop(a, b, jnp.float32(0), slots)
        for out, z in slots:
            np.testing.assert_array_equal(np.asarray(out), np.asarray(jnp.tanh(y)))
            np.testing.assert_array_equal(np.asarray(z), np.asarray(y))

    def test_time_device_donates_the_slots_it_makes(self):
        # time_device makes each kind of results' slots once, outside the timed calls, and
        # donates them: the first call consumes them (its results become the next call's).
        a, b = _operands(24, 40, 32)
        made = []

        def spy(*args, **kwargs):
            made.append(bench.loop_slots_unspied(*args, **kwargs))
            return made[-1]

        with mock.patch.multiple(bench, loop_slots=spy, loop_slots_unspied=bench.loop_slots,
                                 create=True):  # fmt: skip
            t = bench.time_device(
                [jnp.dot, lambda x, y: jnp.dot(x, y) * 2], a, b, min_seconds=1e-3, rounds=2
            )
        self.assertLen(made, 1)  # the two products' results are alike: one set of slots
        self.assertTrue(all(x.is_deleted() for x in jax.tree.leaves(made[0])))
        self.assertEqual([x.check.problems() for x in t], [[], []])

    def test_several_products_are_timed_alike(self):
        a, b = _operands(24, 40, 32)
        timings = bench.time_device(
            [p for _, p in PRODUCTS], a, b, min_seconds=2e-3, rounds=3, unroll=3
        )
        self.assertLen(timings, len(PRODUCTS))
        for t in timings:
            self.assertTrue(math.isfinite(t.seconds) and t.seconds > 0, t)
            self.assertEqual(t.reps % 3, 0)
            self.assertEqual(t.check.trip_count, t.reps // 3)
            self.assertEqual(t.check.problems(), [])
        # Each timed call's span, one per round: the median span over R is the figure, and the
        # two products' spans never overlap (rounds run them one after the other).
        spans = sorted(iv for t in timings for iv in t.intervals)
        self.assertLen(spans, 3 * len(PRODUCTS))
        for t in timings:
            self.assertLen(t.intervals, 3)
            lengths = sorted(t1 - t0 for t0, t1 in t.intervals)
            self.assertAlmostEqual(lengths[1] / t.reps, t.seconds, delta=1e-12)
        for (_, end), (start, _) in zip(spans[:-1], spans[1:], strict=True):
            self.assertLessEqual(end, start)

    def test_clock_sampler(self):
        # Without an NVIDIA driver (CI, this machine) nothing is sampled, and a reading is None.
        with bench.ClockSampler(period=1e-3) as clocks:
            pass
        if clocks.samples:
            self.skipTest("NVML present: the samples are the GPU's")
        self.assertIsNone(clocks.over([(0.0, float("inf"))]))
        # A reading summarizes the samples inside the intervals: (t, MHz, mW, reasons).
        clocks.samples = [(1.0, 1400, 600_000, 0x4), (2.0, 1600, 700_000, 0x0),
                          (3.0, 1980, 100_000, 0x1), (4.0, 1500, 650_000, 0x20)]  # fmt: skip
        seen = clocks.over([(0.5, 2.5), (3.5, 4.0)])
        self.assertEqual(seen, bench.ClockReading(1500.0, 650.0, 3, 0x24))
        self.assertIsNone(clocks.over([(5.0, 6.0)]))

    def test_clock_sampler_reads_nvml(self):
        # The sampling thread against a stand-in for libnvidia-ml: each call writes through
        # its pointer argument, as NVML does.
        class FakeNvml:
            shut = False

            def nvmlInit_v2(self):
                return 0

            def nvmlDeviceGetHandleByIndex_v2(self, index, handle):
                return 0

            def nvmlDeviceGetClockInfo(self, handle, clock, out):
                out._obj.value = 1410 if clock == bench.ClockSampler._SM_CLOCK else 0

            def nvmlDeviceGetPowerUsage(self, handle, out):
                out._obj.value = 699_000

            def nvmlDeviceGetCurrentClocksEventReasons(self, handle, out):
                out._obj.value = 0x4

            def nvmlShutdown(self):
                FakeNvml.shut = True

        with mock.patch("ctypes.CDLL", return_value=FakeNvml()):
            with bench.ClockSampler(period=1e-3) as clocks:
                t0 = time.perf_counter()
                time.sleep(0.05)
                t1 = time.perf_counter()
        self.assertTrue(FakeNvml.shut)
        seen = clocks.over([(t0, t1)])
        self.assertGreater(seen.samples, 5)
        self.assertEqual((seen.sm_mhz, seen.watts, seen.reasons), (1410.0, 699.0, 0x4))

    def test_training_steps_are_timed_in_alternating_rounds(self):
        # bench --train's two sides: rounds interleaved, each side first as often, and every
        # timed round after an untimed step of the same side (timed one side after the other,
        # the second inherited the first's clocks).
        calls = []

        def side(i):
            def step(x):
                calls.append(i)
                return x

            return step

        x = jnp.ones(())
        times = bench_train.time_steps_alike([(side(0), (x,)), (side(1), (x,))], steps=2, rounds=4)
        self.assertLen(times, 2)
        timed = calls[6:]  # after 3 warm-up steps each
        self.assertEqual(calls[:6], [0, 0, 0, 1, 1, 1])
        self.assertLen(timed, 4 * 2 * 3)
        rounds = [timed[j : j + 3] for j in range(0, len(timed), 3)]
        self.assertTrue(all(len(set(r)) == 1 for r in rounds))  # settle step + 2 timed, one side
        firsts = [rounds[j][0] for j in range(0, len(rounds), 2)]
        self.assertEqual(sorted(firsts), [0, 0, 1, 1])

    def test_round_orders_balance_place_and_predecessor(self):
        # Each product takes each place, and follows each other product, equally often over
        # the design (a Williams design: n orders, 2n for odd n).
        self.assertEqual(bench.round_orders(1), [[0]])
        for n in range(2, 9):
            orders = bench.round_orders(n)
            self.assertLen(orders, n if n % 2 == 0 else 2 * n)
            for order in orders:
                self.assertCountEqual(order, range(n))
            places = collections.Counter((i, p) for o in orders for i, p in enumerate(o))
            follows = collections.Counter((o[i - 1], o[i]) for o in orders for i in range(1, n))
            self.assertLen(places, n * n)
            self.assertLen(set(places.values()), 1)
            self.assertLen(follows, n * (n - 1))
            self.assertLen(set(follows.values()), 1)

    def test_no_rounds_is_refused(self):
        a, b = _operands(8, 8, 8)
        with self.assertRaisesRegex(ValueError, "rounds=0"):
            bench.time_device(jnp.dot, a, b, rounds=0)

    def test_reps_are_multiples_of_unroll_within_bounds(self):
        a, b = _operands(8, 8, 8)
        # One call cannot reach 10 s: R stops at max_reps, rounded down to a multiple of 6.
        t = bench.time_device(jnp.dot, a, b, min_seconds=10.0, rounds=1, max_reps=40, unroll=6)
        self.assertEqual(t.reps, 36)
        self.assertEqual((t.check.trip_count, t.check.body_products), (6, 6))
        t = bench.time_device(jnp.dot, a, b, min_seconds=0.0, rounds=1, start_trips=3, unroll=5)
        self.assertEqual(t.reps, 15)
        self.assertEqual(t.check.problems(), [])

    @parameterized.named_parameters(
        (f"{name}_unroll{unroll}", product, unroll)
        for name, product in PRODUCTS
        for unroll in (1, 4)
    )
    def test_unroll_products_per_iteration(self, product, unroll):
        a, b = _operands(24, 40, 32)
        reps = 5 * unroll
        text = _compiled_text(bench.loop_fn(product, reps, unroll), a, b, jnp.float32(0))
        check = bench.LoopCheck.from_hlo(text, reps, unroll, 24 * 40)
        self.assertEqual((check.whiles, check.trip_count), (1, 5))
        self.assertEqual((check.body_products, check.small_products), (unroll, 0))
        self.assertEqual((check.other_products, check.body_copies), (0, 0))
        self.assertEqual(check.problems(), [])
        # The same facts read off the text without the parser: one loop of 5 iterations and
        # `unroll` full-size dots in the module (all of them in the loop, as the parser says).
        self.assertEqual(text.count(" while("), 1)
        self.assertIn('"known_trip_count":{"n":"5"}', text)
        self.assertEqual(text.count(" dot("), unroll)
        self.assertEqual(text.count(" f32[24,40]{1,0} dot("), unroll)

    def test_copies_of_stream_k_flags_are_not_operand_copies(self):
        # A stream-K product's flags (int32, zeroed per call) reach the kernel through a copy
        # XLA inserts for the aliased buffer; an operand copy (any float array) still counts.
        text = """HloModule m

%body (p: (f32[8,8], s32[132])) -> (f32[8,8], s32[132]) {
  %p = (f32[8,8]{1,0}, s32[132]{0}) parameter(0)
  %a = f32[8,8]{1,0} get-tuple-element(%p), index=0
  %c1 = f32[8,8]{1,0} copy(%a)
  %f = s32[132]{0} get-tuple-element(%p), index=1
  %c2 = s32[132]{0} copy(%f)
  ROOT %t = (f32[8,8]{1,0}, s32[132]{0}) tuple(%c1, %c2)
}

%cond (p: (f32[8,8], s32[132])) -> pred[] {
  %p = (f32[8,8]{1,0}, s32[132]{0}) parameter(0)
  ROOT %r = pred[] constant(true)
}

ENTRY %main (x: f32[8,8], y: s32[132]) -> (f32[8,8], s32[132]) {
  %x = f32[8,8]{1,0} parameter(0)
  %y = s32[132]{0} parameter(1)
  %t0 = (f32[8,8]{1,0}, s32[132]{0}) tuple(%x, %y)
  ROOT %w = (f32[8,8]{1,0}, s32[132]{0}) while(%t0), condition=%cond, body=%body
}
"""
        check = bench.LoopCheck.from_hlo(text, 1, 1)
        self.assertEqual((check.whiles, check.body_copies), (1, 1))
        self.assertIn("1 operand copies per iteration", check.loop_problems())

    def test_loop_fn_rejects_reps_not_a_multiple_of_unroll(self):
        with self.assertRaisesRegex(ValueError, "reps=10, unroll=4"):
            bench.loop_fn(jnp.dot, 10, 4)
        with self.assertRaisesRegex(ValueError, "reps=4, unroll=0"):
            bench.loop_fn(jnp.dot, 4, 0)

    def test_check_flags_loops_that_are_not_unroll_products_per_iteration(self):
        a, b = _operands(32, 32, 32)
        s = jnp.float32(0)
        # Asked for 2 products per iteration, got 4 (as if XLA had unrolled the loop further).
        check = bench.LoopCheck.from_hlo(
            _compiled_text(bench.loop_fn(jnp.dot, 8, 4), a, b, s), 8, 2, 32 * 32
        )
        self.assertEqual(check.body_products, 4)
        self.assertIn("4 products per iteration, want 2", check.problems())
        self.assertIn("trip count 2, want 4 (unrolled or split further)", check.problems())

        peeled = lambda a, b, s: bench.loop_fn(jnp.dot, 4, 2)(a, b, s)[-1] + jnp.dot(a, b)
        check = bench.LoopCheck.from_hlo(_compiled_text(peeled, a, b, s), 4, 2, 32 * 32)
        self.assertEqual((check.body_products, check.other_products), (2, 1))
        self.assertIn("1 products outside the loop (hoisted or peeled)", check.problems())

        # Products narrowed to one row: the right count, but not the full [m, n] output.
        narrow = bench.loop_fn(lambda x, y: jnp.dot(x[:1], y), 6, 3)
        check = bench.LoopCheck.from_hlo(_compiled_text(narrow, a, b, s), 6, 3, 32 * 32)
        self.assertEqual((check.body_products, check.small_products), (3, 3))
        self.assertEqual(
            check.problems(),
            [
                "3 products per iteration with fewer than 1024 output elements (narrowed)",
                # its results are [1, 32]
                "0 full-size results returned by the loop, want 3 (of results not returned, "
                "XLA may compute only part)",
            ],
        )

        check = bench.LoopCheck.from_hlo(_compiled_text(jnp.dot, a, b), 4, 2)
        self.assertEqual(check.whiles, 0)
        self.assertIn("0 while loops, want 1 (removed, unrolled or split)", check.problems())

    def test_check_flags_a_loop_without_a_known_trip_count(self):
        a, b = _operands(16, 16, 16)

        def dynamic(a, b, n):  # a runtime trip count: XLA cannot annotate it
            return jax.lax.fori_loop(0, n, lambda i, x: jnp.dot(x, b), a)

        text = _compiled_text(dynamic, a, b, jnp.int32(3))
        check = bench.LoopCheck.from_hlo(text, 3, 1, 16 * 16)
        self.assertIsNone(check.trip_count)
        self.assertIn("no known trip count (XLA did not annotate the loop)", check.problems())

    @parameterized.parameters("float32", "bfloat16")
    def test_loop_overhead_is_the_same_loop_without_products(self, dtype):
        a, b = (x.astype(dtype) for x in _operands(24, 40, 32))
        t = bench._loop_overhead(a, b, 1e-3, unroll=4)
        self.assertTrue(math.isfinite(t.seconds) and t.seconds > 0, t)
        self.assertEqual((t.check.unroll, t.check.trip_count), (4, t.reps // 4))
        self.assertEqual((t.check.body_products, t.check.other_products), (0, 0))
        self.assertEqual(t.check.loop_problems(), [])

    def test_a_loop_of_one_trip_is_removed_and_flagged(self):
        a, b = _operands(16, 16, 16)
        t = bench.time_device(jnp.dot, a, b, min_seconds=0.0, rounds=1, start_trips=1, unroll=2)
        self.assertEqual((t.reps, t.check.whiles, t.check.other_products), (2, 0, 2))
        self.assertIn("0 while loops, want 1 (removed, unrolled or split)", t.check.problems())

    @parameterized.named_parameters(*PRODUCTS)
    def test_loop_computes_the_product(self, product):
        a, b = _operands(24, 40, 32, seed=1)
        single = np.asarray(jax.jit(product)(a, b))
        # scale 0, as the benchmark runs it: exactly one product, whatever R and U.
        for reps, unroll in ((7, 1), (12, 4), (16, 16)):
            outs = jax.jit(bench.loop_fn(product, reps, unroll))(a, b, jnp.float32(0))
            self.assertLen(outs, unroll)  # the last iteration's products, each in full
            for out in outs:
                np.testing.assert_array_equal(np.asarray(out), single)

        # scale 0.25: a[0, 0] moves after every product, so only row 0 changes, as simulated.
        def simulate(reps):
            a64, b64 = np.asarray(a, np.float64), np.asarray(b, np.float64)
            for _ in range(reps):
                z = a64 @ b64
                a64[0, 0] = np.float32(a64[0, 0] + 0.25 * z[0, 0])
            return z

        for reps, unroll in ((3, 1), (6, 3)):
            loop = jax.jit(bench.loop_fn(product, reps, unroll))
            out = np.asarray(loop(a, b, jnp.float32(0.25))[-1])
            np.testing.assert_allclose(out[1:], single[1:], rtol=1e-6, atol=1e-6)
            np.testing.assert_allclose(out[0], simulate(reps)[0], rtol=1e-4, atol=1e-4)
            # `reps` dependent products ran: not fewer (one per iteration, say), not more.
            for other in {1, 2, reps - 1, reps // unroll, reps + 1} - {reps}:
                self.assertGreater(np.abs(simulate(other)[0] - out[0]).max(), 1e-2, other)


class MainTest(absltest.TestCase):
    def test_cli_prints_both_methods(self):
        with tempfile.TemporaryDirectory() as tmp, contextlib.redirect_stdout(io.StringIO()) as f:
            argv = ["--shapes", "16x8x24,4096x8x8", "--dtypes", "float32", "--device-ms", "1",
                    "--unroll", "4", "--no-compile-times",
                    "--plot", os.path.join(tmp, "bench.png")]  # fmt: skip
            with contextlib.redirect_stderr(io.StringIO()):
                self.assertEqual(bench.main(argv), 0)
        text = f.getvalue()
        self.assertIn("methods wall+device, device-method unroll 4", text)
        self.assertIn("| wall: ours", text)
        self.assertIn("| device: ours", text)
        self.assertIn("geomean ratio (wall) over shapes with m >= 4096", text)
        self.assertIn("geomean ratio (device) over shapes with m >= 4096", text)
        self.assertIn("loop overhead per product (float32, no product, unroll 4)", text)
        self.assertNotIn("not measured as timed", text)
        self.assertNotIn("check failed", text)


class RaggedBenchTest(absltest.TestCase):
    def test_small_problems_print_a_row_each(self):
        # `python -m jax_sm100.bench --ragged --small`: the table, one row and a path per
        # problem and kind of group sizes (equal, skewed).
        out = io.StringIO()
        with contextlib.redirect_stdout(out):
            self.assertEqual(bench.main(["--ragged", "--small", "--bias"]), 0)
        text = out.getvalue()
        self.assertEqual(text.count("path:"), 4, text)
        self.assertEqual(text.count(" equal |"), 2, text)
        self.assertEqual(text.count(" skewed|"), 2, text)
        self.assertIn("/dense", text)
        # Our three products timed alone, beside their bytes at copy speed.
        self.assertEqual(text.count("products alone: forward"), 4, text)
        self.assertIn("the bytes at copy speed", text)
        self.assertEqual(text.count("with a per-group bias and gelu: forward"), 4, text)

    def _rows_with_a_noted_step(self, step: str, note: str, **run_kwargs):
        """`bench_ragged.run` of the first small problem with its jitted `step` recording
        `note` when it is lowered, as a GPU lowering would."""
        from jax_sm100 import bench_ragged  # noqa: PLC0415
        from jax_sm100._src import dispatch  # noqa: PLC0415

        plain = getattr(bench_ragged, step)

        def noted(*args):
            dispatch.record(dispatch.Lowered(None, note))
            return plain(*args)

        with mock.patch.object(bench_ragged, step, jax.jit(noted)):
            return bench_ragged.run(bench_ragged.SMALL[:1], **run_kwargs)

    def test_path_is_the_plain_products(self):
        # The row's path names what the plain product and its gradients ran on, not the bias
        # side's plan (whose lowering is recorded here as a GPU's would be).
        rows = self._rows_with_a_noted_step(
            "_BIASED", "the bias plan; bias in the epilogue", kinds=("equal",), bias=True
        )
        self.assertEqual(rows[0][-1], "XLA (no CUDA lowering)")

    def test_every_row_names_its_path(self):
        # The skewed row of a problem names the path too, not only what JAX's caches left to
        # lower after the equal row of the same shapes (the forward's went missing on the H200).
        rows = self._rows_with_a_noted_step("_D_LHS", "the d lhs plan", kinds=("equal", "skewed"))
        self.assertEqual([row[-1] for row in rows], ["the d lhs plan"] * 2)


class QuantizeBenchTest(absltest.TestCase):
    def test_small_shapes_print_a_row_each(self):
        # `python -m jax_sm100.bench --quantize --small`: a row per shape and recipe, both
        # sides' data against the exact quotient and ours' scales against XLA's (all equal on
        # CPU, where both sides are XLA's ops), and ours' path.
        out = io.StringIO()
        with contextlib.redirect_stdout(out):
            self.assertEqual(bench.main(["--quantize", "--small"]), 0)
        text = out.getvalue()
        self.assertEqual(text.count("    ours: "), 4, text)
        for shape in ("256x384", "512x256"):
            for recipe in ("fp8_block128", "fp8_block128x128"):
                self.assertRegex(text, rf"\n{shape} +\| {recipe} +\|( +[\d.]+ \|){{4}} +0 / 0 "
                                       r"+\| 0\n")  # fmt: skip
        with self.assertRaises(SystemExit):
            bench.main(["--quantize", "--small", "--recipes", "mxfp8"])

    def test_mismatches_counts_a_wrong_byte_and_scale(self):
        # The check the table reports can fail: one data byte and one scale changed are found.
        from jax_sm100 import bench_quantize  # noqa: PLC0415

        x = jax.random.normal(jax.random.key(0), (256, 256), jnp.bfloat16)
        (q, s), (qt, st) = quantize_both._reference(x, data_dtype=jnp.float8_e4m3fn)
        x32 = np.asarray(x.astype(jnp.float32))
        want = (np.asarray(s), np.asarray(st))
        self.assertEqual(bench_quantize._mismatches(((q, s), (qt, st)), x32, want), (0, 0))
        q = np.asarray(q).copy()
        q.view(np.uint8)[3, 5] ^= 1
        self.assertEqual(bench_quantize._mismatches(((q, s), (qt, st)), x32, want), (1, 0))
        s = np.asarray(s).copy()
        s[7, 1] *= 2  # its block's data then differs from that scale's quotients too
        data, scales = bench_quantize._mismatches(((q, s), (qt, st)), x32, want)
        self.assertEqual(scales, 1)
        self.assertGreater(data, 100)
        # Per 128 x 128 tile: a changed tile scale changes its whole tile's quotients.
        (q, s), (qt, st) = quantize_both._reference(x, data_dtype=jnp.float8_e4m3fn,
                                                    recipe="fp8_block128x128")  # fmt: skip
        want = (np.asarray(s), np.asarray(st))
        self.assertEqual(bench_quantize._mismatches(((q, s), (qt, st)), x32, want), (0, 0))
        st = np.asarray(st).copy()
        st[1, 0] *= 2
        data, scales = bench_quantize._mismatches(((q, s), (qt, st)), x32, want)
        self.assertEqual(scales, 1)
        self.assertGreater(data, 128 * 128 // 2)


def _step_profile():
    """benchmarks/step_profile.py as a module (benchmarks/ is not a package)."""
    import importlib.util  # noqa: PLC0415

    path = os.path.join(os.path.dirname(__file__), "..", "benchmarks", "step_profile.py")
    spec = importlib.util.spec_from_file_location("step_profile", path)
    sp = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(sp)
    return sp


class StepProfileTest(absltest.TestCase):
    def test_gaps_by_position(self):
        # benchmarks/step_profile.py's gap table: each position's gap averaged over the steps,
        # the largest first, with the kernels on either side (the last into the next step).
        sp = _step_profile()
        events, t = [], 0
        for step in range(sp.STEPS):
            for name, length, gap in (("gemm", 100_000, 4_000), ("fusion", 2_000, 30_000 + step),
                                      ("quantize", 50_000, 1_000)):  # fmt: skip
                events.append((t, length, name))
                t += length + gap
        out = io.StringIO()
        with contextlib.redirect_stdout(out):
            sp._gaps(events, 2)
        lines = out.getvalue().splitlines()
        self.assertLen(lines, 2)
        self.assertIn("30.0 us after kernel   1 fusion -> quantize", lines[0])  # 30 us + 9.5 ns
        self.assertIn("4.0 us after kernel   0 gemm -> fusion", lines[1])

    def test_report_with_gaps_and_host_events(self):
        # `--gaps N --host M` together: the stream's idle total and its N largest gaps, then
        # the host's M busiest events a step (total, count and longest of each name).
        sp = _step_profile()
        events, t = [], 0
        for _ in range(sp.STEPS):
            for name, length, gap in (("gemm", 100_000, 4_000), ("fusion", 2_000, 30_000)):
                events.append((t, length, name))
                t += length + gap
        host = {"cuLaunchKernelEx": [sp.STEPS * 3_000, sp.STEPS, 5_000],
                "cuStreamSynchronize": [sp.STEPS * 9_000, sp.STEPS, 12_000],
                "stop_trace": [10**9, 1, 10**9]}  # once, after the steps: not listed  # fmt: skip
        out = io.StringIO()
        with contextlib.redirect_stdout(out):
            sp._report("ours", 1e-3, 1e-4, {"Stream #1": events}, host, top=1, gaps=1, host_top=1)
        text = out.getvalue()
        self.assertIn("dispatched in 0.100 ms a step", text)
        self.assertRegex(text, r"host +9\.0 us +x1 +longest +12\.0 us cuStreamSynchronize")
        self.assertNotIn("cuLaunchKernelEx", text)
        self.assertNotIn("stop_trace", text)
        self.assertIn("idle between them 32.5 us", text)  # (20 x 4 + 19 x 30) us / 20 steps
        self.assertIn("30.0 us after kernel   1 fusion -> gemm", text)
        self.assertNotIn("kernel   0", text)
        out = io.StringIO()
        with contextlib.redirect_stdout(out):
            sp._report("ours", 1e-3, 1e-4, {"Stream #1": events}, {}, top=0, sequence=True)
        self.assertIn("kernel   0     100.0 us  gemm\n    kernel   1       2.0 us  fusion",
                      out.getvalue())  # fmt: skip


class ScaledBenchTest(absltest.TestCase):
    def test_small_problems_print_a_row_each(self):
        # `python -m jax_sm100.bench --scaled --small`: one row, ours' path and the ratios per
        # problem (jax.nn.scaled_matmul has no CPU lowering: left out on CPU).
        out = io.StringIO()
        with contextlib.redirect_stdout(out):
            self.assertEqual(bench.main(["--scaled", "--small"]), 0)
        text = out.getvalue()
        self.assertEqual(text.count("    ours: "), 2, text)
        self.assertIn("/cublas fp8", text)
        self.assertIn("256x256x512", text)
        self.assertNotIn("! ", text)

    def test_overlap_both_prints_two_rows_each(self):
        # `--overlap both`: ours lowered with JAX_SM100_SCALED_OVERLAP=0 and =1, timed in the
        # same rounds, a row each; the variable is restored afterwards.
        env = scaled_planning.OVERLAP_ENV
        out = io.StringIO()
        with mock.patch.dict(os.environ, {env: "0"}), contextlib.redirect_stdout(out):
            self.assertEqual(bench.main(["--scaled", "--small", "--overlap", "both"]), 0)
            self.assertEqual(os.environ[env], "0")
        text = out.getvalue()
        self.assertEqual(text.count("    ours: "), 4, text)
        self.assertRegex(text, r"\n256x256x512 +\|")
        self.assertRegex(text, r"\n256x256x512 overlap +\|")
        self.assertEqual(text.count(" overlap "), 2, text)
        self.assertNotIn("! ", text)

    def test_contexts_are_entered_while_each_product_compiles(self):
        entered = []

        @contextlib.contextmanager
        def note(name):
            entered.append(name)
            yield

        a = jnp.ones((8, 8), jnp.float32)
        product = lambda x, y: x @ y  # noqa: E731
        bench.time_device([product, product], a, a, min_seconds=0.0, rounds=1, unroll=2,
                          contexts=[lambda: note("first"), None])  # fmt: skip
        self.assertEqual(entered, ["first"])
        with self.assertRaisesRegex(ValueError, "1 contexts for 2 products"):
            bench.time_device([product, product], a, a, contexts=[None])


class CommandLineTest(parameterized.TestCase):
    """Mistyped arguments of `python -m jax_sm100.bench` are usage errors naming the flag, before
    anything runs (they were tracebacks, or silently ignored)."""

    @parameterized.parameters(
        ("bench", ["--shapes", "128x128"], "is not MxNxK"),
        ("bench", ["--dtypes", "bogus"], "is not a dtype"),
        ("bench_ragged", ["--shapes", "4:256x64"], "is not G:MxKxN"),
        ("bench_ragged", ["--dtype", "bogus"], "is not a dtype"),
        ("bench_scaled", ["--unroll", "0"], "--unroll must be >= 1"),
        ("bench_scaled", ["--shapes", "64x64"], "is not MxNxK"),
        ("bench_quantize", ["--shapes", "100"], "is not RxC"),
        ("bench_train", ["--models", "bogus"], "not in mlp, transformer"),
    )
    def test_bad_arguments_are_usage_errors(self, module, argv, message):
        import importlib  # noqa: PLC0415

        main = importlib.import_module(f"jax_sm100.{module}").main
        err = io.StringIO()
        with contextlib.redirect_stderr(err), self.assertRaises(SystemExit) as cm:
            main(argv)
        self.assertEqual(cm.exception.code, 2)
        self.assertIn(message, err.getvalue())


if __name__ == "__main__":
    absltest.main()
