"""The `tandem` command line: models, generate, bench. Errors are one line and a non-zero exit."""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="tandem", description="Lossless speculative decoding.")
    parser.add_argument("-v", "--verbose", action="store_true", help="log progress to stderr")
    sub = parser.add_subparsers(dest="command", required=True)

    models_p = sub.add_parser("models", help="manage model files")
    models_sub = models_p.add_subparsers(dest="models_command", required=True)
    prepare = models_sub.add_parser("prepare", help="materialise SmolLM2-135M-Instruct into the cache; print its path")
    prepare.add_argument("--cache-dir", help="cache root (default $TANDEM_CACHE_DIR or ~/.cache/tandem)")
    prepare.add_argument("--force", action="store_true", help="rebuild even if present")

    gen = sub.add_parser("generate", help="generate a completion for one prompt")
    gen.add_argument("prompt")
    gen.add_argument("--chat", action="store_true", help="wrap the prompt in the model's chat template")
    gen.add_argument("--max-tokens", type=int, default=64)
    gen.add_argument("--temperature", type=float, default=0.0, help="0 (default) is greedy")
    gen.add_argument("--top-p", type=float, default=1.0)
    gen.add_argument("--top-k", type=int, default=0)
    gen.add_argument("--seed", type=int)
    gen.add_argument("--stop", action="append", default=[], help="stop string (repeatable)")
    _engine_args(gen)
    gen.add_argument("--json", action="store_true", help="print one JSON object")
    gen.add_argument("--distributed", action="store_true", help="run on a local Ray cluster (drafter actor, gRPC verifiers)")
    gen.add_argument("--pipeline-depth", type=int, default=2, help="with --distributed: rounds in flight (1 = sequential)")
    gen.add_argument("--tensor-parallel-size", type=int, default=1, help="with --distributed: target ranks per replica")
    gen.add_argument("--replicas", type=int, default=1, help="with --distributed: verifier replicas")

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
    bench.add_argument("--distributed", action="store_true",
                       help="target-only vs sequential vs pipelined through Ray + gRPC (workload humaneval unless set)")
    bench.add_argument("--proposer", default="draft",
                       help="with --distributed or --engine vllm: draft | ngram | hybrid (tandem's drafter)")
    bench.add_argument("--modes", default="",
                       help="with --distributed: optional modes besides target_only, sequential, pipelined and "
                            "pipelined_no_fill, comma-separated (sequential_tree, sequential_gamma_matches, continuous, continuous_depth2; "
                            "default: all)")
    bench.add_argument("--pin-cpus", action="store_true",
                       help="with --distributed: the drafter pinned to the last CPU, the verifier to the others")
    bench.add_argument("--concurrency", default="1,4,16",
                       help="with --distributed or --endpoint: concurrent sessions / streams")
    bench.add_argument("--endpoint", metavar="URL",
                       help="drive a running server (e.g. http://127.0.0.1:8000): speculative vs plain, side by side")
    bench.add_argument("--api-key", help="with --endpoint: Bearer key")
    bench.add_argument("--engine", choices=["torch", "vllm"], default="torch",
                       help="vllm: vLLM target-only vs vLLM + tandem's drafter (overlapped: a miss costs a plain "
                            "step or waits for the redraft; synchronous) vs "
                            "vLLM's ngram, side by side (needs .[vllm]; --dtype float32 for exact greedy equality)")

    drafts_p = sub.add_parser("drafts", help="make and check drafts for a target")
    drafts_sub = drafts_p.add_subparsers(dest="drafts_command", required=True)
    dist = drafts_sub.add_parser("distill", help="train a draft on the target's own distributions")
    dist.add_argument("--kind", choices=["small", "feature"], default="small",
                      help="small: a few of the target's layers; feature: an EAGLE-style draft fed the target's "
                           "last hidden state")
    dist.add_argument("--out", required=True, help="draft directory (resumes from its checkpoint when present)")
    dist.add_argument("--target", default="default")
    dist.add_argument("--layers", default="0,1,29", help="small: target layers the draft's layers start from")
    dist.add_argument("--vocab-size", type=int, default=8192, help="reduced head: most frequent corpus tokens (0: all)")
    dist.add_argument("--self-speculative", action="store_true",
                      help="small: train only an exit head over the target's own first L layers (--layers 0..L-1)")
    dist.add_argument("--max-tokens", type=int,
                      help="training token budget (small, default 400000) or distinct training tokens whose "
                           "target features are cached (feature, default 1000000)")
    dist.add_argument("--max-minutes", type=float, default=0.0,
                      help="time budget (0: none); feature: the whole call, data and features included")
    dist.add_argument("--chat-samples", type=int, help="target-generated chat answers in the corpus (default: "
                                                       "64 small, 192 feature)")
    dist.add_argument("--seq-len", type=int, default=128)
    dist.add_argument("--batch-size", type=int, default=8)
    dist.add_argument("--lr", type=float, help="peak learning rate (default: 3e-4 small, 1e-3 feature)")
    dist.add_argument("--seed", type=int, default=0)
    dist.add_argument("--threads", type=int, help="torch threads (default: 2 small, 1 feature)")
    dist.add_argument("--epochs", type=int, help="feature: passes over the cached windows (default 8)")
    dist.add_argument("--feature-weight", type=float, help="feature: weight of the feature regression (default 1)")
    dist.add_argument("--feature-noise", type=float, help="feature: std of the noise on input features (default 0.02)")
    dist.add_argument("--eval-every", type=int, help="feature: steps between evaluations and checkpoints (default 500)")
    dist.add_argument("--unroll", type=int, help="feature: passes per batch, each later one feeding the draft's own "
                                                 "predicted features at half the positions (default 1)")
    dist.add_argument("--init-from", help="feature: start from this exported feature draft (trained on the same data)")
    dist.add_argument("--code-dir", action="append", default=[],
                      help="feature: more Python sources for the corpus (repeatable; e.g. a site-packages folder)")
    dist.add_argument("--cache-dir")
    val = drafts_sub.add_parser("validate", help="acceptance by position, cost ratio, predicted speedups; a gate")
    val.add_argument("--target", default="default")
    val.add_argument("--draft", default="int8", help="'int8', a tandem draft directory or an HF model directory")
    val.add_argument("--workload", default="humaneval", help="humaneval | chat | a text file with one prompt per line")
    val.add_argument("--prompts", type=int, default=8)
    val.add_argument("--max-tokens", type=int, default=64)
    val.add_argument("--max-gamma", type=int, default=8)
    val.add_argument("--dtype", default="bfloat16")
    val.add_argument("--threads", type=int, default=1)
    val.add_argument("--json", metavar="FILE")
    val.add_argument("--plot", metavar="FILE", help="PNG: acceptance by position, predicted speedup by γ")
    val.add_argument("--min-acceptance", type=float, help="exit 1 when α is below this")
    val.add_argument("--record", action="store_true",
                     help="write the report's summary into the draft directory's tandem_draft.json (under "
                          "validate.<workload>), beside its provenance")
    val.add_argument("--cache-dir")

    srv = sub.add_parser("serve", help="serve the Ray Serve application on a local Ray (127.0.0.1) until Ctrl-C")
    srv.add_argument("--config", help="Serve config (default: the repository's ray_config.yaml)")
    srv.add_argument("--http-port", type=int, help="override http_options.port")
    srv.add_argument("--grpc-port", type=int, help="override grpc_options.port")
    srv.add_argument("--engine", choices=["torch", "vllm"],
                     help="override engine.backend: vllm serves the target on vLLM verifier replicas (Ray Serve "
                          "LLM's LLMServer) with tandem's drafter (needs .[vllm])")
    return parser


