"""Exceptions the engine raises for problems a user can fix.

Each one subclasses the builtin a caller would naturally catch (ValueError for bad input,
RuntimeError for a model we cannot run), so plain `except ValueError` keeps working.
"""


class InvalidRequestError(ValueError):
    """A prompt or its sampling parameters cannot be served; nothing was queued."""


class ModelLoadError(ValueError):
    """A model folder is missing, incomplete or malformed."""


class UnsupportedModelError(RuntimeError):
    """The model loaded, but the engine cannot run it (unknown architecture, un-lowerable attention)."""


class LoweringError(UnsupportedModelError):
    """A captured graph still contains attention that was not rewritten to the paged-attention op."""
