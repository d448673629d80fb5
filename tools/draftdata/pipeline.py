"""The generator: plan a shard's prompts, let the target answer them, write the shard, repeat.

Shard `k` holds samples `k*S .. k*S+S-1` (`S` = shard size). Its prompts are a function of the
recipe seed, `k`, the pool cursors after shard `k-1` (in the manifest) and the prompts already used
(read back from the done shards): Magpie queries first, then template × topic, code and completion
prompts by the recipe's mix, shuffled; any shortfall (Magpie rejects) is filled with topic prompts.
A fraction of the answers is greedy, the rest sampled at the target's usual setting.
"""

from __future__ import annotations

import datetime as dt
import gzip
import hashlib
import json
import logging
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np

from .corpora import Corpora
from .engines import Engine, GenRequest
from .heldout import HeldOut, normalise
from .magpie import MagpieConfig, magpie_queries, seed_for, user_prefix
from .prompts import Prompt, StaticSources, kind_counts, shuffled
from .shards import (
    Manifest,
    RunRecord,
    ShardData,
    ShardRecord,
    locked,
    read_shard,
    shard_name,
    write_atomic,
    write_shard,
)

log = logging.getLogger("tools.draftdata")
SOURCES = "sources.json.gz"
DEFAULT_MIX = {"magpie": 0.40, "topic": 0.30, "code": 0.20, "completion": 0.10}


@dataclass
class Recipe:
    """Everything that decides the data; a resumed run must have the same recipe."""

    seed: int = 0
    shard_size: int = 256
    max_tokens: int = 512
    greedy_fraction: float = 0.5
    temperature: float = 0.7   # the target's usual sampling (generation_config.json when it names one)
    top_p: float = 0.9
    mix: dict[str, float] = field(default_factory=lambda: dict(DEFAULT_MIX))
    magpie: dict = field(default_factory=lambda: asdict(MagpieConfig()))
    max_prompt_tokens: int = 1024
    heldout_ngram: int = 8
    heldout_prompts: int = 0      # how many held-out prompts the filter had
    sources_sha256: str = ""
    source_sizes: dict[str, int] = field(default_factory=dict)
    chat_prefix: str = ""         # the Magpie user-turn prefix (it shows the default system prompt)


def target_sampling(model_dir: Path) -> tuple[float, float]:
    """(temperature, top_p) from generation_config.json when it names them, else (0.7, 0.9)."""
    path = Path(model_dir) / "generation_config.json"
    cfg = json.loads(path.read_text()) if path.is_file() else {}
    return float(cfg.get("temperature", 0.7)), float(cfg.get("top_p", 0.9))


def load_sources(out: Path, tokenizer, expect_sha: str = "") -> tuple[Corpora, str]:
    """The corpora snapshot in OUT (built and written on the first run), and its sha256."""
    path = out / SOURCES
    if path.is_file():
        data = path.read_bytes()
    else:
        data = gzip.compress(json.dumps(Corpora.build(tokenizer).to_json(), sort_keys=True).encode(), mtime=0)
        write_atomic(path, data)
    sha = hashlib.sha256(data).hexdigest()
    if expect_sha and sha != expect_sha:
        raise RuntimeError(f"{path} has sha256 {sha}, the manifest's recipe says {expect_sha}")
    return Corpora.from_json(json.loads(gzip.decompress(data))), sha


def encode(tokenizer, p: Prompt) -> list[int]:
    """The prompt's token ids as tandem serves it (cluster.engine.encode_prompt)."""
    if p.chat:
        return list(tokenizer.apply_chat_template([{"role": "user", "content": p.text}], add_generation_prompt=True,
                                                  tokenize=True, return_dict=False))
    return list(tokenizer(p.text)["input_ids"])


