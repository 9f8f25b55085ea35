"""Pieces every kernel family shares: dtypes, the compile target, fake operands, the epilogue.

Nothing here decides a tiling: that is the plan's job (the planning package). This module turns a
`GemmPlan` and a `KernelSpec` into what `cute.compile` needs on a machine without a GPU
(symbolic operand descriptions and a target architecture), and holds the one statement of the
epilogue arithmetic that the SM90 and SM100 kernels both apply to their float32 accumulators.

Symbolic shapes: m, n, k and l are `cute.sym_int`s shared by every operand, so one compiled
binary serves any problem with the same divisibility; the contiguous dimension of each operand
is declared divisible by the number of elements in 16 bytes, which TMA requires. The planner
only sends a problem to a kernel when that holds (constraints.py).
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
from collections.abc import Iterator

import cutlass
from cutlass import cute
from cutlass._mlir.dialects import llvm
from cutlass.cute.runtime import make_fake_compact_tensor, make_fake_tensor

from jax_sm100._src import constraints, planning
from jax_sm100._src.kernels.spec import ACT_GRAD_CLAMP, GELU_K0, GELU_K1, KernelSpec

# numpy dtype names (what GemmPlan and KernelSpec carry) -> CuTe DSL element types.
CUTLASS_DTYPES: dict[str, type[cutlass.Numeric]] = {
    "bfloat16": cutlass.BFloat16,
    "float16": cutlass.Float16,
    "float32": cutlass.Float32,
    "float8_e4m3fn": cutlass.Float8E4M3FN,
    "float8_e5m2": cutlass.Float8E5M2,
    # Block-scaled data and scale factors (kernels/sm100_blockscaled.py).
    "float4_e2m1fn": cutlass.Float4E2M1FN,
    "float8_e8m0fnu": cutlass.Float8E8M0FNU,
}

# TMA moves whole 16-byte units along the contiguous dimension and needs 16-byte aligned bases;
# the architectures this package compiles for, as the DSL spells them (both: constraints.py).
TMA_ALIGN_BYTES = constraints.TMA_ALIGN_BYTES
ARCHS = constraints.ARCHS

# Named-barrier ids of both families (0 is __syncthreads), in one table so they never collide.
SM90_EPI_BARRIER = 1  # + the epilogue group: 1 (and 2 in ping-pong)
SM90_TURN_BARRIER = 3  # + the consumer warp group: 3 and 4, the ping-pong turns
SM100_EPI_BARRIER = 1  # the four epilogue warps
SM100_TMEM_PTR_BARRIER = 2  # the epilogue warps and the MMA warp: the TMEM allocation's address


# The SM90 kernels' A/B stage waits (dense, block-scaled, grouped) poll first: one mbarrier try_wait
# without a suspend hint, and the DSL's blocking wait (a retry loop with a 10 ms suspend hint)
# only when that found the phase incomplete, as CUTLASS's C++ collectives wait. H200,
# eighteenth session (`bench --scaled`, two processes each, 4096x7168x16384): block-scaled B
# per row 882-885 -> 896-900 TF/s, per 128 x 128 tile 1101-1103 -> 1115; unscaled fp8 within
# spread (1278-1293 against 1282-1287). The SM100 kernels keep the blocking waits: their
# pipeline participants' token forms (`consumer.wait_and_advance(consumer.try_wait())`, and the
# producer's) fail the DSL's IR verification in nvidia-cutlass-dsl 4.8.1 ("operand does not
# dominate this use") inside the kernels' dynamic k loops.


def wait_full(pipe, state):
    """The consumers' wait for A/B stage `state` of `pipe` (a PipelineTmaAsync) to land."""
    pipe.consumer_wait(state, pipe.consumer_try_wait(state))


def acquire_empty(pipe, state):
    """The producer's wait for A/B stage `state` of `pipe` to be released."""
    pipe.producer_acquire(state, pipe.producer_try_acquire(state))


