"""What a cpu rank program's collective costs beyond MPI's own call: run under ``mpiexec -n 2``.

A cpu run is one native call (``sf_run_program``) that calls back into Python at each collective
step, where the prepared collective (``runtime/comm/prepared.py``) calls mpi4py. This prints, per
all-reduce size: mpi4py's ``Allreduce`` alone, ``MPI_Allreduce`` called through ctypes with the raw
handles (what a native collective slot would call, less ctypes' own cost), the prepared collective as
the program calls it, and ``sf_run_program`` over collective steps that call a Python no-op (the
callback's own cost per step). The difference says what moving collectives into native code would save.

    mpiexec -n 2 python benchmarks/mpi_collective_overhead.py [--iters 20000]
"""
from __future__ import annotations

import argparse
import ctypes
import time

import numpy as np
from mpi4py import MPI

from shardflow.runtime import native
from shardflow.runtime.comm.mpi import MPICommunicator
from shardflow.runtime.comm.prepared import prepare


def _timed(comm, fn, iters: int) -> float:
    """Microseconds a call, after warm-up, ranks started together."""
    for _ in range(min(iters, 200)):
        fn()
    comm.Barrier()
    t0 = time.perf_counter()
    for _ in range(iters):
        fn()
    return (time.perf_counter() - t0) / iters * 1e6


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--iters", type=int, default=20000)
    args = ap.parse_args()
    comm = MPI.COMM_WORLD
    ours = MPICommunicator()
    mpi_lib = ctypes.CDLL(MPI.__file__)  # (dlsym through the module's dependencies finds libmpi's symbols)
    handle = ctypes.c_int if MPI._sizeof(MPI.Comm) == 4 else ctypes.c_void_p
    allreduce = mpi_lib.MPI_Allreduce
    allreduce.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int, handle, handle, handle]
    allreduce.restype = ctypes.c_int
    h_float, h_sum, h_comm = MPI._handleof(MPI.FLOAT), MPI._handleof(MPI.SUM), MPI._handleof(comm)

    lib = native.load()
    steps = 64
    noop = native.COLLECTIVE_FN(lambda _ctx, _step: 0)
    null_fns = (ctypes.c_void_p * steps)()
    call_noop = _timed(comm, lambda: lib.sf_run_program(steps, ctypes.addressof(null_fns), None, None, noop, None),
                       max(args.iters // 20, 50)) / steps
    if comm.rank == 0:
        print(f"MPI: {MPI.Get_library_version().splitlines()[0].strip()}; {comm.size} ranks")
        print(f"sf_run_program's callback into Python (a no-op collective step): {call_noop:.2f} us a step")
    for n in (768, 8 * 768, 128 * 768):
        x = np.ones(n, np.float32)
        y = np.empty_like(x)
        iters = args.iters if n < 10000 else max(args.iters // 10, 50)
        raw = _timed(comm, lambda: comm.Allreduce(x, y), iters)
        direct = _timed(comm, lambda: allreduce(x.ctypes.data, y.ctypes.data, n, h_float, h_sum, h_comm), iters)
        prepared = _timed(comm, prepare(ours, "all_reduce", x, y, {"op": "sum"}), iters)
        if comm.rank == 0:
            print(f"all-reduce {n * 4 / 1024:6.0f} KiB: mpi4py {raw:7.2f} us   ctypes MPI_Allreduce {direct:7.2f} us   "
                  f"prepared {prepared:7.2f} us   prepared + callback - mpi4py {prepared + call_noop - raw:5.2f} us")


if __name__ == "__main__":
    main()
