"""`build_app(config) -> Application`: the ingress, the router, the drafter and the verifier pool as
Serve deployments, wired by DeploymentHandles. `ray_config.yaml` imports it; its `args` are the
`TandemAppConfig` fields."""

from __future__ import annotations

from ray import serve
from ray.serve import Application

from cluster.model import models
from cluster.ray.runtime import check_tensor_parallel
from deployments.assembly import deployment_options, ingress_deployment, router_options
from deployments.config import TandemAppConfig
from deployments.pools import DrafterPool, VerifierPool
from deployments.router import RouterDeployment

SESSION_POOL_POLICY = "deployments.autoscaling:session_pool_policy"


def _check_tensor_parallel(config: TandemAppConfig) -> None:
    from transformers import AutoConfig

    path = models.resolve_model_path(config.engine.target, config.engine.cache_dir)
    check_tensor_parallel(config.tensor_parallel_size, AutoConfig.from_pretrained(path).num_key_value_heads)


def build_app(config: TandemAppConfig | dict | None = None) -> Application:
    config = TandemAppConfig.build(config)
    _check_tensor_parallel(config)
    if config.engine.backend == "vllm":  # vLLM verifier replicas (Ray Serve LLM's LLMServer) + their drafters
        from deployments.vllm_app import build_vllm_app  # on use: vLLM is optional

        return build_vllm_app(config)
    plain = config.model_dump(mode="json")
    engine = config.engine.model_dump(mode="json")

    rank = config.verifier.placement
    bundles = [rank.bundle() for _ in range(config.tensor_parallel_size)]
    verifier = serve.deployment(VerifierPool).options(
        **deployment_options(config.verifier, "VerifierPool", SESSION_POOL_POLICY),
        ray_actor_options={"num_cpus": rank.num_cpus, "num_gpus": rank.num_gpus,
                           **({"resources": rank.resources} if rank.resources else {}),
                           **({"accelerator_type": rank.accelerator_type} if rank.accelerator_type else {})},
        **({"placement_group_bundles": bundles, "placement_group_strategy": "STRICT_PACK"}
           if config.tensor_parallel_size > 1 else {}),
        graceful_shutdown_timeout_s=30,
    ).bind(engine, config.tensor_parallel_size, rank.model_dump(mode="json"))

    drafter = None
    if config.speculative:
        drafter = serve.deployment(DrafterPool).options(
            **deployment_options(config.drafter, "DrafterPool", SESSION_POOL_POLICY),
            ray_actor_options={"num_cpus": 0},
        ).bind(engine, config.drafter.placement.model_dump(mode="json"))

    router = serve.deployment(RouterDeployment).options(**router_options(config)).bind(plain, drafter, verifier)
    return ingress_deployment(config, plain, router)
