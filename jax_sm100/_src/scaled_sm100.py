"""`scaled_matmul` on sm_100a: one `jax_sm100_gemm` call of the block-scaled tcgen05 kernel.

scaled_gpu.py's CUDA lowering calls `call` for plans of `planning.KERNEL_SM100_BLOCKSCALED`
(mxfp8 and nvfp4 problems, planning/sm100_blockscaled.py). lhs [B, m, k] and rhs [B, n, k] go
to the kernel as they are (K-major: a (m, k, B), b (n, k, B); float4_e2m1fn data packed two to
a byte, as XLA stores it on GPUs), and its output is d (m, n, B) = out [B, m, n].

The scales go as they are when they are in the blocked layout (scale_layout.py), which is what
`jax_sm100.quantize` makes: the kernel's TMA reads that layout directly (the module docstring of
kernels/sm100_blockscaled.py). Plain scales [B, rows, k / block] are put in that layout first by
XLA ops (a transpose of the scales: 1 / block of the data's elements, one byte each).
"""

from __future__ import annotations

import math

from jax_sm100._src import scale_layout


def call(plan, lhs, rhs, lhs_scales, rhs_scales):
    """The product of the block-scaled kernel compiled for `plan` (the module docstring)."""
    from jax_sm100._src import scaled_gpu  # noqa: PLC0415
    from jax_sm100._src.compile import compile_plan  # noqa: PLC0415

    sfa, sfb = (blocked_flat(x, s) for x, s in ((lhs, lhs_scales), (rhs, rhs_scales)))
    scale_modes = {"sfa": ((sfa.shape[0],), (1,)), "sfb": ((sfb.shape[0],), (1,))}
    return scaled_gpu.launch(plan, compile_plan(plan), lhs, rhs, sfa, sfb, scale_modes)


def blocked_flat(data, scales):
    """`scales` of `data` in the blocked layout, as the 1-D buffer the kernel reads (plain ones
    of 128-row tiles repeated per row first)."""
    if not scale_layout.is_blocked(data.ndim, scales.ndim):
        scales = scale_layout.to_blocked(scale_layout.plain(data.shape, scales))
    return scales.reshape(math.prod(scales.shape))
