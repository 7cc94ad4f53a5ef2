"""sparseinfer.cpu.DecodeBlock (a whole llama block for one token in C) against its float64
torch reference (``reference.block_decode_ref``: products on the input rounded as the kernels
round it, plain softmax attention), over both ISAs, 1 and 2 threads, positions, grouped heads,
both rope layouts, FFN kinds and biases; and a real model decoded with and without it."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from sparseinfer import cpu
from sparseinfer.cpu import reference as ref

gguf = pytest.importorskip("gguf")


def qmat(type_name: str, rows: int, cols: int, rng: np.random.Generator) -> cpu.QuantMatrix:
    w = (rng.standard_normal((rows, cols)) / np.sqrt(cols)).astype(np.float32)
    raw = gguf.quants.quantize(w, gguf.GGMLQuantizationType[type_name]).reshape(-1)
    return cpu.QuantMatrix(type_name, raw, rows, cols)


def make(rng, *, d=64, nh=4, nkv=2, hd=16, d_ff=96, gated=True, gate_act="silu", up_act=None,
         interleaved=False, bias=False, types=("Q4_0", "Q8_0")):
    t0, t1 = types
    q = [qmat(t0, nh * hd, d, rng), qmat(t1, nkv * hd, d, rng), qmat(t0, nkv * hd, d, rng)]
    w_in = [qmat(t0, d_ff, d, rng)] + ([qmat(t1, d_ff, d, rng)] if gated else [])
    biases = None
    if bias:
        def vec(n):
            return torch.from_numpy(rng.standard_normal(n).astype(np.float32))

        biases = {"qkv": vec((nh + 2 * nkv) * hd), "w_in": vec(len(w_in) * d_ff) * 0.1}
    return {"d_model": d, "n_heads": nh, "n_kv_heads": nkv, "head_dim": hd, "d_ff": d_ff,
            "gated": gated, "gate_act": gate_act, "up_act": up_act, "interleaved": interleaved,
            "eps": 1e-5,
            "attn_norm": torch.from_numpy(rng.uniform(0.5, 1.5, d).astype(np.float32)),
            "ffn_norm": torch.from_numpy(rng.uniform(0.5, 1.5, d).astype(np.float32)),
            "qkv": q, "wo": [qmat(t1, d, nh * hd, rng)], "w_in": w_in,
            "down": [qmat(t0, d, d_ff, rng)], "biases": biases}


def rope_row(hd: int, pos: int) -> tuple[torch.Tensor, torch.Tensor]:
    half = hd // 2
    inv = 1.0 / (10000.0 ** (torch.arange(half, dtype=torch.float64) / half))
    ang = torch.cat([pos * inv, pos * inv])
    return ang.cos().float(), ang.sin().float()


def check(kw, pos, S=48, seed=0):
    g = torch.Generator().manual_seed(seed)
    nkv, hd = kw["n_kv_heads"], kw["head_dim"]
    kc, vc = torch.randn(nkv, S, hd, generator=g), torch.randn(nkv, S, hd, generator=g)
    kr, vr = kc.clone(), vc.clone()
    x = torch.randn(kw["d_model"], generator=g)
    cos, sin = rope_row(hd, pos)
    want = ref.block_decode_ref(**kw, x=x.clone(), pos=pos, k_cache=kr, v_cache=vr, cos=cos,
                                sin=sin)
    block = cpu.DecodeBlock(**kw)
    got = x.clone()
    assert block(got, pos, kc, vc, cos, sin) is got
    scale = want.abs().max().item()
    torch.testing.assert_close(got, want, rtol=2e-3, atol=2e-3 * scale)
    torch.testing.assert_close(kc, kr, rtol=1e-3, atol=1e-3)
    torch.testing.assert_close(vc, vr, rtol=1e-3, atol=1e-3)


@pytest.mark.parametrize("pos", [0, pytest.param(1, marks=pytest.mark.slow), 9,
                                 pytest.param(47, marks=pytest.mark.slow)])
@pytest.mark.parametrize("nh,nkv,hd,d", [(4, 2, 16, 64), (4, 4, 8, 64), (8, 2, 20, 64),
                                         (8, 2, 64, 1024), (9, 3, 64, 576), (8, 1, 64, 512)])
def test_block_matches_reference(isa, threads, pos, nh, nkv, hd, d):
    """The last three shapes spread over the pool: products in several chunks, and at pos 47
    the kv heads in parallel (the small ones run on the calling thread alone) — SmolLM2's 3 and
    Gemma-3 270M's 1, fewer than or not a multiple of 2 threads."""
    check(make(np.random.default_rng(pos + nh), d=d, nh=nh, nkv=nkv, hd=hd, d_ff=256), pos)