def _engine_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--target", default="default", help="'default' (SmolLM2-135M-Instruct) or a local HF model dir")
    p.add_argument("--proposer", default="hybrid",
                   help="hybrid (default: a suffix match when long enough, else the draft; BENCHMARKS.md) | draft | ngram | none")
    p.add_argument("--draft", default="int8", help="'int8' (quantized copy of the target) or a local HF model dir")
    p.add_argument("--num-speculative-tokens", type=int, default=3)
    p.add_argument("--dtype", default="bfloat16", help="bfloat16 | float32 | float16")
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--cache-dir")
    p.add_argument("--engine", choices=["torch", "vllm"], default="torch",
                   help="target engine: torch (tandem's runner) or vllm (vLLM decodes; tandem drafts; needs .[vllm])")


def _generate(args) -> int:
    from cluster.engine import EngineConfig, build_decoder, encode_prompt
    from cluster.errors import InvalidRequestError
    from cluster.sampling import SamplingParams

    params = SamplingParams.build(max_tokens=args.max_tokens, temperature=args.temperature, top_p=args.top_p,
                                  top_k=args.top_k, seed=args.seed, stop=args.stop)
    if not args.prompt:
        raise InvalidRequestError("the prompt is empty")
    config = EngineConfig.build(target=args.target, proposer=args.proposer, draft=args.draft,
                                num_speculative_tokens=args.num_speculative_tokens, dtype=args.dtype,
                                threads=args.threads, cache_dir=args.cache_dir, backend=args.engine)
    if config.backend == "vllm":  # vLLM decodes; the drafter runs in its worker, or as the Ray actor (--distributed)
        from cluster.vllm_engine import build_vllm_decoder

        decoder = build_vllm_decoder(config, distributed=args.distributed)
        try:
            result = decoder.generate(encode_prompt(decoder.tokenizer, args.prompt, args.chat), params)
            print(f"[vllm: {json.dumps(decoder.stats())}]", file=sys.stderr)  # drafter hits, misses, fallbacks
        finally:
            decoder.shutdown()
    elif args.distributed:
        from cluster.runtime import ClusterConfig, TandemCluster

        cluster = TandemCluster(ClusterConfig.build(engine=config, pipeline_depth=args.pipeline_depth,
                                                    tensor_parallel_size=args.tensor_parallel_size,
                                                    num_verifier_replicas=args.replicas))
        try:
            result = cluster.generate(encode_prompt(cluster.tokenizer, args.prompt, args.chat), params)
        finally:
            cluster.shutdown()
    else:
        decoder = build_decoder(config)
        result = decoder.generate(encode_prompt(decoder.tokenizer, args.prompt, args.chat), params)
    if args.json:
        print(json.dumps({"text": result.text, "token_ids": result.token_ids,
                          "finish_reason": result.finish_reason, "stats": result.stats.to_dict()}))
    else:
        print(result.text)
        s = result.stats
        print(f"[{s.num_generated_tokens} tokens, {s.tokens_per_s:.1f} tokens/s, acceptance rate "
              f"{s.acceptance_rate:.2f}, mean accepted length {s.mean_accepted_length:.2f}]", file=sys.stderr)
    return 0


