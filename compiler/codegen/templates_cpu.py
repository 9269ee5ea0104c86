"""Fast CPU kernels for the heavy ops: float32 MatMul, Gemm, PackedMatMul, 2-D/1-D Conv, PackedConv, WinogradConv.

They share one GEMM (``cpu_library/gemm.h``, in :data:`TEMPLATE_PRELUDE`), written like BLIS: for each
block of 256 of the contracted dim, B is packed into panels of NR columns and A into panels of MR rows (zero padded),
then a register-blocked micro-kernel computes MR×NR tiles of C. The micro-kernel is chosen once,
when first used, from the CPU: AVX-512 (12×32), AVX2+FMA (6×16) or SSE (4×8); each is compiled with
its own ``target`` attribute, so the library still loads on any x86-64. Threads (OpenMP) split the
packing and the C tiles; small products run on the calling thread. Batched matmuls split the batch
across threads when each product is small. ``M == 1`` (a row vector times a matrix) skips packing.
A PackedMatMul (a constant weight, ``passes/prepack.py``) reads B from panels of ``PANEL`` columns
packed at compile time instead of packing it on every call.

Conv is a GEMM per image and group, ``w[OCG, C*KH*KW] @ im2col(x)``, whose B panels are packed
straight from the image (no im2col buffer; a 1×1, stride-1, unpadded conv uses the image as B),
with the bias added in the GEMM's epilogue. With AVX2 a conv of horizontal stride 1 whose output
rows fill a panel is not packed at all: its micro-kernel loads each panel row from the image
through a table of tap offsets. A PackedConv (a 1x1 conv on a small image, ``passes/prepack.py``) is
the prepacked GEMM with the output pixels as rows, transposed back. A WinogradConv (a 3x3 stride-1 conv,
``passes/prepack.py``) transforms its input tiles, runs one prepacked GEMM per transform position (tiles
as rows) and transforms the products back into output tiles. A PackedMatMulInteger (int8/uint8 times a
weight packed at compile time, int32 sums) runs the integer GEMM of ``cpu_library/gemm_int8.h``; a
MatMulNBits (2/4/8-bit codes in blocks, onnxruntime's layout) the GEMV or dequantizing GEMM of
``cpu_library/lowbit.h``. A PackedMatMulBf16 (bfloat16 values times a bfloat16 weight packed at compile
time, float32 sums) runs ``cpu_library/gemm_bf16.h``: AMX tiles, AVX-512's ``vdpbf16ps``, or, on a CPU
with neither, both operands widened for the float32 GEMM (chosen when first used, as the others are).
Depthwise, 3-D and transposed convs, pools, attention, Resize, LRN, scans, pads, TopK, Det, BitCast (a byte
copy; the driver runs it as a view) and large transposes have
templates of their own (below); every other op, and other dtypes, use the generic lowering.
"""
from __future__ import annotations

import functools
import math
import platform

import numpy as np

from ..ops.linalg import PANEL
from .cpp import PRELUDE, _clones_macro, literal
from .prelude_cpu import read_library

__all__ = ["TEMPLATE_PRELUDE", "library_header", "prebuilt_tables", "template_body", "template_kind",
           "accepts_epilogue", "accepts_group", "CLONED_TEMPLATES"]

# The templates' C++ (cpu_library/*.h, in this order: a file uses only those before it); gemm.h
# takes the column count of a panel packed at compile time (ops.linalg.PANEL) for @PANEL@.
_LIBRARY_FILES = ("gemm.h", "gemm_f64.h", "gemm_bf16.h", "gemm_int8.h", "lowbit.h", "conv.h", "conv_int8.h",
                  "conv_bf16.h", "depthwise.h", "pool.h", "conv3d.h", "conv_transpose.h", "attention.h", "winograd.h")
_LIBRARY_TEXT = "\n" + read_library(*_LIBRARY_FILES).replace("@PANEL@", str(PANEL))

# The drivers the kernels call (the GEMMs, the convs, the attention): SF_LIB(name, function)(every argument)
# in a kernel's text (helpers.h). Like the tables below, each is compiled once per kernel cache into an
# object of its own (prebuilt_tables, with -DSF_PREBUILT_TABLES: it takes the tables from theirs) that the
# libraries calling it link, where every library's units compiled them again before: most of a transformer's
# unit (gpt2_ts17's 20 kernels compiled in 2.9 s, 0.8 s without the GEMM and attention drivers).
_FUNCTIONS = {
    "sgemm": "sf_sgemm", "sgemm_batched": "sf_sgemm_batched", "sgemm_prepacked": "sf_sgemm_prepacked<float>",
    "sgemm_prepacked_f16": "sf_sgemm_prepacked<uint16_t>", "dgemm": "sf_dgemm", "dgemm_batched": "sf_dgemm_batched",
    "bgemm_prepacked": "sf_bgemm_prepacked", "bgemm_prepacked_bf16": "sf_bgemm_prepacked_bf16",
    "igemm_prepacked": "sf_igemm_prepacked", "iconv2d": "sf_iconv2d", "bconv2d": "sf_bconv2d",
    "matmul_nbits": "sf_matmul_nbits", "expert_matmul_i32": "sf_expert_matmul<int32_t>",
    "expert_matmul_i64": "sf_expert_matmul<int64_t>", "conv2d": "sf_conv2d", "conv2d_packed": "sf_conv2d_packed",
    "conv2d_winograd2": "sf_conv2d_winograd<2>", "conv2d_winograd4": "sf_conv2d_winograd<4>",
    "conv_depthwise": "sf_conv_depthwise", "conv3d": "sf_conv3d", "conv_transpose2d": "sf_conv_transpose2d",
    "conv_transpose3d": "sf_conv_transpose3d", "attention": "sf_attention"}

TEMPLATE_PRELUDE = _LIBRARY_TEXT + "\n// ---- the drivers' prebuilt objects (SF_LIB) ----\n" + "".join(
    f'extern "C" const void* sf_rt_fn_{name}();\n' for name in _FUNCTIONS)


def _lib(name: str) -> str:
    """What a kernel calls for the driver ``name`` of :data:`_FUNCTIONS` (with every argument)."""
    return f"SF_LIB({name}, {_FUNCTIONS[name]})"

# The micro-kernel tables (GEMM, int8 GEMM, packed and direct convs): with every tile size and form they
# instantiate, they were most of a library's compile time (25 s of 27 s for a unit with one conv, 2 cores),
# the same in every library. Each is compiled once into a cached object (toolchain.build_shared_library's
# ``prebuilt``) that the libraries needing it link; their units, compiled with -DSF_PREBUILT_TABLES, take
# the table through ``sf_rt_<name>()``.
_TABLES = ("ukr", "i8_kernel", "cukr", "pdkr", "pdkr2")


# the prebuilt units each prebuilt unit's object refers to (prebuilt_needs; checked against the objects by
# test_the_prebuilt_units_needs_are_what_their_objects_refer_to)
_NEEDS = {f"sf_rt_fn_{name}": ("sf_rt_ukr", "sf_rt_workspace") for name in _FUNCTIONS}
_NEEDS.update({
    "sf_rt_fn_dgemm": ("sf_rt_workspace",), "sf_rt_fn_dgemm_batched": ("sf_rt_workspace",),
    "sf_rt_fn_conv2d": ("sf_rt_cukr", "sf_rt_workspace"), "sf_rt_fn_conv3d": ("sf_rt_cukr", "sf_rt_workspace"),
    "sf_rt_fn_conv2d_packed": ("sf_rt_ukr", "sf_rt_cukr", "sf_rt_pdkr", "sf_rt_pdkr2", "sf_rt_workspace"),
    "sf_rt_fn_iconv2d": ("sf_rt_i8_kernel", "sf_rt_workspace"),
    "sf_rt_fn_igemm_prepacked": ("sf_rt_i8_kernel", "sf_rt_workspace"),
    "sf_rt_pdkr": ("sf_rt_pdkr_1", "sf_rt_pdkr_2", "sf_rt_pdkr_3"), "sf_rt_cukr": ("sf_rt_cukr_1", "sf_rt_cukr_2")})
if platform.machine() not in ("x86_64", "AMD64"):  # (the packed conv's tables are x86-64 code: elsewhere its
    # driver does not refer to them, and their units would not compile)
    _NEEDS = {s: tuple(n for n in needs if not n.startswith("sf_rt_pdkr")) for s, needs in _NEEDS.items()
              if not s.startswith("sf_rt_pdkr")}


def prebuilt_needs() -> dict[str, tuple[str, ...]]:
    """``{symbol: symbols}``: the units of :func:`prebuilt_tables` whose objects refer to others (a conv
    driver to its micro-kernel tables, the packed conv's table to its parts), so that a build missing them
    compiles them side by side (``toolchain.build_shared_library``'s ``prebuilt_needs``)."""
    return dict(_NEEDS)


def library_header(float8: str = "") -> str:
    """The start of every cpu library's units (:class:`.cpp.CpuSource`'s ``header``): the helpers, then
    ``float8`` (the float8 conversions of a library with float8 values: the library code does not use
    them), the clones macro and the templates."""
    return "\n".join([PRELUDE + float8, _clones_macro(), TEMPLATE_PRELUDE])


def prebuilt_tables() -> dict[str, str]:
    """``{symbol: translation unit}`` of the micro-kernel tables and the drivers (:data:`_FUNCTIONS`), each
    :func:`library_header` and one function returning it, of the scratch memory (``sf_rt_workspace``: the
    helpers and its function) and of the helpers the kernels call in vector form (``sfv_exp``,
    ``sfv_exp_nonpos``, ``sfv_h2f``, ``sfv_f2h``, ``sfv_f16_round``: ``cpu_library/vmath.h``). The same for
    every library (its own header may add the float8 conversions), so each is compiled once per cache and
    command line."""
    return dict(_prebuilt_units())


@functools.lru_cache(maxsize=1)
def _prebuilt_units() -> dict[str, str]:
    header = library_header()
    units = {f"sf_rt_{name}": f'{header}\nextern "C" const void* sf_rt_{name}() {{ return &sf_{name}(); }}\n'
             for name in _TABLES}
    # the conv tables in parts compiled side by side (conv.h's sf_pdkr_part, 4 forms, and sf_cukr_part, 3)
    units.update(_split_table(header, "pdkr", "SfPdkr", 4))
    units.update(_split_table(header, "cukr", "SfCukr", 3))
    units.update({f"sf_rt_fn_{name}": f'#define SF_PREBUILT_TABLES 1\n{header}\n'
                  f'extern "C" const void* sf_rt_fn_{name}() {{ return reinterpret_cast<const void*>(&{fn}); }}\n'
                  for name, fn in _FUNCTIONS.items()})
    units.update(_VMATH_UNITS)
    units["sf_rt_workspace"] = _WORKSPACE_UNIT
    return units


def _split_table(header: str, name: str, struct: str, n: int) -> dict[str, str]:
    """The units of the micro-kernel table ``sf_<name>`` compiled in ``n`` parts (``sf_<name>_part<k>`` of
    the library, each a unit: the whole table took 35 s or 13.5 s of g++ in one): ``sf_rt_<name>`` holds part
    0 and hands ``sf_pick_<name>`` the others from the objects ``sf_rt_<name>_1 ..``."""
    others = range(1, n)
    table = header + "".join(f'extern "C" void sf_rt_{name}_{k}(void* t);\n'
                             f"static void sf_{name}_from_{k}({struct}& t) {{ sf_rt_{name}_{k}(&t); }}\n"
                             for k in others)
    table += (f'extern "C" const void* sf_rt_{name}() {{\n  static const {struct}PartFn parts[{n}] = '
              f"{{{', '.join([f'sf_{name}_part<0>'] + [f'sf_{name}_from_{k}' for k in others])}}};\n"
              f"  static const {struct} u = sf_pick_{name}(parts);\n  return &u;\n}}\n")
    units = {f"sf_rt_{name}": table}
    units.update({f"sf_rt_{name}_{k}": f'{header}\nextern "C" void sf_rt_{name}_{k}(void* t) '
                  f"{{ sf_{name}_part<{k}>(*static_cast<{struct}*>(t)); }}\n" for k in others})
    return units


# the units of the helpers in vector form (helpers.h alone before them: they need no template)
_VMATH = "#define SF_VMATH_UNIT 1\n" + PRELUDE + _clones_macro() + read_library("vmath.h")
_VMATH_UNITS = {"sfv_exp": _VMATH + "SF_VMATH_DEFINE(sfv_exp, sf_exp, false)\n",
                "sfv_exp_nonpos": _VMATH + "SF_VMATH_DEFINE(sfv_exp_nonpos, sf_exp_nonpos, true)\n",
                "sfv_h2f": _VMATH + "SF_VMATH_DEFINE_H2F\n",
                "sfv_f2h": _VMATH + "SF_VMATH_DEFINE_F2H\n",
                "sfv_f16_round": _VMATH + "SF_VMATH_DEFINE_F16_ROUND\n"}
# the scratch memory of a library's units and drivers (helpers.h's sf_workspace)
_WORKSPACE_UNIT = (PRELUDE + 'extern "C" void* sf_rt_workspace(int slot, size_t bytes) '
                   '{ return sf_workspace(slot, bytes); }\n'
                   'SF_EXPORT size_t sf_rt_workspace_bytes(void) '
                   '{ return __atomic_load_n(&sf_workspace_held, __ATOMIC_RELAXED); }\n')


def _prod(xs) -> int:
    return int(math.prod(xs))


def _args(op, ctype: str = "float") -> list[str]:
    lines = []
    for k, t in enumerate(op.inputs):
        lines.append(f"  const {ctype}* __restrict__ in{k} = static_cast<const {ctype}*>(inputs[{k}]);")
    lines.append(f"  {ctype}* __restrict__ out0 = static_cast<{ctype}*>(outputs[0]);")
    return lines


def _all_f32(op) -> bool:
    return all(t.dtype == "float32" for t in list(op.inputs) + list(op.outputs))


def _arr(xs) -> str:
    return "{" + ", ".join(str(int(x)) for x in xs) + "}" if xs else "{0}"


def _f64(op) -> bool:
    """Whether ``op`` is a float64 product (every operand float64): the GEMM templates' ``sf_dgemm``."""
    return all(t.dtype == "float64" for t in list(op.inputs) + list(op.outputs))


def _gemm_call(op, M, N, K, A: str, rsa, csa, B: str, rsb, csb, alpha: float = 1.0, bias: str = "nullptr",
               rbs: int = 0, cbs: int = 0) -> str:
    """The call of the float32 (``sf_sgemm``) or float64 (``sf_dgemm``) GEMM writing ``out0`` ([M, N])."""
    if _f64(op):
        return (f"  {_lib('dgemm')}({M}, {N}, {K}, {A}, {rsa}, {csa}, {B}, {rsb}, {csb}, out0, {N}, "
                f"{literal(alpha, 'float64')}, {bias}, {rbs}, {cbs}, true);")
    return (f"  {_lib('sgemm')}({M}, {N}, {K}, {A}, {rsa}, {csa}, {B}, {rsb}, {csb}, out0, {N}, {_flt(alpha)}, "
            f"{bias}, {rbs}, {cbs}, true);")


