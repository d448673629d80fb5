"""What the engine and the front door tell tandem's proposer inside vLLM's workers.

- `DrafterSpec`: where the drafts come from (a drafter, and/or matches the proposer makes itself,
  `InlineMatches`) and how the proposer waits for them, sent to every rank
  through `collective_rpc("tandem_configure", args=(spec.wire(),))` (vLLM carries plain data only:
  the worker validates the dict back into a `DrafterSpec`).
- `RequestKey`: the request id the front door gives vLLM, `<session>~k<n>` when the request caps its
  own drafts at n tokens (0 = plain decoding), with `~g<group>` before it for a request with a `cache_salt`
  (a digest of it, `salt_group`); the proposer reads both back from vLLM's request id.

Pure (pydantic and the engine config): importable without vLLM.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from cluster.core.config import EAGLE3, EngineConfig
from drafts.suffix import OwnMatch

TUNING = ("max_k", "overlap", "wait_s", "on_miss", "wait_first", "matches")  # changing only these keeps the drafter


class RayDrafter(BaseModel):
    """A `cluster.ray.drafter.Drafter` actor, found by name on the Ray cluster at `address`."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    actor: str = Field(..., min_length=1)
    namespace: str | None = None
    address: str | None = None  # the cluster's GCS address; None: "auto"
    auth_mode: str | None = None  # the cluster's RAY_AUTH_MODE (a local Ray started by ray.init uses tokens)


class ProposerImport(BaseModel):
    """Tests only: the proposer is `path` ("package.module:callable") called with `kwargs`, imported in
    the worker process (the test doubles of `tests/vllm_doubles.py`). Nothing in the runtime sets it."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    path: str = Field(..., pattern=r"^[A-Za-z_][\w.]*:[A-Za-z_]\w*$")
    kwargs: dict = Field(default_factory=dict)


class InlineMatches(BaseModel):
    """Drafts the proposer makes itself, inside vLLM's step, from a request's committed tokens: no drafter
    call, no thread, no round trip (`drafts.suffix`). Lossless whatever they propose (one-hot q).

    - `lookup`: prompt lookup, the `ngram` proposer's own (`drafts.ngram.ngram_lookup`: the earliest match
      of the last n tokens, n from `max_ngram` down to 1), up to `max_tokens`;
    - `own`: the hybrid's long match rounds (`drafts.suffix.OwnMatch`): a match of the suffix at least
      `min_match` tokens long proposes up to `max_tokens` of its continuation; without one the row goes
      to the drafter;
    - `priced`: proposer `suffix` (`drafts.suffix.PricedMatch`): the longest match's continuation, cut where
      a further token's learned chance of acceptance falls below its verify price (`threshold`, plus
      `per_row` for each further row of the step; near-certain tokens only from `busy_rows` rows on), up to
      `max_tokens`."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    kind: Literal["lookup", "own", "priced"]
    max_tokens: int = Field(..., ge=1, le=32)
    max_ngram: int = Field(3, ge=1, le=16)
    min_match: int = Field(4, ge=1, le=32, description="`own` only: the shortest match drafted inline.")
    max_match: int = Field(16, ge=1, le=64, description="`priced` only: how far back a match is extended (longer ones share its table row).")
    threshold: float = Field(0.1, gt=0, lt=1, description="`priced` only: the price of one verified token at one row, in tokens gained.")
    per_row: float = Field(0.04, ge=0, le=1, description="`priced` only: the price's rise per further row of the step.")
    busy_rows: int = Field(0, ge=0, le=4096, description="`priced` only: from this many rows in a step, a token is drafted only when near-certain (`PricedMatch.BUSY_PRICE`); 0: the price only rises by `per_row`.")
    match_factor: float = Field(0.0, ge=0, le=8, description="`priced` only: a draft at most this many times its match long (0: no such cap).")
    pool_tokens: int = Field(0, ge=0, le=1 << 22, description="`priced` only: finished requests' outputs kept, in tokens, where a request's own tokens match nothing as long (`drafts.suffix.SuffixPool`; greedy and unseeded requests only); 0: none.")


class DrafterSpec(BaseModel):
    """One drafter for the proposer: at most one of `engine`, `ray`, `proposer_import`; none of them
    means no drafter (plain decoding). The tuning fields (`TUNING`) may change without a new drafter."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    engine: EngineConfig | None = Field(None, description="A tandem proposer built by `drafts.factory` from this config, on one drafting thread in rank 0's worker.")
    ray: RayDrafter | None = Field(None, description="The remote `Drafter` actor, called through Ray from rank 0.")
    proposer_import: ProposerImport | None = Field(None, description="Tests only: a proposer imported by path in the worker.")
    label: str | None = Field(None, description="Specs with different labels never share a drafter (a fresh one per benchmark mode).")
    registered: bool = Field(False, description="The front door opens and releases each session, keyed by the request id it gave vLLM.")
    max_k: int | None = Field(None, ge=0, description="Draft tokens per step, at most vLLM's num_speculative_tokens (None: that many).")
    overlap: bool = Field(True, description="After handing vLLM a draft, keep drafting as if it will be accepted.")
    wait_s: float = Field(0.2, ge=0, description="How long one step waits for its drafts; a late row gets no draft (a plain step).")
    on_miss: Literal["plain", "wait"] = Field("plain", description="Overlapped, a missed draft means one plain step ('plain') or waiting for the redraft ('wait').")
    wait_first: bool = Field(True, description="A request's first step waits for its first draft (else: one plain step, the first token leaves at once).")
    matches: InlineMatches | None = Field(None, description="Drafts the proposer makes itself from the committed tokens (before, or instead of, the drafter's).")

    @model_validator(mode="after")
    def _one_source(self) -> "DrafterSpec":
        sources = [name for name in ("engine", "ray", "proposer_import") if getattr(self, name) is not None]
        if len(sources) > 1:
            raise ValueError(f"a drafter spec has at most one source, not {' and '.join(sources)}")
        return self

    @property
    def has_drafter(self) -> bool:
        return self.engine is not None or self.ray is not None or self.proposer_import is not None

    @property
    def drafts(self) -> bool:
        """Whether anything drafts: a drafter or inline matches."""
        return self.has_drafter or self.matches is not None

    def tuned(self, **changes) -> "DrafterSpec":
        """This spec with `changes` (any fields), validated."""
        return DrafterSpec.model_validate({**self.model_dump(), **changes})

    def drafter_part(self) -> dict:
        """What names the drafter: equal drafter parts share one (only the tuning differs)."""
        return self.model_dump(mode="json", exclude=set(TUNING))

    def wire(self) -> dict:
        """The plain data `collective_rpc` carries to the workers (`DrafterSpec.model_validate` reads it back)."""
        return self.model_dump(mode="json")


REQUEST_CAP_SEP = "~k"
REQUEST_GROUP_SEP = "~g"
GROUP_LEN = 16  # hex digits of a salt group
VLLM_SUFFIX_LEN = 9  # vLLM appends "-" and 8 random characters to the request id it is given


def salt_group(cache_salt: str | None) -> str | None:
    """The pool group of a request's `cache_salt` (None: unsalted): a digest, so the salt itself is in no request
    id (vLLM logs them). Requests share the matches' pool of finished outputs only within one group."""
    return None if cache_salt is None else hashlib.sha256(cache_salt.encode()).hexdigest()[:GROUP_LEN]