def _drafts(args) -> int:
    import torch

    from cluster import models

    target_path = models.resolve_model_path(args.target, args.cache_dir)
    tokenizer = models.load_tokenizer(target_path)
    if args.drafts_command == "distill":
        from cluster.errors import ConfigError
        from cluster.workloads import CHAT_PROMPTS, humaneval_prompts

        def given(*names):
            return {n: getattr(args, n) for n in names if getattr(args, n) is not None}

        held_out = set(humaneval_prompts()) | set(CHAT_PROMPTS)
        shared = given("max_tokens", "lr", "chat_samples", "threads")
        if args.kind == "feature":
            from drafts.feature_draft import FeatureDistillConfig, distill_feature

            if args.self_speculative or args.vocab_size <= 0:
                raise ConfigError("--kind feature takes neither --self-speculative nor --vocab-size 0")
            config = FeatureDistillConfig(**shared, **given("epochs", "feature_weight", "feature_noise", "eval_every",
                                                            "unroll", "init_from"),
                                          max_minutes=args.max_minutes, vocab_size=args.vocab_size, seed=args.seed,
                                          seq_len=args.seq_len, batch_size=args.batch_size,
                                          code_dirs=tuple(args.code_dir))
            torch.set_num_threads(config.threads)
            target = models.load_causal_lm(target_path, "bfloat16", "cpu")
            print(json.dumps(distill_feature(target, tokenizer, args.out, config, held_out), indent=1))
            return 0
        feature_only = given("epochs", "feature_weight", "feature_noise", "eval_every", "unroll", "init_from")
        if args.code_dir:
            feature_only["code_dir"] = args.code_dir
        if feature_only:
            raise ConfigError(f"--{next(iter(feature_only)).replace('_', '-')} needs --kind feature")
        from drafts.distill import DistillConfig, distill

        config = DistillConfig(layers=[int(x) for x in args.layers.split(",")], vocab_size=args.vocab_size,
                               self_speculative=args.self_speculative, seq_len=args.seq_len,
                               batch_size=args.batch_size, max_minutes=args.max_minutes, seed=args.seed,
                               **{"max_tokens": 400_000, "lr": 3e-4, "chat_samples": 64, "threads": 2, **shared})
        torch.set_num_threads(config.threads)
        target = models.load_causal_lm(target_path, "bfloat16", "cpu")
        report = distill(target, tokenizer, args.out, config, held_out=held_out)
        print(json.dumps(report, indent=1))
        return 0

    from cluster.engine import EngineConfig, encode_prompt, make_proposer
    from cluster.errors import ConfigError
    from cluster.workloads import workload
    from drafts import validate as v

    torch.set_num_threads(args.threads)
    if args.workload in ("humaneval", "chat"):
        texts, chat = workload(args.workload, args.prompts)
    else:
        try:
            texts = [line for line in open(args.workload).read().splitlines() if line.strip()][: args.prompts]
        except OSError as e:
            raise ConfigError(f"cannot read workload file {args.workload}: {e}") from None
        chat = False
    target = models.load_causal_lm(target_path, args.dtype, "cpu")
    engine = EngineConfig.build(target=str(target_path), draft=args.draft, dtype=args.dtype, cache_dir=args.cache_dir)
    proposer = make_proposer(engine, target, tokenizer)
    draft = proposer if getattr(proposer, "needs_features", False) else proposer.runner.model
    prompts = [encode_prompt(tokenizer, t, chat) for t in texts]
    report = v.validate(target, draft, prompts, args.max_tokens, args.max_gamma)
    report.update(target=str(target_path), draft=args.draft, workload=args.workload, dtype=args.dtype,
                  threads=args.threads)
    print(v.format_report(report))
    if args.json:
        from cluster.bench import write_json

        write_json(report, args.json)
    if args.plot:
        v.plot(report, args.plot)
    if args.record:
        _record_validation(args, report)
    if args.min_acceptance is not None and report["alpha"] < args.min_acceptance:
        print(f"tandem: α = {report['alpha']:.3f} is below --min-acceptance {args.min_acceptance}", file=sys.stderr)
        return 1
    return 0