def _matmul(op) -> str | None:
    """MatMul (float32 or float64): one GEMM, A's batch dims folded into M where B has none, else a GEMM per
    output batch index (broadcast operands at stride 0)."""
    a, b = op.inputs[0].shape, op.inputs[1].shape
    out = op.outputs[0].shape
    if len(a) == 0 or len(b) == 0:
        return None
    f64 = _f64(op)
    K = a[-1]
    M = a[-2] if len(a) >= 2 else 1
    N = b[-1] if len(b) >= 2 else 1
    nb = len(out) - (len(a) >= 2) - (len(b) >= 2)
    batch = tuple(out[:nb])
    a_batch, b_batch = tuple(a[:-2]), tuple(b[:-2])
    lines = _args(op, "double" if f64 else "float")
    rsa, csa = K, 1
    rsb, csb = (N, 1) if len(b) >= 2 else (1, 1)
    if not b_batch and len(a) >= 2 and a_batch:
        # B is a plain matrix: fold A's batch dims into M (one big GEMM)
        Mt = _prod(a_batch) * M
        lines.append(f"  // MatMul: [{Mt}, {K}] @ [{K}, {N}] (batch dims of A folded into M)")
        lines.append(_gemm_call(op, Mt, N, K, "in0", rsa, csa, "in1", rsb, csb))
        return "\n".join(lines)

    def bstrides(shape, mat):
        # element strides of each output batch dim in an operand with batch dims `shape` (0 = broadcast)
        full = list(shape) + list(mat)
        st, acc = [], 1
        for d in reversed(full):
            st.append(acc)
            acc *= d
        st = list(reversed(st))[: len(shape)]
        res = []
        off = nb - len(shape)
        for d in range(nb):
            if d < off:
                res.append(0)
            else:
                res.append(0 if shape[d - off] == 1 and batch[d] != 1 else st[d - off])
        return res
    a_mat = a[-2:] if len(a) >= 2 else a[-1:]
    b_mat = b[-2:] if len(b) >= 2 else b[-1:]
    astr = bstrides(a_batch, a_mat)
    bstr = bstrides(b_batch, b_mat)
    cst, acc = [], M * N
    for d in reversed(batch):
        cst.append(acc)
        acc *= d
    cstr = list(reversed(cst))
    lines.append(f"  // MatMul: batch {list(batch)} of [{M}, {K}] @ [{K}, {N}]")
    if nb == 0:
        lines.append(_gemm_call(op, M, N, K, "in0", rsa, csa, "in1", rsb, csb))
    else:
        lines.append(f"  static const int64_t bshape[] = {_arr(batch)}, astr[] = {_arr(astr)}, bstr[] = {_arr(bstr)}, "
                     f"cstr[] = {_arr(cstr)};")
        lines.append(f"  {_lib('dgemm_batched' if f64 else 'sgemm_batched')}({nb}, bshape, astr, bstr, cstr, "
                     f"{M}, {N}, {K}, in0, {rsa}, {csa}, in1, {rsb}, {csb}, out0, {N}, {'1.0' if f64 else '1.0f'}, "
                     "nullptr, 0, 0);")
    return "\n".join(lines)


def _expert_matmul(op) -> str | None:
    """ExpertMatMul (float32, its expert indices int32/int64) through :func:`sf_expert_matmul`
    (``gemm.h``): the slots grouped by expert, GEMVs for an expert's one or two slots, one GEMM on
    the gathered rows of more, so each chosen expert's weight is read once."""
    x, w, experts = op.inputs[:3]
    if any(t.dtype != "float32" for t in (x, w, *op.inputs[3:], op.outputs[0])) or experts.dtype not in ("int32",
                                                                                                       "int64"):
        return None
    (t_len, j_len), (e_len, n_len, k_len) = experts.shape, w.shape
    ctype = "int32_t" if experts.dtype == "int32" else "int64_t"
    bias = "static_cast<const float*>(inputs[3])" if len(op.inputs) > 3 else "nullptr"
    return "\n".join(_args(op)[:2] + [
        f"  // ExpertMatMul: {t_len} x {j_len} slots of [1, {k_len}] @ an expert's [{n_len}, {k_len}]^T (of {e_len})",
        f"  {_lib('expert_matmul_i' + experts.dtype[3:])}({t_len * j_len}, {j_len}, "
        f"{'true' if x.ndim == 3 else 'false'}, {e_len}, {n_len}, "
        f"{k_len}, in0, in1, static_cast<const {ctype}*>(inputs[2]), {bias}, static_cast<float*>(outputs[0]));"])


def _einsum(op) -> str | None:
    """A two-operand Einsum that is a (batched) matrix product: every label is a batch label (both
    operands and the output), a row label (A and the output), a column label (B and the output) or a
    contracted label (both operands, not the output). It runs as ``sf_sgemm_batched`` with each operand
    read in place through its labels' strides (a transposed operand is just other strides). Labels of a
    kind that lie nested in every tensor that has them (``b, h`` of ``bhwc`` and ``bhwk``) are one label;
    of the row (column) labels left, one is the product's rows (columns) and the others are batch labels
    that B (A) does not have (stride 0: ViTDet's ``bhwc,hkc->bhwk``). The output's matrix is written row
    by row where its column label is contiguous, or transposed (``C^T = B^T A^T``) where its row label
    is. Other equations (contracted labels that do not nest, a label summed within one operand, repeated
    or broadcast labels, no contiguous output label) keep the generic nest, which sums one output element
    at a time ("bij,bjk->bik" at 8 x 128 x 64 x 128: 3.8 ms against onnxruntime's 0.19)."""
    from ..ops.linalg import parse_einsum

    if len(op.inputs) != 2:
        return None
    x0, x1 = op.inputs
    (la, lb), out, ext, _ = parse_einsum(op.attrs["equation"], [x0.shape, x1.shape], op.name)
    if len(set(la)) != len(la) or len(set(lb)) != len(lb) or len(set(out)) != len(out) or not out:
        return None
    if any(ext[lab] != e for labs, t in ((la, x0), (lb, x1)) for lab, e in zip(labs, t.shape)):
        return None  # a broadcast (extent-1) dim

    def strides(labs, shape):
        st, acc = {}, 1
        for lab, e in zip(reversed(labs), reversed(shape)):
            st[lab] = acc
            acc *= e
        return st
    sa, sb, so = strides(la, x0.shape), strides(lb, x1.shape), strides(out, op.outputs[0].shape)
    batch = [lab for lab in out if lab in sa and lab in sb]
    rows = [lab for lab in out if lab in sa and lab not in sb]
    cols = [lab for lab in out if lab in sb and lab not in sa]
    red = [lab for lab in la if lab in sb and lab not in out]
    if set(la) | set(lb) != set(out) | set(red):
        return None

    def groups(labels, maps):  # runs of labels nested in every map: (extent, [innermost stride in each map])
        found: list[list[str]] = []
        for lab in labels:
            if found and all(st[found[-1][-1]] == ext[lab] * st[lab] for st in maps):
                found[-1].append(lab)
            else:
                found.append([lab])
        return [(int(np.prod([ext[lab] for lab in g])), [st[g[-1]] for st in maps]) for g in found]
    rg, cg, kg = groups(rows, (sa, so)), groups(cols, (sb, so)), groups(red, (sa, sb))
    if len(kg) != 1:
        return None
    (K, (csa, rsb)), = kg
    # (extent, a stride, b stride, c stride) of each batch dim; the product's rows and columns
    dims = [(ext[lab], sa[lab], sb[lab], so[lab]) for lab in batch]
    col = next((g for g in cg if g[1][1] == 1), None)
    row = None if col else next((g for g in rg if g[1][1] == 1), None)
    if col is None and row is None and (rg or cg):
        return None  # (no contiguous output label: the generic nest)
    col = col or max(cg, key=lambda g: g[0], default=None)
    row = row or max(rg, key=lambda g: g[0], default=None)
    dims += [(g[0], g[1][0], 0, g[1][1]) for g in rg if g is not row]
    dims += [(g[0], 0, g[1][0], g[1][1]) for g in cg if g is not col]
    M, rsa, rso = (row[0], *row[1]) if row else (1, 0, 0)
    N, csb, cso = (col[0], *col[1]) if col else (1, 0, 0)
    if cso == 1 or not row:  # C = A B, rows of C at stride rso
        first, ldc = x0, rso if row else N
    else:  # C^T = B^T A^T: B's column label is C's row
        first, ldc = x1, cso if col else M
        M, N, rsa, csa, rsb, csb = N, M, csb, rsb, csa, rsa
        dims = [(e, b, a, c) for e, a, b, c in dims]
    ia, ib = (0, 1) if first is x0 else (1, 0)
    lines = _args(op)
    lines.append(f"  // Einsum {op.attrs['equation']!r}: batch {[d[0] for d in dims]} of [{M}, {K}] @ [{K}, {N}]"
                 + (" (the output transposed: B^T A^T)" if first is x1 else ""))
    if not dims:
        lines.append(f"  {_lib('sgemm')}({M}, {N}, {K}, in{ia}, {rsa}, {csa}, in{ib}, {rsb}, {csb}, out0, {ldc}, 1.0f, "
                     "nullptr, 0, 0, true);")
    else:
        lines.append(f"  static const int64_t bshape[] = {_arr([d[0] for d in dims])}, "
                     f"astr[] = {_arr([d[1] for d in dims])}, bstr[] = {_arr([d[2] for d in dims])}, "
                     f"cstr[] = {_arr([d[3] for d in dims])};")
        lines.append(f"  {_lib('sgemm_batched')}({len(dims)}, bshape, astr, bstr, cstr, {M}, {N}, {K}, in{ia}, "
                     f"{rsa}, {csa}, in{ib}, {rsb}, {csb}, out0, {ldc}, 1.0f, nullptr, 0, 0);")
    return "\n".join(lines)


def _gemm_bias(op, beta: float, lines: list[str]) -> tuple[str, int, int]:
    """The bias operand ``C`` (input 2, broadcasting to ``[M, N]``) of a GEMM as the template's
    ``(pointer, row stride, column stride)``; ``beta != 1`` scales it once into a temporary."""
    cs = op.inputs[2].shape
    full = (1,) * (2 - len(cs)) + tuple(cs)
    rbs = 0 if full[0] == 1 else full[1]
    cbs = 0 if full[1] == 1 else 1
    if beta == 1:
        return "in2", rbs, cbs
    n = _prod(cs)
    ctype, dtype = ("double", "float64") if op.inputs[2].dtype == "float64" else ("float", "float32")
    lines.append(f"  {ctype}* __restrict__ cb_ = "
                 f"static_cast<{ctype}*>(sf_workspace(0, {max(n, 1)} * sizeof({ctype})));")
    lines.append(f"  for (int64_t i = 0; i < {n}; ++i) cb_[i] = {literal(beta, dtype)} * in2[i];")
    return "cb_", rbs, cbs


def _gemm(op) -> str | None:
    ta, tb = bool(op.attrs.get("trans_a", False)), bool(op.attrs.get("trans_b", False))
    alpha, beta = float(op.attrs.get("alpha", 1.0)), float(op.attrs.get("beta", 1.0))
    a = op.inputs[0].shape
    M, N = op.outputs[0].shape
    K = a[0] if ta else a[1]
    rsa, csa = (1, M) if ta else (K, 1)
    rsb, csb = (1, K) if tb else (N, 1)
    dt = "float64" if _f64(op) else "float32"
    lines = _args(op, "double" if _f64(op) else "float")
    has_c = len(op.inputs) > 2 and beta != 0
    bias, rbs, cbs = _gemm_bias(op, beta, lines) if has_c else ("nullptr", 0, 0)
    lines.append(f"  // Gemm: {literal(alpha, dt)} * [{M}, {K}]{'ᵀ' if ta else ''} @ [{K}, {N}]{'ᵀ' if tb else ''}"
                 + (f" + {literal(beta, dt)} * C{list(op.inputs[2].shape)}" if has_c else ""))
    lines.append(_gemm_call(op, M, N, K, "in0", rsa, csa, "in1", rsb, csb, alpha, bias, rbs, cbs))
    return "\n".join(lines)


def _packed_bias(op, beta: float, lines: list[str]) -> tuple[str, int, int] | None:
    """A packed product's bias (input 2, unless ``beta`` is 0) as :func:`_gemm_bias` gives it,
    ``("nullptr", 0, 0)`` without one, ``None`` for a bias over more than one matrix of rows (which the
    generic lowering takes)."""
    if len(op.inputs) <= 2 or beta == 0:
        return "nullptr", 0, 0
    cs = op.inputs[2].shape
    if len(cs) > 2 or (len(cs) == 2 and op.inputs[0].ndim != 2):
        return None
    return _gemm_bias(op, beta, lines)


def _packed_matmul(op) -> str | None:
    """PackedMatMul: ``a`` with its leading dims folded into M, times the weight packed at compile
    time (``passes/prepack.py``), plus Gemm's bias. Float16 panels (a weight of float16 values) are
    widened as the GEMM reads them (``cpu_library/gemm.h``, ``SfHalfPrepacked``)."""
    half = op.inputs[1].dtype == "float16"
    if any(t.dtype != "float32" for k, t in enumerate(list(op.inputs) + op.outputs) if not (half and k == 1)):
        return None
    a = op.inputs[0].shape
    K, N = a[-1], int(op.attrs["n"])
    M = _prod(a[:-1])
    alpha, beta = float(op.attrs.get("alpha", 1.0)), float(op.attrs.get("beta", 1.0))
    lines = _args(op)
    if half:  # (the float16 panels' bits)
        lines[1] = "  const uint16_t* __restrict__ in1 = static_cast<const uint16_t*>(inputs[1]);"
    packed_bias = _packed_bias(op, beta, lines)
    if packed_bias is None:
        return None
    bias, rbs, cbs = packed_bias
    lines.append(f"  // PackedMatMul: {_flt(alpha)} * [{M}, {K}] @ [{K}, {N}] (packed{', float16' if half else ''})"
                 + (f" + {_flt(beta)} * C{list(op.inputs[2].shape)}" if bias != "nullptr" else ""))
    lines.append(f"  {_lib('sgemm_prepacked_f16' if half else 'sgemm_prepacked')}({M}, {N}, {K}, in0, {K}, 1, in1, "
                 f"out0, {N}, {_flt(alpha)}, {bias}, {rbs}, {cbs}, true);")
    return "\n".join(lines)


def _packed_matmul_bf16(op) -> str | None:
    """PackedMatMulBf16: ``a`` (bfloat16) with its leading dims folded into M times the bfloat16 weight
    packed at compile time, float32 sums and output, plus Gemm's bias (``cpu_library/gemm_bf16.h``: AMX
    tiles, AVX-512 BF16, or both operands widened for the float32 GEMM)."""
    a, out = op.inputs[0], op.outputs[0]
    if a.dtype != "bfloat16" or op.inputs[1].dtype != "bfloat16" or out.dtype not in ("float32", "bfloat16") \
            or any(t.dtype != "float32" for t in op.inputs[2:]):
        return None
    K, N = a.shape[-1], int(op.attrs["n"])
    M = _prod(a.shape[:-1])
    alpha, beta = float(op.attrs.get("alpha", 1.0)), float(op.attrs.get("beta", 1.0))
    lines = ["  const sf_bf16* in0 = static_cast<const sf_bf16*>(inputs[0]);",
             "  const sf_bf16* in1 = static_cast<const sf_bf16*>(inputs[1]);"]
    if len(op.inputs) > 2:
        lines.append("  const float* __restrict__ in2 = static_cast<const float*>(inputs[2]);")
    ct = "sf_bf16" if out.dtype == "bfloat16" else "float"
    lines.append(f"  {ct}* __restrict__ out0 = static_cast<{ct}*>(outputs[0]);")
    packed_bias = _packed_bias(op, beta, lines)
    if packed_bias is None:
        return None
    bias, rbs, cbs = packed_bias
    lines.append(f"  // PackedMatMulBf16: {_flt(alpha)} * [{M}, {K}] (bfloat16) @ [{K}, {N}] (bfloat16, packed)"
                 + (f" + {_flt(beta)} * C{list(op.inputs[2].shape)}" if bias != "nullptr" else "") + " in float32"
                 + (", stored bfloat16" if ct == "sf_bf16" else ""))
    lines.append(f"  {_lib('bgemm_prepacked_bf16' if ct == 'sf_bf16' else 'bgemm_prepacked')}({M}, {N}, {K}, in0, "
                 f"{K}, in1, out0, {N}, {_flt(alpha)}, {bias}, {rbs}, {cbs}, true);")
    return "\n".join(lines)