@pytest.mark.parametrize("gated,gate_act,up_act", [(True, "silu", None), (True, "gelu_tanh", None),
                                                   (True, "gelu", None), (True, "relu", "relu"),
                                                   (False, None, "relu")])
@pytest.mark.parametrize("interleaved", [False, True])
@pytest.mark.parametrize("bias", [False, True])
def test_ffn_kinds_rope_layouts_and_biases(isa, gated, gate_act, up_act, interleaved, bias):
    kw = make(np.random.default_rng(3), gated=gated, gate_act=gate_act, up_act=up_act,
              interleaved=interleaved, bias=bias)
    check(kw, 20)


@pytest.mark.parametrize("pos", [0, 5, 30])
@pytest.mark.parametrize("opts", ["qk_norm", "post_norms", "window", "scale", "softcap",
                                  "residual", "gemma"])
def test_gemma_and_qwen3_options(isa, threads, opts, pos):
    """q/k head norms (Qwen3, Gemma 3), post-norms (Gemma 2/3), a sliding window shorter and
    longer than the cache so far, a custom score scale, soft-capped scores (Gemma 2; a cap these
    random scores reach), a residual multiplier (Granite), and all of them at once."""
    rng = np.random.default_rng(11)
    kw = make(rng, gated=True, gate_act="gelu_tanh", hd=16)

    def vec(n):
        return torch.from_numpy(rng.uniform(0.5, 1.5, n).astype(np.float32))

    if opts in ("qk_norm", "gemma"):
        kw.update(q_norm=vec(16), k_norm=vec(16))
    if opts in ("post_norms", "gemma"):
        kw.update(attn_post_norm=vec(64), ffn_post_norm=vec(64))
    if opts in ("window", "gemma"):
        kw.update(window=8)
    if opts in ("scale", "gemma"):
        kw.update(scale=0.1)
    if opts in ("softcap", "gemma"):
        kw.update(softcap=0.5 if opts == "softcap" else 0.05)
    if opts in ("residual", "gemma"):
        kw.update(residual=0.22)
    check(kw, pos)


@pytest.mark.parametrize("pos", [0, 13])
@pytest.mark.parametrize("opts", ["plain", "qk_norm"])
def test_attention_only_block(isa, threads, opts, pos):
    """d_ff 0 and no FFN matrices (a mixture of experts' block: its experts come after, in
    Python): ``x += wo(attention)`` only — the reference with an FFN that adds nothing — and the
    cache written; refused in a ``DecodeStack``, and with an FFN post-norm."""
    rng = np.random.default_rng(12)
    kw = make(rng)
    if opts == "qk_norm":
        kw.update(q_norm=torch.from_numpy(rng.uniform(0.5, 1.5, 16).astype(np.float32)),
                  k_norm=torch.from_numpy(rng.uniform(0.5, 1.5, 16).astype(np.float32)))
    g = torch.Generator().manual_seed(pos)
    kc, vc = torch.randn(2, 48, 16, generator=g), torch.randn(2, 48, 16, generator=g)
    kr, vr = kc.clone(), vc.clone()
    x = torch.randn(64, generator=g)
    cos, sin = rope_row(16, pos)
    want = ref.block_decode_ref(**kw, x=x.clone(), pos=pos, k_cache=kr, v_cache=vr, cos=cos,
                                sin=sin, ffn=lambda h, x: torch.zeros_like(h))
    block = cpu.DecodeBlock(**{**kw, "d_ff": 0, "w_in": [], "down": []})
    assert block.attn_only
    got = x.clone()
    block(got, pos, kc, vc, cos, sin)
    torch.testing.assert_close(got, want, rtol=2e-3, atol=2e-3 * want.abs().max().item())
    torch.testing.assert_close(kc, kr, rtol=1e-3, atol=1e-3)
    with pytest.raises(ValueError, match="attention-only"):
        cpu.DecodeStack([block])
    with pytest.raises(ValueError, match="block: expected"):
        cpu.DecodeBlock(**{**kw, "d_ff": 0, "w_in": [], "down": []},
                        ffn_post_norm=torch.ones(64))


