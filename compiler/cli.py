"""The ``shardflow`` command: ``compile``, ``run``, ``plan``, ``inspect``.

::

    shardflow compile MODEL.onnx -o OUT [--mesh 2x2] [--target cpu|cuda] [--arch sm_90] [--sm-count 132]
                      [--shape NAME=2x24 ...] [--value NAME=FILE.npy ...] [--variant NAME=SIZE ...]
                      [--algo ilp|megatron|data|replicate]
                      [--distributed-config FILE.json] [--optimization-config FILE.json]
    shardflow run OUT --nproc N --inputs in.npz --outputs out.npz
    shardflow plan MODEL.onnx --mesh 2x2 [--shape NAME=2x24 ...] [--value NAME=FILE.npy ...] [--algo ...]
    shardflow inspect OUT [--verify]

Flags override the keys of the config files. Progress goes to stderr.
"""
from __future__ import annotations

import argparse
import json
import logging
import os
import sys
import time
from pathlib import Path
from typing import Any, Sequence

from shardflow.runtime.errors import format_bytes

__all__ = ["main", "build_parser", "parse_mesh", "parse_shapes", "parse_values"]

log = logging.getLogger("shardflow.cli")


class _CLIError(Exception):
    pass


# ---------------------------------------------------------------------------------------
# parsing helpers
# ---------------------------------------------------------------------------------------
def parse_mesh(text: str) -> list[int]:
    """``"2x2"`` → ``[2, 2]``; ``"4"`` → ``[4]``."""
    try:
        dims = [int(d) for d in text.lower().replace("×", "x").split("x")]
    except ValueError:
        raise _CLIError(f"--mesh {text!r}: use sizes joined by 'x', e.g. 4 or 2x2") from None
    if not dims or any(d < 1 for d in dims):
        raise _CLIError(f"--mesh {text!r}: every size must be a positive integer")
    return dims


def parse_shapes(items: Sequence[str] | None) -> dict[str, list] | None:
    """``["input_ids=2x24"]`` → ``{"input_ids": [2, 24]}`` (``NAME=`` is a scalar); a sequence input's
    items in brackets, ``["s=[2x3,4x3]"]`` → ``{"s": [[2, 3], [4, 3]]}``."""
    if not items:
        return None
    res: dict[str, list] = {}
    for item in items:
        name, sep, dims = item.rpartition("=")
        if not sep or not name:
            raise _CLIError(f"--shape {item!r}: use NAME=DIMS, e.g. input_ids=2x24")
        sequence = dims.startswith("[") and dims.endswith("]")
        parts = (dims[1:-1].split(",") if dims[1:-1] else []) if sequence else [dims]
        try:
            shapes = [[int(d) for d in part.lower().split("x")] if part else [] for part in parts]
        except ValueError:
            raise _CLIError(f"--shape {item!r}: dims must be integers joined by 'x', e.g. 2x24 (a sequence "
                            "input's items in brackets, e.g. s=[2x3,4x3])") from None
        if any(d < 0 for shape in shapes for d in shape):
            raise _CLIError(f"--shape {item!r}: dims must be non-negative")
        res[name] = shapes if sequence else shapes[0]
    return res


def parse_dims(items: Sequence[str] | None, flag: str = "--dim") -> dict[str, int] | None:
    """``["batch_size=1", "sequence_length=128"]`` → ``{"batch_size": 1, "sequence_length": 128}``."""
    if not items:
        return None
    res: dict[str, int] = {}
    for item in items:
        name, sep, size = item.rpartition("=")
        if not sep or not name:
            raise _CLIError(f"{flag} {item!r}: use NAME=SIZE, e.g. batch_size=1")
        try:
            res[name] = int(size)
        except ValueError:
            raise _CLIError(f"{flag} {item!r}: the size must be an integer, e.g. batch_size=1") from None
        if res[name] < 0:
            raise _CLIError(f"{flag} {item!r}: the size must be non-negative")
    return res


def parse_state(items: Sequence[str] | None) -> dict[str, str] | None:
    """``["present.0.key=past_key_values.0.key"]`` → ``{"present.0.key": "past_key_values.0.key"}``."""
    if not items:
        return None
    res: dict[str, str] = {}
    for item in items:
        out, sep, name = item.partition("=")
        if not sep or not out or not name:
            raise _CLIError(f"--state {item!r}: use OUTPUT=INPUT, e.g. present.0.key=past_key_values.0.key")
        res[out] = name
    return res


def parse_values(items: Sequence[str] | None) -> dict[str, Any] | None:
    """``["axes=axes.npy"]`` → ``{"axes": <the array in axes.npy>}`` (inputs bound at compile time); a
    sequence input's items in brackets, ``["s=[a.npy,b.npy]"]`` → ``{"s": [<a.npy>, <b.npy>]}``."""
    if not items:
        return None
    import numpy as np

    def read(item: str, path: str):
        try:
            a = np.load(path, allow_pickle=False)
        except (OSError, ValueError) as exc:
            raise _CLIError(f"--value {item!r}: cannot read {path} as a .npy array ({exc})") from None
        if not isinstance(a, np.ndarray):
            raise _CLIError(f"--value {item!r}: {path} holds several arrays (.npz); give one .npy per input "
                            "(a sequence input's items in brackets, e.g. s=[a.npy,b.npy])")
        return a

    res: dict[str, Any] = {}
    for item in items:
        name, sep, path = item.partition("=")
        if not sep or not name or not path:
            raise _CLIError(f"--value {item!r}: use NAME=FILE.npy, e.g. axes=axes.npy (a sequence input's items "
                            "in brackets, e.g. s=[a.npy,b.npy])")
        if path.startswith("[") and path.endswith("]"):
            paths = path[1:-1].split(",") if path[1:-1] else []
            if any(not p for p in paths):
                raise _CLIError(f"--value {item!r}: an empty file name among the sequence's items")
            res[name] = [read(item, p) for p in paths]
        else:
            res[name] = read(item, path)
    return res


