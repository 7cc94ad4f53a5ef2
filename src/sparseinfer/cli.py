"""The sparseinfer command line (flags follow llama.cpp where one exists).

Only this module prints; library code logs. A ``SparseInferError`` becomes one ``error:`` line
and exit status 1 (``-v`` shows the traceback and INFO logs).
"""

from __future__ import annotations

import argparse
import json
import logging
import math
import sys
import time
from pathlib import Path

from . import __version__
from .config import SamplingParams
from .errors import SparseInferError
from .threads import default_threads, passive_wait

log = logging.getLogger("sparseinfer.cli")


# ---- shared flags ------------------------------------------------------------------------------


# why a run without -t takes one thread (threads.small_model_threads)
ONE_THREAD_WHY = "a model this small runs faster on one without the C kernels; -t to choose"


def _add_model(p: argparse.ArgumentParser) -> None:
    p.add_argument("-m", "--model", type=Path, default=None,
                   help="GGUF file or Hugging Face directory, or a model already on this machine: "
                        "pulled with Ollama (llama3.2:1b) or in the Hugging Face cache "
                        "(org/name, org/name:Q4_K_M); nothing is downloaded (default: embedded "
                        "SmolLM2-135M)")
    p.add_argument("-t", "--threads", type=int, default=None,
                   help=f"CPU threads (default: the cores this process may use, "
                        f"{default_threads()} here; one for a small model without the C kernels; "
                        f"idle threads sleep, so a busy machine costs little)")
    p.add_argument("-c", "--ctx-size", type=int, default=4096, help="context size in tokens")
    p.add_argument("--dtype", default="auto", choices=["auto", "fp32", "bf16", "q4"],
                   help="weights: auto (default) keeps every tensor as the file stores it "
                        "(quantized blocks and F16 / BF16 weights computed in place by the C kernels, "
                        "F32 as fp32); "
                        "q4 = every projection 4-bit (torch's int4 kernel) with an int8 LM head; "
                        "fp32 / bf16")
    p.add_argument("-ct", "--cache-type", default="auto", choices=["auto", "fp32", "fp16"],
                   help="KV cache elements (llama.cpp's -ctk/-ctv): auto (default) = fp16 with "
                        "the default weights of a model the fused kernels decode (llama-family "
                        "blocks, dense or sparse), else the activations' type (fp32)")
    sp = p.add_argument_group("sparse runtime (models converted with `sparseinfer convert`)")
    sp.add_argument("--dense", action="store_true", help="ignore predictors: dense FFNs")
    sp.add_argument("--sparse-threshold", type=float, default=None,
                    help="predictor logit threshold (default: the one stored in the file)")
    sp.add_argument("--device", default="cpu", help="fast-tier device: cpu or cuda")
    sp.add_argument("--vram-budget", type=float, default=None,
                    help="fast-tier budget in GiB (default: the placement stored in the file)")
    sp.add_argument("--sparse-mode", default="predictor", choices=["predictor", "oracle"],
                    help="predictor: computed set from the predictors (default); oracle: the "
                         "true active set from dense activations (exactness/quality checks)")
    sp.add_argument("--gpu-index", default=None,
                    help="PowerInfer GPU index file (blk.N.gpu_idx masks) used as the placement "
                         "of a run with a fast device (ignored with a warning on CPU only)")
    sp.add_argument("--ffn-dtype", default="auto", choices=["auto", "fp32", "bf16", "int8", "q4"],
                    help="storage of the sparse FFN rows (int8: a scale per 32 weights; q4: Q4_0 "
                         "blocks of 32, C kernels, the fastest; auto: int8 for a quantized "
                         "file, else fp32)")
    sp.add_argument("--no-q4-gates", action="store_true",
                    help="int8 rows of a ReLU gate stored as Q4_0: make int8 gate rows too "
                         "(by default the file's 4-bit gate rows are kept apart and the kernels "
                         "take the gates from them: less memory, half the bytes read per "
                         "predicted neuron; this option is for comparisons)")
    sp.add_argument("--no-q4-ups", action="store_true",
                    help="with those 4-bit gates, make int8 up rows too (by default a file's "
                         "Q4_0 up rows stay 4-bit, each neuron's up row and int8 down row one "
                         "bundle: fewer bytes read per fired neuron; for comparisons)")
    sp.add_argument("--batch-ffn", default="auto", choices=["auto", "sparse", "dense"],
                    help="several rows at once (batched steps of `serve -np N`, prompts): "
                         "sparse = each row its own predicted neurons over the bundles; dense "
                         "= every neuron from a dense copy of the FFN held beside them (more "
                         "memory); auto (default) = dense where the file's predictors select "
                         "half the neurons or more (a batch's union is then nearly all)")
    sp.add_argument("--ram-budget", type=float, default=None,
                    help="GiB this process may hold, page cache of the model file included: "
                         "the hottest FFN neurons stay in RAM, the rest are read from the file "
                         "per token (a file bundled by `python -m sparseinfer.disk bundle`); "
                         "with --device cuda and --vram-budget, the hottest go to the GPU first "
                         "(three tiers)")
    sp.add_argument("--disk-cache", default="lru", choices=["lru", "freq"],
                    help="with --ram-budget: eviction of the cold-neuron cache (least recently "
                         "used, or least frequent by the file's statistics)")
    p.add_argument("-v", "--verbose", action="store_true", help="INFO logs and tracebacks")


