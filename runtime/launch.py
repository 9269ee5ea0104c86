"""Start ranks and run an out_dir: the ``shardflow run`` command.

``shardflow run OUT --nproc N --inputs in.npz --outputs out.npz``

* Started plainly, it launches N local ranks: through ``mpiexec -n N`` when mpiexec and mpi4py
  are available, else through its own spawner (N child processes finding each other with a TCP
  rendezvous at ``MASTER_ADDR:MASTER_PORT``).
* Started by a launcher — ``mpiexec -n N shardflow run OUT ...``, ``srun``, or torchrun-style
  variables (``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``, ``MASTER_ADDR``, ``MASTER_PORT``) — each
  process finds its rank and runs it.

Every rank reads the full inputs; rank 0 writes the outputs (an npz keyed by the ONNX output
names, assembled from the ranks' shards when an output is not replicated). A world size that
does not match the artifacts is refused before anything runs. A rank that dies makes every other
rank exit non-zero within seconds, naming it (:mod:`shardflow.runtime.comm.watchdog`); the
spawner also kills any rank still alive 60 s after the first failure.

Also runnable as ``python -m shardflow.runtime.launch OUT ...`` (no compiler needed).
"""
from __future__ import annotations

import argparse
import dataclasses
import functools
import logging
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Mapping, Sequence

import numpy as np

from .artifact import ArtifactError, list_ranks, read_manifest, rank_dir, write_json
from .pipeline import PipelineProgram, read_pipeline, stage_of_rank, stage_ranks
from .variants import first_variant_dir
from .errors import ShardflowError, number_from_env
from .executor import WorldSizeError

__all__ = ["LaunchEnv", "detect_environment", "main", "add_run_arguments", "artifact_world_size", "LaunchError",
           "start_ranks"]

log = logging.getLogger("shardflow.runtime.launch")

#: Seconds the spawner waits after the first failing rank before killing the others
#: (``SHARDFLOW_FAILURE_GRACE`` overrides it).
FAILURE_GRACE_S = 50.0


class LaunchError(ShardflowError):
    """Ranks could not be started, or a rank failed."""


@dataclasses.dataclass(frozen=True)
class LaunchEnv:
    """How this process was started.

    ``launched_by`` is ``mpi`` (mpiexec / srun with PMI), ``env`` (``RANK``/``WORLD_SIZE``
    variables: torchrun style or ``shardflow run``'s spawner) or ``single`` (no launcher).
    """

    launched_by: str
    rank: int
    size: int
    local_rank: int = 0
    local_size: int = 1
    master_addr: str | None = None
    master_port: int | None = None
    source: str = ""


def _int(environ: Mapping[str, str], *names: str) -> int | None:
    for n in names:
        v = environ.get(n)
        if v not in (None, ""):
            try:
                return int(v)
            except ValueError:
                raise LaunchError(f"environment variable {n}={v!r} is not an integer") from None
    return None


def detect_environment(environ: Mapping[str, str] | None = None) -> LaunchEnv:
    """Find this process's rank from the launcher's environment variables.

    Recognized: MPICH/Intel MPI (``PMI_RANK``, ``PMI_SIZE``), Open MPI
    (``OMPI_COMM_WORLD_RANK``...), MVAPICH, PMIx, Slurm's ``srun`` (``SLURM_PROCID``,
    ``SLURM_NTASKS``; through PMI unless ``MASTER_PORT`` is set) and torchrun-style ``RANK``,
    ``WORLD_SIZE``, ``LOCAL_RANK``, ``LOCAL_WORLD_SIZE``, ``MASTER_ADDR``, ``MASTER_PORT``.
    """
    e = os.environ if environ is None else environ
    addr = e.get("MASTER_ADDR") or None
    port = _int(e, "MASTER_PORT")
    for rank_var, size_var, local_var, lsize_var, what in (
            ("PMI_RANK", "PMI_SIZE", "MPI_LOCALRANKID", "MPI_LOCALNRANKS", "mpiexec (PMI)"),
            ("OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE", "OMPI_COMM_WORLD_LOCAL_RANK",
             "OMPI_COMM_WORLD_LOCAL_SIZE", "Open MPI"),
            ("MV2_COMM_WORLD_RANK", "MV2_COMM_WORLD_SIZE", "MV2_COMM_WORLD_LOCAL_RANK", "MV2_COMM_WORLD_LOCAL_SIZE",
             "MVAPICH"),
            ("PMIX_RANK", "PMIX_SIZE", "PMIX_LOCAL_RANK", "PMIX_LOCAL_SIZE", "PMIx")):
        r = _int(e, rank_var)
        n = _int(e, size_var)
        if r is not None and n is not None:
            return LaunchEnv("mpi", r, n, _int(e, local_var) or 0, _int(e, lsize_var) or 1, addr, port, what)
    r, n = _int(e, "SLURM_PROCID"), _int(e, "SLURM_NTASKS")
    if r is not None and n is not None and _int(e, "RANK") is None:
        by = "env" if port is not None else "mpi"
        return LaunchEnv(by, r, n, _int(e, "SLURM_LOCALID") or 0, _int(e, "SLURM_NTASKS_PER_NODE") or 1, addr, port,
                         "srun")
    r, n = _int(e, "RANK"), _int(e, "WORLD_SIZE")
    if r is not None and n is not None:
        return LaunchEnv("env", r, n, _int(e, "LOCAL_RANK") or 0, _int(e, "LOCAL_WORLD_SIZE") or n, addr, port,
                         "RANK/WORLD_SIZE variables")
    return LaunchEnv("single", 0, 1, source="no launcher")


