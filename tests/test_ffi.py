"""The FFI handler's contract on a CPU machine: the lowering's attributes, the checks, trust.

- `LayoutTest`: ffi_checks' format and rules (spans, the int32 extent range, malformed dims).
- `LoweringDimsTest`: every custom call the CUDA lowering emits for a matrix of shapes, batch
  forms, layouts, epilogues and schedules (exported for sm_90a and sm_100a, no GPU needed) is
  accepted by the Python mirror and by the handler's own check code (`ffi.check_call`, the
  C++ that Execute runs), and each tensor's buffer made one element short, or of another
  dtype, is refused by both, naming that tensor. The handler's per-call check is timed.
- `NativeTest`: the handler builds without a warning; its SHA-256 agrees with hashlib.
- `TrustTest`: the kernel cache and the cached FFI library refuse folders and files that other
  users could write, and `JAX_SM100_TRUSTED_CACHE_DIRS` opts a shared folder in.

The handler's behaviour on a GPU (refused launches, the key check, CUDA graphs) is in
tests/test_gpu_ffi.py.
"""

from __future__ import annotations

import dataclasses
import hashlib
import os
import re
import shutil
import stat
import subprocess
import sys
import tempfile
from pathlib import Path
from unittest import mock

import jax
import jax.numpy as jnp
import numpy as np
from absl.testing import absltest, parameterized
from jax._src.interpreters import mlir
from jax._src.lib.mlir import ir

import jax_sm100
from jax_sm100._src import constraints, disk_cache, dispatch, ffi, ffi_checks
from jax_sm100._src import primitive as P

_HAS_CXX = bool(os.environ.get("CXX") or shutil.which("g++") or shutil.which("c++"))
_NEEDS_CXX = "the handler's own checks need its library built: needs g++ or c++ on PATH"
_INVALID_ARGUMENT = 3  # XLA_FFI_Error_Code_INVALID_ARGUMENT

_MLIR_DTYPES = {"bf16": "bfloat16", "f16": "float16", "f32": "float32", "i32": "int32",
                "f8E4M3FN": "float8_e4m3fn", "f8E5M2": "float8_e5m2",
                "f4E2M1FN": "float4_e2m1fn", "f8E8M0FNU": "float8_e8m0fnu"}  # fmt: skip


# ------------------------------------------------------------------------------- the format