def _read_config(path: str | None, what: str) -> dict:
    if path is None:
        return {}
    try:
        with open(path) as f:
            cfg = json.load(f)
    except FileNotFoundError:
        raise _CLIError(f"--{what} {path!r} does not exist") from None
    except json.JSONDecodeError as exc:
        raise _CLIError(f"--{what} {path!r} is not valid JSON: {exc}") from None
    if not isinstance(cfg, dict):
        raise _CLIError(f"--{what} {path!r} must hold a JSON object")
    return cfg


#: The keys of a `shardflow calibrate` file that `--calibration` takes.
CALIBRATED_KEYS = ("device", "axis_bandwidth_GBps", "axis_latency_us")


def _count_or_auto(what: str):
    """``--stages`` / ``--microbatches``: a count, or ``auto``."""
    def parse(text: str):
        if text == "auto":
            return text
        try:
            return int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r}: give a number of {what} or 'auto'") from None
    return parse


def _distributed_config(args) -> dict:
    cfg = _read_config(args.distributed_config, "distributed-config")
    if args.mesh is not None:
        cfg["mesh_shape"] = parse_mesh(args.mesh)
    if args.calibration is not None:
        cal = _read_config(args.calibration, "calibration")
        missing = [k for k in ("mesh_shape",) + CALIBRATED_KEYS if k not in cal]
        if missing:
            raise _CLIError(f"--calibration {args.calibration!r} lacks {missing}; write it with `shardflow calibrate`")
        cfg.setdefault("mesh_shape", cal["mesh_shape"])
        if list(cfg["mesh_shape"]) != list(cal["mesh_shape"]):
            raise _CLIError(f"--calibration {args.calibration!r} measured the links of mesh {cal['mesh_shape']}, "
                            f"the plan is for mesh {cfg['mesh_shape']}; calibrate with --mesh "
                            f"{'x'.join(map(str, cfg['mesh_shape']))}")
        for k in CALIBRATED_KEYS:  # what the config file or a flag sets wins
            cfg.setdefault(k, cal[k])
    cfg.setdefault("mesh_shape", [1])
    for flag, key in (("algo", "algo"), ("device", "device"), ("stages", "pipeline_stages"),
                      ("microbatches", "pipeline_microbatches"), ("balance", "pipeline_balance"),
                      ("preload_plan", "preload_plan")):
        if getattr(args, flag) is not None:  # (a flag wins over the config file)
            cfg[key] = getattr(args, flag)
    for item in args.place or ():
        op, sep, spec = item.rpartition("=")
        if not sep or not op or not spec.strip():
            raise _CLIError(f"--place {item!r}: write OP=SPEC, e.g. '/model/h.*/mlp/c_fc/Gemm=R, S(1), S(0) -> S(1)'")
        pins = cfg.setdefault("op_placements", {})
        if not isinstance(pins, dict):
            raise _CLIError("--distributed-config: op_placements must be a JSON object (op name -> spec)")
        pins[op] = spec.strip()
    return cfg


