"""Text ⇄ token ids, and chat prompts, for a model from a GGUF file or a Hugging Face directory.

The work is done by the `tokenizers` library; this module only assembles a `tokenizers.Tokenizer`
from what the model file says:

- GGUF ``tokenizer.ggml.model == "gpt2"``: byte-level BPE with the file's merges, split first by
  the regexes that ``tokenizer.ggml.pre`` names (:data:`PRE_TOKENIZERS`, as llama.cpp does).
- GGUF ``tokenizer.ggml.model == "llama"``: a SentencePiece vocabulary with scores. It becomes a
  BPE with byte fallback whose merges are recovered from the scores (the highest-scoring merged
  piece first, as SentencePiece's BPE encoder picks them), with ``▁`` for spaces and an optional
  leading ``▁`` (``tokenizer.ggml.add_space_prefix``).
- A ``tokenizer.json`` (plus ``tokenizer_config.json`` and ``generation_config.json``).

Control, unknown and user-defined tokens are registered as added tokens, so their text
(``<|im_start|>``) maps to their id. Chat templates are rendered with jinja2 in the same sandbox
and with the same helpers as ``transformers``.
"""

from __future__ import annotations

import json
import logging
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path
from typing import TYPE_CHECKING, Any

import jinja2
import jinja2.ext
import jinja2.sandbox
import numpy as np
from gguf import Keys, TokenType
from tokenizers import AddedToken, Regex, decoders, models, normalizers, pre_tokenizers
from tokenizers import Tokenizer as _Backend

from .errors import ModelFileError, SparseInferError

if TYPE_CHECKING:
    import gguf

logger = logging.getLogger(__name__)

__all__ = ["CHATML_TEMPLATE", "PRE_TOKENIZERS", "IncrementalDecoder", "Tokenizer"]

SPIECE_UNDERLINE = "\u2581"  # SentencePiece's visible space

# --- pre-tokenizers of byte-level BPE vocabularies, by `tokenizer.ggml.pre` -----------------------

_GPT2_SPLIT = r"""'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"""
_LLAMA3_SPLIT = (
    r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"""
    r"""| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"""
)
_QWEN2_SPLIT = (
    r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"""
    r"""| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"""
)
_TEKKEN_SPLIT = (
    r"""[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+"""
    r"""|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*"""
    r"""|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+"""
)
_GPT4O_SPLIT = (
    r"""[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+"""
    r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)?"""
    r"""|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*"""
    r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)?"""
    r"""|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+"""
)


@dataclass(frozen=True)
class PreTokenizer:
    """How a byte-level BPE vocabulary cuts text into words before merging.

    ``splits`` are applied in order, each isolating its matches (llama.cpp's ``regex_exprs``).
    ``ignore_merges``: a word that is itself a token is taken whole (Llama 3's tokenizer.json).
    ``add_bos``: the default when the file has no ``tokenizer.ggml.add_bos_token``.
    """

    splits: tuple[str, ...]
    ignore_merges: bool = False
    add_bos: bool = False


_GPT2 = PreTokenizer((_GPT2_SPLIT,))
_DIGITS_THEN_GPT2 = PreTokenizer((r"\p{N}", _GPT2_SPLIT))  # StarCoder-style: single digits
_LLAMA3 = PreTokenizer((_LLAMA3_SPLIT,), ignore_merges=True, add_bos=True)
_QWEN2 = PreTokenizer((_QWEN2_SPLIT,))

PRE_TOKENIZERS: dict[str, PreTokenizer] = {
    "default": _GPT2,
    "gpt2": _GPT2,
    "gpt-2": _GPT2,
    "phi-2": _GPT2,
    "mpt": _GPT2,
    "olmo": _GPT2,
    "jais": _GPT2,
    "exaone4": _GPT2,
    "smollm": _DIGITS_THEN_GPT2,
    "starcoder": _DIGITS_THEN_GPT2,
    "refact": _DIGITS_THEN_GPT2,
    "command-r": _DIGITS_THEN_GPT2,
    "codeshell": _DIGITS_THEN_GPT2,
    "exaone": _DIGITS_THEN_GPT2,
    "minerva-7b": _DIGITS_THEN_GPT2,
    "llama3": _LLAMA3,
    "llama-v3": _LLAMA3,
    "llama-bpe": _LLAMA3,
    "falcon3": _LLAMA3,
    "falcon-h1": _LLAMA3,
    "pixtral": _LLAMA3,
    "lfm2": _LLAMA3,
    "dbrx": PreTokenizer((_LLAMA3_SPLIT,)),
    "smaug-bpe": PreTokenizer((_LLAMA3_SPLIT,)),
    "chatglm-bpe": PreTokenizer((_LLAMA3_SPLIT,)),
    "glm4": PreTokenizer((_LLAMA3_SPLIT,)),
    "qwen2": _QWEN2,
    "deepseek-r1-qwen": _QWEN2,
    "megrez": _QWEN2,
    "stablelm2": _QWEN2,
    "tekken": PreTokenizer((_TEKKEN_SPLIT,), ignore_merges=True, add_bos=True),
    "gpt-4o": PreTokenizer((_GPT4O_SPLIT,)),
    "llama4": PreTokenizer((_GPT4O_SPLIT,)),
}

