"""How fast this GPU streams memory, for the bounds on memory-bound grouped products.

    python benchmarks/hbm_probe.py

Times XLA's simplest streaming programs (wall clock: 3 warm-up calls, median of 5 rounds of 10
async calls, as `bench --ragged`) and prints the bytes each moved per second:

* read: the sum of 1 GiB of bfloat16 (a scalar out);
* write: 1 GiB of bfloat16 filled with a value held on the device;
* copy: `x * 2` over 1 GiB (read and written, the "copy speed" of `bench --ragged`);
* ragged forward's bytes: a column sum that reads what a forward `ragged_dot` over 128 groups of
  128 rows (16384 x 2048 x 768, bfloat16) must read at least (A and the weights, 470 MB) and
  writes its output (25 MB);
* ragged d rhs's bytes: an outer broadcast that reads 92 MB and writes the 403 MB a weight
  gradient over the same problem writes.

No kernel that moves the same bytes can be faster than the HBM's peak (4.8 TB/s on the
H200); these programs say what XLA's own streaming kernels reach.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from jax_sm100.bench_ragged import copy_bandwidth
from jax_sm100.bench_train import time_steps


def _rate(nbytes, f, *args):
    return nbytes / time_steps(jax.jit(f), *args)


def main():
    gib = 1 << 30
    x = jnp.ones((gib // 2,), jnp.bfloat16)
    fill = jnp.asarray(3.0, jnp.bfloat16)
    rows = 19  # 19 x 16384 x 768 x 2 B = 478 MB read, 25 MB written
    cols = 16384 * 768
    r = jax.random.normal(jax.random.key(0), (rows, cols), jnp.bfloat16)
    lhs = jax.random.normal(jax.random.key(1), (16384 * 2048 + 16384 * 768,), jnp.bfloat16)
    scale = jax.random.normal(jax.random.key(2), (128, 1, 1), jnp.bfloat16)
    out = {
        "read 1 GiB (sum)": _rate(gib, lambda v: jnp.sum(v, dtype=jnp.float32), x),
        "write 1 GiB (fill)": _rate(gib, lambda c: jnp.full((gib // 2,), c), fill),
        "copy 1 GiB (x * 2)": copy_bandwidth(),
        "read 478 MB, write 25 MB (column sum)": _rate(
            r.size * 2 + cols * 2,
            lambda v: jnp.sum(v, axis=0, dtype=jnp.float32).astype(v.dtype),
            r,
        ),
        "read 92 MB, write 403 MB (broadcast)": _rate(
            lhs.size * 2 + 128 * 2048 * 768 * 2,
            lambda a, s: (
                (a[: 2048 * 768].reshape(1, 2048, 768) * s)
                + jnp.sum(a[2048 * 768 :], dtype=jnp.float32).astype(a.dtype)
            ),
            lhs,
            scale,
        ),
    }
    print(f"{jax.devices()[0].device_kind}: bytes moved per second")
    print("| program | TB/s |\n| --- | --- |")
    for name, rate in out.items():
        print(f"| {name} | {rate / 1e12:.2f} |")


if __name__ == "__main__":
    main()