def pinned_thread_idx() -> cutlass.Int32:
    """threadIdx.x, read once through an opaque (volatile) asm, for the SM90 A/B pipelines'
    `tidx`: which lanes release a stage (and to which CTA of the cluster) is computed from it.
    Read with `cute.arch.thread_idx()`, NVVM sinks the %tid.x read to every release, and ptxas
    then put an S2R in each k-tile, in the 256-row block-scaled loop between its second
    wave's wgmmas, where the warp waited for it (Nsight Compute on the H200, twentieth session:
    3 % of the kernel's samples). NVVM cannot move or copy the asm; ptxas sees a plain %tid.x
    read and could in principle re-read it, but on the plans checked (256-row block-scaled,
    dense ping-pong, grouped 2x1) keeps it from the kernel's start: no S2R in the loop
    (DeepGEMM reads its lane index through an asm too). Same call, one process per side:
    256 x 128 block-scaled tiles 1131 -> 1135, 1116 -> 1142, 1176 -> 1179 TF/s. The dense fp8
    ping-pong at 16384x4096x4096 read 1256 -> 1288, but its loop had no S2R to lose (one LOP3
    per release left it): that may be spread."""
    return cutlass.Int32(
        llvm.inline_asm(
            cutlass.Int32.mlir_type, [], "mov.u32 $0, %tid.x;", "=r", has_side_effects=True
        )
    )


def cutlass_dtype(name: str) -> type[cutlass.Numeric]:
    """Returns the CuTe DSL element type for a numpy dtype name such as "bfloat16"."""
    try:
        return CUTLASS_DTYPES[name]
    except KeyError:
        raise TypeError(
            f"{name=} has no CuTe DSL kernel type; one of {sorted(CUTLASS_DTYPES)}"
        ) from None


def dtype_bits(name: str) -> int:
    return cutlass_dtype(name).width


def elems_per_16b(name: str) -> int:
    """Elements of dtype `name` in one 16-byte TMA unit (the contiguous-dim divisibility)."""
    return constraints.tma_quantum_bits(dtype_bits(name))


@contextlib.contextmanager
def target_arch(arch: str) -> Iterator[None]:
    """Makes `cute.compile` inside the block target `arch` ("sm_90a" or "sm_100a").

    The DSL reads its target from `CuTeDSL._get_dsl().envar.arch` at compile time (what the
    `CUTE_DSL_ARCH` environment variable sets); with no GPU and nothing set it assumes sm_100a.
    Passing `--gpu-arch` to `cute.compile` instead breaks `export_to_c`/`dump_to_object`, so
    the arch is switched here and restored afterwards. Not thread-safe: compile.py serialises.
    """
    if arch not in ARCHS:
        raise ValueError(f"{arch=} must be one of {ARCHS}")
    from cutlass.cutlass_dsl.cutlass import CuTeDSL

    envar = CuTeDSL._get_dsl().envar
    previous = envar._arch
    envar.arch = arch
    try:
        yield
    finally:
        envar.arch = previous


@dataclasses.dataclass(frozen=True)
class FakeOperands:
    """The fake tensors one compile takes, in the host entry point's order (spec.py)."""

    a: cute.Tensor
    b: cute.Tensor
    d: cute.Tensor
    c: cute.Tensor | None
    bias: cute.Tensor | None
    z: cute.Tensor | None = None

    def __iter__(self):
        return iter((self.a, self.b, self.d, self.c, self.bias, self.z))


def _operand(dtype: str, rows, cols, l, *, major_is_cols: bool, batched: bool) -> cute.Tensor:
    """A fake (rows, cols, l) operand of a row-major JAX buffer.

    `major_is_cols` says the buffer is [l, rows, cols] (cols contiguous); otherwise it is
    [l, cols, rows]. An unbatched operand has batch stride 0 (one matrix for every l).
    """
    ctype = cutlass_dtype(dtype)
    if batched:
        order = (1, 0, 2) if major_is_cols else (0, 1, 2)
        return make_fake_compact_tensor(
            ctype, (rows, cols, l), stride_order=order, assumed_align=TMA_ALIGN_BYTES
        )
    ld = cute.sym_int64(divisibility=elems_per_16b(dtype))
    stride = (ld, 1, 0) if major_is_cols else (1, ld, 0)
    return make_fake_tensor(ctype, (rows, cols, l), stride, assumed_align=TMA_ALIGN_BYTES)


def shared_struct(fields: dict, plan) -> cute.struct:
    """The CTA's shared storage from `fields` (name -> `cute.struct` member type), refused above
    a CTA's capacity for `plan.arch`: such a kernel compiles, here without a GPU too, but cannot
    launch, so a plan that undercounts its layout fails at compile time instead."""
    struct = cute.struct(type("SharedStorage", (), {"__annotations__": fields}))
    used, capacity = struct.size_in_bytes(), planning.smem_capacity(plan.arch)
    if used > capacity:
        raise ValueError(
            f"the kernel's shared storage takes {used} bytes, above the {capacity} of an "
            f"{plan.arch} CTA (its plan counts {plan.smem_bytes}: a planner defect, please "
            "report it)"
        )
    return struct


