"""Structured outputs and tool calls through a served application with the real `openai` client, shared by
test_serving (torch engine) and test_vllm_serving (vLLM backend), each on the server it already runs.

Greedy output under a grammar is the same with speculation on and off (`num_speculative_tokens: 0`), and
speculation does run (drafted > 0); every finished output parses and follows its schema, greedy and sampled.
"""

from __future__ import annotations

import json
import re
from typing import Literal

import jsonschema
import openai
import pytest
from pydantic import BaseModel

WEATHER = {"type": "function", "function": {"name": "get_weather", "description": "Current weather in a city.",
                                            "parameters": {"type": "object", "properties": {
                                                "city": {"type": "string"},
                                                "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]}},
                                                "required": ["city", "unit"]}}}
TIME = {"type": "function", "function": {"name": "get_time", "description": "The time in a timezone.",
                                         "parameters": {"type": "object", "properties": {"tz": {"type": "string"}},
                                                        "required": ["tz"]}}}


class Capital(BaseModel):
    country: str
    capital: str
    population_millions: int
    continent: Literal["Europe", "Asia", "Africa", "America", "Oceania"]


def _ids(choice) -> list[int]:
    return choice.model_extra["token_ids"]


def assert_structured_outputs(client: openai.OpenAI, model: str) -> None:
    ask = [{"role": "user", "content": "Tell me about France as JSON."}]
    # the openai client's own structured-output path: a pydantic model as the response format
    parsed = client.chat.completions.parse(model=model, messages=ask, response_format=Capital, max_tokens=96,
                                           temperature=0, extra_body={"return_token_ids": True})
    assert isinstance(parsed.choices[0].message.parsed, Capital), parsed.choices[0].message.content
    assert parsed.model_extra["speculation"]["drafted"] > 0
    # the same with speculation off: the same tokens
    plain = client.chat.completions.parse(model=model, messages=ask, response_format=Capital, max_tokens=96,
                                          temperature=0, extra_body={"return_token_ids": True,
                                                                     "num_speculative_tokens": 0})
    assert _ids(plain.choices[0]) == _ids(parsed.choices[0])
    assert plain.model_extra["speculation"]["drafted"] == 0

    grammars = [({"choice": ["positive", "negative", "neutral"]}, lambda t: t in ("positive", "negative", "neutral")),
                ({"regex": r"[A-Z][a-z]+, [0-9]{4}"}, lambda t: re.fullmatch(r"[A-Z][a-z]+, [0-9]{4}", t)),
                ({"json": {"type": "object", "properties": {"items": {"type": "array", "items": {"type": "integer"},
                                                                      "maxItems": 4}},
                           "required": ["items"]}, "disable_any_whitespace": True},
                 lambda t: jsonschema.validate(json.loads(t), {"required": ["items"]}) or True)]
    for so, valid in grammars:
        outs = []
        for speculative in (None, 0):
            r = client.completions.create(model=model, prompt="Review: the film was great. Sentiment and details:",
                                          max_tokens=40, temperature=0,
                                          extra_body={"structured_outputs": so, "return_token_ids": True,
                                                      "num_speculative_tokens": speculative})
            assert r.choices[0].finish_reason == "stop" and valid(r.choices[0].text), (so, r.choices[0].text)
            outs.append(_ids(r.choices[0]))
        assert outs[0] == outs[1], so
    # sampled: JSON mode, several seeds and n; every finished choice is a JSON object
    r = client.chat.completions.create(model=model, messages=[{"role": "user", "content": "A JSON object about dogs."}],
                                       response_format={"type": "json_object"}, max_tokens=64, temperature=0.8,
                                       n=3, seed=5)
    finished = [c for c in r.choices if c.finish_reason == "stop"]
    for c in finished:
        assert isinstance(json.loads(c.message.content), dict), c.message.content
    # a grammar xgrammar cannot compile is a 400 naming it
    with pytest.raises(openai.BadRequestError, match="cannot be compiled"):
        client.completions.create(model=model, prompt="x", max_tokens=4, extra_body={"structured_outputs": {"regex": "(a"}})


def assert_tool_calls(client: openai.OpenAI, model: str) -> None:
    ask = [{"role": "user", "content": "What is the weather in Paris?"}]
    r = client.chat.completions.create(model=model, messages=ask, tools=[WEATHER, TIME], tool_choice="required",
                                       max_tokens=96, temperature=0)
    choice = r.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.tool_calls, choice.message
    for call in choice.message.tool_calls:
        tool = {"get_weather": WEATHER, "get_time": TIME}[call.function.name]
        jsonschema.validate(json.loads(call.function.arguments), tool["function"]["parameters"])
    named = client.chat.completions.create(model=model, messages=ask, tools=[WEATHER, TIME], max_tokens=64, temperature=0,
                                           tool_choice={"type": "function", "function": {"name": "get_weather"}})
    call = named.choices[0].message.tool_calls[0]
    assert call.function.name == "get_weather" and named.choices[0].message.content is None
    jsonschema.validate(json.loads(call.function.arguments), WEATHER["function"]["parameters"])
    # streamed: the call arrives as deltas the client accumulates (one whole call per delta here)
    calls: dict[int, dict] = {}
    finish = None
    for chunk in client.chat.completions.create(model=model, messages=ask, tools=[WEATHER, TIME], tool_choice="required",
                                                max_tokens=96, temperature=0, stream=True):
        for c in chunk.choices:
            for d in c.delta.tool_calls or []:
                entry = calls.setdefault(d.index, {"name": "", "arguments": ""})
                entry["name"] += d.function.name or ""
                entry["arguments"] += d.function.arguments or ""
            finish = c.finish_reason or finish
    assert finish == "tool_calls"
    assert [(c["name"], c["arguments"]) for c in calls.values()] == [(x.function.name, x.function.arguments)
                                                                     for x in choice.message.tool_calls]
    # the result goes back in the conversation: the assistant's call, then the tool's answer
    follow = client.chat.completions.create(model=model, max_tokens=24, temperature=0, tools=[WEATHER], messages=[
        *ask, {"role": "assistant", "content": None, "tool_calls": [call.model_dump()]},
        {"role": "tool", "tool_call_id": call.id, "content": '{"temperature": 18, "sky": "clear"}'}])
    assert follow.choices[0].message.content or follow.choices[0].message.tool_calls
    assert follow.usage.prompt_tokens > r.usage.prompt_tokens  # the call and its result are in the prompt
