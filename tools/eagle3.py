"""Train an EAGLE-3-style draft (`drafts.eagle3_model`) on the target's own answers (issue 24, item 2).

    python -m tools.eagle3 --data ~/.cache/tandem/draftdata/smollm2-135m --out DIR
        [--steps 2000] [--max-minutes 60] [--ttt-steps 5] [--seq-len 256] [--batch-size 4]

Data: the shards of `python -m tools.draftdata generate` (the target's answers to prompts made here;
HumanEval and the benchmark prompts held out there), each sample cut into windows of `seq_len` tokens, the
first starting `context` (32) tokens before its answer, each later one `context` tokens before the last one's end,
so the whole answer is trained (`--max-windows 1`: its first window only); the loss counts answer positions
only, each once. The target runs on every batch (its hidden states
entering the three fused layers and its distribution), so nothing is cached and the data can grow.

Objective (EAGLE-3): no feature regression; "training-time test" over `ttt_steps` steps: step 0 reads
the fused target states, step j > 0 reads the draft's own output of step j − 1 at the position before,
and attends to the target-fed entries up to the round's start plus its own earlier steps of that round
(`ttt_mask`), exactly what drafting j tokens past the committed point sees. Step j's loss, weighted
0.8^j, is the soft cross-entropy of the draft against the target's distribution over the draft's
vocabulary (the most frequent answer tokens; `d2t` maps them to target ids).

Every `eval_every` steps (and at the end) the held-out sets (HumanEval and chat prompts with the
target's greedy continuation) are scored by the same forward: per-step agreement and the mean accepted
length of a greedy γ = ttt_steps round; appended to `learning_curve.jsonl`; a checkpoint is written and
a rerun resumes from it, on its shards plus those finished since (the data grows between sessions; the
draft vocabulary stays the checkpoint's; `--freeze-data` keeps the shards it had). `--init DIR` starts a fresh
run (no checkpoint in `--out`) from an exported draft's weights and vocabulary, with a new schedule. The export is bf16 safetensors with
provenance in `tandem_draft.json`.
"""

from __future__ import annotations

import argparse
import copy
import json
import logging
import shlex
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import torch
from transformers import DynamicCache

from cluster.core.tree import additive_mask
from cluster.model import models
from drafts.eagle3_model import WEIGHTS, Eagle3Draft, load_eagle3, save_tandem
from drafts.training import restores_torch_threads
from drafts.training.distill import frequent_vocab
from drafts.training.feature_draft import _eval_sets
from tools.draftdata.shards import Manifest, read_shard

log = logging.getLogger(__name__)
CHECKPOINT, CURVE = "checkpoint.pt", "learning_curve.jsonl"


@dataclass
class Eagle3Config:
    data: str
    ttt_steps: int = 5
    step_weight: float = 0.8
    seq_len: int = 256
    batch_size: int = 4
    lr: float = 5e-4
    vocab_size: int = 8192
    steps: int = 2000
    max_minutes: float = 0.0
    eval_every: int = 200
    eval_humaneval: int = 16
    eval_chat: int = 8
    eval_new_tokens: int = 64
    context: int = 32  # tokens kept before the answer (or before a later window's first trained token)
    max_windows: int = 0  # windows a sample at most (0: as many as cover its whole answer)
    max_shards: int = 0  # 0: every shard the manifest lists at the first run
    freeze_data: bool = False  # on resume, keep the checkpoint's shards (default: add those finished since)
    seed: int = 0
    threads: int = 1
    precision: str = "bf16"  # "bf16": the target's features in a bf16 copy, the draft's products in bf16 (autocast)
    init: str = ""  # a fresh run starts from this tandem EAGLE-3 directory's weights and vocabulary (a warm start)


