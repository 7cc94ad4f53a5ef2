"""Subcommands of the offline pipeline: ``convert`` (all steps) and each step on its own.

    sparseinfer convert -m MODEL -o OUT.gguf [--corpus FILE ...] [--target-density D] [--budget B]
    sparseinfer profile -m MODEL -o PROFILE_DIR [--corpus FILE ...] [--max-tokens N]
    sparseinfer train-predictors --profile PROFILE_DIR -o PREDICTORS.npz [--recall R]
    sparseinfer solve -m MODEL --profile DIR --predictors P.npz --budget B -o PLACEMENT.npz
    sparseinfer export -m MODEL --profile DIR --predictors P.npz [--placement P.npz] -o OUT.gguf

Only these handlers print (results on stdout, progress on stderr); bad input raises
``SparseInferError`` (exit status 1 with one ``error:`` line).
"""

from __future__ import annotations

import argparse
import contextlib
import signal
import sys
import threading
from pathlib import Path

from ..errors import SparseInferError
from .defaults import (DEFAULT_CHUNK_LEN, DEFAULT_MAX_TOKENS, DEFAULT_SCORE,
                       DEFAULT_TARGET_DENSITY, SCORES)


def _threads(args) -> None:
    import torch

    if args.threads is None:  # (the model flags' default: the cores, as torch takes them)
        return
    if args.threads < 1:
        raise SparseInferError(f"-t/--threads: expected a positive number, got {args.threads}")
    torch.set_num_threads(args.threads)


def _profile_options(args):
    from .profile import ProfileOptions

    return ProfileOptions(chunk_len=args.chunk_len, max_tokens=args.max_tokens,
                          target_density=args.target_density, score=args.score)


def _train_options(args):
    from .train import TrainOptions

    try:
        ranks = tuple(int(r) for r in args.ranks.split(","))
    except ValueError:
        raise SparseInferError(f"--ranks: expected comma-separated integers, got "
                               f"{args.ranks!r}") from None
    return TrainOptions(recall=args.recall, max_density_ratio=args.max_density_ratio,
                        policy=args.policy, ranks=ranks, epochs=args.epochs, seed=args.seed)


def _corpus(args) -> tuple[Path, ...]:
    from ..data import DEFAULT_CORPUS

    return tuple(args.corpus) if args.corpus else (DEFAULT_CORPUS,)


def _budget(args) -> int | None:
    from .pipeline import parse_bytes

    return None if args.budget is None else parse_bytes(args.budget)


def _check_ctx(args) -> None:
    if args.ctx_size < 1:
        raise SparseInferError(f"-c/--ctx-size: expected a positive number, got {args.ctx_size}")


def _show_progress_logs() -> None:
    """Progress goes to the log when stderr is not a terminal (``pipeline.Bars``): show it."""
    import logging

    logging.getLogger("sparseinfer.offline.progress").setLevel(logging.INFO)


@contextlib.contextmanager
def _termination_interrupts():
    """Within the block, SIGTERM and SIGHUP raise KeyboardInterrupt (as SIGINT does), so the
    pipeline's ``finally`` clauses remove its temporary profile and partial output."""
    def interrupt(signum, frame):
        raise KeyboardInterrupt(signal.Signals(signum).name)

    if threading.current_thread() is not threading.main_thread():
        yield
        return
    previous = {sig: signal.signal(sig, interrupt) for sig in (signal.SIGTERM, signal.SIGHUP)}
    try:
        yield
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)


# ---- handlers ----------------------------------------------------------------------------------


def cmd_convert(args) -> int:
    from .export import ExportOptions
    from .pipeline import Bars, ConvertOptions, convert, format_summary

    _threads(args)
    _check_ctx(args)
    options = ConvertOptions(
        corpus=_corpus(args), profile=_profile_options(args), train=_train_options(args),
        export=ExportOptions(outtype=args.outtype), budget_bytes=_budget(args),
        ctx=args.ctx_size, work_dir=args.work_dir, keep_work=args.keep_work,
        report=not args.no_report, eval_chunks=args.eval_chunks, disk_bundle=args.disk_bundle,
        disk_coactivation=args.disk_order == "coactivation",
    )
    if args.eval_chunks < 0:
        raise SparseInferError(f"--eval-chunks: expected a count >= 0, got {args.eval_chunks}")
    print(f"converting {args.model or 'the default model'} -> {args.output}", file=sys.stderr)
    _show_progress_logs()
    with _termination_interrupts():  # SIGTERM/SIGHUP unwind like Ctrl-C: temp files removed
        report = convert(args.model, args.output, options, Bars())
    print(format_summary(report.profile, report.predictors, report.placement))
    steps = ", ".join(f"{k} {v:.1f} s" for k, v in report.seconds.items())
    print(f"wrote {report.output.path} ({report.output.n_bytes / 2**20:.1f} MiB, "
          f"{report.output.n_tensors} tensors) in {sum(report.seconds.values()):.1f} s "
          f"({steps})")
    if report.evaluation is not None:
        from .report import density_note, ppl_line

        print(ppl_line(report.evaluation))
        note = density_note(report.evaluation, args.model)
        if note:
            print(note)
    if report.report_path is not None:
        print(f"report: {report.report_path}")
    if report.work_dir is not None:
        print(f"profile kept in {report.work_dir}")
    return 0


