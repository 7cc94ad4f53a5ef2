"""Every bad model input gives one clear error naming the file and what was expected and found,
and the CLI shows it as one `error:` line without a traceback."""

from __future__ import annotations

import json
import shutil

import numpy as np
import pytest
from safetensors.torch import load_file, save_file

from sparseinfer.cli import main
from sparseinfer.errors import ModelFileError, SparseInferError
from sparseinfer.models.loading import load_model


def _cli_error(capsys, argv) -> str:
    code = main(argv)
    err = capsys.readouterr().err
    assert code == 1
    assert "Traceback" not in err
    lines = [ln for ln in err.splitlines() if ln.startswith("error:")]
    assert len(lines) == 1, err
    return lines[0]


def test_missing_file(tmp_path, capsys):
    line = _cli_error(capsys, ["run", "-m", str(tmp_path / "nope.gguf"), "-p", "hi"])
    assert "model not found" in line and "nope.gguf" in line


def test_not_a_model_file(tmp_path):
    bad = tmp_path / "notes.txt"
    bad.write_text("hello world")
    with pytest.raises(ModelFileError, match=r"notes\.txt.*expected a GGUF file.*found magic"):
        load_model(bad)


@pytest.mark.slow
def test_truncated_gguf(tmp_path, smollm2_path, capsys):
    cut = tmp_path / "cut.gguf"
    with open(smollm2_path, "rb") as f:
        cut.write_bytes(f.read(40_000_000))  # header intact, tensor data cut short
    line = _cli_error(capsys, ["info", "-m", str(cut)])
    assert "cut.gguf" in line and ("truncated" in line or "corrupt" in line)


def test_truncated_gguf_header(tmp_path, smollm2_path):
    cut = tmp_path / "head.gguf"
    with open(smollm2_path, "rb") as f:
        cut.write_bytes(f.read(5000))  # inside the metadata
    with pytest.raises(ModelFileError, match=r"head\.gguf.*(truncated|corrupt)"):
        load_model(cut)


def test_corrupt_gguf(tmp_path):
    bad = tmp_path / "garbage.gguf"
    rng = np.random.default_rng(0)
    bad.write_bytes(b"GGUF" + rng.integers(0, 256, 4096, dtype=np.uint8).tobytes())
    with pytest.raises(ModelFileError, match=r"garbage\.gguf"):
        load_model(bad)


def test_unknown_gguf_architecture(tmp_path):
    import gguf

    path = tmp_path / "mamba.gguf"
    w = gguf.GGUFWriter(str(path), "mamba")
    w.add_tensor("token_embd.weight", np.zeros((4, 8), dtype=np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    with pytest.raises(ModelFileError, match=r"mamba\.gguf.*unsupported architecture 'mamba'.*llama"):
        load_model(path)


def test_split_gguf_with_a_part_missing(tmp_path, capsys):
    """Parts written by gguf-py's own splitting writer (llama.cpp's gguf-split naming and
    ``split.*`` keys), one of them gone: the error names it, from whichever part is given
    (tests/models/test_split_gguf.py reads a whole split model)."""
    import gguf

    w = gguf.GGUFWriter(str(tmp_path / "m.gguf"), "llama", split_max_tensors=1)
    for i in range(3):
        w.add_tensor(f"blk.{i}.attn_norm.weight", np.ones(8, dtype=np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    parts = sorted(tmp_path.glob("m-*-of-*.gguf"))
    assert [p.name for p in parts] == [f"m-0000{i}-of-00003.gguf" for i in (1, 2, 3)]
    parts[2].unlink()
    with pytest.raises(ModelFileError, match=r"m-00001-of-00003\.gguf: part of a model split "
                                             r"into 3 files.*missing m-00003-of-00003\.gguf"):
        load_model(parts[0])
    line = _cli_error(capsys, ["info", "-m", str(parts[1])])
    assert "split into 3 files" in line and "missing m-00003-of-00003.gguf" in line


def test_unknown_hf_architecture(foreign_arch_dir):
    d = foreign_arch_dir("swiglu", "MambaForCausalLM")
    with pytest.raises(ModelFileError, match=r"unsupported architecture 'MambaForCausalLM'"):
        load_model(d)


def test_missing_tensor(tmp_path, tiny_model_dir):
    d = tmp_path / "m"
    shutil.copytree(tiny_model_dir("swiglu"), d)
    st = load_file(d / "model.safetensors")
    del st["model.layers.1.mlp.up_proj.weight"]
    save_file(st, d / "model.safetensors")
    with pytest.raises(ModelFileError,
                       match=r"missing tensor 'model\.layers\.1\.mlp\.up_proj\.weight'"):
        load_model(d)


def test_wrong_shape(tmp_path, tiny_model_dir, capsys):
    d = tmp_path / "m"
    shutil.copytree(tiny_model_dir("reglu"), d)
    st = load_file(d / "model.safetensors")
    st["model.layers.0.self_attn.q_proj.weight"] = st["model.layers.0.self_attn.q_proj.weight"][:, :32].contiguous()
    save_file(st, d / "model.safetensors")
    line = _cli_error(capsys, ["run", "-m", str(d), "-p", "x"])
    assert "q_proj.weight" in line and "expected shape (64, 64)" in line and "(64, 32)" in line


def test_truncated_safetensors(tmp_path, tiny_model_dir):
    d = tmp_path / "m"
    shutil.copytree(tiny_model_dir("opt"), d)
    data = (d / "model.safetensors").read_bytes()
    (d / "model.safetensors").write_bytes(data[: len(data) // 2])
    with pytest.raises(ModelFileError, match=r"model\.safetensors.*(truncated|corrupt)"):
        load_model(d)


def test_missing_config_key(tmp_path, tiny_model_dir):
    d = tmp_path / "m"
    shutil.copytree(tiny_model_dir("swiglu"), d)
    cfg = json.loads((d / "config.json").read_text())
    del cfg["hidden_size"]
    (d / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ModelFileError, match=r"config\.json: missing key 'hidden_size'"):
        load_model(d)


def test_prompt_longer_than_context(tiny_model_dir, capsys):
    line = _cli_error(capsys, ["run", "-m", str(tiny_model_dir("swiglu")), "-c", "16",
                               "-p", "a long prompt " * 20])
    assert "context holds 16" in line and "tokens" in line


def test_bad_sampling_flag(capsys, tiny_model_dir):
    line = _cli_error(capsys, ["run", "-m", str(tiny_model_dir("swiglu")), "-p", "x",
                               "--top-p", "1.5"])
    assert "--top-p" in line and "1.5" in line


def test_library_raises_one_type():
    assert issubclass(ModelFileError, SparseInferError)
