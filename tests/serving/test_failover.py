"""Router failover through the real Serve application: the router replica carrying streams is killed
(SIGKILL through Ray) mid-stream; every stream goes on from what it had sent, on the replica Serve
starts instead, with the reference tokens (fp32, so exact), nothing repeated, the same usage; the
sessions the killed router held on the verifier and the drafter are released there."""

from __future__ import annotations

import asyncio
import random
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import grpc
import httpx
import openai
import pytest
import ray

from cluster.core.sampling import SamplingParams
from deployments.chunks import SessionProgress, TokensChunk
from protos import pb, rpc
from tests.helpers import SERVE_PROMPTS
from tests.serving import API_KEY, MAX_RESUMES, METADATA, MODEL

MAX_TOKENS = 48
PROMPTS = SERVE_PROMPTS + [
    ("def is_prime(n):\n", False),
    ("Explain what a hash table is.", True),
    ("import os\n\ndef list_files(path):\n", False),
]
AUTH = {"Authorization": f"Bearer {API_KEY}"}


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.http + "/v1", api_key=API_KEY, max_retries=0, timeout=300)


def _replica(prefix: str):
    """(name, handle) of the live actor whose name starts with `prefix` (Serve replicas are named
    SERVE_REPLICA::app#Deployment#id; drafter actors tandem-drafter-app-id)."""
    for info in ray.util.list_named_actors(all_namespaces=True):
        if info["name"].startswith(prefix):
            try:
                return info["name"], ray.get_actor(info["name"], namespace=info["namespace"])
            except ValueError:  # listed but already dead
                continue
    return None, None


ROUTER = "SERVE_REPLICA::tandem#Router"
VICTIMS = {"router": ROUTER, "verifier": "SERVE_REPLICA::tandem#VerifierPool", "drafter": "tandem-drafter-tandem-"}


def _router_replica():
    return _replica(ROUTER)


def _kill(victim: str = "router") -> str:
    """SIGKILL one actor; Serve replaces router and verifier replicas, Ray restarts the drafter actor."""
    name, actor = _replica(VICTIMS[victim])
    assert actor is not None, f"no {victim}"
    ray.kill(actor, no_restart=victim != "drafter")
    return name


def _grpc_stream(server, prompt: str, chat: bool, on_chunk, max_tokens: int) -> tuple[list[int], str, int]:
    """A greedy gRPC Generate stream's token ids, text and completion_tokens."""
    channel = grpc.insecure_channel(server.grpc)
    if chat:
        request = pb.GenerateRequest(model=MODEL, messages=pb.ChatMessages(messages=[pb.ChatMessage(role="user", content=prompt)]),
                                     params=pb.SamplingParams(max_tokens=max_tokens))
    else:
        request = pb.GenerateRequest(model=MODEL, prompt=prompt, params=pb.SamplingParams(max_tokens=max_tokens))
    ids, text, completion = [], "", 0
    for response in rpc.GenerationStub(channel).Generate(request, metadata=METADATA, timeout=600):
        ids += response.token_ids
        text += response.text
        completion = response.completion_tokens or completion
        on_chunk(ids)
    channel.close()
    return ids, text, completion


def _stream(client, prompt: str, chat: bool, on_chunk=None, **params) -> tuple[list[int], str, object]:
    """A streamed request's token ids, text and final usage; `on_chunk(ids so far)` after each chunk."""
    extra = {"return_token_ids": True, **params.pop("extra_body", {})}
    common = dict(model=MODEL, stream=True, stream_options={"include_usage": True}, extra_body=extra, **params)
    if chat:
        stream = client.chat.completions.create(messages=[{"role": "user", "content": prompt}], **common)
    else:
        stream = client.completions.create(prompt=prompt, **common)
    ids, text, usage = [], "", None
    for chunk in stream:
        for choice in chunk.choices:
            ids += choice.model_extra.get("token_ids") or []
            text += (choice.delta.content or "") if chat else choice.text
        usage = chunk.usage or usage
        if on_chunk is not None:
            on_chunk(ids)
    return ids, text, usage


