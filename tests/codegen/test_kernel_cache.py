"""The kernel cache's upkeep: what `shardflow cache` finds, prunes and clears, and hits that keep an entry's
last use (compiler/codegen/cache.py)."""
import ctypes
import json
import os
import time

import pytest

from shardflow.compiler import cli
from shardflow.compiler.codegen import build_cpu_library, cache, toolchain
from shardflow.compiler.codegen.lower import CodegenError
from shardflow.compiler.ir import Tensor
from shardflow.compiler.ops.elementwise import Unary

KEY = "ab" * 32


def _key(i: int) -> str:
    return f"{i:064x}"


def _file(path, size: int, age_s: float) -> str:
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path, "wb") as f:
        f.write(b"x" * size)
    t = time.time() - age_s
    os.utime(path, (t, t))
    return str(path)


def _cache(tmp_path):
    """A cache of every kind of entry, the oldest first: 100-byte cpu libraries used 1000, 900, ... 100 s
    ago, a header pair, an object, a cubin, a tuning choice, temporaries and a file of the user's."""
    d = tmp_path / "cache"
    libs = [_file(d / f"{_key(i)}.so", 100, 1000 - 100 * i) for i in range(10)]
    header = [_file(d / f"{_key(20)}.h.gch", 300, 50), _file(d / f"{_key(20)}.h", 10, 50)]
    obj = _file(d / f"{_key(21)}.o", 40, 5000)
    cubin = _file(d / _key(22)[:2] / f"{_key(22)}.cubin", 70, 2000)
    tune = _file(d / "tune" / _key(23)[:2] / f"{_key(23)}.json", 5, 10)
    stale = _file(d / ".tmp-old.so", 7, 7200)
    young = _file(d / ".tmp-new.so", 9, 5)
    mine = _file(d / "notes.txt", 3, 9999)
    _file(d / "locks" / _key(3), 0, 10)  # (a build's lock file: no entry, not the user's)
    return str(d), dict(libs=libs, header=header, obj=obj, cubin=cubin, tune=tune, stale=stale, young=young, mine=mine)


def test_the_cache_lists_its_entries_by_kind(tmp_path):
    d, f = _cache(tmp_path)
    s = cache.cache_summary(d)
    assert {k: (v["count"], v["bytes"]) for k, v in s["entries"].items()} == {
        "cpu library": (10, 1000), "cpu shared object": (1, 40), "cpu header": (1, 310), "cuda library": (1, 70),
        "tuning choice": (1, 5), "unfinished write": (2, 16)}
    assert s["bytes"] == 1441 and s["others"] == [f["mine"]]
    assert cache.cache_summary(str(tmp_path / "none"))["bytes"] == 0  # (no folder: an empty cache)


def test_prune_removes_the_least_recently_used_until_the_cache_fits(tmp_path):
    d, f = _cache(tmp_path)
    # 1441 bytes; to fit 1000: the stale temporary (7), then by last use the object (40, 5000 s), the cubin
    # (70, 2000 s), the libraries of 1000, 900, 800 s (300): 1441 - 417 = 1024 > 1000, so one more library
    n, freed = cache.prune_cache(d, 1000, keep_recent_s=60)
    assert (n, freed) == (7, 517)
    gone = [f["stale"], f["obj"], f["cubin"]] + f["libs"][:4]
    assert not any(os.path.exists(p) for p in gone)
    assert all(os.path.exists(p) for p in f["libs"][4:] + f["header"] + [f["tune"], f["young"], f["mine"]])
    # nothing used in the last 60 s goes, whatever the limit: the header (50 s) and the tuning choice (10 s) stay
    n, _ = cache.prune_cache(d, 0, keep_recent_s=60)
    assert n == 6 and all(os.path.exists(p) for p in f["header"] + [f["tune"], f["young"], f["mine"]])
    assert cache.prune_cache(d, 0, keep_recent_s=0) == (2, 315)  # (the header as a pair; the young temporary stays)
    with pytest.raises(CodegenError, match="at least 0"):
        cache.prune_cache(d, -1)


def test_clear_removes_every_entry_and_leaves_other_files(tmp_path):
    d, f = _cache(tmp_path)
    assert cache.clear_cache(d, keep_recent_s=20) == (14, 1441 - 5 - 9)  # (the tuning choice, used 10 s ago, stays)
    assert os.path.exists(f["tune"]) and os.path.exists(f["young"]) and os.path.exists(f["mine"])
    assert cache.clear_cache(d) == (1, 5)