class Generator:
    """Generates shards into `out` until a token budget or a shard limit; resumes from the manifest."""

    def __init__(self, out: Path, tokenizer, engine: Engine, recipe: Recipe, heldout: HeldOut | None = None):
        self.out, self.tok, self.engine = Path(out), tokenizer, engine
        self.heldout = heldout or HeldOut.default(recipe.heldout_ngram)
        self.stop_id = tokenizer.convert_tokens_to_ids("<|im_end|>")
        self.recipe = recipe

    # -- planning -----------------------------------------------------------------------------------

    def _prompts(self, index: int, cursors: dict[str, int], seen: set[str]) -> tuple[list[Prompt], list[list[int]], int]:
        r = self.recipe
        rng = np.random.default_rng([r.seed, index])
        counts = kind_counts(r.shard_size, r.mix)
        prompts, magpie_tokens = magpie_queries(self.engine, self.tok, counts.get("magpie", 0), seed=r.seed,
                                                shard=index, heldout=self.heldout, seen=seen,
                                                config=MagpieConfig(**r.magpie))
        for kind in ("topic", "code", "completion"):
            prompts += self.sources.draw(kind, counts.get(kind, 0), rng, cursors, seen)
        ids = [encode(self.tok, p) for p in prompts]
        keep = [i for i, x in enumerate(ids) if len(x) <= r.max_prompt_tokens]
        prompts, ids = [prompts[i] for i in keep], [ids[i] for i in keep]
        while len(prompts) < r.shard_size:  # Magpie rejects, over-long prompts: topic prompts instead
            extra = self.sources.draw("topic", 1, rng, cursors, seen) or \
                self.sources.draw("code", 1, rng, cursors, seen)
            if not extra:
                break
            x = encode(self.tok, extra[0])
            if len(x) <= r.max_prompt_tokens:
                prompts.append(extra[0])
                ids.append(x)
        order = shuffled(list(range(len(prompts))), rng)
        return [prompts[i] for i in order], [ids[i] for i in order], magpie_tokens

    def build_shard(self, index: int, cursors: dict[str, int], seen: set[str]) -> tuple[ShardData | None, int]:
        """Shard `index`: (its data, tokens the engine generated for it, Magpie included); None: no prompts left."""
        r = self.recipe
        prompts, ids, magpie_tokens = self._prompts(index, cursors, seen)
        if not prompts:
            return None, magpie_tokens
        rng = np.random.default_rng([r.seed, index, 1])
        greedy = rng.random(len(prompts)) < r.greedy_fraction  # [N]
        sids = [index * r.shard_size + slot for slot in range(len(prompts))]
        seeds = [seed_for(r.seed, sid) for sid in sids]
        reqs = [GenRequest(x, r.max_tokens, 0.0 if g else r.temperature, 1.0 if g else r.top_p, s, (self.stop_id,))
                for x, g, s in zip(ids, greedy, seeds, strict=True)]
        results = self.engine.generate(reqs)
        full = [x + res.token_ids for x, res in zip(ids, results, strict=True)]
        lengths = np.array([len(f) for f in full], dtype=np.int64)
        dtype = np.uint16 if max(max(f) for f in full) < 2**16 else np.int32
        shard = ShardData(
            tokens=np.concatenate([np.asarray(f, dtype=dtype) for f in full]),
            offsets=np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64),
            prompt_len=np.array([len(x) for x in ids], dtype=np.int32),
            sample_id=np.array(sids, dtype=np.int64),
            kind=np.array([p.kind for p in prompts], dtype="<U16"),
            source=np.array([p.source for p in prompts], dtype="<U32"),
            chat=np.array([p.chat for p in prompts], dtype=bool),
            greedy=greedy.astype(bool),
            seed=np.array(seeds, dtype=np.int64),
            finish=np.array([res.finish for res in results], dtype="<U8"),
            prompt=np.array([p.text for p in prompts], dtype=str),
        )
        return shard, magpie_tokens + sum(len(res.token_ids) for res in results)

    # -- the run --------------------------------------------------------------------------------------

    def _open(self) -> Manifest:
        """The manifest (a new one with this recipe, or the existing one after checking the recipe)."""
        manifest = Manifest.load(self.out)
        for stale in self.out.glob(".*.tmp*"):
            stale.unlink()
        expect = manifest.recipe.get("sources_sha256", "") if manifest else ""
        corpora, sha = load_sources(self.out, self.tok, expect)
        self.sources = StaticSources(corpora, self.recipe.seed, self.heldout)
        self.recipe.sources_sha256, self.recipe.source_sizes = sha, self.sources.sizes()
        self.recipe.heldout_prompts = len(self.heldout)
        self.recipe.chat_prefix = user_prefix(self.tok)
        if manifest is None:
            manifest = Manifest(asdict(self.recipe))
            manifest.save(self.out)
            return manifest
        diff = {k: (manifest.recipe.get(k), v) for k, v in asdict(self.recipe).items()
                if manifest.recipe.get(k) != v and k != "heldout_prompts"}
        if diff:
            raise RuntimeError(f"{self.out} was made with another recipe (manifest, now): {diff}; "
                               "resume with the same options or use a new --out")
        manifest.recipe["heldout_prompts"] = len(self.heldout)  # the set may grow; done shards are rechecked
        return manifest

    def run(self, target_tokens: int, limit_shards: int | None = None) -> Manifest:
        with locked(self.out):
            manifest = self._open()
            seen: set[str] = set()
            for rec in manifest.shards:
                texts = [str(p) for p in read_shard(self.out / rec.file).prompt]
                bad = [t for t in texts if self.heldout.rejects(t)]
                if bad:
                    raise RuntimeError(f"{rec.file} holds {len(bad)} prompts the held-out filter now rejects "
                                       f"(the held-out set grew?), e.g. {bad[0][:80]!r}")
                seen.update(normalise(t) for t in texts)
            cursors = dict(manifest.shards[-1].cursors) if manifest.shards else {}
            run = RunRecord(dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"), self.engine.name)
            manifest.runs.append(run)
            t_run = time.perf_counter()
            try:
                self._loop(manifest, run, cursors, seen, target_tokens, limit_shards, t_run)
            except BaseException:
                run.stopped = "interrupted"
                raise
            finally:
                run.seconds = round(time.perf_counter() - t_run, 2)
                manifest.save(self.out)
            return manifest

    def _loop(self, manifest: Manifest, run: RunRecord, cursors: dict[str, int], seen: set[str],
              target_tokens: int, limit_shards: int | None, t_run: float) -> None:
        """Shards until the budget, the shard limit, or the pools run dry; the manifest after each."""
        while True:
            if manifest.totals()["answer_tokens"] >= target_tokens:
                run.stopped = "budget"
                break
            if limit_shards is not None and run.shards >= limit_shards:
                run.stopped = "limit"
                break
            index = len(manifest.shards)
            t0 = time.perf_counter()
            shard, generated = self.build_shard(index, cursors, seen)
            if shard is None:
                run.stopped = "exhausted"
                break
            assert not any(self.heldout.rejects(str(p)) for p in shard.prompt), "held-out prompt in a shard"
            sha = write_shard(self.out / shard_name(index), shard)
            seconds = time.perf_counter() - t0
            kinds, counts = np.unique(shard.kind, return_counts=True)
            manifest.shards.append(ShardRecord(
                index, shard_name(index), len(shard), shard.answer_tokens(), shard.prompt_tokens(), sha,
                dict(cursors), {str(k): int(c) for k, c in zip(kinds, counts, strict=True)},
                self.engine.name, round(seconds, 2), generated))
            run.shards += 1
            run.answer_tokens += shard.answer_tokens()
            run.generated_tokens += generated
            run.seconds = round(time.perf_counter() - t_run, 2)
            manifest.save(self.out)
            log.info("shard %d: %d samples, %d answer tokens, %.0f generated tok/s; total %d / %d answer tokens",
                     index, len(shard), shard.answer_tokens(), generated / max(seconds, 1e-9),
                     manifest.totals()["answer_tokens"], target_tokens)


def status(out: Path) -> str:
    """A short human-readable summary of OUT's manifest."""
    manifest = Manifest.load(Path(out))
    if manifest is None:
        return f"{out}: no manifest (nothing generated yet)"
    t = manifest.totals()
    kinds: dict[str, int] = {}
    for s in manifest.shards:
        for k, n in s.by_kind.items():
            kinds[k] = kinds.get(k, 0) + n
    lines = [f"{out}",
             (f"  shards {t['shards']}, samples {t['samples']}, answer tokens {t['answer_tokens']:,}, "
              f"prompt tokens {t['prompt_tokens']:,}"),
             f"  by kind: {', '.join(f'{k} {n}' for k, n in sorted(kinds.items())) or '-'}",
             (f"  recipe: seed {manifest.recipe['seed']}, shard size {manifest.recipe['shard_size']}, "
              f"max tokens {manifest.recipe['max_tokens']}, greedy {manifest.recipe['greedy_fraction']}, "
              f"T {manifest.recipe['temperature']} top-p {manifest.recipe['top_p']}, mix {manifest.recipe['mix']}")]
    if manifest.runs:
        r = manifest.runs[-1]
        lines.append(f"  last run: {r.started_at}, engine {r.engine}, {r.shards} shards, {r.answer_tokens:,} answer "
                     f"tokens in {r.seconds:.0f} s, {r.tokens_per_s:.1f} generated tok/s ({r.stopped})")
    return "\n".join(lines)
