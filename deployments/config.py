"""The serving configuration: pydantic models, every field described. `ray_config.yaml`'s `args`
go through `TandemAppConfig.build`, so a wrong field fails fast with a message that names it."""

from __future__ import annotations

import importlib.util
import logging
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from cluster.core.config import AUTO_PROPOSERS, EAGLE3, EngineConfig, PlacementConfig, check_tp_placement
from cluster.core.errors import ConfigError, validation_message
from cluster.session.loop import LoopConfig
from drafts.routing import check_eagle3_draft, needs_features, speculates

log = logging.getLogger(__name__)


def resolve_backend(engine: EngineConfig) -> tuple[str, str]:
    """(backend, why) for `engine.backend: auto`: vLLM when it is installed and can serve `engine` (its step
    was measured faster than tandem's torch runner on every machine so far: BENCHMARKS.md, "Peer"), else the
    torch runner. Deterministic for a given installation and config."""
    if importlib.util.find_spec("vllm") is None:
        return "torch", "vLLM is not installed"
    if speculates(engine) and needs_features(engine):
        return "torch", "the feature-fed draft needs the target's hidden states, which vLLM does not return"
    return "vllm", "vLLM is installed (its step is faster than the torch runner's: BENCHMARKS.md)"


class AutoscalingSpec(BaseModel):
    """Ray Serve autoscaling bounds for one deployment (its `autoscaling_config`)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    min_replicas: int = Field(1, ge=0, description="Fewest replicas (0 lets an idle deployment scale to zero).")
    max_replicas: int = Field(1, ge=1, description="Most replicas.")
    target_ongoing_requests: float = Field(8.0, gt=0, description="Ongoing requests per replica the autoscaler aims for (for the verifier pool and drafter: open sessions).")
    upscale_delay_s: float = Field(10.0, ge=0, description="How long demand must stay high before adding replicas.")
    downscale_delay_s: float = Field(120.0, ge=0, description="How long demand must stay low before removing replicas.")

    @model_validator(mode="after")
    def _bounds(self) -> "AutoscalingSpec":
        if self.min_replicas > self.max_replicas:
            raise ValueError(f"min_replicas={self.min_replicas} must be <= max_replicas={self.max_replicas}")
        return self

    def serve_config(self, policy: str | None = None) -> dict[str, Any]:
        config = {"min_replicas": self.min_replicas, "max_replicas": self.max_replicas,
                  "target_ongoing_requests": self.target_ongoing_requests,
                  "upscale_delay_s": self.upscale_delay_s, "downscale_delay_s": self.downscale_delay_s}
        if policy:
            config["policy"] = {"policy_function": policy}
        return config


class DeploymentSpec(BaseModel):
    """How one deployment is replicated and where its replicas run."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    num_replicas: int = Field(1, ge=1, le=1024, description="Fixed replica count (ignored when `autoscaling` is set).")
    autoscaling: AutoscalingSpec | None = Field(None, description="Autoscale between bounds instead of a fixed count.")
    max_ongoing_requests: int = Field(64, ge=1, description="Requests (sessions, for verifier and drafter) one replica takes at once; more wait in Serve's queue.")
    max_queued_requests: int = Field(-1, ge=-1, description="Requests that may wait for a replica beyond `max_ongoing_requests` (per caller; -1: unbounded). For the router this is the admission bound: past it a request is refused at once (HTTP 503 with Retry-After, gRPC RESOURCE_EXHAUSTED).")
    placement: PlacementConfig = Field(default_factory=lambda: PlacementConfig(num_cpus=0.0),
                                       description="Resources per replica (per rank for the verifier pool; of the drafter actor for the drafter).")
    health_check_period_s: float = Field(10.0, gt=0, le=600, description="How often Serve checks each replica (its `health_check_period_s`): a replica whose process died is replaced at the first check after its death, one that fails its check after three in a row.")
    graceful_shutdown_wait_loop_s: float = Field(2.0, gt=0, le=60, description="How often a stopping replica checks whether its requests have finished (Serve's `graceful_shutdown_wait_loop_s`, its default 2 s): a replica waits at least this long before it stops, and Serve stops an application's deployments one after another.")

    def replica_options(self, policy: str | None = None) -> dict[str, Any]:
        if self.autoscaling is not None:
            return {"autoscaling_config": self.autoscaling.serve_config(policy)}
        return {"num_replicas": self.num_replicas}


