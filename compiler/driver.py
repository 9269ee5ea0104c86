"""``compile()``: ONNX model → sharding plan → one compiled artifact per rank.

The pipeline: :func:`~shardflow.compiler.load_onnx` → :func:`~shardflow.compiler.parallel.search`
→ :func:`~shardflow.compiler.parallel.partition` → per rank: kernels (codegen), the rank program
(steps and a buffer plan that reuses memory by liveness) and the weight shard → the out_dir
(format: :mod:`shardflow.runtime.artifact`, ``rfcs/0003-artifacts-and-runtime.md``).

``optimization_config`` keys (all optional):

================  =========================================================================  ==========
key               meaning                                                                    default
================  =========================================================================  ==========
``target``        ``"cpu"`` (C++ kernels in a ``.so``) or ``"cuda"``                         ``"cpu"``
``arch``          GPU architecture for cuda, e.g. ``"sm_90"`` (cpu: must be unset)           ``"sm_90"``
``sm_count``      cuda: the target GPU's multiprocessors (114 for an H100 PCIe, 78 for an     the GPU's
                  H20, 108 for an A100), which the GEMM tiles, K splits, persistent grids    or ``132``
                  and attention KV splits are sized for. Default: the visible GPU's count
                  when its compute capability is ``arch``'s, else 132 (an H100 SXM's or
                  H200's). Any value runs correctly; a wrong one fills the GPU less well
``precision``     ``"float32"`` (cuda GEMMs: 3xTF32, fp32-accurate); ``"tf32"`` (cuda only:   ``"float32"``
                  one TF32 product, faster, relative error ~1e-3; see ``wgmma_fp32``);
                  ``"float16"``: the operands of contractions rounded to float16 (weights
                  stored in float16),
                  fp32 accumulation, everything else float32 (passes/precision.py);
                  ``"bfloat16"`` likewise with bfloat16. On cuda, at every
                  precision, a model's own float16/bfloat16 ``Attention`` ops compute in
                  float32 and round the output (passes/attention.py)
``fuse``          let codegen fuse elementwise/injective ops into their neighbours           ``True``
``cuda_graph``    cuda runtime: replay one CUDA graph per run after warm-up                  ``True``
``pdl``           cuda, sm_90 and newer: programmatic dependent launch, each kernel launched ``False``
                  while the one before it finishes and waiting on the GPU for its results
                  (``griddepcontrol``; runtime/pdl.py; not yet timed on a GPU)
``wgmma_fp32``    cuda, sm_90: float32 products on the Hopper wgmma GEMMs too (one TF32      ``False``
                  product at ``tf32``, else 3xTF32), every MatMul/Gemm weight stored
                  ``[N, K]`` for them (rounded to TF32 at ``tf32``); rfcs/0005 decisions
                  33-34; not yet run on a GPU
``prepack``       cpu: store the constant weights of float32 MatMul/Gemm packed for the      ``True``
                  GEMM kernel (passes/prepack.py) instead of packing them on every call;
                  also those of 1x1 convs on small images (run as that GEMM)
``winograd``      cpu: 3x3 stride-1 convs of 64+ channels (on enough pixels) as Winograd         ``True``
                  F(4x4, 3x3) or F(2x2, 3x3) with the weights transformed at compile time
                  (passes/prepack.py); fewer products, rounding up to ~7e-6 of the largest output (direct: 4e-7);
                  off under ``memory_budget_bytes`` (the larger weights are not in the plan)
``int8_qdq``      cpu: a MatMul of two DequantizeLinear'd int8/uint8 values (QDQ models, e.g.   ``True``
                  onnxruntime's quantize_static) runs as the integer product it stands for,
                  exact in int32 then scaled, on the int8 GEMM (frontend/qdq.py); ``False``
                  keeps the float MatMul of the dequantized values
``precompute``    steps computed from constants alone (ops constant folding leaves in the      ``True``
                  graph because their results are too large to store, e.g. ``ConstantOfShape``
                  fills of big weights) run once when the program loads, their results kept
                  in memory between runs; ``False`` runs them on every call
``blocked``       cpu: tensors between convs kept blocked by 16 channels, ``[N, C/16, H, W,   ``True``
                  16]``, the layout the conv kernels compute in, instead of blocking each
                  conv's image and transposing its output on every call (passes/layout.py);
                  depthwise convs, pools, global pools, element-wise ops and channel
                  concatenations between them follow, and stems (3-channel images) write it
``channels_last`` cuda, sm_90: convs with a window, a stride or padding (and 1x1 convs whose     ``True``
                  ``H*W`` is not a multiple of 8) read a channels-last copy of their image,
                  written by the kernel before them where it can, as implicit GEMMs on the
                  wgmma template (grouped convs too, a product per group, where their groups
                  have multiples of 8 channels), and the activations between such convs stay
                  channels-last (passes/channels_last.py; rfcs/0005 decisions 57-62; not yet
                  timed on a GPU); ``False`` leaves them in NCHW on the portable template
``index_checks``  index values checked at run time where the compiled kernels would clamp    ``True``
                  them silently (passes/index_checks.py): inputs read as indices before each
                  run (``InputIndexError``), and indices computed in the graph not proven in
                  their axes by an extra check output each (``IndexRangeError`` after the
                  run); ``False``: neither (an index outside its axis reads the nearest row)
``fold_affine``   a conv's following BatchNormalization and element-wise Mul/Div/Add/Sub by    ``True``
                  per-channel constants folded into its weight and bias at compile time, for
                  every target (passes/fold.py); values change by rounding only
``search_space``  kernel tuning level 0, 1 or 2: 0/1 the default tile choice; 2 (cuda) times   ``1``
                  the wgmma GEMM tiles on this machine's GPU if one is visible (codegen/tune.py)
``comm_backend``  ``"auto"``, ``"mpi"``, ``"nccl"`` (cuda only) or ``"tcp"``                  ``"auto"``
``gemm_tiles``    cuda only: ``{node name pattern: tile}`` forces wgmma GEMM tiles (names of ``{}``
                  ``codegen/cuda_wgmma.WGMMA_CONFIGS``) on the GEMM kernels whose op, or an
                  op fused into them, matches the ``fnmatch`` pattern (first match wins;
                  over the tuned and the default choice). A tile for a K-major B
                  (``tma64x96``, ``tma128x160``) also stores, at half precision, the
                  ``[K, N]`` weight of a MatMul/Gemm whose own name matches as ``[N, K]``,
                  and on sm_90 so does a matched float32 MatMul/Gemm, which then runs on
                  the tile (TF32 or 3xTF32; rfcs/0005 decisions 33-34)
================  =========================================================================  ==========
"""
from __future__ import annotations

import dataclasses
import difflib
import fnmatch
import gc
import importlib
import inspect
import json
import logging
import math
import os
import platform
import re
import shutil
import time
from pathlib import Path
from typing import Any, Callable, Mapping, Sequence

import numpy as np

from shardflow.runtime import __version__
from shardflow.runtime.artifact import ALIGNMENT, atomic_output_dir, finalize_rank_dir, write_json

from .errors import ConfigError, DtypeError, GraphError, ShardflowError
from .ir.expr import numpy_type
from .ir.graph import RNG_STEP, RNG_STEP_NEXT, FlowGraph, Operator, Tensor
from .ir.spill import spill, spilling
from .passes.index_checks import add_index_checks, index_check_outputs, input_index_ranges

__all__ = ["compile", "planned_graph", "compare_plans", "CompileResult", "OptimizationConfig", "build_program",
           "plan_buffers", "TARGETS", "PRECISIONS", "COMM_BACKENDS"]

log = logging.getLogger(__name__)

TARGETS = ("cpu", "cuda")
PRECISIONS = ("float32", "tf32", "float16", "bfloat16")
COMM_BACKENDS = ("auto", "mpi", "nccl", "tcp")
#: a rank's weights from which compile() runs the cycle collector before the next rank is made
COLLECT_RANK_BYTES = 16 << 20


# ---------------------------------------------------------------------------------------
# optimization_config
# ---------------------------------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class OptimizationConfig:
    """Validated ``optimization_config`` (see the module docstring for the keys)."""

    target: str = "cpu"
    arch: str | None = None
    sm_count: int | None = None
    precision: str = "float32"
    fuse: bool = True
    cuda_graph: bool = True
    pdl: bool = False
    wgmma_fp32: bool = False
    prepack: bool = True
    winograd: bool = True
    int8_qdq: bool = True
    precompute: bool = True
    blocked: bool = True
    channels_last: bool = True
    fold_affine: bool = True
    index_checks: bool = True
    search_space: int = 1
    comm_backend: str = "auto"
    gemm_tiles: dict = dataclasses.field(default_factory=dict)

    @classmethod
    def from_dict(cls, cfg: "Mapping[str, Any] | OptimizationConfig | None") -> "OptimizationConfig":
        """Validate a user dictionary.

        Raises
        ------
        ConfigError
            Naming an unknown key (with the closest known one), a value of the wrong type, or
            an impossible value.
        """
        if cfg is None:
            cfg = {}
        if isinstance(cfg, OptimizationConfig):
            return cfg
        if not isinstance(cfg, Mapping):
            raise ConfigError(f"optimization_config must be a dict, got {type(cfg).__name__}")
        known = [f.name for f in dataclasses.fields(cls)]
        for key in cfg:
            if key not in known:
                close = difflib.get_close_matches(str(key), known, n=1)
                hint = f"; did you mean {close[0]!r}?" if close else ""
                raise ConfigError(f"optimization_config: unknown key {key!r}{hint} (known keys: {known})")

        def typed(key, types, what):
            v = cfg[key]
            if not isinstance(v, types) or (isinstance(v, bool) and bool not in types):
                raise ConfigError(f"optimization_config[{key!r}] = {v!r}: need {what}")
            return v

        kw: dict[str, Any] = {}
        if "target" in cfg:
            kw["target"] = typed("target", (str,), f"one of {list(TARGETS)}")
            if kw["target"] not in TARGETS:
                raise ConfigError(f"optimization_config['target'] = {kw['target']!r}: choose one of {list(TARGETS)}")
        target = kw.get("target", "cpu")
        if "arch" in cfg and cfg["arch"] is not None:
            arch = typed("arch", (str,), "a string such as 'sm_90'")
            if target != "cuda":
                raise ConfigError(f"optimization_config['arch'] = {arch!r} only applies to target 'cuda' (the cpu "
                                  "target compiles for the machine running the compiler)")
            if not re.fullmatch(r"sm_\d+a?", arch):
                raise ConfigError(f"optimization_config['arch'] = {arch!r}: use a CUDA GPU architecture such as "
                                  "'sm_80' or 'sm_90' (the cuda target compiles cubins, not PTX for a "
                                  "'compute_' virtual architecture)")
            if _cuda_sm(arch) < 80:
                raise ConfigError(f"optimization_config['arch'] = {arch!r}: the cuda target generates code for "
                                  "sm_80 (Ampere) and newer (cp.async copies, TF32 and bfloat16 tensor cores)")
            kw["arch"] = arch
        elif target == "cuda":
            kw["arch"] = "sm_90"
        if "sm_count" in cfg and cfg["sm_count"] is not None:
            kw["sm_count"] = typed("sm_count", (int,), "the target GPU's multiprocessor count, e.g. 132")
            if target != "cuda":
                raise ConfigError(f"optimization_config['sm_count'] = {kw['sm_count']!r} only applies to target "
                                  "'cuda' (the cpu target uses the threads of the machine it runs on)")
            if not 1 <= kw["sm_count"] <= 1024:
                raise ConfigError(f"optimization_config['sm_count'] = {kw['sm_count']!r}: give the GPU's "
                                  "multiprocessor count (nvidia-smi -q or cudaDeviceProp.multiProcessorCount), "
                                  "between 1 and 1024")
        if "precision" in cfg:
            kw["precision"] = typed("precision", (str,), f"one of {list(PRECISIONS)}")
            if kw["precision"] not in PRECISIONS:
                raise ConfigError(f"optimization_config['precision'] = {kw['precision']!r}: choose one of "
                                  f"{list(PRECISIONS)}")
        if kw.get("precision") == "tf32" and target != "cuda":
            raise ConfigError("optimization_config['precision'] = 'tf32' only applies to target 'cuda' (a GPU "
                              "tensor-core format); use 'float32', 'float16' or 'bfloat16'")
        for key in ("fuse", "cuda_graph", "pdl", "wgmma_fp32", "prepack", "winograd", "int8_qdq", "precompute",
                    "blocked", "channels_last", "fold_affine", "index_checks"):
            if key in cfg:
                kw[key] = typed(key, (bool,), "true or false")
        if kw.get("pdl") and (target != "cuda" or _cuda_sm(kw["arch"]) < 90):
            raise ConfigError("optimization_config['pdl'] = true needs target 'cuda' and an arch of sm_90 or newer "
                              f"(programmatic dependent launch is a Hopper feature); got target {target!r}"
                              + (f", arch {kw['arch']!r}" if target == "cuda" else ""))
        if kw.get("wgmma_fp32") and (target != "cuda" or _cuda_sm(kw["arch"]) < 90):
            raise ConfigError("optimization_config['wgmma_fp32'] = true needs target 'cuda' and an arch of sm_90 "
                              f"or newer (the Hopper wgmma GEMMs); got target {target!r}"
                              + (f", arch {kw['arch']!r}" if target == "cuda" else ""))
        if "search_space" in cfg:
            kw["search_space"] = typed("search_space", (int,), "0, 1 or 2")
            if kw["search_space"] not in (0, 1, 2):
                raise ConfigError(f"optimization_config['search_space'] = {kw['search_space']!r}: choose 0, 1 or 2")
        if "gemm_tiles" in cfg:
            kw["gemm_tiles"] = _gemm_tiles(typed("gemm_tiles", (dict,), "a dict {node name pattern: tile name}"),
                                           target)
        if "comm_backend" in cfg:
            kw["comm_backend"] = typed("comm_backend", (str,), f"one of {list(COMM_BACKENDS)}")
            if kw["comm_backend"] not in COMM_BACKENDS:
                raise ConfigError(f"optimization_config['comm_backend'] = {kw['comm_backend']!r}: choose one of "
                                  f"{list(COMM_BACKENDS)}")
            if kw["comm_backend"] == "nccl" and target != "cuda":
                raise ConfigError("optimization_config['comm_backend'] = 'nccl' needs target 'cuda'; the cpu target "
                                  "communicates with 'mpi' or 'tcp' ('auto' picks)")
        return cls(**kw)

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)


