"""``-m`` finds models other tools put on this machine: Ollama's store (manifest -> blob) and the
Hugging Face cache (``huggingface_hub`` with ``local_files_only``), laid out here as those tools
lay them out; nothing is downloaded."""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
from pathlib import Path

import gguf
import pytest

from sparseinfer.errors import SparseInferError
from sparseinfer.models.find import OLLAMA_MODEL_LAYER, find_model, ollama_names
from sparseinfer.models.loading import open_source


def _digest(data: bytes) -> str:
    return "sha256:" + hashlib.sha256(data).hexdigest()


def ollama_store(root: Path, models: dict[str, Path], old_blob_names: bool = False) -> Path:
    """An Ollama model directory: ``manifests/<host>/<namespace>/<model>/<tag>`` JSON whose model
    layer's digest names a file in ``blobs`` (linked to the given GGUF), beside a template layer
    as Ollama writes one. ``models``: "host/namespace/model/tag" -> GGUF file."""
    (root / "blobs").mkdir(parents=True, exist_ok=True)
    for key, gguf_path in models.items():
        digest = _digest(gguf_path.read_bytes())
        template = b"{{ .Prompt }}"
        blob = root / "blobs" / (digest if old_blob_names else digest.replace(":", "-"))
        if not blob.exists():
            blob.symlink_to(gguf_path)
        (root / "blobs" / _digest(template).replace(":", "-")).write_bytes(template)
        manifest = root / "manifests" / key
        manifest.parent.mkdir(parents=True, exist_ok=True)
        manifest.write_text(json.dumps({
            "schemaVersion": 2,
            "mediaType": "application/vnd.docker.distribution.manifest.v2+json",
            "config": {"mediaType": "application/vnd.docker.container.image.v1+json",
                       "digest": _digest(b"{}"), "size": 2},
            "layers": [
                {"mediaType": "application/vnd.ollama.image.template",
                 "digest": _digest(template), "size": len(template)},
                {"mediaType": OLLAMA_MODEL_LAYER, "digest": digest,
                 "size": gguf_path.stat().st_size},
            ]}))
    return root


def hf_cache(root: Path, repo: str, files: dict[str, Path | bytes], commit: str = "0" * 40) -> Path:
    """The Hugging Face hub cache's layout for ``repo``: ``models--org--name/refs/main`` naming
    a commit whose ``snapshots/<commit>/`` holds the files (links to blobs, as the hub does)."""
    d = root / ("models--" + repo.replace("/", "--"))
    (d / "refs").mkdir(parents=True, exist_ok=True)
    (d / "refs" / "main").write_text(commit)
    snap = d / "snapshots" / commit
    (d / "blobs").mkdir(exist_ok=True)
    for name, src in files.items():
        data = src if isinstance(src, bytes) else src.read_bytes()
        blob = d / "blobs" / hashlib.sha256(data).hexdigest()
        blob.write_bytes(data)
        (snap / name).parent.mkdir(parents=True, exist_ok=True)
        (snap / name).symlink_to(blob)
    return root


@pytest.fixture
def tiny_gguf(tmp_path) -> Path:
    """A small GGUF written by gguf-py (find_model only resolves; nothing reads its tensors)."""
    path = tmp_path / "tiny.gguf"
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_uint32("llama.block_count", 1)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


@pytest.mark.parametrize("spec, key, name", [
    ("smollm2", "registry.ollama.ai/library/smollm2/latest", "smollm2:latest"),
    ("smollm2:135m", "registry.ollama.ai/library/smollm2/135m", "smollm2:135m"),
    ("me/tuned:q4", "registry.ollama.ai/me/tuned/q4", "me/tuned:q4"),
    ("hf.co/org/Repo-GGUF:Q4_K_M", "hf.co/org/Repo-GGUF/Q4_K_M", "hf.co/org/Repo-GGUF:Q4_K_M"),
])
@pytest.mark.parametrize("old_blob_names", [False, True])
def test_ollama_names(tmp_path, tiny_gguf, spec, key, name, old_blob_names):
    store = ollama_store(tmp_path / "ollama", {key: tiny_gguf}, old_blob_names)
    found = find_model(spec, ollama=[tmp_path / "elsewhere", store], hf_cache=tmp_path / "hf")
    assert found.origin == "ollama" and found.name == name
    assert os.path.samefile(found.path, tiny_gguf)
    assert found.path.parent == store / "blobs"


