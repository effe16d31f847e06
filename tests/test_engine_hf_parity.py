"""Greedy tokens identical to transformers (fp32) for every family, batch shape, chunking and pool size."""
from __future__ import annotations

import random

import pytest
import torch

from streamer import LLM, SamplingParams
from tests.checkpoints import FAMILIES, hf_greedy

MAX_NEW = 12


def _prompts(n: int, seed: int, vocab: int = 500, max_len: int = 60) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, vocab) for _ in range(rng.randrange(1, max_len))] for _ in range(n)]


def _greedy(llm: LLM, prompts: list[list[int]], max_tokens: int = MAX_NEW) -> list[list[int]]:
    # min_tokens = max_tokens bans EOS at every position, as hf_greedy's min_new_tokens does (ignore_eos alone
    # would let EOS be the argmax, where transformers picks the next best token).
    params = SamplingParams(max_tokens=max_tokens, min_tokens=max_tokens, temperature=0.0)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params)
    return [o.outputs[0].token_ids for o in outs]


def _assert_pool_whole(llm: LLM) -> None:
    e = llm.engine
    e.scheduler.check_invariants()
    assert e.kv.pool.num_free == e.kv.num_blocks
    assert not e.seqs and not e.groups


@pytest.fixture(scope="module")
def batch16() -> list[list[int]]:
    return _prompts(16, seed=1)


@pytest.mark.parametrize("family", FAMILIES)
def test_family_matches_transformers(make_ckpt, family, batch16):
    path = make_ckpt(family, family=family)
    ref = hf_greedy(path, batch16, MAX_NEW)
    llm = LLM(str(path), dtype="float32")
    assert _greedy(llm, batch16) == ref  # one batch of 16 mixed-length prompts
    for p, r in zip(batch16[:3], ref[:3]):  # and single prompts
        assert _greedy(llm, [p]) == [r]
    assert len({tuple(r) for r in ref}) > 4, "degenerate reference: the test would not discriminate"
    # (nor would continuations that mostly repeat the prompt's last token, as a random tied head tends to)
    assert sum(len(set(r)) for r in ref) > 2 * len(ref), "degenerate reference: continuations repeat one token"
    _assert_pool_whole(llm)


@pytest.fixture(scope="module")
def llama_ref(llama_dir, batch16):
    return hf_greedy(llama_dir, batch16, MAX_NEW)


@pytest.mark.parametrize("engine_args", [
    dict(max_num_batched_tokens=5),  # chunked prefill: prompts split over many steps, mixed with decodes
    dict(max_num_batched_tokens=7, num_kv_blocks=6, block_size=16),  # preemption + chunking
    dict(num_kv_blocks=12, block_size=8),  # small pool: preemption by recompute
    dict(num_kv_blocks=12, block_size=8, enable_prefix_caching=False),
    dict(block_size=1),
    dict(block_size=32),
    dict(max_num_seqs=3),
], ids=lambda d: ",".join(f"{k}={v}" for k, v in d.items()))
def test_scheduling_variants_match(llama_dir, batch16, llama_ref, engine_args):
    llm = LLM(str(llama_dir), dtype="float32", **engine_args)
    assert _greedy(llm, batch16) == llama_ref
    _assert_pool_whole(llm)
    if engine_args.get("num_kv_blocks", 1000) < 16:
        assert llm.engine.scheduler.num_preemptions > 0, "the pool was meant to run dry"


@pytest.mark.parametrize("family", ["llama", "qwen3", "mistral"])
def test_attention_bias_matches_transformers(make_ckpt, family):
    """attention_bias puts biases on q/k/v, and on o_proj too except where transformers hard-codes none
    (Mistral's): a wrong guess either fails to load or changes the tokens."""
    path = make_ckpt(f"{family}_attn_bias", family=family, attention_bias=True)
    prompts = _prompts(4, seed=5, max_len=30)
    assert _greedy(LLM(str(path), dtype="float32"), prompts) == hf_greedy(path, prompts, MAX_NEW)


def test_sliding_window_mistral(make_ckpt):
    path = make_ckpt("mistral_sw", family="mistral", sliding_window=8)
    prompts = _prompts(4, seed=3, max_len=30)
    ref = hf_greedy(path, prompts, MAX_NEW)
    assert _greedy(LLM(str(path), dtype="float32"), prompts) == ref
    assert _greedy(LLM(str(path), dtype="float32", max_num_batched_tokens=4, block_size=4), prompts) == ref


