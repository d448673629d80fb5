"""Static prompt sources: template × topic, code tasks, code completions; drawn by cursor.

Each source is a set of `Pool`s. A pool is the cross product of its items with its templates,
walked in a seeded affine permutation (`i -> (a*i + b) mod N`, `gcd(a, N) = 1`), so that item `i`
is computed without materialising the product and never repeats within a pool. The `cursors`
(one per pool) are the only state: the manifest records them after every shard, and a resumed run
continues from the same place. `draw` skips prompts the held-out filter rejects and prompts already
used (normalised), so the data never holds a held-out prompt nor the same prompt twice.
"""

from __future__ import annotations

import math
import zlib
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TypeVar

import numpy as np

from . import templates
from .corpora import CodeItem, Corpora, Topic
from .heldout import HeldOut, normalise

T = TypeVar("T")
KINDS = ("magpie", "topic", "code", "completion")
# category weights of the template × topic prompts (a category drops out when exhausted)
TOPIC_WEIGHTS = {"word": 0.30, "command": 0.20, "concept": 0.06, "file format": 0.04, "package": 0.08,
                 "pymodule": 0.16, "pytopic": 0.10, "pykeyword": 0.06}


@dataclass(frozen=True)
class Prompt:
    text: str
    kind: str    # one of KINDS
    source: str  # the pool: "topic/word", "topic/pymodule", "code", "completion"; or "magpie"
    chat: bool   # sent through the chat template (completion prompts are not)


@dataclass
class Pool:
    """`n_items × n_templates` prompts in a seeded permutation; `render(item, template)` makes one."""

    name: str
    n_items: int
    n_templates: int
    render: Callable[[int, int], str]
    seed: int

    def __post_init__(self) -> None:
        self.size = self.n_items * self.n_templates
        rng = np.random.default_rng([self.seed, _stable_hash(self.name)])
        self._a, self._b = 1, 0
        if self.size > 1:
            a = int(rng.integers(1, self.size))
            while math.gcd(a, self.size) != 1:
                a = a % (self.size - 1) + 1
            self._a, self._b = a, int(rng.integers(0, self.size))

    def __getitem__(self, i: int) -> str:
        if not 0 <= i < self.size:
            raise IndexError(i)
        j = (self._a * i + self._b) % self.size
        return self.render(j // self.n_templates, j % self.n_templates)


def _stable_hash(text: str) -> int:
    """A process-independent 32-bit hash (Python's `hash` is salted per process)."""
    return zlib.crc32(text.encode())


def _topic_pool(category: str, topics: list[Topic], seed: int) -> Pool:
    tpls = templates.BY_CATEGORY[category]

    def render(i: int, t: int) -> str:
        topic = topics[i]
        name = topic.name.replace("_", " ") if topic.name.isupper() else topic.name
        return tpls[t].format(name=name, desc=topic.description.rstrip(".") or topic.name)

    return Pool(f"topic/{category}", len(topics), len(tpls), render, seed)


def _code_pool(items: list[CodeItem], seed: int) -> Pool:
    def render(i: int, t: int) -> str:
        c = items[i]
        lang = "Python" if c.language == "python" else "C"
        return templates.CODE[t].format(q=c.qualname, sig=c.signature, short=c.qualname.rsplit(".", 1)[-1],
                                        summary=c.summary, lang=lang)

    return Pool("code", len(items), len(templates.CODE), render, seed)


def _completion_pool(items: list[CodeItem], seed: int) -> Pool:
    def render(i: int, t: int) -> str:
        c = items[i]
        sig = c.signature.replace("(self, ", "(").replace("(self)", "()")
        module = c.qualname.split(".")[0] if "." in c.qualname else "builtins"
        return templates.COMPLETION[t].format(name=c.qualname.rsplit(".", 1)[-1], sig=sig, doc=c.doc,
                                              summary=c.summary, module=module)

    return Pool("completion", len(items), len(templates.COMPLETION), render, seed)


class StaticSources:
    """The template × topic, code and completion pools of one corpora snapshot and seed."""

    def __init__(self, corpora: Corpora, seed: int, heldout: HeldOut):
        self.heldout = heldout
        cats = corpora.by_category()
        self.topic_pools = {c: _topic_pool(c, cats[c], seed) for c in TOPIC_WEIGHTS if cats.get(c)}
        self.code_pool = _code_pool(corpora.callables, seed)
        py = [c for c in corpora.callables if c.language == "python" and c.signature]
        self.completion_pool = _completion_pool(py, seed)

    def pools(self) -> dict[str, Pool]:
        return {**{p.name: p for p in self.topic_pools.values()}, "code": self.code_pool,
                "completion": self.completion_pool}

    def sizes(self) -> dict[str, int]:
        return {name: pool.size for name, pool in self.pools().items()}

    def _next(self, pool: Pool, cursors: dict[str, int], seen: set[str]) -> str | None:
        """The pool's next usable prompt (cursor advanced past it), None when the pool is spent."""
        i = cursors.get(pool.name, 0)
        while i < pool.size:
            text = pool[i]
            i += 1
            norm = normalise(text)
            if norm not in seen and not self.heldout.rejects(text):
                cursors[pool.name] = i
                seen.add(norm)
                return text
        cursors[pool.name] = i
        return None

    def draw(self, kind: str, n: int, rng: np.random.Generator, cursors: dict[str, int],
             seen: set[str]) -> list[Prompt]:
        """`n` new prompts of `kind` (topic, code or completion); updates `cursors` and `seen`."""
        out: list[Prompt] = []
        while len(out) < n:
            if kind == "topic":
                live = [c for c, p in self.topic_pools.items() if cursors.get(p.name, 0) < p.size]
                if not live:
                    break
                w = np.array([TOPIC_WEIGHTS[c] for c in live])
                pool = self.topic_pools[live[int(rng.choice(len(live), p=w / w.sum()))]]
            else:
                pool = self.code_pool if kind == "code" else self.completion_pool
            text = self._next(pool, cursors, seen)
            if text is None:
                if kind != "topic":
                    break
                continue
            out.append(Prompt(text, kind, pool.name, chat=kind != "completion"))
        return out


def kind_counts(n: int, mix: dict[str, float]) -> dict[str, int]:
    """Split `n` slots by the `mix` fractions (largest remainder; sums to `n`)."""
    total = sum(mix.values())
    raw = {k: n * v / total for k, v in mix.items()}
    counts = {k: int(v) for k, v in raw.items()}
    for k in sorted(raw, key=lambda k: (counts[k] - raw[k], k))[: n - sum(counts.values())]:
        counts[k] += 1
    return counts


def shuffled(items: Sequence[T], rng: np.random.Generator) -> list[T]:
    return [items[i] for i in rng.permutation(len(items))]
