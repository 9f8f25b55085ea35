"""The CUDA lowering of the matmul primitive: plan for the device, compile, call the FFI handler.

Entry point for lowering.py (wrapped with `mlir.lower_fun`):

    cuda_matmul_impl(a, b, bias, c, *, transpose_a, transpose_b, alpha, beta, activation,
                     out_dtype, plan, save_preact, act_grad, **unused) -> [out, (z)]

It runs at trace time on the operands' shapes (primitive.py's conventions: a [*Ba, m, k] or
[*Ba, k, m], b [*Bb, k, n] or [*Bb, n, k], bias [*Bbias, n], c [*Bc, m, n], out [*B, m, n]):

1. The target: the device's arch (sm_90a for compute capability 9.0, sm_100a for 10.0) and SM
   count (`dispatch.lowering_target`). A call with fp8 in it that the kernels cannot take as
   given runs in an exact form they take (`dispatch.kernel_form`: widened operands, a float32
   result rounded by XLA, sm_90a's fp8 operands transposed K-major).
2. Batch dims are flattened into one L. When B is shared by the whole batch (a weight) and A is
   K-major, the batch folds into m (free reshape, one large GEMM; `primitive.folds_batch`);
   other broadcasts are materialised (a copy, noted in the recorded `Lowered.note`).
3. The plan that runs that problem on the target (`dispatch.plan_call`: the planner's or the
   caller's, split-K fitted to k).
4. `compile_plan` (once per process per binary) and one `jax.ffi.ffi_call` to the
   `jax_sm100_gemm` target (`jax_sm100_quantize` for the quantize kernel), carrying the object
   file, its function name and the runtime extents and strides as attributes; the binary
   travels inside the HLO.
5. A split-K plan runs the kernel on (M, K/s, s) views of A and B. With `split_reduce="xla"`
   (the planner's) it writes float32 partials, summed by XLA with the epilogue fused into that
   reduction; with "cluster" each output tile's s CTAs sum their partials in the cluster and
   apply the epilogue themselves (one launch, no workspace).
6. `save_preact` (the forward under `grad`) makes the kernel write the pre-activation too, as
   a second result (`KernelSpec.preact_out`, `planning.with_preact` for a caller's plan);
   `act_grad` (a backward product) is the kernel epilogue `act'(c) * acc` (`KernelSpec.act_grad`).

Anything a kernel cannot take (unsupported dtype, misaligned contiguous dim, batched bias, an
`xla_dot` plan) runs on XLA's dot with the same float32 epilogue (`primitive.reference_matmul`);
each lowering's plan and notes are recorded (`dispatch.record`; `jax_sm100.last_lowering()`).
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from jax_sm100._src import compile as compile_mod
from jax_sm100._src import constraints, dispatch, dtypes, ffi, ffi_checks, planning
from jax_sm100._src import primitive as P
from jax_sm100._src.ffi_checks import Tie, problem_ties
from jax_sm100._src.kernels.spec import KernelSpec


def _reference(a, b, bias, c, **kw):
    """XLA's dot and the float32 epilogue. Two operands of one fp8 format run XLA's fp8 GEMM at
    DEFAULT: the tensor core's fp8 accumulation, as the kernels' and cuBLAS's (not the exact
    float32 product that the CPU computes, whose dot takes no fp8). Others at HIGHEST (exact
    products), fp8 widened as the kernels' form widens it (`dtypes.widen_fp8_pair`: e4m3 beside
    e5m2 to bfloat16, as on the kernels and on every path with static dims)."""
    if a.dtype == b.dtype and dispatch.is_fp8(a.dtype):
        return P.reference_matmul(a, b, bias, c, upcast=False, precision=lax.Precision.DEFAULT,
                                  **kw)  # fmt: skip
    a, b = dtypes.widen_fp8_pair(a, b)
    upcast = any(np.dtype(x.dtype).itemsize == 1 for x in (a, b))
    return P.reference_matmul(a, b, bias, c, upcast=upcast, **kw)


def _form_takes(plan, form: dispatch.KernelForm, bias, kw) -> bool:
    """Whether a caller's plan was made for the kernels' form of the call (its dtypes and
    layouts: `plan_for`'s plan of it), not for the call as given."""
    try:
        problem = P.problem_for_operands(
            form.a, form.b, bias, form.c, **{**kw, "transpose_a": form.transpose_a,
                                             "transpose_b": form.transpose_b,
                                             "out_dtype": form.out_dtype},
        )  # fmt: skip
        planning.check_plan_fits(plan, problem, plan.arch, sizes=False)
    except (TypeError, ValueError):  # (PlanError is a ValueError)
        return False
    return True


def cuda_matmul_impl(a, b, bias, c, *, transpose_a, transpose_b, alpha, beta, activation,
                     out_dtype, plan=None, save_preact=False, act_grad=None, _notes=(),
                     **unused):  # fmt: skip
    """The primitive's math on a CUDA device through our kernels (see the module docstring).
    `_notes`: what `dispatch.kernel_form` changed of the call, for the recorded lowering."""
    del unused
    out_dtype = np.dtype(out_dtype)
    epi = dict(alpha=alpha, beta=beta, activation=activation, out_dtype=out_dtype,
               save_preact=save_preact, act_grad=act_grad)  # fmt: skip
    kw = dict(transpose_a=transpose_a, transpose_b=transpose_b, **epi)
    target = dispatch.lowering_target(plan)
    if target is None:
        dispatch.record(dispatch.Lowered(None, "no sm_90a/sm_100a device: XLA dot"))
        return _reference(a, b, bias, c, **kw)

    out_shape = P.shape_rule(
        a.shape, b.shape, None if bias is None else bias.shape, None if c is None else c.shape,
        transpose_a=transpose_a, transpose_b=transpose_b,
    )  # fmt: skip
    if dispatch.symbolic_dims(a, b):
        # Folding the batch compares its size with 1, too.
        dispatch.record(dispatch.Lowered(None, f"symbolic dims ({a.shape} x {b.shape}): XLA dot"))
        return _reference(a, b, bias, c, **kw)
    batch_shape, (m, n) = tuple(out_shape[:-2]), out_shape[-2:]
    k = a.shape[-2] if transpose_a else a.shape[-1]
    L = math.prod(batch_shape)

    def batched(x):
        return x is not None and tuple(x.shape[: len(batch_shape)]) == batch_shape and L > 1

    def unbatched(x):
        return all(d == 1 for d in x.shape[: len(batch_shape)])

    if bias is not None and L > 1 and not unbatched(bias):
        dispatch.record(dispatch.Lowered(None, "bias with batch dims: XLA dot"))
        return _reference(a, b, bias, c, **kw)

    form = dispatch.kernel_form(a, b, c, transpose_a=transpose_a, transpose_b=transpose_b,
                                out_dtype=out_dtype, arch=target.arch)  # fmt: skip
    if form.notes and (plan is None or _form_takes(plan, form, bias, kw)):
        # The kernels' form of the call (a caller's plan made for it: `plan_for`'s), its
        # results rounded back to the call's dtypes.
        outs = cuda_matmul_impl(
            form.a, form.b, bias, form.c, transpose_a=form.transpose_a,
            transpose_b=form.transpose_b, alpha=alpha, beta=beta, activation=activation,
            out_dtype=form.out_dtype, plan=plan, save_preact=save_preact, act_grad=act_grad,
            _notes=(*_notes, *form.notes),
        )  # fmt: skip
        return [outs[0].astype(out_dtype), *(z.astype(P.preact_dtype(out_dtype)) for z in outs[1:])]

    notes = list(_notes)
    fold = P.folds_batch(a.shape, b.shape, transpose_a, out_shape)
    if fold:
        notes.append(f"batch {L} folded into m (B shared)")
        a3 = a.reshape(1, L * m, k)
        c3 = None
        if c is not None:
            if not batched(c):
                notes.append("C broadcast over the batch materialised")
            c3 = jnp.broadcast_to(c, out_shape).reshape(1, L * m, n)
        mm, LL = L * m, 1
    else:
        if L > 1 and any(x is not None and not batched(x) for x in (a, b, c)):
            notes.append("broadcast batch operands materialised")

        def full(x):
            return (
                x.reshape(L, *x.shape[-2:])
                if batched(x) or L == 1
                else (jnp.broadcast_to(x, (*batch_shape, *x.shape[-2:])).reshape(L, *x.shape[-2:]))
            )

        a3 = full(a)
        c3 = None if c is None else full(c)
        mm, LL = m, L
    b3 = b.reshape(1, *b.shape[-2:]) if fold else (
        b.reshape(L, *b.shape[-2:]) if (batched(b) or L == 1) else
        jnp.broadcast_to(b, (*batch_shape, *b.shape[-2:])).reshape(L, *b.shape[-2:])
    )  # fmt: skip
    bias1 = None if bias is None else bias.reshape(n)
    a_major = "m" if transpose_a else "k"
    b_major = "k" if transpose_b else "n"

    names = [np.dtype(x.dtype).name for x in (a, b)]
    c_name = None if c is None else np.dtype(c.dtype).name
    try:
        problem = P.problem_for_operands(a, b, bias, c, **kw)
        decision = dispatch.plan_call(problem, target, plan)
    except (TypeError, ValueError) as e:
        if plan is not None:
            raise  # a caller's plan that does not fit: the error names the fix
        dispatch.record(dispatch.Lowered(None, "; ".join([*notes, f"no plan ({e}): XLA dot"])))
        return _reference(a, b, bias, c, **kw)
    p = decision.plan
    notes.extend(decision.notes)
    if p.kernel == planning.KERNEL_XLA:
        why = p.reason if p.reason.startswith("XLA dot") else f"XLA dot: {p.reason}"
        dispatch.record(dispatch.Lowered(p, "; ".join(notes + [why])))
        return _reference(a, b, bias, c, **kw)
    bias_name = None if bias is None else np.dtype(bias.dtype).name
    read_as = None if bias is None else constraints.kernel_bias_dtype(bias_name)
    if read_as != bias_name:
        # An fp8 or float64 bias: the epilogue adds it in float32 (`epilogue_xla` casts it to
        # the accumulator's dtype, float32 wherever the kernels run), so the kernel takes it
        # converted, with the same result.
        notes.append(f"bias {bias_name} converted to {read_as}, the epilogue's dtype")
        bias_name, bias1 = read_as, bias1.astype(read_as)
    spec = KernelSpec(
        a_dtype=names[0], b_dtype=names[1], out_dtype=out_dtype.name, a_major=a_major,
        b_major=b_major, c_dtype=c_name, bias_dtype=bias_name, activation=activation,
        alpha=alpha, beta=1.0 if act_grad else beta, preact_out=save_preact, act_grad=act_grad,
    )  # fmt: skip
    swap = p.swap_ab
    if swap:
        # D^T = B A^T: the caller's B (K-major, [n, k]) is the kernel's A, its A the kernel's B,
        # and the kernel stores D M-major, straight into the caller's row-major [m, n].
        spec = spec.swapped()
        notes.append("swapped: the kernel runs D^T = B A^T, D stored M-major (plan.swap_ab)")

    dispatch.record(dispatch.Lowered(p, "; ".join(notes) or "kernel"))
    ffi.register()
    compiled = compile_mod.compile_plan(p, spec)
    if p.split_k > 1 and p.split_reduce == "xla":
        (parts,) = _call(compiled, a3[0], b3[0], None, None, mm, n, k, 1, a_major, b_major, None)
        acc = jnp.sum(parts, axis=0)
        outs = P.epilogue_xla(acc, None if c3 is None else c3[0], bias1, **epi)
        return [x.reshape(out_shape) for x in outs]
    if swap:
        outs = _call(compiled, b3, a3, c3, bias1, n, mm, k, LL, a_major, b_major, out_dtype,
                     d_m_major=True)  # fmt: skip
    else:
        outs = _call(compiled, a3, b3, c3, bias1, mm, n, k, LL, a_major, b_major, out_dtype)
    return [x.reshape(out_shape) for x in outs]


def _ffi(compiled, out_type, operands, layouts, order, aliases=None, ties=()):
    """The custom call of `compiled` (`launch`'s last step; `jax_sm100_gemm`, or
    `jax_sm100_quantize` for the quantize_both kernel: `ffi.target_for`): `layouts` (one
    `ffi_checks.TensorLayout` per tensor argument, in the kernel's order) encoded as the
    handler's attributes and checked against the buffers first, `order[i]` the input (>= 0) or
    result (-1 - j) that tensor argument i is, `aliases` input -> result as `jax.ffi.ffi_call`
    takes them, `ties` the `ffi_checks.Tie`s between the tensors' extents."""
    # The attributes the handler reads (ffi/gemm_ffi.cc; ffi_checks.py states the format).
    dims, names = ffi_checks.encode(layouts, ties)
    # The handler's own checks, at trace time: a lowering bug fails here, with a traceback into
    # this file, rather than as a refused launch.
    ins = [(x.shape, x.dtype) for x in operands]
    outs = [(o.shape, o.dtype) for o in (out_type if isinstance(out_type, tuple) else (out_type,))]
    ffi_checks.check_call(dims, order, names, ins, outs)
    target = ffi.target_for(compiled.plan.kernel)
    call = jax.ffi.ffi_call(target, out_type, input_output_aliases=aliases)
    return call(
        *operands,
        key=compiled.digest,
        object=np.frombuffer(compiled.object_bytes, dtype=np.uint8),
        prefix=compiled.function_prefix,
        dims=np.asarray(dims, dtype=np.int64),
        order=np.asarray(order, dtype=np.int64),
        names=names,
    )


def _call(compiled, a3, b3, c3, bias1, m, n, k, L, a_major, b_major, out_dtype,
          d_m_major=False):  # fmt: skip
    # (shape, strides) of each operand in the kernel's modes (spec.py), for row-major buffers.
    # A split-K kernel (L == 1) takes A and B as (rows, K/s, s) views: split j is columns (or
    # rows) [j K/s, (j + 1) K/s) of the same buffer. With "xla" reduction it returns the float32
    # partials (s, m, n). With `d_m_major` (a swapped product: m and n are the kernel's, the
    # caller's n and m) D and Z are M-major: the buffer is [L, n, m], the caller's [L, m, n].
    s = compiled.split_k
    kc = k // s
    partials = s > 1 and compiled.plan.split_reduce == "xla"
    if s > 1:
        modes = {
            "a": ((m, kc, s), (k, 1, kc)) if a_major == "k" else ((m, kc, s), (1, m, kc * m)),
            "b": ((n, kc, s), (1, n, kc * n)) if b_major == "n" else ((n, kc, s), (k, 1, kc)),
        }
    else:
        modes = {
            "a": ((m, k, L), (k, 1, m * k)) if a_major == "k" else ((m, k, L), (1, m, m * k)),
            "b": ((n, k, L), (1, n, n * k)) if b_major == "n" else ((n, k, L), (k, 1, n * k)),
        }
    assert not (d_m_major and c3 is not None), "a swapped product takes no C"
    d_modes = ((m, n, L), (1, m, m * n)) if d_m_major else ((m, n, L), (n, 1, m * n))
    modes |= {
        "d": d_modes,
        "z": d_modes,
        "c": ((m, n, L), (n, 1, m * n)),
        "bias": ((m,), (1,)) if d_m_major else ((n,), (1,)),
    }
    if partials:
        modes["d"] = ((m, n, s), (n, 1, m * n))
        out_dtype, L = np.dtype(np.float32), s
    operands = [a3, b3] + [x for x in (c3, bias1) if x is not None]
    index = {"a": 0, "b": 1, "d": -1}
    nxt = 2
    for name, x in (("c", c3), ("bias", bias1)):
        if x is not None:
            index[name] = nxt
            nxt += 1
    d_buf = (L, n, m) if d_m_major else (L, m, n)
    out_types = [jax.ShapeDtypeStruct(d_buf, out_dtype)]
    results = 1
    if compiled.spec.preact_out and not partials:
        # The pre-activation: the second result, in D's dtype and layout.
        index["z"] = -1 - len(out_types)
        out_types.append(jax.ShapeDtypeStruct(d_buf, out_dtype))
        results = 2
    spec = compiled.spec
    dtypes = {"a": spec.a_dtype, "b": spec.b_dtype, "d": spec.out_dtype, "z": spec.out_dtype,
              "c": spec.c_dtype, "bias": spec.bias_dtype}  # fmt: skip
    # A, B and D agree on the problem (a split-K kernel's A and B are (rows, K/s, s) views of a
    # D with L = 1, the partials' D is (m, n, s)); the epilogue reads bias and (unstaged) C, and
    # writes z, by D's extents with plain loads and stores: the handler checks they agree with
    # D's. (No bias, C or z with the partials.)
    ties = problem_ties(batched=s == 1 or partials)
    if s > 1 and not partials:  # the splits: A's and B's third mode
        ties.append(Tie("a", 2, "b", 2))
    if not partials:
        ties += [
            Tie("bias", 0, "d", 0 if d_m_major else 1),
            *(Tie(name, mode, "d", mode) for name in ("c", "z") for mode in range(3)),
        ]  # fmt: skip
    return launch(compiled, operands, index, out_types, modes, dtypes, ties=ties)[:results]


def launch(compiled, operands, index, out_types, modes, dtypes, zeroed=None, ties=()):
    """One custom call of `compiled` (`_ffi`): every lowering's way to its kernel.

    Args:
      compiled: the `compile.CompiledGemm` to run.
      operands: the inputs, in the order the call takes them.
      index: each tensor argument's name (`compiled.tensor_args`) -> its input's position in
        `operands` (>= 0), or -1 - its result's position in `out_types`.
      out_types: the results' `jax.ShapeDtypeStruct`s, D's first.
      modes: name -> (extents, strides) of each tensor argument in the kernel's modes.
      dtypes: name -> the dtype its binary reads or writes.
      zeroed: name -> (shape, dtype) of more buffers the kernel takes zeroed at each launch
        (the dynamic schedule's tile counter), passed as the stream-K flags are.
      ties: `ffi_checks.Tie`s the handler checks between the tensors' extents (a kernel that
        indexes one tensor by another's extents outside a TMA descriptor's bounds).

    The plan's stream-K workspace (`compile.workspace_shapes`) is added here: "ws" an extra
    result the kernel writes before it reads, "flags" zeros passed in and aliased to a result,
    so that every launch (CUDA graph replays included) starts from zeroed buffers XLA owns.

    Returns:
      The results as a list, the added buffers' last.
    """
    operands, index, out_types = list(operands), dict(index), list(out_types)
    modes, dtypes, aliases = dict(modes), dict(dtypes), {}
    work, zeroed = compile_mod.workspace_shapes(compiled.plan), zeroed or {}
    assert set(work) <= {"ws", "flags"} and not set(work) & set(zeroed), (work, zeroed)
    results = {name: work[name] for name in ("ws",) if name in work}
    zeroed = {name: work[name] for name in ("flags",) if name in work} | zeroed
    for name, (shape, dtype) in results.items():  # results alone
        modes[name], dtypes[name] = (shape, (1,)), dtype
        index[name] = -1 - len(out_types)
        out_types.append(jax.ShapeDtypeStruct(shape, dtype))
    for name, (shape, dtype) in zeroed.items():  # zeros passed in, aliased to a result
        modes[name], dtypes[name] = (shape, (1,)), dtype
        index[name] = len(operands)
        aliases[len(operands)] = len(out_types)
        operands.append(jnp.zeros(shape, dtype))
        out_types.append(jax.ShapeDtypeStruct(shape, dtype))
    present = {arg.name for arg in compiled.tensor_args}
    ties = [t for t in ties if t.name in present and t.other in present]  # optional tensors
    layouts = [
        ffi_checks.TensorLayout(
            arg.name,
            dtypes[arg.name],
            *modes[arg.name],
            arg.dynamic_shape_modes,
            arg.dynamic_stride_modes,
        )  # fmt: skip
        for arg in compiled.tensor_args
    ]
    order = [index[arg.name] for arg in compiled.tensor_args]
    if len(out_types) == 1:
        return [_ffi(compiled, out_types[0], operands, layouts, order, ties=ties)]
    return list(_ffi(compiled, tuple(out_types), operands, layouts, order, aliases or None, ties))
