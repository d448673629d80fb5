"""`python -m tools bench ...`: tandem's benchmarks, side by side in one run (run from the repository root).

Outside the wheel: the runtime never imports this package.
"""

from __future__ import annotations

import argparse
import os

from cluster.core.workloads import peer_workload, workload
from cluster.model import models
from deployments.cli import run_command
from tools.bench import format_report, run_bench, write_json
from tools.bench_distributed import format_distributed, run_distributed_bench
from tools.loadgen import format_endpoint_report, run_endpoint_bench
from tools.peer_bench import compare, fresh_plan, fresh_prompts_needed, merge_alone, split_bind, start_servers
from tools.peer_bench import format_report as format_peer_report

os.environ.setdefault("HF_HUB_OFFLINE", "1")


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m tools", description="tandem's benchmarks.")
    parser.add_argument("-v", "--verbose", action="store_true", help="log progress to stderr")
    sub = parser.add_subparsers(dest="command", required=True)
    bench = sub.add_parser("bench", help="speculative vs target-only decoding, side by side")
    bench.add_argument("--workload", choices=["humaneval", "chat", "all"], default="all")
    bench.add_argument("--prompts", type=int, default=10, help="prompts per workload")
    bench.add_argument("--max-tokens", type=int, default=128)
    bench.add_argument("--num-speculative-tokens", type=int, default=3)
    bench.add_argument("--dtype", choices=["bfloat16", "float32"], default="bfloat16")
    bench.add_argument("--threads", type=int, default=1, help="torch threads (pinned)")
    bench.add_argument("--cache-dir")
    bench.add_argument("--no-hf", action="store_true", help="skip the transformers reference modes")
    bench.add_argument("--draft", action="append", default=[],
                       help="also bench this tandem draft directory, or 'feature' (the shipped feature-fed draft, "
                            "alone and in the hybrid) (repeatable); with --distributed: the model draft of "
                            "--proposer draft|hybrid (default int8)")
    bench.add_argument("--json", metavar="FILE", help="also write the figures as JSON")
    bench.add_argument("--eagle3", metavar="DIR", help="with --engine vllm: also vLLM's own eagle3 method on this "
                       "exported EAGLE-3 draft (drafts.eagle3_model.export_vllm)")
    bench.add_argument("--distributed", action="store_true",
                       help="target-only vs sequential vs pipelined through Ray + gRPC (workload humaneval unless set)")
    bench.add_argument("--proposer", default="draft",
                       help="with --distributed or --engine vllm: draft | ngram | suffix | hybrid (tandem's drafter)")
    bench.add_argument("--modes", default="",
                       help="with --distributed: optional modes besides target_only, sequential, pipelined and "
                            "pipelined_no_fill, comma-separated (sequential_tree, sequential_gamma_matches, "
                            "sequential_drafter_matches, sequential_adaptive; default: all)")
    bench.add_argument("--pin-cpus", action="store_true",
                       help="with --distributed: the drafter pinned to the last CPU, the verifier to the others")
    bench.add_argument("--concurrency", default="1,4,16",
                       help="with --distributed or --endpoint: concurrent sessions / streams")
    bench.add_argument("--endpoint", metavar="URL",
                       help="drive a running server (e.g. http://127.0.0.1:8000): speculative vs plain, side by side")
    bench.add_argument("--api-key", help="with --endpoint: Bearer key")
    bench.add_argument("--peer", action="store_true",
                       help="tandem serve (default config, and plain decoding through it) beside vLLM's own OpenAI "
                            "server (plain and its ngram method), started and stopped here; interleaved greedy "
                            "streams; --concurrency 1,16 (default here), --prompts per workload")
    bench.add_argument("--peer-servers", default="vllm,vllm_ngram,tandem",
                       help="with --peer: which servers to start (vllm, vllm_ngram, vllm_eagle3[_sched], vllm_sync: vLLM "
                            "alone with async scheduling off; vllm_suffix[_own]: vLLM's suffix method, `make peer-extras`; tandem: --peer-config as it is; "
                            "tandem_<engine>[_<proposer>], e.g. tandem_torch, tandem_vllm_ngram: with `tandem serve "
                            "--engine E --proposer P`), then engine fields as +FIELD=VALUE (`tandem serve --set`, e.g. "
                            "tandem_torch_hybrid+draft=eagle3); a side may end in @BIND, its own "
                            "VLLM_CPU_OMP_THREADS_BIND (vllm@0-1,tandem_vllm_none@0)")
    bench.add_argument("--peer-vllm-openmp", choices=["intel", "gnu"], default="intel",
                       help="with --peer: the OpenMP runtime of vLLM alone: intel (libiomp5 in LD_PRELOAD, as vLLM's CPU "
                            "guide sets it up and tandem gives its own engine) or gnu (vLLM's fallback, libgomp)")
    bench.add_argument("--peer-config", default="ray_config.yaml", help="with --peer: tandem's Serve config")
    bench.add_argument("--peer-tandem-via", choices=["direct", "proxy"], default="direct",
                       help="with --peer: call each tandem server at its replica's own port, as `tandem serve` prints "
                            "it (direct: Serve's direct ingress on one machine), or through Serve's proxy")
    bench.add_argument("--peer-repeats", type=int, default=2, help="with --peer: batches per server at N streams")
    bench.add_argument("--peer-fresh", action="store_true",
                       help="with --peer: no server gets a prompt twice (each N-stream batch its own prompts, chat going on "
                            "into the tuning chat prompts): servers that keep earlier outputs (vLLM's suffix method, "
                            "tandem's pool) cannot recall an answer; without it the N-stream batches repeat --prompts")
    bench.add_argument("--peer-port", type=int, default=8100, help="with --peer: first port (each server +10)")
    bench.add_argument("--peer-logs", default=".", help="with --peer: folder for the servers' logs")
    bench.add_argument("--peer-alone", action="store_true",
                       help="with --peer: each server started, measured and stopped in turn (its sides, e.g. tandem "
                            "and tandem_plain, still interleaved), so that idle servers take no CPU")
    bench.add_argument("--peer-vllm-bind", default="auto",
                       help="with --peer: VLLM_CPU_OMP_THREADS_BIND for every vLLM engine of the run (vLLM alone "
                            "and tandem's vLLM replicas alike); vLLM's auto binds one thread per core and "
                            "reserves one core per rank for its scheduler")
    bench.add_argument("--engine", choices=["torch", "vllm"], default="torch",
                       help="vllm: vLLM target-only vs vLLM + tandem's drafter (overlapped: a miss costs a plain "
                            "step or waits for the redraft; synchronous) vs "
                            "vLLM's ngram, side by side (needs .[vllm]; --dtype float32 for exact greedy equality)")
    return parser


