"""The epilogue of the SM100 GEMM (sm100_gemm.py): accumulators out of TMEM and into D.

Runs on the four epilogue warps of `Sm100GemmKernel`, one output tile after another in the
kernel's persistent schedule, one epilogue subtile (the plan's `epi_tile`) at a time:

    TMEM -> registers       tcgen05.ld of the subtile's fp32 accumulators
    fused math              `common.apply_epilogue`: alpha, beta * C, bias, activation (or a
                            backward epilogue's act'(C) * acc); C comes from the SMEM ring that
                            the C producer warp fills by TMA, bias from global memory
                            (predicated on a ragged last N tile)
    registers -> SMEM       into one of `num_epi_stages` D buffers (and Z buffers, for the
                            pre-activation with `spec.preact_out`), then a proxy fence
    SMEM -> global          TMA store of D (and Z), issued by the first epilogue warp

Once the last subtile of a tile is in registers the TMEM stage goes back to the MMA warp, so its
next tile's MMAs overlap this tile's math and stores.

`epilogue` walks the dense kernel's static persistent schedule; a kernel with its own schedule
(sm100_grouped.py) calls its two halves: `setup` once, then `store_tile` per tile, with the
tile's D partition and whether the tile has an accumulator at all (one with no k-blocks stores
the epilogue of zeros).

The epilogue warps and their named barrier are defined here; sm100_gemm.py builds its warp-role
table around them. This module is device code only: it emits nothing unless traced from the
kernel, and it reads every number from the kernel object it is handed.

Like the kernel, verified only by compiling for sm_100a on a CPU machine
(tests/test_sm100_ptx.py); no SM100 GPU has run this code.
"""

from __future__ import annotations

import collections
from typing import TYPE_CHECKING

import cutlass
import cutlass.cute as cute
import cutlass.pipeline as pipeline
import cutlass.utils as utils
from cutlass.cute.nvgpu import cpasync, tcgen05

from jax_sm100._src.kernels import common

if TYPE_CHECKING:
    from jax_sm100._src.kernels.sm100_gemm import Sm100GemmKernel

WARP = 32
EPI_WARPS = (0, 1, 2, 3)
# Named barrier the epilogue warps meet at around each TMA store (common.py's table).
EPI_BARRIER = common.SM100_EPI_BARRIER


def group_mma_modes(t: cute.Tensor) -> cute.Tensor:
    """((atom_m, atom_n), rest_m, rest_n, *more) -> ((atom_m, rest_m), (atom_n, rest_n), *more).

    `partition_C` keeps the MMA atom's values in mode 0; the epilogue wants plain M and N modes
    so that it can divide them by the epilogue subtile.
    """
    lay = t.layout
    outer = lay.outer if isinstance(lay, cute.ComposedLayout) else lay
    (am, an), rm, rn, *more = outer.shape
    (sam, san), srm, srn, *more_s = outer.stride
    regrouped = cute.make_layout(
        ((am, rm), (an, rn), *more), stride=((sam, srm), (san, srn), *more_s)
    )
    if isinstance(lay, cute.ComposedLayout):
        regrouped = cute.make_composed_layout(lay.inner, lay.offset, regrouped)
    return cute.make_tensor(t.iterator, regrouped)


# What `setup` derives for one CTA's epilogue warps, and `store_tile` uses on every tile: the
# TMEM load and register/SMEM copies, D's (and Z's) TMA partition, the C ring's read side, the
# bias's partition, the store barrier and the TMA-store ring. (None for what the spec lacks.)
Epilogue = collections.namedtuple(
    "Epilogue", "t2r tTR_tAcc tTR_rAcc r2s tRS_rD d_out z_out c_in bias_in store_barrier d_pipe"
)