def rope_tables(hd: int, n: int) -> tuple[torch.Tensor, torch.Tensor]:
    rows = [rope_row(hd, p) for p in range(n)]
    return torch.stack([c for c, _ in rows]), torch.stack([s for _, s in rows])


@pytest.mark.parametrize("opts", ["plain", "gemma", "bias"])
@pytest.mark.parametrize("B", [2, 5, 8])
def test_rows_equal_one_row_calls(isa, threads, opts, B):
    """``DecodeBlock.rows`` (one token of B sequences, the weights read once: a GEMM over the
    rows) gives every row exactly what a one-row call gives it (itself compared with the
    reference above): same outputs and cache rows, bit for bit, whatever the other rows are.
    Rows at different positions (short and long contexts, a window), in slots out of order."""
    rng = np.random.default_rng(B)
    kw = make(rng, d=128, nh=4, nkv=2, hd=32, d_ff=160, bias=opts == "bias",
              types=("Q4_1", "Q8_0") if opts == "bias" else ("Q4_0", "Q8_0"))
    if opts == "gemma":
        def vec(n):
            return torch.from_numpy(rng.uniform(0.5, 1.5, n).astype(np.float32))

        kw.update(q_norm=vec(32), k_norm=vec(32), attn_post_norm=vec(128),
                  ffn_post_norm=vec(128), window=8, scale=0.1, softcap=0.3, residual=0.5)
    n_slots, S = 10, 64
    g = torch.Generator().manual_seed(B)
    kc = torch.randn(n_slots, 2, S, 32, generator=g)
    vc = torch.randn(n_slots, 2, S, 32, generator=g)
    cos, sin = rope_tables(32, S)
    slots = torch.tensor([9, 2, 0, 5, 7, 1, 3, 8][:B], dtype=torch.int32)
    positions = torch.tensor([0, 63, 5, 40, 1, 12, 30, 7][:B], dtype=torch.int32)
    x = torch.randn(B, 128, generator=g)
    block = cpu.DecodeBlock(**kw)
    k1, v1, want = kc.clone(), vc.clone(), x.clone()
    for i in range(B):
        p, s = int(positions[i]), int(slots[i])
        block(want[i], p, k1[s], v1[s], cos[p], sin[p])
    got = x.clone()
    assert block.rows(got, positions, slots, kc, vc, cos, sin) is got
    assert torch.equal(got, want)
    assert torch.equal(kc, k1) and torch.equal(vc, v1)
    block(x[0].clone(), 3, kc[0].clone(), vc[0].clone(), cos[3], sin[3])  # one row after many


