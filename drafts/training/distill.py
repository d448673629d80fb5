"""`tandem drafts distill`: train a small draft on the target's own distributions.

Corpus (offline): the Python standard library's source (code), its documentation text
(`pydoc_data`, prose) and, for chat, answers the target itself generates to instructions built here
from templates. HumanEval and every benchmark prompt are held out (none are in the corpus; a check
refuses a corpus window that contains a benchmark prompt). Training: teacher forcing; the loss is the
cross-entropy of the draft's distribution against the target's, both over the draft head's vocabulary
subset (the target's renormalised there). Fixed seed, a token or time budget, checkpoints with
resume, a progress bar and a final report (greedy agreement α before and after, on held-out text).
"""

from __future__ import annotations

import copy
import json
import logging
import random
import sysconfig
import time
from collections import Counter
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
import torch.nn.functional as F

from drafts.small_draft import DraftSpec, build_draft, save_draft, trainable_parameters
from drafts.training import restores_torch_threads

log = logging.getLogger(__name__)

CHECKPOINT = "checkpoint.pt"
_TOPICS = ["volcanoes", "the printing press", "honeybees", "compound interest", "the Roman Empire", "rainbows",
           "sourdough bread", "electric cars", "the human heart", "chess openings", "coral reefs", "jazz music",
           "the internet", "glaciers", "solar panels", "the French Revolution", "penguins", "recycling",
           "machine learning", "the moon landing", "tea ceremonies", "earthquakes", "bicycles", "democracy"]
_TEMPLATES = ["Tell me about {t}.", "Explain {t} in simple terms.", "Write a short paragraph about {t}.",
              "What are some interesting facts about {t}?", "Why is {t} important?",
              "Give me three questions a student might ask about {t}, with answers.",
              "Write a Python function related to {t}, with a docstring.", "Summarize the history of {t}."]


@dataclass
class DistillConfig:
    layers: list[int]
    vocab_size: int = 8192  # head size; 0 keeps the full vocabulary
    self_speculative: bool = False
    seq_len: int = 128
    batch_size: int = 8
    lr: float = 3e-4
    max_tokens: int = 200_000  # training tokens budget
    max_minutes: float = 0.0  # time budget (0: none)
    chat_samples: int = 64  # answers the target generates for chat-style training text
    seed: int = 0
    checkpoint_every: int = 50
    threads: int = 2


def stdlib_texts(max_files: int | None = None) -> tuple[list[str], list[str]]:
    """(code, prose): the standard library's Python sources, and its documentation topics."""
    root = Path(sysconfig.get_paths()["stdlib"])
    files = sorted(p for p in root.rglob("*.py") if not any(part in ("test", "tests", "idle_test", "site-packages")
                                                            for part in p.relative_to(root).parts))
    code = []
    for path in files[:max_files]:
        try:
            code.append(path.read_text(encoding="utf-8"))
        except (UnicodeDecodeError, OSError):
            continue
    prose = []
    try:
        from pydoc_data.topics import topics

        prose = [topics[k] for k in sorted(topics)]
    except ImportError:
        pass
    return code, prose


def package_code(dirs: list[str], max_chars: int, held_out: set[str], seed: int = 0) -> list[str]:
    """Python sources under `dirs` (e.g. a site-packages folder), in a seeded random file order, up to
    `max_chars` characters; files with tests in their path or holding a held-out prompt are skipped."""
    files = sorted({p for d in dirs for p in Path(d).expanduser().rglob("*.py")
                    if not any(part in ("test", "tests", "testing") for part in p.parts)})
    random.Random(seed).shuffle(files)
    code, total = [], 0
    for path in files:
        if total >= max_chars:
            break
        try:
            text = path.read_text(encoding="utf-8")
        except (UnicodeDecodeError, OSError):
            continue
        if len(text) < 200 or any(prompt and prompt in text for prompt in held_out):
            continue
        code.append(text)
        total += len(text)
    return code


