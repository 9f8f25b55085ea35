"""Tests of the matmul primitive's partitioning on a ("data", "model") device mesh (sharding.py).

Every case runs one jitted function on sharded operands and compares it with the same function
on one device, then counts the collectives in the compiled HLO: each count is what the math
needs and no more (a weight is all-gathered only where that moves fewer bytes than
reducing partial products: FSDP's layout).

Where the mesh lives (read at import, before JAX starts a backend):

    JAX_SM100_SHARDING_PLATFORM  "cpu" (default): 8 host CPU devices, forced by this module.
                                 "gpu": the devices of jax.devices("gpu").
    JAX_SM100_SHARDING_MESH      "DxM", the ("data", "model") shape, e.g. "2x2". Default: 2x4 on
                                 cpu; on gpu 2x4 with 8 or more GPUs, 2x2 with 4 to 7, 1x2 with 2
                                 or 3 (`mesh_shape`). The mesh takes the first D * M devices.

On the GPU machine, in one command (NCCL_NVLS_ENABLE=0 is already set there: NVLink multicast
must stay off; leave it as it is):

    JAX_SM100_SHARDING_PLATFORM=gpu python -m pytest -q tests/test_sharding.py

With 2 GPUs the default mesh is 1x2 (tensor parallelism only); add a run on 2x1 for the
data-parallel side of the same cases:

    export JAX_SM100_SHARDING_PLATFORM=gpu; python -m pytest -q tests/test_sharding.py && \
        JAX_SM100_SHARDING_MESH=2x1 python -m pytest -q tests/test_sharding.py

On gpu the module sets XLA_PYTHON_CLIENT_PREALLOCATE=false (unless set) so that the example's
child process can allocate next to this one. The unsharded reference runs on the mesh's first
device, of the same platform. Tolerances (`XLA_RTOL`, `KERNEL_RTOL`) depend on the platform and
on whether a product's operand dtype may run on our kernels there (`kernel_may_run`).

The expected collective counts are derived from the mesh: a case states the mesh axes it reduces
over, and an axis of size 1 needs no collective (`reduces`), so the same assertions hold on 2x4,
2x2, 1x2 and 2x1 meshes. Cases that exist to show one collective (the reduce-scatters) skip when
the mesh lacks that axis (`require`); the others still check their results and that nothing is
communicated. To check on a CPU machine what a smaller GPU mesh will expect:

    JAX_SM100_SHARDING_MESH=1x2 python -m pytest -q tests/test_sharding.py   # also 2x1, 2x2

On cpu the devices are asked for before JAX starts its backend. Under pytest every module is
imported before any test runs, so that normally holds; when another module has already started
the backend with fewer devices, each test class runs in a child process (`_delegated`) and every
test reports its own outcome from there.
"""

from __future__ import annotations

import math
import os
import re

AXES = ("data", "model")
_PLATFORM_ENV = "JAX_SM100_SHARDING_PLATFORM"
_MESH_ENV = "JAX_SM100_SHARDING_MESH"
_CHILD_ENV = "JAX_SM100_SHARDING_TEST_CHILD"


def mesh_shape(platform: str, num_devices: int, override: str | None = None) -> tuple[int, int]:
    """The ("data", "model") shape of the test mesh on `num_devices` devices of `platform`.

    Eight devices give the 2 x 4 mesh the CPU run has always used; four give 2 x 2, where both
    kinds of parallelism still communicate. Two cannot have both: 1 x 2 keeps tensor
    parallelism, where the partitioner's decisions are (row-parallel reductions, the epilogue
    after them, reduce-scatters); data parallelism only adds gradient reductions over rows.
    """
    if platform not in ("cpu", "gpu"):
        raise ValueError(f"{_PLATFORM_ENV}={platform!r}: want 'cpu' or 'gpu'")
    if override:
        match = re.fullmatch(r"\s*(\d+)\s*x\s*(\d+)\s*", override)
        if not match or min(int(match[1]), int(match[2])) < 1:
            raise ValueError(f"{_MESH_ENV}={override!r}: want DATAxMODEL, e.g. '2x2' or '1x2'")
        return int(match[1]), int(match[2])
    if platform == "cpu" or num_devices >= 8:
        return 2, 4
    return (2, 2) if num_devices >= 4 else (1, 2)


_PLATFORM = os.environ.get(_PLATFORM_ENV, "cpu")
_MESH_OVERRIDE = os.environ.get(_MESH_ENV)
# Checks both variables at collection; on cpu it is the mesh's shape (the devices are forced).
_CPU_SHAPE = mesh_shape(_PLATFORM, 8, _MESH_OVERRIDE)
_DEVICES = max(8, _CPU_SHAPE[0] * _CPU_SHAPE[1])  # host devices forced on cpu
if _PLATFORM == "cpu":
    _FLAG = f"--xla_force_host_platform_device_count={_DEVICES}"
    if _FLAG not in os.environ.get("XLA_FLAGS", ""):
        os.environ["XLA_FLAGS"] = f"{os.environ.get('XLA_FLAGS', '')} {_FLAG}".strip()
else:
    # JAX takes 75% of every GPU when its backend starts; the example's child process would
    # then find too little memory next to this one.
    os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")

import ast  # noqa: E402
import functools  # noqa: E402
import subprocess  # noqa: E402
import sys  # noqa: E402
import tempfile  # noqa: E402
import xml.etree.ElementTree as ET  # noqa: E402
from pathlib import Path  # noqa: E402
from unittest import mock  # noqa: E402

import jax  # noqa: E402

if _PLATFORM == "cpu":
    try:
        jax.config.update("jax_num_cpu_devices", _DEVICES)
    except RuntimeError:
        pass  # the backend is already up in this process; see `_delegated`

import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from absl.testing import absltest, parameterized  # noqa: E402
from jax._src import core as jax_core  # noqa: E402
from jax.sharding import AxisType, NamedSharding  # noqa: E402
from jax.sharding import PartitionSpec as PS  # noqa: E402

import jax_sm100  # noqa: E402
from jax_sm100._src import constraints, primitive  # noqa: E402
from jax_sm100._src import sharding as sharding_rules  # noqa: E402

REPO_ROOT = Path(__file__).resolve().parents[1]
COLLECTIVES = ("all-reduce", "reduce-scatter", "all-gather", "collective-permute", "all-to-all")


# --- the mesh ----------------------------------------------------------------------------------


def platform_devices() -> list:
    try:
        return jax.devices(_PLATFORM)
    except RuntimeError:  # no such backend (gpu on a machine without one): every case skips
        return []


@functools.cache
def run_mesh_shape() -> tuple[int, int]:
    """The mesh shape of this run (on gpu it depends on the GPUs present)."""
    if _PLATFORM == "cpu":
        return _CPU_SHAPE
    return mesh_shape(_PLATFORM, len(platform_devices()), _MESH_OVERRIDE)


def axis_size(axis: str) -> int:
    return dict(zip(AXES, run_mesh_shape(), strict=True))[axis]


def reduces(*axes: str) -> int:
    """How many collectives the reductions over `axes` (one entry each) need on this mesh.

    A reduction over an axis of size 1 is the identity: XLA drops it, or it is never made.
    """
    return sum(axis_size(axis) > 1 for axis in axes)


def _enough_devices() -> bool:
    return len(platform_devices()) >= run_mesh_shape()[0] * run_mesh_shape()[1]


def kernel_may_run(dtype) -> bool:
    """Whether a product with `dtype` operands may run on one of our GPU kernels in this run."""
    if _PLATFORM == "cpu":
        return False
    from jax_sm100._src import dispatch  # noqa: PLC0415

    target = dispatch.device_target()
    arch = None if target is None else target.arch
    return arch is not None and np.dtype(dtype).name in constraints.KERNEL_OPERAND_DTYPES[arch]


# Tolerance of a sharded result against the unsharded one, relative to the result's largest
# element, (forward, gradient). Both programs accumulate in float32 and differ in the order of
# their sums (partial products are reduced across devices): a few hundred float32 ulps of the
# largest element, more for a gradient, a chain of such products. On GPUs the two programs are
# also fused differently, and XLA's GPU tanh/sin/exp are few-ulp approximations, so the
# epilogues may round differently too.
XLA_RTOL = {"cpu": (2e-5, 1e-4), "gpu": (1e-4, 5e-4)}
# Where our GPU kernels run a product (the sharded program may run XLA's dot instead, on a local
# block whose contiguous dim is misaligned): their epilogue's fast-math tanh and exp have a
# relative error near 2**-11, and float32 operands on sm_100a run tf32 MMAs (10-bit mantissa).
KERNEL_RTOL = (2e-3, 1e-2)


def assert_f32_close(got, want, tol: float, err_msg: str = ""):
    """float32 results of ours and of XLA's products: within `tol` (relative and absolute) on
    cpu; on gpu both run float32 products as TF32, with different tiles and sums, so within
    KERNEL_RTOL's gradient tolerance of the largest element."""
    if _PLATFORM == "cpu":
        np.testing.assert_allclose(got, want, rtol=tol, atol=tol, err_msg=err_msg)
        return
    want = np.asarray(want, np.float64)
    scale = max(float(np.max(np.abs(want))), 1e-6)
    np.testing.assert_allclose(
        np.asarray(got, np.float64), want, rtol=0, atol=KERNEL_RTOL[1] * scale, err_msg=err_msg
    )


def rtol_for(args, *, grad: bool) -> float:
    kernel = any(kernel_may_run(x.dtype) for x in jax.tree.leaves(args))
    return (KERNEL_RTOL if kernel else XLA_RTOL[_PLATFORM])[int(grad)]


# --- helpers -----------------------------------------------------------------------------------


def collectives(hlo: str) -> dict[str, int]:
    """How many of each collective the compiled HLO text runs (async pairs count once).

    A collective whose device groups are all single devices moves nothing and is not counted:
    a `psum` over a mesh axis of size 1 still lowers to one, which XLA's CPU pipeline keeps.
    """
    found = dict.fromkeys(COLLECTIVES, 0)
    for line in hlo.splitlines():
        for name in COLLECTIVES:
            if re.search(rf"\s{name}(?:-start)?\(", line) and not _single_device_groups(line):
                found[name] += 1
    return found


def _single_device_groups(instruction: str) -> bool:
    """Whether an HLO instruction's replica_groups are all of one device, in either notation."""
    if match := re.search(r"replica_groups=\[\d+,(\d+)\]<=", instruction):  # iota: [groups,size]
        return match[1] == "1"
    if match := re.search(r"replica_groups=\{(\{[\d,{}]*\})\}", instruction):
        return all("," not in g for g in re.findall(r"\{([\d,]*)\}", match[1]))
    return False


def gathered(hlo: str) -> list[tuple[int, ...]]:
    """The result shapes of the compiled HLO text's all-gathers."""
    shapes = []
    for line in hlo.splitlines():
        if (match := re.search(r"=\s*\w+\[([\d,]*)\][^=]*\sall-gather(?:-start)?\(", line)) and (
            not _single_device_groups(line)
        ):
            shapes.append(tuple(int(d) for d in match[1].split(",") if d))
    return shapes


