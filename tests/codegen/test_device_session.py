"""benchmarks/gpu/device_session.sh cannot rot between leases of a GPU: every mode runs here with
stand-ins for ``python3``, ``nvidia-smi`` and ``ncu`` that record what they are asked to run
(and succeed); it must leave at most 8 files in ``$OUT`` (what the device tool brings back), each
recorded benchmark command must parse with its script's own argument parser, and (``-m slow``)
each recorded pytest command's selection must collect tests. A renamed flag, test or file, or a
shell error (an unset variable under ``set -u``), would otherwise show only on the GPU machine,
whose device time a task gets rarely and for 15 minutes.

The script itself writes under ``/tmp`` (``/tmp/pkg``, ``/tmp/sf-export``: its fixed places on the
device machine), as it does there; the lease's stage is moved into the test's folder."""
from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import tarfile

import pytest

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", ".."))
SCRIPT = os.path.join(ROOT, "benchmarks", "gpu", "device_session.sh")

pytestmark = pytest.mark.skipif(shutil.which("bash") is None or shutil.which("timeout") is None,
                                reason="needs bash and timeout")

# each call: its arguments separated by \x1f, the call ended by \x1e; `python3 -` reads its script;
# pytest "passes" (the cluster step times the tiles only after its tests passed); the files a
# benchmark writes are made (`--json FILE`; run_all.py's results JSON and TXT in `--out-dir`)
_FAKE_PYTHON = r"""#!/usr/bin/env bash
printf '%s\x1f' "$@" >> "$SF_FAKE_LOG"; printf '\x1e' >> "$SF_FAKE_LOG"
case "$1" in
    -) cat > /dev/null ;;
    -m) [ "$2" = pytest ] && echo "3 passed in 0.1s" ;;
esac
while [ $# -gt 1 ]; do
    case "$1" in
        --json) echo "{}" > "$2" ;;
        --out-dir) echo "{}" > "$2/stand-in-gpu.json"; echo > "$2/stand-in-gpu.txt" ;;
    esac
    shift
done
exit 0
"""
# Nsight Compute runs the command after its flags
_FAKE_NCU = r"""#!/usr/bin/env bash
while [ $# -gt 0 ] && [ "$1" != python3 ]; do shift; done
exec "$@"
"""

# parses every recorded script call with the script's own parser (stopping right after it), in one
# process: [[call, why], ...] for those that do not parse
_PARSE_ONLY = r"""
import argparse, contextlib, io, json, runpy, sys

class Parsed(Exception):
    pass

parse_args = argparse.ArgumentParser.parse_args

def parse_only(self, args=None, namespace=None):
    parse_args(self, args, namespace)
    raise Parsed

argparse.ArgumentParser.parse_args = parse_only
bad = []
for call in json.load(sys.stdin):
    sys.argv, err = list(call), io.StringIO()
    try:
        with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
            runpy.run_path(call[0], run_name="__main__")
        bad.append([call, "returned without parsing its arguments"])
    except Parsed:
        pass
    except SystemExit as e:
        bad.append([call, f"exit {e.code}: {err.getvalue().strip()[-400:]}"])
    except Exception as e:
        bad.append([call, f"{type(e).__name__}: {e}"])
json.dump(bad, sys.stdout)
"""


def _modes() -> list[str]:
    """The script's modes (its ``case`` labels), but ``run`` (any command)."""
    with open(SCRIPT) as f:
        return [m for m in re.findall(r"^    ([a-z0-9]+)\)", f.read(), re.M) if m != "run"]


