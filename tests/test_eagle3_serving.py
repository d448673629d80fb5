"""The EAGLE-3 draft served on the torch runner (proposer 'eagle3'): the verifier's runner captures the states
entering the draft's three fused layers, side by side, for the sessions whose draft reads them; the
feature-fed proposer fuses them and drafts chains or EAGLE-2 dynamic trees; the output stays the target's
(greedy equality against transformers in fp32, sequential and pipelined, chains and trees), the sampled
distribution is the target's (chi-square), and the shipped draft validates above a threshold on held-out
prompts."""

from __future__ import annotations

import json

import pytest
import torch

from cluster.core.config import EngineConfig
from cluster.core.errors import ConfigError
from cluster.core.sampling import SamplingParams
from cluster.model.runner import TorchModelRunner
from cluster.model.verifier import Round, VerifierEngine
from cluster.session.speculate import SpeculativeDecoder
from drafts.eagle3_model import Eagle3Draft, fusion_layers
from drafts.factory import make_proposer
from drafts.routing import needs_features, target_feature_layers
from drafts.feature_proposer import SHIPPED_EAGLE3, FeatureProposer, target_features
from tests.helpers import tiny_llama, torch_threads
from tests.test_sampling_e2e import FALSE_ALARM, chi_square_pvalue, exact_continuation_probs

MAX_TOKENS = 40
PROMPTS = [
    ("def fibonacci(n):\n    \"\"\"Return the n-th Fibonacci number.\"\"\"\n", False),
    ("class Stack:\n    def __init__(self):\n        self.items = []\n\n    def push(self, item):\n", False),
    ("Write a short poem about the moon.", True),
]


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    with torch_threads(1):
        yield


def eagle3_config(**kwargs) -> EngineConfig:
    return EngineConfig.build(proposer="eagle3", backend="torch", dtype="float32", **kwargs)


def test_config_routes_the_shipped_draft_and_refuses_others(tmp_path):
    config = eagle3_config()
    assert config.draft == "eagle3", "proposer 'eagle3' with no draft of its own takes the shipped one"
    assert needs_features(config) and target_feature_layers(config) == fusion_layers(30) == (2, 15, 27)
    # the same draft directory through proposer 'draft' (and the hybrid) is fed the same way
    assert target_feature_layers(EngineConfig.build(proposer="hybrid", draft=str(SHIPPED_EAGLE3))) == (2, 15, 27)
    # the EAGLE-1 style draft reads the last hidden state; vLLM's own method reads the layers itself
    assert target_feature_layers(EngineConfig.build(proposer="draft", draft="feature")) is None
    assert not needs_features(EngineConfig.build(proposer="eagle3", backend="vllm"))
    with pytest.raises(ConfigError, match="kind 'eagle3'"):
        make_proposer(eagle3_config(draft=str(tmp_path)), None, None)
    # inside the hybrid, its c is the one its `drafts validate` records measured
    from drafts.routing import FEATURE_DRAFT_COST_RATIO, feature_cost_ratio

    records = json.loads((SHIPPED_EAGLE3 / "tandem_draft.json").read_text())["validate"].values()
    assert feature_cost_ratio("eagle3") == pytest.approx(sum(r["cost_ratio"] for r in records) / len(records))
    assert feature_cost_ratio("feature") == FEATURE_DRAFT_COST_RATIO


def test_the_runner_sends_the_three_layers(target_fp32, tokenizer):
    """Engine level: a feature session gets, with its prefill and each round, the states entering layers 2, 15
    and 27 side by side (3H wide) for exactly the committed positions fed, equal to a plain forward's; the
    logits (and so the output) are the model's own."""
    layers = fusion_layers(target_fp32.config.num_hidden_layers)
    engine = VerifierEngine(TorchModelRunner(target_fp32, name="target", feature_layers=layers))
    hidden = target_fp32.config.hidden_size
    ids = tokenizer("def add(a, b):\n    return a + b\n\ndef sub(a, b):\n")["input_ids"]
    truth = target_fp32.generate(torch.tensor([ids]), max_new_tokens=8, do_sample=False)[0].tolist()
    n, prompt_features = engine.open("f", ids, SamplingParams(max_tokens=32), features=True)[:2]
    assert prompt_features.shape == (len(ids) - 1, 3 * hidden)
    rows, committed, results = [prompt_features], list(ids), []
    for r, draft in enumerate([truth[n:n + 2], [truth[n + 3], 0]]):
        draft = draft if committed == truth[:len(committed)] else []
        engine.submit(Round("f", r, engine._sessions["f"].epoch, draft, None, True), results.append)
        engine.step()
        got = results[-1]
        assert got.feature_start == len(committed) - 1 and got.features.shape[1] == 3 * hidden
        rows.append(got.features)
        committed += got.output_token_ids
    assert committed == truth[:len(committed)]
    with torch.no_grad():
        expected = target_features(target_fp32, torch.tensor([committed]), layers)[:-1]
    got = torch.cat(rows)
    assert got.shape == expected.shape
    torch.testing.assert_close(got.float(), expected, atol=0.05, rtol=0.02)  # bf16 on the wire
    with pytest.raises(ValueError, match="outside"):
        TorchModelRunner(target_fp32, feature_layers=(2, 30))


