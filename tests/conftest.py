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

torch.set_num_threads(int(os.environ.get("TANDEM_TEST_THREADS", "2")))


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