def _record_validation(args, report: dict) -> None:
    import shlex

    from cluster.errors import ConfigError
    from drafts.feature_proposer import feature_draft_dir, is_feature_draft

    folder = feature_draft_dir(args.draft) if is_feature_draft(args.draft) else Path(args.draft).expanduser()
    meta_file = folder / "tandem_draft.json"
    if not meta_file.is_file():
        raise ConfigError(f"--record needs a tandem draft directory, not {args.draft!r}")
    meta = json.loads(meta_file.read_text())
    hybrid = report["sources"]["hybrid"]
    meta.setdefault("validate", {})[args.workload] = {
        "command": shlex.join(["tandem", *sys.argv[1:]]), "prompts": report["prompts"],
        "max_tokens": report["max_tokens"], "dtype": args.dtype, "threads": args.threads,
        "alpha": round(report["alpha"], 4), "cost_ratio": round(report["cost_ratio"], 4),
        "acceptance_by_position": [round(a, 4) for a in report["acceptance_by_position"]],
        "recommended_gamma": report["recommended_gamma"],
        "predicted_sequential_speedup": round(report["best_predicted_sequential_speedup"], 3),
        "hybrid_predicted_sequential_speedup": round(hybrid["best_predicted_sequential_speedup"], 3)}
    meta_file.write_text(json.dumps(meta, indent=1) + "\n")


