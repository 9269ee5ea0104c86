"""float8 storage for the code generators: the four 8-bit float types ONNX has (E4M3FN, E4M3FNUZ,
E5M2, E5M2FNUZ), stored as their byte and computed in float32, like bfloat16.

:func:`c_source` is the C++ both targets' preludes include (with their own function qualifier):
per type, ``sf_<t>_to_float`` (exact), ``sf_float_to_<t>`` (round to nearest even, as ml_dtypes'
``astype`` does, which the evaluator uses: a value that rounds past the largest finite one becomes
NaN, or an infinity for E5M2, the one type with infinities; the fnuz types have no negative zero,
so a negative value that rounds to zero is +0, and their NaN is ``0x80``) and ``sf_round_<t>``
(the float32 value of that rounding). ONNX's saturating cast (``saturate=1``, its default) clamps
to the largest finite value before rounding; that is in the op's definition (``CastOp.compute``),
not here.
"""
from __future__ import annotations

#: ``{dtype: (C name, exponent bits, mantissa bits, exponent bias, fnuz)}``
FLOAT8 = {
    "float8_e4m3fn": ("e4m3fn", 4, 3, 7, False),
    "float8_e4m3fnuz": ("e4m3fnuz", 4, 3, 8, True),
    "float8_e5m2": ("e5m2", 5, 2, 15, False),
    "float8_e5m2fnuz": ("e5m2fnuz", 5, 2, 16, True),
}

_GENERIC = r"""
// ---- float8 storage (codegen/float8.py) -----------------------------------------------------------
// A byte per value, computed in float32. E: exponent bits, M: mantissa bits; FNUZ: no infinity, no
// negative zero, NaN 0x80; otherwise E4M3FN (no infinity, NaN x111 1111) or E5M2 (IEEE-like).
template <int E, int M, int BIAS, bool FNUZ> SF_F8_FN float sf_f8_to_float(unsigned char c) {
  const int ef = (c >> M) & ((1 << E) - 1), man = c & ((1 << M) - 1);
  const bool neg = (c & 0x80) != 0;
  if (FNUZ ? c == 0x80 : (E == 4 ? (c & 0x7f) == 0x7f : ef == 31 && man != 0)) return SF_F8_NAN;
  if (!FNUZ && E == 5 && ef == 31) return neg ? -SF_F8_INF : SF_F8_INF;
  const float v = ef == 0 ? ldexpf((float)man, 1 - BIAS - M) : ldexpf((float)((1 << M) | man), ef - BIAS - M);
  return neg ? -v : v;
}
template <int E, int M, int BIAS, bool FNUZ> SF_F8_FN unsigned char sf_float_to_f8(float x) {
  const unsigned char nan = FNUZ ? 0x80 : 0x7f;  // (0x7f: E4M3FN's NaN, and one of E5M2's)
  if (x != x) return nan;
  const unsigned char sign = (x < 0.0f || (x == 0.0f && 1.0f / x < 0.0f)) ? 0x80 : 0;
  const unsigned char over = (!FNUZ && E == 5) ? (unsigned char)(sign | 0x7c) : nan;  // (E5M2: infinity)
  const int maxcode = FNUZ ? 0x7f : (E == 4 ? 0x7e : 0x7b);  // the largest finite value's bits
  const float a = fabsf(x);
  if (!(a <= 3.40282347e38f)) return over;
  if (a == 0.0f) return FNUZ ? 0 : sign;
  int e;
  frexpf(a, &e);  // a = f 2^e, f in [0.5, 1): a's exponent is e - 1
  const int ue = e - 1, emin = 1 - BIAS;
  const int q = (ue < emin ? emin : ue) - M;  // the exponent of the target's unit in the last place
  const int m = (int)rintf(ldexpf(a, -q));  // a in those units, to nearest even (the scaling is exact)
  int code;
  if (ue < emin) {
    code = m;  // subnormal (m = 2^M: the smallest normal value's bits)
  } else if (m == (2 << M)) {
    code = (ue + BIAS + 1) << M;  // rounded up to the next power of two
  } else {
    code = ((ue + BIAS) << M) | (m - (1 << M));
  }
  if (code > maxcode) return over;
  if (code == 0) return FNUZ ? 0 : sign;
  return (unsigned char)(sign | code);
}
"""


def used_by(ops) -> bool:
    """Whether a float8 value is read or written by ``ops`` or by the members of fused ones (a
    translation unit carries the conversions only then: every other source stays as it was, and
    so do the kernel cache's keys)."""
    return any(t.dtype in FLOAT8 for op in ops for m in getattr(op, "members", [op])
               for t in list(m.inputs) + list(m.outputs))


def prelude(qualifiers: str, nan: str, inf: str) -> str:
    """:func:`c_source` with its macros defined: the functions' ``qualifiers`` and the float
    constants ``nan`` and ``inf``."""
    return (f"#define SF_F8_FN {qualifiers}\n#define SF_F8_NAN {nan}\n#define SF_F8_INF {inf}\n" + c_source())


def c_source() -> str:
    """The C++ of the float8 conversions; the includer defines ``SF_F8_FN`` (the functions'
    qualifiers), ``SF_F8_NAN`` and ``SF_F8_INF`` (float constants) and provides ``ldexpf``,
    ``frexpf``, ``rintf`` and ``fabsf``."""
    per_type = []
    for name, e, m, bias, fnuz in FLOAT8.values():
        args = f"{e}, {m}, {bias}, {'true' if fnuz else 'false'}"
        per_type.append(
            f"SF_F8_FN float sf_{name}_to_float(unsigned char c) {{ return sf_f8_to_float<{args}>(c); }}\n"
            f"SF_F8_FN unsigned char sf_float_to_{name}(float x) {{ return sf_float_to_f8<{args}>(x); }}\n"
            f"SF_F8_FN float sf_round_{name}(float x) {{ return sf_f8_to_float<{args}>(sf_float_to_f8<{args}>(x)); }}")
    return _GENERIC + "\n".join(per_type) + "\n"


def load(x: str, dtype: str) -> str:
    """C expression widening the stored byte ``x`` of float8 type ``dtype`` to float."""
    return f"sf_{FLOAT8[dtype][0]}_to_float({x})"


def store(x: str, dtype: str) -> str:
    """C expression storing float ``x`` as float8 type ``dtype`` (its byte)."""
    return f"sf_float_to_{FLOAT8[dtype][0]}({x})"


def rounder(dtype: str) -> str:
    """The C function rounding a float to float8 type ``dtype`` (a float of its value)."""
    return f"sf_round_{FLOAT8[dtype][0]}"


def rounded(x: str, dtype: str) -> str:
    """C expression of float ``x`` rounded to float8 type ``dtype``, as a float."""
    return f"{rounder(dtype)}({x})"


def round_value(v: float, dtype: str) -> float:
    """``v`` rounded to float8 type ``dtype`` as ml_dtypes rounds it (a literal's value)."""
    import ml_dtypes
    import numpy as np

    with np.errstate(all="ignore"):
        return float(np.float32(v).astype(getattr(ml_dtypes, dtype)).astype(np.float32))