def own_rank_dir(out_dir: str | os.PathLike, rank: int) -> Path:
    """The folder of global ``rank``'s program (of pipeline stages: its stage's; of shape variants: the
    first variant's, which every variant shares): what a launcher reads before it loads."""
    stages = read_pipeline(out_dir)
    if stages is not None:
        s, c = stage_of_rank(stages, rank)
        return rank_dir(Path(out_dir) / stages["stages"][s]["dir"], c)
    first = first_variant_dir(out_dir)
    return rank_dir(first, rank) if first == Path(out_dir) else own_rank_dir(first, rank)


def artifact_world_size(out_dir: str | os.PathLike) -> int:
    """The world size an out_dir was compiled for (from ``rank0/manifest.json``; an out_dir of shape
    variants: its first variant's, which every variant shares)."""
    if not Path(out_dir).is_dir():
        raise ArtifactError(f"out_dir {str(out_dir)!r} does not exist; compile the model first (`shardflow compile`)")
    stages = read_pipeline(out_dir)
    if stages is not None:
        for st in stages["stages"]:
            ranks = list_ranks(Path(out_dir) / st["dir"])
            if ranks != list(range(stages["stage_world_size"])):
                raise ArtifactError(f"{str(out_dir)!r}: stage folder {st['dir']!r} holds rank directories {ranks}, "
                                    f"not the stage's {stages['stage_world_size']}")
        return int(stages["world_size"])
    out = first_variant_dir(out_dir)
    if out != Path(out_dir):  # (shape variants: the first one's, which may be pipeline stages)
        return artifact_world_size(out)
    m = read_manifest(rank_dir(out, 0))
    n = int(m["world_size"])
    ranks = list_ranks(out)
    if ranks != list(range(n)):
        raise ArtifactError(f"{str(out_dir)!r} is compiled for {n} ranks but holds rank directories {ranks}")
    return n