def _serve(args) -> int:
    import signal
    import threading

    from deployments.serving import load_config, start

    config = load_config(args.config)  # fails fast, naming the field, before Ray starts
    if args.engine:
        config.app_configs = {name: app.with_backend(args.engine) for name, app in config.app_configs.items()}
    endpoints = start(config, args.http_port, args.grpc_port)
    model = next(iter(config.app_configs.values())).model_id
    print(f"tandem is serving {model}\n"
          f"  OpenAI HTTP API: {endpoints.http}/v1   (GET /v1/models, POST /v1/completions, /v1/chat/completions)\n"
          f"  gRPC:            {endpoints.grpc}   (tandem.v1.Generation/Generate; metadata application="
          f"{endpoints.app_names[0]}; reflection and grpc.health.v1 on)\n"
          f"  try: curl {endpoints.http}/v1/completions -H 'Content-Type: application/json' "
          f"-d '{{\"model\": \"{model}\", \"prompt\": \"def fib(n):\", \"max_tokens\": 32, \"temperature\": 0}}'\n"
          f"Ctrl-C stops it.", flush=True)
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    try:
        while not stop.wait(1.0):
            pass
    except KeyboardInterrupt:
        pass
    finally:
        import ray
        from ray import serve

        print("stopping...", file=sys.stderr, flush=True)
        serve.shutdown()
        ray.shutdown()
    return 0


def _bench(args) -> int:
    from cluster.bench import format_report, run_bench, write_json

    if args.endpoint:
        from cluster.workloads import workload
        from deployments.loadgen import format_endpoint_report, run_endpoint_bench

        prompts, chat = workload("humaneval" if args.workload == "all" else args.workload, args.prompts)
        report = run_endpoint_bench(args.endpoint, prompts, args.max_tokens,
                                    tuple(int(n) for n in args.concurrency.split(",")), api_key=args.api_key,
                                    chat=chat)
        print(format_endpoint_report(report))
        if args.json:
            write_json(report, args.json)
        return 0

    if args.distributed:
        from cluster.bench_distributed import format_distributed, run_distributed_bench

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
        from cluster.vllm_engine import format_vllm_bench, run_vllm_bench, strip_outputs

        report = run_vllm_bench(workloads, args.prompts, args.max_tokens, args.num_speculative_tokens, args.dtype,
                                args.cache_dir, proposer=args.proposer)
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
    args = _parser().parse_args(argv)
    logging.basicConfig(level=logging.INFO if args.verbose else logging.WARNING,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    if not args.verbose:
        from transformers.utils import logging as hf_logging

        hf_logging.set_verbosity_error()
        hf_logging.disable_progress_bar()
    from cluster.errors import TandemError

    try:
        if args.command == "models":
            from cluster.models import prepare_default_model

            print(prepare_default_model(args.cache_dir, force=args.force))
            return 0
        if args.command == "generate":
            return _generate(args)
        if args.command == "serve":
            return _serve(args)
        if args.command == "drafts":
            return _drafts(args)
        return _bench(args)
    except TandemError as e:
        print(f"tandem: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
