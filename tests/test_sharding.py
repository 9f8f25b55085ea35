"""Tests of the matmul primitive's partitioning on 8 CPU devices (sharding.py).

Every case runs one jitted function on sharded operands and compares it with the same function
on one device, then counts the collectives in the compiled HLO: each count is what the math
needs and no more (in particular, no weight is ever all-gathered).

The 8 devices: this module asks for them before JAX starts its backend. Under pytest every
module is imported before any test runs, so that normally holds; when another module has
already started the backend with fewer devices, each test class runs in a child process
(`_delegated`) and every test reports its own outcome from there.
"""

from __future__ import annotations

import os

_DEVICES = 8
_CHILD_ENV = "JAX_SM100_SHARDING_TEST_CHILD"
_FLAG = f"--xla_force_host_platform_device_count={_DEVICES}"
if _FLAG not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = f"{os.environ.get('XLA_FLAGS', '')} {_FLAG}".strip()

import functools  # noqa: E402
import re  # noqa: E402
import subprocess  # noqa: E402
import sys  # noqa: E402
import tempfile  # noqa: E402
import xml.etree.ElementTree as ET  # noqa: E402
from pathlib import Path  # noqa: E402

import jax  # noqa: E402

try:
    jax.config.update("jax_num_cpu_devices", _DEVICES)
except RuntimeError:
    pass  # the backend is already up in this process; see `_delegated`

import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from absl.testing import absltest, parameterized  # noqa: E402
from jax.sharding import AxisType, NamedSharding  # noqa: E402
from jax.sharding import PartitionSpec as PS  # noqa: E402

import jax_sm100  # noqa: E402

REPO_ROOT = Path(__file__).resolve().parents[1]
COLLECTIVES = ("all-reduce", "reduce-scatter", "all-gather", "collective-permute", "all-to-all")


# --- helpers -----------------------------------------------------------------------------------


