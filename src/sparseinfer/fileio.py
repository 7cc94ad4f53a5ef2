"""Reading the small files the loaders and offline steps hand each other, with one kind of error
message."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

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


def read_json(path: Path, error: type[SparseInferError] = SparseInferError) -> Any:
    """The parsed JSON of ``path``; invalid JSON or text raises ``error`` naming the file."""
    try:
        return json.loads(path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise error(f"{path}: not valid JSON: {e}") from None