def _add_sampling(p: argparse.ArgumentParser) -> None:
    d = SamplingParams()
    p.add_argument("-n", "--n-predict", type=int, default=d.max_tokens,
                   help=f"tokens to generate, -1 = until EOS (default {d.max_tokens})")
    p.add_argument("--temp", type=float, default=d.temperature, help="0 = greedy")
    p.add_argument("--top-k", type=int, default=d.top_k)
    p.add_argument("--top-p", type=float, default=d.top_p)
    p.add_argument("--min-p", type=float, default=d.min_p)
    p.add_argument("--repeat-penalty", type=float, default=d.repeat_penalty)
    p.add_argument("--repeat-last-n", type=int, default=d.repeat_last_n)
    p.add_argument("--seed", type=int, default=-1, help="-1 = random")
    p.add_argument("-r", "--reverse-prompt", "--stop", dest="stop", action="append", default=[],
                   help="stop string (repeatable)")
    p.add_argument("--ignore-eos", action="store_true")
    p.add_argument("--context-shift", nargs="?", const="rotate", default=None,
                   choices=["rotate", "recompute"],
                   help="when the context is full, keep the first --keep tokens, drop half of "
                        "the rest and go on (llama.cpp's context shift; default: stop). rotate "
                        "(default): the kept keys are rotated to their new positions, as "
                        "llama.cpp does (instant); recompute: the kept tokens are run again "
                        "(exactly a fresh run over the kept text; one prefill per shift)")
    p.add_argument("--keep", type=int, default=0, metavar="N",
                   help="with --context-shift: prompt tokens never dropped (-1 = the whole "
                        "prompt; a BOS token is kept on top, as llama.cpp does; default 0)")
    p.add_argument("--no-warmup", dest="warmup", action="store_false",
                   help="skip the warm-up run before the first generation (its one-time costs "
                        "then land in the first timings)")


def _sampling(args) -> SamplingParams:
    for name, ok, want in (("--temp", args.temp >= 0, ">= 0"), ("--top-k", args.top_k >= 0, ">= 0"),
                           ("--top-p", 0 < args.top_p <= 1, "in (0, 1]"),
                           ("--min-p", 0 <= args.min_p <= 1, "in [0, 1]"),
                           ("--repeat-penalty", args.repeat_penalty > 0, "> 0")):
        if not ok:
            raise SparseInferError(f"{name}: expected a value {want}, got "
                                   f"{getattr(args, name[2:].replace('-', '_'))}")
    return SamplingParams(
        max_tokens=args.n_predict, temperature=args.temp, top_k=args.top_k, top_p=args.top_p,
        min_p=args.min_p, repeat_penalty=args.repeat_penalty, repeat_last_n=args.repeat_last_n,
        seed=None if args.seed < 0 else args.seed, stop=tuple(args.stop),
        ignore_eos=args.ignore_eos,
    )