def test_ollama_names_listed_in_the_error(tmp_path, tiny_gguf):
    store = ollama_store(tmp_path / "ollama", {
        "registry.ollama.ai/library/smollm2/latest": tiny_gguf,
        "registry.ollama.ai/me/tuned/q4": tiny_gguf,
        "hf.co/org/Repo/Q8_0": tiny_gguf})
    assert ollama_names(store) == ["hf.co/org/Repo:Q8_0", "me/tuned:q4", "smollm2:latest"]
    with pytest.raises(SparseInferError) as e:
        find_model("llama3.2:1b", ollama=[store], hf_cache=tmp_path / "hf")
    msg = str(e.value)
    assert "model not found: llama3.2:1b" in msg and str(store) in msg
    assert "smollm2:latest" in msg and str(tmp_path / "hf") in msg and "nothing is downloaded" in msg


def test_ollama_missing_blob_and_bad_manifest(tmp_path, tiny_gguf):
    store = ollama_store(tmp_path / "ollama", {"registry.ollama.ai/library/m/latest": tiny_gguf})
    for blob in (store / "blobs").iterdir():
        blob.unlink()
    with pytest.raises(SparseInferError, match=r"names the model blob sha256:.*not in .*ollama pull m"):
        find_model("m", ollama=[store], hf_cache=tmp_path / "hf")
    (store / "manifests/registry.ollama.ai/library/m/latest").write_text('{"layers": []}')
    with pytest.raises(SparseInferError, match=r"expected an Ollama manifest with a layer of type "
                                               r"application/vnd.ollama.image.model"):
        find_model("m", ollama=[store], hf_cache=tmp_path / "hf")


def test_hf_cache_safetensors_directory(tmp_path):
    cache = hf_cache(tmp_path / "hub", "Org/Model", {"config.json": b"{}",
                                                    "model.safetensors": b"x"})
    found = find_model("Org/Model", ollama=[], hf_cache=cache)
    assert found.origin == "huggingface" and found.name == "Org/Model"
    assert found.path == cache / "models--Org--Model" / "snapshots" / ("0" * 40)


def test_hf_cache_gguf_repository(tmp_path, tiny_gguf):
    cache = hf_cache(tmp_path / "hub", "org/Repo-GGUF", {"Repo-Q4_K_M.gguf": tiny_gguf,
                                                         "Repo-Q8_0.gguf": tiny_gguf,
                                                         "README.md": b"hi"})
    found = find_model("org/Repo-GGUF:q8_0", ollama=[], hf_cache=cache)
    assert found.path.name == "Repo-Q8_0.gguf" and found.name == "org/Repo-GGUF:q8_0"
    assert found.path.read_bytes() == tiny_gguf.read_bytes()
    with pytest.raises(SparseInferError, match=r"holds 2 GGUF files of org/Repo-GGUF "
                                               r"\(Repo-Q4_K_M.gguf, Repo-Q8_0.gguf\); expected "
                                               r"one: name a quant, e.g. org/Repo-GGUF:Q4_K_M"):
        find_model("org/Repo-GGUF", ollama=[], hf_cache=cache)
    with pytest.raises(SparseInferError, match=r"no GGUF file whose name has 'Q2_K' \(it has "
                                               r"Repo-Q4_K_M.gguf, Repo-Q8_0.gguf\)"):
        find_model("org/Repo-GGUF:Q2_K", ollama=[], hf_cache=cache)
    one = hf_cache(tmp_path / "hub", "org/One", {"sub/One-Q4_0.gguf": tiny_gguf})
    assert find_model("org/One", ollama=[], hf_cache=one).path.name == "One-Q4_0.gguf"
    split = hf_cache(tmp_path / "hub", "org/Big", {"Big-Q4_0-00001-of-00002.gguf": tiny_gguf,
                                                   "Big-Q4_0-00002-of-00002.gguf": b"part 2"})
    # a split model is found by its first part (the loader reads the others beside it)
    assert find_model("org/Big", ollama=[], hf_cache=split).path.name == \
        "Big-Q4_0-00001-of-00002.gguf"


