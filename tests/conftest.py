"""Shared fixtures: tiny HF checkpoints (random weights, trained tokenizers) built once per session."""
from __future__ import annotations

import getpass
import os
import sys
import tempfile
from pathlib import Path

import pytest

# Tests run on small CPU tensors: more threads than cores only adds contention.
os.environ.setdefault("OMP_NUM_THREADS", "2")
# One Inductor cache per pytest-xdist worker: two workers compiling the same graph (bigcode and starcoder2 share one)
# at once race on the cache's .so file, and the loser reads it half-written ("file too short") and runs eagerly.
_worker = os.environ.get("PYTEST_XDIST_WORKER")
if _worker:
    _base = os.environ.get("TORCHINDUCTOR_CACHE_DIR") or os.path.join(
        tempfile.gettempdir(), f"torchinductor_{getpass.getuser()}")
    os.environ["TORCHINDUCTOR_CACHE_DIR"] = os.path.join(_base, _worker)


@pytest.fixture(autouse=True, scope="module")
def _fresh_compile_caches():
    """Each test module starts with empty torch.compile caches. Dynamo's recompile limit (64) counts the graphs of
    every model compiled in the process for one code object (LlamaForCausalLM.forward serves dozens of families):
    over a whole suite run it would be reached, and a later compiled test would fall back to eager."""
    yield
    if "torch._dynamo" in sys.modules:
        sys.modules["torch._dynamo"].reset()


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
