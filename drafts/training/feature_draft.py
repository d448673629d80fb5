"""`tandem drafts distill --kind feature`: train a feature-fed (EAGLE-style) draft to acceptance.

The draft reads the target's last hidden state f_t (post-norm: what the target's head reads) with the
next token's embedding: fc([f_t; emb(x_{t+1})]) -> one Llama decoder layer (initialised from the
target's last) -> norm -> f̂_{t+1}, read by the target's head restricted to the corpus's most frequent
tokens to predict x_{t+2}. Beyond the committed point it drafts from its own f̂.

Data: stdlib code, pydoc prose and chat (the target's own greedy answers to instruction templates,
generated once and cached), cut into windows of `seq_len` tokens; HumanEval and the chat benchmark
prompts are held out. The target's features for those windows are computed once and cached on disk
in shards, so an interrupted run resumes without recomputing them. Loss: feature_weight ·
smooth-L1(f̂_{t+1}, f_{t+1}) + the cross-entropy of the draft's distribution against the target's over
the reduced vocabulary; Gaussian noise on the input features. Every `eval_every` steps (and at the end)
α is measured on held-out HumanEval prompts + the target's greedy continuations and on the chat
prompts, appended to `learning_curve.jsonl`, and a checkpoint is written; rerunning resumes from it.
"""

from __future__ import annotations

import contextlib
import copy
import hashlib
import json
import logging
import shlex
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
import torch.nn.functional as F

from cluster.core.workloads import CHAT_PROMPTS, humaneval_prompts
from cluster.model.models import encode_prompt
from drafts.feature_model import (
    CHECKPOINT,
    CURVE,
    META,
    WEIGHTS,
    FeatureDraft,
    load_feature_draft,
)
from drafts.training import restores_torch_threads
from drafts.training.distill import (
    build_corpus,
    chat_corpus,
    frequent_vocab,
    package_code,
    stdlib_texts,
)

log = logging.getLogger(__name__)



@dataclass
class FeatureDistillConfig:
    epochs: int = 8
    max_tokens: int = 1_000_000  # distinct training tokens (windows whose target features are cached)
    max_minutes: float = 0.0  # wall budget for the whole call, data and features included (0: none)
    lr: float = 1e-3
    vocab_size: int = 8192  # reduced head: the most frequent training tokens
    feature_weight: float = 1.0  # weight of the smooth-L1 feature regression against the token CE
    feature_noise: float = 0.02  # std of the Gaussian noise added to input features
    eval_every: int = 500  # steps between evaluations (each also writes a checkpoint)
    threads: int = 1
    seed: int = 0
    chat_samples: int = 192  # target-generated chat answers in the corpus (cached)
    chat_new_tokens: int = 256
    seq_len: int = 128
    batch_size: int = 8
    eval_humaneval: int = 16  # held-out HumanEval prompts in each evaluation
    eval_chat: int = 8  # held-out chat prompts in each evaluation
    eval_new_tokens: int = 64  # target greedy continuation evaluated after each prompt
    cache_dir: str = "~/.cache/tandem/feature-draft"
    code_dirs: tuple[str, ...] = ()  # more Python sources beyond the standard library (e.g. site-packages)
    unroll: int = 1  # passes per batch: pass k feeds, at a random `unroll_fraction` of positions, the draft's
    unroll_fraction: float = 0.5  # own prediction of the input feature from pass k-1 (drafting from its own)
    init_from: str = ""  # an exported feature draft (same data, so the same vocabulary) to start from
    precision: str = "auto"  # matmuls: "bf16" (autocast, fp32 weights), "fp32", or "auto": the faster of the
    #   two, timed on this machine at the start of each run (bf16 backward was 20x slower than fp32 on one CPU)


