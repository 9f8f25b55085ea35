"""Exporting for CUDA on a CPU-only machine: the sm_100a kernel travels inside the module."""

from __future__ import annotations

import contextlib
import dataclasses
import os
import re
import types
from unittest import mock

import jax
import jax.numpy as jnp
import numpy as np
from absl.testing import absltest, parameterized

import jax_sm100
from jax_sm100._src import dispatch, ffi, ffi_checks, gpu_lowering, planning
from jax_sm100._src.primitive import matmul_p
from tests import test_gpu_matrix as gpu_matrix


def _export(fn, *args):
    return jax.export.export(
        jax.jit(fn), platforms=["cuda"], disabled_checks=ffi.export_safety_checks()
    )(*args)


def _embedded_objects(text: str) -> list[bytes]:
    return [bytes.fromhex(h) for h in re.findall(r'object = dense<"0x([0-9A-F]+)"', text)]


class ExportForSm100Test(parameterized.TestCase):
    @parameterized.named_parameters(
        ("one_cta", 512, 1024, 256, False, None),
        ("two_cta_relu_bias", 4096, 4096, 512, True, "relu"),
    )
    def test_kernel_in_exported_module(self, m, n, k, two_cta, activation):
        a = jax.ShapeDtypeStruct((m, k), jnp.bfloat16)
        b = jax.ShapeDtypeStruct((k, n), jnp.bfloat16)
        bias = jax.ShapeDtypeStruct((n,), jnp.bfloat16)
        p = jax_sm100.plan(m, n, k, a_dtype="bfloat16", b_dtype="bfloat16", arch="sm_100a")
        if two_cta != p.use_2cta:
            p = dataclasses.replace(p, mma_tiler_mnk=(256, 128, 64), use_2cta=True,
                                    cluster_shape_mn=(2, 1))  # fmt: skip
        self.assertEqual(p.kernel, "sm100_tcgen05")
        self.assertEqual(p.use_2cta, two_cta)

        def fn(a, b, bias):
            return jax_sm100.matmul(a, b, bias=bias, activation=activation, plan=p)

        exp = _export(fn, a, b, bias)
        text = exp.mlir_module()
        self.assertEqual(text.count("stablehlo.custom_call @jax_sm100_gemm"), 1)
        self.assertNotIn("stablehlo.dot_general", text)
        (obj,) = _embedded_objects(text)
        self.assertEqual(obj[:4], b"\x7fELF")  # the host object with the cubin inside
        self.assertTrue(b"sm_100a" in obj and b"Sm100GemmKernel" in obj)
        self.assertGreater(len(exp.serialize()), len(obj))
        spec = jax_sm100.KernelSpec(
            a_dtype="bfloat16", b_dtype="bfloat16", out_dtype="bfloat16",
            bias_dtype="bfloat16", activation=activation,
        )  # fmt: skip
        compiled = jax_sm100.compile_plan(p, spec)
        self.assertEqual(compiled.object_bytes, obj)
        self.assertIn("tcgen05.mma.cta_group::" + ("2" if two_cta else "1"), compiled.ptx)
        self.assertIn(f"tcgen05.alloc.cta_group::{2 if two_cta else 1}", compiled.ptx)

    def test_stream_k_workspace_in_exported_module(self):
        # A stream-K plan's custom call takes zeroed flags, aliased to a result, and returns
        # its float32 workspace beside D; the caller sees D only.
        # (The planner takes ping-pong here, which has no stream-K: its cooperative plan.)
        p = jax_sm100.plan(16384, 4096, 4096, a_dtype="bfloat16", b_dtype="bfloat16",
                           arch="sm_90a")  # fmt: skip
        p = planning.cooperative(p)
        self.assertTrue(p.stream_k)
        a = jax.ShapeDtypeStruct((16384, 4096), jnp.bfloat16)
        b = jax.ShapeDtypeStruct((4096, 4096), jnp.bfloat16)
        exp = _export(lambda a, b: jax_sm100.matmul(a, b, plan=p), a, b)
        self.assertEqual(exp.out_avals[0].shape, (16384, 4096))
        self.assertLen(exp.out_avals, 1)
        text = exp.mlir_module()
        (call,) = [ln for ln in text.splitlines() if "custom_call @jax_sm100_gemm" in ln]
        ws, flags = f"tensor<{p.num_sms * 128 * 256}xf32>", f"tensor<{p.num_sms}xi32>"
        self.assertIn(f"{flags}) -> (tensor<1x16384x4096xbf16>, {ws}, {flags})", call)
        self.assertIn("output_tuple_indices = [2], operand_index = 2", call)
        self.assertIn("order = dense<[0, 1, -1, -2, 2]>", call)

    def test_every_extra_buffer_in_its_place(self):
        # `gpu_lowering.launch` puts every lowering's extra buffers after the call's own: a
        # stream-K forward under grad takes a, b, bias, then its zeroed flags (aliased to the
        # last result), and returns D, the pre-activation, the workspace and the flags; a
        # grouped forward with dynamic tiles takes a, b, group sizes, bias, then its zeroed
        # tile counter (aliased to its second result).
        p = planning.with_preact(planning.cooperative(jax_sm100.plan(
            16384, 4096, 4096, a_dtype="bfloat16", b_dtype="bfloat16", arch="sm_90a")))  # fmt: skip
        self.assertTrue(p.stream_k and p.preact_out)
        x = jax.ShapeDtypeStruct((16384, 4096), jnp.bfloat16)
        w = jax.ShapeDtypeStruct((4096, 4096), jnp.bfloat16)
        bias = jax.ShapeDtypeStruct((4096,), jnp.bfloat16)

        def loss(x, w, bias):
            y = jax_sm100.matmul(x, w, bias=bias, activation="gelu", plan=p)
            return jnp.sum(y.astype(jnp.float32))

        text = _export(jax.grad(loss), x, w, bias).mlir_module()
        (call,) = [ln for ln in text.splitlines() if 'names = "a,b,d,bias,z,' in ln]
        ws, flags = f"tensor<{p.num_sms * 128 * 256}xf32>", f"tensor<{p.num_sms}xi32>"
        self.assertIn('names = "a,b,d,bias,z,ws,flags"', call)
        self.assertIn("order = dense<[0, 1, -1, 2, -2, -3, 3]>", call)
        self.assertIn("output_tuple_indices = [3], operand_index = 3,", call)
        self.assertIn(f"{flags}) -> (tensor<1x16384x4096xbf16>, tensor<1x16384x4096xbf16>, "
                      f"{ws}, {flags})", call)  # fmt: skip

        def grouped(x, w, sizes, bias):
            return jax_sm100.ragged_dot(x, w, sizes, bias=bias, activation="gelu")

        args = (jax.ShapeDtypeStruct((16384, 2048), jnp.bfloat16),
                jax.ShapeDtypeStruct((128, 2048, 768), jnp.bfloat16),
                jax.ShapeDtypeStruct((128,), jnp.int32),
                jax.ShapeDtypeStruct((128, 768), jnp.bfloat16))  # fmt: skip
        for arch in ("sm_90a", "sm_100a"):
            with mock.patch.dict(os.environ, {"JAX_SM100_TARGET_ARCH": arch}):
                text = _export(grouped, *args).mlir_module()
            self.assertTrue(jax_sm100.last_lowering().plan.dynamic_tiles, arch)
            (call,) = [ln for ln in text.splitlines() if "custom_call @jax_sm100_gemm" in ln]
            self.assertIn('names = "a,b,d,group_sizes,bias,counter"', call)
            self.assertIn("order = dense<[0, 1, -1, 2, 3, 4]>", call)
            self.assertIn("output_tuple_indices = [1], operand_index = 4,", call)
            self.assertIn("-> (tensor<16384x768xbf16>, tensor<1xi32>)", call)

    def test_swapped_product_in_exported_module(self):
        # A very tall fp8 product runs swapped: the custom call takes B (the kernel's A) first,
        # A second, and writes the caller's [m, n] as the kernel's M-major (n, m) D.
        a = jax.ShapeDtypeStruct((16384, 2048), jnp.float8_e4m3fn)
        b = jax.ShapeDtypeStruct((4096, 2048), jnp.float8_e4m3fn)  # [n, k]: K-major
        nt = (((1,), (1,)), ((), ()))
        with mock.patch.dict(os.environ, {"JAX_SM100_TARGET_ARCH": "sm_90a"}):
            exp = _export(lambda a, b: jax_sm100.dot_general(
                a, b, nt, preferred_element_type=jnp.bfloat16), a, b)  # fmt: skip
        low = jax_sm100.last_lowering()
        self.assertTrue(low.plan.swap_ab, low)
        self.assertIn("D^T = B A^T", low.note)
        (call,) = [ln for ln in exp.mlir_module().splitlines()
                   if "custom_call @jax_sm100_gemm" in ln]  # fmt: skip
        self.assertIn("(tensor<1x4096x2048xf8E4M3FN>, tensor<1x16384x2048xf8E4M3FN>) -> "
                      "tensor<1x16384x4096xbf16>", call)  # fmt: skip
        # D's modes (extents, then strides): (4096, 16384, 1) with strides (1, 4096, m * n);
        # then the five ties of A, B and D's problem (no bias, C or z here).
        self.assertIn("4096, 16384, 1, 1, 4096, 67108864, 5, ", call)
        dims = re.search(r"dims = dense<\[([-\d, ]+)\]>", call)[1].split(",")
        self.assertEqual(ffi_checks.decode_call(dims, "a,b,d", 3)[1], ffi_checks.problem_ties())
        # With bias, gelu and the pre-activation (the forward under grad): bias runs along the
        # kernel's M (the caller's n), and Z is a second M-major result.
        bias = jax.ShapeDtypeStruct((4096,), jnp.bfloat16)

        def fwd(a, b, bias):
            return matmul_p.bind(
                a, b, bias, transpose_a=False, transpose_b=True, alpha=1.0, beta=1.0,
                activation="gelu", out_dtype=np.dtype(jnp.bfloat16), has_bias=True, has_c=False,
                plan=None, save_preact=True, act_grad=None,
            )  # fmt: skip

        with mock.patch.dict(os.environ, {"JAX_SM100_TARGET_ARCH": "sm_90a"}):
            text = _export(fwd, a, b, bias).mlir_module()
        low = jax_sm100.last_lowering()
        self.assertTrue(low.plan.swap_ab and low.plan.preact_out, low)
        (call,) = [ln for ln in text.splitlines() if "custom_call @jax_sm100_gemm" in ln]
        self.assertIn("-> (tensor<1x16384x4096xbf16>, tensor<1x16384x4096xbf16>)", call)
        self.assertIn('names = "a,b,d,bias,z"', call)
        dims = re.search(r"dims = dense<\[([-\d, ]+)\]>", call)[1].split(",")
        decoded, ties = ffi_checks.decode_call(dims, "a,b,d,bias,z", 5)
        layouts = {t.name: (t.shape, t.strides) for t in decoded}
        # The epilogue reads bias along D's mode 0 here (the kernel's M): tied to it.
        self.assertIn(ffi_checks.Tie("bias", 0, "d", 0), ties)
        m_major = ((4096, 16384, 1), (1, 4096, 16384 * 4096))
        self.assertEqual((layouts["d"], layouts["z"]), (m_major, m_major))
        self.assertEqual(layouts["bias"], ((4096,), (1,)))
        self.assertEqual(layouts["a"], ((4096, 2048, 1), (2048, 1, 4096 * 2048)))

    def test_target_arch_without_plan(self):
        # With no plan and no SM90/SM100 device, lowering for CUDA picks XLA's dot, unless
        # JAX_SM100_TARGET_ARCH names the arch to cross-compile for. 1024x4096x1024 is at
        # planning.SM90_MIN_FLOPS: the sm_90a planner sends smaller problems to XLA's dot.
        a = jax.ShapeDtypeStruct((1024, 1024), jnp.bfloat16)
        b = jax.ShapeDtypeStruct((1024, 4096), jnp.bfloat16)
        text = _export(lambda a, b: jax_sm100.matmul(a, b), a, b).mlir_module()
        self.assertNotIn("jax_sm100_gemm", text)
        self.assertIn("stablehlo.dot_general", text)
        for arch, family in (("sm_100a", b"Sm100GemmKernel"), ("sm_90a", b"Sm90GemmKernel")):
            with mock.patch.dict(os.environ, {"JAX_SM100_TARGET_ARCH": arch}):
                text = _export(lambda a, b: jax_sm100.matmul(a, b, alpha=0.5), a, b).mlir_module()
            (obj,) = _embedded_objects(text)
            self.assertTrue(family in obj, f"{arch}: no {family} kernel in the exported object")

    def test_bad_target_arch_names_the_variable(self):
        a = jax.ShapeDtypeStruct((1024, 1024), jnp.bfloat16)
        b = jax.ShapeDtypeStruct((1024, 4096), jnp.bfloat16)
        with mock.patch.dict(os.environ, {"JAX_SM100_TARGET_ARCH": "sm_80"}):
            with self.assertRaisesRegex(
                jax_sm100.PlanError, "JAX_SM100_TARGET_ARCH='sm_80' in the environment: .*sm_90a"
            ):
                _export(lambda a, b: jax_sm100.matmul(a, b), a, b)

    def test_only_the_kernels_own_compute_capabilities_are_targets(self):
        # Arch-specific code runs only on its own compute capability: a 10.3 part (B300) or an
        # 8.0 one runs XLA's dot, not sm_100a or sm_90a kernels it could not load.
        for cc, arch in (("9.0", "sm_90a"), ("10.0", "sm_100a"), ("10.3", None), ("9.1", None),
                         ("8.0", None), ("12.0", None), ("", None)):  # fmt: skip
            dev = types.SimpleNamespace(compute_capability=cc, core_count=100)
            target = dispatch._target_of(dev)
            self.assertEqual(target and (target.arch, target.num_sms), arch and (arch, 100), cc)
        # A GPU that is no target says so once (device_target is cached), naming what runs.
        a100 = types.SimpleNamespace(compute_capability="8.0", device_kind="NVIDIA A100")
        with mock.patch.object(jax, "devices", return_value=[a100]):
            with self.assertWarnsRegex(UserWarning, r"A100, compute capability 8.0\) runs none"):
                self.assertIsNone(dispatch.device_target.__wrapped__())

    def test_sm100_grid_from_the_drivers_occupancy(self):
        # On an sm_100a device the lowering asks the driver how many clusters fit (whole GPCs);
        # where that is fewer than the plan's resources allow, the grid launches that many.
        a = jax.ShapeDtypeStruct((4096, 4096), jnp.bfloat16)
        with (
            mock.patch.object(
                dispatch, "device_target", return_value=dispatch.Target("sm_100a", 148, True)
            ),
            mock.patch.object(dispatch, "driver_max_clusters", return_value=70) as query,
        ):
            _export(lambda a, b: jax_sm100.matmul(a, b), a, a)
        how = dispatch.last_lowering()
        size = how.plan.cluster_shape_mn[0] * how.plan.cluster_shape_mn[1]
        query.assert_called_once_with(size)
        self.assertEqual(how.plan.max_clusters, 70)
        self.assertEqual(planning.grid_clusters(how.plan), 70)
        self.assertIn("grid: 70 clusters", how.note)
        self.assertGreater(planning.resident_clusters(how.plan), 70)

    def test_plan_given_follows_vmap(self):
        # A caller's plan, checked against the call's own problem by matmul, keeps its choices
        # when vmap turns the call into a bigger one (here the batch folds into m).
        p = jax_sm100.plan(2048, 2048, 2048, a_dtype="bfloat16", b_dtype="bfloat16",
                           arch="sm_100a")  # fmt: skip
        a = jax.ShapeDtypeStruct((4, 2048, 2048), jnp.bfloat16)
        w = jax.ShapeDtypeStruct((2048, 2048), jnp.bfloat16)
        with jax_sm100.lowerings() as seen:
            _export(jax.vmap(lambda a, w: jax_sm100.matmul(a, w, plan=p), in_axes=(0, None)), a, w)
        (how,) = seen
        self.assertEqual((how.plan.m, how.plan.batch), (8192, 1))
        self.assertEqual(how.plan.mma_tiler_mnk, p.mma_tiler_mnk)
        self.assertEqual(how.plan.cluster_shape_mn, p.cluster_shape_mn)
        self.assertIn("the plan given resized", how.note)

    def test_sm100_plan_on_other_device_raises(self):
        p = jax_sm100.plan(128, 64, 64, a_dtype="bfloat16", b_dtype="bfloat16", arch="sm_100a")
        a = jax.ShapeDtypeStruct((128, 64), jnp.bfloat16)
        with mock.patch.object(
            dispatch, "device_target", return_value=dispatch.Target("sm_90a", 132, True)
        ):
            with self.assertRaisesRegex(
                jax_sm100.PlanError, "is for sm_100a, but this call runs on sm_90a"
            ):
                _export(lambda a, b: jax_sm100.matmul(a, b, plan=p), a, a.update(shape=(64, 64)))


