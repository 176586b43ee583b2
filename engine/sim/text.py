"""Tokenizer and deterministic text for the simulated model.

Tokenizer: a token is a run of word characters or one other non-space character
(regex ``\\w+|[^\\w\\s]``). Output: words from a small bundled list, drawn by a
random generator seeded from the prompt, so the same prompt gives the same text.
"""

from __future__ import annotations

import random
import re
import zlib
from collections.abc import Iterator
from typing import Any

_TOKEN = re.compile(r"\w+|[^\w\s]")
VOCAB_SIZE = 32000

WORDS = (
    "the a an and or but so then this that these those here there now later soon "
    "request reply token cache prefill decode transfer worker gateway engine queue "
    "model agent tool result round context window budget deadline abort retry room "
    "bytes stream event trace phase batch step node pool link state value signal "
    "hello hi yes no maybe always never often quick slow steady calm clear bright "
    "river stone cloud light field garden bridge tower market harbor valley forest "
    "read write send receive open close start stop wait watch count measure check "
    "small large long short early late first last next every other same new old "
    "we you they it is are was were be been has have had can will would should"
).split()


def count_tokens(text: str) -> int:
    return len(_TOKEN.findall(text))


def token_ids(text: str) -> list[int]:
    return [zlib.crc32(t.encode()) % VOCAB_SIZE for t in _TOKEN.findall(text)]


def chat_prompt(messages: list[dict[str, Any]]) -> str:
    """Flatten chat messages the way a chat template would, roughly."""
    parts = []
    for m in messages:
        content = m.get("content")
        if isinstance(content, list):  # OpenAI content parts
            content = " ".join(str(p.get("text", "")) for p in content if isinstance(p, dict))
        parts.append(f"{m.get('role', 'user')}: {content or ''}")
    return "\n".join(parts) + "\nassistant:"


def words(prompt: str) -> Iterator[str]:
    """Endless deterministic stream of output tokens for ``prompt``."""
    rng = random.Random(zlib.crc32(prompt.encode()))
    first = True
    while True:
        w = rng.choice(WORDS)
        yield w if first else " " + w
        first = False


def token_logprob(token: str) -> float:
    return -round((zlib.crc32(token.encode()) % 1000) / 250.0, 4)
