"""Serving on vLLM with the ingress apart from the verifier replicas (`vllm.direct_ingress: false`): the
`Ingress` deployment validates, tokenizes and writes the OpenAI and gRPC responses, and drives each session
on a verifier replica through a Serve handle (the route where a replica's death is survived: the ingress
resumes the stream on a live replica). The default, replicas that are their own ingress, is tested with the
whole API in `tests/test_vllm_serving.py`; this module checks that the other route serves the same tokens.

Runs when vLLM is importable (CI installs it); one application for the module (~50 s to start).
"""

from __future__ import annotations

import grpc
import openai
import pytest

pytest.importorskip("vllm")  # the only skip: this module needs vLLM installed

from protos import pb, rpc  # noqa: E402
from tests.helpers import SERVE_PROMPTS, serve_app  # noqa: E402

MODEL = "SmolLM2-135M-Instruct"
MAX_TOKENS = 24
PROMPTS = SERVE_PROMPTS
VERIFIER = f"Verifier:{MODEL}"


@pytest.fixture(scope="module")
def server():
    # suffix matches drafted in vLLM's step (the default proposer on vLLM): speculation on, no drafter actor
    with serve_app(engine={"backend": "vllm", "dtype": "float32", "proposer": "suffix", "num_speculative_tokens": 3,
                           "threads": 1},
                   vllm={"kv_cache_space_gib": 1, "compile": False, "direct_ingress": False}) as endpoints:
        yield endpoints


def test_ingress_apart_serves_the_targets_tokens(server, tokenizer, prompt_ids, references):
    from ray import serve

    assert set(serve.status().applications["tandem"].deployments) == {"Ingress", VERIFIER}
    client = openai.OpenAI(base_url=server.http + "/v1", api_key="none", max_retries=0, timeout=300)
    for i, (text, chat) in enumerate(PROMPTS):
        ref = references[tuple(prompt_ids[i])]
        if chat:
            stream = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": text}],
                                                    max_tokens=MAX_TOKENS, temperature=0, stream=True,
                                                    extra_body={"return_token_ids": True})
            ids = [t for chunk in stream for choice in chunk.choices for t in choice.model_extra.get("token_ids") or []]
        else:
            r = client.completions.create(model=MODEL, prompt=text, max_tokens=MAX_TOKENS, temperature=0,
                                          extra_body={"return_token_ids": True})
            ids = r.choices[0].model_extra["token_ids"]
            assert r.choices[0].text == tokenizer.decode(ref, skip_special_tokens=True)
        assert ids == ref, (text, ids, ref)
    # gRPC through Serve's proxy to the ingress deployment: the same tokens
    with grpc.insecure_channel(server.grpc) as channel:
        replies = list(rpc.GenerationStub(channel).Generate(
            pb.GenerateRequest(model=MODEL, prompt=PROMPTS[1][0], params=pb.SamplingParams(max_tokens=MAX_TOKENS)),
            metadata=(("application", "tandem"),), timeout=300))
    assert [t for reply in replies for t in reply.token_ids] == references[tuple(prompt_ids[1])]
    assert replies[-1].finish_reason == "length" and replies[-1].completion_tokens == MAX_TOKENS
