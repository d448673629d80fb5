"""`python -m tools bench --engine vllm`: vLLM target-only vs vLLM + tandem's drafter (each drafter
mode) vs vLLM's own ngram, on the same prompts, greedy (`run_vllm_bench`, `format_vllm_bench`)."""

from __future__ import annotations

import copy
import logging
import os
import time
from collections.abc import Sequence

from cluster.core.config import EngineConfig
from cluster.core.sampling import SamplingParams
from cluster.core.workloads import workload
from cluster.model import models
from cluster.model.models import encode_prompt
from cluster.vllm.engine import VLLMEngine, drafter_spec
from cluster.vllm.protocol import engine_draft_tokens

log = logging.getLogger(__name__)

DRAFTER_MODES = {"overlap": {"overlap": True, "on_miss": "plain"},  # a miss: one plain step
                 "overlap_wait": {"overlap": True, "on_miss": "wait"},  # a miss: wait for the redraft
                 "sync": {"overlap": False}}  # every step drafts on demand


def run_vllm_bench(workloads: list[str], num_prompts: int, max_tokens: int, gamma: int = 3, dtype: str = "float32",
                   cache_dir: str | None = None, concurrency: int = 1,
                   drafter_modes: Sequence[str] = ("overlap", "overlap_wait", "sync"),
                   draft: str = "int8", proposer: str = "draft", eagle3_dir: str | None = None) -> dict:
    """vLLM target-only vs vLLM + tandem's drafter (overlapped with a plain step on a miss, overlapped
    waiting for the redraft on a miss, and synchronous) vs vLLM's own ngram, on
    the same prompts, greedy. `concurrency` prompts are submitted together (1: one at a time). One engine
    per method; the tandem engine is reconfigured between drafter modes. `eagle3_dir`: also vLLM's own eagle3
    method on that exported EAGLE-3 draft."""
    path = models.prepare_default_model(cache_dir)
    tokenizer = models.load_tokenizer(path)
    params = SamplingParams.build(max_tokens=max_tokens)
    prompts_by_workload = {}
    for name in workloads:
        texts, chat = workload(name, num_prompts)
        prompts_by_workload[name] = [encode_prompt(tokenizer, t, chat) for t in texts]
    tandem_config = EngineConfig.build(target=str(path), proposer=proposer, draft=draft,
                                       num_speculative_tokens=gamma, dtype=dtype)
    drafter = drafter_spec(tandem_config)
    report: dict = {"config": {"engine": "vllm", "dtype": dtype, "num_speculative_tokens": gamma,
                               "max_tokens": max_tokens, "prompts": num_prompts, "concurrency": concurrency,
                               "draft": draft, "proposer": proposer, "eagle3": eagle3_dir, "cpus": os.cpu_count()},
                    "workloads": {name: {"prompts": len(p)} for name, p in prompts_by_workload.items()}}

    def run(engine: VLLMEngine, mode: str) -> None:
        for name, prompts in prompts_by_workload.items():
            engine.generate_batch(prompts[:1], params.model_copy(update={"max_tokens": 4}))  # warm-up
            before_p = engine.proposer_stats()
            before_m = engine.spec_metrics() if engine.method else {}
            outputs, seconds = [], 0.0
            for i in range(0, len(prompts), concurrency):
                t0 = time.perf_counter()
                results = engine.generate_batch(prompts[i: i + concurrency], params)
                seconds += time.perf_counter() - t0
                outputs.extend(r.token_ids for r in results)
            tokens = sum(len(o) for o in outputs)
            row = {"tokens": tokens, "seconds": seconds, "tokens_per_s": tokens / seconds if seconds else 0.0,
                   "outputs": outputs}
            if engine.method:
                m = engine.spec_metrics()
                drafted = m["draft_tokens"] - before_m["draft_tokens"]
                accepted = m["accepted_tokens"] - before_m["accepted_tokens"]
                row.update(drafted=drafted, accepted=accepted, acceptance_rate=accepted / drafted if drafted else 0.0,
                           mean_accepted_length=tokens / max(1, tokens - accepted))
            if engine.method == "tandem":
                p = engine.proposer_stats()
                row["proposer"] = {k: v - before_p.get(k, 0) for k, v in p.items() if isinstance(v, int)
                                   and k not in ("rank", "sessions_open")}
            report["workloads"][name][mode] = row
            log.info("%s %s: %.2f tokens/s", name, mode, row["tokens_per_s"])

    for method in (None, "tandem", "ngram") + (("eagle3",) if eagle3_dir else ()):
        engine = VLLMEngine(path, dtype=dtype, method=method, eagle3_dir=eagle3_dir,
                            num_speculative_tokens=engine_draft_tokens(tandem_config) if method == "tandem" else gamma)
        try:
            if method is None:
                run(engine, "vllm_target_only")
            elif method in ("ngram", "eagle3"):
                run(engine, f"vllm_{method}")
            else:
                for mode in (drafter_modes if drafter.has_drafter else ("sync",)):  # inline lookup: no drafter to tune
                    # a fresh drafter per mode (the label is not tuning): the hybrid remembers other
                    # sessions' outputs, and these are the same prompts again
                    engine.configure(drafter.tuned(**DRAFTER_MODES[mode], wait_s=0.5, label=mode))
                    run(engine, f"vllm_tandem_{proposer if proposer != 'draft' else draft}_{mode}")
        finally:
            engine.shutdown()
    for name, entry in report["workloads"].items():
        base = entry["vllm_target_only"]
        for mode, row in entry.items():
            if isinstance(row, dict):
                row["speedup"] = row["tokens_per_s"] / base["tokens_per_s"] if base["tokens_per_s"] else 0.0
                row["diverged_prompts"] = sum(o != b for o, b in zip(row["outputs"], base["outputs"]))
    return report


def format_vllm_bench(report: dict) -> str:
    cfg = report["config"]
    lines = [f"engine=vllm dtype={cfg['dtype']} γ={cfg['num_speculative_tokens']} max_tokens={cfg['max_tokens']} "
             f"prompts={cfg['prompts']} concurrency={cfg['concurrency']} proposer={cfg.get('proposer', 'draft')} "
             f"draft={cfg['draft']} cpus={cfg['cpus']}"]
    for name, entry in report["workloads"].items():
        lines.append(f"\n## {name} ({entry['prompts']} prompts, greedy)\n")
        lines.append("| mode | tokens/s | speedup | accept rate | mean acc. len | hits / misses / [] rows | diverged |")
        lines.append("|---|---|---|---|---|---|---|")
        for mode, row in entry.items():
            if not isinstance(row, dict):
                continue
            p = row.get("proposer")
            cells = [mode, f"{row['tokens_per_s']:.2f}", f"{row['speedup']:.2f}×",
                     f"{row['acceptance_rate']:.2f}" if "acceptance_rate" in row else "",
                     f"{row['mean_accepted_length']:.2f}" if "mean_accepted_length" in row else "",
                     f"{p.get('hits', 0)} / {p.get('misses', 0)} / {p.get('empty_rows', 0)}" if p else "",
                     f"{row['diverged_prompts']}/{entry['prompts']}"]
            lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def strip_outputs(report: dict) -> dict:
    """The report without per-prompt outputs (for JSON files)."""
    out = copy.deepcopy(report)
    for entry in out["workloads"].values():
        for row in entry.values():
            if isinstance(row, dict):
                row.pop("outputs", None)
    return out
