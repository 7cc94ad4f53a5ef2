"""The engine interface: what the CLI and the server talk to, never the model directly.

An ``Engine`` owns one loaded model, its tokenizer and a KV cache. It is not thread-safe: a caller
that serves several clients runs it from one worker thread.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Literal, Protocol

from .config import SamplingParams


@dataclass(frozen=True)
class TokenEvent:
    """One generated token. ``text`` is the text that became final with it (may be "")."""

    token_id: int
    text: str


@dataclass(frozen=True)
class FinishEvent:
    """The last event of a stream."""

    reason: Literal["stop", "length", "cancelled"]
    prompt_tokens: int
    completion_tokens: int
    prefill_seconds: float = 0.0
    decode_seconds: float = 0.0


StreamEvent = TokenEvent | FinishEvent


class EngineProtocol(Protocol):
    name: str  # model id shown by /v1/models
    n_ctx: int  # context window in tokens

    def encode(self, text: str, add_bos: bool = True) -> list[int]: ...

    def decode(self, ids: list[int]) -> str: ...

    def chat_prompt(self, messages: list[dict[str, str]]) -> list[int]:
        """Render ``messages`` with the model's chat template (generation prompt added), tokenize."""
        ...

    def stream(
        self,
        prompt_ids: list[int],
        params: SamplingParams,
        cancel: threading.Event | None = None,
    ) -> Iterator[StreamEvent]:
        """Generate from ``prompt_ids``; yields TokenEvents then exactly one FinishEvent.

        Raises ContextOverflowError (before yielding anything) when the prompt does not fit.
        Stop strings in ``params.stop`` end generation with reason "stop"; their text is not
        yielded. Setting ``cancel`` ends the stream early with reason "cancelled".
        """
        ...
