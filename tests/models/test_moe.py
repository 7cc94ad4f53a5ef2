"""Mixtures of experts (Mixtral, Qwen3-MoE, Granite-MoE) beyond the float checks of
test_architectures.py: quantized experts on the C kernels from files llama.cpp's converter wrote (against transformers
reading the same GGUF, or gguf-py's dequantization of it), the engine and the batch engine end to
end, and the errors for what is not supported."""

from __future__ import annotations

import json
import shutil
import threading

import pytest
import torch

from conftest import gguf_parsed_once, tiny_arch_model
from sparseinfer.errors import ModelFileError, SparseInferError
from sparseinfer.models.build import load
from sparseinfer.models.loading import load_model


def _rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).abs().max() / b.abs().max())


def _logits(lm, ids: torch.Tensor) -> torch.Tensor:
    cache = lm.model.new_cache(ids.shape[0], ids.shape[1] + 1)
    with torch.inference_mode():
        return lm.model(ids, 0, cache)


IDS = torch.randint(3, 200, (2, 29), generator=torch.Generator().manual_seed(5))


def _routed(lm, ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Logits (rows, vocab) and each row's experts in every layer (rows, layers · k), read from
    the routers' outputs by forward hooks."""
    k, picked = lm.config.n_experts_used, []
    hooks = [blk.ffn.router.register_forward_hook(
        lambda m, i, out: picked.append(out.float().topk(k, -1).indices.sort(-1).values))
        for blk in lm.model.layers]
    try:
        logits = _logits(lm, ids)
    finally:
        for h in hooks:
            h.remove()
    return logits.reshape(-1, logits.shape[-1]), torch.cat(picked, -1)


def _check_quantized(lm, exact) -> None:
    """Quantized experts against the same file's numbers in float32: rows routed to the same
    experts in every layer within 3% (x quantized to 8 bits, as llama.cpp does), and few rows
    routed otherwise (a near tie between two experts' scores flips: the output differs as
    much as two experts do)."""
    got, got_routes = _routed(lm, IDS)
    want, want_routes = _routed(exact, IDS)
    same = (got_routes == want_routes).all(-1)
    assert int(same.sum()) >= 0.9 * len(same)
    err = (got - want).abs().amax(-1) / want.abs().max()
    assert float(err[same].max()) < 3e-2


def _expert_types(lm) -> set[str]:
    from sparseinfer.quant.linear import GGMLLinear

    return {m.type_name for name, mod in lm.model.named_modules()
            if ".experts." in name and isinstance(mod, GGMLLinear) for m in mod.mats}


@pytest.mark.slow
def test_qwen3moe_q8_0_experts_on_c_kernels_match_transformers_gguf(arch_model_dir,
                                                                      llamacpp_convert):
    """llama.cpp's converter writes the tiny Qwen3-MoE as Q8_0 (every expert of a layer in one
    3-D tensor); the default plan runs each expert's slice of it in place on the C kernels.
    Reference: transformers reading the same GGUF (its own dequantization, its own MoE), which
    our float32 reading of the file matches within 1e-4."""
    import transformers as tf

    d = arch_model_dir("qwen3moe")
    path = llamacpp_convert(d, "q8_0")
    lm = load(path, "auto", fused=True)
    assert lm.config.n_experts == 4 and lm.config.n_experts_used == 2
    assert _expert_types(lm) and all(t.startswith("Q8_0") for t in _expert_types(lm))
    # (transformers' GGUF reader misses qwen3moe.expert_feed_forward_length: the directory's
    # config.json gives the shapes, the GGUF every weight)
    with gguf_parsed_once():
        ref = tf.AutoModelForCausalLM.from_pretrained(
            d, gguf_file=path.name, config=tf.AutoConfig.from_pretrained(d)).eval()
    with torch.no_grad():
        want = ref(IDS).logits
    exact = load(path, "fp32")  # gguf-py's dequantization through our float path
    assert _rel_err(_logits(exact, IDS), want) < 1e-4
    _check_quantized(lm, exact)


@pytest.mark.slow
def test_mixtral_q8_0_experts_match_their_dequantized_weights(arch_model_dir, llamacpp_convert):
    """transformers does not read a Mixtral GGUF: the reference is the same file's numbers
    dequantized by gguf-py and run in float32 (the float path test_architectures.py checks
    against transformers)."""
    path = llamacpp_convert(arch_model_dir("mixtral"), "q8_0")
    lm = load(path, "auto", fused=True)
    assert all(t.startswith("Q8_0") for t in _expert_types(lm))
    _check_quantized(lm, load(path, "fp32"))


def test_route_picks_the_top_experts_by_brute_force(arch_model_dir):
    """One layer's output against a loop over every token and every expert."""
    lm = load_model(arch_model_dir("qwen3moe_nonorm"))
    moe = lm.model.layers[0].ffn
    x = torch.randn(5, lm.config.d_model, generator=torch.Generator().manual_seed(2))
    with torch.inference_mode():
        got = moe(x)
        for t in range(5):
            probs = torch.softmax(moe.router(x[t]).float(), -1)
            best = sorted(range(4), key=lambda e: -float(probs[e]))[:2]
            want = sum(probs[e] * moe.experts[e](x[t:t + 1])[0] for e in best)
            assert torch.allclose(got[t], want, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("bf16", [False, True], ids=["fp32", "bf16"])
@pytest.mark.parametrize("name", ["mixtral", "qwen3moe"])
def test_engine_and_batch_engine_generate_transformers_tokens(arch_model_dir, tmp_path, name,
                                                             bf16):
    """The engine (the CLI's and server's load) greedy-decodes what transformers generates:
    each block's attention in the C block (attention only; Qwen3-MoE's q/k norms too), the
    experts after it — as float32 modules (``MoE.loop``), or, from a bfloat16 checkpoint, on the
    C kernels' BF16 rows (``fused.experts.CExperts``; transformers then runs the same numbers
    in float32); the batch engine gives each of two concurrent requests the same tokens."""
    from sparseinfer.config import SamplingParams
    from sparseinfer.engine import Engine, TokenEvent
    from sparseinfer.fused.experts import CExperts
    from sparseinfer.server.batching import BatchEngine

    ref, d = tiny_arch_model(name), arch_model_dir(name)
    if bf16:
        d = tmp_path / name
        shutil.copytree(arch_model_dir(name), d)
        tiny_arch_model(name).to(torch.bfloat16).save_pretrained(d, safe_serialization=True)
        with torch.no_grad():
            for p in ref.parameters():
                p.copy_(p.to(torch.bfloat16).float())
    eng = Engine.load(d, threads=1)
    assert eng.loaded.plan.fused_decode
    assert all(blk.fused is not None for blk in eng.loaded.model.layers)
    assert (CExperts.of(eng.loaded.model.layers[0].ffn) is not None) == bf16
    prompts = [[1, 17, 42, 99, 7], [1, 5, 6, 150, 33, 2]]
    params = SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True)

    def tokens(engine, ids):
        return [e.token_id for e in engine.stream(ids, params)
                if isinstance(e, TokenEvent) and e.token_id >= 0]

    for ids in prompts:
        with torch.no_grad():
            hf = ref.generate(torch.tensor([ids]), max_new_tokens=10, min_new_tokens=10,
                              do_sample=False)
        assert tokens(eng, ids) == hf[0, len(ids):].tolist()
    assert all(blk.fused.attn_only for blk in eng.loaded.model.layers)  # (made by the decode)
    single = [tokens(eng, ids) for ids in prompts]
    be = BatchEngine(eng, parallel=2, prefill_chunk=4, cache_prompt=False)
    try:
        got: dict[int, list[int]] = {}
        threads = [threading.Thread(target=lambda i=i: got.__setitem__(i, tokens(be, prompts[i])))
                   for i in range(2)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(120)
        assert [got[0], got[1]] == single
    finally:
        be.close()


@pytest.mark.slow
def test_granitemoe_gguf_decodes_transformers_tokens(arch_model_dir, llamacpp_convert):
    """Granite's mixture of experts from llama.cpp's converter: its residual multiplier inside
    the C block's attention-only mode and on the experts' output after it (and in the batch
    engine's steps); greedy tokens equal transformers' on the checkpoint the file came from."""
    from sparseinfer.config import SamplingParams
    from sparseinfer.engine import Engine, TokenEvent
    from sparseinfer.server.batching import BatchEngine

    path = llamacpp_convert(arch_model_dir("granitemoe"))
    ref = tiny_arch_model("granitemoe")
    eng = Engine.load(path, threads=1)
    assert eng.loaded.plan.fused_decode and eng.loaded.config.residual_scale == 0.25
    params = SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True)
    ids = [1, 17, 42, 99, 7]

    def tokens(engine):
        return [e.token_id for e in engine.stream(ids, params)
                if isinstance(e, TokenEvent) and e.token_id >= 0]

    with torch.no_grad():
        hf = ref.generate(torch.tensor([ids]), max_new_tokens=10, min_new_tokens=10,
                          do_sample=False)
    assert tokens(eng) == hf[0, len(ids):].tolist()
    assert all(blk.fused.attn_only for blk in eng.loaded.model.layers)
    be = BatchEngine(eng, parallel=2, prefill_chunk=4, cache_prompt=False)
    try:
        assert tokens(be) == hf[0, len(ids):].tolist()
    finally:
        be.close()


@pytest.mark.parametrize("name", ["mixtral", "qwen3moe_nonorm"])
def test_grouped_c_experts_match_the_loop(arch_model_dir, tmp_path, name):
    """``fused.experts.CExperts`` (the experts' products grouped into few C calls, router
    weights folded into the down products' inputs) against ``MoE.loop`` (each picked expert's
    own modules) on the same layers, with the experts on the C kernels' BF16 rows (a bfloat16
    checkpoint): one token, and 1 to 37 rows (experts with one row, several, none)."""
    from sparseinfer.fused.experts import CExperts

    d = tmp_path / name
    shutil.copytree(arch_model_dir(name), d)
    tiny_arch_model(name).to(torch.bfloat16).save_pretrained(d, safe_serialization=True)
    lm = load(d, "auto")
    x = torch.randn(37, lm.config.d_model, generator=torch.Generator().manual_seed(3))
    with torch.inference_mode():
        for blk in lm.model.layers:
            c = CExperts.of(blk.ffn)
            assert c is not None
            for t in range(4):
                assert torch.allclose(c.one(x[t].contiguous()), blk.ffn.loop(x[t:t + 1])[0],
                                      rtol=1e-5, atol=1e-6)
            for n in (1, 2, 5, 37):
                assert torch.allclose(c.rows(x[:n]), blk.ffn.loop(x[:n]), rtol=1e-5, atol=1e-6)
    assert CExperts.of(load_model(d).model.layers[0].ffn) is None  # fp32: torch's matmul


def test_convert_refuses_a_mixture_of_experts(arch_model_dir, tmp_path):
    from sparseinfer.offline.pipeline import convert

    with pytest.raises(SparseInferError, match="mixture of experts .4 experts, 2 a token. cannot "
                                               "be converted"):
        convert(arch_model_dir("qwen3moe"), tmp_path / "out.gguf")


def test_dense_layers_among_experts_named(arch_model_dir, tmp_path):
    d = tmp_path / "mixed"
    shutil.copytree(arch_model_dir("qwen3moe"), d)
    cfg = json.loads((d / "config.json").read_text())
    cfg["mlp_only_layers"] = [1]
    (d / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ModelFileError, match="dense layers among the experts"):
        load_model(d)


def test_missing_expert_named(arch_model_dir, tmp_path):
    """A checkpoint with fewer experts than its config says: the error names the tensor."""
    from safetensors.torch import load_file, save_file

    d = tmp_path / "short"
    shutil.copytree(arch_model_dir("mixtral"), d)
    f = next(d.glob("*.safetensors"))
    tensors = {k: v for k, v in load_file(f).items() if ".experts.3." not in k}
    save_file(tensors, f, metadata={"format": "pt"})
    with pytest.raises(ModelFileError, match=r"missing tensor 'model\.layers\.0\.block_sparse_moe"
                                             r"\.experts\.3\.w1\.weight'"):
        load_model(d)
