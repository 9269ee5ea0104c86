"""Build script for the ``shardflow`` distribution.

``shardflow.compiler`` lives in ``compiler/`` and ``shardflow.runtime`` in ``runtime/``.

Building (``pip install .``, ``pip install -e .``) also builds the native part of the runtime,
``libshardflow_native.so``, by driving CMake on ``CMakeLists.txt`` (sources in ``runtime/native/``;
without CMake the C++ compiler builds the same sources directly). It goes into
``shardflow/runtime/_native/`` of the wheel, or into ``runtime/_native/`` of this checkout for an
editable install. ``SHARDFLOW_SKIP_NATIVE=1`` skips it (a cuda-only node without a C++ compiler).
"""
import importlib.util
import logging
import os
from pathlib import Path

from setuptools import Command, Distribution, find_packages, setup
from setuptools.command.build import build as _build
from setuptools.command.develop import develop as _develop

ROOT = Path(__file__).resolve().parent
NATIVE_OUT = ("shardflow", "runtime", "_native")  # where shardflow.runtime.native looks for the library

# shardflow.compiler.* from compiler/, shardflow.runtime.* from runtime/
PACKAGES = {}
for prefix, root in (("shardflow.compiler", "compiler"), ("shardflow.runtime", "runtime")):
    PACKAGES[prefix] = root
    for sub in find_packages(root):
        PACKAGES[f"{prefix}.{sub}"] = f"{root}/{sub.replace('.', '/')}"


def _native_build_module():
    """runtime/native/_build.py, loaded by path: the package itself needs numpy to import."""
    spec = importlib.util.spec_from_file_location("_shardflow_native_build", ROOT / "runtime" / "native" / "_build.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


class build_native(Command):
    """Build libshardflow_native.so with CMake (a sub-command of ``build``)."""

    description = "build the native runtime library (CMakeLists.txt, runtime/native/)"
    user_options = [("inplace", "i", "write it into runtime/_native/ of the source tree")]
    boolean_options = ["inplace"]

    def initialize_options(self):
        self.build_lib = None
        self.build_temp = None
        self.inplace = False
        self.editable_mode = False  # set by setuptools' editable_wheel (pip install -e .)

    def finalize_options(self):
        self.set_undefined_options("build", ("build_lib", "build_lib"), ("build_temp", "build_temp"))

    def _in_tree(self):
        return bool(self.inplace or self.editable_mode)

    def _dest(self):
        return ROOT / "runtime" / "_native" if self._in_tree() else Path(self.build_lib, *NATIVE_OUT)

    def run(self):
        if os.environ.get("SHARDFLOW_SKIP_NATIVE", "") not in ("", "0"):
            self.announce("SHARDFLOW_SKIP_NATIVE is set: not building the native runtime library (cpu "
                          "targets will need `python -m shardflow.runtime.native`)", level=logging.WARNING)
            return
        mod = _native_build_module()
        top = ROOT / "CMakeLists.txt"  # absent from an sdist: then runtime/native/CMakeLists.txt alone
        try:
            path = mod.build(self._dest(), source_dir=ROOT if top.is_file() else None,
                             work_dir=Path(self.build_temp) / "native",
                             log=lambda cmd: self.announce(cmd, level=logging.INFO))
        except mod.BuildError as exc:
            raise SystemExit(f"error: building the native runtime library failed; it needs a C++17 compiler "
                             f"and CMake >= 3.18 (or the cmake wheel).\n{exc}") from None
        self.announce(f"built {path}", level=logging.INFO)

    def get_outputs(self):
        return [] if self._in_tree() else [str(self._dest() / "libshardflow_native.so")]

    def get_output_mapping(self):
        return {}


class build(_build):
    sub_commands = _build.sub_commands + [("build_native", None)]


class develop(_develop):
    def run(self):
        if hasattr(_develop, "install_for_development"):  # setuptools < 80: develop does not go through pip -e
            self.reinitialize_command("build_native", inplace=1)
            self.run_command("build_native")
        super().run()


class BinaryDistribution(Distribution):
    """The wheel carries a native library: platform-specific, installed into platlib."""

    def has_ext_modules(self):
        return True


setup(
    name="shardflow",
    version="0.1.0",
    description="Automatic sharding compiler for ONNX models over device meshes",
    python_requires=">=3.10",
    packages=list(PACKAGES),
    package_dir=PACKAGES,
    # the native sources travel with the package: shardflow.runtime.native can rebuild the library;
    # the cpu code generator puts its kernel library's C++ (cpu_library/) into every source it writes
    package_data={"shardflow.runtime.native": ["CMakeLists.txt", "include/shardflow/*.h", "src/*.cpp"],
                  "shardflow.compiler.codegen": ["cpu_library/*.h", "cpu_library/README.md"]},
    install_requires=["numpy>=1.24", "onnx>=1.15", "pulp>=2.7,<4", "highspy>=1.7"],
    extras_require={
        # torch/transformers export test models on the fly (tests and benchmarks only, never at runtime)
        "test": ["pytest>=7", "pytest-xdist>=3.2", "onnxruntime>=1.17", "hypothesis>=6", "highspy>=1.7", "scipy",
                 "torch==2.13.0", "transformers", "diffusers", "onnxscript",
                 # the real-rank tests run under mpiexec (MPICH from PyPI) like a cluster job would
                 "mpi4py", "mpich"],
        "cuda12": ["cupy-cuda12x", "nvidia-nccl-cu12"],
        "cuda13": ["cupy-cuda13x", "nvidia-nccl-cu13"],
        "mpi": ["mpi4py", "mpich"],
    },
    entry_points={"console_scripts": ["shardflow = shardflow.compiler.cli:main"]},
    cmdclass={"build": build, "build_native": build_native, "develop": develop},
    distclass=BinaryDistribution,
)
