"""What q4 gate rows beside int8 up/down rows save a ReLU-gated sparse FFN.

    python benchmarks/gates_apart_int8.py [--density 0.40] [--fire 0.19] [--rounds 12] [-t 2]
                                          [--isa avx2]

A Llama-7B-shaped ReGLU FFN (4096 x 11008, random weights, the gates shifted so that a share
``--fire`` of all neurons fire for x) and active sets of ``--density`` of the neurons, pools of 4
layer copies (not served from cache). Times, alternated in blocks of 8 calls:

- A: int8 rows (a scale per 32) alone, gates first (``cpu.sparse_ffn_i8`` as
  ``kernels.sparse_ffn`` runs it without ``PackedFFN.gates``: every selected neuron's int8 gate
  row, its up and down rows where it fired; ``run --no-q4-gates``);
- B: the first spike: the gate dot products over q4 gate rows (``kernels.gate_dots``, half the
  bytes of an int8 gate row, the file's Q4_0 numbers), then A's kernel over the fired neurons
  alone, which reads their int8 gate rows a second time;
- C: what a one-token call with the gates apart runs (``PackedFFN.with_q4_gates``: int8 bundles
  of up and down rows, the gates as q4 rows; ``cpu.sparse_ffn_i8_q4g``, the default for a ReLU
  gate stored as Q4_0): every gate over the q4 rows on the pool, then only the fired neurons'
  up and down rows;
- D: the same gates in A's one pass (``cpu.sparse_ffn_i8(..., gates=)``, what several tokens
  of a prompt or a batched step run);
- E: C with the up rows q4 rows too (``PackedFFN.with_q4_ups``, dtype "q4i8": each neuron's one
  bundle its down row's scales, its q4 up row and its int8 down row; the default where a file's
  up rows are Q4_0 as well), two passes as C.

Prints the CPU, the read bandwidth, the neurons selected and fired, the p50s and their ratios to
A.

``--split``: instead, C's and E's two passes apart (the gate pass alone, and C or E minus it:
the fired neurons' rows), each from memory (the pool of 4 layer copies and 8 sets, as above) and "in
cache" (one layer and one set called again and again: ~7 MB, in the L3 where the machine's L3
keeps it — a VM sharing its L3 keeps part), beside a plain read of the same rows
(``cpu.read_gather``: the selected neurons' q4 gate rows; the fired neurons' int8 up and down
rows, their scales not counted; E's bundles, scales and all) and the time those bytes take at
the streaming read probe: a pass near its plain read is bound by how fast the memory serves its
scattered rows, not by its arithmetic.
"""

from __future__ import annotations