def _check_model_args(args) -> None:
    """Flags checked before the model loads (a load takes seconds)."""
    if args.ctx_size < 8:
        raise SparseInferError(f"-c/--ctx-size: expected at least 8, got {args.ctx_size}")
    if args.threads is not None and args.threads < 1:
        raise SparseInferError(f"-t/--threads: expected a positive number, got {args.threads}")
    if getattr(args, "n_predict", -1) < -1:
        raise SparseInferError(f"-n/--n-predict: expected -1 (until EOS) or a count >= 0, got "
                               f"{args.n_predict}")
    if getattr(args, "parallel", 1) < 1:
        raise SparseInferError(f"-np/--parallel: expected a positive number, got {args.parallel}")
    if getattr(args, "batch_prefill_chunk", 1) < 1:
        raise SparseInferError(f"--batch-prefill-chunk: expected a positive number, got "
                               f"{args.batch_prefill_chunk}")
    if getattr(args, "batch_step_rows", 0) < 0:
        raise SparseInferError(f"--batch-step-rows: expected 0 (no budget) or a positive number, "
                               f"got {args.batch_step_rows}")
    ratio = getattr(args, "batch_step_ratio", 0.0)
    if ratio != 0 and not 1.0 < ratio < math.inf:
        raise SparseInferError(f"--batch-step-ratio: expected 0 (no budget) or a finite number "
                               f"> 1, got {ratio}")
    if args.model is not None:
        from .models.find import find_model

        find_model(args.model)  # a path, or an Ollama / Hugging Face cache name (no download)


def _engine(args):
    from .engine import Engine

    _check_model_args(args)
    engine = Engine.load(args.model, n_ctx=args.ctx_size, threads=args.threads,
                         dtype=args.dtype, dense=args.dense, threshold=args.sparse_threshold,
                         device=args.device, vram_budget=args.vram_budget,
                         ffn_dtype=args.ffn_dtype, q4_gates=not args.no_q4_gates,
                         q4_ups=not args.no_q4_ups, batch_ffn=args.batch_ffn, mode=args.sparse_mode,
                         gpu_index=args.gpu_index, kv_type=args.cache_type,
                         **_disk_options(args))
    if args.dtype == "auto":
        what = " = the file's quantized blocks, in place" if engine.dtype == "ggml" else ""
        print(f"weights: {engine.dtype}{what} (--dtype auto)", file=sys.stderr)
    why = ("-t" if args.threads else "the cores" if engine.threads == default_threads()
           else ONE_THREAD_WHY)
    print(f"threads: {engine.threads} ({why})", file=sys.stderr)
    return engine


def _read_text(path: Path) -> str:
    try:
        return path.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise SparseInferError(f"file not found: {path}") from None
    except UnicodeDecodeError as e:
        raise SparseInferError(f"{path}: expected UTF-8 text: {e}") from None
    except OSError as e:
        raise SparseInferError(f"{path}: cannot read: {e.strerror}") from None


def _disk_options(args) -> dict:
    if getattr(args, "ram_budget", None) is None:
        return {}
    from .disk.plan import DiskOptions

    return {"ram_budget": args.ram_budget, "disk_options": DiskOptions(eviction=args.disk_cache)}


def _print_sparse(engine) -> None:
    info = engine.sparse_info
    if info is not None:
        print(f"sparse FFN: {info.density():.1%} of neurons computed per token "
              f"(mode {info.mode}, {info.ffn_dtype}, fast tier {info.device}, "
              f"{sum(info.hot_counts)} hot neurons)", file=sys.stderr)
        from .disk.tier import disk_report

        rep = disk_report(engine.model)
        if rep is not None:
            pp = rep.prefetch_precision  # (NaN without cache prefetches: gates first)
            print(f"disk tier: {rep.bytes_per_token / 2**20:.2f} MiB read per token, cache hit "
                  f"rate {rep.cache.hit_rate:.1%}"
                  + (f", prefetch precision {pp:.1%}" if pp == pp else ""), file=sys.stderr)


