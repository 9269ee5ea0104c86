"""The root of Shardflow's user-facing error hierarchy."""

import os


class ShardflowError(Exception):
    """Base class of every error Shardflow raises for bad input or unsupported features.

    Messages name the culprit (node, input, key or file) and say what to do about it.
    """


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
