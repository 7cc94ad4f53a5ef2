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
    t = _timings(err)
    from sparseinfer.models.loading import load_model

    n_prompt = len(load_model(tiny_model_dir("swiglu")).tokenizer.encode("Emma said"))
    assert t["prompt eval time"][1] == n_prompt and t["eval time"][1] == 11  # 12 - the first
    assert t["total time"][1] == n_prompt + 11
    assert t["total time"][0] == pytest.approx(t["prompt eval time"][0] + t["eval time"][0],
                                               abs=0.02)
    for key in ("prompt eval time", "eval time"):
        ms, n, per_token, rate = t[key]
        # printed values are rounded to 0.01 (ms of a tiny model can be < 1): within that
        assert abs(per_token * n - ms) <= 0.006 * n + 0.006
        assert abs(rate * ms / 1e3 - n) <= n * 0.006 / ms + 0.006 * ms / 1e3 + 1e-3
    assert t["load time"][0] > 0 and "warm-up" in t["load line"]  # warm-up ran outside
    from sparseinfer import cpu
    from sparseinfer.threads import default_threads

    if cpu.loads():  # the threads it ran with, and why (no -t: the cores)
        assert f"threads: {default_threads()} (the cores)" in err


def test_run_says_threads_asked(tiny_model_dir, capsys):
    assert main(["run", "-m", str(tiny_model_dir("swiglu")), "-p", "Emma said", "-n", "2",
                 "-t", "1"]) == 0
    assert "threads: 1 (-t)" in capsys.readouterr().err


def _timings(err: str) -> dict:
    """llama.cpp-style timing lines -> {label: (ms, n, ms per token, tokens per second)}."""
    import re

    out = {}
    for line in err.splitlines():
        m = re.match(r"\s*(prompt eval time|eval time|total time|load time) = +([\d.]+) ms"
                     r"(?: / +(\d+) \w+)?(?: +\( *([\d.]+) ms per token, +([\d.]+) tokens per "
                     r"second\))?", line)
        if m:
            label, ms, n, per, rate = m.groups()
            out[label] = (float(ms), int(n) if n else None, float(per) if per else None,
                          float(rate) if rate else None)
            if label == "load time":
                out["load line"] = line
    assert {"load time", "prompt eval time", "eval time", "total time"} <= out.keys(), err
    return out


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


def test_chat_template_kwargs(tiny_model_dir, monkeypatch, capsys):
    """--chat-template-kwargs reaches the template (Qwen3's enable_thinking, say); not a JSON
    object is refused by the parser."""
    from sparseinfer.tokenizer import Tokenizer

    seen = []
    render = Tokenizer.apply_chat_template

    def recording(self, messages, add_generation_prompt=True, template_kwargs=None):
        seen.append(template_kwargs)
        return render(self, messages, add_generation_prompt, template_kwargs)

    monkeypatch.setattr(Tokenizer, "apply_chat_template", recording)
    monkeypatch.setattr(sys, "stdin", io.StringIO("hello\n\n"))
    assert main(["chat", "-m", str(tiny_model_dir("swiglu")), "-n", "2", "--no-warmup",
                 "--chat-template-kwargs", '{"enable_thinking": false}']) == 0
    assert seen == [{"enable_thinking": False}]
    with pytest.raises(SystemExit) as exc:
        main(["chat", "--chat-template-kwargs", "[1]"])
    assert exc.value.code == 2
    assert "expected a JSON object, got '[1]'" in capsys.readouterr().err


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


@pytest.mark.parametrize("kind", ["swiglu", pytest.param("opt", marks=pytest.mark.slow)])
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


# ---- the first ten minutes: fast help, checks before the load, honest messages -------------


def test_help_and_version_do_not_import_torch():
    code = ("import sys\nfrom sparseinfer.cli import main\n"
            "for argv in (['--help'], ['--version'], ['convert', '--help'], ['run', '--help']):\n"
            "    try:\n        main(argv)\n    except SystemExit:\n        pass\n"
            "print('torch' in sys.modules, 'numba' in sys.modules)")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    assert "sparseinfer 0.1.0" in r.stdout
    assert r.stdout.strip().splitlines()[-1] == "False False"


