"""Checks of the routes vLLM's server has beside chat and completions, shared by the torch application's tests
(test_serving) and the vLLM application's (test_vllm_serving): the Responses API (`POST /v1/responses`) through
the real `openai` client, where the text is the target's greedy text, and the tokenizer routes (`/tokenize`,
`/detokenize`, `/version`). What a client of `vllm serve` sends to them works unchanged."""

from __future__ import annotations

import json

import httpx
import openai
import pytest
from pydantic import BaseModel

MODEL = "SmolLM2-135M-Instruct"
STREAM_ORDER = ["response.created", "response.in_progress", "response.output_item.added",
                "response.content_part.added"]
STREAM_END = ["response.output_text.done", "response.content_part.done", "response.output_item.done"]


def assert_responses_greedy(client: openai.OpenAI, tokenizer, prompt: str, prompt_ids: list[int], ref: list[int],
                            max_tokens: int) -> None:
    """`prompt` as the user's one message; `ref`: the target's greedy tokens for its chat prompt `prompt_ids`
    (at most `max_tokens` of them). Non-streamed, streamed, and through the client's stream helper."""
    text = tokenizer.decode(ref, skip_special_tokens=True)
    status = "incomplete" if len(ref) == max_tokens and ref[-1] != tokenizer.eos_token_id else "completed"
    r = client.responses.create(model=MODEL, input=prompt, max_output_tokens=max_tokens, temperature=0)
    assert r.output_text == text and r.status == status and r.object == "response" and r.id.startswith("resp_")
    assert (r.incomplete_details.reason if r.incomplete_details else None) == \
        ("max_output_tokens" if status == "incomplete" else None)
    assert [(o.type, o.role, [c.type for c in o.content]) for o in r.output] == \
        [("message", "assistant", ["output_text"])]
    assert r.usage.input_tokens == len(prompt_ids) and r.usage.output_tokens == len(ref)
    assert r.usage.total_tokens == len(prompt_ids) + len(ref) and r.store is False
    assert r.model_extra["speculation"]["rounds"] > 0

    events = list(client.responses.create(model=MODEL, input=[{"role": "user", "content": prompt}],
                                          max_output_tokens=max_tokens, temperature=0, stream=True))
    kinds = [e.type for e in events]
    deltas = [e for e in events if e.type == "response.output_text.delta"]
    assert kinds == STREAM_ORDER + ["response.output_text.delta"] * len(deltas) + STREAM_END + ["response.completed"]
    assert [e.sequence_number for e in events] == list(range(len(events)))
    assert "".join(e.delta for e in deltas) == text and len(deltas) >= 2  # streamed as it is generated
    final = events[-1].response
    assert final.output_text == text and final.status == status and final.usage.output_tokens == len(ref)
    assert events[0].response.status == "in_progress" and events[0].response.id == final.id

    with client.responses.stream(model=MODEL, input=prompt, max_output_tokens=max_tokens, temperature=0) as stream:
        helper_text = "".join(e.delta for e in stream if e.type == "response.output_text.delta")
        assert stream.get_final_response().output_text == helper_text == text


