"""CLI: `python -m tools.draftdata generate|status`.

    python -m tools.draftdata generate --out DIR --target-tokens 5000000 --shard-size 256 \\
        [--engine auto|vllm|hf] [--max-tokens 512] [--seed 0] [--limit-shards N] [--threads 1]
    python -m tools.draftdata status --out DIR

`generate` resumes from DIR's manifest by default and stops when DIR holds `--target-tokens`
answer tokens (or after `--limit-shards` new shards). Recipe options left out on a resume are taken
from the manifest; given ones must match it.
"""

from __future__ import annotations

import argparse
import logging
import os
import signal
import sys
from dataclasses import asdict, fields
from pathlib import Path

from transformers import AutoTokenizer

from .engines import make_engine
from .pipeline import Generator, Recipe, status, target_sampling
from .shards import Manifest

DEFAULT_MODEL = Path(os.environ.get("TANDEM_CACHE_DIR", "~/.cache/tandem")).expanduser() / "models" / \
    "SmolLM2-135M-Instruct"
DEFAULT_OUT = Path("~/.cache/tandem/draftdata/smollm2-135m").expanduser()
log = logging.getLogger("tools.draftdata")


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m tools.draftdata", description=__doc__.splitlines()[0])
    sub = p.add_subparsers(dest="cmd", required=True)
    g = sub.add_parser("generate", help="generate (or resume) on-policy data")
    g.add_argument("--out", type=Path, default=DEFAULT_OUT)
    g.add_argument("--model", type=Path, default=DEFAULT_MODEL, help="the target's Hugging Face directory")
    g.add_argument("--target-tokens", type=int, default=5_000_000, help="stop at this many answer tokens")
    g.add_argument("--limit-shards", type=int, default=None, help="at most this many new shards this run")
    g.add_argument("--engine", choices=("auto", "vllm", "hf"), default="auto")
    g.add_argument("--threads", type=int, default=1, help="compute threads (vLLM: cores bound; hf: torch)")
    g.add_argument("--batch-size", type=int, default=16, help="hf engine batch size")
    # auto: bfloat16 where the CPU has native bf16 (an Intel Xeon with AMX, one core, 64 chat prompts at once:
    # 635 generated tok/s in bf16, 228 in fp32), float32 elsewhere (an AVX2 CPU: 65 in fp32, 26 in bf16)
    g.add_argument("--vllm-dtype", default="auto", help="auto, bfloat16 or float32")
    g.add_argument("--hf-dtype", default="float32")
    # recipe options: None = the manifest's value on a resume, the Recipe default on a new folder
    g.add_argument("--shard-size", type=int, default=None)
    g.add_argument("--max-tokens", type=int, default=None)
    g.add_argument("--seed", type=int, default=None)
    g.add_argument("--greedy-fraction", type=float, default=None)
    s = sub.add_parser("status", help="summarise a data folder")
    s.add_argument("--out", type=Path, default=DEFAULT_OUT)
    return p


def resolve_recipe(out: Path, model: Path, given: dict) -> Recipe:
    """The manifest's recipe on a resume (given options must agree), else defaults plus options."""
    manifest = Manifest.load(out)
    names = {f.name for f in fields(Recipe)}
    if manifest is not None:
        recipe = Recipe(**{k: v for k, v in manifest.recipe.items() if k in names})
        clash = {k: (getattr(recipe, k), v) for k, v in given.items() if v is not None and getattr(recipe, k) != v}
        if clash:
            raise SystemExit(f"{out}: options differ from the manifest's recipe (manifest, given): {clash}")
        return recipe
    temperature, top_p = target_sampling(model)
    return Recipe(temperature=temperature, top_p=top_p, **{k: v for k, v in given.items() if v is not None})


def _terminate(signum, frame):
    raise KeyboardInterrupt(f"signal {signum}")


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    if args.cmd == "status":
        print(status(args.out.expanduser()))
        return 0
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    out = args.out.expanduser()
    given = {"shard_size": args.shard_size, "max_tokens": args.max_tokens, "seed": args.seed,
             "greedy_fraction": args.greedy_fraction}
    recipe = resolve_recipe(out, args.model, given)
    tokenizer = AutoTokenizer.from_pretrained(str(args.model))
    engine = make_engine(args.engine, args.model, tokenizer.convert_tokens_to_ids("<|im_end|>"), seed=recipe.seed,
                         threads=args.threads, vllm_dtype=args.vllm_dtype, hf_dtype=args.hf_dtype,
                         batch_size=args.batch_size)
    signal.signal(signal.SIGTERM, _terminate)
    log.info("recipe: %s", {k: v for k, v in asdict(recipe).items()
                            if k not in ("source_sizes", "chat_prefix", "sources_sha256", "heldout_prompts")})
    try:
        Generator(out, tokenizer, engine, recipe).run(args.target_tokens, args.limit_shards)
    except KeyboardInterrupt as exc:
        log.warning("interrupted (%s); the shard in progress is dropped, done shards are kept", exc)
        print(status(out))
        return 130
    print(status(out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
