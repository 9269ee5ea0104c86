"""The C++ of the CPU kernel library (``compiler/codegen/cpu_library/*.h``), put at the top of every
generated CPU translation unit, so that the source text, and with it the kernel cache key, contains
everything a library is built from."""
from __future__ import annotations

from pathlib import Path

__all__ = ["LIBRARY_DIR", "PRELUDE", "read_library"]

LIBRARY_DIR = Path(__file__).with_name("cpu_library")


def read_library(*names: str) -> str:
    """The text of the library files ``names`` (in ``LIBRARY_DIR``), in that order."""
    return "\n".join((LIBRARY_DIR / name).read_text() for name in names)


# includes, the SF_* macros, scratch memory and the scalar math every generated kernel uses
PRELUDE = "\n" + read_library("helpers.h")
