"""Serve LLM, adjusted for tandem's vLLM replicas: a model already on the node is not "downloaded" by a task per
node (`LocalModelCallback`), and with Ray's usage stats off no telemetry actor is started
(`skip_llm_telemetry_actor`). Imported where the replicas are built (`deployments.vllm_serving`)."""

from __future__ import annotations

import logging
import os

log = logging.getLogger(__name__)


def skip_llm_telemetry_actor() -> bool:
    """With Ray's usage stats off (tandem turns them off: `cluster.TELEMETRY_OFF`), Serve LLM's replica still
    starts a detached `TelemetryAgent` actor when its engine starts, to hold usage tags that Ray then never sends:
    one more process polling ~0.6% of a core for the server's life (BENCHMARKS.md, "The plain path's
    last 10%"). Replaces that call with nothing, in this process, only while usage stats are off. Returns whether it did."""
    from ray._common.usage import usage_lib
    from ray.llm._internal.serve.core.server import llm_server

    if usage_lib.usage_stats_enabled() or not hasattr(llm_server, "push_telemetry_report_for_all_models"):
        return False
    llm_server.push_telemetry_report_for_all_models = _no_telemetry_report
    return True


def _no_telemetry_report(*_, **__) -> None:
    log.debug("Ray's usage stats are off: Serve LLM's telemetry actor is not started")


def _callback_base():
    from ray.llm._internal.common.callbacks.base import CallbackBase

    return CallbackBase


class LocalModelCallback(_callback_base()):
    """Serve LLM's node initialisation for a model already on this node's disk: its replica normally runs a
    task per node of its placement group to download the model files (a fresh worker process each time,
    ~15 s here); a local directory with every bundle on this node has nothing to download, so that step is
    skipped (`CallbackCtx.run_init_node`). Anything else goes through Serve LLM's own initialisation."""

    async def on_before_node_init(self) -> None:
        import ray
        from ray.util import placement_group_table

        source = self.llm_config.model_loading_config.model_source
        group = self.ctx.placement_group
        if not isinstance(source, str) or not os.path.isdir(source) or group is None:
            return
        nodes = set(placement_group_table(group)["bundles_to_node_id"].values())
        if nodes == {ray.get_runtime_context().get_node_id()}:
            self.ctx.run_init_node = False
            log.info("model files %s are on this node: no download tasks", source)


LOCAL_MODEL_CALLBACK = f"{LocalModelCallback.__module__}.{LocalModelCallback.__qualname__}"