def make_fake_operands(plan, spec: KernelSpec) -> FakeOperands:
    """Fake tensors `(a, b, d, c_or_None, bias_or_None, z_or_None)` for compiling `plan` with
    `spec`.

    Modes follow spec.py: a (M, K, L), b (N, K, L), d, z and c (M, N, L) N-major (d and z
    M-major with `spec.d_major="m"`), bias (N,), or (M,) for a swapped product's D M-major.
    m, n, k, l are symbolic and shared across operands; each contiguous dimension is declared
    divisible by the elements in 16 bytes of its operand's dtype.

    Args:
      plan: the GemmPlan (only dtypes are read here; the shapes stay symbolic).
      spec: the KernelSpec (layouts, optional operands, batching).

    Returns:
      A FakeOperands, iterable as the 6-tuple the kernels' host entry points take.
    """
    del plan  # The compiled binary depends on the spec's dtypes and layouts, not on sizes.

    def div(*dtypes: str) -> int:
        return math.lcm(*(elems_per_16b(t) for t in dtypes))

    a_k_major = spec.a_major == "k"
    b_n_major = spec.b_major == "n"
    d_n_major = spec.d_major == "n"
    # D (and C, bias) run along its contiguous extent: n, or m for D stored M-major.
    d_dtypes = [spec.out_dtype] + [t for t in (spec.c_dtype, spec.bias_dtype) if t]
    n_dtypes = (d_dtypes if d_n_major else []) + ([spec.b_dtype] if b_n_major else [])
    m_dtypes = ([] if a_k_major else [spec.a_dtype]) + ([] if d_n_major else d_dtypes)
    k_dtypes = ([spec.a_dtype] if a_k_major else []) + ([] if b_n_major else [spec.b_dtype])
    m = cute.sym_int(divisibility=div(*m_dtypes) if m_dtypes else 1)
    n = cute.sym_int(divisibility=div(*n_dtypes) if n_dtypes else 1)
    k = cute.sym_int(divisibility=div(*k_dtypes) if k_dtypes else 1)
    l = cute.sym_int()

    a = _operand(spec.a_dtype, m, k, l, major_is_cols=a_k_major, batched=spec.a_batched)
    b = _operand(spec.b_dtype, n, k, l, major_is_cols=not b_n_major, batched=spec.b_batched)
    d = _operand(spec.out_dtype, m, n, l, major_is_cols=d_n_major, batched=True)
    c = None
    if spec.has_c:
        c = _operand(spec.c_dtype, m, n, l, major_is_cols=True, batched=spec.c_batched)
    bias = None
    if spec.has_bias:
        bias = make_fake_compact_tensor(
            cutlass_dtype(spec.bias_dtype), (n if d_n_major else m,), assumed_align=TMA_ALIGN_BYTES
        )
    z = None
    if spec.preact_out:
        z = _operand(spec.out_dtype, m, n, l, major_is_cols=d_n_major, batched=True)
    return FakeOperands(a, b, d, c, bias, z)


def apply_epilogue(acc, c=None, bias=None, *, alpha=1.0, beta=1.0, activation=None, act_grad=None,
                   preact=False):  # fmt: skip
    """The spec's epilogue on float32 register values; call inside a trace.

    `act(alpha * acc + beta * c + bias)`, or with `act_grad` (a backward epilogue)
    `act_grad'(c) * (alpha * acc)`. Plain Python over TensorSSA values, so both kernel families
    inline it into their `@cute.kernel`s. Terms that are absent (None) or neutral (alpha == 1)
    emit no instructions.

    Args:
      acc: TensorSSA of Float32, the accumulator fragment.
      c: None or a TensorSSA of the same shape (any float type; converted to Float32).
      bias: None or a TensorSSA of the same shape, already broadcast along m.
      alpha, beta: Python floats (compile-time constants of the KernelSpec).
      activation: None, "relu", "gelu" (tanh approximation) or "silu".
      act_grad: None or an activation whose derivative at c multiplies the product.
      preact: also return the pre-activation (`KernelSpec.preact_out`).

    Returns:
      A Float32 TensorSSA of acc's shape; with `preact`, (that, the pre-activation).
    """
    x = acc
    if alpha != 1.0:
        x = x * cutlass.Float32(alpha)
    if act_grad == "relu":
        # A select, as jax.nn.relu's derivative (primitive.times_activation_grad): 0 where
        # relu is flat whatever the product, not 0 * x (NaN for a non-finite x).
        return cute.where(c.to(cutlass.Float32) > cutlass.Float32(0.0), x, cute.full_like(x, 0.0))
    if act_grad is not None:
        return x * activation_derivative(c.to(cutlass.Float32), act_grad)
    if c is not None and beta != 0.0:
        cf = c.to(cutlass.Float32)
        x = x + (cf if beta == 1.0 else cf * cutlass.Float32(beta))
    if bias is not None:
        x = x + bias.to(cutlass.Float32)
    if preact:
        return _activate(x, activation), x
    return _activate(x, activation)