class _Compiled(Exception):
    """Raised by a stand-in compile_plan: the lowering got as far as compiling."""


class LoweringAgreesWithPlanTest(parameterized.TestCase):
    """What plan_for says a call runs is what its CUDA lowering runs and records."""

    @parameterized.parameters("float8_e4m3fn", "float8_e5m2")
    def test_fp8_bias_runs_on_the_kernel(self, bias_dtype):
        # The epilogue adds the bias in float32, so a bias of a dtype the kernels do not read
        # goes to them converted (it went to XLA's dot while plan_for named the kernel).
        a = jax.ShapeDtypeStruct((256, 384), jnp.bfloat16)
        b = jax.ShapeDtypeStruct((384, 512), jnp.bfloat16)
        bias = jax.ShapeDtypeStruct((512,), jnp.dtype(bias_dtype))
        for arch in ("sm_90a", "sm_100a"):
            p = jax_sm100.plan(256, 512, 384, a_dtype="bfloat16", b_dtype="bfloat16",
                               arch=arch, force_kernel=True)  # fmt: skip
            self.assertNotEqual(p.kernel, "xla_dot")
            self.assertEqual(jax_sm100.plan_for(a, b, bias=bias, arch=arch).kernel,
                             jax_sm100.plan_for(a, b, arch=arch).kernel)  # fmt: skip
            compile_plan = mock.Mock(side_effect=_Compiled)
            with (
                mock.patch.dict(os.environ, {"JAX_SM100_TARGET_ARCH": arch}),
                mock.patch.object(gpu_lowering.compile_mod, "compile_plan", compile_plan),
                mock.patch.object(ffi, "register"),
            ):
                with self.assertRaises(_Compiled):
                    _export(lambda a, b, bias, p=p: jax_sm100.matmul(a, b, bias=bias, plan=p),
                            a, b, bias)  # fmt: skip
            (plan, spec), _ = compile_plan.call_args
            self.assertEqual((plan.kernel, spec.bias_dtype), (p.kernel, "float32"))
            self.assertIn(f"bias {bias_dtype} converted to float32", dispatch.last_lowering().note)

    def test_split_k_refitted_says_so(self):
        # k / 2 = 4100 is not a multiple of 8: the planner's split-K x2 drops to the unsplit
        # kernel, and the plan's reason says that rather than the split it no longer runs.
        a = jax.ShapeDtypeStruct((64, 8200), jnp.bfloat16)
        b = jax.ShapeDtypeStruct((8200, 8192), jnp.bfloat16)
        planned = jax_sm100.plan(64, 8192, 8200, a_dtype="bfloat16", b_dtype="bfloat16",
                                 arch="sm_90a")  # fmt: skip
        self.assertEqual(planned.split_k, 2)
        p = jax_sm100.plan_for(a, b, arch="sm_90a")
        self.assertEqual((p.kernel, p.split_k), ("sm90_wgmma", 1))
        self.assertRegex(p.reason, r"^wgmma \d+x\d+ tile, unsplit: the planner's split-K x2 needs")
        self.assertIn("unsplit", str(p))

    def test_xla_reason_named_once(self):
        a = jax.ShapeDtypeStruct((64, 64), jnp.bfloat16)
        with mock.patch.dict(os.environ, {"JAX_SM100_TARGET_ARCH": "sm_90a"}):
            _export(lambda a, b: jax_sm100.matmul(a, b), a, a)
        note = dispatch.last_lowering().note
        self.assertTrue(note.startswith("XLA dot: a small problem"), note)
        self.assertEqual(note.count("XLA dot"), 1, note)

    @parameterized.parameters(((0, 128), (128, 256)), ((64, 0), (0, 256)), ((4, 0, 8), (8, 16)))
    def test_plan_for_an_empty_product(self, a_shape, b_shape):
        a = jax.ShapeDtypeStruct(a_shape, jnp.bfloat16)
        b = jax.ShapeDtypeStruct(b_shape, jnp.bfloat16)
        with self.assertRaisesRegex(jax_sm100.PlanError, "empty product, which has no plan: "
                                    "matmul computes it with XLA's dot"):  # fmt: skip
            jax_sm100.plan_for(a, b, arch="sm_90a")
        with mock.patch.dict(os.environ, {"JAX_SM100_TARGET_ARCH": "sm_90a"}):
            exp = _export(lambda a, b: jax_sm100.matmul(a, b), a, b)
        self.assertNotIn("custom_call @jax_sm100", exp.mlir_module())