@pytest.fixture(scope="module")
def session_calls(tmp_path_factory) -> dict[str, list[list[str]]]:
    """Every mode's recorded ``python3`` calls, each mode run to its end (``LEASE_S`` large, so that
    every step of ``lease`` starts); fails on a shell error."""
    tmp = tmp_path_factory.mktemp("device_session")
    bin_dir = tmp / "bin"
    bin_dir.mkdir()
    for name, text in (("python3", _FAKE_PYTHON), ("ncu", _FAKE_NCU),
                       ("nvidia-smi", "#!/bin/sh\necho 'Stand-in GPU, 0.0, 0 MiB'\n")):
        (bin_dir / name).write_text(text)
        (bin_dir / name).chmod(0o755)
    calls = {}
    for mode in _modes():
        log = tmp / f"{mode}.log"
        env = dict(os.environ, PATH=f"{bin_dir}{os.pathsep}{os.environ['PATH']}", SF_FAKE_LOG=str(log),
                   OUT=str(tmp / f"out-{mode}"), LEASE_S="100000", SF_LEASE_STAGE=str(tmp / "stage"))
        proc = subprocess.run(["bash", SCRIPT, mode], cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)
        errors = [ln for ln in proc.stderr.splitlines()
                  if re.search(r"unbound variable|syntax error|command not found|bad substitution|No such file", ln)]
        assert not errors, f"device_session.sh {mode}: {errors}"
        records = log.read_text().split("\x1e")[:-1] if log.exists() else []
        calls[mode] = [r.split("\x1f")[:-1] for r in records]
        # the device tool brings back at most 8 files from $OUT (the lease packs the rest: pack_lease)
        back = [p for p in (tmp / f"out-{mode}").rglob("*") if p.is_file()]
        assert len(back) <= 8, f"device_session.sh {mode} leaves {len(back)} files in $OUT: {sorted(back)}"
        if mode == "lease":
            with tarfile.open(tmp / "out-lease" / "lease-more.tar.gz") as t:
                packed = set(t.getnames())
            assert {"gemm-cluster.txt", "models-tiles.txt", "gemm-kmajor.txt", "profile.txt"} <= packed, packed
            assert {p.name for p in back} == {"gpu-suite.txt", "bench.txt", "stand-in-gpu.json", "stand-in-gpu.txt",
                                              "lease-more.tar.gz"}, back
        # (each mode runs something past the runtime's native library)
        assert len(calls[mode]) > 1, f"device_session.sh {mode} ran {calls[mode]} ({proc.stderr[-300:]})"
    return calls


def test_every_benchmark_command_of_the_device_session_parses(session_calls):
    """Each ``python3 benchmarks/gpu/X.py ARGS`` any mode runs (the lease's 28 calls among them) is
    accepted by X's argument parser: flags that exist, values of their types and choices."""
    scripts = [c for cs in session_calls.values() for c in cs if c and c[0].endswith(".py")]
    unique = [list(c) for c in dict.fromkeys(map(tuple, scripts))]
    assert {os.path.basename(c[0]) for c in unique} >= {"run_all.py", "gemm.py", "models.py", "kernel_profile.py"}
    for c in unique:
        assert os.path.exists(os.path.join(ROOT, c[0])), c
    proc = subprocess.run([sys.executable, "-c", _PARSE_ONLY], cwd=ROOT, input=json.dumps(unique),
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    bad = json.loads(proc.stdout)
    assert not bad, "\n".join(f"{' '.join(c)}: {why}" for c, why in bad)


def _pytest_selections(session_calls) -> list[tuple[str, ...]]:
    out = []
    for cs in session_calls.values():
        for c in cs:
            if c[:2] == ["-m", "pytest"]:
                args = c[2:]
                if "-n" in args:  # (xdist's workers: not needed to collect)
                    i = args.index("-n")
                    del args[i:i + 2]
                out.append(tuple(args))
    return list(dict.fromkeys(out))


@pytest.mark.slow
def test_every_test_selection_of_the_device_session_collects_tests(session_calls):
    """Each pytest command any mode runs (``-m gpu`` and a ``-k`` expression over named files)
    selects at least one test: a renamed test or file would leave a lease's step running nothing."""
    selections = _pytest_selections(session_calls)
    assert len(selections) >= 8
    for args in selections:
        proc = subprocess.run([sys.executable, "-m", "pytest", "--collect-only", "-q", *args], cwd=ROOT,
                              capture_output=True, text=True, timeout=300)
        # (-q once more than the command's: "file.py: N" a file, or with none of its own, a node id a line)
        counts = [int(n) for n in re.findall(r"^\S+\.py: (\d+)$", proc.stdout, re.M)]
        nodes = re.findall(r"^\S+\.py::\S", proc.stdout, re.M)
        assert proc.returncode == 0 and (sum(counts) or len(nodes)), f"pytest {' '.join(args)}: {proc.stdout[-500:]}"