@dataclass(frozen=True)
class RequestKey:
    """The request id the front door gives vLLM for a session, which is also the drafter's session:
    `session`, with the request's salt group (`~g<16 hex>`, `salt_group`) and its own cap on draft tokens
    (`~k<n>`) appended when it has them."""

    session: str
    cap: int | None = None  # 0: plain decoding, no drafts and no drafter session
    group: str | None = None  # the cache salt's group (None: unsalted)

    def __post_init__(self) -> None:
        if self.cap is not None and self.cap < 0:
            raise ValueError(f"a request's draft cap is >= 0, not {self.cap}")
        if self.group is not None and not _is_group(self.group):
            raise ValueError(f"a salt group is {GROUP_LEN} lowercase hex digits, not {self.group!r}")

    def __str__(self) -> str:
        group = "" if self.group is None else f"{REQUEST_GROUP_SEP}{self.group}"
        return self.session + group + ("" if self.cap is None else f"{REQUEST_CAP_SEP}{int(self.cap)}")

    @classmethod
    def parse(cls, key: str) -> "RequestKey":
        """The key `str(RequestKey(...))` made; a key without a cap or group (or nothing before them) has None."""
        head, sep, tail = key.rpartition(REQUEST_CAP_SEP)
        cap = int(tail) if sep and head and tail.isascii() and tail.isdigit() else None
        rest = head if cap is not None else key
        head, sep, tail = rest.rpartition(REQUEST_GROUP_SEP)
        if sep and head and _is_group(tail):
            return cls(head, cap, tail)
        return cls(rest, cap)

    @staticmethod
    def from_vllm(internal_id: str) -> str:
        """The id the front door gave vLLM, from vLLM's internal request id (that id + "-" + 8 characters)."""
        if len(internal_id) > VLLM_SUFFIX_LEN and internal_id[-VLLM_SUFFIX_LEN] == "-":
            return internal_id[:-VLLM_SUFFIX_LEN]
        return internal_id


def _is_group(text: str) -> bool:
    return len(text) == GROUP_LEN and all(c in "0123456789abcdef" for c in text)


INLINE_ONLY = ("ngram", "suffix")  # proposers whose drafts are all made in vLLM's step: no drafter at all


def inline_matches(config: EngineConfig) -> InlineMatches | None:
    """The matches vLLM's proposer drafts itself for a tandem engine config: proposer `ngram`'s prompt lookup
    and proposer `suffix`'s priced matches (all their drafts: no drafter at all; with `eagle3_matches`, also those
    vLLM's EAGLE-3 proposer takes where they beat its drafts: `cluster.vllm.eagle_matches`), the hybrid's long match
    rounds (`own_matches`, `match_tokens` > γ; the rest of its rounds are the drafter's). None for the others."""
    gamma = config.num_speculative_tokens
    if config.proposer == "none" or gamma == 0:
        return None
    if config.proposer == "ngram":
        return InlineMatches(kind="lookup", max_tokens=gamma, max_ngram=config.max_ngram)
    if config.proposer == "suffix" or (config.proposer == EAGLE3 and config.eagle3_matches):
        return InlineMatches(kind="priced", max_tokens=config.suffix_tokens, max_ngram=config.max_ngram,
                             threshold=config.suffix_threshold, match_factor=config.suffix_match_factor,
                             busy_rows=config.suffix_busy_rows,
                             pool_tokens=config.suffix_pool_tokens)
    own = OwnMatch.for_rounds(config.match_tokens, gamma, max_ngram=config.max_ngram) \
        if config.proposer == "hybrid" and config.own_matches else None
    if own is None:
        return None
    return InlineMatches(kind="own", max_tokens=own.max_tokens, max_ngram=own.max_ngram, min_match=own.min_match)


def engine_draft_tokens(config: EngineConfig) -> int:
    """vLLM's `num_speculative_tokens` for a tandem engine config: γ, or the inline matches' length when longer
    (the drafter's own drafts stay at most γ: `DrafterSpec.max_k`)."""
    matches = inline_matches(config)
    return max(config.num_speculative_tokens, matches.max_tokens if matches else 0)
