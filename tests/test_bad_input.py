"""Bad input gets one clear error: engine, config, CLI."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
from tokenizers import Tokenizer, models as tok_models, pre_tokenizers
from transformers import PreTrainedTokenizerFast

from cluster.engine import EngineConfig, make_proposer
from cluster.errors import ConfigError, InvalidRequestError
from cluster.sampling import SamplingParams
from cluster.speculate import SpeculativeDecoder
from tests.helpers import tiny_llama


@pytest.fixture()
def decoder(target_runner, tokenizer):
    return SpeculativeDecoder(target_runner, None, tokenizer, 0)


def test_empty_prompt(decoder):
    with pytest.raises(InvalidRequestError, match="empty"):
        decoder.generate([], SamplingParams())


def test_prompt_longer_than_context(decoder, target_runner):
    with pytest.raises(InvalidRequestError, match="context length"):
        decoder.generate([1] * (target_runner.max_context + 1), SamplingParams(max_tokens=1))
    with pytest.raises(InvalidRequestError, match="context length"):
        decoder.generate([1] * 100, SamplingParams(max_tokens=target_runner.max_context))


def test_out_of_vocabulary_prompt_ids(decoder):
    with pytest.raises(InvalidRequestError, match="token ids"):
        decoder.generate([1, 10**6], SamplingParams())


def test_unknown_proposer_and_bad_config():
    with pytest.raises(ConfigError, match="proposer"):
        EngineConfig.build(proposer="magic")
    with pytest.raises(ConfigError, match="num_speculative_tokens"):
        EngineConfig.build(num_speculative_tokens=-1)
    with pytest.raises(ConfigError, match="dtype"):
        EngineConfig.build(dtype="int3")


def test_draft_with_another_tokenizer_is_refused(tmp_path, target_fp32, tokenizer):
    vocab = {w: i for i, w in enumerate(["[UNK]", "hello", "world", "foo", "bar"])}
    raw = Tokenizer(tok_models.WordLevel(vocab, unk_token="[UNK]"))
    raw.pre_tokenizer = pre_tokenizers.Whitespace()
    PreTrainedTokenizerFast(tokenizer_object=raw, unk_token="[UNK]").save_pretrained(tmp_path)
    tiny_llama(seed=0, vocab_size=5).save_pretrained(tmp_path)
    config = EngineConfig.build(proposer="draft", draft=str(tmp_path), dtype="float32")
    with pytest.raises(ConfigError, match="tokenizer differs"):
        make_proposer(config, target_fp32, tokenizer)


def test_draft_directory_that_is_not_a_model(tmp_path, target_fp32, tokenizer):
    config = EngineConfig.build(proposer="draft", draft=str(tmp_path))
    with pytest.raises(ConfigError, match="config.json"):
        make_proposer(config, target_fp32, tokenizer)


@pytest.mark.parametrize("args,message", [
    (["generate", ""], "prompt is empty"),
    (["generate", "hi", "--max-tokens", "0"], "max_tokens"),
    (["generate", "hi", "--temperature", "-1"], "temperature"),
    (["generate", "hi", "--proposer", "magic"], "proposer"),
    (["generate", "hi", "--top-p", "2"], "top_p"),
])
def test_cli_errors_are_one_line_and_exit_non_zero(args, message):
    proc = subprocess.run([sys.executable, "-m", "cluster.cli", *args], capture_output=True, text=True,
                          timeout=120, env={**os.environ, "HF_HUB_OFFLINE": "1"})
    assert proc.returncode == 2
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    assert lines[-1].startswith("tandem: error:") and message in lines[-1], proc.stderr
    assert "Traceback" not in proc.stderr