def _packed_matmul_integer(op) -> str | None:
    """PackedMatMulInteger: ``a`` (int8/uint8) with its leading dims folded into M times the int8
    weight packed at compile time, in int32 (``cpu_library/gemm_int8.h``); a zero point per row of a
    batched ``a`` runs one GEMM per matrix."""
    a, out = op.inputs[0], op.outputs[0]
    azp = op.inputs[3] if len(op.inputs) > 3 else None
    if a.dtype not in ("int8", "uint8") or out.dtype != "int32" or (azp is not None and azp.dtype != a.dtype):
        return None
    K, N = a.shape[-1], int(op.attrs["n"])
    rows = a.shape[-2] if a.ndim >= 2 else 1
    per_row = azp is not None and int(np.prod(azp.shape)) > 1
    count, M = (_prod(a.shape[:-2]), rows) if per_row else (1, _prod(a.shape[:-1]))
    lines = ["  const unsigned char* in0 = static_cast<const unsigned char*>(inputs[0]);",
             "  const int8_t* in1 = static_cast<const int8_t*>(inputs[1]);",
             "  const int32_t* in2 = static_cast<const int32_t*>(inputs[2]);",
             f"  const void* zp = {'inputs[3]' if azp is not None else 'nullptr'};",
             "  int32_t* out0 = static_cast<int32_t*>(outputs[0]);",
             f"  // PackedMatMulInteger: {count} x [{M}, {K}] ({a.dtype}) @ [{K}, {N}] (int8, packed) in int32",
             f"  for (int64_t b = 0; b < {count}; ++b)",
             f"    {_lib('igemm_prepacked')}({M}, {N}, {K}, in0 + b * {M * K}, {str(a.dtype == 'int8').lower()}, zp, "
             f"{str(per_row).lower()}, in1, in2, out0 + b * {M * N}, {N}, true);"]
    return "\n".join(lines)


def _packed_conv_integer(op) -> str | None:
    """PackedConvInteger: per image and group, the integer GEMM of the weight's prepared rows by the
    image's im2col matrix packed into the GEMM's panels, in int32 (``cpu_library/conv_int8.h``)."""
    x, out = op.inputs[0], op.outputs[0]
    xzp = op.inputs[3] if len(op.inputs) > 3 else None
    if x.dtype not in ("int8", "uint8") or out.dtype != "int32" or x.ndim not in (3, 4) \
            or (xzp is not None and (xzp.dtype != x.dtype or xzp.size != 1)):
        return None
    kern = tuple(int(k) for k in op.attrs["kernel"])
    geo = _packed_conv_geometry(op)
    oc, group, rows = int(op.attrs["oc"]), int(op.attrs.get("group", 1)), op.inputs[1].shape[0]
    return "\n".join([
        f"  // PackedConvInteger: {x.shape[0]} images ({x.dtype}), {group} group(s) of [{oc // group}, "
        f"{x.shape[1] // group * _prod(kern)}] (int8 rows, packed) @ im2col [.., {_prod(out.shape[2:])}] in int32",
        f"  static const SfConvGeom g = {{{', '.join(str(int(v)) for v in geo)}}};",
        f"  {_lib('iconv2d')}(inputs[0], {str(x.dtype == 'int8').lower()}, "
        f"{'inputs[3]' if xzp is not None else 'nullptr'}, "
        "static_cast<const uint8_t*>(inputs[1]), static_cast<const int32_t*>(inputs[2]), "
        f"static_cast<int32_t*>(outputs[0]), {x.shape[0]}, {oc}, {group}, g, {rows});"])


def _packed_conv_bf16(op) -> str | None:
    """PackedConvBf16: per image and group, the bfloat16 GEMM of the weight's rows by the image's im2col
    matrix packed into the GEMM's panels of pairs, in float32 with the bias, then clamped (a folded Relu or
    Clip), stored float32 or rounded to bfloat16 (``cpu_library/conv_bf16.h``)."""
    x, out = op.inputs[0], op.outputs[0]
    bias = op.inputs[2] if len(op.inputs) > 2 else None
    if x.dtype != "bfloat16" or out.dtype not in ("float32", "bfloat16") or x.ndim not in (3, 4) \
            or (bias is not None and (bias.dtype != "float32" or bias.shape != (int(op.attrs["oc"]),))):
        return None
    oc, group = int(op.attrs["oc"]), int(op.attrs.get("group", 1))
    lo, hi = op.attrs.get("lo"), op.attrs.get("hi")
    clamp = lo is not None or hi is not None
    bounds = f"{_flt(-math.inf if lo is None else lo)}, {_flt(math.inf if hi is None else hi)}" if clamp else ""
    return "\n".join([
        f"  // PackedConvBf16: {x.shape[0]} images, {group} group(s) of [{oc // group}, "
        f"{x.shape[1] // group * _prod(op.attrs['kernel'])}] "
        f"(bfloat16 rows) @ im2col [.., {_prod(out.shape[2:])}] in float32" + (", then clamped" if clamp else "")
        + (", stored bfloat16" if out.dtype == "bfloat16" else ""),
        f"  static const SfConvGeom g = {{{', '.join(str(int(v)) for v in _packed_conv_geometry(op))}}};",
        f"  {_lib('bconv2d')}(static_cast<const sf_bf16*>(inputs[0]), static_cast<const sf_bf16*>(inputs[1]), "
        f"{'static_cast<const float*>(inputs[2])' if bias is not None else 'nullptr'}, "
        f"outputs[0], {x.shape[0]}, {oc}, {group}, g, {str(out.dtype == 'bfloat16').lower()}, "
        + (f"true, {bounds});" if clamp else "false, 0.0f, 0.0f);")])


def _packed_conv_geometry(op) -> tuple:
    """SfConvGeom's fields for a packed conv of 1 or 2 spatial dims (a 1-D one as one row)."""
    x, out = op.inputs[0], op.outputs[0]
    n_sp = x.ndim - 2
    kern = tuple(int(k) for k in op.attrs["kernel"])
    strides = tuple(op.attrs.get("strides") or (1,) * n_sp)
    dil = tuple(op.attrs.get("dilations") or (1,) * n_sp)
    pads = tuple(op.attrs.get("pads") or (0,) * (2 * n_sp))
    if n_sp == 1:
        return (x.shape[1], 1, x.shape[2], 1, kern[0], 1, strides[0], 1, dil[0], 0, pads[0], 1, out.shape[2])
    return (x.shape[1], x.shape[2], x.shape[3], kern[0], kern[1], strides[0], strides[1], dil[0], dil[1],
            pads[0], pads[1], out.shape[2], out.shape[3])


def _matmul_nbits(op) -> str | None:
    """MatMulNBits: ``a`` (float32) with its leading dims folded into M times the low-bit weight as
    stored (``cpu_library/lowbit.h``): a GEMV on the codes for one or two rows, else the GEMM with
    each weight panel dequantized into its packing buffer."""
    a, bq = op.inputs[0], op.inputs[1]
    if a.dtype != "float32" or op.outputs[0].dtype != "float32" or op.attrs.get("operand_dtype"):
        return None  # (half operands: the cuda target's rounding; the generic kernel computes it)
    K, M = a.shape[-1], _prod(a.shape[:-1])
    N, blocks = bq.shape[0], bq.shape[1]
    bits, bs = int(op.attrs["bits"]), int(op.attrs["block_size"])
    zp = "static_cast<const float*>(inputs[3])" if len(op.inputs) > 3 else "nullptr"
    return "\n".join([
        f"  // MatMulNBits: [{M}, {K}] @ [{K}, {N}] ({bits}-bit codes, blocks of {bs})",
        f"  const SfNbits w{{static_cast<const uint8_t*>(inputs[1]), static_cast<const float*>(inputs[2]), {zp}, "
        f"{K}, {N}, {bs}, {blocks}, {bits}}};",
        f"  {_lib('matmul_nbits')}({M}, w, static_cast<const float*>(inputs[0]), static_cast<float*>(outputs[0]));"])


def _flt(v: float) -> str:
    return literal(v, "float32")


def _conv3d(op, fused=None) -> str | None:
    """Conv over 3 spatial dims through :func:`sf_conv3d` (the 2-D conv's tiles per output depth slice, B
    read from the padded volume); with ``fused``, the ops after it that its kernels finish as they store
    (:func:`_kernel_finish`: a residual Add, then a Relu or Clip), else ``None`` (the group is refused).
    ``None`` (the generic nest) also where a group's padded volume has 2^31 floats or more (the kernels'
    offsets are int32)."""
    x, w, out = op.inputs[0].shape, op.inputs[1].shape, op.outputs[0].shape
    g = int(op.attrs.get("group", 1))
    oc, icg = w[0], w[1]
    strides = tuple(op.attrs.get("strides") or (1, 1, 1))
    dil = tuple(op.attrs.get("dilations") or (1, 1, 1))
    pads = tuple(op.attrs.get("pads") or (0,) * 6)
    padded = [max(x[2 + a] + pads[a], (out[2 + a] - 1) * strides[a] + (w[2 + a] - 1) * dil[a] + 1) for a in range(3)]
    if icg * _prod(padded) >= 2 ** 31:
        return None
    geom = (icg, *x[2:], *w[2:], *strides, *dil, *pads[:3], *out[2:])
    index, xin, win, bias = _conv_io(op, fused)
    finish = ", nullptr, SfClamp{}"  # (the residual and the clamp)
    if fused is not None:
        simple = _kernel_finish(fused, index)
        if simple is None:
            return None
        finish = f", {simple[0]}, {simple[1]}"
    lines = _args(fused or op)
    lines.append(f"  // Conv 3-D: {x[0]} images, {g} group(s) of [{oc // g}, {icg * _prod(w[2:])}] @ "
                 f"[{icg * _prod(w[2:])}, {_prod(out[2:])}] read from the padded volume (kernel {list(w[2:])}, "
                 f"strides {list(strides)}, dilations {list(dil)}, pads {list(pads)})")
    lines.append(f"  static const SfConv3Geom geom = {_arr(geom)};")
    if fused is not None:
        lines.append("  // finished as stored: bias -> " + " -> ".join(
            f"{m.op_type}({m.attrs.get('fn') or m.attrs.get('kind') or m.attrs.get('to')})" for m in fused.members[1:]))
    lines.append(f"  {_lib('conv3d')}({xin}, {win}, {bias or 'nullptr'}, out0, geom, {x[0]}, {g}, {oc // g}{finish});")
    return "\n".join(lines)


def _conv_io(op, fused) -> tuple[dict[int, int], str, str, str | None]:
    """``(index, x, w, bias)``: the kernel's names of a conv's input, weight and bias (``None`` without
    one), arguments of ``op``'s own kernel or of ``fused``'s (``index``: tensor id -> argument)."""
    index = {id(t): k for k, t in enumerate((fused or op).inputs)}
    x, w = f"in{index[id(op.inputs[0])]}", f"in{index[id(op.inputs[1])]}"
    return index, x, w, f"in{index[id(op.inputs[2])]}" if len(op.inputs) > 2 else None


def _conv(op, fused=None) -> str | None:
    """Conv over 1 or 2 spatial dims through :func:`sf_conv2d`; with ``fused`` (a fused op whose first
    member is ``op``, the others element-wise ops on its output), the kernel of the whole group: its
    tiles are finished by the bias and those ops (:func:`_conv_epilogue`)."""
    x = op.inputs[0].shape
    blocked = [bool(op.attrs.get(k)) for k in ("blocked_in", "blocked_out")]
    if blocked[0]:  # [N, C / 16, H, W, 16] (passes/layout.py): the conv's geometry is the logical shape's
        x = (x[0], x[1] * x[-1]) + tuple(x[2:-1])
    n_sp = len(x) - 2
    if n_sp == 3 and op.op_type == "Conv":
        return _conv3d(op, fused)
    if n_sp not in (1, 2):
        return None
    g = int(op.attrs.get("group", 1))
    packed = op.op_type == "PackedConv"  # weights in GEMM panels: sf_conv2d_packed
    wino = int(op.attrs["m"]) if op.op_type == "WinogradConv" else 0  # sf_conv2d_winograd<m>
    if packed:
        oc, icg, kern = int(op.attrs["oc"]), x[1] // g, tuple(int(k) for k in op.attrs["kernel"])
    elif wino:
        if n_sp != 2:
            return None
        oc, icg, kern = int(op.attrs["oc"]), x[1], (3, 3)
    else:
        w = op.inputs[1].shape
        oc, icg, kern = w[0], w[1], tuple(w[2:])
    ocg = oc // g
    # sf_conv_depthwise: one input channel per group (a vector holds 16 channels, so with fewer than 16 of them
    # the lanes are mostly idle: a one-channel signal's Conv1d to 512 outputs, wav2vec2's first, took 37x
    # onnxruntime's time; such convs take the GEMM of each group where it applies)
    depthwise = (not packed and not wino and icg == 1 and g == x[1]
                 and not (g < 16 and ocg >= 4 and _prod(kern) >= 4))
    if op.op_type == "Conv" and any(blocked) and not (depthwise and ocg == 1):
        return None  # of plain Convs, only depthwise ones of one output per channel read or write the layout
    if (icg * _prod(kern) < 4 or ocg < 4) and not depthwise:
        return None  # thin groups that are not depthwise: the generic nest
    strides = tuple(op.attrs.get("strides") or (1,) * n_sp)
    dil = tuple(op.attrs.get("dilations") or (1,) * n_sp)
    pads = tuple(op.attrs.get("pads") or (0,) * (2 * n_sp))
    out = op.outputs[0].shape
    if blocked[1]:
        out = (out[0], out[1] * out[-1]) + tuple(out[2:-1])
    if n_sp == 1:
        H, W, KH, KW = 1, x[2], 1, kern[0]
        SH, SW, DH, DW, PT, PL = 1, strides[0], 1, dil[0], 0, pads[0]
        OH, OW = 1, out[2]
    else:
        H, W = x[2], x[3]
        KH, KW = kern
        SH, SW = strides
        DH, DW = dil
        PT, PL = pads[0], pads[1]
        OH, OW = out[2], out[3]
    Nb = x[0]
    P = OH * OW
    KK = icg * KH * KW
    direct = KH == 1 and KW == 1 and SH == 1 and SW == 1 and PT == 0 and PL == 0 and OH == H and OW == W
    epi, finish, res, clamp = None, False, "nullptr", "SfClamp{}"
    index, xin, win, bias = _conv_io(op, fused)
    bias = bias or "nullptr"
    if fused is None:
        lines = _args(op)
    else:
        simple = _kernel_finish(fused, index)
        if simple is not None and depthwise and simple[0] != "nullptr":
            simple = None  # the depthwise kernels clamp (and round) only; a residual add goes to the epilogue
        if simple is not None:  # the kernels (PackedConv's transposition, Winograd's output transform) finish
            (res, clamp), finish = simple, True
        else:
            epi = _conv_epilogue(fused, oc, OH, OW, None if bias == "nullptr" else
                                 f"{bias}[c_ * 16 + l_]" if blocked[1] else f"{bias}[c_]")
            if epi is None:
                return None
            bias = "nullptr"
        lines = _args(fused)
    geometry = f"{KH}x{KW}, stride {SH}x{SW}, dilation {DH}x{DW}, pad {PT},{PL}"
    if depthwise:
        lines.append(f"  // depthwise Conv: {Nb} images, {g} channels, {ocg} output(s) each ({geometry})"
                     + "".join(f"; {w} blocked [N, C/16, H, W, 16]" for w, b in zip(("input", "output"), blocked) if b))
    elif wino:
        a = wino + 2
        lines.append(f"  // WinogradConv F({wino}x{wino}, 3x3): {Nb} images, {a * a} GEMMs [tiles, {icg}] @ [{icg}, {oc}] "
                     f"per chunk of tiles (pad {PT},{PL})"
                     + "".join(f"; {w} blocked [N, C/16, H, W, 16]" for w, b in zip(("input", "output"), blocked) if b))
    elif packed:
        lines.append(f"  // PackedConv: {Nb} images" + (f", {g} groups" if g > 1 else "") + f" of [{P}, {KK}] @ [{KK}, "
                     f"{ocg}] (weights packed), transposed; "
                     + ("1x1: the image is A" if direct else f"A = im2col of the image ({geometry})")
                     + "".join(f"; {w} blocked [N, C/16, H, W, 16]" for w, b in zip(("input", "output"), blocked) if b))
    else:
        lines.append(f"  // Conv: {Nb} images, {g} group(s) of [{ocg}, {KK}] @ [{KK}, {P}]"
                     + (" (1x1: the image is B)" if direct else f", B = im2col packed from the image ({geometry})"))
    lines.append(f"  static const SfConvGeom geom = {{{icg}, {H}, {W}, {KH}, {KW}, {SH}, {SW}, {DH}, {DW}, {PT}, {PL}, "
                 f"{OH}, {OW}" + (f", {g}" if packed and g > 1 else "") + "};")
    direct_arg = "true" if direct else "false"
    blk = " | ".join(f for f, b in zip(("SF_BLK_IN", "SF_BLK_OUT"), blocked) if b) or "0"
    if depthwise:
        fn, args = "conv_depthwise", f"{xin}, {win}, {bias}, out0, geom, {Nb}, {g}, {ocg}, {blk}"
    elif wino:
        fn, args = f"conv2d_winograd{wino}", f"{xin}, {win}, {bias}, out0, geom, {Nb}, {oc}, {blk}"
    elif packed:
        fn, args = "conv2d_packed", f"{xin}, {win}, {bias}, out0, geom, {Nb}, {oc}, {direct_arg}, {blk}"
    else:
        fn, args = "conv2d", f"{xin}, {win}, {bias}, out0, geom, {Nb}, {g}, {ocg}, {direct_arg}"
    if finish:
        members = list(fused.members)[1:]
        lines.append("  // the tiles are finished as they are stored: bias -> "
                     + " -> ".join(f"{m.op_type}({m.attrs.get('fn') or m.attrs.get('kind')})" for m in members))
    elif epi is not None:
        lines += epi
    # (then the epilogue, its context, the residual (none for the depthwise kernels) and the clamp)
    tail = ("epi_, &ctx_" if epi is not None else "nullptr, nullptr") + ("" if depthwise else f", {res}")
    lines.append(f"  {_lib(fn)}({args}, {tail}, {clamp});")
    return "\n".join(lines)


