"""Reading one raw request body of the OpenAI-compatible HTTP API, and its OpenAI-style error body.

The body is read with a size bound (413) and checked for nesting depth and unencodable strings before
any model sees it (`deployments/openai_api.py` then validates it into a request)."""

from __future__ import annotations

import json
from typing import Any

from fastapi.responses import JSONResponse
from pydantic import BaseModel, Field

from protos import MAX_REQUEST_BYTES

MAX_JSON_DEPTH = 64  # a chat request with content parts is 5 deep


class ErrorBody(BaseModel):
    message: str = Field(description="What is wrong, in one line.")
    type: str = Field(description="`invalid_request_error` for a bad request, `server_error` otherwise.")
    param: str | None = Field(description="The request field at fault, when one is.")
    code: str | None = Field(description="A machine-readable code, when there is one (`invalid_api_key`, `model_not_found`, `unsupported_parameter`, `request_too_large`).")


class ErrorResponse(BaseModel):
    error: ErrorBody


class ApiError(Exception):
    """A request refused with an OpenAI-style error body."""

    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None,
                 type_: str = "invalid_request_error"):
        super().__init__(message)
        self.status, self.message, self.param, self.code, self.type = status, message, param, code, type_

    def response(self) -> JSONResponse:
        return error_response(self.status, self.message, self.param, self.code, self.type)


def error_response(status: int, message: str, param: str | None = None, code: str | None = None,
                   type_: str = "invalid_request_error") -> JSONResponse:
    body = ErrorResponse(error=ErrorBody(message=message, type=type_, param=param, code=code))
    return JSONResponse(status_code=status, content=body.model_dump())


# ---- reading the body -------------------------------------------------------------------------------


def _too_large(size: str) -> ApiError:
    return ApiError(413, f"the request body is {size} bytes; this server accepts at most {MAX_REQUEST_BYTES}",
                    code="request_too_large")


async def read_body(request) -> bytes:
    """The raw body of a Starlette request, refused (413) once it passes MAX_REQUEST_BYTES."""
    declared = request.headers.get("content-length", "")
    if declared.isdigit() and int(declared) > MAX_REQUEST_BYTES:
        raise _too_large(declared)
    body = bytearray()
    async for chunk in request.stream():
        body += chunk
        if len(body) > MAX_REQUEST_BYTES:
            raise _too_large(f"more than {MAX_REQUEST_BYTES}")
    return bytes(body)


def _refuse_constant(name: str):
    raise ValueError(f"{name} is not valid JSON")


def parse_json_object(raw: bytes) -> dict:
    """Strict JSON (no NaN / Infinity), a JSON object, at most MAX_JSON_DEPTH deep, every string
    encodable as UTF-8 (JSON's \\ud800 escapes can name lone surrogates)."""
    try:
        data = json.loads(raw.decode("utf-8"), parse_constant=_refuse_constant)
    except UnicodeDecodeError:
        raise ApiError(400, "the request body is not valid UTF-8") from None
    except RecursionError:
        raise ApiError(400, f"the request body is nested more than {MAX_JSON_DEPTH} levels deep") from None
    except ValueError as e:  # JSONDecodeError, NaN / Infinity, an integer of more than 4300 digits
        raise ApiError(400, f"the request body is not valid JSON: {e}") from None
    if not isinstance(data, dict):
        raise ApiError(400, "the request body must be a JSON object")
    _check_tree(data)
    return data


def _encodable(text: str, path: str) -> None:
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        raise ApiError(400, f"{path}: the string holds a lone surrogate (\\ud800-\\udfff), which cannot be encoded "
                            "as UTF-8", param=path) from None


def _check_tree(data: dict) -> None:
    stack: list[tuple[Any, str, int]] = [(data, "", 1)]
    while stack:
        value, path, depth = stack.pop()
        if isinstance(value, str):
            _encodable(value, path)
        elif isinstance(value, (dict, list)):
            if depth > MAX_JSON_DEPTH:
                raise ApiError(400, f"the request body is nested more than {MAX_JSON_DEPTH} levels deep",
                               param=path or None)
            for key, item in value.items() if isinstance(value, dict) else enumerate(value):
                if isinstance(key, str):
                    _encodable(key, f"{path or 'body'} (a key)")
                stack.append((item, f"{path}.{key}" if path else str(key), depth + 1))