# ---------------------------------------------------------------------------------------
# parser
# ---------------------------------------------------------------------------------------
def _add_plan_flags(p: argparse.ArgumentParser) -> None:
    p.add_argument("model", help="the ONNX model file")
    p.add_argument("--mesh", metavar="DxD", default=None,
                   help="device mesh, ranks per axis joined by 'x' (4, 2x2, 2x4); overrides mesh_shape of "
                        "--distributed-config; default 1 (a single rank)")
    p.add_argument("--shape", action="append", metavar="NAME=DIMS", default=None,
                   help="static shape of an input with dynamic dims, e.g. input_ids=2x24 (repeat per input; "
                        "inputs whose dynamic dims all have names an input given sizes need none); a sequence "
                        "input's items' shapes in brackets, e.g. s=[2x3,4x3] (the program takes them as the "
                        "inputs s[0], s[1])")
    p.add_argument("--dim", action="append", metavar="NAME=SIZE", default=None,
                   help="size of a named dynamic dim (an input's dim_param), e.g. batch_size=1 or "
                        "sequence_length=128: inputs whose dynamic dims all have sizes need no --shape (repeat per "
                        "name)")
    p.add_argument("--value", action="append", metavar="NAME=FILE.npy", default=None,
                   help="bind an input to the array in FILE.npy at compile time: it becomes a constant and the "
                        "program no longer takes it (for shape-steering inputs such as axes or sizes; repeat "
                        "per input); a sequence input's items in brackets, e.g. s=[a.npy,b.npy]")
    p.add_argument("--algo", choices=("ilp", "megatron", "data", "replicate"), default=None,
                   help="plan search: ilp (optimal under the cost model, default), or the megatron, data or "
                        "replicate baselines")
    p.add_argument("--stages", type=_count_or_auto("stages"), default=None, metavar="P",
                   help="pipeline stages: the graph cut into P contiguous stages along the first mesh axis (P must "
                        "divide it), each sharded over its share of the mesh; 'auto': compile weighs every such P "
                        "against one plan over the whole mesh (distributed_config pipeline_stages)")
    p.add_argument("--microbatches", type=_count_or_auto("microbatches"), default=None, metavar="M",
                   help="with --stages: a run's batch in M parts that follow each other through the stages; 'auto': "
                        "compile weighs every M dividing the batch by its modeled run (distributed_config "
                        "pipeline_microbatches)")
    p.add_argument("--balance", choices=("modeled", "measured"), default=None,
                   help="with --stages, what the cut balances: the cost model's roofline times (default) or the "
                        "ops' kernels timed on this machine (cpu target; distributed_config pipeline_balance)")
    p.add_argument("--place", action="append", metavar="OP=SPEC", default=None,
                   help="run OP (a name as plan.txt prints it, or a pattern: *, ?, [...]) with SPEC, its inputs' and "
                        "outputs' specs as plan.txt writes them ('R, S(1) -> S(1)'; the outputs' alone: 'S(1)'; '*': "
                        "any); the ILP plans the rest around it (repeat per op; distributed_config op_placements)")
    p.add_argument("--state", action="append", metavar="OUTPUT=INPUT", default=None,
                   help="keep OUTPUT in the program as the next run's INPUT (same shape and type), e.g. "
                        "present.0.key=past_key_values.0.key for a KV cache of fixed size; not returned by runs "
                        "(repeat per pair; compile(state=...)); `plan` plans as compile does with it (a cache kept "
                        "split where its writer is, a stage's instances per microbatch)")
    p.add_argument("--preload-plan", metavar="PATH", default=None,
                   help="use a saved plan instead of searching: a plan.json or its folder (`shardflow plan -o DIR`, "
                        "an out_dir); with --stages, the folder `shardflow plan --stages P -o DIR` wrote "
                        "or a staged out_dir: its cut and each stage's plan (distributed_config preload_plan)")
    p.add_argument("--device", choices=("cpu", "h100", "h200"), default=None,
                   help="what a rank computes on, for the cost model (compute against communication); default: "
                        "the compile target's (cpu or h100), h100 for `shardflow plan`")
    p.add_argument("--calibration", metavar="FILE.json", default=None,
                   help="a file written by `shardflow calibrate`: its device and link figures, unless "
                        "--distributed-config or --device sets them (the meshes must match)")
    p.add_argument("--distributed-config", metavar="FILE.json", default=None,
                   help="a JSON object of distributed_config keys (mesh_shape, axis_bandwidth_GBps, "
                        "axis_latency_us, memory_budget_bytes, algo, solver, time_limit_s, max_nodes, "
                        "input_placements, output_placements, op_placements, ...); flags override it")


def _add_target_flag(p: argparse.ArgumentParser) -> None:
    p.add_argument("--target", choices=("cpu", "cuda"), default=None,
                   help="kernel target: cpu (C++ kernels, default) or cuda (CUDA kernels; cross-compiles without "
                        "a GPU)")


def _add_optimization_config_flag(p: argparse.ArgumentParser) -> None:
    p.add_argument("--optimization-config", metavar="FILE.json", default=None,
                   help="a JSON object of optimization_config keys (target, arch, sm_count, precision, fuse, "
                        "cuda_graph, pdl, prepack, winograd, int8_qdq, precompute, search_space, comm_backend, "
                        "gemm_tiles); flags override it")


