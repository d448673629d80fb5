"""Logits processors: a pure function of logits, the request's parameters and its token history.

What vLLM (0.32, `v1/sample/sampler.py`) applies before temperature, in its order: `allowed_token_ids`
(every other id masked), `bad_words` (a sequence's last token masked where the output ends with the
rest of it), `min_tokens` (the stop ids, EOS and `stop_token_ids`, masked until the output holds that many
tokens), `logit_bias` (added), then the penalties: `repetition_penalty` over prompt + output (a seen
token's logit divided by it when positive, multiplied when negative), `frequency_penalty` (minus the
penalty times the token's count in the output) and `presence_penalty` (minus the penalty once a token is
in the output). tandem adds `structured_outputs` (a grammar's token mask, `cluster.core.grammar`) after
the masks and the bias, before the penalties (a mask's -inf stays -inf either way). `min_p` acts after
temperature and lives in `cluster.core.sampling.probabilities`.

The target (p) and the draft (q) are processed by the same function with the same history: a round's
row i (the distribution at its draft position i) continues the committed output plus the round's drafts
0..i-1, as vLLM's rejection sampler does (`_combine_outputs_with_spec_tokens`); a token tree's node row
continues the output plus the node's path. The default parameters change nothing and cost nothing
(`SamplingParams.processes_logits` is False: the logits come back as they are). A position where the
masks leave no token at all falls back to its raw logits (vLLM would sample from NaN there).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from cluster.core.errors import InvalidRequestError
from cluster.core.grammar import mask_rows
from cluster.core.sampling import FLOAT32_MAX, SamplingParams


def stop_ids(params: SamplingParams) -> list[int]:
    """The ids `min_tokens` holds back: `stop_token_ids`, and the model's EOS unless `ignore_eos`."""
    eos = [] if params.ignore_eos else list(params.eos_token_ids)
    return sorted(set(eos) | set(params.stop_token_ids))


def tokenize_bad_words(tokenizer, words: Sequence[str]) -> list[list[int]]:
    """`bad_words` strings as token sequences, tokenized as vLLM does (`SamplingParams.update_from_tokenizer`):
    each word left-stripped, and after a space where that gives a different first token and as many tokens."""
    out: list[list[int]] = []
    for word in dict.fromkeys(words):
        plain = list(tokenizer.encode(word.lstrip(), add_special_tokens=False))
        if not plain:
            raise InvalidRequestError(f"bad_words: {word[:32]!r} tokenizes to no token")
        out.append(plain)
        spaced = list(tokenizer.encode(" " + word.lstrip(), add_special_tokens=False))
        if spaced and spaced[0] != plain[0] and len(spaced) == len(plain):
            out.append(spaced)
    return out


def _bad_word_ids(bad_words: Sequence[Sequence[int]], output: Sequence[int]) -> list[int]:
    """The last token of every bad word whose other tokens end `output` (vLLM: over output tokens only)."""
    banned = []
    for word in bad_words:
        prefix = len(word) - 1
        if prefix > len(output):
            continue
        if prefix == 0 or list(output[len(output) - prefix:]) == list(word[:prefix]):
            banned.append(word[-1])
    return banned


