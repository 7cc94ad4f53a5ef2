"""The sparseinfer command line on tiny models (and once on the embedded default model)."""

from __future__ import annotations

import io
import math
import subprocess
import sys

import pytest
import torch

from conftest import tiny_hf_model
from sparseinfer.cli import main


def test_run_prints_prompt_continuation_and_speed(tiny_model_dir, capsys):
    code = main(["run", "-m", str(tiny_model_dir("swiglu")), "-p", "Emma said", "-n", "12",
                 "--temp", "0", "--ignore-eos"])
    out, err = capsys.readouterr()
    assert code == 0
    assert out.startswith("Emma said") and len(out) > len("Emma said\n")
    assert "prompt eval:" in err and "generation:" in err and "tokens/s" in err


def test_run_prompt_file_and_seed(tiny_model_dir, tmp_path, capsys):
    f = tmp_path / "p.txt"
    f.write_text("Harriet Smith was")
    argv = ["run", "-m", str(tiny_model_dir("opt")), "-f", str(f), "-n", "10", "--seed", "7",
            "--temp", "1.0", "--ignore-eos"]
    assert main(argv) == 0
    first = capsys.readouterr().out
    assert main(argv) == 0
    assert capsys.readouterr().out == first


def test_run_without_prompt_is_an_error(tiny_model_dir, capsys):
    assert main(["run", "-m", str(tiny_model_dir("swiglu"))]) == 1
    assert "no prompt" in capsys.readouterr().err


def test_chat_two_turns(tiny_model_dir, monkeypatch, capsys):
    monkeypatch.setattr(sys, "stdin", io.StringIO("hello there\nand again\n\n"))
    code = main(["chat", "-m", str(tiny_model_dir("swiglu")), "-n", "6", "--temp", "0",
                 "--ignore-eos", "--system", "Be brief."])
    out = capsys.readouterr().out
    assert code == 0
    assert out.count("\n") >= 2  # one line per reply


def _reference_perplexity(kind: str, ids: list[int], n_ctx: int) -> float:
    """llama.cpp's method computed with the transformers model: score the second half of every
    n_ctx-token chunk."""
    ref = tiny_hf_model(kind)
    nll, n = 0.0, 0
    for c in range(len(ids) // n_ctx):
        chunk = torch.tensor([ids[c * n_ctx:(c + 1) * n_ctx]])
        with torch.no_grad():
            logp = torch.log_softmax(ref(chunk).logits[0].double(), -1)
        first = n_ctx // 2
        for j in range(first, n_ctx - 1):
            nll -= float(logp[j, chunk[0, j + 1]])
            n += 1
    return math.exp(nll / n)


@pytest.mark.parametrize("kind", ["swiglu", "opt"])
def test_perplexity_matches_reference(tiny_model_dir, tmp_path, capsys, kind):
    from sparseinfer.data import HELDOUT_TEXT
    from sparseinfer.tokenizer import Tokenizer

    text = HELDOUT_TEXT.read_text()[:6000]
    f = tmp_path / "t.txt"
    f.write_text(text)
    path = tiny_model_dir(kind)
    assert main(["perplexity", "-m", str(path), "-f", str(f), "-c", "64"]) == 0
    out = capsys.readouterr().out.strip().splitlines()
    assert out[-1].startswith("PPL = ")
    ours = float(out[-1].split("=")[1])
    ids = Tokenizer.from_hf_dir(path).encode(text, add_bos=False)
    assert ours == pytest.approx(_reference_perplexity(kind, ids, 64), rel=1e-4)


def test_perplexity_text_too_short(tiny_model_dir, tmp_path, capsys):
    f = tmp_path / "short.txt"
    f.write_text("Too short.")
    assert main(["perplexity", "-m", str(tiny_model_dir("swiglu")), "-f", str(f), "-c", "64"]) == 1
    assert "at least one chunk" in capsys.readouterr().err


def test_info_lists_tensors(tiny_model_dir, capsys):
    assert main(["info", "-m", str(tiny_model_dir("reglu"))]) == 0
    out = capsys.readouterr().out
    assert "ffn_kind         reglu" in out
    assert "model.layers.1.mlp.down_proj.weight" in out


@pytest.mark.slow
def test_python_m_default_model_greedy():
    """`python -m sparseinfer run` without -m uses the embedded SmolLM2."""
    r = subprocess.run([sys.executable, "-m", "sparseinfer", "run", "-p",
                        "The capital of France is", "-n", "8", "--temp", "0"],
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    assert r.stdout.startswith("The capital of France is")
    assert "Paris" in r.stdout