@cute.jit
def epilogue(
    kernel: Sm100GemmKernel,
    tidx,
    warp,
    acc: cute.Tensor,
    acc_pipe,
    sD: cute.Tensor,
    tma_atom_d: cute.CopyAtom,
    tDgD: cute.Tensor,
    sC,
    c_pipe,
    mBias,
    d_in: cute.Tensor,
    thr_mma,
    sched,
    work,
    pair,
    epi_tile,
    zout=None,
):
    """TMEM -> registers -> fused math -> SMEM -> TMA store, one epilogue subtile at a time,
    for every tile of the CTA's static persistent schedule (`setup`, then `store_tile` per tile).

    `kernel` is the `Sm100GemmKernel` being traced (dtypes, tiles, stage counts, the spec's
    epilogue); the other arguments are what its `device_kernel` built for this CTA. `zout` is
    (sZ, tma_atom_z, tZgZ) when the spec also writes the pre-activation, else None.
    """
    epi = setup(kernel, tidx, acc, sD, tma_atom_d, tDgD, mBias, d_in, thr_mma, epi_tile, sC, zout)
    c_state = None
    if cutlass.const_expr(kernel.spec.has_c):
        c_state = pipeline.make_pipeline_state(
            pipeline.PipelineUserType.Consumer, kernel.num_epi_stages
        )
    acc_state = pipeline.make_pipeline_state(
        pipeline.PipelineUserType.Consumer, kernel.num_acc_stages
    )
    d_stage = cutlass.Int32(0)

    while work.is_valid_tile:
        tile = work.tile_idx
        mma_tile = (tile[0] // pair, tile[1], tile[2])
        d_stage, acc_state, c_state = store_tile(
            kernel, epi, warp, mma_tile, acc_pipe, acc_state, c_pipe, c_state, d_stage
        )
        sched.advance_to_next_work()
        work = sched.get_current_work()

    epi.d_pipe.producer_tail()


@cute.jit
def setup(
    kernel: Sm100GemmKernel,
    tidx,
    acc: cute.Tensor,
    sD: cute.Tensor,
    tma_atom_d: cute.CopyAtom,
    tDgD: cute.Tensor,
    mBias,
    d_in,
    thr_mma,
    epi_tile,
    sC=None,
    zout=None,
) -> Epilogue:
    """The epilogue's copies and partitions for thread `tidx` of the epilogue warps: `acc` is
    the TMEM accumulators ((M, N) modes, then the stages), `tDgD` this CTA's share of D by
    MMA tile (`group_mma_modes` of its `partition_C`, tiles after the M and N modes); only
    its shapes are read when the caller partitions D tile by tile (`store_tile`'s `d_tiles`)."""
    t2r_atom = utils.sm100.get_tmem_load_op(
        kernel.cta_tile,
        kernel.d_layout,
        kernel.d_dtype,
        kernel.acc_dtype,
        epi_tile,
        kernel.use_2cta,
    )
    # (EPI_M, EPI_N, n_epi_m, n_epi_n, ACC_STAGE)
    acc_epi = cute.flat_divide(acc, epi_tile)
    t2r = tcgen05.make_tmem_copy(t2r_atom, acc_epi[(None, None, 0, 0, 0)])
    thr_t2r = t2r.get_slice(tidx)
    tTR_tAcc = thr_t2r.partition_S(acc_epi)
    gD_epi = cute.flat_divide(tDgD, epi_tile)
    tTR_gD = thr_t2r.partition_D(gD_epi)
    # One subtile's registers: (T2R values, T2R_M, T2R_N) of the first subtile of the first tile.
    first = (None, None, None) + (0,) * (cute.rank(tTR_gD) - 3)
    tTR_rAcc = cute.make_rmem_tensor(tTR_gD[first].shape, kernel.acc_dtype)

    r2s = cute.make_tiled_copy_D(
        utils.sm100.get_smem_store_op(kernel.d_layout, kernel.d_dtype, kernel.acc_dtype, t2r), t2r
    )
    thr_r2s = r2s.get_slice(tidx)
    tRS_sD = thr_r2s.partition_D(sD)
    tRS_rD = cute.make_rmem_tensor(r2s.retile(tTR_rAcc).shape, kernel.d_dtype)

    bSG_sD, bSG_gD = cpasync.tma_partition(
        tma_atom_d,
        0,
        cute.make_layout(1),
        cute.group_modes(sD, 0, 2),
        cute.group_modes(gD_epi, 0, 2),
    )

    d_out = (tma_atom_d, tRS_sD, bSG_sD, bSG_gD)
    z_out = None
    if cutlass.const_expr(kernel.spec.preact_out):
        sZ, tma_atom_z, tZgZ = zout
        bSG_sZ, bSG_gZ = cpasync.tma_partition(
            tma_atom_z,
            0,
            cute.make_layout(1),
            cute.group_modes(sZ, 0, 2),
            cute.group_modes(cute.flat_divide(tZgZ, epi_tile), 0, 2),
        )
        z_out = (tma_atom_z, thr_r2s.partition_D(sZ), bSG_sZ, bSG_gZ)

    c_in = None
    if cutlass.const_expr(kernel.spec.has_c):
        # C is read into registers in the order the TMEM load left the accumulator in, so
        # the same r2s retile lines C up with acc element for element.
        s2r = cute.make_tiled_copy_D(
            cute.make_copy_atom(cute.nvgpu.CopyUniversalOp(), kernel.c_dtype), t2r
        )
        tSR_sC = s2r.get_slice(tidx).partition_D(sC)
        tTR_rC = cute.make_rmem_tensor(tTR_rAcc.shape, kernel.c_dtype)
        c_in = (s2r, tSR_sC, tTR_rC, s2r.retile(tTR_rC))

    bias_in = None
    if cutlass.const_expr(kernel.spec.has_bias):
        # Bias goes through the same partition as D, so its registers line up with the
        # accumulator's; D's coordinates say which columns exist in a ragged last N tile.
        tile_mn = cute.slice_(kernel.mma_tiler, (None, None, 0))
        tBgBias, tBcD = (
            thr_t2r.partition_D(
                cute.flat_divide(
                    group_mma_modes(
                        thr_mma.partition_C(cute.local_tile(t, tile_mn, (None, None, None)))
                    ),
                    epi_tile,
                )
            )
            for t in (mBias, cute.make_identity_tensor(d_in.shape))
        )
        # Read in the loops through a local: the DSL carries any object whose attribute is
        # called inside a `while` (`self` excepted) as loop state, and a kernel cannot be one.
        bias_dtype = kernel.bias_dtype
        tRrBias = cute.make_rmem_tensor(tTR_rAcc.shape, bias_dtype)
        bias_in = (bias_dtype, tBgBias, tBcD, tRrBias, d_in.shape[1])

    store_barrier = pipeline.NamedBarrier(barrier_id=EPI_BARRIER, num_threads=WARP * len(EPI_WARPS))
    d_pipe = pipeline.PipelineTmaStore.create(
        num_stages=kernel.num_epi_stages,
        producer_group=pipeline.CooperativeGroup(pipeline.Agent.Thread, WARP * len(EPI_WARPS)),
    )
    return Epilogue(t2r, tTR_tAcc, tTR_rAcc, r2s, tRS_rD, d_out, z_out, c_in, bias_in,
                    store_barrier, d_pipe)  # fmt: skip


@cute.jit
def store_tile(
    kernel: Sm100GemmKernel,
    epi: Epilogue,
    warp,
    mma_tile,
    acc_pipe,
    acc_state,
    c_pipe,
    c_state,
    d_stage,
    d_tiles=None,
    has_acc=None,
    bias_tile=None,
    bias_on=None,
):
    """One output tile: its accumulator stage (`acc_state`) out of TMEM, subtile by subtile,
    through the fused math into D's tile `mma_tile` (which also indexes the pre-activation and
    bias). `d_tiles`: D's TMA partition to index, ((values), n_epi_m, n_epi_n, tiles...), when
    not `setup`'s (a grouped kernel's, per group). `has_acc` (a device bool, or None for
    always): False stores the epilogue of a zero accumulator without waiting on the
    accumulator ring (a tile with no k-blocks, whose stage the MMA warp never filled).
    `bias_tile`: the bias's tile, when not `mma_tile` (a grouped kernel's, at its group);
    `bias_on` (a device bool, or None for always): False adds no bias.
    Returns the advanced (d_stage, acc_state, c_state)."""
    tma_atom_d, tRS_sD, bSG_sD, bSG_gD = epi.d_out
    if cutlass.const_expr(d_tiles is not None):
        bSG_gD = d_tiles
    src = epi.tTR_tAcc[(None, None, None, None, None, acc_state.index)]
    src = cute.group_modes(src, 3, cute.rank(src))
    dst = bSG_gD[(None, None, None, *mma_tile)]
    dst = cute.group_modes(dst, 1, cute.rank(dst))
    t2r, tTR_rAcc, r2s, tRS_rD = epi.t2r, epi.tTR_rAcc, epi.r2s, epi.tRS_rD
    store_barrier, d_pipe = epi.store_barrier, epi.d_pipe
    if cutlass.const_expr(kernel.spec.preact_out):
        tma_atom_z, tRS_sZ, bSG_sZ, bSG_gZ = epi.z_out
        dst_z = bSG_gZ[(None, None, None, *mma_tile)]
        dst_z = cute.group_modes(dst_z, 1, cute.rank(dst_z))
    if cutlass.const_expr(kernel.spec.has_c):
        s2r, tSR_sC, tTR_rC, tSR_rC = epi.c_in
    if cutlass.const_expr(kernel.spec.has_bias):
        bias_dtype, tBgBias, tBcD, tRrBias, n_extent = epi.bias_in
        if cutlass.const_expr(bias_tile is None):
            bias_tile = mma_tile
        bias_src = tBgBias[(None, None, None, None, None, *bias_tile)]
        bias_src = cute.group_modes(bias_src, 3, cute.rank(bias_src))
        coords = tBcD[(None, None, None, None, None, *bias_tile)]
        coords = cute.group_modes(coords, 3, cute.rank(coords))
        if cutlass.const_expr(bias_on is not None):
            # No bias: no column in range, so every element reads as zero.
            n_limit = cutlass.Int32(n_extent)
            if not bias_on:
                n_limit = cutlass.Int32(0)
            n_extent = n_limit
        # Whole N tile inside the matrix: vector loads, no per-element predicate.
        bias_in_range = (bias_tile[1] + 1) * kernel.mma_tiler[1] <= n_extent

    if cutlass.const_expr(has_acc is None):
        acc_pipe.consumer_wait(acc_state)
    else:
        if has_acc:
            acc_pipe.consumer_wait(acc_state)
    num_sub = cute.size(src, mode=[3])
    for sub in cutlass.range(num_sub):
        if cutlass.const_expr(has_acc is None):
            acc_state = _load_subtile(t2r, src, sub, num_sub, tTR_rAcc, acc_pipe, acc_state)
        else:
            if has_acc:
                acc_state = _load_subtile(t2r, src, sub, num_sub, tTR_rAcc, acc_pipe, acc_state)
            else:
                _zero(tTR_rAcc)

        c_vec, bias_vec = None, None
        if cutlass.const_expr(kernel.spec.has_c):
            c_pipe.consumer_wait(c_state)
            cute.copy(s2r, tSR_sC[(None, None, None, c_state.index)], tSR_rC)
            # The slot is refilled by TMA (async proxy) after this generic-proxy read.
            cute.arch.fence_proxy("async.shared", space="cta")
            c_pipe.consumer_release(c_state)
            c_state.advance()
            c_vec = r2s.retile(tTR_rC).load()
        if cutlass.const_expr(kernel.spec.has_bias):
            b_view = bias_src[(None, None, None, sub)]
            if bias_in_range:
                cute.autovec_copy(b_view, tRrBias)
            else:
                coord_view = coords[(None, None, None, sub)]
                for i in cutlass.range(cute.size(tRrBias), unroll_full=True):
                    tRrBias[i] = bias_dtype(0.0)
                    if coord_view[i][1] < n_extent:
                        tRrBias[i] = b_view[i]
            bias_vec = r2s.retile(tRrBias).load()
        v = common.apply_epilogue(
            r2s.retile(tTR_rAcc).load(),
            c_vec,
            bias_vec,
            alpha=kernel.spec.alpha,
            beta=kernel.spec.beta,
            activation=kernel.spec.activation,
            act_grad=kernel.spec.act_grad,
            preact=kernel.spec.preact_out,
        )
        if cutlass.const_expr(kernel.spec.preact_out):
            v, pre = v
            tRS_rD.store(pre.to(kernel.d_dtype))
            cute.copy(r2s, tRS_rD, tRS_sZ[(None, None, None, d_stage)])
        tRS_rD.store(v.to(kernel.d_dtype))

        cute.copy(r2s, tRS_rD, tRS_sD[(None, None, None, d_stage)])
        # Generic-proxy SMEM writes must be visible to the async (TMA) proxy.
        cute.arch.fence_proxy("async.shared", space="cta")
        store_barrier.arrive_and_wait()
        if warp == EPI_WARPS[0]:
            cute.copy(tma_atom_d, bSG_sD[(None, d_stage)], dst[(None, sub)])
            if cutlass.const_expr(kernel.spec.preact_out):
                cute.copy(tma_atom_z, bSG_sZ[(None, d_stage)], dst_z[(None, sub)])
            d_pipe.producer_commit()
            d_pipe.producer_acquire()
        store_barrier.arrive_and_wait()
        d_stage = (d_stage + 1) % kernel.num_epi_stages
    return d_stage, acc_state, c_state


@cute.jit
def _load_subtile(t2r, src, sub, num_sub, tTR_rAcc, acc_pipe, acc_state):
    """Subtile `sub` of the accumulator stage into registers; after the last one, the stage
    goes back to the MMA warp (before the math, so the next tile's MMAs can start)."""
    cute.copy(t2r, src[(None, None, None, sub)], tTR_rAcc)
    if sub == num_sub - 1:
        cute.arch.fence_view_async_tmem_load()
        with cute.arch.elect_one():
            acc_pipe.consumer_release(acc_state)
        acc_state.advance()
    return acc_state


@cute.jit
def _zero(t: cute.Tensor):
    # A function, not `t.fill` in the loop: the DSL would carry `t` as loop state.
    t.fill(0.0)
