"""Does an L2 prefetch of B ahead of the stage ring speed the skewed grouped forward?

One variant per process (`JAX_SM100_GROUPED_L2_PREFETCH` is read when the kernel module loads):
`python benchmarks/grouped_prefetch.py` runs each of --variants in a child process and prints one
table. Per variant: the per-SM stream of weight slices (groups of one row: each work tile streams
k x 256 of B with almost no MMA work; g groups -> 3 g tiles), the skewed and equal forwards of
`bench --ragged`'s 128- and 256-group problems, our dense product at the same m, k, n, and a
digest of each output (bit-identical across variants, or the prefetch changed a result).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import subprocess
import sys


def _child(out_path):
    import jax
    import jax.numpy as jnp
    import numpy as np

    import jax_sm100
    from jax_sm100.bench_ragged import group_sizes, operands
    from jax_sm100.bench_train import time_steps

    rows = {}
    f = jax.jit(lambda a, b, s: jax_sm100.ragged_dot(a, b, s))
    # Weight streams: g groups of one row over k = 8192 (4 MiB of B a work tile).
    for g in (4, 22, 44, 88):
        lhs, rhs, _, _ = operands(0, g, 128 * g, 8192, 768)
        sizes = jnp.ones((g,), jnp.int32)
        t = time_steps(f, lhs, rhs, sizes, steps=20)
        rows[f"stream g={g} ({3 * g} tiles)"] = (t, g * 8192 * 768 * 2 / t / 1e12)
    for g, m, k, n in ((128, 16384, 2048, 768), (256, 32768, 2048, 768)):
        lhs, rhs, _, _ = operands(0, g, m, k, n)
        dense = jax.jit(jax_sm100.matmul)
        td = time_steps(dense, lhs, rhs[0])
        rows[f"dense {m}x{k}x{n}"] = (td, 2 * m * k * n / td / 1e12)
        for kind in ("skewed", "equal"):
            sizes = group_sizes(0, g, m, kind)
            out = f(lhs, rhs, sizes)
            digest = hashlib.sha256(np.asarray(out.astype(jnp.float32)).tobytes()).hexdigest()[:12]
            t = time_steps(f, lhs, rhs, sizes)
            rows[f"{kind} {g}"] = (t, 2 * m * k * n / t / 1e12, td / t, digest)
    with open(out_path, "w") as fh:
        json.dump(rows, fh)


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--variants", default="0,8,8:small,16")
    ap.add_argument("--child", default="")
    args = ap.parse_args()
    if args.child:
        _child(args.child)
        return
    results = {}
    for v in args.variants.split(","):
        path = f"/tmp/grouped_prefetch_{v.replace(':', '_')}.json"
        env = dict(os.environ, JAX_SM100_GROUPED_L2_PREFETCH=v, JAX_SM100_CACHE_DIR="off")
        subprocess.run([sys.executable, __file__, "--child", path], env=env, check=True)
        with open(path) as fh:
            results[v] = json.load(fh)
        print(v, results[v], flush=True)
    keys = list(next(iter(results.values())))
    print("\nus (TF/s or TB/s of B; x dense; digest) by prefetch variant")
    print("| case | " + " | ".join(results) + " |")
    for key in keys:
        cells = []
        for v in results:
            r = results[v][key]
            cell = f"{r[0] * 1e6:.1f} ({r[1]:.2f}"
            cell += f"; {r[2]:.3f}; {r[3]})" if len(r) > 2 else ")"
            cells.append(cell)
        print(f"| {key} | " + " | ".join(cells) + " |")


if __name__ == "__main__":
    main()
