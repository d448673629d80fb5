"""Magpie: the target writes the user instructions itself.

The target sees only its chat template's prefix up to and including the user-turn header: the
template rendered for one user message (so the default system prompt it adds is there too), cut
after `<|im_start|>user\\n`. Sampled (temperature 1.0, top-p 0.95) until `<|im_end|>`, what it writes
is a user query; a query is kept when it ended on `<|im_end|>` (not cut by the length limit), is
non-trivial (3..300 words, some letters, no special tokens, not a repeated-character run), is new
(normalised) and passes the held-out filter.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

import numpy as np

from .engines import Engine, GenRequest
from .heldout import HeldOut, normalise
from .prompts import Prompt

USER_HEADER = "<|im_start|>user\n"
_SENTINEL = "\u2063MAGPIE\u2063"


@dataclass(frozen=True)
class MagpieConfig:
    temperature: float = 1.0
    top_p: float = 0.95
    max_tokens: int = 128
    oversample: float = 1.5  # candidates per wanted query in the first round
    rounds: int = 3


def user_prefix(tokenizer) -> str:
    """The chat template rendered up to and including the user-turn header."""
    text = tokenizer.apply_chat_template([{"role": "user", "content": _SENTINEL}], tokenize=False,
                                         add_generation_prompt=False)
    cut = text.find(_SENTINEL)
    if cut < 0 or not text[:cut].endswith(USER_HEADER):
        raise ValueError(f"chat template has no {USER_HEADER!r} right before the user content: {text!r}")
    return text[:cut]


def user_prefix_ids(tokenizer) -> list[int]:
    """Token ids of `user_prefix`, identical to the chat-encoded prompt's first tokens."""
    return list(tokenizer(user_prefix(tokenizer), add_special_tokens=False)["input_ids"])


def acceptable(text: str) -> bool:
    """A non-trivial query: 3..300 words, mostly text, no special tokens, not a character run."""
    words = text.split()
    if not 3 <= len(words) <= 300 or len(text) < 15 or "<|" in text or "|>" in text:
        return False
    letters = sum(ch.isalpha() for ch in text)
    return letters >= 0.5 * len(text.replace(" ", "")) and not re.search(r"(.)\1{15,}", text)


def seed_for(seed: int, *path: int) -> int:
    """A 31-bit seed derived from the run seed and a path (shard, round, index)."""
    return int(np.random.SeedSequence([seed, *path]).generate_state(1)[0] & 0x7FFFFFFF)


def magpie_queries(engine: Engine, tokenizer, n: int, *, seed: int, shard: int, heldout: HeldOut,
                   seen: set[str], config: MagpieConfig = MagpieConfig()) -> tuple[list[Prompt], int]:
    """Up to `n` new queries written by the target; `seen` gets their normalised text.

    Returns (prompts, tokens the target generated for them). Candidate `i` of round `r` for shard
    `s` samples with `seed_for(seed, s, r, i)`, so a shard's queries depend only on the seed, the
    shard index and what earlier shards used.
    """
    prefix = user_prefix_ids(tokenizer)
    stop = tokenizer.convert_tokens_to_ids("<|im_end|>")
    out: list[Prompt] = []
    generated = 0
    for rnd in range(config.rounds):
        want = n - len(out)
        if want <= 0:
            break
        count = int(np.ceil(want * (config.oversample if rnd == 0 else 2.0))) + 2
        reqs = [GenRequest(prefix, config.max_tokens, config.temperature, config.top_p,
                           seed_for(seed, shard, rnd, i), stop_ids=(stop,)) for i in range(count)]
        for res in engine.generate(reqs):
            generated += len(res.token_ids)
            if res.finish != "stop" or len(out) >= n:
                continue
            text = tokenizer.decode([t for t in res.token_ids if t != stop], skip_special_tokens=False).strip()
            norm = normalise(text)
            if acceptable(text) and norm not in seen and not heldout.rejects(text):
                seen.add(norm)
                out.append(Prompt(text, "magpie", "magpie", chat=True))
    return out, generated