import argparse
import math
import os
import statistics
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from timing import alternated  # noqa: E402 (this folder, on the path above)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--density", type=float, default=0.40, help="neurons selected (default 0.40)")
    p.add_argument("--fire", type=float, default=0.19,
                   help="share of all neurons whose gate fires for x (default 0.19)")
    p.add_argument("--rounds", type=int, default=12, help="blocks of 8 calls of each (default 12)")
    p.add_argument("-t", "--threads", type=int, default=2)
    p.add_argument("--split", action="store_true",
                   help="C's gate pass and fired rows apart, from memory and in cache, beside a "
                        "plain read of their rows")
    p.add_argument("--isa", default="auto", help="the C library's kernels: auto (default), avx512, "
                   "avx2, avx2_vnni or avx2_128 (this CPU's)")
    a = p.parse_args()
    from sparseinfer.threads import passive_wait

    passive_wait()
    import torch
    from kernels import pool_of

    from sparseinfer import cpu
    from sparseinfer.bench import cpu_model, measure_read_bandwidth
    from sparseinfer.sparse import kernels
    from sparseinfer.sparse.packed import PackedFFN, empty_hugepages

    cpu.set_isa(a.isa)
    cpu.set_threads(a.threads)
    kernels.set_threads(a.threads)
    torch.set_num_threads(a.threads)
    d, f = 4096, 11008
    g = torch.Generator().manual_seed(0)
    gate = torch.randn(f, d, generator=g) / math.sqrt(d)
    up = torch.randn(f, d, generator=g) / math.sqrt(d)
    down = torch.randn(d, f, generator=g) / math.sqrt(f)
    x = torch.randn(d, generator=g)
    thr = torch.quantile(gate @ x, 1.0 - a.fire)  # as kernels.py --fire
    gate = gate - torch.outer(torch.ones(f), x) * (thr / (x @ x))
    i8, q4 = (PackedFFN.from_dense("reglu", gate, up, down, dtype=dt, block=b)
              for dt, b in (("int8", 32), ("q4", 0)))
    i8, q4 = pool_of(i8, i8.nbytes)[:4], pool_of(q4, q4.nbytes)[:4]  # 4 layers each
    k = round(a.density * f)
    sets = [torch.sort(torch.randperm(f, generator=g)[:k])[0].to(torch.int32) for _ in range(8)]
    out = torch.empty(d)

    def int8_gates_first(i: int) -> None:
        kernels.sparse_ffn(x, i8[i % 4], sets[i % 8], out)

    def q4_gates_then_int8(i: int) -> None:
        idx = sets[i % 8]
        fired = idx[kernels.gate_dots(x, q4[i % 4], idx) > 0]
        kernels.sparse_ffn(x, i8[(i + 1) % 4], fired, out)

    gates = []  # the q4 gate rows alone, as PackedFFN.gates holds them
    for q in q4:
        gates.append(empty_hugepages((f, q.rows.shape[2]), torch.uint8))
        gates[-1].copy_(q.rows[:, 0])
    apart = [i8[n].with_q4_gates(gates[(n + 1) % 4]) for n in range(4)]  # up/down rows only
    q4i8 = [apart[n].with_q4_ups(q4[(n + 2) % 4].rows[:, 1]) for n in range(4)]
    x1, out1 = x.reshape(1, -1), out.reshape(1, -1)

    def q4_gates_two_passes(i: int) -> None:  # (kernels.sparse_ffn: cpu.sparse_ffn_i8_q4g)
        kernels.sparse_ffn(x, apart[(i + 2) % 4], sets[i % 8], out)

    def q4_gates_one_pass(i: int) -> None:
        f8 = apart[(i + 2) % 4]
        cpu.sparse_ffn_i8(f8.rows, f8.scales, f8.block, True, sets[i % 8], x1, out1, 1, 0,
                          gates=f8.gates)

    def q4_ups_two_passes(i: int) -> None:
        kernels.sparse_ffn(x, q4i8[(i + 3) % 4], sets[i % 8], out)

    fired = int((kernels.gate_dots(x, q4[0], sets[0]) > 0).sum())
    print(f"# {cpu_model()}; {cpu.get_isa()} kernels; {a.threads} threads; read bandwidth "
          f"{measure_read_bandwidth(a.threads):.1f} GB/s; 7B ReGLU FFN: {k} neurons selected, "
          f"{fired} of them fired ({fired / k:.0%})")
    if a.split:
        split(a.rounds, apart, q4i8, sets, x, out)
        return
    fns = [int8_gates_first, q4_gates_then_int8, q4_gates_two_passes, q4_gates_one_pass,
           q4_ups_two_passes]
    ta, tb, tc, td, te = (statistics.median(t) * 1e6 for t in alternated(fns, a.rounds, 8))
    print(f"A int8 rows alone, gates first:         p50 {ta:6.0f} us")
    print(f"B q4 gate dots, then A over the fired:  p50 {tb:6.0f} us   B/A {tb / ta:.3f}")
    print(f"C q4 gates apart, two passes (1 token): p50 {tc:6.0f} us   C/A {tc / ta:.3f}")
    print(f"D q4 gates apart, A's one pass:         p50 {td:6.0f} us   D/A {td / ta:.3f}")
    print(f"E q4 gates and ups (q4i8), two passes:  p50 {te:6.0f} us   E/A {te / ta:.3f}   "
          f"E/C {te / tc:.3f}")