# Tokens that end a turn in common chat formats; any present in the vocabulary joins `eos_ids`
# (llama.cpp's end-of-generation list).
END_OF_TURN_TEXTS = frozenset(
    {
        "<|eot_id|>",
        "<|eom_id|>",
        "<|im_end|>",
        "<|end|>",
        "<end_of_turn>",
        "<|endoftext|>",
        "<|end_of_text|>",
        "<EOT>",
        "_<EOT>",
        "<｜end▁of▁sentence｜>",
        "<end_of_utterance>",
    }
)

# Used, with a warning, when a model carries no chat template.
CHATML_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)

_SPECIAL_TYPES = (TokenType.CONTROL, TokenType.UNKNOWN)

# Tokens a chat template can name (`{{ bos_token }}`), and where each file type gives them.
_GGUF_NAMED_TOKENS = {
    "bos_token": Keys.Tokenizer.BOS_ID,
    "eos_token": Keys.Tokenizer.EOS_ID,
    "unk_token": Keys.Tokenizer.UNK_ID,
    "pad_token": Keys.Tokenizer.PAD_ID,
}
_HF_NAMED_TOKENS = tuple(_GGUF_NAMED_TOKENS)  # keys of tokenizer_config.json


# what apply_chat_template itself gives a template (template_kwargs may not set these)
TEMPLATE_VARIABLES = ("messages", "add_generation_prompt", "tools", "documents")


