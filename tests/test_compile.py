"""compile_plan on a CPU machine: objects, argument layouts, the binary cache, the CUDA lowering."""

import dataclasses
import os
import shutil
import tempfile
from unittest import mock

import jax
import jax.numpy as jnp
from absl.testing import absltest

import jax_sm100
from jax_sm100._src import compile as compile_mod
from jax_sm100._src import disk_cache, dispatch, ffi, kernel_key, planning
from jax_sm100._src.kernels.spec import KernelSpec

_HAS_CXX = bool(shutil.which("g++") or shutil.which("c++"))


def _export_for_h200(f, *args) -> str:
    """The StableHLO of `f` exported for CUDA as if on an H200 (sm_90a, 132 SMs), on any machine."""
    with mock.patch.object(dispatch, "device_target", lambda: dispatch.Target("sm_90a", 132, True)):
        exp = jax.export.export(
            f, platforms=["cuda"],
            disabled_checks=[jax.export.DisabledSafetyCheck.custom_call(ffi.TARGET)],
        )(*args)  # fmt: skip
    return exp.mlir_module()


def _plan(m, n, k, **kw):
    # force_kernel: compile_plan needs a kernel plan, also for problems the planner would send
    # to XLA's dot (`planning.SM90_MIN_FLOPS`).
    return planning.plan(
        m, n, k, a_dtype="bfloat16", b_dtype="bfloat16", arch="sm_90a", force_kernel=True, **kw
    )


