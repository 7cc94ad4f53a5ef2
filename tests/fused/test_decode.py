"""Fused single-token decode kernels against their torch references, and whole models with and
without them (the unfused path is itself compared with transformers in tests/test_model.py)."""

from __future__ import annotations

import pytest
import torch

from sparseinfer.fused.decode import FusedDecode, attend, attend_ref, rms_norm, rms_norm_ref
from sparseinfer.models.model import rope_tables


@pytest.mark.parametrize("d", [8, 576, 1000])
@pytest.mark.parametrize("with_add", [False, True])
def test_rms_norm_matches_reference(d, with_add):
    torch.manual_seed(d)
    x, add, w = torch.randn(d) * 3, torch.randn(d), torch.rand(d) + 0.5
    want_x, want = rms_norm_ref(x, add if with_add else None, w, 1e-5)
    out = torch.empty(d)
    got = rms_norm(x, add if with_add else None, w, 1e-5, out)
    assert got is out
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(x, want_x)  # the residual is updated in place


@pytest.mark.parametrize("nh,nkv,hd", [(4, 4, 16), (9, 3, 64), (8, 2, 32), (6, 1, 8)])
@pytest.mark.parametrize("pos", [0, 1, 37, 200])
@pytest.mark.parametrize("interleaved", [False, True])
def test_attend_matches_reference(nh, nkv, hd, pos, interleaved):
    torch.manual_seed(nh * 1000 + pos)
    S = 256
    cos_t, sin_t = rope_tables(type("C", (), {"head_dim": hd, "rope_theta": 10000.0, "rope_factors": ()})(), S)
    qkv = torch.randn((nh + 2 * nkv) * hd)
    kc, vc = torch.randn(nkv, S, hd), torch.randn(nkv, S, hd)
    kc_ref, vc_ref = kc.clone(), vc.clone()
    want = attend_ref(qkv.clone(), kc_ref, vc_ref, pos, cos_t[pos], sin_t[pos], nh, nkv,
                      interleaved)
    got = attend(qkv.clone(), kc, vc, pos, cos_t[pos], sin_t[pos], nh, nkv, torch.empty(S),
                 torch.empty(nh * hd), interleaved)
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(kc, kc_ref, rtol=1e-5, atol=1e-6)  # the new key, rotated
    torch.testing.assert_close(vc, vc_ref)


def _decode(model, prompt, n):
    cache = model.new_cache(1, 64)
    out = [model(prompt, 0, cache, last_only=True)]
    pos = prompt.shape[1]
    for i in range(n):
        tok = out[-1].argmax(-1)
        out.append(model(tok, pos + i, cache))
    return torch.cat(out, 1)


@pytest.mark.parametrize("kind", ["swiglu", "reglu", "drelu"])
def test_fused_model_equals_torch_path(tiny_model_dir, kind):
    from sparseinfer.models.build import load

    fused = load(tiny_model_dir(kind), "fp32", fused=True).model
    plain = load(tiny_model_dir(kind), "fp32", fused=False).model
    assert all(isinstance(b.fused, FusedDecode) for b in fused.layers)
    assert all(b.fused is None for b in plain.layers)
    prompt = torch.tensor([[1, 7, 3, 9, 4]])
    torch.testing.assert_close(_decode(fused, prompt, 12), _decode(plain, prompt, 12),
                               rtol=1e-4, atol=1e-4)


def test_fused_decode_follows_a_new_cache(tiny_model_dir):
    """The fused block reads the KV cache it is given: a second cache (which may reuse a freed
    one's id) gives the same results as the first."""
    from sparseinfer.models.build import load

    model = load(tiny_model_dir("swiglu"), "fp32", fused=True).model
    prompt = torch.tensor([[1, 7, 3, 9, 4]])
    first = _decode(model, prompt, 6)
    for _ in range(3):  # freed caches: new ones may land at the same address
        again = _decode(model, prompt, 6)
        torch.testing.assert_close(again, first)


def test_fused_decode_declines_other_models(tiny_model_dir):
    from sparseinfer.models.build import load

    assert load(tiny_model_dir("opt"), "fp32", fused=True).plan.fused_decode is False
    assert load(tiny_model_dir("swiglu"), "bf16", fused=True).plan.fused_decode is False


def test_interleaved_rope_equals_rotate_half_on_permuted_rows():
    """Rope over adjacent pairs on llama.cpp-permuted rows equals rotate-half rope on the
    original rows, up to the same permutation of the head dimension (which attention scores
    do not see)."""
    from sparseinfer.models.loading import permute_qk
    from sparseinfer.models.model import apply_rope

    torch.manual_seed(0)
    nh, hd, T = 3, 16, 5
    cos, sin = rope_tables(type("C", (), {"head_dim": hd, "rope_theta": 10000.0, "rope_factors": ()})(), T)
    x = torch.randn(1, nh, T, hd)
    perm = permute_qk(torch.arange(nh * hd), nh).view(nh, hd) % hd  # per-head dim order
    xp = torch.stack([x[:, h, :, perm[h]] for h in range(nh)], dim=1)
    want = apply_rope(x, cos, sin)
    got = apply_rope(xp, cos, sin, interleaved=True)
    wantp = torch.stack([want[:, h, :, perm[h]] for h in range(nh)], dim=1)
    torch.testing.assert_close(got, wantp)
