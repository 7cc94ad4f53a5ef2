"""Reading the small files the offline steps hand each other, with one kind of error message."""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np

from .errors import SparseInferError


def read_npz(path: str | os.PathLike, what: str) -> dict[str, np.ndarray]:
    """All arrays of an .npz (no pickles); ``what`` names the expected file in errors,
    e.g. "a placement .npz written by save_placement"."""
    path = Path(path)
    kind = what.split(" .npz")[0]
    try:
        with np.load(path, allow_pickle=False) as z:
            return {k: z[k] for k in z.files}
    except FileNotFoundError:
        raise SparseInferError(f"{path}: expected {kind} file, found no such file") from None
    except (OSError, ValueError) as e:
        raise SparseInferError(f"{path}: expected {what}, found: {e}") from None