def _windows(target, tokenizer, config, cache: Path, held_out, texts) -> tuple[torch.Tensor, dict]:
    """Training windows [N, seq_len]: every chat window, then stdlib code and prose up to max_tokens."""
    chat_file = cache / f"chat-{config.chat_samples}-{config.chat_new_tokens}-{config.seed}.json"
    if not chat_file.is_file():
        t0 = time.time()
        chats = chat_corpus(target, tokenizer, config.chat_samples, config.chat_new_tokens, config.seed)
        chats = chats[: config.chat_samples]  # it answers in batches of 16
        chat_file.write_text(json.dumps(chats))
        log.info("%d chat answers from the target in %.0fs", len(chats), time.time() - t0)
    chats = json.loads(chat_file.read_text())
    code, prose = texts if texts is not None else stdlib_texts()
    if config.code_dirs:  # ~3.5 characters a token; twice the budget, the windows are sampled from the pool
        code = code + package_code(list(config.code_dirs), 7 * config.max_tokens, held_out, config.seed)
    T = config.seq_len
    streams = {"code": build_corpus(tokenizer, code, [], held_out),
               "pydoc_prose": build_corpus(tokenizer, prose, [], held_out),
               "chat_from_target": build_corpus(tokenizer, [], chats, held_out)}
    tiles = {k: torch.tensor(s[: len(s) // T * T], dtype=torch.long).view(-1, T) for k, s in streams.items()}
    g = torch.Generator().manual_seed(config.seed)
    chat = tiles["chat_from_target"][: config.max_tokens // T]
    pool = torch.cat([tiles["code"], tiles["pydoc_prose"]])  # [M, T]
    is_code = torch.arange(len(pool)) < len(tiles["code"])
    pick = torch.randperm(len(pool), generator=g)[: max(0, config.max_tokens // T - len(chat))]
    windows = torch.cat([chat, pool[pick]])  # [N, T]
    n_code = int(is_code[pick].sum())
    data = {"seq_len": T, "windows": len(windows), "tokens": windows.numel(), "chat_transcripts": len(chats),
            "code_dirs": list(config.code_dirs),
            "tokens_by_source": {"stdlib_code" if not config.code_dirs else "code": n_code * T, "pydoc_prose": (len(pick) - n_code) * T,
                                 "chat_from_target": len(chat) * T},
            "held_out": "HumanEval prompts and cluster.core.workloads.CHAT_PROMPTS (refused in any window)"}
    return windows, data


@torch.no_grad()
def _teacher_features(target, windows: torch.Tensor, folder: Path, shard: int = 256) -> torch.Tensor:
    """The target's last hidden state for every window [N, T, H] bf16, cached in shards of `shard` windows
    named by their content (a run with more windows reuses the shards it shares with an earlier one)."""
    folder.mkdir(parents=True, exist_ok=True)
    shards, t0 = [], time.time()
    for start in range(0, len(windows), shard):
        ids = windows[start:start + shard]  # [shard, T]
        path = folder / f"feats-{hashlib.sha1(ids.numpy().tobytes()).hexdigest()[:16]}.pt"
        if not path.is_file():
            feats = torch.cat([target.model(input_ids=ids[i:i + 16]).last_hidden_state.bfloat16()
                               for i in range(0, len(ids), 16)])  # [shard, T, H]
            torch.save(feats, path.with_suffix(".tmp"))
            path.with_suffix(".tmp").rename(path)
            log.info("teacher features: %d/%d windows, %.0fs", start + len(ids), len(windows), time.time() - t0)
        shards.append(torch.load(path))
    return torch.cat(shards)


def _eval_sets(target, tokenizer, config, out: Path) -> dict[str, list[tuple[int, list[int]]]]:
    """Held-out (prompt length, prompt + the target's greedy continuation) per workload, cached in out."""
    path = out / f"eval_sets-{config.eval_humaneval}-{config.eval_chat}-{config.eval_new_tokens}.json"
    if not path.is_file():
        sets = {}
        for name, prompts, chat in (("humaneval", humaneval_prompts(config.eval_humaneval), False),
                                    ("chat", CHAT_PROMPTS[: config.eval_chat], True)):
            sets[name] = []
            for prompt in prompts:
                ids = encode_prompt(tokenizer, prompt, chat)
                with torch.inference_mode():
                    full = target.generate(torch.tensor([ids]), max_new_tokens=config.eval_new_tokens,
                                           do_sample=False)[0].tolist()
                sets[name].append((len(ids), full))
        path.write_text(json.dumps(sets))
    return json.loads(path.read_text())


@torch.no_grad()
def evaluate(target, draft: FeatureDraft, sets, gamma: int = 3) -> dict:
    """Per workload: α at draft position 1 given the target's features, and the mean accepted of a γ
    round drafting from its own features after the first token (greedy, on the target's continuation)."""
    from transformers import DynamicCache

    was_training = draft.training
    draft.eval()
    result = {}
    for name, seqs in sets.items():
        agree = total = accepted = rounds = 0
        for plen, ids in seqs:
            x = torch.tensor([ids])  # [1, L]
            f = target.model(input_ids=x).last_hidden_state.float()  # [1, L, H]; f[t] predicts ids[t+1]
            fh, _ = draft(f[:, :-1], x[:, 1:])  # position t: (f_t, x_{t+1}) -> f̂_{t+1} -> predicts x_{t+2}
            pred = draft.vocab[draft.logits(fh).argmax(-1)][0]  # [L-1]
            agree += int((pred[plen - 2:-1] == x[0, plen:]).sum())
            total += len(ids) - plen
            cache = DynamicCache()  # the draft's KV, target-fed up to the committed point; rounds move its cursor
            draft(f[:, :plen - 1], x[:, 1:plen], past=cache)  # positions 0 .. plen-2
            for s in range(plen, len(ids) - gamma - 1, 2):  # a round after the committed prefix ids[:s+1]
                if s > plen:  # target-fed positions s-3, s-2
                    draft(f[:, s - 3:s - 1], x[:, s - 2:s], past=cache)
                f_in, x_in, n_ok = f[:, s - 1:s], x[:, s:s + 1], 0  # (f_{s-1}, x_s) -> the first draft token
                for k in range(gamma):
                    fh, _ = draft(f_in, x_in, past=cache)
                    token = int(draft.vocab[draft.logits(fh[:, -1]).argmax(-1)])
                    if token != ids[s + 1 + k]:
                        break
                    n_ok += 1
                    f_in, x_in = fh[:, -1:], torch.tensor([[token]])  # its own feature beyond the committed point
                cache.crop(s - 1 - cache.get_seq_length())  # back to the committed point
                accepted, rounds = accepted + n_ok, rounds + 1
        result[name] = {"alpha_pos1": agree / max(total, 1), f"mean_accepted_of_{gamma}": accepted / max(rounds, 1)}
    draft.train(was_training)
    return result


@torch.no_grad()
def cost_ratio(target, draft: FeatureDraft, ids: list[int], repeats: int = 20) -> dict:
    """c = t_draft / t_target for one new token with a KV cache, bf16, one thread."""
    from transformers import DynamicCache

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    t16, d16 = copy.deepcopy(target).bfloat16().eval(), copy.deepcopy(draft).bfloat16().eval()
    x = torch.tensor([ids])  # [1, L]
    past = t16(x[:, :-1], use_cache=True).past_key_values
    t0 = time.perf_counter()
    for _ in range(repeats):
        t16(x[:, -1:], past_key_values=past, use_cache=True).logits.argmax(-1)
        past.crop(-1)
    t_target = (time.perf_counter() - t0) / repeats
    f = t16.model(input_ids=x).last_hidden_state  # [1, L, H]
    _, cache = d16(f[:, :-2], x[:, 1:-1], past=DynamicCache())
    pos = torch.tensor([[x.shape[1] - 2]])
    t0 = time.perf_counter()
    for _ in range(repeats):
        fh, _ = d16(f[:, -2:-1], x[:, -1:], past=cache, pos=pos)
        d16.logits(fh[:, -1]).argmax(-1)
        cache.crop(-1)
    t_draft = (time.perf_counter() - t0) / repeats
    torch.set_num_threads(threads)
    return {"target_step_ms": 1e3 * t_target, "draft_step_ms": 1e3 * t_draft, "c": t_draft / t_target}


@restores_torch_threads
def distill_feature(target, tokenizer, out_dir, config: FeatureDistillConfig, held_out=frozenset(),
                    texts: tuple[list[str], list[str]] | None = None) -> dict:
    """Train (or resume) a feature-fed draft into `out_dir` (fp32 weights; matmuls in `config.precision`); returns (and
    writes) its tandem_draft.json.
    `texts` (code, prose) replaces the standard library, for tests."""
    started = time.time()
    deadline = started + 60 * config.max_minutes if config.max_minutes else float("inf")
    out, cache = Path(out_dir), Path(config.cache_dir).expanduser() / Path(target.config.name_or_path).name
    out.mkdir(parents=True, exist_ok=True)
    cache.mkdir(parents=True, exist_ok=True)
    torch.manual_seed(config.seed)
    target.eval()
    windows, data = _windows(target, tokenizer, config, cache, set(held_out), texts)  # [N, T]
    digest = hashlib.sha1(windows.numpy().tobytes()).hexdigest()[:16]
    feats = _teacher_features(target, windows, cache / "features")  # [N, T, H] bf16
    vocab = torch.tensor(frequent_vocab(windows.flatten().tolist(), config.vocab_size, [tokenizer.eos_token_id]))
    sets = _eval_sets(target, tokenizer, config, out)
    draft = FeatureDraft(target, vocab).float().train()
    if config.init_from:
        start = load_feature_draft(target, Path(config.init_from).expanduser(), torch.float32)
        if not torch.equal(start.vocab, draft.vocab):
            raise ValueError(f"{config.init_from} was trained on other data (another vocabulary)")
        draft.load_state_dict(start.state_dict())
    params = [p for p in draft.parameters() if p.requires_grad]
    B, per_epoch = config.batch_size, len(windows) // config.batch_size
    tokens_per_step = B * config.seq_len
    amp = _autocast(config.precision)

    def loss_at(step):  # (loss, reg, ce) for the batch of `step`; epoch order and noise keyed by the step
        epoch, i = divmod(step, per_epoch)
        order = torch.randperm(len(windows), generator=torch.Generator().manual_seed(config.seed + epoch))
        idx = order[i * B:(i + 1) * B]
        ids, f = windows[idx], feats[idx].float()  # [B, T], [B, T, H]
        noise = torch.randn(f[:, :-1].shape, generator=torch.Generator().manual_seed(config.seed * 1_000_003 + step))
        gen = torch.Generator().manual_seed(config.seed * 7_000_003 + step)
        inputs = f[:, :-1] + config.feature_noise * noise  # [B, T-1, H]: f_t
        with amp():
            p = torch.softmax(draft.logits(f[:, 1:]).float(), -1)  # the target's distribution, on the head
        reg = ce = 0.0
        fh = inputs
        for k in range(config.unroll):
            if k:  # the draft's prediction of f_t (pass k-1's output at t-1) replaces f_t at some positions
                own = torch.cat([inputs[:, :1], fh[:, :-1]], 1)
                pick = torch.rand(inputs.shape[:2], generator=gen)[..., None] < config.unroll_fraction
                inputs = torch.where(pick, own.float(), inputs)
            with amp():
                fh, _ = draft(inputs, ids[:, 1:])  # [B, T-1, H]: f̂_{t+1}
                draft_logits = draft.logits(fh)  # [B, T-1, K]
            log_q = torch.log_softmax(draft_logits.float(), -1)
            reg = reg + F.smooth_l1_loss(fh.float(), f[:, 1:]) / config.unroll
            ce = ce + -(p * log_q).sum(-1).mean() / config.unroll
        return config.feature_weight * reg + ce, reg, ce

    if config.precision == "auto":  # the faster of bf16 autocast and fp32 for one step here (numbers only differ)
        timed = {}
        for name in ("bf16", "fp32"):
            amp = _autocast(name)
            t0 = time.perf_counter()
            loss_at(0)[0].backward()
            timed[name] = time.perf_counter() - t0
        draft.zero_grad(set_to_none=True)
        amp = _autocast(min(timed, key=timed.get))
        log.info("precision: %s (one step: bf16 %.2fs, fp32 %.2fs)", min(timed, key=timed.get), timed["bf16"],
                 timed["fp32"])
    ckpt = out / CHECKPOINT
    state = torch.load(ckpt, weights_only=False) if ckpt.is_file() else None
    if state is not None:
        if state["data"] != digest:
            raise ValueError(f"{out} holds a checkpoint trained on other data; use a fresh --out")
        draft.load_state_dict(state["draft"])
        step, total_steps, minutes_before = state["step"], state["total_steps"], state["minutes"]
        log.info("resuming from step %d of %d", step, total_steps)
    else:
        step, minutes_before, t0 = 0, 0.0, time.time()
        _record(out, step, per_epoch, tokens_per_step, minutes_before + (time.time() - started) / 60,
                evaluate(target, draft, sets), None)
        eval_s = time.time() - t0
        t0 = time.perf_counter()
        for s in range(3):  # the step time, to fit the one-cycle schedule into the time budget
            loss_at(s)[0].backward()
        draft.zero_grad(set_to_none=True)
        step_s = 1.15 * (time.perf_counter() - t0) / 3
        total_steps = config.epochs * per_epoch
        if config.max_minutes:
            left = deadline - time.time() - 2 * eval_s - 60  # final evaluation, export and c
            total_steps = max(1, min(total_steps, int(left / (step_s + eval_s / config.eval_every))))
        log.info("plan: %d steps (%.2f epochs of %d windows), %.2fs a step, %.0fs an evaluation",
                 total_steps, total_steps / per_epoch, len(windows), step_s, eval_s)
    optimizer = torch.optim.AdamW(params, lr=config.lr)
    scheduler = torch.optim.lr_scheduler.OneCycleLR(optimizer, max_lr=config.lr, total_steps=total_steps,
                                                    pct_start=0.05)
    if state is not None:
        optimizer.load_state_dict(state["optimizer"])
        scheduler.load_state_dict(state["scheduler"])

    def checkpoint():
        torch.save({"draft": draft.state_dict(), "optimizer": optimizer.state_dict(), "data": digest,
                    "scheduler": scheduler.state_dict(), "step": step, "total_steps": total_steps,
                    "minutes": minutes_before + (time.time() - started) / 60}, ckpt)

    if step == 0:
        checkpoint()
    losses, t_log, last = [], time.time(), None
    while step < total_steps and time.time() < deadline:
        loss, reg, ce = loss_at(step)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        optimizer.step()
        scheduler.step()
        step += 1
        losses.append(loss.item())
        if time.time() - t_log > 60:
            log.info("step %d/%d loss %.3f (reg %.4f, ce %.3f)", step, total_steps, loss.item(), reg.item(), ce.item())
            t_log = time.time()
        if step % config.eval_every == 0 or step == total_steps or time.time() >= deadline:
            last = _record(out, step, per_epoch, tokens_per_step, minutes_before + (time.time() - started) / 60,
                           evaluate(target, draft, sets), sum(losses) / len(losses))
            losses = []
            checkpoint()
    if last is None:  # resumed a finished run: nothing trained now
        last = json.loads((out / CURVE).read_text().splitlines()[-1])
    return _export(target, draft, out, config, data, step, total_steps, per_epoch, last,
                   cost_ratio(target, draft, sets["humaneval"][0][1]))


def _autocast(precision: str):
    """A context-manager factory: bf16 autocast (fp32 weights, bf16 matmuls) or nothing (fp32)."""
    if precision not in ("auto", "bf16", "fp32"):
        raise ValueError(f"precision must be auto, bf16 or fp32, not {precision!r}")
    if precision == "bf16":
        return lambda: torch.autocast("cpu", dtype=torch.bfloat16)
    return contextlib.nullcontext


def _record(out: Path, step, per_epoch, tokens_per_step, minutes, scores: dict, loss) -> dict:
    entry = {"tokens_seen": step * tokens_per_step, "step": step, "epoch": round(step / per_epoch, 3),
             "minutes": round(minutes, 2), **scores, "loss": loss}
    with open(out / CURVE, "a") as f:
        f.write(json.dumps(entry) + "\n")
    log.info("evaluation %s", json.dumps(entry))
    return entry


def _command() -> str:
    argv = sys.argv if Path(sys.argv[0]).name != "tandem" else ["tandem", *sys.argv[1:]]
    return shlex.join(argv)


def _export(target, draft, out: Path, config, data, step, total_steps, per_epoch, last, cost) -> dict:
    from safetensors.torch import save_file

    weights = {k: v.bfloat16() if v.is_floating_point() else v for k, v in draft.state_dict().items()}
    save_file(weights, out / WEIGHTS)
    meta = {"kind": "feature", "target": str(target.config.name_or_path), "vocab_size": len(draft.vocab),
            "weights": f"{WEIGHTS} (bf16): fc, the decoder layer, norm and the vocab index; the token "
                       "embedding and the head rows at vocab are rebuilt from the target",
            "command": _command(), "data": data, "steps": step, "total_steps": total_steps,
            "epochs": round(step / per_epoch, 3), "seed": config.seed, "minutes": last["minutes"],
            "config": asdict(config), "final_eval": {k: last[k] for k in ("humaneval", "chat")}, "cost": cost,
            "torch": torch.__version__}
    (out / META).write_text(json.dumps(meta, indent=1) + "\n")
    return meta