@pytest.mark.parametrize("case", [
    {"loop": {}, "tree_width": 1},
    {"loop": {"pipeline_depth": 2, "overlap": True}, "tree_width": 1},
    {"loop": {}, "tree_width": 4},
], ids=["chain", "chain-pipelined", "dynamic-tree"])
def test_greedy_equals_transformers(target_fp32, tokenizer, prompt_ids, references, case):
    config = eagle3_config(tree_width=case["tree_width"], tree_tokens=12)
    proposer = make_proposer(config, target_fp32, tokenizer)
    assert isinstance(proposer, FeatureProposer) and isinstance(proposer.draft, Eagle3Draft)
    runner = TorchModelRunner(target_fp32, name="target", feature_layers=target_feature_layers(config))
    decoder = SpeculativeDecoder(runner, proposer, tokenizer, 3, **case["loop"])
    drafted = accepted = rounds = 0
    for ids in prompt_ids:
        result = decoder.generate(ids, SamplingParams(max_tokens=MAX_TOKENS))
        assert result.token_ids == references[tuple(ids)][: len(result.token_ids)], f"diverged on {ids[:6]}"
        assert len(result.token_ids) == MAX_TOKENS or result.finish_reason == "stop"
        drafted, accepted, rounds = drafted + result.stats.drafted, accepted + result.stats.accepted, rounds + \
            result.stats.rounds
    assert proposer.proposals_without_features == 0, "every round had the target's three layers"
    assert proposer.num_sessions == 0 and runner.num_sessions == 0
    assert drafted > 0 and accepted > 0.1 * rounds, (accepted, drafted, rounds)  # the trained draft is read
    if case["tree_width"] > 1:
        assert decoder.metrics.tree_rounds > 0.8 * rounds, (decoder.metrics.tree_rounds, rounds)


@pytest.mark.parametrize("loop", [{}, {"pipeline_depth": 2}], ids=["sequential", "pipelined"])
def test_sampling_follows_target(loop):
    """An EAGLE-3 draft made from a tiny target (reduced vocabulary: 8 of its 10 tokens, its fusion perturbed),
    sampled at temperature 1: the output's distribution is the target's."""
    target = tiny_llama(seed=2)
    torch.manual_seed(5)
    draft = Eagle3Draft(target, torch.arange(8)).eval()
    with torch.no_grad():
        draft.fc.weight.add_(0.3 * torch.randn_like(draft.fc.weight))
    proposer = FeatureProposer(draft)
    runner = TorchModelRunner(target, feature_layers=draft.feature_layers)
    decoder = SpeculativeDecoder(runner, proposer, None, 3, **loop)
    prompt, params = [1, 4, 2, 7], SamplingParams(temperature=1.0)
    exact = exact_continuation_probs(target, prompt, 3, params)
    results = [decoder.generate(prompt, params.model_copy(update={"seed": i, "max_tokens": 3})) for i in range(1500)]
    assert decoder.metrics.rounds > 1500 and proposer.proposals_without_features == 0
    assert sum(r.stats.drafted for r in results) > 1500 and sum(r.stats.accepted for r in results) > 0
    assert chi_square_pvalue([tuple(r.token_ids) for r in results], exact) > FALSE_ALARM


