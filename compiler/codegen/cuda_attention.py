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

Split-KV (decision 36; :func:`kv_splits`): when the blocks of queries would leave most
multiprocessors idle and the keys are long (a decoding step: one query per head over a KV
cache), each block of queries is taken by several blocks, each over an equal share of its key
steps; each stores its rows' running maximum, sum and unnormalized outputs, and the last to
count itself in (a per-block counter, reset by it) combines them in split order (the same bits
whichever finishes last) and runs the epilogue.

Float32 operands (``precision`` float32 or tf32; rfcs/0005-hopper-gemm.md, decision 35) take the
same kernel on ``mma.sync.m16n8k8`` TF32 tensor cores: one TF32 product (tf32), or 3xTF32 (each
operand ``hi + lo``, ``lo·hi + hi·lo + hi·hi``: float32 accuracy, as the portable GEMM at float32).
Q, K and V stay float32 in shared memory (32 keys a step; at head size 128 Q and two stages of K
and V take 99 KB, what sm_86/sm_89 give a block) and are converted at each use: Q's and K's
fragments by ``ldmatrix`` (its 16-bit 8 x 8 matrices are 8 x 4 floats, where the TF32 fragments
want them), V's one float at a time; the probabilities stay in the registers of the scores, the
keys of each 8 taken in the order those hold them (``2t``, ``2t + 1``).

