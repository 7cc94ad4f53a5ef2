"""Where ``-m`` points: a path, or a model another tool already put on this machine.

    find_model("model.gguf")                      # a GGUF file or a Hugging Face directory
    find_model("llama3.2:1b")                     # pulled with Ollama (~/.ollama/models)
    find_model("HuggingFaceTB/SmolLM2-135M")      # in the Hugging Face cache (safetensors)
    find_model("bartowski/Llama-3.2-1B-Instruct-GGUF:Q4_K_M")  # a GGUF repository, one quant

Nothing is downloaded: Ollama's manifests are read from its model directory (``OLLAMA_MODELS``,
else ``~/.ollama/models``, else the Linux service's ``/usr/share/ollama/.ollama/models``), and
Hugging Face repositories are looked up by ``huggingface_hub`` with ``local_files_only`` in its
cache (``HF_HUB_CACHE`` / ``HF_HOME``). An existing path always wins.
"""

from __future__ import annotations

import json
import os
import re
from dataclasses import dataclass
from pathlib import Path

from ..errors import SparseInferError

OLLAMA_MODEL_LAYER = "application/vnd.ollama.image.model"
OLLAMA_HOST, OLLAMA_NAMESPACE, OLLAMA_TAG = "registry.ollama.ai", "library", "latest"
PATH_SUFFIXES = (".gguf", ".bin", ".safetensors")  # a name ending so is a file, not a model name
# llama.cpp's gguf-split names its parts PREFIX-00001-of-00003.gguf
SPLIT_PART = re.compile(r"^(?P<prefix>.+)-(?P<no>\d{5})-of-(?P<count>\d{5})\.gguf$")


@dataclass(frozen=True)
class FoundModel:
    path: Path  # the GGUF file or Hugging Face directory to open
    name: str  # what to call it (the server's model id): the name asked for, or the file's stem
    origin: str  # "path" | "ollama" | "huggingface"


def ollama_dirs() -> list[Path]:
    """Ollama's model directories to look in, in order."""
    if os.environ.get("OLLAMA_MODELS"):
        return [Path(os.environ["OLLAMA_MODELS"]).expanduser()]
    return [Path.home() / ".ollama" / "models", Path("/usr/share/ollama/.ollama/models")]


def hf_cache_dir() -> Path:
    from huggingface_hub import constants

    return Path(constants.HF_HUB_CACHE)


def find_model(spec: str | Path, *, ollama: list[Path] | None = None,
               hf_cache: Path | None = None) -> FoundModel:
    """The model ``spec`` names: an existing path, else an Ollama model, else a Hugging Face
    repository in the local cache (``ollama`` / ``hf_cache``: the places to look, default the
    tools' own). Raises ``SparseInferError`` naming every place looked in."""
    path = Path(spec).expanduser()
    if path.exists():
        split = SPLIT_PART.match(path.name)
        name = split["prefix"] if split else path.stem if path.is_file() else path.name
        return FoundModel(path, name, "path")
    text = str(spec)
    if path.is_absolute() or text.startswith((".", "~")) or path.suffix in PATH_SUFFIXES:
        raise SparseInferError(f"model not found: {text} (no such file or directory)")
    dirs = ollama_dirs() if ollama is None else ollama
    found = _ollama(text, dirs)
    if found is not None:
        return found
    cache = hf_cache_dir() if hf_cache is None else hf_cache
    found = _huggingface(text, cache)
    if found is not None:
        return found
    pulled = [n for d in dirs for n in ollama_names(d)]
    have = f"; it has {', '.join(pulled[:8])}{' …' if len(pulled) > 8 else ''}" if pulled else ""
    raise SparseInferError(
        f"model not found: {text} (-m: expected a GGUF file, a Hugging Face model directory, a "
        f"model pulled with Ollama (looked in {', '.join(map(str, dirs))}{have}) or a Hugging "
        f"Face repository in its cache (looked in {cache}); nothing is downloaded)")


def _ollama_parts(name: str) -> tuple[str, str, str, str] | None:
    """``[host/][namespace/]model[:tag]`` -> (host, namespace, model, tag), Ollama's defaults
    filled in; None if it cannot be an Ollama name."""
    base, _, tag = name.partition(":")
    parts = base.split("/")
    if not all(parts) or len(parts) > 3 or "/" in tag or ".." in parts:
        return None
    host, namespace = OLLAMA_HOST, OLLAMA_NAMESPACE
    if len(parts) == 3:
        host, namespace = parts[0], parts[1]
    elif len(parts) == 2:
        namespace = parts[0]
    return host, namespace, parts[-1], tag or OLLAMA_TAG


