"""Flax layers whose bias and activation run inside the GEMM's epilogue.

Any Flax layer takes `jax_sm100.dot_general` as its `dot_general=` (or `jax_sm100.einsum` as
`nnx.Einsum`'s `einsum_op=`); Flax then adds the bias, and the model applies its activation,
as separate XLA ops. The layers here are the same layers with both fused into the kernel's
epilogue, and, under `jax.grad`, the activation's derivative fused into the backward products
(see the README's Training section):

    from jax_sm100 import flax as sm100_flax

    self.up = sm100_flax.Linear(d, 4 * d, activation="gelu", rngs=rngs)   # nnx
    h = self.up(x)                                         # was nnx.gelu(nnx.Linear(...)(x))

    y = sm100_flax.Dense(features=4 * d, activation="gelu")(x)            # linen

Each is a subclass of the Flax layer with the same parameters, names, shapes and initializers,
so checkpoints and optimizer state carry over both ways. `activation` is None, "relu", "gelu"
(tanh form, `jax.nn.gelu`'s default) or "silu". Differences from the unfused layer: the bias and
activation are applied to the float32 accumulator and rounded once (Flax adds the bias in the
product's dtype; with a `preferred_element_type` narrower than the bias, the result has the
bias's dtype, as Flax's `y + bias` gives, without the product's rounding to the narrower one).
Where the layer's `precision` (or `jax.default_matmul_precision`) asks for more than the kernels
give (HIGHEST with float32: they multiply float32 as tf32; HIGH or HIGHEST with two operands
of one fp8 format: they accumulate as cuBLAS's fast mode), or its dtypes are ones the kernels do
not take (complex), the layer computes as the Flax layer on `jax_sm100.dot_general` does: lax's
dot, then bias and activation in XLA. With fp8 `dtype` the result is fp8, as Flax's.

This module imports Flax, which jax_sm100 itself does not depend on (`pip install flax`).
"""

from __future__ import annotations

try:
    from flax import linen, nnx
except ImportError as e:  # pragma: no cover  (flax is in the test extra)
    raise ImportError(
        "jax_sm100.flax needs Flax (pip install flax); jax_sm100.dot_general works without it"
    ) from e

import jax
import jax.numpy as jnp
from jax import lax

from jax_sm100._src.api import matmul
from jax_sm100._src.dot_general import dot_general, fallback_reason
from jax_sm100._src.kernels.spec import ACTIVATIONS
from jax_sm100._src.primitive import apply_activation

__all__ = ["Dense", "Linear"]


def _check_activation(activation) -> None:
    if activation not in ACTIVATIONS:
        raise ValueError(
            f"jax_sm100.flax: unknown {activation=}; use one of {ACTIVATIONS} (fused into the "
            "GEMM's epilogue; 'gelu' is the tanh form)"
        )


def _result_dtype(inputs, kernel, bias, preferred_element_type):
    """The Flax layer's result dtype: its product's, `preferred_element_type` or else what
    lax.dot_general gives the promoted operands (their dtype: fp8 for fp8 operands, where
    `jax_sm100.matmul` would default to bfloat16; lax's own rule for the mixed dtypes a
    non-promoting `promote_dtype` leaves, which jnp.result_type refuses for fp8), then promoted
    with the bias as Flax's `y + bias` promotes it (a float32 bias widens a bfloat16
    `preferred_element_type`, on the fused path as on the fallback). Worked out on one-element
    avals without shardings: a row-parallel call's operands would ask lax for an out_sharding
    (review helper-160: the layer refused a call nnx.Linear takes)."""

    def aval(x, shape):
        return jax.ShapeDtypeStruct(shape, x.dtype, weak_type=jax.typeof(x).weak_type)

    def flax_math(a, b, c):
        if preferred_element_type is not None:
            y = jnp.zeros((1, 1), preferred_element_type)
        else:
            y = lax.dot_general(a, b, (((1,), (0,)), ((), ())))
        return y if c is None else y + c

    c = None if bias is None else aval(bias, (1, 1))  # as Flax reshapes it to y's rank
    return jax.eval_shape(flax_math, aval(inputs, (1, 1)), aval(kernel, (1, 1)), c).dtype


