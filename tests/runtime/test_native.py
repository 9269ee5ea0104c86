"""The native part of the runtime: libshardflow_native.so (runtime/native/, built by CMakeLists.txt)."""
import ctypes
import logging
import re
import shutil
import subprocess

import numpy as np
import pytest

import handmade
from shardflow.runtime import ShardflowError, load, native
from shardflow.runtime.native import NativeLibraryError

_VP = ctypes.c_void_p

KERNELS = r"""
extern "C" void add(const void* const* in, void* const* out) {
    const float* a = (const float*)in[0]; const float* b = (const float*)in[1]; float* y = (float*)out[0];
    for (int i = 0; i < 8; ++i) y[i] = a[i] + b[i];
}
extern "C" void twice(const void* const* in, void* const* out) {
    const float* a = (const float*)in[0]; float* y = (float*)out[0];
    for (int i = 0; i < 8; ++i) y[i] = 2.0f * a[i];
}
"""


def _compile(tmp, name: str, source: str) -> ctypes.CDLL:
    if shutil.which("g++") is None:
        pytest.skip("no g++")
    src, lib = tmp / f"{name}.cpp", tmp / f"{name}.so"
    src.write_text(source)
    subprocess.run(["g++", "-O1", "-shared", "-fPIC", "-o", str(lib), str(src)], check=True)
    return ctypes.CDLL(str(lib))


@pytest.fixture(scope="module")
def kernels(tmp_path_factory):
    return _compile(tmp_path_factory.mktemp("kernels"), "k", KERNELS)


class Program:
    """Flat step arrays for sf_run_steps / sf_run_program: ``(kernel, ins, outs)`` or None (a collective)."""

    def __init__(self, steps):
        self.keep = []
        n = len(steps)
        self.fns, self.ins, self.outs = (_VP * n)(), (_VP * n)(), (_VP * n)()
        for i, step in enumerate(steps):
            if step is None:
                continue
            fn, ins, outs = step
            a = (_VP * len(ins))(*[x.ctypes.data for x in ins])
            b = (_VP * len(outs))(*[y.ctypes.data for y in outs])
            self.keep += [a, b]
            self.fns[i] = ctypes.cast(fn, _VP).value
            self.ins[i], self.outs[i] = ctypes.addressof(a), ctypes.addressof(b)
        self.n = n

    def args(self):
        return self.n, ctypes.addressof(self.fns), ctypes.addressof(self.ins), ctypes.addressof(self.outs)


def test_library_loads_and_its_abi_version_matches_header_and_python():
    lib = native.load()
    assert lib is native.load()  # opened once per process
    assert lib.sf_native_abi_version() == native.ABI_VERSION
    header = (native.include_dir() / "shardflow" / "runtime.h").read_text()
    assert int(re.search(r"#define SHARDFLOW_NATIVE_ABI_VERSION (\d+)", header).group(1)) == native.ABI_VERSION


def test_run_steps_runs_the_kernels_in_order(kernels):
    a = np.arange(8, dtype=np.float32)
    b = np.full(8, 10, np.float32)
    c, d = np.zeros(8, np.float32), np.zeros(8, np.float32)
    prog = Program([(kernels.add, [a, b], [c]), (kernels.twice, [c], [d])])
    native.load().sf_run_steps(*prog.args())
    np.testing.assert_array_equal(c, a + b)
    np.testing.assert_array_equal(d, 2 * (a + b))


def test_run_program_calls_the_collectives_in_order_between_kernels(kernels):
    a = np.arange(8, dtype=np.float32)
    b = np.ones(8, np.float32)
    c, d, e = (np.zeros(8, np.float32) for _ in range(3))
    # kernel, collective, kernel, collective, kernel: each collective sees what came before it and
    # writes what comes after it (like an all-reduce into its output view)
    prog = Program([(kernels.add, [a, b], [c]), None, (kernels.twice, [c], [d]), None, (kernels.add, [d, b], [e])])
    seen = []

    def collective(ctx, step):
        seen.append((ctx, step, c.copy(), d.copy()))
        if step == 1:
            c[:] += 100
        return 0

    cb = native.COLLECTIVE_FN(collective)
    assert native.load().sf_run_program(*prog.args(), cb, 1234) == 0
    assert [(ctx, step) for ctx, step, _, _ in seen] == [(1234, 1), (1234, 3)]
    np.testing.assert_array_equal(seen[0][2], a + b)
    np.testing.assert_array_equal(seen[0][3], 0)  # the second kernel had not run yet
    np.testing.assert_array_equal(seen[1][3], 2 * (a + b + 100))
    np.testing.assert_array_equal(e, 2 * (a + b + 100) + 1)


def test_run_program_stops_at_a_failing_collective(kernels):
    a = np.arange(8, dtype=np.float32)
    c, d = np.zeros(8, np.float32), np.zeros(8, np.float32)
    prog = Program([(kernels.twice, [a], [c]), None, (kernels.twice, [c], [d])])
    cb = native.COLLECTIVE_FN(lambda ctx, step: 7)
    assert native.load().sf_run_program(*prog.args(), cb, None) == 7
    np.testing.assert_array_equal(c, 2 * a)
    np.testing.assert_array_equal(d, 0)  # the kernel after it did not run


