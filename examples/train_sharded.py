"""Trains transformer blocks with data and tensor parallelism, every product in `jax_sm100.matmul`.

    python examples/train_sharded.py [--steps 40] [--tp 4] [--dtype float32] [--axes auto]
    python examples/train_sharded.py --reference   # the same training on jnp.matmul
    python examples/train_sharded.py --fsdp        # every weight also split over "data"

The mesh is ("data", "model"): the batch is split over "data"; the attention heads and the MLP's
hidden units over "model" (Megatron-style: q/k/v and the MLP's up-projection column-parallel,
the attention output and the MLP's down-projection row-parallel, one all-reduce each). The
attention scores and their weighted sum are batched products over (batch, heads), local to
every device. On a machine without GPUs it runs on 8 host CPU devices (2 x 4; set
JAX_NUM_CPU_DEVICES for another count); with GPUs, on
all of them. The student learns to match a fixed random teacher with the same architecture, so
the loss falls towards zero; the loss and the time per step are printed, and the collectives of
the compiled step are counted once: on the default 2 x 4 mesh, 9 all-reduces per step (two per
layer forward, two per layer backward, one for the data-parallel gradients) and nothing else.
With --fsdp every weight (and its optimizer state) is also split over "data" along its other
dim, as fully sharded data parallelism keeps it: each weight is gathered where it is used,
once a step, and its gradient reduce-scattered back to its split.
"""

from __future__ import annotations

import argparse
import functools
import math
import os
import re
import time

import jax

# Must precede JAX's first use of a backend; GPU runs are unaffected.
jax.config.update("jax_num_cpu_devices", int(os.environ.get("JAX_NUM_CPU_DEVICES", 8)))
# This model's products are small (under 2^33 FLOPs), which the planner would send to XLA's dot
# on an H200; the example is here to run our kernels, so it asks for them. (On one H200 with JAX
# 0.11.2, XLA's Triton GEMM also made this bf16 model's loss inf by step 2, benchmarks/RESULTS.md.)
os.environ.setdefault("JAX_SM100_SMALL_PROBLEMS", "kernel")

import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from jax.sharding import AxisType, NamedSharding  # noqa: E402
from jax.sharding import PartitionSpec as PS  # noqa: E402

import jax_sm100  # noqa: E402

# The products of the model; `--reference` swaps in `jnp_matmul` to time the same program on
# XLA's dot (cuBLAS on GPUs).
matmul = jax_sm100.matmul


def jnp_matmul(a, b, *, bias=None, c=None, alpha=1.0, beta=1.0, activation=None, out_dtype=None):
    """jax_sm100.matmul's math in jnp ops, as a jnp user writes it: the product in the operands'
    dtype (XLA accumulates in float32 inside it), the epilogue in float32. (Asking the product
    for a float32 result instead would make XLA's backward run float32 GEMMs.)"""
    out_dtype = out_dtype or jnp.result_type(a, b)
    z = alpha * jnp.matmul(a, b).astype(jnp.float32)
    if c is not None:
        z = z + beta * c.astype(jnp.float32)
    if bias is not None:
        z = z + bias.astype(jnp.float32)
    if activation == "gelu":
        z = jax.nn.gelu(z, approximate=True)
    elif activation is not None:
        raise ValueError(f"{activation=} is not used by this example")
    return z.astype(out_dtype)


COLLECTIVES = ("all-reduce", "reduce-scatter", "all-gather", "collective-permute", "all-to-all")


# --- the model ---------------------------------------------------------------------------------


def param_specs(layers, fsdp=False):
    """Where each parameter lives: column-parallel and row-parallel weights split on "model";
    with `fsdp`, each weight's other dim over "data" too (gathered where it is used)."""
    f = "data" if fsdp else None
    block = {
        "ln1": PS(), "ln2": PS(),
        "wq": PS(f, "model"), "wk": PS(f, "model"), "wv": PS(f, "model"),
        "wo": PS("model", f), "bo": PS(),
        "w1": PS(f, "model"), "b1": PS("model"),
        "w2": PS("model", f), "b2": PS(),
    }  # fmt: skip
    return [dict(block) for _ in range(layers)]


