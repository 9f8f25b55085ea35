"""Trains a small mixture-of-experts transformer with every expert product in `ragged_dot`.

    python examples/train_moe.py [--steps 60] [--experts 8] [--top-k 2] [--dtype float32]
    python examples/train_moe.py --reference     # the same model on jax.lax.ragged_dot

The model is a pre-norm residual stack of transformer blocks over sequences of `--seq` tokens:
causal multi-head self-attention (its q, k, v and output projections `jax_sm100.matmul`, the
scores and their weighted sum XLA's), then a MoE MLP: a router (`jax_sm100.matmul`) scores each
token's experts, each token goes to its top-k experts (its copies sorted by expert, so every
expert's rows are consecutive), each expert runs a SwiGLU MLP on its rows, gate and up
projections and the down projection each one `jax_sm100.ragged_dot` over all experts, and the
outputs return to their tokens weighted by the router's probabilities. The student learns to
match a fixed random teacher of the same architecture, so the loss falls towards zero; the loss
and the median time per step are printed. On a CPU the products run on XLA's `ragged_dot`;
on a GPU the paths the products took are printed (`jax_sm100.lowerings()`).
"""

from __future__ import annotations

import argparse
import functools
import time

import jax
import jax.numpy as jnp
from jax import lax

import jax_sm100


def init(key, layers, d_model, d_ff, experts, dtype):
    params = []
    for layer_key in jax.random.split(key, layers):
        kr, kg, ku, kd, ka = jax.random.split(layer_key, 5)
        attn = jax.random.normal(ka, (4, d_model, d_model)) * d_model**-0.5
        params.append({
            "qkvo": attn.astype(dtype),
            "router": jax.random.normal(kr, (d_model, experts), jnp.float32) * d_model**-0.5,
            "gate": (jax.random.normal(kg, (experts, d_model, d_ff)) * d_model**-0.5).astype(dtype),
            "up": (jax.random.normal(ku, (experts, d_model, d_ff)) * d_model**-0.5).astype(dtype),
            "down": (jax.random.normal(kd, (experts, d_ff, d_model)) * d_ff**-0.5).astype(dtype),
        })  # fmt: skip
    return params


