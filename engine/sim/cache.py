"""The prefill's prefix cache (SGLang's radix cache, approximately): what earlier prompts computed, in blocks
of ``BLOCK`` tokens, least recently used first out, at most ``capacity_tokens``.

Block i's key is a hash of blocks 0..i, so a key stands for a whole prefix (a node of the radix tree) and the
cached part of a prompt is its leading blocks found. A prompt's blocks are touched last block first, so a
prefix's root outlives its branches (as a radix tree evicts leaves first)."""

from __future__ import annotations

import re
from collections import OrderedDict

BLOCK = 16
_TOKEN = re.compile(r"\w+|[^\w\s]")  # engine.sim.text's tokenizer


class PrefixCache:
    def __init__(self, capacity_tokens: int) -> None:
        self.capacity_blocks = capacity_tokens // BLOCK
        self.blocks: OrderedDict[int, None] = OrderedDict()
        self.hits = 0  # tokens found cached, over all prompts
        self.lookups = 0  # tokens looked up

    @staticmethod
    def keys(prompt: str) -> list[int]:
        toks = _TOKEN.findall(prompt)
        out, h = [], 0
        for i in range(0, len(toks) - len(toks) % BLOCK, BLOCK):  # whole blocks only, as a paged cache holds
            h = hash((h, *toks[i:i + BLOCK]))
            out.append(h)
        return out

    def cached(self, keys: list[int]) -> int:
        """Tokens of a prompt with these keys already cached."""
        n = 0
        for k in keys:
            if k not in self.blocks:
                break
            n += 1
        return n * BLOCK

    def insert(self, keys: list[int]) -> None:
        if not self.capacity_blocks:
            return
        b = self.blocks
        for k in reversed(keys):
            if k in b:
                b.move_to_end(k)
            else:
                b[k] = None
        while len(b) > self.capacity_blocks:
            b.popitem(last=False)

    def account(self, prompt_tokens: int, cached: int) -> None:
        self.lookups += prompt_tokens
        self.hits += cached

    @property
    def hit_rate(self) -> float:
        return self.hits / self.lookups if self.lookups else 0.0

    def flush(self) -> None:
        self.blocks.clear()