def counts(**nonzero) -> dict[str, int]:
    want = dict.fromkeys(COLLECTIVES, 0)
    want.update({k.replace("_", "-"): v for k, v in nonzero.items()})
    return want


def same_spec(spec):
    """A PartitionSpec without its trailing unsharded dims, for comparisons."""
    spec = tuple(spec)
    while spec and spec[-1] is None:
        spec = spec[:-1]
    return spec


def assert_rounded_once(test, got, want_f32, max_share=0.01):
    """Nearly every element of `got` (16 bits) is `want_f32` rounded once to its dtype: partials
    summed in float32 before the rounding differ from it in a few elements at most (another
    summation order), partials each rounded to 16 bits first in many."""
    got = np.asarray(got)
    rounded = np.asarray(jnp.asarray(want_f32).astype(got.dtype))
    share = float(np.mean(got != rounded))
    test.assertLessEqual(share, max_share, f"{share:.1%} of the elements differ")


def rand(seed, *shape):
    x = np.random.default_rng(seed).standard_normal(shape).astype(np.float32)
    return jnp.asarray(x)


def mlp(x, w1, b1, w2, activation="gelu"):
    """A Megatron MLP: column-parallel up-projection, row-parallel down-projection."""
    h = jax_sm100.matmul(x, w1, bias=b1, activation=activation)
    return jax_sm100.matmul(h, w2)


def grad_of(f, argnums):
    return jax.grad(lambda *args: jnp.sum(jnp.sin(f(*args))), argnums=argnums)


def _delegated(cls):
    """Runs each test of `cls` here, or on cpu reports its outcome from a child with the devices."""
    for name in [n for n in dir(cls) if n.startswith("test")]:
        method = getattr(cls, name)
        if not callable(method):
            continue

        @functools.wraps(method)
        def wrapper(self, *args, _method=method, **kwargs):
            if _PLATFORM != "cpu" or _enough_devices():
                return _method(self, *args, **kwargs)
            if os.environ.get(_CHILD_ENV):
                self.fail(f"the child process has {len(jax.devices('cpu'))} CPU devices")
            module_file = sys.modules[type(self).__module__].__file__
            outcome, message = _child_outcomes(module_file, type(self).__name__).get(
                self._testMethodName, ("missing", "the child process did not run this test")
            )
            if outcome == "skipped":
                self.skipTest(message)
            if outcome != "passed":
                self.fail(f"in a child process with {_DEVICES} CPU devices: {message}")
            return None

        setattr(cls, name, wrapper)
    return cls


def _child_env() -> dict[str, str]:
    return dict(
        os.environ, PYTHONPATH=os.pathsep.join([str(REPO_ROOT), os.environ.get("PYTHONPATH", "")])
    )


@functools.cache
def _child_outcomes(module_file: str, class_name: str) -> dict[str, tuple[str, str]]:
    """Runs one test class of a module (this one, or another sharded suite that imports these
    helpers) under pytest in a fresh process; {test name: (outcome, message)}."""
    env = dict(_child_env(), **{_CHILD_ENV: "1"})
    with tempfile.TemporaryDirectory() as tmp:
        report = Path(tmp) / "report.xml"
        proc = subprocess.run(
            [
                sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-p", "no:xdist",
                f"--junitxml={report}", f"{module_file}::{class_name}",
            ],
            env=env, cwd=REPO_ROOT, capture_output=True, text=True, timeout=600,
        )  # fmt: skip
        if not report.exists():
            return {"": ("error", proc.stdout[-4000:] + proc.stderr[-4000:])}
        outcomes = {}
        for case in ET.parse(report).iter("testcase"):
            outcome, message = "passed", ""
            for child in case:
                if child.tag in ("failure", "error", "skipped"):
                    outcome = child.tag
                    kind = child.get("type", "")
                    message = f"{kind} {child.get('message', '')}\n{child.text or ''}"[-4000:]
            outcomes[case.get("name")] = (outcome, message)
        return outcomes


class ShardedTestCase(parameterized.TestCase):
    """The ("data", "model") mesh of this run and the checks every case makes."""

    axis_types = AxisType.Explicit

    def setUp(self):
        super().setUp()
        shape = run_mesh_shape()
        if _PLATFORM == "cpu" and not _enough_devices():
            return  # `_delegated` runs the test in a child process
        if not _enough_devices():
            self.skipTest(
                f"the {shape[0]}x{shape[1]} mesh needs {shape[0] * shape[1]} {_PLATFORM} devices; "
                f"{len(platform_devices())} found"
            )
        self.devices = platform_devices()[: shape[0] * shape[1]]
        self.mesh = jax.make_mesh(
            shape, AXES, axis_types=(self.axis_types,) * 2, devices=self.devices
        )

    def require(self, axis: str):
        """Skips a case that exists to show a collective over `axis` when the mesh lacks it."""
        if axis_size(axis) < 2:
            shape = "x".join(map(str, run_mesh_shape()))
            self.skipTest(f"needs a {axis!r} axis of size >= 2; the mesh is {shape} {AXES}")

    def put(self, x, spec):
        return jax.device_put(x, NamedSharding(self.mesh, spec))

    def check(
        self, f, args, specs, want_counts, *, out_spec=None, grad=False, reference=None, rtol=None
    ):
        """f on sharded args equals `reference` (default f) on one device, to `rtol` of the
        largest element (default `rtol_for`); its collectives (`want_counts`, or one of a list
        of them)."""
        sharded = [self.put(x, s) for x, s in zip(args, specs, strict=True)]
        out_shardings = None if out_spec is None else NamedSharding(self.mesh, out_spec)
        jitted = jax.jit(f, out_shardings=out_shardings)
        hlo = jitted.lower(*sharded).compile().as_text()
        got = jitted(*sharded)
        want = jax.jit(reference or f)(*[jax.device_put(x, self.devices[0]) for x in args])
        rtol = rtol_for(args, grad=grad) if rtol is None else rtol
        for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
            w = np.asarray(w, np.float64)
            scale = max(float(np.max(np.abs(w))), 1e-6)
            np.testing.assert_allclose(np.asarray(g, np.float64), w, atol=rtol * scale, rtol=0)
        if isinstance(want_counts, list):
            self.assertIn(collectives(hlo), want_counts)
        else:
            self.assertEqual(collectives(hlo), want_counts)
        return got, hlo


class HelpersTest(absltest.TestCase):
    def test_collectives_skips_single_device_groups(self):
        hlo = "\n".join([
            "  %a = f32[8] all-reduce(f32[8] %x), replica_groups={{0,1},{2,3}}, to_apply=%add",
            "  %b = f32[8] all-reduce-start(f32[8] %a), replica_groups=[4,2]<=[8], to_apply=%add",
            "  %c = f32[8] all-reduce-done(f32[8] %b)",
            "  %d = f32[8] all-reduce(f32[8] %c), replica_groups={{0},{1}}, to_apply=%add",
            "  %e = f32[8] all-reduce(f32[8] %d), replica_groups=[2,1]<=[2], to_apply=%add",
            "  %f = f32[4] reduce-scatter(f32[8] %e), replica_groups={{0,1}}, dimensions={0}",
        ])  # fmt: skip
        self.assertEqual(collectives(hlo), counts(all_reduce=2, reduce_scatter=1))

    def test_defaults(self):
        self.assertEqual(mesh_shape("cpu", 8), (2, 4))
        self.assertEqual(mesh_shape("cpu", 1), (2, 4))  # the devices are forced
        for n, want in ((2, (1, 2)), (3, (1, 2)), (4, (2, 2)), (6, (2, 2)), (8, (2, 4))):
            self.assertEqual(mesh_shape("gpu", n), want, f"{n} GPUs")

    def test_override(self):
        self.assertEqual(mesh_shape("gpu", 2, "2x1"), (2, 1))
        self.assertEqual(mesh_shape("cpu", 8, " 1x2 "), (1, 2))
        for bad in ("2", "2x0", "2*4", "ax2"):
            with self.assertRaisesRegex(ValueError, _MESH_ENV):
                mesh_shape("cpu", 8, bad)
        with self.assertRaisesRegex(ValueError, _PLATFORM_ENV):
            mesh_shape("tpu", 8)


# --- the cases of issue 4 ----------------------------------------------------------------------


def gelu_bias(x, w, b):
    return jax_sm100.matmul(x, w, bias=b, activation="gelu")


