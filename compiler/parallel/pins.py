"""``op_placements``: specs the user fixes for some ops, the plan search choosing the rest.

An auto-sharder's plan is only as good as its cost model; users of GSPMD (``mark_sharding``), Alpa
(manual sharding options) and PyTorch's autoparallel (node constraints) fix the placements they know
better and let the search fill in the rest. ``distributed_config["op_placements"]`` maps an op name
as ``plan.txt`` prints it, or a shell-style pattern of such names (``fnmatch``:
``/model/transformer/h.*/mlp/c_fc/MatMul``), to the specs the op must run with, written as plan.txt
writes them:

* ``"R, S(1) -> S(1)"``: every input's spec (constants, the weights, included) and every output's;
* ``"S(1)"``: the outputs' specs only (several comma-separated for an op with several outputs);
* ``*`` in place of a spec: any.

Each spec has one placement per mesh axis of the mesh the op is planned on (a pipeline stage's
mesh with stages). :func:`resolve_pins` checks the table against a graph; the search
(:class:`~.search.Problem`) then keeps only the strategies each pinned op's pin admits, so the ILP
gives the cheapest plan under the cost model among those running the pinned ops as given, the
resharding around them priced as any other.
"""
from __future__ import annotations

import difflib
import fnmatch
from dataclasses import dataclass
from typing import Mapping, Sequence

from ..errors import ConfigError
from .placement import Shard, TensorShardSpec
from .rules import OpShardSpec

__all__ = ["OpPin", "parse_pin", "resolve_pins", "matching_ops", "unavailable"]

KEY = "distributed_config['op_placements']"


@dataclass(frozen=True)
class OpPin:
    """One entry of ``op_placements``: the ``pattern`` it came from, its text, and the specs it fixes
    (``None`` for ``*``; ``inputs`` ``None`` when only the outputs are given)."""

    pattern: str
    text: str
    inputs: tuple[TensorShardSpec | None, ...] | None
    outputs: tuple[TensorShardSpec | None, ...]

    def admits(self, s: OpShardSpec) -> bool:
        """Whether strategy ``s`` runs the op with the pinned specs."""
        def same(want, got) -> bool:
            return all(w is None or w == g for w, g in zip(want, got))
        return same(self.outputs, s.output_specs) and (self.inputs is None or same(self.inputs, s.input_specs))


def _specs(part: str, pattern: str, text: str) -> tuple[TensorShardSpec | None, ...]:
    items = [x.strip() for x in part.split(",")]
    if not all(items):
        raise ConfigError(f"{KEY}[{pattern!r}] = {text!r}: an empty spec; write one per tensor, e.g. 'R, S(1) -> "
                          "S(1)', or '*' for any")
    try:
        return tuple(None if x == "*" else TensorShardSpec.parse(x) for x in items)
    except ConfigError as exc:
        raise ConfigError(f"{KEY}[{pattern!r}] = {text!r}: {exc}") from None


def parse_pin(pattern: str, text: str) -> OpPin:
    """``text`` (``"IN, ... -> OUT, ..."`` or ``"OUT, ..."``) as an :class:`OpPin`."""
    if not isinstance(text, str):
        raise ConfigError(f"{KEY}[{pattern!r}] must be a string like 'R, S(1) -> S(1)', got {type(text).__name__}")
    if text.count("->") > 1:
        raise ConfigError(f"{KEY}[{pattern!r}] = {text!r}: one '->' at most ('inputs -> outputs')")
    if "->" in text:
        ins, outs = text.split("->")  # (no inputs before the arrow: an op that reads none, a generator's)
        return OpPin(pattern, text, _specs(ins, pattern, text) if ins.strip() else (), _specs(outs, pattern, text))
    return OpPin(pattern, text, None, _specs(text, pattern, text))


def matching_ops(names: Sequence[str], pattern: str) -> list[str]:
    """The op names ``pattern`` names: itself when it is one, else those it matches as a shell-style
    pattern (``*``, ``?``, ``[...]``)."""
    if pattern in names:
        return [pattern]
    return [n for n in names if fnmatch.fnmatchcase(n, pattern)]


