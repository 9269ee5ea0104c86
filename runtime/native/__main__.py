"""``python -m shardflow.runtime.native [DEST_DIR] [--no-cmake]``: build ``libshardflow_native.so``.

For a checkout used from ``PYTHONPATH`` without ``pip install``; pip installs build it already.
"""
from __future__ import annotations

import argparse
import logging
import sys

from . import NativeLibraryError, build


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m shardflow.runtime.native",
                                 description="Build libshardflow_native.so, the native part of the shardflow "
                                             "runtime, from the package's sources.")
    ap.add_argument("dest_dir", nargs="?", help="output directory (default: shardflow/runtime/_native/)")
    ap.add_argument("--no-cmake", action="store_true", help="compile with $CXX / g++ directly")
    args = ap.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    try:
        path = build(args.dest_dir, use_cmake=False if args.no_cmake else None)
    except NativeLibraryError as exc:
        logging.getLogger(__name__).error("%s", exc)
        return 1
    sys.stdout.write(f"{path}\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
