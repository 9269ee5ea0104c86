"""``distributed_config``: the mesh, its links, the memory budget and the search settings.

Every key is validated; unknown keys and wrong types raise :class:`ConfigError` naming the key
and the fix.

========================  ===========================================================  ============
key                       meaning                                                      default
========================  ===========================================================  ============
``mesh_shape``            ranks per mesh axis, e.g. ``[2, 4]`` (required)              —
``mesh_axis_names``       one name per axis                                            ``x, y, z...``
``rank_map``              global rank of each mesh position (row-major), a permutation identity
``axis_bandwidth_GBps``   link bandwidth per mesh axis, GB/s (number or list)          100
``axis_latency_us``       link latency per mesh axis, µs (number or list)              5
``memory_budget_bytes``   per-rank memory limit (parameters, as stored: float32        see left
                          weights at 2 bytes under a half ``precision``, + peak
                          activations; not the kernels' scratch, which ``shardflow
                          run --profile`` reports). Default: none, but a plan above
                          0.9 of the device's memory (81559 MiB for ``"h100"``; the
                          ``device``'s ``memory_GB``) is searched again under it
                          (ilp) or refused (baselines)
``algo``                  ``ilp``, ``megatron``, ``data`` or ``replicate``             ``ilp``
``solver``                ``highs``, ``cbc``, or ``auto``: HiGHS when highspy is       ``auto``
                          installed (a dependency; mostly faster than CBC on the
                          budgeted searches), CBC (PuLP's own) otherwise or with
                          ``max_nodes``
``time_limit_s``          ILP time limit, s: all its solves together (a memory      60
                          budget adds rows and solves again)
``mip_rel_gap``           ILP relative optimality gap                                  0 (exact)
``max_nodes``             ILP node limit per solve (``cbc`` only): a search bounded    none
                          by work, so the same plan on every machine
``input_placements``      graph input name → spec string (``"S(0)R"``), default R      all R
``output_placements``     graph output name → spec string, default R                   all R
``op_placements``         op name (as plan.txt prints it) or a shell-style pattern of   none
                          names → the specs the op must run with, as plan.txt writes
                          them: ``"R, S(1) -> S(1)"`` (inputs, weights included, and
                          outputs) or ``"S(1)"`` (outputs), ``*`` for any; the ILP
                          plans the rest around them (pins.py; ``algo`` ilp only)
``preload_plan``          path to a saved ``plan.json`` (or its folder) to reuse;      none
                          with ``pipeline_stages``, the folder of a saved pipeline
                          (``shardflow plan --stages P -o DIR``, or a staged
                          out_dir): its cut and each stage's plan
``alias_layers``          share one decision among structurally identical layers      true
``partial_sums``          let linear ops (adds, scalings, reshapes) work on partial    ``auto``
                          sums, so an all-reduce can wait past them (one for two
                          summed parallel branches): ``true``, ``false``, or
                          ``auto``: true except under a memory budget on a mesh
                          with two axes or more, where the MIP got 2.5-3x slower
``pad_heads``             attention heads that do not divide over the last mesh axis   ``auto``
                          padded to a multiple of it before the plan (copies of head
                          0, their output rows zero; passes/heads.py): ``true``,
                          ``false``, or ``auto``: for ``algo="megatron"`` only
``pipeline_stages``       stages the graph is cut into along the first mesh axis     1
                          (whose size they must divide): each stage a contiguous
                          run of ops, compiled and sharded on its own ranks, its
                          share of the first axis and the other axes (``[2, 4]``
                          in 2 stages: each ``[4]``; ``[4, 2]``: each ``[2, 2]``);
                          the activations crossing a cut are sent between stages
                          (parallel/pipeline.py). ``"auto"``: ``compile`` plans
                          every count of stages dividing ``mesh_shape[0]`` and one
                          plan over the whole mesh and keeps the least modeled time
``pipeline_microbatches`` with stages: a run's batch (dim 0 of every input and     1
                          output) split into this many equal microbatches that
                          follow each other through the stages, so that the stages
                          work at once (GPipe's schedule); each stage compiled for
                          one microbatch, derived from the model at the whole batch
                          and checked to compute its samples apart. ``"auto"``:
                          ``compile`` weighs every count dividing the batch (up to
                          16) by its modeled run and keeps the fastest
``pipeline_balance``      what the cut between stages balances: ``"modeled"`` (the     ``modeled``
                          cost model's roofline times; with microbatches, again on
                          the stages' plans) or ``"measured"`` (cpu target: the
                          graph compiled for one rank and its kernels timed on this
                          machine, each kernel's time spread over the ops it fused)
``device``                what one rank computes on, for the cost model's roofline:    see left
                          ``"h100"``, ``"h200"``, ``"cpu"`` (:mod:`~.cost`), or
                          ``{"peak_tflops": x, "mem_bandwidth_GBps": y}`` (optionally
                          ``"memory_GB"``: what a rank may hold, 1e9 bytes). Default:
                          the compile target's (``compile``: cpu -> ``"cpu"``, cuda
                          -> ``"h100"``); ``search`` alone: ``"h100"``
========================  ===========================================================  ============
"""
from __future__ import annotations