def collectives(hlo: str) -> dict[str, int]:
    """How many of each collective the compiled HLO text runs (async pairs count once)."""
    return {name: len(re.findall(rf"\s{name}(?:-start)?\(", hlo)) for name in COLLECTIVES}


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
    """Runs each test of `cls` here, or reports its outcome from a child with 8 devices."""
    for name in [n for n in dir(cls) if n.startswith("test")]:
        method = getattr(cls, name)
        if not callable(method):
            continue

        @functools.wraps(method)
        def wrapper(self, *args, _method=method, **kwargs):
            if len(jax.devices("cpu")) >= _DEVICES:
                return _method(self, *args, **kwargs)
            if os.environ.get(_CHILD_ENV):
                self.fail(f"the child process has {len(jax.devices('cpu'))} CPU devices")
            outcome, message = _child_outcomes(type(self).__name__).get(
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
def _child_outcomes(class_name: str) -> dict[str, tuple[str, str]]:
    """Runs one test class under pytest in a fresh process; {test name: (outcome, message)}."""
    env = dict(_child_env(), **{_CHILD_ENV: "1"})
    with tempfile.TemporaryDirectory() as tmp:
        report = Path(tmp) / "report.xml"
        proc = subprocess.run(
            [
                sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-p", "no:xdist",
                f"--junitxml={report}", f"{__file__}::{class_name}",
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
    """A 2 x 4 mesh ("data", "model") and the checks every case makes."""

    axis_types = AxisType.Explicit

    def setUp(self):
        super().setUp()
        if len(jax.devices("cpu")) >= _DEVICES:
            self.mesh = jax.make_mesh((2, 4), ("data", "model"), axis_types=(self.axis_types,) * 2)

    def put(self, x, spec):
        return jax.device_put(x, NamedSharding(self.mesh, spec))

    def check(self, f, args, specs, want_counts, *, out_spec=None, rtol=2e-5, reference=None):
        """f on sharded args equals `reference` (default f) on one device; its collectives."""
        sharded = [self.put(x, s) for x, s in zip(args, specs, strict=True)]
        out_shardings = None if out_spec is None else NamedSharding(self.mesh, out_spec)
        jitted = jax.jit(f, out_shardings=out_shardings)
        hlo = jitted.lower(*sharded).compile().as_text()
        got = jitted(*sharded)
        want = jax.jit(reference or f)(*[jax.device_put(x, jax.devices("cpu")[0]) for x in args])
        for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
            w = np.asarray(w, np.float64)
            scale = max(float(np.max(np.abs(w))), 1e-6)
            np.testing.assert_allclose(np.asarray(g, np.float64), w, atol=rtol * scale, rtol=0)
        self.assertEqual(collectives(hlo), want_counts)
        return got, hlo


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
        got, _ = self.check(f, (x, w, b), specs, counts(all_reduce=1))
        self.assertEqual(same_spec(got.sharding.spec), same_spec(PS("data")))

    def test_row_parallel_reduce_scatters_when_the_output_is_sharded(self):
        x, w, b = rand(0, 32, 48), rand(1, 48, 64), rand(2, 64)
        specs = (PS("data", "model"), PS("model", None), PS())
        got, _ = self.check(
            gelu_bias, (x, w, b), specs, counts(reduce_scatter=1), out_spec=PS("data", "model")
        )
        self.assertEqual(same_spec(got.sharding.spec), same_spec(PS("data", "model")))

    def test_row_parallel_with_c_alpha_beta_bfloat16(self):
        x, w, c = rand(0, 32, 48), rand(1, 48, 64), rand(2, 32, 64)
        x, w = x.astype(jnp.bfloat16), w.astype(jnp.bfloat16)
        f = lambda x, w, c: jax_sm100.matmul(
            x, w, c=c, alpha=0.5, beta=-2.0, activation="silu", out_dtype=jnp.float32
        )
        specs = (PS(None, "model"), PS("model", None), PS("data"))
        self.check(f, (x, w, c), specs, counts(all_reduce=1))

    def test_mlp_on_2d_mesh(self):
        # Data parallel over "data", tensor parallel over "model": one all-reduce per block.
        x, w1, b1, w2 = rand(0, 32, 48), rand(1, 48, 128), rand(2, 128), rand(3, 128, 48)
        specs = (PS("data"), PS(None, "model"), PS("model"), PS("model", None))
        got, _ = self.check(mlp, (x, w1, b1, w2), specs, counts(all_reduce=1))
        self.assertEqual(same_spec(got.sharding.spec), same_spec(PS("data")))

    def test_batch_and_n_sharded_is_local(self):
        a, b = rand(0, 4, 16, 32), rand(1, 4, 32, 64)
        specs = (PS("data"), PS("data", None, "model"))
        got, _ = self.check(jax_sm100.matmul, (a, b), specs, counts())
        self.assertEqual(same_spec(got.sharding.spec), same_spec(PS("data", None, "model")))

    @parameterized.named_parameters(
        ("column_parallel", (PS("data"), PS(None, "model"), PS("data", "model")), {}),
        ("row_parallel", (PS("data", "model"), PS("model"), PS("data")), {"all_reduce": 1}),
    )
    def test_a_users_plan_runs_on_the_local_problem(self, specs, want):
        x, w, c = rand(0, 64, 128), rand(1, 128, 256), rand(2, 64, 256)
        plan = jax_sm100.plan_for(x, w, c=c)
        f = lambda x, w, c: jax_sm100.matmul(x, w, c=c, beta=0.5, plan=plan)
        self.check(f, (x, w, c), specs, counts(**want))

    def test_cpu_lowering_is_a_custom_partitioning_call(self):
        # XLA must not see a dot it could partition by itself, or the CPU tests prove nothing.
        x, w, b = rand(0, 32, 48), rand(1, 48, 64), rand(2, 64)
        specs = (PS("data"), PS(None, "model"), PS("model"))
        sharded = [self.put(v, s) for v, s in zip((x, w, b), specs, strict=True)]
        text = jax.jit(gelu_bias).lower(*sharded).as_text()
        self.assertIn("@CustomSPMDPartitioning", text)
        self.assertIn("sdy.sharding_rule", text)
        self.assertNotIn("dot_general", text)
        single = jax.jit(gelu_bias).lower(x, w, b).as_text()
        self.assertNotIn("CustomSPMDPartitioning", single)
        self.assertIn("dot_general", single)

    def test_single_device_programs_still_export(self):
        # The partitioner's callbacks cannot be serialized; unsharded lowerings never make one.
        x, w, b = rand(0, 32, 48), rand(1, 48, 64), rand(2, 64)
        exported = jax.export.export(jax.jit(gelu_bias))(x, w, b)
        self.assertNotIn("CustomSPMDPartitioning", exported.mlir_module())
        restored = jax.export.deserialize(exported.serialize())
        np.testing.assert_array_equal(restored.call(x, w, b), jax.jit(gelu_bias)(x, w, b))

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
        self.check(f, (x, w), specs, counts(all_reduce=1), reference=reference)


@_delegated
class TransformTest(ShardedTestCase):
    def test_vmap_over_a_sharded_batch_is_local(self):
        x, w, b = rand(0, 4, 16, 48), rand(1, 48, 64), rand(2, 64)
        f = jax.vmap(gelu_bias, in_axes=(0, None, None))
        specs = (PS("data"), PS(None, "model"), PS("model"))
        got, _ = self.check(f, (x, w, b), specs, counts())
        self.assertEqual(same_spec(got.sharding.spec), same_spec(PS("data", None, "model")))
        # The backward pass: dx over the sharded n, dW and db over the sharded batch.
        self.check(grad_of(f, (0, 1, 2)), (x, w, b), specs, counts(all_reduce=2), rtol=1e-4)

    def test_vmap_over_both_operands_with_k_sharded(self):
        a, b = rand(0, 8, 16, 32), rand(1, 8, 32, 64)
        f = jax.vmap(lambda a, b: jax_sm100.matmul(a, b, activation="gelu"))
        specs = (PS("data", None, "model"), PS("data", "model"))
        self.check(f, (a, b), specs, counts(all_reduce=1))
        # da and db contract over unsharded n and m: only the forward pass communicates.
        self.check(grad_of(f, (0, 1)), (a, b), specs, counts(all_reduce=1), rtol=1e-4)

    @parameterized.named_parameters(
        # dW and db sum over the sharded rows: the data-parallel gradient reduction.
        ("data_parallel", (PS("data"), PS(), PS()), 1),
        # dx contracts over the sharded n (over "model"); dW and db over the rows ("data").
        ("column_parallel", (PS("data"), PS(None, "model"), PS("model")), 2),
        # The forward all-reduce over "model"; dW and db over "data"; dx is local.
        ("row_parallel", (PS("data", "model"), PS("model", None), PS()), 2),
    )
    def test_grad(self, specs, all_reduces):
        x, w, b = rand(0, 32, 48), rand(1, 48, 64), rand(2, 64)
        grads, _ = self.check(
            grad_of(gelu_bias, (0, 1, 2)), (x, w, b), specs, counts(all_reduce=all_reduces),
            rtol=1e-4,
        )  # fmt: skip
        # Each gradient keeps its primal's sharding: no weight was gathered.
        for g, spec in zip(grads, specs, strict=True):
            self.assertEqual(same_spec(g.sharding.spec), same_spec(spec))

    def test_grad_of_mlp_on_2d_mesh(self):
        # Forward: one all-reduce. Backward: dx over "model", the weight gradients over "data".
        x, w1, b1, w2 = rand(0, 32, 48), rand(1, 48, 128), rand(2, 128), rand(3, 128, 48)
        specs = (PS("data"), PS(None, "model"), PS("model"), PS("model", None))
        grads, _ = self.check(
            grad_of(mlp, (0, 1, 2, 3)), (x, w1, b1, w2), specs, counts(all_reduce=3), rtol=1e-4
        )
        for g, spec in zip(grads, specs, strict=True):
            self.assertEqual(same_spec(g.sharding.spec), same_spec(spec))


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
            self.check(mlp, (x, w1, b1, w2), specs, counts(all_reduce=1))
            self.check(
                grad_of(mlp, (0, 1, 2, 3)), (x, w1, b1, w2), specs, counts(all_reduce=3),
                rtol=1e-4,
            )  # fmt: skip
        finally:
            jax.config.update("jax_use_shardy_partitioner", before)

    def test_row_parallel_reduce_scatter(self):
        x, w, b = rand(0, 32, 48), rand(1, 48, 64), rand(2, 64)
        specs = (PS(None, "model"), PS("model", None), PS())
        self.check(
            gelu_bias, (x, w, b), specs, counts(reduce_scatter=1), out_spec=PS(None, "model")
        )


@_delegated
class ExplicitAxesTest(ShardedTestCase):
    """Under Explicit axes the result is typed with the sharding the partitioner gives it, and
    the epilogue's tangents are typed like the result, so no cotangent is gathered."""

    def test_bias_gradient_is_one_all_reduce(self):
        # Only the bias is differentiated: its tangent reaches the output without a product.
        x, w, b, y = rand(0, 32, 48), rand(1, 48, 64), rand(2, 64), rand(3, 32, 64)
        f = jax.grad(lambda b, x, w, y: jnp.sum((jax_sm100.matmul(x, w, bias=b) - y) ** 2), 0)
        specs = (PS(), PS("data"), PS(), PS("data"))
        got, _ = self.check(f, (b, x, w, y), specs, counts(all_reduce=1), rtol=1e-4)
        self.assertEqual(same_spec(got.sharding.spec), ())

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


class ExampleTest(absltest.TestCase):
    def run_example(self, *flags):
        proc = subprocess.run(
            [
                sys.executable, str(REPO_ROOT / "examples" / "train_sharded.py"), "--steps", "3",
                "--seq", "16", "--d-model", "32", "--d-ff", "64", "--heads", "4", "--head-dim", "8",
                *flags,
            ],
            env=_child_env(),
            capture_output=True, text=True, timeout=300,
        )  # fmt: skip
        self.assertEqual(proc.returncode, 0, proc.stderr[-4000:])
        self.assertIn("mesh data=2 x model=4", proc.stdout)
        return proc.stdout, [float(m) for m in re.findall(r"loss (\S+)", proc.stdout)]

    def test_train_sharded_runs_with_tensor_parallel_collectives_only(self):
        out, losses = self.run_example()
        # Per layer: two forward all-reduces (attention output, MLP down-projection), two
        # backward ones (the inputs of the column-parallel projections); plus one data-parallel
        # gradient reduction. No all-gather.
        self.assertIn("collectives per training step: {'all-reduce': 9}", out)
        self.assertLen(losses, 2)  # the first step's and the last's
        self.assertLess(losses[-1], losses[0])
        # The same training on jnp.matmul: the same collectives and the same losses.
        ref_out, ref_losses = self.run_example("--reference")
        self.assertIn("products on jnp.matmul", ref_out)
        self.assertIn("collectives per training step: {'all-reduce': 9}", ref_out)
        np.testing.assert_allclose(losses, ref_losses, rtol=1e-5)


if __name__ == "__main__":
    absltest.main()
