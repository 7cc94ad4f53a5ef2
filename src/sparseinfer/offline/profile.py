"""Profile a model's FFN activations on a corpus: per-neuron activation frequencies, and the
(layer input, active mask) pairs the predictors train on, streamed to disk.

The corpus is tokenized, cut into chunks of ``chunk_len`` tokens (each run as its own sequence
from position 0, BOS first when the tokenizer adds one) and capped at ``max_tokens``. Every FFN
is hooked (its instance ``forward`` overridden for the duration; model.py is untouched) and
records, per token:

- the FFN input x (after ffn_norm) as float16, into ``x_LLL.npy`` (a memmap [T, d_model]);
- the active mask, bit-packed along neurons (``np.packbits(..., bitorder="little")``) into
  ``mask_LLL.npy`` (a memmap [T, ceil(d_ff / 8)] uint8).

Memory stays bounded by one chunk's activations whatever the corpus size; the disk holds
T · L · (2 · d_model + d_ff / 8) bytes (and, until the masks are written, 2 · T · L · d_ff of
scores).

Activity. ReLU-family FFNs (``FFNKind.relu_sparse``): neuron i is active iff h_i != 0, exactly,
recorded during the model pass. Other FFNs: active iff its magnitude score (calibrate.py)
exceeds the layer's threshold t_l. The model pass then fills a score histogram per layer and
stores every score as float16 (``score_LLL.npy``, [T, d_ff], temporary); the thresholds are the
histograms' (1 - target_density) quantiles, and a pass over the stored scores writes the masks
and deletes the scores. (Recomputing the gate/up projections from the stored inputs instead
took a quarter of SmolLM2's profile time.) With thresholds given, the model pass writes the
masks itself.

The directory is complete when ``profile.json`` exists (written last).
"""

from __future__ import annotations

import json
import logging
import os
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np
import torch

from ..config import FFN_KINDS
from ..errors import SparseInferError
from ..fileio import read_json
from ..models.model import Transformer
from .defaults import DEFAULT_CHUNK_LEN, DEFAULT_MAX_TOKENS  # noqa: F401 (re-exported)
from .calibrate import (DEFAULT_SCORE, DEFAULT_TARGET_DENSITY, ScoreHistogram, check_density,
                        check_score, down_norms, hooked_ffns, neuron_scores)

log = logging.getLogger(__name__)

PROFILE_FORMAT = "sparseinfer-profile"
PROFILE_VERSION = 1
MIN_TOKENS = 256  # fewer leave too few held-out tokens to measure a 99% recall
MASK_BLOCK_BYTES = 64 << 20  # float32 scores per block when thresholding the stored ones
FP16_MAX = 65504.0

Progress = Callable[[int], None]  # called with the number of units just done


@dataclass(frozen=True)
class ProfileOptions:
    chunk_len: int = DEFAULT_CHUNK_LEN
    max_tokens: int = DEFAULT_MAX_TOKENS
    target_density: float = DEFAULT_TARGET_DENSITY  # magnitude mode only
    score: str = DEFAULT_SCORE  # magnitude mode only
    min_tokens: int = MIN_TOKENS

    def __post_init__(self) -> None:
        if self.chunk_len < 8:
            raise SparseInferError(f"chunk length: expected at least 8 tokens, got "
                                   f"{self.chunk_len}")
        if self.max_tokens < 1:
            raise SparseInferError(f"max tokens: expected a positive number, got {self.max_tokens}")
        check_density(self.target_density)
        check_score(self.score)


@dataclass(frozen=True)
class Profile:
    """A finished profile directory (see the module docstring)."""

    path: Path
    model: str  # the profiled model file
    ffn_kind: str
    mode: str  # "relu" (h != 0) | "magnitude" (score > threshold)
    score: str | None  # magnitude mode: the score (calibrate.SCORES)
    target_density: float | None  # magnitude mode: the calibration target
    n_layers: int
    d_model: int
    d_ff: int
    n_tokens: int
    chunk_lens: tuple[int, ...]  # tokens of each chunk, in file order
    thresholds: np.ndarray = field(repr=False)  # (L,) float32; relu mode: zeros
    counts: np.ndarray = field(repr=False)  # (L, d_ff) int64: tokens on which each neuron fired
    seconds: float = 0.0

    @property
    def freqs(self) -> np.ndarray:
        """(L, d_ff) float64 activation frequency of every neuron."""
        return self.counts / max(self.n_tokens, 1)

    @property
    def densities(self) -> np.ndarray:
        """(L,) mean share of active neurons per token."""
        return self.counts.sum(axis=1) / max(self.n_tokens * self.d_ff, 1)

    def inputs(self, layer: int) -> np.ndarray:
        """(T, d_model) float16 memmap of the layer's FFN inputs."""
        return np.load(self.path / _x_name(layer), mmap_mode="r")

    def packed_masks(self, layer: int) -> np.ndarray:
        """(T, ceil(d_ff / 8)) uint8 memmap of the layer's bit-packed active masks."""
        return np.load(self.path / _mask_name(layer), mmap_mode="r")

    def masks(self, layer: int, start: int = 0, stop: int | None = None) -> np.ndarray:
        """(stop - start, d_ff) bool active masks of tokens [start, stop)."""
        packed = self.packed_masks(layer)[start:stop]
        return np.unpackbits(packed, axis=-1, count=self.d_ff, bitorder="little").astype(bool)


