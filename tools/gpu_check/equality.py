"""Greedy equality on the device: speculative decoding through `SpeculativeDecoder` must output exactly
what plain decoding (γ = 0, the same loop and runner) outputs, and plain decoding what transformers'
`generate` outputs, for chains and token trees, sequential and pipelined rounds, always-right,
always-wrong and mixed oracles, a draft model and the feature-fed draft. Random fp32 weights: exactness
does not depend on them. A sampled (temperature > 0) run checks that the rejection sampler's sampling
path runs on the device too (its distribution is tested on CPU by the test suite).
"""

from __future__ import annotations

import time
import traceback

import torch

from cluster.core.sampling import SamplingParams
from cluster.model.runner import TorchModelRunner
from cluster.session.speculate import SpeculativeDecoder
from drafts.draft_model import DraftModelProposer
from drafts.feature_proposer import FeatureProposer
from tools.gpu_check.oracles import ControlledOracle, SiblingOracle
from tools.gpu_check.shapes import Models, build_feature_draft

GAMMA = 4


def random_prompts(vocab_size: int, lengths: list[int], seed: int) -> list[list[int]]:
    """Prompts of random token ids (seeded)."""
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, vocab_size, (n,), generator=g).tolist() for n in lengths]


def first_divergence(a: list[int], b: list[int]) -> int | None:
    """Index of the first differing token (or the shorter length); None when equal."""
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return i
    return None if len(a) == len(b) else min(len(a), len(b))


def _cases(model, runner: TorchModelRunner, references: dict, tiny: bool):
    """(name, decoder factory, expectation on (drafted, accepted) or None) for one target."""
    vocab = runner.vocab_size

    def oracle(alpha, seed=0):
        return ControlledOracle(references, vocab, alpha=alpha, seed=seed)

    def decoder(proposer, gamma=GAMMA, **kw):
        return lambda: SpeculativeDecoder(runner, proposer, None, gamma, **kw)

    right = lambda d, a: a == d > 0
    wrong = lambda d, a: a == 0 and d > 0
    cases = [
        ("chain always-right", decoder(oracle(1.0)), right),
        ("chain always-wrong", decoder(oracle(0.0)), wrong),
        ("chain alpha=0.7", decoder(oracle(0.7, seed=1)), None),
        ("pipelined always-right", decoder(oracle(1.0), pipeline_depth=2), right),
        ("pipelined always-wrong, bubble fills", decoder(oracle(0.0), pipeline_depth=2, fill_min_redraft=0.0), wrong),
        ("pipelined alpha=0.7, drafter thread", decoder(oracle(0.7, seed=2), pipeline_depth=2, overlap=True), None),
        ("tree sibling-oracle", decoder(SiblingOracle(references, vocab), gamma=3), None),
        ("chain draft model (the target's weights)",
         decoder(DraftModelProposer(TorchModelRunner(model, name="draft"))), None),
        ("tree draft model (width 2)",
         decoder(DraftModelProposer(TorchModelRunner(model, name="draft"), tree_width=2), gamma=3), None),
        ("chain feature-fed draft", lambda: SpeculativeDecoder(
            runner, FeatureProposer(build_feature_draft(model, tiny, runner.device)), None, GAMMA), None),
    ]
    if runner.device.type != "cpu":  # the feature draft on the CPU beside a CUDA target
        cases.append(("chain feature-fed draft on cpu", lambda: SpeculativeDecoder(
            runner, FeatureProposer(build_feature_draft(model, tiny, torch.device("cpu")).float()), None, GAMMA),
            None))
    return cases


def _hf_greedy(model, ids: list[int], max_tokens: int, device) -> list[int]:
    with torch.inference_mode():
        x = torch.tensor([ids], device=device)  # [1, n]
        out = model.generate(x, attention_mask=torch.ones_like(x), do_sample=False, max_new_tokens=max_tokens,
                             pad_token_id=0)
    return out[0, len(ids):].tolist()