# ---------------------------------------------------------------------------------------
# command line
# ---------------------------------------------------------------------------------------
def add_run_arguments(p: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """The flags of ``shardflow run`` (shared by ``shardflow`` and ``python -m shardflow.runtime.launch``)."""
    p.add_argument("out_dir", help="an out_dir written by `shardflow compile`")
    p.add_argument("--nproc", type=int, default=None,
                   help="number of ranks to start (default: the world size the out_dir was compiled for; must "
                        "equal it). Ignored when started under mpiexec/srun/torchrun, except that it must match")
    p.add_argument("--inputs", metavar="IN.npz", default=None,
                   help="the model inputs: an .npz keyed by the ONNX input names (every rank reads it whole)")
    p.add_argument("--outputs", metavar="OUT.npz", default=None,
                   help="where rank 0 writes the outputs, an .npz keyed by the ONNX output names (numpy "
                        "stores a bfloat16 output as void 'V2': view it with ml_dtypes.bfloat16, a float8 one as 'V1'; "
                        "an input read back that way is accepted)")
    p.add_argument("--backend", choices=("auto", "mpi", "tcp", "nccl"), default=None,
                   help="communicator: mpi (mpi4py), tcp (sockets), nccl (GPUs); default: the compiled comm_backend, "
                        "where auto means mpi under mpiexec, else tcp (nccl for cuda)")
    p.add_argument("--launcher", choices=("auto", "mpiexec", "spawn"), default=None,
                   help="how to start local ranks: mpiexec, or spawn (own processes, TCP rendezvous); default auto: "
                        "mpiexec when it and mpi4py are available (or $SHARDFLOW_LAUNCHER)")
    p.add_argument("--repeat", type=int, default=1, help="run the program this many times (timing; default 1)")
    p.add_argument("--warmup", type=int, default=0, help="untimed runs before the timed ones (default 0)")
    p.add_argument("--throughput", action="store_true",
                   help="after the timed runs, --repeat more back to back (pipeline stages: a stage takes the next "
                        "run while later stages finish this one) and print the time a run took on average, with "
                        "the median of single runs (each from a barrier to a barrier for pipeline stages)")
    p.add_argument("--profile", action="store_true",
                   help="after the timed runs, time every kernel and collective of every rank (--repeat runs, "
                        "stepping from Python; cuda: CUDA events between the steps) and print where the time goes")
    p.add_argument("--profile-json", metavar="FILE.json", default=None,
                   help="with --profile: also write every rank's step times to FILE.json (rank 0)")
    p.add_argument("--trace", metavar="FILE.json", default=None,
                   help="after the timed runs, trace --repeat more runs step by step on every rank (kernels, "
                        "collectives, a pipeline's sends and receives per microbatch) and write one timeline of all "
                        "ranks to FILE.json (rank 0), a Chrome trace that ui.perfetto.dev or chrome://tracing opens; "
                        "prints each rank's time in kernels and waiting on others")
    p.add_argument("--timeout", type=float, default=0.0,
                   help="kill every rank after this many seconds (default 0: no limit)")
    p.add_argument("--no-verify", action="store_true", help="skip the sha256 check of the artifact files")
    p.add_argument("--map-weights", action=argparse.BooleanOptionalAction, default=None,
                   help="map each rank's weights.bin (copy-on-write) instead of reading it into the rank's memory "
                        "(default: mapped for cuda artifacts, read for cpu ones; shardflow.runtime.load)")
    p.add_argument("-v", "--verbose", action="store_true", help="debug logging")
    return p


def _parser() -> argparse.ArgumentParser:
    return add_run_arguments(argparse.ArgumentParser(
        prog="shardflow run", description="Run a compiled out_dir on N ranks; rank 0 writes the outputs."))


class _RankFormatter(logging.Formatter):
    def __init__(self, rank: int | None):
        super().__init__("%(message)s")
        self.prefix = f"[rank {rank}] " if rank is not None else ""

    def format(self, record):
        msg = super().format(record)
        if record.levelno >= logging.WARNING and not msg.startswith("shardflow"):
            msg = f"{record.levelname.lower()}: {msg}"
        return self.prefix + msg


def _setup_logging(rank: int | None, verbose: bool) -> None:
    root = logging.getLogger("shardflow")
    for h in list(root.handlers):
        if getattr(h, "_shardflow_cli", False):
            root.removeHandler(h)
    h = logging.StreamHandler(sys.stderr)
    h._shardflow_cli = True
    h.setFormatter(_RankFormatter(rank))
    root.addHandler(h)
    root.setLevel(logging.DEBUG if verbose else logging.INFO)
    root.propagate = False


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of ``shardflow run``; returns the exit status."""
    argv = list(sys.argv[1:] if argv is None else argv)
    args = _parser().parse_args(argv)
    env = detect_environment()
    if env.launched_by != "single":
        _setup_logging(env.rank, args.verbose)
        return _worker(args, env)
    _setup_logging(None, args.verbose)
    try:
        world = artifact_world_size(args.out_dir)
        nproc = world if args.nproc is None else args.nproc
        if nproc != world:
            raise WorldSizeError(f"--nproc {nproc} does not match {args.out_dir!r}, which was compiled for {world} "
                                 f"ranks; run with --nproc {world} or compile again for {nproc} ranks")
        if args.inputs is not None and not Path(args.inputs).is_file():
            raise LaunchError(f"--inputs {args.inputs!r} does not exist")
    except ShardflowError as exc:
        log.error("%s", exc)
        return 2
    if nproc == 1:
        _setup_logging(0, args.verbose)
        return _worker(args, LaunchEnv("single", 0, 1, source="single process"))
    return _spawn(args, argv, nproc)


# ---------------------------------------------------------------------------------------
# parent: start N ranks
# ---------------------------------------------------------------------------------------
def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _use_mpiexec(launcher: str | None, backend: str | None) -> str | None:
    choice = launcher or os.environ.get("SHARDFLOW_LAUNCHER", "auto")
    if choice not in ("auto", "mpiexec", "spawn"):
        raise LaunchError(f"SHARDFLOW_LAUNCHER={choice!r}: use auto, mpiexec or spawn")
    if choice == "spawn":
        return None
    exe = shutil.which("mpiexec")
    try:
        import importlib.util

        has_mpi4py = importlib.util.find_spec("mpi4py") is not None
    except (ImportError, ValueError):
        has_mpi4py = False
    if choice == "mpiexec" and (exe is None or not has_mpi4py):
        raise LaunchError("--launcher mpiexec: " + ("mpiexec is not on PATH" if exe is None else
                                                    "mpi4py is not installed (pip install 'shardflow[mpi]')"))
    if backend == "tcp" and choice == "auto":
        return None
    return exe if has_mpi4py else None


def _allowed_cpus() -> list[int]:
    """The CPUs this process may run on (its affinity mask: a container's cpuset, a launcher's
    binding), else all of them."""
    try:
        return sorted(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return list(range(os.cpu_count() or 1))


def _threads_per_rank(nproc: int) -> str:
    """The default ``OMP_NUM_THREADS`` of ``nproc`` ranks sharing this process's CPUs (its affinity
    mask's, not the machine's: in a container given 4 of 64 cores, 64 // nproc threads a rank would
    oversubscribe them 16 times)."""
    return str(max(1, len(_allowed_cpus()) // nproc))


def _topology_key(cpu: int) -> tuple[int, int, int]:
    """(socket, core, cpu) from sysfs: the CPUs in this order make contiguous slices whole cores of one
    socket (Linux numbers a core's hardware threads apart, e.g. 0-15 the cores' first threads and
    16-31 their second: slices of the sorted numbers would put two ranks on every core); (0, cpu,
    cpu) where sysfs does not say."""
    base = f"/sys/devices/system/cpu/cpu{cpu}/topology/"
    try:
        with open(base + "physical_package_id") as f:
            package = int(f.read())
        with open(base + "core_id") as f:
            core = int(f.read())
    except (OSError, ValueError):
        return 0, cpu, cpu
    return package, core, cpu


#: the starter's CPUs (comma-separated), for the ranks it starts on this machine to share out
_CPUS_ENV = "SHARDFLOW_CPUS"


def _bind_to_share(local_rank: int, local_size: int) -> list[int] | None:
    """Bind this rank (and the threads it starts later) to its share of the CPUs its starter
    (``start_ranks``) had: ``local_size`` contiguous slices of them, this rank's the
    ``local_rank``-th, so that ranks on one machine do not take each other's cores (their OpenMP
    threads spin while they wait). Only where the starter recorded its CPUs (``SHARDFLOW_CPUS``),
    there are at least as many as ranks, ``SHARDFLOW_BIND`` is not ``0``, and nothing narrowed this
    process's mask since (an ``mpiexec`` binding its ranks itself). Returns the CPUs bound to, or
    ``None``."""
    given = os.environ.get(_CPUS_ENV)
    if not given or os.environ.get("SHARDFLOW_BIND", "1") == "0" or local_size < 2:
        return None
    try:
        cpus = sorted(int(c) for c in given.split(","))
    except ValueError:
        return None
    if len(cpus) < local_size or not 0 <= local_rank < local_size or _allowed_cpus() != cpus:
        return None
    cpus = sorted(cpus, key=_topology_key)
    share = len(cpus) // local_size
    mine = sorted(cpus[local_rank * share:(local_rank + 1) * share])
    try:
        os.sched_setaffinity(0, mine)
    except (AttributeError, OSError) as exc:
        log.debug("rank %d: cannot bind to CPUs %s (%s)", local_rank, mine, exc)
        return None
    return mine


def _spawn(args, argv: list[str], nproc: int) -> int:
    return start_ranks("shardflow.runtime.launch", argv, nproc, launcher=args.launcher, backend=args.backend,
                       timeout=args.timeout)


def start_ranks(module: str, argv: Sequence[str], nproc: int, *, launcher: str | None = None,
                backend: str | None = None, timeout: float = 0.0) -> int:
    """Start ``nproc`` local ranks of ``python -m module *argv`` and wait for them.

    ``launcher`` is ``auto`` (mpiexec when it and mpi4py are installed, else own processes with a
    TCP rendezvous through ``RANK``/``WORLD_SIZE``/``MASTER_PORT``), ``mpiexec`` or ``spawn``;
    ``None`` reads ``$SHARDFLOW_LAUNCHER``. A ``backend`` of ``tcp`` under ``auto`` spawns.
    Every rank is killed after ``timeout`` seconds (0: no limit), and the others shortly after
    one fails. Returns the exit status (0 when every rank succeeded).
    """
    try:
        mpiexec = _use_mpiexec(launcher, backend)
        grace = number_from_env("SHARDFLOW_FAILURE_GRACE", FAILURE_GRACE_S, "seconds", LaunchError)
    except LaunchError as exc:
        log.error("%s", exc)
        return 2
    child = [sys.executable, "-m", module, *argv]
    base_env = dict(os.environ)
    base_env.setdefault("OMP_NUM_THREADS", _threads_per_rank(nproc))
    base_env[_CPUS_ENV] = ",".join(map(str, _allowed_cpus()))
    for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE"):
        base_env.pop(k, None)
    deadline = time.monotonic() + timeout if timeout > 0 else None
    if mpiexec is not None:
        return _run_mpiexec(mpiexec, nproc, child, base_env, deadline, timeout, grace)
    port = _free_port()
    procs = []
    for r in range(nproc):
        env = dict(base_env, RANK=str(r), WORLD_SIZE=str(nproc), LOCAL_RANK=str(r), LOCAL_WORLD_SIZE=str(nproc),
                   MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
        procs.append(subprocess.Popen(child, env=env, start_new_session=True))
    log.debug("spawned %d ranks (pids %s), rendezvous at 127.0.0.1:%d", nproc, [p.pid for p in procs], port)
    return _supervise(procs, deadline, timeout, grace)


@functools.lru_cache(maxsize=8)
def _is_hydra(mpiexec: str) -> bool:
    """Whether ``mpiexec`` is MPICH's hydra (which takes ``-disable-auto-cleanup``). Decided from
    the file names first (``mpiexec.hydra`` beside it, as MPICH installs it): asking
    ``mpiexec --version`` can be slow on a loaded machine, and a wrong answer lets hydra kill every
    rank before the watchdog names the one that failed."""
    real = os.path.realpath(mpiexec)
    if "hydra" in os.path.basename(real) or os.path.exists(os.path.join(os.path.dirname(real), "mpiexec.hydra")):
        return True
    try:
        out = subprocess.run([mpiexec, "--version"], capture_output=True, text=True, timeout=60)
    except (OSError, subprocess.SubprocessError) as exc:
        log.warning("cannot tell which MPI runs %s (%s); assuming it is not MPICH's hydra", mpiexec, exc)
        return False
    return "HYDRA" in out.stdout + out.stderr


def _pid_alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(")")[-1].split()[0] != "Z"
    except OSError:
        try:
            os.kill(pid, 0)
        except (ProcessLookupError, PermissionError):
            return False
        return True


def _run_mpiexec(mpiexec: str, nproc: int, child: list[str], env: dict, deadline: float | None,
                 timeout: float, grace: float) -> int:
    """Run the ranks under mpiexec. With MPICH's hydra, automatic cleanup is off so that the
    ranks' watchdog reports which rank failed; the ranks' pids (written to a folder) let this
    process kill any rank still alive ``SHARDFLOW_FAILURE_GRACE`` seconds after the first failure."""
    import tempfile

    pid_dir = tempfile.mkdtemp(prefix="shardflow-pids-")
    env = dict(env, SHARDFLOW_PID_DIR=pid_dir)
    cmd = [mpiexec, *(["-disable-auto-cleanup"] if _is_hydra(mpiexec) else []), "-n", str(nproc), *child]
    log.debug("starting %s", " ".join(cmd))
    proc = subprocess.Popen(cmd, env=env, start_new_session=True)
    pids: dict[int, int] = {}
    first_dead: tuple[int | None, float] | None = None  # (rank, when) of the first rank seen failed
    gone_at: float | None = None  # when a rank was first seen gone, for whatever reason but done

    def kill_all():
        for pid in pids.values():
            try:
                os.kill(pid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass
        _kill_group(proc)

    try:
        while proc.poll() is None:
            for name in os.listdir(pid_dir):
                if name.startswith("rank") and name.endswith(".pid"):
                    r = int(name[4:-4])
                    if r not in pids:
                        try:
                            pids[r] = int(Path(pid_dir, name).read_text() or 0)
                        except (OSError, ValueError):
                            pass
            now = time.monotonic()
            gone = [r for r, pid in pids.items()
                    if pid and not _pid_alive(pid) and not Path(pid_dir, f"rank{r}.done").exists()]
            if gone and gone_at is None:  # (the ranks that stop for a hung peer leave it alive: it is killed too)
                gone_at = now
            if first_dead is None:  # (a rank that left because of a peer, by its record, is no cause)
                dead = [r for r in gone if not _left_for_peer(pid_dir, r)]
                if dead:  # several found gone at once: which went first is unknown (None)
                    first_dead = (dead[0] if len(dead) == 1 else None, now)
            if gone_at is not None and now - gone_at > grace:
                log.error("shardflow run: killing the ranks still alive %g s after %s", grace,
                          "a rank stopped" if first_dead is None or first_dead[0] is None
                          else f"rank {first_dead[0]} failed")
                kill_all()
            if deadline is not None and now > deadline:
                log.error("shardflow run: --timeout %g s passed; killing the ranks", timeout)
                kill_all()
                proc.wait()
                return 124
            time.sleep(0.05)
        if proc.returncode != 0:
            failed = _failed_rank(pid_dir)
            if failed is None and first_dead is not None:
                failed = first_dead[0]  # None when the ranks were found gone together
            log.error("shardflow run: mpiexec exited with status %d%s", proc.returncode,
                      f"; rank {failed} failed first" if failed is not None
                      else " (a rank failed; see its messages above)")
    except KeyboardInterrupt:
        kill_all()
        proc.wait()
        return 130
    finally:
        shutil.rmtree(pid_dir, ignore_errors=True)
    return proc.returncode


def _kill_group(proc: subprocess.Popen, sig=signal.SIGKILL) -> None:
    try:
        os.killpg(proc.pid, sig)
    except (ProcessLookupError, PermissionError):
        try:
            proc.send_signal(sig)
        except ProcessLookupError:
            pass


def _describe_status(rc: int) -> str:
    if rc < 0:
        try:
            return f"was killed by signal {signal.Signals(-rc).name}"
        except ValueError:
            return f"was killed by signal {-rc}"
    return f"exited with status {rc}"


def _supervise(procs: list[subprocess.Popen], deadline: float | None, timeout: float, grace: float) -> int:
    from .comm.watchdog import EXIT_PEER_FAILED

    ended: list[tuple[int, int]] = []  # (rank, status) in the order the failures were seen
    first_at: float | None = None
    try:
        while True:
            running = 0
            for r, p in enumerate(procs):
                rc = p.poll()
                if rc is None:
                    running += 1
                elif rc != 0 and all(r != k for k, _ in ended):
                    ended.append((r, rc))
                    first_at = first_at or time.monotonic()
            if not running:
                break
            now = time.monotonic()
            if first_at is not None and now - first_at > grace:
                log.error("shardflow run: killing the ranks still alive %g s after the first failure", grace)
                for p in procs:
                    if p.poll() is None:
                        _kill_group(p)
            if deadline is not None and now > deadline:
                log.error("shardflow run: --timeout %g s passed; killing the ranks", timeout)
                for p in procs:
                    if p.poll() is None:
                        _kill_group(p)
                for p in procs:
                    p.wait()
                return 124
            time.sleep(0.05)
    except KeyboardInterrupt:
        for p in procs:
            if p.poll() is None:
                _kill_group(p)
        return 130
    if not ended:
        return 0
    # the cause: the first rank that failed on its own (not because a peer failed)
    causes = [(r, rc) for r, rc in ended if rc != EXIT_PEER_FAILED] or ended
    r, rc = causes[0]
    others = [f"rank {k} {_describe_status(p.returncode)}" for k, p in enumerate(procs) if k != r]
    log.error("shardflow run: rank %d %s; %s", r, _describe_status(rc), "; ".join(others))
    return rc if rc > 0 else 128 - rc


# ---------------------------------------------------------------------------------------
# one rank
# ---------------------------------------------------------------------------------------
def _record_exit(pid_dir: str | None, rank: int, why: str) -> None:
    """``rank{r}.exit`` in the launcher's folder: why this rank leaves (``peer N``: rank N failed;
    ``error``: its own error). A rank killed by a signal leaves none."""
    if pid_dir:
        try:
            Path(pid_dir, f"rank{rank}.exit").write_text(why)
        except OSError:
            pass


def _left_for_peer(pid_dir: str, rank: int) -> bool:
    """Whether ``rank``'s exit record says it left because a peer failed."""
    try:
        return Path(pid_dir, f"rank{rank}.exit").read_text().startswith("peer")
    except OSError:
        return False