def cmd_profile(args) -> int:
    from .pipeline import Bars, format_summary, load, run_profile

    _threads(args)
    options = _profile_options(args)
    corpus = _corpus(args)
    for p in corpus:
        if not Path(p).is_file():
            raise SparseInferError(f"corpus file not found: {p}")
    _show_progress_logs()
    loaded = load(args.model)
    with _termination_interrupts():
        prof = run_profile(loaded, corpus, args.output, options, Bars())
    print(format_summary(prof, placement_line=False))
    print(f"wrote profile {args.output} ({prof.n_tokens} tokens, {prof.seconds:.1f} s)")
    return 0


def cmd_train(args) -> int:
    from .pipeline import Bars, format_summary, run_train
    from .profile import load_profile
    from .train import save_predictors

    _threads(args)
    options = _train_options(args)
    prof = load_profile(args.profile)
    _check_writable(args.output)
    _show_progress_logs()
    with _termination_interrupts():
        preds = run_train(prof, options, Bars())
    save_predictors(args.output, preds)
    print(format_summary(prof, preds, placement_line=False))
    print(f"wrote predictors {args.output}")
    return 0


def cmd_solve(args) -> int:
    from .pipeline import load, run_solve
    from .profile import load_profile
    from .solve import save_placement
    from .train import check_matches, load_predictors

    _check_ctx(args)
    budget = _budget(args)
    prof = load_profile(args.profile)
    preds = load_predictors(args.predictors)
    check_matches(preds, prof)
    _check_writable(args.output)
    loaded = load(args.model)
    sol = run_solve(loaded, prof, preds, budget, args.ctx_size, args.outtype, args.time_limit)
    save_placement(args.output, sol)
    print(f"{'layer':>5} {'d_ff':>6} {'hot':>6} {'mass share':>10}")
    for r in sol.summary_rows():
        print(f"{r['layer']:5d} {r['d_ff']:6d} {r['hot_count']:6d} {r['hot_mass_share']:10.3f}")
    print(f"placement {sol.status} in {sol.solve_seconds:.2f} s: {sum(sol.hot_counts)} neurons "
          f"on the fast tier, {sol.fast_bytes:,} of {sol.budget_bytes:,} bytes "
          f"(dense {sol.dense_bytes:,})")
    print(f"wrote placement {args.output}")
    return 0


def cmd_export(args) -> int:
    from .export import ExportOptions, check_output_path
    from .pipeline import Bars, format_summary, load, run_export
    from .profile import load_profile
    from .solve import load_placement
    from .train import check_matches, load_predictors

    prof = load_profile(args.profile)
    preds = load_predictors(args.predictors)
    check_matches(preds, prof)
    placement = load_placement(args.placement) if args.placement else None
    check_output_path(args.output)
    loaded = load(args.model)
    res = run_export(loaded, prof, preds, args.output, placement,
                     ExportOptions(outtype=args.outtype), Bars())
    print(format_summary(prof, preds, placement))
    print(f"wrote {res.path} ({res.n_bytes / 2**20:.1f} MiB, {res.n_tensors} tensors)")
    return 0


def _check_writable(path: Path) -> None:
    from .export import check_output_path

    check_output_path(path)


# ---- parser ------------------------------------------------------------------------------------


