"""Benchmark datasets: exact token lengths with the model's tokenizer, shared prefixes, files, seeds."""
from __future__ import annotations

import json
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from tokenizers import Tokenizer

from streamer.bench.datasets import (
    PromptMaker,
    count_tokens,
    file_requests,
    length_range,
    load_tokenizer,
    synthetic_requests,
)
from streamer.bench.testing import make_tokenizer

KINDS = ("bytelevel", "metaspace")


@pytest.fixture(scope="module", params=KINDS)
def tok(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Tokenizer:
    return load_tokenizer(make_tokenizer(tmp_path_factory.mktemp(request.param), request.param))


_TOKS: dict[str, Tokenizer] = {}


def tokenizer(kind: str, tmp: Path) -> Tokenizer:
    if kind not in _TOKS:
        _TOKS[kind] = load_tokenizer(make_tokenizer(tmp / kind, kind))
    return _TOKS[kind]


@settings(max_examples=40, deadline=None)
@given(kind=st.sampled_from(KINDS), input_len=st.integers(1, 300), prefix_len=st.integers(0, 64),
       seed=st.integers(0, 2**32 - 1))
def test_random_prompts_have_exact_lengths(tmp_path_factory: pytest.TempPathFactory, kind: str, input_len: int,
                                           prefix_len: int, seed: int) -> None:
    tk = tokenizer(kind, tmp_path_factory.getbasetemp())
    reqs = synthetic_requests(tk, 6, input_len=input_len, output_len=7, prefix_len=prefix_len, seed=seed)
    prefix = tk.encode(reqs[0].prompt, add_special_tokens=False).ids[:prefix_len]
    for r in reqs:
        ids = tk.encode(r.prompt, add_special_tokens=False).ids
        assert len(ids) == r.prompt_len == prefix_len + input_len
        assert ids[:prefix_len] == prefix  # token-identical shared prefix (what a prefix cache sees)
        assert r.output_len == 7


def test_long_prompts_exact(tok: Tokenizer) -> None:
    for r in synthetic_requests(tok, 3, input_len=2048, output_len=1, seed=1):
        assert count_tokens(tok, r.prompt) == 2048


def test_range_ratio_bounds(tok: Tokenizer) -> None:
    reqs = synthetic_requests(tok, 200, input_len=40, output_len=20, range_ratio=0.5, seed=3)
    ins = [r.prompt_len for r in reqs]
    outs = [r.output_len for r in reqs]
    assert min(ins) >= 20 and max(ins) <= 60 and len(set(ins)) > 10
    assert min(outs) >= 10 and max(outs) <= 30 and len(set(outs)) > 5
    assert all(count_tokens(tok, r.prompt) == r.prompt_len for r in reqs)
    assert length_range(10, 0.25, 1) == (7, 13)
    assert length_range(1, 0.9, 1) == (1, 2)


def test_prefix_groups(tok: Tokenizer) -> None:
    reqs = synthetic_requests(tok, 20, input_len=8, output_len=4, prefix_len=16, num_prefixes=4, seed=5,
                              shuffle=True)
    prefixes = [tuple(tok.encode(r.prompt, add_special_tokens=False).ids[:16]) for r in reqs]
    assert sorted(prefixes.count(p) for p in set(prefixes)) == [5, 5, 5, 5]
    assert all(r.prompt_len == 24 for r in reqs)
    assert prefixes[:5] != [prefixes[0]] * 5 or prefixes[5:10] != [prefixes[5]] * 5  # shuffled, not in blocks


def test_seed_repeats_and_varies(tok: Tokenizer) -> None:
    a = synthetic_requests(tok, 10, input_len=30, output_len=5, range_ratio=0.3, prefix_len=4, seed=11)
    b = synthetic_requests(tok, 10, input_len=30, output_len=5, range_ratio=0.3, prefix_len=4, seed=11)
    c = synthetic_requests(tok, 10, input_len=30, output_len=5, range_ratio=0.3, prefix_len=4, seed=12)
    assert a == b and a != c


def test_special_tokens_never_sampled(tok: Tokenizer) -> None:
    import numpy as np

    maker = PromptMaker(tok, np.random.default_rng(0))
    specials = {tok.token_to_id(t) for t in ("<s>", "</s>", "<unk>")}
    assert specials.isdisjoint(maker.pool.tolist())


def test_file_formats(tmp_path: Path, tok: Tokenizer) -> None:
    sharegpt = [{"id": "1", "conversations": [{"from": "human", "value": "what is a cat"},
                                              {"from": "gpt", "value": "a small furry animal that purrs"}]},
                {"id": "2", "conversations": [{"from": "gpt", "value": "no human turn: skipped"}]},
                {"id": "3", "conversations": [{"from": "human", "value": "only a question"}]}]
    f = tmp_path / "sg.json"
    f.write_text(json.dumps(sharegpt))
    reqs = file_requests(f, 2, tok=tok, shuffle=False)
    assert [r.prompt for r in reqs] == ["what is a cat", "only a question"]
    assert reqs[0].output_len == count_tokens(tok, "a small furry animal that purrs")
    assert reqs[1].output_len == 128  # no reply: the default
    assert reqs[0].prompt_len == count_tokens(tok, "what is a cat")
    assert [r.output_len for r in file_requests(f, 2, tok=tok, output_len=9)] == [9, 9]

    jl = tmp_path / "p.jsonl"
    jl.write_text('"plain string"\n{"prompt": "with len", "output_len": 5}\n{"prompt": "mt", "max_tokens": 3}\n'
                  '{"messages": [{"role": "user", "content": "chat style"}, {"role": "assistant", "content": "ok"}]}\n')
    reqs = file_requests(jl, 4, tok=None, shuffle=False)
    assert [(r.prompt, r.output_len, r.prompt_len) for r in reqs] == [
        ("plain string", 128, 0), ("with len", 5, 0), ("mt", 3, 0), ("chat style", 128, 0)]


def test_file_cycles_and_shuffles_with_seed(tmp_path: Path) -> None:
    f = tmp_path / "p.json"
    f.write_text(json.dumps([f"prompt {i}" for i in range(5)]))
    a = file_requests(f, 12, tok=None, seed=1)
    assert a == file_requests(f, 12, tok=None, seed=1)
    assert [r.prompt for r in a[:5]] != [f"prompt {i}" for i in range(5)] or \
        [r.prompt for r in file_requests(f, 5, tok=None, seed=2)] != [f"prompt {i}" for i in range(5)]
    assert sorted(r.prompt for r in a[:5]) == [f"prompt {i}" for i in range(5)]
    assert [r.prompt for r in a[5:10]] == [r.prompt for r in a[:5]]


def test_file_errors(tmp_path: Path) -> None:
    f = tmp_path / "bad.json"
    f.write_text('{"not": "a list"}')
    with pytest.raises(ValueError, match="expected a JSON list"):
        file_requests(f, 1, tok=None)
    f.write_text("[1, 2]")
    with pytest.raises(ValueError, match="no usable prompts"):
        file_requests(f, 1, tok=None)
    with pytest.raises(FileNotFoundError):
        load_tokenizer(tmp_path)


@pytest.mark.parametrize("factory", ["make_bytelevel_tokenizer", "make_sentencepiece_tokenizer"])
def test_exact_lengths_with_the_projects_test_tokenizers(factory: str, tmp_path: Path) -> None:
    """The Llama-3 / Llama-2 style tokenizers the engine's own tests use (byte fallback, BOS templates)."""
    tf = pytest.importorskip("tests.tokenizer_factory")
    tk = load_tokenizer(getattr(tf, factory)(tmp_path))
    for input_len, prefix_len in [(1, 0), (2, 3), (37, 11), (400, 64)]:
        reqs = synthetic_requests(tk, 12, input_len=input_len, output_len=4, prefix_len=prefix_len,
                                  num_prefixes=3, seed=input_len)
        assert all(count_tokens(tk, r.prompt) == r.prompt_len == input_len + prefix_len for r in reqs)
