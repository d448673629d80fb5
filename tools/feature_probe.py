"""Probe (not part of tandem's served path yet): how far does a feature-fed draft (EAGLE-style) get on this CPU budget?

Draft: fc([f_t ; emb(x_{t+1})]) -> one Llama decoder layer (init from the target's last) -> norm
-> the target's head restricted to an 8k vocabulary subset. f_t is the target's last hidden state
(post-norm, what its LM head reads). Trained on the target's features + distributions over stdlib
code and pydoc prose (teacher forcing), loss = smooth-L1(f̂_{t+1}, f_{t+1}) + CE(p_{t+2} || q).
Eval: α at draft position 1 given the target's features and tokens of the prefix (the issue's
"given the target's own prefix, step by step"), and chained acceptance for γ = 3 using its own
features, on HumanEval prompts + the target's greedy continuations (held out), and chat.
"""
import argparse
import copy
import json
import os
import random
import time

import torch
import torch.nn.functional as F

from cluster.core.workloads import CHAT_PROMPTS, humaneval_prompts
from cluster.model import models
from cluster.model.models import encode_prompt
from drafts.feature_model import FeatureDraft
from drafts.training.distill import build_corpus, frequent_vocab, stdlib_texts


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--tokens", type=int, default=500_000, help="training tokens (teacher features computed once, cached)")
    parser.add_argument("--epochs", type=int, default=9)
    parser.add_argument("--lr", type=float, default=1e-3)
    parser.add_argument("--wreg", type=float, default=1.0, help="weight of the feature regression loss")
    parser.add_argument("--cache-dir", default=os.path.expanduser("~/.cache/tandem/feature-probe"))
    args = parser.parse_args()
    THREADS, TRAIN_TOKENS, EPOCHS = args.threads, args.tokens, args.epochs
    os.makedirs(args.cache_dir, exist_ok=True)
    torch.set_num_threads(THREADS); torch.manual_seed(0); rng = random.Random(0)
    path = models.resolve_model_path("default", None)
    tok = models.load_tokenizer(path)
    target = models.load_causal_lm(path, "bfloat16", "cpu").eval()
    cfg = target.config
    SEQ, B = 128, 8

    code, prose = stdlib_texts()
    rng.shuffle(code)
    stream = build_corpus(tok, code[8:] + prose[4:], [], set(humaneval_prompts()) | set(CHAT_PROMPTS))
    vocab = torch.tensor(frequent_vocab(stream, 8192, [tok.eos_token_id]))
    print("corpus tokens", len(stream), flush=True)

    @torch.no_grad()
    def teacher(ids):  # [B,T] -> features [B,T,H] (fp32)
        return target.model(input_ids=ids).last_hidden_state.float()

    draft = FeatureDraft(target, vocab).float()
    params = [p for p in draft.parameters() if p.requires_grad]
    print("draft trainable params", sum(p.numel() for p in params), flush=True)

    # --- collect teacher features once
    n_windows = TRAIN_TOKENS // SEQ
    t0 = time.time()
    starts = [rng.randrange(0, len(stream) - SEQ - 1) for _ in range(n_windows)]
    data_ids = torch.tensor([stream[s:s + SEQ] for s in starts])
    cache_file = os.path.join(args.cache_dir, f"feats-{TRAIN_TOKENS}.pt")
    if os.path.exists(cache_file):
        feats = torch.load(cache_file)
    else:
        feats = torch.empty(n_windows, SEQ, cfg.hidden_size, dtype=torch.bfloat16)
        for i in range(0, n_windows, 16):
            feats[i:i + 16] = teacher(data_ids[i:i + 16]).bfloat16()
        torch.save(feats, cache_file)
    print(f"features for {n_windows * SEQ} tokens in {time.time() - t0:.0f}s", flush=True)

    # --- eval sets: prompt + target greedy continuation
    def refs(prompts, chat, n):
        out = []
        for p in prompts[:n]:
            ids = encode_prompt(tok, p, chat)
            with torch.no_grad():
                g = target.generate(torch.tensor([ids]), max_new_tokens=12 if os.environ.get("SMOKE") else 64, do_sample=False)[0].tolist()
            out.append((len(ids), g))
        return out
    t0 = time.time()
    SMOKE = bool(os.environ.get("SMOKE"))
    evals = {"humaneval": refs(humaneval_prompts(), False, 2 if SMOKE else 16), "chat": refs(CHAT_PROMPTS, True, 1 if SMOKE else 8)}
    print(f"eval refs in {time.time() - t0:.0f}s", flush=True)

    @torch.no_grad()
    def evaluate(gamma=3):
        draft.eval(); res = {}
        for name, seqs in evals.items():
            agree = total = 0; chain_acc = chain_rounds = 0
            for plen, ids in seqs:
                x = torch.tensor([ids]); f = teacher(x)  # f[t] predicts ids[t+1]
                fh, _ = draft(f[:, :-1], x[:, 1:])  # position t: (f_t, x_{t+1}) -> f̂_{t+1} -> predicts x_{t+2}
                pred = draft.vocab[draft.logits(fh).argmax(-1)][0]  # pred[t] for ids[t+2]
                tgt = x[0, 2:]
                for t in range(plen - 2, len(ids) - 2):
                    agree += int(pred[t] == tgt[t]); total += 1
                # chained: a round starting after committed prefix ids[:s+1] (target features up to s)
                for s in range(plen, len(ids) - gamma - 1, 2):
                    # draft token 1 = prediction from (f_{s-1}, x_s); then own features
                    fs, xs = f[:, :s], x[:, 1:s + 1]
                    n_ok = 0
                    for k in range(gamma):
                        fh, _ = draft(fs, xs)
                        tok_k = int(draft.vocab[draft.logits(fh[:, -1]).argmax(-1)])
                        if tok_k != ids[s + 1 + k]: break
                        n_ok += 1
                        fs = torch.cat([fs, fh[:, -1:]], 1); xs = torch.cat([xs, torch.tensor([[tok_k]])], 1)
                    chain_acc += n_ok; chain_rounds += 1
            res[name] = {"alpha_pos1": agree / total, "mean_accepted_of_3": chain_acc / chain_rounds}
        draft.train(); return res

    print("before", evaluate(), flush=True)
    LR = args.lr
    opt = torch.optim.AdamW(params, lr=LR)
    steps = EPOCHS * (n_windows // B)
    sched = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=LR, total_steps=steps, pct_start=0.05)
    t0 = time.time(); step = 0
    for ep in range(EPOCHS):
        order = torch.randperm(n_windows)
        for i in range(0, n_windows - B + 1, B):
            idx = order[i:i + B]
            ids, f = data_ids[idx], feats[idx].float()
            f_in = f[:, :-1] + 0.02 * torch.randn_like(f[:, :-1])  # EAGLE's feature noise
            fh, _ = draft(f_in, ids[:, 1:])  # predicts f_{t+1}
            f_tgt = f[:, 1:]
            p = torch.softmax(draft.logits(f_tgt), -1)
            logq = torch.log_softmax(draft.logits(fh), -1)
            reg = F.smooth_l1_loss(fh, f_tgt); ce = -(p * logq).sum(-1).mean()
            loss = reg * args.wreg + ce
            opt.zero_grad(); loss.backward(); torch.nn.utils.clip_grad_norm_(params, 1.0); opt.step(); sched.step(); step += 1
            if step % 200 == 0:
                print(f"step {step}/{steps} loss {loss.item():.3f} reg {reg.item():.4f} ce {ce.item():.3f} {time.time() - t0:.0f}s", flush=True)
        if ep % 3 == 2 or ep == EPOCHS - 1:
            print("epoch", ep, evaluate(), f"{time.time() - t0:.0f}s", flush=True)
    torch.save({k: v for k, v in draft.state_dict().items() if not k.startswith("embed")}, os.path.join(args.cache_dir, "draft.pt"))

    # cost ratio: one new token with KV cache, draft vs target (bf16, 1 thread)
    torch.set_num_threads(1)
    from transformers import DynamicCache
    d16 = copy.deepcopy(draft).bfloat16().eval()
    ids = torch.tensor([evals["humaneval"][0][1]])
    with torch.no_grad():
        out = target(ids[:, :-1], use_cache=True); past = out.past_key_values
        tt = time.perf_counter()
        for _ in range(20):
            target(ids[:, -1:], past_key_values=past, use_cache=True); past.crop(-1)
        t_target = (time.perf_counter() - tt) / 20
        f = target.model(ids).last_hidden_state.bfloat16()
        cache = DynamicCache()
        _, cache = d16(f[:, :-2], ids[:, 1:-1], past=cache)
        L = ids.shape[1] - 2
        tt = time.perf_counter()
        for _ in range(20):
            fh, _ = d16(f[:, -2:-1], ids[:, -1:], past=cache, pos=torch.tensor([[L]])); d16.logits(fh[:, -1]).argmax(-1); cache.crop(-1)
        t_draft = (time.perf_counter() - tt) / 20
    print(json.dumps({"target_step_ms": 1e3 * t_target, "draft_step_ms": 1e3 * t_draft, "c": t_draft / t_target}), flush=True)


if __name__ == "__main__":
    main()
