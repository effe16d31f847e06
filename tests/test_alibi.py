"""BLOOM (models/bloom.py), Falcon-RW (models/falcon.py, `alibi: true`) and MPT (models/mpt.py): ALiBi attention (a per-head linear bias on the key's distance, through the backends'
relative-bias table) in prefill chunks and decode, eager and compiled, batched, on the Triton interpreter and under
tensor parallelism, equal to transformers' greedy tokens; the bias matters (the tokens change without it)."""
from __future__ import annotations

import pytest
import torch

from streamer import LLM, SamplingParams
from tests.checkpoints import hf_greedy, register_family
from tests.parity import random_prompts

pytest.importorskip("transformers")


def _bloom_config(**kw):
    import transformers as tf
    return tf.BloomConfig(vocab_size=kw["vocab_size"], hidden_size=kw.get("hidden", 64), n_layer=2,
                          n_head=kw.get("n_head", 4),
                          layer_norm_epsilon=1e-5, tie_word_embeddings=kw.get("tie", True),
                          bos_token_id=kw.get("bos_token_id"),
                          eos_token_id=kw.get("eos_token_id"),
                          apply_residual_connection_post_layernorm=kw.get("post_ln_residual", False))


def _randomise(model) -> None:
    # LayerNorms and biases start at (1, 0) / 0: random ones show each is loaded. (Tied, the tiny model's greedy
    # output repeats its input token whatever the attention does: the parity checkpoints have their own LM head.)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name or "ln_f" in name:
                p.normal_(1.0 if name.endswith("weight") else 0.0, 0.3)
            elif name.endswith("bias"):
                p.normal_(0.0, 0.1)
            else:
                p.normal_(0.0, 0.1)


def _falcon_rw_config(**kw):
    """Falcon-RW's shape: ALiBi (no rotary), sequential layers with two norms, per-head q/k/v, biases."""
    import transformers as tf
    return tf.FalconConfig(vocab_size=kw["vocab_size"], hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                           alibi=True, parallel_attn=False, multi_query=False, new_decoder_architecture=False,
                           bias=True, tie_word_embeddings=False, bos_token_id=kw.get("bos_token_id"),
                           eos_token_id=kw.get("eos_token_id"))


register_family("bloom", _bloom_config, _randomise)
register_family("falcon_rw", _falcon_rw_config, _randomise)
PROMPTS = random_prompts(6, seed=31, max_len=90)
MAX_NEW = 16


@pytest.fixture(scope="module")
def bloom(make_ckpt):
    return make_ckpt("bloom", family="bloom", tie=False)


@pytest.fixture(scope="module")
def want(bloom):
    return hf_greedy(bloom, PROMPTS, MAX_NEW)


def _greedy(path, prompts=PROMPTS, **kw) -> list[list[int]]:
    with LLM(str(path), dtype="float32", **kw) as llm:
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts],
                            SamplingParams(max_tokens=MAX_NEW, min_tokens=MAX_NEW, temperature=0.0))
        assert llm.engine.kv.pool.num_free == llm.engine.kv.num_blocks
        return [o.outputs[0].token_ids for o in outs]


@pytest.mark.parametrize("kw", [{}, {"max_num_batched_tokens": 16, "block_size": 8}, {"enforce_eager": False}],
                         ids=["eager", "chunked", "compiled"])
def test_matches_transformers(bloom, want, kw):
    assert len({tuple(w) for w in want}) == len(want)  # (a reference that tells prompts apart)
    assert _greedy(bloom, **kw) == want
    assert _greedy(bloom, PROMPTS[:1], **kw) == want[:1]  # a lone request (the compiled decode path's)


@pytest.mark.parametrize("kw", [{}, {"max_num_batched_tokens": 16, "block_size": 8}], ids=["whole", "chunked"])
def test_a_bias_mask_made_by_rows(bloom, want, kw, monkeypatch):
    """A prefill whose [heads, q, L] mask is over the budget makes it a few query rows at a time (each reading
    the keys up to its last query): the same tokens."""
    import streamer.attention.torch_backend as tb
    monkeypatch.setattr(tb, "BIAS_MASK_ELEMENTS", 200)
    calls = []
    real = tb.TorchAttentionBackend._biased_by_rows
    monkeypatch.setattr(tb.TorchAttentionBackend, "_biased_by_rows",
                        lambda self, *a: calls.append(1) or real(self, *a))
    assert _greedy(bloom, **kw) == want and calls


@pytest.mark.parametrize("compiled", [False, True])
def test_decode_logprobs_match_transformers(bloom, compiled):
    """Each generated token's logprob (decode steps, where the bias reaches back over the whole context; a lone
    request takes the compiled model's inline decode graph) equals transformers' on the whole sequence."""
    import transformers as tf
    model = tf.AutoModelForCausalLM.from_pretrained(bloom, dtype=torch.float32).eval()
    with LLM(str(bloom), dtype="float32", enforce_eager=not compiled) as llm:
        for prompt in PROMPTS[:2]:
            out = llm.generate({"prompt_token_ids": prompt}, SamplingParams(
                max_tokens=MAX_NEW, min_tokens=MAX_NEW, temperature=0.0, logprobs=3))[0].outputs[0]
            with torch.no_grad():
                want = model(torch.tensor([prompt + out.token_ids])).logits[0].log_softmax(-1)
            for i, lps in enumerate(out.logprobs):
                for tok, lp in lps.items():
                    assert abs(lp.logprob - want[len(prompt) - 1 + i, tok].item()) < 1e-4, (i, tok)


