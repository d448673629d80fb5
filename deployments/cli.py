"""The `tandem` command line: models, generate, serve, drafts. Errors are one line and a non-zero exit.

Benchmarks are tools, outside the wheel: `python -m tools bench ...` from the repository root.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys

from transformers.utils import logging as hf_logging

from cluster.core.config import PROPOSERS, EngineConfig
from cluster.core.errors import ConfigError, InvalidRequestError, TandemError
from cluster.core.sampling import SamplingParams, prediction_seed, prediction_token_ids
from cluster.model.models import encode_prompt, prepare_default_model
from cluster.ray.runtime import ClusterConfig, TandemCluster
from cluster.session.engine import build_decoder
from cluster.session.loop_state import LoopConfig
from deployments.serving import load_config, start
from drafts.training.cli import add_drafts_parser, run_drafts

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
    gen.add_argument("--logprobs", type=int, help="with --json: each token's logprob and this many top ones (0 .. 20)")
    gen.add_argument("--logprobs-mode", choices=["raw_logprobs", "processed_logprobs"], default="raw_logprobs")
    gen.add_argument("--prediction", help="OpenAI's Predicted Outputs: text the answer is expected to match in large "
                                          "part (a file being edited), drafted from and verified like any draft; "
                                          "@PATH reads it from a file")
    _engine_args(gen)
    gen.add_argument("--json", action="store_true", help="print one JSON object")
    gen.add_argument("--distributed", action="store_true", help="run on a local Ray cluster (drafter actor, gRPC verifiers)")
    gen.add_argument("--pipeline-depth", type=int, default=LoopConfig.model_fields["pipeline_depth"].default,
                     help="with --distributed: rounds in flight (1 = sequential)")
    gen.add_argument("--tensor-parallel-size", type=int, default=1, help="with --distributed: target ranks per replica")
    gen.add_argument("--replicas", type=int, default=1, help="with --distributed: verifier replicas")

    add_drafts_parser(sub)

    srv = sub.add_parser("serve", help="serve the Ray Serve application on a local Ray (127.0.0.1) until Ctrl-C")
    srv.add_argument("--config", help="Serve config (default: the repository's ray_config.yaml)")
    srv.add_argument("--http-port", type=int, help="override http_options.port")
    srv.add_argument("--grpc-port", type=int, help="override grpc_options.port")
    srv.add_argument("--engine", choices=["auto", "torch", "vllm"],
                     help="override engine.backend: vllm serves the target on vLLM verifier replicas (Ray Serve "
                          "LLM's LLMServer) with tandem's drafter (needs .[vllm]); auto: vLLM when installed")
    srv.add_argument("--proposer", choices=PROPOSERS, help="override engine.proposer")
    srv.add_argument("--set", dest="engine_set", action="append", default=[], metavar="FIELD=VALUE",
                     help="override any engine field (repeatable; the value read as YAML), e.g. --set draft=eagle3 "
                          "--set tree_width=4")
    return parser


def _engine_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--target", default="default", help="'default' (SmolLM2-135M-Instruct) or a local HF model dir")
    p.add_argument("--proposer", default="auto",
                   help="auto (default: the engine's, 'hybrid' on torch, 'suffix' on vLLM; BENCHMARKS.md) | hybrid (a suffix "
                        "match when long enough, else the draft) | suffix (priced suffix matches, no model) | draft | ngram | none")
    p.add_argument("--draft", default="int8", help="'int8' (quantized copy of the target) or a local HF model dir")
    p.add_argument("--num-speculative-tokens", type=int, default=3)
    p.add_argument("--dtype", default="bfloat16", help="bfloat16 | float32 | float16")
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--cache-dir")
    p.add_argument("--engine", choices=["torch", "vllm"], default="torch",
                   help="target engine: torch (tandem's runner) or vllm (vLLM decodes; tandem drafts; needs .[vllm])")


def _generate(args) -> int:
    if args.max_tokens < 1:  # 0 (score the prompt only) is an HTTP completions feature, with echo
        raise InvalidRequestError(f"max_tokens: must be at least 1 (got {args.max_tokens})")
    params = SamplingParams.build(max_tokens=args.max_tokens, temperature=args.temperature, top_p=args.top_p,
                                  top_k=args.top_k, seed=args.seed, stop=args.stop, logprobs=args.logprobs,
                                  logprobs_mode=args.logprobs_mode)
    if not args.prompt:
        raise InvalidRequestError("the prompt is empty")
    prediction = _prediction_text(args.prediction)
    config = EngineConfig.build(target=args.target, proposer=args.proposer, draft=args.draft,
                                num_speculative_tokens=args.num_speculative_tokens, dtype=args.dtype,
                                threads=args.threads, cache_dir=args.cache_dir, backend=args.engine)
    if config.backend == "vllm":  # vLLM decodes; the drafter runs in its worker, or as the Ray actor (--distributed)
        from cluster.vllm.engine import build_vllm_decoder

        decoder = build_vllm_decoder(config, distributed=args.distributed)
        try:
            params = _with_prediction(params, prediction, decoder.tokenizer)
            result = decoder.generate(encode_prompt(decoder.tokenizer, args.prompt, args.chat), params)
            print(f"[vllm: {json.dumps(decoder.stats())}]", file=sys.stderr)  # drafter hits, misses, fallbacks
        finally:
            decoder.shutdown()
    elif args.distributed:
        cluster = TandemCluster(ClusterConfig.build(engine=config, pipeline_depth=args.pipeline_depth,
                                                    tensor_parallel_size=args.tensor_parallel_size,
                                                    num_verifier_replicas=args.replicas))
        try:
            params = _with_prediction(params, prediction, cluster.tokenizer)
            result = cluster.generate(encode_prompt(cluster.tokenizer, args.prompt, args.chat), params)
        finally:
            cluster.shutdown()
    else:
        decoder = build_decoder(config)
        params = _with_prediction(params, prediction, decoder.tokenizer)
        result = decoder.generate(encode_prompt(decoder.tokenizer, args.prompt, args.chat), params)
        if params.prediction:
            print(f"[prediction: {decoder.metrics.prediction_rounds} rounds drafted from it, "
                  f"{decoder.metrics.prediction_accepted} of their tokens accepted]", file=sys.stderr)
    if args.json:
        logprobs = None if result.logprobs is None else \
            [{"token_id": t.token_id, "logprob": t.logprob, "top": [list(e) for e in t.top]} for t in result.logprobs]
        print(json.dumps({"text": result.text, "token_ids": result.token_ids, "logprobs": logprobs,
                          "finish_reason": result.finish_reason, "stats": result.stats.to_dict()}))
    else:
        print(result.text)
        s = result.stats
        print(f"[{s.num_generated_tokens} tokens, {s.tokens_per_s:.1f} tokens/s, acceptance rate "
              f"{s.acceptance_rate:.2f}, mean accepted length {s.mean_accepted_length:.2f}]", file=sys.stderr)
    return 0


def _prediction_text(value: str | None) -> str | None:
    """`--prediction`: the text itself, or @PATH's contents (read before any model loads: a bad path fails at once)."""
    if not value or not value.startswith("@"):
        return value or None
    try:
        return open(value[1:], encoding="utf-8").read()
    except OSError as e:
        raise InvalidRequestError(f"--prediction: cannot read {value[1:]}: {e}") from None


