"""What a kernel is specialised on, beyond its plan: operand layouts and the fused epilogue.

A `GemmPlan` (planning/) fixes the tiling and pipelining of a problem size; a `KernelSpec` fixes
everything else that changes the compiled binary. Together they are the compile key.

Tensor-mode contract shared by every kernel family (CUTLASS's convention), for JAX row-major
buffers whose batch dims have been flattened into one leading dim `l`:

    a    (M, K, L)  K-major when the buffer is [l, m, k]; M-major when it is [l, k, m]
    b    (N, K, L)  N-major when the buffer is [l, k, n]; K-major when it is [l, n, k]
    d    (M, N, L)  N-major, buffer [l, m, n]; M-major, buffer [l, n, m], with `d_major="m"`
    c    (M, N, L)  N-major, buffer [l, m, n]                      (only when `c_dtype` is set)
    bias (N,), or (M,) with `d_major="m"`                          (only when `bias_dtype` is set)
    z    (M, N, L)  d's layout                                      (only when `preact_out`)

`d_major="m"` is how a product swapped by its plan (`GemmPlan.swap_ab`: D^T = B A^T, so that
the tiles pad the caller's n less) writes the caller's row-major [l, m, n]: the kernel's M is
the caller's n and its N the caller's m. SM90 dense plans only, without C.

An operand whose `*_batched` flag is False has batch stride 0: one matrix shared by every batch.
A grouped kernel (kernels/grouped.py) in ragged-rows mode with `b_groups` set holds that many
matrices in B, fewer than its plan's groups: group j reads B[j mod b_groups] (ragged_dot under
`vmap` with experts shared by every batch, `ragged_gpu.fold_rows`: no copy of them per batch).
In ragged-contraction mode `k_segments` S > 1 sums runs of groups into one D: the plan's G
groups are S runs of G / S, and D[j] is the product over the rows of groups j, j + G / S, ...
(the weight gradient of those shared experts, summed over the batches in the accumulators).

The host entry point of every kernel takes `(a, b, d, c, bias, z, ..., stream)` with `None` for
an absent `c`, `bias` or `z` (the SM90 family also takes its stream-K workspace before the stream).

The epilogue computes, in float32, `d = act(alpha * acc + beta * c + bias)` and converts to
`out_dtype`. With `preact_out` it also writes `z = alpha * acc + beta * c + bias` (before the
activation) to a second output of `out_dtype`, with d's layout. With `act_grad` set (a backward
epilogue) it computes instead `d = act_grad'(c) * (alpha * acc)`: the product times the named
activation's derivative at c.
"""

from __future__ import annotations

import dataclasses

ACTIVATIONS = (None, "relu", "gelu", "silu")
# The tanh form of GELU (jax.nn.gelu(approximate=True)): sqrt(2 / pi) and the cubic coefficient.
GELU_K0 = 0.7978845608028654
GELU_K1 = 0.044715
# Pre-activations beyond +-this give the derivatives their limits (primitive.ACT_GRAD_CLAMP).
ACT_GRAD_CLAMP = 1e4
A_MAJORS = ("k", "m")
B_MAJORS = ("n", "k")
D_MAJORS = ("n", "m")


@dataclasses.dataclass(frozen=True)
class KernelSpec:
    """Layouts, dtypes and epilogue a kernel is compiled for (hashable; part of the cache key)."""

    a_dtype: str
    b_dtype: str
    out_dtype: str
    a_major: str = "k"
    b_major: str = "n"
    c_dtype: str | None = None
    bias_dtype: str | None = None
    activation: str | None = None
    alpha: float = 1.0
    beta: float = 1.0
    a_batched: bool = True
    b_batched: bool = True
    c_batched: bool = True
    preact_out: bool = False
    act_grad: str | None = None
    d_major: str = "n"
    b_groups: int = 0
    k_segments: int = 1

    def __post_init__(self):
        if not isinstance(self.b_groups, int) or self.b_groups < 0:
            raise ValueError(f"{self.b_groups=} must be an int >= 0 (0: one B per group)")
        if not isinstance(self.k_segments, int) or self.k_segments < 1:
            raise ValueError(f"{self.k_segments=} must be an int >= 1 (1: one D per group)")
        if self.a_major not in A_MAJORS:
            raise ValueError(f"{self.a_major=} must be one of {A_MAJORS}")
        if self.b_major not in B_MAJORS:
            raise ValueError(f"{self.b_major=} must be one of {B_MAJORS}")
        if self.d_major not in D_MAJORS:
            raise ValueError(f"{self.d_major=} must be one of {D_MAJORS}")
        if self.d_major == "m" and self.c_dtype is not None:
            raise ValueError(
                "d_major='m' (a swapped product) takes no C; its C would be read transposed"
            )
        if self.activation not in ACTIVATIONS:
            raise ValueError(f"{self.activation=} must be one of {ACTIVATIONS}")
        if self.act_grad is not None and (
            self.act_grad not in ACTIVATIONS or self.c_dtype is None or self.bias_dtype
            or self.activation or self.preact_out
        ):  # fmt: skip
            raise ValueError(
                f"{self.act_grad=} needs c (the pre-activation) and no bias, activation or "
                "preact_out"
            )
        if self.preact_out and self.activation is None:
            raise ValueError("preact_out=True needs an activation (else z is d)")
        object.__setattr__(self, "alpha", float(self.alpha))
        object.__setattr__(self, "beta", float(self.beta))

    @classmethod
    def for_plan(cls, plan) -> KernelSpec:
        """The spec of a plain product of the plan's dtypes and layouts (no epilogue extras);
        for a swapped plan (`swap_ab`) the product the kernel runs (`swapped`)."""
        spec = cls(
            a_dtype=plan.a_dtype,
            b_dtype=plan.b_dtype,
            out_dtype=plan.out_dtype,
            a_major=plan.a_major,
            b_major=plan.b_major,
            c_dtype=plan.c_dtype,
        )
        return spec.swapped() if getattr(plan, "swap_ab", False) else spec

    def swapped(self) -> KernelSpec:
        """The product a swapped plan's kernel runs for this one (D^T = B A^T): B as its A and
        A as its B (both K-major, as `GemmPlan.swap_ab` requires), D stored M-major."""
        return dataclasses.replace(
            self, a_dtype=self.b_dtype, b_dtype=self.a_dtype, a_batched=self.b_batched,
            b_batched=self.a_batched, d_major="m",
        )  # fmt: skip

    @property
    def has_c(self) -> bool:
        return self.c_dtype is not None

    @property
    def has_bias(self) -> bool:
        return self.bias_dtype is not None