def _activate(x, activation):
    f32 = cutlass.Float32
    if activation == "relu":
        # One max.NaN an element: a NaN stays NaN, as jnp.maximum(x, 0) keeps it (a select on
        # x > 0 writes 0 for NaN).
        x = _elementwise(x, lambda v: cute.arch.fmax(v, f32(0.0), nan=True))
    elif activation == "gelu":
        # 0.5 x (1 + tanh(k0 (x + k1 x^3))), as x (0.5 + 0.5 t). Scalar constants: a
        # `full_like` constant is a register vector the size of the fragment.
        t = cute.math.tanh(x * (f32(GELU_K0) + f32(GELU_K0 * GELU_K1) * (x * x)), fastmath=True)
        x = x * (f32(0.5) + f32(0.5) * t)
    elif activation == "silu":
        # x / (1 + exp(-x)); not 0.5 x (1 + tanh(x / 2)), whose 1 + t cancels for x << 0.
        x = x / (f32(1.0) + cute.math.exp(-x, fastmath=True))
    elif activation is not None:
        raise ValueError(f"{activation=} is not one of None, 'relu', 'gelu', 'silu'")
    return x


def _elementwise(x, fn):
    """`fn` (of one Float32) applied to each element of the Float32 TensorSSA x."""
    r = cute.make_rmem_tensor(x.shape, cutlass.Float32)
    r.store(x)
    for i in range(cute.size(r)):  # plain Python: unrolled at trace time
        r[i] = fn(r[i])
    return r.load()


def _clamp(x, bound):
    """x clamped to [-bound, bound] by two min/max instructions per element (a TensorSSA
    clamp lowers to NaN-aware compares and selects), NaN kept as jnp.clip keeps it (the plain
    instructions return the bound: a NaN pre-activation gave gelu's and silu's derivative 0)."""
    nan = dict(nan=True)
    return _elementwise(x, lambda v: cute.arch.fmin(cute.arch.fmax(v, -bound, **nan), bound, **nan))


def activation_derivative(z, activation):
    """d activation / dz at the float32 values z for gelu and silu (primitive.activation_grad's
    formulas, z clamped to +-ACT_GRAD_CLAMP as there, so an overflowed saved pre-activation
    gives 0 or 1; relu's derivative is `apply_epilogue`'s select).
    Written as fused multiply-adds around one tanh: this runs on every element of a backward
    product's output, beside the other warp group's main loop."""
    f32, one = cutlass.Float32, cutlass.Float32(1.0)
    z = _clamp(z, ACT_GRAD_CLAMP)
    if activation == "gelu":
        # t = tanh(k0 (z + k1 z^3)); 0.5 (1 + t) + (1 - t^2) z (0.5 k0 + 1.5 k0 k1 z^2): each
        # step one (fused) multiply-add.
        z2 = z * z
        t = cute.math.tanh(z * (f32(GELU_K0) + f32(GELU_K0 * GELU_K1) * z2), fastmath=True)
        slope = z * (f32(0.5 * GELU_K0) + f32(1.5 * GELU_K0 * GELU_K1) * z2)
        return (f32(0.5) + f32(0.5) * t) + (one - t * t) * slope
    if activation == "silu":
        s = one / (one + cute.math.exp(-z, fastmath=True))
        return s * (one + z * (one - s))
    raise ValueError(f"{activation=} has no derivative here; one of 'gelu', 'silu'")


def epilogue_is_identity(spec: KernelSpec) -> bool:
    """True when the epilogue is a plain conversion of the accumulator (no extra loads/math)."""
    return (
        spec.alpha == 1.0 and not spec.has_c and not spec.has_bias and spec.activation is None
        and spec.act_grad is None
    )  # fmt: skip