class Tokenizer:
    """Encode, decode and render chat prompts the way the model expects.

    Build one with :meth:`from_gguf` or :meth:`from_hf_dir`.
    """

    def __init__(
        self,
        backend: _Backend,
        *,
        vocab_size: int,
        bos_id: int | None,
        eos_id: int | None,
        eos_ids: frozenset[int],
        add_bos: bool,
        chat_template: str | None,
        source: str,
        template_tokens: Mapping[str, str | None] | None = None,
        space_prefix: _SpacePrefix | None = None,
    ) -> None:
        self._backend = backend
        self._space_prefix = space_prefix
        if template_tokens is None:  # what a chat template sees as bos_token, eos_token...
            named = {"bos_token": bos_id, "eos_token": eos_id}
            template_tokens = {k: backend.id_to_token(i) for k, i in named.items() if i is not None}
        self._template_tokens = {k: v for k, v in template_tokens.items() if v is not None}
        self._plain_backend: _Backend | None = None  # special-token text kept as text; lazy
        self.vocab_size = vocab_size
        self.bos_id = bos_id
        self.eos_id = eos_id
        self.eos_ids = eos_ids
        self.add_bos = add_bos
        self.chat_template = chat_template
        self.source = source
        self._compiled_template: jinja2.Template | None = None

    def __repr__(self) -> str:
        return (
            f"Tokenizer(source={self.source!r}, vocab_size={self.vocab_size}, "
            f"bos_id={self.bos_id}, eos_ids={sorted(self.eos_ids)}, add_bos={self.add_bos})"
        )

    # --- construction -------------------------------------------------------------------------

    @classmethod
    def from_gguf(cls, reader: gguf.GGUFReader, path: str | Path) -> Tokenizer:
        """The tokenizer described by a GGUF file's ``tokenizer.*`` metadata.

        ``reader`` is already open; ``path`` names the file in messages.
        """
        meta = _GGUFMetadata(reader, str(path))
        model = meta.get(Keys.Tokenizer.MODEL)
        if model is None:
            raise ModelFileError(
                f"{path}: no tokenizer in the GGUF metadata: expected key "
                f"{Keys.Tokenizer.MODEL!r} (and {Keys.Tokenizer.LIST!r}), found none"
            )
        builder = _GGUF_BUILDERS.get(model)
        if builder is None:
            raise ModelFileError(
                f"{path}: unsupported tokenizer {Keys.Tokenizer.MODEL} = {model!r}; "
                f"expected one of {sorted(_GGUF_BUILDERS)}"
            )
        tokens = meta.require(Keys.Tokenizer.LIST)
        tokens = [t if t else f"[EMPTY_{i}]" for i, t in enumerate(tokens)]
        types = meta.get(Keys.Tokenizer.TOKEN_TYPE) or [int(TokenType.NORMAL)] * len(tokens)
        if len(types) != len(tokens):
            raise ModelFileError(
                f"{path}: {Keys.Tokenizer.TOKEN_TYPE} has {len(types)} entries, expected one per "
                f"token ({len(tokens)})"
            )
        backend, default_add_bos, space_prefix = builder(meta, tokens, types)
        _register_added_tokens(backend, tokens, types, meta.path)

        named = {name: meta.token_id(key, len(tokens)) for name, key in _GGUF_NAMED_TOKENS.items()}
        bos_id, eos_id = named["bos_token"], named["eos_token"]
        eos_ids = {i for i in (eos_id,) if i is not None}
        for key in (Keys.Tokenizer.EOT_ID, Keys.Tokenizer.EOM_ID):
            if (i := meta.token_id(key, len(tokens))) is not None:
                eos_ids.add(i)
        eos_ids.update(i for i, t in enumerate(tokens) if t in END_OF_TURN_TEXTS)
        add_bos = meta.get(Keys.Tokenizer.ADD_BOS)
        tokenizer = cls(
            backend,
            vocab_size=len(tokens),
            bos_id=bos_id,
            eos_id=eos_id,
            eos_ids=frozenset(eos_ids),
            add_bos=default_add_bos if add_bos is None else bool(add_bos),
            chat_template=meta.get(Keys.Tokenizer.CHAT_TEMPLATE),
            source=str(path),
            template_tokens={n: tokens[i] for n, i in named.items() if i is not None},
            space_prefix=space_prefix,
        )
        logger.debug("tokenizer from %s: %r", path, tokenizer)
        return tokenizer

    @classmethod
    def from_hf_dir(cls, path: str | Path) -> Tokenizer:
        """The tokenizer of a Hugging Face model directory.

        Reads ``tokenizer.json``; ``tokenizer_config.json`` for the BOS/EOS tokens,
        ``add_bos_token`` and the chat template (or ``chat_template.jinja``);
        ``generation_config.json`` and ``config.json`` for further end-of-generation ids.
        """
        root = Path(path)
        tokenizer_file = root / "tokenizer.json"
        if not tokenizer_file.is_file():
            raise ModelFileError(f"{root}: expected a tokenizer.json in this directory, found none")
        try:
            backend = _Backend.from_file(str(tokenizer_file))
        except Exception as e:
            raise ModelFileError(f"{tokenizer_file}: not a valid tokenizer.json: {e}") from e
        config = _read_json(root / "tokenizer_config.json")
        generation = _read_json(root / "generation_config.json")
        model_config = _read_json(root / "config.json")

        named = {name: _token_content(config.get(name)) for name in _HF_NAMED_TOKENS}

        def token_id(name: str) -> int | None:
            text = named[name]
            if text is not None:
                found = backend.token_to_id(text)
                if found is None:
                    logger.warning(
                        "%s: %s %r is not in the vocabulary of %s; ignoring it",
                        root / "tokenizer_config.json", name, text, tokenizer_file,
                    )
                return found
            for source in (generation, model_config):
                value = source.get(f"{name}_id")
                if isinstance(value, list):
                    value = value[0] if value else None
                if isinstance(value, int):
                    return value
            return None

        bos_id, eos_id = token_id("bos_token"), token_id("eos_token")
        size = backend.get_vocab_size(with_added_tokens=True)
        eos_ids = _end_of_turn_ids(backend) | {i for i in (eos_id,) if i is not None}
        for source in (generation, model_config):
            value = source.get("eos_token_id")
            listed = value if isinstance(value, list) else [value]
            eos_ids.update(i for i in listed if isinstance(i, int) and 0 <= i < size)
        for name, i in (("bos_token", bos_id), ("eos_token", eos_id)):
            if named[name] is None and i is not None:
                named[name] = backend.id_to_token(i)
        add_bos = config.get("add_bos_token")
        if not isinstance(add_bos, bool):
            add_bos = _post_processor_adds(backend, bos_id)
        tokenizer = cls(
            backend,
            vocab_size=size,
            bos_id=bos_id,
            eos_id=eos_id,
            eos_ids=frozenset(eos_ids),
            add_bos=add_bos,
            chat_template=_hf_chat_template(root, config),
            source=str(root),
            template_tokens=named,
        )
        logger.debug("tokenizer from %s: %r", root, tokenizer)
        return tokenizer

    # --- text <-> ids -------------------------------------------------------------------------

    def encode(self, text: str, add_bos: bool | None = None, special: bool = True) -> list[int]:
        """Token ids of ``text``.

        ``add_bos``: prepend BOS (default: :attr:`add_bos`); it is not doubled when the text already
        starts with the BOS token (as chat templates often write it). ``special``: text such as
        ``"<|im_start|>"`` becomes that special token's id; with False it is tokenized as text.
        """
        if not isinstance(text, str):
            raise SparseInferError(f"encode expects a str, got {type(text).__name__}")
        backend = self._backend if special else self._plain()
        if self._space_prefix is not None:
            text = self._space_prefix(text, special)
        ids = backend.encode(text, add_special_tokens=False).ids
        if (self.add_bos if add_bos is None else add_bos) and self.bos_id is not None:
            if not ids or ids[0] != self.bos_id:
                ids.insert(0, self.bos_id)
        return ids

    def decode(self, ids: Sequence[int], skip_special: bool = True) -> str:
        """The text of ``ids``; special tokens (BOS, ``<|im_end|>``...) are dropped unless asked."""
        ids = [int(i) for i in ids]
        if ids and (min(ids) < 0 or max(ids) >= self.vocab_size):
            bad = next(i for i in ids if not 0 <= i < self.vocab_size)
            raise SparseInferError(
                f"token id {bad} is out of range for the tokenizer of {self.source} "
                f"(vocabulary of {self.vocab_size})"
            )
        return self._backend.decode(ids, skip_special_tokens=skip_special)

    def decoder(self, skip_special: bool = True) -> IncrementalDecoder:
        """A decoder for a stream of generated ids (text is released only once it is complete)."""
        return IncrementalDecoder(self, skip_special=skip_special)

    def backend_json(self) -> str:
        """This tokenizer as ``tokenizers`` JSON (what grammar libraries build their vocab from)."""
        return self._backend.to_str()

    def token_text(self, token_id: int) -> str | None:
        """The vocabulary spelling of one id (``Ġthe``, ``▁the``, ``<0x0A>``), for debugging."""
        return self._backend.id_to_token(int(token_id))

    def _plain(self) -> _Backend:
        if self._plain_backend is None:
            plain = _Backend.from_str(self._backend.to_str())
            plain.encode_special_tokens = True
            self._plain_backend = plain
        return self._plain_backend

    # --- chat ---------------------------------------------------------------------------------

    def apply_chat_template(
        self,
        messages: list[dict[str, str]],
        add_generation_prompt: bool = True,
        template_kwargs: Mapping[str, Any] | None = None,
    ) -> str:
        """The prompt text for a conversation, rendered with the model's chat template.

        ``messages`` are ``{"role": ..., "content": ...}`` dicts. Without a template in the model,
        ChatML is used (with a warning). ``template_kwargs`` are more variables for the template
        (llama.cpp's ``chat_template_kwargs``, transformers' keyword arguments), e.g.
        ``{"enable_thinking": False}`` for Qwen3.
        """
        if isinstance(messages, str) or not isinstance(messages, Sequence) or not all(
            isinstance(m, Mapping) for m in messages
        ):
            raise SparseInferError(
                "apply_chat_template expects a list of {'role': ..., 'content': ...} dicts, "
                f"got {type(messages).__name__}"
            )
        extra = dict(template_kwargs or {})
        taken = sorted(set(extra) & set(TEMPLATE_VARIABLES))
        if taken:
            raise SparseInferError(
                f"chat template variables: expected names other than "
                f"{', '.join(TEMPLATE_VARIABLES)}, got {', '.join(taken)}"
            )
        template = self._template()
        try:
            return template.render(
                messages=[dict(m) for m in messages],
                add_generation_prompt=add_generation_prompt,
                tools=None,
                documents=None,
                **{**self._template_tokens, **extra},
            )
        except (jinja2.TemplateError, TypeError, ValueError, LookupError, AttributeError) as e:
            raise SparseInferError(
                f"the chat template of {self.source} failed on these messages: "
                f"{type(e).__name__}: {e}"
            ) from e

    def _template(self) -> jinja2.Template:
        if self._compiled_template is None:
            source = self.chat_template
            if source is None:
                logger.warning(
                    "%s has no chat template; using ChatML (<|im_start|>role ... <|im_end|>)",
                    self.source,
                )
                source = CHATML_TEMPLATE
            try:
                self._compiled_template = _jinja_environment().from_string(source)
            except jinja2.TemplateError as e:
                raise SparseInferError(
                    f"the chat template of {self.source} is not valid jinja: {e}"
                ) from e
        return self._compiled_template