def _held() -> dict[str, int]:
    """Sessions and leases every part still holds (one replica of each in this app)."""
    from ray import serve

    def ask(deployment: str, method: str) -> int:
        return getattr(serve.get_deployment_handle(deployment, "tandem"), method).remote().result(timeout_s=60)

    return {"router": ask("Router", "sessions"), "verifier": ask("VerifierPool", "sessions"),
            "verifier_leases": ask("VerifierPool", "open_leases"), "drafter": ask("DrafterPool", "sessions"),
            "drafter_leases": ask("DrafterPool", "open_leases")}


NOTHING_HELD = {"router": 0, "verifier": 0, "verifier_leases": 0, "drafter": 0, "drafter_leases": 0}


def _assert_nothing_held(deadline_s: float) -> None:
    deadline = time.time() + deadline_s
    while _held() != NOTHING_HELD and time.time() < deadline:
        time.sleep(1)
    assert _held() == NOTHING_HELD


def test_leases_of_a_dead_holder_are_ended_and_their_sessions_released():
    """The pools' lease bookkeeping (`deployments.pools._Leases`) without Serve: once a holder is found
    dead, each session it held is released (with its kind), once more at the next check, and its lease
    ends; leases its holder ended are not released; other holders' and unwatched leases stay; the
    holder check runs once per distinct holder, and a check that fails counts as alive."""
    from deployments.pools import _Leases

    async def scenario():
        alive = {"a": True, "b": True, "c": True}
        asked: list[str] = []
        released: list[tuple[str, object]] = []
        counted: list[int] = []

        def is_alive(holder):
            asked.append(holder[1])
            if alive[holder[1]] is None:
                raise TimeoutError("GCS not answering")
            return alive[holder[1]]

        def watcher(period_s: float) -> _Leases:
            return _Leases(lambda session, kind: released.append((session, kind)), alive=is_alive,
                           period_s=period_s, on_orphans=counted.append, pool="test")

        async def lease(leases, session, holder, kind=None):  # as VerifierPool.lease / DrafterPool.lease
            with leases.held(session, holder, kind) as ended:
                yield session
                await ended.wait()

        async def hold(session, holder, kind=None):  # the caller keeps the stream open until cancelled
            async for _ in lease(leases, session, holder and ("serve", holder), kind):
                pass

        leases = watcher(3600)  # checked by hand below
        tasks = {s: asyncio.create_task(hold(s, h, k)) for s, h, k in
                 [("a1", "a", None), ("a2", "a", True), ("a3", "a", None), ("b1", "b", None), ("c1", "c", None),
                  ("x1", None, None)]}
        await asyncio.sleep(0.01)
        assert leases.open == 6
        assert await leases.check() == 0 and sorted(asked) == ["a", "b", "c"]  # one check per holder
        tasks["a3"].cancel()  # its holder let go of it, as a router does
        await asyncio.gather(tasks["a3"], return_exceptions=True)
        assert leases.open == 5
        alive["a"], alive["c"] = False, None
        assert await leases.check() == 2
        await asyncio.wait_for(asyncio.gather(tasks["a1"], tasks["a2"]), 5)  # their leases ended
        assert sorted(released) == [("a1", None), ("a2", True)] and counted == [2]
        assert leases.open == 3 and not any(tasks[s].done() for s in ("b1", "c1", "x1"))
        assert await leases.check() == 0  # released once more (idempotent), nothing new
        assert sorted(released) == [("a1", None), ("a1", None), ("a2", True), ("a2", True)]
        await leases.check()
        assert len(released) == 4

        for session in ("b1", "c1", "x1"):
            tasks[session].cancel()
        await asyncio.gather(*tasks.values(), return_exceptions=True)
        assert leases.open == 0 and released.count(("c1", None)) == 0

        # the background task: started by the first watched lease, ends leases by itself, stops when idle
        leases = watcher(0.05)
        alive["c"] = True
        tasks = {s: asyncio.create_task(hold(s, h)) for s, h in [("b1", "b"), ("c1", "c")]}
        await asyncio.sleep(0.01)
        assert leases._task is not None and leases.open == 2
        alive["c"] = False
        await asyncio.wait_for(tasks["c1"], 5)
        assert ("c1", None) in released and leases.orphans_released == 1 and not tasks["b1"].done()
        tasks["b1"].cancel()
        await asyncio.gather(*tasks.values(), return_exceptions=True)
        await asyncio.sleep(0.3)
        assert leases.open == 0 and leases._task is None
        assert released.count(("c1", None)) == 2 and ("b1", None) not in released

    asyncio.run(scenario())