def build_parser() -> argparse.ArgumentParser:
    """The argument parser of ``shardflow`` (``run`` is parsed by :mod:`shardflow.runtime.launch`)."""
    from shardflow.runtime.launch import add_run_arguments

    parser = argparse.ArgumentParser(
        prog="shardflow",
        description="Compile an ONNX model into one program per rank of a device mesh, and run it.",
        epilog="`shardflow COMMAND --help` documents each command's flags.")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")

    pc = sub.add_parser("compile", help="compile a model into an out_dir of per-rank artifacts",
                        description="Import MODEL, search a sharding plan on the mesh, generate kernels and write "
                                    "one artifact per rank into OUT (written atomically: an interrupted compile "
                                    "leaves no OUT).")
    _add_plan_flags(pc)
    pc.add_argument("-o", "--out", required=True, metavar="OUT", help="the out_dir to write (replaced if it exists)")
    _add_target_flag(pc)
    pc.add_argument("--arch", default=None, metavar="SM",
                    help="CUDA architecture for --target cuda, e.g. sm_90 (default sm_90)")
    pc.add_argument("--sm-count", type=int, default=None, metavar="N",
                    help="the target GPU's multiprocessors for --target cuda, e.g. 114 for an H100 PCIe (default: "
                         "the visible GPU's, else 132)")
    _add_optimization_config_flag(pc)
    pc.add_argument("--variant", action="append", metavar="NAME=SIZE[,NAME=SIZE]", default=None,
                    help="compile a shape variant: sizes of the model's named dynamic dims, e.g. sequence_length=64 "
                         "(repeat per variant); OUT then holds a program per variant and `shardflow run` / "
                         "load() runs the one compiled for the inputs' shapes (compile_variants)")
    pc.add_argument("-q", "--quiet", action="store_true", help="no progress messages")
    pc.add_argument("-v", "--verbose", action="store_true", help="debug logging")

    add_run_arguments(sub.add_parser(
        "run", help="run an out_dir on N ranks (mpiexec, srun, torchrun-style or own spawner)",
        description="Run the compiled OUT on its ranks. Started plainly it launches N local ranks (mpiexec when "
                    "available, else its own processes with a TCP rendezvous); started under mpiexec/srun/torchrun "
                    "each process runs its rank. Rank 0 writes the outputs."))

    pp = sub.add_parser("plan", help="print the sharding plan (plan.txt) without compiling",
                        description="Import MODEL, search a sharding plan on the mesh and print it.")
    _add_plan_flags(pp)
    pp.add_argument("-o", "--out", default=None, metavar="DIR", help="also save plan.json and plan.txt into DIR")
    # (the target's import and passes: the graph compile plans, so that a saved plan loads there)
    _add_target_flag(pp)
    _add_optimization_config_flag(pp)
    pp.add_argument("--compare", action="store_true",
                    help="after the plan, a table of every algo's plan on the same mesh and cost model (modeled run, "
                         "memory a rank, collectives); with --place, the ILP without the pins too (what they cost)")
    pp.add_argument("--explain", action="append", default=[], metavar="NODE",
                    help="after the plan, why NODE (an op name from it) runs as it does: what each mesh axis "
                         "splits, its costs, the resharding of its inputs (repeat per op)")
    pp.add_argument("-v", "--verbose", action="store_true", help="debug logging")

    pk = sub.add_parser("calibrate", help="measure this machine's ranks and links for the cost model",
                        description="Start the mesh's ranks on this machine (or, started under mpiexec/srun, be "
                                    "one of them), time a GEMM, a memory stream and the "
                                    "collectives along every mesh axis, and write the fitted figures as a "
                                    "distributed_config fragment (mesh_shape, axis_bandwidth_GBps, axis_latency_us, "
                                    "device) for `shardflow compile --distributed-config OUT`.")
    pk.add_argument("--mesh", metavar="DxD", required=True,
                    help="ranks per axis joined by 'x' (2, 2x2): the ranks started and the axes timed")
    pk.add_argument("-o", "--out", required=True, metavar="FILE.json", help="where to write the figures")
    pk.add_argument("--launcher", choices=("auto", "mpiexec", "spawn"), default=None,
                    help="how to start the ranks, as for `shardflow run` (default auto)")
    pk.add_argument("--backend", choices=("auto", "mpi", "tcp"), default=None,
                    help="communicator whose collectives are timed, as for `shardflow run` (default auto: mpi "
                         "under mpiexec, else tcp); use the one your runs use")
    pk.add_argument("--trials", type=int, default=5, help="timings per figure, the median is kept (default 5)")
    pk.add_argument("--timeout", type=float, default=900.0, help="kill the ranks after this many seconds (900)")
    pk.add_argument("-v", "--verbose", action="store_true", help="debug logging")

    pi = sub.add_parser("inspect", help="summarize an out_dir",
                        description="Print what an out_dir holds: target, mesh, plan, and per rank its kernels, "
                                    "collectives, memory, inputs and outputs.")
    pi.add_argument("out_dir", help="an out_dir written by `shardflow compile`")
    pi.add_argument("--verify", action="store_true", help="also check the sha256 of every file")
    pi.add_argument("--json", action="store_true", help="print the summary as JSON")

    pa = sub.add_parser("cache", help="show or shrink the kernel cache",
                        description="The kernel cache keeps every library compile builds (cpu .so, cuda cubins, the "
                                    "precompiled header, tuning choices) and never removes one by itself. `info` "
                                    "(the default) prints what it holds, `prune --max-size SIZE` removes the least "
                                    "recently used entries until it fits, `clear` removes them all; entries used in "
                                    "the last --keep-recent seconds stay (prune: a compile beside it may read them). "
                                    "Clear it between compiles: a cpu compile running meanwhile may fail.")
    pa.add_argument("action", nargs="?", choices=("info", "prune", "clear"), default="info",
                    help="info (default): what the cache holds; prune: remove the least recently used entries "
                         "down to --max-size; clear: remove every entry")
    pa.add_argument("--dir", default=None, metavar="DIR",
                    help="the cache (default $SHARDFLOW_CACHE_DIR, else ~/.cache/shardflow/kernels)")
    pa.add_argument("--max-size", default=None, metavar="SIZE", help="for prune: the size to fit, e.g. 500M or 2G")
    pa.add_argument("--keep-recent", type=float, default=None, metavar="SECONDS",
                    help="leave entries used this recently (default: 60 for prune, 0 for clear)")
    pa.add_argument("--json", action="store_true", help="print what the cache holds as JSON (info)")
    return parser


