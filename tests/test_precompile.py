"""Tests of precompile: planning per shape, deduplication, progress, errors (compile mocked)."""

from __future__ import annotations

import io
import math
import sys
import types
from unittest import mock

import jax
import jax.numpy as jnp
import numpy as np
from absl.testing import absltest, parameterized

from jax_sm100._src import dispatch, gpu_lowering, planning
from jax_sm100._src.compile import binary_key as compile_binary_key
from jax_sm100._src.precompile import precompile

_COMPILE = "jax_sm100._src.compile"


def _restore_module(name, module):
    if module is None:
        sys.modules.pop(name, None)
    else:
        sys.modules[name] = module


class _Compiling(Exception):
    """Raised by the stand-in compile_plan once the CUDA lowering has chosen its binary."""


def _binary_the_lowering_compiles(m, n, k, *, arch, num_sms, bias_dtype=None):
    """(plan, spec) the CUDA lowering passes to compile_plan for a bf16 [m, k] @ [k, n] call
    (with a [n] bias of `bias_dtype`, where given)."""
    calls = []

    def record(plan, spec):
        calls.append((plan, spec))
        raise _Compiling

    def call(a, b, bias=None):
        return gpu_lowering.cuda_matmul_impl(
            a, b, bias, None, transpose_a=False, transpose_b=False, alpha=1.0, beta=1.0,
            activation=None, out_dtype=jnp.bfloat16,
        )  # fmt: skip

    operands = (jax.ShapeDtypeStruct((m, k), jnp.bfloat16),
                jax.ShapeDtypeStruct((k, n), jnp.bfloat16))  # fmt: skip
    if bias_dtype is not None:
        operands += (jax.ShapeDtypeStruct((n,), jnp.dtype(bias_dtype)),)
    stand_in = types.SimpleNamespace(compile_plan=record)
    with (
        mock.patch.object(dispatch, "device_target", lambda: dispatch.Target(arch, num_sms, True)),
        mock.patch.object(gpu_lowering.ffi, "register", lambda: None),
        mock.patch.object(gpu_lowering, "compile_mod", stand_in),
    ):
        try:
            jax.eval_shape(call, *operands)
        except _Compiling:
            pass
    if not calls:
        return None  # the lowering ran XLA's dot
    (binary,) = calls
    return binary


