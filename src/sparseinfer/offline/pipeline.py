"""The offline pipeline end to end: profile → train predictors → solve placement → export.

Each step is a function over explicit inputs and outputs (a profile directory, a predictors
.npz, a placement .npz, the GGUF), so the CLI can run them one at a time or all together
(``convert``). Progress bars (tqdm, on stderr) show each long step on a terminal, log lines
otherwise (``Bars``); ``summary_rows`` / ``format_summary`` give the per-layer table printed at the end.
"""

from __future__ import annotations

import logging
import os
import re
import shutil
import sys
import tempfile
import time
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path

import numpy as np

from ..data import DEFAULT_CORPUS
from ..errors import SparseInferError
from .export import (ExportOptions, ExportResult, check_output_path, dense_parts,
                     export_sparse_gguf, neuron_bytes, stored_sizes)
from .profile import Profile, ProfileOptions, corpus_chunks, profile_model, read_corpus
from .train import Predictors, TrainOptions, train_predictors

log = logging.getLogger(__name__)

_UNITS = {"": 1, "b": 1, "k": 10**3, "kb": 10**3, "m": 10**6, "mb": 10**6, "g": 10**9,
          "gb": 10**9, "t": 10**12, "tb": 10**12, "kib": 2**10, "mib": 2**20, "gib": 2**30,
          "tib": 2**40}


def parse_bytes(text: str) -> int:
    """'1500000', '512MiB', '1.5G', '2 GiB' -> bytes (K/M/G are powers of 1000, KiB… of 1024)."""
    m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([A-Za-z]*)\s*", str(text))
    if not m or m.group(2).lower() not in _UNITS:
        raise SparseInferError(f"budget: expected bytes such as 1500000, 512MiB or 1.5GB, got "
                               f"{text!r}")
    return int(float(m.group(1)) * _UNITS[m.group(2).lower()])


# ---- progress ----------------------------------------------------------------------------------


class Bars:
    """A factory of progress reporters, one per stage; a new stage closes the previous one.

    On a terminal (or ``enabled=True``) each stage is a tqdm bar on stderr. Otherwise (a log
    file, CI, ``nohup``) each stage logs INFO lines on ``sparseinfer.offline.progress``: one when
    it starts, one per tenth of the work (or at least every ``every`` seconds) with the elapsed
    time and an estimate of the rest, and one when it ends. The CLI shows that logger."""

    def __init__(self, enabled: bool | None = None, every: float = 30.0):
        self.enabled = sys.stderr.isatty() if enabled is None else enabled
        self.every = every
        self.bar = None
        self.lines: _LogLines | None = None

    def __call__(self, stage: str, total: int, unit: str):
        self.close()
        if not self.enabled:
            self.lines = _LogLines(stage, total, unit, self.every)
            return self.lines.update
        from tqdm import tqdm

        scale = unit == "B"
        self.bar = tqdm(total=total, desc=stage, unit=unit, unit_scale=scale, file=sys.stderr,
                        leave=True, dynamic_ncols=True)
        return self.bar.update

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()
            self.bar = None
        if self.lines is not None:
            self.lines.close()
            self.lines = None


progress_log = logging.getLogger("sparseinfer.offline.progress")


def _amount(n: float, unit: str) -> str:
    if unit == "B":
        return f"{n / 2**20:.1f} MiB"
    return f"{int(n)} {unit}{'s' if unit == 'layer' and n != 1 else ''}"


def _of(done: float, total: float, unit: str) -> str:
    """'8 of 30 layer' reads badly: '8/30 layer', '1.2/4.0 MiB'."""
    if unit == "B":
        return f"{done / 2**20:.1f}/{total / 2**20:.1f} MiB"
    return f"{int(done)}/{int(total)} {unit}{'s' if unit == 'layer' and total != 1 else ''}"