def chat_corpus(target, tokenizer, n: int, max_new_tokens: int = 96, seed: int = 0) -> list[list[int]]:
    """Chat transcripts (template + the target's own greedy answer) as token ids."""
    if n <= 0:
        return []
    rng = random.Random(seed)
    instructions = [tpl.format(t=topic) for topic in _TOPICS for tpl in _TEMPLATES]
    rng.shuffle(instructions)
    out = []
    batch = 16
    tokenizer.padding_side = "left"
    for start in range(0, min(n, len(instructions)), batch):
        chats = [[{"role": "user", "content": text}] for text in instructions[start:start + batch]]
        enc = tokenizer.apply_chat_template(chats, add_generation_prompt=True, return_tensors="pt", padding=True,
                                            return_dict=True)
        with torch.inference_mode():
            gen = target.generate(**enc, do_sample=False, max_new_tokens=max_new_tokens,
                                  pad_token_id=tokenizer.pad_token_id or tokenizer.eos_token_id)
        for row, mask in zip(gen, enc["attention_mask"]):
            ids = row[int((mask == 0).sum()):].tolist()
            out.append([t for t in ids if t != tokenizer.pad_token_id] if tokenizer.pad_token_id is not None else ids)
    return out


def build_corpus(tokenizer, texts: list[str], chats: list[list[int]], held_out: set[str]) -> list[int]:
    """One token stream (documents separated by EOS); refuses benchmark text."""
    for text in texts:
        for prompt in held_out:
            if prompt and prompt in text:
                raise ValueError("a benchmark prompt appears in the training corpus")
    eos = tokenizer.eos_token_id
    stream: list[int] = []
    for text in texts:
        stream += tokenizer(text)["input_ids"] + [eos]
    for ids in chats:
        stream += ids + [eos]
    return stream


def frequent_vocab(stream: list[int], size: int, always: list[int]) -> list[int]:
    """The `size` most frequent ids of the corpus (plus `always`, e.g. EOS), sorted."""
    counts = Counter(stream)
    chosen = {t for t, _ in counts.most_common(size)} | set(always)
    return sorted(chosen)[: max(size, len(always))] if len(chosen) > size else sorted(chosen)


def greedy_agreement(target, draft, sequences: list[list[int]], skip: int = 1) -> float:
    """α as the issue defines it: the fraction of positions where the draft's greedy token equals the
    target's, given the same (target-generated or corpus) prefix."""
    agree = total = 0
    with torch.inference_mode():
        for ids in sequences:
            x = torch.tensor([ids])
            t = target(x).logits[0, skip:].argmax(-1)
            d = draft(x).logits[0, skip:].argmax(-1)
            agree += int((t == d).sum())
            total += t.numel()
    return agree / total if total else 0.0


def _windows(stream: list[int], seq_len: int, rng: random.Random, n: int) -> torch.Tensor:
    starts = [rng.randrange(0, len(stream) - seq_len - 1) for _ in range(n)]
    return torch.tensor([stream[s:s + seq_len] for s in starts])  # [n, seq_len]


