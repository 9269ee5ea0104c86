"""Code generation: compute definitions → loop nests → kernels.

``target="cpu"``: :func:`build_cpu_library` writes one C++ translation unit with one kernel per op
and compiles it into a shared library (see :mod:`.cpp` for the kernel ABI and :mod:`.toolchain`
for the compiler flags and the kernel cache). Collectives are not compiled: the runtime runs them
with its communicator.
"""
from __future__ import annotations

import logging
import time
from typing import Any, Collection, Mapping, Sequence

from .cpp import CpuSource
from .lower import CodegenError, lower_task, lowerable, why_not_lowerable
from .toolchain import CompileError, ToolchainError, build_shared_library, default_cache_dir, default_jobs

__all__ = ["build_cpu_library", "prepare_cpu_library", "compile_cpu_sources", "CpuSource", "lowerable",
           "why_not_lowerable", "lower_task", "generate_cpu_source", "CodegenError", "CompileError",
           "ToolchainError", "default_cache_dir"]

log = logging.getLogger(__name__)


def generate_cpu_source(ops, clones: str = "auto", in_place: Mapping[str, int] | None = None):
    """The C++ translation unit for ``ops`` (see :func:`.cpp.generate_cpu_source`)."""
    from .cpp import generate_cpu_source as gen
    return gen(ops, clones, in_place)


def build_cpu_library(ops: Sequence, path: str, *, cache_dir: str | None = None, opt_level: int = 2,
                      fuse: bool = False, keep: Collection[str] = (), views: Collection[str] = (),
                      in_place: Mapping[str, str] | None = None) -> dict[str, Any]:
    """Compile the kernels of ``ops`` into the shared library ``path``.

    Parameters
    ----------
    ops
        Operators (graph nodes) with static shapes. Ops that cannot be lowered — collectives
        (``op.collective`` non-empty; the runtime runs them) and ops with extern outputs that no
        template implements (TopK of uint64; the others have one) — are left out of the library
        and of the result (see :func:`lowerable`).
    path
        The library to write (written to a temporary name, then renamed).
    cache_dir
        The kernel cache; default ``$SHARDFLOW_CACHE_DIR`` or ``~/.cache/shardflow/kernels``. A
        build whose source, compiler command line and compiler version were built before copies
        the cached library.
    opt_level
        0: ``-O0``; 1: ``-O1`` (quick builds); 2 (default) and 3: ``-O3``.
    fuse
        Fuse injective ops into their neighbours' kernels (:mod:`.fusion`; the GEMM templates
        stay alone, the convolution template applies element-wise epilogues). ``keep`` names tensors that must still be written
        (graph outputs, inputs of collectives or of ops compiled elsewhere).
    views
        Names of ops in ``ops`` that can run as views (no kernel): fusion may fold them into a
        neighbour's kernel (:func:`.fusion.fuse`); the others get no kernel and no entry in
        the result.
    in_place
        ``{output tensor name: input tensor name}``: outputs the program will write over that
        input's bytes (a state, ``compile(state=...)``; the caller makes sure the program aliases
        them). The kernel writing such an output as a select that keeps the input's element
        (``c ? x[i] : e``) stores only where ``c`` does not hold.

    Returns
    -------
    dict
        ``op.name`` → exported symbol, for every lowered op. Each symbol is a function
        ``extern "C" void f(const void* const* inputs, void* const* outputs)`` taking the op's
        inputs and outputs in order as contiguous row-major arrays of their static shapes and
        dtypes. Ops with identical kernels share a symbol. With ``fuse``, the last op of a fused
        group maps to ``{"symbol", "inputs", "outputs"}`` (tensor names) and the group's other
        ops to ``None``.

    Raises
    ------
    CodegenError
        an op cannot be lowered although :func:`lowerable` accepted it.
    CompileError
        the compiler rejected the generated code (names the ops).
    ToolchainError
        no C++ compiler.
    """
    t0 = time.perf_counter()
    entries, src = prepare_cpu_library(ops, fuse=fuse, keep=keep, views=views, in_place=in_place)
    compile_cpu_sources([src], path, cache_dir=cache_dir, opt_level=opt_level, source_seconds=time.perf_counter() - t0)
    return entries


def prepare_cpu_library(ops: Sequence, *, fuse: bool = False, keep: Collection[str] = (),
                        views: Collection[str] = (), in_place: Mapping[str, str] | None = None
                        ) -> tuple[dict[str, Any], CpuSource]:
    """The kernels of ``ops`` as C++, not compiled yet: what :func:`build_cpu_library` returns, and
    the source :func:`compile_cpu_sources` builds (alone, or merged with other ranks' sources).
    The parameters are :func:`build_cpu_library`'s."""
    groups = list(ops)
    if fuse:
        from .fusion import fuse as fuse_ops
        from .fusion import in_place_concat
        from .templates_cpu import accepts_epilogue, accepts_group, template_kind

        groups = fuse_ops(groups, keep=keep, barriers=lambda op: template_kind(op) is not None
                          and not accepts_epilogue(op), no_prologue=lambda op: accepts_epilogue(op)
                          or in_place_concat(op), accept=accepts_group, views=views)
    from .fusion import aliased_inputs, drop_views
    groups = drop_views(groups, views)
    src = generate_cpu_source(groups, in_place=aliased_inputs(groups, in_place))
    if src.skipped:
        log.info("not compiled (run by the runtime or unsupported): %s",
                 ", ".join(f"{n} ({why})" for n, why in list(src.skipped.items())[:8]))
    if not fuse:
        return dict(src.symbols), src
    from .fusion import kernel_entries
    return kernel_entries(groups, dict(src.symbols)), src


def compile_cpu_sources(sources: Sequence[CpuSource], path: str, *, cache_dir: str | None = None,
                        opt_level: int = 2, source_seconds: float | None = None) -> bool:
    """Compile one library ``path`` with the kernels of every source in ``sources`` (from
    :func:`prepare_cpu_library`; their headers must be equal, see :meth:`.cpp.CpuSource.merge`).

    The ranks of a plan mostly run the same kernels (symbols name their code): one library for all
    of them compiles each distinct kernel once, where a library per rank compiled them once per rank
    whenever a single kernel differed (a slice at the rank's offset). Returns True on a cache hit."""
    t1 = time.perf_counter()
    src = CpuSource.merge(sources)
    n_units = min(default_jobs(), max(1, len(src.kernels) // 16))
    whole, lines = src.units(1)[0]
    from .templates_cpu import prebuilt_needs, prebuilt_tables
    hit = build_shared_library(whole, path, cache_dir=cache_dir, opt_level=opt_level, line_map=lines,
                               units=src.units(n_units) if n_units > 1 else None,
                               prebuilt=prebuilt_tables(), header=src.header, prebuilt_needs=prebuilt_needs())
    log.info("cpu library %s: %d ops, %d kernels%s%s, %s %.2f s", path, len(src.symbols), len(src.kernels),
             f" (of {len(sources)} sources)" if len(sources) > 1 else "",
             f", source {source_seconds:.2f} s" if source_seconds is not None else "",
             "cache hit" if hit else "compile", time.perf_counter() - t1)
    return hit