class FailoverConfig(BaseModel):
    """What the ingress does when the router replica carrying a stream dies (README: "What survives what")."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    max_resumes: int = Field(3, ge=0, le=100, description="Times one request is resumed on another router replica before it ends with an error (0: never).")
    resume_delay_s: float = Field(0.5, ge=0, le=60, description="Wait before each resume (Serve notices the dead replica and routes elsewhere or starts a new one).")


# vLLM's eagle3 method, γ by batch size (`vllm.speculative_schedule: auto`): 3 while 1-2 requests run, 2 for 3-4, 1 for
# 5-8, none from 9 (measured, BENCHMARKS.md: 16 streams 0.55 -> 0.84 of vLLM alone on chat, one stream unchanged)
EAGLE3_SCHEDULE = ((1, 2, 3), (3, 4, 2), (5, 8, 1), (9, 9, 0))


class VLLMServingConfig(BaseModel):
    """The vLLM verifier replicas (`engine.backend: vllm`): Ray Serve LLM's LLMServer with tandem's drafter."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    max_model_len: int = Field(2048, ge=16, description="vLLM's context length (also the API's limit).")
    kv_cache_space_gib: float = Field(1.0, gt=0, description="VLLM_CPU_KVCACHE_SPACE on CPU (GiB of KV cache per replica).")
    overlap: bool = Field(False, description="The drafter keeps drafting as if its last draft will be accepted (a miss costs one plain step, or a wait: on_miss). Off by default: on two shared CPU cores drafting on demand serves faster (BENCHMARKS.md); on with the drafter on a device of its own.")
    wait_s: float = Field(0.2, ge=0, le=30, description="How long vLLM's proposer waits for a draft per step before a plain step.")
    wait_first: bool = Field(True, description="Whether a request's first step waits for its first draft (vLLM samples the first token in that step, so waiting may delay it; not waiting costs one plain step). Not waiting did not lower the served TTFT here (BENCHMARKS.md).")
    on_miss: Literal["plain", "wait"] = Field("plain", description="Overlapped, when the drafter's draft missed the committed tokens: 'plain' (one plain step while it redrafts) or 'wait' (wait up to wait_s for the redraft).")
    compile: bool = Field(True, description="vLLM's torch.compile of the model, its own default (false: eager, vLLM's enforce_eager). Measured here on CPU: 31 ms a token against 49 eager at one stream, at 160 s of startup against 35 (BENCHMARKS.md); eager suits short-lived servers such as tests.")
    speculative_schedule: list[tuple[int, int, int]] | Literal["auto"] | None = Field("auto", description="γ by the number of requests in a step: (first, last batch size, γ) ranges from 1, γ 0 for plain steps (vLLM's `num_speculative_tokens_per_batch_size`; never above the engine's γ), e.g. [[1, 2, 3], [3, 4, 2], [5, 8, 1], [9, 9, 0]]: speculate while few requests run. 'auto' (the default): that schedule, measured here, for vLLM's own eagle3 method, whose γ is otherwise the same at any load (BENCHMARKS.md, eagle3 with γ by batch size); none for tandem's proposer, which prices each request's draft itself. null: none.")
    intel_openmp: bool = Field(True, description="On CPU, vLLM's engine processes run on Intel's OpenMP (libiomp5, installed with vllm-cpu; LD_PRELOAD set for the engine's processes only), as vLLM's CPU guide sets it up: measured faster than GNU libgomp, most with speculative decoding (BENCHMARKS.md). An OpenMP runtime already in LD_PRELOAD is kept.")
    engine_kwargs: dict[str, Any] = Field(default_factory=dict, description="More vLLM engine arguments, passed as they are (e.g. gpu_memory_utilization).")
    direct_ingress: bool = Field(True, description="The verifier replicas serve the OpenAI and gRPC API themselves (no ingress deployment: Serve's proxy calls them directly, one Serve hop less per streamed chunk; measured faster, BENCHMARKS.md). A replica's death then ends its streams; with the ingress apart (false) they resume on a live replica.")

    def schedule_for(self, method: str) -> list[list[int]] | None:
        """The γ-by-batch-size schedule vLLM gets for its speculative `method` ('eagle3' or 'custom_class')."""
        if self.speculative_schedule == "auto":
            return [list(r) for r in EAGLE3_SCHEDULE] if method == "eagle3" else None
        return None if self.speculative_schedule is None else [list(r) for r in self.speculative_schedule]

    @field_validator("speculative_schedule")
    @classmethod
    def _schedule(cls, value):
        if value is None or value == "auto":
            return value
        previous = 0
        for first, last, gamma in sorted(value):
            if first != previous + 1 or last < first or gamma < 0:
                raise ValueError("speculative_schedule: ranges (first, last, γ) from batch size 1, contiguous, "
                                 f"first <= last, γ >= 0; got {value}")
            previous = last
        return sorted(value)


def _default_verifier() -> DeploymentSpec:
    return DeploymentSpec(placement=PlacementConfig(num_cpus=1.0), max_ongoing_requests=32)


def _default_drafter() -> DeploymentSpec:
    return DeploymentSpec(placement=PlacementConfig(num_cpus=1.0), max_ongoing_requests=64)


