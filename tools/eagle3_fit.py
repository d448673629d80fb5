"""Is the EAGLE-3 draft short of data or of capacity? Its agreement on answers it was trained on, beside held-out ones
(issue 24: what would reach the goal).

    python -m tools.eagle3_fit --draft drafts/trained/eagle3-smollm2-135m --data drafts/data/smollm2-135m \
        [--samples 16] [--tokens 64] [--json F]

Training sets: greedy samples of the shards the draft was trained on (its `tandem_draft.json` names them), taken
evenly across them (`--shards N`: the first N only), each cut to its prompt and its answer's first `tokens` tokens, i.e. the target's own greedy
continuation as the data engine wrote it and the draft trained on it: `train_chat` (Magpie and topic prompts,
through the chat template) and `train_code` (the code tasks). Held out: the HumanEval and chat sets the training run
scores (`drafts.training.feature_draft._eval_sets`, the same sizes). All four are scored by `tools.eagle3.evaluate`
as the training run scores them (the target's features from its bf16 copy): agreement at each of the 5 steps of a
round and the mean accepted of a 5-token greedy round. A draft that agrees far more on its training answers than on
held-out ones is short of data; one that agrees about as little on both is short of capacity or of training.
"""

from __future__ import annotations

import argparse
import copy
import json
from pathlib import Path
from types import SimpleNamespace

import torch

from cluster.model import models
from drafts.eagle3_model import META, load_eagle3
from drafts.training.feature_draft import _eval_sets
from tools.draftdata.shards import Manifest, read_shard
from tools.eagle3 import evaluate

KINDS = {"train_chat": ("magpie", "topic"), "train_code": ("code",)}


def training_sets(data: Path, shards: list[str], samples: int, tokens: int) -> dict[str, list[tuple[int, list[int]]]]:
    """Per training set, `samples` (prompt length, prompt + first `tokens` answer tokens) of greedy, chat-template
    samples of its kinds whose answer has at least `tokens` tokens: a first pass takes one a set from each of the
    shards spread evenly over `shards`, then from every shard in order, as many as are still needed."""
    sets: dict[str, list[tuple[int, list[int]]]] = {name: [] for name in KINDS}
    stride = max(1, len(shards) // samples)
    used: set[tuple[str, int]] = set()
    for one_each, names in ((True, shards[::stride]), (False, shards)):
        for name in names:
            if all(len(v) >= samples for v in sets.values()):
                return sets
            shard, taken = read_shard(data / name), set()
            for i in range(len(shard)):
                plen, full = int(shard.prompt_len[i]), shard.sample(i)
                if (name, i) in used or not (bool(shard.greedy[i]) and bool(shard.chat[i])
                                             and len(full) - plen >= tokens):
                    continue
                for set_name, kinds in KINDS.items():
                    if (str(shard.kind[i]) in kinds and len(sets[set_name]) < samples
                            and not (one_each and set_name in taken)):
                        sets[set_name].append((plen, full[:plen + tokens]))
                        taken.add(set_name)
                        used.add((name, i))
    return sets


def trained_shards(data: dict) -> list[str]:
    """The shard files a draft's provenance names: a list (tools.eagle3's export), or a count from shard 0
    (tools.eagle3_export_checkpoint's)."""
    shards = data["shards"]
    return list(shards) if isinstance(shards, list) else [f"shard-{i:06d}.npz" for i in range(int(shards))]


def unseen_shards(data: Path, trained: list[str]) -> list[str]:
    """The finished shards of `data`'s manifest that are not among `trained`, in order."""
    seen = set(trained)
    return [s.file for s in Manifest.load(data).shards if s.file not in seen]


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--draft", required=True, help="a tandem EAGLE-3 directory (tools.eagle3's export)")
    parser.add_argument("--data", required=True, help="the draftdata folder it was trained on")
    parser.add_argument("--samples", type=int, default=16, help="samples per training set")
    parser.add_argument("--tokens", type=int, default=64, help="answer tokens per sample")
    parser.add_argument("--shards", type=int, default=0,
                        help="take the training sets from the draft's first N shards only (0: all it names), e.g. "
                             "those every run of a warm-started chain trained on")
    parser.add_argument("--unseen", action="store_true",
                        help="also the same sets from the data's shards the draft did not train on (`unseen_chat`, "
                             "`unseen_code`): held out, but drawn as the training data was")
    parser.add_argument("--eval-humaneval", type=int, default=8)
    parser.add_argument("--eval-chat", type=int, default=8)
    parser.add_argument("--cache-dir", default="~/.cache/tandem/eagle3/fit", help="the held-out sets are kept here")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--json", metavar="F")
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    path = models.prepare_default_model()
    target = models.load_causal_lm(path, "float32", "cpu").eval()
    draft_dir = Path(args.draft)
    meta = json.loads((draft_dir / META).read_text())
    draft = load_eagle3(target, draft_dir, torch.float32)
    cache = Path(args.cache_dir).expanduser()
    cache.mkdir(parents=True, exist_ok=True)
    shape = SimpleNamespace(eval_humaneval=args.eval_humaneval, eval_chat=args.eval_chat,
                            eval_new_tokens=args.tokens)
    trained = trained_shards(meta["data"])
    shards = trained[: args.shards or None]
    sets = {**training_sets(Path(args.data), shards, args.samples, args.tokens),
            **_eval_sets(target, models.load_tokenizer(path), shape, cache)}
    unseen = unseen_shards(Path(args.data), trained) if args.unseen else []
    if args.unseen:
        if not unseen:
            raise SystemExit(f"{args.data}: every shard its manifest lists was trained on; nothing unseen")
        sets.update({k.replace("train_", "unseen_"): v
                     for k, v in training_sets(Path(args.data), unseen, args.samples, args.tokens).items()})
    features = copy.deepcopy(target).to(torch.bfloat16).eval()
    scores = evaluate(features, draft, sets, 5, bf16=True)
    report = {"draft": str(draft_dir), "steps": meta.get("steps"), "answer_tokens": meta["data"].get("answer_tokens"),
              "shards": len(trained), "sets_from_shards": len(shards), "unseen_shards": len(unseen), "samples": {k: len(v) for k, v in sets.items()},
              "tokens": args.tokens, "scores": scores}
    print(json.dumps(report, indent=1))
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=1) + "\n")


if __name__ == "__main__":
    main()
