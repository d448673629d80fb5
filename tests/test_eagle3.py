"""The EAGLE-3-style draft and its trainer (`drafts/eagle3_model.py`, `tools/eagle3.py`) on a tiny target:
the training-time-test forward computes exactly what drafting past the committed point computes, training
lowers the loss and raises agreement, a rerun resumes, and the export round-trips."""

from __future__ import annotations

import json
import shlex
import sys

import numpy as np
import pytest
import torch

from drafts.eagle3_model import Eagle3Draft, fusion_layers, load_eagle3
from tests.helpers import tiny_llama
from tools.draftdata.shards import Manifest, ShardData, ShardRecord, write_shard
from tools.eagle3 import CHECKPOINT, CURVE, Eagle3Config, load_windows, ttt_forward, ttt_mask, train
from tools.eagle3_export_checkpoint import export_checkpoint


def test_ttt_mask_is_what_a_drafting_round_sees():
    assert torch.equal(ttt_mask(5, 0), torch.ones(5, 5, dtype=torch.bool).tril())
    m = ttt_mask(5, 2)  # query (step 2, entry 4): target-fed entries 0..2, step 1's entry 3, itself
    seen = {(int(k) // 5, int(k) % 5) for k in torch.nonzero(m[2 * 5 + 4]).flatten()}
    assert seen == {(0, 0), (0, 1), (0, 2), (1, 3), (2, 4)}
    assert fusion_layers(30) == (2, 15, 27)


def test_ttt_forward_equals_drafting_with_a_cache():
    """Step j at entry t = a round that starts after entry t - j (target-fed) and drafts j entries from
    its own outputs, with the draft's KV cache, one entry at a time."""
    from transformers import DynamicCache

    target = tiny_llama(0, vocab_size=16)
    draft = Eagle3Draft(target, torch.arange(16)).float().eval()
    torch.manual_seed(1)
    for p in draft.parameters():
        p.data.add_(0.05 * torch.randn_like(p))
    ids = torch.randint(0, 16, (1, 12))
    with torch.no_grad():
        _, logits = ttt_forward(target, draft, ids, 3)
        u = draft.fused(target(input_ids=ids, output_hidden_states=True).hidden_states)[:, :-1]
        for j in range(3):
            for t in range(j, 10):
                cache = DynamicCache()
                g, _ = draft(u[:, :t - j + 1], ids[:, 1:t - j + 2], past=cache)
                g = g[:, -1:]
                for e in range(t - j + 1, t + 1):
                    g, _ = draft(g, ids[:, e + 1:e + 2], past=cache, pos=torch.tensor([[e]]))
                torch.testing.assert_close(logits[j][0, t], draft.logits(g[0, -1]), atol=1e-5, rtol=1e-5)


class _Tok:
    eos_token_id = 0


def _dataset(folder, target, n: int = 24, length: int = 20, prompt: int = 4, shards: int = 1) -> None:
    """Samples whose answers are the tiny target's own greedy continuations (a learnable, on-policy set)."""
    g = torch.Generator().manual_seed(3)
    records = []
    for index in range(shards):
        starts = torch.randint(1, 16, (n, prompt), generator=g)
        with torch.no_grad():  # one batch: the same length everywhere, no padding
            samples = target.generate(starts, attention_mask=torch.ones_like(starts), max_new_tokens=length - prompt,
                                      do_sample=False, min_new_tokens=length - prompt).tolist()
        tokens = np.array([t for s in samples for t in s], dtype=np.uint16)
        offsets = np.cumsum([0] + [len(s) for s in samples]).astype(np.int64)
        shard = ShardData(tokens, offsets, np.full(n, prompt, np.int32), np.arange(n, dtype=np.int64),
                          np.array(["magpie"] * n), np.array(["magpie"] * n), np.ones(n, bool), np.ones(n, bool),
                          np.zeros(n, np.int64), np.array(["length"] * n), np.array(["p"] * n))
        name = f"shard-{index:06d}.npz"
        sha = write_shard(folder / name, shard)
        records.append(ShardRecord(index, name, n, n * (length - prompt), n * prompt, sha, {}, {}, "test", 1.0,
                                   n * length))
    Manifest({"seed": 0}, records).save(folder)


def test_windows_train_each_answer_token_once_with_context_before_it(tmp_path):
    """Answers longer than a window are cut into windows that overlap by `context` tokens: every answer token is
    trained in exactly one window, in order, with the sample's `context` tokens before it there; no prompt token
    is trained; max_windows=1 keeps only each answer's first window."""
    from tools.draftdata.shards import read_shard

    target = tiny_llama(0, vocab_size=16)
    _dataset(tmp_path, target, n=6, length=40, prompt=5)
    shard, seq_len, context = "shard-000000.npz", 12, 3
    ids, mask = load_windows(tmp_path, [shard], seq_len=seq_len, context=context, pad=0)
    data = read_shard(tmp_path / shard)
    rows = iter(range(len(ids)))
    for i in range(len(data)):
        tokens, plen = data.sample(i), int(data.prompt_len[i])
        pos = plen  # the next answer token to be trained
        while pos < len(tokens):
            r = next(rows)
            window, trained = ids[r].tolist(), torch.nonzero(mask[r]).flatten().tolist()
            assert trained and trained == list(range(trained[0], trained[-1] + 1))
            for j in trained:  # the token itself and the sample's context before it
                assert j >= context and window[j - context:j + 1] == tokens[pos - context:pos + 1]
                pos += 1
    assert next(rows, None) is None
    first, first_mask = load_windows(tmp_path, [shard], seq_len=seq_len, context=context, pad=0, max_windows=1)
    assert len(first) == len(data) < len(ids) and int(first_mask.sum()) == len(data) * (seq_len - context)
    with pytest.raises(ValueError):
        load_windows(tmp_path, [shard], seq_len=context, context=context, pad=0)


def test_a_resumed_run_adds_the_shards_finished_since_and_keeps_its_vocabulary(tmp_path):
    """Data generation goes on between sessions: a resumed run trains on the new shards too (the draft's
    vocabulary stays the checkpoint's); `freeze_data` keeps the shards it had."""
    target = tiny_llama(0, vocab_size=16)
    data = tmp_path / "data"
    data.mkdir()
    _dataset(data, target, shards=1)
    sets = {"held_out": [(4, [5, 3, 9, 2, 7, 1, 4, 8])]}
    config = Eagle3Config(data=str(data), ttt_steps=2, seq_len=20, batch_size=8, vocab_size=12, steps=4,
                          eval_every=2, context=4)
    # a session's time runs out before its first step: the checkpoint holds step 0 on one shard
    first = train(target, _Tok(), tmp_path / "a", Eagle3Config(**{**config.__dict__, "max_minutes": 1e-9}),
                  eval_sets=sets)
    frozen_dir = tmp_path / "frozen"
    frozen_dir.mkdir()
    (frozen_dir / "checkpoint.pt").write_bytes((tmp_path / "a" / "checkpoint.pt").read_bytes())
    d2t = torch.load(tmp_path / "a" / "checkpoint.pt", weights_only=False)["draft"]["d2t"]
    _dataset(data, target, shards=2)  # a second shard finished since
    grown = train(target, _Tok(), tmp_path / "a", config, eval_sets=sets)
    assert first["data"]["shards"] == ["shard-000000.npz"] and first["data"]["windows"] == 24
    assert grown["data"]["shards"] == ["shard-000000.npz", "shard-000001.npz"] and grown["data"]["windows"] == 48
    assert first["steps"] == 0 and grown["steps"] == 4
    after = torch.load(tmp_path / "a" / "checkpoint.pt", weights_only=False)
    assert torch.equal(after["draft"]["d2t"], d2t) and after["shards"] == grown["data"]["shards"]
    frozen = train(target, _Tok(), frozen_dir, Eagle3Config(**{**config.__dict__, "freeze_data": True}),
                   eval_sets=sets)
    assert frozen["data"]["shards"] == ["shard-000000.npz"] and frozen["steps"] == 4
def test_training_lowers_the_loss_resumes_and_exports(tmp_path):
    target = tiny_llama(0, vocab_size=16)
    data, out = tmp_path / "data", tmp_path / "draft"
    data.mkdir()
    _dataset(data, target)
    with torch.no_grad():
        sets = {"held_out": [(4, target.generate(torch.tensor([[5, 3, 9, 2]]), max_new_tokens=16,
                                                 do_sample=False)[0].tolist())]}
    config = Eagle3Config(data=str(data), ttt_steps=3, seq_len=20, batch_size=8, lr=3e-3, vocab_size=16, steps=30,
                          eval_every=15, context=4)
    meta = train(target, _Tok(), out, config, eval_sets=sets)
    curve = [json.loads(line) for line in (out / CURVE).read_text().splitlines()]
    assert [c["step"] for c in curve] == [0, 15, 30]
    assert curve[2]["loss"] < curve[1]["loss"]
    first, last = curve[0]["held_out"], curve[-1]["held_out"]
    assert last["soft_ce_step0"] < first["soft_ce_step0"] and last["mean_accepted_of_3"] > 1.0, (first, last)
    assert meta["kind"] == "eagle3" and meta["steps"] == 30 and meta["data"]["shards"] == ["shard-000000.npz"]
    assert (out / "draft.safetensors").stat().st_size < 20 * 2**20
    again = train(target, _Tok(), out, config, eval_sets=sets)  # finished: resumes at the end, trains nothing
    assert again["steps"] == 30 and len((out / CURVE).read_text().splitlines()) == 3
    loaded = load_eagle3(target, out, torch.float32)
    ids = torch.tensor([sets["held_out"][0][1]])
    with torch.no_grad():
        trained = Eagle3Draft(target, loaded.d2t, loaded.layers)
        trained.load_state_dict(torch.load(out / "checkpoint.pt", weights_only=False)["draft"])
        a, b = ttt_forward(target, loaded, ids, 2)[1], ttt_forward(target, trained.eval(), ids, 2)[1]
    torch.testing.assert_close(a[1], b[1], atol=0.05, rtol=0.05)  # bf16 export
    # a checkpoint exported mid-run in vLLM's layout (tools.eagle3_export_checkpoint)
    from safetensors.torch import load_file

    exported, step = export_checkpoint(out / "checkpoint.pt", tmp_path / "vllm", target)
    assert step == 30 and json.loads((exported / "config.json").read_text())["architectures"] == ["LlamaForCausalLMEagle3"]
    torch.testing.assert_close(load_file(exported / "model.safetensors")["fc.weight"].float(), trained.fc.weight,
                               atol=0.02, rtol=0.02)
    # a warm start (--init): a fresh run from the export keeps its vocabulary and starts where it ended
    warm = train(target, _Tok(), tmp_path / "warm", Eagle3Config(**{**config.__dict__, "steps": 2, "eval_every": 2,
                                                                   "init": str(out)}), eval_sets=sets)
    start = json.loads((tmp_path / "warm" / CURVE).read_text().splitlines()[0])
    assert warm["config"]["init"] == str(out) and warm["steps"] == 2
    assert torch.equal(load_eagle3(target, tmp_path / "warm", torch.float32).d2t, loaded.d2t)
    assert start["held_out"]["soft_ce_step0"] < first["soft_ce_step0"]  # not the random start
    assert abs(start["held_out"]["soft_ce_step0"] - last["soft_ce_step0"]) < 0.05, (start, last)
    # an export of the warm run's checkpoint names the run that wrote it and the draft it began from
    warm_export, _ = export_checkpoint(tmp_path / "warm" / CHECKPOINT, tmp_path / "warm-export", target, "tandem",
                                       data=None)
    meta = json.loads((warm_export / "tandem_draft.json").read_text())
    assert meta["training_command"] == shlex.join(sys.argv) and meta["init"]["dir"] == str(out)
    assert meta["init"]["steps"] == 30 and meta["steps"] == 2


def test_a_run_without_data_is_refused(tmp_path):
    with pytest.raises(FileNotFoundError, match="manifest"):
        train(tiny_llama(0, vocab_size=16), _Tok(), tmp_path / "o", Eagle3Config(data=str(tmp_path)))


def test_fit_sets_are_greedy_training_answers_spread_over_the_shards(tmp_path):
    """tools.eagle3_fit scores a draft on answers it trained on: greedy chat samples of the draft's own shards,
    one a shard first, each cut to its prompt and its answer's first `tokens` tokens."""
    from tools.draftdata.shards import read_shard
    from tools.eagle3_fit import trained_shards, training_sets, unseen_shards

    _dataset(tmp_path, tiny_llama(0, vocab_size=16), n=4, shards=3)
    names = trained_shards({"shards": 3})
    assert names == ["shard-000000.npz", "shard-000001.npz", "shard-000002.npz"]
    assert trained_shards({"shards": names[:2]}) == names[:2]
    assert unseen_shards(tmp_path, names[:2]) == names[2:] and unseen_shards(tmp_path, names) == []
    sets = training_sets(tmp_path, names, samples=3, tokens=8)
    assert sets["train_code"] == []  # no code sample in this data
    firsts = [read_shard(tmp_path / name) for name in names]
    assert sets["train_chat"] == [(4, shard.sample(0)[:4 + 8]) for shard in firsts]  # one from each shard
    assert len(training_sets(tmp_path, names, samples=5, tokens=8)["train_chat"]) == 5  # then more a shard
    assert training_sets(tmp_path, names, samples=3, tokens=17)["train_chat"] == []  # answers of 16 tokens
