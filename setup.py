"""Build script for the ``shardflow`` distribution.

``shardflow.compiler`` lives in ``compiler/`` and ``shardflow.runtime`` in ``runtime/``.
"""
from setuptools import setup

from setuptools import find_packages

# shardflow.compiler.* from compiler/, shardflow.runtime.* from runtime/
PACKAGES = {}
for prefix, root in (("shardflow.compiler", "compiler"), ("shardflow.runtime", "runtime")):
    PACKAGES[prefix] = root
    for sub in find_packages(root):
        PACKAGES[f"{prefix}.{sub}"] = f"{root}/{sub.replace('.', '/')}"

setup(
    name="shardflow",
    version="0.1.0",
    description="Automatic sharding compiler for ONNX models over device meshes",
    python_requires=">=3.10",
    packages=list(PACKAGES),
    package_dir=PACKAGES,
    install_requires=["numpy>=1.24", "onnx>=1.15", "pulp>=2.7,<4"],
    extras_require={
        # torch/transformers export test models on the fly (tests and benchmarks only, never at runtime)
        "test": ["pytest>=7", "onnxruntime>=1.17", "hypothesis>=6", "highspy>=1.7", "scipy",
                 "torch==2.13.0", "transformers", "onnxscript"],
        "cuda12": ["cupy-cuda12x", "nvidia-nccl-cu12"],
        "cuda13": ["cupy-cuda13x", "nvidia-nccl-cu13"],
        "mpi": ["mpi4py", "mpich"],
    },
    entry_points={"console_scripts": ["shardflow = shardflow.compiler.cli:main"]},
)