_H200 = dispatch.Target("sm_90a", 132, True)


def _lowered(fn, *args, target=_H200, real_compile=False):
    """The lowerings recorded while exporting `fn` for CUDA on `target`; compile_plan stopped
    where it would start (unless `real_compile`)."""
    patches = [mock.patch.object(dispatch, "device_target", lambda: target)]
    if not real_compile:
        stop = mock.Mock(side_effect=_Compiled)
        patches += [mock.patch.object(gpu_lowering.compile_mod, "compile_plan", stop),
                    mock.patch.object(ffi, "register")]  # fmt: skip
    with jax_sm100.lowerings() as seen, contextlib.ExitStack() as stack:
        for patch in patches:
            stack.enter_context(patch)
        try:
            jax.export.export(jax.jit(fn), platforms=["cuda"],
                              disabled_checks=ffi.export_safety_checks())(*args)  # fmt: skip
        except _Compiled:
            pass
    return seen


def _bf16(*shape, dtype=jnp.bfloat16):
    return jax.ShapeDtypeStruct(shape, dtype)


class CallersPlanTest(parameterized.TestCase):
    """A caller's plan (`matmul(plan=...)`) as the CUDA lowering adjusts it for the call."""

    def test_takes_the_devices_sm_count(self):
        p = jax_sm100.plan(4096, 4096, 4096, a_dtype="bfloat16", b_dtype="bfloat16", arch="sm_90a")
        self.assertEqual(p.num_sms, 132)
        smaller = dispatch.Target("sm_90a", 114, True)
        (low,) = _lowered(lambda a, b: jax_sm100.matmul(a, b, plan=p), _bf16(4096, 4096),
                          _bf16(4096, 4096), target=smaller)  # fmt: skip
        self.assertEqual(low.plan.num_sms, 114)

    def test_split_plan_on_a_batch_runs_unsplit(self):
        p = jax_sm100.plan(64, 4096, 4096, a_dtype="bfloat16", b_dtype="bfloat16", arch="sm_90a")
        self.assertGreater(p.split_k, 1)
        f = jax.vmap(lambda a, b: jax_sm100.matmul(a, b, plan=p))
        (low,) = _lowered(f, _bf16(2, 64, 4096), _bf16(2, 4096, 4096))
        self.assertEqual((low.plan.batch, low.plan.split_k), (2, 1))

    def test_split_plan_that_cannot_split_stays_on_a_kernel(self):
        # k / 2 = 2052 is not a multiple of 8: unsplit, on the wgmma kernel (not XLA's dot,
        # where the planner's own small problem would go).
        p = jax_sm100.plan(64, 4096, 4104, a_dtype="bfloat16", b_dtype="bfloat16", arch="sm_90a")
        self.assertGreater(p.split_k, 1)
        (low,) = _lowered(lambda a, b: jax_sm100.matmul(a, b, plan=p), _bf16(64, 4104),
                          _bf16(4104, 4096))  # fmt: skip
        self.assertEqual((low.plan.kernel, low.plan.split_k), (planning.KERNEL_SM90, 1))

    def test_under_grad_writes_the_preactivation(self):
        p = jax_sm100.plan(1024, 1024, 1024, a_dtype="bfloat16", b_dtype="bfloat16",
                           arch="sm_90a", force_kernel=True)  # fmt: skip

        def loss(x, w):
            return jnp.sum(jax_sm100.matmul(x, w, activation="gelu", plan=p).astype(jnp.float32))

        seen = _lowered(jax.grad(loss, argnums=(0, 1)), _bf16(1024, 1024), _bf16(1024, 1024))
        self.assertTrue(seen[0].plan.preact_out, seen[0])

    def test_batched_bias_runs_xla_and_says_so(self):
        f = jax.vmap(lambda a, b, bias: jax_sm100.matmul(a, b, bias=bias))  # a bias per example
        seen = _lowered(f, _bf16(2, 1024, 1024), _bf16(2, 1024, 4096),
                        _bf16(2, 4096, dtype=jnp.float32))  # fmt: skip
        self.assertEqual([x.note for x in seen], ["bias with batch dims: XLA dot"])

    def test_fp8_bias_compiles_converted(self):
        # Through the real compile (the fp8 bias test above stops before it).
        p = jax_sm100.plan(256, 512, 384, a_dtype="bfloat16", b_dtype="bfloat16", arch="sm_90a",
                           force_kernel=True)  # fmt: skip
        with mock.patch.object(ffi, "register"):
            (low,) = _lowered(lambda a, b, bias: jax_sm100.matmul(a, b, bias=bias, plan=p),
                              _bf16(256, 384), _bf16(384, 512),
                              _bf16(512, dtype=jnp.float8_e4m3fn), real_compile=True)  # fmt: skip
        self.assertIn("converted to float32", low.note)