def _failed_rank(pid_dir: str) -> int | None:
    """The rank that failed first, from the ranks' exit records: the one the others name (not counting
    names of ranks that themselves left because of a peer: rank 0 leaves on rank 1's death, ranks 2
    and 3 then may see rank 0 gone first), else the one that left with its own error, else the only
    one that left no record (killed)."""
    named: dict[int, int] = {}
    followers: set[int] = set()  # ranks that left because of a peer
    errors, silent = [], []
    started = sorted(int(n[4:-4]) for n in os.listdir(pid_dir) if n.startswith("rank") and n.endswith(".pid"))
    for r in started:
        try:
            why = Path(pid_dir, f"rank{r}.exit").read_text().split()
        except OSError:
            if not Path(pid_dir, f"rank{r}.done").exists():
                silent.append(r)
            continue
        if why[:1] == ["peer"] and len(why) > 1 and why[1].lstrip("-").isdigit():
            named[int(why[1])] = named.get(int(why[1]), 0) + 1
            followers.add(r)
        elif why[:1] == ["error"]:
            errors.append(r)
    causes = {r: n for r, n in named.items() if r not in followers} or named
    if causes:
        return max(causes, key=causes.get)
    if errors:
        return errors[0]
    return silent[0] if len(silent) == 1 else None


