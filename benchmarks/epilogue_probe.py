"""What each fused epilogue costs on the H200: one GEMM shape, the epilogue varied.

    python benchmarks/epilogue_probe.py [--shape 8192x14336x4096] [--b-major k]

Times, by `jax_sm100.bench`'s device method (interleaved rounds), our kernel with: no epilogue;
C added (beta * C), as the planner stages it and loaded from global memory; each backward
epilogue `act'(C) * acc`; bias + gelu; bias + gelu writing the pre-activation too (the forward
under `grad`); and the act' epilogue on the cooperative plan, beside `lax.dot_general` with and
without XLA's elementwise gelu' pass. Prints TFLOP/s and the
ratio to XLA's plain product.
"""

from __future__ import annotations

import argparse
import math

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from jax_sm100 import bench
from jax_sm100._src import planning
from jax_sm100._src import primitive as P


def _bind(a, b, *extra, tb, c=False, act_grad=None, bias=False, activation=None, preact=False,
          plan=None):  # fmt: skip
    params = dict(
        transpose_a=False, transpose_b=tb, alpha=1.0, beta=1.0, activation=activation,
        out_dtype=np.dtype(jnp.bfloat16), has_bias=bias, has_c=c, plan=plan,
        save_preact=preact, act_grad=act_grad,
    )  # fmt: skip
    return P.matmul_p.bind(a, b, *extra, **params)[0]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--shape", default="8192x14336x4096")
    ap.add_argument("--b-major", default="k", choices=("k", "n"))
    args = ap.parse_args()
    m, n, k = (int(v) for v in args.shape.split("x"))
    tb = args.b_major == "k"
    keys = jax.random.split(jax.random.key(0), 4)
    a = jax.random.normal(keys[0], (m, k), jnp.float32).astype(jnp.bfloat16)
    b = (jax.random.normal(keys[1], (n, k) if tb else (k, n), jnp.float32) * k**-0.5).astype(
        jnp.bfloat16
    )
    z = jax.random.normal(keys[2], (m, n), jnp.float32).astype(jnp.bfloat16)
    bias = jax.random.normal(keys[3], (n,), jnp.float32).astype(jnp.bfloat16)
    dn = (((1,), (1 if tb else 0,)), ((), ()))
    p = planning.plan(m, n, k, a_dtype="bfloat16", b_dtype="bfloat16", c_dtype="bfloat16",
                      arch="sm_90a", b_major=args.b_major)  # fmt: skip
    coop = planning.cooperative(p)
    direct = planning.sm90_variant(p, stage_c=False, num_epi_stages=4)
    deep = planning.sm90_variant(p, num_epi_stages=4)
    gelu_grad = lambda y: (  # noqa: E731
        y.astype(jnp.float32) * P.activation_grad(z.astype(jnp.float32), "gelu")
    ).astype(jnp.bfloat16)
    variants = {
        "XLA dot": lambda a, b: lax.dot_general(a, b, dn),
        "XLA dot, then gelu'(z) *": lambda a, b: gelu_grad(lax.dot_general(a, b, dn)),
        "ours, no epilogue": lambda a, b: _bind(a, b, tb=tb),
        "ours, + C from global memory": lambda a, b: _bind(a, b, z, tb=tb, c=True, plan=direct),
        "ours, + C (planner)": lambda a, b: _bind(a, b, z, tb=tb, c=True),
        "ours, relu'(C) * acc (planner)": lambda a, b: _bind(
            a, b, z, tb=tb, c=True, act_grad="relu"
        ),
        "ours, gelu'(C) * acc, C from global": lambda a, b: _bind(
            a, b, z, tb=tb, c=True, act_grad="gelu", plan=direct
        ),
        "ours, gelu'(C) * acc (planner)": lambda a, b: _bind(
            a, b, z, tb=tb, c=True, act_grad="gelu"
        ),
        f"ours, gelu'(C) * acc, {deep.num_ab_stages}/4 stages": lambda a, b: _bind(
            a, b, z, tb=tb, c=True, act_grad="gelu", plan=deep
        ),
        "ours, gelu'(C) * acc, cooperative": lambda a, b: _bind(
            a, b, z, tb=tb, c=True, act_grad="gelu", plan=coop
        ),
        "ours, gelu(acc + bias)": lambda a, b: _bind(
            a, b, bias, tb=tb, bias=True, activation="gelu"
        ),
        "ours, gelu(acc + bias) and z": lambda a, b: _bind(
            a, b, bias, tb=tb, bias=True, activation="gelu", preact=True
        ),
    }
    print(f"{m}x{n}x{k}, B {args.b_major}-major; planner: {p.cta_tile_mnk[:2]} "
          f"pingpong={p.pingpong} stage_c={p.stage_c} stages {p.num_ab_stages}/"
          f"{p.num_epi_stages}; global C {direct.num_ab_stages}/{direct.num_epi_stages}; "
          f"cooperative: {coop.cta_tile_mnk[:2]} "
          f"stream_k={coop.stream_k}")  # fmt: skip
    timings = bench.time_device(list(variants.values()), a, b, min_seconds=0.05)
    base = timings[0].seconds
    flop = 2 * m * n * k
    for (label, _), t in zip(variants.items(), timings, strict=True):
        flag = " !" + "; ".join(t.check.problems()) if t.check.problems() else ""
        print(f"{label:38s} {flop / t.seconds / 1e12:7.1f} TF/s  {base / t.seconds:6.3f}{flag}")
    assert math.isfinite(base)


if __name__ == "__main__":
    main()
