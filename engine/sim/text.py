"""Tokenizer and deterministic text for the simulated model.

Tokenizer: a token is a run of word characters or one other non-space character
(regex ``\\w+|[^\\w\\s]``). Output: words from a small bundled list (``Sampler``): at each step the
model prefers one word, fixed by the prompt and the step (greedy decoding, temperature 0); at temperature
T > 0 it takes another word with probability T/(1+T), drawn by a generator seeded with the request's
``seed`` (0 when absent). So the same (prompt, seed, temperature) always gives the same text, temperature 0
gives one text whatever the seed, and a higher temperature strays further from it. Log-probabilities are
those of that distribution.
"""

from __future__ import annotations

import math
import random
import re
import zlib
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


IMPOSSIBLE = -9999.0  # OpenAI's logprob for a token the distribution cannot produce


class Sampler:
    """The sim model's output distribution for one prompt (module docstring)."""

    __slots__ = ("base", "keep", "rng", "step")

    def __init__(self, prompt: str, seed: int | None = None, temperature: float = 1.0) -> None:
        self.base = zlib.crc32(prompt.encode())
        self.keep = 1.0 / (1.0 + max(0.0, float(temperature)))  # chance of the preferred word, before the draw
        self.rng = random.Random((self.base << 64) ^ ((seed or 0) & 0xFFFFFFFFFFFFFFFF))
        self.step = 0

    def preferred(self, step: int) -> str:
        w = WORDS[(self.base + step * 2654435761) % len(WORDS)]
        return w if step == 0 else " " + w

    def next(self) -> str:
        g = self.preferred(self.step)
        if self.keep < 1.0 and self.rng.random() >= self.keep:
            w = self.rng.choice(WORDS)
            g = w if self.step == 0 else " " + w
        self.step += 1
        return g

    def logprob(self, step: int, token: str) -> float:
        other = (1.0 - self.keep) / len(WORDS)
        p = self.keep + other if token == self.preferred(step) else other
        return round(math.log(p), 4) if p > 0 else IMPOSSIBLE

    def top(self, step: int, n: int) -> list[tuple[str, float]]:
        """The ``n`` likeliest tokens at ``step``: the preferred one, then others in vocabulary order."""
        g = self.preferred(step)
        out = [(g, self.logprob(step, g))]
        sp = "" if step == 0 else " "
        for w in WORDS:
            if len(out) >= n:
                break
            if sp + w != g:
                out.append((sp + w, self.logprob(step, sp + w)))
        return out[:n]


def token_logprob(token: str) -> float:
    return -round((zlib.crc32(token.encode()) % 1000) / 250.0, 4)
