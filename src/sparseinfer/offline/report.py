"""The conversion report: one HTML file with embedded plots, written beside the sparse GGUF.

    model.sparse.gguf  ->  model.sparse.report.html

What it shows, for a person to read at a glance: how often each FFN neuron fires (sorted per
layer: the power law, and where the hot/cold split falls), how well the predictors do per layer
(recall against the target, predicted against true density), the placement under the fast-tier
budget, and, when ``evaluate`` ran, the measured density and perplexity cost of the sparse model
on held-out text. Plots are matplotlib (Agg backend, no display needed).
"""

from __future__ import annotations

import base64
import html
import io
import logging
import math
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Evaluation:
    """Held-out perplexity of the model dense and sparse, and the density actually computed."""

    text: str  # what was scored
    n_ctx: int
    n_chunks: int
    dense_ppl: float
    sparse_ppl: float
    measured_density: float  # share of FFN neurons computed per scored token (sparse run)
    seconds: float

    @property
    def ppl_cost(self) -> float:
        return self.sparse_ppl / self.dense_ppl - 1.0


def report_path(gguf_path: str | Path) -> Path:
    """``x.sparse.gguf`` -> ``x.sparse.report.html``."""
    p = Path(gguf_path)
    stem = p.name[:-len(".gguf")] if p.name.endswith(".gguf") else p.name
    return p.with_name(stem + ".report.html")


def evaluate(loaded, sparse_path: str | Path, n_ctx: int = 512, max_chunks: int = 4,
             threads: int | None = None, text_path: str | Path | None = None) -> Evaluation:
    """Perplexity of ``loaded`` (the dense source model, fp32) and of the sparse file it was
    converted to (fp32 rows, each token its own predicted set), on the held-out text."""
    from ..data import HELDOUT_TEXT
    from ..engine import Engine
    from ..perplexity import perplexity

    t0 = time.perf_counter()
    path = Path(text_path) if text_path else HELDOUT_TEXT
    tok = loaded.tokenizer
    ids = tok.encode(path.read_text(encoding="utf-8"), add_bos=False)
    n_ctx = min(n_ctx, loaded.config.max_seq_len)
    bos = tok.bos_id if tok.add_bos else None
    dense = perplexity(loaded.model, ids, n_ctx, bos, max_chunks)
    engine = Engine.load(sparse_path, n_ctx=n_ctx, threads=threads, dtype="fp32")
    info = engine.sparse_info
    info.set_batch_mode("masked")
    info.reset_stats()
    sparse = perplexity(engine.model, ids, n_ctx, bos, max_chunks)
    return Evaluation(path.name, n_ctx, dense.n_chunks, dense.ppl, sparse.ppl,
                      float(info.density()), time.perf_counter() - t0)


# ---- figures -----------------------------------------------------------------------------------


def _png(fig) -> str:
    import matplotlib.pyplot as plt

    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=96, bbox_inches="tight")
    plt.close(fig)
    return base64.b64encode(buf.getvalue()).decode("ascii")


def _layer_axis(ax, axis: str = "x") -> None:
    from matplotlib.ticker import MaxNLocator

    (ax.xaxis if axis == "x" else ax.yaxis).set_major_locator(MaxNLocator(integer=True))


def _frequency_figure(profile, placement):
    import matplotlib.pyplot as plt

    freqs = np.sort(profile.freqs, axis=1)[:, ::-1]  # (L, d_ff), hottest first
    L, d = freqs.shape
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(12, 4.2))
    cmap = plt.get_cmap("viridis")
    rank = np.arange(1, d + 1)
    for l in range(L):
        ax1.plot(rank, np.maximum(freqs[l], 1e-6), color=cmap(l / max(L - 1, 1)), lw=1)
    ax1.set_xscale("log")
    ax1.set_yscale("log")
    ax1.set_xlabel("neuron, hottest first (rank)")
    ax1.set_ylabel("activation frequency")
    ax1.set_title("Activation frequency per neuron (one line per layer)")
    sm = plt.cm.ScalarMappable(cmap=cmap, norm=plt.Normalize(0, L - 1))
    fig.colorbar(sm, ax=ax1, label="layer")
    im = ax2.imshow(freqs, aspect="auto", cmap="magma", vmin=0, vmax=1, interpolation="nearest",
                    extent=(0, d, L - 0.5, -0.5))
    ax2.set_xlabel("neuron, hottest first")
    ax2.set_ylabel("layer")
    title = "Frequency by layer"
    if placement is not None:
        ax2.plot(placement.hot_counts, range(L), "c|", ms=9, mew=2, label="hot/cold split")
        ax2.legend(loc="lower right", fontsize=8)
        title += " (| = fast-tier neurons end)"
    else:
        half = [int(np.searchsorted(np.cumsum(f) / max(f.sum(), 1e-12), 0.5)) for f in freqs]
        ax2.plot(half, range(L), "c|", ms=9, mew=2, label="half the activations")
        ax2.legend(loc="lower right", fontsize=8)
    ax2.set_title(title)
    _layer_axis(ax2, "y")
    fig.colorbar(im, ax=ax2, label="frequency")
    return fig


