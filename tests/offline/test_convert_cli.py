"""`sparseinfer convert` and the step subcommands end to end through ``cli.main``, and the error
cases: exit status 1, one message, no output file."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
from pathlib import Path

import pytest

import sparseinfer

from sparseinfer.cli import main
from sparseinfer.models.loading import load_model

FAST = ["--max-tokens", "1024", "--chunk-len", "128", "--ranks", "4", "--epochs", "2", "-t", "1"]


def _files(d):
    return sorted(os.listdir(d))


@pytest.mark.slow
def test_convert_end_to_end(tiny_model_dir, tmp_path, capsys, caplog):
    src = tiny_model_dir("reglu")
    out = tmp_path / "sparse.gguf"
    rc = main(["convert", "-m", str(src), "-o", str(out), *FAST, "--budget", "1MB", "-c", "64"])
    captured = capsys.readouterr()
    assert rc == 0, captured.err
    # no profile left behind; the report beside the output
    assert out.is_file() and _files(tmp_path) == ["sparse.gguf", "sparse.report.html"]
    text = captured.out
    assert "held-out perplexity" in text and f"report: {tmp_path / 'sparse.report.html'}" in text
    computed = float(re.search(r"([\d.]+)% of FFN neurons computed per token", text)[1])
    assert ("note: " in text) == (computed > 50)  # the dense source is then likely faster
    page = (tmp_path / "sparse.report.html").read_text()
    assert page.count("<img") == 3 and "Which neurons fire" in page and "Placement" in page
    assert "measured density" in page and "perplexity" in page
    # not a terminal: progress comes as log lines, one per stage start and end at least
    for stage in ("load", "profile", "train", "export", "evaluate"):
        assert f"{stage}: done" in caplog.text
    assert "to go" in caplog.text  # an estimate of the rest
    assert "layer  density  rank  recall precision pred.dens     hot" in text
    assert "predictors:" in text and "placement: optimal" in text
    assert f"wrote {out}" in text
    lines = [ln.split() for ln in text.splitlines() if ln.startswith("    ")]
    assert [int(ln[0]) for ln in lines] == [0, 1] and all(int(ln[2]) == 4 for ln in lines)
    assert main(["info", "-m", str(out)]) == 0  # the file's own summary of its conversion
    info = capsys.readouterr().out
    assert "sparse file (format 1): reglu FFNs" in info and "recall target 0.99" in info
    assert "placement: optimal; 384 neurons on the fast tier" in info
    assert f"report: {tmp_path / 'sparse.report.html'}" in info
    lm = load_model(out)
    assert any(k.endswith("gpu_bucket") for k in lm.extras)
    assert lm.metadata["sparseinfer.placement.budget_bytes"] == 1_000_000


@pytest.mark.slow
def test_steps_equal_convert(tiny_model_dir, tmp_path, capsys):
    src = str(tiny_model_dir("swiglu"))
    corpus = tmp_path / "corpus.txt"
    from sparseinfer.data import DEFAULT_CORPUS

    corpus.write_text(DEFAULT_CORPUS.read_text()[:40_000])
    prof, preds, place = tmp_path / "prof", tmp_path / "p.npz", tmp_path / "place.npz"
    steps = [
        ["profile", "-m", src, "-o", str(prof), "--corpus", str(corpus), "--max-tokens", "1024",
         "--chunk-len", "128", "--target-density", "0.4", "-t", "1"],
        ["train-predictors", "--profile", str(prof), "-o", str(preds), "--ranks", "4",
         "--epochs", "2", "-t", "1"],
        ["solve", "-m", src, "--profile", str(prof), "--predictors", str(preds), "--budget",
         "1MB", "-c", "64", "-o", str(place)],
        ["export", "-m", src, "--profile", str(prof), "--predictors", str(preds),
         "--placement", str(place), "-o", str(tmp_path / "steps.gguf")],
    ]
    for argv in steps:
        assert main(argv) == 0, (argv[0], capsys.readouterr().err)
    out = capsys.readouterr().out
    assert "wrote profile" in out and "wrote predictors" in out and "wrote placement" in out
    assert main(["convert", "-m", src, "-o", str(tmp_path / "all.gguf"), "--corpus", str(corpus),
                 "--target-density", "0.4", *FAST, "--budget", "1MB", "-c", "64"]) == 0
    # the steps and the all-in-one run make the same file, byte for byte
    assert (tmp_path / "steps.gguf").read_bytes() == (tmp_path / "all.gguf").read_bytes()
    lm = load_model(tmp_path / "steps.gguf")
    assert lm.metadata["sparseinfer.sparsity.target_density"] == pytest.approx(0.4)


def _tiny_corpus(tmp_path):
    p = tmp_path / "tiny.txt"
    p.write_text("Emma Woodhouse, handsome, clever, and rich.")
    return p


@pytest.mark.parametrize("case", ["small corpus", "missing corpus", "unknown arch",
                                  "small budget", "missing model", "missing out dir",
                                  "bad budget"])
def test_convert_errors(tiny_model_dir, foreign_arch_dir, tmp_path, capsys, case):
    src = tiny_model_dir("reglu")
    work = tmp_path / "work"
    work.mkdir()
    out = work / "out.gguf"
    args = ["convert", "-m", str(src), "-o", str(out), *FAST]
    expect = {
        "small corpus": "corpus too small: expected at least 256 tokens",
        "missing corpus": "corpus file not found",
        "unknown arch": "unsupported architecture 'GPT2LMHeadModel'",
        "small budget": "fast-tier budget too small",
        "missing model": "model not found",
        "missing out dir": "output directory does not exist",
        "bad budget": "budget: expected bytes",
    }[case]
    if case == "small corpus":
        args += ["--corpus", str(_tiny_corpus(tmp_path))]
    elif case == "missing corpus":
        args += ["--corpus", str(tmp_path / "nope.txt")]
    elif case == "unknown arch":
        args[2] = str(foreign_arch_dir("reglu", "GPT2LMHeadModel"))
    elif case == "small budget":
        args += ["--budget", "1000"]
    elif case == "missing model":
        args[2] = str(tmp_path / "no-model.gguf")
    elif case == "missing out dir":
        out = tmp_path / "no-dir" / "out.gguf"
        args[4] = str(out)
    elif case == "bad budget":
        args += ["--budget", "lots"]
    rc = main(args)
    err = capsys.readouterr().err
    assert rc == 1
    assert expect in err and err.count("error:") == 1
    assert "Traceback" not in err
    assert not out.exists() and _files(work) == []


def test_step_errors(tiny_model_dir, tmp_path, capsys):
    src = str(tiny_model_dir("reglu"))
    cases = [
        (["train-predictors", "--profile", str(tmp_path / "none"), "-o", str(tmp_path / "p.npz")],
         "expected a directory written by `sparseinfer profile`"),
        (["solve", "-m", src, "--profile", str(tmp_path), "--predictors", str(tmp_path / "p.npz"),
          "--budget", "1GB", "-o", str(tmp_path / "s.npz")], "expected profile.json"),
        (["profile", "-m", src, "-o", str(tmp_path / "prof"), "--corpus",
          str(_tiny_corpus(tmp_path))], "corpus too small"),
        (["profile", "-m", src, "-o", str(tmp_path / "prof2"), "--target-density", "1.5"],
         "target density: expected a fraction in (0, 1], got 1.5"),
    ]
    for argv, msg in cases:
        assert main(argv) == 1
        assert msg in capsys.readouterr().err
    assert not (tmp_path / "p.npz").exists() and not (tmp_path / "s.npz").exists()


@pytest.mark.slow
@pytest.mark.parametrize("sig", [signal.SIGTERM, pytest.param(signal.SIGINT, marks=pytest.mark.slow)])
def test_stopped_convert_leaves_no_temporary_files(tiny_model_dir, tmp_path, sig):
    tmp = tmp_path / "tmp"
    tmp.mkdir()
    out = tmp_path / "sparse.gguf"
    env = dict(os.environ, TMPDIR=str(tmp))
    env["PYTHONPATH"] = os.pathsep.join([str(Path(sparseinfer.__file__).parents[1]),
                                         env.get("PYTHONPATH", "")])
    proc = subprocess.Popen([sys.executable, "-m", "sparseinfer", "convert", "-m",
                             str(tiny_model_dir("reglu")), "-o", str(out), *FAST,
                             "--epochs", "500"], env=env, stderr=subprocess.PIPE, text=True,
                            # a shell running the suite in the background ignores SIGINT, and
                            # the child would inherit that: give it the default disposition
                            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    lines = []
    for line in proc.stderr:  # progress log lines: stderr is a pipe, not a terminal
        lines.append(line)
        if "train: started" in line:
            assert os.listdir(tmp), "the profile should be in a temporary directory"
            proc.send_signal(sig)
            break
    rest = proc.communicate(timeout=120)[1]
    assert proc.returncode == 130, "".join(lines) + rest
    assert os.listdir(tmp) == [] and not out.exists()


def test_density_note():
    """convert's note when the sparse run computed most neurons anyway (gated FFNs like
    SmolLM2's: its sparse file decodes slower than its source)."""
    from sparseinfer.offline.report import Evaluation, density_note

    e = Evaluation("t", 64, 2, 20.0, 20.2, 0.942, 1.0)
    note = density_note(e, "m.gguf")
    assert note.startswith("note: 94% of the FFN neurons are computed per token")
    assert "`sparseinfer run -m m.gguf`" in note
    assert density_note(Evaluation("t", 64, 2, 20.0, 20.2, 0.12, 1.0), "m.gguf") is None
    assert "compare `sparseinfer run` with" in density_note(e, None)  # the default model
