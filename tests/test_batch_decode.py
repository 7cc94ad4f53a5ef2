"""models/batch.py: one decode step over several sequences (each at its own position in its own
cache slot) against transformers' logits for each whole sequence."""

from __future__ import annotations

import pytest
import torch

from conftest import tiny_hf_model
from sparseinfer.models.batch import decode_step, slot_cache
from sparseinfer.models.loading import load_model


@pytest.mark.parametrize("kind", ["swiglu", "opt"])
@pytest.mark.parametrize("slots", [[0, 1, 2], [3, 0, 2], [1]])
def test_decode_step_matches_transformers(tiny_model_dir, kind, slots):
    lm = load_model(tiny_model_dir(kind))
    ref = tiny_hf_model(kind)
    gen = torch.Generator().manual_seed(len(slots))
    lengths = [5, 17, 1][: len(slots)]
    seqs = [torch.randint(3, lm.config.vocab_size, (n + 2,), generator=gen).tolist()
            for n in lengths]
    cache = lm.model.new_cache(4, 64)
    with torch.inference_mode():
        for seq, slot in zip(seqs, slots):  # prompts of different lengths into their slots
            lm.model(torch.tensor([seq[:-2]]), 0, slot_cache(cache, slot))
        for step in (2, 1):  # two decode steps: every row at its own position
            tokens = torch.tensor([s[-step] for s in seqs])
            positions = torch.tensor([len(s) - step for s in seqs])
            got = decode_step(lm.model, tokens, positions, cache, torch.tensor(slots))
            for row, seq in enumerate(seqs):
                with torch.no_grad():
                    want = ref(torch.tensor([seq[: len(seq) - step + 1]])).logits[0, -1]
                err = float((got[row] - want).abs().max() / want.abs().max())
                assert err < 1e-4, (kind, slots, row, step, err)


def test_slot_cache_checks_the_slot(tiny_model_dir):
    lm = load_model(tiny_model_dir("swiglu"))
    cache = lm.model.new_cache(2, 8)
    with pytest.raises(ValueError, match="slot"):
        slot_cache(cache, 2)


@pytest.mark.parametrize("kv", [torch.float32, torch.float16], ids=["fp32", "fp16"])
@pytest.mark.parametrize("slots,positions", [([0, 1, 2], [4, 11, 0]), ([3, 0, 2], [4, 11, 0]),
                                             ([1, 1, 1, 3], [4, 5, 6, 9])])
def test_fused_attend_rows_matches_reference(tiny_model_dir, slots, positions, kv):
    """The per-row attention kernel (numba's for a float32 cache, the C library's for a float16
    one) against the torch ``Attention.attend_rows``: the same keys and values written, the
    same outputs; rows alone in their slots and a prompt's rows sharing one."""
    from sparseinfer.fused.decode import attend_rows, supports
    from sparseinfer.models.model import KVCache, Rows

    lm = load_model(tiny_model_dir("swiglu"))
    assert supports(lm.model)
    cfg = lm.config
    gen = torch.Generator().manual_seed(7)
    width = (cfg.n_heads + 2 * cfg.n_kv_heads) * cfg.head_dim
    lm.model.new_cache(1, 32)  # rope tables for 32 positions
    caches = [KVCache(cfg, 4, 32, kv) for _ in range(2)]
    caches[0].k.copy_(torch.randn(caches[0].k.shape, generator=gen))
    caches[0].v.copy_(torch.randn(caches[0].v.shape, generator=gen))
    caches[1].k.copy_(caches[0].k)  # the same contents in both
    caches[1].v.copy_(caches[0].v)
    qkv = torch.randn(len(slots), width, generator=gen)
    rows = Rows(torch.tensor(positions), torch.tensor(slots))
    attn = lm.model.layers[1].attn
    assert attn.plain(1)
    want = attn.attend_rows(qkv.clone(), 1, rows, caches[0], lm.model.rope)
    got = attend_rows(cfg, 1, qkv.clone(), rows, caches[1], lm.model.rope)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(caches[1].k, caches[0].k, atol=1e-6, rtol=0)  # the same writes
    torch.testing.assert_close(caches[1].v, caches[0].v, atol=1e-6, rtol=0)


def prompts_in_slots(model, prompts, slots, n_slots, max_seq):
    """A batch cache of ``n_slots`` with each prompt prefilled into its slot, and for each prompt
    a cache of its own holding it alone."""
    cache = model.new_cache(n_slots, max_seq)
    alone = [model.new_cache(1, max_seq) for _ in prompts]
    with torch.inference_mode():
        for prompt, slot, own in zip(prompts, slots, alone):
            model(torch.tensor([prompt]), 0, slot_cache(cache, slot))
            model(torch.tensor([prompt]), 0, own)
    return cache, alone


# every architecture of the model file (q/k norms, windows, soft-capping, custom scales,
# post-norms, parallel blocks, learned positions with post-norm blocks, tied heads)
ARCHS = ["qwen2", "qwen3", "llama3", "mistral", "phi3", "falcon", "falcon40", "opt350m",
         "gemma2", "gemma3"]