class IncrementalDecoder:
    """Turns generated ids into text as they arrive.

    A token may end inside a UTF-8 character (byte-level BPE, or SentencePiece byte fallback);
    its text is held back until a later token completes it. Every push decodes a short window of
    recent ids and releases what it adds to the text already released, so the concatenation of all
    pushes plus :meth:`flush` equals ``tokenizer.decode(all_ids)``.
    """

    def __init__(self, tokenizer: Tokenizer, skip_special: bool = True) -> None:
        self._tokenizer = tokenizer
        self._skip_special = skip_special
        self._ids: list[int] = []  # the window still decoded: released context + pending ids
        self._read = 0  # ids before this index are released

    def push(self, token_id: int) -> str:
        """The text that became final with this token ("" while a character is incomplete)."""
        self._ids.append(int(token_id))
        return self._release(final=False)

    def flush(self) -> str:
        """Whatever is still held back (an incomplete character decodes as U+FFFD)."""
        return self._release(final=True)

    def _release(self, final: bool) -> str:
        # Decoding the last released ids together with the pending ones keeps what depends on
        # context (a SentencePiece leading space, bytes of one character) the same as in decode().
        released = self._tokenizer.decode(self._ids[: self._read], self._skip_special)
        text = self._tokenizer.decode(self._ids, self._skip_special)
        if not final and (len(text) <= len(released) or text.endswith("\ufffd")):
            return ""
        del self._ids[: self._read]  # the just-released ids are the next window's context
        self._read = len(self._ids)
        return text[len(released) :]