def test_the_bias_matters(bloom, want):
    with LLM(str(bloom), dtype="float32") as llm:
        llm.engine.runner.model.alibi.zero_()
        outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS],
                            SamplingParams(max_tokens=MAX_NEW, min_tokens=MAX_NEW, temperature=0.0))
    assert sum(o.outputs[0].token_ids != w for o, w in zip(outs, want)) >= len(want) // 2


def test_non_power_of_two_heads_post_ln_residuals_tied_head(make_ckpt):
    # 6 heads: 4 slopes from one base, 2 interleaved from the next; residuals taken from each norm's output
    path = make_ckpt("bloom6", family="bloom", n_head=6, hidden=96, post_ln_residual=True, tie=False)
    assert len(_greedy(path, PROMPTS[:1])[0]) == MAX_NEW
    tied = make_ckpt("bloom_tied", family="bloom")
    prompts = PROMPTS[:3]
    assert _greedy(path, prompts) == hf_greedy(path, prompts, MAX_NEW)
    assert _greedy(tied, prompts) == hf_greedy(tied, prompts, MAX_NEW)


def test_tensor_parallel(make_ckpt):
    path = make_ckpt("bloom_tp", family="bloom", seed=2, tie=False)
    prompts = PROMPTS[:3]
    assert _greedy(path, prompts, tensor_parallel_size=2) == hf_greedy(path, prompts, MAX_NEW)


@pytest.mark.parametrize("kw", [{}, {"max_num_batched_tokens": 16, "block_size": 8}], ids=["whole", "chunked"])
def test_falcon_rw_matches_transformers(make_ckpt, kw):
    """Falcon-RW: the same ALiBi, divided by sqrt(head_dim), in a Falcon layer that does not rotate."""
    path = make_ckpt("falcon_rw", family="falcon_rw")
    want = hf_greedy(path, PROMPTS, MAX_NEW)
    assert len({tuple(w) for w in want}) == len(want)
    assert _greedy(path, **kw) == want
    with LLM(str(path), dtype="float32") as llm:
        model = llm.engine.runner.model
        assert model.relative_bias and not model.layers[0].self_attn.use_rope


def _mpt_config(**kw):
    import transformers as tf
    heads = kw.get("n_head", 4)
    return tf.MptConfig(vocab_size=kw["vocab_size"], d_model=16 * heads, n_heads=heads, n_layers=2, max_seq_len=256,
                        tie_word_embeddings=False, attn_config={"alibi_bias_max": 8, "clip_qkv": kw.get("clip")},
                        bos_token_id=kw.get("bos_token_id"), eos_token_id=kw.get("eos_token_id"))


register_family("mpt", _mpt_config, _randomise)


@pytest.mark.parametrize("name, kw", [("mpt", {}), ("mpt6_clip", {"n_head": 6, "clip": 0.3})],
                         ids=["mpt", "six-heads-clip-qkv"])
def test_mpt_matches_transformers(make_ckpt, name, kw):
    """MPT: its own slopes (6 heads: odd ones of the next power of two first), q/k/v clamped by clip_qkv, norms
    without biases, all in one Wqkv; chunked prefill beside decodes."""
    path = make_ckpt(name, family="mpt", **kw)
    want = hf_greedy(path, PROMPTS, MAX_NEW)
    assert len({tuple(w) for w in want}) == len(want)
    assert _greedy(path, max_num_batched_tokens=16, block_size=8) == want


def test_mpt_configs_transformers_cannot_run_are_refused():
    from streamer.models.config import ModelConfig
    base = {"architectures": ["MPTForCausalLM"], "model_type": "mpt", "d_model": 64, "n_heads": 4, "n_layers": 1,
            "vocab_size": 100, "attn_config": {"alibi": True}}
    assert ModelConfig.from_dict(base).num_heads == 4
    for change, field in (({"attn_config": {"alibi": False}}, "alibi"), ({"attn_config": {"qk_ln": True}}, "qk_ln"),
                          ({"no_bias": False}, "no_bias"), ({"expansion_ratio": 2}, "expansion_ratio")):
        with pytest.raises(ValueError, match=field):
            ModelConfig.from_dict({**base, **change})


def test_prefix_cache_hits_and_speculative_drafts_keep_the_tokens(bloom, want):
    """ALiBi's bias reads only distances, so cached K/V of a shared prefix serve as computed, and verify steps (several
    query tokens after a context) take the bias as prefill chunks do."""
    chosen = [i for i, p in enumerate(PROMPTS) if len(p) > 16][:3]
    prompts = [{"prompt_token_ids": PROMPTS[i]} for i in chosen]
    params = SamplingParams(max_tokens=MAX_NEW, min_tokens=MAX_NEW, temperature=0.0)
    with LLM(str(bloom), dtype="float32", enable_prefix_caching=True, block_size=8, num_speculative_tokens=3,
             prompt_lookup_min=1) as llm:
        first = [o.outputs[0].token_ids for o in llm.generate(prompts, params)]
        again = llm.generate(prompts, params)
        assert all(o.num_cached_tokens >= 8 for o in again)
        assert llm.engine.num_draft_tokens > 0
    assert first == [o.outputs[0].token_ids for o in again] == [want[i] for i in chosen]
