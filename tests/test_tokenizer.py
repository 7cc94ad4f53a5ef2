"""Tokenizer tests, each against an independent reference:

- SmolLM2's GGUF (byte-level BPE, pre-tokenizer 'smollm'): transformers' own GGUF tokenizer.
- A SentencePiece BPE trained here on Austen and written into a tiny GGUF: sentencepiece itself.
- A Hugging Face directory saved by transformers: transformers loading that directory.
- A byte-level BPE with an unknown pre-tokenizer name: `tokenizers` with GPT-2's own splitting.
"""

from __future__ import annotations

import io
import logging
import random
from pathlib import Path

import gguf
import pytest

from conftest import gguf_parsed_once
from sparseinfer.data import DEFAULT_CORPUS, HELDOUT_TEXT, default_model_path
from sparseinfer.errors import ModelFileError, SparseInferError
from sparseinfer.tokenizer import Tokenizer

TEXTS = [
    "",
    "Hello world",
    "Hello, world! How are you doing today?",
    "  two leading spaces and trailing ones   ",
    "tabs\t\tand\nnewlines\n\n\n  indented\r\nwindows",
    "digits 7 42 1234567890123456789 3.14159 1,000,000 2024-05-17",
    "def f(x):\n    return x ** 2  # square\n\nprint(f(3))\n",
    "Café naïve résumé façade Ωμέγα Привет",
    "中文测试，日本語のテキスト、한국어 문장",
    "emoji 😀👍🏽 👨‍👩‍👧 🇫🇷 ✨",
    "don't I'LL we've they'RE",
    "nbsp\u00a0and zero\u200bwidth",
    "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n",
    "text<|endoftext|>more text",
]

CONVERSATIONS = {
    "no_system": [
        {"role": "user", "content": "What is the capital of France?"},
        {"role": "assistant", "content": "Paris."},
        {"role": "user", "content": "And of Italy?"},
    ],
    "system": [
        {"role": "system", "content": "You are terse."},
        {"role": "user", "content": "Hi! 😀"},
        {"role": "assistant", "content": "Hello."},
        {"role": "user", "content": "Count: 1 2 3"},
    ],
}


def _stream(tok: Tokenizer, ids: list[int], skip_special: bool = True) -> list[str]:
    dec = tok.decoder(skip_special=skip_special)
    return [dec.push(i) for i in ids] + [dec.flush()]


# --- SmolLM2 GGUF vs transformers -----------------------------------------------------------------


@pytest.fixture(scope="module")
def smol_reader():
    return gguf.GGUFReader(default_model_path())


@pytest.fixture(scope="module")
def smol(smol_reader):
    return Tokenizer.from_gguf(smol_reader, default_model_path())


@pytest.fixture(scope="module")
def smol_ref():
    transformers = pytest.importorskip("transformers")
    path = default_model_path()
    with gguf_parsed_once():
        return transformers.AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)


@pytest.mark.slow
@pytest.mark.parametrize("text", TEXTS)
def test_smollm2_ids_match_transformers(smol, smol_ref, text):
    assert smol.encode(text) == smol_ref.encode(text, add_special_tokens=False)


@pytest.mark.slow
def test_smollm2_special_text_as_plain_text(smol, smol_ref):
    text = "<|im_start|>user\nhi<|im_end|>"
    ours = smol.encode(text, special=False)
    assert ours == smol_ref.encode(text, add_special_tokens=False, split_special_tokens=True)
    assert smol.bos_id not in ours and smol.eos_id not in ours
    assert smol.encode(text)[0] == smol_ref.convert_tokens_to_ids("<|im_start|>")


@pytest.mark.slow
def test_smollm2_special_ids(smol, smol_ref):
    assert smol.vocab_size == len(smol_ref) == 49152
    assert smol.bos_id == smol_ref.bos_token_id
    assert smol.eos_id == smol_ref.eos_token_id
    assert smol.add_bos is False  # tokenizer.ggml.add_bos_token = false
    im_end, endoftext = smol_ref.convert_tokens_to_ids(["<|im_end|>", "<|endoftext|>"])
    assert {smol.eos_id, im_end, endoftext} <= smol.eos_ids
    assert smol.encode("hi", add_bos=True) == [smol.bos_id, *smol.encode("hi")]
    # BOS already written by a template is not doubled
    assert smol.encode("<|im_start|>hi", add_bos=True).count(smol.bos_id) == 1


