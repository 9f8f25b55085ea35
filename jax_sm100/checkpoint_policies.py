"""`jax.checkpoint` policies that treat this library's products as dots.

JAX's own dot policies (`jax.checkpoint_policies.checkpoint_dots`, `dots_saveable`,
`dots_with_no_batch_dims_saveable`) recognise JAX's products alone (`lax.dot_general`,
convolutions, cuDNN's scaled matmul), so under them every product of `jax_sm100` (matmul,
dot_general, einsum and the Flax layers that use them, ragged_dot, scaled_matmul) is recomputed
in the backward pass. These are the same policies, each asked first, with those products
counted too:

>>> f = jax.checkpoint(block, policy=jax_sm100.checkpoint_policies.dots_saveable)

or `nnx.remat(..., policy=...)` / `linen.remat(..., policy=...)`.

A policy saves all of a product's results. A `matmul` with a fused activation under `grad`
has two: the activation's output and its input (the pre-activation, which the backward of the
activation reads). Both are saved, where `jnp.dot(x, w) + b` followed by `jax.nn.gelu` saves
the dot's output alone and recomputes the rest in the backward pass: more memory, less
recomputation. To save the dot's output alone, call `matmul` without the activation and apply
it after.
"""

from __future__ import annotations

import jax

from jax_sm100._src import primitive as P
from jax_sm100._src import ragged, scaled

# The forward products a policy sees (the backward's own binds run outside the saved region).
_PRODUCTS = (P.matmul_p, ragged.ragged_dot_p, scaled.scaled_matmul_p)


def dots_saveable(prim, *avals, **params) -> bool:
    """Saves the output of every dot: what `jax.checkpoint_policies.dots_saveable` saves
    (`lax.dot_general`, convolutions) and this library's products."""
    return prim in _PRODUCTS or jax.checkpoint_policies.dots_saveable(prim, *avals, **params)


checkpoint_dots = dots_saveable


def dots_with_no_batch_dims_saveable(prim, *avals, **params) -> bool:
    """Saves the output of dots without batch dims: what
    `jax.checkpoint_policies.dots_with_no_batch_dims_saveable` saves (`lax.dot_general` with no
    batch dimension numbers, cuDNN's scaled matmul of one batch; no convolution), and this
    library's matmul where one operand is a matrix shared by every batch (activations
    [..., m, k] against weights [k, n], as a dense layer's), ragged_dot with its experts shared,
    and scaled_matmul of one product or against one rhs shared by every batch (B = 1, as the
    weights a `vmap` leaves unmapped)."""
    if jax.checkpoint_policies.dots_with_no_batch_dims_saveable(prim, *avals, **params):
        return True
    if prim is P.matmul_p:  # a shared operand comes with unit batch dims
        return any(all(d == 1 for d in aval.shape[:-2]) for aval in avals[:2])
    if prim is ragged.ragged_dot_p:
        return len(avals[1].shape) == 3  # experts [g, k, n] (or [g, n, k]) shared
    if prim is scaled.scaled_matmul_p:  # lhs [B, m, k], rhs [B, n, k] (or [1, n, k], shared)
        return avals[0].shape[0] == 1 or avals[1].shape[0] == 1
    return False


__all__ = ["checkpoint_dots", "dots_saveable", "dots_with_no_batch_dims_saveable"]