@_delegated
class ForwardTest(ShardedTestCase):
    def test_data_parallel_is_local(self):
        x, w, b = rand(0, 32, 48), rand(1, 48, 64), rand(2, 64)
        got, _ = self.check(gelu_bias, (x, w, b), (PS("data"), PS(), PS()), counts())
        self.assertEqual(same_spec(got.sharding.spec), same_spec(PS("data")))

    def test_column_parallel_is_local(self):
        x, w, b = rand(0, 32, 48), rand(1, 48, 64), rand(2, 64)
        specs = (PS("data"), PS(None, "model"), PS("model"))
        got, _ = self.check(gelu_bias, (x, w, b), specs, counts())
        self.assertEqual(same_spec(got.sharding.spec), same_spec(PS("data", "model")))

    @parameterized.named_parameters(
        ("plain", None, False), ("gelu_bias", "gelu", True), ("relu_bias", "relu", True)
    )
    def test_row_parallel_reduces_once(self, activation, with_bias):
        # The bias (added once) and the activation (applied to the sum) only match the
        # unsharded result if the epilogue waits for the reduction.
        x, w, b = rand(0, 32, 48), rand(1, 48, 64), rand(2, 64)
        f = lambda x, w, b: jax_sm100.matmul(
            x, w, bias=b if with_bias else None, activation=activation
        )
        specs = (PS("data", "model"), PS("model", None), PS())
        got, _ = self.check(f, (x, w, b), specs, counts(all_reduce=reduces("model")))
        self.assertEqual(same_spec(got.sharding.spec), same_spec(PS("data")))

    def test_row_parallel_reduce_scatters_when_the_output_is_sharded(self):
        # Asked by the jit's out_shardings or by the product's out_sharding=: behind the
        # results' open constraints (sharding.lower_partitioned) the split reaches the custom
        # call by propagation (a closed constraint of the type all-reduced, then sliced).
        self.require("model")
        x, w, b = rand(0, 32, 48), rand(1, 48, 64), rand(2, 64)
        specs = (PS("data", "model"), PS("model", None), PS())
        split = NamedSharding(self.mesh, PS("data", "model"))
        typed = lambda x, w, b: jax_sm100.matmul(
            x, w, bias=b, activation="gelu", out_sharding=split
        )
        for f in (gelu_bias, typed):
            got, _ = self.check(
                f, (x, w, b), specs, counts(reduce_scatter=1), out_spec=PS("data", "model"),
                reference=gelu_bias,
            )  # fmt: skip
            self.assertEqual(same_spec(got.sharding.spec), same_spec(PS("data", "model")))

    def test_row_parallel_with_c_alpha_beta_bfloat16(self):
        x, w, c = rand(0, 32, 48), rand(1, 48, 64), rand(2, 32, 64)
        x, w = x.astype(jnp.bfloat16), w.astype(jnp.bfloat16)
        f = lambda x, w, c: jax_sm100.matmul(
            x, w, c=c, alpha=0.5, beta=-2.0, activation="silu", out_dtype=jnp.float32
        )
        specs = (PS(None, "model"), PS("model", None), PS("data"))
        self.check(f, (x, w, c), specs, counts(all_reduce=reduces("model")))

    def test_mlp_on_2d_mesh(self):
        # Data parallel over "data", tensor parallel over "model": one all-reduce per block.
        x, w1, b1, w2 = rand(0, 32, 48), rand(1, 48, 128), rand(2, 128), rand(3, 128, 48)
        specs = (PS("data"), PS(None, "model"), PS("model"), PS("model", None))
        got, _ = self.check(mlp, (x, w1, b1, w2), specs, counts(all_reduce=reduces("model")))
        self.assertEqual(same_spec(got.sharding.spec), same_spec(PS("data")))

    def test_batch_and_n_sharded_is_local(self):
        a, b = rand(0, 4, 16, 32), rand(1, 4, 32, 64)
        specs = (PS("data"), PS("data", None, "model"))
        got, _ = self.check(jax_sm100.matmul, (a, b), specs, counts())
        self.assertEqual(same_spec(got.sharding.spec), same_spec(PS("data", None, "model")))

    @parameterized.named_parameters(
        ("column_parallel", (PS("data"), PS(None, "model"), PS("data", "model")), ()),
        ("row_parallel", (PS("data", "model"), PS("model"), PS("data")), ("model",)),
    )
    def test_a_users_plan_runs_on_the_local_problem(self, specs, reduced_over):
        x, w, c = rand(0, 64, 128), rand(1, 128, 256), rand(2, 64, 256)
        plan = jax_sm100.plan_for(x, w, c=c)
        f = lambda x, w, c: jax_sm100.matmul(x, w, c=c, beta=0.5, plan=plan)
        # The per-device bind's plan (on a CPU the kernels do not run it: read it as made).
        made = []

        def spy(*args):
            params = local_params(*args)
            made.append(params["plan"])
            return params

        local_params = sharding_rules._local_params
        with mock.patch.object(sharding_rules, "_local_params", spy):
            self.check(f, (x, w, c), specs, counts(all_reduce=reduces(*reduced_over)))
        split = lambda size, spec: size // math.prod(axis_size(a) for a in spec if a)  # noqa: E731
        m, k, n = split(64, specs[0][:1]), split(128, specs[1][:1]), split(256, specs[1][1:])
        self.assertTrue(made)
        for local in made:
            self.assertEqual((local.m, local.n, local.k), (m, n, k))
            self.assertEqual(local.out_dtype, "float32")
            # A k split over devices binds the partial product (no C; C added after the sum).
            self.assertEqual(local.c_dtype, None if reduces(*reduced_over) else "float32")

    def test_lowering_is_a_custom_partitioning_call(self):
        # XLA must not see a dot it could partition by itself, or the CPU tests prove nothing
        # about the GPU runs.
        x, w, b = rand(0, 32, 48), rand(1, 48, 64), rand(2, 64)
        specs = (PS("data"), PS(None, "model"), PS("model"))
        sharded = [self.put(v, s) for v, s in zip((x, w, b), specs, strict=True)]
        text = jax.jit(gelu_bias).lower(*sharded).as_text()
        self.assertIn("@CustomSPMDPartitioning", text)
        self.assertIn("sdy.sharding_rule", text)
        self.assertNotIn("stablehlo.dot_general", text)
        single = jax.jit(gelu_bias).lower(x, w, b).as_text()
        self.assertNotIn("CustomSPMDPartitioning", single)
        # XLA's dot, or on a GPU our kernel's FFI call (float32 operands on sm_100a).
        self.assertTrue("dot_general" in single or "jax_sm100_gemm" in single, single[-2000:])

    def test_single_device_programs_still_export(self):
        # The partitioner's callbacks cannot be serialized; unsharded lowerings never make one.
        x, w, b = rand(0, 32, 48), rand(1, 48, 64), rand(2, 64)
        exported = jax.export.export(jax.jit(gelu_bias))(x, w, b)
        self.assertNotIn("CustomSPMDPartitioning", exported.mlir_module())
        restored = jax.export.deserialize(exported.serialize())
        got, want = restored.call(x, w, b), jax.jit(gelu_bias)(x, w, b)
        if _PLATFORM == "cpu":
            np.testing.assert_array_equal(got, want)
        else:  # two compilations: XLA's GPU autotuner may pick another GEMM algorithm
            scale = float(np.max(np.abs(want)))
            np.testing.assert_allclose(got, want, rtol=0, atol=rtol_for((x,), grad=False) * scale)

    def test_inside_shard_map_runs_the_local_product(self):
        x, w = rand(0, 32, 48), rand(1, 48, 64)

        def f(x, w):
            local = lambda x, w: jax.lax.psum(jax_sm100.matmul(x, w, alpha=2.0), "model")
            return jax.shard_map(
                local, mesh=self.mesh, in_specs=(PS("data", "model"), PS("model")),
                out_specs=PS("data"),
            )(x, w)  # fmt: skip

        specs = (PS("data", "model"), PS("model"))
        reference = lambda x, w: jax_sm100.matmul(x, w, alpha=2.0)
        self.check(f, (x, w), specs, counts(all_reduce=reduces("model")), reference=reference)


@_delegated
class TransformTest(ShardedTestCase):
    def test_vmap_over_a_sharded_batch_is_local(self):
        x, w, b = rand(0, 4, 16, 48), rand(1, 48, 64), rand(2, 64)
        f = jax.vmap(gelu_bias, in_axes=(0, None, None))
        specs = (PS("data"), PS(None, "model"), PS("model"))
        got, _ = self.check(f, (x, w, b), specs, counts())
        self.assertEqual(same_spec(got.sharding.spec), same_spec(PS("data", None, "model")))
        # The backward pass: dx over the sharded n, dW and db over the sharded batch.
        want = counts(all_reduce=reduces("model", "data"))
        self.check(grad_of(f, (0, 1, 2)), (x, w, b), specs, want, grad=True)

    def test_vmap_over_both_operands_with_k_sharded(self):
        a, b = rand(0, 8, 16, 32), rand(1, 8, 32, 64)
        f = jax.vmap(lambda a, b: jax_sm100.matmul(a, b, activation="gelu"))
        specs = (PS("data", None, "model"), PS("data", "model"))
        self.check(f, (a, b), specs, counts(all_reduce=reduces("model")))
        # da and db contract over unsharded n and m: only the forward pass communicates.
        want = counts(all_reduce=reduces("model"))
        self.check(grad_of(f, (0, 1)), (a, b), specs, want, grad=True)

    @parameterized.named_parameters(
        # dW and db sum over the sharded rows: the data-parallel gradient reduction.
        ("data_parallel", (PS("data"), PS(), PS()), ("data",)),
        # dx contracts over the sharded n (over "model"); dW and db over the rows ("data").
        ("column_parallel", (PS("data"), PS(None, "model"), PS("model")), ("model", "data")),
        # The forward all-reduce over "model"; dW and db over "data"; dx is local.
        ("row_parallel", (PS("data", "model"), PS("model", None), PS()), ("model", "data")),
    )
    def test_grad(self, specs, reduced_over):
        x, w, b = rand(0, 32, 48), rand(1, 48, 64), rand(2, 64)
        want = counts(all_reduce=reduces(*reduced_over))
        grads, _ = self.check(grad_of(gelu_bias, (0, 1, 2)), (x, w, b), specs, want, grad=True)
        # Each gradient keeps its primal's sharding: no weight was gathered.
        for g, spec in zip(grads, specs, strict=True):
            self.assertEqual(same_spec(g.sharding.spec), same_spec(spec))

    def test_grad_of_mlp_on_2d_mesh(self):
        # Forward: one all-reduce. Backward: dx over "model", the weight gradients over "data".
        x, w1, b1, w2 = rand(0, 32, 48), rand(1, 48, 128), rand(2, 128), rand(3, 128, 48)
        specs = (PS("data"), PS(None, "model"), PS("model"), PS("model", None))
        want = counts(all_reduce=reduces("model", "model", "data"))
        grads, _ = self.check(grad_of(mlp, (0, 1, 2, 3)), (x, w1, b1, w2), specs, want, grad=True)
        for g, spec in zip(grads, specs, strict=True):
            self.assertEqual(same_spec(g.sharding.spec), same_spec(spec))

    def test_shard_map_results_vary_and_differentiate(self):
        # Inside shard_map a product of device-varying operands varies over their manual axes
        # (as lax's do): its gradient through a psum is typed right (it raised "Expected
        # cotangent type ...{V:model}") and out_specs claiming a varying result replicated are
        # refused (they were accepted: each device's rows, silently). Every primitive alike.
        self.require("model")
        x, w, bias = rand(0, 16, 32), rand(1, 32, 24), rand(2, 24)
        sizes = jnp.array([5, 2], jnp.int32)  # of each device's 8 rows
        sx, sw = PS("data", "model"), PS("model", None)
        products = {
            "matmul": (
                lambda a, b, c: jax_sm100.matmul(a, b, bias=c, activation="gelu"),
                lambda a, b, c: jax.nn.gelu(a @ b + c, approximate=True),
            ),
            "dot_general": (
                lambda a, b, c: jax_sm100.dot_general(a, b, (((1,), (0,)), ((), ()))) * c,
                lambda a, b, c: (a @ b) * c,
            ),
            "ragged_dot": (
                lambda a, b, c: jax_sm100.ragged_dot(a, jnp.stack([b, 2 * b]), sizes) + c,
                lambda a, b, c: jax.lax.ragged_dot(a, jnp.stack([b, 2 * b]), sizes) + c,
            ),
            "scaled_matmul": (
                lambda a, b, c: (
                    jax_sm100.scaled_matmul(
                        a[None],
                        b.T[None],
                        jnp.ones((1, a.shape[0], 1), jnp.float32),
                        jnp.ones((1, 24, 1), jnp.float32),
                    )[0]
                    + c
                ),
                lambda a, b, c: a @ b + c,
            ),
        }
        args = (self.put(x, sx), self.put(w, sw), self.put(bias, PS()))
        for name, (ours, theirs) in products.items():
            for op in (ours, theirs):
                f = jax.shard_map(
                    lambda a, b, c, op=op: jax.lax.psum(op(a, b, c), "model"),
                    mesh=self.mesh, in_specs=(sx, sw, PS()), out_specs=PS("data"),
                )  # fmt: skip
                got = jax.jit(jax.grad(lambda *v, f=f: jnp.sum(jnp.sin(f(*v))), (0, 1, 2)))(*args)
                if op is ours:
                    mine = got
            for u, v in zip(mine, got, strict=True):
                assert_f32_close(u, v, 1e-4, err_msg=name)
            wrong = jax.shard_map(ours, mesh=self.mesh, in_specs=(sx, sw, PS()), out_specs=PS())
            with self.assertRaisesRegex(ValueError, "out_specs which require replication"):
                jax.jit(wrong)(*args)


