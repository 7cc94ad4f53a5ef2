"""The 16-bit GEMM (a prompt's products over F16 / BF16 weights) at a Llama-7B layer's shapes:
x rows against the fused q/k/v (12288 x 4096), wo (4096 x 4096), gate+up (22016 x 4096) and
down (4096 x 11008), three layers of distinct random matrices (1.2 GB: from memory), GMAC/s
with 1 and 2 threads; and one q/k/v matrix called again and again ("hot").

    python benchmarks/gemm16.py --type F16 --rows-of-x 29
    python benchmarks/gemm16.py --type BF16 --rows-of-x 29 64

Compare trees by running it with each on PYTHONPATH in turn (machines are noisy: alternate).
"""

from __future__ import annotations

import argparse
import time

SHAPES = [(12288, 4096), (4096, 4096), (22016, 4096), (4096, 11008)]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--type", default="F16", choices=["F16", "BF16"])
    ap.add_argument("--rows-of-x", type=int, nargs="+", default=[29])
    ap.add_argument("--threads", type=int, nargs="+", default=[1, 2])
    a = ap.parse_args()
    import numpy as np
    import torch

    from sparseinfer import cpu
    from sparseinfer.bench import cpu_model
    from sparseinfer.cpu.ops import QuantMatrix, gemm

    rng = np.random.default_rng(0)

    def mat(rows: int, cols: int) -> QuantMatrix:
        w = (rng.standard_normal((rows, cols)) * 0.02).astype(np.float32)
        bits = w.astype(np.float16).view(np.uint16) if a.type == "F16" else \
            (w.view(np.uint32) >> 16).astype(np.uint16)
        return QuantMatrix(a.type, np.ascontiguousarray(bits.view(np.uint8)), rows, cols)

    layers = [[mat(r, c) for r, c in SHAPES] for _ in range(3)]
    print(f"CPU: {cpu_model()}; kernels {cpu.get_isa()}; {a.type}")
    for T in a.rows_of_x:
        xs = {c: torch.randn(T, c) for c in (4096, 11008)}
        macs = sum(r * c for r, c in SHAPES) * T
        for th in a.threads:
            cpu.set_threads(th)
            m = layers[0][0]
            gemm(m, xs[m.cols])
            t = time.perf_counter()
            for _ in range(5):
                gemm(m, xs[m.cols])
            hot = 5 * m.rows * m.cols * T / (time.perf_counter() - t) / 1e9
            best = 0.0
            for _ in range(3):
                t = time.perf_counter()
                for layer in layers:
                    for mm in layer:
                        gemm(mm, xs[mm.cols])
                best = max(best, len(layers) * macs / (time.perf_counter() - t) / 1e9)
            print(f"{T} x rows, {th} thread(s): hot {hot:.1f} GMAC/s, three layers from memory "
                  f"{best:.1f} GMAC/s")


if __name__ == "__main__":
    main()
