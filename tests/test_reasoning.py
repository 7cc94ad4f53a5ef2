"""Thoughts apart from answers (``reasoning.py``): the streaming splitter against a regular
expression over the whole text, for every way of cutting the text into pieces; chat template
variables (Qwen3's ``enable_thinking``) against transformers rendering the same template."""

from __future__ import annotations

import itertools
import json
import random
import re

import pytest

from sparseinfer.errors import SparseInferError
from sparseinfer.reasoning import THINK, ThinkTags, ThoughtSplitter, split_thoughts, template_tags
from sparseinfer.tokenizer import Tokenizer


def reference(text: str, opened: bool = False) -> tuple[str, str]:
    """(thinking, answer) by regular expressions over the whole text: a thought only at the
    start (after whitespace), its text stripped, the answer's leading whitespace after it
    dropped; a thought never closed takes the rest."""
    if opened:  # the model may open the thought again: one such tag is dropped
        text = "<think>" + re.sub(r"^\s*<think>", "", text, count=1)
    closed = re.fullmatch(r"\s*<think>(.*?)</think>\s*(.*)", text, re.S)
    if closed:
        return closed.group(1).strip(), closed.group(2)
    unclosed = re.fullmatch(r"\s*<think>(.*)", text, re.S)
    if unclosed:
        return unclosed.group(1).strip(), ""
    return "", text


TEXTS = [
    "<think>plan</think>answer",
    "<think>\nI should add 2 and 2.\n\nThat is 4.\n</think>\n\nThe answer is 4.",
    "  \n<think> a </think>  b  ",
    "<think></think>answer",
    "<think>\n\n</think>\n\n",
    "<think>never closed, cut short by max_tokens",
    "<think>half a close tag </thi",
    "<think>a < b and c </ d </think> ok",
    "<think>x</think>y</think>z <think>w</think>",
    "no thought at all",
    "answer first <think>not a thought</think>",
    "<thinking>another tag</thinking>",
    "<th",
    "<",
    "   ",
    "",
    "<think>",
    "</think>stray close",
    "<think>nested <think> open</think> done",
    "  <think> <think>twice</think> x",
    " <thi",
]


def pieces_of(text: str, cuts: tuple[int, ...]) -> list[str]:
    bounds = [0, *cuts, len(text)]
    return [text[a:b] for a, b in zip(bounds, bounds[1:])]


def run(pieces: list[str], opened: bool = False) -> tuple[str, str]:
    splitter = ThoughtSplitter(THINK, opened)
    thinking = answer = ""
    for piece in pieces:
        t, a = splitter.push(piece)
        thinking, answer = thinking + t, answer + a
    t, a = splitter.flush()
    return thinking + t, answer + a


@pytest.mark.parametrize("opened", [False, True])
@pytest.mark.parametrize("text", TEXTS)
def test_whole_text_matches_the_regular_expressions(text, opened):
    assert split_thoughts(text, THINK, opened) == reference(text, opened)


@pytest.mark.parametrize("opened", [False, True])
@pytest.mark.parametrize("text", TEXTS)
def test_every_cut_into_two_and_three_pieces(text, opened):
    want = reference(text, opened)
    for k in (1, 2):
        for cuts in itertools.combinations(range(1, len(text)), k):
            assert run(pieces_of(text, cuts), opened) == want, cuts


def test_random_pieces_of_random_texts():
    """Texts made of tag fragments, whitespace and words, cut at random: the pieces released
    add up to the whole text's split."""
    rng = random.Random(0)
    atoms = ["<think>", "</think>", "<th", "</", "ink>", " ", "\n", "a", "bc", "<", ">", "x y"]
    for _ in range(3000):
        text = "".join(rng.choice(atoms) for _ in range(rng.randint(0, 9)))
        cuts = tuple(sorted(rng.sample(range(1, len(text)), min(len(text) - 1, rng.randint(0, 6)))
                            )) if len(text) > 1 else ()
        opened = rng.random() < 0.3
        assert run(pieces_of(text, cuts), opened) == reference(text, opened), (text, cuts)


def test_one_character_a_piece_releases_the_thought_as_it_comes():
    """Streamed a character at a time, the thought's words come out before the thought ends:
    only what may begin the close tag (or whitespace it would swallow) is held."""
    splitter = ThoughtSplitter()
    out = [splitter.push(c) for c in "<think>abc de</think> fin"]
    thinking_so_far = "".join(t for t, _ in out[: len("<think>abc de")])
    assert thinking_so_far == "abc de"
    assert "".join(a for _, a in out) + splitter.flush()[1] == "fin"


def test_tags_of_templates_and_prompts():
    assert template_tags(None) is None
    assert template_tags("{% for m in messages %}{{ m.content }}{% endfor %}") is None
    assert template_tags("{{ '<think>\\n' }}") == THINK
    assert THINK.opened_by("<|Assistant|><think>\n")
    assert not THINK.opened_by("<|im_start|>assistant\n<think>\n\n</think>\n\n")
    assert not THINK.opened_by("<|im_start|>assistant\n")
    tags = ThinkTags("<reasoning>", "</reasoning>")
    assert split_thoughts("<reasoning>r</reasoning> a", tags) == ("r", "a")


# Qwen3's switch, in the shape its template has it (the real one is longer): without
# enable_thinking the model thinks; enable_thinking=false closes an empty thought in the prompt
QWEN3_LIKE = (
    "{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n"
    "{% if enable_thinking is defined and enable_thinking is false %}<think>\n\n</think>\n\n"
    "{% endif %}{% endif %}"
)


@pytest.fixture(scope="module")
def qwen3_like_dir(tiny_model_dir, tmp_path_factory):
    out = tmp_path_factory.mktemp("qwen3_like")
    src = tiny_model_dir("swiglu")
    for f in ("tokenizer.json", "config.json"):
        (out / f).write_bytes((src / f).read_bytes())
    config = json.loads((src / "tokenizer_config.json").read_text())
    config["chat_template"] = QWEN3_LIKE
    (out / "tokenizer_config.json").write_text(json.dumps(config))
    return out


def test_template_variables_match_transformers(qwen3_like_dir):
    transformers = pytest.importorskip("transformers")
    ref = transformers.AutoTokenizer.from_pretrained(str(qwen3_like_dir))
    ours = Tokenizer.from_hf_dir(qwen3_like_dir)
    assert template_tags(ours.chat_template) == THINK
    messages = [{"role": "user", "content": "2 + 2?"}]
    for kwargs in ({}, {"enable_thinking": True}, {"enable_thinking": False}):
        want = ref.apply_chat_template(messages, tokenize=False, add_generation_prompt=True,
                                       **kwargs)
        assert ours.apply_chat_template(messages, template_kwargs=kwargs) == want
    assert ours.apply_chat_template(messages, template_kwargs={"enable_thinking": False}
                                    ).endswith("<think>\n\n</think>\n\n")
    with pytest.raises(SparseInferError, match="other than messages.*got add_generation_prompt"):
        ours.apply_chat_template(messages, template_kwargs={"add_generation_prompt": False})
