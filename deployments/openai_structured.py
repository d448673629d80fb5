"""Structured outputs on the OpenAI-compatible API: the request fields that ask for a grammar, as OpenAI
(`response_format`) and vLLM (`structured_outputs`, and the `guided_*` names of vLLM before 0.11) spell
them, and how they become one `cluster.core.grammar.StructuredOutputs`.

Tool calling builds on it (`deployments/openai_tools.py`): a required or named tool choice is a JSON
schema the output must follow.
"""

from __future__ import annotations

import json
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from cluster.core.errors import InvalidRequestError
from cluster.core.grammar import MAX_SPEC_CHARS, StructuredOutputs

MAX_CHOICES = 256


class JsonSchemaFormat(BaseModel):
    """OpenAI's `response_format.json_schema`."""

    model_config = ConfigDict(extra="allow", populate_by_name=True)

    name: str = Field("response", max_length=64, description="The schema's name.")
    description: str | None = Field(None, description="What the response is for (not shown to the model).")
    schema_: dict[str, Any] | bool = Field(True, alias="schema", description="The JSON schema the output follows (default: any JSON value).")
    strict: bool | None = Field(None, description="Accepted: the output always follows the schema here (a grammar masks every token).")


class ResponseFormat(BaseModel):
    """OpenAI's `response_format`: `text` (the default), `json_object` (any JSON object) or `json_schema`."""

    model_config = ConfigDict(extra="allow")

    type: Literal["text", "json_object", "json_schema"] = Field(description="`text`, `json_object` or `json_schema` (`structural_tag` is not served).")
    json_schema: JsonSchemaFormat | None = Field(None, description="With `json_schema`: the schema.")

    @model_validator(mode="after")
    def _schema_given(self) -> "ResponseFormat":
        if self.type == "json_schema" and self.json_schema is None:
            raise ValueError("type json_schema needs the json_schema field")
        return self


class StructuredOutputsBody(BaseModel):
    """vLLM's `structured_outputs` (one constraint at a time)."""

    model_config = ConfigDict(extra="forbid", populate_by_name=True)

    json_: dict[str, Any] | bool | str | None = Field(None, alias="json", description="A JSON schema (an object, or its JSON text).")
    regex: str | None = Field(None, max_length=MAX_SPEC_CHARS, description="A regular expression the whole output matches.")
    choice: list[str] | None = Field(None, min_length=1, max_length=MAX_CHOICES, description="The output is exactly one of these strings.")
    grammar: str | None = Field(None, max_length=MAX_SPEC_CHARS, description="An EBNF grammar (xgrammar's dialect, GBNF-like; `root` is the start rule).")
    json_object: bool | None = Field(None, description="Any JSON object.")
    disable_any_whitespace: bool = Field(False, description="JSON without free whitespace (one space after `:` and `,`).")
    disable_additional_properties: bool = Field(False, description="Objects of the schema take no properties beyond those it names.")
    whitespace_pattern: None = Field(None, description="Not supported (nor by vLLM's xgrammar backend).")
    structural_tag: None = Field(None, description="Not supported.")


def _no_additional_properties(schema: Any) -> Any:
    """The schema with `additionalProperties: false` on every object that does not say (vLLM's option)."""
    if isinstance(schema, list):
        return [_no_additional_properties(s) for s in schema]
    if not isinstance(schema, dict):
        return schema
    out = {k: _no_additional_properties(v) for k, v in schema.items()}
    if out.get("type") == "object" or "properties" in out:
        out.setdefault("additionalProperties", False)
    return out


def _schema(value: dict | bool | str, param: str) -> dict | bool:
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except ValueError as e:
            raise InvalidRequestError(f"{param}: the JSON schema is not valid JSON: {e}") from None
    if not isinstance(value, (dict, bool)):
        raise InvalidRequestError(f"{param}: a JSON schema is an object (or true / false)")
    return value


def of_body(body: StructuredOutputsBody, param: str = "structured_outputs") -> StructuredOutputs:
    given = [name for name, on in (("json", body.json_ is not None), ("regex", body.regex is not None),
                                   ("choice", body.choice is not None), ("grammar", body.grammar is not None),
                                   ("json_object", bool(body.json_object)))
             if on]
    if len(given) != 1:
        raise InvalidRequestError(f"{param}: give exactly one of json, regex, choice, grammar, json_object"
                                  f"{' (got ' + ', '.join(given) + ')' if given else ''}")
    ws = not body.disable_any_whitespace
    if body.json_ is not None:
        schema = _schema(body.json_, f"{param}.json")
        if body.disable_additional_properties:
            schema = _no_additional_properties(schema)
        return StructuredOutputs.of_schema(schema, any_whitespace=ws)
    if body.choice is not None:
        if not all(body.choice):
            raise InvalidRequestError(f"{param}.choice: the choices must be non-empty strings")
        return StructuredOutputs.of_choice(body.choice)
    if body.json_object:
        return StructuredOutputs(kind="json_object", any_whitespace=ws)
    kind = "regex" if body.regex is not None else "grammar"
    return StructuredOutputs(kind=kind, spec=body.regex if kind == "regex" else body.grammar)


class StructuredFields(BaseModel):
    """The request fields that ask for a grammar; at most one of them per request."""

    response_format: ResponseFormat | None = Field(None, description="OpenAI's: `{'type': 'json_object'}` or `{'type': 'json_schema', 'json_schema': {'name': ..., 'schema': {...}}}`; the output follows it (served with speculation).")
    structured_outputs: StructuredOutputsBody | None = Field(None, description="vLLM's structured outputs: one of json, regex, choice, grammar, json_object (served with speculation, on both backends).")
    guided_json: dict[str, Any] | bool | str | None = Field(None, description="vLLM's earlier name of structured_outputs.json.")
    guided_regex: str | None = Field(None, max_length=MAX_SPEC_CHARS, description="vLLM's earlier name of structured_outputs.regex.")
    guided_choice: list[str] | None = Field(None, min_length=1, max_length=MAX_CHOICES, description="vLLM's earlier name of structured_outputs.choice.")
    guided_grammar: str | None = Field(None, max_length=MAX_SPEC_CHARS, description="vLLM's earlier name of structured_outputs.grammar.")
    guided_decoding_backend: str | None = Field(None, description="Accepted and ignored: the backend is xgrammar.")

    def structured(self) -> StructuredOutputs | None:
        """The request's grammar, or None; InvalidRequestError where two fields ask for one."""
        asked: list[tuple[str, StructuredOutputs]] = []
        rf = self.response_format
        if rf is not None and rf.type == "json_object":
            asked.append(("response_format", StructuredOutputs(kind="json_object")))
        elif rf is not None and rf.type == "json_schema":
            asked.append(("response_format", StructuredOutputs.of_schema(
                _schema(rf.json_schema.schema_, "response_format.json_schema.schema"))))
        if self.structured_outputs is not None:
            asked.append(("structured_outputs", of_body(self.structured_outputs)))
        for name in ("guided_json", "guided_regex", "guided_choice", "guided_grammar"):
            value = getattr(self, name)
            if value is not None:
                key = name.removeprefix("guided_")
                asked.append((name, of_body(StructuredOutputsBody(**{key: value}), name)))
        if len(asked) > 1:
            raise InvalidRequestError(f"{', '.join(n for n, _ in asked)}: ask for one grammar at a time")
        return asked[0][1] if asked else None
