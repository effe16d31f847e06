"""Speculative decoding with a draft model (streamer/spec_decode/draft_model.py): greedy output identical to transformers'
with drafts that are always right, often right or mostly wrong; chunked prefill, catch-up in chunks, preemption;
sampled requests; bad drafts refused; the server."""
from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import openai
import pytest
from safetensors.torch import load_file, save_file

from streamer import LLM, SamplingParams
from streamer.spec_decode.draft_model import plan_drafts
from streamer.worker.input_batch import StepInputs
from tests.checkpoints import hf_greedy
from tests.server_utils import LiveServer, metric

PROMPTS = [[5, 6, 7, 8, 9, 5, 6, 7, 8, 9, 5, 6], list(range(20, 40)) * 3, [7, 7, 7, 7, 7, 7],
           [300, 12, 450, 3], list(range(100, 190))]
MAX_NEW = 30
GREEDY = SamplingParams(max_tokens=MAX_NEW, temperature=0.0, ignore_eos=True)


def first_layers(model_dir: Path, out: Path, keep: int) -> Path:
    """A draft cut from the target: its embeddings, head and first `keep` layers (a self-speculative draft)."""
    out.mkdir(parents=True, exist_ok=True)
    for f in model_dir.iterdir():
        if f.suffix != ".safetensors":
            shutil.copy(f, out / f.name)
    cfg = json.loads((model_dir / "config.json").read_text())
    cfg["num_hidden_layers"] = keep
    (out / "config.json").write_text(json.dumps(cfg))
    weights = {k: v for f in model_dir.glob("*.safetensors") for k, v in load_file(f).items()
               if not k.startswith("model.layers.") or int(k.split(".")[2]) < keep}
    save_file(weights, out / "model.safetensors", metadata={"format": "pt"})
    return out


@pytest.fixture(scope="module")
def cut_draft(llama_dir, tmp_path_factory) -> Path:
    return first_layers(llama_dir, tmp_path_factory.mktemp("draft") / "llama-1layer", 1)


@pytest.fixture(scope="module")
def expected(llama_dir) -> list[list[int]]:
    return hf_greedy(llama_dir, PROMPTS, MAX_NEW)


def _generate(target: Path, draft: Path, **engine_args) -> tuple[list[list[int]], LLM]:
    llm = LLM(str(target), dtype="float32", speculative_model=str(draft), num_speculative_tokens=3, **engine_args)
    outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], GREEDY)
    return [o.outputs[0].token_ids for o in outs], llm


def _pool_whole(llm: LLM) -> None:
    e = llm.engine
    e.scheduler.check_invariants()
    assert e.kv.pool.num_free == e.kv.num_blocks and not e.seqs and not e.groups


@pytest.mark.parametrize("engine_args", [{}, {"num_kv_blocks": 16, "block_size": 8, "max_num_batched_tokens": 16}],
                         ids=["plain", "preempting-chunked"])
def test_the_target_as_its_own_draft_is_always_right(llama_dir, expected, engine_args):
    """Only a draft whose KV is right proposes what the target samples: this fails if the draft's KV is not
    caught up, not recomputed after a preemption or kept past a rejected proposal."""
    tokens, llm = _generate(llama_dir, llama_dir, **engine_args)
    assert tokens == expected
    e = llm.engine
    # Drafts of the same weights agree with the target (up to float ties): nearly k + 1 tokens a step.
    assert e.num_draft_tokens > 0 and e.num_accepted_tokens >= 0.95 * e.num_draft_tokens
    if engine_args:
        assert e.scheduler.num_preemptions > 0
    else:
        assert e.num_steps < len(PROMPTS) * MAX_NEW / 3
    _pool_whole(llm)
    llm.close()


@pytest.mark.parametrize("engine_args", [
    {},
    {"max_num_batched_tokens": 12},  # chunked prefill; the draft catches up on the prompts in chunks too
    {"num_kv_blocks": 16, "block_size": 8},  # preemption: the draft's KV goes with the blocks
], ids=["plain", "chunked", "preempting"])
def test_greedy_matches_transformers_with_a_cut_draft(llama_dir, cut_draft, expected, engine_args):
    tokens, llm = _generate(llama_dir, cut_draft, **engine_args)
    assert tokens == expected
    e = llm.engine
    assert 0 < e.num_accepted_tokens < e.num_draft_tokens  # both outcomes happened
    if "num_kv_blocks" in engine_args:
        assert e.scheduler.num_preemptions > 0
    _pool_whole(llm)
    llm.close()


def test_the_draft_never_claims_kv_past_a_rejected_proposal(llama_dir, cut_draft):
    """After each verification the draft holds KV only for positions whose tokens are the sequence's."""
    with LLM(str(llama_dir), dtype="float32", speculative_model=str(cut_draft), num_speculative_tokens=3) as llm:
        e = llm.engine
        for i, p in enumerate(PROMPTS):
            e.add_request(f"r{i}", {"prompt_token_ids": p}, GREEDY)
        rejected = 0
        while e.has_unfinished():
            before = e.num_draft_tokens - e.num_accepted_tokens
            e.step()
            rejected += (e.num_draft_tokens - e.num_accepted_tokens) > before
            for req in e.scheduler.running:
                assert req.num_draft_computed <= req.num_tokens - 1
        assert rejected > 0
        _pool_whole(llm)


