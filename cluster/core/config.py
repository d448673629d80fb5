"""Configuration leaves: what runs where in one process (`EngineConfig`) and how the internal gRPC
service listens (`NetworkConfig`, `TLSConfig`). Pure pydantic models, validated at the edge; every
layer above reads them, none of them imports anything of tandem but its errors."""

from __future__ import annotations

from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from cluster.core.errors import ConfigError, validation_message


class TLSConfig(BaseModel):
    """PEM files for the internal `Verifier` service's TLS (paths as seen on the verifier's node)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    cert_file: str = Field(..., min_length=1, description="PEM certificate (chain) the verifier presents; it must name the address routers dial (an IP SAN) or `server_name`.")
    key_file: str = Field(..., min_length=1, description="PEM private key of `cert_file`.")
    ca_file: str | None = Field(None, min_length=1, description="PEM CA certificate(s) that `cert_file` chains to; routers verify the verifier against it. Default: `cert_file` itself (self-signed).")
    server_name: str | None = Field(None, min_length=1, description="Name routers expect in the certificate instead of the IP address they dial (gRPC's `ssl_target_name_override`).")

    def read_pem(self, field: str) -> bytes:
        path = getattr(self, field)
        try:
            return Path(path).expanduser().read_bytes()
        except OSError as e:
            raise ConfigError(f"network.tls.{field}: cannot read {path!r}: {e.strerror or e}") from None

    def root_certificates(self) -> bytes:
        return self.read_pem("ca_file" if self.ca_file else "cert_file")


class NetworkConfig(BaseModel):
    """How a verifier's internal gRPC service listens and is reached."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    bind: Literal["node", "loopback"] = Field("node", description="Address the verifier binds and advertises: 'node' = the Ray node's IP (127.0.0.1 on a single-machine loopback cluster, so nothing listens elsewhere; the node's own address on a multi-node cluster); 'loopback' = always 127.0.0.1 (routers must share the verifier's machine).")
    tls: TLSConfig | None = Field(None, description="Serve the internal `Verifier` service over TLS with these certificates (recommended across nodes). None: plaintext; calls are still authenticated with the cluster secret.")


INT8_DRAFT = "int8"
# proposer 'auto' per target engine, by measurement (BENCHMARKS.md, "Beside vLLM's own server"): on vLLM a model
# draft costs most of a target step (the int8 copy ~23 ms a token against vLLM's ~20-28), so the free priced
# matches made in its step win; tandem's torch step is slower (~52 ms), and the hybrid's int8 rounds pay there
AUTO_PROPOSERS = {"vllm": "eagle3", "torch": "hybrid"}
PROMPT_CACHE_TOKENS = 4096  # EngineConfig.prompt_cache_tokens' default, and the in-process engine's
PROPOSERS = ("draft", "ngram", "suffix", "hybrid", "eagle3", "none", "auto")
EAGLE3 = "eagle3"  # an exported EAGLE-3 draft: vLLM's own method on vLLM, the feature-fed proposer on torch
EAGLE3_DRAFT = "eagle3"  # engine.draft shorthand: the EAGLE-3 draft shipped for the default target