def init(key, args, dtype):
    d, hd, f = args.d_model, args.heads * args.head_dim, args.d_ff
    params = []
    for _ in range(args.layers):
        key, *ks = jax.random.split(key, 7)

        def dense(k, fan_in, fan_out):
            return (jax.random.normal(k, (fan_in, fan_out)) / math.sqrt(fan_in)).astype(dtype)

        params.append({
            "ln1": jnp.ones((d,)), "ln2": jnp.ones((d,)),
            "wq": dense(ks[0], d, hd), "wk": dense(ks[1], d, hd), "wv": dense(ks[2], d, hd),
            "wo": dense(ks[3], hd, d), "bo": jnp.zeros((d,)),
            "w1": dense(ks[4], d, f), "b1": jnp.zeros((f,)),
            "w2": dense(ks[5], f, d), "b2": jnp.zeros((d,)),
        })  # fmt: skip
    return params


def layer_norm(x, scale):
    x32 = x.astype(jnp.float32)
    mean = jnp.mean(x32, -1, keepdims=True)
    var = jnp.mean(jnp.square(x32 - mean), -1, keepdims=True)
    return ((x32 - mean) * jax.lax.rsqrt(var + 1e-5) * scale).astype(x.dtype)


def attention(p, x, heads):
    b, s, _ = x.shape
    dtype = x.dtype

    def project(w):  # [b, s, d] @ [d, heads * dh] -> [b, heads, s, dh], heads split on "model"
        y = matmul(x, w)
        return y.reshape(b, s, heads, -1).transpose(0, 2, 1, 3)

    q, k, v = project(p["wq"]), project(p["wk"]), project(p["wv"])
    scale = 1.0 / math.sqrt(q.shape[-1])
    causal = jnp.tril(jnp.ones((s, s), bool))
    # Batched over (batch, heads), both split: local on every device.
    scores = matmul(q, k.transpose(0, 1, 3, 2), alpha=scale, out_dtype=jnp.float32)
    probs = jax.nn.softmax(jnp.where(causal, scores, -1e9), axis=-1).astype(dtype)
    ctx = matmul(probs, v).transpose(0, 2, 1, 3).reshape(b, s, -1)
    # Row-parallel: partial products over the local heads, one all-reduce, then the bias.
    return matmul(ctx, p["wo"], bias=p["bo"])


def mlp(p, x):
    h = matmul(x, p["w1"], bias=p["b1"], activation="gelu")  # column-parallel
    return matmul(h, p["w2"], bias=p["b2"])  # row-parallel


def forward(params, x, heads):
    for p in params:
        x = x + attention(p, layer_norm(x, p["ln1"]), heads)
        x = x + mlp(p, layer_norm(x, p["ln2"]))
    return x


def loss_fn(params, x, y, heads):
    return jnp.mean(jnp.square(forward(params, x, heads).astype(jnp.float32) - y))


# --- training ----------------------------------------------------------------------------------


def adam(params, grads, state, step, lr, b1=0.9, b2=0.999, eps=1e-8):
    """One Adam step in float32; each parameter keeps its dtype and sharding."""
    m, v = state
    m = jax.tree.map(lambda m, g: b1 * m + (1 - b1) * g.astype(jnp.float32), m, grads)
    v = jax.tree.map(lambda v, g: b2 * v + (1 - b2) * jnp.square(g.astype(jnp.float32)), v, grads)
    t = step + 1
    corr = jnp.sqrt(1 - b2**t) / (1 - b1**t)

    def update(p, m, v):
        return (p.astype(jnp.float32) - lr * corr * m / (jnp.sqrt(v) + eps)).astype(p.dtype)

    return jax.tree.map(update, params, m, v), (m, v)