class TandemAppConfig(LoopConfig):
    """The whole application: models, speculation, the four deployments and the API's limits
    (scheduling fields from `LoopConfig`, shared with the standalone runtime's config)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    model_id: str = Field("SmolLM2-135M-Instruct", min_length=1, description="Model name clients pass as `model` (and /v1/models lists).")
    engine: EngineConfig = Field(default_factory=EngineConfig, description="Target, draft / proposer, maximum γ, dtype, torch threads per model process.")
    tensor_parallel_size: int = Field(1, ge=1, le=64, description="Target ranks per verifier replica (one STRICT_PACK placement group).")
    default_max_tokens: int = Field(256, ge=1, description="max_tokens when a request leaves it out.")
    max_tokens_limit: int | None = Field(None, ge=1, description="Refuse requests asking for more tokens (None: only the context length limits).")
    api_keys: list[str] = Field(default_factory=list, description="Accepted keys: HTTP `Authorization: Bearer KEY` or `x-api-key: KEY`, gRPC metadata of the same names; empty: no authentication.")
    failover: FailoverConfig = Field(default_factory=FailoverConfig, description="Resuming streams whose router replica died.")
    request_timeout_s: float | None = Field(None, gt=0, description="Optional per-request deadline: a request still running after this long ends with HTTP 504 / gRPC DEADLINE_EXCEEDED (an error event once streaming).")
    retry_after_s: int = Field(1, ge=0, description="The Retry-After a refused (overloaded) request is given.")
    stream_messages_per_s: float = Field(50.0, ge=0, description="Stream messages a session-driving replica (router, or vLLM verifier) sends per second over all its sessions at most: a session waits open sessions / this between two messages, and what it committed meanwhile leaves in one (a first token, the end and errors are never held). Each message costs CPU in every process it crosses (BENCHMARKS.md); 0: every step's tokens as they come.")
    ingress: DeploymentSpec = Field(default_factory=DeploymentSpec, description="The HTTP / gRPC ingress (tokenizer, validation, SSE).")
    router: DeploymentSpec = Field(default_factory=DeploymentSpec, description="Routers: drive sessions, own committed tokens (torch backend; on vLLM the verifier replicas drive their sessions, and this section's max_queued_requests is their admission bound unless verifier sets one).")
    drafter: DeploymentSpec = Field(default_factory=_default_drafter, description="Drafters: the draft model on a cheap accelerator.")
    verifier: DeploymentSpec = Field(default_factory=_default_verifier, description="The verifier pool: target model replicas, `tensor_parallel_size` ranks each.")
    vllm: VLLMServingConfig = Field(default_factory=VLLMServingConfig, description="vLLM verifier replicas (only with engine.backend 'vllm').")

    @model_validator(mode="before")
    @classmethod
    def _resolve_auto(cls, data: Any) -> Any:
        """engine.backend 'auto' becomes the engine `resolve_backend` chooses (logged); engine.proposer 'auto' then
        becomes that engine's (`EngineConfig`, `AUTO_PROPOSERS`), logged here."""
        if not isinstance(data, dict):
            return data
        engine = data.get("engine")
        if isinstance(engine, EngineConfig):
            engine = engine.model_dump()
        if isinstance(engine, dict) and engine.get("backend") == "auto":
            try:
                backend, why = resolve_backend(EngineConfig(**{**engine, "backend": "torch"}))
            except ValidationError:
                return data  # the engine's own validation names the field
            log.info("engine.backend auto: %s (%s)", backend, why)
            engine = {**engine, "backend": backend}
            data = {**data, "engine": engine}
        backend = engine.get("backend", "torch") if isinstance(engine, dict) else None
        if backend in AUTO_PROPOSERS and engine.get("proposer") == "auto":  # EngineConfig resolves it; logged here, once
            log.info("engine.proposer auto: %s (on the %s engine: BENCHMARKS.md)", AUTO_PROPOSERS[backend], backend)
        return data

    @model_validator(mode="after")
    def _check(self) -> "TandemAppConfig":
        if self.engine.backend == "torch" and self.speculative and self.engine.proposer == EAGLE3:
            check_eagle3_draft(self.engine.draft)  # a ConfigError is a ValueError: named like any field's
        if self.engine.backend == "vllm" and self.speculative and needs_features(self.engine):
            raise ValueError("a feature-fed draft cannot draft for vLLM replicas (vLLM does not return the target's "
                             "hidden states to the proposer); use draft 'int8' or proposer 'ngram'")
        if self.max_tokens_limit is not None and self.default_max_tokens > self.max_tokens_limit:
            raise ValueError(f"default_max_tokens={self.default_max_tokens} must be <= max_tokens_limit={self.max_tokens_limit}")
        check_tp_placement(self.tensor_parallel_size, self.engine, self.verifier.placement, "verifier.placement")
        return self

    def with_backend(self, backend: str) -> "TandemAppConfig":
        """This config with `engine.backend` replaced (validated again)."""
        return self.with_engine(backend=backend)

    def with_engine(self, **changes) -> "TandemAppConfig":
        """This config with `engine` fields replaced (validated again; backend 'auto' chosen again)."""
        return TandemAppConfig.build({**self.model_dump(), "engine": {**self.engine.model_dump(), **changes}})

    @property
    def speculative(self) -> bool:
        return speculates(self.engine)

    @classmethod
    def build(cls, config: "TandemAppConfig | dict | None" = None) -> "TandemAppConfig":
        if isinstance(config, cls):
            return config
        try:
            return cls(**(config or {}))
        except ValidationError as e:
            raise ConfigError(f"invalid tandem config: {validation_message(e)}") from None
