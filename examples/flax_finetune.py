"""Fine-tunes a Flax nnx transformer on `jax_sm100.dot_general`, beside the same model on lax.

    python examples/flax_finetune.py                 # the H200 size; both models, side by side
    python examples/flax_finetune.py --small         # a size a CPU runs in seconds
    python examples/flax_finetune.py --only ours     # or --only lax: one model
    python examples/flax_finetune.py --no-fused      # nnx.Linear + nnx.gelu for the MLP too
    python examples/flax_finetune.py --fp8           # ours in fp8 (DeepSeek-V3's recipe)

The model is what a Flax user writes: pre-LayerNorm blocks of `nnx.MultiHeadAttention` and an
MLP of `nnx.Linear` layers, bfloat16 compute on float32 parameters, AdamW. The only change for
jax_sm100 is `dot_general=jax_sm100.dot_general` (`qkv_dot_general=`/`out_dot_general=` for the
attention projections), and, unless `--no-fused`, the MLP's up-projection as
`jax_sm100.flax.Linear(..., activation="gelu")`, whose bias and gelu run in the GEMM's epilogue
(and gelu' in the backward GEMM's). The attention scores and their weighted sum stay
`jnp.einsum` (Flax's `dot_product_attention`) in both models.

With `--fp8` every projection of our model is `jax_sm100.scaled_dot_general` with
`jax_sm100.DEEPSEEK_V3` (`dot_general=functools.partial(...)`; each product and both of its
gradients quantized to fp8 inside, on the block-scaled kernel; the up-projection then
`nnx.Linear` + `nnx.gelu`), beside the same bfloat16 model on lax.

Both models start from the same weights (a "pretrained" model) and are fine-tuned to match a
fixed teacher of the same architecture on random inputs, so their losses agree step by step to
bfloat16 rounding (with `--fp8`, to fp8's: within a per cent). Printed: the device, date and
versions; per model, the first step's time (tracing, kernel and XLA compiles, one step), the
median step time (each step waited for, the first `--warmup` timed steps left out), the
products of the compiled step on our kernels and on XLA's (counted in its HLO), and how the
CUDA lowerings went (`jax_sm100.lowerings()`); then a summary table with the step-time ratio,
and the two loss curves.
"""

from __future__ import annotations

import argparse
import collections
import functools
import statistics
import time

import flax
import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx
from jax import lax

import jax_sm100
from jax_sm100 import flax as sm100_flax


class Block(nnx.Module):
    def __init__(self, d, heads, d_ff, *, dot_general, fused, dtype, rngs):
        self.ln1 = nnx.LayerNorm(d, dtype=dtype, rngs=rngs)
        self.attn = nnx.MultiHeadAttention(
            heads, d, qkv_dot_general=dot_general, out_dot_general=dot_general, dtype=dtype,
            decode=False, rngs=rngs,
        )  # fmt: skip
        self.ln2 = nnx.LayerNorm(d, dtype=dtype, rngs=rngs)
        if fused:
            self.up = sm100_flax.Linear(d, d_ff, activation="gelu", dtype=dtype, rngs=rngs)
        else:
            self.up = nnx.Linear(d, d_ff, dot_general=dot_general, dtype=dtype, rngs=rngs)
        self.down = nnx.Linear(d_ff, d, dot_general=dot_general, dtype=dtype, rngs=rngs)
        self.fused = fused

    def __call__(self, x):
        x = x + self.attn(self.ln1(x))
        h = self.up(self.ln2(x))
        return x + self.down(h if self.fused else nnx.gelu(h))


class Model(nnx.Module):
    def __init__(self, args, *, dot_general, fused, seed):
        rngs = nnx.Rngs(seed)
        dtype = jnp.dtype(args.dtype)
        self.blocks = nnx.List(
            Block(args.d_model, args.heads, args.d_ff, dot_general=dot_general, fused=fused,
                  dtype=dtype, rngs=rngs)
            for _ in range(args.layers)
        )  # fmt: skip
        self.ln = nnx.LayerNorm(args.d_model, dtype=dtype, rngs=rngs)
        self.head = nnx.Linear(args.d_model, args.d_model, dot_general=dot_general,
                               dtype=dtype, rngs=rngs)  # fmt: skip

    def __call__(self, x):
        for block in self.blocks:
            x = block(x)
        return self.head(self.ln(x))