def _conv_transpose(op, fused=None) -> str | None:
    """ConvTranspose over 1 or 2 spatial dims through :func:`sf_conv_transpose2d` (a GEMM into columns,
    then col2im); with ``fused``, element-wise ops after it finish each output plane (:func:`_conv_epilogue`).
    Over 3 spatial dims through :func:`sf_conv_transpose3d` (the same by slabs of input slices; no fused
    ops). ``None`` (the generic nest) when a group's product is too thin for the GEMM (depthwise-like)."""
    x, w = op.inputs[0].shape, op.inputs[1].shape
    n_sp = len(x) - 2
    if n_sp not in (1, 2, 3) or (n_sp == 3 and fused is not None):
        return None
    g = int(op.attrs.get("group", 1))
    icg, ocg, kern = x[1] // g, w[1], tuple(w[2:])
    if icg < 4 or ocg * _prod(kern) < 8:
        return None
    strides = tuple(op.attrs.get("strides") or (1,) * n_sp)
    dil = tuple(op.attrs.get("dilations") or (1,) * n_sp)
    pads = tuple(op.attrs.get("pads") or (0,) * (2 * n_sp))
    out = tuple(op.attrs["output_shape"])
    what = (f"  // ConvTranspose: {x[0]} images, {g} group(s) of columns [{ocg * _prod(kern)}, {icg}] @ "
            f"[{icg}, {_prod(x[2:])}], folded into [{ocg}, {'x'.join(map(str, out))}] "
            f"(kernel {'x'.join(map(str, kern))}, strides {list(strides)}, dilations {list(dil)}, "
            f"pads {list(pads)})")
    if n_sp == 3:
        bias = "in2" if len(op.inputs) > 2 else "nullptr"
        return "\n".join(_args(op) + [what, f"  static const SfConv3Geom geom = "
                                            f"{_arr((icg, *x[2:], *kern, *strides, *dil, *pads[:3], *out))};",
                                     f"  {_lib('conv_transpose3d')}(in0, in1, {bias}, out0, geom, {x[0]}, {g}, "
                                     f"{ocg});"])
    if n_sp == 1:
        geom = (icg, 1, x[2], 1, kern[0], 1, strides[0], 1, dil[0], 0, pads[0], 1, out[0])
    else:
        geom = (icg, x[2], x[3], *kern, *strides, *dil, pads[0], pads[1], *out)
    epi = None
    _, xin, win, bias = _conv_io(op, fused)
    if fused is None:
        lines = _args(op)
        bias = bias or "nullptr"
    else:
        epi = _conv_epilogue(fused, g * ocg, geom[-2], geom[-1], bias and f"{bias}[c_]")
        if epi is None:
            return None
        lines = _args(fused) + epi
        bias = "nullptr"
    lines.append(what)
    lines.append(f"  static const SfConvGeom geom = {_arr(geom)};")
    extra = ", nullptr, nullptr" if epi is None else ", epi_, &ctx_"
    lines.append(f"  {_lib('conv_transpose2d')}({xin}, {win}, {bias}, out0, geom, {x[0]}, {g}, {ocg}{extra});")
    return "\n".join(lines)


def _attention(op) -> str | None:
    """Attention (float32 Q/K/V and output; an optional float or bool mask, ``nonpad_kv_seqlen``, causal,
    windows, softcap, attention sinks, grouped K/V heads, 3-D or 4-D forms) through :func:`sf_attention`; also the float32 form
    FuseAttention makes on the cpu target (``acc_dtype`` float32: the sums scaled by ``scale``; one or two
    extra biases in place of a mask, added in turn, a row whose every logit is -inf NaN as a Softmax gives it:
    T5's position bias and mask, BLOOM's ALiBi and mask), with its probabilities rounded to float16's or
    bfloat16's values where it has ``probs_dtype`` (precision float16/bfloat16 on float32 operands that the
    precision pass rounded). Half operands, more extra biases and the ``qk_matmul_output`` modes keep the
    generic nest."""
    a = op.attrs
    extra_biases = a.get("extra_biases", 0)
    probs = a.get("probs_dtype")
    if a.get("acc_dtype") not in (None, "float32") or probs not in (None, "float16", "bfloat16") \
            or (probs and not a.get("acc_dtype")) or a.get("qk_mode") is not None \
            or extra_biases > 2 or (extra_biases and (a.get("has_mask") or a.get("has_nonpad"))) \
            or a.get("softmax_dtype") not in (None, "float32") or not isinstance(a.get("past_len", 0), int):
        return None
    q, k, v = op.inputs[:3]
    y = op.outputs[0]
    if any(t.dtype != "float32" for t in (q, k, v, y)):
        return None
    b_, hq, hk, s_len, l_len, d, dv = op._geometry(q, k, v)
    extra = list(op.inputs[3:])
    mask = extra.pop(0) if a.get("has_mask") or extra_biases else None
    nonpad = extra.pop(0) if a.get("has_nonpad") else None
    sink = extra.pop(0) if a.get("has_sink") else None
    bias2 = extra.pop(0) if extra_biases == 2 else None
    if (mask is not None and mask.dtype not in ("float32", "bool")) or (extra_biases and mask.dtype != "float32") \
            or (nonpad is not None and nonpad.dtype != "int64") or (sink is not None and sink.dtype != "float32") \
            or (bias2 is not None and (bias2.dtype != "float32" or mask.shape[-1] != l_len
                                       or bias2.ndim < 1 or bias2.shape[-1] != l_len)):
        return None

    def strides(t, heads, rows, width):  # (batch, head, row) element strides of a 4-D or 3-D [B, N, H*E] tensor
        return (heads * rows * width, rows * width, width) if t.ndim == 4 else (rows * heads * width, width,
                                                                               heads * width)
    ys = strides(y, hq, s_len, dv)
    def bias_strides(m):  # (batch, head, row) element strides of a bias broadcast to [B, H, S, L], 0 = broadcast
        full, acc, st = (1,) * (4 - m.ndim) + tuple(m.shape), 1, []
        for e in reversed(full):
            st.append(0 if e == 1 else acc)
            acc *= e
        return tuple(reversed(st))[:3]
    ms, mlen, mkind = (0, 0, 0), 0, 0
    if mask is not None:
        mkind = 1 if mask.dtype == "float32" else 2
        ms, mlen = bias_strides(mask), int(mask.shape[-1])  # keys contiguous (a key dim of 1: mlen 1)
    # the scores' scale: scale_sqrt squared (ONNX scales Q and K), or the scale itself (acc_dtype: after the sum)
    c2 = np.float32(a.get("scale", 1.0)) if a.get("acc_dtype") else np.float32(a.get("scale_sqrt", 1.0)) ** 2
    phalf = {None: 0, "float16": 1, "bfloat16": 2}[probs]  # (SfAttn's phalf)
    lines = _args(op)
    mask_arg = "inputs[3]" if mask is not None else "nullptr"
    np_arg = f"static_cast<const int64_t*>(inputs[{3 + (mask is not None)}])" if nonpad is not None else "nullptr"
    sink_arg = (f"static_cast<const float*>(inputs[{3 + (mask is not None) + (nonpad is not None)}])"
                if sink is not None else "nullptr")
    bias2_arg = "static_cast<const float*>(inputs[4])" if bias2 is not None else "nullptr"
    what = (", causal" if a.get("is_causal") else "") + (", mask" if mask is not None else "") + \
        (", sinks" if sink is not None else "") + (", second bias" if bias2 is not None else "") + \
        (f", {probs} probabilities" if probs else "")
    lines.append(f"  // Attention: {b_} x {hq} heads (K/V {hk}) of softmax([{s_len}, {d}] @ [{d}, {l_len}]) @ "
                 f"[{l_len}, {dv}]{what}")
    lines.append(f"  static const SfAttn cfg = {{{b_}, {hq}, {hk}, {s_len}, {l_len}, {d}, {dv}, "
                 f"{_arr(strides(q, hq, s_len, d))}, {_arr(strides(k, hk, l_len, d))}, "
                 f"{_arr(strides(v, hk, l_len, dv))}, {_arr(ys)}, {_flt(c2)}, {_flt(a.get('softcap', 0.0))}, "
                 f"{'true' if a.get('is_causal') else 'false'}, {int(a.get('past_len', 0))}, "
                 f"{int(a.get('left_window', -1))}, {int(a.get('right_window', -1))}, {mkind}, {_arr(ms)}, {mlen}, "
                 f"{'true' if nonpad is not None else 'false'}, {'true' if extra_biases else 'false'}, "
                 f"{'true' if bias2 is not None else 'false'}, "
                 f"{_arr(bias_strides(bias2) if bias2 is not None else (0, 0, 0))}, "
                 f"{phalf}}};")
    lines.append(f"  {_lib('attention')}(in0, in1, in2, {mask_arg}, {np_arg}, {sink_arg}, {bias2_arg}, out0, cfg);")
    return "\n".join(lines)


def _kernel_finish(fused, index: dict[int, int]) -> tuple[str, str] | None:
    """``(residual, clamp)`` where the ops after ``fused``'s conv are those the conv kernels apply as
    they store their output (``SfFin`` in :func:`sf_conv2d`, ``PackedConv``'s transposition,
    Winograd's output transform, the depthwise kernels' stores): an Add of a tensor shaped as the
    output (``residual``: its argument, else ``"nullptr"``), then a Relu or a Clip (``clamp``: an
    ``SfClamp`` literal, ``"SfClamp{}"`` without), either optional, and a float16 or bfloat16 model's roundings
    (``RoundHalf``, all to one type: after the conv and after the Add, or anywhere without one; ``SfClamp``'s
    ``half``: 1 float16, 2 bfloat16); else ``None`` (the generic epilogue)."""
    members = list(fused.members)
    prev = members[0].outputs[0]
    shape = tuple(prev.shape)
    res, clamp = "nullptr", None
    rounded: list[str] = []  # what each RoundHalf followed: "conv", "add" or "clamp"
    halves: set[str] = set()  # the types they round to
    for m in members[1:]:
        out = m.outputs[0]
        if len(m.outputs) != 1 or tuple(out.shape) != shape or out.dtype != "float32" \
                or not any(t is prev for t in (m.inputs if m.op_type == "Binary" else m.inputs[:1])):
            return None
        if m.op_type == "RoundHalf" and m.attrs.get("to") in ("float16", "bfloat16"):
            rounded.append("clamp" if clamp else "add" if res != "nullptr" else "conv")
            halves.add(m.attrs["to"])
        elif clamp:
            return None  # nothing but a rounding after the clamp
        elif m.op_type == "Activation" and m.attrs.get("kind") == "relu":
            clamp = (0.0, math.inf)
        elif m.op_type == "Clip":
            lo, hi = m.attrs.get("lo"), m.attrs.get("hi")
            clamp = (-math.inf if lo is None else lo, math.inf if hi is None else hi)
        elif m.op_type == "Binary" and m.attrs.get("fn") == "add" and res == "nullptr" and len(m.inputs) == 2:
            other = [t for t in m.inputs if t is not prev]
            if len(other) != 1 or tuple(other[0].shape) != shape or other[0].dtype != "float32" \
                    or id(other[0]) not in index:
                return None
            res = f"in{index[id(other[0])]}"
        else:
            return None
        prev = out
    # half roundings: the kernels round after the bias and after the residual, then clamp (the bounds values of
    # the half type, so that a rounding after the clamp is the same); without a residual one rounding anywhere
    from ..ir.expr import numpy_type

    if len(halves) > 1:
        return None
    half = {"float16": 1, "bfloat16": 2}[halves.pop()] if halves else 0
    if half and res != "nullptr" and (rounded[0] != "conv" or not set(rounded[1:]) & {"add", "clamp"}):
        return None
    nt = np.float16 if half == 1 else numpy_type("bfloat16")
    if half and clamp and any(np.isfinite(v) and float(np.float32(v).astype(nt)) != v for v in clamp):
        return None
    if clamp is None:
        return res, f"SfClamp{{false, 0.0f, 0.0f, {half}}}" if half else "SfClamp{}"
    lo, hi = (_flt(v) for v in clamp)
    return res, f"SfClamp{{true, {lo}, {hi}{f', {half}' if half else ''}}}"


def _flat_plane(value, axes, shape):
    """``value`` (an epilogue member's element, over ``axes`` of a 4-D output ``shape``) with the row
    axis replaced by 0, so that the column axis runs over a channel's flat pixels; ``None`` unless the
    two axes appear only as the last two indices of reads of tensors whose last two dims are the
    output's (there the flat index is the same)."""
    from ..ir.expr import Const, TensorElement, Var
    from .lower import substitute

    h, w = axes[-2], axes[-1]
    memo: dict[int, bool] = {}

    def ok(e) -> bool:
        k = id(e)
        if k not in memo:
            if isinstance(e, Var):
                memo[k] = e is not h and e is not w
            elif isinstance(e, TensorElement) and len(e.indices) >= 2 and e.indices[-2] is h \
                    and e.indices[-1] is w and tuple(e.tensor.shape[-2:]) == tuple(shape[-2:]):
                memo[k] = all(ok(i) for i in e.indices[:-2])
            else:
                memo[k] = all(ok(c) for c in e.children())
        return memo[k]

    return substitute(value, {h: Const(0)}) if ok(value) else None


