"""Free drafts replayed offline: how far each suffix-match rule would get on the target's own greedy output.

`python -m tools.match_replay [--refs FILE]`: greedy bf16 references from vLLM (offline `LLM`, written to
FILE once: HumanEval 0-39 and the tuning chat prompts, plus the peer bench's prompts, 256 tokens each), then for
each rule the tokens per verify step and a predicted speedup under a step cost of 1 + v per drafted token
(v = 0.03 and 0.1 of a step). Rules: tandem's prompt lookup (n 1-3, γ 3), vLLM's `ngram` as its docs
configure it (4-grams, 5 tokens), `PricedMatch` (proposer `suffix`) learning online, and, where Arctic Inference
is installed (`make peer-extras`), vLLM's own `suffix` method at its defaults (a request's own suffix tree; then
with its global tree of the earlier references' outputs too). A model of the draft side only: vLLM's own per-step
costs are not in it (BENCHMARKS.md compares it with the served bench).
"""

from __future__ import annotations

import argparse
import json
import os

from cluster.core import workloads
from cluster.model import models
from drafts.ngram import ngram_lookup
from drafts.suffix import PooledPricedMatch, PricedMatch, SuffixPool

SETS = ("tune_he", "tune_chat", "peer_he", "peer_chat")


def references(path: str) -> dict:
    if os.path.exists(path):
        with open(path) as f:
            return json.load(f)
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "2")
    os.environ.setdefault("VLLM_HOST_IP", "127.0.0.1")
    from vllm import LLM, SamplingParams

    model = str(models.resolve_model_path("default"))
    tok = models.load_tokenizer(model)
    sets = {"tune_he": (workloads.humaneval_prompts(40), False), "tune_chat": (workloads.chat_prompts(), True),
            "peer_he": workloads.peer_workload("humaneval", 16), "peer_chat": workloads.peer_workload("chat", 16)}
    llm = LLM(model=model, dtype="bfloat16", max_model_len=2048, seed=0)
    out = {}
    for name, (prompts, chat) in sets.items():
        ids = [tok(tok.apply_chat_template([{"role": "user", "content": p}], add_generation_prompt=True, tokenize=False),
                   add_special_tokens=False).input_ids if chat else tok(p).input_ids for p in prompts]
        res = llm.generate([{"prompt_token_ids": i} for i in ids], SamplingParams(max_tokens=256, temperature=0))
        out[name] = [{"prompt": i, "out": list(r.outputs[0].token_ids)} for i, r in zip(ids, res)]
    with open(path, "w") as f:
        json.dump(out, f)
    return out


def replay(refs: list[dict], propose, learn=None, v: float = 0.03, begin=None, end=None) -> dict:
    """Each reference decoded by verify steps: `propose(history, limit)` -> (draft, match) drafts, the target's
    greedy output decides; `learn(match, drafted, accepted)` hears each verdict; `begin(prompt)` and `end()`
    bracket each reference (a rule that keeps per-request state)."""
    tokens = accepted = drafted = steps = 0
    for ref in refs:
        if begin is not None:
            begin(list(ref["prompt"]))
        history, out = list(ref["prompt"]), ref["out"]
        while len(history) < len(ref["prompt"]) + len(out):
            pos = len(history) - len(ref["prompt"])
            draft, match = propose(history, len(out) - pos - 1)
            a = 0
            while a < len(draft) and draft[a] == out[pos + a]:
                a += 1
            if learn is not None:
                learn(match, len(draft), a)
            history.extend(out[pos:pos + a + 1])
            tokens, accepted, drafted, steps = tokens + a + 1, accepted + a, drafted + len(draft), steps + 1
        if end is not None:
            end()
    cost = steps + v * drafted  # each step 1, plus v per drafted token
    return {"tokens_per_step": tokens / max(steps, 1), "speedup": tokens / max(cost, 1e-9),
            "acceptance": accepted / max(drafted, 1)}