def loss_fn(model, x, y):
    return jnp.mean((model(x).astype(jnp.float32) - y) ** 2)


@nnx.jit
def train_step(model, optimizer, x, y):
    loss, grads = nnx.value_and_grad(loss_fn)(model, x, y)
    optimizer.update(model, grads)
    return loss


def kernel_summary(seen) -> str:
    """What the CUDA lowerings of a compiled step chose (one per distinct product: identical
    products share a lowering; none on a CPU, where nothing lowers to CUDA)."""
    runs = collections.Counter(
        (
            "on our kernels"
            if x.plan is not None and x.plan.kernel != "xla_dot"
            else "on XLA's dot: " + x.note
        )
        for x in seen
        if not x.note.startswith("jax_sm100.")  # trace-time notes (copies, lax fallbacks)
    )
    traced = [x.note for x in seen if x.note.startswith("jax_sm100.")]
    parts = [f"{n} lowered {what}" for what, n in sorted(runs.items())]
    parts += [f"traced: {note}" for note in sorted(set(traced))]
    return "; ".join(parts) or "none through jax_sm100 (no GPU, or lax's dot)"


def products(hlo: str) -> tuple[int, int]:
    """(our kernels, XLA's products) among a compiled module's instructions: custom calls to
    jax_sm100's FFI target; XLA's dots and cuBLAS calls."""
    # (The quantize_both kernel's calls, which quantize scaled_dot_general's operands, have
    # their own target, jax_sm100_quantize.)
    ours = sum('custom_call_target="jax_sm100_gemm"' in line for line in hlo.splitlines())
    xla = sum(
        (" dot(" in line or 'custom_call_target="__cublas' in line) and "jax_sm100" not in line
        for line in hlo.splitlines()
    )
    return ours, xla