def split(rounds: int, apart, q4i8, sets, x, out) -> None:
    """``--split``: C's (and E's) gate pass and fired neurons' rows apart (see the module
    docstring)."""
    import torch

    from sparseinfer import cpu
    from sparseinfer.bench import measure_read_bandwidth
    from sparseinfer.sparse.kernels import ACT_CODES

    identity = ACT_CODES[None]  # ReGLU's up rows: no activation
    x1, out1 = x.reshape(1, -1), out.reshape(1, -1)
    probe = measure_read_bandwidth(cpu.get_threads())
    fired = []  # fired[i]: set i's neurons whose gate fires over layer i % 4 (as in C)
    for i in range(8):
        f8 = apart[i % 4]
        fired.append(sets[i % 8][cpu.sparse_q4_gates(f8.gates, sets[i % 8], x) > 0].contiguous())
    ffn, gate_w = apart[0], apart[0].gates.shape[1]
    up_down = ffn.rows.shape[1] * ffn.rows.shape[2]  # bytes of a bundle's int8 up and down rows
    gate_bytes = statistics.mean(s.numel() for s in sets) * gate_w
    row_bytes = statistics.mean(f.numel() for f in fired) * up_down
    e_row = q4i8[0].rows.shape[2]  # bytes of a q4i8 bundle: scales, q4 up row, int8 down row
    e_bytes = statistics.mean(f.numel() for f in fired) * e_row

    def calls(hot: bool):
        pick = (lambda i: 0) if hot else (lambda i: i)
        return {
            "both": lambda i: cpu.sparse_ffn_i8_q4g(
                apart[pick(i) % 4].rows, apart[pick(i) % 4].scales, apart[0].block,
                apart[pick(i) % 4].gates, sets[pick(i) % 8], x1, out1, identity),
            "gates": lambda i: cpu.sparse_q4_gates(apart[pick(i) % 4].gates, sets[pick(i) % 8], x),
            "read gates": lambda i: cpu.read_gather(apart[pick(i) % 4].gates, gate_w, gate_w,
                                                    sets[pick(i) % 8]),
            "read rows": lambda i: cpu.read_gather(
                apart[pick(i) % 4].rows.view(torch.uint8).view(ffn.rows.shape[0], -1), up_down,
                up_down, fired[pick(i) % 8]),
            "E": lambda i: cpu.sparse_ffn_i8_q4g(
                q4i8[pick(i) % 4].rows, None, apart[0].block, q4i8[pick(i) % 4].gates,
                sets[pick(i) % 8], x1, out1, identity),
            "read E rows": lambda i: cpu.read_gather(q4i8[pick(i) % 4].rows, e_row, e_row,
                                                     fired[pick(i) % 8]),
        }

    print(f"# streaming read probe {probe:.1f} GB/s; a call reads {gate_bytes / 1e6:.2f} MB of q4 "
          f"gate rows and {row_bytes / 1e6:.2f} MB of int8 up/down rows "
          f"({statistics.mean(f.numel() for f in fired):.0f} fired neurons)")
    for where, hot in (("from memory", False), ("in cache", True)):
        fns = calls(hot)
        p50 = {n: statistics.median(t) * 1e6
               for n, t in zip(fns, alternated(list(fns.values()), rounds, 8))}
        ups = p50["both"] - p50["gates"]
        print(f"{where}: C {p50['both']:.0f} us = gate pass {p50['gates']:.0f} "
              f"+ fired rows {ups:.0f} us; plain reads: gate rows {p50['read gates']:.0f} us "
              f"({gate_bytes / p50['read gates'] / 1e3:.1f} GB/s), fired rows "
              f"{p50['read rows']:.0f} us ({row_bytes / p50['read rows'] / 1e3:.1f} GB/s)")
        e_ups = p50["E"] - p50["gates"]
        print(f"{where}: E {p50['E']:.0f} us = gate pass + fired q4i8 rows {e_ups:.0f} us "
              f"({e_ups / ups:.3f}x C's); plain read of those bundles {p50['read E rows']:.0f} us "
              f"({e_bytes / p50['read E rows'] / 1e3:.1f} GB/s, "
              f"{p50['read E rows'] / p50['read rows']:.3f}x C's rows)")
    print(f"at the probe: gate rows {gate_bytes / probe / 1e3:.0f} us, fired rows "
          f"{row_bytes / probe / 1e3:.0f} us (E's bundles {e_bytes / probe / 1e3:.0f} us)")


if __name__ == "__main__":
    main()