def _add_profile_flags(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("profiling")
    g.add_argument("--corpus", type=Path, action="append", default=[], metavar="FILE",
                   help="UTF-8 text to profile on (repeatable; default: the Emma excerpt)")
    g.add_argument("--max-tokens", type=int, default=DEFAULT_MAX_TOKENS,
                   help=f"profile at most this many tokens (default {DEFAULT_MAX_TOKENS})")
    g.add_argument("--chunk-len", type=int, default=DEFAULT_CHUNK_LEN,
                   help=f"tokens per sequence (default {DEFAULT_CHUNK_LEN})")
    g.add_argument("--target-density", type=float, default=DEFAULT_TARGET_DENSITY,
                   help=f"non-ReLU FFNs: share of neurons counted active, calibrated per layer "
                        f"(default {DEFAULT_TARGET_DENSITY}; ReLU-family FFNs are exact)")
    g.add_argument("--score", choices=SCORES, default=DEFAULT_SCORE,
                   help=f"non-ReLU FFNs: neuron magnitude score (default {DEFAULT_SCORE})")


def _add_train_flags(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("predictors")
    g.add_argument("--recall", type=float, default=0.99,
                   help="target recall of active neurons on held-out tokens (default 0.99)")
    g.add_argument("--max-density-ratio", type=float, default=1.5,
                   help="target: predicted density <= this x true density (default 1.5)")
    g.add_argument("--policy", choices=("recall", "density"), default="recall",
                   help="when both targets cannot be met, keep the recall target or cap the "
                        "predicted density (default recall)")
    g.add_argument("--ranks", default="16,32,64,128",
                   help="candidate predictor ranks, smallest first (capped at 10%% of the FFN's "
                        "parameters)")
    g.add_argument("--epochs", type=int, default=6, help="training epochs per rank")
    g.add_argument("--seed", type=int, default=0)


def _add_out_type(p: argparse.ArgumentParser) -> None:
    p.add_argument("--outtype", choices=("f32", "f16"), default="f32",
                   help="type of ffn_down_t, predictors and converted float weights "
                        "(default f32: lossless)")


def _add_placement_flags(p: argparse.ArgumentParser, required: bool) -> None:
    p.add_argument("--budget", default=None, required=required, metavar="BYTES",
                   help="fast-tier budget, e.g. 300MB or 1.5GiB; the dense parts (embeddings, "
                        "a KV cache of -c tokens, attention, predictors, norms) are charged "
                        "first (convert default: none, every neuron on the CPU)")


def add_offline_commands(sub, add_model_flags) -> None:
    """Register convert / profile / train-predictors / solve / export on ``sub``."""
    c = sub.add_parser("convert", help="profile, train predictors, place, export a sparse GGUF")
    add_model_flags(c)
    c.add_argument("-o", "--output", type=Path, required=True, help="the sparse GGUF to write")
    _add_profile_flags(c)
    _add_train_flags(c)
    _add_placement_flags(c, required=False)
    _add_out_type(c)
    c.add_argument("--work-dir", type=Path, default=None,
                   help="keep the profile here (default: a temporary directory)")
    c.add_argument("--keep-work", action="store_true", help="do not delete the profile")
    c.add_argument("--eval-chunks", type=int, default=4, metavar="N",
                   help="measure held-out perplexity dense vs sparse and the density computed, "
                        "on N chunks of 512 tokens (default 4; 0 = skip)")
    c.add_argument("--no-report", action="store_true",
                   help="do not write the HTML report (OUT without .gguf + .report.html)")
    c.add_argument("--disk-bundle", choices=("q4", "fp32"), default=None,
                   help="write the file for the disk tier (--ram-budget): each neuron's gate, up "
                        "and down rows as one aligned read, in this dtype (as `python -m "
                        "sparseinfer.disk bundle` does to a finished file)")
    c.add_argument("--disk-order", choices=("neuron", "coactivation"), default="neuron",
                   help="with --disk-bundle: the file order of the bundles; neuron (default): "
                        "hottest first, so the predicted neurons of a token, mostly the warm "
                        "ones, lie close together; coactivation: neurons that fired together on "
                        "the profile side by side (fewer reads where co-activation, not "
                        "frequency, decides what fires; benchmarks/RESULTS.md)")
    c.set_defaults(func=cmd_convert)

    p = sub.add_parser("profile", help="record activation frequencies and predictor data")
    add_model_flags(p)
    p.add_argument("-o", "--output", type=Path, required=True, help="profile directory")
    _add_profile_flags(p)
    p.set_defaults(func=cmd_profile)

    t = sub.add_parser("train-predictors", help="train per-layer predictors on a profile")
    t.add_argument("--profile", type=Path, required=True, help="profile directory")
    t.add_argument("-o", "--output", type=Path, required=True, help="predictors .npz to write")
    t.add_argument("-t", "--threads", type=int, default=2)
    t.add_argument("-v", "--verbose", action="store_true")
    _add_train_flags(t)
    t.set_defaults(func=cmd_train)

    s = sub.add_parser("solve", help="place the hottest neurons within a fast-tier budget")
    add_model_flags(s)
    s.add_argument("--profile", type=Path, required=True, help="profile directory")
    s.add_argument("--predictors", type=Path, required=True, help="predictors .npz")
    s.add_argument("-o", "--output", type=Path, required=True, help="placement .npz to write")
    s.add_argument("--time-limit", type=float, default=30.0, help="ILP time limit (s)")
    _add_placement_flags(s, required=True)
    _add_out_type(s)
    s.set_defaults(func=cmd_solve)

    e = sub.add_parser("export", help="write the sparse GGUF from a profile, predictors and a "
                                      "placement")
    add_model_flags(e)
    e.add_argument("--profile", type=Path, required=True, help="profile directory")
    e.add_argument("--predictors", type=Path, required=True, help="predictors .npz")
    e.add_argument("--placement", type=Path, default=None,
                   help="placement .npz (default: nothing on the fast tier)")
    e.add_argument("-o", "--output", type=Path, required=True, help="the sparse GGUF to write")
    _add_out_type(e)
    e.set_defaults(func=cmd_export)
