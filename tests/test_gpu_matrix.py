"""The GPU correctness matrix: every dtype, epilogue, layout, batch form and SM90 schedule.

Each case runs a product through `jax.jit` on an SM90 device and asserts it against float32
math (float64 for float64 operands) on the same device, from the same rounded inputs: the
result's shape, dtype and finiteness, its relative Frobenius error under the result dtype's
entry of `TOL`, and the path it took, read back from `jax_sm100.last_lowering()`: our kernel
wherever `jax_sm100.plan` says a kernel can take the problem and XLA's dot elsewhere, and for a
forced schedule that schedule. Randomized cases are drawn from seeded generators at import and
named with their shapes, so a failure names its case and reproduces. Run on the H200 with the
other GPU suites (sized for about 3 minutes there, most of it kernel compiles; not yet timed):

    XLA_PYTHON_CLIENT_PREALLOCATE=false python3 -m pytest -n 8 -q \\
        tests/test_gpu_training.py tests/test_gpu.py tests/test_gpu_matrix.py

Skipped without an SM90 CUDA device. Small problems are put on our kernels
(`JAX_SM100_SMALL_PROBLEMS=kernel`) except in `RoutingTest`, which checks the planner's own
routing. 182 cases:

- `MatrixTest` (64): random problems, sizes 1 to 1024 (not multiples of the tiles), bfloat16
  and float16 operands in every layout, 16-bit or float32 outputs, every activation, alpha,
  beta * C (C broadcast or not, in the output's dtype or float32), bias (float32 or 16-bit),
  batch dims, each operand broadcast or not; the planner's plans.
- `EdgeTest` (11): m, n or k = 1, the smallest aligned problem, misaligned rows.
- `DtypeTest` (21): fp8 (e4m3, e5m2) on the kernel and with an epilogue; fp8 outputs, mixed
  fp8 operands, fp8 C and fp8 with an N-major B or M-major A, on the kernel in the form the
  lowering gives them; float32, float64 and mixed 16-bit operands, which run on XLA's dot.
- `RoutingTest` (5): the planner's small-problem rule, bfloat16 and fp8.
- `ScheduleTest` (20): each cooperative tile, cluster, raster and swizzle the planner uses,
  64-wide epilogue sub-tiles, each ping-pong tile and the ping-pong walk along N; two problems
  each (one batched), one random epilogue and layout per schedule.
- `StreamKTest` (16): stream-K in every cooperative tile and cluster on problems with more tiles
  than clusters; the large shapes, bitwise stable over 20 replays, no worse than without it.
- `PingPongTest` (11): the planner's own ping-pong plans at the large shapes, 16-bit and fp8.
- `SplitKTest` (17): split-K in the cluster (every factor and split tile, random problems), the
  planner's XLA-reduced split-K, and the splits a call cannot take.
- `VmapTest` (5), `GradTest` (5): vmap forms and gradients beyond tests/test_gpu_training.py.
- `GraphReplayTest` (1): the kernels in CUDA-graph command buffers, replayed 50 times.
- `SanitizedCasesTest` (10) and `SanitizerTest` (2): cases that `SanitizerTest` reruns under
  compute-sanitizer's memcheck and racecheck when `JAX_SM100_SANITIZE=memcheck,racecheck` is
  set (minutes each, so they are skipped otherwise).

Schedules are forced in one place, `_force`, through the public plan edits of
`jax_sm100.tuning` (`cooperative`, `sm90_variant`, `with_split`). One private name is used:
`jax_sm100._src.primitive.matmul_p`, bound only by `_bind` (the one way to pass a transposed
operand, as the backward products do).
"""

from __future__ import annotations

import dataclasses
import math
import os
import shutil
import subprocess
import sys
import zlib
from pathlib import Path
from unittest import mock

import jax
import jax.numpy as jnp
import numpy as np
from absl.testing import absltest, parameterized

import jax_sm100
from jax_sm100 import tuning
from jax_sm100._src import dispatch
from jax_sm100._src.primitive import matmul_p

ACTS = (None, "relu", "gelu", "silu")
_ACT_FNS = {
    None: lambda z: z,
    "relu": jax.nn.relu,
    "gelu": lambda z: jax.nn.gelu(z, approximate=True),
    "silu": jax.nn.silu,
}
_HIGHEST = jax.lax.Precision.HIGHEST

# Relative Frobenius error allowed, by the dtype of the checked result: (forward, gradient).
# Rounding a float32 result to a dtype of unit roundoff u moves it by at most u in this norm
# (bfloat16 2^-8, float16 2^-11, e4m3 2^-4, e5m2 2^-3); the forward tolerances leave 2-4x for
# the epilogue's fast tanh/exp and for fp8's reduced-precision MMA accumulation (bfloat16
# results of fp8 products measured 1.7e-3 to 2.1e-3 on the H200, k up to 4096). A gradient
# carries two roundings (its cotangent's and its own).
TOL = {
    "float64": (1e-10, 1e-10),
    "float32": (2e-3, 2e-3),
    "float16": (2e-3, 5e-3),
    "bfloat16": (1e-2, 2e-2),
    "float8_e4m3fn": (1.5e-1, 2e-1),
    "float8_e5m2": (3e-1, 4e-1),
}
_SHORT = {"bfloat16": "bf16", "float16": "f16", "float32": "f32", "float64": "f64",
          "float8_e4m3fn": "e4m3", "float8_e5m2": "e5m2"}  # fmt: skip


def _sm90_device() -> bool:
    try:
        dev = jax.devices("gpu")[0]
    except RuntimeError:
        return False
    # The library's own rule (dispatch.ARCH_OF_CAPABILITY); on a 9.0 GPU it must take it.
    target = dispatch._target_of(dev)
    if str(getattr(dev, "compute_capability", "")) == "9.0":
        assert target is not None and target.arch == "sm_90a", (dev, target)
    return target is not None and target.arch == "sm_90a"


_SKIP = (not _sm90_device(), "needs an SM90 (Hopper) CUDA device and jax[cuda]")


