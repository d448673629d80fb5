"""Shared fixtures. Everything runs on CPU with the real SmolLM2 weights (fp32 for exactness)."""

from __future__ import annotations

import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import pytest
import torch

from cluster.model import models
from cluster.model.runner import TorchModelRunner
from drafts.draft_model import quantized_copy

# `make test` runs two pytest workers (pytest-xdist, one module per worker at a time) on this 2-core
# machine: one torch thread each (a decode step is as fast on one thread as on two here).
_WORKER = os.environ.get("PYTEST_XDIST_WORKER")
torch.set_num_threads(int(os.environ.get("TANDEM_TEST_THREADS", "1" if _WORKER else "2")))

# The longest modules first (measured: a clean-clone run, --durations; `make test` keeps this order with
# --no-loadscope-reorder, xdist would otherwise start the modules with the most tests), so that two workers finish
# together instead of one running the last long module alone.
LONGEST_FIRST = ("test_greedy_equality", "test_distributed", "test_failover", "test_sampling_e2e", "test_vllm",
                 "test_serving", "test_drafts", "test_hybrid", "test_vllm_serving", "test_bad_input",
                 "test_feature_draft", "test_fuzz", "test_feature_serving", "test_logprobs", "test_processors")


def pytest_collection_modifyitems(config, items):
    rank = {name: i for i, name in enumerate(LONGEST_FIRST)}
    items.sort(key=lambda item: rank.get(item.module.__name__.rsplit(".", 1)[-1], len(rank)))


@pytest.fixture(scope="session")
def model_dir():
    return models.prepare_default_model()


@pytest.fixture(scope="session")
def tokenizer(model_dir):
    return models.load_tokenizer(model_dir)


@pytest.fixture(scope="session")
def target_fp32(model_dir):
    return models.load_causal_lm(model_dir, "float32", "cpu")


@pytest.fixture(scope="session")
def draft_int8(target_fp32):
    return quantized_copy(target_fp32)


@pytest.fixture(scope="module")
def prompt_ids(request, tokenizer):
    """The test module's PROMPTS [(text, use_chat_template)], encoded."""
    from cluster.model.models import encode_prompt

    return [encode_prompt(tokenizer, text, chat) for text, chat in request.module.PROMPTS]


@pytest.fixture(scope="module")
def references(request, target_fp32, prompt_ids):
    """transformers' greedy output for each of the module's prompts, MAX_TOKENS long."""
    from tests.helpers import greedy_references

    return greedy_references(target_fp32, prompt_ids, request.module.MAX_TOKENS)


@pytest.fixture()
def target_runner(target_fp32):
    return TorchModelRunner(target_fp32, name="target")


@pytest.fixture()
def draft_runner(draft_int8):
    return TorchModelRunner(draft_int8, name="draft")
