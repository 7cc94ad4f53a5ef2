"""One exception type for every user-facing failure.

The CLI catches it and prints its message without a traceback (``--verbose`` shows one).
Messages say what was expected and what was found, and name the file when there is one.
"""


class SparseInferError(Exception):
    """A failure caused by user input (a bad file, flag, prompt or request)."""


class ModelFileError(SparseInferError):
    """A model file that cannot be read: corrupt, truncated, unknown architecture, bad tensor."""


class ContextOverflowError(SparseInferError):
    """A prompt (plus requested tokens) that does not fit the context window."""
