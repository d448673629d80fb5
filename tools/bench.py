"""`tandem bench`: single-process speculative decoding against target-only decoding, side by side.

Every mode runs in one process on the same weights, dtype and torch threads, one prompt at a time,
and is timed end to end (prefill included). Ratios are what matter on a shared, noisy machine.
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from cluster.core.config import EngineConfig
from cluster.core.sampling import SamplingParams
from cluster.core.workloads import workload
from cluster.model import models
from cluster.model.models import encode_prompt
from cluster.model.runner import TorchModelRunner
from cluster.session.speculate import SpeculationStats, SpeculativeDecoder
from drafts.cost_model import effective_alpha, predicted_speedup
from drafts.draft_model import quantized_copy
from drafts.factory import make_proposer
from drafts.feature_proposer import FEATURE_DRAFT, feature_draft_dir, is_feature_draft
from drafts.small_draft import draft_path

MATCH_TOKENS = EngineConfig.model_fields["match_tokens"].default  # the hybrid's long match rounds, as served

log = logging.getLogger(__name__)


@dataclass
class ModeResult:
    tokens: int = 0
    seconds: float = 0.0
    outputs: list[list[int]] = field(default_factory=list)
    stats: SpeculationStats = field(default_factory=SpeculationStats)

    @property
    def tokens_per_s(self) -> float:
        return self.tokens / self.seconds if self.seconds else 0.0


def _run_decoder(decoder: SpeculativeDecoder, prompts: list[list[int]], params: SamplingParams) -> ModeResult:
    result = ModeResult()
    for ids in prompts:
        t0 = time.perf_counter()
        out = decoder.generate(ids, params)
        result.seconds += time.perf_counter() - t0
        result.tokens += len(out.token_ids)
        result.outputs.append(out.token_ids)
        result.stats.merge(out.stats)
    return result


def _run_hf(model, prompts: list[list[int]], max_tokens: int, **generate_kwargs) -> ModeResult:
    result = ModeResult()
    for ids in prompts:
        input_ids = torch.tensor([ids])
        t0 = time.perf_counter()
        with torch.inference_mode():
            out = model.generate(input_ids, attention_mask=torch.ones_like(input_ids), do_sample=False,
                                 max_new_tokens=max_tokens, **generate_kwargs)
        result.seconds += time.perf_counter() - t0
        generated = out[0, len(ids):].tolist()
        result.tokens += len(generated)
        result.outputs.append(generated)
    return result


def _first_divergence_gap(target: TorchModelRunner, prompt: list[int], a: list[int], b: list[int]) -> float | None:
    """Where `b` first leaves target-only output `a`: how far b's token's logit lies below the
    target's best, as target-only decoding computes it (one token per forward). None if equal."""
    n = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), None)
    if n is None:
        return None
    session = target.add_session()
    try:
        target.extend(session, prompt[:-1], num_logits=0)
        for token in [prompt[-1], *a[:n]]:
            logits = target.extend(session, [token], num_logits=1)[0]  # [vocab_size]
    finally:
        target.release(session)
    return float(logits.max() - logits[b[n]])


