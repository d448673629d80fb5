"""Start tandem's Serve application on a local Ray (127.0.0.1) from `ray_config.yaml`.

The YAML goes through Ray Serve's own schema (`ServeDeploySchema`) and each application's `args`
through `TandemAppConfig`, so a wrong key fails before anything starts, with the field named.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
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
    direct: dict[str, list[str]] = field(default_factory=dict)  # app -> its ingress replicas' own HTTP addresses


def direct_urls(app_name: str, timeout_s: float = 30.0) -> list[str]:
    """The HTTP addresses at which `app_name`'s ingress replicas answer themselves (Serve's direct ingress, on
    one machine: `cluster.ray.runtime.LOCAL_SERVE_ENV`), from Serve's controller; [] where it is off. A
    replica's port is allocated while it starts, so this asks until every running replica has one."""
    import ray
    from ray.serve._private.constants import SERVE_PROXY_NAME
    from ray.serve.context import _get_global_client

    controller = _get_global_client()._controller
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            groups = ray.get(controller.get_target_groups.remote(app_name), timeout=timeout_s)
        except Exception as e:  # a private Serve call: its failure only loses the printed addresses
            log.warning("direct ingress addresses of %s not read: %s", app_name, e)
            return []
        # the proxy's own group (app_name "") is what Serve answers when direct ingress is off, and an app
        # whose replicas are not running yet gets the proxies as its targets
        urls = sorted({f"http://{t.ip}:{t.port}" for g in groups if g.app_name == app_name
                       and str(getattr(g.protocol, "value", g.protocol)) == "HTTP" for t in g.targets
                       if not t.name.startswith(SERVE_PROXY_NAME)})
        if urls or time.monotonic() > deadline or groups and not any(g.app_name == app_name for g in groups):
            return urls
        time.sleep(0.5)


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
    names = [app.name for app in schema.applications]
    return Endpoints(f"http://{LOOPBACK}:{http_port}", f"{LOOPBACK}:{grpc_port}", names,
                     {name: direct_urls(name) for name in names})