def rules():
    yield "lookup n1-3 k3 (tandem ngram)", lambda: (lambda h, lim: (ngram_lookup(h, min(lim, 3), 3, 1), 0), None)
    yield "lookup n4 k5 (vLLM ngram)", lambda: (lambda h, lim: (ngram_lookup(h, min(lim, 5), 4, 4), 0), None)

    def priced():
        p = PricedMatch()
        return p.propose, p.learn
    yield "PricedMatch (proposer suffix)", priced
    yield "PricedMatch + pool (proposer suffix)", lambda: PooledRule().rule()
    try:
        from arctic_inference.suffix_decoding import SuffixDecodingCache  # noqa: F401
    except ImportError:
        print("(vLLM's suffix method left out: Arctic Inference is not installed; `make peer-extras`)")
        return
    yield "vLLM suffix, own tree", lambda: VLLMSuffix(global_cache=False).rule()
    yield "vLLM suffix, + global tree", lambda: VLLMSuffix(global_cache=True).rule()


class PooledRule:
    """Proposer `suffix` with its pool of earlier sessions' outputs (`drafts.suffix.PooledPricedMatch`): each
    finished reference's output joins the pool for the next ones, as a finished request's does in the proposer."""

    def __init__(self):
        self.match = PooledPricedMatch(PricedMatch(), SuffixPool())
        self.prompt, self.history = 0, []
        self.last_pooled = False

    def begin(self, prompt: list[int]) -> None:
        self.prompt, self.history = len(prompt), prompt

    def end(self) -> None:
        self.match.pool.add(self.history[self.prompt:])

    def propose(self, history: list[int], limit: int) -> tuple[list[int], int]:
        self.history = history
        draft, match, self.last_pooled = self.match.propose(history, limit)
        return draft, match

    def learn(self, match: int, drafted: int, accepted: int) -> None:
        self.match.learn(match, drafted, accepted, self.last_pooled)

    def rule(self):
        return self.propose, self.learn, self.begin, self.end


class VLLMSuffix:
    """vLLM's `suffix` method as its proposer drives Arctic Inference (`vllm/v1/spec_decode/suffix_decoding.py`, its
    defaults: trees 24 deep, up to 24 tokens, spec factor 1, tokens below probability 0.1 cut): the request's
    prompt starts its tree, each step's committed tokens are added, the last 24 tokens are matched. With the
    global tree, each finished reference's output is kept for the next ones (vLLM keeps 10,000)."""

    DEPTH, MIN_PROB = 24, 0.1

    def __init__(self, global_cache: bool):
        from arctic_inference.suffix_decoding import SuffixDecodingCache

        self.cache = SuffixDecodingCache(max_tree_depth=self.DEPTH, max_cached_requests=10000 if global_cache else 0)
        self.request, self.seen, self.count = None, 0, 0

    def begin(self, prompt: list[int]) -> None:
        self.count += 1
        self.request, self.seen = f"r{self.count}", len(prompt)
        self.cache.start_request(self.request, prompt)

    def end(self) -> None:
        self.cache.stop_request(self.request)

    def propose(self, history: list[int], limit: int) -> tuple[list[int], int]:
        if len(history) > self.seen:
            self.cache.add_active_response(self.request, history[self.seen:])
            self.seen = len(history)
        draft = self.cache.speculate(self.request, history[-self.DEPTH:], max_spec_tokens=min(self.DEPTH, limit),
                                     max_spec_factor=1.0, min_token_prob=self.MIN_PROB)
        return list(draft.token_ids), draft.match_len

    def rule(self):
        return self.propose, None, self.begin, self.end


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--refs", default=os.path.expanduser("~/.cache/tandem/match_replay_refs.json"))
    args = ap.parse_args(argv)
    refs = references(args.refs)
    for v in (0.03, 0.1):
        print(f"v={v}: predicted speedup (tokens per step)")
        print(f"{'rule':32s}" + "".join(f"{s:>18s}" for s in SETS))
        for name, make in rules():
            cells = []
            for s in SETS:
                propose, learn, *bracket = make()
                r = replay(refs[s], propose, learn, v, *bracket)
                cells.append(f"{r['speedup']:.2f}x ({r['tokens_per_step']:.2f})")
            print(f"{name:32s}" + "".join(f"{c:>18s}" for c in cells))


if __name__ == "__main__":
    main()