@_delegated
class PartitionerTest(ShardedTestCase):
    """The same rules under Auto mesh axes, with Shardy and with GSPMD propagation."""

    axis_types = AxisType.Auto

    @parameterized.named_parameters(("shardy", True), ("gspmd", False))
    def test_mlp_and_its_grad(self, shardy):
        x, w1, b1, w2 = rand(0, 32, 48), rand(1, 48, 128), rand(2, 128), rand(3, 128, 48)
        specs = (PS("data"), PS(None, "model"), PS("model"), PS("model", None))
        before = jax.config.jax_use_shardy_partitioner
        jax.config.update("jax_use_shardy_partitioner", shardy)
        try:
            self.check(mlp, (x, w1, b1, w2), specs, counts(all_reduce=reduces("model")))
            want = counts(all_reduce=reduces("model", "model", "data"))
            self.check(grad_of(mlp, (0, 1, 2, 3)), (x, w1, b1, w2), specs, want, grad=True)
        finally:
            jax.config.update("jax_use_shardy_partitioner", before)

    def test_row_parallel_reduce_scatter(self):
        self.require("model")
        x, w, b = rand(0, 32, 48), rand(1, 48, 64), rand(2, 64)
        specs = (PS(None, "model"), PS("model", None), PS())
        self.check(
            gelu_bias, (x, w, b), specs, counts(reduce_scatter=1), out_spec=PS(None, "model")
        )

    def test_scatter_inside_a_dims_local_blocks(self):
        # m over "data" (local), k over "model"; the result asked over ("data", "model"): k's
        # partials are scattered onto m inside each "data" block, "model" the minor axis.
        self.require("data")
        self.require("model")
        x, w = rand(0, 32, 48), rand(1, 48, 64)
        specs = (PS("data", "model"), PS("model", None))
        got, _ = self.check(jax_sm100.matmul, (x, w), specs, counts(reduce_scatter=1),
                            out_spec=PS(("data", "model")))  # fmt: skip
        self.assertEqual(same_spec(got.sharding.spec), (("data", "model"),))

    def test_requested_split_of_n_beside_rows_over_its_axis(self):
        # Sequence parallelism's backward: the cotangent's rows over "model", the weight's n
        # over "model", the result asked over "model" along n. The rows are gathered (XLA's
        # dot does the same); the rows took the axis before, so the weight was gathered and the
        # result moved to the requested split by an all-to-all. Both propagators.
        self.require("model")
        x, w = rand(0, 4, 64, 32), rand(1, 32, 256)
        specs = (PS(None, "model"), PS(None, "model"))
        for shardy in (True, False):
            before = jax.config.jax_use_shardy_partitioner
            jax.config.update("jax_use_shardy_partitioner", shardy)
            try:
                got, _ = self.check(jax_sm100.matmul, (x, w), specs, counts(all_gather=1),
                                    out_spec=PS(None, None, "model"))  # fmt: skip
            finally:
                jax.config.update("jax_use_shardy_partitioner", before)
            self.assertEqual(same_spec(got.sharding.spec), (None, None, "model"))

    def test_requested_split_beside_rows_in_bfloat16(self):
        # The case above in bfloat16: the rows are gathered, not the weight. Counted in the
        # result's own dtype the two moves tied, and the tie kept the rows' split: the weight
        # gathered and the result moved, by a full gather on JAX 0.12 (2.5x the bytes; the
        # weight's gradient gathers the rows anyway). Ties go to the request, and the result's
        # move counts as a gather (review helper-115).
        self.require("model")
        x, w = rand(0, 1024, 256).astype(jnp.bfloat16), rand(1, 256, 512).astype(jnp.bfloat16)
        f = jax.jit(jax_sm100.matmul, out_shardings=NamedSharding(self.mesh, PS(None, "model")))
        args = (self.put(x, PS("model")), self.put(w, PS(None, "model")))
        self.assertNotIn((256, 512), gathered(f.lower(*args).compile().as_text()))
        want = np.matmul(np.asarray(x, np.float32), np.asarray(w, np.float32))
        np.testing.assert_allclose(np.asarray(f(*args), np.float32), want, rtol=0,
                                   atol=2e-2 * np.abs(want).max())  # fmt: skip

    def test_k_over_two_axes_scattered_over_one(self):
        # k over both axes, the result asked split over "model": one bind both reduce-scatters
        # (over "model") and all-reduces (over "data").
        self.require("model")
        x, w = rand(0, 32, 64), rand(1, 64, 48)
        specs = (PS(None, ("data", "model")), PS(("data", "model")))
        want = counts(reduce_scatter=1, all_reduce=reduces("data"))
        self.check(jax_sm100.matmul, (x, w), specs, want, out_spec=PS(None, "model"))

    @parameterized.parameters(12, 4)
    def test_k_uneven_over_two_axes(self, k):
        # k that each axis divides but their product does not (on 2 x 4): the product is split
        # over the prefix that divides it, never unevenly.
        x, w = rand(0, 32, k), rand(1, k, 16)
        both = PS(None, ("data", "model"))

        def f(x, w):
            x = jax.lax.with_sharding_constraint(x, NamedSharding(self.mesh, both))
            w = jax.lax.with_sharding_constraint(w, NamedSharding(self.mesh, PS(both[1])))
            return jax_sm100.matmul(x, w)

        got = jax.jit(f)(x, w)
        want = jnp.matmul(x, w, precision="highest")
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)

    def test_k_partials_reduce_in_float32(self):
        # bfloat16 operands and result, k over "model": the partials are summed in float32 and
        # rounded once, so (nearly) every element is the float32 product rounded once (each
        # device's partial rounded to bfloat16 first moved 18-40 % of them).
        x = rand(0, 64, 1024).astype(jnp.bfloat16)
        w = rand(1, 1024, 64).astype(jnp.bfloat16)
        specs = (PS(None, "model"), PS("model"))
        got = jax.jit(jax_sm100.matmul)(self.put(x, specs[0]), self.put(w, specs[1]))
        self.assertEqual(got.dtype, jnp.bfloat16)
        want = jnp.matmul(x, w, preferred_element_type=jnp.float32, precision="highest")
        assert_rounded_once(self, got, want)

    @parameterized.named_parameters(("shardy", True), ("gspmd", False))
    def test_fully_sharded_operands_scatter_once(self, shardy):
        # FSDP's layout: the activations, the weight and the bias all split on their first
        # dim over one axis, so k is split and both m (from x) and n (from the bias) name its
        # axis. Its partials are reduce-scattered onto one of them; both claimed it before
        # (Shardy: a spec naming the axis twice; GSPMD aborted the process).
        x, w, b = rand(0, 32, 48), rand(1, 48, 64), rand(2, 64)
        specs = (PS("data"), PS("data"), PS("data"))
        before = jax.config.jax_use_shardy_partitioner
        jax.config.update("jax_use_shardy_partitioner", shardy)
        try:
            sharded = [self.put(v, sp) for v, sp in zip((x, w, b), specs, strict=True)]
            for f in (gelu_bias, grad_of(gelu_bias, (0, 1, 2))):
                got = jax.jit(f)(*sharded)
                want = jax.jit(f)(*[jax.device_put(v, self.devices[0]) for v in (x, w, b)])
                for g, r in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
                    np.testing.assert_allclose(g, r, rtol=1e-4, atol=1e-4)
        finally:
            jax.config.update("jax_use_shardy_partitioner", before)

    @parameterized.named_parameters(("shardy", True), ("gspmd", False))
    def test_fsdp_gathers_the_weight_when_that_moves_less(self, shardy):
        # FSDP's layout: x's rows and w's k over "data". With 256 rows, gathering w (48 x 64)
        # moves less than reduce-scattering every device's float32 partial product of all 256
        # rows, so w is gathered and each device computes its rows, with no reduction (k-split
        # first moved x and reduce-scattered 64 KiB). With 8 rows the partials are the smaller
        # and k stays split. Under grad, as for jnp.matmul: w gathered once, its gradient
        # all-reduced (no output sharding asks for w's split).
        self.require("data")
        before = jax.config.jax_use_shardy_partitioner
        jax.config.update("jax_use_shardy_partitioner", shardy)
        try:
            w = rand(1, 48, 64)
            specs = (PS("data"), PS("data"))
            self.check(jax_sm100.matmul, (rand(0, 256, 48), w), specs, counts(all_gather=1))
            _, hlo = self.check(jax_sm100.matmul, (rand(0, 8, 48), w), specs,
                                [counts(reduce_scatter=1, all_to_all=1),
                                 counts(reduce_scatter=1, all_gather=1)])  # fmt: skip
            loss = grad_of(jax_sm100.matmul, (0, 1))
            self.check(loss, (rand(0, 256, 48), w), specs,
                       counts(all_gather=1, all_reduce=1), grad=True)  # fmt: skip
        finally:
            jax.config.update("jax_use_shardy_partitioner", before)

    def test_fsdp_training_step(self):
        # A two-layer MLP's step with FSDP's layout (x's rows, w1's and w2's first dim and the
        # updated weights over "data"): each weight is gathered once, each gradient
        # reduce-scattered to its split, as FSDP does by hand. Before, layer 1's forward kept k
        # split: two all-to-alls and four reduce-scatters, one of every device's partials of
        # the whole hidden activation; jnp.dot's step all-reduces both gradients.
        self.require("data")
        x, w1, w2 = rand(0, 512, 32), rand(1, 32, 128), rand(2, 128, 32)

        def step(w1, w2, x):
            def loss(w1, w2):
                h = jax.nn.gelu(jax_sm100.matmul(x, w1))
                return jnp.mean(jax_sm100.matmul(h, w2) ** 2)

            g1, g2 = jax.grad(loss, (0, 1))(w1, w2)
            return w1 - 0.1 * g1, w2 - 0.1 * g2

        self.check(step, (w1, w2, x), (PS("data"),) * 3,
                   counts(all_gather=2, reduce_scatter=2),
                   out_spec=PS("data"), grad=True)  # fmt: skip

    @parameterized.named_parameters(("shardy", True), ("gspmd", False))
    def test_layouts_that_keep_k_split(self, shardy):
        # Sequence parallelism's row-parallel product: x and w split along k over "model", the
        # residual c and the result along rows over it. Gathering x and w would move fewer
        # bytes than the float32 partials, but c's rows claim nothing: k stays split and the
        # partials are reduce-scattered onto the rows (review helper-103: they were gathered).
        # Then x's rows over both axes, w's k over "data" and n over "model": gathering w
        # would undo its n split too, more bytes than keeping k (it was gathered).
        self.require("model")
        self.require("data")
        before = jax.config.jax_use_shardy_partitioner
        jax.config.update("jax_use_shardy_partitioner", shardy)
        try:
            args = (rand(0, 512, 16), rand(1, 16, 64), rand(2, 512, 64))
            self.check(lambda x, w, c: jax_sm100.matmul(x, w, c=c), args,
                       (PS(None, "model"), PS("model"), PS("model")), counts(reduce_scatter=1),
                       out_spec=PS("model"))  # fmt: skip
            _, hlo = self.check(jax_sm100.matmul, (rand(0, 256, 256), rand(1, 256, 256)),
                                (PS(("data", "model")), PS("data", "model")),
                                [counts(reduce_scatter=1, all_gather=1, all_to_all=1,
                                        collective_permute=cp) for cp in (1, 2)])  # fmt: skip
        finally:
            jax.config.update("jax_use_shardy_partitioner", before)

    def test_fsdp_counts_the_results_reordering(self):
        # FSDP's layout with the result asked over ("data", "model"): keeping k reduce-scatters
        # onto rows already split over "model", so the rows come out over ("model", "data") and
        # XLA permutes them back (two collective-permutes); gathering w moves less (review
        # helper-104: the permutes were not counted and k stayed split).
        self.require("data")
        self.require("model")
        f = lambda x, w: jax_sm100.matmul(x, w)
        self.check(f, (rand(0, 128, 48), rand(1, 48, 64)), (PS("data"), PS("data")),
                   counts(all_gather=1), out_spec=PS(("data", "model")))  # fmt: skip

    def test_decoded_shardings(self):
        # The callbacks' GSPMD shardings read back as the NamedShardings they came from, over
        # meshes in and out of device order, one dim over two axes in either order; a dim over
        # a part of an axis reads as unsplit, the others keep their axes.
        from jax._src.sharding_impls import GSPMDSharding

        from jax_sm100._src import sharding as S

        if len(self.devices) < 8:
            self.skipTest("meshes of 8 devices")
        devices = np.array(self.devices)
        for order in (np.arange(8), np.arange(8)[::-1], np.array([5, 2, 7, 0, 3, 6, 1, 4])):
            for names, shape in ((("a", "b"), (2, 4)), (("a", "b", "c"), (2, 2, 2))):
                mesh = jax.sharding.Mesh(devices[order].reshape(shape), names)
                specs = [
                    PS(),
                    PS(names[0]),
                    PS(None, names[-1]),
                    PS((names[1], names[0])),
                    PS(names[0], (names[-1], names[1])) if len(names) > 2 else PS(names[1]),
                ]
                for spec in specs:
                    hlo = NamedSharding(mesh, spec)._to_xla_hlo_sharding(3)
                    gspmd = GSPMDSharding(mesh._flat_devices_tuple, hlo)
                    got = S.decoded(jax.ShapeDtypeStruct((8, 8, 8), jnp.float32, sharding=gspmd),
                                    mesh).sharding  # fmt: skip
                    self.assertEqual(same_spec(got.spec), same_spec(spec), (order, names, spec))
        # A sub-axis: dim 0 over half of "b" (4), dim 1 over "a": dim 0 reads as unsplit.
        mesh = jax.sharding.Mesh(devices.reshape(2, 4), ("a", "b"))
        replicated = [S.xc.OpSharding.Type.REPLICATED]
        sub = S.xc.HloSharding.iota_tile([2, 2, 2], [2, 2, 2], [1, 0, 2], replicated)
        got = S.decoded(jax.ShapeDtypeStruct(
            (8, 8), jnp.float32, sharding=GSPMDSharding(mesh._flat_devices_tuple, sub)
        ), mesh).sharding  # fmt: skip
        self.assertEqual(same_spec(got.spec), same_spec(PS(None, "a")))

    @parameterized.named_parameters(("shardy", True), ("gspmd", False))
    def test_an_operand_split_over_part_of_an_axis(self, shardy):
        # Rows split over "model" then reshaped to [2, rows / 2, k]: over 4 devices, the batch
        # dim of 2 holds a part of the axis (a sub-axis), a sharding JAX's decoding for custom
        # partitioning refused (the compile raised; under GSPMD XLA aborted the process). Such
        # an operand is gathered.
        # Its other dims keep their axes: with batch split over "data" as well, each device
        # computes its half of the batch.
        if axis_size("model") != 4:
            self.skipTest("a part of the axis: 'model' of 4 devices over a dim of 2")
        x, w = rand(0, 2, 256, 64), rand(1, 64, 32)
        f = lambda x, w: jax_sm100.matmul(x.reshape(2, 2, 128, 64), w)
        before = jax.config.jax_use_shardy_partitioner
        jax.config.update("jax_use_shardy_partitioner", shardy)
        try:
            for spec in (PS(None, "model"), PS("data", "model")):
                sharded = self.put(x, spec)
                got = jax.jit(f)(sharded, w)
                want = jax.jit(f)(*[jax.device_put(v, self.devices[0]) for v in (x, w)])
                np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)
                hlo = jax.jit(f).lower(sharded, w).compile().as_text()
                dots = re.findall(r"= f32\[([\d,]+)\]\{[^}]*\} dot\(", hlo)
                rows = 2 * 256 // (axis_size("data") if spec[0] else 1)
                self.assertTrue(dots, hlo)
                self.assertEqual({math.prod(map(int, d.split(","))) for d in dots}, {rows * 32})
        finally:
            jax.config.update("jax_use_shardy_partitioner", before)