@pytest.mark.slow
@pytest.mark.parametrize("text", TEXTS)
def test_smollm2_decode(smol, smol_ref, text):
    ids = smol.encode(text)
    assert smol.decode(ids, skip_special=False) == text
    assert smol.decode(ids) == smol_ref.decode(
        ids, skip_special_tokens=True, clean_up_tokenization_spaces=False
    )


@pytest.mark.slow
def test_smollm2_incremental_decoder_multibyte(smol):
    text = "Smile 😀👍🏽 中文字 done"
    ids = smol.encode(text)
    pieces = _stream(smol, ids)
    assert "".join(pieces) == smol.decode(ids) == text
    assert "" in pieces[:-1]  # an emoji spans several byte-level tokens and is held back
    assert all("\ufffd" not in p for p in pieces)
    assert any("😀" in p for p in pieces)  # released whole once its last byte arrives


@pytest.mark.slow
@pytest.mark.parametrize("text", TEXTS)
def test_smollm2_incremental_decoder_equals_decode(smol, text):
    ids = smol.encode(text)
    for skip in (True, False):
        assert "".join(_stream(smol, ids, skip)) == smol.decode(ids, skip_special=skip)


@pytest.mark.slow
def test_smollm2_incremental_decoder_random_ids(smol):
    rng = random.Random(0)
    for _ in range(200):  # low ids include the raw byte tokens: many invalid UTF-8 sequences
        ids = [rng.randrange(smol.vocab_size) if rng.random() < 0.5 else rng.randrange(300)
               for _ in range(rng.randrange(1, 24))]
        for skip in (True, False):
            assert "".join(_stream(smol, ids, skip)) == smol.decode(ids, skip_special=skip), ids


@pytest.mark.slow
def test_decode_rejects_out_of_range_ids(smol):
    with pytest.raises(SparseInferError, match="out of range"):
        smol.decode([5, smol.vocab_size])


@pytest.mark.slow
@pytest.mark.parametrize("name", sorted(CONVERSATIONS))
def test_smollm2_chat_template_matches_transformers(smol, smol_ref, name):
    messages = CONVERSATIONS[name]
    for gen in (True, False):
        expected = smol_ref.apply_chat_template(messages, tokenize=False, add_generation_prompt=gen)
        assert smol.apply_chat_template(messages, add_generation_prompt=gen) == expected
    if name == "no_system":  # SmolLM2's template inserts its default system prompt
        assert smol.apply_chat_template(messages).startswith("<|im_start|>system\nYou are")


# --- SentencePiece ('llama') vocabulary in a GGUF vs sentencepiece --------------------------------

SPM_TEXTS = [
    "",
    "Emma Woodhouse, handsome, clever, and rich, with a comfortable home",
    "Hello  world   with  runs of spaces ",
    " leading space",
    "tabs\tand\nnewlines\n\nhere",
    "digits 1234567 3.14",
    "naïve café — “quoted” ‘single’ …",
    "中文 and 日本語 need byte fallback",
    "emoji 😀👍🏽",
    "user-defined <tool> inside text",
    "<tool>at the start and glued<tool>x",
]


def _write_gguf(path: Path, **kv) -> None:
    """A GGUF with the given tokenizer metadata and no tensors."""
    writer = gguf.GGUFWriter(str(path), "llama")
    for add, value in kv.items():
        getattr(writer, f"add_{add}")(value)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def _spm_type(sp, i: int) -> gguf.TokenType:
    if sp.is_unknown(i):
        return gguf.TokenType.UNKNOWN
    if sp.is_control(i):
        return gguf.TokenType.CONTROL
    if sp.is_byte(i):
        return gguf.TokenType.BYTE
    if sp.is_unused(i):
        return gguf.TokenType.UNUSED
    return gguf.TokenType.USER_DEFINED if sp.id_to_piece(i) == "<tool>" else gguf.TokenType.NORMAL


