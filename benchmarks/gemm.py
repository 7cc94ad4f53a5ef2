"""GEMM over a few rows of x (a batched decode step, a prompt chunk): Q4_1 (or ``--type``) as
the file stores it against the same blocks in 16-row panels (``cpu/panels.py``), in one run.

    python benchmarks/gemm.py [--threads 1] [--rows-of-x 1,8,32] [--type Q5_0]
    python benchmarks/gemm.py --k-quants --rows-of-x 1,4,6,8     # Q4_K / Q5_K / Q6_K, hot only

Two measurements per thread count: (1) hot: one matrix of each SmolLM2/7B shape called again
and again (its weights stay in cache: the arithmetic rate, GMAC/s); (2) from memory: 30 layers
of SmolLM2's four projection shapes as distinct matrices (~70 MB, past the last-level cache),
all of them per pass, the time of one pass (what a decode step's products cost). Weights are
gguf-py-quantized random values; the CPU model is printed beside the figures. ``--k-quants``:
the hot measurement of a 4096 x 4096 Q4_K, Q5_K and Q6_K matrix instead, each also in the
loader's panels (random blocks with small positive fp16 scales: gguf-py cannot quantize to
K-quants).
"""

from __future__ import annotations

import argparse


def best_of(fn, n: int, rounds: int = 3) -> float:
    """Seconds per call of ``fn``: the best of ``rounds`` runs of ``n`` calls, after one more."""
    from sparseinfer.bench import timeit

    fn()
    return min(timeit(fn, repeats=rounds, number=n))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--threads", type=int, nargs="+", default=[1, 2])
    p.add_argument("--rows-of-x", default="1,8,32")
    p.add_argument("--type", default="Q4_1", choices=["Q4_0", "Q4_1", "Q5_0", "Q8_0"],
                   help="the block type of the stored / panel pair (default Q4_1, SmolLM2's)")
    p.add_argument("--k-quants", action="store_true", help="Q4_K/Q5_K/Q6_K GEMM, hot")
    a = p.parse_args()
    import gguf
    import numpy as np
    import torch

    from sparseinfer import cpu
    from sparseinfer.bench import cpu_model
    from sparseinfer.cpu.panels import panel_type, to_panels

    Ts = [int(t) for t in a.rows_of_x.split(",")]
    rng = np.random.default_rng(0)

    def pair(rows: int, cols: int):
        raw = gguf.quants.quantize(rng.standard_normal((rows, cols)).astype(np.float32),
                                   gguf.GGMLQuantizationType[a.type])
        pt = panel_type(a.type, cpu.get_isa())  # the loader's layout for it
        return (cpu.QuantMatrix(a.type, raw.reshape(-1), rows, cols),
                cpu.QuantMatrix(pt, to_panels(raw, a.type, rows, cols, pt), rows, cols))

    def product(m, X: torch.Tensor, out: torch.Tensor):
        if X.shape[0] == 1:
            return lambda: cpu.gemv([m], X[0], [out])
        return lambda: cpu.gemm(m, X)

    if a.k_quants:
        k_quants(a.threads, Ts, rng, cpu_model(), product)
        return
    print(f"# {cpu_model()}; {a.type}, best of 3 rounds")
    hot = {s: pair(*s) for s in ((1536, 576), (576, 1536), (4096, 4096))}
    shapes = ((960, 576), (576, 576), (3072, 576), (576, 1536))  # SmolLM2: qkv, wo, gate+up, down
    cold = [pair(r, c) for _ in range(30) for r, c in shapes]
    for nt in a.threads:
        cpu.set_threads(nt)
        print(f"\n{nt} thread(s), hot (one matrix again and again), GMAC/s as stored / in panels")
        for (rows, cols), (f, pn) in hot.items():
            line = f"  {rows:>5}x{cols:<5}"
            for T in Ts:
                X, out = torch.randn(T, cols), torch.empty(rows)
                n = max(20, int(1e9 / (rows * cols * T)))
                tf, tp = best_of(product(f, X, out), n), best_of(product(pn, X, out), n)
                line += f"  x{T}: {rows * cols * T / tf / 1e9:5.0f} / {rows * cols * T / tp / 1e9:5.0f}"
            print(line)
        print(f"{nt} thread(s), 30 SmolLM2 layers from memory, ms per pass as stored / in panels")
        for T in Ts:
            Xs = {c: torch.randn(T, c) for c in (576, 1536)}
            outs = {r: torch.empty(r) for r, _ in shapes}
            for k, name in ((0, "as stored"), (1, "panels")):
                fns = [product(m[k], Xs[m[k].cols], outs[m[k].rows]) for m in cold]
                t = best_of(lambda: [f() for f in fns], 5)
                print(f"  x{T}: {name:>9} {t * 1e3:6.2f} ms")


def k_quants(threads, Ts, rng, cpu_name: str, product) -> None:
    """GMAC/s of one hot 4096 x 4096 matrix per K-quant type and row count of x."""
    import numpy as np
    import torch

    from sparseinfer import cpu
    from sparseinfer.cpu.panels import panel_type, to_panels

    rows = cols = 4096
    fp16_fields = {"Q4_K": (0, 2), "Q5_K": (0, 2), "Q6_K": (208,)}
    mats = {}
    for name, offs in fp16_fields.items():
        _, elems, size = cpu.TYPES[name]
        blocks = rng.integers(0, 256, (rows * cols // elems, size), dtype=np.uint8)
        for off in offs:
            scale = rng.uniform(0.0, 0.02, (blocks.shape[0], 1)).astype(np.float16)
            blocks[:, off:off + 2] = scale.view(np.uint8)
        mats[name] = cpu.QuantMatrix(name, blocks.reshape(-1), rows, cols)
        pt = panel_type(name, cpu.get_isa())  # the loader's layout for it (cpu/panels.py)
        if pt:
            raw16 = to_panels(blocks.reshape(rows, -1), name, rows, cols, pt)
            mats[pt] = cpu.QuantMatrix(pt, raw16, rows, cols)
    print(f"# {cpu_name}; K-quants {rows}x{cols}, hot, best of 3 rounds, GMAC/s")
    for nt in threads:
        cpu.set_threads(nt)
        print(f"\n{nt} thread(s)  " + "  ".join(f"{'x' + str(T):>6}" for T in Ts))
        for name, m in mats.items():
            line = f"  {name:8s}"
            for T in Ts:
                X, out = torch.randn(T, cols), torch.empty(rows)
                t = best_of(product(m, X, out), max(20, int(1e9 / (rows * cols * T))))
                line += f"  {rows * cols * T / t / 1e9:6.1f}"
            print(line)


if __name__ == "__main__":
    main()
