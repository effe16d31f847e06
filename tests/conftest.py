"""Shared fixtures: tiny HF checkpoints (random weights, trained tokenizers) built once per session."""
from __future__ import annotations

import os
from pathlib import Path

import pytest

# Tests run on small CPU tensors: more threads than cores only adds contention.
os.environ.setdefault("OMP_NUM_THREADS", "2")


@pytest.fixture(scope="session")
def ckpt_root(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("ckpts")


def _ckpt(root: Path, name: str, **kw) -> Path:
    from tests.checkpoints import make_checkpoint
    path = root / name
    if not (path / "config.json").exists():
        make_checkpoint(path, **kw)
    return path


@pytest.fixture(scope="session")
def llama_dir(ckpt_root) -> Path:
    return _ckpt(ckpt_root, "llama", family="llama")


@pytest.fixture(scope="session")
def make_ckpt(ckpt_root):
    """Build (once) and return a checkpoint folder: make_ckpt(name, family=..., **overrides)."""
    def make(name: str, **kw) -> Path:
        return _ckpt(ckpt_root, name, **kw)
    return make
