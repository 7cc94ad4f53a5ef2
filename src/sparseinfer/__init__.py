"""sparseinfer: LLM inference that exploits activation sparsity."""

import logging

from .errors import SparseInferError

__version__ = "0.1.0"
__all__ = ["SparseInferError", "__version__"]

logging.getLogger(__name__).addHandler(logging.NullHandler())
