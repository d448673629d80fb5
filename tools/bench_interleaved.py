"""Target-only vs draft(int8) vs ngram vs hybrid, side by side in one process (bf16, 1 thread, γ 3),
prompt by prompt (every mode decodes prompt i, in rotating order, before any decodes prompt i + 1, so
a change of the shared machine's load hits every mode alike).

    python tools/bench_interleaved.py PROMPTS MAX_TOKENS OUT.json "default;min_match=2"

(the last argument: hybrid variants, `;`-separated `key=value,...` overrides of HybridProposer)."""
import json
import sys

import torch

torch.set_num_threads(1)
from cluster.core.sampling import SamplingParams
from cluster.core.workloads import workload
from cluster.model import models
from cluster.model.models import encode_prompt
from cluster.model.runner import TorchModelRunner
from cluster.session.speculate import SpeculativeDecoder
from drafts.cost_model import effective_alpha
from drafts.draft_model import DraftModelProposer, quantized_copy
from drafts.hybrid import HybridProposer
from drafts.ngram import NGramProposer
from tools.bench import ModeResult, _run_decoder

GAMMA, PROMPTS, MAX_TOKENS = 3, int(sys.argv[1]) if len(sys.argv) > 1 else 8, int(sys.argv[2]) if len(sys.argv) > 2 else 128
path = models.prepare_default_model()
tok = models.load_tokenizer(path)
target_model = models.load_causal_lm(path, "bfloat16", "cpu")
target = TorchModelRunner(target_model, name="target")
draft_model = quantized_copy(target_model)
draft = lambda: DraftModelProposer(TorchModelRunner(draft_model, "draft"))
params = SamplingParams.build(max_tokens=MAX_TOKENS)
VARIANTS = sys.argv[4].split(";") if len(sys.argv) > 4 else ["default"]
report = {}
for name in ("humaneval", "chat"):
    texts, chat = workload(name, PROMPTS)
    prompts = [encode_prompt(tok, t, chat) for t in texts]
    plain = SpeculativeDecoder(target, None, tok, 0)
    plain.generate(prompts[0], params.model_copy(update={"max_tokens": 8}))  # warm-up
    proposers = {"target_only": None, "draft_int8": draft(), "ngram": NGramProposer()}
    for variant in VARIANTS:
        kwargs = dict(x.split("=") for x in variant.split(",")) if variant != "default" else {}
        proposers[f"hybrid[{variant}]"] = HybridProposer(draft(), **{k: int(v) for k, v in kwargs.items()})
    decoders = {mode: SpeculativeDecoder(target, p, tok, GAMMA if p else 0) for mode, p in proposers.items()}
    results = {mode: ModeResult() for mode in proposers}
    for i, ids in enumerate(prompts):  # interleaved: every mode decodes prompt i before prompt i + 1
        order = list(decoders)[i % len(decoders):] + list(decoders)[:i % len(decoders)]
        for mode in order:
            r = _run_decoder(decoders[mode], [ids], params)
            acc = results[mode]
            acc.tokens += r.tokens; acc.seconds += r.seconds; acc.outputs += r.outputs; acc.stats.merge(r.stats)
    rows, base = {}, results["target_only"]
    step_s = (base.stats.total_s - base.stats.prefill_s) / max(1, base.stats.num_generated_tokens)
    for mode, proposer in proposers.items():
        r = results[mode]
        s = r.stats
        row = {"tokens_per_s": round(r.tokens_per_s, 2), "speedup": round(r.tokens_per_s / base.tokens_per_s, 3),
               "diverged": sum(o != b for o, b in zip(r.outputs, base.outputs))}
        if proposer is not None:
            row.update(accept_rate=round(s.acceptance_rate, 3), mean_acc_len=round(s.mean_accepted_length, 2),
                       alpha=round(effective_alpha(s.mean_accepted_length, GAMMA), 3),
                       c=round((s.draft_s / s.drafted) / step_s, 3) if s.drafted else 0.0)
        if isinstance(proposer, HybridProposer):
            row["sources"] = proposer.report()
        rows[mode] = row
        print(name, mode, json.dumps(row), flush=True)
    report[name] = rows
json.dump(report, open(sys.argv[3] if len(sys.argv) > 3 else "bench-interleaved.json", "w"), indent=1)