# ---------------------------------------------------------------------------------------
# commands
# ---------------------------------------------------------------------------------------
class _Progress(logging.Formatter):
    def __init__(self):
        super().__init__()
        self.t0 = time.perf_counter()

    def format(self, record):
        msg = record.getMessage()
        if record.levelno >= logging.WARNING:
            msg = f"{record.levelname.lower()}: {msg}"
        if record.exc_info and record.levelno >= logging.ERROR:
            msg += "\n" + self.formatException(record.exc_info)
        return f"[{time.perf_counter() - self.t0:6.1f}s] {msg}"


def _setup_logging(quiet: bool = False, verbose: bool = False) -> None:
    root = logging.getLogger("shardflow")
    h = logging.StreamHandler(sys.stderr)
    h.setFormatter(_Progress())
    root.addHandler(h)
    root.setLevel(logging.DEBUG if verbose else (logging.WARNING if quiet else logging.INFO))
    root.propagate = False


def _cmd_compile(args) -> int:
    from . import driver

    _setup_logging(args.quiet, args.verbose)
    dcfg = _distributed_config(args)
    ocfg = _read_config(args.optimization_config, "optimization-config")
    if args.target is not None:
        ocfg["target"] = args.target
    if args.arch is not None:
        ocfg["arch"] = args.arch
        ocfg.setdefault("target", "cuda")
    if args.sm_count is not None:
        ocfg["sm_count"] = args.sm_count
        ocfg.setdefault("target", "cuda")
    if args.variant:
        from .variants import compile_variants

        variants = [parse_dims(item.split(","), flag="--variant") for item in args.variant]
        result = compile_variants(args.model, variants=variants, distributed_config=dcfg, optimization_config=ocfg,
                                  out_dir=args.out, input_shapes=parse_shapes(args.shape),
                                  input_values=parse_values(args.value), state=parse_state(args.state),
                                  dim_sizes=parse_dims(args.dim))
    else:
        result = driver.compile(args.model, distributed_config=dcfg, optimization_config=ocfg, out_dir=args.out,
                                input_shapes=parse_shapes(args.shape), input_values=parse_values(args.value),
                                state=parse_state(args.state), dim_sizes=parse_dims(args.dim))
    print(result.summary())
    return 0


def _cmd_plan(args) -> int:
    from . import driver

    _setup_logging(False, args.verbose)
    dcfg = _distributed_config(args)
    ocfg = _read_config(args.optimization_config, "optimization-config")
    if args.target is not None:
        ocfg["target"] = args.target
    if "auto" in (dcfg.get("pipeline_stages", 1), dcfg.get("pipeline_microbatches", 1)):
        if args.compare:
            raise _CLIError("`shardflow plan --compare` compares plans over the whole mesh; with --stages or "
                            "--microbatches auto, the options compile weighs are listed without it")
        dcfg = _plan_options(args, dcfg, ocfg)  # (the options weighed; then the one kept, planned as below)
    if dcfg.get("pipeline_stages", 1) > 1:
        if args.compare:
            raise _CLIError("`shardflow plan --compare` compares plans over the whole mesh; with --stages, plan the "
                            "stages and the whole mesh apart")
        return _plan_stages(args, dcfg, ocfg)
    model = dict(input_shapes=parse_shapes(args.shape), input_values=parse_values(args.value),
                 dim_sizes=parse_dims(args.dim))
    state = parse_state(args.state)
    if args.compare:  # (the config's own plan first: the one compile makes)
        rows = driver.compare_plans(args.model, distributed_config=dcfg, optimization_config=ocfg, state=state,
                                    **model)
        plan = rows[0][1]
    else:
        graph = driver.planned_graph(args.model, distributed_config=dcfg, optimization_config=ocfg, **model)
        # (the target's device, and the states kept as compile keeps them)
        plan = driver.plan_with_state(graph, driver.planning_config(dcfg, ocfg), state, model["input_values"])[0]
    if args.out:
        plan.save(args.out)
    explained = [plan.explain(node) for node in args.explain]  # (an unknown name fails before any output)
    sys.stdout.write(plan.to_text())
    if not plan.to_text().endswith("\n"):
        sys.stdout.write("\n")
    for text in explained:
        sys.stdout.write("\n" + text + "\n")
    if args.compare:
        sys.stdout.write("\n" + _comparison(plan, rows))
    return 0


def _comparison(plan, rows) -> str:
    """``--compare``'s table: each algo's modeled run, memory a rank and collectives."""
    from shardflow.runtime.errors import format_bytes

    def us(x: float) -> str:
        return f"{x * 1e6:.2f} us"

    lines = [f"== plans compared on mesh {list(plan.mesh.shape)}, modeled by the one cost model above (its device "
             "and links; `--algo A` or distributed_config algo makes each)",
             f"{'algo':<28} {'total':>13} {'compute':>13} {'comm':>13} {'memory/rank':>12} {'collectives':>11}"]
    for label, p, why in rows:
        if p is None:
            lines.append(f"{label:<28} refused: {why}")
            continue
        lines.append(f"{label:<28} {us(p.cost):>13} {us(p.compute_cost):>13} {us(p.comm_cost):>13} "
                     f"{format_bytes(p.memory_bytes):>12} {len(p.collectives):>11}")
    return "\n".join(lines) + "\n"


