"""The report of ``shardflow run --profile``: where each rank's time goes, step by step.

:meth:`~shardflow.runtime.executor.RankProgram.profile` times every step of one rank; rank 0
gathers the ranks' records and :func:`format_profile` prints, per rank, the time in kernels and
in collectives (a collective's time includes waiting for its group's slowest member, so a rank
that waits more than the others is the fast one), the collectives per kind, and the slowest steps.
"""
from __future__ import annotations

from collections import defaultdict
from typing import Sequence

__all__ = ["format_profile", "memory_record", "chrome_trace", "format_trace_summary"]

#: the event kinds in which a rank waits on others (a collective waits for its group's slowest member,
#: a pipeline's receive for the earlier stage)
WAITING_KINDS = ("collective", "receive", "send")


def format_profile(per_rank: Sequence[Sequence[dict]], repeat: int, top: int = 15, plan: dict | None = None,
                   memory: Sequence[dict] | None = None) -> str:
    """A text report of the ranks' step times (``per_rank[r]``: rank r's
    :meth:`~shardflow.runtime.executor.RankProgram.profile` records); with the out_dir's
    ``plan`` (``plan.json``), also the plan's modeled compute and communication beside them; with
    ``memory`` (``memory[r]``: rank r's :func:`memory_record` after the runs), each rank's memory
    beside the plan's model of it."""
    lines = [f"profile: median of {repeat} run(s) per step, stepping through the program from Python",
             f"{'rank':>4}  {'kernels ms':>10}  {'collectives ms':>14}  {'sum ms':>9}  collectives (count, ms)"]
    for r, steps in enumerate(per_rank):
        kern = sum(s["ms"] for s in steps if s["kind"] == "kernel")
        by_kind: dict[str, list[float]] = defaultdict(list)
        for s in steps:
            if s["kind"] == "collective":
                by_kind[s["what"]].append(s["ms"])
        coll = sum(sum(v) for v in by_kind.values())
        kinds = ", ".join(f"{k} {len(v)} ({sum(v):.2f})" for k, v in sorted(by_kind.items())) or "none"
        lines.append(f"{r:>4}  {kern:10.2f}  {coll:14.2f}  {kern + coll:9.2f}  {kinds}")
    if plan and "compute_cost_s" in plan and "comm_cost_s" in plan:
        device = plan.get("device", {}).get("name", "h100-sxm")
        lines.append(f"modeled by the plan (device {device}): compute {plan['compute_cost_s'] * 1e3:.2f} ms, "
                     f"communication {plan['comm_cost_s'] * 1e3:.2f} ms per rank")
    if memory:
        lines += _memory_lines(memory, plan)
    n_steps = {len(steps) for steps in per_rank}
    if len(n_steps) == 1:  # same program shape on every rank: the slowest rank's time per step
        slowest = [max(((steps[k]["ms"], r) for r, steps in enumerate(per_rank)), key=lambda t: t[0])
                   for k in range(n_steps.pop())]
        order = sorted(range(len(slowest)), key=lambda k: -slowest[k][0])[:top]
        lines.append(f"the {len(order)} slowest steps (time on the slowest rank):")
        lines.append(f"{'ms':>9}  {'rank':>4}  {'step':>5}  {'kind':<10}  {'what':<16}  node")
        for k in order:
            s = per_rank[slowest[k][1]][k]
            lines.append(f"{slowest[k][0]:9.3f}  {slowest[k][1]:>4}  {k:>5}  {s['kind']:<10}  {s['what']:<16}  "
                         f"{s['node']}")
    return "\n".join(lines)


def memory_record(prog) -> dict:
    """Rank program ``prog``'s memory in bytes: its ``arena`` (activations and what its load steps
    made), its ``weights`` (with those it reads from an earlier shape variant's file, less those it
    reads from another variant's memory) and, for a
    cpu program, its kernels' ``scratch`` buffers (``None``: not known)."""
    weights = getattr(prog, "weights", None)
    external = sum(a.nbytes for a in getattr(prog, "external_regions", {}).values())
    borrowed = getattr(prog, "borrowed_weights_bytes", 0)
    return {"arena": int(prog.arena.nbytes) if getattr(prog, "arena", None) is not None else None,
            "weights": int(weights.nbytes) + external - borrowed if weights is not None else None,
            "scratch": prog.scratch_bytes}