def _predictor_figure(profile, predictors):
    import matplotlib.pyplot as plt

    layers = np.arange(profile.n_layers)
    p = predictors.layers
    o = predictors.options
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(12, 3.8))
    ax1.plot(layers, [x.recall for x in p], "o-", ms=4, label="recall (held-out tokens)")
    ax1.axhline(o.recall, color="gray", ls="--", lw=1, label=f"target {o.recall:g}")
    ax1.set_ylim(min(0.9, min(x.recall for x in p) - 0.01), 1.002)
    ax1.set_xlabel("layer")
    ax1.set_title("Predictor recall per layer")
    ax1.legend(fontsize=8, loc="lower left")
    true = np.array([x.true_density for x in p])
    ax2.bar(layers, [x.pred_density for x in p], color="#9ab7e8", label="predicted density")
    ax2.plot(layers, true, "k.-", label="true density")
    ax2.plot(layers, np.minimum(true * o.max_density_ratio, 1), color="gray", ls="--", lw=1,
             label=f"target: {o.max_density_ratio:g}x true")
    missed = [l for l, x in zip(layers, p) if not x.met_targets]
    if missed:
        ax2.plot(missed, [p[l].pred_density for l in missed], "rv", ms=6,
                 label="targets not both met")
    ax2.set_ylim(0, 1.05)
    ax2.set_xlabel("layer")
    _layer_axis(ax1)
    _layer_axis(ax2)
    ax2.set_title("Share of neurons computed per token")
    ax2.legend(fontsize=8, loc="lower right")
    return fig


def _placement_figure(profile, placement):
    import matplotlib.pyplot as plt

    rows = placement.summary_rows()
    layers = [r["layer"] for r in rows]
    fig, ax = plt.subplots(figsize=(12, 3.4))
    ax.bar(layers, [r["hot_count"] / r["d_ff"] for r in rows], color="#e8a33d",
           label="neurons on the fast tier")
    ax.plot(layers, [r["hot_mass_share"] for r in rows], "k.-", label="activations they serve")
    ax.set_ylim(0, 1.05)
    ax.set_xlabel("layer")
    _layer_axis(ax)
    ax.set_title(f"Placement ({placement.status}): {placement.fast_bytes / 2**20:.1f} of "
                 f"{placement.budget_bytes / 2**20:.1f} MiB budget used")
    ax.legend(fontsize=8, loc="lower right")
    return fig


# ---- page --------------------------------------------------------------------------------------


def _numbers(profile, predictors, placement, evaluation) -> list[tuple[str, str]]:
    o = predictors.options
    mean = lambda xs: float(np.mean(list(xs)))  # noqa: E731
    rows = [
        ("model", html.escape(str(profile.model))),
        ("profile", f"{profile.n_tokens:,} tokens; {profile.n_layers} layers x {profile.d_ff} "
                    f"neurons; activity: " + (
                        "ReLU (exact zeros)" if profile.mode == "relu" else
                        f"magnitude of {profile.score} above a per-layer threshold, target "
                        f"density {profile.target_density:g}")),
        ("true density", f"{mean(profile.densities):.1%} of neurons per token (mean of layers)"),
        ("predictors", f"recall {mean(p.recall for p in predictors.layers):.4f} at predicted "
                       f"density {mean(p.pred_density for p in predictors.layers):.1%} (target "
                       f"recall {o.recall:g} at <= {o.max_density_ratio:g}x true); "
                       f"{predictors.n_params:,} parameters = {predictors.param_share:.1%} of "
                       f"the FFNs; {sum(p.met_targets for p in predictors.layers)} of "
                       f"{len(predictors.layers)} layers meet both targets"),
    ]
    if placement is None:
        rows.append(("placement", "none (no --budget): every neuron on the CPU"))
    else:
        share = placement.objective / max(placement.total_mass, 1e-12)
        rows.append(("placement", f"{sum(placement.hot_counts):,} of "
                                  f"{profile.d_ff * profile.n_layers:,} neurons on the fast "
                                  f"tier, serving {share:.1%} of the activations; "
                                  f"{placement.fast_bytes:,} of {placement.budget_bytes:,} "
                                  f"budget bytes ({placement.status})"))
    if evaluation is None:
        rows.append(("perplexity", "not measured (convert --eval-chunks 0)"))
    else:
        e = evaluation
        rows.append(("measured density", f"{e.measured_density:.1%} of FFN neurons computed "
                                         f"per token (sparse model on {e.text})"))
        rows.append(("perplexity", f"dense {e.dense_ppl:.3f}, sparse {e.sparse_ppl:.3f}: "
                                   f"<b>{e.ppl_cost:+.2%}</b> ({e.n_chunks} chunks of {e.n_ctx} "
                                   f"tokens of {html.escape(e.text)})"))
    return rows