class EngineConfig(BaseModel):
    """What runs where in one process."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    target: str = Field("default", description="Target model: 'default' (SmolLM2-135M-Instruct) or a local Hugging Face model directory.")
    proposer: Literal[PROPOSERS] = Field("draft", description="'draft' (a draft model), 'ngram' (prompt lookup, no model), 'suffix' (the session's own longest suffix match, each draft as long as its tokens pay for their verification, learned from the verdicts; no model; up to max(num_speculative_tokens, match_tokens) tokens), 'hybrid' (a suffix match when one is long enough, else the draft model, chosen per round from each one's acceptance), 'eagle3' (the EAGLE-3 draft in `draft`, a directory `python -m tools.eagle3_export_checkpoint` wrote: on vLLM, vLLM's own EAGLE-3 method runs it inside its step on the target's fused layers, γ by batch size, with proposer 'suffix''s priced matches in its place where they are expected to go further (`eagle3_matches`); on the torch runner, tandem's feature-fed proposer runs it on the three layers' states the verifier sends, with `tree_width` > 1 as EAGLE-2 dynamic trees), 'none' (plain target decoding) or 'auto' (chosen with the engine, `AUTO_PROPOSERS`: 'eagle3' with its matches on vLLM, 'hybrid' on the torch runner; BENCHMARKS.md).")
    draft: str = Field(INT8_DRAFT, description="Draft model for proposers 'draft' and 'hybrid': 'int8' (int8 dynamic-quantized copy of the target), 'feature' (the feature-fed draft shipped for the default target, drafts/trained/feature-smollm2-135m: it reads the target's last hidden state, which the verifier sends), 'eagle3' (the EAGLE-3 draft shipped for the default target, drafts/trained/eagle3-smollm2-135m: it reads three of the target's layers; proposer 'eagle3' takes it when `draft` is left at 'int8'), a tandem draft directory (`tandem drafts distill`) or a local model directory with the target's tokenizer.")
    num_speculative_tokens: int = Field(3, ge=0, le=32, description="Tokens drafted per round (γ); 0 is plain target decoding.")
    dtype: Literal["bfloat16", "float32", "float16"] = Field("bfloat16", description="Target (and model draft) dtype; the int8 draft computes in float32.")
    device: str | None = Field(None, description="torch device; CUDA when visible, else CPU.")
    threads: int | None = Field(1, ge=1, description="torch intra-op threads for this process (None leaves torch's default).")
    cache_dir: str | None = Field(None, description="Model cache root (default $TANDEM_CACHE_DIR or ~/.cache/tandem).")
    max_ngram: int = Field(3, ge=1, le=16, description="Longest n-gram the prompt-lookup proposer matches.")
    tree_width: int = Field(1, ge=1, le=10, description="Sequential rounds, verified as a token tree in one forward: the draft model's candidates at the first draft position (its most likely tokens); the feature-fed draft's dynamic tree (EAGLE-2): the nodes expanded per depth and the children each gets; the hybrid's match rounds: up to this many continuations of the session's own suffix with different first tokens. 1 drafts a chain.")
    tree_tokens: int = Field(16, ge=1, le=128, description="The feature-fed draft's dynamic tree (tree_width > 1): the most draft tokens one tree holds, the best by cumulative draft log-probability (what one verify forward scores).")
    match_tokens: int = Field(16, ge=0, le=32, description="Proposer 'hybrid', sequential rounds: a suffix match at least 4 tokens long proposes up to this many tokens of its continuation instead of γ (a long match tends to go on; its drafts cost nothing and verifying more of them little; BENCHMARKS.md). 0 (or at most γ): match rounds are γ long like the model's.")
    suffix_threshold: float = Field(0.1, gt=0, lt=1, description="Proposer 'suffix' on vLLM (and proposer 'eagle3''s matches there): the price of one verified draft token at one row, in tokens gained (a token is drafted while its learned chance of acceptance, times its predecessors', stays at or above it; 0.04 more per further row of the step, near-certain tokens only from `suffix_busy_rows` requests).")
    suffix_busy_rows: int = Field(9, ge=0, le=4096, description="Proposer 'suffix' on vLLM (and proposer 'eagle3''s matches there): from this many requests in a step, a match token is drafted only when its learned chance of acceptance is near-certain (0.95): a full CPU step pays for a verified token with compute (16 HumanEval streams offline: 264 tok/s at the rising price, 290 with it from 9 rows; BENCHMARKS.md). 0: the price only rises per row.")
    suffix_match_factor: float = Field(0.0, ge=0, le=8, description="Proposer 'suffix' on vLLM: a draft at most this many times its match long (SuffixDecoding's spec factor); 0: no such cap.")
    suffix_pool_tokens: int = Field(65536, ge=0, le=1 << 22, description="Proposer 'suffix' on vLLM (and proposer 'eagle3''s matches there): finished requests' outputs kept in vLLM's step (up to this many tokens, the oldest leave first); where a request's own tokens match nothing as long, the longest match in them drafts (priced by its own table; greedy and unseeded sampled requests only). 0: a request's own tokens only.")
    eagle3_matches: bool = Field(True, description="Proposer 'eagle3' on vLLM: proposer 'suffix''s priced matches (suffix_threshold, suffix_pool_tokens) inside vLLM's EAGLE-3 proposer: a request whose match is expected to have more tokens accepted than EAGLE-3's γ gets the match's continuation (up to suffix_tokens) instead, per row and step (cluster/vllm/eagle_matches.py; BENCHMARKS.md). false: vLLM's method as it is, one γ for every request.")
    own_matches: bool = Field(True, description="Proposer 'hybrid' with long match rounds: the router drafts a match of the session's own suffix at least 4 tokens long itself, up to match_tokens, without calling the drafter: in sequential rounds, and in place of the plain steps the speculation policy chooses (BENCHMARKS.md).")
    onednn: bool = Field(True, description="Torch backend on CPU in bf16: the target's linear weights laid out once for oneDNN (cluster/model/onednn.py: the same output bits, 1.9x a one-row GEMV measured here). Ignored (logged) in fp32, on CUDA and with tensor parallelism.")
    fp32_gemm: bool = Field(True, description="Torch backend on CPU in fp32: the target's linear layers compute up to 8 rows (a decode step, a verification) as W·xᵀ, the weight as the GEMM's left operand, which MKL streams 1.5-2x as fast as nn.Linear's x·Wᵀ here (cluster/model/gemm.py; not the same bits as nn.Linear, the same greedy tokens as transformers: tests/test_gemm.py). Ignored (logged) in bf16, on CUDA and with tensor parallelism.")
    prompt_cache_tokens: int = Field(PROMPT_CACHE_TOKENS, ge=0, description="Torch backend: the prompt KV (the target's on each verifier, the draft model's on each drafter) kept after a request ends, in tokens, for a later request whose prompt is exactly the same (the same prompt sampled again, best-of-n or pass@k across requests, a retried request): it skips the prefill, and output is bit for bit the same (cluster/model/prompt_cache.py; only exact matches are used). Least recently used out first; each token holds layers x 2 x kv heads x head size values (SmolLM2-135M in fp32: 46 KB, so 4096 tokens 188 MB; an 8B Llama in bf16 128 KB). 0: off. vLLM has its own prefix caching.")
    cuda_graphs: int = Field(0, ge=0, le=256, description="Torch backend on CUDA: up to this many sessions at once (each process: the verifier's target, the drafter's draft model) keep their KV in a fixed buffer and replay their steps of up to 8 tokens (plain and draft steps, chain verification) from CUDA graphs (cluster/model/graphs.py; the GPU check measured an eager step 5-11x a replayed one). 0: off, the default until a GPU run of the check's `runner_graphs` section has shown it exact; ignored (logged) without CUDA and with tensor parallelism.")
    network: NetworkConfig = Field(default_factory=NetworkConfig, description="The verifier's internal gRPC service: the address it binds and advertises ('node' or 'loopback') and optional TLS; calls always need the cluster secret.")
    backend: Literal["auto", "torch", "vllm"] = Field("torch", description="Target engine: 'torch' (tandem's own runner over transformers' models, the default here) or 'vllm' (vLLM owns the target and its decoding loop; tandem's drafts reach it through vLLM's custom proposer class; needs `pip install -e '.[vllm]'`); 'auto' (the served config's, `ray_config.yaml`): vLLM when it is installed and can serve the config, else torch (`deployments.config.resolve_backend`, logged).")

    @model_validator(mode="before")
    @classmethod
    def _auto_proposer(cls, data: Any) -> Any:
        """proposer 'auto' becomes the engine's (`AUTO_PROPOSERS`) once the backend is torch or vllm."""
        if isinstance(data, dict) and data.get("proposer") == "auto" and data.get("backend", "torch") in AUTO_PROPOSERS:
            data = {**data, "proposer": AUTO_PROPOSERS[data.get("backend", "torch")]}
        if isinstance(data, dict) and data.get("proposer") == EAGLE3 and data.get("draft", INT8_DRAFT) == INT8_DRAFT:
            data = {**data, "draft": EAGLE3_DRAFT}  # proposer 'eagle3' with no draft of its own: the shipped one
        return data

    @property
    def suffix_tokens(self) -> int:
        """Proposer 'suffix': the most tokens one draft holds (it drafts as long as the tokens pay, up to the
        long match rounds' length)."""
        return max(self.num_speculative_tokens, self.match_tokens)

    @classmethod
    def build(cls, **kwargs) -> "EngineConfig":
        try:
            return cls(**{k: v for k, v in kwargs.items() if v is not None})
        except ValidationError as e:
            raise ConfigError(validation_message(e)) from None


