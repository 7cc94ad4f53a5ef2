"""Thinking models' thoughts apart from their answers (DeepSeek-R1 and its distills, QwQ, Qwen3).

Such a model writes ``<think> ... </think>`` before its answer, or its chat template opens the
block in the prompt and the model only closes it. What llama.cpp's server does by default
(``--reasoning-format deepseek``) and Ollama does for thinking models, the server does too: the
text inside the block goes to ``reasoning_content`` (OpenAI routes) / ``thinking`` (Ollama's),
the rest is the answer. Only a block at the start of the answer is taken (after whitespace), as
llama.cpp does; a ``<think>`` later on is answer text.

``ThoughtSplitter`` splits a generation piece by piece as it streams: text that may still turn
out to be part of a tag (or whitespace that a tag would swallow) is held back until the next
piece decides it, so the pieces it releases add up to ``split_thoughts`` of the whole text
whatever the pieces were.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass


@dataclass(frozen=True)
class ThinkTags:
    """The tags around a model's thoughts."""

    open: str = "<think>"
    close: str = "</think>"

    def opened_by(self, prompt_tail: str) -> bool:
        """Whether a prompt ending in ``prompt_tail`` leaves a thought open, so the generation
        starts inside it (DeepSeek-R1's template ends its generation prompt with ``<think>``)."""
        start = prompt_tail.rfind(self.open)
        return start >= 0 and self.close not in prompt_tail[start:]


THINK = ThinkTags()


def template_tags(template: str | None) -> ThinkTags | None:
    """The think tags of a chat template written for a thinking model (it names ``<think>``,
    to open the block or to drop earlier turns' thoughts), else None."""
    return THINK if template and THINK.open in template else None


class _State(enum.Enum):
    START = "start"  # nothing but whitespace so far: a thought may still open
    THOUGHT = "thought"  # inside the thought
    AFTER = "after"  # the thought closed; the answer's leading whitespace is dropped
    ANSWER = "answer"


def _partial_suffix(text: str, tag: str) -> int:
    """The length of the longest end of ``text`` that begins ``tag`` (shorter than it)."""
    for k in range(min(len(tag) - 1, len(text)), 0, -1):
        if text.endswith(tag[:k]):
            return k
    return 0


class ThoughtSplitter:
    """One generation's text, pushed piece by piece, split into (thinking, answer) pieces.

    ``opened``: the prompt left a thought open (``ThinkTags.opened_by``), so the text starts
    inside it (an opening tag the model writes again first is dropped). Whitespace at either
    end of the thought and at the start of an answer after a thought is dropped.
    """

    def __init__(self, tags: ThinkTags = THINK, opened: bool = False) -> None:
        self.tags = tags
        self.state = _State.THOUGHT if opened else _State.START
        self.opened = opened  # until the thought starts: its tag may come again
        self.held = ""
        self.thought_started = False  # leading whitespace of the thought is dropped

    def push(self, text: str) -> tuple[str, str]:
        """Add ``text``; returns the (thinking, answer) text it releases (either may be "")."""
        self.held += text
        thinking = answer = ""
        while True:
            if self.state is _State.START:
                body = self.held.lstrip()
                if body.startswith(self.tags.open):
                    self.held = body[len(self.tags.open):]
                    self.state = _State.THOUGHT
                    continue
                if self.tags.open.startswith(body):  # "" or a beginning of the tag: wait
                    return thinking, answer
                self.state, answer, self.held = _State.ANSWER, answer + self.held, ""
                return thinking, answer
            if self.state is _State.THOUGHT:
                if not self.thought_started:
                    self.held = self.held.lstrip()
                    # a thought the prompt opened may be opened again by the model: one tag
                    if self.opened and self.held.startswith(self.tags.open):
                        self.held, self.opened = self.held[len(self.tags.open):], False
                        continue
                    if self.opened and self.held and self.tags.open.startswith(self.held):
                        return thinking, answer  # a beginning of that tag: wait
                    self.thought_started = bool(self.held)
                end = self.held.find(self.tags.close)
                if end >= 0:
                    thinking += self.held[:end].rstrip()
                    self.held = self.held[end + len(self.tags.close):]
                    self.state = _State.AFTER
                    continue
                # release all but what may begin the close tag, and whitespace it may follow
                keep = _partial_suffix(self.held, self.tags.close)
                out = self.held[: len(self.held) - keep]
                body = out.rstrip()
                thinking += body
                self.held = out[len(body):] + self.held[len(self.held) - keep:]
                return thinking, answer
            if self.state is _State.AFTER:
                self.held = self.held.lstrip()
                if not self.held:
                    return thinking, answer
                self.state = _State.ANSWER
            answer, self.held = answer + self.held, ""
            return thinking, answer

    def flush(self) -> tuple[str, str]:
        """The end of the generation: what is still held, released."""
        held, self.held = self.held, ""
        if self.state is _State.THOUGHT:  # the generation stopped inside its thought
            return held.strip() if not self.thought_started else held.rstrip(), ""
        if self.state is _State.START:  # whitespace, or the beginning of a tag: answer text
            return "", held
        return "", held if self.state is _State.ANSWER else ""


def split_thoughts(text: str, tags: ThinkTags = THINK, opened: bool = False) -> tuple[str, str]:
    """A whole generation's (thinking, answer)."""
    splitter = ThoughtSplitter(tags, opened)
    thinking, answer = splitter.push(text)
    more_thinking, more_answer = splitter.flush()
    return thinking + more_thinking, answer + more_answer


__all__ = ["THINK", "ThinkTags", "ThoughtSplitter", "split_thoughts", "template_tags"]
