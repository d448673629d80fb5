"""What a session loop and a verifier pass each other, in process or over the wire: a round of drafts
(`Round`), its verification (`RoundResult`), and what opening a session prefilled (`Opened`). Plain data: they
import no model runner, so the processes that only route them (the ingress, the router, the wire codec) need not
load one. `cluster.model.verifier.VerifierEngine` produces them."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, NamedTuple

from cluster.core.logprobs import TokenLogprob
from cluster.core.tree import TokenTree

if TYPE_CHECKING:
    import torch


@dataclass
class Round:
    session: str
    round: int
    epoch: int
    token_ids: list[int]  # [k] drafts
    draft_probs: torch.Tensor | None  # [k, vocab_size] or None (deterministic proposer)
    bonus: bool
    parents: list[int] | None = None  # the drafts form a token tree (cluster.core.tree); None: a chain

    def tree(self) -> TokenTree | None:
        return None if self.parents is None else TokenTree(self.token_ids, self.parents, self.draft_probs)


@dataclass
class RoundResult:
    session: str
    round: int
    epoch: int
    num_accepted: int = 0
    output_token_ids: list[int] = field(default_factory=list)
    recovered: bool = False
    bonus: bool = False
    stale: bool = False
    verify_start: float = 0.0
    verify_end: float = 0.0
    # the target's last hidden state of the committed positions this round fed (feature-fed drafts
    # only): rows for positions feature_start ..  # [m, H] bf16
    features: torch.Tensor | None = None
    feature_start: int = 0
    # sessions whose params ask for `logprobs`: one per output token, the target's at its position
    logprobs: list[TokenLogprob] | None = None


class Opened(NamedTuple):
    """What `VerifierEngine.open` prefilled: the committed tokens' count, the target's features of all but
    the last (`features` asked)  # [n - 1, H] bf16, and the prompt logprobs (`params.prompt_logprobs` set:
    one per token after the first, `cluster.core.logprobs.prompt_logprobs`)."""

    length: int
    features: torch.Tensor | None = None
    prompt_logprobs: list[TokenLogprob] | None = None