@pytest.fixture(scope="module")
def spm(tmp_path_factory):
    """(sentencepiece processor, our Tokenizer from a GGUF holding the same vocabulary)."""
    sentencepiece = pytest.importorskip("sentencepiece")
    text = DEFAULT_CORPUS.read_text(encoding="utf-8")[10_000:40_000]
    proto = io.BytesIO()
    sentencepiece.SentencePieceTrainer.train(  # Llama's settings, byte fallback included
        sentence_iterator=iter([line for line in text.splitlines() if line.strip()]),
        model_writer=proto, vocab_size=500, model_type="bpe", byte_fallback=True,
        normalization_rule_name="identity", remove_extra_whitespaces=False,
        add_dummy_prefix=True, split_digits=True, character_coverage=1.0,
        user_defined_symbols=["<tool>"], minloglevel=2,
    )
    sp = sentencepiece.SentencePieceProcessor(model_proto=proto.getvalue())
    n = sp.get_piece_size()
    path = tmp_path_factory.mktemp("spm") / "spm-vocab.gguf"
    _write_gguf(
        path,
        tokenizer_model="llama",
        token_list=[sp.id_to_piece(i) for i in range(n)],
        token_scores=[sp.get_score(i) for i in range(n)],
        token_types=[_spm_type(sp, i) for i in range(n)],
        bos_token_id=sp.bos_id(),
        eos_token_id=sp.eos_id(),
        unk_token_id=sp.unk_id(),
    )
    return sp, Tokenizer.from_gguf(gguf.GGUFReader(path), path)


@pytest.mark.parametrize("text", SPM_TEXTS)
def test_sentencepiece_ids_match(spm, text):
    sp, tok = spm
    ids = tok.encode(text, add_bos=False)
    assert ids == sp.encode(text)
    assert tok.decode(ids) == sp.decode(ids) == text


def test_sentencepiece_long_passage(spm):
    sp, tok = spm
    passage = HELDOUT_TEXT.read_text(encoding="utf-8")[:8_000]
    assert tok.encode(passage, add_bos=False) == sp.encode(passage)


def test_sentencepiece_byte_fallback_and_special_tokens(spm):
    sp, tok = spm
    assert tok.add_bos is True  # llama.cpp's default for SentencePiece vocabularies
    assert tok.bos_id == sp.bos_id() and tok.eos_ids == {sp.eos_id()}
    ids = tok.encode("中")
    assert ids[0] == tok.bos_id
    assert [sp.id_to_piece(i) for i in ids[1:]] == ["▁", "<0xE4>", "<0xB8>", "<0xAD>"]
    # control-token text is parsed only with special=True; the text after it gets the space prefix
    parsed = tok.encode("<s>Emma", add_bos=False)
    assert parsed == [sp.bos_id(), *sp.encode("Emma")]
    assert tok.encode("<s>Emma", add_bos=False, special=False) == sp.encode("<s>Emma")
    assert tok.decode(parsed) == "Emma"


@pytest.mark.parametrize("text", ["中文 and 😀 mixed", "plain words only", "<s>x</s>"])
def test_sentencepiece_incremental_decoder(spm, text):
    _, tok = spm
    ids = tok.encode(text)
    for skip in (True, False):
        pieces = _stream(tok, ids, skip)
        assert "".join(pieces) == tok.decode(ids, skip_special=skip)
        assert all("\ufffd" not in p for p in pieces)


def test_missing_chat_template_falls_back_to_chatml(spm, caplog):
    _, tok = spm
    assert tok.chat_template is None
    with caplog.at_level(logging.WARNING, logger="sparseinfer.tokenizer"):
        out = tok.apply_chat_template([{"role": "user", "content": "hi"}])
    assert out == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
    assert "no chat template" in caplog.text


# --- Hugging Face directory vs transformers ------------------------------------------------------

RICH_TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}"
    "{% if m['role'] not in ['system', 'user', 'assistant'] %}"
    "{{ raise_exception('unknown role ' + m['role']) }}{% endif %}\n"
    "  [{{ m['role'] | upper }}] {{ m['content'] | trim }}{% if not loop.last %} |{% endif %}\n"
    "{% endfor %}{{ messages | map(attribute='content') | list | tojson }}"
    "{% if add_generation_prompt %}[ASSISTANT]{% endif %}{{ eos_token }}"
)


@pytest.fixture(scope="module")
def hf_dir(smol_ref, tmp_path_factory):
    out = tmp_path_factory.mktemp("hf_tokenizer")
    smol_ref.save_pretrained(out)
    return out


@pytest.mark.slow
def test_hf_dir_matches_transformers(hf_dir):
    transformers = pytest.importorskip("transformers")
    ref = transformers.AutoTokenizer.from_pretrained(hf_dir)
    ours = Tokenizer.from_hf_dir(hf_dir)
    for text in TEXTS:
        assert ours.encode(text) == ref.encode(text), text
    assert (ours.bos_id, ours.eos_id) == (ref.bos_token_id, ref.eos_token_id)
    assert ours.add_bos is False and not getattr(ref, "add_bos_token", False)
    assert ours.chat_template == ref.chat_template
    assert ours.vocab_size == len(ref)
    assert ref.convert_tokens_to_ids("<|im_end|>") in ours.eos_ids
    messages = CONVERSATIONS["system"]
    assert ours.apply_chat_template(messages) == ref.apply_chat_template(
        messages, tokenize=False, add_generation_prompt=True
    )


