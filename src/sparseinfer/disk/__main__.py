"""``python -m sparseinfer.disk bundle SPARSE.gguf OUT.gguf [--dtype q4|fp32] [--profile DIR]
[--gates-apart auto|yes|no]``: rewrite a sparse GGUF with bundled neuron rows (``layout.py``),
ready for ``--ram-budget``; with the profile directory its convert kept (``--keep-work``), in
co-activation order (``order.py``); with the gate rows in their own tensor (by default for q4 rows
of a ReLU-gated FFN), the disk tier reads up and down rows only for the neurons whose gate fired
(``tier.py``).

``python -m sparseinfer.disk upgrade OLD.gguf NEW.gguf``: rewrite a q4 bundled file made before q4
rows put their scales first (which the kernels no longer read) with the same numbers in the new
layout, for when its sparse GGUF is gone (else bundle that again)."""

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
    b.add_argument("--profile", help="the profile directory SPARSE.gguf was converted from "
                                     "(convert --keep-work): write the bundles in co-activation "
                                     "order")
    b.add_argument("--gates-apart", choices=("auto", "yes", "no"), default="auto",
                   help="the gate rows in their own tensor, so the disk tier reads up and down "
                        "rows only where the gate fired (ReGLU/dReLU; auto: for q4 rows of "
                        "such an FFN)")
    u = sub.add_parser("upgrade", help="rewrite a q4 bundled file of Q4_0 blocks (an older "
                                       "sparseinfer's) with its rows' scales first")
    u.add_argument("src")
    u.add_argument("out")
    args = ap.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    from ..offline.pipeline import Bars
    from .layout import bundle_file, upgrade_file

    bars = Bars()
    progress = lambda n: bars(args.cmd, n, "B")  # noqa: E731  (the bytes written)
    try:
        if args.cmd == "upgrade":
            out = upgrade_file(args.src, args.out, progress=progress)
        else:
            orders = None if args.profile is None else _orders(args.src, args.profile)
            apart = {"auto": None, "yes": True, "no": False}[args.gates_apart]
            out = bundle_file(args.src, args.out, args.dtype, orders, gates_apart=apart,
                              progress=progress)
    except SparseInferError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    finally:
        bars.close()
    print(out)
    return 0


def _orders(src_path: str, profile_dir: str):
    """Co-activation orders from the profile ``src_path`` was made from (checked: the file's
    activation frequencies must be the profile's, hot-first)."""
    import numpy as np

    from ..models.loading import open_source
    from ..offline.export import hot_first_permutations
    from ..offline.pipeline import Bars
    from ..offline.profile import load_profile
    from .order import profile_orders

    profile = load_profile(profile_dir)
    src = open_source(src_path)
    cfg = src.config
    if (profile.n_layers, profile.d_ff) != (cfg.n_layers, cfg.d_ff):
        raise SparseInferError(f"{profile_dir}: a profile of {profile.n_layers} layers x "
                               f"{profile.d_ff} neurons; {src_path} has {cfg.n_layers} x {cfg.d_ff}")
    for layer, perm in enumerate(hot_first_permutations(profile.freqs)):
        got = src.extra_array(f"blk.{layer}.act_freq")
        if got is None or not np.allclose(got, profile.freqs[layer][perm], atol=1e-6):
            raise SparseInferError(f"{src_path}: blk.{layer}.act_freq does not match the profile "
                                   f"in {profile_dir}: expected the profile {src_path} was "
                                   f"converted from")
    bars = Bars()
    try:
        return profile_orders(profile, progress=bars("co-activation order", profile.n_layers,
                                                     "layer"))
    finally:
        bars.close()


if __name__ == "__main__":
    sys.exit(main())
