"""`tandem bench --distributed`: target-only vs sequential (depth 1) vs pipelined (depth 2) speculation
through the whole Ray + gRPC path, side by side in one run, plus throughput under concurrency."""

from __future__ import annotations

import os
import statistics
import threading
import time

import ray

from cluster.core.config import EngineConfig
from cluster.core.sampling import SamplingParams
from cluster.core.stats import SpeculationStats
from cluster.core.workloads import workload
from cluster.model.models import encode_prompt
from cluster.ray.runtime import ClusterConfig, TandemCluster, init_local_ray
from drafts.cost_model import effective_alpha, predicted_speedup
from drafts.pipeline_model import pipelined_ceiling
from drafts.policy import SpeculationPolicyConfig

MODES = {  # mode -> (proposer on, pipeline_depth, fill_bubbles, extra ClusterConfig / EngineConfig fields)
    "target_only": (False, 1, False, {}),
    "sequential": (True, 1, False, {}),
    "sequential_tree": (True, 1, False, {"tree_width": 2}),  # top-2 siblings at the first draft position
    "sequential_gamma_matches": (True, 1, False, {"match_tokens": 0}),  # the hybrid's match rounds γ long
    "sequential_drafter_matches": (True, 1, False, {"own_matches": False}),  # the drafter finds every match
    # γ per session from the speculation policy, as `tandem serve` runs it (ray_config.yaml)
    "sequential_adaptive": (True, 1, False, {"speculation": SpeculationPolicyConfig(saturation_sessions=8)}),
    "pipelined": (True, 2, True, {}),  # the depth-2 chain with filled bubbles
    "pipelined_no_fill": (True, 2, False, {}),  # the same without plain steps in the post-rejection bubble
}
ENGINE_FIELDS = {"tree_width", "match_tokens", "own_matches"}


def pin_threads(cpus: set[int]) -> list[int]:
    """Pins every thread of this process to `cpus` (threads started later inherit it); the CPUs it runs on."""
    for tid in os.listdir("/proc/self/task"):
        try:
            os.sched_setaffinity(int(tid), cpus)
        except OSError:  # the thread ended meanwhile
            pass
    return sorted(os.sched_getaffinity(0))


def _pin_actor(actor, cpus: set[int]) -> list[int]:
    return ray.get(actor.__ray_call__.remote(lambda self, c: pin_threads(c), cpus))


def pin_cluster(cluster: TandemCluster) -> dict:
    """The drafter on the last CPU, the verifier's ranks on the others: the models on cores of their own (the
    nearest a machine without accelerators comes to the drafter's own device); the router and Ray's own
    processes are not pinned. Returns the CPUs of each."""
    cpus = sorted(os.sched_getaffinity(0))
    if len(cpus) < 2:
        raise ValueError("pinning the drafter and the verifier to cores of their own needs 2 CPUs")
    pinned = {}
    for replica in cluster.replicas:
        for rank, actor in enumerate(replica.ranks):
            pinned[f"{replica.name}/rank{rank}"] = _pin_actor(actor, set(cpus[:-1]))
    if cluster.drafter is not None:
        pinned["drafter"] = _pin_actor(cluster.drafter, {cpus[-1]})
    return pinned


def _concurrent(cluster: TandemCluster, prompts: list[list[int]], sessions: int, max_tokens: int) -> dict:
    results: list = [None] * sessions
    params = SamplingParams(max_tokens=max_tokens)

    def run(i: int) -> None:
        results[i] = cluster.generate(prompts[i % len(prompts)], params)

    threads = [threading.Thread(target=run, args=(i,)) for i in range(sessions)]
    t0 = time.perf_counter()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    wall = time.perf_counter() - t0
    tokens = sum(len(r.token_ids) for r in results)
    return {"sessions": sessions, "tokens": tokens, "seconds": wall, "tokens_per_s": tokens / wall}