@pytest.mark.parametrize("name", ARCHS)
@pytest.mark.parametrize("kernel", [False, True])
def test_decode_step_equals_each_sequence_alone(arch_model_dir, name, kernel):
    """One step over three sequences at different positions (some past an 8-token window) gives
    each row the logits of that sequence decoded alone through ``Transformer.forward``."""
    from sparseinfer.fused.decode import attend_rows, supports

    lm = load_model(arch_model_dir(name))
    model = lm.model
    if kernel and not supports(model):
        pytest.skip(f"{name}: no fused per-row kernel (not an fp32 RMSNorm/RoPE model)")
    gen = torch.Generator().manual_seed(3)
    lengths, slots = [3, 12, 20], [2, 0, 1]
    seqs = [torch.randint(3, lm.config.vocab_size, (n + 2,), generator=gen).tolist()
            for n in lengths]
    # where the plan fuses the single-token decode, every block runs the rows in one C call
    # (cpu.DecodeBlock.rows), else the block's torch code with the per-row attention ``kernel``
    c_rows = [b.fused is not None and b.fused.takes_rows(i) for i, b in enumerate(model.layers)]
    assert all(c_rows) == lm.plan.fused_decode and len(set(c_rows)) == 1, (name, c_rows)
    cache, alone = prompts_in_slots(model, [s[:-2] for s in seqs], slots, 3, 32)
    with torch.inference_mode():
        for step in (2, 1):
            tokens = torch.tensor([s[-step] for s in seqs])
            positions = torch.tensor([len(s) - step for s in seqs])
            got = decode_step(model, tokens, positions, cache, torch.tensor(slots),
                              attend_rows if kernel else None)
            for row, (seq, own) in enumerate(zip(seqs, alone)):
                pos = len(seq) - step
                want = model(torch.tensor([[seq[pos]]]), pos, own)[0, -1]
                err = float((got[row] - want).abs().max() / want.abs().max())
                assert err < 1e-4, (name, row, step, err)


def test_smollm2_rows_equal_each_sequence_alone(smollm2_path):
    """The real Q4_1 file on the C kernels: a step over four sequences (each block one
    ``DecodeBlock.rows`` call, the head one GEMM) gives every row the logits of its sequence
    decoded alone on the single-token path, bit for bit: the GEMM rows are their GEMVs', so a
    sequence's tokens do not depend on what else is in the batch."""
    from sparseinfer.fused.decode import attend_rows
    from sparseinfer.models.build import load

    model = load(smollm2_path, "auto", fused=True).model
    assert all(b.fused.takes_rows(i) for i, b in enumerate(model.layers))
    gen = torch.Generator().manual_seed(5)
    lengths, slots = [4, 9, 1, 30], [3, 0, 2, 1]
    seqs = [torch.randint(3, 40000, (n + 1,), generator=gen).tolist() for n in lengths]
    cache, alone = prompts_in_slots(model, [s[:-1] for s in seqs], slots, 4, 48)
    with torch.inference_mode():
        tokens = torch.tensor([s[-1] for s in seqs])
        positions = torch.tensor([len(s) - 1 for s in seqs])
        got = decode_step(model, tokens, positions, cache, torch.tensor(slots), attend_rows)
        for row, (seq, own) in enumerate(zip(seqs, alone)):
            want = model(torch.tensor([[seq[-1]]]), len(seq) - 1, own)[0, -1]
            assert torch.equal(got[row], want), row


def test_smollm2_prompt_equals_its_tokens_one_by_one(smollm2_path):
    """A prompt run in one forward on a fused-stack model (``Transformer._prompt_rows``: its
    tokens as rows, here 70 of them, two C calls of at most 64) leaves the cache and gives the
    last logits that feeding the tokens one at a time does, bit for bit."""
    from sparseinfer.models.build import load

    model = load(smollm2_path, "auto", fused=True).model
    ids = torch.randint(3, 40000, (70,), generator=torch.Generator().manual_seed(7))
    together, alone = model.new_cache(1, 96), model.new_cache(1, 96)
    with torch.inference_mode():
        got = model(ids.view(1, -1), 0, together, last_only=True)[0, -1]
        for pos, tok in enumerate(ids.tolist()):
            want = model(torch.tensor([[tok]]), pos, alone)[0, -1]
    assert torch.equal(got, want)
    assert torch.equal(together.k, alone.k) and torch.equal(together.v, alone.v)


@pytest.mark.parametrize("name", ["llama3", "qwen3", "gemma3", "mistral"])
def test_fused_stack_equals_the_blocks_one_by_one(arch_model_dir, name):
    """``Transformer.blocks`` runs a model whose blocks are all on the C library as one C call
    (``fused.decode.FusedStack``): a single token and a step of several sequences give exactly
    what calling the blocks one by one gives (Gemma 3: windowed layers with their own rope
    tables; Mistral: a window)."""
    from sparseinfer.fused.decode import FusedStack
    from sparseinfer.models.build import load
    from sparseinfer.models.model import Rows

    model = load(arch_model_dir(name), "fp32", fused=True).model
    assert isinstance(model._fused_stack(), FusedStack), name

    def one_by_one(x, pos, cache):
        for i, block in enumerate(model.layers):
            x = block(x, i, pos, cache, model.rope_of(i))
        return x

    gen = torch.Generator().manual_seed(2)
    D = model.cfg.d_model
    with torch.inference_mode():
        for B, positions in ((1, None), (3, [4, 11, 0])):
            ca, cb = model.new_cache(B, 32), model.new_cache(B, 32)
            cb.k.copy_(ca.k.normal_(generator=gen))
            cb.v.copy_(ca.v.normal_(generator=gen))
            x = torch.randn(B, 1, D, generator=gen)
            pos = 13 if positions is None else Rows(torch.tensor(positions),
                                                    torch.tensor([2, 0, 1]))
            got = model._fused_stack()(x, pos, ca)
            want = one_by_one(x, pos, cb)
            assert torch.equal(got, want) and torch.equal(ca.k, cb.k) and torch.equal(ca.v, cb.v)