class PrecompileTest(parameterized.TestCase):
    def setUp(self):
        super().setUp()
        # A stand-in for compile.py: precompile must not need the DSL compiler to be tested.
        self.compile_plan = mock.Mock(side_effect=lambda plan, spec: ("compiled", plan, spec))
        fake = types.ModuleType(_COMPILE)
        fake.compile_plan = self.compile_plan
        fake.binary_key = compile_binary_key
        # Not mock.patch.dict(sys.modules): restoring the whole dict would drop the DSL modules
        # imported during the test, and the DSL's native library cannot be imported twice.
        saved = sys.modules.get(_COMPILE)
        sys.modules[_COMPILE] = fake
        self.addCleanup(_restore_module, _COMPILE, saved)

    @parameterized.parameters("sm_100a", "sm_90a")
    def test_compiles_each_kernel_once_in_order(self, arch):
        # Every shape is at or above planning.SM90_MIN_FLOPS, so sm_90a plans kernels for all.
        # A shape whose plan differs from an earlier one's in its sizes only is the same binary
        # (on sm_90a the last plans the first's tiles: it was compiled, and counted, again).
        shapes = [(4096, 4096, 4096), (2, 1024, 2048, 1024), (4096, 4096, 4096), (2048, 2048, 1024)]
        results = precompile(shapes, arch=arch, progress=False)

        self.assertEqual([r.shape for r in results], shapes)
        first = {}
        for r in results:
            binary = compile_binary_key(r.plan, r.spec)
            if binary in first:
                self.assertEqual(r.note, f"same kernel as {first[binary]}")
                self.assertIsNone(r.compiled)
            else:
                first[binary] = r.shape
                self.assertIsNotNone(r.compiled)
        self.assertEqual(results[2].note, "same kernel as (4096, 4096, 4096)")
        if arch == "sm_90a":
            self.assertNotEqual(results[3].plan, results[0].plan)
            self.assertEqual(results[3].note, "same kernel as (4096, 4096, 4096)")
        compiled = [r for r in results if r.compiled is not None]
        self.assertLen(compiled, len(first))
        self.assertEqual(
            self.compile_plan.call_args_list,
            [mock.call(r.plan, r.spec) for r in compiled],
        )
        for r in results:
            self.assertEqual(r.plan.arch, arch)
        expected = planning.plan(1024, 2048, 1024, a_dtype="bfloat16", b_dtype="bfloat16",
                                 batch=2, arch=arch)  # fmt: skip
        self.assertEqual(results[1].plan, expected)

    def test_spec_carries_dtypes_layouts_and_epilogue(self):
        (result,) = precompile(
            [(2048, 2048, 1024)], dtypes=("float16", "float16", "float32"), arch="sm_90a",
            a_major="m", b_major="k", c_dtype="float32", bias_dtype="float32",
            activation="relu", alpha=2, beta=0.5, progress=False,
        )  # fmt: skip
        spec = result.spec
        self.assertEqual(
            (spec.a_dtype, spec.b_dtype, spec.out_dtype, spec.c_dtype, spec.bias_dtype),
            ("float16", "float16", "float32", "float32", "float32"),
        )
        self.assertEqual((spec.a_major, spec.b_major), ("m", "k"))
        self.assertEqual((result.plan.a_major, result.plan.b_major), ("m", "k"))
        self.assertEqual((spec.activation, spec.alpha, spec.beta), ("relu", 2.0, 0.5))
        self.compile_plan.assert_called_once_with(result.plan, spec)

    def test_same_shape_with_other_num_sms_is_a_new_plan(self):
        results = precompile([(4096, 4096, 4096)], arch="sm_90a", num_sms=114, progress=False)
        self.assertEqual(results[0].plan.num_sms, 114)
        self.compile_plan.assert_called_once()

    @parameterized.parameters("float8_e4m3fn", "float8_e5m2", "bfloat16", "float32")
    def test_bias_dtype_is_the_one_the_lowering_compiles(self, bias_dtype):
        # The lowering hands the kernel an fp8 bias as float32: precompile warms that binary.
        lowered = _binary_the_lowering_compiles(4096, 4096, 4096, arch="sm_90a", num_sms=132,
                                                bias_dtype=bias_dtype)  # fmt: skip
        (result,) = precompile([(4096, 4096, 4096)], arch="sm_90a", num_sms=132,
                               bias_dtype=bias_dtype, progress=False)  # fmt: skip
        self.assertEqual((result.plan, result.spec), lowered)
        self.assertEqual(result.spec.bias_dtype, "bfloat16" if bias_dtype == "bfloat16"
                         else "float32")  # fmt: skip

    def test_fp8_in_the_lowerings_form(self):
        # sm_90a's fp8 with an N-major B (the default layout) and fp8 results: the lowering
        # runs the kernel on a K-major B and a float32 result (`dispatch.kernel_form`), and
        # precompile warms that binary (it planned XLA's dot and compiled nothing).
        e4 = "float8_e4m3fn"
        for dtypes, b_major, out in (((e4, e4), "n", "bfloat16"), ((e4, e4, e4), "k", "float32")):
            (result,) = precompile([(4096, 4096, 4096)], dtypes=dtypes, arch="sm_90a",
                                   b_major=b_major, progress=False)  # fmt: skip
            self.assertEqual((result.plan.kernel, result.plan.b_major), ("sm90_wgmma", "k"))
            self.assertEqual(result.plan.out_dtype, out)
            self.assertIsNotNone(result.compiled)

    def test_plans_for_the_targets_sm_count(self):
        # The planner plans for the device's SM count (not a default count swapped in after):
        # 64x4096x4096 fills 132 SMs with 4 splits of its 32 tiles, 114 SMs with 2.
        shape = (64, 4096, 4096)
        for num_sms, split in ((132, 4), (114, 2)):
            lowered = _binary_the_lowering_compiles(*shape, arch="sm_90a", num_sms=num_sms)
            (result,) = precompile([shape], arch="sm_90a", num_sms=num_sms, progress=False)
            self.assertEqual(lowered[0], result.plan)
            self.assertEqual((result.plan.num_sms, result.plan.split_k), (num_sms, split))

    @parameterized.named_parameters(
        # The planner splits K by 4 for these skinny shapes; whether the call can depends on k.
        ("split_kept", 4096, 4, planning.KERNEL_SM90_SPLITK),
        # 4112 / 4 = 1028 bf16 is not a whole number of 16-byte units; 4112 / 2 = 2056 is.
        ("split_reduced", 4112, 2, planning.KERNEL_SM90_SPLITK),
        # 4104 / 2 = 2052 is not 16-byte aligned either: unsplit, 64x4096x4104 is under the
        # planner's SM90_MIN_FLOPS, so XLA's dot runs and nothing is compiled.
        ("split_dropped_small", 4104, 1, planning.KERNEL_XLA),
        # 128x4096x16392: 16392 / 2 = 8196 bf16 is not 16-byte aligned; unsplit, the problem is
        # big enough for the wgmma kernel.
        ("split_dropped", 16392, 1, planning.KERNEL_SM90, 128),
    )
    def test_split_k_plan_is_the_one_the_lowering_compiles(self, k, split, kernel, m=64):
        n, num_sms = 4096, 132
        planned = planning.plan(m, n, k, a_dtype="bfloat16", b_dtype="bfloat16", arch="sm_90a")
        self.assertEqual(planned.kernel, planning.KERNEL_SM90_SPLITK)

        lowered = _binary_the_lowering_compiles(m, n, k, arch="sm_90a", num_sms=num_sms)
        (result,) = precompile([(m, n, k)], arch="sm_90a", num_sms=num_sms, progress=False)

        self.assertEqual((result.plan.kernel, result.plan.split_k), (kernel, split))
        if kernel == planning.KERNEL_XLA:
            self.assertIsNone(lowered)
            self.compile_plan.assert_not_called()
            self.assertIn("force_kernel", result.note)
            return
        self.assertEqual((result.plan, result.spec), lowered)
        self.compile_plan.assert_called_once_with(*lowered)
        self.assertEqual(result.note.startswith("compiled; split-K not applicable"), split == 1)

    def test_the_drivers_grid_is_the_one_the_lowering_compiles(self):
        # On an sm_100a device whose driver keeps fewer clusters resident than the plan's
        # count, the lowering compiles that grid into the binary: precompile compiles the same
        # one when given the driver's answer, or when this machine's GPU is the target.
        m = n = k = 4096
        with mock.patch.object(dispatch, "driver_max_clusters", lambda size: 70):
            lowered = _binary_the_lowering_compiles(m, n, k, arch="sm_100a", num_sms=148)
            self.assertEqual(lowered[0].max_clusters, 70)
            size = math.prod(lowered[0].cluster_shape_mn)
            (given,) = precompile([(m, n, k)], arch="sm_100a", num_sms=148, progress=False,
                                  resident_clusters={size: 70})  # fmt: skip
            here = dispatch.Target("sm_100a", 148, True)
            with mock.patch.object(dispatch, "device_target", lambda: here):
                (local,) = precompile([(m, n, k)], arch="sm_100a", progress=False)
            (elsewhere,) = precompile([(m, n, k)], arch="sm_100a", num_sms=148, progress=False)
        for result in (given, local):
            self.assertEqual((result.plan, result.spec), lowered)
        self.assertEqual(elsewhere.plan.max_clusters, 0)  # no answer: the plan's own grid
        self.assertIn("70 clusters", " ".join(given.note.split()), given.note)

    def test_xla_dot_plans_compile_nothing(self):
        # k=100 bf16 rows are 200 bytes: not 16-byte aligned, so the planner picks XLA's dot.
        (result,) = precompile([(100, 100, 100)], progress=False)
        self.assertEqual(result.plan.kernel, planning.KERNEL_XLA)
        self.assertIsNone(result.compiled)
        self.assertIn("XLA dot", result.note)
        self.compile_plan.assert_not_called()

    def test_progress_and_summary(self):
        out = io.StringIO()
        precompile([(4096, 4096, 4096), (4096, 4096, 4096), (100, 100, 100)], file=out)
        lines = out.getvalue().splitlines()
        self.assertEqual([line.split("] ")[1].split()[0] for line in lines[:-1]],
                         ["0/3", "1/3", "2/3", "3/3"])  # fmt: skip
        self.assertIn("4096x4096x4096 sm_100a", lines[0])
        self.assertEqual(lines[-1].split(" in ")[0], "precompile: 1 kernels for sm_100a")
        self.assertIn("(1 shapes shared a kernel, 1 run on XLA's dot)", lines[-1])

    def test_progress_on_a_terminal_rewrites_one_line(self):
        out = io.StringIO()
        out.isatty = lambda: True
        precompile([(4096, 4096, 4096), (512, 512, 512)], file=out)
        text = out.getvalue()
        self.assertEqual(text.count("\r\x1b[K"), 3)
        self.assertEqual(text.count("\n"), 2)

    def test_no_progress_writes_nothing(self):
        with mock.patch.object(sys, "stderr", io.StringIO()) as err:
            precompile([(4096, 4096, 4096)], progress=False)
        self.assertEqual(err.getvalue(), "")

    def test_compile_error_names_the_shape(self):
        self.compile_plan.side_effect = [("ok",), RuntimeError("ptxas failed")]
        with self.assertRaisesRegex(RuntimeError, "ptxas failed") as cm:
            precompile([(4096, 4096, 4096), (512, 512, 512)], progress=False)
        self.assertIn("(512, 512, 512)", "\n".join(cm.exception.__notes__))

    def test_integer_sizes_of_any_kind_are_taken(self):
        # Python, numpy and JAX integers alike (what shapes read off arrays give).
        shape = (4096, np.int64(4096), jnp.int32(4096))
        precompile([shape], progress=False)
        self.compile_plan.assert_called()
        (result,) = precompile([shape], arch="sm_90a", num_sms=np.int64(114), progress=False)
        self.assertEqual(result.plan.num_sms, 114)

    @parameterized.named_parameters(
        ("short_shape", dict(shapes=[(4096, 4096)])),
        ("long_shape", dict(shapes=[(1, 2, 3, 4, 5)])),
        ("dtypes", dict(shapes=[(64, 64, 64)], dtypes=("bfloat16",))),
        ("float_size", dict(shapes=[(4096, 4096, 4096), (64.5, 64, 64)]), "sizes must be ints"),
        ("activation", dict(shapes=[(4096, 4096, 4096)], activation="tanh"),
         "activation='tanh' must be one of"),
        ("num_sms", dict(shapes=[(4096, 4096, 4096)], num_sms=0), "num_sms=0 must be an int"),
        ("preact", dict(shapes=[(4096, 4096, 4096)], preact_out=True), "needs an activation"),
    )  # fmt: skip
    def test_bad_arguments_raise(self, kwargs, message=""):
        # Refused before anything is planned or compiled, naming the argument.
        with self.assertRaisesRegex(ValueError, message):
            precompile(progress=False, **kwargs)
        self.compile_plan.assert_not_called()

    @parameterized.named_parameters(
        ("one_shape", dict(shapes=(4096, 4096, 4096)), r"for one shape pass \[\(4096"),
        ("alpha_str", dict(shapes=[(4096, 4096, 4096)], alpha="2"), "alpha must be"),
        ("beta_bool", dict(shapes=[(4096, 4096, 4096)], beta=True), "beta must be"),
        ("clusters", dict(shapes=[(4096, 4096, 4096)], resident_clusters=[(2, 66)]),
         "resident_clusters must be a mapping"),
        ("num_sms_str", dict(shapes=[(4096, 4096, 4096)], num_sms="132"), "num_sms must be an"),
    )  # fmt: skip
    def test_bad_argument_types_raise(self, kwargs, message):
        with self.assertRaisesRegex(TypeError, message):
            precompile(progress=False, **kwargs)
        self.compile_plan.assert_not_called()

    def test_preact_out_is_the_training_forwards_spec(self):
        (result,) = precompile([(4096, 4096, 4096)], arch="sm_90a", bias_dtype="bfloat16",
                               activation="gelu", preact_out=True, progress=False)  # fmt: skip
        self.assertTrue(result.spec.preact_out)
        self.assertEqual(result.spec.activation, "gelu")
        self.compile_plan.assert_called_once_with(result.plan, result.spec)


if __name__ == "__main__":
    absltest.main()
