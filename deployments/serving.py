"""Start tandem's Serve application on a local Ray (127.0.0.1) from `ray_config.yaml`.

The YAML goes through Ray Serve's own schema (`ServeDeploySchema`) and each application's `args`
through `TandemAppConfig`, so a wrong key fails before anything starts, with the field named.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path

import yaml
from pydantic import ValidationError

from cluster.core.errors import ConfigError, validation_message
from cluster.ray.runtime import LOOPBACK, init_local_ray
from deployments.builder import build_app
from deployments.config import TandemAppConfig

log = logging.getLogger(__name__)

DEFAULT_CONFIG = Path(__file__).resolve().parent.parent / "ray_config.yaml"


@dataclass
class ServeConfig:
    schema: object  # ray.serve.schema.ServeDeploySchema
    app_configs: dict[str, TandemAppConfig]


def load_config(path: str | Path | None = None, overrides: dict | None = None) -> ServeConfig:
    """Parse and validate a Serve config; `overrides` replace top-level `args` keys of every app."""
    from ray.serve.schema import ServeDeploySchema

    path = Path(path or DEFAULT_CONFIG)
    try:
        raw = yaml.safe_load(path.read_text())
    except (OSError, yaml.YAMLError) as e:
        raise ConfigError(f"cannot read {path}: {e}") from None
    if not isinstance(raw, dict):
        raise ConfigError(f"{path}: expected a mapping at the top level")
    for app in raw.get("applications") or []:
        if overrides and isinstance(app, dict):
            app["args"] = {**(app.get("args") or {}), **overrides}
    try:
        schema = ServeDeploySchema.model_validate(raw)
    except ValidationError as e:
        raise ConfigError(f"{path}: {validation_message(e)}") from None
    apps = {}
    for app in schema.applications:
        try:
            apps[app.name] = TandemAppConfig(**app.args)
        except ValidationError as e:
            raise ConfigError(f"{path}: applications[{app.name}].args.{validation_message(e)}") from None
    return ServeConfig(schema, apps)


@dataclass
class Endpoints:
    http: str
    grpc: str
    app_names: list[str]


def start(config: ServeConfig, http_port: int | None = None, grpc_port: int | None = None,
          blocking: bool = False) -> Endpoints:
    """Deploy every application of `config` on a local Ray; returns the addresses."""
    from ray import serve
    from ray.serve.config import HTTPOptions, gRPCOptions

    init_local_ray()
    schema = config.schema
    http_port = http_port if http_port is not None else schema.http_options.port
    grpc_port = grpc_port if grpc_port is not None else schema.grpc_options.port
    serve.start(http_options=HTTPOptions(host=LOOPBACK, port=http_port),
                grpc_options=gRPCOptions(port=grpc_port,
                                         grpc_servicer_functions=list(schema.grpc_options.grpc_servicer_functions)))
    for app in schema.applications:
        serve.run(build_app(config.app_configs[app.name]), name=app.name, route_prefix=app.route_prefix,
                  blocking=False)
    return Endpoints(f"http://{LOOPBACK}:{http_port}", f"{LOOPBACK}:{grpc_port}",
                     [app.name for app in schema.applications])