def _epilogue_values(fused, chain: bool = False) -> list | None:
    """The element-wise members after a template's op (``fused.members[0]``) as ``[(axes, value)]``,
    one per member: its value at one output element over its axes, the template's value read as the
    local ``v_`` and each earlier member's as ``t<k>_`` (k from 1; :func:`_epilogue_stmts` prints
    them). ``None`` unless every later member has one float32 output of the template's shape,
    computed element by element (no reductions), reads earlier members' values only at its own
    index (a chain, or a graph such as GELU's ``x * f(x)``; ``chain``: the previous member's only)
    and the group's inputs at indices inside them (or constants)."""
    from ..ir.expr import BinOp, Const, Reduce, TensorElement
    from ..ir.task import GridCompute
    from .lower import Buffer, Local, transform

    members = list(fused.members)
    shape = tuple(members[0].outputs[0].shape)
    index = {id(t): k for k, t in enumerate(fused.inputs)}
    local = {id(members[0].outputs[0]): Local("v_", "float32")}
    values = []
    for n, m in enumerate(members[1:], 1):
        task = m.task
        if len(m.outputs) != 1 or tuple(m.outputs[0].shape) != shape or m.outputs[0].dtype != "float32" \
                or task.is_extern or len(task.outputs) != 1 or not isinstance(task.outputs[0], GridCompute):
            return None
        gc = task.outputs[0]
        axes = list(gc.axes)
        if len(axes) != len(shape):
            return None
        source = {id(ph): t for ph, t in zip(task.inputs, m.inputs)}
        ok = [True]
        prev = members[n - 1].outputs[0]

        def read(old, new, axes=axes, source=source, ok=ok, prev=prev):
            if isinstance(old, Reduce):
                ok[0] = False
                return None
            if not (isinstance(new, TensorElement) and id(new.tensor) in source):
                return None
            t = source[id(new.tensor)]
            if id(t) in local:  # an earlier member's value: only at this element
                if len(new.indices) != len(axes) or not all(i is a for i, a in zip(new.indices, axes)) \
                        or (chain and t is not prev):
                    ok[0] = False
                return local[id(t)]
            k = index.get(id(t))
            if k is None:
                ok[0] = False
                return None
            for i, d in zip(new.indices, t.shape):
                shift = 0  # an axis plus a constant (a rank's slice of an input: LocalSlice)
                if isinstance(i, BinOp) and i.op == "add" and isinstance(i.b, Const) \
                        and isinstance(i.b.value, (int, np.integer)) and int(i.b.value) >= 0:
                    i, shift = i.a, int(i.b.value)
                pos = next((p for p, a in enumerate(axes) if i is a), None)
                inside = (pos is not None and shape[pos] + shift <= d) or (
                    not shift and isinstance(i, Const) and isinstance(i.value, (int, np.integer))
                    and 0 <= int(i.value) < d)
                if not inside:
                    ok[0] = False
            return TensorElement(Buffer(f"in{k}", t.shape, t.dtype, "input", k), new.indices)

        value = transform(gc.value, read)
        if not ok[0]:
            return None
        values.append((axes, value))
        local[id(m.outputs[0])] = Local(f"t{n}_", "float32")
    return values


def _epilogue_stmts(values: list, names: tuple[str, ...]) -> list[str] | None:
    """:func:`_epilogue_values`' values as C++ statements, the element's axes named ``names``: each
    member's value a local ``t<k>_``, the last one assigned to ``v_``; ``None`` if one cannot be
    printed."""
    from .cpp import _Printer

    printer = _Printer(None)
    stmts = []
    for n, (axes, value) in enumerate(values, 1):
        for a, name in zip(axes, names):
            printer.var_names[id(a)] = name
            printer.used_names.add(name)
        try:
            text = printer.expr(value, "float32")
        except Exception:  # noqa: BLE001 - anything the printer cannot print stays generic
            return None
        stmts.append(f"v_ = {text};" if n == len(values) else f"const float t{n}_ = {text};")
    return stmts


def _conv_epilogue(fused, oc: int, OH: int, OW: int, bias: str | None) -> list[str] | None:
    """C++ defining ``epi_`` and ``ctx_`` for :func:`sf_conv2d`: per element of a tile, ``v_`` = the
    conv's value (+ ``bias``), then the later members of ``fused`` (:func:`_epilogue_values`). A 5-D
    output is the blocked layout ``[N, C/16, H, W, 16]``
    (passes/layout.py): its axes are ``n_, c_`` (the block), ``h_, w_, l_`` (the lane), ``bias`` indexed
    so, and the epilogue's channel range may end inside a block."""
    members = list(fused.members)
    shape = tuple(members[0].outputs[0].shape)
    names = {4: ("n_", "c_", "h_", "w_"), 5: ("n_", "c_", "h_", "w_", "l_")}.get(len(shape), ("n_", "c_", "w_"))
    # (the blocked layout's epilogue loops over a pixel's 16 lanes: there a graph of members, SiLU's, measured
    # slower than the conv and a kernel of the members apart, EfficientNet-B0 1.05x; rfcs/0002 session 87)
    values = _epilogue_values(fused, chain=len(shape) == 5)
    stmts = _epilogue_stmts(values, names) if values is not None else None
    if stmts is None:
        return None
    flat = None  # the statements over a channel's flat pixels (w_ = j), where every read allows it
    if len(shape) == 4:
        flat_values = [(axes, _flat_plane(value, axes, shape)) for axes, value in values]
        if all(v is not None for _, v in flat_values):
            flat = _epilogue_stmts(flat_values, names)
    P = OH * OW
    # the epilogue is a function of the file (marked for kernel_source), so that it is compiled for the
    # kernel's instruction sets too (a lambda's body would not be: SSE loops)
    lines = ["  // the conv's tiles are finished in place by: " + " -> ".join(m.op_type for m in members[1:]),
             "  const SfEpiCtx ctx_ = {inputs, outputs};",
             "  const SfConvEpi epi_ = SF_SYM_epi;",
             FILE_SCOPE_BEGIN,
             "SF_ATTR static void SF_SYM_epi(const void* p, int64_t n_, int64_t c0, int64_t c1, int64_t j0, "
             "int64_t j1) {",
             "  const void* const* inputs = static_cast<const SfEpiCtx*>(p)->in;",
             "  void* const* outputs = static_cast<const SfEpiCtx*>(p)->out;"]
    lines += _args(fused)
    if len(shape) == 5:  # blocked: the lanes of a pixel innermost (a channel range may end inside a block)
        lines += [f"  const int64_t h0 = j0 / {OW}, h1 = (j1 - 1) / {OW};",
                  "  for (int64_t c_ = c0 / 16; c_ < (c1 + 15) / 16; ++c_) {",
                  "    const int64_t la = std::max<int64_t>(c0 - 16 * c_, 0), lb = std::min<int64_t>(c1 - 16 * c_, 16);",
                  f"    float* __restrict__ yb = out0 + (n_ * {oc // 16} + c_) * {P * 16};",
                  "    for (int64_t h_ = h0; h_ <= h1; ++h_) {",
                  f"      const int64_t wa = h_ == h0 ? j0 - h0 * {OW} : 0, wb = h_ == h1 ? j1 - h1 * {OW} : {OW};",
                  "      for (int64_t w_ = wa; w_ < wb; ++w_) {",
                  f"        float* __restrict__ yr = yb + (h_ * {OW} + w_) * 16;",
                  "        for (int64_t l_ = la; l_ < lb; ++l_) {",
                  f"          float v_ = yr[l_] + {bias or '0.0f'};"]
        lines += ["          " + st for st in stmts]
        lines += ["          yr[l_] = v_;", "        }", "      }", "    }", "  }", "}", FILE_SCOPE_END]
        return lines
    if flat is not None:  # one loop over the tile's pixels of a channel (rows of OW would be short)
        lines += ["  for (int64_t c_ = c0; c_ < c1; ++c_) {",
                  f"    const float b_ = {bias or '0.0f'};",
                  f"    float* __restrict__ yr = out0 + (n_ * {oc} + c_) * {P};",
                  "    for (int64_t w_ = j0; w_ < j1; ++w_) {",
                  "      float v_ = yr[w_] + b_;"]
        lines += ["      " + st for st in flat]
        lines += ["      yr[w_] = v_;", "    }", "  }", "}", FILE_SCOPE_END]
        return lines
    lines += [f"  const int64_t h0 = j0 / {OW}, h1 = (j1 - 1) / {OW};",
              "  for (int64_t c_ = c0; c_ < c1; ++c_) {",
              f"    const float b_ = {bias or '0.0f'};",
              f"    float* __restrict__ yr = out0 + (n_ * {oc} + c_) * {P};",
              "    for (int64_t h_ = h0; h_ <= h1; ++h_) {",
              f"      const int64_t wa = h_ == h0 ? j0 - h0 * {OW} : 0, wb = h_ == h1 ? j1 - h1 * {OW} : {OW};",
              "      for (int64_t w_ = wa; w_ < wb; ++w_) {",
              f"        float v_ = yr[h_ * {OW} + w_] + b_;"]
    lines += ["        " + st for st in stmts]
    lines += [f"        yr[h_ * {OW} + w_] = v_;", "      }", "    }", "  }", "}", FILE_SCOPE_END]
    return lines


def _fused(op) -> str | None:
    """A fused group (:mod:`.fusion`) of a Conv and element-wise ops after it: the conv template with
    the ops in its epilogue (see :func:`accepts_epilogue`)."""
    members = list(getattr(op, "members", ()))
    if len(members) < 2 or not accepts_epilogue(members[0]):
        return None
    if members[0].op_type == "ConvTranspose":
        return _conv_transpose(members[0], fused=op)
    if members[0].op_type == "Resize":
        return _resize(members[0], fused=op)
    return _conv(members[0], fused=op)


def accepts_epilogue(op) -> bool:
    """Whether ``op``'s template can apply element-wise ops to its output (a float32 conv, transposed
    conv or Resize of a 3-D or 4-D tensor, a conv over 3 spatial dims: only what its kernels finish, see
    :func:`_conv3d`): a fused group of ``op`` and such ops compiles to the template with the ops in its
    epilogue."""
    return op.op_type in ("Conv", "PackedConv", "WinogradConv", "ConvTranspose", "Resize") \
        and (op.inputs[0].ndim in (3, 4) or op.attrs.get("blocked_in") or op.op_type == "Conv") \
        and template_kind(op) == op.op_type


def accepts_group(group) -> bool:
    """Whether a fused group compiles on the cpu target: one of ops without templates, or a
    template op with the element-wise ops its template applies as its epilogue."""
    return not any(template_kind(m) for m in group.members) or template_kind(group) == "Fused"


def _tap_span(o: int, k: int, s: int, d: int, p: int, n: int) -> tuple[int, int]:
    """The taps ``[lo, hi)`` of window ``o`` whose positions ``o*s + kk*d - p`` lie in ``[0, n)`` (``(0, 0)``
    when none does)."""
    v = [kk for kk in range(k) if 0 <= o * s + kk * d - p < n]
    return (v[0], v[-1] + 1) if v else (0, 0)


def _inside_run(spans: list, k: int) -> tuple[int, int]:
    """The run ``[a, b)`` of windows whose ``k`` taps all lie inside the input (``spans``: their
    :func:`_tap_span`), ``(0, 0)`` when there is none (or, defensively, when they are not one run)."""
    inside = [o for o, span in enumerate(spans) if tuple(span) == (0, k)]
    a, b = (inside[0], inside[-1] + 1) if inside else (0, 0)
    return (a, b) if len(inside) == b - a else (0, 0)


