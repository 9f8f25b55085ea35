"""How many clusters of our SM90 kernels can be resident at once on this GPU, against the grid
the persistent kernel launches.

    python benchmarks/cluster_occupancy.py [--shapes 64x4096x4096,...] [--splits 2,4,8]

The persistent kernels launch `min(clusters of tiles, num_sms // cluster size)` clusters and
hand each a static share of the tiles, which assumes every launched cluster is resident at
once. A cluster of S CTAs at one CTA per SM needs S free SMs in one GPC, so fewer than
`num_sms // S` clusters may fit; the rest then run as a second wave. For each plan this compiles
the kernel (as the lowering would), loads its cubin with the CUDA driver and asks
`cuOccupancyMaxActiveClusters` with the kernel's block size, shared memory and cluster shape,
then prints the clusters the kernel launches beside the clusters that fit.
"""

from __future__ import annotations

import argparse
import math
import re
import sys

import jax_sm100
from jax_sm100._src import compile as compile_mod
from jax_sm100._src import planning
from jax_sm100._src.kernels import sm90_gemm


def _check(result):
    err, *rest = result
    if int(err) != 0:
        raise RuntimeError(f"CUDA driver error {err}")
    return rest[0] if len(rest) == 1 else rest


def _context():
    from cuda.bindings import driver as cu  # noqa: PLC0415

    _check(cu.cuInit(0))
    dev = _check(cu.cuDeviceGet(0))
    ctx = _check(cu.cuDevicePrimaryCtxRetain(dev))
    _check(cu.cuCtxSetCurrent(ctx))
    sms = _check(
        cu.cuDeviceGetAttribute(cu.CUdevice_attribute.CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT, dev)
    )
    return cu, int(sms)


def max_active_clusters(cu, compiled, threads: int, smem: int, cluster: tuple[int, int]) -> int:
    """`cuOccupancyMaxActiveClusters` for the compiled kernel at this launch shape."""
    name = re.search(r"\.entry\s+([A-Za-z0-9_$]+)\s*\(", compiled.ptx).group(1)
    module = _check(cu.cuModuleLoadData(compiled.cubin))
    func = _check(cu.cuModuleGetFunction(module, name.encode()))
    attr = cu.CUfunction_attribute
    _check(cu.cuFuncSetAttribute(func, attr.CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES, smem))
    _check(cu.cuFuncSetAttribute(func, attr.CU_FUNC_ATTRIBUTE_NON_PORTABLE_CLUSTER_SIZE_ALLOWED, 1))
    config = cu.CUlaunchConfig()
    config.blockDimX, config.blockDimY, config.blockDimZ = threads, 1, 1
    config.gridDimX, config.gridDimY, config.gridDimZ = cluster[0], cluster[1], 1
    config.sharedMemBytes = smem
    dims = cu.CUlaunchAttribute()
    dims.id = cu.CUlaunchAttributeID.CU_LAUNCH_ATTRIBUTE_CLUSTER_DIMENSION
    value = cu.CUlaunchAttributeValue()
    value.clusterDim.x, value.clusterDim.y, value.clusterDim.z = cluster[0], cluster[1], 1
    dims.value = value
    config.attrs = [dims]
    config.numAttrs = 1
    return int(_check(cu.cuOccupancyMaxActiveClusters(func, config)))


def launched_clusters(plan, sms: int) -> tuple[int, int]:
    """(clusters of tiles, clusters the persistent kernel launches) for `plan` on `sms` SMs."""
    tm, tn, _ = plan.cta_tile_mnk
    cm, cn = plan.cluster_shape_mn
    tiles_n = math.ceil(plan.n / tn)
    layers = plan.batch
    if plan.split_k > 1:
        if plan.split_reduce == "cluster":
            tiles_n *= plan.split_k
        else:
            layers *= plan.split_k
    total = math.ceil(math.ceil(plan.m / tm) / cm) * math.ceil(tiles_n / cn) * layers
    return total, min(total, max(1, sms // (cm * cn)))


def plans_to_probe(shapes, splits):
    for m, n, k in shapes:
        base = jax_sm100.plan(m, n, k, a_dtype="bfloat16", b_dtype="bfloat16", arch="sm_90a",
                              force_kernel=True)  # fmt: skip
        yield f"{m}x{n}x{k} planner", base
        if base.kernel == planning.KERNEL_XLA or m > 256:
            continue  # split-K variants only for skinny problems
        for tile in ((64, 128), (64, 256), (128, 128)):
            for split in splits:
                for reduce in ("xla", "cluster"):
                    try:
                        tiled = planning.sm90_variant(base, tile_mn=tile)
                        p = planning.with_split(tiled, split, reduce=reduce)
                    except planning.C.PlanError:
                        continue
                    yield f"{m}x{n}x{k} {tile[0]}x{tile[1]} split {split} {reduce}", p


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--shapes", default="64x4096x4096,128x4096x8192,8192x8192x8192,16384x4096x4096")
    ap.add_argument("--splits", default="2,4,8")
    args = ap.parse_args()
    shapes = [tuple(int(v) for v in s.split("x")) for s in args.shapes.split(",")]
    splits = [int(v) for v in args.splits.split(",")]
    try:
        cu, sms = _context()
    except Exception as e:  # noqa: BLE001  (no driver or no GPU: say so and stop)
        print(f"no CUDA device ({type(e).__name__}: {e})")
        return 1
    print(f"{sms} SMs")
    for label, plan in plans_to_probe(shapes, splits):
        plan = planning.dataclasses.replace(plan, num_sms=sms)
        compiled = compile_mod.compile_plan(plan)
        threads = sm90_gemm.Sm90GemmKernel(compiled.plan, compiled.spec).threads
        cluster = plan.cluster_shape_mn
        fit = max_active_clusters(cu, compiled, threads, plan.smem_bytes, cluster)
        total, launched = launched_clusters(plan, sms)
        verdict = "fits" if launched <= fit else f"{launched - fit} clusters wait for a 2nd wave"
        print(f"OCC {label:42s} cluster {cluster[0]}x{cluster[1]} smem {plan.smem_bytes:6d}: "
              f"{fit:3d} resident, kernel launches {launched:3d} of {total:4d} -> {verdict}",
              flush=True)  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