import difflib
from dataclasses import dataclass, field
from typing import Any, Mapping

from ..errors import ConfigError

__all__ = ["DistributedConfig", "ALGOS", "SOLVERS", "highs_available"]

ALGOS = ("ilp", "megatron", "data", "replicate")
SOLVERS = ("auto", "cbc", "highs")


@dataclass(frozen=True)
class DistributedConfig:
    """Validated ``distributed_config`` (see the module docstring for the keys)."""

    mesh_shape: tuple[int, ...]
    mesh_axis_names: tuple[str, ...] | None = None
    rank_map: tuple[int, ...] | None = None
    axis_bandwidth_GBps: tuple[float, ...] | None = None
    axis_latency_us: tuple[float, ...] | None = None
    memory_budget_bytes: int | None = None
    algo: str = "ilp"
    solver: str = "highs"  # (never "auto": from_dict resolves it)
    time_limit_s: float = 60.0
    mip_rel_gap: float = 0.0
    max_nodes: int | None = None
    input_placements: dict = field(default_factory=dict)
    output_placements: dict = field(default_factory=dict)
    preload_plan: str | None = None
    alias_layers: bool = True
    partial_sums: bool | str = "auto"
    pad_heads: bool | str = "auto"
    device: Any = None  # a cost.DeviceProfile, or None for the caller's default
    pipeline_stages: int | str = 1  # or "auto"
    pipeline_microbatches: int | str = 1  # or "auto"
    pipeline_balance: str = "modeled"  # or "measured"
    op_placements: dict = field(default_factory=dict)
    #: (not a key) a pattern of op_placements may name no op of the graph planned: a pipeline stage's,
    #: which holds some of the ops (compile checks that each names an op of some stage)
    pins_may_miss: bool = False
    #: (not a key) how many instances of the planned program a rank holds, each with its own activations and
    #: states, the parameters shared: a pipeline stage keeping states with microbatches holds one per
    #: microbatch (runtime/pipeline.py), so its plan's memory is ``params + program_instances * peak``
    program_instances: int = 1

    @property
    def staged(self) -> bool:
        """Whether the graph is cut into pipeline stages (``pipeline_stages`` > 1; ``"auto"`` is decided
        by ``compile``, which then gives a config with a number)."""
        return self.pipeline_stages != "auto" and self.pipeline_stages > 1

    def stage_config(self, keeps_states: bool = False) -> "DistributedConfig":
        """The config one pipeline stage is planned with: the stages split the first mesh axis into
        ``pipeline_stages`` runs of ``q = mesh_shape[0] / pipeline_stages`` positions, so a stage's mesh
        is ``[q, *mesh_shape[1:]]`` (the first axis keeps its name and links), or ``mesh_shape[1:]`` when
        ``q`` is 1 (``[1]`` when that was the only axis). ``keeps_states``: the stage keeps states (a KV
        cache), so with microbatches its ranks hold an instance of its program per microbatch, which its
        plan counts (``program_instances``). Without ``rank_map``: a stage numbers its own ranks, which
        ``pipeline.json``'s ``ranks`` place in the world (compiler/stages.py)."""
        import dataclasses

        q = self.mesh_shape[0] // int(self.pipeline_stages)
        keep = 0 if q > 1 else 1  # (the axes the stage keeps start here)

        def rest(v):
            return None if v is None else tuple(v[keep:]) or None
        shape = ((q,) if q > 1 else ()) + tuple(self.mesh_shape[1:]) or (1,)
        many = len(self.mesh_shape) > 1 or q > 1
        return dataclasses.replace(
            self, mesh_shape=shape, pipeline_stages=1, pipeline_microbatches=1, pins_may_miss=True, rank_map=None,
            program_instances=int(self.pipeline_microbatches) if keeps_states else 1,
            mesh_axis_names=rest(self.mesh_axis_names) if many else None,
            axis_bandwidth_GBps=rest(self.axis_bandwidth_GBps) if many else None,
            axis_latency_us=rest(self.axis_latency_us) if many else None)

    @classmethod
    def from_dict(cls, cfg: "Mapping[str, Any] | DistributedConfig") -> "DistributedConfig":
        """Validate a user dictionary."""
        if isinstance(cfg, DistributedConfig):
            return cfg
        if not isinstance(cfg, Mapping):
            raise ConfigError(f"distributed_config must be a dict, got {type(cfg).__name__}")
        known = set(cls.__dataclass_fields__) - {"pins_may_miss", "program_instances"}
        for key in cfg:
            if key not in known:
                close = difflib.get_close_matches(str(key), sorted(known), n=1)
                hint = f"; did you mean {close[0]!r}?" if close else ""
                raise ConfigError(f"distributed_config: unknown key {key!r}{hint} (known keys: {sorted(known)})")
        if "mesh_shape" not in cfg:
            raise ConfigError("distributed_config: 'mesh_shape' is required, e.g. {'mesh_shape': [2, 2]}")
        shape = _int_tuple(cfg["mesh_shape"], "mesh_shape")
        if not shape or any(d < 1 for d in shape):
            raise ConfigError(f"distributed_config['mesh_shape'] = {cfg['mesh_shape']!r}: need one or more positive ints")
        n = len(shape)
        names = cfg.get("mesh_axis_names")
        if names is not None:
            if (not isinstance(names, (list, tuple)) or len(names) != n
                    or not all(isinstance(x, str) and x for x in names) or len(set(names)) != n):
                raise ConfigError(f"distributed_config['mesh_axis_names'] = {names!r}: need {n} distinct names")
            names = tuple(names)
        rank_map = cfg.get("rank_map")
        if rank_map is not None:
            rank_map = _int_tuple(rank_map, "rank_map")
        algo = cfg.get("algo", "ilp")
        if algo not in ALGOS:
            raise ConfigError(f"distributed_config['algo'] = {algo!r}: choose one of {list(ALGOS)}")
        solver = cfg.get("solver", "auto")
        if solver not in SOLVERS:
            raise ConfigError(f"distributed_config['solver'] = {solver!r}: choose one of {list(SOLVERS)}")
        budget = _opt_positive_int(cfg.get("memory_budget_bytes"), "memory_budget_bytes")
        max_nodes = _opt_positive_int(cfg.get("max_nodes"), "max_nodes")
        if max_nodes is not None and solver == "highs":
            # PuLP (3.3) has no status for HiGHS's node limit (kSolutionLimit) and raises a KeyError on it
            raise ConfigError("distributed_config['max_nodes'] works with solver 'cbc' only (PuLP cannot read the "
                              "status HiGHS stops with at a node limit); drop 'max_nodes' or use solver 'cbc'")
        stages = cfg.get("pipeline_stages", 1)
        if stages == "auto":
            if shape[0] < 2:
                raise ConfigError(f"distributed_config['pipeline_stages'] = 'auto' weighs stages on the first mesh "
                                  f"axis against a plan over the whole mesh; mesh_shape {list(shape)} has no first "
                                  "axis to cut along (give one of 2 or more, e.g. [2, 4])")
        else:
            stages = _opt_positive_int(stages, "pipeline_stages")
        if stages == "auto" or stages > 1:
            if stages != "auto" and shape[0] % stages:
                raise ConfigError(f"distributed_config['pipeline_stages'] = {stages}: the stages split the first mesh "
                                  f"axis, so its size must be a multiple of {stages} (got mesh_shape {list(shape)}), "
                                  f"e.g. {[stages] + list(shape)}")
            if cfg.get("preload_plan"):  # (the saved cut and stages' plans: compiler/stages.py saved_cut)
                fixed = [f"{k} 'auto'" for k in ("pipeline_stages", "pipeline_microbatches") if cfg.get(k) == "auto"]
                if cfg.get("pipeline_balance", "modeled") != "modeled":
                    fixed.append(f"pipeline_balance {cfg['pipeline_balance']!r}")
                if fixed:
                    raise ConfigError(f"distributed_config['preload_plan'] gives a saved pipeline's cut and plans, "
                                      f"which {' and '.join(fixed)} would choose: give the saved numbers, or drop "
                                      "preload_plan")
        pins = _placements(cfg.get("op_placements", {}), "op_placements", "op names (or patterns of them)",
                           "'R, S(1) -> S(1)'")
        if pins:
            from .pins import parse_pin

            for pattern, text in pins.items():
                parse_pin(pattern, text)  # (the grammar here; the ops and the mesh when the graph is planned)
            if algo != "ilp":
                raise ConfigError(f"distributed_config['op_placements'] constrains the ILP's search; algo {algo!r} "
                                  "is a fixed recipe: use algo 'ilp' (which plans the rest around the pinned ops) or "
                                  "drop op_placements")
            if cfg.get("preload_plan"):
                raise ConfigError("distributed_config['op_placements'] constrains the plan search, which "
                                  "preload_plan skips: drop one of them")
            if stages == "auto":
                raise ConfigError("distributed_config['op_placements'] with pipeline_stages 'auto': a pin's specs "
                                  "name one mesh's axes, and 'auto' weighs meshes of different axes (the whole mesh, "
                                  "each stage's); give a number of stages (the specs then on a stage's mesh) or "
                                  "drop one of them")
        micro = cfg.get("pipeline_microbatches", 1)
        if micro != "auto":
            micro = _opt_positive_int(micro, "pipeline_microbatches")
        if (micro == "auto" or micro > 1) and stages != "auto" and stages < 2:
            raise ConfigError(f"distributed_config['pipeline_microbatches'] = {micro!r} needs pipeline_stages > 1 "
                              "(the microbatches follow each other through the stages)")
        balance = cfg.get("pipeline_balance", "modeled")
        if balance not in ("modeled", "measured"):
            raise ConfigError(f"distributed_config['pipeline_balance'] = {balance!r}: 'modeled' (the cost model's "
                              "roofline times) or 'measured' (the ops timed on this machine's cpu)")
        if balance != "modeled" and stages != "auto" and stages < 2:
            raise ConfigError(f"distributed_config['pipeline_balance'] = {balance!r} needs pipeline_stages > 1 (it "
                              "says what the cut between stages balances)")
        if solver == "auto":
            solver = "highs" if max_nodes is None and highs_available() else "cbc"
        elif solver == "highs" and not highs_available():
            raise ConfigError("distributed_config['solver'] = 'highs' needs the highspy package (pip install "
                              "highspy); or use solver 'cbc', which PuLP ships")
        return cls(
            mesh_shape=shape, mesh_axis_names=names, rank_map=rank_map,
            axis_bandwidth_GBps=_per_axis(cfg.get("axis_bandwidth_GBps"), n, "axis_bandwidth_GBps"),
            axis_latency_us=_per_axis(cfg.get("axis_latency_us"), n, "axis_latency_us", allow_zero=True),
            memory_budget_bytes=budget, algo=algo, solver=solver,
            time_limit_s=_positive(cfg.get("time_limit_s", 60.0), "time_limit_s"),
            mip_rel_gap=_nonneg(cfg.get("mip_rel_gap", 0.0), "mip_rel_gap"), max_nodes=max_nodes,
            input_placements=_placements(cfg.get("input_placements", {}), "input_placements"),
            output_placements=_placements(cfg.get("output_placements", {}), "output_placements"),
            preload_plan=_opt_str(cfg.get("preload_plan"), "preload_plan"),
            alias_layers=_bool(cfg.get("alias_layers", True), "alias_layers"),
            partial_sums=_bool_or_auto(cfg.get("partial_sums", "auto"), "partial_sums"),
            pad_heads=_bool_or_auto(cfg.get("pad_heads", "auto"), "pad_heads"),
            device=_device(cfg.get("device")), pipeline_stages=stages, pipeline_microbatches=micro,
            pipeline_balance=balance, op_placements=pins,
        )