def test_no_session_leaks_after_disconnects_and_timeouts(server):
    """16 clients go away at random points (before the first token, mid-stream, by a client timeout,
    after the end, non-streaming ones by timeout): afterwards nothing holds a session or a lease.
    (A killed router's sessions: `test_sixteen_streams_survive_a_kill_of_each_part`.)"""
    rng = random.Random(0)
    body = {"model": MODEL, "prompt": PROMPTS[2][0], "max_tokens": 400, "temperature": 0.7, "ignore_eos": True}

    def one(i: int) -> str:
        how = ["stream", "stream", "stream", "timeout", "plain-timeout", "complete"][i % 6]
        lines = rng.randrange(0, 30)
        timeout = httpx.Timeout(300, read=0.3 + rng.random()) if "timeout" in how else 300
        try:
            if how == "plain-timeout":
                httpx.post(server.http + "/v1/completions", json=body, headers=AUTH, timeout=timeout)
                return "finished"
            small = {**body, "max_tokens": 8} if how == "complete" else body
            with httpx.stream("POST", server.http + "/v1/completions", json={**small, "stream": True},
                              headers=AUTH, timeout=timeout) as r:
                for n, _ in enumerate(r.iter_lines()):
                    if how == "stream" and n >= lines:
                        return "disconnected"
            return "finished"
        except httpx.TimeoutException:
            return "timed out"

    with ThreadPoolExecutor(16) as pool:
        outcomes = list(pool.map(one, range(16)))
    assert "disconnected" in outcomes and "timed out" in outcomes and "finished" in outcomes
    _assert_nothing_held(90)


KILL_ORDER = ("drafter", "router", "verifier")  # quickest recovery first: the streams outlive all three


def test_sixteen_streams_survive_a_kill_of_each_part(server, client, tokenizer, prompt_ids, references):
    """16 concurrent greedy streams (12 HTTP, 4 gRPC). Once every stream has sent tokens the drafter is
    killed (plain decoding until Ray restarts it); once the streams have moved on, the router replica
    (streams resumed by the ingress); once they have moved on again, the verifier replica (sessions
    replayed by the router). Every stream completes with the reference tokens, its text once, the same
    usage. Afterwards nothing holds a session or a lease: a killed router's sessions are released by the
    verifier and the drafter, which find their lease holder gone."""
    n = 2 * len(PROMPTS)
    progress = [0] * n  # tokens each stream has received so far

    def one(i: int):
        prompt, chat = PROMPTS[i % len(PROMPTS)]

        def seen(ids):
            progress[i] = len(ids)
        if i % 4 == 3:
            ids, text, completion = _grpc_stream(server, prompt, chat, seen, MAX_TOKENS)
            return ids, text, completion
        ids, text, usage = _stream(client, prompt, chat, on_chunk=seen, max_tokens=MAX_TOKENS, temperature=0)
        return ids, text, usage.completion_tokens

    def wait_for(condition, what: str, timeout_s: float = 300) -> None:
        deadline = time.time() + timeout_s
        while not condition():
            assert time.time() < deadline, what
            time.sleep(0.05)

    at_kill: dict[str, list[int]] = {}
    killed: dict[str, str] = {}
    with ThreadPoolExecutor(n) as pool:
        futures = [pool.submit(one, i) for i in range(n)]
        wait_for(lambda: all(progress), "a stream sent nothing")
        for victim in KILL_ORDER:
            if at_kill:  # the streams moved on since the last kill (or all ended: asserted below)
                wait_for(lambda target=sum(progress) + n: sum(progress) >= target or all(f.done() for f in futures),
                         f"no progress after the {list(at_kill)[-1]} was killed")
            at_kill[victim] = list(progress)
            killed[victim] = _kill(victim)
        results = [f.result(timeout=600) for f in futures]
    for victim in ("router", "verifier"):
        assert _replica(VICTIMS[victim])[0] != killed[victim]  # Serve started another replica
    for i, (ids, text, completion) in enumerate(results):
        ref = references[tuple(prompt_ids[i % len(PROMPTS)])]
        assert ids == ref, f"stream {i} differs from transformers' greedy output"
        assert text == tokenizer.decode(ref, skip_special_tokens=True), f"stream {i}: text repeated or missing"
        assert completion == len(ref)
    for victim, seen in at_kill.items():
        assert any(seen[i] < len(results[i][0]) for i in range(n)), f"the {victim} was killed after every stream ended"
    _assert_nothing_held(60)