def test_blocks_of_different_sizes_share_the_scratch(threads):
    """The blocks' scratch is one buffer (calls are serialised) that grows with the largest block,
    row count and cache seen: interleaving a small and a large block, one row and several, gives
    each call what it gives alone (the one-row jobs follow the buffer when it moves)."""
    rng = np.random.default_rng(7)
    small = cpu.DecodeBlock(**make(rng, d=64, nh=4, nkv=2, hd=16, d_ff=96))
    large = cpu.DecodeBlock(**make(rng, d=256, nh=8, nkv=4, hd=32, d_ff=512))
    g = torch.Generator().manual_seed(1)
    cases = []  # (block, d, hd, nkv, rows, S)
    for block, d, hd, nkv in ((small, 64, 16, 2), (large, 256, 32, 4)):
        for B, S in ((1, 16), (6, 40)):
            cases.append((block, d, hd, nkv, B, S))

    def run(case, x, kc, vc):
        block, d, hd, nkv, B, S = case
        cos, sin = rope_tables(hd, S)
        if B == 1:
            return block(x[0], 5, kc[0], vc[0], cos[5], sin[5]).clone()
        pos = torch.arange(B, dtype=torch.int32) * 3 + 1
        return block.rows(x, pos, torch.arange(B, dtype=torch.int32), kc, vc, cos, sin).clone()

    inputs = []
    for _, d, hd, nkv, B, S in cases:
        inputs.append((torch.randn(B, d, generator=g), torch.randn(B, nkv, S, hd, generator=g),
                       torch.randn(B, nkv, S, hd, generator=g)))
    alone = [run(c, x.clone(), k.clone(), v.clone()) for c, (x, k, v) in zip(cases, inputs)]
    for i in [0, 3, 1, 2, 0, 1, 3, 0]:  # interleaved: the buffer moves, the jobs must follow
        x, k, v = inputs[i]
        assert torch.equal(run(cases[i], x.clone(), k.clone(), v.clone()), alone[i]), i


def test_stack_equals_its_blocks_one_by_one(threads):
    """``cpu.DecodeStack``: every block over the same rows in one call, each block with its own
    cache layer and its own rope tables, gives what ``DecodeBlock.rows`` gives block by block."""
    rng = np.random.default_rng(4)
    blocks = [cpu.DecodeBlock(**make(rng), window=w) for w in (0, 6, 0)]
    g = torch.Generator().manual_seed(4)
    L, n_slots, S, B = len(blocks), 4, 24, 3
    kc = torch.randn(L, n_slots, 2, S, 16, generator=g)
    vc = torch.randn(L, n_slots, 2, S, 16, generator=g)
    tables = [rope_tables(16, S), rope_tables(16, S + 8), rope_tables(16, S)]
    positions = torch.tensor([3, 20, 9], dtype=torch.int32)
    slots = torch.tensor([1, 3, 0], dtype=torch.int32)
    x = torch.randn(B, 64, generator=g)
    want, k1, v1 = x.clone(), kc.clone(), vc.clone()
    for layer, (block, (cos, sin)) in enumerate(zip(blocks, tables)):
        block.rows(want, positions, slots, k1[layer], v1[layer], cos, sin)
    stack = cpu.DecodeStack(blocks)
    got = x.clone()
    assert stack(got, positions, slots, kc, vc, tables) is got
    assert torch.equal(got, want) and torch.equal(kc, k1) and torch.equal(vc, v1)
    with pytest.raises(ValueError, match="k_cache: expected \\[3, slots"):
        stack(got, positions, slots, kc[:2], vc[:2], tables)
    with pytest.raises(ValueError, match="rope tables: expected 3"):
        stack(got, positions, slots, kc, vc, tables[:2])
    with pytest.raises(ValueError, match="rope tables: expected at least 24 positions"):
        stack(got, positions, slots, kc, vc, [rope_tables(16, 8)] * 3)
    with pytest.raises(ValueError, match="slots: expected values in"):
        stack(got, positions, torch.tensor([1, 4, 0], dtype=torch.int32), kc, vc, tables)


