"""Structured outputs: a grammar's token mask, one per draft position, with xgrammar (as vLLM's
`v1/structured_output/backend_xgrammar.py` does).

A request's grammar (`StructuredOutputs`: a JSON schema, any JSON object, a regex, a choice of strings or
an EBNF grammar) is compiled once per process for the model's vocabulary. `mask_rows` is a logits
processor like the others of `cluster.core.processors`: row i of a round continues the committed output
plus the round's drafts before it, and gets the tokens the grammar allows there; the target (p) and the
draft (q) are masked by the same function with the same histories, so speculation stays lossless. A row
whose history already breaks the grammar (a draft token the grammar refuses: p gives it 0, so it is
rejected and the row is never used) is left unmasked.

Matchers are cached per process and keyed by the tokens they consumed: a session's next round finds the
matcher of its committed output and advances it by the newly committed tokens (drafts are accepted, the
row's mask filled, then rolled back). A history no cached matcher leads to (a new process, a failover) is
replayed from the start: the cache only saves work, it never changes a mask.

xgrammar is imported only when a grammar is used. The process's tokenizer is registered by whoever loads
a model (`cluster.model.models`); a grammar in a process with none is a loud error.
"""

from __future__ import annotations

import json
import logging
import threading
from collections import OrderedDict
from collections.abc import Callable, Sequence
from typing import Literal

import torch
from pydantic import BaseModel, ConfigDict, Field

from cluster.core.errors import InvalidRequestError

GrammarKind = Literal["json", "json_object", "regex", "choice", "grammar"]
MAX_SPEC_CHARS = 64 * 1024  # a schema, regex or grammar's text
MAX_MATCHERS = 256  # cached matchers per process (a session's committed output each)
MAX_COMPILED = 64  # compiled grammars per process
log = logging.getLogger(__name__)