def assert_responses_features(client: openai.OpenAI, http: str, api_key: str | None = None) -> None:
    """Instructions, a conversation of items, `text.format` (a JSON schema the output follows), logprobs, and
    the fields a server with no response store refuses: each a clear 400 naming the field."""
    class City(BaseModel):
        city: str

    # the client's parse: a strict JSON schema from the pydantic model in `text.format`, the output parsed back
    r = client.responses.parse(
        model=MODEL, instructions="Answer in JSON.", max_output_tokens=48, temperature=0, text_format=City,
        input=[{"role": "user", "content": [{"type": "input_text", "text": "Name a city in France."}]},
               {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "Paris."}]},
               {"role": "user", "content": "Another one, please."}])
    assert r.status == "completed" and isinstance(r.output_parsed, City) and r.output_parsed.city, r.output_text
    assert json.loads(r.output_text) == r.output_parsed.model_dump()  # the grammar held from the first token
    assert r.text.format.type == "json_schema" and r.instructions == "Answer in JSON."

    r = client.responses.create(model=MODEL, input="Say hi.", max_output_tokens=6, temperature=0, top_logprobs=2,
                                include=["message.output_text.logprobs"])
    entries = r.output[0].content[0].logprobs
    assert len(entries) == r.usage.output_tokens and all(len(e.top_logprobs) == 2 for e in entries)
    assert all(e.logprob <= e.top_logprobs[0].logprob + 1e-6 for e in entries)

    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    refused = [({"previous_response_id": "resp_1"}, "previous_response_id", "stores no responses"),
               ({"tools": [{"type": "web_search"}]}, "tools.0.type", "'function'"),
               ({"background": True}, "background", "not supported"),
               ({"input": [{"type": "reasoning", "summary": []}]}, "input", "not served"),
               ({"input": [{"type": "function_call_output", "call_id": "c"}]}, "input", "needs output"),
               ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]}, "input",
                "only text parts"),
               ({"max_output_tokens": 0}, "max_output_tokens", "greater than or equal to 1"),
               ({"return_token_ids": True}, "return_token_ids", "chat completions return them")]
    for fields, param, needle in refused:
        body = {"model": MODEL, "input": "hi", **fields}
        out = httpx.post(http + "/v1/responses", json=body, headers=headers, timeout=60)
        assert out.status_code == 400, (fields, out.text)
        error = out.json()["error"]
        assert error["param"].startswith(param) and needle in error["message"], (fields, error)
    out = httpx.post(http + "/v1/responses", json={"model": "nope", "input": "hi"}, headers=headers, timeout=60)
    assert out.status_code == 404 and out.json()["error"]["code"] == "model_not_found"
    with pytest.raises(openai.BadRequestError, match="stores no responses"):
        client.responses.create(model=MODEL, input="hi", previous_response_id="resp_1")


def assert_tokenizer_routes(http: str, api_key: str, tokenizer, prompt: str, chat_prompt: str,
                            chat_ids: list[int]) -> None:
    """`chat_ids`: the prompt ids chat completions build for `chat_prompt` as the user's message."""
    headers = {"Authorization": f"Bearer {api_key}"}

    def post(path: str, body: dict, status: int = 200, auth: bool = True) -> dict:
        out = httpx.post(http + path, json=body, headers=headers if auth else {}, timeout=60)
        assert out.status_code == status, (path, body, out.text)
        return out.json()

    context = httpx.get(http + "/v1/models", headers=headers, timeout=60).json()["data"][0]["max_model_len"]
    ids = list(tokenizer(prompt)["input_ids"])
    r = post("/tokenize", {"model": MODEL, "prompt": prompt, "return_token_strs": True})
    assert r["tokens"] == ids and r["count"] == len(ids) and r["token_strs"] == tokenizer.convert_ids_to_tokens(ids)
    assert 0 < r["max_model_len"] <= context
    r = post("/tokenize", {"messages": [{"role": "user", "content": chat_prompt}]})  # `model` is optional
    assert r["tokens"] == chat_ids and r["token_strs"] is None
    bare = post("/tokenize", {"messages": [{"role": "user", "content": chat_prompt}], "add_generation_prompt": False})
    assert chat_ids[:bare["count"]] == bare["tokens"] and bare["count"] < len(chat_ids)
    assert post("/detokenize", {"model": MODEL, "tokens": ids})["prompt"] == tokenizer.decode(ids)
    for path, body, status, needle in [
            ("/tokenize", {"prompt": "a", "messages": [{"role": "user", "content": "b"}]}, 400, "exactly one"),
            ("/tokenize", {}, 400, "exactly one"),
            ("/detokenize", {"tokens": [len(tokenizer) + 5]}, 400, "not a token id"),
            ("/detokenize", {"tokens": [-1]}, 400, "tokens.0"),
            ("/tokenize", {"model": "nope", "prompt": "a"}, 404, "does not exist")]:
        assert needle in post(path, body, status)["error"]["message"], (path, body)
    assert post("/tokenize", {"prompt": "a"}, 401, auth=False)["error"]["code"] == "invalid_api_key"
    from importlib.metadata import version

    assert httpx.get(http + "/version", timeout=60).json() == {"version": version("tandem")}