def _pool(op) -> str | None:
    """MaxPool / AveragePool over 1 or 2 spatial dims (no indices output). Each output element
    reduces its window in a register; the windows that lie inside the input (ranges computed here)
    run a loop over output columns with the taps unrolled, which vectorizes; windows at the borders
    take only their valid taps."""
    kind = op.attrs.get("kind")
    x, y = op.inputs[0].shape, op.outputs[0].shape
    n_sp = len(x) - 2
    if kind in ("max", "avg") and not op.attrs.get("with_indices", False) and n_sp == 3 and len(op.inputs) == 1:
        return _pool_blocked(op)
    if kind not in ("max", "avg") or op.attrs.get("with_indices", False) or n_sp not in (1, 2) or len(op.inputs) != 1:
        return None
    kern = tuple(op.attrs["kernel"])
    strides = tuple(op.attrs.get("strides") or (1,) * n_sp)
    dil = tuple(op.attrs.get("dilations") or (1,) * n_sp)
    pads = tuple(op.attrs.get("pads") or (0,) * (2 * n_sp))
    if n_sp == 1:
        kern, strides, dil, pads = (1,) + kern, (1,) + strides, (1,) + dil, (0, pads[0], 0, pads[1])
        H, W, OH, OW = 1, x[2], 1, y[2]
    else:
        H, W, OH, OW = x[2], x[3], y[2], y[3]
    KH, KW = kern
    SH, SW = strides
    DH, DW = dil
    PT, PL, PB, PR = pads
    planes = x[0] * x[1]
    if KH * KW > 1024:
        return None

    kh_lo, kh_hi = map(list, zip(*(_tap_span(oh, KH, SH, DH, PT, H) for oh in range(OH))))
    kw_lo, kw_hi = map(list, zip(*(_tap_span(ow, KW, SW, DW, PL, W) for ow in range(OW))))
    ow_a, ow_b = _inside_run(list(zip(kw_lo, kw_hi)), KW)  # interior columns (every tap inside)
    is_max = kind == "max"
    init = "-std::numeric_limits<float>::infinity()" if is_max else "0.0f"

    # max: maxss-shaped selects and a NaN flag (numpy propagates NaN), so nothing branches on data
    def acc(v):
        return f"m = {v} > m ? {v} : m; nan |= {v} != {v};" if is_max else f"m += {v};"
    start = f"float m = {init};" + (" int nan = 0;" if is_max else "")
    fin = "nan ? std::numeric_limits<float>::quiet_NaN() : m" if is_max else "m"
    lines = _args(op)
    lines.append(f"  // {'max' if is_max else 'average'} pool {KH}x{KW}, stride {SH}x{SW}, dilation {DH}x{DW}, pads "
                 f"{list(pads)}: {planes} planes [{H}, {W}] -> [{OH}, {OW}]; columns [{ow_a}, {ow_b}) of the full rows "
                 "have every tap inside")
    lines.append(f"  static const int32_t kh_lo[] = {_arr(kh_lo)}, kh_hi[] = {_arr(kh_hi)};")
    lines.append(f"  static const int32_t kw_lo[] = {_arr(kw_lo)}, kw_hi[] = {_arr(kw_hi)};")
    div = ""
    if not is_max:
        if op.attrs.get("count_include_pad", False):
            lo_h, hi_h, lo_w, hi_w = -PT, H + PB, -PL, W + PR
        else:
            lo_h, hi_h, lo_w, hi_w = 0, H, 0, W
        cnt_h = [sum(1 for k in range(KH) if lo_h <= oh * SH + k * DH - PT < hi_h) for oh in range(OH)]
        cnt_w = [sum(1 for k in range(KW) if lo_w <= ow * SW + k * DW - PL < hi_w) for ow in range(OW)]
        lines.append(f"  static const float cnt_h[] = {{{', '.join(f'{c}.0f' for c in cnt_h)}}};")
        lines.append(f"  static const float cnt_w[] = {{{', '.join(f'{c}.0f' for c in cnt_w)}}};")
        div = " / (cnt_h[oh] * cnt_w[ow])"
    work = planes * OH * OW * KH * KW
    cond = "sf_max_threads() > 1" if work >= (1 << 14) and planes > 1 else "false"
    if is_max and n_sp == 2 and KW in (2, 3) and SW == 2 and DW == 1 and DH == 1 and OW >= 8:
        lines.append("  if (sf_maxpool_s2_fits()) {  // AVX-512: runs of 16 outputs, even and odd columns by permutes")
        lines.append(f"    sf_maxpool_s2(in0, out0, {planes}, {H}, {W}, {OH}, {OW}, {KH}, {KW}, {SH}, {PT}, {PL}, "
                     f"{cond});")
        lines.append("    return;")
        lines.append("  }")
    lines.append(f"  #pragma omp parallel for schedule(static) if ({cond})")
    lines.append(f"  for (int64_t pl = 0; pl < {planes}; ++pl) {{")
    # small planes (rows shorter than a vector have no interior run to vectorize): copied into a buffer
    # padded with the neutral value, where every window is whole and one loop does all of them
    Hq = max(H + PT, (OH - 1) * SH + (KH - 1) * DH + 1)
    Wq = max(W + PL, (OW - 1) * SW + (KW - 1) * DW + 1)
    if OW < 16 and Hq * Wq <= 4096 and (PT or PL or Hq > H or Wq > W):
        fill = init
        lines.append(f"    alignas(64) float xq[{Hq * Wq}];  // the plane at ({PT}, {PL}) of [{Hq}, {Wq}], {fill} around")
        lines.append(f"    for (int64_t i = 0; i < {Hq * Wq}; ++i) xq[i] = {fill};")
        lines.append(f"    for (int64_t r = 0; r < {H}; ++r)")
        lines.append(f"      for (int64_t c = 0; c < {W}; ++c) xq[(r + {PT}) * {Wq} + {PL} + c] = in0[(pl * {H} + r) * {W} + c];")
        lines.append(f"    for (int64_t oh = 0; oh < {OH}; ++oh) {{")
        lines.append(f"      float* __restrict__ yr = out0 + (pl * {OH} + oh) * {OW};")
        lines.append(f"      for (int64_t ow = 0; ow < {OW}; ++ow) {{")
        lines.append(f"        {start}")
        lines.append("        #pragma GCC unroll 8")
        lines.append(f"        for (int64_t kh = 0; kh < {KH}; ++kh)")
        lines.append("          #pragma GCC unroll 8")
        lines.append(f"          for (int64_t kw = 0; kw < {KW}; ++kw) {{ const float v = "
                     f"xq[(oh * {SH} + kh * {DH}) * {Wq} + ow * {SW} + kw * {DW}]; {acc('v')} }}")
        lines.append(f"        yr[ow] = {fin}{div};")
        lines.append("      }")
        lines.append("    }")
        lines.append("  }")
        return "\n".join(lines)
    lines.append(f"    const float* __restrict__ xp = in0 + pl * {H * W};")
    if KH > 1:
        lines += _pool_separable(is_max, init, div, H, W, OH, OW, KH, KW, SH, SW, DH, DW, PT, PL, ow_a, ow_b)
        return "\n".join(lines)
    lines.append(f"    for (int64_t oh = 0; oh < {OH}; ++oh) {{")
    lines.append(f"      float* __restrict__ yr = out0 + (pl * {OH} + oh) * {OW};")
    lines.append("      auto border = [&](int64_t ow) {")
    lines.append(f"        {start}")
    lines.append("        for (int64_t kh = kh_lo[oh]; kh < kh_hi[oh]; ++kh)")
    lines.append(f"          for (int64_t kw = kw_lo[ow]; kw < kw_hi[ow]; ++kw) {{ const float v = "
                 f"xp[(oh * {SH} + kh * {DH} - {PT}) * {W} + ow * {SW} + kw * {DW} - {PL}]; {acc('v')} }}")
    lines.append(f"        yr[ow] = {fin}{div};")
    lines.append("      };")
    if ow_b > ow_a:
        lines.append(f"      if (kh_lo[oh] == 0 && kh_hi[oh] == {KH}) {{")
        lines.append(f"        const float* __restrict__ xr = xp + (oh * {SH} - {PT}) * {W} - {PL};  // tap (0, 0) of column 0")
        lines.append(f"        for (int64_t ow = 0; ow < {ow_a}; ++ow) border(ow);")
        lines.append(f"        for (int64_t ow = {ow_a}; ow < {ow_b}; ++ow) {{")
        lines.append(f"          {start}")
        lines.append(f"          for (int64_t kh = 0; kh < {KH}; ++kh)")
        lines.append(f"            for (int64_t kw = 0; kw < {KW}; ++kw) {{ const float v = "
                     f"xr[kh * {DH * W} + ow * {SW} + kw * {DW}]; {acc('v')} }}")
        lines.append(f"          yr[ow] = {fin}{div};")
        lines.append("        }")
        lines.append(f"        for (int64_t ow = {ow_b}; ow < {OW}; ++ow) border(ow);")
        lines.append("        continue;")
        lines.append("      }")
    lines.append(f"      for (int64_t ow = 0; ow < {OW}; ++ow) border(ow);")
    lines.append("    }")
    lines.append("  }")
    return "\n".join(lines)


def _pool_blocked(op) -> str | None:
    """A 2-D MaxPool / AveragePool of a tensor in the blocked layout ``[N, C / 16, H, W, 16]``
    (passes/layout.py): a 3-D pool whose last window is one lane (kernel, stride and dilation 1, no
    padding). Each output pixel reduces its window's valid taps as vectors of 16 channels; else ``None``."""
    x, y = op.inputs[0].shape, op.outputs[0].shape
    kern = tuple(op.attrs["kernel"])
    strides = tuple(op.attrs.get("strides") or (1, 1, 1))
    dil = tuple(op.attrs.get("dilations") or (1, 1, 1))
    pads = tuple(op.attrs.get("pads") or (0,) * 6)
    L = x[-1]
    if kern[2] != 1 or strides[2] != 1 or dil[2] != 1 or pads[2] or pads[5] or y[-1] != L or L != 16:
        return None
    (KH, KW), (SH, SW), (DH, DW) = kern[:2], strides[:2], dil[:2]
    PT, PL, PB, PR = pads[0], pads[1], pads[3], pads[4]
    H, W, OH, OW = x[2], x[3], y[2], y[3]
    planes = x[0] * x[1]
    is_max = op.attrs["kind"] == "max"

    hs = [_tap_span(o, KH, SH, DH, PT, H) for o in range(OH)]
    ws = [_tap_span(o, KW, SW, DW, PL, W) for o in range(OW)]
    # the windows inside the image (all taps valid) take constant loops the compiler unrolls
    ow_a, ow_b = _inside_run(ws, KW)
    lines = _args(op)
    lines.append(f"  // {'max' if is_max else 'average'} pool {KH}x{KW}, stride {SH}x{SW}, dilation {DH}x{DW}, pads "
                 f"{[PT, PL, PB, PR]} of {planes} blocked planes [{H}, {W}, 16] -> [{OH}, {OW}, 16]")
    lines.append(f"  static const int32_t kh_lo[] = {_arr([a for a, _ in hs])}, kh_hi[] = {_arr([b for _, b in hs])};")
    lines.append(f"  static const int32_t kw_lo[] = {_arr([a for a, _ in ws])}, kw_hi[] = {_arr([b for _, b in ws])};")
    scale = ""
    if not is_max:
        lo_h, hi_h, lo_w, hi_w = (-PT, H + PB, -PL, W + PR) if op.attrs.get("count_include_pad", False) \
            else (0, H, 0, W)
        cnt = [[sum(1 for k in range(KH) if lo_h <= oh * SH + k * DH - PT < hi_h)
                * sum(1 for k in range(KW) if lo_w <= ow * SW + k * DW - PL < hi_w) for ow in range(OW)]
               for oh in range(OH)]
        # the sum times 1 / count (within an ulp of the quotient; a division of 16 lanes cost more than the
        # window's nine additions: Inception's 3x3 average pools at 28x28 took 2.2x onnxruntime's time)
        # (a window of no valid tap, count_include_pad off: 0 / 0, NaN)
        rcp = [f"{float(np.float32(1.0) / np.float32(c))!r}f" if c else "std::numeric_limits<float>::quiet_NaN()"
               for row in cnt for c in row]
        lines.append(f"  static const float rcp[] = {{{', '.join(rcp)}}};")
        scale = f" * rcp[oh * {OW} + ow]"
    cond = "sf_max_threads() > 1" if planes * OH * OW * KH * KW * 16 >= (1 << 14) and planes * OH > 1 else "false"
    init = "-std::numeric_limits<float>::infinity()" if is_max else "0.0f"
    # max: a NaN propagates (v != v takes it; nothing is greater than a NaN held)
    step = "m[l] = (v > m[l] || v != v) ? v : m[l];" if is_max else "m[l] += v;"
    tap = f"          for (int l = 0; l < 16; ++l) {{ const float v = s[l]; {step} }}"
    lines += [f"  #pragma omp parallel for schedule(static) if ({cond})",
              f"  for (int64_t t = 0; t < {planes * OH}; ++t) {{",
              f"    const int64_t pl = t / {OH}, oh = t % {OH};",
              f"    const float* __restrict__ xp = in0 + pl * {H * W * 16};",
              f"    float* __restrict__ yr = out0 + t * {OW * 16};",
              f"    const bool rows_in = kh_lo[oh] == 0 && kh_hi[oh] == {KH};",
              f"    for (int64_t ow = 0; ow < {OW}; ++ow) {{",
              "      float m[16];",
              f"      for (int l = 0; l < 16; ++l) m[l] = {init};",
              f"      if (rows_in && ow >= {ow_a} && ow < {ow_b}) {{",
              f"        const float* __restrict__ s0 = xp + ((oh * {SH} - {PT}) * {W} + ow * {SW} - {PL}) * 16;",
              "        #pragma GCC unroll 8",
              f"        for (int64_t kh = 0; kh < {KH}; ++kh)",
              "          #pragma GCC unroll 8",
              f"          for (int64_t kw = 0; kw < {KW}; ++kw) {{",
              f"            const float* __restrict__ s = s0 + (kh * {DH * W} + kw * {DW}) * 16;",
              "            #pragma omp simd",
              "  " + tap,
              "          }",
              "      } else {",
              "        for (int64_t kh = kh_lo[oh]; kh < kh_hi[oh]; ++kh)",
              "          for (int64_t kw = kw_lo[ow]; kw < kw_hi[ow]; ++kw) {",
              f"            const float* __restrict__ s = xp + ((oh * {SH} + kh * {DH} - {PT}) * {W} + ow * {SW} "
              f"+ kw * {DW} - {PL}) * 16;",
              "            #pragma omp simd",
              "  " + tap,
              "          }",
              "      }",
              f"      for (int l = 0; l < 16; ++l) yr[ow * 16 + l] = m[l]{scale};",
              "    }",
              "  }"]
    return "\n".join(lines)


def _pool_separable(is_max, init, div, H, W, OH, OW, KH, KW, SH, SW, DH, DW, PT, PL, ow_a, ow_b) -> list[str]:
    """The body of :func:`_pool`'s plane loop for windows of several rows: a max (or sum) is taken
    along each input row first (``hb[r][ow]``, the KW taps of column ``ow``), then down the KH rows
    of each output row, so that an input row shared by several windows (3x3 stride 2: 112 rows for
    56 x 3 windows) is reduced once, and the second pass reads contiguous rows. The max is a plain
    ``v > m ? v : m`` (a vmaxps) with a NaN flag on the side, so a NaN is kept, as numpy does;
    an average divides the window's sum by its count. Measured on Zen 3 (rfcs/0002, kernel time):
    ResNet's 3x3 stride-2 max pool at 112x112, 64 channels, 0.20 -> 0.13 ms; 3x3 stride 1 at 56x56,
    256 channels, 0.52 -> 0.20 ms."""
    red = "m = v > m ? v : m; nan |= v != v;" if is_max else "m += v;"
    start = f"float m = {init};" + (" int nan = 0;" if is_max else "")
    done = "nan ? std::numeric_limits<float>::quiet_NaN() : m" if is_max else "m"
    return [
        f"    float* __restrict__ hb = static_cast<float*>(sf_workspace(0, sizeof(float) * {H * OW}));  // [{H}][{OW}]",
        f"    for (int64_t r = 0; r < {H}; ++r) {{  // along the rows: the taps kw_lo[ow]..kw_hi[ow] of each column",
        f"      const float* __restrict__ xr = xp + r * {W};",
        f"      float* __restrict__ hr = hb + r * {OW};",
        "      auto border = [&](int64_t ow) {",
        f"        {start}",
        f"        for (int64_t kw = kw_lo[ow]; kw < kw_hi[ow]; ++kw) {{ "
        f"const float v = xr[ow * {SW} + kw * {DW} - {PL}]; {red} }}",
        f"        hr[ow] = {done};",
        "      };",
        f"      for (int64_t ow = 0; ow < {ow_a}; ++ow) border(ow);",
        f"      for (int64_t ow = {ow_a}; ow < {ow_b}; ++ow) {{",
        f"        {start}",
        "        #pragma GCC unroll 8",
        f"        for (int64_t kw = 0; kw < {KW}; ++kw) {{ const float v = xr[ow * {SW} + kw * {DW} - {PL}]; {red} }}",
        f"        hr[ow] = {done};",
        "      }",
        f"      for (int64_t ow = {max(ow_b, ow_a)}; ow < {OW}; ++ow) border(ow);",
        "    }",
        f"    for (int64_t oh = 0; oh < {OH}; ++oh) {{  // down the rows kh_lo[oh]..kh_hi[oh] of each window",
        f"      float* __restrict__ yr = out0 + (pl * {OH} + oh) * {OW};",
        f"      const int64_t r0 = oh * {SH} - {PT};  // the input row of tap kh = 0",
        f"      if (kh_lo[oh] == 0 && kh_hi[oh] == {KH}) {{",
        f"        for (int64_t ow = 0; ow < {OW}; ++ow) {{",
        f"          {start}",
        "          #pragma GCC unroll 8",
        f"          for (int64_t kh = 0; kh < {KH}; ++kh) {{ "
        f"const float v = hb[(r0 + kh * {DH}) * {OW} + ow]; {red} }}",
        f"          yr[ow] = {done}{div};",
        "        }",
        "      } else {",
        f"        for (int64_t ow = 0; ow < {OW}; ++ow) {{",
        f"          {start}",
        f"          for (int64_t kh = kh_lo[oh]; kh < kh_hi[oh]; ++kh) {{ "
        f"const float v = hb[(r0 + kh * {DH}) * {OW} + ow]; {red} }}",
        f"          yr[ow] = {done}{div};",
        "        }",
        "      }",
        "    }",
        "  }",
    ]