def test_seeded_sampled_stream_resumed_equals_uninterrupted(server, client):
    """Sampling is keyed by (seed, position): the resumed session draws the same numbers. Plain decoding
    (num_speculative_tokens 0) makes the whole schedule deterministic; with drafts, which positions are
    drafted depends on timing, so equal seeds give equal outputs only in distribution there."""
    params = dict(max_tokens=40, temperature=0.9, top_p=0.95, seed=1234, extra_body={"num_speculative_tokens": 0})
    uninterrupted, _, _ = _stream(client, PROMPTS[4][0], True, **dict(params, extra_body=dict(params["extra_body"])))
    killed = []

    def kill_once(ids):
        if len(ids) >= 5 and not killed:
            killed.append(_kill("router"))

    resumed, _, usage = _stream(client, PROMPTS[4][0], True, on_chunk=kill_once, **params)
    assert killed and len(resumed) == 40
    assert resumed == uninterrupted
    assert usage.completion_tokens == 40


def test_stop_string_across_the_resume_point(server, tokenizer, prompt_ids, references):
    """A resumed session whose prefix ends inside a stop string: the router sees the whole output."""
    from ray import serve

    ref = references[tuple(prompt_ids[0])]
    full = tokenizer.decode(ref, skip_special_tokens=True)
    # a stop string made of the end of token k-1's text and the start of token k's
    k = next(k for k in range(8, len(ref)) if len(tokenizer.decode(ref[k - 1:k]).strip()) >= 2
             and len(tokenizer.decode(ref[k:k + 1]).strip()) >= 2)
    head, tail = tokenizer.decode(ref[:k], skip_special_tokens=True), tokenizer.decode(ref[:k + 1], skip_special_tokens=True)
    stop = head[-2:] + tail[len(head):len(head) + 2]
    assert stop in full
    cut = full.index(stop)
    assert cut < len(head)  # the stop string starts before the resume point
    sent_text = full[:cut]  # what the ingress had streamed: the text before the pending stop string
    router = serve.get_deployment_handle("Router", "tandem")
    params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, stop=[stop], seed=7)
    chunks = list(router.options(stream=True).generate.remote(
        prompt_ids[0], params, None, SessionProgress(token_ids=ref[:k], text=sent_text)))
    final = chunks[-1]
    assert final.finish_reason == "stop"
    assert sent_text + "".join(c.text for c in chunks) == full[:cut]
    # it stopped on the next token at the latest
    assert sum(len(c.token_ids) for c in chunks if isinstance(c, TokensChunk)) <= 1