def assert_responses_tools(client: openai.OpenAI) -> None:
    """Function tools on /v1/responses: a required (and a named) tool choice gives `function_call` items whose
    arguments follow the schema (a grammar), streamed as whole items; the call and its output sent back as
    items give the prompt and the answer chat completions give for the same conversation."""
    tools = [{"type": "function", "name": "get_weather", "description": "The weather in a city.",
              "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"],
                             "additionalProperties": False}}]
    ask = [{"role": "user", "content": "What is the weather in Paris?"}]
    r = client.responses.create(model=MODEL, input=ask, tools=tools, tool_choice="required", max_output_tokens=48,
                                temperature=0, parallel_tool_calls=False)  # one call (the grammar ends after it)
    calls = [o for o in r.output if o.type == "function_call"]
    assert r.status == "completed" and len(calls) == 1 and calls[0].name == "get_weather", r.output
    assert set(json.loads(calls[0].arguments)) == {"city"} and r.tools[0].name == "get_weather"
    assert r.parallel_tool_calls is False
    events = list(client.responses.create(model=MODEL, input=ask, tools=tools, tool_choice="required",
                                          max_output_tokens=48, temperature=0, parallel_tool_calls=False, stream=True))
    done = [e for e in events if e.type == "response.function_call_arguments.done"]
    assert [e.arguments for e in done] == [c.arguments for c in calls]
    assert events[-1].type == "response.completed" and len(events[-1].response.output) == len(r.output)
    assert [e.sequence_number for e in events] == list(range(len(events)))
    named = client.responses.create(model=MODEL, input=ask, tools=tools, max_output_tokens=48, temperature=0,
                                    tool_choice={"type": "function", "name": "get_weather"})
    assert [(o.type, o.name) for o in named.output] == [("function_call", "get_weather")]
    assert set(json.loads(named.output[0].arguments)) == {"city"}

    call = calls[0]
    back = ask + [{"type": "function_call", "call_id": call.call_id, "name": call.name, "arguments": call.arguments},
                  {"type": "function_call_output", "call_id": call.call_id, "output": "Sunny, 21 C"}]
    answer = client.responses.create(model=MODEL, input=back, tools=tools, max_output_tokens=16, temperature=0)
    streamed = list(client.responses.create(model=MODEL, input=back, tools=tools, max_output_tokens=16, temperature=0,
                                            stream=True))
    assert [o.model_dump(exclude={"id", "call_id"}) for o in streamed[-1].response.output] == \
        [o.model_dump(exclude={"id", "call_id"}) for o in answer.output]
    deltas = [e.delta for e in streamed if e.type == "response.output_text.delta"]
    text = "".join(c.text for o in answer.output if o.type == "message" for c in o.content)
    assert "".join(deltas) == text and (len(deltas) >= 2 or not text)  # with auto, text streams as it comes
    chat = client.chat.completions.create(
        model=MODEL, max_tokens=16, temperature=0,
        tools=[{"type": "function", "function": {k: v for k, v in tools[0].items() if k != "type"}}],
        messages=ask + [{"role": "assistant", "content": None, "tool_calls": [
            {"id": call.call_id, "type": "function", "function": {"name": call.name, "arguments": call.arguments}}]},
            {"role": "tool", "tool_call_id": call.call_id, "content": "Sunny, 21 C"}])
    assert answer.usage.input_tokens == chat.usage.prompt_tokens
    message = chat.choices[0].message
    if message.tool_calls:  # the model called again: the same calls
        assert [(o.name, o.arguments) for o in answer.output if o.type == "function_call"] == \
            [(c.function.name, c.function.arguments) for c in message.tool_calls]
    else:
        assert answer.output_text == message.content