def _x_name(layer: int) -> str:
    return f"x_{layer:03d}.npy"


def _mask_name(layer: int) -> str:
    return f"mask_{layer:03d}.npy"


def _score_name(layer: int) -> str:
    return f"score_{layer:03d}.npy"


# ---- corpus ------------------------------------------------------------------------------------


def read_corpus(paths: Sequence[Path]) -> list[str]:
    texts = []
    for p in paths:
        p = Path(p)
        try:
            texts.append(p.read_text(encoding="utf-8"))
        except FileNotFoundError:
            raise SparseInferError(f"corpus file not found: {p}") from None
        except IsADirectoryError:
            raise SparseInferError(f"corpus: expected a text file, found a directory: "
                                   f"{p}") from None
        except UnicodeDecodeError as e:
            raise SparseInferError(f"corpus {p}: expected UTF-8 text: {e}") from None
        except OSError as e:
            raise SparseInferError(f"corpus {p}: cannot read: {e.strerror}") from None
    return texts


def corpus_chunks(tokenizer, texts: Sequence[str], chunk_len: int, max_tokens: int,
                  min_tokens: int = MIN_TOKENS) -> list[list[int]]:
    """Token chunks of the concatenated texts: full chunks of ``chunk_len`` (BOS first when the
    tokenizer adds one), plus a last partial one of at least 16 tokens, ``max_tokens`` in all.

    Raises SparseInferError when fewer than ``min_tokens`` tokens result.
    """
    ids: list[int] = []
    for t in texts:
        ids.extend(tokenizer.encode(t, add_bos=False))
        if len(ids) >= max_tokens:
            break
    bos = tokenizer.bos_id if getattr(tokenizer, "add_bos", False) else None
    step = chunk_len - (bos is not None)
    chunks, total, i = [], 0, 0
    while i < len(ids) and total < max_tokens:
        body = ids[i: i + min(step, max_tokens - total - (bos is not None))]
        i += len(body)
        chunk = ([bos] if bos is not None else []) + body
        if len(chunk) < min(16, chunk_len) or not body:
            break
        chunks.append(chunk)
        total += len(chunk)
    if total < min_tokens:
        raise SparseInferError(
            f"corpus too small: expected at least {min_tokens} tokens to profile, found {total} "
            f"(the corpus has {len(ids)} tokens; give a longer --corpus or raise --max-tokens)"
        )
    return chunks


# ---- profiling ---------------------------------------------------------------------------------


def _prepare_dir(out_dir: Path) -> None:
    try:
        out_dir.mkdir(parents=True, exist_ok=True)
        (out_dir / "profile.json").unlink(missing_ok=True)  # incomplete until rewritten
        probe = out_dir / ".write-test"
        probe.write_bytes(b"")
        probe.unlink()
    except OSError as e:
        raise SparseInferError(f"profile directory {out_dir}: cannot write: "
                               f"{e.strerror or e}") from None
    for f in out_dir.glob("*.npy"):
        if f.name.startswith(("x_", "mask_", "score_")) or f.name in ("counts.npy",
                                                                      "thresholds.npy"):
            f.unlink()