def test_router_dying_on_every_attempt_gives_an_error_event(server, client):
    """Kill every router replica as soon as it is up: after MAX_RESUMES resumes the stream ends with an
    SSE error object (HTTP) / UNAVAILABLE (gRPC), never a bare closed connection."""
    stop = threading.Event()
    kills = []

    def router_running() -> bool:
        from ray import serve

        return serve.status().applications["tandem"].deployments["Router"].status == "HEALTHY"

    def killer():
        while not stop.is_set():
            name, actor = _router_replica()
            if actor is not None and name not in kills and router_running():
                time.sleep(2.0)  # the resumed request reaches it
                ray.kill(actor, no_restart=True)
                kills.append(name)
            time.sleep(0.2)

    body = dict(model=MODEL, prompt=PROMPTS[2][0], max_tokens=4000, temperature=0, stream=True,
                extra_body={"ignore_eos": True})
    thread = threading.Thread(target=killer, daemon=True)
    thread.start()
    try:
        with pytest.raises(openai.APIError) as info:
            for _ in client.completions.create(**body):
                pass
        assert "failed" in str(info.value.message) and "router" in str(info.value.message)
        assert len(kills) >= MAX_RESUMES + 1
        channel = grpc.insecure_channel(server.grpc)
        stub = rpc.GenerationStub(channel)
        request = pb.GenerateRequest(model=MODEL, prompt=PROMPTS[2][0],
                                     params=pb.SamplingParams(max_tokens=4000, ignore_eos=True))
        with pytest.raises(grpc.RpcError) as rpc_info:
            for _ in stub.Generate(request, metadata=METADATA, timeout=600):
                pass
        assert rpc_info.value.code() == grpc.StatusCode.UNAVAILABLE, rpc_info.value.details()
    finally:
        stop.set()
        thread.join()
    # with the killer gone, Serve's next router replica serves again
    deadline = time.time() + 120
    while time.time() < deadline:
        try:
            r = client.completions.create(model=MODEL, prompt="hi", max_tokens=2, temperature=0)
            assert r.usage.completion_tokens == 2
            break
        except openai.APIError:
            time.sleep(2)
    else:
        raise AssertionError("the server did not serve again")


def test_greedy_is_repeatable_alone_and_in_a_batch(server, client):
    """With `engine.dtype: float32` (this app) greedy output does not depend on what else is verified
    in the same forward: one request alone and the same request among 7 concurrent others agree."""
    def ask(prompt: str) -> list[int]:
        r = client.completions.create(model=MODEL, prompt=prompt, max_tokens=32, temperature=0,
                                      extra_body={"return_token_ids": True})
        return r.choices[0].model_extra["token_ids"]

    alone = ask(PROMPTS[6][0])
    with ThreadPoolExecutor(8) as pool:
        batch = list(pool.map(ask, [PROMPTS[6][0]] * 4 + [p for p, _ in PROMPTS[:4]]))
    assert batch[:4] == [alone] * 4


def test_health_check_period_reaches_each_deployment():
    """`health_check_period_s` per deployment goes to Serve's options (the package's server, tests/serving/conftest.py, sets 2 s for all four);
    Serve's own 10 s where it is not set."""
    from deployments.assembly import deployment_options, router_options
    from deployments.config import TandemAppConfig
    from deployments.vllm_serving import llm_config

    config = TandemAppConfig.build({"router": {"health_check_period_s": 2}, "verifier": {"health_check_period_s": 3}})
    assert router_options(config)["health_check_period_s"] == 2
    assert deployment_options(config.verifier, "VerifierPool")["health_check_period_s"] == 3
    assert deployment_options(config.drafter, "DrafterPool")["health_check_period_s"] == 10
    assert llm_config(config.with_backend("vllm")).deployment_config["health_check_period_s"] == 3


def test_drain_loop_reaches_each_deployment():
    """`graceful_shutdown_wait_loop_s` per deployment goes to Serve's options; Serve's own 2 s where it is not set."""
    from deployments.assembly import deployment_options, router_options
    from deployments.config import TandemAppConfig
    from deployments.vllm_serving import llm_config

    config = TandemAppConfig.build({"router": {"graceful_shutdown_wait_loop_s": 0.5},
                                    "verifier": {"graceful_shutdown_wait_loop_s": 0.25}})
    assert router_options(config)["graceful_shutdown_wait_loop_s"] == 0.5
    assert deployment_options(config.verifier, "VerifierPool")["graceful_shutdown_wait_loop_s"] == 0.25
    assert deployment_options(config.ingress, "Ingress")["graceful_shutdown_wait_loop_s"] == 2.0
    assert llm_config(config.with_backend("vllm")).deployment_config["graceful_shutdown_wait_loop_s"] == 0.25