class PlacementConfig(BaseModel):
    """Resources of one actor: GPUs (fractional allowed), accelerator type, custom resources."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    num_cpus: float = Field(1.0, ge=0, description="CPUs reserved for the actor.")
    num_gpus: float = Field(0.0, ge=0, description="GPUs per actor; fractions share a device.")
    accelerator_type: str | None = Field(None, description="Ray accelerator type, e.g. 'L4' or 'H100'.")
    resources: dict[str, float] = Field(default_factory=dict, description="Custom Ray resources, e.g. {'draft_node': 1}.")

    def bundle(self) -> dict[str, float]:
        bundle = {"CPU": self.num_cpus, **self.resources}
        if self.num_gpus:
            bundle["GPU"] = self.num_gpus
        if self.accelerator_type:
            bundle[f"accelerator_type:{self.accelerator_type}"] = 0.001
        return bundle


def check_tp_placement(tensor_parallel_size: int, engine: EngineConfig, placement: PlacementConfig, field: str) -> None:
    """Tensor parallelism on GPUs needs a whole GPU per rank (`field`: where the ranks' placement is configured)."""
    if tensor_parallel_size > 1 and engine.device not in (None, "cpu") and placement.num_gpus < 1:
        raise ValueError(f"tensor_parallel_size={tensor_parallel_size} on GPUs needs {field}.num_gpus >= 1")