def assert_hosting_routes(http: str, api_key: str, chat_prompt: str, prompt: str, max_tokens: int) -> None:
    """vLLM's routes for hosts: `/ping` (GET and POST) needs no key, as `/health`; `/invocations` answers a chat
    body as chat completions and a completions body as completions (greedy: the same text, streamed too), needs
    the key and refuses a body that is neither."""
    headers = {"Authorization": f"Bearer {api_key}"}
    for method in ("GET", "POST"):
        out = httpx.request(method, http + "/ping", timeout=60)
        assert out.status_code == 200 and out.json() == {"status": "ok"}, (method, out.text)

    chat = {"model": MODEL, "messages": [{"role": "user", "content": chat_prompt}], "max_tokens": max_tokens,
            "temperature": 0}
    completion = {"model": MODEL, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0}
    texts = {}
    for body, route, text_of in [
            (chat, "/v1/chat/completions", lambda r: r["choices"][0]["message"]["content"]),
            (completion, "/v1/completions", lambda r: r["choices"][0]["text"])]:
        direct = httpx.post(http + route, json=body, headers=headers, timeout=120).json()
        invoked = httpx.post(http + "/invocations", json=body, headers=headers, timeout=120)
        assert invoked.status_code == 200, invoked.text
        assert invoked.json()["object"] == direct["object"] and text_of(invoked.json()) == text_of(direct)
        assert invoked.json()["usage"] == direct["usage"]
        texts[route] = text_of(direct)
    with httpx.stream("POST", http + "/invocations", json={**completion, "stream": True}, headers=headers,
                      timeout=120) as streamed:
        events = [json.loads(line[6:]) for line in streamed.iter_lines() if line.startswith("data: {")]
    assert "".join(e["choices"][0]["text"] for e in events if e["choices"]) == texts["/v1/completions"]
    neither = httpx.post(http + "/invocations", json={"model": MODEL, "input": "hi"}, headers=headers, timeout=60)
    assert neither.status_code == 400 and "neither" in neither.json()["error"]["message"]
    bad = httpx.post(http + "/invocations", json={**chat, "temperature": -1}, headers=headers, timeout=60)
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "temperature", bad.text
    for body in (chat, {"input": "neither"}):
        assert httpx.post(http + "/invocations", json=body, timeout=60).status_code == 401