def run(name, args, dot_general, fused, data):
    x, y = data
    model = Model(args, dot_general=dot_general, fused=fused, seed=0)
    optimizer = nnx.Optimizer(model, optax.adamw(args.lr), wrt=nnx.Param)
    with jax_sm100.lowerings() as seen:
        start = time.perf_counter()
        losses = [float(train_step(model, optimizer, x, y))]  # compiles
        compile_s = time.perf_counter() - start
    times = []
    for _ in range(args.steps - 1):
        start = time.perf_counter()
        losses.append(float(jax.block_until_ready(train_step(model, optimizer, x, y))))
        times.append(time.perf_counter() - start)
    timed = times[args.warmup :] or times
    step_ms = 1e3 * statistics.median(timed)
    ours, xla = products(train_step.lower(model, optimizer, x, y).compile().as_text())
    print(f"{name}: first step (compile) {compile_s:.1f} s; step {step_ms:.2f} ms (median of "
          f"{len(timed)}); products in the compiled step: {ours} on our kernels, {xla} on XLA's; "
          f"CUDA lowerings: {kernel_summary(seen)}")  # fmt: skip
    return dict(losses=np.array(losses), compile_s=compile_s, step_ms=step_ms, timed=len(timed),
                ours=ours, xla=xla)  # fmt: skip


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--warmup", type=int, default=3, help="timed steps left out")
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--seq", type=int, default=1024)
    parser.add_argument("--d-model", type=int, default=2048)
    parser.add_argument("--heads", type=int, default=16)
    parser.add_argument("--d-ff", type=int, default=8192)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--lr", type=float, default=1e-4)
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"])
    parser.add_argument("--only", choices=["ours", "lax"], help="run one model")
    parser.add_argument("--no-fused", dest="fused", action="store_false",
                        help="the MLP's up-projection as nnx.Linear + nnx.gelu too")  # fmt: skip
    parser.add_argument("--fp8", action="store_true",
                        help="our model's products in fp8: jax_sm100.scaled_dot_general with "
                             "DEEPSEEK_V3 (no fused up-projection)")  # fmt: skip
    parser.add_argument("--small", action="store_true",
                        help="smaller defaults (2 layers, d_model 128, 4 heads, d_ff 512, 4 x 64 "
                             "tokens, 8 steps, warmup 1, lr 1e-3): seconds on a CPU; flags "
                             "given beside it still count")  # fmt: skip
    args = parser.parse_args()
    if args.small:
        parser.set_defaults(layers=2, d_model=128, heads=4, d_ff=512, batch=4, seq=64, steps=8,
                            warmup=1, lr=1e-3)  # fmt: skip
        args = parser.parse_args()
    if args.steps < 2:
        parser.error(f"--steps {args.steps}: at least 2 (the first step compiles, the rest are "
                     "timed)")  # fmt: skip
    if args.dtype == "float16" and jax.default_backend() == "cpu":
        # Flax's attention asks dot_general for F16_F16_F32, which XLA's CPU backend lacks.
        parser.error("--dtype float16 needs a GPU (JAX's CPU dot_general has no float16 "
                     "product with float32 accumulation); use bfloat16 or float32")  # fmt: skip

    print(f"{jax.devices()[0].device_kind}, {time.strftime('%Y-%m-%d')}, jax {jax.__version__}, "
          f"flax {flax.__version__}, optax {optax.__version__}: {args.layers} blocks, "
          f"d_model {args.d_model}, {args.heads} heads, d_ff {args.d_ff}, "
          f"{args.batch} x {args.seq} tokens, {args.dtype} compute, float32 parameters, AdamW, "
          f"{args.steps} steps")  # fmt: skip
    key_x, _ = jax.random.split(jax.random.key(42))
    x = jax.random.normal(key_x, (args.batch, args.seq, args.d_model), jnp.float32)
    teacher = Model(args, dot_general=lax.dot_general, fused=False, seed=1)
    y = nnx.jit(lambda teacher, x: teacher(x).astype(jnp.float32))(teacher, x)
    del teacher
    data = (x, y)

    results = {}
    if args.only in (None, "ours") and args.fp8:
        label = "ours fp8 (jax_sm100.scaled_dot_general, DEEPSEEK_V3)"
        # The operands' dtype out, as lax.dot_general's (jax.nn's default is float32).
        fp8_dot = functools.partial(jax_sm100.scaled_dot_general, configs=jax_sm100.DEEPSEEK_V3,
                                    preferred_element_type=None)  # fmt: skip
        results[label] = run(label, args, fp8_dot, False, data)
    elif args.only in (None, "ours"):
        label = "ours (jax_sm100.dot_general" + (", fused up-projection)" if args.fused else ")")
        results[label] = run(label, args, jax_sm100.dot_general, args.fused, data)
    if args.only in (None, "lax"):
        label = "lax (lax.dot_general)"
        results[label] = run(label, args, lax.dot_general, False, data)

    width = max(map(len, results))
    timed = next(iter(results.values()))["timed"]
    print(f"\nsummary: first step = trace + compiles + one step; step = median of {timed} "
          f"steps, each waited for; products = in the compiled step's HLO")  # fmt: skip
    print(f"{'model':<{width}}  {'first step s':>12}  {'step ms':>9}  products: ours / XLA's")
    for label, r in results.items():
        print(f"{label:<{width}}  {r['compile_s']:>12.1f}  {r['step_ms']:>9.2f}  "
              f"{r['ours']} / {r['xla']}")  # fmt: skip
    if len(results) == 2:
        ours, ref = results.values()
        print(
            f"step time lax / ours: {ref['step_ms'] / ours['step_ms']:.3f}x (above 1: ours faster)"
        )
        print(f"\n{'step':>4}  {'loss ours':>12}  {'loss lax':>12}")
        for i, (a, b) in enumerate(zip(ours["losses"], ref["losses"], strict=True)):
            print(f"{i:>4}  {a:>12.6f}  {b:>12.6f}")
        diff = np.max(np.abs(ours["losses"] - ref["losses"]) / ref["losses"])
        print(f"largest relative loss difference: {diff:.2e}")
    else:
        (r,) = results.values()
        print("losses:", " ".join(f"{v:.6f}" for v in r["losses"]))


if __name__ == "__main__":
    main()