class StructuredOutputs(BaseModel):
    """One request's grammar (vLLM's `StructuredOutputsParams`, one kind at a time). Hashable: the key of
    the process's compiled-grammar cache."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    kind: GrammarKind = Field(description="`json` (a JSON schema), `json_object` (any JSON object), `regex`, `choice` (one of some strings) or `grammar` (EBNF, xgrammar's dialect).")
    spec: str = Field("", max_length=MAX_SPEC_CHARS, description="The schema as JSON text, the regex, the choices as a JSON list of strings, or the grammar; empty for `json_object`.")
    any_whitespace: bool = Field(True, description="JSON may hold any whitespace between tokens (vLLM's default; `disable_any_whitespace` turns it off).")

    @classmethod
    def of_schema(cls, schema: dict | bool, any_whitespace: bool = True) -> "StructuredOutputs":
        return cls(kind="json", spec=json.dumps(schema, separators=(",", ":")),  # property order kept: it is the output's
                   any_whitespace=any_whitespace)

    @classmethod
    def of_choice(cls, choices: Sequence[str]) -> "StructuredOutputs":
        return cls(kind="choice", spec=json.dumps(list(choices)))


# ---- the process's vocabulary and compiled grammars --------------------------------------------------

class NoTokenizer(RuntimeError):
    """A grammar in a process that loaded no model (nor its tokenizer)."""


_warned: set[str] = set()


def warn_once(message: str) -> None:
    if message not in _warned:
        _warned.add(message)
        log.warning("%s (logged once per process)", message)


_lock = threading.RLock()  # re-entered: the lazy loader registers the tokenizer it loads
_tokenizer_loader: Callable[[], object] | None = None
_tokenizer = None
_compilers: dict[int, object] = {}  # vocab_size -> xgrammar.GrammarCompiler
_compiled: OrderedDict[tuple[StructuredOutputs, int], object] = OrderedDict()


def register_tokenizer(tokenizer=None, loader: Callable[[], object] | None = None) -> None:
    """The tokenizer of this process's models (all share the target's); `loader` loads it when first needed. A
    tokenizer of another vocabulary than the one registered before drops the grammars compiled for that one."""
    global _tokenizer, _tokenizer_loader
    with _lock:
        if tokenizer is not None:
            if _tokenizer is not None and tokenizer is not _tokenizer and \
                    tokenizer.get_vocab() != _tokenizer.get_vocab():
                _compilers.clear()
                _compiled.clear()
            _tokenizer = tokenizer
        elif loader is not None and _tokenizer is None:
            _tokenizer_loader = loader


def _loaded_tokenizer():
    global _tokenizer
    with _lock:
        if _tokenizer is None:
            if _tokenizer_loader is None:
                raise NoTokenizer("structured outputs: no tokenizer registered in this process "
                                  "(cluster.core.grammar.register_tokenizer)")
            _tokenizer = _tokenizer_loader()
        return _tokenizer


def _compiler(vocab_size: int):
    compiler = _compilers.get(vocab_size)
    if compiler is not None:
        return compiler
    import xgrammar

    info = xgrammar.TokenizerInfo.from_huggingface(_loaded_tokenizer(), vocab_size=vocab_size)
    compiler = _compilers[vocab_size] = xgrammar.GrammarCompiler(info, max_threads=1)
    return compiler


def _choice_grammar(choices: list[str]) -> str:
    """A choice of literal strings as EBNF (vLLM's `choice_as_grammar`)."""
    return "root ::= " + " | ".join(json.dumps(c) for c in choices)


def compile_grammar(so: StructuredOutputs, vocab_size: int):
    """The compiled grammar (cached); InvalidRequestError for a schema, regex or grammar xgrammar refuses."""
    key = (so, vocab_size)
    with _lock:
        hit = _compiled.get(key)
        if hit is not None:
            _compiled.move_to_end(key)
            return hit
        compiler = _compiler(vocab_size)
        try:
            if so.kind == "json":
                compiled = compiler.compile_json_schema(so.spec, any_whitespace=so.any_whitespace)
            elif so.kind == "json_object":
                compiled = compiler.compile_builtin_json_grammar()
            elif so.kind == "regex":
                compiled = compiler.compile_regex(so.spec)
            elif so.kind == "choice":
                choices = json.loads(so.spec)
                if not choices or not all(isinstance(c, str) and c for c in choices):
                    raise ValueError("choices must be a non-empty list of non-empty strings")
                compiled = compiler.compile_grammar(_choice_grammar(choices))
            else:
                compiled = compiler.compile_grammar(so.spec)
        except Exception as e:  # noqa: BLE001 - xgrammar's parse errors (RuntimeError, ValueError, its own) are the request's
            raise InvalidRequestError(f"structured outputs: the {so.kind} cannot be compiled: "
                                      f"{str(e).splitlines()[0][:300] if str(e) else type(e).__name__}") from None
        _compiled[key] = compiled
        while len(_compiled) > MAX_COMPILED:
            _compiled.popitem(last=False)
        return compiled


# ---- matchers keyed by the tokens they consumed -------------------------------------------------------

class _Matchers:
    """Matchers at known histories: `take` removes the one that leads furthest along a history (a thread
    then owns it), `put` files it again under the history it now stands at."""

    def __init__(self, limit: int = MAX_MATCHERS):
        self._limit = limit
        self._entries: OrderedDict[int, tuple[tuple[StructuredOutputs, int], tuple[int, ...], object]] = OrderedDict()
        self._next = 0
        self._lock = threading.Lock()
        self.replayed = 0  # matchers built from the start (a cache miss)

    def take(self, key, history: Sequence[int]):
        """(matcher, consumed): a matcher of `key` that consumed history[:consumed]; a new one (0) if none."""
        best, best_len = None, -1
        with self._lock:
            for entry_id, (k, consumed, _) in self._entries.items():
                n = len(consumed)
                if k == key and best_len < n <= len(history) and tuple(history[:n]) == consumed:
                    best, best_len = entry_id, n
            if best is not None:
                _, _, matcher = self._entries.pop(best)
                return matcher, best_len
        import xgrammar

        self.replayed += 1
        return xgrammar.GrammarMatcher(compile_grammar(*key)), 0

    def put(self, key, history: Sequence[int], matcher) -> None:
        with self._lock:
            self._entries[self._next] = (key, tuple(history), matcher)
            self._next += 1
            while len(self._entries) > self._limit:
                self._entries.popitem(last=False)


_matchers = _Matchers()


def _advance(matcher, tokens: Sequence[int]) -> int:
    """Accept `tokens` in order; how many the grammar took (it stops at the first it refuses)."""
    for i, t in enumerate(tokens):
        if matcher.is_terminated() or not matcher.accept_token(int(t)):
            return i
    return len(tokens)


def _matcher_after(key, output_ids: Sequence[int]):
    """A matcher (taken from the cache, or new) that has consumed `output_ids`; None where the output left the
    grammar (never for a masked output)."""
    matcher, consumed = _matchers.take(key, output_ids)
    if _advance(matcher, output_ids[consumed:]) < len(output_ids) - consumed:
        return None
    return matcher


def mask_rows(logits: torch.Tensor, so: StructuredOutputs, output_ids: Sequence[int],
              suffixes: Sequence[Sequence[int]]) -> None:
    """Mask in place the tokens the grammar refuses at each row.

    logits      # [r, vocab_size] float32, changed in place
    output_ids  # [O]: the committed output (what the grammar has consumed)
    suffixes    # r lists: row i continues output_ids + suffixes[i]
    """
    import xgrammar

    r, vocab_size = logits.shape
    key = (so, vocab_size)
    matcher = _matcher_after(key, output_ids)
    if matcher is None:
        return  # nothing after an output that left the grammar is masked
    bitmask = xgrammar.allocate_token_bitmask(r, vocab_size)  # [r, ceil(vocab_size / 32)] int32, all allowed
    on: list[int] = []  # the suffix tokens the matcher holds now
    for i, suffix in enumerate(suffixes):
        common = 0
        while common < min(len(on), len(suffix)) and on[common] == suffix[common]:
            common += 1
        if len(on) > common:
            matcher.rollback(len(on) - common)
            del on[common:]
        taken = _advance(matcher, suffix[common:])
        on.extend(int(t) for t in suffix[common:common + taken])
        if common + taken == len(suffix) and not matcher.is_terminated():
            matcher.fill_next_token_bitmask(bitmask, i)
    if on:
        matcher.rollback(len(on))
    _matchers.put(key, output_ids, matcher)
    xgrammar.apply_token_bitmask_inplace(logits, bitmask.to(logits.device), vocab_size=vocab_size)


def valid_prefix(so: StructuredOutputs, output_ids: Sequence[int], draft_ids: Sequence[int],
                 vocab_size: int | None = None) -> int:
    """How many of `draft_ids` the grammar accepts after `output_ids` (drafts are cut there before
    verification: p gives the first refused one no mass). `vocab_size` None: the tokenizer's (which tokens
    a grammar accepts does not depend on the logits' padding)."""
    if vocab_size is None:
        vocab_size = next(iter(_compilers), None) or len(_loaded_tokenizer())
    key = (so, vocab_size)
    matcher = _matcher_after(key, output_ids)
    if matcher is None:
        return len(draft_ids)
    taken = _advance(matcher, draft_ids)
    if taken:
        matcher.rollback(taken)
    _matchers.put(key, output_ids, matcher)
    return taken


def check(so: StructuredOutputs, vocab_size: int) -> None:
    """Compile at the edge, so that a bad schema, regex or grammar is a 400 there."""
    compile_grammar(so, vocab_size)
