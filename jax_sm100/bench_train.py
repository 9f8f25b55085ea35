"""`python -m jax_sm100.bench --train`: a training step on jax_sm100.matmul beside jnp.dot's.

What users run: `jax.jit(jax.value_and_grad(loss, argnums=(0, 1)))` of a model, once with every
product through `jax_sm100.matmul` (bias and activation in its epilogue) and once through
`jnp.dot` (bias and activation by XLA), same inputs (normal random data), same process.

Models (bfloat16):

mlp
    `gelu(x @ w1 + b1) @ w2`, x [8192, 4096], w1 [4096, 14336], w2 [14336, 4096].
transformer
    One pre-LayerNorm block, 4 x 2048 tokens, d_model 4096, 32 heads: fused QKV projection,
    causal attention (`jax.nn.dot_product_attention`, the same on both sides), output
    projection, residual, LayerNorm, then the MLP above (d_ff 14336), residual.

For each: the step time (3 warm-up steps, then 6 rounds of 50 asynchronously dispatched steps
blocked once, the two sides' rounds interleaved with the first side alternating, each round
after an untimed step of its own: `time_steps_alike`; median round / 50), the products' TFLOP/s
(3 x 2mnk per product per step: forward, input gradient, weight gradient; attention's own
FLOPs not counted), the ratio jnp.dot's step time / ours (> 1: ours faster), the compiled
step's temporary memory (`memory_analysis()`, what
the step needs beside its inputs and outputs: saved activations, gradients in flight) and the
bytes of the residuals the backward saves (`saved_residuals`), and how many of the compiled
step's products are our kernel and how many XLA's.

`--fp8` instead times each model with its products through `jax_sm100.scaled_dot_general`
(DeepSeek-V3's recipe, `jax_sm100.DEEPSEEK_V3`: every product quantized inside, the gradients'
too, on the block-scaled kernel; bias and activation by XLA) and through
`jax.nn.scaled_dot_general` (mxfp8), beside our bfloat16 step and jnp.dot's, all interleaved as
above; a side this JAX cannot compile is reported with its error.

Then (unless `--no-products` or `--fp8`) the MLP block's products alone by the device method of
`jax_sm100.bench` (R dependent products in one XLA loop): each product in the layout the
backward runs it in (input gradients with B transposed, weight gradients with A transposed, the
fused activation-gradient epilogue against XLA's product plus its elementwise pass), ours
beside the same product by `lax.dot_general`; and `jax.vjp` of one 8192^3 product by wall
clock (`time_steps_alike`, 6 rounds of 20 calls).
"""

from __future__ import annotations

import dataclasses
import math
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

import jax_sm100
from jax_sm100 import bench
from jax_sm100._src import ffi
from jax_sm100._src import primitive as P

MLP = dict(tokens=8192, d_model=4096, d_ff=14336)
# A model's timed rounds: steps per round and rounds (even, so each side leads equally often).
# Rounds of 10 steps read the transformer block's ratio anywhere in 0.95-1.00 on the H200
# (forty-third session, one process, the sides alternating); rounds of 50 and 200 read
# 1.000 and 1.002, and the profiler's GPU spans of the two steps agreed within 0.6 %.
MODEL_STEPS, MODEL_ROUNDS = 50, 6
TRANSFORMER = dict(batch=4, seq=2048, d_model=4096, heads=32, d_ff=14336)


def _normal(key, shape, scale=1.0):
    return (jax.random.normal(key, shape, jnp.float32) * scale).astype(jnp.bfloat16)


# `--fp8`'s sides: block-scaled fp8 training products (the bias and activation by XLA).
FP8_SIDES = {
    "ours fp8": lambda x, w, dn: jax_sm100.scaled_dot_general(
        x, w, dn, jnp.bfloat16, jax_sm100.DEEPSEEK_V3
    ),
    "jax.nn fp8": lambda x, w, dn: jax.nn.scaled_dot_general(
        x, w, dn, jnp.bfloat16, [jax.nn.get_scaled_dot_general_config("mxfp8")] * 3
    ),
}


def _linear(impl, x, w, b=None, activation=None):
    if impl == "ours":
        return jax_sm100.matmul(x, w, bias=b, activation=activation)
    if impl in FP8_SIDES:
        y = FP8_SIDES[impl](x, w, (((x.ndim - 1,), (0,)), ((), ())))
    else:
        y = jnp.dot(x, w)
    if b is not None:
        y = y + b
    return P.apply_activation(y, activation)