def _die(message: str, code: int = 1, hard: bool = True) -> int:
    """Log, then leave at once when other ranks exist (no MPI_Finalize that could wait for ranks
    stuck in a collective); a single process just returns ``code``."""
    log.error("%s", message)
    if not hard:
        return code
    for h in logging.getLogger("shardflow").handlers:
        h.flush()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def _worker(args, env: LaunchEnv) -> int:
    from .comm import RankFailedError, create_world, host_communicator

    hard = env.size > 1 or env.launched_by == "mpi"
    from .comm.watchdog import EXIT_PEER_FAILED, Watchdog
    from .executor import load

    try:
        world = artifact_world_size(args.out_dir)
        if env.size != world:
            raise WorldSizeError(f"{args.out_dir!r} was compiled for {world} ranks but {env.size} were started "
                                 f"({env.source}); start exactly {world}")
        if args.nproc is not None and args.nproc != env.size:
            raise WorldSizeError(f"--nproc {args.nproc} but {env.size} ranks were started ({env.source})")
        manifest = read_manifest(own_rank_dir(args.out_dir, env.rank))
        inputs = _read_inputs(args.inputs)
    except ShardflowError as exc:
        return _die(f"rank {env.rank}: {exc}", 2, hard)
    pid_dir = os.environ.get("SHARDFLOW_PID_DIR")
    if pid_dir:
        try:
            Path(pid_dir, f"rank{env.rank}.pid").write_text(str(os.getpid()))
        except OSError:
            pid_dir = None
    if "OMP_NUM_THREADS" not in os.environ:
        os.environ["OMP_NUM_THREADS"] = _threads_per_rank(max(env.local_size, 1))
    bound = _bind_to_share(env.local_rank, env.local_size)
    if bound is not None:
        log.debug("rank %d: bound to CPUs %s", env.rank, bound)
    backend = args.backend or manifest.get("comm_backend", "auto")
    try:
        comm = create_world(backend, launched_by=env.launched_by, rank=env.rank, size=env.size,
                            target=manifest["target"], master_addr=env.master_addr, master_port=env.master_port,
                            local_rank=env.local_rank)
    except ShardflowError as exc:
        return _die(f"rank {env.rank}: cannot connect the ranks: {exc}", 1, hard)
    def on_peer_failure(message: str, failed: int | None) -> None:
        # leave a record for the launcher (which cannot see the ranks' exit codes under mpiexec)
        _record_exit(pid_dir, env.rank, f"peer {failed}" if failed is not None else "peer")
        from .comm.watchdog import _default_fail
        _default_fail(message, failed)

    watchdog = Watchdog(host_communicator(comm), on_failure=on_peer_failure)
    try:
        prog = load(args.out_dir, env.rank, comm, verify=not args.no_verify, map_weights=args.map_weights)
        for _ in range(max(args.warmup, 0)):
            prog.run(inputs)
        times = []
        outs = {}
        # pipeline stages: a rank's run returns once its stage is done, and the next run's first stage
        # would overlap the last's; each run is timed from a barrier to a barrier (one run's latency)
        staged = isinstance(prog, PipelineProgram) or getattr(prog, "staged", False)
        fence = host_communicator(comm).barrier if staged and env.size > 1 else None
        for _ in range(max(args.repeat, 1)):
            if fence:
                fence()
            t0 = time.perf_counter()
            outs = prog.run(inputs)
            if fence:
                fence()
            times.append(time.perf_counter() - t0)
        stream = None
        if args.throughput:  # back to back, one barrier at the end: the runs' pace, not one run's time
            world = host_communicator(comm)
            if env.size > 1:
                world.barrier()
            t0 = time.perf_counter()
            for _ in range(max(args.repeat, 1)):
                outs = prog.run(inputs)
            if env.size > 1:
                world.barrier()
            stream = (time.perf_counter() - t0) / max(args.repeat, 1)
        ran = _ran(prog)
        if isinstance(ran, PipelineProgram):  # (each output from the stage making it)
            full = ran.gather_outputs(outs)
        else:
            full = _assemble_outputs(ran.out_dir, ran, host_communicator(comm), outs)
        if env.rank == 0:
            med = float(np.median(times)) * 1e3
            log.info("ran %s on %d rank(s): %d run(s), median %.3f ms", ran.out_dir, env.size, len(times), med)
            if stream is not None:
                log.info("back to back: %.3f ms a run (%.1f runs/s), against a single run's median %.3f ms",
                         stream * 1e3, 1.0 / stream if stream else float("inf"), med)
            if args.outputs:
                _write_npz(args.outputs, full)
                log.info("wrote %s (%s)", args.outputs,
                         ", ".join(f"{k}: {list(v.shape)} {v.dtype}" for k, v in full.items()))
        if args.profile or args.profile_json:
            _profile(args, prog, host_communicator(comm), inputs, env.rank)
        if args.trace:
            _trace(args, prog, host_communicator(comm), inputs, env.rank)
    except RankFailedError as exc:
        # the watchdog usually knows the root cause (the rank that died first): give it a moment
        deadline = time.monotonic() + 3.0
        while time.monotonic() < deadline:
            time.sleep(0.05)
        _record_exit(pid_dir, env.rank, f"peer {exc.rank}" if getattr(exc, "rank", None) is not None else "peer")
        return _die(f"rank {env.rank}: {exc}", EXIT_PEER_FAILED, hard)
    except ShardflowError as exc:
        _record_exit(pid_dir, env.rank, "error")
        return _die(f"rank {env.rank}: {type(exc).__name__}: {exc}", 1, hard)
    except Exception as exc:  # noqa: BLE001 - a rank must never leave the others waiting
        log.exception("rank %d: unexpected error", env.rank)
        _record_exit(pid_dir, env.rank, "error")
        return _die(f"rank {env.rank}: {type(exc).__name__}: {exc}", 1, hard)
    watchdog.finish()
    prog.close()
    comm.close()
    if pid_dir:
        try:
            Path(pid_dir, f"rank{env.rank}.done").write_text("")
        except OSError:
            pass
    return 0