@_delegated
class ExplicitAxesTest(ShardedTestCase):
    """Under Explicit axes the result is typed with the sharding the partitioner gives it, and
    the epilogue's tangents are typed like the result, so no cotangent is gathered."""

    def test_bias_gradient_is_one_all_reduce(self):
        # Only the bias is differentiated: its tangent reaches the output without a product.
        x, w, b, y = rand(0, 32, 48), rand(1, 48, 64), rand(2, 64), rand(3, 32, 64)
        f = jax.grad(lambda b, x, w, y: jnp.sum((jax_sm100.matmul(x, w, bias=b) - y) ** 2), 0)
        specs = (PS(), PS("data"), PS(), PS("data"))
        want = counts(all_reduce=reduces("data"))
        got, _ = self.check(f, (b, x, w, y), specs, want, grad=True)
        self.assertEqual(same_spec(got.sharding.spec), ())

    def test_flax_row_parallel_linear_with_out_sharding(self):
        # x split over k on "model" as the kernel's rows are: nnx.Linear takes the call with an
        # out_sharding (the partial sums reduced), and so does the fused layer (review
        # helper-160: its result dtype was worked out by a lax.dot_general without one, which
        # raised "Contracting dimensions are sharded").
        from flax import nnx  # noqa: PLC0415  (Flax is a test dependency, not the library's)

        from jax_sm100 import flax as sm100_flax  # noqa: PLC0415

        self.require("model")
        x = rand(0, 8, 6, 32)
        want_spec = same_spec(PS("data", None, None))
        with jax.set_mesh(self.mesh):
            xs = self.put(x, PS("data", None, "model"))
            outs = []
            for cls in (nnx.Linear, sm100_flax.Linear):
                layer = cls(32, 16, bias_init=nnx.initializers.normal(1.0), rngs=nnx.Rngs(0))
                layer.kernel.set_value(jax.sharding.reshard(layer.kernel[...], PS("model", None)))
                y = jax.jit(lambda x, m=layer: m(x, out_sharding=PS("data", None, None)))(xs)
                self.assertEqual(same_spec(y.sharding.spec), want_spec, cls)
                outs.append(np.asarray(y))
        np.testing.assert_allclose(outs[1], outs[0], rtol=1e-5, atol=1e-5)

    def test_gradients_typed_as_their_primals(self):
        # Each cotangent has its primal's type, as jnp's do: the backward products type theirs
        # from the other operand and the cotangent (a k split as the weight is, a bias whole
        # where the product is), which JAX refused; and a backward product whose operands
        # name one axis on both of its dims (c split over rows beside a weight split over k
        # on the same axis) types that dim once instead of raising.
        x, w, b, c = rand(0, 32, 48), rand(1, 48, 64), rand(2, 64), rand(3, 32, 64)
        ours = lambda x, w, b, c: jax_sm100.matmul(x, w, bias=b, c=c, activation="gelu")  # noqa: E731
        ref = lambda x, w, b, c: jax.nn.gelu(  # noqa: E731
            jnp.matmul(x, w, precision="highest") + c + b, approximate=True
        )
        loss = lambda f: lambda *a: jnp.sum(jnp.sin(f(*a)))  # noqa: E731
        cases = [
            (PS(), PS("data"), PS(), PS()),
            (PS(None, "data"), PS(), PS(), PS()),
            (PS(), PS(), PS("data"), PS()),
            (PS("data"), PS(), PS(), PS()),
            (PS(), PS("data"), PS(), PS("data", "model")),
        ]
        want = jax.grad(loss(ref), (0, 1, 2, 3))(x, w, b, c)
        for specs in cases:
            args = [self.put(v, sp) for v, sp in zip((x, w, b, c), specs, strict=True)]
            got = jax.jit(jax.grad(loss(ours), (0, 1, 2, 3)))(*args)
            for g, r, sp in zip(got, want, specs, strict=True):
                self.assertEqual(same_spec(g.sharding.spec), same_spec(sp), specs)
                np.testing.assert_allclose(g, r, rtol=1e-4, atol=1e-4)

    def test_fused_activation_gradients_typed_as_their_primals(self):
        # gelu(x @ w1) @ w2: the backward runs the activation's derivative in the d h
        # product's epilogue (autodiff's gated product), whose cotangents are typed as their
        # primals too. With w2's rows split on an axis h's columns are not (FSDP layouts), JAX
        # refused its d x ("Expected cotangent type").
        # (Scaled to keep the results near 1, where sin's gradient is well conditioned.)
        x, w1, w2 = (0.25 * rand(0, 32, 48), 0.25 * rand(1, 48, 64), 0.25 * rand(2, 64, 48))
        ours = lambda x, w1, w2: jax_sm100.matmul(  # noqa: E731
            jax_sm100.matmul(x, w1, activation="gelu"), w2
        )
        ref = lambda x, w1, w2: jnp.matmul(  # noqa: E731
            jax.nn.gelu(jnp.matmul(x, w1, precision="highest"), approximate=True), w2,
            precision="highest",
        )  # fmt: skip
        loss = lambda f: lambda *a: jnp.sum(jnp.sin(f(*a)))  # noqa: E731
        want = jax.grad(loss(ref), (0, 1, 2))(x, w1, w2)
        cases = [
            (PS("data"), PS(), PS("model")),
            (PS("data"), PS("model"), PS("model")),  # FSDP over "model"
            (PS("data"), PS(None, "model"), PS("model")),  # Megatron
        ]
        for specs in cases:
            args = [self.put(v, sp) for v, sp in zip((x, w1, w2), specs, strict=True)]
            f = jax.grad(loss(ours), (0, 1, 2))
            eqns = jax.make_jaxpr(f)(*args).jaxpr.eqns
            fused = [e for e in eqns if e.params.get("act_grad") is not None]
            self.assertEqual(len(fused), 1, specs)  # d h, gelu' in its epilogue
            got = jax.jit(f)(*args)
            for g, r, sp in zip(got, want, specs, strict=True):
                self.assertEqual(same_spec(g.sharding.spec), same_spec(sp), specs)
                np.testing.assert_allclose(g, r, rtol=1e-4, atol=1e-4)

    def test_weight_gradient_folds_a_split_batch(self):
        # A transformer's [batch, seq, d] activations with the batch over "data" and a 2-D
        # weight: its gradient folds the batch into k as without a mesh (a batch split becomes
        # a split of k), one product reduced over "data". It was a float32 product per local
        # batch index, [batch / data, d, n] (a weight's size times the local batch), summed
        # after. With the weight split over "data" too (FSDP) the reduction is a
        # reduce-scatter onto its split (it was an all-reduce and a slice).
        self.require("data")
        batch = 4 * axis_size("data")
        x, w = rand(0, batch, 8, 48), rand(1, 48, 64)
        loss = lambda w, x: jnp.sum(jnp.sin(jax_sm100.matmul(x, w)))  # noqa: E731
        ref = lambda w, x: jnp.sum(jnp.sin(jnp.matmul(x, w, precision="highest")))  # noqa: E731
        per_index = f"[{batch // axis_size('data')},48,64]"
        for w_spec, want in ((PS(), counts(all_reduce=reduces("data"))),
                             (PS("data"), counts(all_gather=1, reduce_scatter=1))):  # fmt: skip
            args = (self.put(w, w_spec), self.put(x, PS("data")))
            jaxpr = jax.make_jaxpr(jax.grad(loss))(*args).jaxpr
            wgrad = [e for e in jaxpr.eqns if e.primitive.name == "jax_sm100_matmul"][-1]
            self.assertEqual(wgrad.invars[0].aval.shape, (1, batch * 8, 48), w_spec)
            got, hlo = self.check(jax.grad(loss), (w, x), (w_spec, PS("data")), want,
                                  grad=True, reference=jax.grad(ref))  # fmt: skip
            self.assertNotIn(per_index, hlo, w_spec)
            self.assertEqual(same_spec(got.sharding.spec), same_spec(w_spec), w_spec)

    def test_weight_gradient_fold_ignores_axes_of_size_one(self):
        # A tensor- or context-parallel degree of 1: the sequence typed over an axis of size 1
        # splits nothing, so the batch still folds into k (the axis rides along on it). It
        # turned the fold off: a float32 product per batch index (review helper-111).
        mesh = jax.make_mesh((2, 1), AXES, axis_types=(AxisType.Explicit,) * 2,
                             devices=self.devices[:2])  # fmt: skip
        x, w = rand(0, 8, 16, 48), rand(1, 48, 64)
        loss = lambda w, x: jnp.sum(jnp.sin(jax_sm100.matmul(x, w)))  # noqa: E731
        ref = lambda w, x: jnp.sum(jnp.sin(jnp.matmul(x, w, precision="highest")))  # noqa: E731
        for x_spec in (PS("data", "model"), PS("model", "data")):
            args = (jax.device_put(w, NamedSharding(mesh, PS())),
                    jax.device_put(x, NamedSharding(mesh, x_spec)))  # fmt: skip
            jaxpr = jax.make_jaxpr(jax.grad(loss))(*args).jaxpr
            wgrad = [e for e in jaxpr.eqns if e.primitive.name == "jax_sm100_matmul"][-1]
            self.assertEqual(wgrad.invars[0].aval.shape, (1, 8 * 16, 48), x_spec)
            got = jax.jit(jax.grad(loss))(*args)
            np.testing.assert_allclose(got, jax.grad(ref)(w, x), rtol=1e-5, atol=1e-5)

    def test_weight_and_bias_gradients_with_the_sequence_split(self):
        # Context parallelism: the sequence split, over "data" under a whole batch, or over
        # "model" beside a batch over "data". The weight's gradient moves each split dim's
        # device blocks to the front of the rows (a local transpose), then folds them into k:
        # one product whose partials are reduced once, [d, n]. It was a float32 product per
        # batch index, [batch, d, n], reduced across devices whole. The bias's gradient is one
        # sum over the rows, reducing [n] (it reduced the per-batch sums, [batch, n]).
        self.require("data")
        self.require("model")
        x, w, b = rand(0, 8, 16, 48), rand(1, 48, 64), rand(2, 64)
        loss = lambda w, b, x: jnp.sum(  # noqa: E731
            jnp.sin(jax_sm100.matmul(x, w, bias=b, activation="gelu"))
        )
        ref = lambda w, b, x: jnp.sum(
            jnp.sin(
                jax.nn.gelu(  # noqa: E731
                    jnp.matmul(x, w, precision="highest") + b, approximate=True
                )
            )
        )
        grad, want_grad = jax.grad(loss, (0, 1)), jax.grad(ref, (0, 1))
        for x_spec, axes in ((PS(None, "data"), ("data",)),
                             (PS("data", "model"), ("data", "model"))):  # fmt: skip
            specs = (PS(), PS(), x_spec)
            jaxpr = jax.make_jaxpr(grad)(*[self.put(v, sp) for v, sp in
                                           zip((w, b, x), specs, strict=True)]).jaxpr  # fmt: skip
            wgrad = [e for e in jaxpr.eqns if e.primitive.name == "jax_sm100_matmul"][-1]
            self.assertEqual(wgrad.invars[0].aval.shape, (1, 8 * 16, 48), x_spec)
            # The two gradients' reductions (over each axis, or combined); nothing else moves.
            want = [counts(all_reduce=n) for n in range(1, 2 * len(axes) + 1)]
            _, hlo = self.check(grad, (w, b, x), specs, want, grad=True, reference=want_grad)
            for shapes in re.findall(r"= (.*) all-reduce(?:-start)?\(", hlo):
                self.assertNotIn("[8,", shapes, x_spec)  # no per-batch-index partial
                self.assertNotIn("[4,", shapes, x_spec)

    def test_einsum_with_heads_split(self):
        # nnx.Einsum's projections with heads split for tensor parallelism: the GEMM's reshapes
        # merge the split heads (major) with the head dim, a reshape that moves no data, typed
        # as such (primitive.typed_reshape): each contraction binds our matmul (they ran on
        # lax.dot_general before, JAX's own reshape rule refusing them). Values and result
        # types as jnp.einsum's.
        x, w, o = rand(0, 4, 8, 32), rand(1, 32, 4, 8), rand(2, 4, 8, 32)
        cases = [
            ("bsd,dhk->bshk", x, w, PS("data"), PS(None, "model")),
            ("bsd,hkd->bshk", x, o, PS("data"), PS("model")),
            ("bshk,hkd->bsd", rand(3, 4, 8, 4, 8), o, PS("data", None, "model"), PS("model")),
            # Sequence split over "model" beside heads split over it: a different plan from
            # XLA's (x moved to the heads' split, the weight never gathered), same values.
            ("bshk,hkd->bsd", rand(5, 4, 8, 4, 8), o, PS("data", "model"), PS("model")),
        ]
        for eq, a, b, sa, sb in cases:
            args = (self.put(a, sa), self.put(b, sb))
            # A contraction over the split heads needs its result's type spelled out (jnp too).
            kw = {"out_sharding": NamedSharding(self.mesh, PS("data"))} if eq[-3:] == "bsd" else {}
            ours = functools.partial(jax_sm100.einsum, eq, **kw)
            self.assertIn("jax_sm100_matmul", str(jax.make_jaxpr(ours)(*args)), eq)
            theirs = functools.partial(jnp.einsum, eq, **kw)
            # The values and their gradients, typed as jnp's.
            for f, g in ((ours, theirs), (grad_of(ours, (0, 1)), grad_of(theirs, (0, 1)))):
                got, want = jax.jit(f)(*args), jax.jit(g)(*args)
                for u, v in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
                    self.assertEqual(same_spec(u.sharding.spec), same_spec(v.sharding.spec), eq)
                    assert_f32_close(u, v, 1e-5)

    def test_typed_reshape(self):
        # Merges and splits whose split dims lead their group (each but the last one index a
        # device), on whole blocks of the group's first result dim, are typed without moving
        # data; the others are left to JAX's rule (a ShardingTypeError where it has none).
        # Values always x.reshape's.
        m = axis_size("model")
        x = rand(0, 2, 4 * m, 3, 8)
        cases = [
            # (spec, new shape, the result's spec or None where JAX's rule decides)
            (PS(None, "model"), (2, 4 * m * 3, 8), PS(None, "model")),
            (PS(None, "model"), (2, m, 4, 3, 8), PS(None, "model")),
            (PS(None, "model"), (2, 1, 4 * m, 1, 24), PS(None, None, "model")),
            # Both merged dims split: typed where the first holds one index a device.
            (
                PS("data", "model"),
                (2 * 4 * m, 3, 8),
                PS(("data", "model")) if axis_size("data") == 2 else None,
            ),
            (PS("data", "model"), (2, 4 * m * 3, 8), PS("data", "model")),
            (PS(None, "model"), (2, 2, 2 * m * 3, 8), None if m > 2 else PS(None, "model")),
        ]
        # An empty array: JAX's rule (the grouping needs nonzero sizes; it raised IndexError).
        empty = self.put(jnp.zeros((0, 4 * m)), PS(None, "model"))
        with self.assertRaises(jax_core.ShardingTypeError):
            primitive.typed_reshape(empty, (4 * m, 0))
        for spec, shape, want in cases:
            sharded = self.put(x, spec)
            f = lambda v, shape=shape: primitive.typed_reshape(v, shape)
            if want is None:
                try:
                    got = jax.jit(f)(sharded)
                except jax_core.ShardingTypeError:
                    continue
            else:
                got = jax.jit(f)(sharded)
                self.assertEqual(same_spec(got.sharding.spec), same_spec(want), (spec, shape))
                hlo = jax.jit(f).lower(sharded).compile().as_text()
                self.assertEqual(collectives(hlo), counts(), (spec, shape))
            np.testing.assert_array_equal(got, x.reshape(shape))

    def test_reshapes_that_move_data_run_on_lax(self):
        # Heads split as the minor dim of a merge (the head dim major) have no type a local
        # reshape gives: those contractions run on lax.dot_general, recorded, with lax's values
        # and types.
        x, o = rand(0, 4, 8, 32), rand(1, 4, 8, 8, 4)
        cases = [
            ("bsd,dkh->bshk", x, rand(2, 32, 8, 4), PS("data"), PS(None, None, "model")),
            ("bskh,khd->bsd", o, rand(3, 8, 4, 32), PS("data", None, None, "model"),
             PS(None, "model")),
        ]  # fmt: skip
        for eq, a, b, sa, sb in cases:
            args = (self.put(a, sa), self.put(b, sb))
            kw = {"out_sharding": NamedSharding(self.mesh, PS("data"))} if eq[-3:] == "bsd" else {}
            with jax_sm100.lowerings() as seen:
                got = jax.jit(functools.partial(jax_sm100.einsum, eq, **kw))(*args)
            self.assertTrue(any("reshape of a sharded dim" in str(s) for s in seen), (eq, seen))
            want = jax.jit(functools.partial(jnp.einsum, eq, **kw))(*args)
            self.assertEqual(same_spec(got.sharding.spec), same_spec(want.sharding.spec), eq)
            np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)

    def test_unreduced_operands_raise_as_in_lax(self):
        # An operand typed unreduced (partial sums pending over "model") raised a ValueError
        # from indexing its spec; lax's products raise a ShardingTypeError. Ours do too, naming
        # the reshard that reduces it, and that reshard works.
        self.require("model")
        a, b, w = rand(0, 16, 32), rand(1, 32, 64), rand(2, 64, 24)
        args = (self.put(a, PS(None, "model")), self.put(b, PS("model")), self.put(w, PS()))
        partial = NamedSharding(self.mesh, PS(None, None, unreduced={"model"}))
        reduced = NamedSharding(self.mesh, PS(None, None))

        def product(op, reduce_first=False):
            def f(a, b, w):
                h = jnp.dot(a, b, out_sharding=partial)
                return op(jax.sharding.reshard(h, reduced) if reduce_first else h, w)

            return f

        dims = (((1,), (0,)), ((), ()))
        for name, op in (
            ("matmul", jax_sm100.matmul),
            ("dot_general", lambda h, w: jax_sm100.dot_general(h, w, dims)),
        ):
            with self.assertRaisesRegex(
                jax_core.ShardingTypeError, rf"jax_sm100.{name}: .* jax.sharding.reshard\("
            ):
                jax.jit(product(op))(*args)
            assert_f32_close(jax.jit(product(op, reduce_first=True))(*args), a @ b @ w, 1e-4)

    def test_unreduced_results_and_reduced_operands(self):
        # out_sharding=P(..., unreduced=...) asks for partial sums: lax gives them (the kernels
        # reduced them, and resharding the sum to unreduced counted it once per device: 4x the
        # product after the next reduction). Operands typed reduced= are taken (their unreduced
        # gradient came out 2x over "data" the same way; an untyped ValueError before that).
        self.require("model")
        a, b = rand(0, 16, 32), rand(1, 32, 24)
        args = (self.put(a, PS(None, "model")), self.put(b, PS("model")))
        partial = NamedSharding(self.mesh, PS(None, None, unreduced={"model"}))
        whole = NamedSharding(self.mesh, PS())
        dims = (((1,), (0,)), ((), ()))
        for op in (
            lambda a, b: jax_sm100.matmul(a, b, out_sharding=partial),
            lambda a, b: jax_sm100.dot_general(a, b, dims, out_sharding=partial),
            lambda a, b: jax_sm100.einsum("ij,jk->ik", a, b, out_sharding=partial),
        ):
            self.assertEqual(jax.typeof(jax.jit(op)(*args)).sharding.spec.unreduced, {"model"})
            got = jax.jit(lambda a, b, op=op: jax.sharding.reshard(op(a, b), whole))(*args)
            np.testing.assert_allclose(got, a @ b, rtol=1e-4, atol=1e-4)
        with self.assertRaisesRegex(ValueError, "unreduced out_sharding asks for partial sums"):
            jax_sm100.matmul(*args, activation="gelu", out_sharding=partial)
        # A weight typed reduced over "data": its gradient is left unreduced, as jnp's.
        w = jax.device_put(b, NamedSharding(self.mesh, PS(None, None, reduced={"data"})))
        x = self.put(a, PS("data"))
        grads = {}
        for name, op in (("ours", jax_sm100.matmul), ("jnp", jnp.matmul)):

            def step(x, w, op=op):
                gx, gw = grad_of(lambda x, w: op(x, w), (0, 1))(x, w)
                self.assertEqual(jax.typeof(gw).sharding.spec.unreduced, {"data"})
                return gx, jax.sharding.reshard(gw, whole)

            grads[name] = jax.jit(step)(x, w)
        for u, v in zip(grads["ours"], grads["jnp"], strict=True):
            assert_f32_close(u, v, 1e-4)

    def test_reshard_of_a_result_to_unreduced(self):
        # A user's reshard of our result to an unreduced type, then back: Shardy gave the
        # custom call the reshard's unreduced axes (its callbacks saw them as replicated), and
        # the sum came back 4x over "model", whatever the operands' splits. Each primitive's
        # result now passes through open constraints (sharding.lower_partitioned).
        self.require("model")
        partial = NamedSharding(self.mesh, PS(None, None, unreduced={"model"}))
        whole = NamedSharding(self.mesh, PS())
        x, w = rand(0, 16, 32), rand(1, 32, 24)
        lhs, rhs = rand(2, 16, 32), rand(3, 4, 32, 24)
        sizes = jnp.asarray([3, 0, 9, 4], jnp.int32)
        q = jax_sm100.quantize(rand(4, 1, 16, 128), "fp8_block128")
        r = jax_sm100.quantize(rand(5, 1, 24, 128), "fp8_block128")
        cases = [
            (jax_sm100.matmul, (x, w), (PS(None, "model"), PS("model"))),
            (jax_sm100.matmul, (x, w), (PS("data"), PS())),
            (jax_sm100.matmul, (x, w), (PS(), PS(None, "model"))),
            (jax_sm100.ragged_dot, (lhs, rhs, sizes), (PS("data"), PS(), PS())),
            (jax_sm100.ragged_dot, (lhs, rhs, sizes), (PS(), PS("model"), PS())),
            (lambda *a: jax_sm100.scaled_matmul(*a)[0], (q[0], r[0], q[1], r[1]),
             (PS(), PS(), PS(), PS())),
        ]  # fmt: skip
        for op, args, specs in cases:
            args = [self.put(a, s) for a, s in zip(args, specs, strict=True)]
            want = jax.jit(lambda *a, op=op: jax.sharding.reshard(op(*a), whole))(*args)
            got = jax.jit(
                lambda *a, op=op: jax.sharding.reshard(jax.sharding.reshard(op(*a), partial), whole)
            )(*args)
            assert_f32_close(got, want, 1e-5, err_msg=str(specs))

    def test_reductions_inside_set_mesh(self):
        # Products whose per-device partial sums are reduced (k split; rows split under
        # ragged_dot's weight gradient), compiled inside `jax.sharding.set_mesh`: JAX 0.11
        # typed the per-device function's operands over the context's Explicit mesh and
        # lowered psum's reducer with Shardy constraints, which XLA refused (a GPU aborted).
        self.require("model")
        x, w = rand(0, 16, 256), rand(1, 256, 24)
        lhs, rhs = rand(2, 16, 32), rand(3, 4, 32, 24)
        sizes = jnp.asarray([3, 0, 9, 4], jnp.int32)
        q = jax_sm100.quantize(rand(4, 1, 16, 512), "fp8_block128")
        r = jax_sm100.quantize(rand(5, 1, 24, 512), "fp8_block128")
        grad = lambda op, n: jax.grad(lambda *a: jnp.sum(jnp.sin(op(*a))), tuple(range(n)))  # noqa: E731
        cases = [
            (jax_sm100.matmul, (x, w), (PS(None, "model"), PS("model"))),
            (grad(jax_sm100.matmul, 2), (x, w), (PS(None, "model"), PS("model"))),
            (grad(jax_sm100.ragged_dot, 2), (lhs, rhs, sizes), (PS("data"), PS(), PS())),
            (lambda *a: jax_sm100.scaled_matmul(*a)[0], (q[0], r[0], q[1], r[1]),
             (PS(None, None, "model"), PS(None, None, "model"), PS(), PS())),
        ]  # fmt: skip
        for op, args, specs in cases:
            sharded = [self.put(a, s) for a, s in zip(args, specs, strict=True)]
            want = jax.jit(op)(*sharded)
            with jax.sharding.set_mesh(self.mesh):
                got = jax.jit(op)(*sharded)
            for g, v in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
                assert_f32_close(g, v, 1e-6, err_msg=str(specs))

    def test_typed_operands_outside_a_mesh_context(self):
        # Operands typed over Explicit axes, no mesh in context: scaled_matmul's gradient (its
        # JVP's reference math passed a bare PartitionSpec to einsum, which needs a mesh in
        # context) and eager calls (ragged_dot's ran XLA's ragged_dot, which has no Explicit
        # rule; now eager calls compile the primitive as jit does), and with only one operand
        # typed (its reference read the plain one's axes).
        self.require("model")
        lhs, rhs = rand(2, 16, 256), rand(3, 4, 256, 24)
        sizes = jnp.asarray([3, 5, 0, 6], jnp.int32)
        q = jax_sm100.quantize(rand(4, 1, 16, 256), "fp8_block128")
        r = jax_sm100.quantize(rand(5, 1, 24, 256), "fp8_block128")
        floats = (q[0].astype(jnp.float32), r[0].astype(jnp.float32), q[1], r[1])
        loss = lambda *a: jnp.sum(jnp.sin(jax_sm100.scaled_matmul(*a)))  # noqa: E731
        cases = [
            (jax.jit(jax.grad(loss, (0, 1))), floats, (PS(None, "data"), PS(), PS(), PS())),
            (jax.jit(jax.grad(loss, (0, 1))), floats,
             (PS(None, None, "model"), PS(None, None, "model"), PS(), PS())),
            # One operand typed, the others plain arrays (None): raised a TypeError.
            (jax.jit(jax.grad(loss, (0, 1))), floats, (None, PS(None, "model"), None, None)),
            (jax.jit(jax.grad(loss, (0, 1))), floats, (PS(None, None, "model"), None, None, None)),
            (jax_sm100.ragged_dot, (lhs, rhs, sizes), (PS(None, "model"), PS(None, "model"), PS())),
            (jax_sm100.ragged_dot, (lhs, rhs, sizes), (PS("data"), PS(), PS())),
            (lambda *a: jax_sm100.scaled_matmul(*a)[0], (q[0], r[0], q[1], r[1]),
             (PS(None, "data"), PS(), PS(), PS())),
        ]  # fmt: skip
        for op, args, specs in cases:
            want = op(*args)
            got = op(
                *[a if s is None else self.put(a, s) for a, s in zip(args, specs, strict=True)]
            )
            for g, v in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
                assert_f32_close(g, v, 1e-5, err_msg=str(specs))

    def test_einsum_results_typed_as_lax(self):
        # Batch dims split in one operand only, or over two axes: the GEMM's rule kept the
        # split, lax's types the batch dim as its lhs has it, so a vjp given jnp's cotangent
        # raised on its type (19 of 240 random einsums, none now). dot_general reshards its
        # result to lax's type where they differ.
        self.require("model")
        cases = [
            ("bac,ac->ba", (4, 8, 16), (8, 16), PS(None, ("model", "data")), PS()),
            ("bac,ac->ba", (4, 8, 16), (8, 16), PS("model", "data"), PS(None, ("model", "data"))),
            ("bij,bjk->bik", (4, 8, 16), (4, 16, 8), PS(), PS("data")),
            # Its backward's products split one batch dim two ways (matmul's type rule raised).
            ("bhqd,bhkd->bhqk", (4, 8, 8, 16), (4, 8, 8, 16), PS("data"),
             PS(None, ("model", "data"))),
        ]  # fmt: skip
        for eq, sa, sb, pa, pb in cases:
            args = (self.put(rand(0, *sa), pa), self.put(rand(1, *sb), pb))
            try:
                want, jnp_vjp = jax.vjp(functools.partial(jnp.einsum, eq), *args)
            except jax_core.ShardingTypeError:
                # Newer JAX refuses batch dims split on one side only: so do ours (lax's rule
                # runs first).
                with self.assertRaises(jax_core.ShardingTypeError):
                    jax_sm100.einsum(eq, *args)
                continue
            got, our_vjp = jax.vjp(functools.partial(jax_sm100.einsum, eq), *args)
            self.assertEqual(jax.typeof(got).sharding.spec, jax.typeof(want).sharding.spec, eq)
            assert_f32_close(got, want, 1e-5)
            for g, w in zip(jax.jit(our_vjp)(want), jax.jit(jnp_vjp)(want), strict=True):
                self.assertEqual(jax.typeof(g).sharding.spec, jax.typeof(w).sharding.spec, eq)
                assert_f32_close(g, w, 1e-4)
        # A user's operands splitting one batch dim two ways raise as jnp.matmul's do.
        a, b = self.put(rand(2, 8, 4, 16), PS("model")), self.put(rand(3, 8, 16, 4), PS("data"))
        with self.assertRaisesRegex(ValueError, "batch dim 0 .* reshard"):
            jax_sm100.matmul(a, b)
        with self.assertRaises(ValueError):
            jnp.matmul(a, b)

    def test_result_types(self):
        x, w, c = rand(0, 32, 48), rand(1, 48, 64), rand(2, 32, 64)
        cases = [
            ((PS("data"), PS(None, "model"), None), ("data", "model")),
            ((PS("data", "model"), PS("model", None), None), ("data",)),
            ((PS(None, "model"), PS("model", None), PS("data")), ("data",)),  # m as c has it
        ]
        for (xs, ws, cs), want in cases:
            args = [self.put(x, xs), self.put(w, ws)] + ([self.put(c, cs)] if cs else [])
            f = lambda x, w, c=None: jax_sm100.matmul(x, w, c=c)
            out_type = jax.eval_shape(f, *args).sharding
            self.assertEqual(same_spec(out_type.spec), want)