def run_bench(workloads: list[str], num_prompts: int, max_tokens: int, gamma: int = 4,
              dtype: str = "bfloat16", threads: int = 1, cache_dir: str | None = None,
              include_hf: bool = True, drafts: list[str] = ()) -> dict:
    """`drafts`: tandem draft directories benchmarked beside the int8 copy."""
    torch.set_num_threads(threads)
    path = models.prepare_default_model(cache_dir)
    tokenizer = models.load_tokenizer(path)
    target_model = models.load_causal_lm(path, dtype, "cpu")
    target = TorchModelRunner(target_model, name="target")
    draft_model = quantized_copy(target_model)
    draft_model.generation_config.num_assistant_tokens = gamma
    draft_model.generation_config.num_assistant_tokens_schedule = "constant"
    draft_model.generation_config.assistant_confidence_threshold = 0.0
    params = SamplingParams.build(max_tokens=max_tokens)
    def mode(**engine) -> Callable[[], SpeculativeDecoder]:  # every proposer comes from drafts.factory
        config = EngineConfig.build(target=str(path), num_speculative_tokens=gamma, dtype=dtype, cache_dir=cache_dir,
                                    **engine)
        return lambda: SpeculativeDecoder(target, make_proposer(config, target_model, tokenizer), tokenizer, gamma)

    spec_modes = {
        "draft_int8": mode(proposer="draft"),
        "ngram": mode(proposer="ngram"),
        "hybrid": mode(proposer="hybrid", match_tokens=MATCH_TOKENS),
        "hybrid_gamma_matches": mode(proposer="hybrid", match_tokens=0),  # match rounds γ long, like the model's
    }
    for name in drafts:
        label = (("feature" if name == FEATURE_DRAFT else f"feature_{feature_draft_dir(name).name}")
                 if is_feature_draft(name) else draft_path(name).name)
        spec_modes[f"draft_{label}"] = mode(proposer="draft", draft=name)
        if is_feature_draft(name):  # reads the target's features: alone and as the hybrid's model
            spec_modes[f"hybrid_{label}"] = mode(proposer="hybrid", draft=name, match_tokens=MATCH_TOKENS)
    report: dict = {"config": {"dtype": dtype, "threads": threads, "num_speculative_tokens": gamma,
                               "max_tokens": max_tokens, "prompts": num_prompts}, "workloads": {}}
    for name in workloads:
        texts, chat = workload(name, num_prompts)
        prompts = [encode_prompt(tokenizer, t, chat) for t in texts]
        plain = SpeculativeDecoder(target, None, tokenizer, 0)
        plain.generate(prompts[0], params.model_copy(update={"max_tokens": 8}))  # warm-up
        modes: dict[str, ModeResult] = {"target_only": _run_decoder(plain, prompts, params)}
        base = modes["target_only"]
        step_s = (base.stats.total_s - base.stats.prefill_s) / max(1, base.stats.num_generated_tokens)
        entry: dict = {"prompts": len(prompts), "target_step_ms": step_s * 1e3}
        if include_hf:
            modes["hf_generate"] = _run_hf(target_model, prompts, max_tokens)
            modes["hf_assisted_draft_int8"] = _run_hf(target_model, prompts, max_tokens, assistant_model=draft_model)
            modes["hf_prompt_lookup"] = _run_hf(target_model, prompts, max_tokens, prompt_lookup_num_tokens=gamma)
        for mode, make in spec_modes.items():
            modes[mode] = _run_decoder(make(), prompts, params)

        for mode, result in modes.items():
            row = {"tokens": result.tokens, "seconds": result.seconds, "tokens_per_s": result.tokens_per_s,
                   "speedup": result.tokens_per_s / base.tokens_per_s if base.tokens_per_s else 0.0}
            diverged = [i for i, out in enumerate(result.outputs) if out != base.outputs[i]]
            row["diverged_prompts"] = len(diverged)
            row["divergence_rate"] = len(diverged) / len(prompts)
            row["divergence_top2_gaps"] = [_first_divergence_gap(target, prompts[i], base.outputs[i], result.outputs[i])
                                           for i in diverged]
            s = result.stats
            if mode in spec_modes:
                c = (s.draft_s / s.drafted) / step_s if s.drafted else 0.0
                alpha = effective_alpha(s.mean_accepted_length, gamma)
                predicted = predicted_speedup(alpha, gamma, c)
                row.update(acceptance_rate=s.acceptance_rate, alpha=alpha,
                           mean_accepted_length=s.mean_accepted_length,
                           acceptance_per_position=[a / d if d else 0.0 for a, d in
                                                    zip(s.accepted_per_position, s.drafted_per_position)],
                           cost_ratio_c=c,
                           verify_step_ratio=(s.verify_s / s.rounds) / step_s if s.rounds else 0.0,
                           predicted_speedup=predicted,
                           predicted_pipelined_speedup=predicted_speedup(alpha, gamma, c, pipelined=True),
                           fraction_of_predicted=row["speedup"] / predicted if predicted else 0.0)
            entry[mode] = row
        report["workloads"][name] = entry
    return report


def format_report(report: dict) -> str:
    cfg = report["config"]
    lines = [f"dtype={cfg['dtype']} threads={cfg['threads']} γ={cfg['num_speculative_tokens']} "
             f"max_tokens={cfg['max_tokens']} prompts={cfg['prompts']}"]
    for name, entry in report["workloads"].items():
        lines.append(f"\n## {name} ({entry['prompts']} prompts, target step {entry['target_step_ms']:.1f} ms)\n")
        lines.append("| mode | tokens/s | speedup | α | accept rate | mean acc. len | c | predicted | of predicted | diverged |")
        lines.append("|---|---|---|---|---|---|---|---|---|---|")
        for mode, row in entry.items():
            if not isinstance(row, dict):
                continue
            spec = "alpha" in row
            cells = [mode, f"{row['tokens_per_s']:.2f}", f"{row['speedup']:.2f}×",
                     f"{row['alpha']:.2f}" if spec else "", f"{row['acceptance_rate']:.2f}" if spec else "",
                     f"{row['mean_accepted_length']:.2f}" if spec else "", f"{row['cost_ratio_c']:.3f}" if spec else "",
                     f"{row['predicted_speedup']:.2f}×" if spec else "",
                     f"{row['fraction_of_predicted']:.0%}" if spec else "",
                     f"{row['diverged_prompts']}/{entry['prompts']}"]
            lines.append("| " + " | ".join(cells) + " |")
        for mode, row in entry.items():
            if isinstance(row, dict) and "acceptance_per_position" in row:
                per_pos = ", ".join(f"{x:.2f}" for x in row["acceptance_per_position"])
                gaps = ", ".join(f"{g:.3f}" for g in row["divergence_top2_gaps"] if g is not None) or "none"
                lines.append(f"\n{mode}: acceptance by position [{per_pos}]; verify step / target step "
                             f"{row['verify_step_ratio']:.2f}; pipelined bound {row['predicted_pipelined_speedup']:.2f}×; "
                             f"logit gaps at divergences: {gaps}")
    return "\n".join(lines)


def write_json(report: dict, path: str) -> None:
    with open(path, "w") as f:
        json.dump(report, f, indent=2)
