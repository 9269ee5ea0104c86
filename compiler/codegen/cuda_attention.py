"""Fused attention kernel for the cuda target: ``softmax(Q Kᵀ · scale + bias) V`` in one pass.

One block of 4 warps takes 64 queries of one (batch, head); each warp owns 16 query rows. The
block walks the keys 64 at a time: K and V tiles are copied to shared memory with ``cp.async``
(double-buffered, the next tile loads while this one is used), the scores of the warp's rows
are computed with ``mma.sync.m16n8k16`` (half operands, float32 accumulators) and kept in
registers, scaled, biased and folded into a running softmax (row maximum, rescaled sum and
output: the online softmax of FlashAttention), and the probabilities, rounded to the half type
in the registers that held the scores, multiply the V tile on the tensor cores. The score
matrix is never written to memory, so memory is linear in the sequence length. At the end each
row is divided by its sum (a row whose every key is masked gives 0 under the op's mask rule,
NaN without it, as the op's definition says) and handed to the fused epilogue element by
element. With a causal mask (``is_causal``: query ``i`` sees keys ``j <= i + past_len``) or a
sliding window (``left_window``/``right_window`` around that diagonal) the kernel masks the
scores outside the band itself and does not visit the key blocks wholly outside it; likewise for
the keys past a batch's ``nonpad_kv_seqlen`` (a padded KV cache: the count is read per block at
run time, and without a past it also places the diagonal, at ``nonpad - S``); a softcap
(``softcap``) bounds the scaled scores with ``tanh`` before the masks are added
(rfcs/0005-hopper-gemm.md, decision 18).

Requirements (else the generic lowering runs): head sizes multiples of 16 up to 128; Q, K and V
dense half tensors whose head dimension is contiguous and whose other strides and offset are
multiples of 8 elements (16-byte copies). Used for the ``Attention`` ops that
:class:`~shardflow.compiler.passes.attention.FuseAttention` makes (mixed precision,
``acc_dtype="float32"``); see rfcs/0005-hopper-gemm.md.

The probabilities are rounded before the division by the row sum (FlashAttention's order), while
the op's definition rounds the normalised ones; both round each probability once to the half
type, so they differ by the half type's rounding (relative ``2**-11`` for float16), the error
budget of the precision (rfcs/0004-precision-and-fusion.md).
"""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from .cuda_templates import _indent

__all__ = ["AttnOperand", "attention_kernel", "ATTENTION_HELPERS", "BLOCK_Q", "BLOCK_K", "MAX_HEAD", "takes_heads"]

#: queries per block (4 warps x 16 rows) and keys per step
BLOCK_Q, BLOCK_K = 64, 64
#: largest head size (Q/K and V) the kernel takes
MAX_HEAD = 128


def takes_heads(d: int, dv: int) -> bool:
    """Whether the kernel takes head sizes ``d`` (Q, K) and ``dv`` (V): multiples of 16 up to
    ``MAX_HEAD``."""
    return d % 16 == 0 and dv % 16 == 0 and 0 < d <= MAX_HEAD and 0 < dv <= MAX_HEAD

ATTENTION_HELPERS = r"""
__device__ __forceinline__ void sf_att_cp16(unsigned dst, const void* src, bool full) {
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" :: "r"(dst), "l"(src), "r"(full ? 16 : 0) : "memory");
}
__device__ __forceinline__ void sf_att_commit() { asm volatile("cp.async.commit_group;\n" ::: "memory"); }
template <int N> __device__ __forceinline__ void sf_att_wait() {
  asm volatile("cp.async.wait_group %0;\n" :: "n"(N) : "memory");
}
__device__ __forceinline__ void sf_ldm_x4(unsigned addr, unsigned& r0, unsigned& r1, unsigned& r2, unsigned& r3) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0, %1, %2, %3}, [%4];\n"
               : "=r"(r0), "=r"(r1), "=r"(r2), "=r"(r3) : "r"(addr));
}
__device__ __forceinline__ void sf_ldm_x4_t(unsigned addr, unsigned& r0, unsigned& r1, unsigned& r2, unsigned& r3) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0, %1, %2, %3}, [%4];\n"
               : "=r"(r0), "=r"(r1), "=r"(r2), "=r"(r3) : "r"(addr));
}
"""

