"""The torch backend's windowed prefill by row blocks (TorchAttentionBackend._windowed_by_rows): a long prompt under
a sliding window or chunked attention runs a block of queries at a time over only the keys the block can see. Here
the block is shrunk to 4 rows so that the tiny test models' prompts take that path, whole and in chunks after a
cached prefix: greedy tokens equal transformers' for a sliding-window Mistral, Gemma 3's local layers and Llama 4's
chunked attention (ModernBERT's two-sided window: tests/test_encoders.py)."""
from __future__ import annotations

import pytest

import streamer.attention.torch_backend as tb
from streamer import LLM
from tests.checkpoints import hf_greedy
from tests.parity import greedy, random_prompts

pytest.importorskip("transformers")

PROMPTS = random_prompts(4, seed=11, min_len=30, max_len=60)
MAX_NEW = 6
CASES = {"mistral_sw": dict(family="mistral", sliding_window=8), "gemma3": dict(family="gemma3"),
         "llama4": dict(family="llama4")}


@pytest.fixture(scope="module")
def ckpt(make_ckpt):
    return lambda name: make_ckpt(f"rows_{name}", **CASES[name])


@pytest.mark.parametrize("name", list(CASES))
@pytest.mark.parametrize("kw", [{}, {"max_num_batched_tokens": 16, "block_size": 8}], ids=["whole", "chunked"])
def test_windowed_rows_match_transformers(ckpt, name, kw, monkeypatch):
    monkeypatch.setattr(tb, "WINDOW_ROWS", 4)
    calls = []
    real = tb.TorchAttentionBackend._windowed_by_rows
    monkeypatch.setattr(tb.TorchAttentionBackend, "_windowed_by_rows",
                        lambda self, *a: calls.append(1) or real(self, *a))
    want = hf_greedy(ckpt(name), PROMPTS, MAX_NEW)
    with LLM(str(ckpt(name)), dtype="float32", **kw) as llm:
        assert greedy(llm, PROMPTS, MAX_NEW) == want
        assert llm.engine.kv.pool.num_free == llm.engine.kv.num_blocks
    assert calls  # (the path under test ran)