def _print_timings(fin, load_seconds: float | None = None, warmup_seconds: float | None = None
                   ) -> None:
    """llama.cpp's ``llama_perf_context_print`` lines: load time (with the warm-up run, which
    the rates below exclude), prompt eval, eval and total. ``warmup_seconds`` None: no warm-up
    ran, so the first generation's rates include one-time costs, and the line says so."""
    def line(label, seconds, n, unit):
        ms = seconds * 1e3
        per = (f"({ms / n:8.2f} ms per token, {n / seconds:8.2f} tokens per second)"
               if n > 0 and seconds > 0 else "(       - ms per token,        - tokens per second)")
        print(f"{label:>16s} = {ms:10.2f} ms / {n:5d} {unit:6s} {per}", file=sys.stderr)

    print(file=sys.stderr)
    if load_seconds is not None:
        warm = ("no warm-up run: the first rates include one-time costs" if warmup_seconds is None
                else f"+ warm-up {warmup_seconds * 1e3:.2f} ms, not in the rates below")
        print(f"{'load time':>16s} = {load_seconds * 1e3:10.2f} ms ({warm})", file=sys.stderr)
    if fin.completion_tokens == 0:  # -n 0: the prompt was never run through the model
        print(f"{'prompt eval time':>16s} = not evaluated ({fin.prompt_tokens} tokens; nothing "
              f"to generate)", file=sys.stderr)
        return
    n_eval = max(fin.completion_tokens - 1, 0)  # the first token comes from the prefill
    line("prompt eval time", fin.prefill_seconds, fin.prompt_tokens, "tokens")
    line("eval time", fin.decode_seconds, n_eval, "runs")
    total = fin.prefill_seconds + fin.decode_seconds
    print(f"{'total time':>16s} = {total * 1e3:10.2f} ms / "
          f"{fin.prompt_tokens + n_eval:5d} tokens", file=sys.stderr)


def _print_finish(fin, engine, params, shift=None) -> None:
    """Say why generation stopped when it was not EOS, a stop string or -n."""
    if fin.reason == "length" and fin.prompt_tokens + fin.completion_tokens >= engine.n_ctx \
            and (params.max_tokens < 0 or fin.completion_tokens < params.max_tokens):
        if shift is None:
            print(f"stopped: the context is full ({engine.n_ctx} tokens); --context-shift or a "
                  f"larger -c/--ctx-size lets it go on", file=sys.stderr)
        else:
            print(f"stopped: the context is full ({engine.n_ctx} tokens) and --keep leaves "
                  f"nothing to drop", file=sys.stderr)


def _context_shift(args):
    if not args.context_shift:
        return None
    from .generate import ContextShift

    return ContextShift(args.keep, recompute=args.context_shift == "recompute")


def _warmup(engine, args) -> float | None:
    return engine.warmup() if args.warmup else None


# ---- subcommands -------------------------------------------------------------------------------


def cmd_run(args) -> int:
    from .engine import FinishEvent

    if args.file is not None:
        prompt = _read_text(args.file)
    elif args.prompt is not None:
        prompt = args.prompt
    else:
        raise SparseInferError("no prompt: give one with -p TEXT or -f FILE")
    if not prompt:
        raise SparseInferError(f"the prompt is empty: expected some text in "
                               f"{'-f ' + str(args.file) if args.file else '-p'}")
    params = _sampling(args)
    shift = _context_shift(args)
    engine = _engine(args)
    ids = engine.encode(prompt)
    engine.check_fits(len(ids))  # before echoing the prompt
    warm = _warmup(engine, args) if params.max_tokens != 0 else None
    print(prompt, end="", flush=True)
    for ev in engine.stream(ids, params, context_shift=shift):
        if isinstance(ev, FinishEvent):
            print()
            _print_timings(ev, engine.load_seconds, warm)
            _print_finish(ev, engine, params, shift)
            _print_sparse(engine)
        else:
            print(ev.text, end="", flush=True)
    return 0


def cmd_chat(args) -> int:
    from .engine import FinishEvent

    params = _sampling(args)
    shift = _context_shift(args)
    engine = _engine(args)
    warm = _warmup(engine, args)
    first = True
    messages = [{"role": "system", "content": args.system}] if args.system else []
    interactive = sys.stdin.isatty()
    if interactive:
        print(f"chatting with {engine.name} — empty line or Ctrl-D to quit", file=sys.stderr)
    while True:
        if interactive:
            print("> ", end="", flush=True)
        line = sys.stdin.readline()
        if not line or not line.strip():
            return 0
        messages.append({"role": "user", "content": line.rstrip("\n")})
        ids = engine.chat_prompt(messages, args.chat_template_kwargs)
        reply = []
        for ev in engine.stream(ids, params, context_shift=shift):
            if isinstance(ev, FinishEvent):
                print()
                if args.timings:
                    _print_timings(ev, engine.load_seconds if first else None, warm)
                _print_finish(ev, engine, params, shift)
                first = False
            else:
                reply.append(ev.text)
                print(ev.text, end="", flush=True)
        messages.append({"role": "assistant", "content": "".join(reply)})