def _with_prediction(params: SamplingParams, text: str | None, tokenizer) -> SamplingParams:
    """The prediction's token ids (`prediction_token_ids`, as the API reads it), its seed mixed as where a request
    enters the server (`prediction_seed`); `params` itself without one."""
    ids = prediction_token_ids(text or "", tokenizer)
    if not ids:
        return params
    seed = prediction_seed(params.seed, params.temperature, ids)
    return SamplingParams.build(**{**params.model_dump(exclude_unset=True), "prediction": ids, "seed": seed})


def engine_overrides(items: list[str]) -> dict:
    """`--set FIELD=VALUE` items as engine field changes (values read as YAML: 4 is an int, true a bool)."""
    import yaml

    changes = {}
    for item in items:
        field, sep, value = item.partition("=")
        if not sep or not field.strip():
            raise ConfigError(f"--set {item!r}: FIELD=VALUE, e.g. draft=eagle3")
        changes[field.strip()] = yaml.safe_load(value)
    return changes


def _serve(args) -> int:
    import signal
    import threading

    config = load_config(args.config)  # fails fast, naming the field, before Ray starts
    changes = {k: v for k, v in (("backend", args.engine), ("proposer", args.proposer)) if v}
    changes.update(engine_overrides(args.engine_set))
    if changes:
        config.app_configs = {name: app.with_engine(**changes) for name, app in config.app_configs.items()}
    endpoints = start(config, args.http_port, args.grpc_port)
    model = next(iter(config.app_configs.values())).model_id
    app = next(iter(config.app_configs.values()))
    replicas = endpoints.direct.get(endpoints.app_names[0]) or []
    direct = "".join(f"  direct, replica {i}: {url}/v1   (the same API from that replica itself, past Serve's proxy: "
                     f"faster; it reaches that replica only)\n" for i, url in enumerate(replicas))
    print(f"tandem is serving {model} on the {app.engine.backend} engine (proposer {app.engine.proposer})\n"
          f"  OpenAI HTTP API: {endpoints.http}/v1   (GET /v1/models, POST /v1/completions, /v1/chat/completions)\n"
          f"  gRPC:            {endpoints.grpc}   (tandem.v1.Generation/Generate; metadata application="
          f"{endpoints.app_names[0]}{'; authorization=Bearer KEY' if app.api_keys else ''}; reflection and "
          f"grpc.health.v1 on)\n"
          f"{direct}"
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


def run_command(args, handler) -> int:
    """Logging as `-v` asks, then `handler(args)`; a TandemError is one line on stderr and exit status 2.
    The `tandem` command and `python -m tools` both run through it."""
    logging.basicConfig(level=logging.INFO if args.verbose else logging.WARNING,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    if not args.verbose:
        hf_logging.set_verbosity_error()
        hf_logging.disable_progress_bar()
    try:
        return handler(args)
    except TandemError as e:
        print(f"tandem: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130


def _dispatch(args) -> int:
    if args.command == "models":
        print(prepare_default_model(args.cache_dir, force=args.force))
        return 0
    if args.command == "generate":
        return _generate(args)
    if args.command == "serve":
        return _serve(args)
    if args.command == "drafts":
        return run_drafts(args)
    raise AssertionError(args.command)


def main(argv: list[str] | None = None) -> int:
    return run_command(_parser().parse_args(argv), _dispatch)


if __name__ == "__main__":
    sys.exit(main())