def test_rows_bad_arguments_say_what_was_expected():
    block = cpu.DecodeBlock(**make(np.random.default_rng(1)))
    kc = torch.zeros(3, 2, 8, 16)
    cos, sin = rope_tables(16, 8)
    i32 = torch.int32
    x = torch.zeros(2, 64)
    with pytest.raises(ValueError, match="positions: expected values in"):
        block.rows(x, torch.tensor([0, 8], dtype=i32), torch.tensor([0, 1], dtype=i32), kc,
                   kc.clone(), cos, sin)
    with pytest.raises(ValueError, match="slots: expected values in"):
        block.rows(x, torch.tensor([0, 1], dtype=i32), torch.tensor([0, 3], dtype=i32), kc,
                   kc.clone(), cos, sin)
    with pytest.raises(ValueError, match="positions: expected contiguous int32"):
        block.rows(x, torch.tensor([0, 1]), torch.tensor([0, 1], dtype=i32), kc, kc.clone(),
                   cos, sin)
    with pytest.raises(ValueError, match="cos: expected at least 8 rows"):
        block.rows(x, torch.tensor([0, 1], dtype=i32), torch.tensor([0, 1], dtype=i32), kc,
                   kc.clone(), cos[:4], sin)


def test_bad_options_say_what_was_expected():
    kw = make(np.random.default_rng(1))
    with pytest.raises(ValueError, match="window"):
        cpu.DecodeBlock(**kw, window=-1)
    with pytest.raises(ValueError, match="q_norm"):
        cpu.DecodeBlock(**kw, q_norm=torch.ones(64))  # head_dim is 16
    with pytest.raises(ValueError, match="softcap: expected a finite float >= 0"):
        cpu.DecodeBlock(**kw, softcap=-1.0)
    with pytest.raises(ValueError, match="residual: expected a finite float > 0"):
        cpu.DecodeBlock(**kw, residual=0.0)


def test_activation_tails_saturate():
    """Large |z| through the vector exp: silu(-100) = 0, silu(100) = 100, no NaN."""
    kw = make(np.random.default_rng(5))
    kw["ffn_norm"] = kw["ffn_norm"] * 1e4
    check(kw, 3)


def test_bad_shapes_say_what_was_expected():
    kw = make(np.random.default_rng(1))
    kw["n_heads"] = 3  # rows no longer match, and 3 % 2 != 0
    with pytest.raises(ValueError, match="expected q/k/v rows"):
        cpu.DecodeBlock(**kw)
    kw = make(np.random.default_rng(1))
    block = cpu.DecodeBlock(**kw)
    kc = torch.zeros(2, 8, 16)
    with pytest.raises(ValueError, match="pos"):
        block(torch.zeros(64), 8, kc, kc.clone(), *rope_row(16, 0))