def write_report(out_gguf: str | Path, profile, predictors, placement=None,
                 evaluation: Evaluation | None = None, seconds: dict | None = None,
                 summary_text: str = "") -> Path:
    """Write the HTML report beside ``out_gguf``; returns its path."""
    import matplotlib

    matplotlib.use("Agg")
    figs = [("Which neurons fire", _frequency_figure(profile, placement),
             "Each layer's neurons sorted by how often they fire. A steep curve (a few neurons "
             "fire on most tokens, most rarely: ReLU-family models) makes the hot ones worth "
             "fast memory; a flat one (activity spread evenly) leaves little to place."),
            ("Predictors", _predictor_figure(profile, predictors),
             "Recall: share of truly active neurons the predictor selects. Density: share of "
             "neurons computed; the closer the bars to the black line, the more sparsity pays.")]
    if placement is not None:
        figs.append(("Placement", _placement_figure(profile, placement),
                     "Per layer, the share of neurons stored on the fast tier and the share of "
                     "activations they serve."))
    table = "".join(f"<tr><th>{k}</th><td>{v}</td></tr>"
                    for k, v in _numbers(profile, predictors, placement, evaluation))
    if seconds:
        table += ("<tr><th>time</th><td>" + ", ".join(f"{k} {v:.1f} s" for k, v in
                                                      seconds.items()) + "</td></tr>")
    body = "".join(f"<h2>{t}</h2><p>{html.escape(c)}</p><img alt='{t}' "
                   f"src='data:image/png;base64,{_png(f)}'>" for t, f, c in figs)
    name = Path(out_gguf).name
    page = f"""<!doctype html>
<html lang="en"><head><meta charset="utf-8"><title>{html.escape(name)}: conversion report</title>
<style>
body {{ font: 15px/1.45 system-ui, sans-serif; color: #1d232a; max-width: 1180px;
        margin: 24px auto; padding: 0 16px; }}
h1 {{ font-size: 22px; margin-bottom: 4px; }} h2 {{ font-size: 18px; margin: 26px 0 4px; }}
table {{ border-collapse: collapse; }} th {{ text-align: left; padding: 3px 14px 3px 0;
        vertical-align: top; color: #555; font-weight: 600; white-space: nowrap; }}
td {{ padding: 3px 0; }} img {{ max-width: 100%; }} p {{ color: #555; margin: 2px 0 8px; }}
pre {{ font-size: 12px; background: #f6f7f9; padding: 10px; overflow-x: auto; }}
</style></head><body>
<h1>{html.escape(name)}</h1><p>sparseinfer conversion report</p>
<table>{table}</table>
{body}
<h2>Per layer</h2><pre>{html.escape(summary_text)}</pre>
</body></html>
"""
    path = report_path(out_gguf)
    path.write_text(page, encoding="utf-8")
    log.info("wrote %s", path)
    return path


def ppl_line(e: Evaluation) -> str:
    """One line: perplexity cost and measured density."""
    cost = e.ppl_cost if math.isfinite(e.ppl_cost) else float("nan")
    return (f"held-out perplexity {e.dense_ppl:.3f} dense -> {e.sparse_ppl:.3f} sparse "
            f"({cost:+.2%}), {e.measured_density:.1%} of FFN neurons computed per token "
            f"({e.n_chunks} x {e.n_ctx} tokens, {e.seconds:.1f} s)")