def collectives(hlo: str) -> dict[str, int]:
    return {name: len(re.findall(rf"\s{name}(?:-start)?\(", hlo)) for name in COLLECTIVES}


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument(
        "--tp", type=int, default=None, help="tensor-parallel size (the 'model' axis)"
    )
    parser.add_argument("--batch", type=int, default=16, help="global batch")
    parser.add_argument("--seq", type=int, default=64)
    parser.add_argument("--d-model", type=int, default=128)
    parser.add_argument("--heads", type=int, default=8)
    parser.add_argument("--head-dim", type=int, default=16)
    parser.add_argument("--d-ff", type=int, default=512)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--lr", type=float, default=3e-3)
    parser.add_argument("--dtype", default=None, choices=["bfloat16", "float16", "float32"])
    parser.add_argument(
        "--reference",
        action="store_true",
        help="every product on jnp.matmul (XLA's dot) instead of jax_sm100.matmul, Auto axes",
    )
    parser.add_argument(
        "--fsdp",
        action="store_true",
        help="also split every weight (and its optimizer state) over 'data' (FSDP)",
    )
    parser.add_argument(
        "--show-collectives",
        action="store_true",
        help="print each collective of the compiled training step (operand shapes, groups)",
    )
    parser.add_argument(
        "--axes",
        default="explicit",
        choices=["explicit", "auto"],
        help="mesh axis types (jax.make_mesh's default is explicit)",
    )
    args = parser.parse_args()

    if args.steps < 1:
        parser.error(f"--steps {args.steps} must be at least 1")
    if args.tp is not None and args.tp < 1:
        parser.error(f"--tp {args.tp} must be at least 1 (or left out: gcd(devices, 4))")
    devices = jax.devices()
    n = len(devices)
    tp = args.tp or math.gcd(n, 4)
    if n % tp or args.heads % tp or args.d_ff % tp:
        parser.error(f"--tp {tp} must divide the {n} devices, --heads and --d-ff")
    dp = n // tp
    if args.batch % dp:
        parser.error(f"--batch {args.batch} must be a multiple of the data-parallel size {dp}")
    dtype = jnp.dtype(args.dtype or ("bfloat16" if devices[0].platform == "gpu" else "float32"))
    # Explicit axes (jax.make_mesh's default): every array's sharding is part of its type, and
    # jax_sm100.matmul types its result as the partitioner shards it. jnp.matmul would need an
    # out_sharding at every row-parallel product under Explicit axes, so --reference runs Auto.
    global matmul
    if args.reference:
        matmul, args.axes = jnp_matmul, "auto"
    axis_type = AxisType.Explicit if args.axes == "explicit" else AxisType.Auto
    mesh = jax.make_mesh((dp, tp), ("data", "model"), devices=devices, axis_types=(axis_type,) * 2)
    which = "jnp.matmul (reference)" if args.reference else "jax_sm100.matmul"
    print(f"{n} {devices[0].device_kind} device(s), mesh data={dp} x model={tp}, {dtype.name}, "
          f"{args.axes} axes, products on {which}")  # fmt: skip

    def place(tree, specs):
        return jax.tree.map(lambda x, s: jax.device_put(x, NamedSharding(mesh, s)), tree, specs)

    specs = param_specs(args.layers, args.fsdp)
    if args.fsdp and dp == 1:
        print("--fsdp: the 'data' axis has one device, so no weight is split further")
    k_teacher, k_student, k_data = jax.random.split(jax.random.key(0), 3)
    teacher = place(init(k_teacher, args, dtype), specs)
    params = place(init(k_student, args, dtype), specs)
    zeros = jax.tree.map(lambda p: jnp.zeros(p.shape, jnp.float32), params)
    state = (place(zeros, specs), place(zeros, specs))
    batch_sharding = NamedSharding(mesh, PS("data"))

    @functools.partial(jax.jit, out_shardings=(batch_sharding, batch_sharding))
    def make_batch(step):
        shape = (args.batch, args.seq, args.d_model)
        x = jax.random.normal(jax.random.fold_in(k_data, step), shape).astype(dtype)
        return x, forward(teacher, x, args.heads).astype(jnp.float32)

    @jax.jit
    def train_step(params, state, x, y, step):
        loss, grads = jax.value_and_grad(loss_fn)(params, x, y, args.heads)
        params, state = adam(params, grads, state, step, args.lr)
        return params, state, loss

    x, y = make_batch(0)
    compiled = train_step.lower(params, state, x, y, 0).compile()
    counts = {k: v for k, v in collectives(compiled.as_text()).items() if v}
    print(f"collectives per training step: {counts or 'none'}")
    if args.show_collectives:
        pattern = rf"^\s*(\S+ = .*\s(?:{'|'.join(COLLECTIVES)})(?:-start)?\(.*)$"
        for line in re.findall(pattern, compiled.as_text(), flags=re.M):
            print(f"  {line[:240]}")

    times = []
    for step in range(args.steps):
        x, y = make_batch(step)
        start = time.perf_counter()
        params, state, loss = compiled(params, state, x, y, step)
        loss = float(loss)  # waits for the step
        times.append(time.perf_counter() - start)
        if step % 5 == 0 or step == args.steps - 1:
            print(f"step {step:4d}  loss {loss:.5f}  {1e3 * times[-1]:8.2f} ms")
    steady = times[1:] or times
    print(f"median step time {1e3 * float(np.median(steady)):.2f} ms over {len(steady)} steps")


if __name__ == "__main__":
    main()