class LayoutTest(parameterized.TestCase):
    def test_span_is_one_past_the_last_element(self):
        # A K-major A of 3 batches, a split-K view of it, a broadcast operand, an empty one.
        t = ffi_checks.TensorLayout("a", "bfloat16", (5, 64, 3), (64, 1, 320), (0, 1, 2), (0, 2))
        self.assertEqual(t.span, 5 * 64 * 3)
        split = ffi_checks.TensorLayout("a", "bfloat16", (5, 16, 4), (64, 1, 16))
        self.assertEqual(split.span, 5 * 64)
        broadcast = ffi_checks.TensorLayout("b", "float16", (8, 16, 4), (16, 1, 0))
        self.assertEqual(broadcast.span, 8 * 16)
        self.assertEqual(ffi_checks.TensorLayout("c", "float32", (0, 7), (7, 1)).span, 0)

    def test_encode_decode_round_trip(self):
        layouts = [
            ffi_checks.TensorLayout("a", "float8_e4m3fn", (7, 32, 2), (1, 7, 224), (0, 1, 2), (1,)),
            ffi_checks.TensorLayout("bias", "float32", (9,), (1,), (0,), ()),
            ffi_checks.TensorLayout("flags", "int32", (132,), (1,)),
        ]
        dims, names = ffi_checks.encode(layouts)
        self.assertEqual(dims[0], ffi_checks.DIMS_FORMAT)
        self.assertEqual(names, "a,bias,flags")
        # dtype code, rank, shape mask, stride mask, shape, strides
        self.assertEqual(dims[1:11], [20, 3, 0b111, 0b010, 7, 32, 2, 1, 7, 224])
        self.assertEqual(ffi_checks.decode(dims, names, 3), layouts)

    def test_extent_range(self):
        top = ffi_checks.MAX_EXTENT
        self.assertEqual(top, 2**31 - 1)
        self.assertIsNone(constraints.extent_support(top, top, top, top))
        # A folded batch of short rows: 2^31 rows of 16 (64 GiB of bf16, an H200 holds it).
        why = constraints.extent_support(2**31, 16, 16)
        self.assertRegex(why, r"m=2147483648 exceeds the kernels' int32 extent range.*XLA's dot")
        self.assertRegex(constraints.extent_support(8, 8, 8, 2**31), "batch=2147483648")
        big = ffi_checks.TensorLayout("a", "bfloat16", (2**31, 16, 1), (16, 1, 2**35), (0, 1, 2))
        with self.assertRaisesRegex(ffi_checks.LayoutError, r"tensor 'a' has extent 2147483648"):
            ffi_checks.encode([big])

    @parameterized.named_parameters(
        ("format", lambda d: [1] + d[1:], "format"),
        ("short", lambda d: d[:-2], "too short|rank"),
        ("no_tie_count", lambda d: d[:-1], "no count of extent ties"),
        ("trailing", lambda d: d + [0], "0 extent ties in 1 entries"),
        ("dtype", lambda d: d[:1] + [13] + d[2:], "dtype code 13"),
        ("mask", lambda d: d[:3] + [0b1000] + d[4:], "masks"),
        ("negative", lambda d: d[:5] + [-1] + d[6:], "negative"),
        # A zero extent before a negative stride (the handler stopped at the zero).
        ("zero_then_negative", lambda d: d[:5] + [0, 8, 1, 8, -1, 32], "negative"),
        ("extent", lambda d: d[:5] + [2**31] + d[6:], "int32 index range"),
        # A zero extent after a mode whose span overflows int64: the handler walks the modes
        # in order and refuses the overflow before it reaches the zero.
        ("zero_after_overflow", lambda d: d[:5] + [127, 0, 1, 2**63 - 1, 1, 1] + d[11:],
         "overflowing"),
    )  # fmt: skip
    def test_malformed_dims_are_refused(self, edit, message):
        layouts = [ffi_checks.TensorLayout("d", "bfloat16", (4, 8, 1), (8, 1, 32), (0, 1, 2))]
        dims, names = ffi_checks.encode(layouts)
        bad = edit(list(dims))
        with self.assertRaisesRegex(ffi_checks.LayoutError, message):
            ffi_checks.check_call(bad, [-1], names, [], [((1, 4, 8), "bfloat16")])
        if _HAS_CXX:
            code, text, _ = ffi.check_call(bad, [-1], names, [], [(16, 32)])
            self.assertEqual(code, _INVALID_ARGUMENT)
            self.assertRegex(text, message)

    def _tied(self, q_shape=(256, 128), ties=None):
        # quantize_both's x and q (both [R, C]) and s ([R, C / 128]), tied to x's extents.
        x = ffi_checks.TensorLayout("x", "bfloat16", (256, 128), (128, 1), (0, 1), (0,))
        q = ffi_checks.TensorLayout("q", "float8_e4m3fn", q_shape, (q_shape[1], 1), (0, 1), (0,))
        s = ffi_checks.TensorLayout("s", "float32", (256, 1), (1, 256), (0, 1), (1,))
        if ties is None:
            tie = ffi_checks.Tie
            ties = [tie("q", 0, "x", 0), tie("q", 1, "x", 1), tie("s", 0, "x", 0),
                    tie("s", 1, "x", 1, 128)]  # fmt: skip
        dims, names = ffi_checks.encode([x, q, s], ties)
        return dims, names, [x, q, s], ties

    def _refused_both_ways(self, dims, names, counts, message):
        inputs = [((256, 128), "bfloat16")]
        results = [(c, d) for c, d in zip(counts, ("float8_e4m3fn", "float32"), strict=True)]
        with self.assertRaisesRegex(ffi_checks.LayoutError, message):
            ffi_checks.check_call(dims, [0, -1, -2], names, inputs, results)
        if _HAS_CXX:
            code, text, _ = ffi.check_call(dims, [0, -1, -2], names, [(16, 256 * 128)],
                                           [(20, int(np.prod(counts[0]))), (11, 256)])  # fmt: skip
            self.assertEqual(code, _INVALID_ARGUMENT)
            self.assertRegex(text, message)

    def test_extent_ties_round_trip_and_pass(self):
        dims, names, layouts, ties = self._tied()
        self.assertEqual(dims[-21:], [4, 1, 0, 0, 0, 1, 1, 1, 0, 1, 1, 2, 0, 0, 0, 1, 2, 1, 0, 1,
                                      128])  # fmt: skip
        self.assertEqual(ffi_checks.decode_call(dims, names, 3), (layouts, ties))
        inputs, results = [((256, 128), "bfloat16")], [((256, 128), "float8_e4m3fn"),
                                                      ((1, 256), "float32")]  # fmt: skip
        ffi_checks.check_call(dims, [0, -1, -2], names, inputs, results)
        if _HAS_CXX:
            code, text, _ = ffi.check_call(dims, [0, -1, -2], names, [(16, 256 * 128)],
                                           [(20, 256 * 128), (11, 256)])  # fmt: skip
            self.assertEqual((code, text), (0, ""))

    def test_extents_that_break_a_tie_are_refused(self):
        # The review's case: x declared larger than q, each tensor within its own buffer; the
        # kernel's grid (x's) would store past q. Refused, naming both tensors.
        dims, names, _, _ = self._tied(q_shape=(128, 128))
        self._refused_both_ways(
            dims, names, [(128, 128), (1, 256)],
            r"tensor 'q' has extent 128 in mode 0, which times 1 is not tensor 'x''s extent 256",
        )  # fmt: skip

    @parameterized.named_parameters(
        ("tensor", lambda d: d[:-5] + [3] + d[-4:]),
        ("mode", lambda d: d[:-4] + [2] + d[-3:]),
        ("divisor", lambda d: d[:-1] + [0]),
        ("int64_min_divisor", lambda d: d[:-1] + [-(2**63)]),
    )
    def test_malformed_ties_are_refused(self, edit):
        dims, names, _, _ = self._tied()
        self._refused_both_ways(edit(list(dims)), names, [(256, 128), (1, 256)],
                                "names no mode of a tensor")  # fmt: skip

    def test_too_many_ties_are_refused(self):
        with self.assertRaisesRegex(ffi_checks.LayoutError, "17 extent ties"):
            self._tied(ties=[ffi_checks.Tie("q", 0, "x", 0)] * 17)
        dims, names, _, _ = self._tied(ties=[])
        dims = dims[:-1] + [17] + [1, 0, 0, 0, 1] * 17
        self._refused_both_ways(dims, names, [(256, 128), (1, 256)], "17 extent ties")

    @parameterized.parameters("d,", ",d", "d,,", "")
    def test_malformed_names_are_refused(self, names):
        dims, _ = ffi_checks.encode(
            [ffi_checks.TensorLayout("d", "bfloat16", (4, 8, 1), (8, 1, 32), (0, 1, 2))]
        )
        with self.assertRaisesRegex(ffi_checks.LayoutError, "does not list 1 tensors"):
            ffi_checks.check_call(dims, [-1], names, [], [((1, 4, 8), "bfloat16")])
        if _HAS_CXX:
            code, text, _ = ffi.check_call(dims, [-1], names, [], [(16, 32)])
            self.assertEqual(code, _INVALID_ARGUMENT)
            self.assertRegex(text, "names lists (more|fewer) tensors than order")

    def test_dtype_codes_are_the_ffi_headers(self):
        header = Path(jax.ffi.include_dir(), "xla", "ffi", "api", "c_api.h").read_text()
        codes = dict(re.findall(r"XLA_FFI_DataType_(\w+) = (\d+)", header))
        ffi_names = {"bool": "PRED", "bfloat16": "BF16", "float8_e5m2": "F8E5M2",
                     "float8_e4m3fn": "F8E4M3FN", "float4_e2m1fn": "F4E2M1FN",
                     "float8_e8m0fnu": "F8E8M0FNU"}  # fmt: skip
        for name, code in ffi_checks.FFI_DTYPES.items():
            dt = np.dtype(name)
            default = (
                f"{'F' if dt.kind == 'f' else 'S' if dt.kind == 'i' else 'U'}{dt.itemsize * 8}"
            )
            self.assertEqual(int(codes[ffi_names.get(name, default)]), code, name)


# ------------------------------------------------------------- the lowering's attributes