def density_note(e: Evaluation, source: str | None) -> str | None:
    """What to tell the user when the sparse run computed most of the neurons anyway (None when
    it did not): the dense source (a path, or None for the default model) is then likely the
    faster file."""
    from .defaults import NOT_SPARSE_DENSITY

    if not e.measured_density > NOT_SPARSE_DENSITY:
        return None
    run = "sparseinfer run" + (f" -m {source}" if source else "")
    return (f"note: {e.measured_density:.0%} of the FFN neurons are computed per token. Sparse "
            f"decoding pays where few neurons fire (ReLU-family FFNs); with this many the "
            f"source is likely to decode faster: compare `{run}` with the sparse file (both "
            f"print tokens/s)")


def file_summary(metadata: dict, path: str | Path | None = None) -> str | None:
    """What a sparse GGUF's metadata says about its conversion, as a per-layer table and totals
    (``sparseinfer info``); None for a file without sparseinfer metadata."""
    md = metadata
    if "sparseinfer.format_version" not in md:
        return None
    dens = list(md.get("sparseinfer.sparsity.layer_densities", []))
    ranks = list(md.get("sparseinfer.predictor.ranks", []))
    recall = list(md.get("sparseinfer.predictor.recall", []))
    prec = list(md.get("sparseinfer.predictor.precision", []))
    pdens = list(md.get("sparseinfer.predictor.density", []))
    hot = list(md.get("sparseinfer.placement.hot_counts", [])) or [0] * len(dens)
    lines = [f"sparse file (format {md['sparseinfer.format_version']}): "
             f"{md.get('sparseinfer.ffn_kind', '?')} FFNs, neurons ordered "
             f"{md.get('sparseinfer.neuron_order', '?')}"]
    if "sparseinfer.bundle.dtype" in md:
        lines.append(f"bundled for the disk tier: {md['sparseinfer.bundle.dtype']} rows, stride "
                     f"{int(md.get('sparseinfer.bundle.stride', 0))} bytes, in "
                     f"{md.get('sparseinfer.bundle.order', 'neuron')} order"
                     + (f", gate rows apart (stride {int(md['sparseinfer.bundle.gate_stride'])}"
                        f" bytes: gates first)" if md.get("sparseinfer.bundle.gate_stride")
                        else ""))
    mode = md.get("sparseinfer.sparsity.mode", "?")
    lines.append("activity: " + ("ReLU (exact zeros)" if mode == "relu" else
                                 f"magnitude of {md.get('sparseinfer.sparsity.score')} above a "
                                 f"per-layer threshold, target density "
                                 f"{float(md.get('sparseinfer.sparsity.target_density', 0)):.3g}")
                 + f"; profiled on {int(md.get('sparseinfer.profile.tokens', 0)):,} tokens")
    if dens and len(ranks) == len(recall) == len(pdens) == len(dens):
        lines.append(f"  {'layer':>5} {'density':>8} {'rank':>5} {'recall':>7} {'precision':>9} "
                     f"{'pred.dens':>9} {'hot':>7}")
        for l, row in enumerate(zip(dens, ranks, recall, prec or [math.nan] * len(dens), pdens,
                                    hot)):
            d, r, rc, pr, pd, h = row
            lines.append(f"  {l:5d} {d:8.3f} {int(r):5d} {rc:7.4f} {pr:9.3f} {pd:9.3f} "
                         f"{int(h):7d}")
        lines.append(f"  {'all':>5} {np.mean(dens):8.3f} {'':5} {np.mean(recall):7.4f} "
                     f"{np.mean(prec) if prec else math.nan:9.3f} {np.mean(pdens):9.3f} "
                     f"{int(sum(hot)):7d}")
        target = md.get("sparseinfer.predictor.recall_target")
        if target is not None:
            lines.append(f"  recall target {float(target):.3g}; a neuron is computed when its "
                         f"predictor logit >= {float(md.get('powerinfer.sparse_threshold', 0)):g}")
    budget = md.get("sparseinfer.placement.budget_bytes")
    if budget:
        lines.append(f"placement: {md.get('sparseinfer.placement.status', '?')}; {sum(hot):,} "
                     f"neurons on the fast tier, {int(md['sparseinfer.placement.fast_bytes']):,} "
                     f"of {int(budget):,} budget bytes")
    else:
        lines.append("placement: none: every neuron on the CPU")
    if path is not None and report_path(path).is_file():
        lines.append(f"report: {report_path(path)}")
    return "\n".join(lines)