def target_sm_count(opt: OptimizationConfig) -> int:
    """The multiprocessors a cuda program is compiled for: ``opt.sm_count``, else the visible GPU's
    when its compute capability is ``opt.arch``'s (the machine compiling is the one that will
    run), else 132 (an H100 SXM's or H200's)."""
    from .codegen.cuda_wgmma import PERSISTENT_SMS
    from .codegen.tune import visible_gpu

    if opt.sm_count is not None:
        return opt.sm_count
    gpu = visible_gpu()
    if gpu is not None and gpu["sm"] == _cuda_sm(opt.arch or ""):
        log.info("cuda: kernels sized for this machine's %s (%d multiprocessors)", gpu["name"], gpu["sms"])
        return gpu["sms"]
    return PERSISTENT_SMS


def _cuda_sm(arch: str) -> int:
    """The compute capability the cuda code generator reads in ``arch`` (``90`` for ``sm_90``)."""
    from .codegen.cuda import _sm

    return _sm(arch)


def _gemm_tiles(tiles: dict, target: str) -> dict:
    """``optimization_config["gemm_tiles"]`` checked: cuda only, string patterns, known tiles."""
    from .codegen.cuda_wgmma import WGMMA_CONFIGS

    if target != "cuda":
        raise ConfigError("optimization_config['gemm_tiles'] only applies to target 'cuda' (the wgmma GEMM tiles)")
    for pattern, tile in tiles.items():
        if not isinstance(pattern, str) or not isinstance(tile, str):
            raise ConfigError(f"optimization_config['gemm_tiles']: {pattern!r}: {tile!r}: give node name patterns "
                              "and tile names as strings")
        if tile not in WGMMA_CONFIGS:
            raise ConfigError(f"optimization_config['gemm_tiles'][{pattern!r}] = {tile!r}: choose one of "
                              f"{sorted(WGMMA_CONFIGS)}")
    return dict(tiles)


def _tiled_ops(tiles: dict) -> Callable[[Operator], bool]:
    """Whether a ``gemm_tiles`` pattern matches an op's own name (its product is on a forced tile)."""
    return lambda op: any(fnmatch.fnmatchcase(op.name, p) for p in tiles)


def _k_major_tiles(tiles: dict) -> Callable[[Operator], bool] | None:
    """Whether an op's first matching ``gemm_tiles`` pattern (matched on the op's own name) forces
    a tile that takes a K-major B only (a column count that is not a multiple of 64): the
    precision pass then stores that op's weight ``[N, K]``. None without such a tile."""
    from .codegen.cuda_wgmma import WGMMA_CONFIGS

    if not any(WGMMA_CONFIGS[t][1] % 64 for t in (tiles or {}).values()):
        return None

    def wants(op: Operator) -> bool:
        tile = next((t for p, t in tiles.items() if fnmatch.fnmatchcase(op.name, p)), None)
        return tile is not None and WGMMA_CONFIGS[tile][1] % 64 != 0
    return wants


# ---------------------------------------------------------------------------------------
# result
# ---------------------------------------------------------------------------------------
@dataclasses.dataclass
class CompileResult:
    """What :func:`compile` produced.

    Attributes
    ----------
    plan
        The :class:`~shardflow.compiler.parallel.ShardingPlan`.
    out_dir
        The written out_dir.
    rank_dirs
        ``out_dir/rank{r}`` for every rank.
    world_size, target, arch
        As compiled.
    timings
        Seconds per stage: ``import``, ``search``, ``partition``, ``codegen``, ``write``, ``total``.
    ranks
        Per rank: number of kernels, collectives, arena and weight bytes.
    """

    plan: Any
    out_dir: Path
    rank_dirs: list[Path]
    world_size: int
    target: str
    arch: str | None
    timings: dict[str, float]
    ranks: list[dict]

    @property
    def plan_path(self) -> Path:
        return self.out_dir / "plan.json"

    @property
    def mesh_path(self) -> Path:
        return self.out_dir / "mesh.json"

    def summary(self) -> str:
        """A few lines for humans."""
        lines = [f"compiled for {self.world_size} rank(s) on mesh {list(self.plan.mesh.shape)} "
                 f"(target {self.target}{', ' + self.arch if self.arch else ''}) into {self.out_dir}",
                 "  " + ", ".join(f"{k} {v:.2f} s" for k, v in self.timings.items())]
        for r, info in enumerate(self.ranks):
            lines.append(f"  rank {r}: {info['kernels']} kernels, {info['collectives']} collectives, arena "
                         f"{info['arena_bytes']:,} B, weights {info['weights_bytes']:,} B")
        return "\n".join(lines)

    def __str__(self) -> str:
        return self.summary()


