"""Test-only proposers, tiny models and the Serve application on a local Ray."""

from __future__ import annotations

import contextlib
import time
import warnings

import torch
from transformers import LlamaConfig, LlamaForCausalLM

from cluster.vllm import reaper
from drafts.proposer import DraftProposal, SequenceProposer


class OracleProposer(SequenceProposer):
    """Knows the reference continuation of each prompt. `wrong=False`: always right (proposes the
    reference); `wrong=True`: always wrong (proposes a token that is never the reference's)."""

    def __init__(self, references: dict[tuple[int, ...], list[int]], vocab_size: int, wrong: bool = False):
        super().__init__()
        self.references, self.vocab_size, self.wrong = references, vocab_size, wrong
        self.name = "always-wrong" if wrong else "always-right"
        self._prompt_len: dict = {}

    def start(self, session, prompt_ids, params):
        super().start(session, prompt_ids, params)
        self._prompt_len[session] = len(prompt_ids)

    def propose(self, session, k):
        tokens = self.tokens(session)
        n = self._prompt_len[session]
        full = list(tokens[:n]) + self.references[tuple(tokens[:n])]
        nxt = full[len(tokens) : len(tokens) + k]
        if self.wrong:
            nxt = [(t + 1) % self.vocab_size for t in nxt]
        tokens.extend(nxt)
        return DraftProposal(nxt, None)


class SiblingOracleProposer(OracleProposer):
    """Proposes token trees whose own chain starts with a wrong token and whose second candidate at
    the first position is the reference's (`tree_width` 2): every round is won by the sibling branch."""

    tree_width = 2

    def propose_batch(self, requests, trees=()):
        out = {}
        for session, k in requests.items():
            tokens = self.tokens(session)
            n = self._prompt_len[session]
            right = (list(tokens[:n]) + self.references[tuple(tokens[:n])])[len(tokens): len(tokens) + k]
            if session not in trees or not right:
                out[session] = self.propose(session, k)
                continue
            wrong = [(t + 1) % self.vocab_size for t in right]
            tokens.extend(wrong)  # the proposer's own sequence follows its chain
            # nodes: wrong[0], right[0] (sibling), then the wrong chain under wrong[0]
            token_ids = [wrong[0], right[0], *wrong[1:]]
            parents = [-1, -1] + ([0, *range(2, len(wrong))] if len(wrong) > 1 else [])
            out[session] = DraftProposal(token_ids, None, parents)
        return out


@contextlib.contextmanager
def torch_threads(n: int):
    """torch's intra-op threads set to `n` inside, restored after (one thread: decoding one token at a time, two
    threads lose to one on a busy 2-core machine)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(n)
    try:
        yield
    finally:
        torch.set_num_threads(threads)


def tiny_llama(seed: int, vocab_size: int = 10, sharpness: float = 8.0) -> LlamaForCausalLM:
    """A small random Llama whose next-token distributions are peaked (so p and q differ clearly)."""
    torch.manual_seed(seed)
    config = LlamaConfig(vocab_size=vocab_size, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=2, num_key_value_heads=1, head_dim=16, max_position_embeddings=64,
                         tie_word_embeddings=False, bos_token_id=None, eos_token_id=None, pad_token_id=None)
    model = LlamaForCausalLM(config).float().eval()
    with torch.no_grad():
        model.lm_head.weight.mul_(sharpness)
    model.generation_config.eos_token_id = None
    return model


def greedy_references(model, prompt_ids: list[list[int]], max_tokens: int) -> dict[tuple[int, ...], list[int]]:
    """transformers' own greedy output for each prompt: the reference every loop must equal."""
    refs = {}
    with torch.inference_mode():
        for ids in prompt_ids:
            out = model.generate(torch.tensor([ids]), attention_mask=torch.ones(1, len(ids), dtype=torch.long),
                                 do_sample=False, max_new_tokens=max_tokens)
            refs[tuple(ids)] = out[0, len(ids):].tolist()
    return refs


# (text, use_chat_template): code, prose and chat prompts the serving tests decode
SERVE_PROMPTS = [
    ("def fibonacci(n):\n    \"\"\"Return the n-th Fibonacci number.\"\"\"\n", False),
    ("class Stack:\n    def __init__(self):\n        self.items = []\n\n    def push(self, item):\n", False),
    ("Once upon a time, in a small village by the sea,", False),
    ("What is the capital of France?", True),
    ("Write a short poem about the moon.", True),
]


# Serve's timing in the tests' applications (what they test does not depend on it): the controller's loop each 0.1 s
# (Serve's own default; tandem serves with 1 s, which saves idle CPU on a long-lived server) and each stopping replica
# looking for unfinished requests each 0.2 s (Serve's default 2 s, and it stops an application's deployments one after
# another). Measured alone on 2 cores: an application's start 23.5 -> 20.3 s, its `serve.shutdown()` 11 -> 7.3 s with
# the loop alone.
TEST_SERVE_ENV = {"RAY_SERVE_CONTROL_LOOP_INTERVAL_S": "0.1"}
TEST_DRAIN_LOOP_S = 0.2
PARTS = ("ingress", "router", "drafter", "verifier")


