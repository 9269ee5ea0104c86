"""The root of Shardflow's user-facing error hierarchy."""


class ShardflowError(Exception):
    """Base class of every error Shardflow raises for bad input or unsupported features.

    Messages name the culprit (node, input, key or file) and say what to do about it.
    """