def test_sizes_read_with_units():
    assert cache.parse_size("500M") == 500 << 20 and cache.parse_size("2G") == 2 << 30
    assert cache.parse_size("1.5GiB") == 3 << 29 and cache.parse_size("100000") == 100000
    for bad in ("", "2x", "-1G", "G"):
        with pytest.raises(CodegenError, match="as a size"):
            cache.parse_size(bad)


def test_the_cache_command(tmp_path, capsys):
    d, f = _cache(tmp_path)
    assert cli.main(["cache", "--dir", d]) == 0
    out = capsys.readouterr().out
    assert "1.4 KiB" in out and "cpu library" in out and "10" in out and "1 other files" in out
    assert cli.main(["cache", "prune", "--dir", d, "--max-size", "1000"]) == 0
    assert "removed 7 entries" in capsys.readouterr().out
    assert cli.main(["cache", "prune", "--dir", d]) == 2 and "--max-size" in capsys.readouterr().err
    assert cli.main(["cache", "prune", "--dir", d, "--max-size", "1Q"]) == 1
    assert cli.main(["cache", "clear", "--dir", d, "--json"]) == 0
    out = capsys.readouterr().out
    summary = json.loads(out[out.index("{"):])
    assert summary["bytes"] == 9 and summary["entries"]["unfinished write"]["count"] == 1  # (the young one)
    assert os.path.exists(f["mine"])


def test_a_hit_marks_the_entry_used_and_a_vanished_entry_is_compiled_again(tmp_path, monkeypatch):
    op = Unary([Tensor("x", (4, 8), "float32")], fn="exp", name="e")
    d = str(tmp_path / "cache")
    build_cpu_library([op], str(tmp_path / "a.so"), cache_dir=d, opt_level=1)
    (lib,) = [e for e in cache.cache_entries(d)[0] if e.kind == "cpu library"]
    os.utime(lib.paths[0], (1e9, 1e9))
    build_cpu_library([op], str(tmp_path / "b.so"), cache_dir=d, opt_level=1)
    assert os.stat(lib.paths[0]).st_mtime > time.time() - 60  # (a hit: used now)
    real = toolchain._atomic_copy
    built = []

    def pruned_meanwhile(src, dst):  # the entry removed between the look and the read
        if src == lib.paths[0]:
            raise FileNotFoundError(src)
        built.append(dst)
        return real(src, dst)
    monkeypatch.setattr(toolchain, "_atomic_copy", pruned_meanwhile)
    build_cpu_library([op], str(tmp_path / "c.so"), cache_dir=d, opt_level=1)
    assert os.path.exists(tmp_path / "c.so") and str(tmp_path / "c.so") in built


def test_side_by_side_builds_of_one_library_compile_it_once(tmp_path, monkeypatch):
    """Two builds of the same library at once (ranks compiled side by side, test workers): the second
    waits on the first's build lock (``locks/<key>``, held while it compiles) and takes the library
    from the cache; its unit and its prebuilt objects are compiled once."""
    import threading
    from concurrent.futures import ThreadPoolExecutor

    import numpy as np

    d = str(tmp_path / "cache")
    outputs = []
    real = toolchain._run_compilers

    def run(cmds, jobs):
        outputs.extend(os.path.basename(c[-1]) for c in cmds if "-c" in c)
        return real(cmds, jobs)
    monkeypatch.setattr(toolchain, "_run_compilers", run)
    ops = [Unary([Tensor("x", (4, 8), "float32")], fn="exp", name="e")]
    start = threading.Barrier(2)

    def build(i):
        start.wait()
        return build_cpu_library(ops, str(tmp_path / f"{i}.so"), cache_dir=d, opt_level=1)
    with ThreadPoolExecutor(2) as pool:
        symbols = list(pool.map(build, range(2)))
    assert len([o for o in outputs if o.startswith("kernels_")]) == 1, outputs
    assert sorted(o for o in outputs if o.startswith("prebuilt_")) == ["prebuilt_sf_rt_ukr.o", "prebuilt_sfv_exp.o"]
    assert not os.listdir(os.path.join(d, "locks"))  # (a lock file lives while its build runs)
    x = np.linspace(-3, 3, 32, dtype=np.float32).reshape(4, 8)
    for i in range(2):
        lib, y = ctypes.CDLL(str(tmp_path / f"{i}.so")), np.empty_like(x)
        fn = getattr(lib, symbols[i]["e"])
        fn((ctypes.c_void_p * 1)(x.ctypes.data), (ctypes.c_void_p * 1)(y.ctypes.data))
        np.testing.assert_allclose(y, np.exp(x), rtol=1e-6)
