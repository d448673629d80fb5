"""Errors that reach users: each carries one clear line."""


class TandemError(Exception):
    """Base class of errors tandem reports to users."""


class InvalidRequestError(TandemError, ValueError):
    """The request itself is wrong (HTTP 400 / gRPC INVALID_ARGUMENT at the edges)."""


class ConfigError(TandemError, ValueError):
    """The configuration or a model file is wrong; refused at construction."""