def test_sharded_checkpoint_and_bf16(make_ckpt, monkeypatch):
    path = make_ckpt("llama_sharded", family="llama", max_shard_size="20KB", seed=5)
    assert (path / "model.safetensors.index.json").exists()
    prompts = _prompts(3, seed=4)
    assert _greedy(LLM(str(path), dtype="float32"), prompts) == hf_greedy(path, prompts, MAX_NEW)
    bf16 = make_ckpt("qwen2_bf16", family="qwen2", dtype=torch.bfloat16, seed=6)
    # dtype auto -> bfloat16 from the checkpoint, on a CPU with native bf16 (said to be, on any test machine; one
    # without runs it in float32: tests/test_model_loading.py)
    monkeypatch.setattr("streamer.worker.model_runner.cpu_native_dtypes", lambda: frozenset({torch.bfloat16}))
    llm = LLM(str(bf16))
    assert llm.engine.runner.dtype == torch.bfloat16
    out = _greedy(llm, prompts)
    assert all(len(o) == MAX_NEW for o in out)
    # The same bf16 weights upcast to fp32 match transformers doing the same.
    assert _greedy(LLM(str(bf16), dtype="float32"), prompts) == hf_greedy(bf16, prompts, MAX_NEW)


def test_text_prompts_with_sentencepiece_tokenizer(make_ckpt):
    """A Llama-2/Mistral-style tokenizer (Metaspace, byte fallback): text in, text out, same tokens as HF."""
    import transformers as tf
    path = make_ckpt("mistral_sp", family="mistral", tokenizer="sentencepiece", seed=11)
    texts = ["Hello world", "def f(x):\n    return x", "日本語のテキスト", "emoji 🙂 ok"]
    hf_tok = tf.AutoTokenizer.from_pretrained(path)
    llm = LLM(str(path), dtype="float32")
    ids = [llm.tokenizer.encode(t) for t in texts]
    assert ids == [hf_tok(t)["input_ids"] for t in texts]
    ref = hf_greedy(path, ids, MAX_NEW)
    outs = llm.generate(texts, SamplingParams(max_tokens=MAX_NEW, temperature=0.0, ignore_eos=True))
    for o, r, p in zip(outs, ref, ids):
        assert o.prompt_token_ids == p and o.outputs[0].token_ids == r
        full = llm.tokenizer.decode(p + r)
        assert o.outputs[0].text == full[len(llm.tokenizer.decode(p)):] or "\ufffd" in full


@pytest.mark.parametrize("engine_args", [
    dict(max_num_batched_tokens=5),  # each prompt scored over several chunks
    dict(num_kv_blocks=12, block_size=8),  # preempted requests recompute their prompts: scored once all the same
], ids=["chunked", "preemption"])
def test_prompt_logprobs_match_transformers(llama_dir, batch16, engine_args):
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(llama_dir, dtype=torch.float32)
    llm = LLM(str(llama_dir), dtype="float32", **engine_args)
    prompts = batch16[:8]
    _greedy(llm, prompts)  # the prompts are in the prefix cache now: scoring must compute them anyway
    params = SamplingParams(max_tokens=MAX_NEW, temperature=0.0, ignore_eos=True, prompt_logprobs=3)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params)
    if "num_kv_blocks" in engine_args:
        assert llm.engine.scheduler.num_preemptions > 0, "the pool was meant to run dry"
    for p, out in zip(prompts, outs):
        with torch.no_grad():
            want = model(torch.tensor([p])).logits[0].log_softmax(-1)
        got = out.prompt_logprobs
        assert got is not None and len(got) == len(p) and got[0] is None
        for i in range(1, len(p)):
            entry = got[i]
            assert abs(entry[p[i]].logprob - want[i - 1, p[i]].item()) < 1e-4
            assert entry[p[i]].rank == int((want[i - 1] > want[i - 1, p[i]]).sum()) + 1
            assert {t for t, lp in entry.items() if lp.rank <= 3} == set(want[i - 1].topk(3).indices.tolist())
    _assert_pool_whole(llm)


def _longrope_ckpt(make_ckpt, partial_rotary_factor: float = 1.0):
    """partial_rotary_factor < 1: Phi-4-mini's kind, the factors cover only the rotated dims."""
    half = int(16 * partial_rotary_factor) // 2  # head_dim 16
    name = "phi3_longrope" if partial_rotary_factor == 1.0 else f"phi3_longrope_partial{partial_rotary_factor}"
    extra = {} if partial_rotary_factor == 1.0 else {"partial_rotary_factor": partial_rotary_factor}
    return make_ckpt(name, family="phi3", max_position_embeddings=64, sliding_window=None,
                     original_max_position_embeddings=16,
                     rope_scaling={"type": "longrope", "short_factor": [1.0 + 0.1 * i for i in range(half)],
                                   "long_factor": [1.0 + 2.0 * i for i in range(half)]}, **extra)