def test_a_missing_library_is_a_clear_error(tmp_path, monkeypatch):
    path = tmp_path / "nowhere" / "libshardflow_native.so"
    with pytest.raises(NativeLibraryError, match="pip install -e .") as info:
        native.load(path)
    assert str(path) in str(info.value) and "does not exist" in str(info.value)
    assert isinstance(info.value, ShardflowError)
    assert not path.parent.exists()  # an explicit path is never built
    # loading a cpu program needs it too ($SHARDFLOW_NATIVE_LIB names the library to use)
    out = handmade.make_artifact(tmp_path / "o1", (1,))
    monkeypatch.setenv(native.LIBRARY_ENV, str(path))
    with pytest.raises(NativeLibraryError, match=re.escape(str(path))):
        load(out)


def test_a_library_of_another_abi_is_refused(tmp_path):
    _compile(tmp_path, "old", 'extern "C" int sf_native_abi_version(void) { return 999; }')
    with pytest.raises(NativeLibraryError, match=f"native ABI 999, this runtime needs {native.ABI_VERSION}"):
        native.load(tmp_path / "old.so")
    (tmp_path / "junk.so").write_text("not a library")
    with pytest.raises(NativeLibraryError, match="cannot be loaded"):
        native.load(tmp_path / "junk.so")


@pytest.mark.parametrize("use_cmake", [True, False], ids=["cmake", "cxx"])
def test_build_from_the_package_sources(tmp_path, use_cmake):
    if use_cmake and native.find_cmake() is None:
        pytest.skip("no cmake")
    if not use_cmake and native.find_cxx() is None:
        pytest.skip("no C++ compiler")
    path = native.build(tmp_path / "out", use_cmake=use_cmake)
    assert path == tmp_path / "out" / "libshardflow_native.so"
    assert sorted(p.name for p in path.parent.iterdir()) == ["libshardflow_native.so"]  # no build leftovers
    lib = native.load(path)
    assert lib.sf_native_abi_version() == native.ABI_VERSION
    if shutil.which("nm"):  # hidden visibility: exactly the header's functions are exported
        syms = subprocess.run(["nm", "-D", "--defined-only", str(path)], capture_output=True, text=True).stdout
        assert sorted(line.split()[-1] for line in syms.splitlines() if " T " in line) == \
            ["sf_native_abi_version", "sf_run_program", "sf_run_steps"]


def test_missing_default_library_is_built_on_first_use(tmp_path, monkeypatch):
    if native.find_cxx() is None and native.find_cmake() is None:
        pytest.skip("no C++ compiler")
    path = tmp_path / "pkg" / "_native" / "libshardflow_native.so"
    monkeypatch.delenv(native.LIBRARY_ENV, raising=False)
    monkeypatch.setattr(native, "default_library_path", lambda: path)
    records = []
    handler = logging.Handler(logging.WARNING)
    handler.emit = records.append  # its own handler: CLI tests may stop "shardflow" logs from propagating
    logging.getLogger(native.__name__).addHandler(handler)
    try:
        lib = native.load()
    finally:
        logging.getLogger(native.__name__).removeHandler(handler)
    assert path.is_file() and lib.sf_native_abi_version() == native.ABI_VERSION
    assert [r.levelno for r in records] == [logging.WARNING]
    assert "is missing" in records[0].getMessage() and str(path) in records[0].getMessage()
    # without a compiler nothing is built: the error says how to get the library
    other = tmp_path / "other" / "libshardflow_native.so"
    monkeypatch.setattr(native, "default_library_path", lambda: other)
    monkeypatch.setattr(native, "find_cxx", lambda: None)
    monkeypatch.setattr(native, "find_cmake", lambda: None)
    with pytest.raises(NativeLibraryError, match="does not exist; reinstall with `pip install -e .`"):
        native.load()
    assert not other.exists()


def test_a_program_is_one_native_call_that_agrees_with_the_python_loop(tmp_path):
    x = np.random.default_rng(0).standard_normal(handmade.SHAPE).astype(np.float32)
    prog = load(handmade.make_artifact(tmp_path / "o1", (1,)))
    assert prog._native is not None and prog._native[0] is native.load().sf_run_program
    got = prog.run({"x": x})
    saved, prog._native = prog._native, None
    looped = prog.run({"x": x})
    for k, want in handmade.expected(x, 1).items():
        np.testing.assert_allclose(got[k], want, rtol=1e-6, atol=1e-6)
        np.testing.assert_array_equal(got[k], looped[k])
    prog._native = saved

    # an exception in a collective (raised inside the native call's callback) reaches the caller
    class Boom(Exception):
        pass

    def fail(*args):
        raise Boom("peer lost")

    step = next(i for i, c in enumerate(prog._step_collectives) if c is not None)
    good, prog._step_collectives[step] = prog._step_collectives[step], fail
    with pytest.raises(Boom, match="peer lost"):
        prog.run({"x": x})
    prog._step_collectives[step] = good
    np.testing.assert_array_equal(prog.run({"x": x})["y"], got["y"])  # and the program still runs