def profile_model(model: Transformer, chunks: Sequence[Sequence[int]], out_dir: str | Path,
                  options: ProfileOptions = ProfileOptions(), model_name: str = "",
                  progress: Callable[[str, int, int], Progress] | None = None,
                  thresholds: Sequence[float] | None = None) -> Profile:
    """Profile ``model`` on token ``chunks`` into ``out_dir``; returns the finished Profile.

    ``thresholds`` (magnitude mode) fixes the per-layer thresholds instead of calibrating them
    on these chunks (to profile held-out text with a model's calibrated thresholds).

    ``progress(stage, total, unit)`` (optional) makes a callback for a stage ("profile": total in
    tokens; "masks": total in layers) that is called with the units just done.
    """
    t0 = time.perf_counter()
    cfg = model.cfg
    out_dir = Path(out_dir)
    L, D, F = cfg.n_layers, cfg.d_model, cfg.d_ff
    relu = FFN_KINDS[cfg.ffn_kind].relu_sparse
    mode = "relu" if relu else "magnitude"
    chunk_lens = tuple(len(c) for c in chunks)
    T = sum(chunk_lens)
    if T < options.min_tokens:
        raise SparseInferError(f"corpus too small: expected at least {options.min_tokens} tokens "
                               f"to profile, found {T}")
    if thresholds is not None and len(thresholds) != L:
        raise SparseInferError(f"thresholds: expected one per layer ({L}), got {len(thresholds)}")
    _prepare_dir(out_dir)
    n_bytes = (F + 7) // 8
    xs = [_RowWriter(out_dir / _x_name(l), np.float16, (T, D)) for l in range(L)]
    masks = [_RowWriter(out_dir / _mask_name(l), np.uint8, (T, n_bytes)) for l in range(L)]
    counts = torch.zeros(L, F, dtype=torch.int64)
    hist = None if (relu or thresholds is not None) else ScoreHistogram(L)
    scores = [] if hist is None else [_RowWriter(out_dir / _score_name(l), np.float16, (T, F))
                                      for l in range(L)]
    fixed = None if thresholds is None else torch.tensor(thresholds, dtype=torch.float32)
    norms: dict[int, torch.Tensor] = {}
    clipped: set[int] = set()
    row = 0  # first row of the current chunk

    def write_mask(i, active):
        counts[i] += active.sum(0)
        masks[i].write(row, np.packbits(active.numpy(), axis=-1, bitorder="little"))

    def record(i, ffn, x, h):
        if float(x.abs().max()) > FP16_MAX and i not in clipped:
            clipped.add(i)
            log.warning("layer %d: FFN inputs exceed the float16 range; stored clipped", i)
        xs[i].write(row, x[0].clamp(-FP16_MAX, FP16_MAX).to(torch.float16).numpy())
        if relu:
            write_mask(i, h[0] != 0)
            return None
        if options.score == "output_norm" and i not in norms:
            norms[i] = down_norms(ffn)
        s = neuron_scores(ffn, x, h, options.score, norms.get(i))[0].float()
        if fixed is not None:
            write_mask(i, s > fixed[i])
        else:
            hist.add(i, s)
            scores[i].write(row, s.clamp(max=FP16_MAX).to(torch.float16).numpy())
        return None

    tick = progress("profile", T, "tok") if progress else None
    cache = model.new_cache(1, max(chunk_lens))
    log.info("profiling %s: %d tokens in %d chunks, %s mode", model_name or cfg.name, T,
             len(chunks), mode)
    try:
        with hooked_ffns(model, record), torch.inference_mode():
            for c in chunks:
                model.hidden(torch.tensor([list(c)], dtype=torch.long), 0, cache)
                row += len(c)
                if tick:
                    tick(len(c))
        for w in scores:
            w.close()
        if relu:
            thresholds = np.zeros(L, dtype=np.float32)
        elif hist is None:
            thresholds = np.asarray(thresholds, dtype=np.float32)
        else:
            thresholds = hist.thresholds(options.target_density)
            tick = progress("masks", L, "layer") if progress else None
            for l in range(L):  # one layer's scores and masks mapped at a time
                s_l = np.load(out_dir / _score_name(l), mmap_mode="r")
                m_l = np.lib.format.open_memmap(out_dir / _mask_name(l), "r+")
                counts[l] = _threshold_masks(s_l, m_l, float(thresholds[l]))
                m_l.flush()
                del s_l, m_l
                (out_dir / _score_name(l)).unlink()
                if tick:
                    tick(1)
        np.save(out_dir / "counts.npy", counts.numpy())
        np.save(out_dir / "thresholds.npy", thresholds)
        seconds = time.perf_counter() - t0
        prof = Profile(
            path=out_dir, model=model_name or cfg.name, ffn_kind=cfg.ffn_kind, mode=mode,
            score=None if relu else options.score,
            target_density=None if relu else options.target_density,
            n_layers=L, d_model=D, d_ff=F, n_tokens=T, chunk_lens=chunk_lens,
            thresholds=thresholds, counts=counts.numpy(), seconds=seconds,
        )
        _write_json(prof)  # last: marks the directory complete
    except OSError as e:
        raise SparseInferError(f"profile directory {out_dir}: cannot write: {e.strerror or e}") \
            from None
    finally:
        for w in xs + masks + scores:  # also on an error
            w.close()
    log.info("profile written to %s in %.1f s: mean density %.3f", out_dir, seconds,
             float(prof.densities.mean()))
    return prof