@dataclasses.dataclass(frozen=True)
class _Call:
    """One custom call of an exported module to the handler (`ffi.TARGETS`)."""

    dims: list[int]
    order: list[int]
    names: str
    inputs: list[tuple[tuple[int, ...], str]]
    results: list[tuple[tuple[int, ...], str]]


def _custom_calls(text: str) -> list[_Call]:
    calls = []
    with mlir.make_ir_context():
        module = ir.Module.parse(text)

        def walk(op):
            for region in op.regions:
                for block in region.blocks:
                    for o in block.operations:
                        target = o.attributes["call_target_name"] if (
                            o.operation.name == "stablehlo.custom_call") else None  # fmt: skip
                        if target is not None and ir.StringAttr(target).value in ffi.TARGETS:
                            calls.append(_parse(o))
                        walk(o.operation)

        walk(module.operation)
    return calls


def _parse(op) -> _Call:
    name = "backend_config" if "backend_config" in op.attributes else "mhlo.backend_config"
    cfg = ir.DictAttr(op.attributes[name])

    def avals(values):
        out = []
        for v in values:
            t = ir.RankedTensorType(v.type)
            out.append((tuple(t.shape), _MLIR_DTYPES[str(t.element_type)]))
        return out

    return _Call(
        dims=[int(x) for x in ir.DenseIntElementsAttr(cfg["dims"])],
        order=[int(x) for x in ir.DenseIntElementsAttr(cfg["order"])],
        names=ir.StringAttr(cfg["names"]).value,
        inputs=avals(op.operands),
        results=avals(op.results),
    )


def _bind(a, b, bias=None, c=None, *, transpose_a=False, transpose_b=False, **kw):
    """The primitive bound directly (the one way to pass a transposed operand)."""
    args = [a, b] + [x for x in (bias, c) if x is not None]
    kw = dict(alpha=1.0, beta=1.0, activation=None, out_dtype=np.dtype(jnp.bfloat16), plan=None,
              save_preact=False, act_grad=None) | kw  # fmt: skip
    (out,) = P.matmul_p.bind(*args, transpose_a=transpose_a, transpose_b=transpose_b,
                             has_bias=bias is not None, has_c=c is not None, **kw)  # fmt: skip
    return out


def _s(*shape, dtype=jnp.bfloat16):
    return jax.ShapeDtypeStruct(shape, dtype)


def _sm90_plan_edit(m, n, k, edit):
    from jax_sm100 import tuning  # noqa: PLC0415

    p = jax_sm100.plan(m, n, k, a_dtype="bfloat16", b_dtype="bfloat16", arch="sm_90a",
                       force_kernel=True)  # fmt: skip
    return edit(tuning, p)


def _matmul_case(m, n, k, **kw):
    return (lambda a, b, bias: jax_sm100.matmul(a, b, bias=bias, activation="gelu", **kw),
            (_s(m, k), _s(k, n), _s(n, dtype=jnp.float32)))  # fmt: skip


def _grad_case(m, n, k):
    # Under grad: the forward writes the pre-activation (z); the backward products take
    # transposed operands and the activation's derivative epilogue.
    def loss(x, w):
        return jnp.sum(jax_sm100.matmul(x, w, activation="gelu").astype(jnp.float32))

    return jax.grad(loss, argnums=(0, 1)), (_s(m, k), _s(k, n))