def _plan_options(args, dcfg: dict, ocfg: dict) -> dict:
    """``shardflow plan`` with ``--stages auto`` or ``--microbatches auto``: print every option ``compile``
    weighs (one plan over the whole mesh, each count of stages and microbatches) with its modeled run or
    why it is refused, and return the config of the one kept, whose plans are printed next."""
    from .driver import OptimizationConfig, planning_config
    from .stages import choose_stages

    options: list = []
    chosen, _ = choose_stages(args.model, dcfg=planning_config(dcfg, ocfg), opt=OptimizationConfig.from_dict(ocfg),
                              optimization_config=ocfg, input_shapes=parse_shapes(args.shape),
                              input_values=parse_values(args.value), state=parse_state(args.state),
                              dim_sizes=parse_dims(args.dim), options=options)
    lines = [f"== options on mesh {list(chosen.mesh_shape)} (modeled runs; compile keeps the fastest, planned below)"]
    for what, cfg, t, why in options:
        mark = "  <- kept" if cfg is chosen else ""
        lines.append(f"{what:<44} " + (f"refused: {why}" if why else f"{t * 1e6:12.2f} us{mark}"))
    sys.stdout.write("\n".join(lines) + "\n\n")
    return {**dcfg, "pipeline_stages": chosen.pipeline_stages, "pipeline_microbatches": chosen.pipeline_microbatches}


def _plan_stages(args, dcfg: dict, ocfg: dict) -> int:
    """``shardflow plan --stages P``: the cut, then each stage's plan (``-o DIR``: ``DIR/stage{s}``)."""
    from .driver import planning_config
    from .stages import plan_stages, write_stage_plans

    pipe, plans = plan_stages(args.model, distributed_config=dcfg, optimization_config=ocfg,
                              input_shapes=parse_shapes(args.shape), input_values=parse_values(args.value),
                              dim_sizes=parse_dims(args.dim), state=parse_state(args.state))
    explained = []
    for node in args.explain:  # (an unknown name fails before any output)
        owner = next((p for p in plans if node in p.op_specs), plans[0])
        explained.append(owner.explain(node))
    if args.out:  # (each stage's plan and the cut: what preload_plan takes)
        write_stage_plans(args.out, pipe, plans, planning_config(dcfg, ocfg))
    for st, plan in zip(pipe.stages, plans):
        recv = ", ".join(f"{n} from {s}" for n, s in st.receives) or "none"
        sends = ", ".join(f"{n} to {to}" for n, to in st.sends) or "none"
        again = f"; makes again from constants: {', '.join(st.remade)}" if st.remade else ""
        sys.stdout.write(f"== pipeline stage {st.index} of {len(plans)}: {st.ops} ops, modeled compute "
                         f"{st.time_s * 1e3:.4g} ms; receives {recv}; sends {sends}{again}\n")
        text = plan.to_text()
        sys.stdout.write(text if text.endswith("\n") else text + "\n")
    for text in explained:
        sys.stdout.write("\n" + text + "\n")
    return 0


def _cmd_calibrate(args) -> int:
    from .calibrate import calibrate

    _setup_logging(False, args.verbose)
    cal = calibrate(parse_mesh(args.mesh), launcher=args.launcher, backend=args.backend, trials=args.trials,
                    timeout_s=args.timeout)
    if cal is None:  # a rank other than 0 under mpiexec/srun: rank 0 writes and reports
        return 0
    cal.save(args.out)
    print(cal.report())
    print(f"wrote {args.out}; use it with `shardflow compile MODEL --calibration {args.out}` (or as the "
          "--distributed-config)")
    return 0