def mlp_params(key, d_model, d_ff):
    k1, k2, k3 = jax.random.split(key, 3)
    return {
        "w1": _normal(k1, (d_model, d_ff), d_model**-0.5),
        "b1": _normal(k2, (d_ff,), 0.1),
        "w2": _normal(k3, (d_ff, d_model), d_ff**-0.5),
    }


def mlp(impl, p, x):
    return _linear(impl, _linear(impl, x, p["w1"], p["b1"], "gelu"), p["w2"])


def transformer_params(key, d_model, d_ff, **_):
    k1, k2, k3 = jax.random.split(key, 3)
    return {
        "wqkv": _normal(k1, (d_model, 3 * d_model), d_model**-0.5),
        "wo": _normal(k2, (d_model, d_model), d_model**-0.5),
        "mlp": mlp_params(k3, d_model, d_ff),
    }


def _layer_norm(x):
    x32 = x.astype(jnp.float32)
    mean = x32.mean(-1, keepdims=True)
    var = ((x32 - mean) ** 2).mean(-1, keepdims=True)
    return ((x32 - mean) * lax.rsqrt(var + 1e-5)).astype(x.dtype)


def transformer(impl, p, x, heads):
    b, s, d = x.shape
    qkv = _linear(impl, _layer_norm(x), p["wqkv"]).reshape(b, s, 3, heads, d // heads)
    attn = jax.nn.dot_product_attention(qkv[:, :, 0], qkv[:, :, 1], qkv[:, :, 2], is_causal=True)
    x = x + _linear(impl, attn.reshape(b, s, d), p["wo"])
    return x + mlp(impl, p["mlp"], _layer_norm(x))


def _loss(model):
    def loss(p, x):
        return jnp.mean(model(p, x).astype(jnp.float32) ** 2)

    return loss


@dataclasses.dataclass
class Side:
    """One side of a model's comparison: step seconds, memory, and what its products ran on."""

    seconds: float
    temp_bytes: int | None
    residual_bytes: int
    ours_products: int
    xla_products: int
    loss: float


def _products(hlo: str) -> tuple[int, int]:
    """(our kernels, XLA's products) among the compiled module's instructions."""
    # The quantize_both kernel's calls have their own target (`ffi.QUANTIZE_TARGET`).
    ours = sum(f'custom_call_target="{ffi.TARGET}"' in line for line in hlo.splitlines())
    xla = sum(
        1
        for line in hlo.splitlines()
        if (" dot(" in line or 'custom_call_target="__cublas' in line) and "jax_sm100" not in line
    )
    return ours, xla


def _residual_bytes(loss, p, x) -> int:
    from jax._src.ad_checkpoint import saved_residuals  # noqa: PLC0415

    total = 0
    for aval, _ in saved_residuals(loss, p, x):
        total += math.prod(aval.shape) * np.dtype(aval.dtype).itemsize
    return total


def _warm_up(step, args) -> None:
    for _ in range(3):
        jax.block_until_ready(step(*args))


def _round(step, args, steps: int) -> float:
    """Wall time of `steps` async steps, blocked once, / steps."""
    t = time.perf_counter()
    for _ in range(steps):
        out = step(*args)
    jax.block_until_ready(out)
    return (time.perf_counter() - t) / steps


def time_steps(step, *args, steps: int = 10, rounds: int = 5) -> float:
    """Median over `rounds` of (wall time of `steps` async steps, blocked once) / steps."""
    _warm_up(step, args)
    return float(np.median([_round(step, args, steps) for _ in range(rounds)]))


def time_steps_alike(steps_args, steps: int = 10, rounds: int = 5) -> list[float]:
    """`time_steps` of several (step, args), their rounds interleaved in `bench.round_orders`,
    each round after an untimed step of its own, so that the card's clock drift and the order's
    own effect fall on every side alike (timed one after the other, the second side inherits
    the first's clocks). Over `len(bench.round_orders(n))` rounds (or a multiple) each side
    comes first and after each other equally often; fewer rounds take the first orders, which
    still put every side in a different place each round."""
    for step, args in steps_args:
        _warm_up(step, args)
    times = [[] for _ in steps_args]
    orders = bench.round_orders(len(steps_args))
    for r in range(rounds):
        for i in orders[r % len(orders)]:
            step, args = steps_args[i]
            jax.block_until_ready(step(*args))  # untimed: this side's own steady state
            times[i].append(_round(step, args, steps))
    return [float(np.median(t)) for t in times]


def prepare(model, p, x) -> tuple:
    """(the compiled value_and_grad step, its Side without the time)."""
    loss = _loss(model)
    step = jax.jit(jax.value_and_grad(loss, argnums=(0, 1)))
    compiled = step.lower(p, x).compile()
    mem = compiled.memory_analysis()
    ours, xla = _products(compiled.as_text())
    value = float(compiled(p, x)[0])
    side = Side(
        seconds=float("nan"),
        temp_bytes=None if mem is None else int(mem.temp_size_in_bytes),
        residual_bytes=_residual_bytes(loss, p, x),
        ours_products=ours,
        xla_products=xla,
        loss=value,
    )
    return compiled, side


def models():
    """(name, per-impl model function, params, x, product FLOPs of one step)."""
    k = jax.random.split(jax.random.key(0), 4)
    t, d, f = MLP["tokens"], MLP["d_model"], MLP["d_ff"]
    yield ("mlp", lambda impl: lambda p, x: mlp(impl, p, x), mlp_params(k[0], d, f),
           _normal(k[1], (t, d)), 3 * 2 * (2 * t * d * f))  # fmt: skip
    c = TRANSFORMER
    tok, d, f = c["batch"] * c["seq"], c["d_model"], c["d_ff"]
    flop = 3 * 2 * tok * (d * 3 * d + d * d + 2 * d * f)
    yield ("transformer", lambda impl: lambda p, x: transformer(impl, p, x, c["heads"]),
           transformer_params(k[2], d, f), _normal(k[3], (c["batch"], c["seq"], d)),
           flop)  # fmt: skip


def run_sides(names, impls, may_fail=()) -> list[tuple[str, int, dict]]:
    """(model, product FLOPs, {impl: Side}) of each model in `names`, every impl's compiled
    step timed in interleaved rounds (`time_steps_alike`); an impl in `may_fail` that does not
    compile on this device is reported by its error (a string) instead."""
    rows = []
    for name, model, p, x, flop in models():
        if name not in names:
            continue
        sides, failed = {}, {}
        for impl in impls:
            try:
                sides[impl] = prepare(model(impl), p, x)
            except Exception as e:
                if impl not in may_fail:
                    raise
                failed[impl] = f"{type(e).__name__}: {str(e).splitlines()[0][:100]}"
        steps = [(compiled, (p, x)) for compiled, _ in sides.values()]
        times = time_steps_alike(steps, steps=MODEL_STEPS, rounds=MODEL_ROUNDS)
        out = {impl: dataclasses.replace(side, seconds=t)
               for (impl, (_, side)), t in zip(sides.items(), times, strict=True)}  # fmt: skip
        rows.append((name, flop, {**out, **failed}))
    return rows


def run_models(names) -> list[tuple[str, int, Side, Side]]:
    return [(name, flop, s["ours"], s["jnp"])
            for name, flop, s in run_sides(names, ("ours", "jnp"))]  # fmt: skip


def run_fp8(names) -> list[tuple[str, int, dict]]:
    """`--fp8`: each model's step with fp8 training products (`FP8_SIDES`) beside our bfloat16
    one and jnp.dot's; an FP8 side that this JAX cannot compile on this device (jax.nn's) is
    reported with its error."""
    return run_sides(names, ("jnp", "ours", *FP8_SIDES), may_fail=tuple(FP8_SIDES))


def report_fp8(rows) -> None:
    print(f"{'model':12s} {'side':11s} | {'ms':>7s} {'vs jnp.dot':>10s} | {'TF/s':>6s} | "
          f"{'temp GiB':>8s} | products ours/XLA | loss")  # fmt: skip
    for name, flop, sides in rows:
        base = sides["jnp"].seconds
        for impl, side in sides.items():
            if isinstance(side, str):
                print(f"{name:12s} {impl:11s} | not run: {side}")
                continue
            temp = "-" if side.temp_bytes is None else f"{side.temp_bytes / 2**30:.2f}"
            print(f"{name:12s} {impl:11s} | {side.seconds * 1e3:7.2f} {base / side.seconds:10.3f}"
                  f" | {flop / side.seconds / 1e12:6.1f} | {temp:>8s} | "
                  f"{side.ours_products}/{side.xla_products} | {side.loss:.5g}")  # fmt: skip


def report_models(rows) -> None:
    print(f"{'model':12s} | {'ours ms':>8s} {'dot ms':>8s} {'ratio':>6s} | {'ours TF/s':>9s} "
          f"{'dot TF/s':>9s} | {'temp GiB ours':>13s} {'dot':>6s} | {'saved GiB ours':>14s} "
          f"{'dot':>6s} | products ours/XLA | loss ours, dot")  # fmt: skip
    gib = lambda b: "-" if b is None else f"{b / 2**30:.2f}"  # noqa: E731
    for name, flop, o, t in rows:
        print(f"{name:12s} | {o.seconds * 1e3:8.2f} {t.seconds * 1e3:8.2f} "
              f"{t.seconds / o.seconds:6.3f} | {flop / o.seconds / 1e12:9.1f} "
              f"{flop / t.seconds / 1e12:9.1f} | {gib(o.temp_bytes):>13s} {gib(t.temp_bytes):>6s} "
              f"| {gib(o.residual_bytes):>14s} {gib(t.residual_bytes):>6s} | "
              f"{o.ours_products}/{o.xla_products} (dot: {t.xla_products}) | "
              f"{o.loss:.5g}, {t.loss:.5g}")  # fmt: skip


# --- the backward products alone ------------------------------------------------------------------


def _bind(x, y, *extra, tx=False, ty=False, act_grad=None, bias=False, activation=None,
          both=False):  # fmt: skip
    params = dict(
        transpose_a=tx, transpose_b=ty, alpha=1.0, beta=1.0, activation=activation,
        out_dtype=np.dtype(jnp.bfloat16), has_bias=bias, has_c=act_grad is not None,
        plan=None, save_preact=activation is not None, act_grad=act_grad,
    )  # fmt: skip
    outs = P.matmul_p.bind(x, y, *extra, **params)
    return tuple(outs) if both else outs[0]


def product_cases():
    """(label, (m, n, k), a, b, ours(a, b), dot(a, b)) for the MLP block's products."""
    t, d, f = MLP["tokens"], MLP["d_model"], MLP["d_ff"]
    k = jax.random.split(jax.random.key(1), 8)
    dn_t = (((0,), (0,)), ((), ()))  # a^T b
    dn_bt = (((1,), (1,)), ((), ()))  # a b^T
    tn = lambda a, b: lax.dot_general(a, b, dn_t)  # noqa: E731
    nt = lambda a, b: lax.dot_general(a, b, dn_bt)  # noqa: E731
    z = _normal(k[0], (t, f))
    b1 = _normal(k[1], (f,), 0.1)

    def dot_fused_gelu(a, b):
        y = jnp.dot(a, b) + b1
        return jax.nn.gelu(y, approximate=True), y

    def dot_act_grad(a, b):
        # What the jnp.dot model's backward runs: the product, then gelu'(z) * it in XLA.
        y = lax.dot_general(a, b, dn_bt).astype(jnp.float32)
        return (y * P.activation_grad(z.astype(jnp.float32), "gelu")).astype(jnp.bfloat16)

    # Both sides write gelu(z) and z (the pre-activation the backward reads).
    yield ("fwd 1: x @ w1 + b1, gelu, saves z", (t, f, d), _normal(k[2], (t, d)),
           _normal(k[3], (d, f)),
           lambda a, b: _bind(a, b, b1, bias=True, activation="gelu", both=True),
           dot_fused_gelu)  # fmt: skip
    yield ("fwd 2: h @ w2", (t, d, f), _normal(k[4], (t, f)), _normal(k[5], (f, d)),
           lambda a, b: _bind(a, b), lambda a, b: jnp.dot(a, b))  # fmt: skip
    yield ("dgrad 2: (g @ w2^T) * gelu'(z)", (t, f, d), _normal(k[6], (t, d)),
           _normal(k[5], (f, d)), lambda a, b: _bind(a, b, z, ty=True, act_grad="gelu"),
           dot_act_grad)  # fmt: skip
    yield ("wgrad 2: h^T @ g", (f, d, t), _normal(k[4], (t, f)), _normal(k[6], (t, d)),
           lambda a, b: _bind(a, b, tx=True), tn)  # fmt: skip
    yield ("dgrad 1: g1 @ w1^T", (t, d, f), _normal(k[7], (t, f)), _normal(k[3], (d, f)),
           lambda a, b: _bind(a, b, ty=True), nt)  # fmt: skip
    yield ("wgrad 1: x^T @ g1", (d, f, t), _normal(k[2], (t, d)), _normal(k[7], (t, f)),
           lambda a, b: _bind(a, b, tx=True), tn)  # fmt: skip
    n = 8192
    yield ("8192^3 dgrad: g @ b^T", (n, n, n), _normal(k[0], (n, n)), _normal(k[1], (n, n)),
           lambda a, b: _bind(a, b, ty=True), nt)  # fmt: skip
    yield ("8192^3 wgrad: a^T @ g", (n, n, n), _normal(k[2], (n, n)), _normal(k[3], (n, n)),
           lambda a, b: _bind(a, b, tx=True), tn)  # fmt: skip


def run_products(device_seconds=0.05):
    rows = []
    for label, shape, a, b, ours, dot in product_cases():
        timings = bench.time_device((ours, dot), a, b, min_seconds=device_seconds)
        problems = [p for t in timings for p in t.check.problems()]
        rows.append((label, shape, timings[0].seconds, timings[1].seconds, problems))
    return rows


def vjp_8192(n=8192):
    k = jax.random.split(jax.random.key(2), 3)
    a, b, ct = _normal(k[0], (n, n)), _normal(k[1], (n, n)), _normal(k[2], (n, n))
    ours = jax.jit(lambda a, b, ct: jax.vjp(jax_sm100.matmul, a, b)[1](ct))
    dot = jax.jit(lambda a, b, ct: jax.vjp(jnp.dot, a, b)[1](ct))
    return tuple(time_steps_alike([(ours, (a, b, ct)), (dot, (a, b, ct))], steps=20, rounds=6))


def report_products(rows, vjp) -> None:
    print(f"{'product (device method)':34s} {'m x n x k':20s} | {'ours TF/s':>9s} "
          f"{'dot TF/s':>9s} {'ratio':>6s}")  # fmt: skip
    for label, shape, o, t, problems in rows:
        flop = 2 * math.prod(shape)
        flag = "!" if problems else " "
        print(f"{label:34s} {'x'.join(map(str, shape)):20s} | {flop / o / 1e12:9.1f} "
              f"{flop / t / 1e12:9.1f} {t / o:5.3f}{flag}")  # fmt: skip
        for p in problems:
            print(f"  ! {p}")
    o, t = vjp
    flop = 2 * 2 * 8192**3
    print(f"{'jax.vjp(matmul)(ct), 8192^3 (wall)':34s} {'':20s} | {flop / o / 1e12:9.1f} "
          f"{flop / t / 1e12:9.1f} {t / o:5.3f}")  # fmt: skip


def main(argv=None) -> int:
    import argparse  # noqa: PLC0415

    ap = argparse.ArgumentParser(prog="python -m jax_sm100.bench --train", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)  # fmt: skip
    ap.add_argument("--models", default="mlp,transformer")
    ap.add_argument("--no-products", action="store_true")
    ap.add_argument("--fp8", action="store_true",
                    help="the models with fp8 training products instead (FP8_SIDES)")  # fmt: skip
    args = ap.parse_args(argv)
    if bad := sorted(set(args.models.split(",")) - {"mlp", "transformer"}):
        ap.error(f"--models: {bad} not in mlp, transformer")
    dev = jax.devices()[0]
    print(f"device: {dev.device_kind} ({dev.platform}), jax {jax.__version__}, bfloat16, "
          "value_and_grad(loss, argnums=(0, 1))")  # fmt: skip
    bench.say_if_no_kernels()
    if args.fp8:
        report_fp8(run_fp8(args.models.split(",")))
        return 0
    report_models(run_models(args.models.split(",")))
    if not args.no_products:
        report_products(run_products(), vjp_8192())
    return 0


if __name__ == "__main__":
    sys.exit(main())
