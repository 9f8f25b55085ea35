"""Which library kernels `jnp.dot` runs on this GPU, per shape (names read from a JAX trace).

    python benchmarks/cublas_kernels.py [--shapes 8192x8192x8192,...] [--dtype bfloat16]

(With an fp8 `--dtype`, `lax.dot_general` of A by a K-major B into bfloat16, as
`python -m jax_sm100.bench --scaled` times cuBLAS fp8.)

For each m x n x k it traces a few warm calls of a jitted `jnp.dot` with `jax.profiler` and prints
the GPU kernel names found in the trace file. cuBLAS names its kernels after their configuration
(CTA tile, k-block and stages, cluster, schedule), so this says what our planner competes with at
each shape without hardware counters or Nsight Systems.
"""

from __future__ import annotations

import argparse
import glob
import os
import re
import tempfile

import jax
import jax.numpy as jnp
from jax import lax

SHAPES = (
    "8192x8192x8192,4096x4096x4096,16384x4096x4096,4096x14336x4096,2048x2048x2048,"
    "256x8192x8192,64x4096x4096,1024x1024x1024,512x2048x512,128x128x128"
)
# Substrings of GPU library kernel names (cuBLAS's nvjet / xmma / cutlass kernels, XLA's Triton
# GEMMs and fusions, reductions).
_KERNEL = re.compile(rb"[A-Za-z_][A-Za-z0-9_]{8,}")
_KEEP = ("nvjet", "gemm", "xmma", "cutlass", "triton", "sm90", "reduce", "splitK", "splitk")


def kernel_names(m: int, n: int, k: int, dtype) -> list[str]:
    key = jax.random.key(0)
    # fp8: B K-major ([n, k]) and a bfloat16 result, as `bench --scaled` times cuBLAS.
    fp8 = dtype.itemsize == 1
    a = jax.random.normal(key, (m, k), jnp.float32).astype(dtype)
    b = jax.random.normal(jax.random.fold_in(key, 1), (n, k) if fp8 else (k, n), jnp.float32)
    b = b.astype(dtype)
    if fp8:
        dims = (((1,), (1,)), ((), ()))
        f = jax.jit(lambda x, y: lax.dot_general(x, y, dims, preferred_element_type=jnp.bfloat16))
    else:
        f = jax.jit(jnp.dot)
    for _ in range(3):
        f(a, b).block_until_ready()
    with tempfile.TemporaryDirectory() as d:
        with jax.profiler.trace(d):
            for _ in range(3):
                f(a, b).block_until_ready()
        names: set[str] = set()
        for path in glob.glob(os.path.join(d, "**", "*.pb"), recursive=True):
            with open(path, "rb") as fh:
                for tok in _KERNEL.findall(fh.read()):
                    s = tok.decode()
                    if any(w in s for w in _KEEP) and not s.startswith("jax"):
                        names.add(s)
    return sorted(names)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--shapes", default=SHAPES)
    ap.add_argument("--dtype", default="bfloat16")
    args = ap.parse_args()
    dtype = jnp.dtype(args.dtype)
    print(jax.devices()[0].device_kind, jax.__version__, os.environ.get("XLA_FLAGS", ""))
    for shape in args.shapes.split(","):
        m, n, k = (int(x) for x in shape.split("x"))
        names = kernel_names(m, n, k, dtype)
        print(f"KERNELS {shape} {args.dtype}: " + (" | ".join(names) or "(none found)"))


if __name__ == "__main__":
    main()