@pytest.fixture
def no_load(monkeypatch):
    """Engine.load fails the test: the command must reject its arguments first."""
    from sparseinfer.engine import Engine

    def load(*a, **kw):
        raise AssertionError("the model was loaded")

    monkeypatch.setattr(Engine, "load", load)


@pytest.mark.parametrize("argv, message", [
    (["run", "-p", ""], "the prompt is empty"),
    (["run", "-p", "hi", "-n", "-2"], "-n/--n-predict: expected -1"),
    (["run", "-p", "hi", "-t", "0"], "-t/--threads: expected a positive number"),
    (["run", "-p", "hi", "-c", "4"], "-c/--ctx-size: expected at least 8"),
    (["run", "-p", "hi", "-m", "/no/such/model.gguf"], "model not found: /no/such/model.gguf"),
    (["serve", "--port", "70000"], "--port: expected 0-65535"),
    (["serve", "--port", "0", "-np", "0"], "-np/--parallel: expected a positive number"),
    (["serve", "--port", "0", "-np", "2", "--batch-prefill-chunk", "0"],
     "--batch-prefill-chunk: expected a positive number"),
    (["serve", "--port", "0", "-np", "2", "--batch-step-rows", "-1"],
     "--batch-step-rows: expected 0 (no budget) or a positive number, got -1"),
    (["serve", "--port", "0", "-np", "2", "--batch-step-ratio", "0.5"],
     "--batch-step-ratio: expected 0 (no budget) or a finite number > 1, got 0.5"),
    (["serve", "--port", "0", "-np", "2", "--batch-step-ratio", "inf"],
     "--batch-step-ratio: expected 0 (no budget) or a finite number > 1, got inf"),
])
def test_bad_arguments_rejected_before_loading(no_load, capsys, argv, message):
    assert main(argv) == 1
    err = capsys.readouterr().err
    assert err.startswith("error: ") and message in err and err.count("\n") == 1


def test_serve_on_a_taken_port_is_one_error_line(no_load, capsys):
    import socket

    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        assert main(["serve", "--port", str(port)]) == 1
    err = capsys.readouterr().err
    assert err == (f"error: --port: expected a free port on 127.0.0.1, got {port} "
                   f"(Address already in use); choose another with --port\n")


def test_run_n_zero_prints_no_rate(tiny_model_dir, capsys):
    assert main(["run", "-m", str(tiny_model_dir("swiglu")), "-p", "Emma said", "-n", "0"]) == 0
    out, err = capsys.readouterr()
    assert out == "Emma said\n"
    assert "not evaluated" in err and "tokens/s" not in err


def test_run_too_long_prompt_is_not_echoed(tiny_model_dir, capsys):
    prompt = "Emma Woodhouse, handsome, clever, and rich " * 20
    assert main(["run", "-m", str(tiny_model_dir("swiglu")), "-p", prompt, "-c", "16"]) == 1
    out, err = capsys.readouterr()
    assert out == ""
    assert err.splitlines()[-1].startswith("error: the prompt has 4")


def test_run_until_context_full_says_so(tiny_model_dir, capsys):
    assert main(["run", "-m", str(tiny_model_dir("swiglu")), "-p", "Emma said", "-n", "-1",
                 "-c", "24", "--ignore-eos", "--temp", "0"]) == 0
    err = capsys.readouterr().err
    assert "stopped: the context is full (24 tokens); --context-shift" in err


def test_run_with_context_shift_goes_past_the_context(tiny_model_dir, capsys):
    assert main(["run", "-m", str(tiny_model_dir("swiglu")), "-p", "Emma said", "-n", "40",
                 "-c", "24", "--ignore-eos", "--temp", "0", "--context-shift", "--keep", "2",
                 "--no-warmup"]) == 0
    err = capsys.readouterr().err
    assert "stopped" not in err
    t = _timings(err)
    assert t["eval time"][1] == 39  # 40 tokens generated through a 24-token context
    assert "no warm-up run" in t["load line"]