# (name, arch, lambda: (fn, args)); shapes of tests/test_gpu.py, test_export_cuda.py and
# test_compile.py, every batch form, layout and optional tensor, and each schedule with its own
# tensors (split-K partials and in-cluster sums, stream-K's workspace and flags).
_CASES = [
    *[(f"sm90_{m}x{n}x{k}", "sm_90a", lambda m=m, n=n, k=k: _matmul_case(m, n, k))
      for m, n, k in [(128, 256, 64), (200, 136, 520), (1, 8, 16), (1024, 1024, 1024),
                      (64, 4096, 4096)]],  # fmt: skip
    ("sm90_folded_batch", "sm_90a",
     lambda: (lambda a, b, bias: jax_sm100.matmul(a, b, bias=bias, activation="relu"),
              (_s(3, 1024, 1024), _s(1024, 2048), _s(2048, dtype=jnp.float32)))),
    ("sm90_batched_c", "sm_90a",
     lambda: (lambda a, b, c: jax_sm100.matmul(a, b, c=c, beta=0.5),
              (_s(4, 136, 72), _s(4, 72, 200), _s(4, 136, 200)))),
    ("sm90_broadcast_b", "sm_90a",
     lambda: (lambda a, b: jax_sm100.matmul(a, b), (_s(2, 3, 64, 128), _s(3, 128, 64)))),
    ("sm90_transposed", "sm_90a",
     lambda: (lambda a, b: _bind(a, b, transpose_a=True, transpose_b=True),
              (_s(320, 96), _s(256, 320)))),
    ("sm90_fp8_float32_out", "sm_90a",
     lambda: (lambda a, b: _bind(a, b, transpose_b=True, out_dtype=np.dtype(jnp.float32)),
              (_s(256, 128, dtype=jnp.float8_e4m3fn), _s(512, 128, dtype=jnp.float8_e4m3fn)))),
    ("sm90_grad", "sm_90a", lambda: _grad_case(256, 512, 128)),
    # Block-scaled: two float32 scale tensors, transposed, rows padded to 16 bytes (202 -> 204).
    ("sm90_scaled", "sm_90a",
     lambda: (lambda *a: jax_sm100.scaled_matmul(*a, preferred_element_type=jnp.bfloat16),
              (_s(2, 202, 256, dtype=jnp.float8_e4m3fn), _s(2, 136, 256, dtype=jnp.float8_e4m3fn),
               _s(2, 202, 2, dtype=jnp.float32), _s(2, 136, 2, dtype=jnp.float32)))),
    ("sm90_scaled_stream_k", "sm_90a",
     lambda: (lambda *a: jax_sm100.scaled_matmul(*a, preferred_element_type=jnp.bfloat16),
              (_s(1, 8192, 8192, dtype=jnp.float8_e4m3fn),) * 2
              + (_s(1, 8192, 64, dtype=jnp.float32),) * 2)),
    ("sm90_split_in_cluster", "sm_90a",
     lambda: _matmul_case(100, 520, 2048, plan=_sm90_plan_edit(
         100, 520, 2048, lambda t, p: t.with_split(t.sm90_variant(p, tile_mn=(64, 128)), 4,
                                                   reduce="cluster")))),
    ("sm90_stream_k", "sm_90a",
     lambda: (lambda a, b: jax_sm100.matmul(a, b, plan=_sm90_plan_edit(
         16384, 4096, 4096, lambda t, p: t.cooperative(p))), (_s(16384, 4096), _s(4096, 4096)))),
    ("sm100_one_cta", "sm_100a", lambda: _matmul_case(512, 1024, 256)),
    ("sm100_batched", "sm_100a",
     lambda: (lambda a, b: jax_sm100.matmul(a, b), (_s(2, 256, 128), _s(2, 128, 384)))),
    ("sm100_grad", "sm_100a", lambda: _grad_case(256, 256, 128)),
    # Block-scaled (tcgen05): data, then the scales as flat buffers of quantize's blocked layout
    # (mxfp8: 200 rows -> 2 atoms of 128 by 2 atoms of 4 blocks; nvfp4's data packed fp4).
    ("sm100_mxfp8", "sm_100a",
     lambda: (lambda *a: jax_sm100.scaled_matmul(*a, preferred_element_type=jnp.bfloat16),
              (_s(2, 200, 256, dtype=jnp.float8_e4m3fn), _s(2, 136, 256, dtype=jnp.float8_e4m3fn),
               _s(2, 2, 2, 32, 4, 4, dtype=jnp.float8_e8m0fnu),
               _s(2, 2, 2, 32, 4, 4, dtype=jnp.float8_e8m0fnu)))),
    ("sm100_nvfp4", "sm_100a",
     lambda: (lambda *a: jax_sm100.scaled_matmul(*a),
              (_s(1, 128, 512, dtype=jnp.float4_e2m1fn), _s(1, 256, 512, dtype=jnp.float4_e2m1fn),
               _s(1, 1, 8, 32, 4, 4, dtype=jnp.float8_e4m3fn),
               _s(1, 2, 8, 32, 4, 4, dtype=jnp.float8_e4m3fn)))),
    # Grouped (sm_90a): ragged_dot with a bias per group, and under grad, where d rhs is the
    # ragged-contraction kernel (one result per group).
    ("sm90_ragged_dot_bias", "sm_90a",
     lambda: (lambda x, w, g, b: jax_sm100.ragged_dot(x, w, g, bias=b),
              (_s(1000, 256), _s(8, 256, 384), _s(8, dtype=jnp.int32), _s(8, 384)))),
    ("sm90_ragged_dot_grad", "sm_90a",
     lambda: (jax.grad(lambda x, w, g: jnp.sum(jax_sm100.ragged_dot(x, w, g).astype(jnp.float32)),
                       argnums=(0, 1)),
              (_s(1000, 256), _s(8, 256, 384), _s(8, dtype=jnp.int32)))),
    # One input, four results (jax_sm100_quantize): the scales written rows-contiguous.
    ("sm90_quantize_both", "sm_90a",
     lambda: (jax_sm100.quantize_both, (_s(2, 256, 384),))),
    ("sm100_quantize_both", "sm_100a",
     lambda: (lambda x: jax_sm100.quantize_both(x, data_dtype=jnp.float8_e5m2),
              (_s(384, 128, dtype=jnp.float32),))),
]  # fmt: skip


def _exported_calls(arch: str, make) -> list[_Call]:
    fn, args = make()
    target = dispatch.Target(arch, 132 if arch == "sm_90a" else 148)
    with (
        mock.patch.object(dispatch, "device_target", lambda: target),
        mock.patch.dict(os.environ, {"JAX_SM100_SMALL_PROBLEMS": "kernel"}),
    ):
        exp = jax.export.export(
            jax.jit(fn), platforms=["cuda"], disabled_checks=ffi.export_safety_checks()
        )(*args)
    return _custom_calls(exp.mlir_module())


def _counts(avals):
    return [(ffi_checks.FFI_DTYPES[dtype], int(np.prod(shape, dtype=np.int64)))
            for shape, dtype in avals]  # fmt: skip