class _LogLines:
    """Progress of one stage as log lines (see ``Bars``)."""

    def __init__(self, stage: str, total: int, unit: str, every: float):
        self.stage, self.total, self.unit, self.every = stage, max(int(total), 0), unit, every
        self.done = 0
        self.t0 = self.t_last = time.monotonic()
        self.next_tenth = 1
        progress_log.info("%s: started, %s to do", stage, _amount(self.total, unit))

    def update(self, n: int = 1) -> None:
        self.done += n
        now = time.monotonic()
        tenth = 10 * self.done // self.total if self.total else 10
        if (tenth >= self.next_tenth or now - self.t_last >= self.every) and self.done < self.total:
            self.next_tenth = tenth + 1
            self.t_last = now
            spent = now - self.t0
            eta = spent * (self.total - self.done) / self.done if self.done else float("nan")
            progress_log.info("%s: %s (%d%%), %.0f s so far, about %.0f s to go",
                              self.stage, _of(self.done, self.total, self.unit),
                              100 * self.done // self.total, spent, eta)

    def close(self) -> None:
        progress_log.info("%s: done, %s in %.1f s", self.stage, _amount(self.done, self.unit),
                          time.monotonic() - self.t0)


# ---- steps -------------------------------------------------------------------------------------


# profile in float32 when its weights take at most this share of the available memory
PROFILE_FP32_SHARE = 0.25


def profile_dtype(model_path: str | Path) -> str:
    """How to hold the weights while profiling: "fp32" when the float32 model takes at most
    ``PROFILE_FP32_SHARE`` of the available memory, else "auto" (each weight as the file stores
    it: a 7B Q4_0 file profiles in about its own size).

    Float32 weights are the file's blocks dequantized once (the same values), and a prompt of
    a few hundred tokens runs through torch's float matmul much faster than through the
    quantized kernels (benchmarks/RESULTS.md, convert time; benchmarks/prefill_chunk.py). The
    held-out evaluation after the export runs the dense model in the same weights."""
    from ..fileio import available_memory
    from ..models.loading import open_source
    from ..models.plan import make_plan

    need = make_plan(open_source(model_path), "fp32", dense=True, fused=False).nbytes
    have = available_memory()
    dtype = "fp32" if need <= PROFILE_FP32_SHARE * have else "auto"
    log.info("profiling with %s weights (float32 would take %.2f GiB of %.2f GiB available)",
             "float32" if dtype == "fp32" else "the file's own", need / 2**30, have / 2**30)
    return dtype


def load(model_path: str | Path | None, dtype: str | None = None):
    """The model to profile, dense, in ``dtype`` (default: ``profile_dtype``'s choice). The
    export reads the source's tensors itself."""
    from ..data import default_model_path
    from ..models.loading import load_model

    path = model_path or default_model_path()
    return load_model(path, dtype=dtype or profile_dtype(path))


def run_profile(loaded, corpus: Sequence[Path], out_dir: str | Path,
                options: ProfileOptions = ProfileOptions(), bars: Bars | None = None) -> Profile:
    cfg = loaded.config
    if cfg.n_experts:
        raise SparseInferError(f"{loaded.path}: a mixture of experts ({cfg.n_experts} experts, "
                               f"{cfg.n_experts_used} a token) cannot be converted: expected a "
                               f"dense model, whose FFN neurons the pipeline profiles; run this "
                               f"one as it is (its router already picks each token's experts)")
    chunk_len = min(options.chunk_len, cfg.max_seq_len)  # learned positions end
    if chunk_len < options.chunk_len:
        log.info("chunks of %d tokens: the model's context is %d", chunk_len, chunk_len)
    chunks = corpus_chunks(loaded.tokenizer, read_corpus(corpus), chunk_len,
                           options.max_tokens, options.min_tokens)
    try:
        return profile_model(loaded.model, chunks, out_dir, options, str(loaded.path), bars)
    finally:
        if bars:
            bars.close()


def run_train(profile: Profile, options: TrainOptions = TrainOptions(),
              bars: Bars | None = None) -> Predictors:
    tick = bars("train", profile.n_layers, "layer") if bars else None
    try:
        return train_predictors(profile, options, tick)
    finally:
        if bars:
            bars.close()


def placement_inputs(loaded, profile: Profile, predictors: Predictors, ctx: int,
                     outtype: str = "f32"):
    """(neuron_bytes, dense_parts) of the stored model, for the placement problem."""
    sizes = stored_sizes(loaded, outtype)
    cfg = loaded.config
    return (neuron_bytes(sizes, cfg.n_layers, cfg.d_ff),
            dense_parts(sizes, cfg, ctx, predictors, outtype))


def check_budget_early(loaded, budget: int | None, ctx: int, outtype: str = "f32") -> None:
    """Fail before profiling when the budget cannot even hold the dense parts (predictors not
    counted yet: the exact check runs in the solver)."""
    if budget is None:
        return
    empty = Predictors((), TrainOptions(), 0, 0)
    sizes = stored_sizes(loaded, outtype)
    parts = dense_parts(sizes, loaded.config, ctx, empty, outtype)
    need = sum(b for _, b in parts)
    if budget < need:
        detail = ", ".join(f"{n}={b}" for n, b in parts if b)
        raise SparseInferError(
            f"fast-tier budget too small: expected --budget >= the dense parts' {need} bytes "
            f"({detail}; predictors come on top), got {budget} bytes")


def run_solve(loaded, profile: Profile, predictors: Predictors, budget: int, ctx: int,
              outtype: str = "f32", time_limit: float = 30.0, **problem_options):
    """Solve the placement ILP (``problem_options``: group_size, min_split_neurons)."""
    from .solve import PlacementProblem, solve_placement

    nb, parts = placement_inputs(loaded, profile, predictors, ctx, outtype)
    problem = PlacementProblem(freqs=tuple(profile.freqs), neuron_bytes=nb, budget_bytes=budget,
                               dense_parts=parts, **problem_options)
    return solve_placement(problem, time_limit=time_limit)


def run_export(loaded, profile: Profile, predictors: Predictors, out: str | Path, placement=None,
               options: ExportOptions = ExportOptions(), bars: Bars | None = None) -> ExportResult:
    try:
        return export_sparse_gguf(loaded, profile, predictors, out, placement, options, bars)
    finally:
        if bars:
            bars.close()


# ---- end to end --------------------------------------------------------------------------------


@dataclass(frozen=True)
class ConvertOptions:
    corpus: tuple[Path, ...] = (DEFAULT_CORPUS,)
    profile: ProfileOptions = field(default_factory=ProfileOptions)
    train: TrainOptions = field(default_factory=TrainOptions)
    export: ExportOptions = field(default_factory=ExportOptions)
    budget_bytes: int | None = None  # None: nothing on the fast tier
    ctx: int = 4096  # tokens of KV cache charged to the fast tier
    work_dir: Path | None = None  # where the profile goes (default: a temporary directory)
    keep_work: bool = False
    solve_time_limit: float = 30.0
    report: bool = True  # write the HTML report beside the output (report.py)
    eval_chunks: int = 4  # held-out perplexity chunks, dense vs sparse, for the report (0: none)
    eval_ctx: int = 512
    # lay the sparse file out for the disk tier (disk/layout.py: each neuron's rows one aligned
    # read) in this row dtype, "q4" or "fp32"; None: the plain sparse layout
    disk_bundle: str | None = None
    # the bundles in co-activation order (disk/order.py); False: neuron order, hottest first,
    # which read fewer runs on the 13B model of benchmarks/RESULTS.md (its predicted sets follow
    # frequency more than co-activation)
    disk_coactivation: bool = False


def _bundle_in_place(result: ExportResult, dtype: str, profile=None,
                     bars: Bars | None = None) -> ExportResult:
    """Rewrite the exported file with bundled neuron rows (``disk.layout.bundle_file``; in
    ``profile``'s co-activation order if given), through a temporary file beside it: the output is
    either the plain file or the bundled one."""
    from ..disk.layout import bundle_file
    from ..disk.order import profile_orders

    progress_log.info("bundle: laying neurons out for the disk tier (%s rows)", dtype)
    orders = None
    if profile is not None:
        tick = bars("co-activation order", profile.n_layers, "layer") if bars else None
        try:
            orders = profile_orders(profile, progress=tick)
        finally:
            if bars:
                bars.close()
    out = result.path
    tmp = out.with_name(f".{out.name}.bundling.gguf")
    try:
        bundle_file(out, tmp, dtype, orders)
        os.replace(tmp, out)
    finally:
        tmp.unlink(missing_ok=True)
    progress_log.info("bundle: done")
    return replace(result, n_bytes=out.stat().st_size)


@dataclass(frozen=True)
class ConvertReport:
    output: ExportResult
    profile: Profile
    predictors: Predictors
    placement: object | None  # solve.PlacementSolution
    seconds: dict[str, float]
    work_dir: Path | None  # kept profile directory, if any
    evaluation: object | None = None  # report.Evaluation, when eval_chunks > 0
    report_path: Path | None = None


def convert(model_path: str | Path | None, out: str | Path,
            options: ConvertOptions = ConvertOptions(), bars: Bars | None = None,
            loaded=None) -> ConvertReport:
    """Profile, train, place and export ``model_path`` into the sparse GGUF ``out``."""
    seconds: dict[str, float] = {}
    out = check_output_path(out)
    for p in options.corpus:
        if not Path(p).is_file():
            raise SparseInferError(f"corpus file not found: {p}")
    t0 = time.perf_counter()
    if loaded is None:
        progress_log.info("load: reading %s", model_path or "the default model")
        loaded = load(model_path)
    seconds["load"] = time.perf_counter() - t0
    progress_log.info("load: done in %.1f s", seconds["load"])
    check_budget_early(loaded, options.budget_bytes, options.ctx, options.export.outtype)

    made_tmp = options.work_dir is None
    work = Path(tempfile.mkdtemp(prefix="sparseinfer-profile-")) if made_tmp else \
        Path(options.work_dir)
    try:
        t0 = time.perf_counter()
        profile = run_profile(loaded, options.corpus, work, options.profile, bars)
        seconds["profile"] = time.perf_counter() - t0

        t0 = time.perf_counter()
        predictors = run_train(profile, options.train, bars)
        seconds["train"] = time.perf_counter() - t0

        t0 = time.perf_counter()
        placement = None
        if options.budget_bytes is not None:
            progress_log.info("solve: placing neurons within %d bytes", options.budget_bytes)
            placement = run_solve(loaded, profile, predictors, options.budget_bytes, options.ctx,
                                  options.export.outtype, options.solve_time_limit)
        seconds["solve"] = time.perf_counter() - t0

        t0 = time.perf_counter()
        result = run_export(loaded, profile, predictors, out, placement, options.export, bars)
        seconds["export"] = time.perf_counter() - t0
        if options.disk_bundle is not None:
            result = _bundle_in_place(result, options.disk_bundle,
                                      profile if options.disk_coactivation else None, bars)
            seconds["bundle"] = time.perf_counter() - t0 - seconds["export"]
    finally:
        if made_tmp and not options.keep_work:
            shutil.rmtree(work, ignore_errors=True)

    evaluation = None
    if options.eval_chunks > 0:
        from .report import evaluate

        progress_log.info("evaluate: held-out perplexity, dense and sparse, %d chunks",
                          options.eval_chunks)
        t0 = time.perf_counter()
        evaluation = evaluate(loaded, out, options.eval_ctx, options.eval_chunks)
        seconds["evaluate"] = time.perf_counter() - t0
        progress_log.info("evaluate: done in %.1f s", seconds["evaluate"])
    report_file = None
    if options.report:
        from .report import write_report

        report_file = write_report(out, profile, predictors, placement, evaluation, seconds,
                                   format_summary(profile, predictors, placement))
    return ConvertReport(result, profile, predictors, placement, seconds,
                         work if (options.keep_work or not made_tmp) else None, evaluation,
                         report_file)


# ---- summary -----------------------------------------------------------------------------------


def summary_rows(profile: Profile, predictors: Predictors | None = None,
                 placement=None) -> list[dict]:
    """One dict per layer: density, rank, recall, precision, predicted density, hot count."""
    rows = []
    dens = profile.densities
    for l in range(profile.n_layers):
        row = {"layer": l, "density": float(dens[l])}
        if predictors is not None:
            p = predictors.layers[l]
            row.update(rank=p.rank, recall=p.recall, precision=p.precision,
                       pred_density=p.pred_density, met=p.met_targets)
        row["hot"] = int(placement.hot_counts[l]) if placement is not None else 0
        rows.append(row)
    return rows


def format_summary(profile: Profile, predictors: Predictors | None = None,
                   placement=None, placement_line: bool = True) -> str:
    """The per-layer table and totals, as text (``placement_line=False``: steps that come
    before placement say nothing about it)."""
    rows = summary_rows(profile, predictors, placement)
    lines = []
    head = f"{'layer':>5} {'density':>8}"
    if predictors is not None:
        head += f" {'rank':>5} {'recall':>7} {'precision':>9} {'pred.dens':>9}"
    head += f" {'hot':>7}"
    lines.append(head)
    for r in rows:
        s = f"{r['layer']:5d} {r['density']:8.3f}"
        if predictors is not None:
            flag = "" if r["met"] else " *"
            s += (f" {r['rank']:5d} {r['recall']:7.4f} {r['precision']:9.3f} "
                  f"{r['pred_density']:9.3f}")
            s += f" {r['hot']:7d}{flag}"
        else:
            s += f" {r['hot']:7d}"
        lines.append(s)
    d = profile.d_ff
    total = f"{'all':>5} {float(np.mean([r['density'] for r in rows])):8.3f}"
    if predictors is not None:
        total += (f" {'':5} {np.mean([r['recall'] for r in rows]):7.4f} "
                  f"{np.mean([r['precision'] for r in rows]):9.3f} "
                  f"{np.mean([r['pred_density'] for r in rows]):9.3f}")
    total += f" {sum(r['hot'] for r in rows):7d}"
    lines.append(total)
    mode = ("relu (h != 0)" if profile.mode == "relu" else
            f"magnitude ({profile.score} > t_l, target density {profile.target_density:g})")
    lines.append(f"{profile.n_tokens} profiled tokens; {profile.n_layers} layers x {d} neurons; "
                 f"activity: {mode}")
    if predictors is not None:
        o = predictors.options
        lines.append(
            f"predictors: {predictors.n_params:,} parameters = {predictors.param_share:.1%} of "
            f"the FFN parameters; recall target {o.recall:g} at predicted density <= "
            f"{o.max_density_ratio:g}x true (policy '{o.policy}'); measured on "
            f"{predictors.n_test_tokens} held-out tokens")
        missed = sum(not r["met"] for r in rows)
        if missed:
            lines.append(f"* {missed} layer(s) could not meet both targets; policy "
                         f"'{o.policy}' kept the "
                         f"{'recall' if o.policy == 'recall' else 'density cap'}")
    if placement is not None:
        lines.append(
            f"placement: {placement.status}; {sum(placement.hot_counts)} of "
            f"{d * profile.n_layers} neurons on the fast tier, "
            f"{placement.objective / max(placement.total_mass, 1e-12):.1%} of the activation "
            f"mass; {placement.fast_bytes:,} of {placement.budget_bytes:,} budget bytes")
    elif placement_line:
        lines.append("placement: none (no --budget): every neuron on the CPU")
    return "\n".join(lines)
