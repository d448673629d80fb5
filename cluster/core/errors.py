"""Errors that reach users: each carries one clear line."""


class TandemError(Exception):
    """Base class of errors tandem reports to users."""


class InvalidRequestError(TandemError, ValueError):
    """The request itself is wrong (HTTP 400 / gRPC INVALID_ARGUMENT at the edges)."""


class ConfigError(TandemError, ValueError):
    """The configuration or a model file is wrong; refused at construction."""


def validation_message(error) -> str:
    """One line from a pydantic ValidationError: the first problem, prefixed by its field."""
    first = error.errors()[0]
    field = ".".join(str(x) for x in first["loc"]) or "request"
    return f"{field}: {first['msg']}"