def test_shipped_draft_provenance_and_validate_gate(target_fp32, tokenizer):
    from cluster.core.workloads import humaneval_prompts
    from drafts.training.validate import validate

    meta = json.loads((SHIPPED_EAGLE3 / "tandem_draft.json").read_text())
    assert meta["kind"] == "eagle3" and meta["fusion_layers"] == [2, 15, 27]
    assert "tools.eagle3 " in meta["training_command"] and meta["steps"] > 0 and "seed" in meta
    assert meta["data"]["answer_tokens"] > 0 and meta["data"]["recipe"]["heldout_prompts"] > 0
    assert (SHIPPED_EAGLE3 / "draft.safetensors").stat().st_size <= 20 * 2**20
    assert {"humaneval", "chat"} <= set(meta["validate"]), "its `drafts validate` report travels with it"
    proposer = make_proposer(eagle3_config(tree_width=4, tree_tokens=12), target_fp32, tokenizer)
    prompts = [tokenizer(p)["input_ids"] for p in humaneval_prompts()[:2]]  # held out of its training data
    report = validate(target_fp32, proposer, prompts, max_tokens=24, max_gamma=3, vllm_step_s=0.5 * 0.03)
    assert report["alpha"] >= 0.2, report["alpha"]
    assert 0 < report["cost_ratio"] < 0.5 and proposer.num_sessions == 0
    # per engine: c against each engine's step, the best chain and (torch) the best dynamic-tree budget
    tree, engines = report["tree"], report["engines"]
    assert [t["budget"] for t in tree["budgets"]] == [4, 8, 12] and tree["depth"] == 3
    for t in tree["budgets"]:
        assert 1.0 < t["tokens_per_round"] <= 4.0 and 0 < t["mean_nodes"] <= t["budget"]
    # a wider tree holds the chain's path and more: it commits at least as much a round as a 1-wide one would
    chain = report["by_gamma"][2]["mean_accepted_length"]
    assert tree["budgets"][-1]["tokens_per_round"] >= chain - 0.05, (tree, chain)
    assert engines["torch"]["tree_budget"] in (4, 8, 12) and engines["torch"]["tree_predicted_speedup"] > 0
    assert engines["vllm"]["cost_ratio"] > engines["torch"]["cost_ratio"] or report["target_step_s"] < 0.015
    assert 1 <= engines["vllm"]["chain_gamma"] <= 3 and "tree_predicted_speedup" not in engines["vllm"]
    assert report["verify_curve"][1] == 1.0 and report["verify_curve"][32] > 1.0


def test_verify_cost_and_tree_paths():
    from drafts.training.validate_engines import accepted_path, verify_cost

    curve = {1: 0.01, 2: 0.011, 4: 0.013, 8: 0.02}
    assert verify_cost(curve, 1) == 1.0 and abs(verify_cost(curve, 3) - 1.2) < 1e-9
    assert abs(verify_cost(curve, 6) - 1.65) < 1e-9 and abs(verify_cost(curve, 12) - 2.7) < 1e-9  # extrapolated
    # root children 5 and 7; 7 -> 8 -> 9; 5 -> 6
    tokens, parents = [5, 7, 6, 8, 9], [-1, -1, 0, 1, 3]
    assert accepted_path(tokens, parents, [7, 8, 9, 1]) == 3 and accepted_path(tokens, parents, [5, 6, 6]) == 2
    assert accepted_path(tokens, parents, [4]) == 0 and accepted_path([], [], [1]) == 0


def test_the_shipped_draft_is_written_in_vllms_layout_once(tmp_path, model_dir):
    """On vLLM, proposer 'eagle3' with tandem's draft: its vLLM layout is written once under the cache, from
    tandem's files and the target (the head rows at d2t), with the same weights."""
    from safetensors.torch import load_file

    from cluster.vllm.eagle3 import checked_eagle3_dir

    out = checked_eagle3_dir("eagle3", target=model_dir, cache=tmp_path)
    config = json.loads((out / "config.json").read_text())
    assert config["architectures"] == ["LlamaForCausalLMEagle3"]
    assert config["eagle_aux_hidden_state_layer_ids"] == [2, 15, 27]
    ours, theirs = load_file(SHIPPED_EAGLE3 / "draft.safetensors"), load_file(out / "model.safetensors")
    assert torch.equal(ours["fc.weight"], theirs["fc.weight"])
    assert torch.equal(ours["d2t"] + 0, theirs["d2t"] + torch.arange(len(ours["d2t"])))  # vLLM's offsets
    stamp = (out / "model.safetensors").stat().st_mtime_ns
    assert checked_eagle3_dir(str(SHIPPED_EAGLE3), target=model_dir, cache=tmp_path) == out
    assert (out / "model.safetensors").stat().st_mtime_ns == stamp, "written once"
    with pytest.raises(ConfigError, match="engine.draft"):
        checked_eagle3_dir(str(tmp_path), target=model_dir, cache=tmp_path)