def process_rows(logits: torch.Tensor, params: SamplingParams, prompt_ids: Sequence[int],
                 output_ids: Sequence[int], suffixes: Sequence[Sequence[int]]) -> torch.Tensor:
    """The processed logits of several positions of one sequence.

    logits      # [r, vocab_size] raw, any float dtype / device -> [r, vocab_size] float32 (the input itself
                #   when nothing is to be done)
    prompt_ids  # [P]: the prompt (repetition penalty)
    output_ids  # [O]: the committed output
    suffixes    # r lists: row i continues output_ids + suffixes[i] (the round's drafts before it)
    """
    if not params.processes_logits:
        return logits
    if len(suffixes) != logits.shape[0]:
        raise ValueError(f"{logits.shape[0]} rows but {len(suffixes)} histories")
    r, vocab = logits.shape
    device = logits.device
    out = logits.float().clone()  # [r, vocab_size]
    ninf = float("-inf")
    if params.allowed_token_ids is not None:
        keep = torch.zeros(vocab, dtype=torch.bool, device=device)
        keep[torch.tensor(params.allowed_token_ids, dtype=torch.long, device=device)] = True
        out.masked_fill_(~keep, ninf)
    histories = [list(output_ids) + list(s) for s in suffixes]  # r x [O + len(s)]
    if params.bad_words:
        for i, history in enumerate(histories):
            banned = _bad_word_ids(params.bad_words, history)
            if banned:
                out[i, torch.tensor(banned, dtype=torch.long, device=device)] = ninf
    if params.min_tokens:
        held = stop_ids(params)
        rows = [i for i, history in enumerate(histories) if len(history) < params.min_tokens]
        if held and rows:
            out[torch.tensor(rows, dtype=torch.long, device=device)[:, None],
                torch.tensor(held, dtype=torch.long, device=device)[None]] = ninf
    if params.logit_bias:
        ids = torch.tensor(list(params.logit_bias), dtype=torch.long, device=device)
        out[:, ids] += torch.tensor(list(params.logit_bias.values()), dtype=torch.float32, device=device)
    if params.structured_outputs is not None:  # the grammar's mask given each row's history
        mask_rows(out, params.structured_outputs, output_ids, suffixes)
    if params.penalizes:
        counts = torch.zeros(r, vocab, dtype=torch.float32, device=device)  # [r, vocab_size]: output counts
        if output_ids:
            base = torch.bincount(torch.tensor(list(output_ids), dtype=torch.long), minlength=vocab)[:vocab]
            counts += base.to(device=device, dtype=torch.float32)
        for i, suffix in enumerate(suffixes):
            if suffix:
                counts[i] += torch.bincount(torch.tensor(list(suffix), dtype=torch.long),
                                            minlength=vocab)[:vocab].to(device=device, dtype=torch.float32)
        seen = counts > 0  # [r, vocab_size]
        if params.repetition_penalty != 1.0:
            rep = seen.clone()
            if prompt_ids:
                rep[:, torch.tensor(sorted(set(prompt_ids)), dtype=torch.long, device=device)] = True
            penalty = params.repetition_penalty
            # a penalty near 0 divides a positive logit past float32's range: +inf, and then no distribution (NaN
            # probabilities). Such a logit is the largest finite value instead, for p and q alike (the fuzzing
            # found the served path refusing its own draft's q at repetition_penalty 5e-324)
            out = torch.where(rep, torch.where(out > 0, out / penalty, out * penalty), out).clamp(max=FLOAT32_MAX)
        if params.frequency_penalty:
            out -= params.frequency_penalty * counts
        if params.presence_penalty:
            out -= params.presence_penalty * seen.float()
    empty = ~torch.isfinite(out).any(dim=-1)  # [r]: the masks left no token (e.g. allowed ids all stop ids)
    if bool(empty.any()):
        out[empty] = logits[empty].float()  # such a position falls back to the raw logits, for p and q alike
    return out


def process_chain(logits: torch.Tensor, params: SamplingParams, prompt_ids: Sequence[int],
                  output_ids: Sequence[int], draft_ids: Sequence[int] = ()) -> torch.Tensor:
    """A round's rows: logits  # [r, vocab_size], r <= len(draft_ids) + 1; row i continues
    output_ids + draft_ids[:i] (row len(draft_ids) is the bonus position)."""
    if not params.processes_logits:
        return logits
    return process_rows(logits, params, prompt_ids, output_ids, [list(draft_ids[:i]) for i in range(logits.shape[0])])


def process_sequence(logits: torch.Tensor, params: SamplingParams, sequence: Sequence[int],
                     suffixes: Sequence[Sequence[int]] | None = None) -> torch.Tensor:
    """`process_rows` for a session's whole sequence (prompt, then output): the first
    `params.prompt_length` tokens are the prompt. `suffixes` None: every row continues `sequence` itself.

    logits  # [r, vocab_size] -> [r, vocab_size]
    """
    if not params.processes_logits:
        return logits
    split = params.prompt_length if params.prompt_length is not None else len(sequence)
    split = min(split, len(sequence))
    suffixes = suffixes if suffixes is not None else [[] for _ in range(logits.shape[0])]
    return process_rows(logits, params, sequence[:split], sequence[split:], suffixes)