Grouped heads in a decoding step (GQA packing, decision 39; :func:`packs_heads`): where a
block per query head would hold a few queries, a block's 64 rows take the ``rep`` query heads
of one KV head (row ``p``: query ``p // rep`` of head ``hk * rep + p % rep``), so that each K and V
tile is loaded once for the group, not once per head, and the blocks saved go to more key splits.

Head sizes beyond 128 (up to 256, Gemma's; half operands, decision 38): 32 keys a step, so that
Q and two stages of K and V still fit 99 KB, and a V wider than 128 columns shared between two
blocks (each computes every score and accumulates half of the columns: the accumulators of 256
columns would not fit a thread's registers).

Head sizes that are multiples of 8 but not 16 (Stable Diffusion's 40, test configurations' 8 and
24; decision 50): float32 operands' ``m16n8k8`` products take them as they are; half operands are
held in shared memory padded to the next multiple of 16, the columns past the head size filled with
zeros by copies of no bytes (Q and K: the scores do not change; V: its extra output columns are not
stored).

Requirements (else the generic lowering runs): sm_80 or newer; head sizes multiples of 8 up to
128, or up to 256 on half operands (V's beyond 128 a multiple of 32); Q, K and V dense tensors
of one type (float16, bfloat16 or float32) whose head dimension is contiguous and whose other
strides and offset are multiples of 16 bytes. Used for the
``Attention`` ops that :class:`~shardflow.compiler.passes.attention.FuseAttention` makes (mixed
precision, ``acc_dtype="float32"``; float32 operands) and a model's own; see
rfcs/0005-hopper-gemm.md.

The probabilities are rounded before the division by the row sum (FlashAttention's order), while
the op's definition rounds the normalised ones; both round each probability once to the half
type, so they differ by the half type's rounding (relative ``2**-11`` for float16), the error
budget of the precision (rfcs/0004-precision-and-fusion.md).
"""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from .cuda_templates import TF32_HI_FINITE, _indent

__all__ = ["AttnOperand", "attention_kernel", "ATTENTION_HELPERS", "ATTENTION_FLOAT_HELPERS", "BLOCK_Q", "BLOCK_K",
           "BLOCK_K_FLOAT", "FLOAT_TYPES", "MAX_HEAD", "kv_splits", "packs_heads", "takes_heads"]

#: queries per block (4 warps x 16 rows) and keys per step
BLOCK_Q, BLOCK_K = 64, 64
#: largest head size (Q/K and V) the kernel takes on float32 operands, and in one pass over V
MAX_HEAD = 128
#: largest head size on half operands: Q Kᵀ in one pass, 32 keys a step; V's columns in two
#: halves (a block each, the scores computed by both) when wider than ``MAX_HEAD``
MAX_HEAD_HALF = 256
#: the float32 kernels' operand types: one TF32 product, or 3xTF32 (``precision`` ``"tf32"``, ``"float32"``)
FLOAT_TYPES = ("tf32", "f32")
#: keys per step of the float32 kernels (Q and two stages of K and V at head size 128: 99 KB)
BLOCK_K_FLOAT = 32
#: split-KV (:func:`kv_splits`): the blocks a launch should fill by default (H100/H200's
#: multiprocessors; the target's count where the caller gives it), the fewest key steps a split
#: takes, the most splits
SPLIT_SMS, SPLIT_MIN_STEPS, MAX_SPLITS = 132, 4, 16


def keys_per_step(ab: str, D: int, Dv: int) -> int:
    """Keys a block takes per step: 64 for half operands (32 beyond head size 128, so that Q and
    two stages of K and V fit 99 KB), ``BLOCK_K_FLOAT`` for float32 ones."""
    if ab in FLOAT_TYPES:
        return BLOCK_K_FLOAT
    return BLOCK_K if max(D, Dv) <= MAX_HEAD else BLOCK_K // 2


def v_chunks(Dv: int) -> int:
    """The blocks V's columns are shared among (each computing all the scores): 2 beyond
    ``MAX_HEAD`` (the output accumulators of 128 columns a thread group holds), else 1."""
    return 1 if Dv <= MAX_HEAD else 2


def packs_heads(S: int, rep: int) -> bool:
    """Whether a block's 64 rows take the ``rep`` query heads of a KV head together (GQA packing,
    decision 39): row ``p`` of the group is query ``p // rep`` of head ``hk * rep + p % rep``, so
    that the group's heads share each K and V tile a block loads, where a block per query head
    would load the same tiles ``rep`` times. When it takes fewer blocks than a block per head
    (``ceil(S * rep / 64) < rep * ceil(S / 64)``): a decoding step's single query (``rep`` rows
    of 64 instead of ``rep`` blocks of one), a few speculative ones; not a prompt, whose blocks
    are full either way."""
    return rep > 1 and -(-S * rep // BLOCK_Q) < rep * -(-S // BLOCK_Q)


def kv_splits(B: int, H: int, S: int, L: int, ab: str, D: int = 64, Dv: int = 64, sms: int = SPLIT_SMS) -> int:
    """How many blocks share the keys of each block of queries (split-KV, FlashDecoding's): 1
    unless the query blocks (``ceil(S / 64) * H * B``, times :func:`v_chunks`; for heads packed
    by :func:`packs_heads`, ``H`` KV heads of ``S * rep`` rows) leave
    multiprocessors (``sms``) idle and the keys are long enough that each split gets
    ``SPLIT_MIN_STEPS`` steps (a decoding step's single query over a long KV cache: otherwise one
    block per head streams the whole cache)."""
    blocks = -(-S // BLOCK_Q) * H * B * v_chunks(Dv)
    steps = -(-L // keys_per_step(ab, D, Dv))
    return max(1, min(sms // max(blocks, 1), steps // SPLIT_MIN_STEPS, MAX_SPLITS))


def takes_heads(d: int, dv: int, float32: bool = False) -> bool:
    """Whether the kernel takes head sizes ``d`` (Q, K) and ``dv`` (V): multiples of 8 up to
    ``MAX_HEAD`` (float32 operands), or up to ``MAX_HEAD_HALF`` (half operands, padded to 16 in
    shared memory: :func:`padded`; a ``dv`` beyond ``MAX_HEAD`` a multiple of 32, halved between
    two blocks)."""
    if d % 8 or dv % 8 or d <= 0 or dv <= 0:
        return False
    if float32:
        return d <= MAX_HEAD and dv <= MAX_HEAD
    return d <= MAX_HEAD_HALF and (dv <= MAX_HEAD or (dv <= MAX_HEAD_HALF and dv % 32 == 0))


def padded(n: int, ab: str) -> int:
    """A head size as the kernel holds it in shared memory: for half operands the next multiple of
    16 (an ``m16n8k16`` product's K, two of ``P V``'s 8-column tiles per ``ldmatrix``), the columns
    past ``n`` zero (copies of no bytes), so that the scores do not change and the outputs past
    ``n`` are not stored; float32 operands' ``m16n8k8`` products take any multiple of 8 as it is."""
    return n if ab in FLOAT_TYPES else -(-n // 16) * 16


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

ATTENTION_FLOAT_HELPERS = r"""// the float32 kernels' TF32 operands (cvt.rna: to nearest, ties away from zero);
// 3xTF32: x = hi + lo, hi finite (an infinite or NaN x in lo)
__device__ __forceinline__ unsigned sf_att_tf32(float x) {
  unsigned r;
  asm("cvt.rna.tf32.f32 %0, %1;\n" : "=r"(r) : "f"(x));
  return r;
}
__device__ __forceinline__ void sf_att_split(float x, unsigned& hi, unsigned& lo) {
  float h = __uint_as_float(sf_att_tf32(x));
  """ + TF32_HI_FINITE.format(h="h", x="x") + r"""
  hi = __float_as_uint(h);
  lo = sf_att_tf32(x - h);
}
"""

_MMA = {
    "f16": ("f16", "__half", "__floats2half2_rn", "__half2"),
    "bf16": ("bf16", "__nv_bfloat16", "__floats2bfloat162_rn", "__nv_bfloat162"),
}


@dataclass(frozen=True)
class AttnOperand:
    """A dense operand: element ``(b, head, row, d)`` at ``ptr[const + b*sb + head*sh +
    row*sr + d]`` (strides in elements)."""

    ptr: str
    const: int
    sb: int
    sh: int
    sr: int


def _base(o: AttnOperand, head: str) -> str:
    return f"{o.ptr} + {o.const}LL + (long long)sf_b * {o.sb}LL + (long long){head} * {o.sh}LL"


def attention_kernel(*, symbol: str, params: str, ab: str, B: int, H: int, S: int, L: int, D: int,
                     Dv: int, rep: int, q: AttnOperand, k: AttnOperand, v: AttnOperand, scale: float,
                     root: str, biases: Sequence[str], epilogue: str, causal: int | str | None = None,
                     empty_rows_zero: bool = True, lo: int | str | None = None, softcap: float = 0.0,
                     keys: str | None = None, sink: str | None = None, sms: int = SPLIT_SMS) -> tuple[str, dict]:
    """The kernel's source and launch (``grid``, ``block``, ``shared_mem``).

    ``ab``: the operands' type and products: ``"f16"``/``"bf16"`` (half operands), ``"tf32"``
    (float32 operands, one TF32 product) or ``"f32"`` (float32 operands, 3xTF32; see
    :data:`FLOAT_TYPES`).
    ``biases``: for each additive bias, in the order they are added to a score, C lines that set
    ``float sf_bias`` from ``sf_b, sf_h, sf_i, sf_j``;
    ``epilogue``: C lines that store the output element ``(sf_b, sf_h, sf_i, sf_e)`` from
    ``float sf_acc``; ``root``: lines run once per block (``sf_b``, ``sf_h`` and ``sf_hk`` known;
    with the heads packed, :func:`packs_heads`, ``sf_b`` and ``sf_hk`` only: ``sf_h`` is a row's,
    known to the biases, the sink and the epilogue).
    ``causal``: None, or the offset ``c`` of a causal mask (or of a window's upper edge): query
    ``i`` sees keys ``j <= i + c`` only. The key blocks wholly past that diagonal are not
    visited (about half the work for a long sequence), and the blocks of queries are taken last
    first, so that the ones with the most keys start first. ``lo``: None, or the first key query
    ``i`` sees, ``i + lo`` (a sliding window); the key blocks wholly before it are not visited. ``softcap`` (> 0):
    scores become ``tanh(s / softcap) * softcap`` before the biases. ``empty_rows_zero``: a row
    whose every key is masked gives 0 (the ONNX op's rule), else NaN (``0 / 0``, what a softmax
    over ``-inf`` everywhere gives). ``keys``: None, or a C expression (of ``sf_b``, set by
    ``root``) for the number of keys the batch's rows see, in ``[0, L]`` (ONNX's
    ``nonpad_kv_seqlen``): the key blocks past it are not visited. ``causal`` and ``lo`` may be C
    expressions of the same kind (the diagonal of a padded KV cache, ``nonpad - S``). ``sink``:
    None, or a C expression (of ``sf_h`` and what ``root`` sets) for the head's attention sink, one more
    logit in each row's softmax that weighs no value: the running maximum starts at it and the
    running sum at 1 (in one of the four threads that share a row, whose sums are added at the end).
    The sizes decide the rest: keys per step (:func:`keys_per_step`), the blocks V's columns are
    shared among (:func:`v_chunks`), whether a block's rows take a KV head's ``rep`` query heads
    (:func:`packs_heads`; then the grid's y is the KV heads) and the key splits
    (:func:`kv_splits`, for ``sms`` multiprocessors); the grid's x is the blocks of queries times
    those splits and chunks.
    """
    flt = ab in FLOAT_TYPES
    if not takes_heads(D, Dv, flt):
        raise ValueError(f"head sizes {D}, {Dv}: not taken for {ab} operands (takes_heads)")
    bk = keys_per_step(ab, D, Dv)
    nkt = bk // 8  # score tiles of 8 keys per step
    nch = v_chunks(Dv)
    dvc = Dv // nch  # this block's columns of V
    Dp, dvp = padded(D, ab), padded(dvc, ab)  # (as held in shared memory: half operands' zero columns)
    if flt:  # row pitches of 4 floats past 32 banks: ldmatrix rows and V's (keys 2t, 2t + 1; column g) apart
        ht, vec, ldq, ldv = "float", 4, D + 4, Dv + 4
        q_elems, k_elems, v_elems = BLOCK_Q * ldq, bk * ldq, bk * ldv
        smem = 4 * (q_elems + 2 * k_elems + 2 * v_elems)
    else:
        mma_ab, ht, pack, h2 = _MMA[ab]
        vec, ldq, ldv = 8, Dp + 8, dvp + 8  # row pitch in shared memory: 16 bytes of padding against bank conflicts
        q_elems, k_elems, v_elems = BLOCK_Q * ldq, bk * ldq, bk * ldv
        smem = 2 * (q_elems + 2 * k_elems + 2 * v_elems)
    nkb = -(-L // bk)
    kd, nd = (D // 8 if flt else Dp // 16), dvp // 8

    def chunks(width: int, width_p: int, full: str) -> tuple[int, str, str]:
        """A row's 16-byte copies (``width_p // vec``, with zero ones past ``width``), the source
        column of copy ``cc`` and whether it copies bytes."""
        if width_p == width:
            return width // vec, f"cc * {vec}", full
        return width_p // vec, f"min(cc, {width // vec - 1}) * {vec}", f"{full} && cc < {width // vec}"

    def mma_call(c, a0, a1, a2, a3, b0, b1):  # C (4 floats) += A (16 x 16 or 16 x 8, 4 regs) B (2 regs)
        outs = ", ".join(f'"+f"({c}[{i}])' for i in range(4))
        ins = ", ".join(f'"r"({x})' for x in (a0, a1, a2, a3, b0, b1))
        shape_types = "m16n8k8.row.col.f32.tf32.tf32" if flt else f"m16n8k16.row.col.f32.{mma_ab}.{mma_ab}"
        return (f'asm volatile("mma.sync.aligned.{shape_types}.f32 {{%0, %1, %2, %3}}, '
                f'{{%4, %5, %6, %7}}, {{%8, %9}}, {{%0, %1, %2, %3}};\\n" : {outs} : {ins});')

    def offset(c: int | str) -> str:
        if isinstance(c, str):
            return f" + ({c})"
        return f" + {c}" if c > 0 else f" - {-c}" if c else ""
    key_limit = str(L) if keys is None else keys
    blocks = str(nkb) if keys is None else f"({keys} + {bk - 1}) / {bk}"  # key blocks with a key
    packed = packs_heads(S, rep)
    R, G = (S * rep, H // rep) if packed else (S, H)  # rows of a block's head (a KV head's group if packed); heads
    nqb, splits = -(-R // BLOCK_Q), kv_splits(B, G, R, L, ab, D, Dv, sms)

    def row(r: str) -> str:  # the query (and, packed, the head) of the block's row r
        if not packed:
            return f"const int sf_i = sf_q0 + {r};"
        return f"const int sf_pr = sf_q0 + {r}, sf_i = sf_pr / {rep}, sf_h = sf_hk * {rep} + sf_pr % {rep};"
    qrow = "sf_q0" if not packed else f"sf_q0 / {rep}"  # the block's first query
    bx = "blockIdx.x" if nch == 1 else f"(blockIdx.x / {nch})"  # (V's columns: blockIdx.x % nch)
    qb = bx if splits == 1 else f"({bx} / {splits})"  # (split-KV: bx % splits)
    if causal is None:
        q_block, causal_test = qb, ""
        nkb_code = "" if keys is None else f"  const int sf_nkb = {blocks};\n"
    else:  # heaviest query blocks first; the key blocks that hold a key some row of the block sees
        q_block = "(gridDim.x - 1 - blockIdx.x)" if splits == nch == 1 else f"({nqb - 1} - {qb})"
        causal_test = f" && sf_j <= sf_i{offset(causal)}"
        last_q = f"sf_q0 + {BLOCK_Q - 1}" if not packed else f"(sf_q0 + {BLOCK_Q - 1}) / {rep}"
        nkb_code = (f"  const int sf_last = min({last_q}, {S - 1}){offset(causal)};  // the last key "
                    "the block's rows see\n"
                    f"  const int sf_nkb = sf_last < 0 ? 0 : min({blocks}, sf_last / {bk} + 1);\n")
    nkb_bound = str(nkb) if causal is None and keys is None else "sf_nkb"
    kb0, stage = "0", "kb & 1"
    if lo is not None:  # the key blocks from the one that holds the first key the block's first row sees
        causal_test += f" && sf_j >= sf_i{offset(lo)}"
        nkb_code += (f"  const int sf_first = {qrow}{offset(lo)};  // the first key the block's rows see\n"
                     f"  const int sf_kb0 = sf_first <= 0 ? 0 : sf_first / {bk};\n")
        kb0, stage = "sf_kb0", "(kb - sf_kb0) & 1"
    if splits > 1:  # this split's share of the block's key steps, in order (a share may be empty)
        nkb_code += (f"  const int sf_split = {bx} % {splits}, sf_steps = max({nkb_bound} - {kb0}, 0);\n"
                     f"  const int sf_per = (sf_steps + {splits - 1}) / {splits};\n"
                     f"  const int sf_kbs = {kb0} + sf_split * sf_per, "
                     f"sf_kbe = min(sf_kbs + sf_per, {kb0} + sf_steps);\n")
        kb0, nkb_bound, stage = "sf_kbs", "sf_kbe", "(kb - sf_kbs) & 1"
    cap = f"        x = tanhf(x / {softcap!r}f) * {softcap!r}f;\n" if softcap > 0 else ""
    bias_code = "\n".join(f"""            {{
              float sf_bias;
{_indent(bias, 14)}
              x += sf_bias;
            }}""" for bias in biases)
    e_test = "" if dvp == dvc else f" && sf_e < {Dv}"  # (a padded V's zero columns: not stored)
    normalised = "sf_sum > 0.0f ? sf_o[n][r] / sf_sum : 0.0f" if empty_rows_zero else "sf_o[n][r] / sf_sum"
    if sink is None:
        init = "  float sf_m[2] = {__int_as_float(0xff800000), __int_as_float(0xff800000)}, sf_l[2] = {0.0f, 0.0f};"
    else:  # the sink's exp(sink - m) = 1 at m = sink, counted once per row (by its t = 0 thread; by split 0 only)
        m0, l0 = (sink, "sf_t == 0") if splits == 1 else \
            (f"sf_split == 0 ? {sink} : __int_as_float(0xff800000)", "sf_split == 0 && sf_t == 0")
        if packed:  # (each row's head's sink)
            init = f"""  float sf_m[2], sf_l[2];
  #pragma unroll
  for (int h = 0; h < 2; ++h) {{
    {row("sf_warp * 16 + sf_g + h * 8")}
    (void)sf_i;
    sf_m[h] = {m0};
    sf_l[h] = {l0} ? 1.0f : 0.0f;
  }}"""
        else:
            init = f"  float sf_m[2] = {{{m0}, {m0}}};\n  float sf_l[2] = {{{l0} ? 1.0f : 0.0f, {l0} ? 1.0f : 0.0f}};"
    epi = _indent(epilogue, 10)
    root_code = _indent(root, 2)
    exp = "expf" if ab == "f32" else "__expf"  # (3xTF32: float32's exp, as the separate Softmax has)
    e0_code = "" if nch == 1 else f"  const int sf_e0 = (int)(blockIdx.x % {nch}) * {dvc};  // this block's V columns\n"
    pointers = f"""  {ht}* sf_Qs = reinterpret_cast<{ht}*>(sf_dyn);
  {ht}* sf_Ks = sf_Qs + {q_elems};  // two stages
  {ht}* sf_Vs = sf_Ks + {2 * k_elems};  // two stages"""
    q_at = "" if not packed else f"(long long)(sf_pr % {rep}) * {q.sh}LL + "  # (packed: the row's head in the group)
    q_row = "i = sf_q0 + r" if not packed else f"sf_pr = sf_q0 + r, i = sf_pr / {rep}"
    nq, q_col, q_full = chunks(D, Dp, f"i < {S}")
    nk, k_col, k_full = chunks(D, Dp, f"j < {L}")
    nv, v_col, v_full = chunks(dvc, dvp, f"j < {L}")
    q_copy = f"""  for (int c = threadIdx.x; c < {BLOCK_Q * nq}; c += 128) {{
    const int r = c / {nq}, cc = c % {nq}, {q_row};
    sf_att_cp16((unsigned)__cvta_generic_to_shared(sf_Qs + r * {ldq} + cc * {vec}),
                sf_qp + {q_at}(long long)min(i, {S - 1}) * {q.sr}LL + {q_col}, {q_full});
  }}
"""
    heads = (f"sf_h = blockIdx.y, sf_q0 = {q_block} * {BLOCK_Q};\n  const int sf_hk = sf_h / {rep};" if not packed else
             f"sf_hk = blockIdx.y, sf_q0 = {q_block} * {BLOCK_Q};  // (the group's {rep} query heads packed)")
    if flt:  # (Q's fragments read from shared memory at each use: the kernel's registers go to the products)
        q_frags = ""
        products, probabilities = _float_products(ab, kd, nkt, nd, ldq, ldv, mma_call, exp)
    else:
        q_frags = f"""  // this warp's 16 query rows as mma A fragments, loaded once
  sf_att_wait<0>();
  __syncthreads();
  unsigned sf_qf[{kd}][4];
  #pragma unroll
  for (int kk = 0; kk < {kd}; ++kk)
    sf_ldm_x4((unsigned)__cvta_generic_to_shared(sf_Qs + (sf_warp * 16 + (sf_lane & 15)) * {ldq} + kk * 16
                                                  + (sf_lane >> 4) * 8),
              sf_qf[kk][0], sf_qf[kk][1], sf_qf[kk][2], sf_qf[kk][3]);
"""
        products, probabilities = _half_products(ht, pack, h2, kd, nd, nkt, ldq, ldv, mma_call)
    src = f"""extern "C" __global__ void __launch_bounds__(128) {symbol}({params}) {{
  extern __shared__ __align__(16) unsigned char sf_dyn[];
{pointers}
  const int sf_b = blockIdx.z, {heads}
  const int sf_warp = threadIdx.x >> 5, sf_lane = threadIdx.x & 31;
  const int sf_g = sf_lane >> 2, sf_t = sf_lane & 3;
{e0_code}{root_code}
  const {ht}* sf_qp = {_base(q, "sf_h" if not packed else f"(sf_hk * {rep})")};
  const {ht}* sf_kp = {_base(k, "sf_hk")};
  const {ht}* sf_vp = {_base(v, "sf_hk")}{"" if nch == 1 else " + sf_e0"};
{q_copy}  auto sf_load_kv = [&](int kb, int st) {{
    {ht}* ks = sf_Ks + st * {k_elems};
    {ht}* vs = sf_Vs + st * {v_elems};
    for (int c = threadIdx.x; c < {bk * nk}; c += 128) {{
      const int r = c / {nk}, cc = c % {nk}, j = kb * {bk} + r;
      sf_att_cp16((unsigned)__cvta_generic_to_shared(ks + r * {ldq} + cc * {vec}),
                  sf_kp + (long long)min(j, {L - 1}) * {k.sr}LL + {k_col}, {k_full});
    }}
    for (int c = threadIdx.x; c < {bk * nv}; c += 128) {{
      const int r = c / {nv}, cc = c % {nv}, j = kb * {bk} + r;
      sf_att_cp16((unsigned)__cvta_generic_to_shared(vs + r * {ldv} + cc * {vec}),
                  sf_vp + (long long)min(j, {L - 1}) * {v.sr}LL + {v_col}, {v_full});
    }}
  }};
{nkb_code}  sf_load_kv({kb0}, 0);
  sf_att_commit();
{q_frags}  float sf_o[{nd}][4];
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
    float sf_s[{nkt}][4];
    #pragma unroll
    for (int n = 0; n < {nkt}; ++n) sf_s[n][0] = sf_s[n][1] = sf_s[n][2] = sf_s[n][3] = 0.0f;
{products}
    // scale, bias, keys past the end; the running maximum of each of the thread's two rows
    float sf_mx[2] = {{__int_as_float(0xff800000), __int_as_float(0xff800000)}};
    #pragma unroll
    for (int n = 0; n < {nkt}; ++n) {{
      #pragma unroll
      for (int r = 0; r < 4; ++r) {{
        {row("sf_warp * 16 + sf_g + (r >> 1) * 8")}
        const int sf_j = kb * {bk} + n * 8 + sf_t * 2 + (r & 1);
        float x = sf_s[n][r] * {scale!r}f;
{cap}        if (sf_j < {key_limit} && sf_i < {S}{causal_test}) {{
{bias_code}
        }} else {{
          x = __int_as_float(0xff800000);
        }}
        (void)sf_i;{"" if not packed else " (void)sf_h;"}
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
      sf_alpha[h] = {exp}(sf_m[h] - sf_base[h]);  // 0 while the row had nothing (exp(-inf))
      sf_m[h] = mnew;
      sf_l[h] *= sf_alpha[h];
    }}
    #pragma unroll
    for (int n = 0; n < {nd}; ++n) {{
      sf_o[n][0] *= sf_alpha[0]; sf_o[n][1] *= sf_alpha[0];
      sf_o[n][2] *= sf_alpha[1]; sf_o[n][3] *= sf_alpha[1];
    }}
{probabilities}
    __syncthreads();  // the stage is loaded again two steps on
  }}
  #pragma unroll
  for (int h = 0; h < 2; ++h) {{
    sf_l[h] += __shfl_xor_sync(0xffffffffu, sf_l[h], 1);
    sf_l[h] += __shfl_xor_sync(0xffffffffu, sf_l[h], 2);
  }}
{_split_combine(symbol, splits, R, G, "sf_h" if not packed else "sf_hk", nqb, nch, dvp, nd, exp)}  #pragma unroll
  for (int n = 0; n < {nd}; ++n) {{
    #pragma unroll
    for (int r = 0; r < 4; ++r) {{
      {row("sf_warp * 16 + sf_g + (r >> 1) * 8")}
      const int sf_e = {"" if nch == 1 else "sf_e0 + "}n * 8 + sf_t * 2 + (r & 1);
      if (sf_i < {S}{e_test}) {{
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
    if splits > 1:  # the splits' partial results and a count per block of queries (module globals, as split-K's)
        rows = min(BLOCK_Q, R)
        src = (f"__device__ float {symbol}_ws[{B * G * nqb * nch * splits * rows * (dvp + 2)}];  // split-KV partials\n"
               f"__device__ unsigned {symbol}_cnt[{B * G * nqb * nch}];  // splits stored per block of queries\n") + src
    cfg = {"grid": (nqb * splits * nch, G, B), "block": (128, 1, 1), "shared_mem": smem}
    return src, cfg


def _split_combine(symbol: str, splits: int, S: int, H: int, head: str, nqb: int, nch: int, dvc: int, nd: int,
                   exp: str) -> str:
    """Split-KV (``S`` rows of each of ``H`` heads, the block's in C variable ``head``): each split
    stores its rows' maximum, sum and unnormalized outputs; the last split
    of a block of queries to count in reads them all and leaves their combination in ``sf_o`` and
    ``sf_l`` for the epilogue (``O = sum_s exp(m_s - M) o_s``, ``l`` likewise, ``M = max_s m_s``;
    a split that saw no key of a row has ``m = -inf`` and weighs 0). The splits are summed in
    order, so the bits do not depend on which block finishes; it resets the count for the next
    launch. Empty when ``splits`` is 1."""
    if splits == 1:
        return ""
    rows, w = min(BLOCK_Q, S), dvc + 2  # a row's partial: m, l, then this block's dvc outputs
    unit = f"(sf_b * {H} + {head}) * {nqb} + sf_q0 / {BLOCK_Q}"
    if nch > 1:
        unit = f"({unit}) * {nch} + (int)(blockIdx.x % {nch})"
    return f"""  {{  // split-KV: store this split's partial rows; the last split of the block combines them
    const int sf_unit = {unit};
    float* sf_ws = {symbol}_ws + (size_t)sf_unit * {splits * rows * w};
    #pragma unroll
    for (int h = 0; h < 2; ++h) {{
      const int sf_r = sf_warp * 16 + sf_g + h * 8;
      if (sf_q0 + sf_r >= {S}) continue;
      float* sf_row = sf_ws + (sf_split * {rows} + sf_r) * {w};
      if (sf_t == 0) {{
        __stcg(sf_row, sf_m[h]);
        __stcg(sf_row + 1, sf_l[h]);
      }}
      #pragma unroll
      for (int n = 0; n < {nd}; ++n) {{
        __stcg(sf_row + 2 + n * 8 + sf_t * 2, sf_o[n][2 * h]);
        __stcg(sf_row + 3 + n * 8 + sf_t * 2, sf_o[n][2 * h + 1]);
      }}
    }}
    sf_att_wait<0>();  // (an empty split's copies are still in flight: none may land on the flag)
    __threadfence();
    __syncthreads();
    volatile unsigned* sf_final = reinterpret_cast<volatile unsigned*>(sf_dyn);  // (Q's first bytes: read no more)
    if (threadIdx.x == 0) *sf_final = atomicAdd(&{symbol}_cnt[sf_unit], 1u) == {splits - 1}u;
    __syncthreads();
    if (!*sf_final) return;  // another split of these rows finishes them
    __threadfence();
    #pragma unroll
    for (int h = 0; h < 2; ++h) {{
      const int sf_r = sf_warp * 16 + sf_g + h * 8;
      if (sf_q0 + sf_r >= {S}) continue;
      const float* sf_row = sf_ws + sf_r * {w};
      float sf_mm = __int_as_float(0xff800000), sf_wt[{splits}];
      #pragma unroll
      for (int q = 0; q < {splits}; ++q) sf_mm = fmaxf(sf_mm, __ldcg(sf_row + q * {rows * w}));
      sf_l[h] = 0.0f;
      #pragma unroll
      for (int q = 0; q < {splits}; ++q) {{
        const float sf_mq = __ldcg(sf_row + q * {rows * w});
        sf_wt[q] = sf_mq == __int_as_float(0xff800000) ? 0.0f : {exp}(sf_mq - sf_mm);
        sf_l[h] += sf_wt[q] * __ldcg(sf_row + q * {rows * w} + 1);
      }}
      #pragma unroll
      for (int n = 0; n < {nd}; ++n) {{
        float sf_x0 = 0.0f, sf_x1 = 0.0f;
        #pragma unroll
        for (int q = 0; q < {splits}; ++q) {{
          sf_x0 += sf_wt[q] * __ldcg(sf_row + q * {rows * w} + 2 + n * 8 + sf_t * 2);
          sf_x1 += sf_wt[q] * __ldcg(sf_row + q * {rows * w} + 3 + n * 8 + sf_t * 2);
        }}
        sf_o[n][2 * h] = sf_x0;
        sf_o[n][2 * h + 1] = sf_x1;
      }}
    }}
    if (threadIdx.x == 0) {symbol}_cnt[sf_unit] = 0u;
  }}
"""


def _half_products(ht: str, pack: str, h2: str, kd: int, nd: int, nkt: int, ldq: int, ldv: int,
                   mma_call) -> tuple[str, str]:
    """The half kernel's ``Q Kᵀ`` products (``ldmatrix`` of K, ``m16n8k16``) and its probabilities
    (rounded to the half type in the registers that held the scores, the C fragments being the
    A fragments of ``P V``) with their ``P V`` products (``ldmatrix.trans`` of V)."""
    p_frag = ("sf_p[2 * kk][0]", "sf_p[2 * kk][1]", "sf_p[2 * kk + 1][0]", "sf_p[2 * kk + 1][1]")
    products = f"""    #pragma unroll
    for (int kk = 0; kk < {kd}; ++kk) {{
      #pragma unroll
      for (int p = 0; p < {nkt // 2}; ++p) {{
        unsigned b0, b1, b2, b3;
        sf_ldm_x4((unsigned)__cvta_generic_to_shared(ks + (p * 16 + (sf_lane >> 4) * 8 + (sf_lane & 7)) * {ldq}
                                                      + kk * 16 + ((sf_lane >> 3) & 1) * 8), b0, b1, b2, b3);
        {mma_call("sf_s[2 * p]", "sf_qf[kk][0]", "sf_qf[kk][1]", "sf_qf[kk][2]", "sf_qf[kk][3]", "b0", "b1")}
        {mma_call("sf_s[2 * p + 1]", "sf_qf[kk][0]", "sf_qf[kk][1]", "sf_qf[kk][2]", "sf_qf[kk][3]", "b2", "b3")}
      }}
    }}"""
    probabilities = f"""    unsigned sf_p[{nkt}][2];  // the probabilities, rounded: A fragments of the P V product
    #pragma unroll
    for (int n = 0; n < {nkt}; ++n) {{
      const float p0 = __expf(sf_s[n][0] - sf_base[0]), p1 = __expf(sf_s[n][1] - sf_base[0]);
      const float p2 = __expf(sf_s[n][2] - sf_base[1]), p3 = __expf(sf_s[n][3] - sf_base[1]);
      sf_l[0] += p0 + p1;
      sf_l[1] += p2 + p3;
      {h2} lo = {pack}(p0, p1), hi = {pack}(p2, p3);
      sf_p[n][0] = *reinterpret_cast<unsigned*>(&lo);
      sf_p[n][1] = *reinterpret_cast<unsigned*>(&hi);
    }}
    #pragma unroll
    for (int kk = 0; kk < {nkt // 2}; ++kk) {{
      #pragma unroll
      for (int n = 0; n < {nd}; n += 2) {{
        unsigned b0, b1, b2, b3;
        sf_ldm_x4_t((unsigned)__cvta_generic_to_shared(vs + (kk * 16 + ((sf_lane >> 3) & 1) * 8 + (sf_lane & 7)) * {ldv}
                                                        + n * 8 + (sf_lane >> 4) * 8), b0, b1, b2, b3);
        {mma_call("sf_o[n]", *p_frag, "b0", "b1")}
        {mma_call("sf_o[n + 1]", *p_frag, "b2", "b3")}
      }}
    }}"""
    return products, probabilities


def _float_products(ab: str, kd: int, nkt: int, nd: int, ldq: int, ldv: int, mma_call,
                    exp: str) -> tuple[str, str]:
    """The float32 kernels' ``Q Kᵀ`` and ``P V`` products on ``m16n8k8`` TF32 tensor cores: one
    product (``tf32``), or three (``f32``, 3xTF32: ``lo·hi + hi·lo + hi·hi``, ``x = hi + lo``).

    Q's and K's fragments come from ``ldmatrix``: its 8 x 8 matrices of 16-bit halves are 8 x 4
    matrices of floats, lane ``(g, t)`` getting row ``g``, float ``t``, which is where the TF32
    fragments want them (columns ``t`` and ``t + 4`` of each 8 dimensions: two matrices). The
    scores' C fragment holds keys ``2t`` and ``2t + 1`` of each 8 in the thread that the A fragment
    of ``P V`` wants keys ``t`` and ``t + 4`` in: so ``P V`` takes the 8 keys in the order
    ``2t, 2t + 1`` (A columns ``t``, ``t + 4``; V's B rows likewise, read one float at a time), which
    needs no exchange between threads."""
    q_addr = f"sf_Qs + (sf_warp * 16 + (sf_lane & 15)) * {ldq} + kk * 8 + (sf_lane >> 4) * 4"
    k_addr = f"ks + (p * 8 + (sf_lane >> 4) * 8 + (sf_lane & 7)) * {ldq} + kk * 8 + ((sf_lane >> 3) & 1) * 4"
    if ab == "tf32":
        q = [f"sf_qf[{c}]" for c in range(4)]
        split_q = """      #pragma unroll
      for (int c = 0; c < 4; ++c) sf_qf[c] = sf_att_tf32(__uint_as_float(sf_qf[c]));
"""
        qk = f"""        #pragma unroll
        for (int c = 0; c < 4; ++c) sf_kf[c] = sf_att_tf32(__uint_as_float(sf_kf[c]));
        {mma_call("sf_s[p]", *q, "sf_kf[0]", "sf_kf[1]")}
        {mma_call("sf_s[p + 1]", *q, "sf_kf[2]", "sf_kf[3]")}"""
        pa = ("      const unsigned a0 = sf_att_tf32(p0), a1 = sf_att_tf32(p2), a2 = sf_att_tf32(p1), "
              "a3 = sf_att_tf32(p3);")
        pv = f"""        const unsigned b0 = sf_att_tf32(sf_vr[e * 8]), b1 = sf_att_tf32(sf_vr[e * 8 + {ldv}]);
        {mma_call("sf_o[e]", "a0", "a1", "a2", "a3", "b0", "b1")}"""
    else:
        hi, lo = [f"sf_qh[{c}]" for c in range(4)], [f"sf_ql[{c}]" for c in range(4)]
        split_q = """      unsigned sf_qh[4], sf_ql[4];
      #pragma unroll
      for (int c = 0; c < 4; ++c) sf_att_split(__uint_as_float(sf_qf[c]), sf_qh[c], sf_ql[c]);
"""
        qk = "\n".join(f"""        {mma_call(f"sf_s[p{off}]", *lo, f"sf_kh[{b}]", f"sf_kh[{b + 1}]")}
        {mma_call(f"sf_s[p{off}]", *hi, f"sf_kl[{b}]", f"sf_kl[{b + 1}]")}
        {mma_call(f"sf_s[p{off}]", *hi, f"sf_kh[{b}]", f"sf_kh[{b + 1}]")}""" for off, b in (("", 0), (" + 1", 2)))
        qk = """        unsigned sf_kh[4], sf_kl[4];
        #pragma unroll
        for (int c = 0; c < 4; ++c) sf_att_split(__uint_as_float(sf_kf[c]), sf_kh[c], sf_kl[c]);
""" + qk
        pa = """      unsigned a0, a1, a2, a3, sf_pl[4];
      sf_att_split(p0, a0, sf_pl[0]);
      sf_att_split(p2, a1, sf_pl[1]);
      sf_att_split(p1, a2, sf_pl[2]);
      sf_att_split(p3, a3, sf_pl[3]);"""
        pv = f"""        unsigned b0, b1, c0, c1;
        sf_att_split(sf_vr[e * 8], b0, c0);
        sf_att_split(sf_vr[e * 8 + {ldv}], b1, c1);
        {mma_call("sf_o[e]", "sf_pl[0]", "sf_pl[1]", "sf_pl[2]", "sf_pl[3]", "b0", "b1")}
        {mma_call("sf_o[e]", "a0", "a1", "a2", "a3", "c0", "c1")}
        {mma_call("sf_o[e]", "a0", "a1", "a2", "a3", "b0", "b1")}"""
    products = f"""    #pragma unroll
    for (int kk = 0; kk < {kd}; ++kk) {{
      unsigned sf_qf[4];  // this warp's rows g, g + 8; dimensions t, t + 4 of these 8
      sf_ldm_x4((unsigned)__cvta_generic_to_shared({q_addr}), sf_qf[0], sf_qf[1], sf_qf[2], sf_qf[3]);
{split_q}      #pragma unroll
      for (int p = 0; p < {nkt}; p += 2) {{
        unsigned sf_kf[4];  // keys 8p + g and 8p + 8 + g; dimensions t, t + 4
        sf_ldm_x4((unsigned)__cvta_generic_to_shared({k_addr}), sf_kf[0], sf_kf[1], sf_kf[2], sf_kf[3]);
{qk}
      }}
    }}"""
    probabilities = f"""    #pragma unroll
    for (int n = 0; n < {nkt}; ++n) {{
      const float p0 = {exp}(sf_s[n][0] - sf_base[0]), p1 = {exp}(sf_s[n][1] - sf_base[0]);
      const float p2 = {exp}(sf_s[n][2] - sf_base[1]), p3 = {exp}(sf_s[n][3] - sf_base[1]);
      sf_l[0] += p0 + p1;
      sf_l[1] += p2 + p3;
      // A fragment of keys 8n..8n+7 in the order 2t, 2t + 1 (columns t, t + 4), as the scores hold them
{pa}
      const float* sf_vr = vs + (n * 8 + sf_t * 2) * {ldv} + sf_g;  // V rows 2t, 2t + 1, column g of each 8
      #pragma unroll
      for (int e = 0; e < {nd}; ++e) {{
{pv}
      }}
    }}"""
    return products, probabilities
