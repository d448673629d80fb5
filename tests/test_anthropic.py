"""Anthropic's Messages API's pure parts: the request as the chat completions request it is
(`deployments/anthropic_api.py`) and the chat answer rewritten as Anthropic's (`deployments/anthropic_events.py`).
No model, no server: the served checks (the real `anthropic` client, greedy text = chat's) are in
`tests/openai_checks.py`, run by test_serving and test_vllm_serving."""

from __future__ import annotations

import asyncio
import json

import pytest
from fastapi.responses import JSONResponse

from deployments.anthropic_api import CountTokensRequest, MessagesRequest
from deployments.anthropic_events import anthropic_error, message_events, stop_reason, to_message
from deployments.openai_api import parse_request
from deployments.openai_body import ApiError, error_response

WEATHER = {"name": "get_weather", "description": "The weather in a city.",
           "input_schema": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}


def _request(**fields) -> MessagesRequest:
    body = {"model": "m", "max_tokens": 8, "messages": [{"role": "user", "content": "hi"}], **fields}
    return parse_request(json.dumps(body).encode(), MessagesRequest)


def test_a_messages_request_is_a_chat_request():
    request = _request(
        system=[{"type": "text", "text": "Be brief."}, {"type": "text", "text": "Be kind."}],
        messages=[{"role": "user", "content": [{"type": "text", "text": "Weather in Oslo?"}]},
                  {"role": "assistant", "content": [
                      {"type": "thinking", "thinking": "...", "signature": "s"},
                      {"type": "text", "text": "Let me look."},
                      {"type": "tool_use", "id": "toolu_1", "name": "get_weather", "input": {"city": "Oslo"}}]},
                  {"role": "user", "content": [
                      {"type": "tool_result", "tool_use_id": "toolu_1", "content": [{"type": "text", "text": "Sunny"}]},
                      {"type": "text", "text": "Thanks!"}]}],
        tools=[WEATHER], tool_choice={"type": "any", "disable_parallel_tool_use": True},
        stop_sequences=["\n\n"], temperature=0.5, top_k=4, stream=True)
    body = json.loads(request.chat_body())
    assert body["messages"] == [
        {"role": "system", "content": "Be brief.\n\nBe kind."},
        {"role": "user", "content": "Weather in Oslo?"},
        {"role": "assistant", "content": "Let me look.", "tool_calls": [
            {"id": "toolu_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Oslo"}'}}]},
        {"role": "tool", "tool_call_id": "toolu_1", "content": "Sunny"},
        {"role": "user", "content": "Thanks!"}]
    assert body["tools"] == [{"type": "function", "function": {"name": "get_weather", "description": WEATHER["description"],
                                                               "parameters": WEATHER["input_schema"]}}]
    assert body["tool_choice"] == "required" and body["parallel_tool_calls"] is False
    assert body["stop"] == ["\n\n"] and body["temperature"] == 0.5 and body["top_k"] == 4 and body["max_tokens"] == 8
    assert body["stream"] and body["stream_options"] == {"include_usage": True} and body["return_token_ids"]
    named = json.loads(_request(tools=[WEATHER], tool_choice={"type": "tool", "name": "get_weather"}).chat_body())
    assert named["tool_choice"] == {"type": "function", "function": {"name": "get_weather"}}
    assert "tools" not in json.loads(_request().chat_body()) and "return_token_ids" in json.loads(_request().chat_body())
    count = parse_request(json.dumps({"model": "m", "messages": [{"role": "user", "content": "hi"}]}).encode(),
                          CountTokensRequest)
    assert json.loads(count.chat_conversation()) == {"model": "m", "messages": [{"role": "user", "content": "hi"}]}


@pytest.mark.parametrize("fields,needle", [
    ({"messages": [{"role": "user", "content": [{"type": "image", "source": {}}]}]}, "not served"),
    ({"tools": [{"type": "web_search_20250305", "name": "web_search"}]}, "built-in tools"),
    ({"tools": [WEATHER], "tool_choice": {"type": "tool"}}, "needs the tool's name"),
    ({"messages": [{"role": "assistant", "content": [{"type": "tool_use", "id": "t"}]}]}, "needs name, input"),
    ({"stop_sequences": [""]}, "must not be empty"),
    ({"max_tokens": 0}, "max_tokens"),
])
def test_what_is_not_served_is_refused(fields, needle):
    with pytest.raises(ApiError, match=needle):
        _request(**fields)


class _Tokenizer:
    """Decodes ids as their letters: ids are what the test names them."""

    def decode(self, ids, skip_special_tokens=True):
        return "".join(chr(i) for i in ids)


def _chat(content, calls=None, finish="stop", token_ids=None) -> dict:
    message = {"role": "assistant", "content": content, **({"tool_calls": calls} if calls else {})}
    return {"id": "chatcmpl-abc", "model": "m", "usage": {"prompt_tokens": 5, "completion_tokens": 3},
            "choices": [{"index": 0, "message": message, "finish_reason": finish,
                         **({"token_ids": token_ids} if token_ids is not None else {})}]}


def _call(arguments: str) -> dict:
    return {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": arguments}}


def test_a_chat_answer_as_a_message():
    text = to_message(_chat("Hello"), None, _Tokenizer())
    assert text == {"id": "msg_abc", "type": "message", "role": "assistant", "content": [{"type": "text", "text": "Hello"}],
                    "model": "m", "stop_reason": "end_turn", "stop_sequence": None,
                    "usage": {"input_tokens": 5, "output_tokens": 3}}
    called = to_message(_chat("Sure.", [_call('{"city": "Oslo"}')], "tool_calls"), None, _Tokenizer())
    assert called["content"] == [{"type": "text", "text": "Sure."},
                                 {"type": "tool_use", "id": "call_1", "name": "get_weather", "input": {"city": "Oslo"}}]
    assert called["stop_reason"] == "tool_use"
    cut = to_message(_chat(None, [_call('{"city": "Os')], "length"), None, _Tokenizer())  # a named call cut short
    assert cut["content"] == [{"type": "text", "text": '{"city": "Os'}] and cut["stop_reason"] == "max_tokens"


def test_the_stop_reason_names_the_stop_sequence_met_first():
    ids = [ord(c) for c in "ab. cd\n\nef"]
    assert stop_reason("stop", False, ids, ["\n\n", ". "], _Tokenizer()) == ("stop_sequence", ". ")
    assert stop_reason("stop", False, ids, ["zz"], _Tokenizer()) == ("end_turn", None)  # ended by EOS
    assert stop_reason("stop", False, ids, None, _Tokenizer()) == ("end_turn", None)
    assert stop_reason("length", False, ids, [". "], _Tokenizer()) == ("max_tokens", None)
    assert stop_reason("stop", True, [], None, _Tokenizer()) == ("tool_use", None)  # a named choice's call


def _sse(*chunks) -> list[str]:
    out = []
    for choices, extra in chunks:
        out.append("data: " + json.dumps({"id": "chatcmpl-abc", "model": "m", "choices": choices, **extra}) + "\n\n")
    return out + ["data: [DONE]\n\n"]


def _events(chat_events: list[str], stops=None) -> list[tuple[str, dict]]:
    async def source():
        for event in chat_events:
            yield event

    async def run():
        return [e async for e in message_events(source(), stops, _Tokenizer(), 5)]

    out = []
    for raw in asyncio.run(run()):
        kind, data = raw.split("\n")[:2]
        out.append((kind.removeprefix("event: "), json.loads(data.removeprefix("data: "))))
        assert out[-1][1]["type"] == out[-1][0]
    return out


def test_a_chat_stream_as_anthropic_events():
    def delta(text=None, finish=None, calls=None, ids=()):
        d = {} if text is None else {"content": text}
        if calls:
            d["tool_calls"] = calls
        return ([{"index": 0, "delta": d, "finish_reason": finish, "token_ids": list(ids)}], {})

    usage = ([], {"usage": {"prompt_tokens": 5, "completion_tokens": 4}})
    events = _events(_sse(delta(""), delta("Hel", ids=[72, 101, 108]), delta("lo", ids=[108, 111]),
                          delta(finish="stop"), usage))
    assert [k for k, _ in events] == ["message_start", "content_block_start", "content_block_delta",
                                      "content_block_delta", "content_block_stop", "message_delta", "message_stop"]
    assert events[0][1]["message"]["usage"] == {"input_tokens": 5, "output_tokens": 0}
    assert "".join(d["delta"]["text"] for k, d in events if k == "content_block_delta") == "Hello"
    assert events[5][1]["delta"] == {"stop_reason": "end_turn", "stop_sequence": None}
    assert events[5][1]["usage"] == {"output_tokens": 4}
    stopped = _events(_sse(delta("He", ids=[72, 101]), delta(finish="stop", ids=[108]), usage), stops=["l"])
    assert stopped[-2][1]["delta"] == {"stop_reason": "stop_sequence", "stop_sequence": "l"}

    call = {"index": 0, **_call('{"city": "Oslo"}')}
    tools = _events(_sse(delta("Sure."), delta(calls=[call]), delta(finish="tool_calls"), usage))
    assert [(k, d.get("index")) for k, d in tools] == [
        ("message_start", None), ("content_block_start", 0), ("content_block_delta", 0), ("content_block_stop", 0),
        ("content_block_start", 1), ("content_block_delta", 1), ("content_block_stop", 1), ("message_delta", None),
        ("message_stop", None)]
    assert tools[4][1]["content_block"] == {"type": "tool_use", "id": "call_1", "name": "get_weather", "input": {}}
    assert json.loads(tools[5][1]["delta"]["partial_json"]) == {"city": "Oslo"}
    assert tools[7][1]["delta"]["stop_reason"] == "tool_use"

    failed = _events(_sse(delta("Hi")) [:1] + ['data: {"error": {"message": "router failed", "type": "unavailable"}}\n\n'])
    assert [k for k, _ in failed] == ["message_start", "content_block_start", "content_block_delta", "error"]
    assert failed[-1][1]["error"] == {"type": "unavailable", "message": "router failed"}


def test_errors_are_anthropic_error_bodies():
    out = anthropic_error(error_response(404, "the model `x` does not exist"))
    assert out.status_code == 404 and json.loads(out.body) == {
        "type": "error", "error": {"type": "not_found_error", "message": "the model `x` does not exist"}}
    busy = error_response(503, "queue full")
    busy.headers["Retry-After"] = "2"
    out = anthropic_error(busy)
    assert json.loads(out.body)["error"]["type"] == "overloaded_error" and out.headers["retry-after"] == "2"
    assert json.loads(anthropic_error(JSONResponse(status_code=500, content={"error": {"message": "x"}})).body)[
        "error"]["type"] == "api_error"