# ---------------------------------------------------------------------------------------
# buffer plan
# ---------------------------------------------------------------------------------------
def _align(n: int, a: int = ALIGNMENT) -> int:
    return -(-n // a) * a


def _bytes_key(a: np.ndarray) -> tuple:
    """A cheap key of an array's bytes (their count, type and up to 64 sampled bytes): arrays with
    different keys differ; equal keys are compared whole (:func:`_same_bytes`)."""
    b = a.reshape(-1).view(np.uint8) if a.size else np.zeros(0, np.uint8)
    step = max(1, b.size // 64)
    return a.dtype.str, b.size, b[::step][:64].tobytes(), b[-8:].tobytes()


def _same_bytes(a: np.ndarray, b: np.ndarray) -> bool:
    """Whether two arrays of one :func:`_bytes_key` (so one type and byte count) hold the same bytes."""
    return np.array_equal(a.reshape(-1).view(np.uint8), b.reshape(-1).view(np.uint8))


def plan_buffers(blocks: Sequence[tuple[int, int, int]]) -> tuple[list[int], int]:
    """Offsets for blocks ``(nbytes, first_step, last_step)`` in one arena.

    Two blocks whose step intervals (inclusive) overlap never overlap in memory; others may
    share it. Greedy by size (largest first), each at the lowest offset that fits between
    the blocks already placed that are live at the same time.

    Returns
    -------
    (offsets, arena_bytes)
        ``offsets[i]`` is ``ALIGNMENT``-aligned.
    """
    order = sorted(range(len(blocks)), key=lambda i: (-blocks[i][0], blocks[i][1], i))
    offsets = [0] * len(blocks)
    po = np.zeros(len(blocks), np.int64)
    ps = np.zeros(len(blocks), np.int64)
    pst = np.zeros(len(blocks), np.int64)
    pen = np.zeros(len(blocks), np.int64)
    n = 0
    total = 0
    for i in order:
        size, start, end = blocks[i]
        size = _align(size)
        if size == 0:
            continue
        live = (pen[:n] >= start) & (pst[:n] <= end)
        cand = 0
        if live.any():
            idx = np.nonzero(live)[0]
            idx = idx[np.argsort(po[idx], kind="stable")]
            for o, s in zip(po[idx].tolist(), ps[idx].tolist()):
                if cand + size <= o:
                    break
                cand = max(cand, o + s)
        offsets[i] = cand
        po[n], ps[n], pst[n], pen[n] = cand, size, start, end
        n += 1
        total = max(total, cand + size)
    return offsets, total


def _is_view(op: Operator) -> bool:
    """Ops whose single output has exactly the bytes of input 0 (row-major reshape, identity, a
    reinterpretation of the bytes as another type of the same width)."""
    if len(op.outputs) != 1 or not op.inputs:
        return False
    x, y = op.inputs[0], op.outputs[0]
    if op.op_type == "BitCast":
        return x.shape == y.shape
    if x.dtype != y.dtype or x.size != y.size:
        return False
    if op.op_type == "Reshape":
        return True
    try:
        return op.passthrough_input() == 0
    except Exception:  # noqa: BLE001 - an op without the query is no view
        return False


def _run_of(op: Operator) -> int | None:
    """The byte offset in its input of the values a Slice ``op`` selects when they are one contiguous run of
    the input (the first dim it takes more than one index of stepped by 1, every later dim whole), else None."""
    x = op.inputs[0]
    starts, steps, sizes = op.attrs["starts"], op.attrs["steps"], op.attrs["sizes"]
    if 0 in sizes or x.ndim == 0 or x.nbytes % x.size:
        return None
    k = next((d for d, n in enumerate(sizes) if n > 1), x.ndim - 1)
    if (steps[k] != 1 and sizes[k] > 1) or any(starts[d] != 0 or sizes[d] != x.shape[d] for d in range(k + 1, x.ndim)):
        return None
    stride = [int(np.prod(x.shape[d + 1:], dtype=np.int64)) for d in range(x.ndim)]
    return sum(int(starts[d]) * stride[d] for d in range(k + 1)) * (x.nbytes // x.size)


def _slice_steps(raw_steps: list) -> dict[int, tuple[Tensor, int]]:
    """``{id(output): (input, byte offset)}`` of the Slice kernel steps of their own (not fused) whose
    output is one contiguous run of their input (:func:`_run_of`)."""
    found = {}
    for kind, _, ins, outs, op in raw_steps:
        if kind == "kernel" and op.op_type == "Slice" and len(outs) == 1 and outs[0] is op.outputs[0] \
                and len(ins) == 1 and ins[0] is op.inputs[0]:
            off = _run_of(op)
            if off is not None:
                found[id(outs[0])] = (ins[0], off)
    return found


def _concatenate_in_place(raw_steps: list, g: FlowGraph, alias: dict[int, Tensor], at: dict[int, int]) -> list:
    """``raw_steps`` without the Concat kernels whose inputs can be written in place, by their producers,
    into the concatenation (``alias[id(input)]`` = its output, ``at[id(input)]`` = the byte offset).

    A Concat qualifies when it is a kernel of its own, every dim before its axis is 1 (each input is then
    one contiguous run of the output), every input starts ``ALIGNMENT``-aligned in it, and every input is
    written by exactly one kernel step (so no graph input or constant; a Concat made in place counts as
    its kernel), is no graph output, no view of another tensor, not placed into an earlier concatenation,
    and appears once. The concatenation then costs no copy (CNNs' channel concatenations: Inception, SqueezeNet,
    DenseNet, whose chained concatenations become prefixes of the last one) and the inputs no memory of
    their own.

    Consecutive inputs that are contiguous slices of one tensor ``X``, in its order and covering it whole (a
    split's parts concatenated again: YOLOv8's C2f blocks), count as ``X``: ``X`` is placed into the
    concatenation, the slices become views of it (no step) and ``X``'s producer writes them all in place.
    """
    writers: dict[int, int] = {}
    for kind, _, _, outs, _ in raw_steps:
        for t in outs:
            writers[id(t)] = writers.get(id(t), 0) + (2 if kind != "kernel" else 1)
    graph_outputs = {id(t) for t in g.outputs}
    slices = _slice_steps(raw_steps)
    dropped: set[int] = set()  # slices made views of their input placed into a concatenation
    keep = []
    for step in raw_steps:
        kind, _, ins, outs, op = step
        y = op.outputs[0]
        if (kind != "kernel" or op.op_type != "Concat" or len(outs) != 1 or outs[0] is not y
                or [id(t) for t in ins] != [id(t) for t in op.inputs] or id(y) in alias):
            keep.append(step)
            continue
        parts = _slice_groups(ins, slices, writers, graph_outputs, alias)
        axis = int(op.attrs["axis"])
        offsets, off, ok = [], 0, int(np.prod(y.shape[:axis], dtype=np.int64)) == 1
        for t, _ in parts:
            ok = ok and (t.dtype == y.dtype and off % ALIGNMENT == 0 and id(t) not in graph_outputs
                         and id(t) not in alias
                         and writers.get(id(t)) == 1
                         and sum(u is t for u, _ in parts) == 1)
            offsets.append(off)
            off += t.nbytes
        if not ok or off != y.nbytes:
            keep.append(step)
            continue
        for (t, group), o in zip(parts, offsets):
            alias[id(t)], at[id(t)] = y, o
            for u in group:
                alias[id(u)], at[id(u)] = t, slices[id(u)][1]
                dropped.add(id(u))
    return [st for st in keep if not (st[0] == "kernel" and id(st[3][0]) in dropped)] if dropped else keep


def _slice_groups(ins: list, slices: dict, writers: dict, graph_outputs: set, alias: dict) -> list:
    """A concatenation's inputs as ``(tensor, slices)``: a run of consecutive inputs that are contiguous
    slices of one tensor ``X`` in its order, covering it whole, as ``(X, [the slices])`` (each slice written
    by its own step alone, starting ``ALIGNMENT``-aligned in ``X``, and no graph output; ``X`` read by nothing
    else among the inputs), any other input as ``(input, [])``."""
    parts, k = [], 0
    while k < len(ins):
        t = ins[k]
        src = slices.get(id(t))
        if src is not None:
            x, end, j = src[0], 0, k
            while j < len(ins) and id(ins[j]) in slices and slices[id(ins[j])][0] is x \
                    and slices[id(ins[j])][1] == end and end % ALIGNMENT == 0 and writers.get(id(ins[j])) == 1 \
                    and id(ins[j]) not in graph_outputs and id(ins[j]) not in alias:
                end += ins[j].nbytes
                j += 1
                if end == x.nbytes:
                    break
            if end == x.nbytes and j - k >= 1 and not any(u is x for u in ins):
                parts.append((x, list(ins[k:j])))
                k = j
                continue
        parts.append((t, []))
        k += 1
    return parts


def _slices_as_views(raw_steps: list, g: FlowGraph, alias: dict[int, Tensor], at: dict[int, int],
                     root: Callable[[Tensor], Tensor]) -> list:
    """``raw_steps`` without the Slice kernels whose output is one contiguous run of their input starting
    ``ALIGNMENT``-aligned (:func:`_run_of`): the output becomes a view of the input at that offset
    (``alias``, ``at``), no copy. Not for an output placed into a concatenation or returned by the graph, nor
    for an input whose storage is a graph input (a state written in place, a caller's array read in place)."""
    graph_io = {id(t) for t in list(g.outputs) + list(g.inputs)}
    slices = _slice_steps(raw_steps)
    views = set()
    for y_id, (x, off) in slices.items():
        if off % ALIGNMENT == 0 and y_id not in alias and y_id not in graph_io and id(root(x)) not in graph_io \
                and not root(x).is_constant:
            views.add(y_id)
    for y_id in views:
        alias[y_id], at[y_id] = slices[y_id]
    return [st for st in raw_steps if not (st[0] == "kernel" and st[3] and id(st[3][0]) in views)]


def build_program(rank_graph: FlowGraph, kernels: Mapping[str, Any], *, rank: int = 0,
                  group_key: Callable[[tuple[int, ...]], str] | None = None,
                  view_ops: Sequence[Operator] = (), precompute: bool = True,
                  state: Mapping[str, str] | None = None,
                  ) -> tuple[dict, list[tuple[int, np.ndarray]], int]:
    """Lay out one rank's program: steps, buffers (arena offsets by liveness, weight offsets).

    Parameters
    ----------
    rank_graph
        The rank's graph (from partition).
    kernels
        What codegen returned for the rank's compute ops, by op name: a symbol (the op's kernel,
        called on its inputs and outputs), a dict ``{"symbol", "inputs", "outputs"}`` naming the
        tensors of a fused kernel, or ``None`` for an op fused into another op's kernel.
    rank
        For messages.
    group_key
        Maps a collective's mesh axes to its group key in the manifest.
    view_ops
        Ops whose output aliases input 0's bytes (no kernel; same buffer).
    precompute
        Put the kernel steps computed from constants alone first and count them in the program's
        ``load_steps``: the runtime runs them once at load, their results keep their memory.
    state
        ``{output name: input name}``: outputs the runtime keeps as the next run's value of an
        input (a KV cache's present as the next past; ``compile(state=...)``). They leave
        ``outputs`` for ``state``; the input's buffer lives through the whole run, and the output
        is written straight into it when its kernel reads the input only at the output's own
        index and nothing else reads it (:func:`_state_in_place`), else copied there after the run.

    Returns
    -------
    (program, weights, weights_bytes)
        ``program`` as written to ``program.json``; ``weights`` as ``(offset, array)``.
    """
    from .parallel.comm_ops import Collective, mesh_axes

    group_key = group_key or (lambda axes: ",".join(str(a) for a in axes))
    g = rank_graph
    by_name: dict[str, Tensor] = {}
    for t in g.inputs:
        by_name[t.name] = t
    for op in g.nodes:
        for t in op.inputs:
            by_name.setdefault(t.name, t)
        for t in op.outputs:
            by_name[t.name] = t
    for t in g.outputs:
        by_name.setdefault(t.name, t)
    views = {id(op) for op in view_ops}
    alias: dict[int, Tensor] = {}  # view output or concatenated-in-place tensor -> the tensor holding its bytes
    at: dict[int, int] = {}  # a concatenated-in-place tensor -> its byte offset in the concatenation

    def root(t: Tensor) -> Tensor:
        while id(t) in alias:
            t = alias[id(t)]
        return t

    def offset_in_root(t: Tensor) -> int:
        off = 0
        while id(t) in alias:
            off += at.get(id(t), 0)
            t = alias[id(t)]
        return off

    # steps, in node order
    raw_steps: list[tuple[str, Any, list[Tensor], list[Tensor], Operator]] = []
    for op in g.nodes:
        if id(op) in views:
            alias[id(op.outputs[0])] = op.inputs[0]
            continue
        if isinstance(op, Collective):
            raw_steps.append(("collective", None, list(op.inputs), list(op.outputs), op))
            continue
        if op.name not in kernels:
            raise ShardflowError(f"rank {rank}: codegen returned no kernel for node {op.name} ({op.op_type})"
                                 f"{_why_no_kernel(op)}; this model cannot be compiled for this target yet")
        k = _kernel_entry(kernels[op.name])
        if k is None:
            continue  # fused into another op's kernel
        if isinstance(k, str):
            raw_steps.append(("kernel", k, list(op.inputs), list(op.outputs), op))
        elif isinstance(k, Mapping) and "symbol" in k:
            try:
                ins = [by_name[n] for n in k.get("inputs", [t.name for t in op.inputs])]
                outs = [by_name[n] for n in k.get("outputs", [t.name for t in op.outputs])]
            except KeyError as exc:
                raise ShardflowError(f"rank {rank}: codegen's kernel for {op.name} names tensor {exc} which the rank "
                                     "graph does not have") from None
            raw_steps.append(("kernel", k, ins, outs, op))
        else:
            raise ShardflowError(f"rank {rank}: codegen returned {k!r} for node {op.name}; expected a symbol name")

    raw_steps = _concatenate_in_place(raw_steps, g, alias, at)
    raw_steps = _slices_as_views(raw_steps, g, alias, at, root)
    pairs = _state_pairs(g, state or {}, rank)
    producer = {id(t): op for op in g.nodes for t in op.outputs} if pairs else {}
    in_place = {out: _state_in_place(raw_steps, g, x, y, root, producer) for out, (y, x) in pairs.items()}
    for out, (y, x) in pairs.items():
        if in_place[out]:
            alias[id(y)], at[id(y)] = x, 0  # the kernel writes the output over the input's bytes
    n_load = 0
    if precompute:
        raw_steps, n_load = _steps_at_load_first(raw_steps, root)

    # materialization check: every step input exists when it runs
    ready = {id(t) for t in g.inputs}
    for kind, _, ins, outs, op in raw_steps:
        for t in ins:
            r = root(t)
            if id(r) not in ready and not r.is_constant:
                raise ShardflowError(f"rank {rank}: step {op.name} reads {t.name}, which no earlier step produces "
                                     "(an op fused away while its output is still needed?)")
        ready.update(id(root(t)) for t in outs)
    for name, t in zip(g.output_names, g.outputs):
        r = root(t)
        if id(r) not in ready and not r.is_constant:
            raise ShardflowError(f"rank {rank}: output {name} ({t.name}) is never produced")

    # buffers: one per distinct tensor; storage blocks per root
    buffers: list[dict] = []
    buf_of: dict[int, int] = {}
    tensor_of: list[Tensor] = []  # buffer index -> its tensor
    roots: dict[int, Tensor] = {}
    first: dict[int, int] = {}
    last: dict[int, int] = {}
    n_steps = len(raw_steps)

    def buffer(t: Tensor) -> int:
        if id(t) not in buf_of:
            buf_of[id(t)] = len(buffers)
            tensor_of.append(t)
            r = root(t)
            roots[id(t)] = r
            buffers.append({"name": t.name, "shape": list(t.shape), "dtype": t.dtype})
        return buf_of[id(t)]

    for t in g.inputs:
        buffer(t)
        first.setdefault(id(t), -1)
        last.setdefault(id(t), -1)
    for i, (kind, _, ins, outs, op) in enumerate(raw_steps):
        for t in ins:
            buffer(t)
            r = root(t)
            last[id(r)] = max(last.get(id(r), i), i)
        for t in outs:
            buffer(t)
            r = root(t)
            first.setdefault(id(r), i)
            last[id(r)] = max(last.get(id(r), i), i)
    for t in g.outputs:
        buffer(t)
        r = root(t)
        last[id(r)] = n_steps
        first.setdefault(id(r), -1 if r.is_constant else n_steps)
    for y, x in pairs.values():  # a state input holds its value from one run to the next
        last[id(x)] = n_steps
    # what the steps run at load write and a run reads (or returns) keeps its memory for good
    for _, _, _, outs, _ in raw_steps[:n_load]:
        for t in outs:
            r = root(t)
            if last[id(r)] >= n_load:
                first[id(r)], last[id(r)] = -1, n_steps

    # weights: constants (by root), in first-use order; constants holding the same bytes share them
    # (a tied table and its lm_head's weight, stored under two shapes)
    weights: list[tuple[int, np.ndarray]] = []
    w_off: dict[int, int] = {}
    same_bytes: dict[tuple, list[tuple[np.ndarray, int]]] = {}
    wpos = 0
    arena_roots: list[Tensor] = []
    seen_roots: set[int] = set()
    tensors_by_buf: list[Tensor] = [None] * len(buffers)  # type: ignore[list-item]
    for tid, bi in buf_of.items():
        tensors_by_buf[bi] = roots[tid]
    for bi in range(len(buffers)):
        r = tensors_by_buf[bi]
        if id(r) in seen_roots:
            continue
        seen_roots.add(id(r))
        if r.is_constant:
            value = np.asarray(r.value, dtype=numpy_type(r.dtype))
            if value.shape != r.shape:
                if value.size != 1:
                    raise GraphError(f"rank {rank}: constant {r.name} holds a value of another shape than {r.shape}")
                value = np.broadcast_to(value.reshape(()), r.shape)  # one value stands for all
            # not ascontiguousarray: it makes 0-d values 1-d; a copy (of a broadcast value) kept in a file
            value = spill(np.asarray(value, order="C"))
            key = _bytes_key(value)
            twin = next((off for v, off in same_bytes.get(key, ()) if _same_bytes(v, value)), None)
            if twin is not None:
                w_off[id(r)] = twin
                continue
            same_bytes.setdefault(key, []).append((value, wpos))
            w_off[id(r)] = wpos
            weights.append((wpos, value))
            wpos = _align(wpos + value.nbytes)
        else:
            arena_roots.append(r)
    blocks = [(r.nbytes, first.get(id(r), -1), last.get(id(r), n_steps)) for r in arena_roots]
    offsets, arena_bytes = plan_buffers(blocks)
    a_off = {id(r): o for r, o in zip(arena_roots, offsets)}
    for bi, b in enumerate(buffers):
        r = tensors_by_buf[bi]
        if id(r) in w_off:
            b["storage"], b["offset"] = "weights", w_off[id(r)]
        else:
            b["storage"], b["offset"] = "arena", a_off[id(r)] + offset_in_root(tensor_of[bi])

    steps = []
    for kind, k, ins, outs, op in raw_steps:
        if kind == "kernel":
            st = {"kind": "kernel", "node": op.name, "op_type": op.op_type,
                  "symbol": k if isinstance(k, str) else k["symbol"],
                  "inputs": [buf_of[id(t)] for t in ins], "outputs": [buf_of[id(t)] for t in outs]}
            if isinstance(k, Mapping):
                extra = {key: v for key, v in k.items() if key not in ("symbol", "inputs", "outputs")}
                if extra:
                    st["launch"] = extra
        else:
            attrs = {key: (list(v) if isinstance(v, tuple) else v) for key, v in op.attrs.items()
                     if key != "mesh_axis"}
            axes = mesh_axes(op.attrs["mesh_axis"])
            st = {"kind": "collective", "node": op.name, "collective": op.collective, "mesh_axis": list(axes),
                  "group": group_key(axes), "attrs": attrs,
                  "inputs": [buf_of[id(t)] for t in ins], "outputs": [buf_of[id(t)] for t in outs]}
        steps.append(st)
    program = {
        "format": 1,
        "alignment": ALIGNMENT,
        "arena_bytes": int(arena_bytes),
        "weights_bytes": int(wpos),
        "weights_file": "weights.bin",
        "kernels_file": "kernels.so",
        "buffers": buffers,
        "inputs": [[t.name, buf_of[id(t)]] for t in g.inputs],
        "outputs": [[name, buf_of[id(t)]] for name, t in zip(g.output_names, g.outputs) if name not in pairs],
        "steps": steps,
    }
    if pairs:
        program["state"] = [{"input": x.name, "input_buffer": buf_of[id(x)], "output": out,
                             "output_buffer": buf_of[id(y)], "in_place": in_place[out]}
                            for out, (y, x) in pairs.items()]
    if n_load:
        program["load_steps"] = n_load
    fresh = _fresh_outputs(g, raw_steps, root, first, n_load, {id(y) for y, _ in pairs.values()})
    if fresh:
        program["fresh_outputs"] = [
            {"output": name, "offset": a_off[id(r)], "bytes": int(r.nbytes),
             "buffers": [bi for bi in range(len(buffers)) if tensors_by_buf[bi] is r]}
            for name, t in zip(g.output_names, g.outputs) for r in [root(t)] if id(r) in fresh]
    borrowed = _borrowed_inputs(g, raw_steps, root, {id(x) for _, x in pairs.values()})
    if borrowed:
        program["borrowed_inputs"] = [
            {"input": t.name, "offset": a_off[id(r)], "bytes": int(r.nbytes),
             "buffers": [bi for bi in range(len(buffers)) if tensors_by_buf[bi] is r]}
            for t in g.inputs for r in [root(t)] if id(r) in borrowed]
    return program, weights, int(wpos)


def _borrowed_inputs(g: FlowGraph, raw_steps: list, root: Callable[[Tensor], Tensor],
                     state_inputs: set[int]) -> set[int]:
    """The storage roots (by id) of the graph inputs a run may read in the caller's own array
    instead of a copy in the arena (``program.json``'s ``borrowed_inputs``; rfcs/0003): each holds
    exactly one input, whole, that no step writes (no in-place kernel, no state input), no
    collective reads (its staging is bound to the arena's bytes when the program loads) and no
    graph output returns."""
    per_root: dict[int, int] = {}
    for t in g.inputs:
        per_root[id(root(t))] = per_root.get(id(root(t)), 0) + 1
    barred = {id(root(t)) for t in g.outputs}
    for kind, _, ins, outs, _ in raw_steps:
        barred.update(id(root(t)) for t in outs)
        if kind == "collective":
            barred.update(id(root(t)) for t in ins)
    return {id(r) for t in g.inputs for r in [root(t)]
            if per_root[id(r)] == 1 and id(t) not in state_inputs and id(r) not in barred and t.nbytes == r.nbytes > 0}


def _fresh_outputs(g: FlowGraph, raw_steps: list, root: Callable[[Tensor], Tensor], first: Mapping[int, int],
                   n_load: int, state_outputs: set[int]) -> set[int]:
    """The storage roots (by id) of the graph outputs a run may write into fresh memory of the
    caller's (``program.json``'s ``fresh_outputs``; rfcs/0003): each holds exactly one output, whole
    (no more bytes than the output's, no state output among its tensors), written on every run
    (not a constant, no graph input, not written at load) and by kernel steps alone (a collective's
    staging is bound to the arena's bytes when the program loads)."""
    per_root: dict[int, int] = {}
    for t in g.outputs:
        per_root[id(root(t))] = per_root.get(id(root(t)), 0) + 1
    collective = {id(root(t)) for kind, _, ins, outs, _ in raw_steps if kind == "collective" for t in ins + outs}
    inputs = {id(root(t)) for t in g.inputs}
    res = set()
    for t in g.outputs:
        r = root(t)
        if (per_root[id(r)] == 1 and not r.is_constant and id(r) not in inputs and id(r) not in collective
                and id(t) not in state_outputs and id(r) not in state_outputs and first.get(id(r), -1) >= n_load
                and t.nbytes == r.nbytes > 0):
            res.add(id(r))
    return res


def _state_selects(g: FlowGraph, pairs: Mapping[str, tuple[Tensor, Tensor]]) -> dict[str, tuple[str, str]]:
    """``{output name: (its tensor's name, the input's)}`` of the state ``pairs`` (:func:`_state_pairs`)
    of a rank graph whose output is a ``Where`` keeping the input's element where its condition
    holds, that ``Where`` being the input's only reader (a KV cache's present over its past):
    :func:`build_program` writes such an output over the input (:func:`_state_in_place` agrees: the
    select reads the input at its own index), so its kernel may store only where the condition
    fails (the ``in_place`` of ``build_cpu_library`` and ``build_cuda_library``)."""
    readers: dict[int, list] = {}
    for op in g.nodes:
        for t in op.inputs:
            readers.setdefault(id(t), []).append(op)
    made = {id(t): op for op in g.nodes for t in op.outputs}
    res = {}
    for out, (y, x) in pairs.items():
        if sum(t is y for t in g.outputs) != 1 or any(t is x for t in g.outputs):
            continue
        op = made.get(id(y))
        if (op is not None and op.op_type == "Where" and len(op.inputs) == 3 and op.inputs[1] is x
                and readers.get(id(x)) == [op]):
            res[out] = (y.name, x.name)
    return res


def _state_pairs(g: FlowGraph, state: Mapping[str, str], rank: int) -> dict[str, tuple[Tensor, Tensor]]:
    """``{output name: (output tensor, input tensor)}`` of a rank graph's state, each pair of one
    local shape and type (``compile`` gives both sides one spec: :func:`_plan_state`)."""
    outputs = dict(zip(g.output_names, g.outputs))
    inputs = {t.name: t for t in g.inputs}
    pairs = {}
    for out, name in state.items():
        if out not in outputs or name not in inputs:
            raise GraphError(f"rank {rank}: state {out} -> {name}: the rank graph has no "
                             f"{'output ' + out if out not in outputs else 'input ' + name}")
        y, x = outputs[out], inputs[name]
        if (tuple(y.shape), y.dtype) != (tuple(x.shape), x.dtype):
            raise GraphError(f"rank {rank}: state output {out} is {y.dtype}{list(y.shape)} on this rank, its input "
                             f"{name} {x.dtype}{list(x.shape)}; a state needs one spec for both (input_placements and "
                             "output_placements)")
        pairs[out] = (y, x)
    return pairs


def _state_in_place(raw_steps: list, g: FlowGraph, x: Tensor, y: Tensor, root: Callable[[Tensor], Tensor],
                    producer: Mapping[int, Operator]) -> bool:
    """Whether state output ``y`` can be written over input ``x``'s bytes: one kernel step writes
    ``y`` (no view, no concatenation, no other output), it is the only step reading ``x`` (directly,
    no view of it) and it reads ``x`` only at ``y``'s own index (a KV cache's present: the past where
    no new token lands, :func:`~shardflow.compiler.codegen.fusion.reads_only_at_own_index`); ``x``
    is no graph output. ``producer``: each tensor's op, by id."""
    from .codegen.fusion import reads_only_at_own_index

    if root(y) is not y or any(root(t) is x for t in g.outputs) or sum(t is y for t in g.outputs) != 1:
        return False
    readers = [i for i, (_, _, ins, _, _) in enumerate(raw_steps) if any(root(t) is x for t in ins)]
    writers = [i for i, (_, _, _, outs, _) in enumerate(raw_steps) if any(root(t) is y for t in outs)]
    if len(writers) != 1 or readers != writers:
        return False
    kind, _, ins, outs, _ = raw_steps[writers[0]]
    if kind != "kernel" or len(outs) != 1 or outs[0] is not y or [t for t in ins if root(t) is x] != [x]:
        return False
    # the ops the kernel computes: back from y to its inputs (constants are its inputs too)
    members: list[Operator] = []
    stack = [(y, False)]
    while stack:
        t, expanded = stack.pop()
        op = producer.get(id(t))
        if expanded:
            if all(m is not op for m in members):
                members.append(op)
            continue
        if any(t is u for u in ins) or t.is_constant or any(m is op for m in members):
            continue
        if op is None:
            return False
        stack.append((t, True))
        stack.extend((u, False) for u in reversed(op.inputs))
    return reads_only_at_own_index(members, x, y)


def _steps_at_load_first(raw_steps: list, root: Callable[[Tensor], Tensor]) -> tuple[list, int]:
    """``(steps, n)``: ``raw_steps`` reordered so that the ``n`` kernel steps whose inputs are all
    constants, or tensors only such steps write, come first (in their order), the others after them
    (in theirs): the runtime runs the first ``n`` once, when it loads the program.

    These are the ops constant folding leaves in the graph because their results are too large to
    store (``FOLD_LIMIT``), e.g. a ``ConstantOfShape`` fill of a big weight. Moving them first keeps
    the order topological: their inputs are constants or written by earlier such steps. Collectives and
    ops whose values are not a function of their inputs (``data_dependent_values``) always run.
    """
    writers: dict[int, int] = {}
    for _, _, _, outs, _ in raw_steps:
        for t in outs:
            writers[id(root(t))] = writers.get(id(root(t)), 0) + 1
    at_load: dict[int, int] = {}  # root -> how many of its writers run at load
    first, rest = [], []
    for step in raw_steps:
        kind, _, ins, outs, op = step
        if kind == "kernel" and not op.data_dependent_values and all(
                root(t).is_constant or at_load.get(id(root(t)), -1) == writers.get(id(root(t))) for t in ins):
            first.append(step)
            for t in outs:
                at_load[id(root(t))] = at_load.get(id(root(t)), 0) + 1
        else:
            rest.append(step)
    if first:
        log.debug("%d steps computed from constants only run once at load", len(first))
    return first + rest, len(first)


def _check_stored_dtypes(graph: FlowGraph, target: str) -> None:
    """Refuse, naming the node, a tensor of a type the code generators do not store (float8: the
    evaluator, ``load_onnx(...).run``, computes such models; the kernels do not)."""
    from .codegen.lower import SUPPORTED_DTYPES

    for op in graph.nodes:
        for t in op.outputs:
            if t.dtype not in SUPPORTED_DTYPES:
                raise DtypeError(f"node {op.name} ({op.op_type}) produces {t.name} of type {t.dtype}, which the "
                                     f"{target} code generator does not store yet (supported: "
                                     f"{', '.join(SUPPORTED_DTYPES)}); load_onnx(...).run computes the model")


def _why_no_kernel(op: Operator) -> str:
    try:
        from .codegen import why_not_lowerable

        why = why_not_lowerable(op)
    except Exception:  # noqa: BLE001 - the explanation is optional
        return ""
    return f": {why}" if why else ""


def _kernel_entry(k: Any) -> Any:
    """Normalize what codegen returned for one op: a symbol, ``None``, or a dict with ``symbol``
    (and optionally ``inputs``/``outputs`` tensor names and launch parameters). A dataclass such as
    the cuda codegen's ``KernelLaunch`` (``args`` = inputs then outputs, ``num_inputs``) becomes
    such a dict."""
    if dataclasses.is_dataclass(k) and not isinstance(k, type):
        k = dataclasses.asdict(k)
    if isinstance(k, Mapping) and "args" in k and "num_inputs" in k:
        args, n = list(k["args"]), int(k["num_inputs"])
        k = {key: (list(v) if isinstance(v, tuple) else v) for key, v in k.items() if key not in ("args",)}
        k["inputs"], k["outputs"] = args[:n], args[n:]
    return k


#: Bytes of a rank's weights, outside the arrays the compile keeps alive, compared by value with an earlier
#: rank's (:func:`_write_or_link_weights`): the scalars and small tables the rank passes make.
LINK_COMPARED_BYTES = 1 << 20


def _write_or_link_weights(path: Path, weights: list[tuple[int, np.ndarray]], total: int, cache, written: dict) -> str:
    """:func:`_write_weights`, or, where an earlier rank wrote the same arrays at the same offsets (a
    replicated plan's ranks), a hard link to that rank's file (its sha256 reused; a copy where the
    file system has no hard links). The same arrays: the same memory of arrays ``cache`` keeps alive
    for the compile (so that an address names its bytes), and equal bytes of the others, at most
    :data:`LINK_COMPARED_BYTES` of them (else the file is written)."""
    if cache is None:
        return _write_weights(path, weights, total)
    parts, compared = [], 0
    for off, a in weights:
        k = cache.pinned_key(a)
        if k is not None:
            parts.append((off, k))
            continue
        compared += a.nbytes
        if compared > LINK_COMPARED_BYTES:
            return _write_weights(path, weights, total)
        parts.append((off, a.shape, a.dtype.str, np.ascontiguousarray(a).tobytes()))
    key = (total, tuple(parts))
    if key in written:
        first, sha = written[key]
        try:
            os.link(first, path)
        except OSError:
            shutil.copyfile(first, path)
        log.debug("%s: the same weights as %s, linked", path, first)
        return sha
    sha = _write_weights(path, weights, total)
    written[key] = (path, sha)
    return sha


def _write_weights(path: Path, weights: list[tuple[int, np.ndarray]], total: int) -> str:
    """Write the weight shard; return its sha256, computed by a second thread while writing
    (both release the GIL on large buffers)."""
    import hashlib
    import queue
    import threading

    h = hashlib.sha256()
    todo: queue.Queue = queue.Queue(maxsize=64)

    def hasher() -> None:
        while (data := todo.get()) is not None:
            h.update(data)

    t = threading.Thread(target=hasher, daemon=True)
    t.start()

    def put(f, data) -> None:
        todo.put(data)
        f.write(data)

    try:
        with open(path, "wb") as f:
            pos = 0
            for off, a in weights:
                if off > pos:
                    put(f, b"\0" * (off - pos))
                    pos = off
                if a.size:
                    put(f, memoryview(a.reshape(-1).view(np.uint8)))
                pos += a.nbytes
            if total > pos:
                put(f, b"\0" * (total - pos))
    except OSError as exc:
        raise ShardflowError(f"could not write the weights {path} ({total:,} bytes): {exc}; free space there or "
                             "choose another out_dir") from exc
    finally:
        todo.put(None)
        t.join()
    return h.hexdigest()


# ---------------------------------------------------------------------------------------
# codegen adapters
# ---------------------------------------------------------------------------------------
def _keywords(fn: Callable) -> set[str] | None:
    """The keyword arguments ``fn`` takes; None when it takes any (``**kw``) or cannot be inspected."""
    try:
        params = inspect.signature(fn).parameters
    except (TypeError, ValueError):
        return None
    if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values()):
        return None
    return set(params)


def _accepts(fn: Callable, name: str) -> bool:
    """Whether ``fn`` takes the keyword argument ``name``."""
    names = _keywords(fn)
    return names is None or name in names


def _call_with_supported(fn: Callable, *args, **kw):
    """Call ``fn`` passing only the keyword arguments its signature accepts."""
    names = _keywords(fn)
    return fn(*args, **(kw if names is None else {k: v for k, v in kw.items() if k in names}))


def _cpu_builder() -> Callable:
    try:
        mod = importlib.import_module("shardflow.compiler.codegen")
        return mod.build_cpu_library
    except (ImportError, AttributeError) as exc:
        raise ShardflowError(f"the cpu target needs shardflow.compiler.codegen.build_cpu_library, which is not "
                             f"available in this installation ({exc}); the cpu kernel codegen is not implemented "
                             "yet") from None


def _shared_codegen(builder: Callable, target: str) -> tuple[Callable, Callable] | None:
    """``(prepare, compile)`` of the stock codegen of ``target`` when ``builder`` is its
    ``build_cpu_library`` or ``build_cuda_library``, else None (a builder of the caller's compiles
    each rank itself)."""
    name = "shardflow.compiler.codegen" + (".cuda" if target == "cuda" else "")
    try:
        mod = importlib.import_module(name)
    except ImportError:
        return None
    if builder is not getattr(mod, f"build_{target}_library", None):
        return None
    return getattr(mod, f"prepare_{target}_library"), getattr(mod, f"compile_{target}_sources")


def _compile_shared_libraries(compile_sources: Callable, sources: list, kernels_name: str) -> None:
    """Compile the ranks' kernel sources (``[(rank dir, source)]``) into one library (or cubin) per
    distinct header (one for all the ranks unless only some use the float8 helpers), written to
    the first rank dir of the group and copied to the others: each rank dir stays whole on its own,
    and a kernel that all ranks share is compiled once, not once per rank."""
    groups: dict[str, list] = {}
    for rdir, source in sources:
        groups.setdefault(source.header, []).append((rdir, source))
    for group in groups.values():
        first = group[0][0] / kernels_name
        compile_sources([source for _, source in group], str(first))
        for rdir, _ in group[1:]:
            shutil.copy(first, rdir / kernels_name)


def _cuda_builder() -> Callable:
    try:
        mod = importlib.import_module("shardflow.compiler.codegen.cuda")
        return mod.build_cuda_library
    except (ImportError, AttributeError):
        raise ShardflowError("the cuda target is not implemented yet (shardflow.compiler.codegen.cuda."
                             "build_cuda_library is missing); compile with target 'cpu'") from None


# ---------------------------------------------------------------------------------------
# compile
# ---------------------------------------------------------------------------------------
def _load_model(model, input_shapes, input_values=None, int8_qdq: bool = False,
                routed_experts: bool = False, dim_sizes=None) -> FlowGraph:
    if isinstance(model, FlowGraph):
        if input_shapes or input_values or dim_sizes:
            raise ConfigError("input_shapes, input_values and dim_sizes apply to ONNX models; a FlowGraph already "
                              "has static shapes and its own inputs")
        return model
    from . import load_onnx

    return load_onnx(model, input_shapes=input_shapes, input_values=input_values, int8_qdq=int8_qdq,
                     routed_experts=routed_experts, dim_sizes=dim_sizes)


def _check_state(graph: FlowGraph, state: Mapping[str, str] | None, input_values: Mapping[str, Any] | None
                 ) -> dict[str, str]:
    """``compile``'s ``state`` checked against the imported graph: every key an output, every value
    an input of its shape and type, no input twice; with the random ops' step (``RNG_STEP``, when
    it is an input) added."""
    outputs = dict(zip(graph.output_names, graph.outputs))
    inputs = {t.name: t for t in graph.inputs}
    rng = {RNG_STEP_NEXT: RNG_STEP} if RNG_STEP in inputs and RNG_STEP_NEXT in outputs else {}
    if state is None:
        return rng
    if not isinstance(state, Mapping) or not all(isinstance(k, str) and isinstance(v, str) for k, v in state.items()):
        raise ConfigError("state must be a dict {output name: input name} of strings, e.g. "
                          "{'present.0.key': 'past_key_values.0.key'}")
    seen: dict[str, str] = {}
    for out, name in state.items():
        if out not in outputs:
            close = difflib.get_close_matches(out, list(outputs), n=1)
            raise ConfigError(f"state: {out!r} is not an output of the model"
                              + (f"; did you mean {close[0]!r}?" if close else f" (outputs: {list(outputs)})"))
        if name not in inputs:
            if input_values and name in input_values:
                raise ConfigError(f"state: input {name!r} of output {out!r} is fixed by input_values; a state input "
                                  "must stay an input")
            close = difflib.get_close_matches(name, list(inputs), n=1)
            raise ConfigError(f"state: {name!r} (for output {out!r}) is not an input of the model"
                              + (f"; did you mean {close[0]!r}?" if close else f" (inputs: {list(inputs)})"))
        if name in seen:
            raise ConfigError(f"state: input {name!r} is given by two outputs, {seen[name]!r} and {out!r}")
        seen[name] = out
        y, x = outputs[out], inputs[name]
        if (tuple(y.shape), y.dtype) != (tuple(x.shape), x.dtype):
            raise ConfigError(f"state: output {out!r} is {y.dtype}{list(y.shape)} but input {name!r} is "
                              f"{x.dtype}{list(x.shape)}; a state needs one shape and type (a KV cache of fixed "
                              "size: input_shapes with the past as long as the present)")
    return {**rng, **state}


def _input_entry(local: Tensor, whole: Tensor, plan, rank: int, padded: Mapping | None = None,
                 index_checks=()) -> dict:
    """A rank's manifest entry for one input: its shape, type and spec; for an input of which the
    rank takes a part (a sharded state), also the whole's shape and the part's bounds. A state kept
    on padded heads (``padded``: :func:`~shardflow.compiler.passes.heads.keep_state_padded`'s entry)
    has the model's shape as ``global_shape``, its bounds in the padded one, and ``padded_heads``:
    the padded whole is the model's taken at ``index`` along ``axis`` (``shape``: the padded whole's).
    ``index_checks``: ``[lo, hi, op]`` ranges its values must lie in, the runtime checks before a run
    (:mod:`~shardflow.compiler.passes.index_checks`)."""
    spec = plan.input_specs.get(local.name)
    entry = {"name": local.name, "shape": list(local.shape), "dtype": local.dtype,
             "placement": str(spec) if spec is not None else "R"}
    if index_checks:
        entry["index_checks"] = [list(c) for c in index_checks]
    if padded is not None:
        entry["global_shape"] = list(padded["shape"])
        entry["bounds"] = [list(b) for b in (spec.local_bounds(whole.shape, plan.mesh, rank) if spec is not None
                                             else [(0, d) for d in whole.shape])]
        entry["padded_heads"] = {"axis": padded["axis"], "index": padded["index"], "shape": list(whole.shape)}
    elif tuple(local.shape) != tuple(whole.shape):
        entry["global_shape"] = list(whole.shape)
        entry["bounds"] = [list(b) for b in spec.local_bounds(whole.shape, plan.mesh, rank)]
    return entry


def plan_with_state(graph: FlowGraph, dcfg, state: Mapping[str, str] | None,
                    input_values: Mapping[str, Any] | None = None) -> tuple:
    """The plan ``compile`` makes for the planned ``graph`` (:func:`planned_graph`) under ``dcfg`` (a
    DistributedConfig) with ``state`` (``compile``'s; checked here): ``(plan, state, padded state,
    sharded state)``. A KV cache whose heads were padded for the ranks is kept so (``padded state``: by
    input, passes/heads.py), and a state the plan's writer splits is kept split (:func:`_plan_state`,
    which searches again with those placements; ``sharded state``: the inputs each rank takes its part
    of). ``shardflow plan --state`` prints this plan."""
    from .parallel import search

    state = _check_state(graph, state, input_values)
    padded_state = {}
    if state and graph.meta.get("padded_heads") and not dcfg.preload_plan:
        # a KV cache whose heads were padded (or replicated) for the ranks kept so, to be split as they are
        from .passes.heads import keep_state_padded

        padded_state = keep_state_padded(graph, state)
    log.info("searching a plan on mesh %s (algo %s)", list(dcfg.mesh_shape), dcfg.algo)
    plan = search(graph, dcfg)
    plan, sharded_state = _plan_state(graph, plan, dcfg, state)
    return plan, state, padded_state, sharded_state


def _plan_state(graph: FlowGraph, plan, dcfg, state: Mapping[str, str]) -> tuple[Any, set[str]]:
    """The plan for a program with ``state`` on several ranks, and the state inputs each rank takes
    only its part of.

    A state pair (output, input) is kept by every rank in one spec on both sides: the one given by
    ``input_placements``/``output_placements`` (both, equal), else the spec the plan's writer of the
    output produces (a KV cache split by heads stays split: no all-gather of the presents, each
    rank's share of the cache in its memory). Such specs become the pair's placements and the plan
    is searched again with them (the input then costs nothing in that spec, the output no
    gathering); a writer's spec with a partial sum, or a replicated one, leaves the pair whole."""
    if not state or plan.mesh.size == 1:
        return plan, set()
    from .parallel import search

    producer = {id(t): (op, k) for op in graph.nodes for k, t in enumerate(op.outputs)}
    outputs = dict(zip(graph.output_names, graph.outputs))
    ins, outs = dict(dcfg.input_placements), dict(dcfg.output_placements)
    chosen = False
    for out, name in state.items():
        if name in ins or out in outs:
            continue  # the user's (checked below)
        found = producer.get(id(outputs[out]))
        spec = plan.op_specs[found[0].name].output_specs[found[1]] if found else None
        if spec is None or spec.is_replicated or spec.partial_axes:
            continue
        ins[name] = outs[out] = str(spec)
        chosen = True
    if chosen and not dcfg.preload_plan:
        log.info("state kept sharded on the ranks: %s; searching the plan again with those placements",
                 ", ".join(f"{n} {ins[n]}" for n in state.values() if n in ins))
        plan = search(graph, dataclasses.replace(dcfg, input_placements=ins, output_placements=outs))
    sharded = set()
    for out, name in state.items():
        a, b = plan.input_specs[name], plan.output_specs.get(out)
        if b is None or a != b:
            raise ConfigError(f"state {out!r} -> {name!r}: the input's placement {a} and the output's {b} differ; "
                              "give both the same spec in input_placements and output_placements (or neither)")
        if not a.is_replicated:
            sharded.add(name)
    return plan, sharded


def _output_entries(rg: FlowGraph, global_out: Mapping[str, Tensor], plan, rank: int,
                    state: Mapping[str, str], checks: Sequence[dict] = ()) -> list[dict]:
    """A rank manifest's ``outputs``: each output's local shape and where it lies in the whole one
    (state outputs, kept by the program, and ``checks``' outputs, read by the runtime, left out)."""
    res = []
    hidden = {c["output"] for c in checks}
    for name, lt in zip(rg.output_names, rg.outputs):
        if name in state or name in hidden:
            continue
        gt = global_out[name]
        spec = plan.output_specs.get(name)
        bounds = spec.local_bounds(gt.shape, plan.mesh, rank) if spec is not None else [(0, d) for d in gt.shape]
        res.append({"name": name, "shape": list(lt.shape), "dtype": lt.dtype, "global_shape": list(gt.shape),
                    "placement": str(spec) if spec is not None else "R", "bounds": [list(b) for b in bounds]})
    return res


def _collective_axes(rg: FlowGraph) -> set[tuple[int, ...]]:
    """The mesh axes (as tuples) the collectives of a rank graph span."""
    from .parallel.comm_ops import Collective, mesh_axes

    return {mesh_axes(op.attrs["mesh_axis"]) for op in rg.nodes if isinstance(op, Collective)}


def _mesh_groups(mesh, axis_sets: set[tuple[int, ...]]) -> dict[str, list[list[int]]]:
    """mesh.json's process groups: those of every single mesh axis and of ``axis_sets``."""
    axis_sets = axis_sets | {(a,) for a in range(mesh.ndim)}
    return {",".join(str(a) for a in axes): [list(g) for g in mesh.groups(list(axes))]
            for axes in sorted(axis_sets, key=lambda a: (len(a), a))}


def plan_passes(graph: FlowGraph, mesh_shape: Sequence[int], *, fold_affine: bool = True,
                pad_heads: int = 1, index_checks: bool = False) -> FlowGraph:
    """The passes the whole graph takes before the plan (what :func:`compile` runs, and ``shardflow
    plan``, so that a plan it saves names the ops ``compile`` plans): affine ops folded into convs
    (``fold_affine``, passes/fold.py), and on a mesh of more than one device the fused QKV products
    split into their parts, which the plan can split by heads (passes/projections.py; each rank's
    parts are merged back by :func:`rank_passes`) and attention computed on heads merged with the
    batch written on its heads (passes/attention.py's ``AttentionOnHeads``, passes/heads.py's
    ``UnmergeHeads``), then, with ``pad_heads`` > 1 (see
    :func:`heads_padding`), attention heads padded to a multiple of it (passes/heads.py; recorded
    in ``graph.meta["padded_heads"]`` for the plan); with ``index_checks``, an output counting the
    values outside their axes of each index computed in the graph and not proven in range
    (passes/index_checks.py; the runtime raises when one is not zero). Rewrites ``graph``."""
    if fold_affine:
        # BatchNorms and per-channel scales and shifts after convs become the convs' weights
        from .passes.fold import FoldAffineIntoConv

        graph = FoldAffineIntoConv().run(graph)
    if math.prod(mesh_shape) > 1:
        from .passes.attention import AttentionOnHeads
        from .passes.heads import UnmergeHeads
        from .passes.projections import SplitProjections

        graph = SplitProjections().run(graph)
        # attention written on its heads, [B, H, ..], where the export merged them with the batch
        # ([B*H, ..]: XGLM's and DeBERTa's products, the dynamo exporter's transposed keys), so
        # that the plan can split it by heads (a split of [B*H] is not a block of rows when B > 1)
        graph = AttentionOnHeads().run(graph)
        if pad_heads > 1:
            from .passes.grouped_queries import ungroup_queries

            # attention on queries grouped by key/value head written on the query heads where the
            # key/value heads do not divide (a repeat_kv that PadHeads replicates them to)
            ungroup_queries(graph, pad_heads)
        graph = UnmergeHeads().run(graph)
    if pad_heads > 1 and math.prod(mesh_shape) > 1:
        from .passes.heads import PadHeads

        pad = PadHeads(pad_heads)
        graph = pad.run(graph)
        if pad.padded or pad.replicated:
            graph.meta["padded_heads"] = {"ranks": pad_heads, "groups": pad.padded, "replicated": pad.replicated,
                                          "grouped": pad.grouped, "products": pad.products}
    if index_checks:
        # the indices computed in the graph that may leave their axes, counted in extra outputs
        add_index_checks(graph)
    return graph


def planned_graph(model, *, distributed_config: Mapping[str, Any], optimization_config: Mapping[str, Any] | None = None,
                  input_shapes: Mapping[str, Sequence[int]] | None = None,
                  input_values: Mapping[str, Any] | None = None,
                  dim_sizes: Mapping[str, int] | None = None) -> FlowGraph:
    """The graph :func:`compile` searches its plan on for these arguments (the same meanings): the
    model imported as ``optimization_config``'s target imports it (the cpu target's QDQ products
    and routed experts, :func:`~shardflow.compiler.load_onnx`), then :func:`plan_passes`. A plan
    searched on it (``shardflow plan -o DIR``) names the ops ``compile`` plans, so it loads there as
    ``preload_plan``. A :class:`FlowGraph` model is copied, not rewritten."""
    from .parallel.config import DistributedConfig

    return _planned_graph(model, OptimizationConfig.from_dict(optimization_config),
                          DistributedConfig.from_dict(distributed_config), input_shapes, input_values, dim_sizes)


def compare_plans(model, *, distributed_config: Mapping[str, Any],
                  optimization_config: Mapping[str, Any] | None = None,
                  input_shapes: Mapping[str, Sequence[int]] | None = None,
                  input_values: Mapping[str, Any] | None = None,
                  dim_sizes: Mapping[str, int] | None = None,
                  state: Mapping[str, str] | None = None) -> list[tuple[str, Any, str | None]]:
    """The plan :func:`compile` makes for these arguments (``state`` as its: :func:`plan_with_state`)
    beside the other algos' plans on the same mesh,
    links and device (``shardflow plan --compare``): ``[(label, plan, None) or (label, None, why refused)]``,
    the config's own first, then, when it pins ops (``op_placements``), the ILP without the pins (what they
    cost), then every other algo (without pins, which only the ILP takes). Each is planned on the graph
    ``compile`` would plan it on (Megatron's with padded heads where that pads them); a plan the budget
    or the device's memory refuses is listed with the reason."""
    from .parallel.config import ALGOS

    opt = OptimizationConfig.from_dict(optimization_config)
    dcfg = planning_config(distributed_config, optimization_config)
    if dcfg.pipeline_stages != 1:
        raise ConfigError("compare_plans compares plans of one graph on the whole mesh; with pipeline_stages, plan "
                          "the stages (plan_stages) and the whole mesh apart")
    if dcfg.preload_plan:
        raise ConfigError("compare_plans searches the plans; preload_plan gives one: drop it")
    options = [(dcfg.algo, dcfg)]
    if dcfg.op_placements:
        options.append(("ilp without op_placements", dataclasses.replace(dcfg, op_placements={})))
    options += [(a, dataclasses.replace(dcfg, algo=a, op_placements={})) for a in ALGOS if a != dcfg.algo]
    graphs: dict[int, FlowGraph] = {}
    res = []
    for label, cfg in options:
        pad = heads_padding(cfg)
        if pad not in graphs:
            graphs[pad] = _planned_graph(model, opt, cfg, input_shapes, input_values, dim_sizes)
        try:
            plan = plan_with_state(graphs[pad], cfg, state, input_values)[0]
            res.append((label + (f", {len(plan.pinned)} op(s) pinned" if plan.pinned else ""), plan, None))
        except ShardflowError as exc:
            if cfg is dcfg:
                raise
            res.append((label, None, str(exc)))
    return res


def planning_config(distributed_config: Mapping[str, Any], optimization_config: Mapping[str, Any] | None = None):
    """The :class:`~shardflow.compiler.parallel.config.DistributedConfig` :func:`compile` plans
    with: ``distributed_config`` validated, its ``device`` the target's profile when it names
    none (what ``shardflow plan`` searches with, so that it prints the plan ``compile`` makes)."""
    from .parallel.config import DistributedConfig

    return _target_device(DistributedConfig.from_dict(distributed_config),
                          OptimizationConfig.from_dict(optimization_config))


def _target_device(dcfg, opt: OptimizationConfig):
    if dcfg.device is not None:
        return dcfg
    # plan for what the ranks will compute on: a cpu rank is ~500x slower than an H100 (the
    # search's own default), so the same collective costs far less next to its compute
    from .parallel.cost import DEVICE_PROFILES

    return dataclasses.replace(dcfg, device=DEVICE_PROFILES[opt.target])


def _import_for(model, opt: OptimizationConfig, input_shapes, input_values, dim_sizes=None) -> FlowGraph:
    """``model`` imported as ``opt``'s target imports it (the cpu target's integer QDQ products and routed
    experts)."""
    return _load_model(model, input_shapes, input_values, int8_qdq=opt.target == "cpu" and opt.int8_qdq,
                       routed_experts=opt.target == "cpu", dim_sizes=dim_sizes)


def _planned_graph(model, opt: OptimizationConfig, dcfg, input_shapes, input_values, dim_sizes=None) -> FlowGraph:
    graph = _import_for(model, opt, input_shapes, input_values, dim_sizes)
    graph = plan_passes(graph.clone() if isinstance(model, FlowGraph) else graph, dcfg.mesh_shape,
                        fold_affine=opt.fold_affine, pad_heads=heads_padding(dcfg), index_checks=opt.index_checks)
    if opt.precision in ("float16", "bfloat16"):
        # the plan's memory counts float32 weights as the ranks will store them (the contractions'
        # weights and the gather tables in the half type, after the plan: rank_passes)
        graph.meta["weights_precision"] = opt.precision
    return graph


def heads_padding(dcfg) -> int:
    """The ranks :func:`plan_passes` pads attention heads for under ``dcfg`` (a DistributedConfig):
    what a preloaded plan was made with; else, with ``pad_heads`` true, or ``auto`` (the default)
    and the Megatron baseline (each rank whole heads; passes/heads.py), the last mesh axis's size;
    else 1 (no padding)."""
    if dcfg.preload_plan:
        from .parallel.plan import plan_file

        try:
            with open(plan_file(dcfg.preload_plan)) as f:
                return int(json.load(f).get("pad_heads", 1))
        except (OSError, ValueError, TypeError, AttributeError):
            return 1  # (the plan's own load names what is wrong with the file)
    pad = dcfg.algo == "megatron" if dcfg.pad_heads == "auto" else dcfg.pad_heads
    return int(dcfg.mesh_shape[-1]) if pad else 1


def rank_passes(rg: FlowGraph, opt: OptimizationConfig, *, winograd: bool = True,
                repack: bool = True, pack_cache=None) -> FlowGraph:
    """The passes one rank's graph takes after the plan, before its kernels are generated, for
    ``opt``'s target and precision (what :func:`compile` runs on each rank; the conformance runs of
    tests/codegen call it too). ``winograd``: 3x3 convs may take Winograd's transformed weights
    (off under a memory budget, which did not count them); ``repack``: the blocked layout may
    store repacked weights (likewise); ``pack_cache``: a :class:`~.passes.prepack.PackCache` the
    ranks of one compile share (the weights they hold whole packed once)."""
    # a bfloat16 model's partial sums reduced over ranks in float32 (passes/precision.py)
    from .passes.precision import ReduceBfloat16InFloat32

    rg = ReduceBfloat16InFloat32().run(rg)
    if opt.target == "cuda" and opt.precision in ("float16", "bfloat16"):
        # low-bit weight products on half operands, rounded by the op (passes/lowbit.py)
        from .passes.lowbit import HalfLowBitOperands

        rg = HalfLowBitOperands(opt.precision).run(rg)
    if opt.target == "cuda":
        # the projections of one activation (Q, K, V) as one GEMM, on this rank's shards
        from .passes.projections import MergeProjections

        rg = MergeProjections(cache=pack_cache).run(rg)
        # attention computed on [B*H, ..] tensors (BLOOM's) on its [B, H, ..] views, before the
        # precision pass's casts stand between those and the products (passes/attention.py)
        from .passes.attention import AttentionOnHeads

        rg = AttentionOnHeads().run(rg)
    if opt.precision in ("float16", "bfloat16"):
        # half operands on each rank's graph, after the plan: the search sees the float32
        # graph, whose weights are constants (a weight read through a Cast is not one to
        # the megatron baseline); rounding commutes with the slicing of the plan, and the
        # collectives carry the float32 values they carried before
        from .passes.precision import HalfPrecisionContractions

        rg = HalfPrecisionContractions(opt.precision, k_major_weights=opt.target == "cuda",
                                       k_major_ops=_k_major_tiles(opt.gemm_tiles),
                                       cast_per_reader=opt.target == "cuda").run(rg)
    if opt.target == "cuda":
        # a half model's own weights stored [N, K] where the wgmma GEMM needs them so
        from .passes.precision import HalfWeightsKMajor

        rg = HalfWeightsKMajor(_k_major_tiles(opt.gemm_tiles)).run(rg)
        from .codegen.cuda_wgmma import WGMMA_ARCHS

        if opt.arch in WGMMA_ARCHS and opt.channels_last:
            # convs of half images with a window, a stride or padding read a channels-last copy
            # of the image, which the wgmma template gathers (passes/channels_last.py)
            from .passes.channels_last import ChannelsLastConvs, KeepChannelsLast

            rg = ChannelsLastConvs().run(rg)
            # and the element-wise ops between such convs on channels-last values (no copies)
            rg = KeepChannelsLast().run(rg)

        if opt.arch in WGMMA_ARCHS and (opt.wgmma_fp32 or opt.gemm_tiles):
            # float32 weights [N, K] for the Hopper wgmma GEMM (rounded to TF32 for one TF32
            # product): every one with wgmma_fp32, else those of the ops on forced tiles
            from .passes.precision import Float32WeightsKMajor

            rg = Float32WeightsKMajor(opt.precision == "tf32",
                                      None if opt.wgmma_fp32 else _tiled_ops(opt.gemm_tiles)).run(rg)
        # an embedding table tied to the output layer looked up in that layer's stored weight
        # (transposed, in the gather's kernel): one copy of the vocabulary's table
        from .passes.precision import TablesFromTiedWeights

        rg = TablesFromTiedWeights().run(rg)
        # one fused kernel per attention on half operands (those of the precision pass, or a
        # float16/bfloat16 model's own; passes/attention.py), on this rank's share
        from .passes.attention import FuseAttention

        rg = FuseAttention().run(rg)
        # and on float32 operands (TF32 or 3xTF32 products; the config takes sm_80 and newer only)
        rg = FuseAttention(float32=True, target="cuda").run(rg)
        # attention that is half in the model: float32 inside, one fused kernel (passes/attention.py)
        from .passes.attention import HalfAttentionInFloat32

        rg = HalfAttentionInFloat32().run(rg)
    if opt.target == "cpu":
        # the parts of a product split for the plan (SplitProjections), one product again on this
        # rank's shards
        from .passes.projections import MergeProjections

        rg = MergeProjections(parts_only=True, cache=pack_cache).run(rg)
        # a float16 or bfloat16 model (and precision's roundings) computed in float32, each op's output
        # rounded to the half type: the float32 templates and epilogues throughout (passes/precision.py;
        # the bfloat16 products and convs then read bfloat16 copies, passes/prepack.py)
        from .passes.precision import HalfModelInFloat32, WidenHalfProducts

        rg = HalfModelInFloat32("float16").run(rg)
        rg = HalfModelInFloat32("bfloat16").run(rg)
        # what is left of half products (of mixed half types) by the float32 templates, rounded once
        rg = WidenHalfProducts().run(rg)
    if opt.target == "cpu" and opt.fuse:
        # attention written as MatMul/Softmax/MatMul as one op the cpu template computes by blocks
        # of rows (passes/attention.py), on this rank's share: no [B, H, S, L] scores in memory; at
        # precision float16/bfloat16 with the probabilities rounded as the precision pass rounded them
        from .passes.attention import FuseAttention

        rg = FuseAttention(float32=True).run(rg)
    if opt.target == "cpu":
        # 3-D max and average pools as two 2-D ones, which the pool template computes (passes/pools.py)
        from .passes.pools import SeparablePools

        rg = SeparablePools().run(rg)
        # resizes of volumes (trilinear upsampling) as two the Resize template computes (passes/resizes.py)
        from .passes.resizes import SeparableResizes

        rg = SeparableResizes().run(rg)
        # depthwise transposed convs as a depthwise conv per output phase (passes/transposed.py)
        from .passes.transposed import PhasedDepthwiseTransposedConvs

        rg = PhasedDepthwiseTransposedConvs().run(rg)
    if opt.target == "cpu" and (opt.prepack or winograd):
        # constant GEMM weights packed once, here, instead of on every call; 3x3 convs as
        # Winograd's, their weights transformed here (passes/prepack.py)
        from .passes.prepack import CONV_MAX_PIXELS, PrepackWeights

        rg = PrepackWeights(conv_max_pixels=CONV_MAX_PIXELS if opt.prepack else 0, winograd=winograd,
                            gemm=opt.prepack, windows=opt.prepack, blocked=opt.blocked, cache=pack_cache).run(rg)
    if opt.target == "cpu" and opt.blocked:
        # the tensors between convs blocked by 16 channels, as the conv kernels compute (passes/layout.py)
        from .passes.layout import BlockedLayout

        rg = BlockedLayout(repack=repack).run(rg)
    if opt.target == "cpu":
        # an embedding table tied to the output layer looked up as the columns of that layer's stored
        # weight, plain or packed (passes/precision.py): one copy of the vocabulary's table
        from .passes.precision import TablesInTiedWeights

        rg = TablesInTiedWeights(pack_cache).run(rg)
    return rg


def compile(model, *, distributed_config: Mapping[str, Any], optimization_config: Mapping[str, Any] | None = None,
            out_dir: str | os.PathLike, input_shapes: Mapping[str, Sequence[int]] | None = None,
            input_values: Mapping[str, Any] | None = None, state: Mapping[str, str] | None = None,
            dim_sizes: Mapping[str, int] | None = None) -> CompileResult:
    """Compile ``model`` into one artifact per rank in ``out_dir``.

    Parameters
    ----------
    model
        An ``.onnx`` path, its bytes, an ``onnx.ModelProto``, or a :class:`FlowGraph`.
    distributed_config
        The mesh and search settings (keys in :mod:`shardflow.compiler.parallel.config`), e.g.
        ``{"mesh_shape": [2, 2]}``.
    optimization_config
        Target and codegen settings (keys in this module's docstring), e.g. ``{"target": "cpu"}``.
    out_dir
        The directory to write; replaced if it exists. It is written under a temporary name
        next to it and renamed at the end, so an interrupted compile leaves no ``out_dir``.
    input_shapes
        Shapes of inputs with dynamic dims, by input name (an input whose dynamic dims all have
        names another given input sizes needs none: :func:`~shardflow.compiler.load_onnx`).
    input_values
        Values of inputs fixed at compile time, by input name; they become constants and the
        compiled program no longer takes them (:func:`~shardflow.compiler.load_onnx`).
    state
        ``{output name: input name}``: outputs the program keeps, on its device, as the next run's
        value of an input of the same shape and type, e.g. a decoding step's KV cache of fixed size
        (``{"present.0.key": "past_key_values.0.key", ...}``). ``run`` then returns the other
        outputs and takes the state inputs only to set them (zeros at load); see
        :meth:`~shardflow.runtime.executor.RankProgram.read_state`. When the output's kernel reads
        the input only where it writes the same element (the past rows of a present), it writes
        straight into the input's buffer: no copy at all; otherwise the output is copied there at
        the end of the run. On several ranks a state split by the plan is kept as each rank's
        part; a KV cache whose heads were padded or replicated for the ranks (more ranks than
        key/value heads) is kept on those heads, split as the attention is (the manifest's
        ``padded_heads``). With ``pipeline_stages``, each state lives in the stage holding its ops (no cut
        between them) and that stage's ranks keep it.
    dim_sizes
        Sizes of the inputs' named dynamic dims, by name (``{"batch_size": 1, "sequence_length":
        128}``): an input whose dynamic dims all have sizes here needs no ``input_shapes`` entry
        (:func:`~shardflow.compiler.load_onnx`).

    Returns
    -------
    CompileResult
        The plan, the paths, per-stage timings and per-rank sizes; with
        ``distributed_config["pipeline_stages"]`` > 1 (or ``"auto"`` choosing stages), a
        :class:`~shardflow.compiler.stages.StagesResult` (one CompileResult per pipeline stage, each
        compiled into ``out_dir/stage{s}``).

    Raises
    ------
    ConfigError
        An unknown key or a bad value in either config.
    ShardflowError
        Anything the pipeline rejects (unsupported ops, shapes, a target not implemented yet).
    """
    # the large constants the compile makes (shards, casts, packed weights) kept in files beside
    # out_dir, not in memory (ir/spill.py)
    with spilling(out_dir):
        return _compile(model, distributed_config=distributed_config, optimization_config=optimization_config,
                        out_dir=out_dir, input_shapes=input_shapes, input_values=input_values, state=state,
                        dim_sizes=dim_sizes)


def _compile(model, *, distributed_config: Mapping[str, Any], optimization_config: Mapping[str, Any] | None,
             out_dir: str | os.PathLike, input_shapes: Mapping[str, Sequence[int]] | None,
             input_values: Mapping[str, Any] | None, state: Mapping[str, str] | None,
             dim_sizes: Mapping[str, int] | None = None, weights_elsewhere: Callable | None = None) -> CompileResult:
    """:func:`compile`'s work, under its spill folder. ``weights_elsewhere(rank, program, weights)``
    (shape variants, compiler/variants.py) may return the program and weights to write instead: some
    weights left in an earlier variant's file."""
    t_all = time.perf_counter()
    opt = OptimizationConfig.from_dict(optimization_config)
    if not isinstance(distributed_config, Mapping) and not hasattr(distributed_config, "mesh_shape"):
        raise ConfigError(f"distributed_config must be a dict, got {type(distributed_config).__name__}")
    from .parallel.comm_ops import Collective
    from .parallel.partition import partition_ranks
    from .parallel.config import DistributedConfig

    dcfg = _target_device(DistributedConfig.from_dict(distributed_config), opt)
    note = None
    if dcfg.pipeline_stages != 1:  # (compile_variants gives no weights_elsewhere then: compiler/variants.py)
        from .stages import choose_stages, compile_stages

        if "auto" in (dcfg.pipeline_stages, dcfg.pipeline_microbatches):
            dcfg, note = choose_stages(model, dcfg=dcfg, opt=opt, optimization_config=optimization_config,
                                       input_shapes=input_shapes, input_values=input_values, state=state,
                                       dim_sizes=dim_sizes)
        if dcfg.staged:
            return compile_stages(model, dcfg=dcfg, opt=opt, optimization_config=optimization_config,
                                  out_dir=out_dir, input_shapes=input_shapes, input_values=input_values, state=state,
                                  dim_sizes=dim_sizes, note=note)
    builder = _cuda_builder() if opt.target == "cuda" else _cpu_builder()
    timings: dict[str, float] = {}

    t = time.perf_counter()
    log.info("importing %s", model if isinstance(model, (str, os.PathLike)) else type(model).__name__)
    graph = _planned_graph(model, opt, dcfg, input_shapes, input_values, dim_sizes)
    timings["import"] = time.perf_counter() - t
    log.info("imported %d ops in %.2f s", len(graph.nodes), timings["import"])
    t = time.perf_counter()
    plan, state, padded_state, sharded_state = plan_with_state(graph, dcfg, state, input_values)
    if note:  # (pipeline_stages 'auto' chose this plan over stages)
        plan.notes.append(note)
    timings["search"] = time.perf_counter() - t
    log.info("plan: %s, modeled cost %.3g s, in %.2f s", plan.algo, plan.cost, timings["search"])

    # each rank's graph built when its turn comes and dropped after it (its weight shards and their
    # packed forms): the compile holds one rank's weights at a time
    rank_graphs = partition_ranks(graph, plan, sharded_inputs=sharded_state)
    # the weights ranks hold whole (replicated) packed once, and a rank's weights that are the same
    # arrays as an earlier rank's linked to that rank's file (passes/prepack.py)
    from .passes.prepack import PackCache

    pack_cache = PackCache(t.value for t in graph.constants()) if plan.mesh.size > 1 else None
    written: dict[tuple, tuple[Path, str]] = {}  # a rank's weights (offsets and memory) -> its file, sha256
    timings["partition"] = 0.0
    mesh = plan.mesh
    world = mesh.size
    axis_sets: set = set()  # the mesh axes the ranks' collectives span (for mesh.json's groups)
    global_out = {name: t for name, t in zip(graph.output_names, graph.outputs)}
    global_in = {t.name: t for t in graph.inputs}
    index_checks = input_index_ranges(graph) if opt.index_checks else {}
    computed_checks = index_check_outputs(graph)
    if computed_checks:
        log.info("index checks: %d computed index tensors checked at run time (%s)", len(computed_checks),
                 ", ".join(n for c in computed_checks for n in c["nodes"]))

    timings["codegen"] = 0.0
    timings["write"] = 0.0
    ranks_info: list[dict] = []
    out = Path(out_dir)
    kernels_name = "kernels.so" if opt.target == "cpu" else "kernels.cubin"
    sm_count = target_sm_count(opt) if opt.target == "cuda" else None
    # Winograd's weights are up to 4x the 3x3 ones, more than the plan counted against a memory budget
    winograd = opt.winograd and dcfg.memory_budget_bytes is None
    if opt.winograd and not winograd and opt.target == "cpu":
        log.info("memory_budget_bytes is set: 3x3 convs stay direct (Winograd's weights would exceed what the plan "
                 "counted)")
    # the stock codegens generate every rank's kernels first and compile them into one library (cubin)
    shared = _shared_codegen(builder, opt.target)
    sources: list = []  # (rank dir, its kernels' source) for `shared`
    finished: list = []  # (rank dir, manifest, weights' sha256): finalized once the libraries are written
    with atomic_output_dir(out) as tmp:
        t = time.perf_counter()
        plan.save(tmp)
        timings["write"] += time.perf_counter() - t
        for r in range(world):
            t = time.perf_counter()
            rg = next(rank_graphs)
            timings["partition"] += time.perf_counter() - t
            axis_sets |= _collective_axes(rg)
            rg = rank_passes(rg, opt, winograd=winograd, repack=dcfg.memory_budget_bytes is None,
                             pack_cache=pack_cache)
            rdir = tmp / f"rank{r}"
            rdir.mkdir()
            names = [op.name for op in rg.nodes]
            if len(set(names)) != len(names):
                dup = sorted({n for n in names if names.count(n) > 1})[:5]
                raise GraphError(f"rank {r}: node names {dup} repeat; kernels are keyed by node name")
            _check_stored_dtypes(rg, opt.target)
            views = [op for op in rg.nodes if not isinstance(op, Collective) and _is_view(op)]
            view_ids = {id(op) for op in views}
            # views go to a codegen that takes them too: fusion may fold a reshape into a
            # neighbour's kernel; the ones it leaves alone get no kernel and alias their input
            with_views = _accepts(builder, "views")
            ops = [op for op in rg.nodes if not isinstance(op, Collective) and (with_views or id(op) not in view_ids)]
            t = time.perf_counter()
            log.info("rank %d (%d of %d): generating kernels for %d ops (%s)", r, r + 1, world, len(ops),
                     opt.target)
            # tensors fusion must still write: read by collectives (not compiled here), by views the
            # codegen does not see, or outputs
            keep = {t.name for op in rg.nodes if isinstance(op, Collective) or (id(op) in view_ids and not with_views)
                    for t in op.inputs}
            keep.update(t.name for t in rg.outputs)
            kw = {"fuse": opt.fuse, "keep": sorted(keep), "search_space": opt.search_space,
                  "views": [op.name for op in views]}
            if opt.target == "cuda":
                kw["arch"] = opt.arch
                kw["sms"] = sm_count
                kw["precision"] = opt.precision
                if opt.gemm_tiles:
                    kw["gemm_tiles"] = opt.gemm_tiles
                if opt.pdl:
                    kw["pdl"] = True
                if opt.wgmma_fp32:
                    kw["wgmma_fp32"] = True
            # presents kept over their pasts: their kernels store only the rows (cpu) or elements (cuda)
            # that change
            selects = _state_selects(rg, _state_pairs(rg, state, r)) if state else {}
            if selects:
                kw["in_place"] = dict(selects.values())
            compute = any(id(op) not in view_ids for op in ops)  # views alone need no kernels
            if compute and shared is not None:  # compiled after the loop, one library for the ranks
                kernels, source = _call_with_supported(shared[0], ops, **kw)
                sources.append((rdir, source))
            else:
                kernels = _call_with_supported(builder, ops, str(rdir / kernels_name), **kw) if compute else {}
                if compute and not (rdir / kernels_name).is_file():
                    raise ShardflowError(f"rank {r}: codegen did not write {kernels_name}")
            timings["codegen"] += time.perf_counter() - t
            t = time.perf_counter()
            views = [op for op in views if op.name not in kernels]  # the ones not fused into a kernel
            program, weights, wbytes = build_program(rg, kernels, rank=r, view_ops=views, precompute=opt.precompute,
                                                     state=state)
            if weights_elsewhere is not None:
                program, weights, wbytes = weights_elsewhere(r, program, weights)
            program["kernels_file"] = kernels_name
            lost = sorted(set(selects) - {e["output"] for e in program.get("state", ()) if e["in_place"]})
            if lost:  # (their kernels store only where the select changes the input: they must run in place)
                raise ShardflowError(f"rank {r}: state outputs {lost} were generated to be written over their inputs, "
                                     "which the program does not do; compile with fuse=False and report this")
            weights_sha = _write_or_link_weights(rdir / "weights.bin", weights, wbytes, pack_cache, written)
            del weights  # (written: the next rank's replace them)
            write_json(rdir / "program.json", program)
            coord = mesh.coord_of(r)
            outputs = _output_entries(rg, global_out, plan, r, state, computed_checks)
            manifest = {
                "shardflow_version": __version__,
                "target": opt.target,
                "arch": opt.arch if opt.target == "cuda" else platform.machine(),
                **({"sm_count": sm_count} if opt.target == "cuda" else {}),
                "rank": r,
                "world_size": world,
                "mesh": {"shape": list(mesh.shape), "axis_names": list(mesh.axis_names), "coord": list(coord),
                         "groups": None},  # (below, once every rank's collectives are known)
                "comm_backend": opt.comm_backend,
                "cuda_graph": opt.cuda_graph,
                "pdl": opt.pdl,
                "precision": opt.precision,
                "inputs": [_input_entry(t_, global_in[t_.name], plan, r, padded_state.get(t_.name),
                                        index_checks.get(t_.name, ()))
                           for t_ in rg.inputs],
                "outputs": outputs,
                **({"index_checks": computed_checks} if computed_checks else {}),
                **({"state": [{k: e[k] for k in ("input", "output", "in_place")} for e in program["state"]]}
                   if state else {}),
                "kernels": sum(1 for s in program["steps"] if s["kind"] == "kernel"),
                "collectives": sum(1 for s in program["steps"] if s["kind"] == "collective"),
            }
            finished.append((rdir, manifest, weights_sha))
            timings["write"] += time.perf_counter() - t
            ranks_info.append({"kernels": manifest["kernels"], "collectives": manifest["collectives"],
                               "arena_bytes": program["arena_bytes"], "weights_bytes": program["weights_bytes"]})
            log.info("rank %d: %d kernels, %d collectives, arena %s B, weights %s B", r,
                     manifest["kernels"], manifest["collectives"], f"{program['arena_bytes']:,}",
                     f"{program['weights_bytes']:,}")
            held = program["weights_bytes"]
            del rg, ops, views, kernels, program  # (what holds this rank's graph and its weight shards)
            # ops and tensors refer to each other (producer, inputs, outputs): the graph is freed by
            # the cycle collector, which could run ranks later, so run it now, before the next rank's
            # graph is made (rfcs/0000). Not after the last rank, nor for a rank holding less than
            # COLLECT_RANK_BYTES of weights: a whole collection scans every object of the process
            # (57 ms in a test process), and what it would free early is small then
            if r + 1 < world and held >= COLLECT_RANK_BYTES:
                gc.collect()
        if sources:
            t = time.perf_counter()
            _compile_shared_libraries(shared[1], sources, kernels_name)
            timings["codegen"] += time.perf_counter() - t
        t = time.perf_counter()
        groups = _mesh_groups(mesh, axis_sets)
        write_json(tmp / "mesh.json", {"format": 1, "mesh": mesh.to_dict(), "world_size": world, "groups": groups})
        for rdir, manifest, weights_sha in finished:
            manifest["mesh"]["groups"] = groups
            finalize_rank_dir(rdir, manifest, known={"weights.bin": weights_sha})
        timings["write"] += time.perf_counter() - t
    timings["total"] = time.perf_counter() - t_all
    result = CompileResult(plan=plan, out_dir=out.resolve(), rank_dirs=[out.resolve() / f"rank{r}" for r in range(world)],
                           world_size=world, target=opt.target, arch=opt.arch, timings=timings, ranks=ranks_info)
    log.info("wrote %s in %.2f s", out, timings["total"])
    return result