@absltest.skipUnless(_HAS_CXX, "the CUDA lowering registers the FFI handler: needs g++/c++")
class LoweringDimsTest(parameterized.TestCase):
    """The lowering's dims against the handler's checks, Python and C++ alike."""

    def _native(self, call: _Call, inputs, results, repeats=1):
        return ffi.check_call(call.dims, call.order, call.names, _counts(inputs), _counts(results),
                              repeats=repeats)  # fmt: skip

    @parameterized.named_parameters(*_CASES)
    def test_every_call_passes_and_every_short_buffer_is_refused(self, arch, make):
        calls = _exported_calls(arch, make)
        self.assertNotEmpty(calls)
        for call in calls:
            layouts = ffi_checks.check_call(
                call.dims, call.order, call.names, call.inputs, call.results
            )
            code, message, _ = self._native(call, call.inputs, call.results)
            self.assertEqual((code, message), (0, ""))
            for t, which in zip(layouts, call.order, strict=True):
                self.assertLessEqual(t.span, _buffer_count(call, which))
                # One element short: the kernel would touch one element past the buffer.
                short = _replace_buffer(call, which, lambda shape, dtype: ((_count(shape) - 1,),
                                                                           dtype))  # fmt: skip
                if t.span == _buffer_count(call, which):
                    self._assert_refused(
                        call, short, rf"tensor '{t.name}' \(\w+ \d+\) spans {t.span} elements"
                    )
                # Another dtype: the kernel would misread it.
                other = "float32" if t.dtype != "float32" else "bfloat16"
                retyped = _replace_buffer(call, which, lambda shape, dtype, o=other: (shape, o))
                self._assert_refused(
                    call, retyped, rf"tensor '{t.name}' \(\w+ \d+\) is .* but the kernel reads"
                )

    def _assert_refused(self, call, buffers, pattern):
        inputs, results = buffers
        with self.assertRaisesRegex(ffi_checks.LayoutError, pattern):
            ffi_checks.check_call(call.dims, call.order, call.names, inputs, results)
        code, message, _ = self._native(call, inputs, results)
        self.assertEqual(code, _INVALID_ARGUMENT, message)
        self.assertRegex(message, pattern)

    def test_kernel_modes_are_the_buffers_layouts(self):
        # The exact (shape, strides) each tensor is passed in: the checks above only bound a
        # tensor's span, which a transposed or wrongly split layout of the same elements passes
        # (the kernel would then read the wrong elements).
        cases = dict((n, m) for n, _, m in _CASES)

        def layouts(name):
            (call,) = _exported_calls("sm_90a", cases[name])
            decoded = ffi_checks.decode(call.dims, call.names, len(call.order))
            return {t.name: (t.shape, t.strides) for t in decoded}

        got = layouts("sm90_128x256x64")  # a [m, k], b [k, n], d [m, n], row-major
        self.assertEqual(got["a"], ((128, 64, 1), (64, 1, 128 * 64)))
        self.assertEqual(got["b"], ((256, 64, 1), (1, 256, 256 * 64)))
        self.assertEqual(got["d"], ((128, 256, 1), (256, 1, 128 * 256)))
        got = layouts("sm90_transposed")  # a [k, m] = (320, 96), b [n, k] = (256, 320)
        self.assertEqual(got["a"], ((96, 320, 1), (1, 96, 96 * 320)))
        self.assertEqual(got["b"], ((256, 320, 1), (320, 1, 256 * 320)))
        got = layouts("sm90_batched_c")  # c [4, 136, 200]
        self.assertEqual(got["c"], ((136, 200, 4), (200, 1, 136 * 200)))
        got = layouts("sm90_64x4096x4096")  # split-K: (rows, k / s, s) views of a and b
        (n, kc, splits), strides = got["b"]
        self.assertEqual((n, kc * splits), (4096, 4096))
        self.assertEqual(strides, (1, n, kc * n))
        self.assertEqual(got["a"][1], (4096, 1, kc))

    @parameterized.parameters("fp8_block128", "fp8_block128x128")
    def test_quantize_call_ties_its_results_to_x(self, recipe):
        # quantize_both's kernel stores q, s, qt and st over x's grid without a TMA descriptor's
        # bounds: its call ties each of their extents to x's. x declared with twice its rows
        # (and its buffer grown to match, so that x's own span check passes) breaks the ties.
        (call,) = _exported_calls(
            "sm_90a", lambda: (lambda x: jax_sm100.quantize_both(x, recipe), (_s(2, 256, 384),))
        )
        layouts, ties = ffi_checks.decode_call(call.dims, call.names, len(call.order))
        self.assertLen(ties, 12)
        self.assertEqual({t.other for t in ties}, {"x"})
        self.assertEqual({t.name for t in ties}, {"q", "s", "qt", "st"})
        x = layouts[0]
        self.assertEqual((x.name, x.shape), ("x", (256, 384, 2)))
        dims = list(call.dims)
        dims[5] = 512  # x's rows (format, dtype, rank, masks, then its shape)
        inputs = [((2, 512, 384), "bfloat16")]
        with self.assertRaisesRegex(ffi_checks.LayoutError, "which times 1 is not tensor 'x''s"):
            ffi_checks.check_call(dims, call.order, call.names, inputs, call.results)
        code, message, _ = ffi.check_call(dims, call.order, call.names, _counts(inputs),
                                          _counts(call.results))  # fmt: skip
        self.assertEqual(code, _INVALID_ARGUMENT)
        self.assertIn("tensor 'q' has extent 256 in mode 0, which times 1 is not tensor 'x''s "
                      "extent 512", message)  # fmt: skip

    @parameterized.parameters(("sm90_folded_batch", "bias"), ("sm90_batched_c", "c"))
    def test_epilogue_operands_are_tied_to_d(self, case, name):
        # The epilogue reads bias and an unstaged C by D's extents with plain loads: a module
        # declaring either smaller than D (its buffer shrunk to match, so that its own span
        # check passes) is refused rather than read past its buffer.
        (call,) = _exported_calls("sm_90a", dict((n, m) for n, _, m in _CASES)[case])
        layouts, ties = ffi_checks.decode_call(call.dims, call.names, len(call.order))
        self.assertEqual({t.other for t in ties if t.name == name}, {"d"})
        at = [t.name for t in layouts].index(name)
        t = layouts[at]
        small = dataclasses.replace(t, shape=(t.shape[0] // 2, *t.shape[1:]))
        dims, names = ffi_checks.encode([*layouts[:at], small, *layouts[at + 1 :]], ties)
        inputs = list(call.inputs)
        which = call.order[at]
        inputs[which] = ((small.span,), inputs[which][1])
        with self.assertRaisesRegex(ffi_checks.LayoutError, f"tensor '{name}' has extent"):
            ffi_checks.check_call(dims, call.order, names, inputs, call.results)
        code, message, _ = ffi.check_call(dims, call.order, names, _counts(inputs),
                                          _counts(call.results))  # fmt: skip
        self.assertEqual(code, _INVALID_ARGUMENT)
        self.assertIn(f"tensor '{name}' has extent {small.shape[0]} in mode 0", message)

    @parameterized.parameters(
        # (case, tensor, mode): halving that extent keeps every tensor inside its buffer (the
        # span shrinks), so only its tie refuses the call: the kernel would compute the
        # problem of the other operands' extents, zero-filling or leaving results unwritten.
        ("sm90_128x256x64", "b", 1),  # k
        ("sm90_batched_c", "d", 0),  # m, a result
        ("sm90_batched_c", "a", 2),  # the batch
        ("sm90_64x4096x4096", "b", 0),  # a split-K product's n
        ("sm90_split_in_cluster", "b", 2),  # the splits, summed in the kernel
        ("sm90_scaled", "sfa", 0),
        ("sm90_scaled", "sfb", 1),  # k-blocks
        ("sm90_ragged_dot_bias", "bias", 1),  # groups
        ("sm90_ragged_dot_bias", "b", 2),  # experts
        ("sm90_ragged_dot_bias", "group_sizes", 0),
        ("sm90_ragged_dot_grad", "d", 2),  # d rhs: one result per group
    )  # fmt: skip
    def test_operands_are_tied_to_the_problem(self, case, name, mode):
        cases = dict((n, m) for n, _, m in _CASES)
        for call in _exported_calls("sm_90a", cases[case]):  # the call whose `name` has `mode`
            layouts, ties = ffi_checks.decode_call(call.dims, call.names, len(call.order))
            at = [t.name for t in layouts].index(name) if name in call.names.split(",") else -1
            if at >= 0 and mode < len(layouts[at].shape):
                break
        else:
            self.fail(f"no call of {case} has a tensor {name!r} with mode {mode}")
        t = layouts[at]
        shape = list(t.shape)
        shape[mode] //= 2
        edited = [*layouts[:at], dataclasses.replace(t, shape=tuple(shape)), *layouts[at + 1 :]]
        pattern = r"tensor '\w+' has extent \d+ in mode \d, which (times|is not ceil)"
        message = self._assert_layouts_refused(call, edited, ties, pattern)
        self.assertIn(name, message)

    def _assert_layouts_refused(self, call, layouts, ties, pattern) -> str:
        """`call` with `layouts` and `ties` encoded in place of its own is refused in Python
        and C++ alike, with `pattern`; returns the handler's message."""
        dims, names = ffi_checks.encode(layouts, ties)
        with self.assertRaisesRegex(ffi_checks.LayoutError, pattern):
            ffi_checks.check_call(dims, call.order, names, call.inputs, call.results)
        code, message, _ = ffi.check_call(dims, call.order, names, _counts(call.inputs),
                                          _counts(call.results))  # fmt: skip
        self.assertEqual(code, _INVALID_ARGUMENT)
        self.assertRegex(message, pattern)
        return message

    def test_a_tie_divides_by_a_positive_int(self):
        for divisor in (0, -128, 2.0):
            with self.assertRaisesRegex(ValueError, "divisor must be a positive int"):
                ffi_checks.Tie("s", 0, "x", 0, divisor)

    def test_tile_scales_are_tied_by_ceil(self):
        # B scaled per 128 x 128 tile: sfb holds ceil(n / 128) rows, tied by a ceil tie
        # (encoded as a negative divisor); n = 200 here, so 2 rows.
        args = (_s(1, 256, 256, dtype=jnp.float8_e4m3fn), _s(1, 200, 256, dtype=jnp.float8_e4m3fn),
                _s(1, 256, 2, dtype=jnp.float32), _s(1, 2, 2, dtype=jnp.float32))  # fmt: skip
        (call,) = _exported_calls(
            "sm_90a",
            lambda: (
                lambda *a: jax_sm100.scaled_matmul(*a, preferred_element_type=jnp.bfloat16),
                args,
            ),
        )
        layouts, ties = ffi_checks.decode_call(call.dims, call.names, len(call.order))
        self.assertIn(ffi_checks.Tie("sfb", 0, "b", 0, 128, ceil=True), ties)
        sfb = [t for t in layouts if t.name == "sfb"][0]
        self.assertEqual(sfb.shape[0], 2)
        self.assertIn(-128, call.dims)
        at = [t.name for t in layouts].index("sfb")
        edited = list(layouts)
        edited[at] = dataclasses.replace(sfb, shape=(1, *sfb.shape[1:]))
        message = (r"tensor 'sfb' has extent 1 in mode 0, which is not ceil\(tensor 'b''s "
                   r"extent 200 in mode 0 / 128\)")  # fmt: skip
        self._assert_layouts_refused(call, edited, ties, message)

    def test_checks_cost_under_a_microsecond(self):
        # The execute stage's checks of the call with the most tensors (stream-K: a, b, d, ws,
        # flags), the fastest of 20 rounds so that other processes on the machine do not count.
        (call,) = _exported_calls("sm_90a", dict((n, m) for n, _, m in _CASES)["sm90_stream_k"])
        rounds = [self._native(call, call.inputs, call.results, repeats=10_000)[2]
                  for _ in range(20)]  # fmt: skip
        self.assertLess(min(rounds), 1000.0, f"the handler's per-call checks took {rounds} ns")

    def test_order_naming_a_missing_buffer_is_refused(self):
        (call,) = _exported_calls("sm_90a", lambda: _matmul_case(128, 256, 64))
        order = [*call.order[:-1], len(call.inputs)]
        with self.assertRaisesRegex(ffi_checks.LayoutError, "but the call has 3 inputs"):
            ffi_checks.check_call(call.dims, order, call.names, call.inputs, call.results)
        code, message, _ = ffi.check_call(call.dims, order, call.names, _counts(call.inputs),
                                          _counts(call.results))  # fmt: skip
        self.assertEqual(code, _INVALID_ARGUMENT)
        self.assertIn("but the call has 3 inputs and 1 results", message)


def _count(shape) -> int:
    return int(np.prod(shape, dtype=np.int64))


def _buffer_count(call: _Call, which: int) -> int:
    shape, _ = call.inputs[which] if which >= 0 else call.results[-1 - which]
    return _count(shape)


def _replace_buffer(call: _Call, which: int, edit):
    inputs, results = list(call.inputs), list(call.results)
    pool, i = (inputs, which) if which >= 0 else (results, -1 - which)
    pool[i] = edit(*pool[i])
    return inputs, results


# ------------------------------------------------------------------------ the native library


@absltest.skipUnless(_HAS_CXX, _NEEDS_CXX)
class NativeTest(parameterized.TestCase):
    def test_builds_without_warnings(self):
        cxx = os.environ.get("CXX") or shutil.which("g++") or shutil.which("c++")
        with tempfile.TemporaryDirectory() as tmp:
            cmd = ffi.compile_command(
                cxx, ffi.source_path(), jax.ffi.include_dir(), Path(tmp, "lib.so")
            )
            proc = subprocess.run([*cmd, "-Werror"], capture_output=True, text=True)
        self.assertEqual(proc.returncode, 0, proc.stderr)
        self.assertEqual(proc.stderr, "")

    @parameterized.parameters(0, 1, 55, 56, 63, 64, 65, 119, 1000, 200_003)
    def test_sha256_matches_hashlib(self, size):
        data = np.random.default_rng(size).integers(0, 256, size, dtype=np.uint8).tobytes()
        out = bytes(65)
        ffi.library().JaxSm100_Sha256Hex(data, size, out)
        self.assertEqual(out[:64].decode(), hashlib.sha256(data).hexdigest())
        if size == 0:  # an empty attribute: no data pointer at all
            ffi.library().JaxSm100_Sha256Hex(None, 0, out)
            self.assertEqual(out[:64].decode(), hashlib.sha256(b"").hexdigest())


# ---------------------------------------------------------------------------------- trust


class TrustTest(absltest.TestCase):
    def setUp(self):
        super().setUp()
        tmp = Path(self.enterContext(tempfile.TemporaryDirectory()))
        self.dir = tmp / "cache"
        self.dir.mkdir(mode=0o700)
        self.enterContext(mock.patch.dict(os.environ))
        os.environ.pop(disk_cache.TRUSTED_DIRS_ENV, None)
        self.key = "ab" * 32
        self.entry = disk_cache.CacheEntry(b"\x7fELF object", {"prefix": "k"})

    def _cache(self, directory=None):
        return disk_cache.KernelCache(directory or self.dir)

    def test_private_folder_is_used(self):
        self._cache().put(self.key, self.entry)
        cache = self._cache()
        self.assertEqual(cache.get(self.key), self.entry)
        self.assertEqual(cache.stats().disk_hits, 1)

    def test_group_writable_folder_is_refused(self):
        self._cache().put(self.key, self.entry)
        os.chmod(self.dir, 0o775)
        cache = self._cache()
        with self.assertRaisesRegex(disk_cache.UntrustedCacheError,
                                    r"writable by group or others \(mode 0775\).*chmod go-w "
                                    + re.escape(str(self.dir))) as cm:  # fmt: skip
            cache.get(self.key)
        self.assertIn(disk_cache.TRUSTED_DIRS_ENV, str(cm.exception))
        self.assertIn("native host code", str(cm.exception))
        build = mock.Mock()
        with self.assertRaises(disk_cache.UntrustedCacheError):
            cache.get_or_create(self.key, build)
        build.assert_not_called()

    def test_trusted_dirs_opt_a_shared_folder_in(self):
        self._cache().put(self.key, self.entry)
        os.chmod(self.dir, 0o775)
        os.environ[disk_cache.TRUSTED_DIRS_ENV] = os.pathsep.join(["/nonexistent", str(self.dir)])
        self.assertEqual(self._cache().get(self.key), self.entry)
        # A folder below a trusted one is trusted too.
        os.environ[disk_cache.TRUSTED_DIRS_ENV] = str(self.dir.parent)
        self.assertEqual(self._cache().get(self.key), self.entry)

    def test_writable_entry_is_refused(self):
        self._cache().put(self.key, self.entry)
        path = self._cache().entry_path(self.key)
        os.chmod(path, 0o666)
        with self.assertRaisesRegex(disk_cache.UntrustedCacheError,
                                    "(?s)writable by group or others.*chmod go-w"):  # fmt: skip
            self._cache().get(self.key)

    def test_ancestor_writable_by_others_is_refused_unless_sticky(self):
        shared = self.dir.parent / "shared"
        shared.mkdir()
        inner = shared / "cache"
        self._cache(inner).put(self.key, self.entry)
        os.chmod(shared, 0o777)
        with self.assertRaisesRegex(disk_cache.UntrustedCacheError,
                                    f"its ancestor {re.escape(str(shared))} .*0777"):  # fmt: skip
            self._cache(inner).get(self.key)
        os.chmod(shared, 0o1777)  # sticky, like /tmp: others cannot rename our folder
        self.assertEqual(self._cache(inner).get(self.key), self.entry)

    @absltest.skipUnless(hasattr(os, "geteuid") and os.geteuid() == 0, "chown needs root")
    def test_folder_of_another_user_is_refused(self):
        self._cache().put(self.key, self.entry)
        os.chown(self.dir, 12345, -1)
        with self.assertRaisesRegex(disk_cache.UntrustedCacheError, "owned by uid 12345"):
            self._cache().get(self.key)
        os.chown(self.dir, 0, -1)
        os.chown(self._cache().entry_path(self.key), 12345, -1)
        with self.assertRaisesRegex(disk_cache.UntrustedCacheError, "owned by uid 12345"):
            self._cache().get(self.key)

    def test_trusted_dir_does_not_trust_a_sibling_with_its_prefix(self):
        evil = self.dir.parent / (self.dir.name + "-evil")
        evil.mkdir(mode=0o700)
        self._cache(evil).put(self.key, self.entry)
        os.chmod(evil, 0o777)
        os.environ[disk_cache.TRUSTED_DIRS_ENV] = str(self.dir)
        with self.assertRaises(disk_cache.UntrustedCacheError):
            self._cache(evil).get(self.key)

    def test_group_writable_ancestor_is_refused(self):
        inner = self.dir / "shared" / "cache"
        self._cache(inner).put(self.key, self.entry)
        os.chmod(self.dir / "shared", 0o775)
        with self.assertRaisesRegex(disk_cache.UntrustedCacheError, "ancestor"):
            self._cache(inner).get(self.key)

    def test_writable_cached_ffi_library_is_refused(self):
        # A handler library planted in the cache folder (a file others can write), where the
        # folder itself is private: not loaded.
        key = ffi._build_key(ffi.source_path().read_bytes(), jax.ffi.include_dir())
        planted = self.dir / f"ffi-{key}" / "libjax_sm100_ffi.so"
        planted.parent.mkdir(mode=0o700)
        planted.write_bytes(b"not a library")
        os.chmod(planted, 0o666)
        os.environ["JAX_SM100_CACHE_DIR"] = str(self.dir)
        os.environ.pop("JAX_SM100_FFI_LIB", None)
        with self.assertRaisesRegex(disk_cache.UntrustedCacheError, "chmod go-w"):
            ffi.build()

    def test_new_folder_is_private_under_a_permissive_umask(self):
        new = self.dir / "sub" / "cache"
        old = os.umask(0o002)
        try:
            self._cache(new).put(self.key, self.entry)
        finally:
            os.umask(old)
        self.assertEqual(stat.S_IMODE(os.stat(new).st_mode), 0o700)
        self.assertEqual(stat.S_IMODE(os.stat(new.parent).st_mode), 0o700)
        self.assertEqual(stat.S_IMODE(os.stat(self._cache(new).entry_path(self.key)).st_mode),
                         0o644)  # fmt: skip
        self.assertEqual(self._cache(new).get(self.key), self.entry)

    @absltest.skipUnless(_HAS_CXX, _NEEDS_CXX)
    def test_cached_ffi_library_in_a_group_writable_folder_is_refused(self):
        key = ffi._build_key(ffi.source_path().read_bytes(), jax.ffi.include_dir())
        planted = self.dir / f"ffi-{key}" / "libjax_sm100_ffi.so"
        planted.parent.mkdir(mode=0o700)
        planted.write_bytes(b"not a library")
        os.environ["JAX_SM100_CACHE_DIR"] = str(self.dir)
        os.environ.pop("JAX_SM100_FFI_LIB", None)
        os.chmod(planted.parent, 0o775)
        with self.assertRaisesRegex(disk_cache.UntrustedCacheError, "chmod go-w"):
            ffi.build()
        os.chmod(planted.parent, 0o700)
        self.assertEqual(ffi.build(), planted)

    def test_ffi_library_is_not_built_in_a_folder_others_can_write(self):
        # The first build is refused where a library found later would be (it was built, and
        # loaded, there).
        os.environ["JAX_SM100_CACHE_DIR"] = str(self.dir)
        os.environ.pop("JAX_SM100_FFI_LIB", None)
        os.environ["CXX"] = "/nonexistent/c++"  # no compile may start
        os.chmod(self.dir, 0o777)
        with self.assertRaisesRegex(disk_cache.UntrustedCacheError, "chmod go-w"):
            ffi.build()
        os.chmod(self.dir, 0o700)
        key = ffi._build_key(ffi.source_path().read_bytes(), jax.ffi.include_dir())
        (self.dir / f"ffi-{key}").chmod(0o770)  # made by the first try, modes kept
        with self.assertRaisesRegex(disk_cache.UntrustedCacheError, f"ffi-{key}"):
            ffi.build()

    def test_default_folder_not_private_is_passed_over(self):
        # The default cache folder under a group-writable ~/.cache (umask 002): the handler is
        # built in a private temporary folder, with a warning naming the fix, not refused (as
        # the kernel cache keeps to memory there); named by JAX_SM100_CACHE_DIR, refused.
        home = self.dir.parent / "home"
        (home / ".cache").mkdir(parents=True)
        os.chmod(home / ".cache", 0o775)
        fake_cxx = self.dir.parent / "fake-c++"  # "builds" by creating its -o file
        fake_cxx.write_text('#!/bin/sh\nwhile [ $# -gt 0 ]; do [ "$1" = -o ] && : > "$2"; '
                            "shift; done\n")  # fmt: skip
        fake_cxx.chmod(0o755)
        for name in ("JAX_SM100_CACHE_DIR", "JAX_SM100_FFI_LIB", "XDG_CACHE_HOME"):
            os.environ.pop(name, None)
        os.environ.update(HOME=str(home), CXX=str(fake_cxx))
        with self.assertLogs(disk_cache.logger, "WARNING") as logs:
            lib = ffi.build()
        self.assertIn("chmod go-w", "".join(logs.output))
        self.assertTrue(lib.is_file())
        self.assertNotIn(home, lib.parents)
        # python -m jax_sm100.build_ffi prints a path to ship: never the temporary folder.
        with self.assertRaisesRegex(disk_cache.UntrustedCacheError, "chmod go-w"):
            ffi.build(lasting=True)
        os.environ["JAX_SM100_CACHE_DIR"] = str(home / ".cache" / "jax_sm100")
        with self.assertRaisesRegex(disk_cache.UntrustedCacheError, "chmod go-w"):
            ffi.build()

    def test_ffi_build_without_a_working_compiler(self):
        # A compiler that cannot run raises FfiBuildError naming the fix, and leaves no
        # temporary file behind (it raised a bare FileNotFoundError and left one a try).
        os.environ["JAX_SM100_CACHE_DIR"] = str(self.dir)
        os.environ.pop("JAX_SM100_FFI_LIB", None)
        os.environ["CXX"] = "/nonexistent/c++"
        for _ in range(2):
            with self.assertRaisesRegex(ffi.FfiBuildError, "(?s)C\\+\\+17 compiler.*did not run"):
                ffi.build()
        (folder,) = self.dir.glob("ffi-*")
        self.assertEqual(list(folder.iterdir()), [])

    def test_no_build_at_import_where_jax_platforms_leaves_cuda_out(self):
        for platforms, excluded in ((None, False), ("", False), ("cpu", True), ("cuda,cpu", False),
                                    ("gpu", False), (" CPU , tpu", True)):  # fmt: skip
            self.assertEqual(ffi.cuda_excluded(platforms), excluded, platforms)
        with (
            mock.patch.object(ffi, "cuda_plugin_installed", return_value=True),
            mock.patch.object(ffi, "cuda_excluded", return_value=True),
            mock.patch.object(ffi, "register") as register,
        ):
            self.assertFalse(ffi.register_if_cuda())
        register.assert_not_called()

    def test_ffi_library_key_names_the_host(self):
        src, include = ffi.source_path().read_bytes(), jax.ffi.include_dir()
        with mock.patch.object(ffi.platform, "machine", return_value="aarch64"):
            other = ffi._build_key(src, include)
        self.assertNotEqual(other, ffi._build_key(src, include))

    @absltest.skipUnless(_HAS_CXX, "the CUDA lowering registers the FFI handler: needs g++/c++")
    def test_lowering_with_a_group_writable_cache_fails_with_the_fix(self):
        # End to end in a fresh process: the kernel cache it reads at its first compile.
        os.chmod(self.dir, 0o770)
        code = (
            "import jax, jax.numpy as jnp, jax_sm100\n"
            "a = jax.ShapeDtypeStruct((1024, 1024), jnp.bfloat16)\n"
            "b = jax.ShapeDtypeStruct((1024, 4096), jnp.bfloat16)\n"
            "jax.export.export(jax.jit(jax_sm100.matmul), platforms=['cuda'],\n"
            "                  disabled_checks=jax_sm100.export_disabled_checks())(a, b)\n"
        )
        # The handler library from the default location, built before the folder is set.
        lib = str(ffi.build())
        env = dict(os.environ, JAX_SM100_CACHE_DIR=str(self.dir), JAX_SM100_TARGET_ARCH="sm_90a",
                   JAX_PLATFORMS="cpu", JAX_SM100_FFI_LIB=lib)  # fmt: skip
        proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                              env=env, timeout=600)  # fmt: skip
        self.assertNotEqual(proc.returncode, 0)
        self.assertIn("UntrustedCacheError", proc.stderr)
        self.assertIn(f"chmod go-w {self.dir}", proc.stderr)


if __name__ == "__main__":
    absltest.main()