# --- GGUF metadata ----------------------------------------------------------------------------


class _GGUFMetadata:
    """Typed access to a GGUF reader's fields, with errors that name the file."""

    def __init__(self, reader: gguf.GGUFReader, path: str) -> None:
        self.reader = reader
        self.path = path

    def get(self, key: str) -> Any:
        field = self.reader.fields.get(key)
        if field is None:
            return None
        try:
            return field.contents()
        except (UnicodeDecodeError, ValueError, IndexError) as e:
            raise ModelFileError(f"{self.path}: cannot read metadata {key!r}: {e}") from e

    def require(self, key: str) -> Any:
        value = self.get(key)
        if value is None:
            raise ModelFileError(f"{self.path}: expected metadata key {key!r}, found none")
        return value

    def token_id(self, key: str, vocab_size: int) -> int | None:
        value = self.get(key)
        if value is None:
            return None
        if not 0 <= int(value) < vocab_size:
            logger.warning(
                "%s: %s = %s is outside the vocabulary (%d tokens); ignoring it",
                self.path, key, value, vocab_size,
            )
            return None
        return int(value)


class _SpacePrefix:
    """SentencePiece's dummy prefix: a space in front of the text, and (as llama.cpp does) in front
    of each stretch of text that follows a control token when those are parsed (``<s>[INST]``
    becomes ``<s>``, ``▁[INST]``). User-defined tokens do not start a new stretch: SentencePiece
    matches them inside the prefixed text."""

    def __init__(self, control_tokens: Sequence[str]) -> None:
        longest_first = sorted(set(control_tokens), key=len, reverse=True)
        self._control = (
            re.compile("|".join(map(re.escape, longest_first))) if longest_first else None
        )

    def __call__(self, text: str, special: bool) -> str:
        if not special or self._control is None:
            return " " + text if text else text
        pieces, start = [], 0
        for match in self._control.finditer(text):
            if match.start() > start:
                pieces.append(" " + text[start : match.start()])
            pieces.append(match.group())
            start = match.end()
        if start < len(text):
            pieces.append(" " + text[start:])
        return "".join(pieces)