def _ran(prog):
    """The program that ran: ``prog`` itself, or of shape variants the one the inputs' shapes chose (a
    :class:`RankProgram` or, for a variant of pipeline stages, a :class:`PipelineProgram`)."""
    if isinstance(prog, PipelineProgram):
        return prog
    return getattr(prog, "last", None) or prog


def _profile(args, prog, host, inputs: dict, rank: int) -> None:
    """Every rank times its steps; rank 0 prints the report (and writes ``--profile-json``)."""
    import json

    from .profile import format_profile, memory_record

    repeat = max(args.repeat, 1)
    steps = prog.profile(inputs, repeat=repeat, warmup=1)
    ran = _ran(prog)
    stages = ran.spec if isinstance(ran, PipelineProgram) else None
    # (of a stage keeping states with microbatches, every instance's arena, their weights held once)
    progs = ran.instances if isinstance(ran, PipelineProgram) else [ran]
    memory = memory_record(progs[0])
    for other in map(memory_record, progs[1:]):
        memory.update({k: memory[k] + other[k] for k in ("arena", "weights") if None not in (memory[k], other[k])})
    record = {"steps": steps, "memory": memory}
    gathered = [json.loads(b) for b in host.allgather_bytes(json.dumps(record).encode())]
    if rank != 0:
        return
    per_rank, memory = [g["steps"] for g in gathered], [g["memory"] for g in gathered]

    def plan_of(folder) -> dict | None:
        try:
            return json.loads(Path(folder, "plan.json").read_text())
        except (OSError, ValueError):
            return None
    if stages is None:
        log.info("%s", format_profile(per_rank, repeat, plan=plan_of(ran.out_dir), memory=memory))
    else:  # each stage's ranks run their own program: a report per stage, beside its own plan
        for s, (st, ranks) in enumerate(zip(stages["stages"], stage_ranks(stages))):
            log.info("== stage %d (ranks %s; its ranks numbered from 0; a microbatch's run)\n%s", s,
                     f"{ranks[0]}-{ranks[-1]}" if ranks == list(range(ranks[0], ranks[-1] + 1)) else ranks,
                     format_profile([per_rank[r] for r in ranks], repeat, plan=plan_of(Path(ran.out_dir, st["dir"])),
                                    memory=[memory[r] for r in ranks]))
    if args.profile_json:
        write_json(args.profile_json, {"out_dir": str(args.out_dir), "repeat": repeat, "ranks": per_rank,
                                       "memory": memory})
        log.info("wrote %s", args.profile_json)


