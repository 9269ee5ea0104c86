"""A stand-in for the cpu codegen in tests: a real ``.so`` whose kernels call back into Python.

``build_callback_library(ops, path)`` has the codegen's contract: it compiles one shared library
with one ``extern "C" void k_<i>(const void* const* inputs, void* const* outputs)`` per op and
returns ``{op.name: symbol}``. Each kernel forwards to a callback that runs the op's numpy
implementation on the buffers behind the pointers. :func:`attach` installs that callback into a
loaded :class:`~shardflow.runtime.RankProgram`. It lets tests check the driver's programs,
buffer plans and the runtime's execution on every test model without depending on the kernel
code generator; real-process runs need the real codegen.
"""
from __future__ import annotations

import ctypes
import subprocess
import tempfile
from pathlib import Path

import numpy as np

#: Op lists of the libraries built in this process, in build order.
BUILT: list[list] = []

_CB = ctypes.CFUNCTYPE(None, ctypes.c_int, ctypes.POINTER(ctypes.c_void_p), ctypes.POINTER(ctypes.c_void_p))


def build_callback_library(ops, path, cache_dir=None, views=(), **_):
    ops = [op for op in ops if op.name not in set(views)]  # views run as views (no fusion here)
    src = ["typedef void (*cb_t)(int, const void* const*, void* const*);", "static cb_t cb = 0;",
           'extern "C" void sf_set_callback(cb_t f) { cb = f; }']
    names = {}
    for i, op in enumerate(ops):
        src.append(f'extern "C" void k_{i}(const void* const* in, void* const* out) {{ cb({i}, in, out); }}')
        names[op.name] = f"k_{i}"
    with tempfile.TemporaryDirectory() as d:
        cpp = Path(d) / "k.cpp"
        cpp.write_text("\n".join(src) + "\n")
        subprocess.run(["g++", "-shared", "-fPIC", "-O0", "-o", str(path), str(cpp)], check=True)
    BUILT.append(list(ops))
    return names


def _wrap(ptr: int, t) -> np.ndarray:
    dt = np.dtype(t.dtype)
    n = int(np.prod(t.shape, dtype=np.int64)) * dt.itemsize
    if n == 0:
        return np.empty(t.shape, dt)
    return np.frombuffer((ctypes.c_char * n).from_address(ptr), dt).reshape(t.shape)


def attach(prog, ops) -> None:
    """Make ``prog``'s kernels run ``ops`` (the list its library was built from)."""

    def run(i, ins, outs):
        op = ops[i]
        args = [_wrap(ins[k], t) for k, t in enumerate(op.inputs)]
        res = op.run(*[a.copy() for a in args])
        for k, t in enumerate(op.outputs):
            dst = _wrap(outs[k], t)
            dst[...] = res[k]

    cb = _CB(run)
    prog._callback = cb  # keep it alive
    prog._lib.sf_set_callback(cb)