class _RowWriter:
    """An .npy file of ``shape`` written a block of rows at a time with ``pwrite``, not through
    a mapping: written pages stay in the page cache, not in this process's resident memory (a
    mapping's dirty pages count in its RSS until it is closed: a 7B profile of 4,096 tokens
    stores about 1 GiB of inputs and masks)."""

    def __init__(self, path: Path, dtype, shape: tuple[int, int]):
        mm = np.lib.format.open_memmap(path, "w+", dtype, shape)  # header + a sparse file
        self.offset, self.dtype = mm.offset, np.dtype(dtype)
        self.row_bytes = shape[1] * self.dtype.itemsize
        del mm
        self.fd: int | None = os.open(path, os.O_WRONLY)

    def write(self, row: int, rows: np.ndarray) -> None:
        data = np.ascontiguousarray(rows, dtype=self.dtype)
        view, pos = memoryview(data).cast("B"), self.offset + row * self.row_bytes
        while view:  # pwrite may write less than asked
            n = os.pwrite(self.fd, view, pos)
            view, pos = view[n:], pos + n

    def close(self) -> None:
        if self.fd is not None:
            os.close(self.fd)
            self.fd = None


def _threshold_masks(scores: np.ndarray, masks: np.ndarray, threshold: float) -> torch.Tensor:
    """Masks (score > threshold) of one layer from its stored scores; returns per-neuron counts."""
    counts = torch.zeros(scores.shape[1], dtype=torch.int64)
    block = max(16, MASK_BLOCK_BYTES // (4 * scores.shape[1]))
    t = np.float32(threshold)
    for start in range(0, scores.shape[0], block):
        active = scores[start: start + block].astype(np.float32) > t
        counts += torch.from_numpy(active.sum(0))
        masks[start: start + active.shape[0]] = np.packbits(active, axis=-1, bitorder="little")
    return counts


def _write_json(p: Profile) -> None:
    d = {k: v for k, v in asdict(p).items() if k not in ("path", "thresholds", "counts")}
    d.update(format=PROFILE_FORMAT, version=PROFILE_VERSION, chunk_lens=list(p.chunk_lens))
    tmp = p.path / "profile.json.tmp"
    tmp.write_text(json.dumps(d, indent=1))
    os.replace(tmp, p.path / "profile.json")


def load_profile(path: str | Path) -> Profile:
    """Open a profile directory written by :func:`profile_model`."""
    path = Path(path)
    meta_file = path / "profile.json"
    if not path.is_dir():
        raise SparseInferError(f"profile: expected a directory written by `sparseinfer profile`, "
                               f"found {'a file' if path.exists() else 'nothing'} at {path}")
    if not meta_file.is_file():
        raise SparseInferError(f"{path}: expected profile.json (written when profiling "
                               f"finishes), found none: an unfinished or foreign directory")
    d = read_json(meta_file)
    if d.get("format") != PROFILE_FORMAT or d.get("version") != PROFILE_VERSION:
        raise SparseInferError(f"{meta_file}: expected format {PROFILE_FORMAT!r} version "
                               f"{PROFILE_VERSION}, found {d.get('format')!r} version "
                               f"{d.get('version')!r}")
    try:
        counts = np.load(path / "counts.npy")
        thresholds = np.load(path / "thresholds.npy")
        prof = Profile(
            path=path, model=d["model"], ffn_kind=d["ffn_kind"], mode=d["mode"],
            score=d["score"], target_density=d["target_density"], n_layers=int(d["n_layers"]),
            d_model=int(d["d_model"]), d_ff=int(d["d_ff"]), n_tokens=int(d["n_tokens"]),
            chunk_lens=tuple(int(n) for n in d["chunk_lens"]), thresholds=thresholds,
            counts=counts, seconds=float(d.get("seconds", 0.0)),
        )
    except (KeyError, OSError, ValueError) as e:
        raise SparseInferError(f"{path}: incomplete or corrupt profile: {e!r}") from None
    L, F = prof.n_layers, prof.d_ff
    if counts.shape != (L, F) or thresholds.shape != (L,):
        raise SparseInferError(f"{path}: expected counts ({L}, {F}) and thresholds ({L},), found "
                               f"{counts.shape} and {thresholds.shape}")
    for l in range(L):
        for name, want in ((_x_name(l), (prof.n_tokens, prof.d_model)),
                           (_mask_name(l), (prof.n_tokens, (F + 7) // 8))):
            try:
                shape = np.load(path / name, mmap_mode="r").shape
            except (OSError, ValueError) as e:
                raise SparseInferError(f"{path / name}: cannot read: {e}") from None
            if shape != want:
                raise SparseInferError(f"{path / name}: expected shape {want}, found {shape}")
    return prof


def remove_profile(path: str | Path) -> None:
    """Delete a profile directory (only the files a profile consists of, then the directory)."""
    path = Path(path)
    if not path.is_dir():
        return
    for f in path.iterdir():
        if f.name in ("profile.json", "profile.json.tmp", "counts.npy", "thresholds.npy") or (
                f.name.startswith(("x_", "mask_", "score_")) and f.suffix == ".npy"):
            f.unlink()
    try:
        path.rmdir()  # only when nothing else was in it
    except OSError:
        pass