@pytest.mark.parametrize("threads", [1, 2], indirect=True, ids=["1thr", "2thr"])
def test_smollm2_blocks_equal_the_torch_path(smollm2_path, threads):
    """SmolLM2's Q4_1 file, layer by layer on real hidden states: each block on DecodeBlock gives
    the output (and cache rows) of the block's torch code over the same GGMLLinear modules, which
    round each product's input the same way. (Whole-model logits are not compared: one int8
    rounding that flips on a float32 summation-order difference moves SmolLM2's logits by ~0.5,
    and greedy tokens then part ways.)"""
    from sparseinfer.models.build import load

    fused = load(smollm2_path, "auto", fused=True).model
    plain = load(smollm2_path, "auto", fused=False).model
    prompt = torch.tensor([[1, 504, 3158, 282, 260, 1345]])
    cf, cp = fused.new_cache(1, 32), plain.new_cache(1, 32)
    assert cf.k.dtype == cp.k.dtype == torch.float16
    tok = plain(prompt, 0, cp, last_only=True).argmax(-1)
    fused(prompt, 0, cf, last_only=True)  # builds the C blocks
    cf.k.copy_(cp.k)  # the same prompt cache for both (the fused model prefills on its C path)
    cf.v.copy_(cp.v)
    pos = prompt.shape[1]
    x = plain.tok_emb(tok)
    for i, (bf, bp) in enumerate(zip(fused.layers, plain.layers)):
        assert bp.fused is None
        got, want = bf(x, i, pos, cf, fused.rope), bp(x, i, pos, cp, plain.rope)
        assert bf.fused._c is not None
        scale = want.abs().max().item()
        # float32 summation order alone gives ~1e-7 of the scale; one int8 rounding of a
        # product's input that flips on it (the two paths' norms sum in different orders) moves
        # a layer by up to ~1.2e-4 of the scale (seen: 4e-5 at layer 9 and 1.2e-4 at layer 27 of
        # this prompt); a wrong kernel or a missing step moves it by 1e-2 or more
        torch.testing.assert_close(got, want, rtol=5e-4, atol=5e-4 * scale, msg=f"layer {i}")
        # the default cache holds float16 (--cache-type auto): the same rounding of values that
        # differ by float32 summation order may land one float16 step apart (~1e-3 relative)
        torch.testing.assert_close(cf.k[i, 0, :, pos].float(), cp.k[i, 0, :, pos].float(),
                                   rtol=2e-3, atol=1e-4)
        torch.testing.assert_close(cf.v[i, 0, :, pos].float(), cp.v[i, 0, :, pos].float(),
                                   rtol=2e-3, atol=1e-4)
        x = want


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["swiglu", "geglu", "geglu_tanh", "reglu", "drelu"])
def test_fp32_models_decode_as_the_torch_path(tiny_model_dir, kind):
    """fp32 weights (``FloatLinear`` on the F32 GEMV) take the C block too; no int8 rounding
    here, so the logits match the torch path's (itself compared with transformers elsewhere)."""
    from sparseinfer.models.build import load

    fused = load(tiny_model_dir(kind), "fp32", fused=True).model
    plain = load(tiny_model_dir(kind), "fp32", fused=False).model
    prompt = torch.tensor([[1, 7, 3, 9, 4]])
    cf, cp = fused.new_cache(1, 64), plain.new_cache(1, 64)
    tok = plain(prompt, 0, cp, last_only=True).argmax(-1)
    fused(prompt, 0, cf, last_only=True)
    for i in range(8):
        got, want = fused(tok, 5 + i, cf), plain(tok, 5 + i, cp)
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
        tok = want.argmax(-1)
    assert all(b.fused._c is not None for b in fused.layers)


@pytest.mark.slow
@pytest.mark.parametrize("kv_type", ["fp32", "fp16"])
def test_numba_path_still_equals_the_c_block(tiny_model_dir, kv_type):
    """``FusedDecode(block, c_block=False)`` (the numba kernels around the block's modules, the
    path of blocks the C library cannot take) against the C block on the same inputs; with a
    float16 cache (which the numba kernels cannot read) the same steps with torch's attention."""
    from sparseinfer.fused.decode import FusedDecode
    from sparseinfer.models.build import load

    model = load(tiny_model_dir("swiglu"), "fp32", fused=True, kv_type=kv_type).model
    numba_blocks = [FusedDecode(b, c_block=False) for b in model.layers]
    ca, cb = model.new_cache(1, 32), model.new_cache(1, 32)
    assert ca.k.dtype == (torch.float16 if kv_type == "fp16" else torch.float32)
    torch.manual_seed(0)
    for pos in range(5):
        x = torch.randn(1, 1, model.cfg.d_model)
        for i, (b, nb) in enumerate(zip(model.layers, numba_blocks)):
            got, want = nb(x, i, pos, cb, model.rope), b(x, i, pos, ca, model.rope)
            torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5)
            x = want
    assert numba_blocks[0]._c is None and model.layers[0].fused._c is not None


