"""On-disk layout: compressed `.npz` shards, a JSON manifest, atomic writes, one writer at a time.

    OUT/manifest.json          recipe, done shards (file, counts, sha256, cursors after it), runs
    OUT/sources.json.gz        the corpora snapshot the prompts are drawn from
    OUT/shard-000000.npz ...   one per done shard
    OUT/.lock                  flock held by the running generator

A shard is written to a temporary file, fsynced and renamed into place; only then is the manifest
(written the same way) updated to list it. The manifest is the truth: a shard file it does not
list (a run killed between the two renames) is ignored and rewritten by the next run, so a killed
run loses at most the shard in progress and never duplicates one.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import io
import json
import os
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np

MANIFEST = "manifest.json"
FORMAT = "tandem-draftdata/1"


@dataclass
class ShardData:
    """The samples of one shard; sample `i` is `tokens[offsets[i]:offsets[i+1]]`."""

    tokens: np.ndarray      # [T] uint16 (int32 for vocabularies ≥ 2^16): prompt template + answer, concatenated
    offsets: np.ndarray     # [N+1] int64
    prompt_len: np.ndarray  # [N] int32, prompt tokens of each sample (the answer follows them)
    sample_id: np.ndarray   # [N] int64, global and unique: shard * shard_size + slot
    kind: np.ndarray        # [N] <U16: magpie | topic | code | completion
    source: np.ndarray      # [N] <U32: pool name ("topic/word", "code", ...) or "magpie"
    chat: np.ndarray        # [N] bool, prompt went through the chat template
    greedy: np.ndarray      # [N] bool
    seed: np.ndarray        # [N] int64, the sampling seed of the answer
    finish: np.ndarray      # [N] <U8: stop | length
    prompt: np.ndarray      # [N] <U…, the prompt text (user content, or raw text for completions)

    def __len__(self) -> int:
        return len(self.prompt_len)

    def sample(self, i: int) -> list[int]:
        return self.tokens[self.offsets[i]:self.offsets[i + 1]].astype(np.int64).tolist()

    def answer_tokens(self) -> int:
        return int((np.diff(self.offsets) - self.prompt_len).sum())

    def prompt_tokens(self) -> int:
        return int(self.prompt_len.sum())


def write_atomic(path: Path, data: bytes) -> None:
    tmp = path.with_name(f".{path.name}.tmp{os.getpid()}")
    with open(tmp, "wb") as fh:
        fh.write(data)
        fh.flush()
        os.fsync(fh.fileno())
    os.replace(tmp, path)
    dir_fd = os.open(path.parent, os.O_RDONLY)
    try:
        os.fsync(dir_fd)
    finally:
        os.close(dir_fd)


def write_shard(path: Path, shard: ShardData) -> str:
    """Write atomically; returns the file's sha256."""
    buf = io.BytesIO()
    np.savez_compressed(buf, **asdict(shard))
    data = buf.getvalue()
    write_atomic(path, data)
    return hashlib.sha256(data).hexdigest()


def read_shard(path: Path) -> ShardData:
    with np.load(path, allow_pickle=False) as z:
        return ShardData(**{k: z[k] for k in ShardData.__dataclass_fields__})


def sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


@dataclass
class ShardRecord:
    index: int
    file: str
    samples: int
    answer_tokens: int
    prompt_tokens: int
    sha256: str
    cursors: dict[str, int]   # pool cursors after this shard; the next shard starts there
    by_kind: dict[str, int]   # samples per kind
    engine: str
    seconds: float
    generated_tokens: int     # answers plus Magpie queries: what the engine produced


@dataclass
class RunRecord:
    started_at: str
    engine: str
    shards: int = 0
    answer_tokens: int = 0
    generated_tokens: int = 0
    seconds: float = 0.0
    stopped: str = "running"  # running (or killed) | budget | limit | exhausted

    @property
    def tokens_per_s(self) -> float:
        return self.generated_tokens / self.seconds if self.seconds else 0.0


@dataclass
class Manifest:
    recipe: dict
    shards: list[ShardRecord] = field(default_factory=list)
    runs: list[RunRecord] = field(default_factory=list)

    def totals(self) -> dict[str, int]:
        return {"shards": len(self.shards), "samples": sum(s.samples for s in self.shards),
                "answer_tokens": sum(s.answer_tokens for s in self.shards),
                "prompt_tokens": sum(s.prompt_tokens for s in self.shards)}

    def save(self, out: Path) -> None:
        runs = [{**asdict(r), "tokens_per_s": round(r.tokens_per_s, 2)} for r in self.runs]
        body = {"format": FORMAT, "recipe": self.recipe, "totals": self.totals(),
                "shards": [asdict(s) for s in self.shards], "runs": runs}
        write_atomic(out / MANIFEST, (json.dumps(body, indent=1, sort_keys=True) + "\n").encode())

    @classmethod
    def load(cls, out: Path) -> Manifest | None:
        path = out / MANIFEST
        if not path.is_file():
            return None
        body = json.loads(path.read_text())
        if body.get("format") != FORMAT:
            raise ValueError(f"{path}: format {body.get('format')!r}, expected {FORMAT!r}")
        runs = [RunRecord(**{k: v for k, v in r.items() if k != "tokens_per_s"}) for r in body["runs"]]
        return cls(body["recipe"], [ShardRecord(**s) for s in body["shards"]], runs)


def shard_name(index: int) -> str:
    return f"shard-{index:06d}.npz"


@contextlib.contextmanager
def locked(out: Path):
    """Hold OUT/.lock for the block; a second generator on the same folder fails at once."""
    out.mkdir(parents=True, exist_ok=True)
    fh = open(out / ".lock", "a+")  # noqa: SIM115
    try:
        try:
            fcntl.flock(fh, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            raise RuntimeError(f"{out} is being written by another generator (lock held)") from None
        yield
    finally:
        fh.close()
