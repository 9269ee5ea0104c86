"""User-facing errors of the compiler. All derive from :class:`ShardflowError`."""
from shardflow.runtime.errors import MemoryLimitError, ShardflowError  # noqa: F401 - (re-exported)


class ModelFormatError(ShardflowError):
    """The model file or proto is not a valid ONNX model."""


class UnsupportedOperatorError(ShardflowError):
    """The model uses operators (or attributes) Shardflow does not implement.

    ``unsupported`` maps each op type to the names of the nodes that use it.
    """

    def __init__(self, message: str, unsupported: dict[str, list[str]] | None = None):
        super().__init__(message)
        self.unsupported = dict(unsupported or {})


class ShapeError(ShardflowError):
    """Shapes are missing, inconsistent, or do not match what the model expects."""


class DtypeError(ShardflowError):
    """A tensor has a dtype the model or Shardflow cannot accept."""


class ConfigError(ShardflowError):
    """A configuration key is unknown, has the wrong type, or an impossible value."""


class GraphError(ShardflowError):
    """A FlowGraph is malformed (dangling tensors, cycles, duplicate names)."""
