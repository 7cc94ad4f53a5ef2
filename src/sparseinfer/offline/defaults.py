"""Default settings of the offline pipeline, importable without torch (the CLI's help reads them).
"""

SCORES = ("gate", "output", "output_norm")
# benchmarks/quality.py (SmolLM2): "output" and "output_norm" cost the same perplexity within
# 0.1 point on the whole held-out text, both far below "gate"; "output" is the simpler rule
DEFAULT_SCORE = "output"
# lowest density whose held-out perplexity cost stays within 3% (benchmarks/quality.py, SmolLM2)
DEFAULT_TARGET_DENSITY = 0.5
DEFAULT_CHUNK_LEN = 512  # tokens per profiled sequence
# above this share of FFN neurons computed per token, convert says the source file may decode
# faster (the sparse files of SmolLM2 and Gemma-3, gated FFNs computing >90%, decode several times
# slower than their sources: benchmarks/RESULTS.md)
NOT_SPARSE_DENSITY = 0.5
DEFAULT_MAX_TOKENS = 16384  # profiled tokens at most
