"""How much of a decode step is the host launching kernels: the same model's one-token step eager and
replayed from a CUDA graph.

The first device run (2026-12-04, H200) found the eager runner's step launch-bound: 17.6 ms for
SmolLM2-135M's shape and 23.6 ms for Llama-3.1-8B's, where streaming the 8B's bf16 weights takes about
3.4 ms. This section measures what a captured step costs: the transformers model with a `StaticCache`
(fixed shapes, the cache written in place at `cache_position`), one token at a context of 512, captured
once with `torch.cuda.graph` and replayed; the eager step with the same cache beside it; the replay's
logits against the eager step's (the same kernels, so they must agree). On CPU there is no CUDA graph:
only the eager static-cache step is timed and the report says so.
"""

from __future__ import annotations

import traceback

import torch
from transformers import StaticCache

from cluster.model.graphs import capture_graph
from tools.gpu_check.costs import context_length
from tools.gpu_check.shapes import Models
from tools.gpu_check.timing import median_time, sync


def _rewind(cache, length: int) -> None:
    """Set each static layer's own write cursor to `length`. transformers 5.x's `StaticLayer.update` writes at
    its `cumulative_length` (a tensor it advances) and ignores `cache_position`: without this each timed step
    moves one slot on and runs off the cache's end (on CUDA, a device-side assert in `index_copy_`: the first
    device run of this section). `fill_` is a kernel, so a captured graph rewinds too."""
    for layer in getattr(cache, "layers", ()):
        cursor = getattr(layer, "cumulative_length", None)
        if isinstance(cursor, torch.Tensor):
            cursor.fill_(length)


def _step(model, cache, ids, pos, start: int):
    """One forward of `ids` [1, k] at positions `pos` [k] (= start + arange(k)) writing into the static cache;
    logits [1, k, V]."""
    _rewind(cache, start)
    return model(input_ids=ids, past_key_values=cache, cache_position=pos, position_ids=pos[None],
                 use_cache=True).logits


@torch.inference_mode()
def graphed_step(model, tiny: bool, reps: int) -> dict:
    device = next(model.parameters()).device
    n = context_length(tiny)
    cache = StaticCache(config=model.config, max_cache_len=n + 8)
    g = torch.Generator().manual_seed(11)
    prompt = torch.randint(0, model.config.vocab_size, (1, n), generator=g).to(device)  # [1, n]
    _step(model, cache, prompt, torch.arange(n, device=device), 0)
    ids = torch.randint(0, model.config.vocab_size, (1, 1), generator=g).to(device)  # [1, 1]
    pos = torch.tensor([n], device=device)  # [1]: position n is rewritten by every step
    eager_s = median_time(lambda: _step(model, cache, ids, pos, n), device, reps)
    eager_logits = _step(model, cache, ids, pos, n).float()  # [1, 1, V]
    out = {"context": n, "eager_step_s": eager_s, "attention": model.config._attn_implementation,
           "cache_length_after_steps": int(cache.get_seq_length())}  # n + 1 when every step wrote slot n
    if device.type != "cuda":
        out["graph"] = "no CUDA graphs on cpu: eager static-cache step only"
        return out
    graph, logits = capture_graph(lambda: _step(model, cache, ids, pos, n), device, warmup=3)  # [1, 1, V] per replay
    graph_s = median_time(graph.replay, device, reps * 3)
    graph.replay()
    sync(device)
    out["cache_length_after_replays"] = int(cache.get_seq_length())
    diff = (logits.float() - eager_logits).abs().max().item()
    out.update(graph_step_s=graph_s, eager_over_graph=eager_s / graph_s, max_abs_logit_diff=diff,
               same_argmax=bool(logits.argmax(-1).eq(eager_logits.argmax(-1)).all()),
               launch_share_of_eager=1 - graph_s / eager_s)
    del graph
    return out


def graphed_step_section(models: Models, targets, tiny: bool, budget) -> dict:
    """Per bf16 target shape: eager vs CUDA-graph one-token step (errors recorded per target)."""
    out: dict = {"dtype": "bfloat16", "batch": 1, "targets": {}}
    reps = 3 if tiny else 20
    for name, dtypes in targets:
        if "bfloat16" not in dtypes or not budget.allows(f"graphed_step/{name}", 1 if tiny else 15):
            continue
        model = models.target(name, "bfloat16")
        attention, errors = model.config._attn_implementation, {}
        try:  # a capture that fails on the device is a finding, recorded; then eager attention is tried
            for implementation in (attention, "eager"):
                model.set_attn_implementation(implementation)
                try:
                    out["targets"][name] = graphed_step(model, tiny, reps)
                    break
                except Exception as e:
                    errors[f"{implementation}_error"] = {"error": f"{type(e).__name__}: {e}",
                                                         "traceback": traceback.format_exc()[-3000:]}
        finally:
            model.set_attn_implementation(attention)
        if name not in out["targets"]:
            out["targets"][name] = {"error": f"no CUDA graph with {attention} or eager attention", **errors}
        elif errors:
            out["targets"][name].update(errors)
    return out