# Runs a script (argv[1], its arguments after it) as __main__ with every plan made with
# force_kernel=True. The sm_90a planner sends problems under planning.SM90_MIN_FLOPS to XLA's
# dot, and the example's small products all are: without this, an H200 would run none on ours.
_FORCE_KERNEL_MAIN = """
import runpy, sys
from jax_sm100._src import planning
plan = planning.plan
planning.plan = lambda *args, **kw: plan(*args, **{**kw, "force_kernel": True})
sys.argv = sys.argv[1:]
runpy.run_path(sys.argv[0], run_name="__main__")
"""


class OneDeviceMeshTest(absltest.TestCase):
    """An Explicit mesh of one device: types name the axes, nothing is partitioned."""

    def test_contracting_dim_typed_on_a_size_one_axis(self):
        # Seen with examples/train_sharded.py on one GPU: XLA's dot refused a k typed as
        # sharded over the size-1 "model" axis ("ambiguous how the output should be sharded").
        mesh = jax.make_mesh((1, 1), AXES, axis_types=(AxisType.Explicit,) * 2,
                             devices=platform_devices()[:1])  # fmt: skip
        x, w, b = rand(0, 8, 32), rand(1, 32, 16), rand(2, 16)
        c = rand(3, 8, 16)

        def f(x, w, b, c):
            return jax_sm100.matmul(x, w, bias=b, c=c, beta=0.5, activation="gelu")

        def loss(x, w, b, c):
            return jnp.sum(f(x, w, b, c) ** 2)

        want = jax.jit(f)(x, w, b, c)
        want_g = jax.jit(jax.grad(loss, argnums=(0, 1, 2)))(x, w, b, c)
        with jax.sharding.set_mesh(mesh):
            args = [jax.device_put(v, NamedSharding(mesh, spec)) for v, spec in
                    zip((x, w, b, c), (PS("data", "model"), PS("model", None), PS(), PS()),
                        strict=True)]  # fmt: skip
            got = jax.jit(f)(*args)
            got_g = jax.jit(jax.grad(loss, argnums=(0, 1, 2)))(*args)
        np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-6, atol=1e-6)
        for g, w_ in zip(got_g, want_g, strict=True):
            np.testing.assert_allclose(np.asarray(g), np.asarray(w_), rtol=1e-5, atol=1e-5)