@pytest.mark.slow
def test_hf_dir_rich_template_and_template_errors(hf_dir, tmp_path):
    transformers = pytest.importorskip("transformers")
    rich = tmp_path / "rich"
    rich.mkdir()
    for name in ("tokenizer.json", "tokenizer_config.json"):
        (rich / name).write_bytes((hf_dir / name).read_bytes())
    (rich / "chat_template.jinja").write_text(RICH_TEMPLATE, encoding="utf-8")
    (rich / "generation_config.json").write_text('{"eos_token_id": [2, 7]}')
    ref = transformers.AutoTokenizer.from_pretrained(rich)
    ours = Tokenizer.from_hf_dir(rich)
    assert 7 in ours.eos_ids
    messages = [*CONVERSATIONS["system"], {"role": "assistant", "content": ' "q" <b>html</b> '}]
    for gen in (True, False):
        assert ours.apply_chat_template(messages, add_generation_prompt=gen) == (
            ref.apply_chat_template(messages, tokenize=False, add_generation_prompt=gen)
        )
    with pytest.raises(SparseInferError, match="unknown role tool"):
        ours.apply_chat_template([{"role": "tool", "content": "x"}])
    (rich / "chat_template.jinja").write_text("{% for m in messages %}{{ m }", encoding="utf-8")
    with pytest.raises(SparseInferError, match="not valid jinja"):
        Tokenizer.from_hf_dir(rich).apply_chat_template(messages)


# --- unknown pre-tokenizer, errors ---------------------------------------------------------------


def test_unknown_pre_tokenizer_warns_and_splits_like_gpt2(tmp_path, caplog):
    from tokenizers import Tokenizer as HFTokenizer
    from tokenizers import models, pre_tokenizers

    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    merges = [("Ġ", "t"), ("h", "e"), ("Ġt", "he"), ("1", "2"), ("Ġ", "1")]
    tokens = [*alphabet, "Ġt", "he", "Ġthe", "12", "Ġ1", "<|endoftext|>"]
    path = tmp_path / "bpe.gguf"
    _write_gguf(
        path, tokenizer_model="gpt2", tokenizer_pre="no-such-pre", token_list=tokens,
        token_types=[gguf.TokenType.NORMAL] * (len(tokens) - 1) + [gguf.TokenType.CONTROL],
        token_merges=[f"{a} {b}" for a, b in merges], eos_token_id=len(tokens) - 1,
    )
    with caplog.at_level(logging.WARNING, logger="sparseinfer.tokenizer"):
        ours = Tokenizer.from_gguf(gguf.GGUFReader(path), path)
    assert "no-such-pre" in caplog.text
    ref = HFTokenizer(models.BPE({t: i for i, t in enumerate(tokens[:-1])}, merges))
    ref.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)  # GPT-2's own regex
    for text in ["the theme 123 12 1212", "  the\n\tthe  ", "x'll the's 12é"]:
        assert ours.encode(text) == ref.encode(text).ids, text
    eot = len(tokens) - 1
    assert ours.encode("the<|endoftext|>")[-1] == eot and ours.eos_ids == {eot}


def test_gguf_without_tokenizer_metadata(tmp_path):
    path = tmp_path / "no-tokenizer.gguf"
    _write_gguf(path, block_count=2)
    with pytest.raises(ModelFileError) as err:
        Tokenizer.from_gguf(gguf.GGUFReader(path), path)
    assert str(path) in str(err.value) and "tokenizer.ggml.model" in str(err.value)


def test_gguf_unknown_tokenizer_model(tmp_path):
    path = tmp_path / "rwkv-vocab.gguf"
    _write_gguf(path, tokenizer_model="rwkv", token_list=["a", "b"])
    with pytest.raises(ModelFileError) as err:
        Tokenizer.from_gguf(gguf.GGUFReader(path), path)
    message = str(err.value)
    assert str(path) in message and "'rwkv'" in message and "'gpt2'" in message


def test_hf_dir_without_tokenizer_json(tmp_path):
    with pytest.raises(ModelFileError, match="tokenizer.json"):
        Tokenizer.from_hf_dir(tmp_path)
