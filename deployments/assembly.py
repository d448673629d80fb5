"""What every serving pattern's builder shares (`deployments.builder` for the torch backend,
`deployments.vllm_serving` for vLLM): Serve options from a `DeploymentSpec`, the router's options and
the ingress deployment each application ends with."""

from __future__ import annotations

from ray import serve
from ray.serve import Application

from deployments.config import DeploymentSpec, TandemAppConfig
from deployments.ingress import Ingress


def deployment_options(spec: DeploymentSpec, name: str, policy: str | None = None) -> dict:
    """Serve's options for a deployment `spec` describes (replicas or autoscaling with `policy`, queues)."""
    return {"name": name, "max_ongoing_requests": spec.max_ongoing_requests,
            "max_queued_requests": spec.max_queued_requests, "health_check_period_s": spec.health_check_period_s,
            "graceful_shutdown_wait_loop_s": spec.graceful_shutdown_wait_loop_s, **spec.replica_options(policy)}


def router_options(config: TandemAppConfig) -> dict:
    place = config.router.placement
    return {**deployment_options(config.router, "Router"),
            "ray_actor_options": {"num_cpus": place.num_cpus,
                                  **({"resources": place.resources} if place.resources else {})}}


def ingress_deployment(config: TandemAppConfig, plain: dict, router) -> Application:
    place = config.ingress.placement
    return serve.deployment(Ingress).options(
        **deployment_options(config.ingress, "Ingress"),
        ray_actor_options={"num_cpus": place.num_cpus, **({"resources": place.resources} if place.resources else {})},
    ).bind(plain, router)
