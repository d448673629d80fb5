"""Autoscaling policy for the session pools (verifier pool, drafter pool).

Serve's default policy scales on ongoing requests per replica; for the pools an ongoing request is an
open session lease, so that is already "sessions per replica". This policy adds the two signals that
matter for speculation: sessions waiting in Serve's queue (their queue time is pure latency, so one
more replica is asked for at once) and, for the drafter, the drafting backlog each replica reports
(`record_autoscaling_stats`: proposes waiting for the drafting thread). Serve applies the
min/max bounds and the upscale/downscale delays around it.

Kept free of heavy imports: Serve ships it to its controller by value.
"""

from __future__ import annotations

BACKLOG_PER_REPLICA = 8.0  # mean proposes waiting per drafter replica that asks for one more replica


def session_pool_policy(ctx) -> tuple[float, dict]:
    current = ctx.current_num_replicas
    if current == 0:
        return ctx.target_num_replicas, {}
    target = ctx.config.get_target_ongoing_requests()
    desired = ctx.total_num_requests / target  # open + queued sessions over sessions per replica
    queued = ctx.total_queued_requests or 0
    if queued > 0:
        desired = max(desired, current + 1)
    metrics = ctx.aggregated_metrics or {}
    backlog = metrics.get("drafting_backlog")
    if backlog:
        if sum(backlog.values()) / max(1, len(backlog)) > BACKLOG_PER_REPLICA:
            desired = max(desired, current + 1)
    return desired, {}
