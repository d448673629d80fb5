"""Tool calling's pure parts (`deployments/openai_tools.py`) and the request fields of structured outputs
(`deployments/openai_structured.py`): no model, no server (the served checks are in
`tests/structured_checks.py`, run by test_serving and test_vllm_serving)."""

from __future__ import annotations

import asyncio
import json

import jsonschema
import pytest

from cluster.core.errors import InvalidRequestError
from deployments import openai_tools
from deployments.openai_api import CompletionRequest, parse_request
from deployments.openai_chat import ChatCompletionRequest
from deployments.openai_responses_api import ResponsesRequest
from deployments.openai_body import ApiError

WEATHER = {"type": "function", "function": {"name": "get_weather", "description": "The weather in a city.",
                                            "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                                                           "required": ["city"]}}}
TIME = {"type": "function", "function": {"name": "get_time", "parameters": {"type": "object", "properties": {}}}}


def _chat(**fields) -> ChatCompletionRequest:
    body = {"model": "m", "messages": [{"role": "user", "content": "hi"}], **fields}
    return parse_request(json.dumps(body).encode(), ChatCompletionRequest)


def test_required_and_named_choices_are_grammars():
    required = _chat(tools=[WEATHER, TIME], tool_choice="required")
    assert required.tool_mode() == "required"
    schema = json.loads(required.structured().spec)
    jsonschema.validate([{"name": "get_weather", "parameters": {"city": "Oslo"}}], schema)
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate([{"name": "get_mood", "parameters": {}}], schema)
    single = json.loads(_chat(tools=[WEATHER], tool_choice="required", parallel_tool_calls=False).structured().spec)
    assert single["maxItems"] == 1
    named = _chat(tools=[WEATHER, TIME], tool_choice={"type": "function", "function": {"name": "get_weather"}})
    assert named.tool_mode() == "named:get_weather"
    assert json.loads(named.structured().spec) == WEATHER["function"]["parameters"]
    assert _chat(tools=[WEATHER]).tool_mode() == "auto" and _chat(tools=[WEATHER]).structured() is None
    assert _chat(tools=[WEATHER], tool_choice="none").tool_mode() is None


@pytest.mark.parametrize("fields,needle", [
    ({"tool_choice": "required"}, "needs tools"),
    ({"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "nope"}}}, "not among the tools"),
    ({"tools": [WEATHER], "tool_choice": "required", "response_format": {"type": "json_object"}}, "cannot be combined"),
    ({"response_format": {"type": "json_object"}, "structured_outputs": {"regex": "a+"}}, "one grammar at a time"),
    ({"structured_outputs": {"regex": "a+", "choice": ["a"]}}, "exactly one"),
    ({"guided_json": "{not json"}, "not valid JSON"),
])
def test_conflicting_or_unknown_asks_are_refused(fields, needle):
    with pytest.raises(InvalidRequestError, match=needle):
        _chat(**fields).structured()


RESPONSES_WEATHER = {"type": "function", **WEATHER["function"]}


@pytest.mark.parametrize("fields,needle", [
    ({"tools": [RESPONSES_WEATHER], "tool_choice": "required", "text": {"format": {"type": "json_object"}}},
     "cannot be combined with text.format"),
    ({"tools": [RESPONSES_WEATHER], "tool_choice": {"type": "function", "name": "get_weather"},
      "structured_outputs": {"regex": "a+"}}, "cannot be combined with text.format"),
    ({"text": {"format": {"type": "json_object"}}, "response_format": {"type": "json_object"}}, "one grammar at a time"),
])
def test_a_responses_request_asks_one_grammar(fields, needle):
    """The Responses API's form of the rule above (`openai_tools.one_grammar`); a tool choice's grammar or
    `text.format`'s alone is served."""
    body = {"model": "m", "input": "hi", **fields}
    with pytest.raises(InvalidRequestError, match=needle):
        parse_request(json.dumps(body).encode(), ResponsesRequest).structured()
    alone = {k: v for k, v in body.items() if k not in ("text", "structured_outputs", "response_format")}
    if "tools" in alone:
        assert parse_request(json.dumps(alone).encode(), ResponsesRequest).structured().kind == "json"
    assert parse_request(json.dumps({"model": "m", "input": "hi", "text": {"format": {"type": "json_object"}}}).encode(),
                         ResponsesRequest).structured().kind == "json_object"


def test_the_request_fields_become_one_grammar():
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}}
    rf = _chat(response_format={"type": "json_schema", "json_schema": {"name": "x", "schema": schema, "strict": True}})
    assert rf.structured().kind == "json" and json.loads(rf.structured().spec) == schema
    assert _chat(response_format={"type": "json_object"}).structured().kind == "json_object"
    assert _chat(response_format={"type": "text"}).structured() is None
    closed = _chat(structured_outputs={"json": schema, "disable_additional_properties": True,
                                       "disable_any_whitespace": True}).structured()
    assert json.loads(closed.spec)["additionalProperties"] is False and not closed.any_whitespace
    body = {"model": "m", "prompt": "x", "guided_choice": ["a", "b"]}
    assert parse_request(json.dumps(body).encode(), CompletionRequest).structured().kind == "choice"
    with pytest.raises(ApiError, match="json_schema"):
        _chat(response_format={"type": "json_schema"})


def test_tool_messages_in_a_template_without_tools(tokenizer):
    body = _chat(tools=[WEATHER], messages=[
        {"role": "user", "content": "Weather in Oslo?"},
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Oslo"}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "sunny, 12 C"}])
    messages, listed = openai_tools.template_messages([m.template_message() for m in body.messages], body.tools,
                                                      body.tool_mode(), tokenizer.chat_template)
    assert listed is None  # SmolLM2's template does not render tools: they are in the system prompt
    assert messages[0]["role"] == "system" and '"get_weather"' in messages[0]["content"]
    assert '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo"}}\n</tool_call>' in messages[2]["content"]
    assert messages[3] == {"role": "tool", "content": "<tool_response>\nsunny, 12 C\n</tool_response>"}
    text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert "<|im_start|>tool\n<tool_response>" in text
    plain, _ = openai_tools.template_messages([{"role": "user", "content": "x"}], body.tools, None, tokenizer.chat_template)
    assert plain == [{"role": "user", "content": "x"}]  # tool_choice none: no tools in the prompt


def test_parse_hermes_required_and_named():
    content, calls = openai_tools.parse('Let me check.\n<tool_call>\n{"name": "get_weather", "arguments": '
                                        '{"city": "Oslo"}}\n</tool_call>', "auto")
    assert content == "Let me check." and calls[0]["function"] == {"name": "get_weather", "arguments": '{"city": "Oslo"}'}
    assert calls[0]["id"].startswith("call_") and calls[0]["type"] == "function"
    assert openai_tools.parse("no call here", "auto") == ("no call here", [])
    assert openai_tools.parse("<tool_call>{broken</tool_call>", "auto")[1] == []
    _, calls = openai_tools.parse('[{"name": "get_time", "parameters": {}}, {"name": "get_weather", '
                                  '"parameters": {"city": "Rome"}}]', "required")
    assert [c["function"]["name"] for c in calls] == ["get_time", "get_weather"]
    assert openai_tools.parse('[{"name": "get_ti', "required") == ('[{"name": "get_ti', [])  # cut short
    assert openai_tools.parse('{"city": "Rome"}', "named:get_weather")[1][0]["function"]["arguments"] == '{"city": "Rome"}'


def _events(pieces: list[str], finish: str = "stop") -> list[str]:
    out = [f"data: {json.dumps({'choices': [{'index': 0, 'delta': {'role': 'assistant', 'content': ''}, 'finish_reason': None}]})}\n\n"]
    out += [f"data: {json.dumps({'choices': [{'index': 0, 'delta': {'content': p}, 'finish_reason': None, 'logprobs': None}]})}\n\n"
            for p in pieces]
    out.append(f"data: {json.dumps({'choices': [{'index': 0, 'delta': {}, 'finish_reason': finish}]})}\n\n")
    return out + ["data: [DONE]\n\n"]


def _run_stream(pieces: list[str], mode: str | None) -> tuple[str, list[dict], str]:
    async def source():
        for e in _events(pieces):
            yield e

    async def run():
        return [e async for e in openai_tools.stream(source(), mode)]

    content, calls, finish = "", [], None
    for event in asyncio.run(run()):
        if event.startswith("data: {"):
            for choice in json.loads(event[6:])["choices"]:
                content += choice["delta"].get("content") or ""
                calls += choice["delta"].get("tool_calls", [])
                finish = choice["finish_reason"] or finish
    return content, calls, finish


def test_streamed_tool_calls_come_whole_before_the_finish():
    content, calls, finish = _run_stream(["Sure. <tool", '_call>{"name": "get_time", ', '"arguments": {}}</tool_call>'], "auto")
    assert content == "Sure. " and finish == "tool_calls"
    assert calls[0]["index"] == 0 and calls[0]["function"] == {"name": "get_time", "arguments": "{}"}
    assert _run_stream(["a <tool", "bar> b"], "auto") == ("a <toolbar> b", [], "stop")  # held back, then sent
    content, calls, finish = _run_stream(['[{"name": "get_time", ', '"parameters": {}}]'], "required")
    assert content == "" and calls[0]["function"]["name"] == "get_time" and finish == "tool_calls"
    assert _run_stream(["hello"], None) == ("hello", [], "stop")


def test_a_streamed_choice_keeps_the_token_ids_of_held_back_text():
    """With `return_token_ids`, each chunk's ids go out as they come, also where its text is held back (a call may
    start there): the ids of the whole stream are the output's."""
    pieces = [("Sure. <tool", [1, 2]), ('_call>{"name": "get_time", ', [3, 4]), ('"arguments": {}}</tool_call>', [5])]
    events = [f"data: {json.dumps({'choices': [{'index': 0, 'delta': {'content': p}, 'finish_reason': None, 'logprobs': None, 'token_ids': ids}]})}\n\n"
              for p, ids in pieces]
    events.append(f"data: {json.dumps({'choices': [{'index': 0, 'delta': {}, 'finish_reason': 'stop', 'token_ids': []}]})}\n\n")

    async def run():
        async def source():
            for e in events:
                yield e
        return [e async for e in openai_tools.stream(source(), "auto")]

    ids = [i for e in asyncio.run(run()) if e.startswith("data: {")
           for c in json.loads(e[6:])["choices"] for i in c.get("token_ids", [])]
    assert ids == [1, 2, 3, 4, 5]