def assert_anthropic_messages(http: str, api_key: str, chat_prompt: str, max_tokens: int) -> None:
    """Anthropic's Messages API through the real `anthropic` client (its key as `x-api-key`): the same greedy text,
    prompt and output tokens as chat completions for the same conversation, streamed (the client's stream helper)
    and not; a stop sequence met; a named tool's call and the round trip with its result; count_tokens; refusals as
    Anthropic's errors."""
    import anthropic

    greedy = {"temperature": 0}  # the client has no sampling arguments (Anthropic's newer models take none)

    client = anthropic.Anthropic(base_url=http, api_key=api_key, max_retries=0, timeout=300)
    chat = openai.OpenAI(base_url=http + "/v1", api_key=api_key, max_retries=0, timeout=300)
    messages = [{"role": "user", "content": chat_prompt}]
    expected = chat.chat.completions.create(model=MODEL, messages=[{"role": "system", "content": "Be brief."}, *messages],
                                            max_tokens=max_tokens, temperature=0)
    text = expected.choices[0].message.content
    answer = client.messages.create(model=MODEL, system="Be brief.", messages=messages, max_tokens=max_tokens,
                                    extra_body=greedy)
    assert [b.type for b in answer.content] == ["text"] and answer.content[0].text == text
    assert answer.usage.input_tokens == expected.usage.prompt_tokens
    assert answer.usage.output_tokens == expected.usage.completion_tokens
    assert answer.stop_reason == {"length": "max_tokens", "stop": "end_turn"}[expected.choices[0].finish_reason]
    assert client.messages.count_tokens(model=MODEL, system="Be brief.", messages=messages).input_tokens == \
        answer.usage.input_tokens
    with client.messages.stream(model=MODEL, system="Be brief.", messages=messages, max_tokens=max_tokens,
                                extra_body=greedy) as stream:
        deltas = list(stream.text_stream)
        final = stream.get_final_message()
    assert "".join(deltas) == text and len(deltas) >= 2 and [(b.type, b.text) for b in final.content] == [("text", text)]
    assert (final.stop_reason, final.usage.output_tokens) == (answer.stop_reason, answer.usage.output_tokens)

    words = text.split()
    stop = " " + words[len(words) // 2]  # met in the greedy text: the answer ends before it
    stopped = client.messages.create(model=MODEL, system="Be brief.", messages=messages, max_tokens=max_tokens,
                                     extra_body=greedy, stop_sequences=["\u2603", stop])
    assert (stopped.stop_reason, stopped.stop_sequence) == ("stop_sequence", stop)
    assert stopped.content[0].text == text[:text.index(stop)]
    with client.messages.stream(model=MODEL, system="Be brief.", messages=messages, max_tokens=max_tokens,
                                extra_body=greedy, stop_sequences=[stop]) as stream:
        assert stream.get_final_message().stop_sequence == stop

    tools = [{"name": "get_weather", "description": "The current weather in a city.",
              "input_schema": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}]
    ask = [{"role": "user", "content": "What is the weather in Paris?"}]
    called = client.messages.create(model=MODEL, messages=ask, tools=tools, max_tokens=48, extra_body=greedy,
                                    tool_choice={"type": "tool", "name": "get_weather"})
    assert [(b.type, b.name) for b in called.content] == [("tool_use", "get_weather")]
    assert set(called.content[0].input) == {"city"} and called.stop_reason == "tool_use"
    with client.messages.stream(model=MODEL, messages=ask, tools=tools, max_tokens=48, extra_body=greedy,
                                tool_choice={"type": "tool", "name": "get_weather"}) as stream:
        assert [b.input for b in stream.get_final_message().content] == [called.content[0].input]
    call = called.content[0]
    back = ask + [{"role": "assistant", "content": [{"type": "tool_use", "id": call.id, "name": call.name,
                                                     "input": call.input}]},
                  {"role": "user", "content": [{"type": "tool_result", "tool_use_id": call.id, "content": "Sunny"}]}]
    result = client.messages.create(model=MODEL, messages=back, tools=tools, max_tokens=16, extra_body=greedy)
    same = chat.chat.completions.create(
        model=MODEL, max_tokens=16, temperature=0,
        tools=[{"type": "function", "function": {"name": "get_weather", "description": tools[0]["description"],
                                                 "parameters": tools[0]["input_schema"]}}],
        messages=ask + [{"role": "assistant", "content": "", "tool_calls": [
            {"id": call.id, "type": "function", "function": {"name": call.name, "arguments": json.dumps(call.input)}}]},
            {"role": "tool", "tool_call_id": call.id, "content": "Sunny"}])
    assert result.usage.input_tokens == same.usage.prompt_tokens
    if not same.choices[0].message.tool_calls:
        assert "".join(b.text for b in result.content if b.type == "text") == same.choices[0].message.content

    for fields, error, needle in [
            ({"messages": [{"role": "user", "content": [{"type": "image", "source": {}}]}]}, anthropic.BadRequestError,
             "not served"),
            ({"model": "nope"}, anthropic.NotFoundError, "does not exist"),
            ({"extra_body": {"temperature": 3}}, anthropic.BadRequestError, "temperature")]:
        with pytest.raises(error, match=needle) as info:
            client.messages.create(**{"model": MODEL, "messages": messages, "max_tokens": 4, **fields})
        assert info.value.body["type"] == "error", info.value.body
    with pytest.raises(anthropic.AuthenticationError):
        anthropic.Anthropic(base_url=http, api_key="wrong", max_retries=0).messages.create(
            model=MODEL, messages=messages, max_tokens=4)