class Linear(nnx.Linear):
    """`flax.nnx.Linear` computing `activation(inputs @ kernel + bias)` in one fused GEMM.

    Args:
      in_features: as `nnx.Linear`.
      out_features: as `nnx.Linear`.
      activation: None, "relu", "gelu" (tanh form) or "silu", applied in the epilogue.
      **kwargs: every other `nnx.Linear` argument (`use_bias`, `dtype`, `param_dtype`,
        `precision`, initializers, `preferred_element_type`, `rngs`, ...) but `dot_general`:
        the product is `jax_sm100.matmul`'s.
    """

    def __init__(self, in_features: int, out_features: int, *, activation=None, **kwargs):
        _check_activation(activation)
        if "dot_general" in kwargs:
            raise TypeError(
                "jax_sm100.flax.Linear takes no dot_general: its product, bias and activation "
                "are one jax_sm100.matmul; use flax.nnx.Linear for another dot_general"
            )
        super().__init__(in_features, out_features, dot_general=dot_general, **kwargs)
        self.activation = activation

    def __call__(self, inputs, out_sharding=None):
        """`activation(inputs @ kernel + bias)` for inputs [..., in_features]."""
        kernel = self.kernel[...]
        bias = self.bias[...] if self.bias is not None else None
        inputs, kernel, bias = self.promote_dtype((inputs, kernel, bias), dtype=self.dtype)
        out_dtype = _result_dtype(inputs, kernel, bias, self.preferred_element_type)
        if fallback_reason(inputs.dtype, kernel.dtype, out_dtype, self.precision):
            # A precision the kernels do not meet (`precision` or jax.default_matmul_precision)
            # or dtypes they do not take (complex): nnx.Linear on jax_sm100.dot_general, which
            # runs lax.dot_general and says why.
            return apply_activation(super().__call__(inputs, out_sharding), self.activation)
        return matmul(
            inputs, kernel, bias=bias, activation=self.activation, precision=self.precision,
            preferred_element_type=out_dtype, out_sharding=out_sharding,
        )  # fmt: skip


class Dense(linen.Dense):
    """`flax.linen.Dense` computing `activation(inputs @ kernel + bias)` in one fused GEMM.

    Attributes:
      activation: None, "relu", "gelu" (tanh form) or "silu", applied in the epilogue.
      (every other attribute as `linen.Dense`; `dot_general` and `dot_general_cls` must stay
      None: the product is `jax_sm100.matmul`'s.)
    """

    activation: str | None = None

    def __post_init__(self):
        # Refused where the module is made, as nnx's Linear refuses them, not at init.
        _check_activation(self.activation)
        if self.dot_general is not None or self.dot_general_cls is not None:
            raise TypeError(
                "jax_sm100.flax.Dense takes no dot_general: its product, bias and activation "
                "are one jax_sm100.matmul; use flax.linen.Dense for another dot_general"
            )
        super().__post_init__()

    @linen.compact
    def __call__(self, inputs):
        """`activation(inputs @ kernel + bias)` for inputs [..., k]."""
        kernel = self.param(
            "kernel", self.kernel_init, (jnp.shape(inputs)[-1], self.features), self.param_dtype
        )
        bias = None
        if self.use_bias:
            bias = self.param("bias", self.bias_init, (self.features,), self.param_dtype)
        inputs, kernel, bias = self.promote_dtype(inputs, kernel, bias, dtype=self.dtype)
        out_dtype = _result_dtype(inputs, kernel, bias, None)
        if fallback_reason(inputs.dtype, kernel.dtype, out_dtype, self.precision):
            # As in Linear: linen.Dense's math on jax_sm100.dot_general (lax.dot_general here).
            dims = (((inputs.ndim - 1,), (0,)), ((), ()))
            y = dot_general(inputs, kernel, dims, precision=self.precision)
            if bias is not None:  # as linen.Dense adds it (of y's rank: rank promotion may raise)
                y = y + jnp.reshape(bias, (1,) * (y.ndim - 1) + (-1,))
            return apply_activation(y, self.activation)
        return matmul(inputs, kernel, bias=bias, activation=self.activation,
                      precision=self.precision, out_dtype=out_dtype)  # fmt: skip