def highs_available() -> bool:
    """Whether PuLP can run HiGHS here (the highspy package is importable)."""
    import importlib.util

    return importlib.util.find_spec("highspy") is not None


def _device(v):
    from .cost import DEVICE_PROFILES, DeviceProfile

    if v is None or isinstance(v, DeviceProfile):
        return v
    if isinstance(v, str):
        from .cost import H200

        by_name = {p.name: p for p in DEVICE_PROFILES.values()} | {"h100": DEVICE_PROFILES["cuda"], "h200": H200}
        if v not in by_name:
            raise ConfigError(f"distributed_config['device'] = {v!r}: choose one of {sorted(by_name)}, or give "
                              "{'peak_tflops': ..., 'mem_bandwidth_GBps': ...}")
        return by_name[v]
    if isinstance(v, Mapping):
        extra = set(v) - {"name", "peak_tflops", "mem_bandwidth_GBps", "memory_GB"}
        if extra or not {"peak_tflops", "mem_bandwidth_GBps"} <= set(v):
            raise ConfigError(f"distributed_config['device'] = {v!r}: need the keys 'peak_tflops' and "
                              "'mem_bandwidth_GBps' (and optionally 'name' and 'memory_GB'), nothing else")
        peak = _positive(v["peak_tflops"], "device.peak_tflops")
        bw = _positive(v["mem_bandwidth_GBps"], "device.mem_bandwidth_GBps")
        mem = _positive(v["memory_GB"], "device.memory_GB") * 1e9 if v.get("memory_GB") is not None else None
        return DeviceProfile(str(v.get("name", "custom")), peak * 1e12, bw * 1e9, mem)
    raise ConfigError(f"distributed_config['device'] = {v!r}: need a device name or a dict of "
                      "'peak_tflops' and 'mem_bandwidth_GBps'")


