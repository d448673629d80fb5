"""Drafts made from the target: reduced-vocabulary and self-speculative drafts keep greedy output
exact; distillation raises acceptance; `validate` agrees with the loop; adaptive γ; the CLI gate."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch

from cluster.core.sampling import SamplingParams
from cluster.model.runner import TorchModelRunner
from cluster.session.speculate import SpeculativeDecoder
from deployments.cli import main
from drafts.draft_model import DraftModelProposer
from drafts.policy import SpeculationPolicy, SpeculationPolicyConfig
from drafts.small_draft import DraftSpec, build_draft, load_draft, save_draft
from drafts.training.distill import DistillConfig, distill, greedy_agreement, stdlib_texts
from drafts.training.validate import agreement, replay_rounds, validate
from tests.helpers import OracleProposer, torch_threads

PROMPTS = [
    ("def binary_search(items, target):\n", False),
    ("import json\n\ndef load_config(path):\n", False),
    ("The history of the bicycle begins", False),
    ("How do plants make food?", True),
]
MAX_TOKENS = 32


def _subset(tokenizer, size=2048):
    ids = tokenizer("def return import the of and to a in is for if else self None True False print "
                    "( ) : , . = \n    ")["input_ids"]
    return sorted(set(range(size)) | set(ids) | {tokenizer.eos_token_id})


@pytest.mark.parametrize("self_speculative", [False, True], ids=["distilled-shape", "self-speculative"])
def test_reduced_vocab_and_self_speculative_drafts_keep_greedy_exact(target_fp32, tokenizer, prompt_ids, references,
                                                                    self_speculative, tmp_path, engine_fp32):
    spec = DraftSpec(layers=[0, 1], vocab=_subset(tokenizer), self_speculative=self_speculative)
    draft = build_draft(target_fp32, spec)
    save_draft(draft, tmp_path)
    draft = load_draft(tmp_path, target_fp32)  # the round trip is what serving loads
    if self_speculative:
        assert draft.model.layers[0] is target_fp32.model.layers[0]  # shares the target's weights
        assert set(os.listdir(tmp_path)) >= {"tandem_draft.json", "model.safetensors"}
    logits = draft(torch.tensor([prompt_ids[0]])).logits[0, -1]
    assert torch.isinf(logits).sum() == logits.numel() - len(spec.vocab)  # only the subset is scored
    decoder = SpeculativeDecoder(TorchModelRunner(engine_fp32), DraftModelProposer(TorchModelRunner(draft)),
                                 tokenizer, num_speculative_tokens=4)
    for ids in prompt_ids:
        result = decoder.generate(ids, SamplingParams(max_tokens=MAX_TOKENS))
        assert result.token_ids == references[tuple(ids)]
        assert result.stats.drafted > 0


def test_sampling_with_a_reduced_vocab_draft_stays_in_the_target_support(target_fp32, tokenizer, prompt_ids,
                                                                        engine_fp32):
    """q = 0 outside the subset: rejection sampling must still reach tokens only the target proposes."""
    spec = DraftSpec(layers=[0], vocab=_subset(tokenizer, 512))
    draft = build_draft(target_fp32, spec)
    decoder = SpeculativeDecoder(TorchModelRunner(engine_fp32), DraftModelProposer(TorchModelRunner(draft)),
                                 tokenizer, num_speculative_tokens=3)
    result = decoder.generate(prompt_ids[2], SamplingParams(max_tokens=24, temperature=1.0, seed=3))
    assert len(result.token_ids) == 24 and any(t not in set(spec.vocab) for t in result.token_ids)


def test_distillation_raises_acceptance_on_held_out_text(target_fp32, tokenizer, tmp_path):
    code, prose = stdlib_texts(max_files=400)
    # 50 documents are plenty for 30 steps of 4 x 64 tokens
    train, held_out = code[40:80] + prose[10:20], code[:6] + prose[:2]
    config = DistillConfig(layers=[0], vocab_size=2048, seq_len=64, batch_size=4, lr=3e-3, max_tokens=30 * 256,
                           chat_samples=0, seed=0, checkpoint_every=15, threads=1)  # held-out α 0.07 -> 0.14
    report = distill(target_fp32, tokenizer, tmp_path, config, texts=train, eval_texts=held_out, progress=False)
    assert report["finished"] and report["steps"] == 30
    assert report["alpha_held_out_after"] > report["alpha_held_out_before"] + 0.05, report
    draft = load_draft(tmp_path, target_fp32)
    sequences = [tokenizer(t)["input_ids"][:128] for t in held_out]
    assert greedy_agreement(target_fp32, draft, sequences) == pytest.approx(report["alpha_held_out_after"], abs=0.05)
    provenance = draft.tandem_spec.provenance
    assert provenance["seed"] == 0 and provenance["steps"] == 30 and provenance["command"] == "tandem drafts distill"
    # resume: a finished run has nothing left to do and keeps its step count
    again = distill(target_fp32, tokenizer, tmp_path, config, texts=train, eval_texts=held_out, progress=False)
    assert again["steps"] == 30


def test_replay_rounds_matches_the_loop_by_hand():
    agree = [True, True, False, True, True, True, True, False]
    drafted, accepted, rounds = replay_rounds(agree, gamma=3)
    # rounds: [T T F] accepts 2 (+1) -> pos 3; [T T T] accepts 3 (+1) -> pos 7; k = min(3, 0) = 0 -> pos 8
    assert rounds == 3 and drafted == [2, 2, 2] and accepted == [2, 2, 1]


def test_validate_agrees_with_the_speculation_loop(target_fp32, draft_int8, tokenizer, prompt_ids, engine_fp32):
    report = validate(engine_fp32, draft_int8, prompt_ids, max_tokens=MAX_TOKENS, max_gamma=4)
    decoder = SpeculativeDecoder(TorchModelRunner(engine_fp32), DraftModelProposer(TorchModelRunner(draft_int8)),
                                 tokenizer, num_speculative_tokens=3)
    drafted = accepted = 0
    for ids in prompt_ids:
        stats = decoder.generate(ids, SamplingParams(max_tokens=MAX_TOKENS, ignore_eos=True)).stats
        drafted, accepted = drafted + stats.drafted, accepted + stats.accepted
    predicted = report["by_gamma"][2]
    assert predicted["gamma"] == 3
    assert abs(predicted["acceptance_rate"] - accepted / drafted) < 0.05, (predicted, accepted / drafted)
    assert 0 < report["cost_ratio"] and 1 <= report["recommended_gamma"] <= 4
    assert len(report["acceptance_by_position"]) == 4
    first = agreement(target_fp32, draft_int8, prompt_ids[0], 8)
    assert len(first.tokens) == len(first.agree) == 8


def test_adaptive_gamma_in_the_loop(target_fp32, tokenizer, prompt_ids, references, engine_fp32):
    policy = SpeculationPolicy(SpeculationPolicyConfig(prior_acceptance=0.7, probe_every=1000), max_gamma=6)
    vocab = target_fp32.config.vocab_size
    for wrong in (False, True):
        decoder = SpeculativeDecoder(TorchModelRunner(engine_fp32), OracleProposer(references, vocab, wrong=wrong),
                                     tokenizer, num_speculative_tokens=6, policy=policy)
        result = decoder.generate(prompt_ids[0], SamplingParams(max_tokens=MAX_TOKENS))
        assert result.token_ids == references[tuple(prompt_ids[0])]
        counts = result.stats.gamma_counts
        if wrong:  # falls to plain decoding (after the running α decays) and stays there
            assert counts[0] >= len(result.token_ids) // 2 and counts[0] > sum(counts[1:])
        else:  # grows to the maximum
            assert len(counts) == 7 and counts[6] >= 3


def test_validate_cli_gate(tmp_path, capsys):
    """`tandem drafts validate`: the report, its plot and JSON, and the gate's exit status: the process once (below
    the gate: 1), and the CLI's `main` in this process above it (0; a second process would import torch,
    transformers and Ray again, ~6 s of CPU)."""
    base = ["drafts", "validate", "--prompts", "2", "--max-tokens", "16", "--max-gamma", "3", "--threads", "1"]
    gate = subprocess.run([sys.executable, "-m", "deployments.cli", *base, "--min-acceptance", "0.999", "--json",
                           str(tmp_path / "v.json"), "--plot", str(tmp_path / "v.png")],
                          capture_output=True, text=True, env={**os.environ, "HF_HUB_OFFLINE": "1"}, timeout=600)
    assert gate.returncode == 1 and "below --min-acceptance" in gate.stderr, gate.stderr
    assert "recommended γ" in gate.stdout and (tmp_path / "v.png").stat().st_size > 1000
    alpha = json.loads((tmp_path / "v.json").read_text())["alpha"]
    assert 0.1 < alpha < 0.999
    with torch_threads(1):  # the CLI sets its --threads; the worker's own are restored after
        assert main([*base, "--min-acceptance", "0.1"]) == 0
    out = capsys.readouterr()
    assert "recommended γ" in out.out and "below --min-acceptance" not in out.err


def test_training_gives_the_callers_torch_threads_back():
    """A training entry point runs with its config's threads and restores the caller's (a pytest worker or a
    server that trains keeps its own count: two workers on two cores must not each take both)."""
    from types import SimpleNamespace

    from drafts.training import restores_torch_threads

    inside = []

    @restores_torch_threads
    def train(target, tokenizer, out_dir, config):
        inside.append(torch.get_num_threads())
        raise RuntimeError("interrupted")

    before = torch.get_num_threads()
    want = 2 if before != 2 else 1
    with pytest.raises(RuntimeError):
        train(None, None, None, SimpleNamespace(threads=want))
    assert inside == [want] and torch.get_num_threads() == before
    train_kw = restores_torch_threads(lambda target, tokenizer, out_dir, config: torch.get_num_threads())
    assert train_kw(None, None, None, config=SimpleNamespace(threads=want)) == want
    assert torch.get_num_threads() == before
