"""Editing plans: the planner's alternatives and the edits that keep a plan consistent.

A `GemmPlan` from `jax_sm100.plan` may be edited with `dataclasses.replace` (every edit is
re-checked: an illegal one raises `PlanError` naming the rule it breaks) and passed to
`jax_sm100.matmul(..., plan=...)`. `dataclasses.replace` keeps the A/B pipeline depth, which is
rarely right for another tile or epilogue; these functions refill it:

>>> p = jax_sm100.plan(8192, 8192, 8192, a_dtype="bfloat16", b_dtype="bfloat16", arch="sm_90a")
>>> q = jax_sm100.tuning.sm90_variant(p, tile_mn=(128, 128), cluster_mn=(1, 2))
>>> r = jax_sm100.tuning.cooperative(p)      # the planner's plan without ping-pong

`with_scaled_overlap` edits a plan of the sm_90a block-scaled kernel (`jax_sm100.plan(...,
scale_dtype="float32", scale_block=128, arch="sm_90a")`) to overlap each k-tile's promotion with
the next k-tile's MMAs; `scaled_matmul` takes no plan, so its calls ask for that with
`JAX_SM100_SCALED_OVERLAP=1` in the environment (read when a call is lowered).
"""

from jax_sm100._src.planning import (
    cooperative,
    replace_fitting,
    sm90_variant,
    with_preact,
    with_scaled_overlap,
    with_split,
)

__all__ = [
    "cooperative",
    "replace_fitting",
    "sm90_variant",
    "with_preact",
    "with_scaled_overlap",
    "with_split",
]
