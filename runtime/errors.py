"""The root of Shardflow's user-facing error hierarchy."""

import os


class ShardflowError(Exception):
    """Base class of every error Shardflow raises for bad input or unsupported features.

    Messages name the culprit (node, input, key or file) and say what to do about it.
    """


#: the bytes one process can address on x86-64 and aarch64 (48-bit virtual addresses, half of them the
#: user's): no tensor or program memory can be larger, whatever the machine
ADDRESSABLE_BYTES = 1 << 47


class MemoryLimitError(ShardflowError):
    """A tensor, or the memory a program needs, is larger than can be allocated: beyond what a
    process can address (:data:`ADDRESSABLE_BYTES`, found at import), or more than this machine could
    give when it was asked for (the reference evaluator's values, a rank program's arena)."""


def format_bytes(n: int) -> str:
    """``n`` bytes in binary units, one decimal (``"192 B"``, ``"1.5 KiB"``, ``"5.3 PiB"``): errors'
    sizes and ``shardflow inspect``'s."""
    if n < 1024:
        return f"{n} B"
    for unit in ("KiB", "MiB", "GiB", "TiB", "PiB", "EiB"):
        n /= 1024
        if n < 1024 or unit == "EiB":
            return f"{n:.1f} {unit}"


def number_from_env(name: str, default: float, meaning: str,
                    error: type[ShardflowError] = ShardflowError) -> float:
    """The environment variable ``name`` as a number >= 0 (``default`` when unset or empty).

    A value that is not a number >= 0 raises ``error`` naming the variable, its value and
    ``meaning`` (what the number is, e.g. ``"seconds"``), so that a typo in a launch script is
    reported as such instead of as a bare ``ValueError`` deep inside the runtime.
    """
    text = os.environ.get(name, "").strip()
    if not text:
        return default
    try:
        value = float(text)
    except ValueError:
        value = float("nan")
    if not value >= 0.0:  # negative or NaN
        raise error(f"{name}={text!r} is not a number of {meaning} >= 0 (unset, {default:g}); "
                    f"set it to a number or unset it")
    return value