@contextlib.contextmanager
def serve_app(**overrides):
    """ray_config.yaml's application on a local Ray (127.0.0.1, free ports), its `args` overridden
    by `overrides` (each part's stopping replicas checking each TEST_DRAIN_LOOP_S); yields the endpoints, shuts
    Serve and Ray down afterwards."""
    import ray
    import yaml
    from ray import serve

    from cluster.ray.runtime import environment, free_port, init_local_ray
    from deployments.serving import DEFAULT_CONFIG, load_config, start

    args = yaml.safe_load(DEFAULT_CONFIG.read_text())["applications"][0]["args"]
    overrides = {**overrides, **{part: {**overrides.get(part, args[part]), "graceful_shutdown_wait_loop_s": TEST_DRAIN_LOOP_S}
                                 for part in PARTS}}
    with environment(TEST_SERVE_ENV):  # what Ray's processes, started here, inherit
        init_local_ray(num_cpus=16)
    try:
        yield start(load_config(DEFAULT_CONFIG, overrides=overrides), http_port=free_port(), grpc_port=free_port())
    finally:
        processes = _cluster_processes()
        serve.shutdown()
        ray.shutdown()
        # the replicas' own children (vLLM's engine processes, GBs each) may outlive the raylet for a moment: the next
        # module's Ray starts once they are gone and their memory is back. (The Ray starts two runs lost right after
        # a teardown were grpcio's fork handlers killing the new raylet, not these: cluster/__init__.py.)
        deadline = time.monotonic() + 20
        while (alive := [pid for pid, started in processes.items() if reaper.alive(pid, started)]) and \
                time.monotonic() < deadline:
            time.sleep(0.1)
        if alive:
            warnings.warn(f"{len(alive)} processes of the stopped cluster still alive after 20 s: {alive}")


def raylet_pid() -> int:
    """The pid of this driver's local raylet."""
    import ray
    from ray._private import ray_constants

    return ray._private.worker._global_node.all_processes[ray_constants.PROCESS_TYPE_RAYLET][0].process.pid


def _cluster_processes() -> dict[int, int | None]:
    """{pid: start time} of every process under this driver's raylet: Ray's workers and what they started."""
    return {pid: reaper.start_time(pid) for pid in reaper.descendants(raylet_pid())}


def stream_and_kill(client, model: str, prompt: str, max_tokens: int, kill) -> list[int]:
    """Stream a greedy completion; call `kill` once the first tokens arrived; return all token ids."""
    stream = client.completions.create(model=model, prompt=prompt, max_tokens=max_tokens, temperature=0,
                                       stream=True, extra_body={"return_token_ids": True})
    ids, killed = [], False
    for chunk in stream:
        for choice in chunk.choices:
            ids += choice.model_extra.get("token_ids") or []
        if ids and not killed:
            kill()
            killed = True
    assert killed
    return ids


def assert_stop_string(client, model: str, prompt: str, ref_text: str, max_tokens: int) -> None:
    """A stop string ("recursive", in `ref_text`: the greedy text of `prompt`) through a served completions
    endpoint, streamed and not: the text up to it, finish reason `stop`."""
    stop = "recursive"
    assert stop in ref_text
    for stream in (False, True):
        r = client.completions.create(model=model, prompt=prompt, max_tokens=max_tokens, temperature=0, stop=[stop],
                                      stream=stream)
        if stream:
            chunks = list(r)
            text = "".join(c.choices[0].text for c in chunks if c.choices)
            finish = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
        else:
            text, finish = r.choices[0].text, [r.choices[0].finish_reason]
        assert text == ref_text[: ref_text.index(stop)]
        assert finish == ["stop"]


def assert_text_options(client, model: str, tokenizer, prompt: str, ref_text: str, max_tokens: int) -> None:
    """`include_stop_str_in_output` and `skip_special_tokens` through a served completions endpoint, streamed
    and not, as vLLM writes the text: the stop string kept; special tokens' text written, an ending EOS's
    only with the stop kept. `ref_text`: the greedy text of `prompt`, containing "recursive"."""
    def complete(stream: bool, **extra):
        tokens = extra.pop("max_tokens", max_tokens)
        r = client.completions.create(model=model, prompt=prompt, temperature=0, stream=stream, max_tokens=tokens,
                                      extra_body=extra)
        if stream:
            chunks = list(r)
            finish = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
            return "".join(c.choices[0].text for c in chunks if c.choices), finish[-1]
        return r.choices[0].text, r.choices[0].finish_reason

    stop = "recursive"
    for stream in (False, True):
        assert complete(stream, stop=[stop], include_stop_str_in_output=True) == \
            (ref_text[: ref_text.index(stop) + len(stop)], "stop")
    eos = tokenizer.convert_tokens_to_ids("<|im_end|>")
    only_eos = {"allowed_token_ids": [eos], "max_tokens": 3}  # every token is EOS
    for stream in (False, True):
        assert complete(stream, **only_eos) == ("", "stop")
        assert complete(stream, **only_eos, skip_special_tokens=False) == ("", "stop")
        assert complete(stream, **only_eos, skip_special_tokens=False, include_stop_str_in_output=True) == \
            ("<|im_end|>", "stop")
        assert complete(stream, **only_eos, skip_special_tokens=False, ignore_eos=True) == ("<|im_end|>" * 3, "length")