_Built = tuple[_Backend, bool, "_SpacePrefix | None"]  # backend, default add_bos, space prefix


def _byte_level_bpe(meta: _GGUFMetadata, tokens: list[str], types: list[int]) -> _Built:
    """``tokenizer.ggml.model == "gpt2"``: byte-level BPE with the file's merges."""
    pre_name = meta.get(Keys.Tokenizer.PRE) or "default"
    pre = PRE_TOKENIZERS.get(pre_name)
    if pre is None:
        logger.warning(
            "%s: unknown pre-tokenizer %s = %r; splitting words like GPT-2 (token ids may differ "
            "from the model's own tokenizer)",
            meta.path, Keys.Tokenizer.PRE, pre_name,
        )
        pre = _GPT2
    merges = []
    for i, merge in enumerate(meta.require(Keys.Tokenizer.MERGES)):
        cut = merge.find(" ", 1)
        if cut < 0:
            raise ModelFileError(
                f"{meta.path}: {Keys.Tokenizer.MERGES}[{i}] = {merge!r}; expected two tokens "
                "separated by a space"
            )
        merges.append((merge[:cut], merge[cut + 1 :]))
    vocab = {token: i for i, token in enumerate(tokens)}
    try:
        model = models.BPE(vocab=vocab, merges=merges, ignore_merges=pre.ignore_merges)
    except Exception as e:
        raise ModelFileError(f"{meta.path}: the BPE merges do not fit the vocabulary: {e}") from e
    backend = _Backend(model)
    backend.pre_tokenizer = pre_tokenizers.Sequence(
        [pre_tokenizers.Split(Regex(split), behavior="isolated") for split in pre.splits]
        + [pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)]
    )
    backend.decoder = decoders.ByteLevel()
    if meta.get(Keys.Tokenizer.ADD_PREFIX):
        logger.info("%s: %s is ignored for a byte-level BPE vocabulary", meta.path,
                    Keys.Tokenizer.ADD_PREFIX)
    return backend, pre.add_bos, None


def _sentencepiece_bpe(meta: _GGUFMetadata, tokens: list[str], types: list[int]) -> _Built:
    """``tokenizer.ggml.model == "llama"``: SentencePiece pieces and scores, as a BPE with byte
    fallback."""
    scores = meta.get(Keys.Tokenizer.SCORES)
    if scores is None:
        raise ModelFileError(
            f"{meta.path}: a SentencePiece ('llama') tokenizer needs {Keys.Tokenizer.SCORES}, "
            "found none"
        )
    if len(scores) != len(tokens):
        raise ModelFileError(
            f"{meta.path}: {Keys.Tokenizer.SCORES} has {len(scores)} entries, "
            f"expected {len(tokens)}"
        )
    vocab = {token: i for i, token in enumerate(tokens)}
    unk_id = meta.token_id(Keys.Tokenizer.UNK_ID, len(tokens))
    if unk_id is None:
        unk_id = next((i for i, t in enumerate(types) if t == TokenType.UNKNOWN), None)
    try:
        model = models.BPE(
            vocab=vocab,
            merges=_merges_from_scores(tokens, scores, types),
            unk_token=tokens[unk_id] if unk_id is not None else None,
            fuse_unk=True,
            byte_fallback=True,
        )
    except Exception as e:
        raise ModelFileError(f"{meta.path}: cannot build a BPE from the vocabulary: {e}") from e
    backend = _Backend(model)
    backend.normalizer = normalizers.Replace(" ", SPIECE_UNDERLINE)
    to_text = [decoders.Replace(SPIECE_UNDERLINE, " "), decoders.ByteFallback(), decoders.Fuse()]
    add_space_prefix = meta.get(Keys.Tokenizer.ADD_PREFIX)
    space_prefix = None
    if add_space_prefix is None or add_space_prefix:
        space_prefix = _SpacePrefix([t for t, k in zip(tokens, types) if k in _SPECIAL_TYPES])
        to_text.append(decoders.Strip(" ", 1, 0))  # the prefix of the first stretch
    backend.decoder = decoders.Sequence(to_text)
    return backend, True, space_prefix