def _int_tuple(v, key) -> tuple[int, ...]:
    if isinstance(v, int) and not isinstance(v, bool):
        return (v,)
    if not isinstance(v, (list, tuple)) or not all(isinstance(x, int) and not isinstance(x, bool) for x in v):
        raise ConfigError(f"distributed_config[{key!r}] = {v!r}: need a list of ints")
    return tuple(int(x) for x in v)


def _per_axis(v, n, key, allow_zero=False) -> tuple[float, ...] | None:
    if v is None:
        return None
    vals = [v] * n if isinstance(v, (int, float)) and not isinstance(v, bool) else v
    if not isinstance(vals, (list, tuple)) or len(vals) != n:
        raise ConfigError(f"distributed_config[{key!r}] = {v!r}: need a number or a list of {n} numbers "
                          "(one per mesh axis)")
    out = []
    for x in vals:
        if not isinstance(x, (int, float)) or isinstance(x, bool) or x < 0 or (x == 0 and not allow_zero):
            raise ConfigError(f"distributed_config[{key!r}] = {v!r}: values must be positive numbers")
        out.append(float(x))
    return tuple(out)


def _opt_positive_int(v, key) -> int | None:
    if isinstance(v, float) and v.is_integer():  # JSON's 4e9
        v = int(v)
    if v is not None and (not isinstance(v, int) or isinstance(v, bool) or v <= 0):
        raise ConfigError(f"distributed_config[{key!r}] = {v!r}: need a positive int (or leave it out)")
    return v


