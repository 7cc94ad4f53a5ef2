"""A converted file through the user's commands: sparse by default, --dense, --sparse-mode oracle.

On a ReLU-family model the oracle active set is exact, so its perplexity equals the dense one;
the predictor mode runs and reports the share of neurons it computed."""

from __future__ import annotations

import pytest

from sparseinfer.cli import main

FAST = ["--max-tokens", "1024", "--chunk-len", "128", "--ranks", "8", "--epochs", "3", "-t", "1"]


@pytest.fixture(scope="module")
def sparse_file(tiny_model_dir, tmp_path_factory):
    out = tmp_path_factory.mktemp("sparse") / "tiny-reglu.sparse.gguf"
    assert main(["convert", "-m", str(tiny_model_dir("reglu")), "-o", str(out), *FAST]) == 0
    return out


def _ppl(capsys, argv) -> tuple[float, str]:
    assert main(argv) == 0
    cap = capsys.readouterr()
    return float(cap.out.strip().splitlines()[-1].split("=")[1]), cap.err


@pytest.mark.slow
def test_sparse_file_perplexity_modes(sparse_file, tiny_model_dir, tmp_path, capsys):
    from sparseinfer.data import HELDOUT_TEXT

    text = tmp_path / "t.txt"
    text.write_text(HELDOUT_TEXT.read_text()[:8000])
    base = ["perplexity", "-f", str(text), "-c", "64"]
    src, _ = _ppl(capsys, [*base, "-m", str(tiny_model_dir("reglu"))])
    dense, err = _ppl(capsys, [*base, "-m", str(sparse_file), "--dense"])
    assert "sparse FFN" not in err
    oracle, err = _ppl(capsys, [*base, "-m", str(sparse_file), "--sparse-mode", "oracle"])
    assert "mode oracle" in err
    pred, err = _ppl(capsys, [*base, "-m", str(sparse_file)])
    assert "mode predictor" in err and "% of neurons computed" in err
    assert dense == pytest.approx(src, rel=1e-5)  # the export changes no output
    assert oracle == pytest.approx(dense, rel=1e-5)  # ReLU zeros skipped exactly
    assert pred == pytest.approx(dense, rel=0.5)  # predictor misses cost something, not everything


@pytest.mark.slow
def test_sparse_file_run_and_threshold_override(sparse_file, capsys):
    argv = ["run", "-m", str(sparse_file), "-p", "Emma", "-n", "8", "--temp", "0", "--ignore-eos"]
    assert main(argv) == 0
    err = capsys.readouterr().err
    assert "mode predictor" in err
    assert main([*argv, "--sparse-threshold=-1e30"]) == 0  # every neuron predicted active
    assert "100.0% of neurons computed" in capsys.readouterr().err


@pytest.mark.slow
def test_sparse_file_with_q4_dense_parts(sparse_file, tiny_model_dir, capsys):
    """--dtype q4 on a converted file: the sparse FFNs stay as they are, attention and the LM
    head become 4-bit / int8, and the CLI runs it."""
    from sparseinfer.engine import Engine
    from sparseinfer.quant.linear import Int4Linear, Int8Linear
    from sparseinfer.sparse.ffn import SparseFFN

    e = Engine.load(sparse_file, dtype="q4", mode="oracle")
    blk = e.model.layers[0]
    assert isinstance(blk.ffn, SparseFFN) and isinstance(blk.attn.wqkv, Int4Linear)
    assert isinstance(e.model.lm_head, Int8Linear) and e.sparse_info is not None
    argv = ["run", "-m", str(sparse_file), "-p", "Emma", "-n", "6", "--temp", "0",
            "--ignore-eos", "--dtype", "q4"]
    assert main(argv) == 0
    assert "mode predictor" in capsys.readouterr().err