def inspect_out_dir(out_dir: str, verify: bool = False) -> dict[str, Any]:
    """A JSON-able summary of an out_dir (what ``shardflow inspect`` prints); of an out_dir of shape
    variants, ``variants``: each variant's ``dir``, ``dim_sizes`` and summary."""
    from shardflow.runtime.artifact import ArtifactError, list_ranks, read_json, read_manifest, read_mesh, verify_files
    from shardflow.runtime.pipeline import read_pipeline, stage_ranks
    from shardflow.runtime.variants import read_variants

    out = Path(out_dir)
    if not out.is_dir():
        raise ArtifactError(f"{out_dir!r} is not a directory")
    stages = read_pipeline(out)
    if stages is not None:
        return {"out_dir": str(out), "world_size": stages["world_size"], "mesh_shape": stages["mesh_shape"],
                "stage_ranks": stage_ranks(stages),
                "microbatches": stages.get("microbatches", 1), "modeled_s": stages.get("modeled_s"),
                "balance": stages.get("balance", "modeled"),
                "notes": [stages[k] for k in ("note", "balance_note") if stages.get(k)],
                "stages": [{"dir": st["dir"], "ops": st.get("ops"), "modeled_time_s": st.get("modeled_time_s"),
                            "receives": st.get("receives", []), "sends": st.get("sends", []),
                            "remade": st.get("remade", []), **inspect_out_dir(str(out / st["dir"]), verify)}
                           for st in stages["stages"]]}
    spec = read_variants(out)
    if spec is not None:
        def regions(v: dict, key: str) -> list:
            return v.get(key, {}).get("0", [])

        def alike(v: dict) -> int:  # rank 0's weights bytes another variant has alike (read from it when both run)
            others = {sha for w in spec["variants"] if w is not v for key in ("weights", "external")
                      for _, _, sha in regions(w, key)}
            return sum(n for _, n, sha in regions(v, "weights") if sha in others)
        return {"out_dir": str(out),
                "variants": [{"dir": v["dir"], "dim_sizes": v["dim_sizes"], "weights_alike_bytes": alike(v),
                              "external_weights_bytes": sum(n for _, n, _ in regions(v, "external")),
                              **inspect_out_dir(str(out / v["dir"]), verify)} for v in spec["variants"]]}
    mesh = read_mesh(out)
    plan = read_json(out / "plan.json", "plan") if (out / "plan.json").is_file() else {}
    ranks = []
    files_seen: dict[tuple[int, int], int] = {}  # (device, inode) of a weights file -> the first rank holding it
    for r in list_ranks(out):
        d = out / f"rank{r}"
        m = read_manifest(d)
        prog = read_json(d / "program.json", "program")
        shares = None
        wpath = d / prog.get("weights_file", "weights.bin")
        if prog["weights_bytes"] and wpath.is_file():
            st = wpath.stat()
            shares = files_seen.setdefault((st.st_dev, st.st_ino), r)
        kinds: dict[str, int] = {}
        for s in prog["steps"]:
            if s["kind"] == "collective":
                key = f"{s['collective']}@{s['group']}"
                kinds[key] = kinds.get(key, 0) + 1
        info = {"rank": r, "coord": m.get("mesh", {}).get("coord"), "kernels": m.get("kernels"),
                "load_steps": int(prog.get("load_steps", 0)), "collectives": kinds,
                "arena_bytes": prog["arena_bytes"], "weights_bytes": prog["weights_bytes"],
                "files": {k: v["bytes"] for k, v in m["files"].items()},
                "weights_file_of_rank": shares if shares != r else None}
        if verify:
            try:
                verify_files(d, m)
                info["verified"] = True
            except ArtifactError as exc:
                info["verified"] = str(exc)
        ranks.append(info)
    m0 = read_manifest(out / "rank0")
    return {"out_dir": str(out), "shardflow_version": m0.get("shardflow_version"),
            "artifact_format": m0.get("artifact_format"), "target": m0["target"], "arch": m0.get("arch"),
            "sm_count": m0.get("sm_count"),
            "world_size": m0["world_size"], "mesh_shape": mesh.get("mesh", {}).get("shape"),
            "axis_names": mesh.get("mesh", {}).get("axis_names"), "algo": plan.get("algo"),
            "modeled_cost_s": plan.get("cost_s"), "comm_backend": m0.get("comm_backend"),
            "inputs": m0["inputs"], "outputs": [{k: o[k] for k in ("name", "global_shape", "dtype", "placement")
                                                  if k in o} for o in m0["outputs"]],
            "state": m0.get("state", []), "ranks": ranks}


def _cmd_inspect(args) -> int:
    info = inspect_out_dir(args.out_dir, args.verify)
    if args.json:
        print(json.dumps(info, indent=1))
    else:
        print("\n".join(_inspect_text(info)))
    bad = [r for p in _programs_of(info) for r in p["ranks"] if r.get("verified", True) is not True]
    return 1 if bad else 0


def _programs_of(info: dict) -> list[dict]:
    """The summaries of single programs in :func:`inspect_out_dir`'s ``info`` (each variant's, each stage's)."""
    parts = info.get("variants", info.get("stages"))
    return [p for part in parts for p in _programs_of(part)] if parts is not None else [info]


def _inspect_text(info: dict) -> list[str]:
    """:func:`inspect_out_dir`'s summary as text lines: of pipeline stages, each stage's; of shape variants,
    each variant's (itself maybe of pipeline stages)."""
    lines = []
    if "stages" in info:
        stages = info["stages"]
        micro = f", {info['microbatches']} microbatches a run" if info["microbatches"] > 1 else ""
        width = stages[0]["world_size"]
        placed = ("global rank s * {} + c runs stage s's rank c".format(width)
                  if info["stage_ranks"] == [[s * width + c for c in range(width)] for s in range(len(stages))]
                  else f"stage s's rank c is global rank ranks[s][c], ranks {info['stage_ranks']} (rank_map)")
        lines.append(f"{info['out_dir']}: {len(stages)} pipeline stages on mesh {info['mesh_shape']}{micro}, "
                     f"{info['world_size']} rank(s) ({placed}); the cut balances {info['balance']} times")
        lines += [f"# {note}" for note in info["notes"]]
        for st in stages:
            recv = ", ".join(f"{e['name']} from {e['from']}" for e in st["receives"]) or "none"
            sends = ", ".join(f"{e['name']} to {e['to']}" for e in st["sends"]) or "none"
            again = f"; makes again from constants: {', '.join(st['remade'])}" if st["remade"] else ""
            lines.append(f"== stage {st['dir']}: {st['ops']} ops; receives {recv}; sends {sends}{again}")
            lines += _inspect_lines(st)
    elif "variants" in info:
        for v in info["variants"]:
            dims = ", ".join(f"{k}={s}" for k, s in v["dim_sizes"].items())
            alike = (f"; rank 0's weights alike in another variant: {format_bytes(v['weights_alike_bytes'])} (held "
                     "once when both run, cpu)") if v["weights_alike_bytes"] else ""
            if v["external_weights_bytes"]:
                alike += (f"; rank 0 reads {format_bytes(v['external_weights_bytes'])} of its weights from an earlier "
                          "variant's file")
            lines.append(f"== shape variant {v['dir']} ({dims}){alike}")
            lines += _inspect_text(v)
    else:
        lines += _inspect_lines(info)
    return lines


