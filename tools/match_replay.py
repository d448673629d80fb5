"""Free drafts replayed offline: how far each suffix-match rule would get on the target's own greedy output.

`python -m tools.match_replay [--refs FILE]`: greedy bf16 references from vLLM (offline `LLM`, written to
FILE once: HumanEval 0-39 and the tuning chat prompts, plus the peer bench's prompts, 256 tokens each), then for
each rule the tokens per verify step and a predicted speedup under a step cost of 1 + v per drafted token
(v = 0.03 and 0.1 of a step). Rules: tandem's prompt lookup (n 1-3, γ 3), vLLM's `ngram` as its docs
configure it (4-grams, 5 tokens), and `PricedMatch` (proposer `suffix`) learning online. A model of the
draft side only: vLLM's own per-step costs are not in it (BENCHMARKS.md compares it with the served bench).
"""

from __future__ import annotations

import argparse
import json
import os

from cluster.core import workloads
from cluster.model import models
from drafts.ngram import ngram_lookup
from drafts.suffix import PricedMatch

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


def replay(refs: list[dict], propose, learn=None, v: float = 0.03) -> dict:
    """Each reference decoded by verify steps: `propose(history, limit)` -> (draft, match) drafts, the target's
    greedy output decides; `learn(match, drafted, accepted)` hears each verdict."""
    tokens = accepted = drafted = steps = 0
    for ref in refs:
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
                propose, learn = make()
                r = replay(refs[s], propose, learn, v)
                cells.append(f"{r['speedup']:.2f}x ({r['tokens_per_step']:.2f})")
            print(f"{name:32s}" + "".join(f"{c:>18s}" for c in cells))


if __name__ == "__main__":
    main()