def _memory_lines(memory: Sequence[dict], plan: dict | None) -> list[str]:
    def mib(v) -> str:
        return f"{v / 2**20:10.2f}" if v is not None else f"{'-':>10}"

    lines = ["memory per rank (MiB; scratch: the cpu kernels' per-thread buffers after the runs, which "
             "memory_budget_bytes does not count)",
             f"{'rank':>4}  {'arena':>10}  {'weights':>10}  {'scratch':>10}  {'total':>10}"]
    for r, m in enumerate(memory):
        total = sum(v for v in m.values() if v is not None)
        lines.append(f"{r:>4}  {mib(m.get('arena'))}  {mib(m.get('weights'))}  {mib(m.get('scratch'))}  {mib(total)}")
    if plan and "params_bytes" in plan and "peak_activation_bytes" in plan:
        k = int(plan.get("instances", 1))  # (a pipeline stage keeping states: an instance a microbatch)
        lines.append(f"modeled by the plan: parameters {plan['params_bytes'] / 2**20:.2f} MiB + "
                     + (f"{k} instances x " if k != 1 else "")
                     + f"peak activations {plan['peak_activation_bytes'] / 2**20:.2f} MiB per rank")
    return lines


def chrome_trace(per_rank: Sequence[Sequence[dict]], labels: Sequence[str], meta: dict | None = None) -> dict:
    """The ranks' :meth:`~shardflow.runtime.executor.RankProgram.trace` events (``per_rank[r]``, their
    ``start_ns`` and ``end_ns`` from a common origin) as a Chrome trace (the JSON object format that
    chrome://tracing and ui.perfetto.dev open): a process per rank named by ``labels[r]``, one complete
    event (``ph`` ``X``, microseconds) per step, named after its node, its kind the category."""
    events: list[dict] = []
    for r, (steps, label) in enumerate(zip(per_rank, labels)):
        events.append({"name": "process_name", "ph": "M", "pid": r, "tid": 0, "args": {"name": label}})
        events.append({"name": "process_sort_index", "ph": "M", "pid": r, "tid": 0, "args": {"sort_index": r}})
        for e in steps:
            events.append({"name": str(e["node"]), "cat": e["kind"], "ph": "X", "pid": r, "tid": 0,
                           "ts": e["start_ns"] / 1e3, "dur": (e["end_ns"] - e["start_ns"]) / 1e3,
                           "args": {k: e[k] for k in ("what", "run", "microbatch") if k in e}})
    return {"traceEvents": events, "displayTimeUnit": "ms", "otherData": dict(meta or {})}


def format_trace_summary(per_rank: Sequence[Sequence[dict]]) -> str:
    """Per rank, from its trace events: the span from its first step's start to its last one's end, the
    time in kernels, waiting on other ranks (collectives, a pipeline's sends and receives) and the rest
    (between steps: idle before its first step is not in the span)."""
    lines = [f"{'rank':>4}  {'span ms':>9}  {'kernels ms':>10}  {'waiting ms':>10}  {'other ms':>9}  waiting %"]
    for r, steps in enumerate(per_rank):
        if not steps:
            lines.append(f"{r:>4}  (no steps)")
            continue
        span = (max(e["end_ns"] for e in steps) - min(e["start_ns"] for e in steps)) / 1e6
        kern = sum(e["end_ns"] - e["start_ns"] for e in steps if e["kind"] == "kernel") / 1e6
        wait = sum(e["end_ns"] - e["start_ns"] for e in steps if e["kind"] in WAITING_KINDS) / 1e6
        lines.append(f"{r:>4}  {span:9.3f}  {kern:10.3f}  {wait:10.3f}  {span - kern - wait:9.3f}  "
                     f"{100 * wait / span if span else 0:8.1f}")
    return "\n".join(lines)