def test_a_wrong_draft_costs_speed_not_correctness(llama_dir, make_ckpt, expected):
    other = make_ckpt("llama-draft-seed7", family="llama", num_hidden_layers=1, seed=7)
    tokens, llm = _generate(llama_dir, other)
    assert tokens == expected
    assert llm.engine.num_draft_tokens > 0
    _pool_whole(llm)
    llm.close()


def test_sampled_requests_run_and_finish(llama_dir, cut_draft):
    with LLM(str(llama_dir), dtype="float32", speculative_model=str(cut_draft), num_speculative_tokens=4) as llm:
        params = SamplingParams(max_tokens=25, temperature=1.0, top_p=0.9, seed=3, ignore_eos=True)
        outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], params)
        again = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], params)
        assert all(len(o.outputs[0].token_ids) == 25 for o in outs)
        vocab = llm.engine.vocab_size
        assert all(0 <= t < vocab for o in outs for t in o.outputs[0].token_ids)
        # Seeded: the same tokens again, whatever was accepted (accepted drafts equal the tokens drawn).
        assert [o.outputs[0].token_ids for o in outs] == [o.outputs[0].token_ids for o in again]
        assert llm.engine.num_accepted_tokens > 0
        _pool_whole(llm)


def test_plan_places_each_proposal_after_its_request_known_tokens():
    # Two decoding requests with 2 and 3 drafts after a prefill chunk of 4 (no drafts); block size 4.
    q_lens = np.array([4, 3, 4])
    seq_lens = np.array([4, 9, 13])
    qsl = np.concatenate([[0], np.cumsum(q_lens)])
    table = np.array([[7, 0, 0, 0], [1, 2, 3, 0], [4, 5, 6, 8]], dtype=np.int32)
    step = StepInputs(req_ids=["a", "b", "c"], rows=np.arange(3), epochs=np.zeros(3, dtype=np.int64),
                      input_ids=np.zeros(11, dtype=np.int64), positions=np.zeros(11, dtype=np.int64),
                      query_start_loc=qsl, seq_lens=seq_lens, block_table=table,
                      slot_mapping=np.zeros(11, dtype=np.int64), sample_idx=np.zeros(0, dtype=np.int64),
                      sampling=None)  # type: ignore[arg-type]
    tokens = np.arange(3 * 16).reshape(3, 16)
    plan = plan_drafts(step, np.array([0, 2, 3]), tokens, np.array([0, 3, 9]), 4, budget=2)
    assert plan.req_ids == ["b", "c"] and plan.counts.tolist() == [2, 3]
    # b: known up to position 6 (9 - 2 - 1), drafts at 7, 8 = flat 5, 6; c: known up to 9, drafts at flat 8-10.
    assert plan.target_idx.tolist() == [5, 6, 8, 9, 10]
    assert plan.source_idx.tolist() == [0, 1, 3, 4, 5]
    # Catch-up: b's positions 3..5 and nothing of c (computed 9 = its last known position), 2 tokens a chunk.
    assert [c.positions.tolist() for c in plan.catch_up] == [[3, 4], [5]]
    assert [c.input_ids.tolist() for c in plan.catch_up] == [[19, 20], [21]]
    assert plan.catch_up[0].slot_mapping.tolist() == [1 * 4 + 3, 2 * 4 + 0]  # b: blocks 1, 2, 3
    # Pass 0 feeds the last known tokens at their positions; pass 2 only c, from the device.
    assert plan.passes[0].input_ids.tolist() == [22, 41] and plan.passes[0].positions.tolist() == [6, 9]
    assert [m.tolist() for m in plan.members] == [[0, 1], [0, 1], [1]]
    assert plan.passes[2].positions.tolist() == [11] and plan.passes[2].pending_rows.tolist() == [1]
    assert plan.passes[2].slot_mapping.tolist() == [6 * 4 + 3]


def test_bad_drafts_are_refused(llama_dir, make_ckpt, tmp_path):
    with pytest.raises(ValueError, match="num_speculative_tokens"):
        LLM(str(llama_dir), speculative_model=str(llama_dir))
    other_tok = make_ckpt("llama-spm", family="llama", tokenizer="sentencepiece")
    with pytest.raises(ValueError, match="speculative_model"):
        LLM(str(llama_dir), dtype="float32", speculative_model=str(other_tok), num_speculative_tokens=2)
    with pytest.raises(FileNotFoundError):
        LLM(str(llama_dir), dtype="float32", speculative_model=str(tmp_path / "none"), num_speculative_tokens=2)


def test_server_with_a_draft_model(llama_dir, cut_draft, expected):
    with LiveServer(llama_dir, speculative_model=str(cut_draft), num_speculative_tokens=3) as server:
        client = openai.OpenAI(base_url=server.base_url, api_key="none")
        for prompt, want in zip(PROMPTS[:3], expected[:3]):
            out = client.completions.create(model=server.model_name, prompt=prompt, max_tokens=MAX_NEW,
                                            temperature=0.0, extra_body={"ignore_eos": True, "return_token_ids": True})
            assert out.choices[0].token_ids == want
        import httpx
        prom = httpx.get(server.url + "/metrics", timeout=30).text
        assert metric(prom, "vllm:spec_decode_num_accepted_tokens_total") > 0
        server.wait_idle()
