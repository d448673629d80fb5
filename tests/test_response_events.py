"""The Responses API's event stream with tools in play (deployments/openai_response_events.py), from a session's
chunks: with `auto` the text streams up to where a call may start and the calls come whole at the end; the
streamed text is the final message's; a required choice's output is all calls. (The routes themselves run
against a real application in test_serving / test_vllm_serving.)"""

from __future__ import annotations

import asyncio
import json

import pytest

from cluster.core.logprobs import TokenLogprob
from deployments.chunks import ErrorChunk, FinishChunk, TokensChunk
from deployments.openai_response_events import ResponseBuilder, collect_response, response_events
from deployments.openai_responses_api import ResponsesRequest

STATS = {"drafted": 0, "accepted": 0, "acceptance_rate": 0.0, "mean_accepted_length": 1.0, "rounds": 1,
         "accepted_per_position": [], "drafted_per_position": [], "gamma_counts": []}
TOOLS = [{"type": "function", "name": "f", "parameters": {"type": "object"}}]
CALL = '<tool_call>\n{"name": "f", "arguments": {"x": 1}}\n</tool_call>'


def _run(pieces: list[str], tool_choice: str = "auto", error: bool = False) -> tuple[list[dict], dict]:
    """(the stream's events, the non-streamed response) for a session whose text comes in `pieces`."""
    body = ResponsesRequest.model_validate({"model": "m", "input": "hi", "tools": TOOLS, "tool_choice": tool_choice})

    async def chunks():
        for piece in pieces:
            yield 0, TokensChunk([1], piece, STATS)
        yield 0, ErrorChunk("timeout", "late") if error else FinishChunk("stop", "", STATS, 3, len(pieces))

    async def main():
        events = [e async for e in response_events(chunks(), ResponseBuilder(body, 3, None))]
        return events, await collect_response(chunks(), ResponseBuilder(body, 3, None))

    events, whole = asyncio.run(main())
    return [json.loads(e.split("data: ", 1)[1]) for e in events], whole


def _deltas(events: list[dict]) -> list[str]:
    return [e["delta"] for e in events if e["type"] == "response.output_text.delta"]


@pytest.mark.parametrize("pieces,text,calls", [
    (["Let me ", "check. <tool", "_call>", CALL.removeprefix("<tool_call>")], "Let me check. ", 1),
    (["No ", "call ", "here <tool"], "No call here <tool", 0),  # a possible start that never became a call
    ([CALL], "", 1),
    ([], "", 0),
], ids=["text-then-call", "text-only", "call-only", "empty"])
def test_auto_streams_text_up_to_a_call_and_the_calls_whole(pieces, text, calls):
    events, whole = _run(pieces)
    assert [e["sequence_number"] for e in events] == list(range(len(events)))
    final = events[-1]["response"]
    assert events[-1]["type"] == "response.completed"
    strip = [{k: v for k, v in o.items() if k not in ("id", "call_id")} for o in final["output"]]
    assert strip == [{k: v for k, v in o.items() if k not in ("id", "call_id")} for o in whole["output"]]
    assert "".join(_deltas(events)) == text
    messages = [o for o in final["output"] if o["type"] == "message"]
    assert [c["text"] for m in messages for c in m["content"]] == ([text] if text or not calls else [])
    called = [o for o in final["output"] if o["type"] == "function_call"]
    assert len(called) == calls and all(json.loads(c["arguments"]) == {"x": 1} for c in called)
    if text and calls:  # the text went out before the call was complete, piece by piece
        assert len(_deltas(events)) >= 2
        first_call = next(i for i, e in enumerate(events) if e["type"] == "response.function_call_arguments.done")
        assert all(i < first_call for i, e in enumerate(events) if e["type"] == "response.output_text.delta")
    added = [e["output_index"] for e in events if e["type"] == "response.output_item.added"]
    done = [e["output_index"] for e in events if e["type"] == "response.output_item.done"]
    assert added == done == list(range(len(final["output"])))


def test_a_required_choice_is_all_calls_and_an_error_is_an_error_event():
    events, whole = _run(['[{"name": "f", "parameters": {"x": 1}}]'], tool_choice="required")
    assert not _deltas(events) and [o["type"] for o in whole["output"]] == ["function_call"]
    events, whole = _run(["partial "], error=True)
    assert events[-1]["type"] == "error" and events[-1]["error"]["type"] == "timeout"
    assert isinstance(whole, ErrorChunk)


def test_without_tools_each_delta_carries_the_logprobs_of_the_text_it_completes(tokenizer):
    """A token whose text is held back (`settled` behind) has its logprob sent with the delta that completes its
    text, the rest with the last text; all of them, in order, are the final part's."""
    body = ResponsesRequest.model_validate({"model": "m", "input": "hi", "top_logprobs": 1,
                                            "include": ["message.output_text.logprobs"]})
    lps = [TokenLogprob(t, -0.5 * (k + 1), ((t, -0.1),)) for k, t in enumerate((100, 200, 300))]
    pieces = [TokensChunk([100], "a", STATS, lps[:1], settled=0),  # its text held back (an incomplete character)
              TokensChunk([200], "b", STATS, lps[1:2], settled=2),
              TokensChunk([300], "", STATS, lps[2:], settled=2)]

    async def chunks():
        for piece in pieces:
            yield 0, piece
        yield 0, FinishChunk("stop", "c", STATS, 3, 3)

    async def main():
        return [e async for e in response_events(chunks(), ResponseBuilder(body, 3, tokenizer))]

    events = [json.loads(e.split("data: ", 1)[1]) for e in asyncio.run(main())]
    deltas = [e for e in events if e["type"] == "response.output_text.delta"]
    assert [(d["delta"], len(d["logprobs"])) for d in deltas] == [("a", 0), ("b", 2), ("c", 1)]
    final = events[-1]["response"]["output"][0]["content"][0]
    assert [e for d in deltas for e in d["logprobs"]] == final["logprobs"] and final["text"] == "abc"
    assert [e["logprob"] for e in final["logprobs"]] == [-0.5, -1.0, -1.5]