@pytest.mark.parametrize("name", ["qwen3", "gemma3", "mistral", "gemma2"])
def test_architectures_decode_on_the_c_block(arch_model_dir, name):
    """Qwen3 (q/k norms), Gemma 3 (q/k norms, post-norms, windowed layers with their own rope
    base, GELU-tanh GLU, a custom scale) and Mistral (a window of 8) decode every token on the C
    block, greedy equal to transformers' ``generate`` past the window, and Gemma 2 (alternating
    windows, soft-capped scores and logits) too."""
    from conftest import tiny_arch_model
    from sparseinfer.models.build import load

    lm = load(arch_model_dir(name), "fp32", fused=True)
    assert lm.plan.fused_decode
    ref = tiny_arch_model(name)
    prompt = torch.randint(3, lm.config.vocab_size, (1, 5),
                           generator=torch.Generator().manual_seed(1))
    n = 24
    with torch.no_grad():
        want = ref.generate(prompt, max_new_tokens=n, min_new_tokens=n, do_sample=False)
    cache = lm.model.new_cache(1, prompt.shape[1] + n)
    out, pos, tok = [], 0, prompt
    with torch.inference_mode():
        for _ in range(n):
            logits = lm.model(tok, pos, cache, last_only=True)[0, -1]
            logits[2] = float("-inf")  # EOS, as min_new_tokens masks it
            out.append(int(logits.argmax()))
            pos += tok.shape[1]
            tok = torch.tensor([[out[-1]]])
    assert out == want[0, prompt.shape[1]:].tolist()
    assert all(b.fused._c is not None for b in lm.model.layers)


@pytest.mark.parametrize("pos", [0, 9, pytest.param(47, marks=pytest.mark.slow)])
def test_float16_cache(isa, threads, pos):
    """Keys and values held as float16 (the default cache where every block is on C): the new
    row is the float32 one a float32 cache gets, rounded to nearest even as torch's ``.half()``,
    the other rows untouched, and the output the float64 reference's over a float16 cache
    (its new row rounded too; large enough for the heads to run on the pool at pos 47)."""
    kw = make(np.random.default_rng(pos + 7), d=1024, nh=8, nkv=2, hd=64, d_ff=256)
    nkv, hd, S = kw["n_kv_heads"], kw["head_dim"], 48
    g = torch.Generator().manual_seed(pos)
    k16, v16 = torch.randn(nkv, S, hd, generator=g).half(), torch.randn(nkv, S, hd, generator=g).half()
    k32, v32 = k16.float(), v16.float()
    kr, vr = k16.clone(), v16.clone()  # the reference writes its new row into float16 too
    x = torch.randn(kw["d_model"], generator=g)
    cos, sin = rope_row(hd, pos)
    want = ref.block_decode_ref(**kw, x=x.clone(), pos=pos, k_cache=kr, v_cache=vr, cos=cos,
                                sin=sin)
    block = cpu.DecodeBlock(**kw)
    before_k, before_v = k16.clone(), v16.clone()
    got, got32 = x.clone(), x.clone()
    block(got, pos, k16, v16, cos, sin)
    block(got32, pos, k32, v32, cos, sin)
    assert torch.equal(k16[:, pos], k32[:, pos].half()) and torch.equal(v16[:, pos], v32[:, pos].half())
    others = [p for p in range(S) if p != pos]
    assert torch.equal(k16[:, others], before_k[:, others])
    assert torch.equal(v16[:, others], before_v[:, others])
    scale = want.abs().max().item()
    torch.testing.assert_close(got, want, rtol=2e-3, atol=2e-3 * scale)
    with pytest.raises(ValueError, match="k and v alike"):
        block(x.clone(), pos, k16, v32, cos, sin)


# (query heads, kv heads, head_dim): the AVX-512 kernel takes up to 3 query heads of a kv head
# a pass where head_dim is a multiple of 16 (groups of 4 = 3 + 1, 3, 1, 7 = 3 + 3 + 1; 64 and
# 256 columns: V in passes of 64, 80: one of 64 and one of 16); 24 is not (one head at a time)
HEADS = [(8, 2, 64), (9, 3, 64), (4, 1, 256), (4, 4, 80), (14, 2, 32), (6, 2, 24)]


@pytest.mark.parametrize("kv", [torch.float32, torch.float16])
@pytest.mark.parametrize("slots,positions", [([2, 0, 3], [5, 99, 0]), ([1, 1, 1, 0], [30, 31, 32, 3]),
                                             ([0], [64])], ids=["apart", "prompt", "one"])
