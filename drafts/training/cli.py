"""`tandem drafts distill|validate`: make and check drafts for a target (training tools, off the serving path)."""

from __future__ import annotations

import json
import shlex
import sys
from pathlib import Path

import torch

from cluster.core.config import EngineConfig
from cluster.core.errors import ConfigError
from cluster.core.workloads import CHAT_PROMPTS, humaneval_prompts, workload
from cluster.model import models
from cluster.model.models import encode_prompt
from cluster.model.gemm import fast_linears
from drafts.factory import make_proposer
from drafts.feature_proposer import feature_draft_dir, is_feature_draft
from drafts.training import validate as v
from drafts.training.distill import DistillConfig, distill
from drafts.training.feature_draft import FeatureDistillConfig, distill_feature


def add_drafts_parser(sub) -> None:
    """`tandem drafts distill|validate`."""
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
    dist.add_argument("--precision", choices=("auto", "bf16", "fp32"),
                      help="feature: matmul precision (default auto: the faster of the two, timed here)")
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
    val.add_argument("--tree-width", type=int, default=1,
                     help="a feature-fed draft's dynamic tree: nodes expanded per depth (1: chains only)")
    val.add_argument("--tree-tokens", type=int, default=16, help="the dynamic tree's node budget")
    val.add_argument("--vllm-step-ms", type=float,
                     help="vLLM's step on this machine (e.g. from `python -m tools bench --peer`): adds its "
                          "engine's c and predicted speedup")
    val.add_argument("--record", action="store_true",
                     help="write the report's summary into the draft directory's tandem_draft.json (under "
                          "validate.<workload>), beside its provenance")
    val.add_argument("--cache-dir")


def run_drafts(args) -> int:

    target_path = models.resolve_model_path(args.target, args.cache_dir)
    tokenizer = models.load_tokenizer(target_path)
    if args.drafts_command == "distill":
        def given(*names):
            return {n: getattr(args, n) for n in names if getattr(args, n) is not None}

        held_out = set(humaneval_prompts()) | set(CHAT_PROMPTS)
        shared = given("max_tokens", "lr", "chat_samples", "threads")
        if args.kind == "feature":
            if args.self_speculative or args.vocab_size <= 0:
                raise ConfigError("--kind feature takes neither --self-speculative nor --vocab-size 0")
            config = FeatureDistillConfig(**shared, **given("epochs", "feature_weight", "feature_noise", "eval_every",
                                                            "unroll", "init_from", "precision"),
                                          max_minutes=args.max_minutes, vocab_size=args.vocab_size, seed=args.seed,
                                          seq_len=args.seq_len, batch_size=args.batch_size,
                                          code_dirs=tuple(args.code_dir))
            torch.set_num_threads(config.threads)
            target = models.load_causal_lm(target_path, "bfloat16", "cpu")
            print(json.dumps(distill_feature(target, tokenizer, args.out, config, held_out), indent=1))
            return 0
        feature_only = given("epochs", "feature_weight", "feature_noise", "eval_every", "unroll", "init_from",
                             "precision")
        if args.code_dir:
            feature_only["code_dir"] = args.code_dir
        if feature_only:
            raise ConfigError(f"--{next(iter(feature_only)).replace('_', '-')} needs --kind feature")

        config = DistillConfig(layers=[int(x) for x in args.layers.split(",")], vocab_size=args.vocab_size,
                               self_speculative=args.self_speculative, seq_len=args.seq_len,
                               batch_size=args.batch_size, max_minutes=args.max_minutes, seed=args.seed,
                               **{"max_tokens": 400_000, "lr": 3e-4, "chat_samples": 64, "threads": 2, **shared})
        torch.set_num_threads(config.threads)
        target = models.load_causal_lm(target_path, "bfloat16", "cpu")
        report = distill(target, tokenizer, args.out, config, held_out=held_out)
        print(json.dumps(report, indent=1))
        return 0

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
    engine = EngineConfig.build(target=str(target_path), draft=args.draft, dtype=args.dtype, cache_dir=args.cache_dir,
                                tree_width=args.tree_width, tree_tokens=args.tree_tokens)
    proposer = make_proposer(engine, target, tokenizer)
    # the target as the torch engine runs it (after the proposer: a copied draft copies plain linears)
    fast_linears(target, "validate target", onednn=engine.onednn, gemm=engine.fp32_gemm)
    draft = proposer if getattr(proposer, "needs_features", False) else proposer.runner.model
    prompts = [encode_prompt(tokenizer, t, chat) for t in texts]
    report = v.validate(target, draft, prompts, args.max_tokens, args.max_gamma,
                        vllm_step_s=args.vllm_step_ms / 1e3 if args.vllm_step_ms else None)
    report.update(target=str(target_path), draft=args.draft, workload=args.workload, dtype=args.dtype,
                  threads=args.threads)
    print(v.format_report(report))
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=2))
    if args.plot:
        v.plot(report, args.plot)
    if args.record:
        _record_validation(args, report)
    if args.min_acceptance is not None and report["alpha"] < args.min_acceptance:
        print(f"tandem: α = {report['alpha']:.3f} is below --min-acceptance {args.min_acceptance}", file=sys.stderr)
        return 1
    return 0


def _rounded(x):
    """A report's figures to 4 decimals, for tandem_draft.json."""
    if isinstance(x, float):
        return round(x, 4)
    if isinstance(x, dict):
        return {k: _rounded(v) for k, v in x.items()}
    if isinstance(x, list):
        return [_rounded(v) for v in x]
    return x


def _record_validation(args, report: dict) -> None:

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
        "hybrid_predicted_sequential_speedup": round(hybrid["best_predicted_sequential_speedup"], 3),
        "engines": _rounded(report["engines"]),
        **({"tree": _rounded(report["tree"])} if report.get("tree") else {})}
    meta_file.write_text(json.dumps(meta, indent=1) + "\n")