def test_paths_win_and_missing_paths_say_so(tmp_path, tiny_gguf, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "org").mkdir()
    local = tmp_path / "org" / "name"
    local.mkdir()  # a directory named like a repository: the path wins
    cache = hf_cache(tmp_path / "hub", "org/name", {"config.json": b"{}"})
    assert find_model("org/name", ollama=[], hf_cache=cache).path == Path("org/name")
    assert find_model(tiny_gguf, ollama=[], hf_cache=cache).name == "tiny"
    for spec in ("/no/such/model.gguf", "./x", "nope.gguf"):
        with pytest.raises(SparseInferError, match=r"model not found: .*\(no such file or "
                                                   r"directory\)$"):
            find_model(spec, ollama=[], hf_cache=cache)


@pytest.mark.slow
def test_cli_and_engine_run_an_ollama_model(tmp_path, smollm2_path):
    """The real SmolLM2 file pulled into an Ollama store: ``-m smollm2`` runs it (greedy text as
    by its path) and the engine, hence the server's model id, is called by Ollama's name."""
    store = ollama_store(tmp_path / "ollama",
                         {"registry.ollama.ai/library/smollm2/latest": smollm2_path})
    env = {**os.environ, "OLLAMA_MODELS": str(store), "HF_HUB_CACHE": str(tmp_path / "hub")}

    def run(model: str) -> str:
        out = subprocess.run([sys.executable, "-m", "sparseinfer", "run", "-m", model, "-p",
                              "The capital of France is", "-n", "8", "--temp", "0",
                              "--no-warmup"], env=env, capture_output=True, text=True,
                             timeout=300)
        assert out.returncode == 0, out.stderr
        return out.stdout

    assert run("smollm2") == run(str(smollm2_path))
    src = open_source(str(smollm2_path))
    assert src.name == smollm2_path.stem
    bad = subprocess.run([sys.executable, "-m", "sparseinfer", "run", "-m", "llama3.2:1b",
                          "-p", "hi"], env=env, capture_output=True, text=True, timeout=300)
    assert bad.returncode == 1 and "Traceback" not in bad.stderr
    assert "model not found: llama3.2:1b" in bad.stderr and "smollm2:latest" in bad.stderr


@pytest.mark.slow
def test_open_source_and_engine_carry_the_name(tmp_path, smollm2_path, monkeypatch):
    store = ollama_store(tmp_path / "ollama",
                         {"registry.ollama.ai/library/smollm2/latest": smollm2_path})
    monkeypatch.setenv("OLLAMA_MODELS", str(store))
    src = open_source("smollm2")
    assert src.name == "smollm2:latest" and src.path.parent == store / "blobs"
    assert src.config.n_layers == gguf.GGUFReader(smollm2_path).fields[
        "llama.block_count"].contents()
    from sparseinfer.engine import Engine

    assert Engine.load("smollm2", n_ctx=64).name == "smollm2:latest"  # the server's model id


def test_a_cached_hugging_face_model_loads_as_its_directory(tmp_path, tiny_model_dir, monkeypatch):
    """A safetensors model in the hub cache (files linked from blobs) loads by its id with the
    logits of the same files read from their directory."""
    import torch
    from huggingface_hub import constants

    from sparseinfer.models.loading import load_model

    src_dir = tiny_model_dir("swiglu")
    cache = hf_cache(tmp_path / "hub", "tiny/llama", {f.name: f for f in src_dir.iterdir()})
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(cache))
    by_id, by_dir = load_model("tiny/llama"), load_model(src_dir)
    assert by_id.source.name == "tiny/llama" and by_id.source.format == "hf"
    ids = torch.tensor([[1, 5, 9, 3]])
    with torch.no_grad():
        logits = [m.model(ids, 0, m.model.new_cache(1, 8)) for m in (by_id, by_dir)]
    assert torch.equal(*logits)