# --- cases -------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Case:
    """One product at the primitive's rank: every operand has the same number of batch dims,
    each of them the output's size or 1 (broadcast).

    a is [*a_batch, m, k] ([*a_batch, k, m] with `transpose_a`), b is [*b_batch, k, n]
    ([*b_batch, n, k] with `transpose_b`), C (dtype `c`, None for none) is [*batch, m, n] or,
    with `c_broadcast`, [1, ..., m, n]; bias (dtype `bias`) is [n].
    """

    m: int
    n: int
    k: int
    dtype: str = "bfloat16"
    b_dtype: str | None = None  # None: dtype
    out_dtype: str | None = None  # None: dtype (bfloat16 for fp8 operands)
    a_batch: tuple[int, ...] = ()
    b_batch: tuple[int, ...] = ()
    c: str | None = None
    c_broadcast: bool = False
    bias: str | None = None
    transpose_a: bool = False
    transpose_b: bool = False
    activation: str | None = None
    alpha: float = 1.0
    beta: float = 1.0
    seed: int = 0

    @property
    def out(self) -> str:
        if self.out_dtype:
            return self.out_dtype
        return "bfloat16" if self.dtype.startswith("float8") else self.dtype

    @property
    def batch(self) -> tuple[int, ...]:
        return tuple(max(x, y) for x, y in zip(self.a_batch, self.b_batch, strict=True))

    @property
    def shape(self) -> str:
        return "x".join(str(d) for d in (*self.batch, self.m, self.n, self.k))

    @property
    def name(self) -> str:
        dt = _SHORT[self.dtype] + (f"_{_SHORT[self.b_dtype]}" if self.b_dtype else "")
        parts = [dt, self.shape, "TN"[not self.transpose_a] + "TN"[not self.transpose_b]]
        if self.a_batch != self.b_batch:
            parts.append("bcast_a" if math.prod(self.a_batch) == 1 else "bcast_b")
            if 1 < math.prod(self.a_batch) < math.prod(self.batch):
                parts[-1] = "bcast_ab"
        parts += [self.activation] if self.activation else []
        if self.alpha != 1.0:
            parts.append(f"alpha{self.alpha:g}".replace(".", "p").replace("-", "m"))
        if self.c:
            parts.append("c" + ("" if self.c == self.out else _SHORT[self.c]))
            parts += [f"beta{self.beta:g}".replace(".", "p")] if self.beta != 1.0 else []
            parts += ["bcast_c"] if self.c_broadcast and self.batch else []
        if self.bias:
            parts.append("bias" + ("" if self.bias == "float32" else _SHORT[self.bias]))
        if self.out != self.dtype:
            parts.append("to_" + _SHORT[self.out])
        return "_".join(p for p in parts if p)

    def kernel_can_take(self) -> bool:
        """Whether the public planner says our SM90 kernel can run this product (the one
        statement of the kernels' dtype and alignment rules), in the form the lowering gives
        it (`dispatch.kernel_form`: fp8 widened, transposed K-major, results in float32)."""
        a = jax.ShapeDtypeStruct((self.k, self.m) if self.transpose_a else (self.m, self.k),
                                 self.dtype)  # fmt: skip
        b = jax.ShapeDtypeStruct((self.n, self.k) if self.transpose_b else (self.k, self.n),
                                 self.b_dtype or self.dtype)  # fmt: skip
        c = None if self.c is None else jax.ShapeDtypeStruct((self.m, self.n), self.c)
        f = dispatch.kernel_form_of(a, b, c, transpose_a=self.transpose_a,
                                    transpose_b=self.transpose_b, out_dtype=self.out,
                                    arch="sm_90a")  # fmt: skip
        p = jax_sm100.plan(
            self.m, self.n, self.k, a_dtype=f.a.dtype, b_dtype=f.b.dtype, out_dtype=f.out_dtype,
            c_dtype=None if f.c is None else f.c.dtype, arch="sm_90a",
            a_major="m" if f.transpose_a else "k", b_major="k" if f.transpose_b else "n",
            force_kernel=True,
        )  # fmt: skip
        return p.kernel != "xla_dot"

    def plan(self) -> jax_sm100.GemmPlan:
        """The planner's sm_90a plan for this product, small problems on the kernel. Only for
        cases whose batch does not fold into m (B shared by a batched, K-major A), which a
        plan would have to be made for as one GEMM of batch * m rows."""
        assert self.a_batch == self.b_batch, "forced schedules take fully batched operands"
        return jax_sm100.plan(
            self.m, self.n, self.k, a_dtype=self.dtype, b_dtype=self.b_dtype or self.dtype,
            out_dtype=self.out, c_dtype=self.c, batch=math.prod(self.batch), arch="sm_90a",
            a_major="m" if self.transpose_a else "k", b_major="k" if self.transpose_b else "n",
            force_kernel=True,
        )  # fmt: skip


def _named(cases, prefix=""):
    """(name, case) pairs; with a prefix, numbered (random cases may share a name)."""
    if prefix:
        return [(f"{prefix}{i:02d}_{c.name}", c) for i, c in enumerate(cases)]
    return [(c.name, c) for c in cases]