def _trace(args, prog, host, inputs: dict, rank: int) -> None:
    """Every rank traces ``--repeat`` runs from a barrier (its events' times from the moment it left it:
    ranks leave a barrier within microseconds of each other, on one machine or several); rank 0 writes
    the Chrome trace and logs the ranks' time in kernels and waiting."""
    import json

    from .profile import chrome_trace, format_trace_summary

    runs = max(args.repeat, 1)
    prog.run(inputs)  # (a warm run: the traced ones start alike on every rank)
    host.barrier()
    origin = time.perf_counter_ns()
    events = prog.trace(inputs, runs=runs, warmup=0)
    for e in events:
        e["start_ns"] -= origin
        e["end_ns"] -= origin
    ran = _ran(prog)
    where = (f"stage {ran.stage}'s rank {stage_of_rank(ran.spec, rank)[1]}"
             if isinstance(ran, PipelineProgram) else "")
    record = {"events": events, "label": f"rank {rank}" + (f" ({where})" if where else "")}
    gathered = [json.loads(b) for b in host.allgather_bytes(json.dumps(record).encode())]
    if rank != 0:
        return
    per_rank = [g["events"] for g in gathered]
    write_json(args.trace, chrome_trace(per_rank, [g["label"] for g in gathered],
                                        {"out_dir": str(ran.out_dir), "runs": runs}))
    log.info("trace of %d run(s) from a barrier (ms; waiting: collectives and a pipeline's sends and receives, "
             "including the wait for the other ranks)\n%s", runs, format_trace_summary(per_rank))
    log.info("wrote %s (open it in ui.perfetto.dev or chrome://tracing)", args.trace)


