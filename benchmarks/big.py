"""Models of PowerInfer's size: load time, peak memory, prefill and decode of a Llama-2-7B (or
13B) shaped Q4_0 (or Q4_K_M, Q5_K_M, F16, BF16) GGUF, sparseinfer against llama.cpp on the same
file, in one run.

    python benchmarks/big.py --shape 7b --out /tmp/big          # writes /tmp/big/llama-7b.q4_0.gguf
    python benchmarks/big.py --shape 13b --out /tmp/big --tokens 8
    python benchmarks/big.py --shape 1b --out /tmp/big               # TinyLlama-1.1B's shape
    python benchmarks/big.py --shape moe --out /tmp/big   # a mixture of experts (Qwen3-30B-A3B's
        # widths in 12 layers; moe48: in all 48, 30B parameters, 16 GB)
    python benchmarks/big.py --shape 7b --out /tmp/big --rounds 5
    python benchmarks/big.py --shape 7b --out /tmp/big --qtype q4_k_m   # the Q4_K_M mix (or q5_k_m)
    python benchmarks/big.py --shape 7b --out /tmp/big --qtype bf16     # 16-bit floats (or f16)
    python benchmarks/big.py --shape 7b --out /tmp/big --isa avx2_vnni  # another of our kernel variants
    python benchmarks/big.py --shape 7b --out /tmp/big --scaling 3   # 1 thread against 2, both engines
    python benchmarks/big.py --shape 7b --out /tmp/big --qtype bf16 --hf 3  # the same numbers as
        # a Hugging Face directory (bf16 safetensors shards): ours on each, alternately

The file holds random weights (a few random matrices reused across layers: bytes are what
matter for speed and memory, not values) and SmolLM2's tokenizer. Each engine runs in its own
subprocess, one after the other: load seconds, peak RSS, RSS after load, prefill and decode
tokens/s, and the GB/s of weights read per decoded token against the measured read bandwidth
(the physical floor). Machines are noisy: compare the ratios of one run. With ``--rounds N``
the two engines run alternately N times more (each round: ours, then llama.cpp, fresh
processes) and every round's decode and prefill ratio is printed with their median: a virtual
machine's memory bandwidth drifts over seconds to minutes, and one pair can land in two
different phases.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

SHAPES = {  # d_model, d_ff, layers, heads, kv heads
    "7b": (4096, 11008, 32, 32, 32),
    "13b": (5120, 13824, 40, 40, 40),
    "1b": (2048, 5632, 22, 32, 4),  # TinyLlama-1.1B's
    "tiny": (256, 768, 2, 4, 4),  # a smoke test of this script
    # a mixture of experts (Mixtral's layout, "llama" with experts): Qwen3-30B-A3B's widths
    # (d_model 2048, 128 experts of 768, 8 a token, head size 128, 4 kv heads) in 12 layers of
    # its 48 and 16 heads of its 32; + (experts, experts a token)
    "moe": (2048, 768, 12, 16, 4, 128, 8),
    "moe48": (2048, 768, 48, 16, 4, 128, 8),  # the same in all 48 layers: 30B parameters
}
PROMPT = ("It is a truth universally acknowledged, that a single man in possession of a good "
          "fortune, must be in want of a wife.")


def _tiled_q4_0(rows: int, cols: int, rng, base_rows: int = 512):
    """Q4_0 bytes of a [rows, cols] matrix: ``base_rows`` random rows quantized once, tiled."""
    import numpy as np
    from gguf import GGMLQuantizationType, quants

    base = (rng.standard_normal((min(base_rows, rows), cols)) * 0.02).astype(np.float32)
    q = quants.quantize(base, GGMLQuantizationType.Q4_0)
    reps = -(-rows // q.shape[0])
    return np.ascontiguousarray(np.tile(q, (reps, 1))[:rows])


def write_model(path: Path, shape: str) -> Path:
    """A random-weight Q4_0 GGUF of ``shape`` with SmolLM2's tokenizer (llama.cpp loads it)."""
    import gguf
    import numpy as np
    from gguf import GGMLQuantizationType as Q

    from sparseinfer.data import default_model_path
    from sparseinfer.offline.export import _copy_fields

    D, F, L, H, KV, *moe = SHAPES[shape]
    src = gguf.GGUFReader(default_model_path())
    vocab = len(src.fields["tokenizer.ggml.tokens"].data)
    rng = np.random.default_rng(0)
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_name(f"random llama-{shape}")
    w.add_context_length(4096)
    w.add_embedding_length(D)
    w.add_block_count(L)
    w.add_feed_forward_length(F)
    w.add_rope_dimension_count(D // H)
    w.add_head_count(H)
    w.add_head_count_kv(KV)
    w.add_layer_norm_rms_eps(1e-5)
    w.add_file_type(2)  # MOSTLY_Q4_0
    if moe:
        w.add_expert_count(moe[0])
        w.add_expert_used_count(moe[1])
    _copy_fields(w, src, lambda k: k.startswith("tokenizer."))
    sq, ff_in, ff_out = _tiled_q4_0(D, D, rng), _tiled_q4_0(F, D, rng), _tiled_q4_0(D, F, rng)
    kv = _tiled_q4_0(KV * (D // H), D, rng)
    norm = np.ones(D, dtype=np.float32)
    emb = _tiled_q4_0(vocab, D, rng)

    def add(name, arr, rows_cols, qtype):
        w.add_tensor(name, arr, raw_dtype=qtype)  # quantized: uint8 [rows, bytes per row]

    add("token_embd.weight", emb, (vocab, D), Q.Q4_0)
    for i in range(L):
        add(f"blk.{i}.attn_norm.weight", norm, None, Q.F32)
        add(f"blk.{i}.attn_q.weight", sq, (D, D), Q.Q4_0)
        add(f"blk.{i}.attn_k.weight", kv, (KV * (D // H), D), Q.Q4_0)
        add(f"blk.{i}.attn_v.weight", kv, (KV * (D // H), D), Q.Q4_0)
        add(f"blk.{i}.attn_output.weight", sq, (D, D), Q.Q4_0)
        add(f"blk.{i}.ffn_norm.weight", norm, None, Q.F32)
        if moe:  # the router (random: tokens spread over the experts), every expert stacked
            E = moe[0]
            add(f"blk.{i}.ffn_gate_inp.weight",
                rng.standard_normal((E, D)).astype(np.float32), None, Q.F32)
            add(f"blk.{i}.ffn_gate_exps.weight", np.stack([ff_in] * E), None, Q.Q4_0)
            add(f"blk.{i}.ffn_up_exps.weight", np.stack([ff_in] * E), None, Q.Q4_0)
            add(f"blk.{i}.ffn_down_exps.weight", np.stack([ff_out] * E), None, Q.Q4_0)
            continue
        add(f"blk.{i}.ffn_gate.weight", ff_in, (F, D), Q.Q4_0)
        add(f"blk.{i}.ffn_up.weight", ff_in, (F, D), Q.Q4_0)
        add(f"blk.{i}.ffn_down.weight", ff_out, (D, F), Q.Q4_0)
    add("output_norm.weight", norm, None, Q.F32)
    add("output.weight", emb, (vocab, D), Q.Q4_0)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file(progress=True)
    w.close()
    return path


def requantize(src: Path, dst: Path, ftype: str, threads: int) -> Path:
    """``src`` requantized to llama.cpp's ``ftype`` mix (e.g. Q4_K_M: Q4_K, with Q6_K for some
    attn_v/ffn_down and the head) by llama.cpp's own quantizer: gguf-py cannot write K-quants."""
    import ctypes

    try:
        import llama_cpp
    except ImportError as e:
        raise SystemExit(f"--qtype {ftype}: llama.cpp's quantizer is needed (llama-cpp-python is "
                         f"not installed: {e})") from e

    params = llama_cpp.llama_model_quantize_default_params()
    params.ftype = getattr(llama_cpp, f"LLAMA_FTYPE_MOSTLY_{ftype.upper()}")
    params.nthread = threads
    params.allow_requantize = True
    rc = llama_cpp.llama_model_quantize(str(src).encode(), str(dst).encode(), ctypes.byref(params))
    if rc != 0:
        raise RuntimeError(f"llama_model_quantize({src} -> {ftype}) returned {rc}, expected 0")
    return dst


def write_hf_dir(src: Path, out: Path, shard_bytes: int = 2 << 30) -> Path:
    """The 16-bit GGUF ``src`` as a Hugging Face directory (what most checkpoints ship):
    LlamaForCausalLM's config.json, the same numbers in safetensors shards of the GGUF's own
    dtype (Q/K rows back in the checkpoint's rotate-half order) and its tokenizer.json."""
    import gguf
    import numpy as np
    import torch
    from safetensors.torch import save_file

    from sparseinfer.models.loading import open_source, unpermute_qk
    from sparseinfer.tokenizer import Tokenizer

    srcm = open_source(src)
    cfg, reader = srcm.config, srcm.reader
    names = {"token_embd": "model.embed_tokens", "output_norm": "model.norm",
             "output": "lm_head", "attn_norm": "input_layernorm",
             "ffn_norm": "post_attention_layernorm", "attn_q": "self_attn.q_proj",
             "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
             "attn_output": "self_attn.o_proj", "ffn_gate": "mlp.gate_proj",
             "ffn_up": "mlp.up_proj", "ffn_down": "mlp.down_proj"}
    torch_of = {"BF16": torch.bfloat16, "F16": torch.float16, "F32": torch.float32}
    out.mkdir(parents=True, exist_ok=True)
    shard: dict[str, torch.Tensor] = {}
    index: dict[str, str] = {}
    n_shards = 0

    def flush() -> None:
        nonlocal shard, n_shards
        if shard:
            n_shards += 1
            name = f"model-{n_shards:05d}.safetensors"
            save_file(shard, str(out / name), metadata={"format": "pt"})
            index.update({k: name for k in shard})
            shard = {}

    for t in reader.tensors:
        base, _, _ = t.name.rpartition(".")
        if base.startswith("blk."):
            _, layer, kind = base.split(".")
            name = f"model.layers.{layer}.{names[kind]}.weight"
        else:
            kind, name = base, names[base] + ".weight"
        shape = tuple(int(n) for n in reversed(t.shape.tolist()))
        w = torch.from_numpy(np.array(t.data)).view(torch_of[t.tensor_type.name])
        w = w.reshape(shape)
        if kind in ("attn_q", "attn_k"):
            w = unpermute_qk(w, cfg.n_heads if kind == "attn_q" else cfg.n_kv_heads).contiguous()
        shard[name] = w
        if sum(v.numel() * v.element_size() for v in shard.values()) >= shard_bytes:
            flush()
    flush()
    dtype = {gguf.GGMLQuantizationType.BF16: "bfloat16", gguf.GGMLQuantizationType.F16:
             "float16"}[next(t.tensor_type for t in reader.tensors if t.name.endswith("attn_q.weight"))]
    tok = Tokenizer.from_gguf(reader, src)
    (out / "tokenizer.json").write_text(tok.backend_json())
    meta = srcm.metadata
    config = {"architectures": ["LlamaForCausalLM"], "model_type": "llama",
              "hidden_size": cfg.d_model, "intermediate_size": cfg.d_ff,
              "num_hidden_layers": cfg.n_layers, "num_attention_heads": cfg.n_heads,
              "num_key_value_heads": cfg.n_kv_heads, "vocab_size": cfg.vocab_size,
              "max_position_embeddings": cfg.max_seq_len, "rms_norm_eps": cfg.norm_eps,
              "rope_theta": cfg.rope_theta, "hidden_act": "silu", "tie_word_embeddings": False,
              "torch_dtype": dtype, "bos_token_id": meta.get("tokenizer.ggml.bos_token_id"),
              "eos_token_id": meta.get("tokenizer.ggml.eos_token_id")}
    (out / "config.json").write_text(json.dumps(config, indent=1))
    (out / "model.safetensors.index.json").write_text(json.dumps(
        {"metadata": {}, "weight_map": index}, indent=1))
    return out


def _hf_rounds(our_args: dict, hf_dir: Path, rounds: int) -> None:
    """Ours on the GGUF and on the same numbers as a Hugging Face directory, alternately, each in
    a fresh process: load, peak memory, prefill and decode of both formats, and whether both
    generate the same tokens."""
    from sparseinfer.bench import run_isolated

    print(f"\nGGUF against the Hugging Face directory {hf_dir} (ours on each, fresh processes; "
          f"{our_args['n_tokens']} tokens):")
    print(f"{'round':>5} {'format':>7} {'load s':>7} {'peak RSS':>9} {'prefill':>8} {'decode':>7} "
          f"{'same tokens':>11}")
    for i in range(rounds):
        a = run_isolated(_ours, **our_args)
        b = run_isolated(_ours, **{**our_args, "path": str(hf_dir)})
        for name, r in (("gguf", a), ("hf", b)):
            if "error" in r:
                print(f"{i + 1:5d} {name:>7} error: {r['error']}")
                continue
            same = "" if name == "gguf" or "error" in a else str(a["ids"] == r["ids"])
            print(f"{i + 1:5d} {name:>7} {r['load_s']:7.1f} {r['peak_rss_mb']:8.0f}M "
                  f"{r['prefill_tok_s']:8.2f} {r['decode_tok_s']:7.2f} {same:>11}")


def _rss_mb() -> float:
    for line in open("/proc/self/status"):
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return float("nan")


def _peak_mb() -> float:
    """VmHWM: this process's peak resident set (ru_maxrss would carry the parent's over exec)."""
    for line in open("/proc/self/status"):
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) / 1024
    return float("nan")


def _ours(path: str, threads: int, n_tokens: int, n_ctx: int, isa: str = "auto") -> dict:
    t0 = time.perf_counter()
    from sparseinfer.threads import passive_wait

    passive_wait()  # as the CLI does, before torch and numba start their pools
    import numba  # noqa: F401  the runtime's fixed cost: torch, numba, the kernel libraries
    import torch  # noqa: F401

    from sparseinfer import cpu
    from sparseinfer.config import SamplingParams
    from sparseinfer.bench import token_split
    from sparseinfer.engine import Engine, FinishEvent, TokenEvent
    from sparseinfer.fused import decode  # noqa: F401
    from sparseinfer.sparse import kernels  # noqa: F401

    cpu.set_threads(threads)
    cpu.set_isa(isa)
    t_import = time.perf_counter() - t0
    rss0 = _rss_mb()
    t0 = time.perf_counter()
    engine = Engine.load(path, n_ctx=n_ctx, threads=threads)
    t_load = time.perf_counter() - t0
    rss_loaded = _rss_mb()
    ids = engine.encode(PROMPT)
    params = SamplingParams(max_tokens=n_tokens, temperature=0.0, ignore_eos=True)
    list(engine.stream(ids[:4], SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True)))
    engine.forget_prefix()
    timing, out = False, []
    for ev in engine.stream(ids, params):
        if isinstance(ev, TokenEvent):
            out.append(ev.token_id)
        if isinstance(ev, TokenEvent) and not timing:  # the prompt is in: time the decode steps
            cpu.block_times(reset=True)
            cpu.set_block_timing(timing := True)
        elif isinstance(ev, FinishEvent):
            fin = ev
    cpu.set_block_timing(False)
    split = token_split(cpu.block_times(reset=True), fin.decode_seconds, fin.completion_tokens - 1)
    plan = engine.loaded.plan
    cfg = plan.config  # a mixture of experts reads k of its E experts a token
    share = cfg.n_experts_used / cfg.n_experts if cfg.n_experts else 1.0
    per_tok = sum(w.nbytes * (share if ".experts." in w.module else 1.0)
                  for w in plan.weights if w.module != "tok_emb")
    return {"import_s": t_import, "load_s": t_load, "rss_runtime_mb": rss0,
            "rss_loaded_mb": rss_loaded, "peak_rss_mb": _peak_mb(),
            "prefill_tok_s": fin.prompt_tokens / fin.prefill_seconds,
            "decode_tok_s": (fin.completion_tokens - 1) / fin.decode_seconds,
            "bytes_per_token": per_tok, "plan": plan.summary(), "dtype": engine.dtype,
            "token_ms": split, "ids": out,
            "kv_mb": engine._cache.nbytes / 2**20}


def _llama_cpp(path: str, threads: int, n_tokens: int, n_ctx: int) -> dict:
    t0 = time.perf_counter()
    from llama_cpp import Llama

    from sparseinfer.bench import time_llama_cpp

    t_import = time.perf_counter() - t0
    rss0 = _rss_mb()
    t0 = time.perf_counter()
    llm = Llama(path, n_threads=threads, n_threads_batch=threads, n_ctx=n_ctx, verbose=False)
    t_load = time.perf_counter() - t0
    rss_loaded = _rss_mb()
    ids = llm.tokenize(PROMPT.encode())
    llm.eval(ids[:4])  # warm-up
    t_prefill, t_dec = time_llama_cpp(llm, ids, n_tokens)
    import gguf

    r = gguf.GGUFReader(path)
    n_exp = int(r.fields["llama.expert_count"].parts[-1][0]) \
        if "llama.expert_count" in r.fields else 0
    share = int(r.fields["llama.expert_used_count"].parts[-1][0]) / n_exp if n_exp else 1.0
    per_tok = sum(int(t.n_bytes) * (share if "_exps." in t.name else 1.0)
                  for t in r.tensors if t.name != "token_embd.weight")
    return {"import_s": t_import, "load_s": t_load, "rss_runtime_mb": rss0,
            "rss_loaded_mb": rss_loaded, "peak_rss_mb": _peak_mb(),
            "prefill_tok_s": len(ids) / t_prefill, "decode_tok_s": (n_tokens - 1) / t_dec,
            "bytes_per_token": per_tok}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shape", default="7b", choices=sorted(SHAPES))
    ap.add_argument("--out", type=Path, required=True, help="directory for the GGUF")
    ap.add_argument("-t", "--threads", type=int, default=2)
    ap.add_argument("-n", "--tokens", type=int, default=16)
    ap.add_argument("-c", "--ctx", type=int, default=512)
    ap.add_argument("--no-llama-cpp", action="store_true")
    ap.add_argument("--rounds", type=int, default=0,
                    help="then run the two engines alternately this many times more")
    ap.add_argument("--qtype", default="q4_0",
                    choices=["q4_0", "q4_k_m", "q5_k_m", "f16", "bf16"],
                    help="q4_k_m / q5_k_m: the Q4_0 file requantized by llama.cpp's quantizer to "
                         "its Q4_K_M / Q5_K_M mix (needs llama-cpp-python; the mixes most GGUF "
                         "downloads use); f16 / bf16: the Q4_0 file's numbers in 16-bit floats "
                         "(llama.cpp's quantizer too; 13 GB at 7B)")
    ap.add_argument("--scaling", type=int, default=0, metavar="ROUNDS",
                    help="then our decode with 1 thread and with -t threads alternately (and "
                         "llama.cpp's, unless --no-llama-cpp), each in a fresh process after a "
                         "read-bandwidth probe at its thread count, this many rounds (issue 14: "
                         "what a second thread adds, against what the memory gives it)")
    ap.add_argument("--hf", type=int, default=0, metavar="ROUNDS",
                    help="with --qtype bf16 / f16: also write the file's numbers as a Hugging "
                         "Face directory (safetensors shards, config.json, tokenizer.json) and "
                         "run ours on the GGUF and on it alternately, this many rounds (instead "
                         "of llama.cpp, which does not read safetensors)")
    ap.add_argument("--isa", default="auto", help="our C kernels' variant (cpu.set_isa; default "
                    "auto: the CPU's best)")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()

    from sparseinfer.bench import cpu_model, measure_read_bandwidth, run_isolated, split_line

    args.out.mkdir(parents=True, exist_ok=True)
    path = args.out / f"llama-{args.shape}.q4_0.gguf"
    if not path.exists():
        t0 = time.perf_counter()
        write_model(path, args.shape)
        print(f"wrote {path} ({path.stat().st_size / 2**30:.2f} GiB) in "
              f"{time.perf_counter() - t0:.0f} s", file=sys.stderr)
    if args.qtype != "q4_0":
        src, path = path, args.out / f"llama-{args.shape}.{args.qtype}.gguf"
        if not path.exists():
            t0 = time.perf_counter()
            requantize(src, path, args.qtype, args.threads)
            print(f"wrote {path} ({path.stat().st_size / 2**30:.2f} GiB) in "
                  f"{time.perf_counter() - t0:.0f} s", file=sys.stderr)
    size = path.stat().st_size
    if args.hf:
        if args.qtype not in ("bf16", "f16"):
            raise SystemExit("--hf: expected --qtype bf16 or f16 (what checkpoints ship)")
        hf_dir = args.out / f"llama-{args.shape}.{args.qtype}-hf"
        if not (hf_dir / "config.json").exists():
            t0 = time.perf_counter()
            write_hf_dir(path, hf_dir)
            print(f"wrote {hf_dir} in {time.perf_counter() - t0:.0f} s", file=sys.stderr)
        print(f"CPU: {cpu_model()}; {args.threads} threads; our kernels {args.isa}")
        _hf_rounds(dict(path=str(path), threads=args.threads, n_tokens=args.tokens,
                        n_ctx=args.ctx, isa=args.isa), hf_dir, args.hf)
        return 0
    print(f"CPU: {cpu_model()}; {args.threads} threads; our kernels {args.isa}; file "
          f"{size / 2**30:.2f} GiB",
          file=sys.stderr)
    rows = {}
    common = dict(path=str(path), threads=args.threads, n_tokens=args.tokens, n_ctx=args.ctx)
    our_args = dict(common, isa=args.isa)  # llama.cpp's arguments and our kernel variant
    bw = measure_read_bandwidth(args.threads)
    rows["sparseinfer"] = run_isolated(_ours, **our_args)
    if not args.no_llama_cpp:
        try:
            import llama_cpp  # noqa: F401
        except ImportError:
            print("llama-cpp-python not installed: llama.cpp not measured", file=sys.stderr)
        else:
            rows["llama.cpp"] = run_isolated(_llama_cpp, **common)
    bw = (bw + measure_read_bandwidth(args.threads)) / 2  # before and after: it drifts
    print(f"read bandwidth ({args.threads} threads, mean of before/after): {bw:.1f} GB/s")
    print(f"\n{'engine':12s} {'load s':>7s} {'peak RSS':>9s} {'RSS load':>9s} {'runtime':>8s} "
          f"{'prefill':>8s} {'decode':>7s} {'GB/s':>6s} {'of BW':>6s} {'floor':>6s}")
    for name, r in rows.items():
        if "error" in r:
            print(f"{name:12s} error: {r['error']}")
            continue
        gbs = r["bytes_per_token"] * r["decode_tok_s"] / 1e9
        floor = bw * 1e9 / r["bytes_per_token"]
        print(f"{name:12s} {r['load_s']:7.1f} {r['peak_rss_mb']:8.0f}M {r['rss_loaded_mb']:8.0f}M "
              f"{r['rss_runtime_mb']:7.0f}M {r['prefill_tok_s']:8.2f} {r['decode_tok_s']:7.2f} "
              f"{gbs:6.1f} {gbs / bw:6.0%} {floor:6.2f}")
    ours, cpp = rows.get("sparseinfer", {}), rows.get("llama.cpp", {})
    if "decode_tok_s" in ours and "decode_tok_s" in cpp:
        print(f"\nsparseinfer / llama.cpp: decode {ours['decode_tok_s'] / cpp['decode_tok_s']:.2f}x, "
              f"prefill {ours['prefill_tok_s'] / cpp['prefill_tok_s']:.2f}x, peak RSS "
              f"{ours['peak_rss_mb'] / cpp['peak_rss_mb']:.2f}x, load "
              f"{ours['load_s'] / max(cpp['load_s'], 1e-9):.1f}x; file {size / 2**20:.0f} MiB, "
              f"our peak RSS / file = {ours['peak_rss_mb'] * 2**20 / size:.2f}")
    if "peak_rss_mb" in ours:
        bound = size / 2**20 * 1.15 + ours["kv_mb"] + ours["rss_runtime_mb"]
        print(f"memory bound (file + 15% + KV cache {ours['kv_mb']:.0f} MiB + runtime "
              f"{ours['rss_runtime_mb']:.0f} MiB): {bound:.0f} MiB; peak {ours['peak_rss_mb']:.0f} "
              f"MiB: {'within' if ours['peak_rss_mb'] <= bound else 'OVER'}")
    if ours.get("token_ms"):
        print("our decode, a token in ms: " + split_line(ours["token_ms"]))
    if "plan" in ours:
        print(ours["plan"])
    if cpp and args.rounds > 0:
        print(f"\nrounds (ours, then llama.cpp, each in a fresh process; {args.tokens} tokens):")
        print(f"{'round':>5} {'ours dec':>9} {'cpp dec':>8} {'ratio':>6} {'ours pre':>9} "
              f"{'cpp pre':>8} {'ratio':>6}")
        dec, pre = [], []
        for i in range(args.rounds):
            a, b = run_isolated(_ours, **our_args), run_isolated(_llama_cpp, **common)
            if "error" in a or "error" in b:
                print(f"{i + 1:5d} error: {a.get('error') or b.get('error')}")
                continue
            dec.append(a["decode_tok_s"] / b["decode_tok_s"])
            pre.append(a["prefill_tok_s"] / b["prefill_tok_s"])
            print(f"{i + 1:5d} {a['decode_tok_s']:9.2f} {b['decode_tok_s']:8.2f} {dec[-1]:5.2f}x "
                  f"{a['prefill_tok_s']:9.2f} {b['prefill_tok_s']:8.2f} {pre[-1]:5.2f}x")
        if dec:
            import statistics

            print(f"median decode {statistics.median(dec):.2f}x (min {min(dec):.2f}x, max "
                  f"{max(dec):.2f}x, {sum(r >= 1.0 for r in dec)} of {len(dec)} >= 1.0x); median "
                  f"prefill {statistics.median(pre):.2f}x")
    if args.scaling > 0 and args.threads > 1:
        _scaling(our_args, common if "llama.cpp" in rows else None, args.threads, args.scaling)
    if args.json:
        print(json.dumps(rows, indent=1, default=str))
    return 0


def _scaling(ours: dict, cpp: dict | None, threads: int, rounds: int) -> None:
    """Our decode at 1 and at ``threads`` threads alternately, each run after a probe of the
    read bandwidth at its own thread count: the decode's ratio beside the memory's, and (``cpp``:
    its arguments) llama.cpp's after ours at each thread count, its own ratio in the same
    minutes."""
    import statistics

    from sparseinfer.bench import measure_read_bandwidth, run_isolated

    engines = {"ours": (_ours, ours)} | ({"cpp": (_llama_cpp, cpp)} if cpp else {})
    print(f"\nscaling (1 thread then {threads}, each run in a fresh process; decode tok/s, "
          f"probe GB/s):")
    cols = [f"{n} {t}t" for t in (1, threads) for n in engines]
    print(f"{'round':>5} {'1t probe':>9} {f'{threads}t probe':>9} "
          + " ".join(f"{c:>8}" for c in cols) + " "
          + " ".join(f"{n + ' x':>7}" for n in engines) + f" {'memory':>7}")
    ratios: dict[str, list[float]] = {n: [] for n in engines}
    mem = []
    for i in range(rounds):
        bws, got = [], {n: [] for n in engines}
        for t in (1, threads):
            bws.append(measure_read_bandwidth(t))
            for n, (fn, kw) in engines.items():
                got[n].append(run_isolated(fn, **{**kw, "threads": t}))
        errors = [r["error"] for rs in got.values() for r in rs if "error" in r]
        if errors:
            print(f"{i + 1:5d} error: {errors[0]}")
            continue
        mem.append(bws[1] / bws[0])
        dec = {n: [r["decode_tok_s"] for r in rs] for n, rs in got.items()}
        for n, (one, many) in dec.items():
            ratios[n].append(many / one)
        print(f"{i + 1:5d} {bws[0]:9.1f} {bws[1]:9.1f} "
              + " ".join(f"{dec[n][k]:8.2f}" for k in (0, 1) for n in engines) + " "
              + " ".join(f"{ratios[n][-1]:6.2f}x" for n in engines) + f" {mem[-1]:6.2f}x")
    if mem:
        print(f"median with {threads} threads: "
              + ", ".join(f"{n} {statistics.median(r):.2f}x" for n, r in ratios.items())
              + f", the memory {statistics.median(mem):.2f}x")


if __name__ == "__main__":
    sys.exit(main())