def _inspect_lines(info: dict) -> list[str]:
    """:func:`inspect_out_dir`'s summary of one program as text lines."""
    lines = [f"{info['out_dir']}: shardflow {info['shardflow_version']} (artifact format "
             f"{info['artifact_format']}), target {info['target']} ({info['arch']}"
             + (f", {info['sm_count']} multiprocessors" if info.get("sm_count") else "") + ")",
             f"mesh {info['mesh_shape']} {info['axis_names']}, {info['world_size']} rank(s), plan "
             f"{info['algo']} (modeled cost {info['modeled_cost_s']} s), comm_backend {info['comm_backend']}",
             "inputs:  " + ", ".join(f"{i['name']} {i['dtype']}{i.get('global_shape', i['shape'])} "
                                     f"{i.get('placement', '')}" for i in info["inputs"]),
             "outputs: " + ", ".join(f"{o['name']} {o['dtype']}{o.get('global_shape')} {o.get('placement', '')}"
                                     for o in info["outputs"])]
    if info["state"]:
        lines.append("state:   " + ", ".join(f"{e['output']} -> {e['input']}"
                                             f"{' (in place)' if e.get('in_place') else ' (copied)'}"
                                             for e in info["state"]))
    for r in info["ranks"]:
        coll = ", ".join(f"{k}×{v}" for k, v in sorted(r["collectives"].items())) or "none"
        at_load = f" ({r['load_steps']} run once at load)" if r["load_steps"] else ""
        line = (f"rank {r['rank']} {r['coord']}: {r['kernels']} kernels{at_load}; collectives {coll}; arena "
                f"{format_bytes(r['arena_bytes'])}, weights {format_bytes(r['weights_bytes'])}"
                + (f" (rank {r['weights_file_of_rank']}'s file, linked)"
                   if r.get("weights_file_of_rank") is not None else ""))
        if "verified" in r:
            line += "; checksums ok" if r["verified"] is True else f"; CHECKSUM ERROR: {r['verified']}"
        lines.append(line)
    return lines


def _size(n: int) -> str:
    for unit, scale in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if n >= scale:
            return f"{n / scale:.1f} {unit}"
    return f"{n} B"


def _cmd_cache(args) -> int:
    from .codegen import cache
    from .codegen.toolchain import default_cache_dir

    folder = args.dir or default_cache_dir()
    if args.action == "prune" and args.max_size is None:
        raise _CLIError("prune needs --max-size SIZE (e.g. 500M, 2G)")
    if args.action != "prune" and args.max_size is not None:
        raise _CLIError("--max-size is for prune")
    keep = args.keep_recent if args.keep_recent is not None else (60.0 if args.action == "prune" else 0.0)
    if keep < 0:
        raise _CLIError(f"--keep-recent must be 0 or more seconds, got {keep}")
    if args.action == "prune":
        n, freed = cache.prune_cache(folder, cache.parse_size(args.max_size), keep)
        print(f"removed {n} entries ({_size(freed)}) from {folder}")
    elif args.action == "clear":
        n, freed = cache.clear_cache(folder, keep)
        print(f"removed {n} entries ({_size(freed)}) from {folder}")
    summary = cache.cache_summary(folder)
    if args.json:
        print(json.dumps(summary, indent=1))
        return 0
    print(f"{summary['dir']}: {_size(summary['bytes'])}")
    for kind, c in summary["entries"].items():
        if c["count"]:
            print(f"  {kind:18s} {c['count']:7d}  {_size(c['bytes'])}")
    if summary["others"]:
        print(f"  ({len(summary['others'])} other files, not cache entries, left alone)")
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the ``shardflow`` console script; returns the exit status."""
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv and argv[0] == "run":
        from shardflow.runtime.launch import main as run_main

        return run_main(argv[1:])
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.command is None:
        parser.print_help(sys.stderr)
        return 2
    from shardflow.runtime.errors import ShardflowError

    try:
        return {"compile": _cmd_compile, "plan": _cmd_plan, "inspect": _cmd_inspect,
                "calibrate": _cmd_calibrate, "cache": _cmd_cache}[args.command](args)
    except _CLIError as exc:
        print(f"shardflow {args.command}: error: {exc}", file=sys.stderr)
        return 2
    except ShardflowError as exc:
        print(f"shardflow {args.command}: {type(exc).__name__}: {exc}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print(f"shardflow {args.command}: interrupted", file=sys.stderr)
        return 130
    except BrokenPipeError:  # (`shardflow plan M.onnx | head`: the reader stopped; what was asked is done)
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())  # (no second error at exit's flush)
        return 141


if __name__ == "__main__":
    sys.exit(main())
