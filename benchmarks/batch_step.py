"""One continuous-batching decode step (``models.batch.decode_step``) against the single-token path.

    python benchmarks/batch_step.py [--model PATH] [--threads 2] [--rows 1,8] [--positions 2,100,400]
                                    [--repeats 30] [--batch-mode auto,union,masked,dense]
                                    [--ffn-dtype q4] [--isa avx2_vnni]

For each row count B and position, the median time of a step of B sequences (all at that position,
in slots 0..B-1, random tokens) on the default model (or ``--model``), and the same for one token
on the fused single-token path (``Transformer.forward``, B = T = 1). Prints tokens/s of the step
(B / time) and its ratio to the single-token path at the same position: the upper bound of what
``serve --parallel B`` can reach before the server's own per-token work (sampling, streaming).
A sparse file's FFNs compute several rows over the union of their predicted sets, each row's own
set, or every neuron (``--batch-mode``, comma-separated: each is measured in turn).
"""

from __future__ import annotations

import argparse
import statistics


def median_ms(fn, repeats: int) -> float:
    from sparseinfer.bench import timeit

    fn()  # warm-up
    return statistics.median(timeit(fn, repeats)) * 1e3


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", default=None, help="a GGUF file (default: the embedded SmolLM2)")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--rows", default="1,8", help="comma-separated row counts")
    p.add_argument("--positions", default="2,100,400", help="comma-separated positions")
    p.add_argument("--repeats", type=int, default=30)
    p.add_argument("--batch-mode", default="auto",
                   help="sparse files: comma-separated FFN batch modes (auto, union, masked, dense)")
    p.add_argument("--ffn-dtype", default="auto",
                   help="sparse files: the FFN rows (as `run --ffn-dtype`: auto, q4, int8, ...)")
    p.add_argument("--batch-ffn", default="auto",
                   help="sparse files: as `run --batch-ffn` (auto, sparse, dense)")
    p.add_argument("--isa", default="auto", help="the C kernels' variant (cpu.set_isa; default "
                   "auto: the CPU's best)")
    a = p.parse_args()
    from sparseinfer.threads import passive_wait

    passive_wait()  # as the CLI does, before torch and numba start their pools
    from sparseinfer import cpu
    from sparseinfer.bench import cpu_model
    from sparseinfer.engine import Engine
    from sparseinfer.fused.decode import attend_rows
    from sparseinfer.models.batch import decode_step

    import torch

    rows = [int(r) for r in a.rows.split(",")]
    positions = [int(q) for q in a.positions.split(",")]
    n_ctx = max(positions) + 1
    opts = {} if a.ffn_dtype == "auto" else {"ffn_dtype": a.ffn_dtype}
    if a.batch_ffn != "auto":
        opts["batch_ffn"] = a.batch_ffn
    cpu.set_isa(a.isa)
    engine = Engine.load(a.model, n_ctx=n_ctx, threads=a.threads, **opts)
    model = engine.model
    cache, single = model.new_cache(max(rows), n_ctx), model.new_cache(1, n_ctx)
    modes = a.batch_mode.split(",")
    if engine.sparse_info is None and modes != ["auto"]:
        raise SystemExit(f"--batch-mode: {engine.name} has no sparse layers")
    print(f"# {cpu_model()}; kernels {cpu.get_isa()}; threads {a.threads}; {engine.name}; "
          f"median of {a.repeats}; {engine.loaded.plan.summary().splitlines()[0]}")
    print(f"{'mode':>6} {'rows':>4} {'pos':>5} {'step ms':>8} {'tok/s':>8} {'1-token ms':>10} "
          f"{'x 1-token':>9}")
    gen = torch.Generator().manual_seed(0)
    with torch.inference_mode():
        for mode in modes:
            if engine.sparse_info is not None:
                engine.sparse_info.set_batch_mode(mode)
            for pos in positions:
                tok = torch.randint(0, engine.vocab_size, (1, 1), generator=gen)
                one = median_ms(lambda: model(tok, pos, single, last_only=True), a.repeats)
                for B in rows:
                    toks = torch.randint(0, engine.vocab_size, (B,), generator=gen)
                    at, slots = torch.full((B,), pos), torch.arange(B)
                    ms = median_ms(
                        lambda: decode_step(model, toks, at, cache, slots, attend_rows), a.repeats)
                    print(f"{mode:>6} {B:>4} {pos:>5} {ms:>8.2f} {B / ms * 1e3:>8.1f} {one:>10.2f} "
                          f"{B / ms * one:>8.2f}x")


if __name__ == "__main__":
    main()