def _resize(op, fused=None) -> str | None:
    """Resize (nearest, linear, cubic; any coordinate transformation, antialias, crop) of the last
    one or two dims, from per-axis tap tables computed here (:meth:`Resize.axis_taps`, float64,
    stored as int32 indices and float weights): each output row is a weighted sum of ``TH`` input
    rows already resized along W (``hb``, a cache of ``TH`` such rows; row ``r`` lives in slot
    ``r % TH``, and the taps of one output row are consecutive rows, so they never share a slot;
    2x upsampling resizes each input row along W once). A row resized along W gathers ``TW``
    columns per output. Nearest rows are gathers (or copies of the previous output row). Work is
    split over planes, and over bands of rows when there are few planes. ``fused``: a group whose
    later members run per band as the conv template's epilogue does (:func:`_conv_epilogue`)."""
    x, y = op.inputs[0].shape, op.outputs[0].shape
    r = len(x)
    if len(op.inputs) != 1 or r < 1 or op.attrs.get("mode") not in ("nearest", "linear", "cubic"):
        return None
    taps = op.axis_taps(x)
    if any(t is not None for t in taps[:-2]):
        return None  # a leading dim resized: the generic nest
    H, OH = (x[-2], y[-2]) if r >= 2 else (1, 1)
    W, OW = x[-1], y[-1]
    th = taps[-2] if r >= 2 else None
    tw = taps[-1]
    TH = 1 if th is None else th[0].shape[1]
    TW = 1 if tw is None else tw[0].shape[1]
    if TH > 32 or TW > 32 or max(H, W, OH, OW) >= 2 ** 31 \
            or not math.isfinite(float(op.attrs.get("extrapolation_value", 0.0))):
        return None
    planes = _prod(x[:-2]) if r >= 2 else 1
    nearest = op.attrs["mode"] == "nearest"
    epi = None
    if fused is not None:
        if r not in (3, 4):
            return None
        # 4-D: a band is rows r0..r1 of channel pl % C of image pl / C; 3-D [N, C, W]: the kernel's
        # rows are the channels (H = C, copied), so a band is channels r0..r1 of image pl
        epi = _conv_epilogue(fused, x[1], OH if r == 4 else 1, OW, None)
        if epi is None:
            return None
        epi_call = (f"epi_(&ctx_, pl / {x[1]}, pl % {x[1]}, pl % {x[1]} + 1, r0 * OW, r1 * OW);" if r == 4
                    else "epi_(&ctx_, pl, r0, r1, 0, OW);")
    xin = f"in{[id(t) for t in (fused or op).inputs].index(id(op.inputs[0]))}"
    lines = _args(fused or op)
    lines.append(f"  // resize ({op.attrs['mode']}, {op.attrs['coordinate_transformation_mode']}): {planes} planes "
                 f"[{H}, {W}] -> [{OH}, {OW}], {TH} x {TW} taps")
    if epi:
        lines += epi

    def table(name, v, tap_major=True):  # [taps][out] so that a loop over outputs reads it in order
        vals = list(v.T.reshape(-1) if tap_major else v.reshape(-1))
        if v.dtype.kind == "f":
            return f"  static const float {name}[] = {{{', '.join(_flt(w) for w in vals)}}};"
        return f"  static const int32_t {name}[] = {_arr(vals)};"

    outside = []
    if th is not None:
        lines.append(table("ih", th[0], tap_major=False))  # [OH][TH]: the rows of one output row together
        if not nearest:
            lines.append(table("wh", th[1], tap_major=False))
        if th[2] is not None and th[2].any():
            lines.append(table("oh_out", th[2].astype(np.int64)))
            outside.append("oh_out[oh]")
    if tw is not None:
        lines.append(table("iw", tw[0]))
        if not nearest:
            lines.append(table("ww", tw[1]))
        if tw[2] is not None and tw[2].any():
            lines.append(table("ow_out", tw[2].astype(np.int64)))
            outside.append("ow_out[ow]")
    # the row src resized along W into dst
    if tw is None:
        hrow = None
    elif nearest:
        hrow = ["for (int64_t ow = 0; ow < OW; ++ow) dst[ow] = src[iw[ow]];"]
    elif TW <= 4:
        terms = " + ".join(f"ww[{k} * OW + ow] * src[iw[{k} * OW + ow]]" for k in range(TW))
        hrow = [f"for (int64_t ow = 0; ow < OW; ++ow) dst[ow] = {terms};"]
    else:
        hrow = ["for (int64_t ow = 0; ow < OW; ++ow) dst[ow] = ww[ow] * src[iw[ow]];",
                "for (int64_t k = 1; k < TW; ++k)",
                "  for (int64_t ow = 0; ow < OW; ++ow) dst[ow] += ww[k * OW + ow] * src[iw[k * OW + ow]];"]
    lines.append(f"  constexpr int64_t H = {H}, W = {W}, OH = {OH}, OW = {OW}, TH = {TH}, TW = {TW};")
    if hrow is not None:
        lines.append("  auto hrow = [](const float* __restrict__ src, float* __restrict__ dst) {")
        lines += ["    " + ln for ln in hrow]
        lines.append("  };")
    bands = 1 if planes >= 16 else min(OH, -(-16 // planes))
    work = planes * OH * OW * (TH + TW)
    cond = "sf_max_threads() > 1" if work >= (1 << 14) and planes * bands > 1 else "false"
    lines.append(f"  #pragma omp parallel for schedule(static) if ({cond})")
    lines.append(f"  for (int64_t item = 0; item < {planes * bands}; ++item) {{")
    lines.append(f"    const int64_t pl = item / {bands}, band = item % {bands};")
    lines.append(f"    const int64_t r0 = band * OH / {bands}, r1 = (band + 1) * OH / {bands};")
    lines.append(f"    const float* __restrict__ xp = {xin} + pl * H * W;")
    lines.append("    float* __restrict__ yp = out0 + pl * OH * OW;")
    row_of = "ih[oh]" if th is not None else "oh"
    if TH == 1:
        lines.append("    for (int64_t oh = r0; oh < r1; ++oh) {")
        lines.append("      float* __restrict__ yr = yp + oh * OW;")
        if th is not None:
            fresh = f"hrow(xp + {row_of} * W, yr);" if hrow else \
                f"std::memcpy(yr, xp + {row_of} * W, sizeof(float) * OW);"
            if "oh_out[oh]" in outside:  # the previous row may hold the extrapolation value: no copies
                lines.append(f"      {fresh}")
            else:  # a row that repeats the previous one (nearest upsampling) is copied
                lines.append(f"      if (oh > r0 && {row_of} == ih[oh - 1]) "
                             "std::memcpy(yr, yr - OW, sizeof(float) * OW);")
                lines.append(f"      else {fresh}")
        elif hrow is not None:
            lines.append(f"      hrow(xp + {row_of} * W, yr);")
        else:  # (a resize to the same size along both dims: a copy)
            lines.append(f"      std::memcpy(yr, xp + {row_of} * W, sizeof(float) * OW);")
    else:
        if hrow is not None:
            lines.append("    float* __restrict__ hb = static_cast<float*>(sf_workspace(0, sizeof(float) * TH * OW));")
            lines.append("    int64_t cached[TH];")
            lines.append("    for (int64_t k = 0; k < TH; ++k) cached[k] = -1;")
        lines.append("    for (int64_t oh = r0; oh < r1; ++oh) {")
        lines.append("      float* __restrict__ yr = yp + oh * OW;")
        lines.append("      const float* rows[TH];")
        lines.append("      for (int64_t k = 0; k < TH; ++k) {")
        lines.append("        const int64_t row = ih[oh * TH + k];")
        if hrow is not None:
            lines.append("        float* slot = hb + (row % TH) * OW;")
            lines.append("        if (cached[row % TH] != row) { hrow(xp + row * W, slot); cached[row % TH] = row; }")
            lines.append("        rows[k] = slot;")
        else:
            lines.append("        rows[k] = xp + row * W;")
        lines.append("      }")
        if TH <= 4:
            terms = " + ".join(f"wh[oh * TH + {k}] * rows[{k}][ow]" for k in range(TH))
            lines.append(f"      for (int64_t ow = 0; ow < OW; ++ow) yr[ow] = {terms};")
        else:
            lines.append("      for (int64_t ow = 0; ow < OW; ++ow) yr[ow] = wh[oh * TH] * rows[0][ow];")
            lines.append("      for (int64_t k = 1; k < TH; ++k) {")
            lines.append("        const float wk = wh[oh * TH + k];")
            lines.append("        const float* __restrict__ rk = rows[k];")
            lines.append("        for (int64_t ow = 0; ow < OW; ++ow) yr[ow] += wk * rk[ow];")
            lines.append("      }")
    if outside:
        ev = _flt(float(op.attrs.get("extrapolation_value", 0.0)))
        lines.append(f"      for (int64_t ow = 0; ow < OW; ++ow) if ({' | '.join(outside)}) yr[ow] = {ev};")
    lines.append("    }")
    if epi:
        lines.append(f"    {epi_call}")
    lines.append("  }")
    return "\n".join(lines)


def _lrn(op) -> str | None:
    """LRN across channels: per image and channel, the window's squares summed into a row of the
    plane's pixels (channel by channel, in the window's order, as the definition sums them), then
    ``x / (bias + alpha / size * s) ** beta`` along the row. Plain loops over contiguous pixels
    that vectorize (``sf_pow`` is branch-free); the generic lowering checked every tap's channel
    per pixel and did not (Inception-v1's 192 x 55 x 55 LRN: rfcs/0002)."""
    x = op.inputs[0].shape
    if len(x) < 3:
        return None
    size, N, C = int(op.attrs["size"]), x[0], x[1]
    P, lo = _prod(x[2:]), (int(op.attrs["size"]) - 1) // 2
    alpha, beta, bias = (float(op.attrs["alpha"]) / size, float(op.attrs["beta"]), float(op.attrs["bias"]))
    lines = _args(op)
    lines += [
        f"  // LRN over {C} channels of {P} pixels ({N} images): window channels [c - {lo}, c + {size - 1 - lo}]",
        f"  #pragma omp parallel for schedule(static) if (sf_max_threads() > 1 && {N * C * P * size} >= 65536)",
        f"  for (int64_t t = 0; t < {N * C}; ++t) {{",
        f"    const int64_t c = t % {C};",
        f"    const int64_t k0 = std::max<int64_t>(0, {lo} - c), k1 = std::min<int64_t>({size}, {C + lo} - c);",
        f"    const float* __restrict__ xc = in0 + t * {P};",
        f"    float* __restrict__ yc = out0 + t * {P};",
        f"    float* __restrict__ ss = static_cast<float*>(sf_workspace(0, sizeof(float) * {P}));",
        f"    for (int64_t p = 0; p < {P}; ++p) ss[p] = 0.0f;",
        "    for (int64_t k = k0; k < k1; ++k) {",
        f"      const float* __restrict__ xk = xc + (k - {lo}) * {P};",
        f"      for (int64_t p = 0; p < {P}; ++p) ss[p] += xk[p] * xk[p];",
        "    }",
        f"    for (int64_t p = 0; p < {P}; ++p)",
        f"      yc[p] = xc[p] / sf_pow({_flt(bias)} + {_flt(alpha)} * ss[p], {_flt(beta)});",
        "  }",
    ]
    return "\n".join(lines)


def _pad(op) -> str | None:
    """Pad in ``reflect``, ``edge`` or ``wrap`` mode of the last two or three dims (no cropping): each output
    row copies its source row (tables made with ``np.pad`` of the indices, so every mode means what numpy
    says) with the interior in one run and the borders through a column table. The generic lowering
    computed each element's source index with a modulo or a clamp per dim (reflect 64 x 128 x 128 by 3:
    0.5-0.9 ms against onnxruntime's 0.2; edge or reflect of a [1, 32, 32, 32, 32] volume by 1: 7.8-10 ms
    against 0.6-0.9). Constant pads keep it (they are fast there, and fuse)."""
    x, y = op.inputs[0].shape, op.outputs[0].shape
    begin, end, mode = list(op.attrs["begin"]), list(op.attrs["end"]), op.attrs["mode"]
    if mode not in ("reflect", "edge", "wrap") or len(op.inputs) != 1 or not x or min(begin + end) < 0 \
            or any(begin[:-3]) or any(end[:-3]) or _prod(y) == 0 or _prod(x) == 0:
        return None
    D, bd, ed = (x[-3], begin[-3], end[-3]) if len(x) >= 3 else (1, 0, 0)
    H, W = (x[-2], x[-1]) if len(x) >= 2 else (1, x[-1])
    bh, eh = (begin[-2], end[-2]) if len(x) >= 2 else (0, 0)
    bw, ew = begin[-1], end[-1]
    planes, OD, OH, OW = _prod(x[:-3]) if len(x) >= 3 else 1, D + bd + ed, H + bh + eh, W + bw + ew
    slices = np.pad(np.arange(D), (bd, ed), mode=mode)
    rows = np.pad(np.arange(H), (bh, eh), mode=mode)
    cols = np.pad(np.arange(W), (bw, ew), mode=mode)
    left, right = cols[:bw].tolist(), cols[bw + W:].tolist()  # (_arr writes {0} for none)
    lines = _args(op) + [
        f"  // Pad ({mode}) depth [{bd}, {ed}], rows [{bh}, {eh}] and columns [{bw}, {ew}]: {planes} volumes "
        f"[{D}, {H}, {W}] -> [{OD}, {OH}, {OW}]",
        f"  static const int32_t slices[] = {_arr(slices.tolist())}, rows[] = {_arr(rows.tolist())};",
        f"  static const int32_t left[] = {_arr(left)}, right[] = {_arr(right)};",
        f"  #pragma omp parallel for schedule(static) if (sf_max_threads() > 1 && {planes * OD * OH * OW} >= 65536)",
        f"  for (int64_t t = 0; t < {planes * OD * OH}; ++t) {{",
        f"    const int64_t sl = t / {OH}, src = (sl / {OD} * {D} + slices[sl % {OD}]) * {H} + rows[t % {OH}];",
        f"    const float* __restrict__ xr = in0 + src * {W};",
        f"    float* __restrict__ yr = out0 + t * {OW};",
        f"    for (int64_t c = 0; c < {bw}; ++c) yr[c] = xr[left[c]];",
        f"    for (int64_t c = 0; c < {W}; ++c) yr[{bw} + c] = xr[c];",
        f"    for (int64_t c = 0; c < {ew}; ++c) yr[{bw + W} + c] = xr[right[c]];",
        "  }",
    ]
    return "\n".join(lines)


def _topk(op) -> str | None:
    """TopK (the op's definition is an extern: no loop nest sorts): per row along ``axis``, the
    positions ordered by value (descending for ``largest``, NaN first, as numpy's stable argsort of
    the reversed axis gives; ascending otherwise, NaN last), equal values by lower position, and the
    first k of them written with their int64 positions. Rows in parallel.

    Per row the candidates are (value, position) pairs in a buffer of ``2k + 64``; when it is full a
    ``std::nth_element`` keeps the k that go first, and the last of them is the bar a later value must
    go before to enter (one read and one comparison per value; a later position never goes before an
    equal value, so the value decides). At the end the k kept are sorted. (Before: ``std::partial_sort``
    of positions, whose heap steps compared through the positions: 0.83-0.9 ms for 64 rows of 4096
    values against onnxruntime's 0.56.)"""
    from .cpp import STORAGE_CTYPE

    x = op.inputs[0]
    if len(op.inputs) != 1 or len(op.outputs) != 2 or x.ndim == 0 or x.dtype not in _TOPK_DTYPES \
            or op.outputs[0].dtype != x.dtype or op.outputs[1].dtype != "int64":
        return None
    k, axis, largest = int(op.attrs["k"]), int(op.attrs["axis"]) % x.ndim, bool(op.attrs.get("largest", True))
    n, outer, inner = x.shape[axis], _prod(x.shape[:axis]), _prod(x.shape[axis + 1:])
    if not 0 <= k <= n:
        return None
    if k * outer * inner == 0:  # (an empty output: a rank's empty shard, or k = 0)
        return "  // TopK: an empty output, nothing to write"
    ct = STORAGE_CTYPE[x.dtype]
    kt = "float" if x.dtype == "bfloat16" else ct  # (the type values are compared in)
    key = "sf_bf16_to_float({})" if x.dtype == "bfloat16" else "{}"
    flt = x.dtype.startswith("float") or x.dtype == "bfloat16"
    cap = min(n, 2 * k + 64)  # (the candidates' buffer)
    if largest:
        before = "(a > b) | ((a != a) & (b == b))" if flt else "a > b"
    else:
        before = "(a < b) | ((a == a) & (b != b))" if flt else "a < b"
    lines = [f"  const {ct}* __restrict__ in0 = static_cast<const {ct}*>(inputs[0]);",
             f"  {ct}* __restrict__ out0 = static_cast<{ct}*>(outputs[0]);",
             "  int64_t* __restrict__ out1 = static_cast<int64_t*>(outputs[1]);",
             f"  // TopK: the {k} {'largest' if largest else 'smallest'} of {n} along axis {axis} "
             f"({outer} x {inner} rows), sorted, ties by lower position",
             f"  #pragma omp parallel for schedule(static) if (sf_max_threads() > 1 && {outer * inner * n} >= 65536)",
             f"  for (int64_t t = 0; t < {outer * inner}; ++t) {{",
             f"    const int64_t o = t / {inner}, i = t % {inner};",
             f"    const {ct}* __restrict__ xr = in0 + o * {n * inner} + i;",
             f"    struct Item {{ {kt} v; int32_t p; }};",
             f"    Item* __restrict__ buf = static_cast<Item*>(sf_workspace(0, sizeof(Item) * {cap}));",
             f"    auto value = [xr](int64_t p) -> {kt} {{ return {key.format(f'xr[p * {inner}]')}; }};",
             f"    auto ahead = []({kt} a, {kt} b) {{ return {before}; }};  // value a goes before value b",
             "    auto first = [ahead](const Item& a, const Item& b) {  // pair a goes before pair b",
             "      return ahead(a.v, b.v) || (!ahead(b.v, a.v) && a.p < b.p);",
             "    };",
             f"    for (int32_t j = 0; j < {cap}; ++j) buf[j] = Item{{value(j), j}};",
             f"    int32_t cnt = {cap};",
             f"    auto keep = [&]() {{ std::nth_element(buf, buf + {k - 1}, buf + cnt, first); cnt = {k}; }};",
             f"    if (cnt > {k}) keep();",
             f"    {kt} bar = buf[{k - 1}].v;  // (the last of the k kept)",
             f"    for (int32_t j = {cap}; j < {n}; ++j) {{",
             f"      const {kt} v = value(j);",
             "      if (ahead(v, bar)) {",
             "        buf[cnt++] = Item{v, j};",
             f"        if (cnt == {cap}) {{ keep(); bar = buf[{k - 1}].v; }}",
             "      }",
             "    }",
             f"    if (cnt > {k}) keep();",
             f"    std::sort(buf, buf + {k}, first);",
             f"    for (int64_t j = 0; j < {k}; ++j) {{",
             f"      out0[(o * {k} + j) * {inner} + i] = xr[(int64_t)buf[j].p * {inner}];",
             f"      out1[(o * {k} + j) * {inner} + i] = buf[j].p;",
             "    }",
             "  }"]
    return "\n".join(lines)


#: the value types of TopK's template: every type the op takes (float16 compared as ``_Float16``,
#: bfloat16 widened to float, integers as themselves)
_TOPK_DTYPES = ("float16", "bfloat16", "float32", "float64", "int8", "int16", "int32", "int64", "uint8", "uint16",
                "uint32", "uint64")


#: elements from which a transposition of two blocks of dims runs the blocked template (smaller ones stay
#: in the generic nest, where they fuse with their neighbours)
_TRANSPOSE_MIN = 1 << 16


def _transpose(op) -> str | None:
    """A Transpose that swaps two blocks of dims (after merging dims that stay adjacent: NCHW <->
    NHWC is ``[N, C, HW] -> [N, HW, C]``), of 64 Ki elements or more: 32 x 32 tiles, each read by
    rows and written by columns within the cache (whole output rows by 64 columns where those rows are
    at most 64 long), with AVX2 in 8 x 8 blocks transposed in registers (``sf_transpose_tile_avx2``:
    64 x 128 x 128 to NHWC 0.54 -> 0.19 ms, onnxruntime 0.29; rfcs/0002).
    The generic nest walks the output in order and reads the input at a stride per element (the same
    case: 1.45 ms against onnxruntime's 0.44, when the tiles were written)."""
    x = op.inputs[0].shape
    perm = [int(p) for p in op.attrs["perm"]]
    if _prod(x) < _TRANSPOSE_MIN:
        return None
    # merge the input dims that stay adjacent, in order, in the output: runs of perm (p, p + 1, ...)
    groups = []
    for p in perm:
        if groups and groups[-1][-1] + 1 == p:
            groups[-1].append(p)
        else:
            groups.append([p])
    groups = [g for g in groups if _prod(x[q] for q in g) != 1]  # size-1 dims move nothing
    order = sorted(range(len(groups)), key=lambda j: groups[j][0])  # the groups in input order
    ext = [_prod(x[q] for q in groups[j]) for j in order]
    if len(groups) == 2 and order == [1, 0]:
        B, (R, C) = 1, ext
    elif len(groups) == 3 and order == [0, 2, 1]:
        B, R, C = ext
    else:
        return None
    # tiles of 32 x 32; where the output's rows are at most 64 long, tiles of whole output rows by 64 columns, so
    # that each output row is written as one run (64 x 16384 to [16384, 64]: 0.36 -> 0.18 ms standalone; 96 rows in
    # 64-row tiles measured slower, 0.074 -> 0.107, two tile rows of unequal work)
    th, tw = (R, 64) if R <= 64 else (32, 32)
    lines = _args(op) + [
        f"  // Transpose {perm}: {B} x [{R}, {C}] -> [{C}, {R}] in {th} x {tw} tiles (8 x 8 register blocks with AVX2)",
        f"  const int64_t tr = {-(-R // th)}, tc = {-(-C // tw)};",
        "#if defined(__x86_64__)",
        "  const bool avx2 = sf_avx2_helpers();",
        "#endif",
        "  #pragma omp parallel for schedule(static) if (sf_max_threads() > 1)",
        f"  for (int64_t t = 0; t < {B} * tr * tc; ++t) {{",
        f"    const int64_t b = t / (tr * tc), r0 = t / tc % tr * {th}, c0 = t % tc * {tw};",
        f"    const int64_t r1 = std::min<int64_t>({R}, r0 + {th}), c1 = std::min<int64_t>({C}, c0 + {tw});",
        f"    const float* __restrict__ xb = in0 + b * {R * C};",
        f"    float* __restrict__ yb = out0 + b * {R * C};",
        "#if defined(__x86_64__)",
        "    if (avx2) {",
        f"      sf_transpose_tile_avx2(xb, yb, {R}, {C}, r0, r1, c0, c1);",
        "      continue;",
        "    }",
        "#endif",
        "    for (int64_t r = r0; r < r1; ++r)",
        f"      for (int64_t c = c0; c < c1; ++c) yb[c * {R} + r] = xb[r * {C} + c];",
        "  }",
    ]
    return "\n".join(lines)


#: the dtypes the scan template runs in their own C type (numpy's cumsum/cumprod with dtype=x.dtype)
_SCAN_DTYPES = ("float32", "float64", "int32", "int64", "uint32", "uint64")
#: columns of a scan's inner dims one task carries (its running values on the stack)
_SCAN_CHUNK = 256


def _scan(op) -> str | None:
    """CumSum / CumProd as a running value per position of the inner dims, carried along ``axis``
    (forward or reversed; ``exclusive`` stores before combining): one pass, where the definition
    (and the generic lowering) combines the whole axis for every output, n^2 / 2 operations (64 x
    4096 floats: 44 ms against onnxruntime's 0.87). The values are combined in the definition's
    order (the running value, then the next element). Tasks of up to 256 inner columns per outer
    index, in parallel; the inner loop vectorizes."""
    from .cpp import STORAGE_CTYPE, literal

    x, y = op.inputs[0], op.outputs[0]
    if x.dtype not in _SCAN_DTYPES or y.dtype != x.dtype or len(op.inputs) != 1 or x.ndim == 0:
        return None
    axis, excl, rev = int(op.attrs["axis"]) % x.ndim, bool(op.attrs["exclusive"]), bool(op.attrs["reverse"])
    n, outer, inner = x.shape[axis], _prod(x.shape[:axis]), _prod(x.shape[axis + 1:])
    if n * outer * inner == 0:
        return None
    ct, comb = STORAGE_CTYPE[x.dtype], "+" if op.op_type == "CumSum" else "*"
    ident = literal(0 if op.op_type == "CumSum" else 1, x.dtype)
    chunk = min(inner, _SCAN_CHUNK)
    nch = -(-inner // chunk)
    step = [f"        acc[c - c0] = acc[c - c0] {comb} xr[c];", "        yr[c] = acc[c - c0];"]
    if excl:
        step.reverse()
    lines = [f"  const {ct}* __restrict__ in0 = static_cast<const {ct}*>(inputs[0]);",
             f"  {ct}* __restrict__ out0 = static_cast<{ct}*>(outputs[0]);",
             f"  // {op.op_type} along axis {axis} ({n} positions{', reversed' if rev else ''}"
             f"{', exclusive' if excl else ''}): {outer} outer x {inner} inner, tasks of {chunk} inner columns",
             f"  #pragma omp parallel for schedule(static) if (sf_max_threads() > 1 && {outer * n * inner} >= 65536)",
             f"  for (int64_t t = 0; t < {outer * nch}; ++t) {{",
             f"    const int64_t o = t / {nch}, c0 = t % {nch} * {chunk};",
             f"    const int64_t c1 = std::min<int64_t>({inner}, c0 + {chunk});",
             f"    {ct} acc[{chunk}];",
             f"    for (int64_t c = c0; c < c1; ++c) acc[c - c0] = {ident};",
             f"    for (int64_t s = 0; s < {n}; ++s) {{",
             f"      const int64_t j = {f'{n - 1} - s' if rev else 's'};",
             f"      const {ct}* __restrict__ xr = in0 + (o * {n} + j) * {inner};",
             f"      {ct}* __restrict__ yr = out0 + (o * {n} + j) * {inner};",
             "      for (int64_t c = c0; c < c1; ++c) {",
             *step,
             "      }",
             "    }",
             "  }"]
    return "\n".join(lines)


def _det(op) -> str | None:
    """Det (an extern definition): each matrix's LU factorization with partial pivoting, in double,
    the product of the pivots with the swaps' sign (0 at the first zero pivot). Matrices in parallel,
    each in a per-thread workspace."""
    from .cpp import STORAGE_CTYPE

    x = op.inputs[0]
    if x.dtype not in ("float32", "float64") or op.outputs[0].dtype != x.dtype:
        return None
    m, count = x.shape[-1], _prod(x.shape[:-2])
    ct = STORAGE_CTYPE[x.dtype]
    lines = [f"  const {ct}* __restrict__ in0 = static_cast<const {ct}*>(inputs[0]);",
             f"  {ct}* __restrict__ out0 = static_cast<{ct}*>(outputs[0]);",
             f"  // Det: {count} matrices of {m} x {m}, LU with partial pivoting in double",
             f"  #pragma omp parallel for schedule(static) if (sf_max_threads() > 1 && {count * m * m * m} >= 262144)",
             f"  for (int64_t b = 0; b < {count}; ++b) {{",
             f"    double* __restrict__ a = static_cast<double*>(sf_workspace(0, sizeof(double) * {max(1, m * m)}));",
             f"    for (int64_t e = 0; e < {m * m}; ++e) a[e] = (double)in0[b * {m * m} + e];",
             "    double det = 1.0;",
             f"    for (int64_t k = 0; k < {m}; ++k) {{",
             "      int64_t p = k;",
             f"      for (int64_t i = k + 1; i < {m}; ++i)",
             f"        if (std::fabs(a[i * {m} + k]) > std::fabs(a[p * {m} + k])) p = i;",
             f"      const double pivot = a[p * {m} + k];",
             "      if (pivot == 0.0) { det = 0.0; break; }",
             "      if (p != k) {",
             f"        for (int64_t j = 0; j < {m}; ++j) std::swap(a[p * {m} + j], a[k * {m} + j]);",
             "        det = -det;",
             "      }",
             "      det *= pivot;",
             f"      for (int64_t i = k + 1; i < {m}; ++i) {{",
             f"        const double f = a[i * {m} + k] / pivot;",
             f"        for (int64_t j = k + 1; j < {m}; ++j) a[i * {m} + j] -= f * a[k * {m} + j];",
             "      }",
             "    }",
             f"    out0[b] = ({ct})det;",
             "  }"]
    return "\n".join(lines)


def _bitcast(op) -> str:
    """BitCast (an extern definition): the input's bytes copied as they are. The driver runs a
    BitCast as a view of its input with no kernel; this one serves a BitCast compiled alone."""
    from ..ir.expr import numpy_type

    nbytes = op.outputs[0].size * numpy_type(op.outputs[0].dtype).itemsize
    return ("  // BitCast: the bytes of the input, read as the output's type\n"
            f"  std::memcpy(outputs[0], inputs[0], {nbytes});")


_TEMPLATES = {"MatMul": _matmul, "Gemm": _gemm, "PackedMatMul": _packed_matmul, "Conv": _conv,
              "PackedConv": _conv, "WinogradConv": _conv, "ConvTranspose": _conv_transpose, "Pool": _pool,
              "Attention": _attention, "Resize": _resize, "LRN": _lrn, "CumSum": _scan, "CumProd": _scan,
              "Pad": _pad, "Einsum": _einsum, "ExpertMatMul": _expert_matmul,
              "TopK": _topk, "Transpose": _transpose, "PackedMatMulInteger": _packed_matmul_integer,
              "PackedConvInteger": _packed_conv_integer, "PackedConvBf16": _packed_conv_bf16,
              "PackedMatMulBf16": _packed_matmul_bf16,
              "MatMulNBits": _matmul_nbits, "Fused": _fused,
              "BitCast": _bitcast, "Det": _det}
#: Templates that check their operands' dtypes themselves (the others take float32 only).
#: Templates that also take float64 ops (every operand float64; rfcs/0002 "Float64 products").
_F64 = frozenset({"MatMul", "Gemm"})
_MIXED_DTYPES = frozenset({"Attention", "CumSum", "CumProd", "TopK", "PackedMatMul", "PackedMatMulInteger",
                           "MatMulNBits", "BitCast", "Det", "ExpertMatMul", "PackedMatMulBf16", "PackedConvInteger",
                           "PackedConvBf16"})
#: Templates of ops with more than one output (they check their outputs themselves).
_MULTI_OUTPUT = frozenset({"TopK"})
#: Templates whose kernels are plain loops, worth compiling for each instruction set (the others
#: call the GEMM, which picks its micro-kernel at run time).
CLONED_TEMPLATES = frozenset({"Pool", "Resize", "LRN", "CumSum", "CumProd", "Pad", "Transpose"})
# a template body's lines between these two are definitions of the file, put before the kernel (``SF_SYM``:
# the kernel's symbol; ``SF_ATTR``: its instruction-set clones); see cpp.kernel_source
FILE_SCOPE_BEGIN, FILE_SCOPE_END = "//<file-scope>", "//</file-scope>"


def _template_fn(op):
    """The template function for ``op``'s type when its outputs and dtypes fit one, else ``None``."""
    fn = _TEMPLATES.get(op.op_type)
    if fn is None or (len(op.outputs) != 1 and op.op_type not in _MULTI_OUTPUT) \
            or (op.op_type not in _MIXED_DTYPES and not _all_f32(op) and not (op.op_type in _F64 and _f64(op))):
        return None
    return fn


def template_kind(op) -> str | None:
    """The template that implements ``op`` (``"MatMul"``, ``"Gemm"``, ``"Conv"``, ``"Pool"``; ``"Fused"`` for a
    conv with fused element-wise ops) or ``None``."""
    fn = _template_fn(op)
    return op.op_type if fn is not None and fn(op) is not None else None


def template_body(op) -> str | None:
    """The kernel body for ``op`` from a template, or ``None`` when the generic lowering applies."""
    fn = _template_fn(op)
    return fn(op) if fn is not None else None
