"""Phi-4-mini, Granite 3.x, OLMo 2 and SmolLM3 (their parity with transformers is test_engine_hf_parity.py's family
test): each of their differences from Llama changes the tokens, so that test would fail with it ignored; what the
greedy tokens cannot show (Granite's logits scaling, the torch rotary path against the kernels' reference) is checked
directly; OLMo 2 refuses tensor parallelism; SmolLM3 also with chunked prefill, compiled and with sliding layers."""
from __future__ import annotations

import pytest
import torch

from streamer import LLM, SamplingParams
from streamer.models.config import ModelConfig
from streamer.models.layers import ParallelContext, RotaryEmbedding
from streamer.models.llama import rope_layers
from streamer.models.olmo2 import Olmo2ForCausalLM, Olmo2RMSNorm
from streamer.models.smollm3 import sliding_layers
from streamer_kernels import reference
from tests.checkpoints import hf_greedy
from tests.test_engine_hf_parity import MAX_NEW, _greedy, _prompts

PROMPTS = _prompts(6, seed=7)


@pytest.fixture(scope="module")
def refs(make_ckpt) -> dict[str, list[list[int]]]:
    """transformers' tokens for the family checkpoints (the parity test's: same names, same arguments)."""
    return {family: hf_greedy(make_ckpt(family, family=family), PROMPTS, MAX_NEW)
            for family in ("phi4_mini", "granite", "olmo2", "smollm3")}


@pytest.mark.parametrize("family,override", [
    ("phi4_mini", {"partial_rotary_factor": 1.0}),  # every dim rotates (LongRoPE factors over all 8 frequencies)
    ("granite", {"embedding_multiplier": 1.0}),
    ("granite", {"residual_multiplier": 1.0}),
    ("granite", {"attention_multiplier": 16 ** -0.5}),  # Llama's scale for head_dim 16
    ("smollm3", {"no_rope_layers": [1, 1, 1, 1]}),  # no NoPE layer
], ids=lambda v: v if isinstance(v, str) else next(iter(v)))
def test_difference_matters(make_ckpt, refs, family, override):
    """The same weights with one of the family's settings at Llama's value: transformers' tokens change (so a
    streamer that ignored it would fail the parity test)."""
    key = next(iter(override))
    as_llama = make_ckpt(f"{family}_{key}_as_llama", family=family, **override)
    assert hf_greedy(as_llama, PROMPTS, MAX_NEW) != refs[family]


def test_olmo2_whole_projection_qk_norm_matters(make_ckpt, refs, monkeypatch):
    """q/k normalised per head (Qwen3's statistics, the same weights) instead of over the whole projection gives
    other tokens than transformers; the real norm gives the same."""
    path = make_ckpt("olmo2", family="olmo2")
    assert _greedy(LLM(str(path), dtype="float32"), PROMPTS) == refs["olmo2"]
    flat_forward = Olmo2RMSNorm.forward

    def per_head(self: Olmo2RMSNorm, x: torch.Tensor, residual=None):
        if not self.flat:
            return flat_forward(self, x, residual)
        xf = x.float() * torch.rsqrt(x.float().pow(2).mean(-1, keepdim=True) + self.eps)
        return (xf * self.weight.float().view(x.shape[1:])).to(x.dtype)

    monkeypatch.setattr(Olmo2RMSNorm, "forward", per_head)
    assert _greedy(LLM(str(path), dtype="float32"), PROMPTS) != refs["olmo2"]


def test_olmo2_refuses_tensor_parallelism(make_ckpt, monkeypatch):
    path = make_ckpt("olmo2", family="olmo2")
    with pytest.raises(ValueError, match="Olmo2ForCausalLM does not support tensor parallelism"):  # before any worker
        LLM(str(path), dtype="float32", tensor_parallel_size=2)
    monkeypatch.setattr(ParallelContext, "size", 2)
    with pytest.raises(ValueError, match="tensor parallelism"):
        Olmo2ForCausalLM(ModelConfig.from_dir(path), None, 64)  # type: ignore[arg-type]  # (refused before any backend)