def run_distributed_bench(workload_name: str = "humaneval", num_prompts: int = 8, max_tokens: int = 128,
                          gamma: int = 4, dtype: str = "bfloat16", proposer: str = "draft",
                          concurrency: tuple[int, ...] = (1, 4, 16), concurrency_max_tokens: int = 64,
                          modes: tuple[str, ...] = (), draft: str = "int8", pin_cpus: bool = False) -> dict:
    """`modes`: the optional modes to run besides the four the report is built on (default: all); `draft`:
    the model draft of proposers draft and hybrid ('int8', 'feature' or a draft directory); `pin_cpus`: the
    verifier and the drafter each pinned to a core of its own (`pin_cluster`)."""
    init_local_ray()
    report: dict = {"config": {"workload": workload_name, "prompts": num_prompts, "max_tokens": max_tokens,
                               "num_speculative_tokens": gamma, "dtype": dtype, "proposer": proposer, "draft": draft,
                               "threads_per_actor": 1, "pin_cpus": pin_cpus}, "modes": {}}
    texts, chat = workload(workload_name, num_prompts)
    for mode, (speculate, depth, fill, extra) in MODES.items():
        if modes and mode not in modes and mode not in ("target_only", "sequential", "pipelined", "pipelined_no_fill"):
            continue
        engine = EngineConfig(proposer=proposer if speculate else "none", num_speculative_tokens=gamma if speculate else 0,
                              dtype=dtype, threads=1, draft=draft, **{k: v for k, v in extra.items() if k in ENGINE_FIELDS})
        config = {"speculation": SpeculationPolicyConfig(adaptive=False)}  # γ as asked, unless the mode says
        config.update({k: v for k, v in extra.items() if k not in ENGINE_FIELDS})
        cluster = TandemCluster(ClusterConfig(engine=engine, pipeline_depth=depth, fill_bubbles=fill, **config))
        try:
            prompts = [encode_prompt(cluster.tokenizer, t, chat) for t in texts]
            if pin_cpus:
                report["config"]["pinned"] = pin_cluster(cluster)
            cluster.generate(prompts[0], SamplingParams(max_tokens=8))  # warm-up
            drafter_before = ray.get(cluster.drafter.stats.remote()) if cluster.drafter else None
            tokens, wall = 0, 0.0
            total = SpeculationStats(drafted_per_position=[0] * gamma, accepted_per_position=[0] * gamma)
            overheads, verify_steps = [], []
            for ids in prompts:
                timeline: list = []
                t0 = time.perf_counter()
                result = cluster.generate(ids, SamplingParams(max_tokens=max_tokens), timeline)
                wall += time.perf_counter() - t0
                tokens += len(result.token_ids)
                total.merge(result.stats)  # per position too, past γ for long match rounds
                for t in timeline:
                    verify_steps.append(t.verify_end - t.verify_start)
                    overheads.append((t.received - t.sent) - (t.verify_end - t.verify_start))
            drafted, accepted, rounds, verify_s = total.drafted, total.accepted, total.rounds, total.verify_s
            row = {"tokens": tokens, "seconds": wall, "tokens_per_s": tokens / wall, "rounds": rounds,
                   "drafted": drafted, "accepted": accepted,
                   "acceptance_rate": accepted / drafted if drafted else 0.0,
                   "mean_accepted_length": tokens / rounds if rounds else 0.0,
                   "acceptance_per_position": [a / d if d else 0.0 for d, a in
                                               zip(total.drafted_per_position, total.accepted_per_position)],
                   "verifier_idle_s": wall - verify_s, "verifier_busy_fraction": verify_s / wall,
                   "verify_step_ms": 1e3 * statistics.mean(verify_steps),
                   "router_grpc_overhead_ms": 1e3 * statistics.median(overheads)}
            if drafter_before is not None:
                after = ray.get(cluster.drafter.stats.remote())
                row["drafter_busy_s"] = after["draft_s"] - drafter_before["draft_s"]
                row["drafter_idle_s"] = wall - row["drafter_busy_s"]
                row["draft_token_ms"] = 1e3 * row["drafter_busy_s"] / max(1, drafted)
            row["overhead_fraction_of_verify_step"] = row["router_grpc_overhead_ms"] / row["verify_step_ms"]
            row["bubble_fills"] = cluster.router.metrics.bubble_fills
            row["bubble_fill_misses"] = cluster.router.metrics.bubble_fill_misses
            row["concurrency"] = [_concurrent(cluster, prompts, n, concurrency_max_tokens)
                                  for n in (concurrency if mode in ("target_only", "sequential", "pipelined") else ())]
            report["modes"][mode] = row
        finally:
            cluster.shutdown()

    base = report["modes"]["target_only"]
    step_ms = base["verify_step_ms"]  # one plain decoding step on the verifier
    for mode in report["modes"]:
        if mode == "target_only":
            continue
        row = report["modes"][mode]
        row["speedup_vs_target_only"] = row["tokens_per_s"] / base["tokens_per_s"]
        draft_ms = 1e3 * row.get("drafter_busy_s", 0.0) / max(1, row["drafted"])
        c = draft_ms / step_ms
        alpha = effective_alpha(row["mean_accepted_length"], gamma) if mode == "sequential" else None
        if mode != "sequential":
            row["over_sequential"] = row["tokens_per_s"] / report["modes"]["sequential"]["tokens_per_s"]
        row["cost_ratio_c"] = c
        if alpha is not None:
            row["alpha"] = alpha
    seq, pipe = report["modes"]["sequential"], report["modes"]["pipelined"]
    alpha, c = seq["alpha"], seq["cost_ratio_c"]
    report["pipelined_over_sequential"] = pipe["tokens_per_s"] / seq["tokens_per_s"]
    report["fill_gain"] = pipe["tokens_per_s"] / report["modes"]["pipelined_no_fill"]["tokens_per_s"]
    report["predicted_sequential_speedup"] = predicted_speedup(alpha, gamma, c)
    report["pipelined_bound"] = predicted_speedup(alpha, gamma, c, pipelined=True)
    report["pipelined_fraction_of_bound"] = pipe["speedup_vs_target_only"] / report["pipelined_bound"]
    # the ceiling of the router's own policy at this α and c (rejections included), from the model
    ceiling = pipelined_ceiling(alpha, c, gamma)
    report["model"] = ceiling
    report["pipelined_fraction_of_ceiling"] = pipe["speedup_vs_target_only"] / ceiling["pipelined_speedup"]
    # κ, contention: how much slower each side's steps are while the other side is busy (pipelined: drafter
    # and verifier overlap) than alone (sequential: each waits for the other). The pipelined rounds carry
    # no bonus token (one fed token fewer), so κ_verify is a slight underestimate.
    report["kappa"] = {"verify": pipe["verify_step_ms"] / seq["verify_step_ms"] - 1,
                       "draft": pipe["draft_token_ms"] / seq["draft_token_ms"] - 1}
    return report