def _ollama(name: str, dirs: list[Path]) -> FoundModel | None:
    parts = _ollama_parts(name)
    if parts is None:
        return None
    host, namespace, model, tag = parts
    for d in dirs:
        manifest = d / "manifests" / host / namespace / model / tag
        if not manifest.is_file():
            continue
        try:
            layers = json.loads(manifest.read_text())["layers"]
            digest = next(x["digest"] for x in layers if x.get("mediaType") == OLLAMA_MODEL_LAYER)
        except (ValueError, KeyError, TypeError, StopIteration):
            raise SparseInferError(f"{manifest}: expected an Ollama manifest with a layer of type "
                                   f"{OLLAMA_MODEL_LAYER}, found none") from None
        # blobs are "sha256-<hex>" (older Ollama: "sha256:<hex>")
        for blob in (d / "blobs" / digest.replace(":", "-"), d / "blobs" / digest):
            if blob.is_file():
                short = name if ":" in name else f"{name}:{tag}"
                return FoundModel(blob, short, "ollama")
        raise SparseInferError(f"{manifest} names the model blob {digest}, which is not in "
                               f"{d / 'blobs'} (a pull that did not finish? `ollama pull {name}`)")
    return None


def ollama_names(d: Path) -> list[str]:
    """The models pulled into Ollama's directory ``d``, as Ollama names them."""
    root = d / "manifests"
    if not root.is_dir():
        return []
    names = []
    for m in root.glob("*/*/*/*"):
        host, namespace, model = m.parts[-4:-1]
        base = model if (host, namespace) == (OLLAMA_HOST, OLLAMA_NAMESPACE) else (
            f"{namespace}/{model}" if host == OLLAMA_HOST else f"{host}/{namespace}/{model}")
        names.append(f"{base}:{m.name}")
    return sorted(names)


def _huggingface(spec: str, cache: Path) -> FoundModel | None:
    """``org/name[:quant]`` in the Hugging Face cache: the snapshot directory when it holds a
    config.json (safetensors), else its one GGUF file (``:quant`` picks one of several by
    name, as llama.cpp's ``-hf`` does)."""
    repo, _, quant = spec.partition(":")
    if repo.count("/") != 1 or not all(repo.split("/")):
        return None
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import LocalEntryNotFoundError

    try:
        snap = Path(snapshot_download(repo, cache_dir=cache, local_files_only=True))
    except (LocalEntryNotFoundError, ValueError, OSError):
        return None
    if not quant and (snap / "config.json").is_file():
        return FoundModel(snap, repo, "huggingface")
    every = sorted(snap.rglob("*.gguf"))
    # a split model counts once, by its first part (the loader reads the others beside it)
    ggufs = [g for g in every if not _later_split_part(g.name)]
    if quant:
        ggufs = [g for g in ggufs if quant.lower() in g.name.lower()]
    if len(ggufs) == 1:
        return FoundModel(ggufs[0], spec, "huggingface")
    if not ggufs:
        what = f"no GGUF file whose name has {quant!r}" if quant else \
            "neither config.json nor a GGUF file"
        have = ", ".join(str(g.relative_to(snap)) for g in every)
        raise SparseInferError(f"{repo} in the Hugging Face cache ({snap}) has {what}"
                               f"{f' (it has {have})' if have else ''}")
    names = ", ".join(str(g.relative_to(snap)) for g in ggufs)
    raise SparseInferError(f"{spec}: the Hugging Face cache holds {len(ggufs)} GGUF files of "
                           f"{repo} ({names}); expected one: name a quant, e.g. "
                           f"{repo}:{_quant_hint(ggufs[0].stem)}")


def _later_split_part(name: str) -> bool:
    """``model-00002-of-00003.gguf`` (llama.cpp's gguf-split naming), not the first part."""
    m = SPLIT_PART.match(name)
    return m is not None and int(m["no"]) > 1


def _quant_hint(stem: str) -> str:
    """The quant part of a GGUF file name (``Llama-3.2-1B-Q4_K_M`` -> ``Q4_K_M``)."""
    return stem.rsplit("-", 1)[-1] if "-" in stem else stem