_MMA = {
    "f16": ("f16", "__half", "__floats2half2_rn", "__half2"),
    "bf16": ("bf16", "__nv_bfloat16", "__floats2bfloat162_rn", "__nv_bfloat162"),
}


@dataclass(frozen=True)
class AttnOperand:
    """A dense half operand: element ``(b, head, row, d)`` at ``ptr[const + b*sb + head*sh +
    row*sr + d]`` (strides in elements)."""

    ptr: str
    const: int
    sb: int
    sh: int
    sr: int


def _base(o: AttnOperand, head: str) -> str:
    return f"{o.ptr} + {o.const}LL + (long long)sf_b * {o.sb}LL + (long long){head} * {o.sh}LL"


def attention_kernel(*, symbol: str, params: str, half: str, B: int, H: int, S: int, L: int, D: int,
                     Dv: int, rep: int, q: AttnOperand, k: AttnOperand, v: AttnOperand, scale: float,
                     root: str, biases: Sequence[str], epilogue: str, causal: int | str | None = None,
                     empty_rows_zero: bool = True, lo: int | str | None = None, softcap: float = 0.0,
                     keys: str | None = None, sink: str | None = None) -> tuple[str, dict]:
    """The kernel's source and launch (``grid``, ``block``, ``shared_mem``).

    ``biases``: for each additive bias, in the order they are added to a score, C lines that set
    ``float sf_bias`` from ``sf_b, sf_h, sf_i, sf_j``;
    ``epilogue``: C lines that store the output element ``(sf_b, sf_h, sf_i, sf_e)`` from
    ``float sf_acc``; ``root``: lines run once per block (``sf_b``, ``sf_h`` known).
    ``causal``: None, or the offset ``c`` of a causal mask (or of a window's upper edge): query
    ``i`` sees keys ``j <= i + c`` only. The key blocks wholly past that diagonal are not
    visited (about half the work for a long sequence), and the blocks of queries are taken last
    first, so that the ones with the most keys start first. ``lo``: None, or the first key query ``i`` sees, ``i + lo`` (a
    sliding window); the key blocks wholly before it are not visited. ``softcap`` (> 0):
    scores become ``tanh(s / softcap) * softcap`` before the biases. ``empty_rows_zero``: a row
    whose every key is masked gives 0 (the ONNX op's rule), else NaN (``0 / 0``, what a softmax
    over ``-inf`` everywhere gives). ``keys``: None, or a C expression (of ``sf_b``, set by
    ``root``) for the number of keys the batch's rows see, in ``[0, L]`` (ONNX's
    ``nonpad_kv_seqlen``): the key blocks past it are not visited. ``causal`` and ``lo`` may be C
    expressions of the same kind (the diagonal of a padded KV cache, ``nonpad - S``). ``sink``:
    None, or a C expression (of ``sf_h``, set by ``root``) for the head's attention sink, one more
    logit in each row's softmax that weighs no value: the running maximum starts at it and the
    running sum at 1 (in one of the four threads that share a row, whose sums are added at the end).
    """
    if D % 16 or Dv % 16:
        raise ValueError(f"head sizes {D}, {Dv}: the kernel takes multiples of 16")
    ab, ht, pack, h2 = _MMA[half]
    ldq, ldv = D + 8, Dv + 8  # row pitch in shared memory: 16 bytes of padding against bank conflicts
    q_elems, k_elems, v_elems = BLOCK_Q * ldq, BLOCK_K * ldq, BLOCK_K * ldv
    smem = 2 * (q_elems + 2 * k_elems + 2 * v_elems)
    nkb = -(-L // BLOCK_K)
    kd, nd = D // 16, Dv // 8

    def mma_call(c, a0, a1, a2, a3, b0, b1):  # C (4 floats) += A (16 x 16, 4 regs) B (16 x 8, 2 regs)
        outs = ", ".join(f'"+f"({c}[{i}])' for i in range(4))
        ins = ", ".join(f'"r"({x})' for x in (a0, a1, a2, a3, b0, b1))
        return (f'asm volatile("mma.sync.aligned.m16n8k16.row.col.f32.{ab}.{ab}.f32 {{%0, %1, %2, %3}}, '
                f'{{%4, %5, %6, %7}}, {{%8, %9}}, {{%0, %1, %2, %3}};\\n" : {outs} : {ins});')

    p_frag = ("sf_p[2 * kk][0]", "sf_p[2 * kk][1]", "sf_p[2 * kk + 1][0]", "sf_p[2 * kk + 1][1]")
    def offset(c: int | str) -> str:
        if isinstance(c, str):
            return f" + ({c})"
        return f" + {c}" if c > 0 else f" - {-c}" if c else ""
    key_limit = str(L) if keys is None else keys
    blocks = str(nkb) if keys is None else f"({keys} + {BLOCK_K - 1}) / {BLOCK_K}"  # key blocks with a key
    if causal is None:
        q_block, causal_test = "blockIdx.x", ""
        nkb_code = "" if keys is None else f"  const int sf_nkb = {blocks};\n"
    else:  # heaviest query blocks first; the key blocks that hold a key some row of the block sees
        q_block = "(gridDim.x - 1 - blockIdx.x)"
        causal_test = f" && sf_j <= sf_i{offset(causal)}"
        nkb_code = (f"  const int sf_last = min(sf_q0 + {BLOCK_Q - 1}, {S - 1}){offset(causal)};  // the last key "
                    "the block's rows see\n"
                    f"  const int sf_nkb = sf_last < 0 ? 0 : min({blocks}, sf_last / {BLOCK_K} + 1);\n")
    nkb_bound = str(nkb) if causal is None and keys is None else "sf_nkb"
    kb0, stage = "0", "kb & 1"
    if lo is not None:  # the key blocks from the one that holds the first key the block's first row sees
        causal_test += f" && sf_j >= sf_i{offset(lo)}"
        nkb_code += (f"  const int sf_first = sf_q0{offset(lo)};  // the first key the block's rows see\n"
                     f"  const int sf_kb0 = sf_first <= 0 ? 0 : sf_first / {BLOCK_K};\n")
        kb0, stage = "sf_kb0", "(kb - sf_kb0) & 1"
    cap = f"        x = tanhf(x / {softcap!r}f) * {softcap!r}f;\n" if softcap > 0 else ""
    bias_code = "\n".join(f"""            {{
              float sf_bias;
{_indent(bias, 14)}
              x += sf_bias;
            }}""" for bias in biases)
    normalised = "sf_sum > 0.0f ? sf_o[n][r] / sf_sum : 0.0f" if empty_rows_zero else "sf_o[n][r] / sf_sum"
    if sink is None:
        init = "  float sf_m[2] = {__int_as_float(0xff800000), __int_as_float(0xff800000)}, sf_l[2] = {0.0f, 0.0f};"
    else:  # the sink's exp(sink - m) = 1 at m = sink, counted once per row (by its t = 0 thread)
        init = (f"  float sf_m[2] = {{{sink}, {sink}}};\n"
                "  float sf_l[2] = {sf_t == 0 ? 1.0f : 0.0f, sf_t == 0 ? 1.0f : 0.0f};")
    epi = _indent(epilogue, 10)
    root_code = _indent(root, 2)
    src = f"""extern "C" __global__ void __launch_bounds__(128) {symbol}({params}) {{
  extern __shared__ __align__(16) unsigned char sf_dyn[];
  {ht}* sf_Qs = reinterpret_cast<{ht}*>(sf_dyn);
  {ht}* sf_Ks = sf_Qs + {q_elems};  // two stages
  {ht}* sf_Vs = sf_Ks + {2 * k_elems};  // two stages
  const int sf_b = blockIdx.z, sf_h = blockIdx.y, sf_q0 = {q_block} * {BLOCK_Q};
  const int sf_hk = sf_h / {rep};
  const int sf_warp = threadIdx.x >> 5, sf_lane = threadIdx.x & 31;
  const int sf_g = sf_lane >> 2, sf_t = sf_lane & 3;
{root_code}
  const {ht}* sf_qp = {_base(q, "sf_h")};
  const {ht}* sf_kp = {_base(k, "sf_hk")};
  const {ht}* sf_vp = {_base(v, "sf_hk")};
  for (int c = threadIdx.x; c < {BLOCK_Q * (D // 8)}; c += 128) {{
    const int r = c / {D // 8}, cc = c % {D // 8}, i = sf_q0 + r;
    sf_att_cp16((unsigned)__cvta_generic_to_shared(sf_Qs + r * {ldq} + cc * 8),
                sf_qp + (long long)min(i, {S - 1}) * {q.sr}LL + cc * 8, i < {S});
  }}
  auto sf_load_kv = [&](int kb, int st) {{
    {ht}* ks = sf_Ks + st * {k_elems};
    {ht}* vs = sf_Vs + st * {v_elems};
    for (int c = threadIdx.x; c < {BLOCK_K * (D // 8)}; c += 128) {{
      const int r = c / {D // 8}, cc = c % {D // 8}, j = kb * {BLOCK_K} + r;
      sf_att_cp16((unsigned)__cvta_generic_to_shared(ks + r * {ldq} + cc * 8),
                  sf_kp + (long long)min(j, {L - 1}) * {k.sr}LL + cc * 8, j < {L});
    }}
    for (int c = threadIdx.x; c < {BLOCK_K * (Dv // 8)}; c += 128) {{
      const int r = c / {Dv // 8}, cc = c % {Dv // 8}, j = kb * {BLOCK_K} + r;
      sf_att_cp16((unsigned)__cvta_generic_to_shared(vs + r * {ldv} + cc * 8),
                  sf_vp + (long long)min(j, {L - 1}) * {v.sr}LL + cc * 8, j < {L});
    }}
  }};
{nkb_code}  sf_load_kv({kb0}, 0);
  sf_att_commit();
  // this warp's 16 query rows as mma A fragments, loaded once
  sf_att_wait<0>();
  __syncthreads();
  unsigned sf_qf[{kd}][4];
  #pragma unroll
  for (int kk = 0; kk < {kd}; ++kk)
    sf_ldm_x4((unsigned)__cvta_generic_to_shared(sf_Qs + (sf_warp * 16 + (sf_lane & 15)) * {ldq} + kk * 16
                                                  + (sf_lane >> 4) * 8),
              sf_qf[kk][0], sf_qf[kk][1], sf_qf[kk][2], sf_qf[kk][3]);
  float sf_o[{nd}][4];
  #pragma unroll
  for (int n = 0; n < {nd}; ++n) sf_o[n][0] = sf_o[n][1] = sf_o[n][2] = sf_o[n][3] = 0.0f;
{init}
  for (int kb = {kb0}; kb < {nkb_bound}; ++kb) {{
    const int st = {stage};
    if (kb + 1 < {nkb_bound}) sf_load_kv(kb + 1, st ^ 1);
    sf_att_commit();
    sf_att_wait<1>();
    __syncthreads();
    const {ht}* ks = sf_Ks + st * {k_elems};
    const {ht}* vs = sf_Vs + st * {v_elems};
    float sf_s[8][4];
    #pragma unroll
    for (int n = 0; n < 8; ++n) sf_s[n][0] = sf_s[n][1] = sf_s[n][2] = sf_s[n][3] = 0.0f;
    #pragma unroll
    for (int kk = 0; kk < {kd}; ++kk) {{
      #pragma unroll
      for (int p = 0; p < 4; ++p) {{
        unsigned b0, b1, b2, b3;
        sf_ldm_x4((unsigned)__cvta_generic_to_shared(ks + (p * 16 + (sf_lane >> 4) * 8 + (sf_lane & 7)) * {ldq}
                                                      + kk * 16 + ((sf_lane >> 3) & 1) * 8), b0, b1, b2, b3);
        {mma_call("sf_s[2 * p]", "sf_qf[kk][0]", "sf_qf[kk][1]", "sf_qf[kk][2]", "sf_qf[kk][3]", "b0", "b1")}
        {mma_call("sf_s[2 * p + 1]", "sf_qf[kk][0]", "sf_qf[kk][1]", "sf_qf[kk][2]", "sf_qf[kk][3]", "b2", "b3")}
      }}
    }}
    // scale, bias, keys past the end; the running maximum of each of the thread's two rows
    float sf_mx[2] = {{__int_as_float(0xff800000), __int_as_float(0xff800000)}};
    #pragma unroll
    for (int n = 0; n < 8; ++n) {{
      #pragma unroll
      for (int r = 0; r < 4; ++r) {{
        const int sf_i = sf_q0 + sf_warp * 16 + sf_g + (r >> 1) * 8;
        const int sf_j = kb * {BLOCK_K} + n * 8 + sf_t * 2 + (r & 1);
        float x = sf_s[n][r] * {scale!r}f;
{cap}        if (sf_j < {key_limit} && sf_i < {S}{causal_test}) {{
{bias_code}
        }} else {{
          x = __int_as_float(0xff800000);
        }}
        (void)sf_i;
        sf_s[n][r] = x;
        sf_mx[r >> 1] = fmaxf(sf_mx[r >> 1], x);
      }}
    }}
    float sf_alpha[2], sf_base[2];
    #pragma unroll
    for (int h = 0; h < 2; ++h) {{
      sf_mx[h] = fmaxf(sf_mx[h], __shfl_xor_sync(0xffffffffu, sf_mx[h], 1));
      sf_mx[h] = fmaxf(sf_mx[h], __shfl_xor_sync(0xffffffffu, sf_mx[h], 2));
      const float mnew = fmaxf(sf_m[h], sf_mx[h]);
      sf_base[h] = mnew == __int_as_float(0xff800000) ? 0.0f : mnew;  // a row with no allowed key so far
      sf_alpha[h] = __expf(sf_m[h] - sf_base[h]);  // 0 while the row had nothing (exp(-inf))
      sf_m[h] = mnew;
      sf_l[h] *= sf_alpha[h];
    }}
    #pragma unroll
    for (int n = 0; n < {nd}; ++n) {{
      sf_o[n][0] *= sf_alpha[0]; sf_o[n][1] *= sf_alpha[0];
      sf_o[n][2] *= sf_alpha[1]; sf_o[n][3] *= sf_alpha[1];
    }}
    unsigned sf_p[8][2];  // the probabilities, rounded: A fragments of the P V product
    #pragma unroll
    for (int n = 0; n < 8; ++n) {{
      const float p0 = __expf(sf_s[n][0] - sf_base[0]), p1 = __expf(sf_s[n][1] - sf_base[0]);
      const float p2 = __expf(sf_s[n][2] - sf_base[1]), p3 = __expf(sf_s[n][3] - sf_base[1]);
      sf_l[0] += p0 + p1;
      sf_l[1] += p2 + p3;
      {h2} lo = {pack}(p0, p1), hi = {pack}(p2, p3);
      sf_p[n][0] = *reinterpret_cast<unsigned*>(&lo);
      sf_p[n][1] = *reinterpret_cast<unsigned*>(&hi);
    }}
    #pragma unroll
    for (int kk = 0; kk < 4; ++kk) {{
      #pragma unroll
      for (int n = 0; n < {nd}; n += 2) {{
        unsigned b0, b1, b2, b3;
        sf_ldm_x4_t((unsigned)__cvta_generic_to_shared(vs + (kk * 16 + ((sf_lane >> 3) & 1) * 8 + (sf_lane & 7)) * {ldv}
                                                        + n * 8 + (sf_lane >> 4) * 8), b0, b1, b2, b3);
        {mma_call("sf_o[n]", *p_frag, "b0", "b1")}
        {mma_call("sf_o[n + 1]", *p_frag, "b2", "b3")}
      }}
    }}
    __syncthreads();  // the stage is loaded again two steps on
  }}
  #pragma unroll
  for (int h = 0; h < 2; ++h) {{
    sf_l[h] += __shfl_xor_sync(0xffffffffu, sf_l[h], 1);
    sf_l[h] += __shfl_xor_sync(0xffffffffu, sf_l[h], 2);
  }}
  #pragma unroll
  for (int n = 0; n < {nd}; ++n) {{
    #pragma unroll
    for (int r = 0; r < 4; ++r) {{
      const int sf_i = sf_q0 + sf_warp * 16 + sf_g + (r >> 1) * 8;
      const int sf_e = n * 8 + sf_t * 2 + (r & 1);
      if (sf_i < {S}) {{
        const float sf_sum = sf_l[r >> 1];
        const float sf_acc = {normalised};
        {{
{epi}
        }}
      }}
    }}
  }}
}}
"""
    cfg = {"grid": (-(-S // BLOCK_Q), H, B), "block": (128, 1, 1), "shared_mem": smem}
    return src, cfg