def cmd_perplexity(args) -> int:
    from tqdm import tqdm

    from .data import HELDOUT_TEXT
    from .engine import Engine  # noqa: F401  (import cost paid before the progress bar)
    from .perplexity import perplexity

    path = args.file or HELDOUT_TEXT
    text = _read_text(path)
    engine = _engine(args)
    tok = engine.tokenizer
    ids = tok.encode(text, add_bos=False)
    bos = tok.bos_id if tok.add_bos else None
    print(f"perplexity: {path}: {len(ids)} tokens, {len(ids) // args.ctx_size} chunks of "
          f"{args.ctx_size}", file=sys.stderr)
    bar = tqdm(total=max(len(ids) // args.ctx_size, 0), unit="chunk", file=sys.stderr,
               disable=None)

    def progress(done, total, ppl):
        bar.total = total
        bar.update(1)
        bar.set_postfix(ppl=f"{ppl:.4f}")

    if engine.sparse_info is not None:  # score what sparse decoding computes, token by token
        engine.sparse_info.set_batch_mode("masked")
    t0 = time.perf_counter()
    res = perplexity(engine.model, ids, args.ctx_size, bos, args.chunks, progress)
    bar.close()
    _print_sparse(engine)
    dt = time.perf_counter() - t0
    print(f"{res.n_scored} tokens scored in {res.n_chunks} chunks, {dt:.1f} s "
          f"({res.n_chunks * args.ctx_size / dt:.1f} tokens/s)", file=sys.stderr)
    print(f"PPL = {res.ppl:.4f}")
    return 0


def cmd_info(args) -> int:
    from .data import default_model_path
    from .fileio import available_memory
    from .models.loading import open_source
    from .models.plan import make_plan

    src = open_source(args.model or default_model_path())  # metadata and tensor index only
    cfg = src.config
    kind = "GGUF from PowerInfer's converter (magic PWRI)" if src.powerinfer else src.format
    split = f", split in {len(src.parts) + 1} parts" if src.parts else ""
    print(f"file:   {src.path}  ({src.file_bytes / 2**20:.1f} MiB, {kind}{split})")
    print(f"name:   {cfg.name}")
    for k, v in vars(cfg).items():
        print(f"  {k:16s} {v}")
    n_params = sum(math.prod(t.shape) for t in src.tensors.values())
    print(f"parameters: {n_params / 1e6:.1f} M")
    from .offline.report import file_summary

    summary = file_summary(src.metadata, src.path)
    if summary is not None:
        print(summary)
    else:
        for k in sorted(k for k in src.metadata if k.startswith(("powerinfer.", "sparseinfer."))):
            print(f"  {k} = {src.metadata[k]}")
    plan = make_plan(src, args.dtype, dense=args.dense, ffn_dtype=args.ffn_dtype,
                     q4_gates=not args.no_q4_gates, q4_ups=not args.no_q4_ups,
                     batch_ffn=args.batch_ffn,
                     mode=args.sparse_mode, device=args.device, kv_type=args.cache_type,
                     n_ctx=min(args.ctx_size, cfg.max_seq_len), **_disk_options(args))
    print(plan.summary())
    from .cpu import kernels_in_use

    print(f"kernels: {kernels_in_use()}")
    from .threads import small_model_threads

    if args.threads:
        print(f"threads: {args.threads} (-t)")
    elif small_model_threads(plan):
        print(f"threads: 1 by default ({ONE_THREAD_WHY})")
    else:
        print(f"threads: {default_threads()} by default (the cores; -t to choose)")
    n_ctx = min(args.ctx_size, cfg.max_seq_len)
    print(f"memory: needs {plan.needed_bytes(n_ctx) / 2**30:.2f} GiB with a {n_ctx}-token "
          f"context; {available_memory() / 2**30:.2f} GiB available")
    print(f"tensors: {len(src.all_tensors)}")
    print(f"  {'name':40s} {'type':8s} {'shape':>20s} {'bytes':>12s}")
    for t in src.infos:
        print(f"  {t.name:40s} {t.kind:8s} {str(list(t.shape)):>20s} {t.nbytes:12d}")
    return 0


def cmd_serve(args) -> int:
    _check_port(args.host, args.port)  # before the load: a taken port fails in a second
    _check_model_args(args)
    from .server.app import serve

    engine = _engine(args)
    if args.parallel > 1:
        from .server.batching import BatchEngine, prompt_budget

        engine = BatchEngine(engine, args.parallel, prefill_chunk=args.batch_prefill_chunk,
                             cache_prompt=not args.no_cache_prompt,
                             budget=prompt_budget(args.batch_step_rows, args.batch_step_ratio))
    logging.getLogger("sparseinfer.server").setLevel(logging.INFO)  # the bound address, requests
    print(f"serving {engine.name} (Ctrl-C to stop)", file=sys.stderr)
    try:
        serve(engine, host=args.host, port=args.port, api_key=args.api_key,
              max_queue=args.max_queue, default_max_tokens=args.default_max_tokens or None,
              max_tokens_limit=args.max_tokens_limit or None,
              max_generation_seconds=args.max_generation_seconds or None,
              pooling=args.pooling, reasoning_format=args.reasoning_format,
              chat_template_kwargs=args.chat_template_kwargs)
    finally:
        close = getattr(engine, "close", None)  # the batch loop of --parallel
        if close is not None:
            close()
    return 0


def _check_port(host: str, port: int) -> None:
    import socket

    if not 0 <= port <= 65535:
        raise SparseInferError(f"--port: expected 0-65535, got {port}")
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
    except socket.gaierror as e:
        raise SparseInferError(f"--host: expected an address or host name, got {host!r} "
                               f"({e.strerror})") from None
    family, kind, proto, _, addr = infos[0]
    with socket.socket(family, kind, proto) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as uvicorn binds
        try:
            s.bind(addr)
        except OSError as e:
            raise SparseInferError(f"--port: expected a free port on {host}, got {port} "
                                   f"({e.strerror}); choose another with --port") from None


# ---- parser ------------------------------------------------------------------------------------


def _json_object(text: str) -> dict:
    try:
        value = json.loads(text)
    except json.JSONDecodeError as e:
        raise argparse.ArgumentTypeError(f"expected a JSON object, got {text!r} ({e})") from None
    if not isinstance(value, dict):
        raise argparse.ArgumentTypeError(f"expected a JSON object, got {text!r}")
    return value


def _add_template_kwargs(p: argparse.ArgumentParser) -> None:
    p.add_argument("--chat-template-kwargs", type=_json_object, default=None, metavar="JSON",
                   help="more variables for the chat template, e.g. "
                        "'{\"enable_thinking\": false}' to turn Qwen3's thinking off "
                        "(llama.cpp's --chat-template-kwargs)")


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="sparseinfer", description=__doc__.splitlines()[0])
    p.add_argument("--version", action="version", version=f"sparseinfer {__version__}")
    sub = p.add_subparsers(dest="command", required=True, metavar="COMMAND")

    r = sub.add_parser("run", help="continue a prompt")
    _add_model(r)
    _add_sampling(r)
    r.add_argument("-p", "--prompt", help="prompt text")
    r.add_argument("-f", "--file", type=Path, help="read the prompt from a file")
    r.set_defaults(func=cmd_run)

    c = sub.add_parser("chat", help="interactive multi-turn chat with the model's template")
    _add_model(c)
    _add_sampling(c)
    c.add_argument("--system", default=None, help="system message")
    c.add_argument("--timings", action="store_true", help="print tokens/s after each reply")
    _add_template_kwargs(c)
    c.set_defaults(func=cmd_chat, n_predict=512)

    pp = sub.add_parser("perplexity", help="llama.cpp-style chunked perplexity of a text file")
    _add_model(pp)
    pp.add_argument("-f", "--file", type=Path, default=None,
                    help="text file (default: the held-out Austen excerpt shipped with us)")
    pp.add_argument("--chunks", type=int, default=None, help="score at most this many chunks")
    pp.set_defaults(func=cmd_perplexity, ctx_size=512)

    i = sub.add_parser("info", help="model config, load plan, memory needed, tensor table "
                                    "(reads no weights)")
    _add_model(i)
    i.set_defaults(func=cmd_info)

    s = sub.add_parser("serve", help="HTTP server speaking the OpenAI API (/v1) and Ollama's "
                                     "(/api)")
    _add_model(s)
    s.add_argument("--host", default="127.0.0.1")
    s.add_argument("--port", type=int, default=8080)
    s.add_argument("--api-key", default=None, help="require this bearer token")
    s.add_argument("--max-queue", type=int, default=16, help="requests waiting at most")
    s.add_argument("-np", "--parallel", type=int, default=1, metavar="N",
                   help="serve up to N requests at once by continuous batching (default 1: one "
                        "at a time, on the fused single-token path)")
    s.add_argument("--batch-prefill-chunk", type=int, default=64, metavar="N",
                   help="with --parallel: prompt tokens run with each decode step "
                        "(smaller: steadier inter-token latency, slower first tokens)")
    s.add_argument("--batch-step-ratio", type=float, default=3.0, metavar="R",
                   help="with --parallel: while any request generates, a newcomer's prompt "
                        "takes the tokens per step that keep the step within R times a step of "
                        "the generating requests alone, by the step times measured (default 3; "
                        "smaller: steadier streams, slower first tokens; 0: a whole "
                        "--batch-prefill-chunk per step)")
    s.add_argument("--batch-step-rows", type=int, default=0, metavar="N",
                   help="with --parallel: instead of --batch-step-ratio, while any request "
                        "generates a step runs at most N rows, a newcomer's prompt taking those "
                        "its neighbours leave (at least one) (0: not this budget; 8 fills the C "
                        "kernels' pass of 8 rows)")
    s.add_argument("--no-cache-prompt", action="store_true",
                   help="with --parallel: run every prompt in full, even where a free slot's "
                        "cache holds its beginning (a shared system prompt, earlier turns)")
    s.add_argument("--default-max-tokens", type=int, default=1024, metavar="N",
                   help="tokens generated for a request that sets no max_tokens (0: until end "
                        "of text or the context is full; default 1024)")
    s.add_argument("--max-tokens-limit", type=int, default=0, metavar="N",
                   help="a request asking for more tokens is refused with a 400 (0: no limit "
                        "beyond the context)")
    s.add_argument("--max-generation-seconds", type=float, default=300.0, metavar="S",
                   help="a generation running longer ends with finish_reason 'length' "
                        "(0: no limit; default 300)")
    s.add_argument("--pooling", choices=["mean", "last"], default="mean",  # generate.POOLINGS
                   help="how /v1/embeddings makes one vector of a text from the model's "
                        "final-normed hidden states: mean over its tokens (default) or the last "
                        "token's (llama.cpp's --pooling); unit length either way")
    s.add_argument("--reasoning-format", choices=["auto", "deepseek", "none"], default="auto",
                   help="a thinking model's thoughts (<think>...</think>: DeepSeek-R1, QwQ, "
                        "Qwen3): auto/deepseek (default) return them apart from the answer, as "
                        "reasoning_content (OpenAI routes) and thinking (Ollama's); none leaves "
                        "them in the answer (llama.cpp's --reasoning-format)")
    _add_template_kwargs(s)
    s.set_defaults(func=cmd_serve)

    from .offline.cli import add_offline_commands

    add_offline_commands(sub, _add_model)  # convert, profile, train-predictors, solve, export
    return p


def main(argv: list[str] | None = None) -> int:
    passive_wait()  # before torch or numba start their thread pools (threads.py)
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=logging.INFO if args.verbose else logging.WARNING,
                        format="%(levelname)s %(name)s: %(message)s")
    try:
        return args.func(args) or 0
    except SparseInferError as e:
        if args.verbose:
            raise
        print(f"error: {e}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print(file=sys.stderr)
        return 130
    except BrokenPipeError:
        return 0
