"""The FFI handler on a GPU: custom calls built by hand that it must refuse, and its state.

Each refused call is a `jax_sm100_gemm` custom call written here with one thing wrong (its dims
past an operand, an output buffer too small, an operand of another dtype, an extent past the
kernels' int32 range, a key that is not the object's sha256): it must fail with the handler's
`INVALID_ARGUMENT` message naming the problem, as a Python exception, and the process must go
on computing correct products afterwards. The well-formed hand-built call is checked against
float32 math first, so that a refusal is not a call that could not have worked. Also: one
kernel in many instances and in a loop XLA may capture as a CUDA graph (the per-instance state
made at instantiate), and a group-writable kernel-cache folder refused in a fresh process.

Skipped without an SM90 or SM100 CUDA device. Run on the H200 with the other GPU suites:

    XLA_PYTHON_CLIENT_PREALLOCATE=false python3 -m pytest -q tests/test_gpu_ffi.py
"""

from __future__ import annotations

import hashlib
import os
import subprocess
import sys
import tempfile

import jax
import jax.numpy as jnp
import numpy as np
from absl.testing import absltest

import jax_sm100
from jax_sm100._src import compile as compile_mod
from jax_sm100._src import dispatch, ffi, ffi_checks
from jax_sm100._src.kernels.spec import KernelSpec

_M, _N, _K = 256, 384, 128


def _arch():
    try:
        target = dispatch.device_target()
    except Exception:  # noqa: BLE001  (no usable backend: skip)
        return None
    return target.arch if target else None


def _compile(activation=None):
    plan = jax_sm100.plan(_M, _N, _K, a_dtype="bfloat16", b_dtype="bfloat16", arch=_arch(),
                          force_kernel=True)  # fmt: skip
    spec = KernelSpec(a_dtype="bfloat16", b_dtype="bfloat16", out_dtype="bfloat16",
                      activation=activation)  # fmt: skip
    return compile_mod.compile_plan(plan, spec)


def _layouts(compiled, m=_M, n=_N, k=_K):
    """A [1, m, k] (K-major), B [1, k, n] (N-major), D [1, m, n], as the lowering describes them."""
    modes = {"a": ((m, k, 1), (k, 1, m * k)), "b": ((n, k, 1), (1, n, n * k)),
             "d": ((m, n, 1), (n, 1, m * n))}  # fmt: skip
    return [
        ffi_checks.TensorLayout(
            t.name, "bfloat16", *modes[t.name], t.dynamic_shape_modes, t.dynamic_stride_modes
        )  # fmt: skip
        for t in compiled.tensor_args
    ]


def _raw_call(compiled, *, layouts=None, dims=None, key=None, obj=None, out_rows=_M,
              prefix=None):  # fmt: skip
    """A jitted f(a [1, m, k], b [1, k, n]) -> d [1, out_rows, n]: one hand-built custom call."""
    enc_dims, names = ffi_checks.encode(layouts or _layouts(compiled))
    attrs = dict(
        key=key or compiled.digest,
        object=np.frombuffer(obj or compiled.object_bytes, dtype=np.uint8),
        prefix=prefix or compiled.function_prefix,
        dims=np.asarray(enc_dims if dims is None else dims, dtype=np.int64),
        order=np.asarray(
            [{"a": 0, "b": 1, "d": -1}[t.name] for t in compiled.tensor_args], dtype=np.int64
        ),  # fmt: skip
        names=names,
    )
    out = jax.ShapeDtypeStruct((1, out_rows, _N), jnp.bfloat16)
    return jax.jit(lambda a, b: jax.ffi.ffi_call(ffi.TARGET, out)(a, b, **attrs))