@pytest.mark.parametrize("heads", HEADS[:3], ids=lambda h: "x".join(map(str, h)))
def test_attend_rows_are_each_rows_own_call(isa, threads, kv, slots, positions, heads):
    """``cpu.attend_rows_raw`` (a batched step's rows in one call, their heads in one pool
    dispatch) gives every row the bits of its own ``attend_token`` call, and writes the caches
    alike: rows in their own slots, and a prompt's rows sharing one (increasing positions)."""
    import math

    g = torch.Generator().manual_seed(len(slots) + heads[0])
    (nh, nkv, hd), S, n_slots = heads, 100, 4
    B, width = len(slots), (nh + 2 * nkv) * hd
    qkv = torch.randn(B, width, generator=g)
    kc = torch.randn(n_slots, nkv, S, hd, generator=g).to(kv)
    vc = torch.randn(n_slots, nkv, S, hd, generator=g).to(kv)
    kr, vr = kc.clone(), vc.clone()
    cos, sin = torch.randn(S, hd, generator=g), torch.randn(S, hd, generator=g)
    want = torch.empty(B, nh * hd)
    for t, (slot, pos) in enumerate(zip(slots, positions)):
        cpu.attend_token(qkv[t].clone(), kr[slot], vr[slot], pos, cos[pos].contiguous(),
                         sin[pos].contiguous(), nh, 1 / math.sqrt(hd), want[t])
    got, q = torch.full((B, nh * hd), float("nan")), qkv.clone()
    pos_t, slot_t = torch.tensor(positions, dtype=torch.int32), torch.tensor(slots, dtype=torch.int32)
    cpu.attend_rows_raw(q.data_ptr(), B, width, kc.data_ptr(), vc.data_ptr(),
                        kc.stride(0) * kc.element_size(), kv == torch.float16, pos_t.data_ptr(),
                        slot_t.data_ptr(), cos.data_ptr(), sin.data_ptr(), nh, nkv, hd, S, False,
                        1 / math.sqrt(hd), got.data_ptr())
    assert torch.equal(got, want)
    assert torch.equal(kc, kr) and torch.equal(vc, vr)


@pytest.mark.parametrize("kv", [torch.float32, torch.float16])
@pytest.mark.parametrize("pos", [0, 7, 39, 99])
@pytest.mark.parametrize("interleaved", [False, True])
@pytest.mark.parametrize("heads", HEADS, ids=lambda h: "x".join(map(str, h)))
def test_attend_token_matches_attend_ref(isa, threads, kv, pos, interleaved, heads):
    """``cpu.attend_token`` (a sparse FFN's block's attention in C) against the torch
    reference ``fused.decode.attend_ref``: the same cache contents after the write (float16:
    rounded alike) and the same output to float32 summation order. Positions 0 and 7 run the
    heads on the calling thread; from 31 on (32 x 8 heads x 64 >= 16384) on the pool. Key
    counts 1, 8, 40 and 100: whole blocks of 8 keys and a tail."""
    import math

    from sparseinfer.fused.decode import attend_ref

    g = torch.Generator().manual_seed(pos)
    (nh, nkv, hd), S = heads, 100
    qkv = torch.randn((nh + 2 * nkv) * hd, generator=g)
    kc, vc = torch.randn(nkv, S, hd, generator=g).to(kv), torch.randn(nkv, S, hd, generator=g).to(kv)
    kr, vr = kc.clone(), vc.clone()
    cos, sin = rope_row(hd, pos)
    want = attend_ref(qkv.clone(), kr, vr, pos, cos, sin, nh, nkv, interleaved)
    out = torch.empty(nh * hd)
    cpu.attend_token(qkv.clone(), kc, vc, pos, cos, sin, nh, 1 / math.sqrt(hd), out, interleaved)
    assert torch.equal(kc, kr) and torch.equal(vc, vr)
    torch.testing.assert_close(out, want, rtol=1e-5, atol=1e-5)
