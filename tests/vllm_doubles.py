"""Test doubles for tandem's proposer inside vLLM, made in vLLM's worker process through a
`DrafterSpec(proposer_import=...)` naming one of the factories below by import path (the worker runs
from the repository root, as pytest does, so `tests.vllm_doubles` imports there).

- `ReplayProposer`: replays the target's own output for known prompts, always right or always wrong;
- `FaultyProposer`: wraps a real proposer (`drafts.factory`) and breaks after n draft batches.
"""

from __future__ import annotations

from cluster.core.config import EngineConfig
from cluster.vllm.protocol import DrafterSpec, ProposerImport
from drafts.factory import build_proposer
from drafts.proposer import DraftProposal, SequenceProposer


class ReplayProposer:
    """A test proposer that knows the target's own output for each prompt (`references`: (prompt ids,
    target-only output ids) pairs) and replays it: `wrong=False` proposes exactly the target's next
    tokens (always right under greedy decoding), `wrong=True` proposes tokens guaranteed to differ from
    them (always wrong under greedy decoding). Where the sequence leaves the reference it proposes nothing."""

    def __init__(self, references: list[tuple[list[int], list[int]]], wrong: bool, vocab_size: int):
        self._base = SequenceProposer()
        self.name = "always-wrong" if wrong else "always-right"
        self.wrong = wrong
        self.vocab_size = vocab_size
        self.references = [(list(p), list(o)) for p, o in references]
        self._ref: dict = {}

    def start(self, session, prompt_ids, params):
        self._base.start(session, prompt_ids, params)
        prompt = list(prompt_ids)
        matches = [(p, o) for p, o in self.references if prompt[: len(p)] == p]
        self._ref[session] = max(matches, key=lambda r: len(r[0])) if matches else None

    def propose(self, session, k):
        tokens = self._base.tokens(session)
        ref = self._ref.get(session)
        draft: list[int] = []
        if ref is not None:
            prompt, output = ref
            full = prompt + output
            n = len(tokens)
            if tokens == full[:n]:
                draft = full[n: n + k]
                if self.wrong:
                    draft = [(t + 1) % self.vocab_size for t in draft]
        tokens.extend(draft)
        return DraftProposal(draft, None)

    def propose_batch(self, requests):
        return {s: self.propose(s, k) for s, k in requests.items()}

    def rollback(self, session, length, token_ids=()):
        self._base.rollback(session, length, token_ids)

    def learn(self, session, num_drafted, num_accepted):
        pass

    def release(self, session):
        self._base.release(session)
        self._ref.pop(session, None)

    @property
    def num_sessions(self):
        return self._base.num_sessions


class FaultyProposer:
    """A test proposer wrapper that raises from `propose_batch` once it has drafted `fail_after` times
    (a drafter that breaks mid-request)."""

    def __init__(self, inner, fail_after: int):
        self.inner = inner
        self.name = f"faulty-{inner.name}"
        self.fail_after = fail_after
        self.calls = 0

    def propose_batch(self, requests):
        self.calls += 1
        if self.calls > self.fail_after:
            raise RuntimeError(f"injected drafter failure (call {self.calls})")
        return self.inner.propose_batch(requests)

    def __getattr__(self, name):
        return getattr(self.inner, name)


def replay(references: list, wrong: bool, vocab_size: int) -> ReplayProposer:
    return ReplayProposer(references, wrong, vocab_size)


def faulty(engine: dict, fail_after: int) -> FaultyProposer:
    """The proposer `drafts.factory` builds for `engine` (EngineConfig fields), failing after `fail_after` batches."""
    return FaultyProposer(build_proposer(EngineConfig(**engine)), fail_after)


def replay_spec(references: list, wrong: bool, vocab_size: int, **tuning) -> DrafterSpec:
    """A drafter replaying `references` ((prompt ids, target-only output ids) pairs) in the worker."""
    kwargs = {"references": [[list(p), list(o)] for p, o in references], "wrong": wrong, "vocab_size": vocab_size}
    return DrafterSpec(proposer_import=ProposerImport(path=f"{__name__}:replay", kwargs=kwargs), **tuning)


def faulty_spec(spec: DrafterSpec, fail_after: int, **tuning) -> DrafterSpec:
    """`spec`'s in-worker engine drafter, raising from its (fail_after + 1)-th draft batch on."""
    kwargs = {"engine": spec.engine.model_dump(mode="json"), "fail_after": fail_after}
    return DrafterSpec(proposer_import=ProposerImport(path=f"{__name__}:faulty", kwargs=kwargs), **tuning)