@absltest.skipIf(_arch() is None, "needs an SM90 or SM100 CUDA device and jax[cuda]")
class HandlerTest(absltest.TestCase):
    @classmethod
    def setUpClass(cls):
        super().setUpClass()
        ffi.register()
        cls.compiled = _compile()
        cls.other = _compile(activation="relu")  # another binary: another object and key
        assert [t.name for t in cls.compiled.tensor_args] == ["a", "b", "d"]
        assert cls.other.object_bytes != cls.compiled.object_bytes
        ka, kb = jax.random.split(jax.random.key(20))
        cls.a = jax.random.normal(ka, (1, _M, _K), jnp.float32).astype(jnp.bfloat16)
        cls.b = jax.random.normal(kb, (1, _K, _N), jnp.float32).astype(jnp.bfloat16)
        cls.ref = np.einsum("lmk,lkn->lmn", np.asarray(cls.a, np.float32),
                            np.asarray(cls.b, np.float32))  # fmt: skip

    def _assert_correct(self, out, ref=None):
        ref = self.ref if ref is None else ref
        out = np.asarray(out, np.float32)
        self.assertEqual(out.shape, ref.shape)
        self.assertLess(np.linalg.norm(out - ref) / np.linalg.norm(ref), 2e-2)

    def _assert_refused(self, fn, pattern, *args):
        with self.assertRaisesRegex(jax.errors.JaxRuntimeError, "(?s)" + pattern):
            jax.block_until_ready(fn(*(args or (self.a, self.b))))
        # Nothing was launched past a buffer: the process computes correct products after.
        self._assert_correct(_raw_call(self.compiled)(self.a, self.b))

    def test_hand_built_call_is_correct(self):
        self._assert_correct(_raw_call(self.compiled)(self.a, self.b))
        self._assert_correct(_raw_call(self.other)(self.a, self.b), np.maximum(self.ref, 0))

    def test_dims_past_an_operand_are_refused(self):
        # The dims say 64 more rows of A (and of D) than the buffers hold.
        fn = _raw_call(self.compiled, layouts=_layouts(self.compiled, m=_M + 64), out_rows=_M + 64)
        self._assert_refused(
            fn, rf"INVALID_ARGUMENT.*tensor 'a' \(input 0\) spans {(_M + 64) * _K} elements"
        )

    def test_too_small_output_buffer_is_refused(self):
        fn = _raw_call(self.compiled, out_rows=_M - 1)
        self._assert_refused(
            fn, rf"INVALID_ARGUMENT.*tensor 'd' \(result 0\) spans {_M * _N} elements.*holds "
            rf"{(_M - 1) * _N}"
        )  # fmt: skip

    def test_operand_of_another_dtype_is_refused(self):
        a16 = self.a.astype(jnp.float16)
        fn = _raw_call(self.compiled)
        self._assert_refused(fn, r"tensor 'a' \(input 0\) is dtype code 10 but the kernel reads "
                                 r"dtype code 16", a16, self.b)  # fmt: skip

    def test_extent_past_int32_is_refused(self):
        dims, _ = ffi_checks.encode(_layouts(self.compiled))
        dims[5] = 2**31  # a's first extent (format, dtype, rank, masks, then the shape)
        fn = _raw_call(self.compiled, dims=dims)
        self._assert_refused(fn, r"tensor 'a' has extent 2147483648 in mode 0, past the kernels' "
                                 r"int32 index range")  # fmt: skip

    def test_malformed_dims_are_refused(self):
        dims, _ = ffi_checks.encode(_layouts(self.compiled))
        self._assert_refused(_raw_call(self.compiled, dims=dims[:-1]), "dims attribute")
        self._assert_refused(_raw_call(self.compiled, dims=[1, *dims[1:]]), "has format 1")

    def test_key_that_is_not_the_objects_sha256_is_refused(self):
        wrong = hashlib.sha256(b"another kernel").hexdigest()
        self._assert_refused(
            _raw_call(self.compiled, key=wrong),
            rf"sha256 is {self.compiled.digest} but the custom call's key attribute says {wrong}",
        )

    def test_same_key_with_another_object_is_refused(self):
        # Before: the first object loaded under a key ran for every module carrying that key.
        first = _raw_call(self.compiled)
        self._assert_correct(first(self.a, self.b))
        forged = _raw_call(self.compiled, obj=self.other.object_bytes)
        self._assert_refused(forged, rf"sha256 is {self.other.digest} but")
        self._assert_correct(first(self.a, self.b))
        self._assert_correct(_raw_call(self.other)(self.a, self.b), np.maximum(self.ref, 0))

    def test_missing_function_is_refused(self):
        # The object loads, its function is not there: refused (the module destroyed), and
        # the kernel loaded under the same key before runs on.
        self._assert_correct(_raw_call(self.compiled)(self.a, self.b))
        self._assert_refused(
            _raw_call(self.compiled, prefix="no_such_function"),
            "function 'no_such_function' not found in the compiled kernel",
        )

    def test_many_instances_and_a_loop(self):
        # Each custom call is an instance with its own state made at instantiate; a loop of
        # them is what XLA captures into a CUDA graph (a command buffer) and replays.
        w = (jax.random.normal(jax.random.key(21), (_K, _K)) / np.sqrt(_K)).astype(jnp.bfloat16)
        plan = jax_sm100.plan(_M, _K, _K, a_dtype="bfloat16", b_dtype="bfloat16", arch=_arch(),
                              force_kernel=True)  # fmt: skip

        def body(_, x):
            return jax_sm100.matmul(x, w, plan=plan)

        loop = jax.jit(lambda x: jax.lax.fori_loop(0, 20, body, x))
        twice = jax.jit(lambda x: body(0, body(0, x)))
        x0 = self.a[0]
        with jax_sm100.lowerings() as seen:
            outs = [np.asarray(f(x0), np.float32) for f in (loop, twice, loop)]
        self.assertTrue(seen and all(s.plan.kernel != "xla_dot" for s in seen))
        ref, wf = np.asarray(x0, np.float32), np.asarray(w, np.float32)
        refs = []
        for i in range(20):
            ref = np.asarray(jnp.asarray(ref @ wf).astype(jnp.bfloat16), np.float32)
            if i == 1:
                refs.append(ref)
        for out, r in zip(outs, [ref, refs[0], ref], strict=True):
            self.assertLess(np.linalg.norm(out - r) / np.linalg.norm(r), 5e-2)
        np.testing.assert_array_equal(outs[0], outs[2])  # a replay gives the same bits

    def test_group_writable_cache_folder_is_refused(self):
        with tempfile.TemporaryDirectory() as tmp:
            os.chmod(tmp, 0o775)
            code = (
                "import jax, jax.numpy as jnp, jax_sm100\n"
                "a = jnp.ones((1024, 1024), jnp.bfloat16)\n"
                "b = jnp.ones((1024, 4096), jnp.bfloat16)\n"
                "jax.jit(jax_sm100.matmul)(a, b).block_until_ready()\n"
            )
            env = dict(os.environ, JAX_SM100_CACHE_DIR=tmp, JAX_SM100_SMALL_PROBLEMS="kernel",
                       JAX_SM100_FFI_LIB=str(ffi.build()))  # fmt: skip
            env["XLA_PYTHON_CLIENT_PREALLOCATE"] = "false"
            proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                                  env=env, timeout=600)  # fmt: skip
        self.assertNotEqual(proc.returncode, 0)
        self.assertIn("UntrustedCacheError", proc.stderr)
        self.assertIn(f"chmod go-w {tmp}", proc.stderr)


if __name__ == "__main__":
    absltest.main()