def _dims(rng, transpose_a, sizes_m, sizes_n, sizes_k):
    """(m, n, k) from the given sizes; every contiguous dim a multiple of 8 (TMA's 16 bytes)."""
    m = int(rng.choice(sizes_m))
    n = max(8, int(rng.choice(sizes_n)) // 8 * 8)
    k = max(8, int(rng.choice(sizes_k)) // 8 * 8)
    if transpose_a:
        m = max(8, m // 8 * 8)
    return m, n, k


# (a's, b's batch dims) at the primitive's rank; a 1 broadcasts. B shared by a batched A folds
# the batch into m (one GEMM); the other broadcasts are materialised.
_BATCHES = (
    ((), ()), ((), ()), ((3,), (3,)), ((2, 2), (2, 2)), ((3,), (1,)), ((1,), (3,)),
    ((2, 1), (1, 3)),
)  # fmt: skip
_SIZES = (1, 7, 8, 16, 64, 100, 128, 136, 200, 256, 384, 520, 1000, 1024)


def _random_spec(rng, dtype):
    """Random epilogue and layout fields of a Case (transposes, out dtype, C, bias, activation,
    alpha, beta)."""
    other = {"bfloat16": "float16", "float16": "bfloat16"}[dtype]
    out = str(rng.choice([dtype, dtype, dtype, "float32", other]))
    c = None
    if rng.random() < 0.4:
        c = out if rng.random() < 0.75 else "float32"
    return dict(
        transpose_a=bool(rng.integers(2)), transpose_b=bool(rng.integers(2)), out_dtype=out,
        c=c, beta=float(rng.choice([1.0, 0.75])) if c else 1.0,
        bias=[None, None, "float32", dtype][rng.integers(4)],
        activation=ACTS[rng.integers(4)], alpha=float(rng.choice([1.0, 1.0, 0.5, -1.5])),
    )  # fmt: skip


def _matrix_cases(count: int, seed: int) -> list[Case]:
    rng = np.random.default_rng(seed)
    cases = []
    for i in range(count):
        dtype = ("bfloat16", "float16")[i % 2]
        spec = _random_spec(rng, dtype)
        m, n, k = _dims(rng, spec["transpose_a"], _SIZES, _SIZES[3:], _SIZES[3:])
        a_batch, b_batch = _BATCHES[rng.integers(len(_BATCHES))]
        c_broadcast = bool(spec["c"]) and bool(a_batch) and bool(rng.integers(2))
        cases.append(Case(m, n, k, dtype, a_batch=a_batch, b_batch=b_batch,
                          c_broadcast=c_broadcast, seed=seed * 1000 + i, **spec))  # fmt: skip
    return cases


# --- running and checking ----------------------------------------------------------------------


def _normal(key, shape, dtype, scale=1.0):
    return (jax.random.normal(key, shape, jnp.float32) * scale).astype(dtype)


def _operands(case: Case):
    """a, b, bias, C of `case` (None where absent): normal random data on the device, B scaled
    by k^-1/2 (but fp8's) so that the product, C and bias weigh alike in the epilogue."""
    ka, kb, kc, kd = jax.random.split(jax.random.key(case.seed), 4)
    m, n, k = case.m, case.n, case.k
    b_dtype = case.b_dtype or case.dtype
    a = _normal(ka, (*case.a_batch, *((k, m) if case.transpose_a else (m, k))), case.dtype)
    b_scale = 1.0 if b_dtype.startswith("float8") else k**-0.5
    b_shape = (*case.b_batch, *((n, k) if case.transpose_b else (k, n)))
    b = _normal(kb, b_shape, b_dtype, b_scale)
    bias = None if case.bias is None else _normal(kd, (n,), case.bias)
    c = None
    if case.c is not None:
        c_batch = tuple(1 for _ in case.batch) if case.c_broadcast else case.batch
        c = _normal(kc, (*c_batch, m, n), case.c)
    return a, b, bias, c


def _bind(a, b, bias=None, c=None, *, out_dtype, plan=None, transpose_a=False,
          transpose_b=False, alpha=1.0, beta=1.0, activation=None, save_preact=False):  # fmt: skip
    """The primitive bound directly; bias [n] is brought to the primitive's rank here. With
    `save_preact`, (result, pre-activation)."""
    nb = a.ndim - 2
    args = [a, b]
    if bias is not None:
        args.append(bias.reshape((1,) * nb + bias.shape))
    if c is not None:
        args.append(c)
    outs = matmul_p.bind(
        *args, transpose_a=transpose_a, transpose_b=transpose_b, alpha=alpha, beta=beta,
        activation=activation, out_dtype=np.dtype(out_dtype), has_bias=bias is not None,
        has_c=c is not None, plan=plan, save_preact=save_preact, act_grad=None,
    )  # fmt: skip
    return tuple(outs) if save_preact else outs[0]


def _case_fn(case: Case, plan=None):
    """`case`'s product as a fresh jitted function of (a, b, bias, C), so that every call
    lowers (and records its plan) once."""
    kw = dict(out_dtype=case.out, plan=plan, transpose_a=case.transpose_a,
              transpose_b=case.transpose_b, alpha=case.alpha, beta=case.beta,
              activation=case.activation)  # fmt: skip
    return jax.jit(lambda a, b, bias, c: _bind(a, b, bias, c, **kw))


def _reference(case: Case, a, b, bias, c):
    """`case`'s math in float32 (float64 for float64 operands) at HIGHEST precision."""
    dts = {np.dtype(x.dtype) for x in (a, b)}
    t = jnp.float64 if np.dtype(np.float64) in dts else jnp.float32
    a, b = a.astype(t), b.astype(t)
    if case.transpose_a:
        a = jnp.swapaxes(a, -1, -2)
    if case.transpose_b:
        b = jnp.swapaxes(b, -1, -2)
    z = case.alpha * jnp.matmul(a, b, precision=_HIGHEST)
    if c is not None:
        z = z + case.beta * c.astype(t)
    if bias is not None:
        z = z + bias.astype(t)
    return _ACT_FNS[case.activation](z)


def _rel_err(got, want) -> float:
    got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
    return float(np.linalg.norm(got - want) / max(np.linalg.norm(want), 1e-30))


def _force(plan, *, coop=False, split=1, **variant):
    """`plan` with a schedule forced, the one use of `jax_sm100.tuning`'s edits: the planner's
    cooperative plan for the same problem (`coop`), unsplit (the planner splits K of skinny
    problems, and of wider ones of few tiles over a long k), then an SM90 variant (`variant`:
    tile_mn, cluster_mn, pingpong, stream_k, epi_n, swizzle_size, raster_along_m; A/B stages
    refilled), then, for `split` > 1, that many K slices summed inside a (1, split) cluster."""
    if coop:
        plan = tuning.cooperative(plan)
    if plan.split_k > 1 and split == 1:
        plan = tuning.with_split(plan, 1, reduce="xla")
    if variant:
        plan = tuning.sm90_variant(plan, **variant)
    if split > 1:
        plan = tuning.with_split(plan, split, reduce="cluster")
    return plan


# The plan fields that make a schedule (the SM count is the device's).
_SCHEDULE_FIELDS = (
    "kernel", "mma_tiler_mnk", "cluster_shape_mn", "pingpong", "stream_k", "split_k",
    "split_reduce", "raster_along_m", "swizzle_size", "epi_n", "stage_c", "swap_ab",
)  # fmt: skip


def _schedule(plan) -> dict:
    return {f: getattr(plan, f) for f in _SCHEDULE_FIELDS}


def _products(fn, *args) -> tuple[int, int]:
    """(our kernel calls, XLA products) in the compiled program of `fn`."""
    text = jax.jit(fn).lower(*args).compile().as_text()
    ours = text.count('custom_call_target="jax_sm100_gemm"')
    xla = sum(" dot(" in ln or '"__cublas' in ln for ln in text.splitlines())
    return ours, xla


class _GpuCase(parameterized.TestCase):
    """Small problems on our kernels (`small_problems = "xla"` keeps the planner's routing)."""

    small_problems = "kernel"

    def setUp(self):
        super().setUp()
        env = {"JAX_SM100_SMALL_PROBLEMS": self.small_problems}
        patcher = mock.patch.dict(os.environ, env)
        patcher.start()
        self.addCleanup(patcher.stop)

    def assert_close(self, got, want, dtype, what="result", grad=False):
        self.assertEqual(got.shape, want.shape, what)
        self.assertEqual(np.dtype(got.dtype).name, dtype, what)
        got64 = np.asarray(got, np.float64)
        self.assertTrue(np.isfinite(got64).all(), f"{what}: not finite")
        tol = TOL[dtype][grad]
        err = _rel_err(got64, want)
        self.assertLess(err, tol, f"{what}: relative error {err:.3g} >= {tol:g} ({dtype})")
        return err

    def run_case(self, case: Case, plan=None, check_path=True, same_plan=True):
        """Runs `case` (on `plan` when given, checking that it ran unchanged unless not
        `same_plan`), asserts it against the reference, and returns (result, how it lowered,
        operands, reference)."""
        ops = _operands(case)
        out = _case_fn(case, plan)(*ops)
        low = jax_sm100.last_lowering()
        want = _reference(case, *ops)
        self.assert_close(out, want, case.out, case.name)
        if check_path:
            ran = low is not None and low.plan is not None and low.plan.kernel != "xla_dot"
            self.assertEqual(ran, case.kernel_can_take(), f"{case.name}: lowered as {low}")
        if plan is not None and same_plan:
            self.assertEqual(_schedule(low.plan), _schedule(plan), case.name)
        return out, low, ops, want


# --- the random matrix and its edges -----------------------------------------------------------


@absltest.skipIf(*_SKIP)
class MatrixTest(_GpuCase):
    @parameterized.named_parameters(_named(_matrix_cases(64, seed=16), "r"))
    def test_case(self, case):
        self.run_case(case)


_EDGES = (
    Case(1, 256, 512, activation="gelu", bias="float32"),  # m = 1 (K-major A): the kernel
    Case(64, 1, 256),  # n = 1: D's rows are 2 bytes, under TMA's 16: XLA's dot
    Case(1, 1, 1),
    Case(128, 136, 1, transpose_a=True, c="bfloat16"),  # k = 1, M-major A, N-major B: kernel
    Case(100, 128, 1),  # k = 1 with a K-major A: XLA's dot
    Case(1, 128, 64, transpose_a=True),  # m = 1 with an M-major A: XLA's dot
    Case(1, 8, 8, activation="relu", bias="bfloat16"),  # the smallest problem the kernel takes
    Case(7, 8, 1000, transpose_b=True, activation="silu", out_dtype="float32"),
    Case(1000, 1000, 1000, "float16", c="float16", bias="float32", activation="gelu"),
    Case(100, 128, 100),  # k = 100: A's rows are 200 bytes: XLA's dot
    Case(100, 100, 128, c="bfloat16"),  # n = 100: B's, C's and D's rows misaligned: XLA's dot
)


@absltest.skipIf(*_SKIP)
class EdgeTest(_GpuCase):
    @parameterized.named_parameters(_named(_EDGES))
    def test_case(self, case):
        self.run_case(case)


_FP8 = ("float8_e4m3fn", "float8_e5m2")
_DTYPE_CASES = (
    # fp8 with K-major B (b stored [n, k]), the layout SM90's fp8 wgmma takes; 64x4096x4096
    # plans split-K.
    *(Case(m, n, k, dt, transpose_b=True) for dt in _FP8
      for m, n, k in ((128, 256, 512), (1000, 520, 256), (64, 4096, 4096), (4096, 4096, 4096))),
    Case(1000, 520, 256, "float8_e4m3fn", transpose_b=True, c="bfloat16", bias="bfloat16",
         activation="gelu", alpha=0.5, beta=0.75),
    Case(200, 264, 256, "float8_e5m2", transpose_b=True, out_dtype="float16", bias="float32",
         activation="relu"),
    Case(256, 512, 256, "float8_e4m3fn", transpose_b=True, out_dtype="float32", c="float32"),
    # An fp8 bias, which the kernels take converted to float32 (the epilogue's dtype).
    Case(1000, 520, 256, "float8_e4m3fn", transpose_b=True, bias="float8_e5m2",
         activation="gelu"),
    Case(1024, 1040, 512, "bfloat16", bias="float8_e4m3fn"),
    # The kernels' form of fp8 calls they cannot take as given (`dispatch.kernel_form`): an
    # N-major B or M-major A transposed by XLA, a float32 result rounded to fp8 by XLA, mixed
    # operands and an fp8 C widened.
    Case(256, 512, 256, "float8_e4m3fn"),  # fp8 with an N-major B
    Case(256, 512, 256, "float8_e5m2", transpose_a=True, bias="float32", activation="gelu"),
    Case(256, 512, 256, "float8_e4m3fn", transpose_b=True, out_dtype="float8_e4m3fn"),
    Case(256, 512, 256, "float8_e4m3fn", "float8_e5m2", transpose_b=True),
    Case(256, 512, 256, "float8_e4m3fn", "bfloat16", c="float8_e4m3fn"),
    # XLA's dot: what the kernels do not take.
    Case(256, 512, 256, "bfloat16", "float16", out_dtype="float32", activation="relu"),
    Case(200, 136, 520, "float32", bias="float32", activation="gelu"),
    Case(200, 136, 520, "float64", c="float64", activation="silu", alpha=0.5),
)  # fmt: skip


@absltest.skipIf(*_SKIP)
class DtypeTest(_GpuCase):
    @parameterized.named_parameters(_named(_DTYPE_CASES))
    def test_case(self, case):
        with jax.enable_x64(case.dtype == "float64"):
            self.run_case(case)


@absltest.skipIf(*_SKIP)
class RoutingTest(_GpuCase):
    """The planner's own routing: small sm_90a problems on XLA's dot (measured faster)."""

    small_problems = "xla"

    @parameterized.named_parameters(
        ("small_to_xla", Case(256, 256, 256), "xla_dot"),
        ("large_to_kernel", Case(2048, 2048, 2048), "sm90_wgmma"),
        ("skinny_to_split_k", Case(64, 4096, 4096), "sm90_wgmma_splitk"),
        # XLA's fp8 GEMM at DEFAULT (it was float32 operands at HIGHEST).
        ("small_fp8_to_xla", Case(256, 256, 256, "float8_e4m3fn"), "xla_dot"),
        ("large_fp8_n_major_to_kernel", Case(2048, 2048, 2048, "float8_e5m2"), "sm90_wgmma"),
    )
    def test_case(self, case, kernel):
        _, low, _, _ = self.run_case(case, check_path=False)
        self.assertEqual(low.plan.kernel, kernel, low)


# --- schedules ---------------------------------------------------------------------------------


def _spec_for(name: str):
    """A random dtype, layout and epilogue for the schedule `name` (seeded by the name)."""
    rng = np.random.default_rng(zlib.crc32(name.encode()))
    dtype = ("bfloat16", "float16")[rng.integers(2)]
    return rng, dtype, _random_spec(rng, dtype)


def _two_problems(name: str, sizes) -> tuple[Case, Case]:
    """Two problems sharing one binary (one spec): a single GEMM and a batch of 2 or 3."""
    rng, dtype, spec = _spec_for(name)
    seed = zlib.crc32(name.encode()) % 10**6
    out = []
    for batch in ((), (int(rng.integers(2, 4)),)):
        m, n, k = _dims(rng, spec["transpose_a"], *sizes)
        out.append(Case(m, n, k, dtype, a_batch=batch, b_batch=batch, seed=seed + len(out),
                        **spec))  # fmt: skip
    return tuple(out)


def _schedule_params(schedules, sizes):
    """Named parameters (edit, two cases) of each schedule; `sizes` are (m, n, k) pools."""
    out = []
    for name, edit in schedules:
        cases = _two_problems(name, sizes)
        out.append((f"{name}_{cases[0].name}_and_{cases[1].shape}", edit, cases))
    return out


_ALONG_N = dict(pingpong=True, cluster_mn=(2, 1), raster_along_m=False)
_SCHEDULES = (
    # Cooperative (two consumer warp groups per tile): the planner's small-problem tiles, then
    # the configurations it picks for large problems (a swizzle of 8 on these problems pads the
    # grid with clusters outside the matrix, which must leave it untouched).
    ("coop_64x128_1x1", dict(tile_mn=(64, 128), cluster_mn=(1, 1))),
    ("coop_128x128_1x1", dict(tile_mn=(128, 128), cluster_mn=(1, 1))),
    ("coop_128x256_2x1_swizzle8", dict(tile_mn=(128, 256), cluster_mn=(2, 1), swizzle_size=8)),
    ("coop_128x256_1x2_swizzle8", dict(tile_mn=(128, 256), cluster_mn=(1, 2), swizzle_size=8)),
    ("coop_128x256_1x2", dict(tile_mn=(128, 256), cluster_mn=(1, 2), swizzle_size=1)),
    ("coop_128x256_1x1", dict(tile_mn=(128, 256), cluster_mn=(1, 1))),
    ("coop_128x128_2x1", dict(tile_mn=(128, 128), cluster_mn=(2, 1), swizzle_size=1)),
    ("coop_64x256_1x2", dict(tile_mn=(64, 256), cluster_mn=(1, 2), swizzle_size=1)),
    ("coop_256x128_1x2", dict(tile_mn=(256, 128), cluster_mn=(1, 2), swizzle_size=1)),
    ("coop_256x128_2x1_swizzle8", dict(tile_mn=(256, 128), cluster_mn=(2, 1), swizzle_size=8)),
    ("coop_128x160_2x1", dict(tile_mn=(128, 160), cluster_mn=(2, 1), swizzle_size=1)),
    # 176 columns: epilogue sub-tiles of 16.
    ("coop_128x176_2x1", dict(tile_mn=(128, 176), cluster_mn=(2, 1), swizzle_size=1)),
    ("coop_256x176_1x2", dict(tile_mn=(256, 176), cluster_mn=(1, 2), swizzle_size=1)),
    ("coop_128x256_2x1_along_n_swizzle2",
     dict(tile_mn=(128, 256), cluster_mn=(2, 1), raster_along_m=False, swizzle_size=2)),
    # Epilogue sub-tiles 64 wide (the planner's are 32, or 16 in 176-column tiles).
    ("coop_128x256_epi_n64", dict(tile_mn=(128, 256), epi_n=64)),
    ("coop_64x128_epi_n64", dict(tile_mn=(64, 128), epi_n=64)),
    # Ping-pong (one consumer warp group per tile; tests/test_gpu.py has 128x160 and 128x192
    # along N with swizzle 2), then the planner's walk along N in swizzled bands.
    ("pingpong_128x128", dict(tile_mn=(128, 128), pingpong=True)),
    ("pingpong_128x192", dict(tile_mn=(128, 192), pingpong=True)),
    ("pingpong_128x176", dict(tile_mn=(128, 176), pingpong=True)),
    ("pingpong_64x256", dict(tile_mn=(64, 256), pingpong=True)),
    ("pingpong_64x128", dict(tile_mn=(64, 128), pingpong=True)),
    ("pingpong_128x160_along_n_swizzle8", dict(_ALONG_N, tile_mn=(128, 160), swizzle_size=8)),
    ("pingpong_128x128_along_n_swizzle2", dict(_ALONG_N, tile_mn=(128, 128), swizzle_size=2)),
)  # fmt: skip


@absltest.skipIf(*_SKIP)
class ScheduleTest(_GpuCase):
    """Each schedule on two problems that are not multiples of its tile (one of them batched),
    with one random epilogue and layout per schedule, so that both mostly share its binary."""

    @parameterized.named_parameters(
        _schedule_params(
            _SCHEDULES, ((7, 100, 136, 200, 520, 1000),) + ((136, 200, 264, 520, 1000),) * 2
        )
    )
    def test_schedule(self, edit, cases):
        for case in cases:
            self.run_case(case, _force(case.plan(), coop=True, **edit))


_STREAM_K = (
    ("stream_k_own_tile", dict()),
    ("stream_k_128x256_2x1", dict(tile_mn=(128, 256), cluster_mn=(2, 1))),
    ("stream_k_128x256_1x2", dict(tile_mn=(128, 256), cluster_mn=(1, 2))),
    ("stream_k_128x256_1x1", dict(tile_mn=(128, 256), cluster_mn=(1, 1))),
    ("stream_k_128x128_2x1", dict(tile_mn=(128, 128), cluster_mn=(2, 1))),
    ("stream_k_64x256_1x2", dict(tile_mn=(64, 256), cluster_mn=(1, 2))),
    ("stream_k_64x128_1x1", dict(tile_mn=(64, 128), cluster_mn=(1, 1))),
    ("stream_k_256x128_1x2", dict(tile_mn=(256, 128), cluster_mn=(1, 2))),
    ("stream_k_256x128_2x1_swizzle8",
     dict(tile_mn=(256, 128), cluster_mn=(2, 1), swizzle_size=8)),
    ("stream_k_128x160_2x1", dict(tile_mn=(128, 160), cluster_mn=(2, 1))),
)  # fmt: skip

# The large shapes (batch, m, n, k) and whether B is transposed ([n, k]) with the fused
# epilogue (alpha 0.5, beta 0.75 * C, bias and an activation).
_LARGE_STREAM_K = (
    ((), 16384, 4096, 4096, False), ((), 8192, 8192, 8192, False),
    ((), 4096, 4096, 4096, False), ((), 4096, 14336, 4096, False),
    ((), 3000, 5000, 1000, True), ((4,), 2048, 2048, 1024, False),
)  # fmt: skip
_LARGE_PINGPONG = (
    ((), 16384, 4096, 4096, False, "bfloat16"), ((), 8192, 8192, 8192, False, "bfloat16"),
    ((), 4096, 14336, 4096, False, "bfloat16"), ((), 16384, 5120, 4096, False, "float16"),
    ((), 8192, 8192, 2048, True, "bfloat16"), ((4,), 4096, 4096, 2048, False, "bfloat16"),
    # 33 cluster rows, which 8 does not divide: the planner's swizzle is 1 here.
    ((), 8200, 8200, 1000, True, "bfloat16"),
)  # fmt: skip


def _large_case(batch, m, n, k, epilogue, dtype="bfloat16", activation="gelu") -> Case:
    epi = dict(c=dtype, bias=dtype, activation=activation, alpha=0.5, beta=0.75)
    return Case(m, n, k, dtype, a_batch=batch, b_batch=batch, transpose_b=epilogue,
                seed=m + n + k, **(epi if epilogue else {}))  # fmt: skip


def _waves(plan) -> float:
    """Output tiles of `plan` per persistent cluster of the device (its SM count)."""
    cm, cn = plan.cluster_shape_mn
    tm, tn, _ = plan.cta_tile_mnk
    tiles = math.ceil(math.ceil(plan.m / tm) / cm) * math.ceil(math.ceil(plan.n / tn) / cn)
    return tiles * plan.batch / (plan.num_sms // (cm * cn))


@absltest.skipIf(*_SKIP)
class StreamKTest(_GpuCase):
    @parameterized.named_parameters(
        _schedule_params(_STREAM_K, ((2600, 3000, 3500, 4000),) * 2 + ((264, 520, 1000, 1200),))
    )
    def test_schedule(self, edit, cases):
        # More tiles than the device's clusters, so the last waves are shared out by k-blocks.
        for case in cases:
            plan = _force(case.plan(), coop=True, stream_k=True, pingpong=False, **edit)
            _, low, _, _ = self.run_case(case, plan)
            self.assertGreater(_waves(low.plan), 1.0, f"{case.name}: no stream-K phase")

    @parameterized.named_parameters(_named(_large_case(*shape) for shape in _LARGE_STREAM_K))
    def test_large(self, case):
        # The planner's cooperative plan, with stream-K and without: the same error, and
        # replays bitwise equal (the split tiles always meet in the same order).
        ops = _operands(case)
        want = _reference(case, *ops)
        errs = {}
        for stream_k in (False, True):
            plan = _force(case.plan(), coop=True, stream_k=stream_k)
            fn = _case_fn(case, plan)
            out = fn(*ops)
            self.assertEqual(_schedule(jax_sm100.last_lowering().plan), _schedule(plan))
            errs[stream_k] = self.assert_close(out, want, case.out, f"stream_k={stream_k}")
        for i in range(20):
            self.assertTrue(bool(jnp.array_equal(fn(*ops), out)), f"replay {i} differs")
        self.assertLessEqual(errs[True], 1.5 * errs[False] + 1e-4)


# The planner's choices the tests below assert, as constants: tests/test_export_cuda.py checks
# the same choices on CPU (`planner_choices`, exported for sm_90a), so a planner change that
# moves one fails in CI, not only on a GPU.
# Many waves of short-k fp8 tiles: (case, tile) of 128x192 or 128x176 ping-pong (swapped in
# very tall grids).
_PLANNER_8BIT = (
    (Case(16384, 4096, 4096, "float8_e4m3fn", transpose_b=True, seed=11), (128, 192)),
    (Case(8200, 8200, 2064, "float8_e5m2", transpose_b=True, c="bfloat16", bias="float32",
          activation="gelu", alpha=0.5, beta=0.75, seed=12), (128, 192)),
    (Case(4096, 4096, 1024, "float8_e4m3fn", a_batch=(3,), b_batch=(3,), transpose_b=True,
          out_dtype="float16", seed=13), (128, 192)),
    (Case(32768, 1408, 2048, "float8_e4m3fn", transpose_b=True, seed=14), (128, 192)),
    # A wide grid: along M in 1x2 clusters, in 176-column tiles (82 x 32: 19.9 waves); then
    # with its C staged by TMA (`GemmPlan.stage_c`, 16-column sub-tiles).
    (Case(4096, 14336, 4096, "float8_e4m3fn", transpose_b=True, bias="bfloat16", seed=15),
     (128, 176)),
    (Case(4096, 14336, 4096, "float8_e4m3fn", transpose_b=True, c="bfloat16", beta=0.5,
          seed=19), (128, 176)),
)  # fmt: skip
# A few waves of 8-bit tiles (under ping-pong's 8): (name, case, cluster) of cooperative
# 256x176, in the pairing that adds no wave.
_PLANNER_256X176 = (
    ("2x1", Case(4000, 7096, 1040, "float8_e4m3fn", transpose_b=True, bias="bfloat16",
                 activation="gelu", seed=16), (2, 1)),
    ("1x2", Case(3000, 7096, 1040, "float8_e5m2", transpose_b=True, c="bfloat16",
                 out_dtype="float16", seed=17), (1, 2)),
    ("float32_out", Case(4000, 7096, 1040, "float8_e4m3fn", transpose_b=True,
                         out_dtype="float32", seed=18), (2, 1)),
)  # fmt: skip
# Very tall fp8 grids: the swapped 128x192 ping-pong plan.
_PLANNER_SWAP = (
    Case(16384, 4096, 4096, "float8_e4m3fn", transpose_b=True, seed=21),
    Case(32768, 2048, 2048, "float8_e5m2", transpose_b=True, bias="float32",
         activation="gelu", alpha=0.5, seed=22),
    # B shared by the batch: folded into 4 x 8200 rows, then swapped.
    Case(8200, 1032, 1024, "float8_e4m3fn", a_batch=(4,), b_batch=(1,),
         transpose_b=True, bias="bfloat16", activation="silu", seed=27),
)  # fmt: skip


def planner_choices():
    """(name, case, fields, want) for each planner choice a test here asserts: `fields(plan)`
    is to equal `want` for the plan `case` lowers to on an sm_90a target."""

    def kernel_pp(p):
        return p.kernel, p.pingpong

    def kernel_pp_tile(p):
        return p.kernel, p.pingpong, p.cta_tile_mnk[:2]

    def tile_cluster(p):
        return p.kernel, p.pingpong, p.cta_tile_mnk[:2], p.cluster_shape_mn

    def swapped(p):
        return p.swap_ab, p.pingpong, p.cta_tile_mnk[:2]

    out = [
        (f"pingpong_{c.name}", c, kernel_pp, ("sm90_wgmma", True))
        for c in (_large_case(*shape, activation="silu") for shape in _LARGE_PINGPONG)
    ]
    out += [
        (f"8bit_{c.name}", c, kernel_pp_tile, ("sm90_wgmma", True, t)) for c, t in _PLANNER_8BIT
    ]
    out += [
        (f"256x176_{name}", c, tile_cluster, ("sm90_wgmma", False, (256, 176), cl))
        for name, c, cl in _PLANNER_256X176
    ]
    out += [(f"swap_{c.name}", c, swapped, (True, True, (128, 192))) for c in _PLANNER_SWAP]
    return out


@absltest.skipIf(*_SKIP)
class PingPongTest(_GpuCase):
    """The planner's ping-pong plans (many waves of 16-bit tiles, walked along N in swizzled
    bands; with a C of D's dtype, staged by TMA), and of short-k fp8 tiles (64x256 in a very
    tall grid, unswizzled)."""

    @parameterized.named_parameters(
        _named(_large_case(*shape, activation="silu") for shape in _LARGE_PINGPONG)
    )
    def test_planner_plan(self, case):
        _, low, _, _ = self.run_case(case)
        self.assertEqual((low.plan.kernel, low.plan.pingpong), ("sm90_wgmma", True), low)

    @parameterized.named_parameters((f"{c.name}_{t[0]}x{t[1]}", c, t) for c, t in _PLANNER_8BIT)
    def test_planner_plan_8bit(self, case, tile):
        # Many waves of short-k fp8 tiles: 128x192 or 128x176 ping-pong (swapped in very tall
        # grids).
        _, low, _, _ = self.run_case(case)
        want = ("sm90_wgmma", True, tile)
        self.assertEqual((low.plan.kernel, low.plan.pingpong, low.plan.cta_tile_mnk[:2]), want, low)

    @parameterized.named_parameters(*_PLANNER_256X176)
    def test_planner_plan_8bit_256x176(self, case, cluster):
        # A few waves of 8-bit tiles (under ping-pong's 8): cooperative 256x176 where its waves
        # fill best, in the pairing that adds no wave (planning/sm90.py `_unpadded_cluster`).
        _, low, _, _ = self.run_case(case)
        got = (low.plan.kernel, low.plan.pingpong, low.plan.cta_tile_mnk[:2])
        self.assertEqual(got, ("sm90_wgmma", False, (256, 176)), low)
        self.assertEqual(low.plan.cluster_shape_mn, cluster, low)


# Forced swapped schedules (`GemmPlan.swap_ab`): (case, tile, ping-pong, cluster). m and n are
# not multiples of the tiles, so D's M-major stores are clipped at both edges.
_SWAP_FORCED = (
    (Case(1000, 520, 256, "float8_e4m3fn", transpose_b=True, bias="float32", activation="relu",
          seed=23), (128, 192), True, (1, 2)),
    (Case(520, 1000, 512, "float8_e5m2", transpose_b=True, bias="bfloat16", alpha=0.5,
          seed=24), (128, 256), False, (2, 1)),
    (Case(300, 264, 512, "float8_e4m3fn", a_batch=(3,), b_batch=(3,), transpose_b=True,
          out_dtype="float16", activation="silu", seed=25), (64, 128), False, (1, 1)),
    (Case(4104, 776, 1024, "float8_e5m2", transpose_b=True, seed=26), (128, 192), True, (2, 1)),
)  # fmt: skip


@absltest.skipIf(*_SKIP)
class SwapTest(_GpuCase):
    """Swapped products (`GemmPlan.swap_ab`: the kernel runs D^T = B A^T and stores D M-major,
    by stmatrix's transposing form and TMA): the planner's in very tall fp8 grids, and forced
    onto uneven, batched problems with every epilogue a swapped plan takes."""

    @parameterized.named_parameters(_named(_PLANNER_SWAP))
    def test_planner_swap(self, case):
        _, low, _, _ = self.run_case(case)
        got = (low.plan.swap_ab, low.plan.pingpong, low.plan.cta_tile_mnk[:2])
        self.assertEqual(got, (True, True, (128, 192)), low)

    @parameterized.named_parameters(
        (f"{c.name}_{t[0]}x{t[1]}_{'pp' if pp else 'coop'}", c, t, pp, cl)
        for c, t, pp, cl in _SWAP_FORCED
    )
    def test_forced(self, case, tile, pingpong, cluster):
        plan = _force(case.plan(), tile_mn=tile, pingpong=pingpong, cluster_mn=cluster,
                      swap_ab=True, raster_along_m=True, stream_k=False)  # fmt: skip
        self.assertTrue(plan.swap_ab)
        self.run_case(case, plan)

    def test_preact(self):
        # The forward under grad: D and the pre-activation Z, both stored M-major.
        case = Case(1000, 520, 256, "float8_e4m3fn", transpose_b=True, bias="float32",
                    activation="gelu", seed=28)  # fmt: skip
        plan = _force(case.plan(), tile_mn=(128, 192), pingpong=True, cluster_mn=(1, 2),
                      swap_ab=True, raster_along_m=True, stream_k=False)  # fmt: skip
        a, b, bias, _ = _operands(case)
        fn = jax.jit(lambda a, b, bias: _bind(
            a, b, bias, out_dtype="bfloat16", plan=plan, transpose_b=True, activation="gelu",
            save_preact=True))  # fmt: skip
        out, z = fn(a, b, bias)
        low = jax_sm100.last_lowering()
        self.assertTrue(low.plan.swap_ab and low.plan.preact_out, low)
        self.assert_close(out, _reference(case, a, b, bias, None), "bfloat16", "d")
        pre = dataclasses.replace(case, activation=None)
        self.assert_close(z, _reference(pre, a, b, bias, None), "bfloat16", "z")


def _split_cases(count: int, seed: int) -> list[tuple[Case, tuple[int, int], int]]:
    """(case, split tile, split factor) of random skinny problems: every factor and split
    tile, m and n not multiples of the tile, both layouts, each epilogue."""
    rng = np.random.default_rng(seed)
    tiles = ((64, 128), (64, 256), (128, 128))
    epilogues = (
        dict(out_dtype="float32"),
        dict(activation="relu", bias="float32"),
        dict(activation="gelu", bias="float32", c="same"),
        dict(activation="silu", bias="float32", c="same", alpha=2.0, beta=0.5),
    )
    out = []
    for i in range(count):
        split, tile = (2, 4, 8)[i % 3], tiles[(i // 3) % 3]
        dtype = ("bfloat16", "float16")[i % 2]
        ta, tb = bool(rng.integers(2)), bool(rng.integers(2))
        m = int(rng.choice([1, 8, 37, 64, 100, 128, 200, 256]))
        m = max(8, m // 8 * 8) if ta else m
        n = int(rng.choice([64, 136, 520, 1000, 4096]))
        k = split * int(rng.choice([256, 520, 1024, 2056]))
        epi = dict(epilogues[i % 4])
        if epi.get("c") == "same":
            epi["c"] = dtype
        case = Case(m, n, k, dtype, transpose_a=ta, transpose_b=tb, seed=seed * 1000 + i, **epi)
        out.append((case, tile, split))
    return out


@absltest.skipIf(*_SKIP)
class SplitKTest(_GpuCase):
    @parameterized.named_parameters(
        (f"x{s}_{t[0]}x{t[1]}_{c.name}", c, t, s) for c, t, s in _split_cases(12, seed=5)
    )
    def test_in_cluster(self, case, tile, split):
        # Each output tile's split CTAs sum their partials in the cluster and run the epilogue.
        self.run_case(case, _force(case.plan(), tile_mn=tile, split=split))

    @parameterized.named_parameters(
        _named([
            Case(64, 4096, 4096),
            Case(1, 4096, 4096, c="bfloat16", bias="float32", activation="silu"),
            Case(200, 1000, 8192, "float16", transpose_b=True, out_dtype="float32"),
            # A wide weight gradient's layout (A transposed) over a long k: re-tiled in
            # 128 x 128 and split 4 ways (`sm90._wide_split`).
            Case(768, 512, 16384, transpose_a=True, bias="float32", activation="gelu"),
            # Two 128-row tiles over a long k: re-tiled likewise, split 4 ways (planned split 2
            # in 64 x 128 tiles), and split 2 ways where 64 x 128 tiles filled the SMs unsplit.
            Case(256, 2048, 16384, transpose_b=True, bias="float32", activation="gelu"),
            Case(255, 4096, 8192, c="bfloat16"),
        ])
    )  # fmt: skip
    def test_planner_split(self, case):
        # The planner's split-K, partials summed by XLA with the epilogue fused into the sum.
        _, low, _, _ = self.run_case(case)
        self.assertGreater(low.plan.split_k, 1, low)
        self.assertEqual(low.plan.split_reduce, "xla")
        # Re-tiled (`sm90._wide_split`): wide problems, and skinny ones of two full 128-row
        # tiles in one GEMM of 2^33 FLOPs or more (Case(200, 1000, 8192) keeps 64 x 128; these
        # cases are one GEMM, their clusters pad nothing).
        if case.m > 256 or (case.m > 192 and 2 * case.m * case.n * case.k >= 2**33):
            self.assertEqual(low.plan.cta_tile_mnk[:2], (128, 128), low)

    def test_fp8_few_tiles_over_a_long_k(self):
        # 512 x 512 x 65536 fp8 (16 output tiles of 128 x 128): split 8 ways. Unsplit, each
        # tile's fp8 accumulation ran over all of k in the tensor core (H100: 2.1e-2 of the
        # largest |ref| from float64; cuBLAS, split, 3.1e-3; ours 64 x 128 split 4 ways 5.3e-3).
        # (Not run_case: its float32 tolerance is for float32 accumulation, which fp8 at DEFAULT
        # is not, split or not.)
        case = Case(512, 512, 65536, "float8_e4m3fn", transpose_b=True, out_dtype="float32")
        ops = _operands(case)
        out = _case_fn(case, None)(*ops)
        low = jax_sm100.last_lowering()
        self.assertEqual(low.plan.kernel, "sm90_wgmma_splitk", low)
        self.assertGreater(low.plan.split_k, 1, low)  # 8 on 132 SMs
        a, b = (np.asarray(x, np.float64) for x in ops[:2])
        want = a @ b.T
        err = np.max(np.abs(np.asarray(out, np.float64) - want)) / np.max(np.abs(want))
        self.assertLess(err, 1e-2)

    def test_split_that_k_cannot_take(self):
        # k = 4104: no split leaves K/split a whole multiple of 8, so the unsplit kernel runs.
        case = Case(64, 4096, 4104, activation="gelu", bias="float32")
        self.assertGreater(case.plan().split_k, 1)
        _, low, _, _ = self.run_case(case)
        self.assertEqual((low.plan.kernel, low.plan.split_k), ("sm90_wgmma", 1), low)

    def test_split_of_a_batch(self):
        # The splits occupy the kernel's batch mode: an in-cluster plan for a batch runs unsplit.
        case = Case(100, 520, 2048, a_batch=(2,), b_batch=(2,), c="bfloat16")
        plan = _force(case.plan(), tile_mn=(64, 128), split=4)
        _, low, _, _ = self.run_case(case, plan, same_plan=False)
        self.assertEqual(low.plan.split_k, 1, low)


# --- vmap and gradients ------------------------------------------------------------------------


@absltest.skipIf(*_SKIP)
class VmapTest(_GpuCase):
    def _check(self, fn, ref, *args, kernel=True):
        got = jax.jit(fn)(*args)
        low = jax_sm100.last_lowering()
        want = ref(*[x.astype(jnp.float32) for x in args])
        self.assert_close(got, want, np.dtype(got.dtype).name)
        self.assertEqual(low.plan is not None and low.plan.kernel != "xla_dot", kernel, low)

    def _normal(self, i, shape, scale=1.0):
        return _normal(jax.random.key(100 + i), shape, jnp.bfloat16, scale)

    def test_over_a_shared_weight(self):
        # The batch folds into m: one GEMM of 5 * 100 rows.
        x, w = self._normal(0, (5, 100, 136)), self._normal(1, (136, 200), 136**-0.5)
        bias = self._normal(2, (200,))
        self._check(
            jax.vmap(lambda x, w, b: jax_sm100.matmul(x, w, bias=b, activation="gelu"),
                     in_axes=(0, None, None)),
            lambda x, w, b: _ACT_FNS["gelu"](jnp.matmul(x, w, precision=_HIGHEST) + b),
            x, w, bias,
        )  # fmt: skip

    def test_over_b_at_axis_1(self):
        x, w = self._normal(3, (100, 136)), self._normal(4, (136, 4, 200), 136**-0.5)
        self._check(
            jax.vmap(lambda x, w: jax_sm100.matmul(x, w, activation="silu"), in_axes=(None, 1)),
            lambda x, w: jax.nn.silu(jnp.einsum("mk,kbn->bmn", x, w, precision=_HIGHEST)),
            x, w,
        )  # fmt: skip

    def test_nested(self):
        x, w = self._normal(5, (2, 64, 3, 136)), self._normal(6, (3, 2, 136, 200), 136**-0.5)
        inner = jax.vmap(lambda x, w: jax_sm100.matmul(x, w, alpha=0.5), in_axes=(1, 0))
        self._check(
            jax.vmap(inner, in_axes=(0, 1)),
            lambda x, w: 0.5 * jnp.einsum("amck,cakn->acmn", x, w, precision=_HIGHEST),
            x, w,
        )  # fmt: skip

    def test_over_c(self):
        x, w = self._normal(7, (100, 136)), self._normal(8, (136, 200), 136**-0.5)
        c = self._normal(9, (4, 100, 200))
        self._check(
            jax.vmap(lambda c, x, w: jax_sm100.matmul(x, w, c=c, beta=0.75),
                     in_axes=(0, None, None)),
            lambda c, x, w: jnp.matmul(x, w, precision=_HIGHEST) + 0.75 * c,
            c, x, w,
        )  # fmt: skip

    def test_over_bias(self):
        # A bias per batch member is no kernel operand ([n] only): XLA's dot runs it.
        x, w = self._normal(10, (100, 136)), self._normal(11, (136, 200), 136**-0.5)
        bias = self._normal(12, (4, 200))
        self._check(
            jax.vmap(lambda b, x, w: jax_sm100.matmul(x, w, bias=b, activation="relu"),
                     in_axes=(0, None, None)),
            lambda b, x, w: jax.nn.relu(jnp.matmul(x, w, precision=_HIGHEST) + b[:, None, :]),
            bias, x, w, kernel=False,
        )  # fmt: skip


@absltest.skipIf(*_SKIP)
class GradTest(_GpuCase):
    """Gradients tests/test_gpu_training.py (bfloat16 throughout) does not take: other dtypes,
    split-K products and the planner's large-problem schedules under `grad`."""

    def _grads(self, fn, ref, args, dtype, products=None):
        nums = tuple(range(len(args)))
        got = jax.jit(jax.grad(fn, argnums=nums))(*args)
        want = jax.grad(ref, argnums=nums)(*[x.astype(jnp.float32) for x in args])
        for i, (g, w) in enumerate(zip(got, want, strict=True)):
            self.assert_close(g, w, dtype, f"gradient {i}", grad=True)
        if products is not None:
            self.assertEqual(_products(jax.grad(fn, argnums=nums), *args), products)

    def _mlp_grads(self, dtype, m, n, k, **kw):
        ks = jax.random.split(jax.random.key(m + n + k), 4)
        x, w = _normal(ks[0], (m, k), dtype), _normal(ks[1], (k, n), dtype, k**-0.5)
        bias, ct = _normal(ks[2], (n,), dtype), _normal(ks[3], (m, n), jnp.float32)

        def ours(x, w, bias):
            y = jax_sm100.matmul(x, w, bias=bias, activation="gelu", **kw)
            return jnp.sum(y.astype(jnp.float32) * ct)

        def ref(x, w, bias):
            return jnp.sum(_ACT_FNS["gelu"](jnp.matmul(x, w, precision=_HIGHEST) + bias) * ct)

        # The forward (which also writes the pre-activation) and the two gradient products.
        self._grads(ours, ref, (x, w, bias), dtype, products=(3, 0))

    def test_float16(self):
        self._mlp_grads("float16", 200, 136, 520)

    def test_float32_output_of_bfloat16_operands(self):
        # The float32 cotangent is rounded to bfloat16 for the backward products.
        self._mlp_grads("bfloat16", 264, 200, 136, out_dtype=jnp.float32)

    def test_skinny_split_k(self):
        # Forward and input gradient are skinny split-K products; the weight gradient is not.
        self._mlp_grads("bfloat16", 64, 4096, 4096)

    def test_planner_schedules_at_scale(self):
        # 8192 x 8192 outputs: the forward plans ping-pong, the backward products cooperative.
        self._mlp_grads("bfloat16", 8192, 8192, 1024)

    def test_fp8_operands(self):
        # Differentiated in bfloat16 on the kernels (the forward is the fp8 kernel with a K-major
        # B); each gradient comes back in its operand's fp8 dtype.
        ks = jax.random.split(jax.random.key(8), 3)
        a, b = _normal(ks[0], (256, 512), _FP8[0]), _normal(ks[1], (384, 512), _FP8[0])
        ct = _normal(ks[2], (256, 384), jnp.float32, 0.05)  # keeps the gradients in e4m3's range

        def ours(a, b):
            y = _bind(a, b, out_dtype="bfloat16", transpose_b=True)
            return jnp.sum(y.astype(jnp.float32) * ct)

        def ref(a, b):
            return jnp.sum(jnp.matmul(a, b.T, precision=_HIGHEST) * ct)

        # The two gradient products (a linear epilogue's gradient does not read the forward).
        self._grads(ours, ref, (a, b), _FP8[0], products=(2, 0))


# --- CUDA graphs and compute-sanitizer ---------------------------------------------------------


@absltest.skipIf(*_SKIP)
class GraphReplayTest(_GpuCase):
    def test_mlp_in_command_buffers(self):
        # Custom calls in XLA's command buffers (CUDA graphs) from the smallest graph up; the
        # handler declares itself graph-safe and loads its module before any capture. Whether
        # XLA captured the calls is not visible in the compiled HLO, so it is not asserted.
        ks = jax.random.split(jax.random.key(1), 4)
        x = _normal(ks[0], (512, 1024), jnp.bfloat16)
        w1, w2 = (
            _normal(ks[1], (1024, 2048), jnp.bfloat16, 1 / 32),
            _normal(ks[2], (2048, 1024), jnp.bfloat16, 1 / 45),
        )
        b1 = _normal(ks[3], (2048,), jnp.bfloat16)

        def ours(x):
            h = jax_sm100.matmul(x, w1, bias=b1, activation="gelu")
            return jax_sm100.matmul(h, w2, c=x, beta=0.5)

        def ref(x):
            f = lambda t: t.astype(jnp.float32)  # noqa: E731
            h = _ACT_FNS["gelu"](jnp.matmul(f(x), f(w1), precision=_HIGHEST) + f(b1))
            h = h.astype(jnp.bfloat16)
            return jnp.matmul(f(h), f(w2), precision=_HIGHEST) + 0.5 * f(x)

        options = {"xla_gpu_enable_command_buffer": "FUSION,CUSTOM_CALL",
                   "xla_gpu_graph_min_graph_size": "1"}  # fmt: skip
        compiled = jax.jit(ours).lower(x).compile(compiler_options=options)
        self.assertEqual(compiled.as_text().count('custom_call_target="jax_sm100_gemm"'), 2)
        first = compiled(x)
        self.assert_close(first, ref(x), "bfloat16")
        for i in range(50):
            self.assertTrue(bool(jnp.array_equal(compiled(x), first)), f"replay {i} differs")


_SANITIZED = (
    ("plain_136x200x264", Case(136, 200, 264), {}),
    ("split_k_planner_64x520x4096", Case(64, 520, 4096), {}),
    ("c_bias_100x256x128", Case(100, 256, 128, c="bfloat16", bias="bfloat16"), {}),
    *((f"pingpong_{t[0]}x{t[1]}_520x1000x264", Case(520, 1000, 264),
       dict(tile_mn=t, pingpong=True)) for t in ((128, 128), (128, 192), (64, 256))),
    *((f"split_x{s}_in_cluster_100x520x2048", Case(100, 520, 2048, c="bfloat16"),
       dict(tile_mn=(64, 128), split=s)) for s in (2, 4, 8)),
    # 2048 x 2304 in 128x128 tiles is 144 tile pairs on 66 clusters: 78 tiles are shared out
    # by k-blocks and 66 pairs meet in the workspace.
    ("stream_k_128x128_2x1_2048x2304x512", Case(2048, 2304, 512),
     dict(tile_mn=(128, 128), cluster_mn=(2, 1), stream_k=True)),
)  # fmt: skip


@absltest.skipIf(*_SKIP)
class SanitizedCasesTest(_GpuCase):
    """Every kind of kernel launch once (`SanitizerTest` runs this class under
    compute-sanitizer): the planner's plans, ping-pong on a problem that is not a multiple of
    its tiles, each in-cluster split factor, stream-K."""

    @parameterized.named_parameters(*_SANITIZED)
    def test_case(self, case, edit):
        self.run_case(case, _force(case.plan(), **edit) if edit else None)


_SANITIZE = tuple(t for t in os.environ.get("JAX_SM100_SANITIZE", "").split(",") if t)


@absltest.skipIf(*_SKIP)
class SanitizerTest(parameterized.TestCase):
    @parameterized.named_parameters(("memcheck", "memcheck"), ("racecheck", "racecheck"))
    def test_sanitized_cases(self, tool):
        if tool not in _SANITIZE:
            self.skipTest(f"set JAX_SM100_SANITIZE={tool} to run SanitizedCasesTest under "
                          f"compute-sanitizer --tool {tool} (minutes)")  # fmt: skip
        exe = shutil.which("compute-sanitizer")
        if exe is None:
            self.skipTest("compute-sanitizer is not on PATH")
        root = Path(__file__).resolve().parent.parent
        env = {k: v for k, v in os.environ.items() if k != "JAX_SM100_SANITIZE"}
        env["XLA_PYTHON_CLIENT_PREALLOCATE"] = "false"
        cmd = [exe, "--tool", tool, "--print-limit", "20", sys.executable, "-m",
               "tests.test_gpu_matrix", "SanitizedCasesTest"]  # fmt: skip
        proc = subprocess.run(cmd, cwd=root, env=env, capture_output=True, text=True,
                              timeout=1500)  # fmt: skip
        out = proc.stdout + proc.stderr
        tail = "\n".join(out.strip().splitlines()[-30:])
        self.assertEqual(proc.returncode, 0, tail)
        # Every case ran (none skipped, e.g. for want of a device under the tool), and clean.
        self.assertIn(f"Ran {len(_SANITIZED)} tests", out, tail)
        self.assertNotIn("skipped=", out, tail)
        self.assertTrue(any(s in tail for s in ("ERROR SUMMARY: 0 errors", "(0 errors")), tail)


if __name__ == "__main__":
    absltest.main()
