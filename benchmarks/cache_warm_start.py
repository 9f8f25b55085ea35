"""The same program in a cold process and then a warm one: what the on-disk kernel cache saves.

    python benchmarks/cache_warm_start.py

Runs a child process twice with one fresh JAX_SM100_CACHE_DIR. Each child lowers and compiles
`jax.jit(matmul)` for a few distinct kernels (the time per kernel covers planning, our compile
or cache hit, and XLA's compile) and reports how many CuTe compilations it ran.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import time

CASES = (
    ((4096, 4096, 4096), None),
    ((256, 8192, 8192), "gelu"),
    ((64, 4096, 4096), None),
    ((1000, 2048, 512), "relu"),
)


def child() -> None:
    import jax
    import jax.numpy as jnp

    import jax_sm100
    from jax_sm100._src import compile as compile_mod

    # Start the backend first, so that the per-kernel times below hold no process start-up.
    t = time.perf_counter()
    jax.jit(lambda x: x + 1)(jnp.ones(8)).block_until_ready()
    startup = time.perf_counter() - t
    out = []
    for (m, n, k), act in CASES:
        a = jax.ShapeDtypeStruct((m, k), jnp.bfloat16)
        b = jax.ShapeDtypeStruct((k, n), jnp.bfloat16)
        t = time.perf_counter()
        jax.jit(lambda a, b, act=act: jax_sm100.matmul(a, b, activation=act)).lower(a, b).compile()
        out.append(time.perf_counter() - t)
    stats = compile_mod.cache_stats()
    dsl = "cutlass.cute" in sys.modules  # whether the DSL's compiler was imported at all
    print(json.dumps({"seconds": out, "stats": stats, "startup": startup, "dsl_imported": dsl}))


def main() -> None:
    with tempfile.TemporaryDirectory() as cache:
        env = {**os.environ, "JAX_SM100_CACHE_DIR": cache}
        for label in ("cold process", "warm process"):
            t = time.perf_counter()
            proc = subprocess.run(
                [sys.executable, __file__, "--child"], env=env, capture_output=True, text=True
            )
            wall = time.perf_counter() - t
            if proc.returncode:
                sys.exit(proc.stderr[-3000:])
            r = json.loads(proc.stdout.strip().splitlines()[-1])
            per = ", ".join(f"{s:.3f}" for s in r["seconds"])
            print(f"{label}: backend start {r['startup']:.2f} s; per kernel [{per}] s; CuTe "
                  f"compiles {r['stats']['compiles']}, disk hits {r['stats']['disk_hits']}, DSL "
                  f"imported {r['dsl_imported']}; process wall {wall:.1f} s")  # fmt: skip


if __name__ == "__main__":
    child() if sys.argv[1:] == ["--child"] else main()