class CompileTest(absltest.TestCase):
    def test_object_and_args(self):
        c = compile_mod.compile_plan(_plan(2048, 2048, 2048))
        self.assertEqual(c.object_bytes[:4], b"\x7fELF")
        self.assertEqual([t.name for t in c.tensor_args], ["a", "b", "d"])
        a = c.tensor_args[0]
        self.assertEqual(a.dynamic_shape_modes, (0, 1, 2))
        self.assertEqual(a.dynamic_stride_modes, (0, 2))

    def test_binary_shared_across_sizes(self):
        p1, p2 = _plan(4096, 4096, 4096), _plan(4096, 4096, 8192)
        self.assertEqual(compile_mod.binary_key(p1, KernelSpec.for_plan(p1)),
                         compile_mod.binary_key(p2, KernelSpec.for_plan(p2)))  # fmt: skip
        self.assertIs(compile_mod.compile_plan(p1), compile_mod.compile_plan(p2))

    def test_binaries_follow_their_spec_in_memory_and_on_disk(self):
        # One plan, two epilogues: two binaries, each handed back for its own spec, from
        # memory and (a new process: the in-memory cache empty) from the disk cache.
        p = _plan(2048, 2048, 2048)
        relu = KernelSpec("bfloat16", "bfloat16", "bfloat16", bias_dtype="float32",
                          activation="relu")  # fmt: skip
        plain = KernelSpec.for_plan(p)
        folder = self.enterContext(tempfile.TemporaryDirectory())
        self.enterContext(mock.patch.dict(compile_mod._cache, clear=True))
        with mock.patch.object(disk_cache, "_default_cache", disk_cache.KernelCache(folder)):
            first = [compile_mod.compile_plan(p, s) for s in (relu, plain)]
        self.assertEqual([c.spec for c in first], [relu, plain])
        self.assertNotEqual(first[0].object_bytes, first[1].object_bytes)
        compile_mod._cache.clear()
        with mock.patch.object(disk_cache, "_default_cache", disk_cache.KernelCache(folder)):
            again = [compile_mod.compile_plan(p, s) for s in (relu, plain)]
            self.assertEqual(disk_cache._default_cache.stats().disk_hits, 2)
        for c, d in zip(first, again, strict=True):
            self.assertEqual((d.spec, d.object_bytes, d.tensor_args, d.ptx, d.cubin),
                             (c.spec, c.object_bytes, c.tensor_args, c.ptx, c.cubin))  # fmt: skip
            # An entry is its object file and little more (PTX and cubin deflated).
            entry = disk_cache.KernelCache(folder).entry_path(
                kernel_key.cache_key(p, c.spec, arch=p.arch, ignore_plan_fields=p.RUNTIME_FIELDS)
            )
            self.assertLess(entry.stat().st_size, 2 * len(c.object_bytes))

    def test_disk_cache_takes_every_alpha_and_the_callers_plan(self):
        # `matmul` takes any float alpha and beta: a non-finite one compiles with the disk
        # cache on (JSON has no inf or NaN) and comes back equal from disk. A split-K plan's
        # CompiledGemm names the caller's plan whether compiled or read from the cache (its
        # spec is the float32 partial product's either way).
        folder = self.enterContext(tempfile.TemporaryDirectory())
        p, splitk = _plan(2048, 2048, 2048), _plan(64, 4096, 4096)
        specs = [dataclasses.replace(KernelSpec.for_plan(p), alpha=a, beta=b)
                 for a, b in ((float("inf"), 1.0), (float("nan"), float("-inf")))]  # fmt: skip
        compiled = []
        for _ in range(2):  # compiled, then read from the disk cache by a "new process"
            self.enterContext(mock.patch.dict(compile_mod._cache, clear=True))
            cache = disk_cache.KernelCache(folder)
            with mock.patch.object(disk_cache, "_default_cache", cache):
                compiled.append([compile_mod.compile_plan(p, s) for s in specs]
                                + [compile_mod.compile_plan(splitk)])  # fmt: skip
        self.assertEqual(cache.stats().disk_hits, 3)
        for first, again in zip(*compiled, strict=True):
            self.assertEqual(repr(first.spec), repr(again.spec))  # NaN != NaN: compare reprs
            self.assertEqual(first.object_bytes, again.object_bytes)
        self.assertEqual(repr(compiled[1][1].spec.alpha), "nan")
        self.assertIs(compiled[0][2].plan, splitk)
        self.assertEqual(compiled[1][2].plan, splitk)
        self.assertEqual(compiled[0][2].spec.out_dtype, "float32")

    def test_splitk_compiles_float32_partials(self):
        p = _plan(64, 4096, 4096)
        self.assertEqual((p.kernel, p.split_reduce), ("sm90_wgmma_splitk", "xla"))
        c = compile_mod.compile_plan(p)
        self.assertEqual(c.spec.out_dtype, "float32")
        self.assertGreater(c.split_k, 1)

    def test_splitk_reduces_in_the_cluster(self):
        # One kernel: the (1, split) cluster sums its partials through distributed shared
        # memory (mapa + ld.shared::cluster), with cluster-scope mbarrier hand-offs, and writes
        # the output dtype itself (no float32 partials, no multicast loads).
        p = planning.with_split(_plan(64, 4096, 4096), 4, reduce="cluster")
        self.assertEqual(p.kernel, "sm90_wgmma_splitk")
        self.assertEqual(p.cluster_shape_mn, (1, p.split_k))
        spec = KernelSpec(
            a_dtype="bfloat16", b_dtype="bfloat16", out_dtype="bfloat16", c_dtype="bfloat16",
            bias_dtype="float32", activation="gelu", beta=0.5,
        )  # fmt: skip
        c = compile_mod.compile_plan(p, spec)
        self.assertEqual((c.spec, c.split_k), (spec, p.split_k))
        ptx = c.ptx
        self.assertIn("ld.shared::cluster.v4", ptx)
        self.assertIn("mapa.shared::cluster", ptx)
        self.assertIn("mbarrier.arrive.release.cluster.shared::cluster", ptx)
        self.assertIn("fence.acq_rel.cluster", ptx)
        self.assertIn("tanh.approx.f32", ptx)
        self.assertNotIn("multicast::cluster", ptx)

    @absltest.skipUnless(_HAS_CXX, "the CUDA lowering registers the FFI handler: needs g++/c++")
    def test_split_reduce_lowerings(self):
        # "xla": the kernel returns float32 partials and XLA sums them (a reduce in the module);
        # "cluster": one custom call returns the bf16 output with C and bias as operands.
        base = _plan(64, 4096, 4096, c_dtype="bfloat16")
        args = (jax.ShapeDtypeStruct((64, 4096), jnp.bfloat16),
                jax.ShapeDtypeStruct((4096, 4096), jnp.bfloat16),
                jax.ShapeDtypeStruct((64, 4096), jnp.bfloat16),
                jax.ShapeDtypeStruct((4096,), jnp.float32))  # fmt: skip
        for reduce in ("xla", "cluster"):
            p = planning.with_split(base, 4, reduce=reduce)
            f = jax.jit(lambda a, b, c, bias, p=p: jax_sm100.matmul(
                a, b, c=c, bias=bias, activation="relu", plan=p))  # fmt: skip
            text = _export_for_h200(f, *args)
            calls = [ln for ln in text.splitlines() if f"custom_call @{ffi.TARGET}" in ln]
            self.assertLen(calls, 1)
            if reduce == "xla":
                self.assertIn("-> tensor<4x64x4096xf32>", calls[0])
                self.assertIn("stablehlo.reduce", text)
            else:
                self.assertIn("-> tensor<1x64x4096xbf16>", calls[0])
                self.assertNotIn("stablehlo.reduce", text)
            self.assertEqual(dispatch.last_lowering().plan.split_reduce, reduce)

    @absltest.skipUnless(_HAS_CXX, "the CUDA lowering registers the FFI handler: needs g++/c++")
    def test_exporting_a_training_step_warms_every_kernel_it_runs(self):
        # precompile's docstring: lowering the step itself for the target fills the cache with
        # every kernel the step asks for (the forward with its pre-activation, the backward
        # products' layouts and fused derivative), so a second process compiles none.
        def step(x, w1, b1, w2):
            h = jax_sm100.matmul(x, w1, bias=b1, activation="gelu")
            return jnp.sum(jax_sm100.matmul(h, w2).astype(jnp.float32) ** 2)

        args = (jax.ShapeDtypeStruct((4096, 2048), jnp.bfloat16),
                jax.ShapeDtypeStruct((2048, 4096), jnp.bfloat16),
                jax.ShapeDtypeStruct((4096,), jnp.bfloat16),
                jax.ShapeDtypeStruct((4096, 2048), jnp.bfloat16))  # fmt: skip
        folder = self.enterContext(tempfile.TemporaryDirectory())
        stats = []
        for _ in range(2):  # the build machine, then a "new process" on the same cache
            self.enterContext(mock.patch.dict(compile_mod._cache, clear=True))
            cache = disk_cache.KernelCache(folder)
            with (
                mock.patch.object(disk_cache, "_default_cache", cache),
                mock.patch.dict(os.environ, {"JAX_SM100_TARGET_ARCH": "sm_90a"}),
            ):  # precompile's recipe, as its docstring and the README give it
                jax.export.export(
                    jax.jit(jax.value_and_grad(step, argnums=(1, 2, 3))), platforms=["cuda"],
                    disabled_checks=jax_sm100.export_disabled_checks(),
                )(*args)  # fmt: skip
            stats.append(cache.stats())
        # Five binaries: the first product with its pre-activation, the second, and the
        # backward's transposed layouts (one with gelu's derivative fused).
        self.assertEqual(stats[0].misses, 5)
        self.assertEqual((stats[1].misses, stats[1].disk_hits), (0, stats[0].misses))

    def test_arguments_of_other_types_are_refused(self):
        with self.assertRaisesRegex(TypeError, "plan must be a jax_sm100.GemmPlan .*got str"):
            compile_mod.compile_plan("plan")
        with self.assertRaisesRegex(TypeError, "spec must be a KernelSpec or None, got dict"):
            compile_mod.compile_plan(_plan(256, 256, 256), spec={})

    def test_xla_plan_is_refused(self):
        p = dataclasses.replace(_plan(256, 256, 256), kernel="xla_dot")
        with self.assertRaisesRegex(ValueError, "XLA"):
            compile_mod.compile_plan(p)

    @absltest.skipUnless(_HAS_CXX, "building the FFI handler needs g++ or c++ on PATH")
    def test_ffi_builds_and_registers(self):
        lib = ffi.build()
        self.assertTrue(lib.exists())
        ffi.register()

    @absltest.skipUnless(_HAS_CXX, "the CUDA lowering registers the FFI handler: needs g++/c++")
    def test_cuda_lowering_emits_ffi_call(self):
        # The lowering plans with no force flag: the folded 3072x2048x1024 problem is above
        # planning.SM90_MIN_FLOPS, so it runs on our kernel (only traced and lowered here).
        f = jax.jit(lambda a, b, bias: jax_sm100.matmul(a, b, bias=bias, activation="relu"))
        args = (jax.ShapeDtypeStruct((3, 1024, 1024), jnp.bfloat16),
                jax.ShapeDtypeStruct((1024, 2048), jnp.bfloat16),
                jax.ShapeDtypeStruct((2048,), jnp.float32))  # fmt: skip
        text = _export_for_h200(f, *args)
        self.assertIn(f"custom_call @{ffi.TARGET}", text)
        self.assertRegex(text, r"prefix = \"jax_sm100_gemm\"")
        how = dispatch.last_lowering()
        self.assertEqual(how.plan.m, 3072)  # the batch of 3 is folded into m (B is shared)
        self.assertEqual(how.plan.kernel, planning.KERNEL_SM90)


if __name__ == "__main__":
    absltest.main()