def _run_case(name, make, expect, prompts, plain, params) -> dict:
    case = {"case": name}
    t0 = time.perf_counter()
    try:
        dec = make()
        drafted = accepted = 0
        diverged = []
        for i, ids in enumerate(prompts):
            result = dec.generate(ids, params)
            drafted, accepted = drafted + result.stats.drafted, accepted + result.stats.accepted
            at = first_divergence(result.token_ids, plain[i])
            if at is not None:
                diverged.append({"prompt": i, "first_divergence": at})
        m = dec.metrics
        case.update(equal=not diverged, diverged=diverged, drafted=drafted, accepted=accepted,
                    tree_rounds=m.tree_rounds, tree_branch_hits=m.tree_branch_hits, bubble_fills=m.bubble_fills,
                    stale_rounds=m.stale_rounds,
                    sessions_released=dec.target.num_sessions == 0 and dec.engine.num_sessions == 0)
        case["expectation_ok"] = expect(drafted, accepted) if expect is not None else None
    except Exception as e:  # recorded: a case that fails on the device is a finding, not the end of the run
        case.update(equal=False, error=f"{type(e).__name__}: {e}", traceback=traceback.format_exc()[-3000:])
    case["seconds"] = round(time.perf_counter() - t0, 3)
    return case


def _sampled_smoke(model, runner: TorchModelRunner, prompt: list[int], max_tokens: int) -> dict:
    """Temperature 0.8 with a draft model (q sent along): runs, fills max_tokens, repeats under its seed."""
    out = {"case": "sampled draft model, temperature 0.8, seed 7"}
    try:
        dec = SpeculativeDecoder(runner, DraftModelProposer(TorchModelRunner(model, name="draft")), None, GAMMA)
        params = SamplingParams(max_tokens=max_tokens, temperature=0.8, seed=7)
        a, b = dec.generate(prompt, params), dec.generate(prompt, params)
        out.update(ok=len(a.token_ids) == max_tokens, repeatable=a.token_ids == b.token_ids,
                   drafted=a.stats.drafted, accepted=a.stats.accepted)
    except Exception as e:
        out.update(ok=False, error=f"{type(e).__name__}: {e}", traceback=traceback.format_exc()[-3000:])
    return out


def greedy_equality(models: Models, targets: list[str], tiny: bool, budget, only: set[str] | None = None) -> dict:
    """The section: per fp32 target, every case against plain decoding. `only`: run these cases alone."""
    lengths, max_tokens = ([5, 24], 10) if tiny else ([12, 300], 48)
    params = SamplingParams(max_tokens=max_tokens)
    out = {"dtype": "float32", "gamma": GAMMA, "max_tokens": max_tokens, "prompt_lengths": lengths, "targets": {}}
    for name in targets:
        if not budget.allows(f"greedy_equality/{name}", 5 if tiny else 40):
            continue
        model = models.target(name, "float32")
        runner = TorchModelRunner(model, name="target")
        prompts = random_prompts(runner.vocab_size, lengths, seed=3)
        plain_dec = SpeculativeDecoder(runner, None)
        plain = [plain_dec.generate(ids, params).token_ids for ids in prompts]
        references = {tuple(ids): ref for ids, ref in zip(prompts, plain)}
        hf = [_hf_greedy(model, ids, max_tokens, runner.device) for ids in prompts]
        cases = [{"case": "plain decoding vs transformers generate", "equal": hf == plain,
                  "diverged": [{"prompt": i, "first_divergence": first_divergence(p, h)}
                               for i, (p, h) in enumerate(zip(plain, hf)) if p != h]}]
        for case_name, make, expect in _cases(model, runner, references, tiny):
            if only is None or case_name in only:
                cases.append(_run_case(case_name, make, expect, prompts, plain, params))
        out["targets"][name] = {"cases": cases, "sampled": _sampled_smoke(model, runner, prompts[0], max_tokens)}
    ran = [c for t in out["targets"].values() for c in t["cases"]]
    out["all_equal"] = bool(ran) and all(c["equal"] and c.get("expectation_ok") is not False for c in ran)
    out["errors"] = [f"{t}: {c['case']}: {c['error']}" for t, v in out["targets"].items()
                     for c in [*v["cases"], v["sampled"]] if "error" in c]
    return out