def _merges_from_scores(
    tokens: list[str], scores: list[float], types: list[int]
) -> list[tuple[str, str]]:
    """BPE merges that reproduce SentencePiece's encoder: every way to form a piece from two
    pieces, ranked by the formed piece's score (highest first; then by the piece's id, then by
    where it is cut). The pieces are put in that order once (numpy), so the merges come out
    ranked with no sort of the merge list (Gemma 3's 262,144 pieces: 515k merges)."""
    mergeable = (TokenType.NORMAL, TokenType.USER_DEFINED)
    vocab = {t: i for i, t in enumerate(tokens) if types[i] in mergeable}
    ids = np.fromiter(vocab.values(), dtype=np.int64, count=len(vocab))
    order = ids[np.lexsort((ids, -np.asarray(scores, dtype=np.float64)[ids]))]
    merges = []
    for i in order.tolist():
        token = tokens[i]
        for cut in range(1, len(token)):
            left = token[:cut]
            if left in vocab and (right := token[cut:]) in vocab:
                merges.append((left, right))
    return merges


_GGUF_BUILDERS = {"gpt2": _byte_level_bpe, "llama": _sentencepiece_bpe}


def _register_added_tokens(
    backend: _Backend, tokens: list[str], types: list[int], source: str
) -> None:
    """Control/unknown tokens become special added tokens, user-defined ones plain added tokens:
    either way their text is matched whole before the model splits the rest."""
    special = [
        AddedToken(t, special=True, normalized=False)
        for t, kind in zip(tokens, types)
        if kind in _SPECIAL_TYPES
    ]
    user = [
        AddedToken(t, special=False, normalized=False)
        for t, kind in zip(tokens, types)
        if kind == TokenType.USER_DEFINED
    ]
    if special:
        backend.add_special_tokens(special)
    if user:
        backend.add_tokens(user)
    if backend.get_vocab_size(with_added_tokens=True) != len(tokens):
        logger.warning(
            "%s: the tokenizer has %d ids but the file lists %d tokens (duplicate token texts?)",
            source, backend.get_vocab_size(with_added_tokens=True), len(tokens),
        )


# --- Hugging Face files -------------------------------------------------------------------------


def _read_json(path: Path) -> dict[str, Any]:
    if not path.is_file():
        return {}
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as e:
        raise ModelFileError(f"{path}: expected a JSON file, could not read it: {e}") from e
    if not isinstance(data, dict):
        raise ModelFileError(f"{path}: expected a JSON object, found {type(data).__name__}")
    return data


def _token_content(value: Any) -> str | None:
    """A token in tokenizer_config.json: a string or an AddedToken-like dict."""
    if isinstance(value, dict):
        value = value.get("content")
    return value if isinstance(value, str) else None


def _hf_chat_template(root: Path, config: dict[str, Any]) -> str | None:
    jinja_file = root / "chat_template.jinja"
    if jinja_file.is_file():
        return jinja_file.read_text(encoding="utf-8")
    template = config.get("chat_template")
    if template is None:
        template = _read_json(root / "chat_template.json").get("chat_template")
    if isinstance(template, list):  # named templates: [{"name": ..., "template": ...}]
        named = {t.get("name"): t.get("template") for t in template if isinstance(t, dict)}
        template = named.get("default")
    return template if isinstance(template, str) else None


def _end_of_turn_ids(backend: _Backend) -> set[int]:
    return {
        i
        for i, token in backend.get_added_tokens_decoder().items()
        if token.special and token.content in END_OF_TURN_TEXTS
    }


def _post_processor_adds(backend: _Backend, bos_id: int | None) -> bool:
    """Whether the tokenizer's post-processor puts BOS in front (when no flag says so)."""
    if bos_id is None or backend.post_processor is None:
        return False
    return backend.encode("", add_special_tokens=True).ids[:1] == [bos_id]


# --- chat templates -----------------------------------------------------------------------------


def _raise_exception(message: str) -> None:
    raise jinja2.exceptions.TemplateError(message)


def _tojson(x: Any, ensure_ascii: bool = False, indent: int | None = None,
            separators: Any = None, sort_keys: bool = False) -> str:
    # jinja's own tojson escapes HTML characters, which chat templates do not want.
    return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators,
                      sort_keys=sort_keys)


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


def _jinja_environment() -> jinja2.sandbox.ImmutableSandboxedEnvironment:
    """The sandbox and helpers transformers gives chat templates."""
    env = jinja2.sandbox.ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[jinja2.ext.loopcontrols]
    )
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    return env