def _positive(v, key) -> float:
    if not isinstance(v, (int, float)) or isinstance(v, bool) or v <= 0:
        raise ConfigError(f"distributed_config[{key!r}] = {v!r}: need a positive number")
    return float(v)


def _nonneg(v, key) -> float:
    if not isinstance(v, (int, float)) or isinstance(v, bool) or v < 0:
        raise ConfigError(f"distributed_config[{key!r}] = {v!r}: need a number ≥ 0")
    return float(v)


def _bool(v, key) -> bool:
    if not isinstance(v, bool):
        raise ConfigError(f"distributed_config[{key!r}] = {v!r}: need true or false")
    return v


def _bool_or_auto(v, key) -> bool | str:
    if v != "auto" and not isinstance(v, bool):
        raise ConfigError(f"distributed_config[{key!r}] = {v!r}: need true, false or 'auto'")
    return v


def _opt_str(v, key) -> str | None:
    if v is not None and not isinstance(v, str):
        raise ConfigError(f"distributed_config[{key!r}] = {v!r}: need a path string")
    return v


def _placements(v, key, what: str = "tensor names", like: str = "'S(0)R'") -> dict:
    if not isinstance(v, Mapping) or not all(isinstance(k, str) and isinstance(x, str) for k, x in v.items()):
        raise ConfigError(f"distributed_config[{key!r}] must map {what} to spec strings like {like}")
    return dict(v)