@restores_torch_threads
def distill(target, tokenizer, out_dir: str | Path, config: DistillConfig, texts: list[str] | None = None,
            eval_texts: list[str] | None = None, held_out: set[str] = frozenset(), progress: bool = True) -> dict:
    """Train (or resume training) a draft into `out_dir`; returns the report (also written as report.json)."""
    from tqdm import tqdm

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    torch.manual_seed(config.seed)
    rng = random.Random(config.seed)
    started = time.time()
    if texts is None:
        code, prose = stdlib_texts()
        rng_files = random.Random(config.seed)
        rng_files.shuffle(code)
        eval_texts = eval_texts or code[:8] + prose[:4]
        texts = code[8:] + prose[4:]
    chats = chat_corpus(target, tokenizer, config.chat_samples, seed=config.seed)
    eval_chats, chats = chats[: len(chats) // 8], chats[len(chats) // 8:]
    stream = build_corpus(tokenizer, texts, chats, set(held_out))
    eval_seqs = [tokenizer(t)["input_ids"][: config.seq_len * 2] for t in (eval_texts or [])]
    eval_seqs = [s for s in eval_seqs if len(s) > 8] + [c[: config.seq_len * 2] for c in eval_chats]
    vocab = None
    if config.vocab_size and config.vocab_size < target.config.vocab_size:
        vocab = frequent_vocab(stream, config.vocab_size, [tokenizer.eos_token_id])
    spec = DraftSpec(layers=list(config.layers), vocab=vocab, self_speculative=config.self_speculative)
    teacher = target.eval()
    student = build_draft(copy.deepcopy(target).float(), spec)  # trained in fp32; the teacher keeps its dtype
    student.train()
    params = trainable_parameters(student)
    for p in student.parameters():
        p.requires_grad_(False)
    for p in params:
        p.requires_grad_(True)
    optimizer = torch.optim.AdamW(params, lr=config.lr, weight_decay=0.0)
    tokens_per_step = config.batch_size * config.seq_len
    total_steps = max(1, config.max_tokens // tokens_per_step)
    scheduler = torch.optim.lr_scheduler.OneCycleLR(optimizer, max_lr=config.lr, total_steps=total_steps,
                                                    pct_start=0.05)
    step, alpha_before = 0, None
    checkpoint = out / CHECKPOINT
    if checkpoint.is_file():
        state = torch.load(checkpoint, weights_only=False)
        student.load_state_dict(state["student"], strict=False)
        optimizer.load_state_dict(state["optimizer"])
        scheduler.load_state_dict(state["scheduler"])
        step, alpha_before = state["step"], state["alpha_before"]
        rng.setstate(state["rng"])
        torch.set_rng_state(state["torch_rng"])
        log.info("resuming from step %d", step)
    if alpha_before is None:
        student.eval()
        alpha_before = greedy_agreement(teacher, student, eval_seqs)
        student.train()
    vocab_ids = student.lm_head.vocab_ids
    bar = tqdm(total=total_steps, initial=step, disable=not progress, desc="distill", unit="step")
    losses: list[float] = []
    deadline = started + config.max_minutes * 60 if config.max_minutes else float("inf")
    while step < total_steps and time.time() < deadline:
        batch = _windows(stream, config.seq_len, rng, config.batch_size)  # [B, T]
        with torch.no_grad():
            p = teacher(batch).logits.float()[..., vocab_ids].softmax(-1)  # [B, T, K], renormalised on the subset
        hidden = student.model(input_ids=batch).last_hidden_state  # [B, T, hidden]
        log_q = F.log_softmax(student.lm_head.proj(hidden).float(), dim=-1)  # [B, T, K]
        loss = -(p * log_q).sum(-1).mean()
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        optimizer.step()
        scheduler.step()
        step += 1
        losses.append(float(loss.detach()))
        bar.update(1)
        bar.set_postfix(loss=f"{sum(losses[-20:]) / len(losses[-20:]):.3f}")
        if step % config.checkpoint_every == 0 or step == total_steps:
            torch.save({"student": {k: v for k, v in student.state_dict().items() if not k.startswith("model.embed")},
                        "optimizer": optimizer.state_dict(), "scheduler": scheduler.state_dict(), "step": step,
                        "alpha_before": alpha_before, "rng": rng.getstate(), "torch_rng": torch.get_rng_state()},
                       checkpoint)
    bar.close()
    student.eval()
    alpha_after = greedy_agreement(teacher, student, eval_seqs)
    spec.provenance = {
        "command": "tandem drafts distill", "config": asdict(config), "steps": step, "tokens": step * tokens_per_step,
        "corpus": {"stdlib_python_files_and_pydoc_topics": len(texts), "chat_transcripts_from_target": len(chats),
                   "corpus_tokens": len(stream)},
        "seed": config.seed, "torch": torch.__version__,
    }
    save_draft(student, out)
    report = {"steps": step, "total_steps": total_steps, "tokens_trained": step * tokens_per_step,
              "final_loss": sum(losses[-20:]) / len(losses[-20:]) if losses else None,
              "alpha_held_out_before": alpha_before, "alpha_held_out_after": alpha_after,
              "minutes": (time.time() - started) / 60, "finished": step >= total_steps, "out": str(out)}
    (out / "report.json").write_text(json.dumps(report, indent=1) + "\n")
    return report