def format_distributed(report: dict) -> str:
    cfg = report["config"]
    lines = [f"workload={cfg['workload']} prompts={cfg['prompts']} max_tokens={cfg['max_tokens']} "
             f"γ={cfg['num_speculative_tokens']} dtype={cfg['dtype']} proposer={cfg['proposer']} (1 torch thread per actor"
             f"{'; verifier and drafter pinned to cores of their own: ' + str(cfg.get('pinned')) if cfg.get('pin_cpus') else ''})", "",
             "| mode | tokens/s | vs target-only | vs sequential | accept rate | mean acc. len | verify step ms | router+gRPC ms/round | verifier busy | drafter idle s |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    for mode, row in report["modes"].items():
        over_seq = f"{row['over_sequential']:.2f}×" if "over_sequential" in row else ""
        lines.append(f"| {mode} | {row['tokens_per_s']:.2f} | {row.get('speedup_vs_target_only', 1.0):.2f}× | {over_seq} | "
                     f"{row['acceptance_rate']:.2f} | {row['mean_accepted_length']:.2f} | {row['verify_step_ms']:.1f} | "
                     f"{row['router_grpc_overhead_ms']:.2f} ({row['overhead_fraction_of_verify_step']:.1%}) | "
                     f"{row['verifier_busy_fraction']:.0%} | {row.get('drafter_idle_s', 0.0):.1f} |")
    lines += ["", f"pipelined / sequential: {report['pipelined_over_sequential']:.2f}×; filled bubbles: "
              f"{report['fill_gain']:.2f}× over pipelined_no_fill ({report['modes']['pipelined']['bubble_fills']} fills, "
              f"{report['modes']['pipelined']['bubble_fill_misses']} misses); "
              f"α (effective) {report['modes']['sequential']['alpha']:.2f}, c {report['modes']['sequential']['cost_ratio_c']:.3f}; "
              f"predicted sequential {report['predicted_sequential_speedup']:.2f}×, pipelined bound "
              f"{report['pipelined_bound']:.2f}×, pipelined reaches {report['pipelined_fraction_of_bound']:.0%} of it", "",
              f"model of the router's policy at this α and c (drafts/pipeline_model.py): sequential "
              f"{report['model']['sequential_speedup']:.2f}× (γ {report['model']['sequential_gamma']}), pipelined "
              f"{report['model']['pipelined_speedup']:.2f}× (γ {report['model']['pipelined_gamma']}), ratio "
              f"{report['model']['pipelined_over_sequential']:.2f}×; pipelined reaches "
              f"{report['pipelined_fraction_of_ceiling']:.0%} of the modelled ceiling", "",
              f"contention κ (pipelined step / sequential step − 1): verify {report['kappa']['verify']:+.2f}, "
              f"draft per token {report['kappa']['draft']:+.2f}", "",
              "| mode | " + " | ".join(f"{c['sessions']} sessions tok/s" for c in report["modes"]["target_only"]["concurrency"]) + " |",
              "|---|" + "---|" * len(report["modes"]["target_only"]["concurrency"])]
    for mode, row in report["modes"].items():
        if not row["concurrency"]:
            continue
        lines.append(f"| {mode} | " + " | ".join(f"{c['tokens_per_s']:.2f}" for c in row["concurrency"]) + " |")
    return "\n".join(lines)