def test_granite_logits_scaling(make_ckpt):
    """logits_scaling leaves the argmax alone: the log-probabilities show it (transformers' vs the engine's prompt
    logprobs, which differ well beyond the tolerance without the scaling)."""
    import transformers

    path = make_ckpt("granite", family="granite")
    model = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    llm = LLM(str(path), dtype="float32")
    params = SamplingParams(max_tokens=1, temperature=0.0, prompt_logprobs=1)
    prompt = PROMPTS[0]
    got = llm.generate([{"prompt_token_ids": prompt}], params)[0].prompt_logprobs
    assert got is not None
    with torch.no_grad():
        logits = model(torch.tensor([prompt])).logits[0]
    want, unscaled = logits.log_softmax(-1), (logits * 8.0).log_softmax(-1)
    for i in range(1, len(prompt)):
        assert abs(got[i][prompt[i]].logprob - want[i - 1, prompt[i]].item()) < 1e-4
    assert (want - unscaled).abs().max() > 0.1


def test_partial_longrope_torch_rotary_matches_kernel_reference(make_ckpt):
    """The model's rotary (torch path) over Phi-4-mini's partial heads and LongRoPE table equals the kernels'
    reference (which the Triton kernel is tested against): the first 12 of 16 dims rotate, the rest pass."""
    cfg = ModelConfig.from_dir(make_ckpt("phi4_mini", family="phi4_mini"))
    assert cfg.rotary_dim == 12
    rotary = RotaryEmbedding(cfg.rotary_dim, 64, cfg.rope_theta, cfg.rope_scaling)
    assert rotary.cos_sin_cache.shape == (2 * 64, 12) and rotary.long_threshold == 32
    g = torch.Generator().manual_seed(0)
    q, k = torch.randn(9, 4, 16, generator=g), torch.randn(9, 2, 16, generator=g)
    positions = torch.tensor([0, 1, 5, 31, 32, 63, 64, 100, 127])  # both tables
    got = rotary(positions, q, k)
    want = reference.rotary_embedding(positions, q, k, rotary.cos_sin_cache, is_neox=True)
    for a, b, x in zip(got, want, (q, k)):
        torch.testing.assert_close(a, b)
        assert torch.equal(a[..., 12:], x[..., 12:]) and not torch.allclose(a[..., :12], x[..., :12])


def test_smollm3_chunked_prefill_and_compiled(make_ckpt, refs):
    """NoPE layers 1 and 3 with prompts prefilled in chunks over small blocks, and compiled."""
    path = make_ckpt("smollm3", family="smollm3")
    with LLM(str(path), dtype="float32", max_num_batched_tokens=16, block_size=8) as llm:
        assert [layer.self_attn.use_rope for layer in llm.engine.runner.model.layers] == [True, False, True, False]
        assert _greedy(llm, PROMPTS) == refs["smollm3"]
    with LLM(str(path), dtype="float32", enforce_eager=False, max_num_batched_tokens=16) as llm:
        assert llm.engine.runner.compiled
        assert _greedy(llm, PROMPTS[:3]) == refs["smollm3"][:3]


def test_smollm3_sliding_layers_match_transformers(make_ckpt):
    """use_sliding_window: the NoPE layers attend within a window of 8 (prompts run past it), the others globally."""
    path = make_ckpt("smollm3_sw", family="smollm3", use_sliding_window=True, sliding_window=8)
    ref = hf_greedy(path, PROMPTS, MAX_NEW)
    assert ref != hf_greedy(make_ckpt("smollm3", family="smollm3"), PROMPTS, MAX_NEW)  # (same weights)
    with LLM(str(path), dtype="float32", max_num_batched_tokens=16, block_size=8) as llm:
        windows = [layer.self_attn.attn.spec.sliding_window for layer in llm.engine.runner.model.layers]
        assert windows == [None, 8, None, 8]
        assert _greedy(llm, PROMPTS) == ref


@pytest.mark.parametrize("over", [{}, {"no_rope_layer_interval": 3}, {"use_sliding_window": True, "sliding_window": 8},
                                  {"use_sliding_window": True, "sliding_window": None}])
def test_smollm3_default_layers_as_transformers(over):
    """Without the per-layer lists, the NoPE and sliding layers transformers' config derives (its config.json always
    writes them out; a hand-written one may not)."""
    import transformers
    c = {"architectures": ["SmolLM3ForCausalLM"], "hidden_size": 64, "intermediate_size": 128,
         "num_attention_heads": 4, "num_hidden_layers": 7, "vocab_size": 100, **over}
    want = transformers.SmolLM3Config(**{k: v for k, v in c.items() if k != "architectures"})
    cfg = ModelConfig.from_dict(c)
    assert rope_layers(cfg.raw, 7) == [bool(f) for f in want.no_rope_layers]
    assert sliding_layers(cfg) == [t == "sliding_attention" for t in want.layer_types]
    assert cfg.tie_word_embeddings and cfg.rope_theta == 2_000_000.0