def _peer(args) -> int:
    names = ["humaneval", "chat"] if args.workload == "all" else [args.workload]
    streams = tuple(int(n) for n in (args.concurrency if args.concurrency != "1,4,16" else "1,16").split(",") if n)
    fresh = fresh_prompts_needed(args.prompts, streams, args.peer_repeats) if args.peer_fresh else None
    workloads = {name: peer_workload(name, fresh or args.prompts, more=bool(fresh)) for name in names}
    for name, (prompts, _) in workloads.items() if fresh else ():
        try:  # before any server starts
            fresh_plan(prompts, args.prompts, streams, args.peer_repeats, name)
        except ValueError as e:
            raise SystemExit(f"--peer-fresh: {e}; ask for fewer --prompts, --peer-repeats or stream counts") from None
    dtype = args.dtype
    model_dir = str(models.resolve_model_path("default", args.cache_dir))
    which = tuple(args.peer_servers.split(","))
    reports = []
    for group in [(name,) for name in which] if args.peer_alone else [which]:  # alone: idle sides cost nothing
        procs, servers = start_servers(model_dir, args.peer_config, dtype, 2048, args.peer_port, args.peer_logs,
                                       group, vllm_bind=args.peer_vllm_bind, openmp=args.peer_vllm_openmp,
                                       via=args.peer_tandem_via)
        try:
            reports.append(compare(servers, workloads, args.max_tokens, streams, args.peer_repeats,
                                   reference=servers[0].name, fresh_one_stream=args.prompts if fresh else None))
        finally:
            for proc in procs:
                proc.stop()
    report = merge_alone(reports, reference=which[0]) if args.peer_alone else reports[0]
    report.update(dtype=dtype, prompts=args.prompts, fresh=bool(fresh), cpus=os.cpu_count(),
                  given={"vllm": f"VLLM_CPU_OMP_THREADS_BIND={args.peer_vllm_bind} (also on tandem's vLLM "
                                 f"replicas), VLLM_CPU_KVCACHE_SPACE={os.environ.get('VLLM_CPU_KVCACHE_SPACE', '2')} GiB, "
                                 f"OpenMP {args.peer_vllm_openmp}",
                         "tandem": f"{args.peer_config} as it is (its `threads` for the torch engine), called "
                                   f"{'at its replica' + chr(39) + 's own port' if args.peer_tandem_via == 'direct' else 'through Serve' + chr(39) + 's proxy'}",
                         "binds": {side: split_bind(side, args.peer_vllm_bind)[1] for side in which}})
    print(format_peer_report(report))
    if args.json:
        write_json(report, args.json)
    return 0


def _bench(args) -> int:
    if args.peer:
        return _peer(args)
    if args.endpoint:
        prompts, chat = workload("humaneval" if args.workload == "all" else args.workload, args.prompts)
        report = run_endpoint_bench(args.endpoint, prompts, args.max_tokens,
                                    tuple(int(n) for n in args.concurrency.split(",")), api_key=args.api_key,
                                    chat=chat)
        print(format_endpoint_report(report))
        if args.json:
            write_json(report, args.json)
        return 0

    if args.distributed:
        report = run_distributed_bench("humaneval" if args.workload == "all" else args.workload, args.prompts,
                                       args.max_tokens, args.num_speculative_tokens, args.dtype, args.proposer,
                                       tuple(int(n) for n in args.concurrency.split(",") if n),
                                       modes=tuple(m for m in args.modes.split(",") if m),
                                       draft=args.draft[0] if args.draft else "int8", pin_cpus=args.pin_cpus)
        print(format_distributed(report))
        if args.json:
            write_json(report, args.json)
        return 0

    workloads = ["humaneval", "chat"] if args.workload == "all" else [args.workload]
    if args.engine == "vllm":
        from tools.bench_vllm import format_vllm_bench, run_vllm_bench, strip_outputs  # on use: vLLM is optional

        report = run_vllm_bench(workloads, args.prompts, args.max_tokens, args.num_speculative_tokens, args.dtype,
                                args.cache_dir, proposer=args.proposer, eagle3_dir=args.eagle3)
        print(format_vllm_bench(report))
        if args.json:
            write_json(strip_outputs(report), args.json)
        return 0
    report = run_bench(workloads, args.prompts, args.max_tokens, args.num_speculative_tokens, args.dtype,
                       args.threads, args.cache_dir, include_hf=not args.no_hf, drafts=args.draft)
    print(format_report(report))
    if args.json:
        write_json(report, args.json)
    return 0


def main(argv: list[str] | None = None) -> int:
    return run_command(_parser().parse_args(argv), _bench)
