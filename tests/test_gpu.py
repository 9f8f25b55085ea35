"""GPU tests: run our kernels through jax.jit on an SM90 device; skipped elsewhere."""

import jax
import jax.numpy as jnp
import numpy as np
from absl.testing import absltest, parameterized

import jax_sm100
from jax_sm100._src import dispatch, planning


def _arch():
    try:
        return getattr(dispatch.device_target(), "arch", None)
    except Exception:
        return None


@absltest.skipIf(_arch() != "sm_90a", "needs an SM90 (Hopper) CUDA device and jax[cuda]")
class GpuTest(parameterized.TestCase):
    @parameterized.product(
        # (4096, 768, 256): 3 tile columns of 256, so the planner pairs CTAs along M (a 1x2
        # cluster would run a fourth column of zero-filled tiles).
        shape=[
            (128, 256, 64),
            (200, 136, 520),
            (1, 8, 16),
            (1024, 1024, 1024),
            (64, 4096, 4096),
            (4096, 768, 256),
        ],
        dtype=["bfloat16", "float16"],
        activation=[None, "gelu"],
    )
    def test_matches_reference(self, shape, dtype, activation):
        m, n, k = shape
        ka, kb, kc = jax.random.split(jax.random.key(m * n + k), 3)
        a = jax.random.normal(ka, (m, k), jnp.float32).astype(dtype)
        b = jax.random.normal(kb, (k, n), jnp.float32).astype(dtype)
        bias = jax.random.normal(kc, (n,), jnp.float32)
        # force_kernel: all but the last shape are small enough that the planner would send them
        # to XLA's dot (planning.SM90_MIN_FLOPS); this test is about our kernels.
        plan = jax_sm100.plan(
            m, n, k, a_dtype=dtype, b_dtype=dtype, arch="sm_90a", force_kernel=True
        )
        fn = jax.jit(
            lambda a, b, bias: jax_sm100.matmul(a, b, bias=bias, activation=activation, plan=plan)
        )
        out = fn(a, b, bias)
        ref = jnp.dot(a.astype(jnp.float32), b.astype(jnp.float32)) + bias
        if activation == "gelu":
            ref = jax.nn.gelu(ref, approximate=True)
        err = np.linalg.norm(np.asarray(out, np.float32) - ref) / np.linalg.norm(ref)
        self.assertLess(err, 2e-2 if dtype == "bfloat16" else 5e-3)
        self.assertNotEqual(dispatch.last_lowering().plan.kernel, "xla_dot")

    _ALONG_N = dict(
        tile_mn=(128, 192), pingpong=True, cluster_mn=(2, 1), raster_along_m=False, swizzle_size=2
    )

    @parameterized.named_parameters(
        ("coop_256x128", dict(tile_mn=(256, 128))),
        ("coop_128x160", dict(tile_mn=(128, 160))),
        ("pingpong_128x160", dict(tile_mn=(128, 160), pingpong=True)),
        # The planner's schedule for many waves (2x1, along N), swizzled on a small grid.
        ("pingpong_along_n", _ALONG_N),
        # C through the TMA-staged shared-memory ring (GemmPlan.stage_c), both schedules.
        ("coop_staged_c", dict(tile_mn=(128, 256), stage_c=True, stream_k=False)),
        ("pingpong_staged_c", dict(_ALONG_N, stage_c=True)),
        ("split4_in_cluster", dict(split=4)),
        ("split8_in_cluster", dict(split=8)),
    )
    def test_plan_variants(self, edit):
        # Schedules and tiles beyond the planner's choice for these sizes, on sizes that are not
        # multiples of their tiles, with C, bias and an activation.
        split = edit.pop("split", 0)
        m, n, k = (100, 520, 2048) if split else (520, 1000, 264)
        ka, kb, kc, kd = jax.random.split(jax.random.key(7), 4)
        a = jax.random.normal(ka, (m, k), jnp.float32).astype(jnp.bfloat16)
        b = (jax.random.normal(kb, (k, n), jnp.float32) / np.sqrt(k)).astype(jnp.bfloat16)
        c = jax.random.normal(kc, (m, n), jnp.float32).astype(jnp.bfloat16)
        bias = jax.random.normal(kd, (n,), jnp.float32)
        plan = jax_sm100.plan(m, n, k, a_dtype="bfloat16", b_dtype="bfloat16", c_dtype="bfloat16",
                              arch="sm_90a", force_kernel=True)  # fmt: skip
        if split:
            tiled = planning.sm90_variant(plan, tile_mn=(64, 128))
            plan = planning.with_split(tiled, split, reduce="cluster")
        else:
            plan = planning.sm90_variant(plan, **edit)
        fn = jax.jit(lambda a, b, c, bias: jax_sm100.matmul(
            a, b, c=c, bias=bias, beta=0.5, activation="silu", plan=plan))  # fmt: skip
        out = fn(a, b, c, bias)
        ref = jax.nn.silu(
            jnp.dot(a.astype(jnp.float32), b.astype(jnp.float32))
            + 0.5 * c.astype(jnp.float32)
            + bias
        )
        err = np.linalg.norm(np.asarray(out, np.float32) - ref) / np.linalg.norm(ref)
        self.assertLess(err, 2e-2)
        self.assertEqual(dispatch.last_lowering().plan, plan)


if __name__ == "__main__":
    absltest.main()