def ttt_mask(n: int, step: int) -> torch.Tensor:
    """Which keys each query sees when the entries of steps 0..step (n each) run as one sequence  # bool
    [(step + 1) n, (step + 1) n]: query (a, t) sees step 0's entries s <= t - a (target-fed context) and
    step b's entry t - a + b for 1 <= b <= a (its own round's earlier steps, then itself)."""
    idx = torch.arange((step + 1) * n)
    a, t = (idx // n)[:, None], (idx % n)[:, None]
    b, s = (idx // n)[None], (idx % n)[None]
    return ((b == 0) & (s <= t - a)) | ((b >= 1) & (b <= a) & (s == t - a + b))


def load_windows(data: Path, names: list[str], seq_len: int, context: int, pad: int,
                 max_windows: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """(ids [N, seq_len], answer mask [N, seq_len]: the positions whose token is part of an answer and is trained
    in this window). A sample's first window starts `context` tokens before its answer; while the answer runs
    past a window, the next starts `context` tokens before the end of the last (its first entries are context
    again, its mask only the tokens no earlier window held), so the whole answer is trained; `max_windows` > 0
    keeps at most that many windows a sample (1: its answer's first seq_len - context tokens only)."""
    if seq_len <= context:
        raise ValueError(f"seq_len {seq_len} must exceed context {context}")
    ids, mask = [], []
    for name in names:
        shard = read_shard(data / name)
        for i in range(len(shard)):
            tokens, plen = shard.sample(i), int(shard.prompt_len[i])
            start, trained, count = max(0, plen - context), plen, 0
            while trained < len(tokens) and (max_windows <= 0 or count < max_windows):
                window = tokens[start:start + seq_len]
                m = [start + j >= trained for j in range(len(window))]
                ids.append(window + [pad] * (seq_len - len(window)))
                mask.append(m + [False] * (seq_len - len(window)))
                trained, count = start + len(window), count + 1
                start = trained - context
    return torch.tensor(ids, dtype=torch.long), torch.tensor(mask, dtype=torch.bool)


def target_states(target, ids: torch.Tensor, d2t: torch.Tensor):
    """The target on ids [B, W]: (transformers' `hidden_states` tuple, p [B, W - 1, K]: its distribution over the
    draft vocabulary at each entry, renormalised there). Only the head's rows at d2t are computed: the
    softmax of those logits is the full distribution renormalised over them, at a sixth of the head's cost."""
    with torch.no_grad():
        out = target.model(input_ids=ids, output_hidden_states=True)
        logits = out.last_hidden_state[:, 1:] @ target.lm_head.weight[d2t].T
        return out.hidden_states, torch.softmax(logits.float(), -1)


def ttt_forward(target, draft: Eagle3Draft, ids: torch.Tensor, steps: int, target_out=None, bf16: bool = False):
    """The target's distribution over the draft vocabulary and the draft's logits at every TTT step.
    ids [B, W] -> (p [B, W - 1, K]: entry t's target, the distribution of token t + 2; logits: steps x [B, W - 1, K]).
    `target_out`: the target's output on `ids` (with hidden states) when the caller has it already. `bf16`:
    the draft's matrix products in bfloat16 (autocast; its weights and the loss stay fp32)."""
    if target_out is not None:
        hidden = target_out.hidden_states
        with torch.no_grad():
            p = torch.softmax(target_out.logits[:, 1:, :].float()[..., draft.d2t], -1)
    else:
        hidden, p = target_states(target, ids, draft.d2t)
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16):
        u = draft.fused(hidden)[:, :-1]  # [B, n, H]
        n, tokens = u.shape[1], ids[:, 1:]
        pos, cache, logits = torch.arange(n)[None], DynamicCache(), []
        for j in range(steps):
            # step j's n entries attend to the cached keys of steps 0..j-1 (their inputs never change, so
            # neither do their keys) and to their own: ttt_mask's rows for step j
            mask = additive_mask(ttt_mask(n, j)[j * n:], u.dtype)
            g, _ = draft(u, tokens, past=cache, pos=pos, mask=mask[None, None])  # [B, n, H]
            logits.append(draft.logits(g))
            u = torch.cat([g[:, :1], g[:, :-1]], 1)  # entry t of the next step reads g at t - 1
    return p, logits


def ttt_loss(p, logits, valid: torch.Tensor, weight: float) -> tuple[torch.Tensor, list[float]]:
    """Σ_j weight^j · soft-CE at step j over entries t >= j whose target token is an answer token
    (valid [B, W - 1])."""
    total, parts = 0.0, []
    for j, lg in enumerate(logits):
        m = valid.clone()
        m[:, :j] = False
        ce = -(p * torch.log_softmax(lg.float(), -1)).sum(-1)  # [B, n]
        part = (ce * m).sum() / m.sum().clamp(min=1)
        total = total + weight ** j * part
        parts.append(part.item())
    return total, parts


def right_drafts(draft: Eagle3Draft, logits, full: list[int]) -> torch.Tensor:
    """[steps, n] bool: step j's greedy draft at entry t (of one sequence `full`, `ttt_forward`'s logits) is the
    token that follows (entry t predicts token t + 2)."""
    truth = torch.tensor(full[2:] + [-1])
    return torch.stack([draft.d2t[lg[0].argmax(-1)] == truth for lg in logits])


def chained_rounds(right: torch.Tensor, prompt_len: int) -> tuple[int, int]:
    """(rounds, accepted drafts) of greedy chains of `right`'s steps along the sequence after its prompt, as a
    speculative engine runs them (vLLM's eagle3 among them): a round drafts after the last target-fed entry,
    keeps its longest run of right drafts, then the target's token."""
    gamma, last = right.shape[0], right.shape[1] - 1
    t, rounds, accepted = prompt_len - 1, 0, 0
    while t < last:
        m = 0
        while m < gamma and t + m < last and bool(right[m, t + m]):
            m += 1
        rounds, accepted, t = rounds + 1, accepted + m, t + m + 1
    return rounds, accepted


@torch.no_grad()
def evaluate(target, draft: Eagle3Draft, sets: dict, steps: int, bf16: bool = False) -> dict:
    """Per workload: agreement at each step (given the correct tokens before), the mean accepted length of
    a greedy round of `steps` drafts (the longest run of agreeing steps along its diagonal) and step 0's
    soft cross-entropy against the target."""
    was = draft.training
    draft.eval()
    result = {}
    for name, seqs in sets.items():
        hits, counts, accepted, rounds, ce, ce_n = np.zeros(steps), np.zeros(steps), 0, 0, 0.0, 0
        for plen, full in seqs:
            ids = torch.tensor([full])
            p, logits = ttt_forward(target, draft, ids, steps, bf16=bf16)
            n = ids.shape[1] - 1
            first = max(plen - 2, 0)
            ce += float(-(p[0, first:] * torch.log_softmax(logits[0][0, first:].float(), -1)).sum())
            ce_n += n - first
            right = right_drafts(draft, logits, full)  # [steps, n]
            for j in range(steps):
                hits[j] += int(right[j, first + j:n - 1].sum())
                counts[j] += max(0, n - 1 - first - j)
            for t in range(first, n - steps):
                m = 0
                while m < steps and bool(right[m, t + m]):
                    m += 1
                accepted, rounds = accepted + m, rounds + 1
        result[name] = {"agreement_per_step": [round(h / max(c, 1), 4) for h, c in zip(hits, counts)],
                        f"mean_accepted_of_{steps}": accepted / max(rounds, 1),
                        "soft_ce_step0": ce / max(ce_n, 1)}  # against the target's distribution
    draft.train(was)
    return result


def resume_shards(state: dict | None, finished: list[str], config: Eagle3Config) -> list[str]:
    """The shards a run trains on: a fresh run every finished one (at most `max_shards`); a resumed run the
    checkpoint's, in their order, then (unless `freeze_data`) those finished since."""
    if state is None:
        return finished[: config.max_shards or None]
    names = list(state["shards"])
    if not config.freeze_data:
        known = set(names)
        names += [name for name in finished if name not in known]
    return names


@restores_torch_threads
def train(target, tokenizer, out_dir, config: Eagle3Config, eval_sets: dict | None = None) -> dict:
    """Train (or resume) into `out_dir`; returns the exported tandem_draft.json. `eval_sets` replaces the
    held-out HumanEval / chat sets (tests)."""
    if config.precision not in ("bf16", "fp32"):
        raise ValueError(f"precision {config.precision!r}: bf16 or fp32")
    started = time.time()
    deadline = started + 60 * config.max_minutes if config.max_minutes else float("inf")
    out, data = Path(out_dir), Path(config.data).expanduser()
    out.mkdir(parents=True, exist_ok=True)
    torch.manual_seed(config.seed)
    target.eval()
    ckpt = out / CHECKPOINT
    state = torch.load(ckpt, weights_only=False) if ckpt.is_file() else None
    manifest = Manifest.load(data)
    if manifest is None:
        raise FileNotFoundError(f"{data} holds no draftdata manifest (python -m tools.draftdata generate)")
    names = resume_shards(state, [s.file for s in manifest.shards], config)
    if not names:
        raise ValueError(f"{data} has no finished shard yet")
    pad = tokenizer.eos_token_id if tokenizer.eos_token_id is not None else 0
    ids, answer = load_windows(data, names, config.seq_len, config.context, pad, config.max_windows)  # [N, W]
    warm = load_eagle3(target, Path(config.init).expanduser(), torch.float32) if config.init and state is None else None
    if state is not None:  # the head's rows are the checkpoint's, whatever data came since
        vocab = state["draft"]["d2t"]
    elif warm is not None:  # a warm start keeps the earlier draft's vocabulary and weights
        vocab = warm.d2t
    else:
        vocab = torch.tensor(frequent_vocab(ids[answer].tolist(), config.vocab_size, [pad]))
    draft = Eagle3Draft(target, vocab).float().train()
    if warm is not None:
        draft.load_state_dict(warm.state_dict())
        log.info("warm start from %s (%d-token vocabulary)", config.init, len(vocab))
    # bf16 (the default): the features and the target's distribution come from a bf16 copy of the target (what a
    # bf16 verifier serves them from) and the draft's products run in bf16; measured 2026-12-04 (BENCHMARKS.md)
    bf16 = config.precision == "bf16"
    features = copy.deepcopy(target).to(torch.bfloat16).eval() if bf16 else target
    params = [p for p in draft.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(params, lr=config.lr)
    scheduler = torch.optim.lr_scheduler.OneCycleLR(optimizer, max_lr=config.lr, total_steps=config.steps,
                                                    pct_start=0.05)
    step, minutes_before = 0, 0.0
    if state is not None:
        draft.load_state_dict(state["draft"])
        optimizer.load_state_dict(state["optimizer"])
        scheduler.load_state_dict(state["scheduler"])
        step, minutes_before = state["step"], state["minutes"]
        log.info("resuming at step %d of %d on %d shards (%d at the checkpoint)", step, config.steps, len(names),
                 len(state["shards"]))
    shape = SimpleNamespace(eval_humaneval=config.eval_humaneval, eval_chat=config.eval_chat,
                            eval_new_tokens=config.eval_new_tokens)  # the fields `_eval_sets` reads
    sets = eval_sets if eval_sets is not None else _eval_sets(target, tokenizer, shape, out)
    valid = answer[:, 2:]  # entry t predicts token t + 2
    valid = torch.cat([valid, torch.zeros(len(valid), 1, dtype=torch.bool)], 1)  # [N, W - 1]
    per_epoch = max(1, len(ids) // config.batch_size)

    def minutes() -> float:
        return minutes_before + (time.time() - started) / 60

    def record(loss) -> dict:
        entry = {"step": step, "epoch": round(step / per_epoch, 3), "minutes": round(minutes(), 2),
                 "loss": loss, **evaluate(features, draft, sets, config.ttt_steps, bf16)}
        with open(out / CURVE, "a") as f:
            f.write(json.dumps(entry) + "\n")
        log.info("evaluation %s", json.dumps(entry))
        torch.save({"draft": draft.state_dict(), "optimizer": optimizer.state_dict(),
                    "scheduler": scheduler.state_dict(), "step": step, "minutes": minutes(), "shards": names,
                    **run_provenance(config)}, ckpt)  # an export of the checkpoint names its run
        return entry

    last = record(None) if step == 0 else None
    losses: list[float] = []
    while step < config.steps and time.time() < deadline:
        epoch, i = divmod(step, per_epoch)
        order = torch.randperm(len(ids), generator=torch.Generator().manual_seed(config.seed + epoch))
        batch = order[i * config.batch_size:(i + 1) * config.batch_size]
        p, logits = ttt_forward(features, draft, ids[batch], config.ttt_steps, bf16=bf16)
        loss, _ = ttt_loss(p, logits, valid[batch], config.step_weight)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        optimizer.step()
        scheduler.step()
        step += 1
        losses.append(loss.item())
        if step % config.eval_every == 0 or step == config.steps or time.time() >= deadline:
            last, losses = record(sum(losses) / len(losses)), []
    if last is None:
        last = json.loads((out / CURVE).read_text().splitlines()[-1])
    return export(target, draft, out, config, manifest, names, len(ids), step, last)


def run_provenance(config: Eagle3Config) -> dict:
    """The run that trained a draft: its command line and config (in its checkpoints and its export)."""
    return {"command": shlex.join(sys.argv), "config": asdict(config)}


def export(target, draft: Eagle3Draft, out: Path, config: Eagle3Config, manifest, names, windows, step, last) -> dict:
    meta = {"target": str(target.config.name_or_path),
            "weights": f"{WEIGHTS} (bf16): fuse, fc, the decoder layer, norm and d2t; the token embedding and "
                       "the head rows at d2t are rebuilt from the target",
            **run_provenance(config), "steps": step,
            "data": {"dir": str(config.data), "shards": names, "windows": windows,
                     "recipe": manifest.recipe,
                     "answer_tokens": sum(s.answer_tokens for s in manifest.shards if s.file in names)},
            "final_eval": {k: v for k, v in last.items() if k not in ("step", "epoch", "minutes", "loss")},
            "minutes": last["minutes"], "torch": torch.__version__}
    return save_tandem(draft, out, meta)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--data", required=True)
    parser.add_argument("--out", required=True)
    parser.add_argument("--target", default="default")
    for name, field in Eagle3Config.__dataclass_fields__.items():
        if name == "data":
            continue
        if isinstance(field.default, bool):
            parser.add_argument("--" + name.replace("_", "-"), action="store_true")
        else:
            parser.add_argument("--" + name.replace("_", "-"), type=type(field.default), default=field.default)
    args = vars(parser.parse_args(argv))
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    path = models.prepare_default_model() if args["target"] == "default" else args["target"]
    target = models.load_causal_lm(path, "float32", "cpu")
    out, _ = args.pop("out"), args.pop("target")
    meta = train(target, models.load_tokenizer(path), out, Eagle3Config(**args))
    print(json.dumps(meta["final_eval"], indent=1))


if __name__ == "__main__":
    main()