class Fp8KernelFormTest(parameterized.TestCase):
    """fp8 products the kernels cannot take as given run on them in an exact kernel form
    (`dispatch.kernel_form`; review helper-155: each ran XLA's dot on float32 operands at
    HIGHEST, no tensor cores)."""

    E4, E5 = jnp.float8_e4m3fn, jnp.float8_e5m2

    def _one(self, fn, *args, arch="sm_90a"):
        target = dispatch.Target(arch, 132, True)
        (low,) = _lowered(fn, *args, target=target)
        return low

    def test_sm90_transposes_an_n_major_b(self):
        # [k, n] weights, and a transposed [n, k] (two transposes in the program, which XLA
        # folds into none).
        e4 = _bf16(4096, 4096, dtype=self.E4)
        for f in (lambda a, b: jax_sm100.matmul(a, b), lambda a, b: jax_sm100.matmul(a, b.T)):
            low = self._one(f, e4, e4)
            self.assertEqual((low.plan.kernel, low.plan.b_major), ("sm90_wgmma", "k"))
            self.assertIn("B transposed to K-major by XLA", low.note)
        # An M-major A too (a weight gradient's x^T): A [k, m] contracted along its dim 0.
        low = self._one(lambda a, b: jax_sm100.dot_general(a, b, (((0,), (1,)), ((), ()))),
                        _bf16(4096, 8192, dtype=self.E4), e4)  # fmt: skip
        self.assertEqual((low.plan.a_major, low.plan.b_major), ("k", "k"))
        self.assertIn("A transposed to K-major", low.note)
        # sm_100a's tcgen05 reads fp8 N-major: nothing to change.
        low = self._one(lambda a, b: jax_sm100.matmul(a, b), e4, e4, arch="sm_100a")
        self.assertEqual((low.plan.b_major, low.note.count("transposed")), ("n", 0))

    def test_fp8_result_from_a_float32_kernel_result(self):
        # dot_general's and einsum's result of two fp8 operands is fp8 (lax's type).
        a, b = _bf16(4096, 4096, dtype=self.E4), _bf16(4096, 4096, dtype=self.E4)
        f = lambda a, b: jax_sm100.dot_general(a, b, (((1,), (1,)), ((), ())))  # noqa: E731
        for arch in ("sm_90a", "sm_100a"):
            low = self._one(f, a, b, arch=arch)
            self.assertNotEqual(low.plan.kernel, "xla_dot")
            self.assertEqual(low.plan.out_dtype, "float32")
            self.assertIn("float32 result rounded to float8_e4m3fn by XLA", low.note)
        with mock.patch.dict(os.environ, {"JAX_SM100_TARGET_ARCH": "sm_90a"}):
            self.assertEqual(_export(f, a, b).out_avals[0].dtype, self.E4)

    def test_mixed_operands_and_c_widened(self):
        for other, to in ((self.E5, "bfloat16"), (jnp.bfloat16, "bfloat16"),
                          (jnp.float16, "float16")):  # fmt: skip
            low = self._one(
                lambda a, b: jax_sm100.matmul(a, b.T),
                _bf16(4096, 4096, dtype=self.E4),
                _bf16(4096, 4096, dtype=other),
            )
            self.assertEqual((low.plan.a_dtype, low.plan.b_dtype), (to, to))
            self.assertIn(f"widened to {to} (exact)", low.note)
        # Beside float32 it stays as given, on XLA's exact dot (sm_100a's kernel would round
        # float32 to tf32).
        low = self._one(lambda a, b: jax_sm100.matmul(a, b.T), _bf16(4096, 4096, dtype=self.E4),
                        _bf16(4096, 4096, dtype=jnp.float32), arch="sm_100a")  # fmt: skip
        self.assertEqual(low.plan.kernel, "xla_dot")
        self.assertNotIn("widened", low.note)
        low = self._one(lambda a, b, c: jax_sm100.matmul(a, b.T, c=c),
                        *(_bf16(4096, 4096, dtype=self.E4) for _ in range(3)))  # fmt: skip
        self.assertEqual((low.plan.kernel, low.plan.c_dtype), ("sm90_wgmma", "bfloat16"))

    def test_fallback_is_xla_fp8_dot(self):
        # A small fp8 problem runs XLA's fp8 GEMM at DEFAULT (cuBLAS's), not float32 at HIGHEST.
        with mock.patch.dict(os.environ, {"JAX_SM100_TARGET_ARCH": "sm_90a"}):
            e4 = _bf16(256, 256, dtype=self.E4)
            exp = _export(lambda a, b: jax_sm100.matmul(a, b.T), e4, e4)
        dots = [ln for ln in exp.mlir_module().splitlines() if "stablehlo.dot_general" in ln]
        self.assertEqual(len(dots), 1, dots)
        self.assertIn("(tensor<256x256xf8E4M3FN>, tensor<256x256xf8E4M3FN>)", dots[0])
        self.assertNotIn("HIGHEST", dots[0])

    def test_mixed_fp8_under_symbolic_dims_widened(self):
        # XLA's path (symbolic dims) widens e4m3 beside e5m2 to bfloat16 as the kernels' form
        # does: exact products, where XLA's fp8 GEMM accumulates as the tensor core's fp8 does.
        # Two operands of one fp8 format stay fp8 there.
        (m,) = jax.export.symbolic_shape("m")
        with mock.patch.dict(os.environ, {"JAX_SM100_TARGET_ARCH": "sm_90a"}):
            for b_dtype, operands in ((self.E5, "bf16"), (self.E4, "f8E4M3FN")):
                exp = _export(lambda a, b: jax_sm100.matmul(a, b.T),
                              jax.ShapeDtypeStruct((m, 256), self.E4),
                              jax.ShapeDtypeStruct((256, 256), b_dtype))  # fmt: skip
                dots = [ln for ln in exp.mlir_module().splitlines()
                        if "stablehlo.dot_general" in ln]  # fmt: skip
                self.assertEqual(len(dots), 1, dots)
                self.assertIn(f"(tensor<?x256x{operands}>, tensor<256x256x{operands}>)", dots[0])

    def test_plan_for_is_taken_back(self):
        # plan_for gives the kernels' form's plan; matmul(plan=) takes it, and still takes a
        # plan of the call as given (XLA's dot).
        a, b = _bf16(4096, 4096, dtype=self.E4), _bf16(4096, 4096, dtype=self.E4)
        p = jax_sm100.plan_for(a, b, arch="sm_90a")
        self.assertEqual((p.kernel, p.b_major), ("sm90_wgmma", "k"))
        low = self._one(lambda a, b: jax_sm100.matmul(a, b, plan=p), a, b)
        self.assertEqual(low.plan.cta_tile_mnk, p.cta_tile_mnk)
        given = jax_sm100.plan(4096, 4096, 4096, a_dtype=self.E4, b_dtype=self.E4, arch="sm_90a")
        self.assertEqual(given.kernel, "xla_dot")
        low = self._one(lambda a, b: jax_sm100.matmul(a, b, plan=given), a, b)
        self.assertEqual(low.plan.kernel, "xla_dot")
        wrong = jax_sm100.plan(64, 64, 64, a_dtype="bfloat16", b_dtype="bfloat16", arch="sm_90a")
        with self.assertRaisesRegex(jax_sm100.PlanError, "made for a_dtype='bfloat16'"):
            jax_sm100.matmul(jnp.ones((64, 64), self.E4), jnp.ones((64, 64), self.E4), plan=wrong)


class GpuSuitePlansTest(parameterized.TestCase):
    """The planner's choices tests/test_gpu_matrix.py asserts on an SM90 GPU, checked here on
    the plans the same calls lower to for an sm_90a target, so that CI sees a planner change
    that moves one (the twenty-fifth session's 256x176 tile took a swapped plan's case, which
    only the GPU run caught)."""

    @parameterized.named_parameters(*gpu_matrix.planner_choices())
    def test_plan(self, case, fields, want):
        operands = jax.eval_shape(lambda: gpu_matrix._operands(case))
        with mock.patch.dict(os.environ, {"JAX_SM100_TARGET_ARCH": "sm_90a"}):
            with jax_sm100.lowerings() as seen:
                _export(gpu_matrix._case_fn(case), *operands)
        (low,) = seen
        self.assertEqual(fields(low.plan), want, low)


if __name__ == "__main__":
    absltest.main()
