"""Issue 49's smaller items: no token emitted outside a request's rules when they leave none, a bounded waiting
queue by default, and the Anthropic-style `x-api-key` header."""
from __future__ import annotations

import pytest
import torch

from streamer import LLM, SamplingParams
from streamer.worker.sampler import PenaltyBatch, Sampler, SamplingBatch, apply_penalties


def _batch(B: int, V: int, *, banned=None, penalties=None, temperature: float = 1.0) -> SamplingBatch:
    return SamplingBatch(temperature=torch.full((B,), temperature), top_k=None, top_p=None, min_p=None,
                         generators=[None] * B, all_greedy=temperature == 0, any_seeded=False, banned=banned,
                         penalties=penalties, max_logprobs=-1)


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_a_row_with_every_token_banned_samples_minus_one(temperature):
    V = 16
    logits = torch.randn(3, V)
    rows = torch.tensor([1] * V)  # row 1: every token banned; rows 0 and 2 untouched
    out = Sampler()(logits, _batch(3, V, banned=(rows, torch.arange(V)), temperature=temperature))
    tokens = out.token_ids.tolist()
    assert tokens[1] == -1
    assert 0 <= tokens[0] < V and 0 <= tokens[2] < V


def test_a_tiny_repetition_penalty_samples_among_the_overflowed_tokens():
    V = 32
    logits = torch.full((1, V), -1.0)
    logits[0, [5, 9]] = 2.0  # seen, positive: divided by 1e-45 they overflow to +inf
    seen = torch.zeros(1, V, dtype=torch.bool)
    seen[0, [5, 9, 11]] = True
    pen = PenaltyBatch(torch.zeros(1, 1), torch.zeros(1, 1), torch.full((1, 1), 1e-45), torch.zeros(1, V), seen)
    assert torch.isposinf(torch.where(logits > 0, logits / 1e-45, logits)).any()  # (what the fix guards)
    penalised = apply_penalties(logits, pen)
    assert not torch.isnan(penalised.softmax(-1)).any()
    drawn = {Sampler()(logits.clone(), _batch(1, V, penalties=pen)).token_ids.item() for _ in range(40)}
    assert drawn <= {5, 9} and drawn


@pytest.fixture(scope="module")
def llm(llama_dir):
    return LLM(str(llama_dir), dtype="float32", num_kv_blocks=64)


def test_allowed_tokens_all_bad_words_is_refused(llm):
    tok = llm.engine.tokenizer
    t = tok.encode("hello", add_special_tokens=False)[0]
    with pytest.raises(ValueError, match="allowed_token_ids"):
        llm.generate("hi", SamplingParams(max_tokens=3, allowed_token_ids=[t], bad_words=[tok.decode([t])]))


def test_a_request_left_no_token_stops_with_a_reason(llm, monkeypatch):
    """Whatever leaves a row no token at run time (here: every token banned, as bad_words' sequences can), the
    output stops with stop_reason "no_token_allowed" instead of emitting token 0."""
    from streamer.worker import model_runner
    real = model_runner.bad_word_bans

    def ban_everything(seqs, output):
        return list(range(llm.engine.vocab_size)) if output else real(seqs, output)

    monkeypatch.setattr(model_runner, "bad_word_bans", ban_everything)
    for temperature in (0.0, 0.8):
        out = llm.generate("hello", SamplingParams(max_tokens=5, bad_words=["zzz"], temperature=temperature,
                                                   ignore_eos=True))[0].outputs[0]
        assert len(out.token_ids) == 1 and 0 not in out.token_ids[1:]
        assert out.finish_reason == "stop" and out.stop_reason == "no_token_allowed"
    ok = llm.generate("hello", SamplingParams(max_tokens=3, temperature=0, ignore_eos=True))[0].outputs[0]
    assert len(ok.token_ids) == 3


def test_serve_bounds_the_waiting_queue_by_default(monkeypatch):
    """`streamer serve` without --max-waiting still bounds the queue (it used to grow without end)."""
    import streamer.server.cli as server_cli
    from streamer.cli import main
    seen: dict = {}

    async def fake_serve(args, api_key, kwargs):
        seen.update(kwargs)
        return 0

    monkeypatch.setattr(server_cli, "_serve", fake_serve)
    assert main(["serve", "--enforce-eager"]) == 0
    assert seen["max_waiting"] == server_cli.DEFAULT_MAX_WAITING > 0
    assert main(["serve", "--enforce-eager", "--max-waiting", "7"]) == 0 and seen["max_waiting"] == 7
