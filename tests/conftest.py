"""Shared fixtures. Everything runs on CPU with the real SmolLM2 weights (fp32 for exactness)."""

from __future__ import annotations

import os
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import pytest
import torch

import cluster
from cluster.core import grammar
from cluster.core.config import PROMPT_CACHE_TOKENS
from cluster.model import models
from cluster.model.gemm import gemm_copy
from cluster.model.runner import TorchModelRunner
from drafts.draft_model import quantized_copy

# The Ray clusters the tests start from this process need grpcio's fork handlers off (cluster/__init__.py: with them
# on, a raylet started beside the tests' gRPC clients may die before its exec)
assert not cluster.GRPC_FORK_HANDLERS_ON, "grpcio imported before `cluster`, or GRPC_ENABLE_FORK_SUPPORT set on"

# `make test` runs two pytest workers (pytest-xdist, one module per worker at a time) on this 2-core
# machine: one torch thread each (a decode step is as fast on one thread as on two here).
_WORKER = os.environ.get("PYTEST_XDIST_WORKER")
torch.set_num_threads(int(os.environ.get("TANDEM_TEST_THREADS", "1" if _WORKER else "2")))

# The longest modules first (measured: a clean-clone run, --durations; `make test` keeps this order with
# --no-loadscope-reorder, xdist would otherwise start the modules with the most tests), so that two workers finish
# together instead of one running the last long module alone: every module of 20 s or more, longest first (at
# 2026-12-07 this order ends the two workers' simulated schedule 32 s sooner than the list before it, which left
# test_structured, 118 s, to start last). test_vllm second: test_distributed, third, decodes 7 of
# test_greedy_equality's prompts, whose references are then in the cache (started beside it, it computed them too).
LONGEST_FIRST = ("test_greedy_equality", "test_vllm", "test_distributed", "test_serving", "test_vllm_fields",
                 "test_fuzz", "test_failover", "test_vllm_serving", "test_sampling_e2e", "test_drafts",
                 "test_bad_input", "test_structured", "test_hybrid", "test_feature_serving", "test_eagle3_serving",
                 "test_auth", "test_bf16", "test_processors", "test_tree", "test_models", "test_multinode",
                 "test_feature_draft")
# Modules that start vLLM engines (each a Ray cluster, an engine core and its KV cache, GBs of memory): never two
# at once on the two workers. A CI run lost a vLLM verifier replica while both ran beside each other's load.
ONE_AT_A_TIME = ("test_vllm", "test_vllm_serving")
# Packages whose modules share a package-scoped fixture (one Serve application): one unit of work, on one worker,
# their modules in LONGEST_FIRST order (tests/serving/__init__.py)
SHARED_PACKAGES = ("tests/serving",)


def pytest_collection_modifyitems(config, items):
    rank = {name: i for i, name in enumerate(LONGEST_FIRST)}
    items.sort(key=lambda item: rank.get(item.module.__name__.rsplit(".", 1)[-1], len(rank)))


@pytest.hookimpl(optionalhook=True, tryfirst=True)
def pytest_xdist_make_scheduler(config, log):
    """`--dist loadfile` (one module per worker at a time, in LONGEST_FIRST order; a package of SHARED_PACKAGES
    counts as one module), except that a worker never starts a module of ONE_AT_A_TIME while another worker has
    one unfinished: it takes the next module that is not, or waits for it to finish."""
    if config.getvalue("dist") != "loadfile":
        return None
    from xdist.scheduler import LoadFileScheduling

    def exclusive(scope: str) -> bool:
        return scope.rsplit("/", 1)[-1].removesuffix(".py") in ONE_AT_A_TIME

    class OneAtATime(LoadFileScheduling):
        def _split_scope(self, nodeid: str) -> str:
            path = super()._split_scope(nodeid)
            return next((package for package in SHARED_PACKAGES if path.startswith(package + "/")), path)

        def _held_elsewhere(self, node) -> bool:
            return any(exclusive(scope) and not all(done.values())
                       for other, work in self.assigned_work.items() if other is not node
                       for scope, done in work.items())

        def _assign_work_unit(self, node) -> None:
            blocked = self._held_elsewhere(node)
            scope = next((s for s in self.workqueue if not (blocked and exclusive(s))), None)
            if scope is None:  # only such modules left, one running elsewhere: wait (see mark_test_complete)
                return
            work_unit = self.workqueue.pop(scope)
            self.assigned_work.setdefault(node, {})[scope] = work_unit
            collection = self.registered_collections[node]
            node.send_runtest_some([collection.index(nodeid) for nodeid, done in work_unit.items() if not done])

        def mark_test_complete(self, node, item_index, duration=0) -> None:
            super().mark_test_complete(node, item_index, duration)
            for other in self.nodes:  # a waiting worker (nothing pending) may go on now, or shut down
                if other is not node and not other.shutting_down and self._pending_of(self.assigned_work[other]) == 0:
                    self._reschedule(other)

    return OneAtATime(config, log)