class ExampleTest(absltest.TestCase):
    """examples/train_sharded.py on this run's platform, its "model" axis the mesh's."""

    LAYERS = 2  # the example's default

    def setUp(self):
        super().setUp()
        # The example meshes every device of its backend: the 8 host devices it asks for on cpu,
        # every GPU on gpu. Its "data" axis is what the "model" axis leaves.
        self.num_devices = 8 if _PLATFORM == "cpu" else len(platform_devices())
        self.tp = axis_size("model")
        if self.num_devices < 2:
            self.skipTest(f"needs 2 or more {_PLATFORM} devices; {self.num_devices} found")
        if self.num_devices % self.tp or 16 % (self.num_devices // self.tp):
            self.skipTest(
                f"--tp {self.tp} on {self.num_devices} devices leaves a data axis that does not "
                "divide the example's batch of 16"
            )
        self.dp = self.num_devices // self.tp

    def run_example(self, dtype, *flags, force_kernel=False):
        env = _child_env()
        if _PLATFORM == "cpu":
            env["JAX_PLATFORMS"] = "cpu"  # the host devices even where GPUs are present
        if dtype == "float32":
            # jnp.matmul (the --reference run) then multiplies at full float32 precision, as
            # jax_sm100.matmul's XLA dot does; on GPUs XLA's default is tf32. No-op on CPU.
            env["JAX_DEFAULT_MATMUL_PRECISION"] = "highest"
        if _PLATFORM == "gpu" and dtype != "float32" and "--reference" in flags:
            # On one H200 (JAX 0.11.2) XLA's Triton GEMMs made this model's bfloat16 loss inf by
            # step 2 on XLA's dot, --reference included; cuBLAS GEMMs train it like our kernels
            # (benchmarks/RESULTS.md). The reference should be XLA's correct dot. Only the
            # reference gets the flag: on 2 H200s it also changed how XLA combines our run's
            # gradient all-reduces (9 instead of 1 on mesh 2x1), though our run has no XLA GEMM.
            xla_flags = env.get("XLA_FLAGS", "")
            env["XLA_FLAGS"] = f"{xla_flags} --xla_gpu_enable_triton_gemm=false".strip()
        python = [sys.executable, "-c", _FORCE_KERNEL_MAIN] if force_kernel else [sys.executable]
        proc = subprocess.run(
            [
                *python, str(REPO_ROOT / "examples" / "train_sharded.py"), "--steps", "3",
                "--seq", "16", "--d-model", "32", "--d-ff", "64", "--heads", "4", "--head-dim", "8",
                "--tp", str(self.tp), "--dtype", dtype, *flags,
            ],
            env=env, capture_output=True, text=True, timeout=300,
        )  # fmt: skip
        self.assertEqual(proc.returncode, 0, proc.stderr[-4000:])
        self.assertIn(f"mesh data={self.dp} x model={self.tp}", proc.stdout)
        return proc.stdout, [float(m) for m in re.findall(r"loss (\S+)", proc.stdout)]

    def want_all_reduces(self) -> int:
        # Per layer: two forward all-reduces over "model" (attention output, MLP down-projection)
        # and two backward ones (the inputs of the column-parallel projections); plus one
        # data-parallel gradient reduction over "data". No all-gather.
        tensor_parallel = 4 * self.LAYERS * (self.tp > 1)
        return tensor_parallel + (self.dp > 1)

    @staticmethod
    def printed_collectives(out: str) -> dict[str, int]:
        """The example's "collectives per training step: {...}" line, as a dict."""
        line = re.search(r"collectives per training step: (.*)", out)
        assert line, out[-2000:]
        return {} if line[1] == "none" else ast.literal_eval(line[1])

    def check_against_reference(self, dtype, force_kernel=False, **tolerance):
        out, losses = self.run_example(dtype, force_kernel=force_kernel)
        n = self.want_all_reduces()
        self.assertEqual(self.printed_collectives(out), {"all-reduce": n} if n else {})
        self.assertLen(losses, 2)  # the first step's and the last's
        self.assertLess(losses[-1], losses[0])
        # The same training on jnp.matmul: the same losses, and no fewer collectives. On the
        # host the reference's are exactly ours. On 2 H200s (mesh 2x1, bfloat16, JAX 0.11.2,
        # with the Triton flag above) XLA left the reference's gradient reductions as 9
        # all-reduces per step where ours has 1 (benchmarks/RESULTS.md).
        ref_out, ref_losses = self.run_example(dtype, "--reference")
        self.assertIn("products on jnp.matmul", ref_out)
        ref = self.printed_collectives(ref_out)
        if _PLATFORM == "cpu":
            self.assertEqual(ref, {"all-reduce": n} if n else {})
        else:
            self.assertEqual(set(ref), {"all-reduce"} if n else set())  # nothing but all-reduces
            self.assertGreaterEqual(ref.get("all-reduce", 0), n)
        np.testing.assert_allclose(losses, ref_losses, **tolerance)

    def test_train_sharded_runs_with_tensor_parallel_collectives_only(self):
        # float32 on every platform (the example would pick bfloat16 on GPUs) keeps the exact
        # comparison: on sm_90a float32 products run on XLA's dot, so both runs compute the same
        # float32 math and differ in the order of their sums only. On GPUs those orders differ
        # more (softmax, layer norm, the loss's mean), and the losses are printed to 5 decimals.
        # On sm_100a our kernels take float32 operands as tf32 (10-bit mantissa): the bfloat16
        # case's tolerance (8 bits) covers it.
        if kernel_may_run(jnp.float32):
            tolerance = {"rtol": 2e-2}
        else:
            tolerance = {"rtol": 1e-5} if _PLATFORM == "cpu" else {"rtol": 1e-4, "atol": 1e-5}
        self.check_against_reference("float32", **tolerance)

    def test_train_sharded_fsdp(self):
        # --fsdp also splits every weight's other dim over "data": each of the 6 weights a layer
        # is gathered once a step, and each gradient reduce-scattered back to its split, under
        # Explicit axes as under Auto (Explicit axes all-reduced them with the data-parallel
        # gradients, each a float32 sum of per-batch-index products); no activation moves
        # (before, layer inputs went to a split of k: 8 all-to-alls). The losses are
        # jnp.matmul's in the same layout.
        if self.dp < 2:
            self.skipTest("FSDP needs a 'data' axis of 2 or more")
        tolerance = {"rtol": 1e-5} if _PLATFORM == "cpu" else {"rtol": 2e-2}
        weights = 6 * self.LAYERS
        ref_out, ref_losses = self.run_example("float32", "--fsdp", "--reference")
        for axes in ("explicit", "auto"):
            out, losses = self.run_example("float32", "--fsdp", "--axes", axes)
            want = {"all-reduce": self.want_all_reduces(), "all-gather": weights,
                    "reduce-scatter": weights}  # fmt: skip
            self.assertEqual(self.printed_collectives(out), want, axes)
            np.testing.assert_allclose(losses, ref_losses, **tolerance)

    def test_train_sharded_bfloat16_on_our_kernels(self):
        # The example's GPU default. Both runs round every activation to bfloat16 (a relative
        # 2**-9) after products summed in different orders, ours with a fast-math GELU: the
        # roundings differ elementwise, and the loss, a mean of them, by a few bfloat16 ulps.
        if not kernel_may_run(jnp.bfloat16):
            self.skipTest(
                "bfloat16 products run on our kernels only on an sm_90a/sm_100a GPU "
                f"({_PLATFORM_ENV}=gpu); the float32 case covers the partitioning here"
            )
        self.check_against_reference("bfloat16", force_kernel=True, rtol=2e-2)


if __name__ == "__main__":
    absltest.main()