def resolve_pins(graph, table: Mapping[str, str], mesh_shape: Sequence[int], *, require_match: bool = True
                 ) -> dict[str, OpPin]:
    """``{op name: pin}`` for ``graph``'s ops that ``table`` (``op_placements``) names, checked: every
    pattern names an op (unless ``require_match`` is false: a pipeline stage holds some of the ops), no
    op is pinned twice differently, every pin has as many specs as the op has inputs and outputs, one
    placement per axis of ``mesh_shape`` and dims the tensors have. Raises :class:`ConfigError` naming
    the pattern, the op and the fix."""
    ops = {op.name: op for op in graph.nodes}
    names = list(ops)
    pins: dict[str, OpPin] = {}
    for pattern, text in table.items():
        pin = parse_pin(pattern, text)
        hits = matching_ops(names, pattern)
        if not hits and require_match:
            close = difflib.get_close_matches(pattern, names, n=3, cutoff=0.6)
            raise ConfigError(f"{KEY}: {pattern!r} names no op of the graph"
                              + (f"; did you mean {close}?" if close else "")
                              + " (ops are named as plan.txt prints them: `shardflow plan MODEL --mesh ...`; a "
                                "pattern takes *, ? and [...])")
        for name in hits:
            op = ops[name]
            if name in pins and pins[name].text != pin.text:
                raise ConfigError(f"{KEY}: op {name!r} is pinned by {pins[name].pattern!r} to {pins[name].text!r} "
                                  f"and by {pattern!r} to {text!r}; give it one")
            _check_arity(pin, op, mesh_shape)
            pins[name] = pin
    return pins


def _check_arity(pin: OpPin, op, mesh_shape: Sequence[int]) -> None:
    where = f"{KEY}[{pin.pattern!r}] = {pin.text!r} for op {op.name!r} ({op.op_type})"
    for what, specs, tensors in (("inputs", pin.inputs, op.inputs), ("outputs", pin.outputs, op.outputs)):
        if specs is None:
            continue
        if len(specs) != len(tensors):
            raise ConfigError(f"{where}: the op has {len(tensors)} {what} ({', '.join(t.name for t in tensors)}), "
                              f"the pin gives {len(specs)} specs; give one per tensor ('*': any)")
        for sp, t in zip(specs, tensors):
            if sp is None:
                continue
            if len(sp.placements) != len(mesh_shape):
                raise ConfigError(f"{where}: {sp} has {len(sp.placements)} placement(s); the mesh it is planned on, "
                                  f"{list(mesh_shape)}, has {len(mesh_shape)} axes (with pipeline stages, a stage's "
                                  "mesh)")
            bad = [p.dim for p in sp.placements if isinstance(p, Shard) and not 0 <= p.dim < t.ndim]
            if bad:
                raise ConfigError(f"{where}: {sp} splits dim {bad[0]} of {t.name!r}, which has {t.ndim} dims "
                                  f"(shape {list(t.shape)})")


def unavailable(pin: OpPin, op, strategies: Sequence[OpShardSpec], off: str | None = None) -> ConfigError:
    """The error for a pin no strategy of ``op`` admits, listing what the op can run as (``off``: the
    distributed_config key whose setting left out the strategies the pin asks for)."""
    seen = sorted({f"{', '.join(map(str, s.input_specs))} -> {', '.join(map(str, s.output_specs))}"
                   for s in strategies})
    shown = "; ".join(seen[:12]) + (f"; ... ({len(seen)} in all)" if len(seen) > 12 else "")
    if off is not None:
        return ConfigError(f"{KEY}[{pin.pattern!r}] = {pin.text!r}: op {op.name!r} ({op.op_type}) runs so on partial "
                           f"sums, which this search leaves out ({off} false, or 'auto' under memory_budget_bytes on a "
                           f"mesh of two or more axes): set {off} true, or pin one of: {shown}")
    return ConfigError(f"{KEY}[{pin.pattern!r}] = {pin.text!r}: op {op.name!r} ({op.op_type}) cannot run so on this "
                       f"mesh (its sharding rules allow: {shown}); pin one of those")