_SESSION_TOKENIZER: list = []  # the default model's tokenizer, once the session fixture `tokenizer` has loaded it


@pytest.fixture(scope="module", autouse=True)
def _grammar_vocabulary_per_module():
    """A module that loads a model of its own (a tiny target with its own tokenizer) makes that tokenizer this
    worker's grammar vocabulary (`cluster.core.grammar`); after each module the worker's vocabulary is the default
    model's again, once the session fixture `tokenizer` has loaded it (registering it drops grammars compiled for
    another vocabulary)."""
    yield
    if _SESSION_TOKENIZER:
        grammar.register_tokenizer(_SESSION_TOKENIZER[0])


@pytest.fixture(scope="session")
def model_dir():
    return models.prepare_default_model()


@pytest.fixture(scope="session")
def tokenizer(model_dir):
    loaded = models.load_tokenizer(model_dir)  # registered: this worker's grammar vocabulary
    _SESSION_TOKENIZER.append(loaded)
    return loaded


@pytest.fixture(scope="session")
def target_fp32(model_dir):
    return models.load_causal_lm(model_dir, "float32", "cpu")


@pytest.fixture(scope="session")
def engine_fp32(target_fp32):
    """The fp32 target as the torch engine runs it (`engine.fp32_gemm`: its linear layers of a few rows as W·xᵀ,
    cluster/model/gemm.py), sharing `target_fp32`'s weights. Runners decode on this one; transformers' references
    and exact distributions come from `target_fp32` as loaded, so the lossless tests cover the engine's kernels."""
    return gemm_copy(target_fp32, "test target")


@pytest.fixture(scope="session")
def draft_int8(target_fp32):
    return quantized_copy(target_fp32)


@pytest.fixture(scope="module")
def prompt_ids(request, tokenizer):
    """The test module's PROMPTS [(text, use_chat_template)], encoded."""
    from cluster.model.models import encode_prompt

    return [encode_prompt(tokenizer, text, chat) for text, chat in request.module.PROMPTS]


@pytest.fixture(scope="session")
def references_key(model_dir):
    """What transformers' greedy references depend on besides the prompt: the model's files, torch and transformers."""
    import hashlib
    import json

    import transformers

    files = sorted((p.name, p.stat().st_size, p.stat().st_mtime_ns) for p in Path(model_dir).iterdir() if p.is_file())
    return hashlib.sha256(json.dumps([str(model_dir), (Path(model_dir) / "config.json").read_text(), files,
                                      torch.__version__, transformers.__version__]).encode()).hexdigest()[:16]


@pytest.fixture(scope="module")
def references(request, target_fp32, prompt_ids, references_key):
    """transformers' greedy output for each of the module's prompts, MAX_TOKENS long. Computed by transformers
    in this run or an earlier one: kept in pytest's cache (shared by the xdist workers), keyed by
    `references_key` and each prompt, so that the modules that decode the same prompts compute them once. A
    longer reference serves a shorter request: greedy output of N tokens is the first N of a longer run's (both
    stop at the same EOS)."""
    import hashlib
    import json

    from tests.helpers import greedy_references

    max_tokens = request.module.MAX_TOKENS
    cache = request.config.cache
    out, missing = {}, []
    for ids in prompt_ids:
        key = f"tandem/references/{references_key}/{hashlib.sha256(json.dumps(ids).encode()).hexdigest()[:16]}"
        entry = cache.get(key, None)
        if entry and (entry["max_tokens"] >= max_tokens or len(entry["tokens"]) < entry["max_tokens"]):
            out[tuple(ids)] = entry["tokens"][:max_tokens]  # a run that ended at EOS before its limit is complete
        else:
            missing.append((ids, key))
    if missing:
        computed = greedy_references(target_fp32, [ids for ids, _ in missing], max_tokens)
        for ids, key in missing:
            tokens = computed[tuple(ids)]
            cache.set(key, {"max_tokens": max_tokens, "tokens": tokens})
            out[tuple(ids)] = tokens
    return out


# The runners as the engines `EngineConfig` builds them (`engine.prompt_cache_tokens`): a session whose prompt an
# earlier one on the runner prefilled copies that KV (bit for bit a prefill's, tests/test_prompt_cache.py)
@pytest.fixture()
def target_runner(engine_fp32):
    return TorchModelRunner(engine_fp32, name="target", prompt_cache_tokens=PROMPT_CACHE_TOKENS)


@pytest.fixture()
def draft_runner(draft_int8):
    return TorchModelRunner(draft_int8, name="draft", prompt_cache_tokens=PROMPT_CACHE_TOKENS)