def test_phi3_longrope_with_prefix_caching(make_ckpt):
    """A block's KV depends on the rotary factors too, so a LongRoPE request's blocks are hashed with the factors
    it uses: prompts that share a 12-token prefix, one short, one long from the start, one crossing the threshold
    while decoding (it recomputes in fresh blocks), batched, repeated (cache hits) and with a pool so small that
    requests are preempted."""
    path = _longrope_ckpt(make_ckpt)
    base = list(range(3, 15))
    prompts = [base + [20, 21], base + list(range(30, 40)), base + [50, 51, 52]]
    ref = hf_greedy(path, prompts, 12)
    with LLM(str(path), dtype="float32", block_size=4) as llm:
        assert _greedy(llm, prompts, 12) == ref
        hits = llm.engine.kv.prefix_hits
        assert [_greedy(llm, [p], 12)[0] for p in reversed(prompts)] == ref[::-1]
        assert llm.engine.kv.prefix_hits > hits
        _assert_pool_whole(llm)
    with LLM(str(path), dtype="float32", block_size=4, num_kv_blocks=12, max_num_batched_tokens=8) as llm:
        assert _greedy(llm, prompts + prompts, 12) == ref + ref
        assert llm.engine.scheduler.num_preemptions > 0
        _assert_pool_whole(llm)


@pytest.mark.parametrize("partial_rotary_factor", [1.0, 0.5], ids=["full", "partial"])
def test_phi3_longrope(make_ckpt, partial_rotary_factor):
    """LongRoPE (Phi-3 128k, Phi-3.5; Phi-4-mini with partial rotary): sequences past original_max_position_embeddings
    rotate with the long factors, decided as transformers decides, by the sequence's length when a token is
    computed. Prompts below, across and past the 16-token threshold; decoding crosses it too; and one batch mixes
    them."""
    path = _longrope_ckpt(make_ckpt, partial_rotary_factor)
    prompts = [list(range(3, 3 + n)) for n in (4, 12, 17, 30)]
    ref = hf_greedy(path, prompts, 20)
    llm = LLM(str(path), dtype="float32")
    assert _greedy(llm, prompts, 20) == ref
    assert [_greedy(llm, [p], 20)[0] for p in prompts] == ref
    # The long table matters here: the same model with the short factors everywhere differs.
    assert llm.engine.runner.model.long_rope == (16, 64)
    assert llm.engine.runner.model.layers[0].self_attn.rotary.cos_sin_cache.shape[-1] == 16 * partial_rotary_factor
    _assert_pool_whole(llm)


@pytest.mark.parametrize("family", ["gemma3", "qwen3_moe", "mixtral", "gemma2", "gpt_oss", "olmo2", "phi4_mini",
                                    "granite"])
def test_compiled_with_drafts_matches_transformers(make_ckpt, family, batch16):
    """The families whose layers differ most from Llama's (Gemma 3: per-layer windows and rotary tables;
    Qwen3-MoE: the experts' custom op; Gemma 2: soft-capped attention, in the compiled decode kernel and in the
    graph's inline decode of a lone request; gpt-oss: attention sinks there too, biased experts; OLMo 2: post-norms
    and whole-projection q/k norms; Phi-4-mini: partial rotary with LongRoPE; Granite: its multipliers), compiled
    and with speculative drafts at once."""
    path = make_ckpt(family, family=family)
    prompts = batch16[:6]
    llm = LLM(str(path), dtype="float32", enforce_eager=False, num_speculative_tokens=3, prompt_lookup_min=1)
    assert llm.engine.runner.compiled
    assert _greedy(llm, prompts) == hf_greedy(path, prompts, MAX_NEW)
    assert _greedy(llm, prompts[:1]) == hf_greedy(path, prompts[:1], MAX_NEW)
    assert llm.engine.num_draft_tokens > 0 and llm.engine.runner.compiled  # no eager fallback on the way
    _assert_pool_whole(llm)


@pytest.mark.parametrize("family,act", [("llama", "gelu_pytorch_tanh"), ("qwen2", "gelu"), ("mistral", "gelu_new")])
def test_gelu_gated_mlp_matches_transformers(make_ckpt, family, act, batch16):
    """A Llama-style config with a GELU `hidden_act` runs GELU(gate) * up, as transformers' ACT2FN does (it once
    ran SiLU whatever the config said)."""
    path = make_ckpt(f"{family}_{act}", family=family, hidden_act=act)
    ref = hf_greedy(path, batch16[:6], MAX_NEW)
    silu_ref = hf_greedy(make_ckpt(family, family=family), batch16[:6], MAX_NEW)
    assert ref != silu_ref, "the activation made no difference: the test would not discriminate"
    assert _greedy(LLM(str(path), dtype="float32"), batch16[:6]) == ref


def test_unsupported_mlp_activation_refused(make_ckpt):
    path = make_ckpt("llama_relu", family="llama", hidden_act="relu")
    with pytest.raises(ValueError, match="hidden_act 'relu'"):
        LLM(str(path), dtype="float32")
