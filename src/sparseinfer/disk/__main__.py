"""``python -m sparseinfer.disk bundle SPARSE.gguf OUT.gguf [--dtype q4|fp32]``: rewrite a sparse
GGUF with bundled neuron rows (``layout.py``), ready for ``--ram-budget``."""

from __future__ import annotations

import argparse
import logging
import sys

from ..errors import SparseInferError


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m sparseinfer.disk")
    sub = ap.add_subparsers(dest="cmd", required=True)
    b = sub.add_parser("bundle", help="rewrite a sparse GGUF with bundled neuron rows")
    b.add_argument("src")
    b.add_argument("out")
    b.add_argument("--dtype", default="q4", choices=("q4", "fp32"))
    args = ap.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    from .layout import bundle_file

    try:
        out = bundle_file(args.src, args.out, args.dtype)
    except SparseInferError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    print(out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
