"""`jax.checkpoint` policies that treat this library's products as dots.

JAX's own dot policies (`jax.checkpoint_policies.checkpoint_dots`, `dots_saveable`,
`dots_with_no_batch_dims_saveable`, `checkpoint_dots_with_no_batch_dims`) recognise JAX's
products alone (`lax.dot_general`, convolutions, cuDNN's scaled matmul), so under them every
product of `jax_sm100` (matmul, dot_general, einsum and the Flax layers that use them,
ragged_dot, scaled_matmul) is recomputed in the backward pass. These are the same policies,
each asked first, with those products counted too:

>>> f = jax.checkpoint(block, policy=jax_sm100.checkpoint_policies.dots_saveable)

or `nnx.remat(..., policy=...)` / `linen.remat(..., policy=...)`.

A policy saves all of a product's results. A `matmul` with a fused activation under `grad`
has two: the activation's output and its input (the pre-activation, which the backward of the
activation reads). Both are saved, where `jnp.dot(x, w) + b` followed by `jax.nn.gelu` saves
the dot's output alone and recomputes the rest in the backward pass: more memory, less
recomputation. To save the dot's output alone, call `matmul` without the activation and apply
it after.

`scaled_dot_general` under a gradient names what it keeps of each operand for the backward
(`jax.ad_checkpoint.checkpoint_name`): `SCALED_DOT_LHS` and `SCALED_DOT_RHS`, whether that is
the operand's other orientation quantized (fp8 data and scales) or the operand itself. JAX's
name policies then choose per operand: save the activations' fp8 residuals and recompute the
weights' quantization in the backward (the memory a weight passed as an argument otherwise
holds from the forward to the backward), or offload them to the host:

>>> from jax_sm100.checkpoint_policies import SCALED_DOT_LHS
>>> P = jax.checkpoint_policies
>>> policy = P.save_only_these_names(SCALED_DOT_LHS)
>>> policy = P.save_and_offload_only_these_names(
...     names_which_can_be_saved=[], names_which_can_be_offloaded=[SCALED_DOT_LHS],
...     offload_src="device", offload_dst="pinned_host")
"""

from __future__ import annotations

import jax

from jax_sm100._src import primitive as P
from jax_sm100._src import ragged, scaled
from jax_sm100._src.scaled_dot import LHS_RESIDUAL as SCALED_DOT_LHS
from jax_sm100._src.scaled_dot import RHS_RESIDUAL as SCALED_DOT_RHS

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


checkpoint_dots_with_no_batch_dims = dots_with_no_batch_dims_saveable


__all__ = [
    "SCALED_DOT_LHS",
    "SCALED_DOT_RHS",
    "checkpoint_dots",
    "checkpoint_dots_with_no_batch_dims",
    "dots_saveable",
    "dots_with_no_batch_dims_saveable",
]