def _read_inputs(path: str | None) -> dict[str, np.ndarray]:
    if path is None:
        return {}
    try:
        with np.load(path, allow_pickle=False) as z:
            return {k: z[k] for k in z.files}
    except FileNotFoundError:
        raise LaunchError(f"--inputs {path!r} does not exist") from None
    except (ValueError, OSError) as exc:
        raise LaunchError(f"--inputs {path!r} is not a readable .npz file ({exc})") from None


def _write_npz(path: str, arrays: dict[str, np.ndarray]) -> None:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}.npz")
    np.savez(tmp, **arrays)
    os.replace(tmp, path)


_PLACEMENT = re.compile(r"S\((\d+)\)|R|P\((\w+)\)")


def _placements(text: str) -> list[tuple[str, str | None]]:
    """``"S(0)P(sum)R"`` → ``[("S", "0"), ("P", "sum"), ("R", None)]`` (one per mesh axis)."""
    res, pos = [], 0
    for m in _PLACEMENT.finditer(text or ""):
        if m.start() != pos:
            break
        pos = m.end()
        res.append(("S", m.group(1)) if m.group(1) is not None else ("P", m.group(2)) if m.group(2) else ("R", None))
    if pos != len(text or ""):
        raise LaunchError(f"cannot read the output placement {text!r} in the manifest")
    return res


def _assemble_outputs(out_dir: str, prog, comm, outs: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """Rank 0 gets every output whole: replicated outputs as they are, sharded ones from the
    ranks holding distinct pieces (``bounds`` in the manifests), Partial ones (pending a sum, max,
    min or average over some mesh axes) reduced over the ranks along those axes, in rank order."""
    specs = {o["name"]: o for o in prog.manifest["outputs"]}
    todo = [n for n in prog.output_names
            if n in specs and ("P(" in specs[n].get("placement", "")
                               or (specs[n].get("bounds") is not None
                                   and [list(b) for b in specs[n]["bounds"]] != [[0, d] for d in specs[n]["global_shape"]]))]
    if not todo or prog.world_size == 1:
        return outs
    from .comm.base import reduce_stacked  # member order, as the compiler's oracle

    manifests = [read_manifest(rank_dir(out_dir, r)) for r in range(prog.world_size)]
    res = dict(outs)
    for n in todo:
        spec0 = specs[n]
        axes = _placements(spec0.get("placement", ""))
        partial = [(a, op) for a, (kind, op) in enumerate(axes) if kind == "P"]
        ops = {op for _, op in partial}
        if len(ops) > 1:
            raise LaunchError(f"output {n!r} is Partial with several reductions ({spec0['placement']}); "
                              "`shardflow run` reduces one kind at a time")
        # the ranks whose blocks rank 0 needs: coordinate 0 along replicated axes; for each box,
        # every rank along the partial axes, in rank order
        boxes: dict[tuple, list[int]] = {}
        for r, m in enumerate(manifests):
            coord = m["mesh"]["coord"]
            if any(kind == "R" and coord[a] != 0 for a, (kind, _) in enumerate(axes)):
                continue
            spec = next(o for o in m["outputs"] if o["name"] == n)
            boxes.setdefault(tuple(tuple(b) for b in spec["bounds"]), []).append(r)
        if not partial:
            boxes = {box: rs[:1] for box, rs in boxes.items()}
        needed = sorted({r for rs in boxes.values() for r in rs})
        if prog.rank == 0:
            full = np.empty(spec0["global_shape"], np.dtype(outs[n].dtype))
            recvs = {r: np.empty(tuple(b - a for a, b in box), full.dtype)
                     for box, rs in boxes.items() for r in rs if r != 0}
            comm.exchange({}, recvs)
            op = next(iter(ops)) if ops else None
            for box, rs in boxes.items():
                blocks = [outs[n] if r == 0 else recvs[r] for r in rs]
                full[tuple(slice(a, b) for a, b in box)] = reduce_stacked(blocks, op) if op else blocks[0]
            res[n] = full
        elif prog.rank in needed:
            comm.exchange({0: np.ascontiguousarray(outs[n])}, {})
    return res


if __name__ == "__main__":
    sys.exit(main())