def moe_layer(p, x, top_k, grouped, dense):
    """One MoE MLP on x [tokens, d]: route, sort by expert, three grouped products, combine."""
    tokens, _ = x.shape
    experts = p["gate"].shape[0]
    logits = dense(x.astype(jnp.float32), p["router"])  # [tokens, experts], float32
    weights, chosen = lax.top_k(jax.nn.softmax(logits, axis=-1), top_k)  # [tokens, top_k]
    weights = weights / weights.sum(-1, keepdims=True)
    flat_expert = chosen.reshape(-1)  # copy c of token t at t * top_k + c
    order = jnp.argsort(flat_expert, stable=True)
    rows = x[order // top_k]  # the copies, sorted by expert
    sizes = jnp.bincount(flat_expert, length=experts).astype(jnp.int32)
    h = jax.nn.silu(grouped(rows, p["gate"], sizes).astype(jnp.float32))
    h = (h * grouped(rows, p["up"], sizes).astype(jnp.float32)).astype(x.dtype)
    out = grouped(h, p["down"], sizes)  # [tokens * top_k, d]
    unsorted = jnp.zeros_like(out).at[order].set(out).reshape(tokens, top_k, -1)
    return (unsorted.astype(jnp.float32) * weights[..., None]).sum(1).astype(x.dtype)


def attention(p, x, seq, heads, dense):
    """Causal multi-head self-attention on x [tokens, d], tokens in sequences of `seq`."""
    tokens, d = x.shape
    q, k, v = (dense(x, p["qkvo"][i]).reshape(tokens // seq, seq, heads, d // heads)
               for i in range(3))  # fmt: skip
    scores = jnp.einsum("bqhd,bkhd->bhqk", q, k, preferred_element_type=jnp.float32)
    causal = jnp.tril(jnp.ones((seq, seq), bool))
    scores = jnp.where(causal, scores * (d // heads) ** -0.5, -jnp.inf)
    probs = jax.nn.softmax(scores, axis=-1).astype(x.dtype)
    out = jnp.einsum("bhqk,bkhd->bqhd", probs, v).reshape(tokens, d)
    return dense(out, p["qkvo"][3])


def _rms(x):
    return (x * lax.rsqrt(jnp.mean(jnp.square(x.astype(jnp.float32)), -1, keepdims=True) + 1e-6)
            ).astype(x.dtype)  # fmt: skip


def model(params, x, top_k, grouped, dense, seq=64, heads=4):
    for p in params:
        x = x + attention(p, _rms(x), seq, heads, dense)
        x = x + moe_layer(p, _rms(x), top_k, grouped, dense)
    return x


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--steps", type=int, default=60)
    ap.add_argument("--tokens", type=int, default=512)
    ap.add_argument("--d-model", type=int, default=128)
    ap.add_argument("--d-ff", type=int, default=256)
    ap.add_argument("--experts", type=int, default=8)
    ap.add_argument("--top-k", type=int, default=2)
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--seq", type=int, default=64, help="tokens per sequence (attention)")
    ap.add_argument("--heads", type=int, default=4)
    ap.add_argument("--lr", type=float, default=3e-3)
    ap.add_argument("--dtype", default="float32", choices=("float32", "bfloat16", "float16"))
    ap.add_argument("--reference", action="store_true", help="lax.ragged_dot and jnp.matmul")
    args = ap.parse_args(argv)
    dtype = jnp.dtype(args.dtype)
    if args.reference:
        grouped = functools.partial(lax.ragged_dot, preferred_element_type=dtype)
        dense = jnp.matmul
    else:
        grouped, dense = jax_sm100.ragged_dot, jax_sm100.matmul
    if args.steps < 1:
        ap.error(f"--steps {args.steps} must be at least 1")
    if not 1 <= args.top_k <= args.experts:
        ap.error(f"--top-k {args.top_k} must be between 1 and --experts {args.experts}")
    if args.seq < 1 or args.tokens % args.seq:
        ap.error(f"--tokens {args.tokens} must be a multiple of --seq {args.seq} (>= 1)")
    if args.heads < 1 or args.d_model % args.heads:
        ap.error(f"--d-model {args.d_model} must be a multiple of --heads {args.heads} (>= 1)")
    forward = functools.partial(model, top_k=args.top_k, grouped=grouped, dense=dense,
                                seq=args.seq, heads=args.heads)  # fmt: skip

    k_teacher, k_student, k_data = jax.random.split(jax.random.key(0), 3)
    shapes = (args.layers, args.d_model, args.d_ff, args.experts, dtype)
    teacher, params = init(k_teacher, *shapes), init(k_student, *shapes)

    def loss_fn(params, x, target):
        return jnp.mean(jnp.square(forward(params, x).astype(jnp.float32) - target))

    @jax.jit
    def step(params, moments, x, target, t):
        # Adam, in float32 moments, written out so the example needs nothing beyond JAX.
        loss, grads = jax.value_and_grad(loss_fn)(params, x, target)
        m, v = moments
        m = jax.tree.map(lambda m, g: 0.9 * m + 0.1 * g.astype(jnp.float32), m, grads)
        v = jax.tree.map(lambda v, g: 0.999 * v + 0.001 * jnp.square(g.astype(jnp.float32)), v,
                         grads)  # fmt: skip
        scale = args.lr * jnp.sqrt(1 - 0.999**t) / (1 - 0.9**t)
        params = jax.tree.map(
            lambda p, m, v: (p.astype(jnp.float32) - scale * m / (jnp.sqrt(v) + 1e-8)).astype(
                p.dtype
            ),
            params, m, v,
        )  # fmt: skip
        return params, (m, v), loss

    zeros = jax.tree.map(lambda p: jnp.zeros(p.shape, jnp.float32), params)
    moments = (zeros, zeros)
    times, losses = [], []
    with jax_sm100.lowerings() as seen:
        for t in range(1, args.steps + 1):
            x = jax.random.normal(jax.random.fold_in(k_data, t), (args.tokens, args.d_model))
            x = x.astype(dtype)
            target = forward(teacher, x).astype(jnp.float32)
            start = time.perf_counter()
            params, moments, loss = step(params, moments, x, target, t)
            loss = float(loss)
            times.append(time.perf_counter() - start)
            losses.append(loss)
            if t == 1 or t % 10 == 0 or t == args.steps:
                print(f"step {t:4d}  loss {loss:.5f}")
    # The first step compiles; the median is of the others (of the first alone if none).
    timed = times[1:] or times
    median = sorted(timed)[len(timed) // 2]
    over = f"{len(timed)} steps" if len(times) > 1 else "1 step, compile included"
    paths = sorted({x.note for x in seen})
    print(f"{'lax.ragged_dot' if args.reference else 'jax_sm100.ragged_dot'}: median step "
          f"{median * 1e3:.2f} ms over {over}; loss {losses[0]:.5f} -> "
          f"{losses[-1]:.5f}")  # fmt: skip
    for note in paths:
        print("  path:", note)


if __name__ == "__main__":
    main()
