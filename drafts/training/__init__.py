"""Draft training: distillation (small drafts, feature-fed drafts) and validation."""

from __future__ import annotations

import functools

import torch


def restores_torch_threads(fn):
    """Run a training entry point with `config.threads` torch threads (its `config` argument, the fourth
    positional or a keyword) and give the caller's thread count back afterwards: a test process or a
    server that trains a draft keeps the threads it chose."""
    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        config = kwargs["config"] if "config" in kwargs else args[3]
        before = torch.get_num_threads()
        torch.set_num_threads(config.threads)
        try:
            return fn(*args, **kwargs)
        finally:
            torch.set_num_threads(before)
    return wrapper

