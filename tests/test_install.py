"""What `make setup` installs, beyond the packages themselves: their bytecode.

uv (the Makefile's installer) writes no .pyc unless told to, and where PYTHONDONTWRITEBYTECODE is set (CI, the
development machines) Python writes none either: every process (each Ray worker, Serve replica and vLLM engine
process) would then compile Ray, torch, transformers and vLLM from source on every import. Measured: a test Serve
application's start took 59.7 s that way and 21.9 s with the bytecode (BENCHMARKS.md, "The test suite's time").
"""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest

# what every Ray worker or Serve replica of tandem imports
HEAVY = ("ray", "ray.serve", "torch", "transformers", "fastapi", "pydantic", "grpc")


def _cached(module: str) -> bool:
    spec = importlib.util.find_spec(module)
    assert spec is not None and spec.origin is not None, module
    return Path(importlib.util.cache_from_source(spec.origin)).exists()


@pytest.mark.parametrize("module", HEAVY)
def test_installed_packages_come_with_bytecode(module):
    assert Path(sys.prefix) != Path(sys.base_prefix), "the tests run in the venv `make setup` builds"
    assert _cached(module), (f"{module} has no .pyc beside it: this venv was made without bytecode (`make clean "
                             "setup` makes it again; the Makefile installs with UV_COMPILE_BYTECODE)")
