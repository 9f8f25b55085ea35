"""Trains a small MLP on synthetic data with every layer through `jax_sm100.matmul`.

    python examples/train_mlp.py [--steps 200] [--dtype bfloat16]

The data is a fixed random teacher network's output plus noise, so the loss has a known floor.
On a CPU the primitive lowers to XLA's dot; on an SM90 or SM100 GPU it runs our kernels. The
plan each layer got is printed first, then the loss as it falls.
"""

from __future__ import annotations

import argparse
import time

import jax
import jax.numpy as jnp
import numpy as np

import jax_sm100

WIDTHS = (256, 512, 512, 64)


def init(key, widths, dtype):
    params = []
    for fan_in, fan_out in zip(widths[:-1], widths[1:], strict=True):
        key, sub = jax.random.split(key)
        w = jax.random.normal(sub, (fan_in, fan_out), jnp.float32) / np.sqrt(fan_in)
        params.append({"w": w.astype(dtype), "b": jnp.zeros((fan_out,), jnp.float32)})
    return params


def epilogue(i, layers, dtype):
    """Layer `i`'s activation and output dtype: gelu in the input's dtype, the last layer linear
    in float32."""
    last = i == layers - 1
    return dict(activation=None if last else "gelu", out_dtype=jnp.float32 if last else dtype)


def forward(params, x):
    for i, layer in enumerate(params):
        x = jax_sm100.matmul(x, layer["w"], bias=layer["b"], **epilogue(i, len(params), x.dtype))
    return x


def loss_fn(params, x, y):
    return jnp.mean((forward(params, x) - y) ** 2)


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--batch", type=int, default=256)
    parser.add_argument("--lr", type=float, default=0.5)
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"])
    args = parser.parse_args()
    if args.steps < 2:  # the loss is compared between the first step and the last
        parser.error(f"--steps {args.steps}: train at least 2 steps")
    dtype = jnp.dtype(args.dtype)

    key = jax.random.key(0)
    k_teacher, k_student, k_data = jax.random.split(key, 3)
    teacher = init(k_teacher, WIDTHS, jnp.float32)
    params = init(k_student, WIDTHS, dtype)

    def batch(step):
        k_x, k_noise = jax.random.split(jax.random.fold_in(k_data, step))
        x = jax.random.normal(k_x, (args.batch, WIDTHS[0]), jnp.float32)
        y = forward(teacher, x) + 0.01 * jax.random.normal(k_noise, (args.batch, WIDTHS[-1]))
        return x.astype(dtype), y

    @jax.jit
    def step(params, x, y):
        loss, grads = jax.value_and_grad(loss_fn)(params, x, y)
        # Plain SGD in float32, stored back in each parameter's dtype.
        new = jax.tree.map(
            lambda p, g: (p.astype(jnp.float32) - args.lr * g.astype(jnp.float32)).astype(p.dtype),
            params,
            grads,
        )
        return new, loss

    print(f"backend: {jax.default_backend()} ({jax.devices()[0].device_kind})")
    x0 = jnp.zeros((args.batch, WIDTHS[0]), dtype)
    h = x0
    for i, layer in enumerate(params):
        plan = jax_sm100.plan_for(h, layer["w"], bias=layer["b"], **epilogue(i, len(params), dtype))
        print(f"\nlayer {i}: [{args.batch} x {layer['w'].shape[0]}] @ {layer['w'].shape}")
        print("  " + str(plan).replace("\n", "\n  "))
        h = jnp.zeros((args.batch, layer["w"].shape[1]), dtype)

    print()
    start = time.perf_counter()
    first = None
    for s in range(args.steps):
        x, y = batch(s)
        params, loss = step(params, x, y)
        if s % max(1, args.steps // 10) == 0 or s == args.steps - 1:
            loss = float(loss)
            first = loss if first is None else first
            print(f"step {s:4d}  loss {loss:.5f}")
    elapsed = time.perf_counter() - start
    print(f"\nloss {first:.5f} -> {float(loss):.5f} in {args.steps} steps ({elapsed:.1f} s)")
    if not float(loss) < first:
        raise SystemExit("the loss did not fall")


if __name__ == "__main__":
    main()
