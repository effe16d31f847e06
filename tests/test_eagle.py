"""Speculative decoding with EAGLE heads (streamer/spec_decode/eagle.py, streamer/models/eagle.py): every proposal equals an
independent reference (the head's math written out here, fed transformers' hidden states of the target), greedy
output stays transformers', with chunked prefill, preemption and sampling; wrong heads are refused."""
from __future__ import annotations

import json
from pathlib import Path
from typing import Optional

import pytest
import torch
from safetensors.torch import save_file

from streamer import LLM, SamplingParams
from tests.checkpoints import hf_greedy

PROMPTS = [[5, 6, 7, 8, 9, 5, 6, 7, 8, 9, 5, 6], list(range(20, 40)) * 3, [7, 7, 7, 7, 7, 7], [300, 12, 450, 3],
           list(range(100, 190))]
MAX_NEW = 24
K = 3
HEADS, KV_HEADS, HEAD_DIM, INTER, THETA, EPS = 4, 2, 16, 96, 10000.0, 1e-6


@pytest.fixture(scope="module")
def target(make_ckpt) -> Path:
    return make_ckpt("llama_8l", family="llama", num_hidden_layers=8, seed=4)


def _rnd(g: torch.Generator, *shape: int, scale: float = 0.08, mean: float = 0.0) -> torch.Tensor:
    return torch.randn(*shape, generator=g) * scale + mean


def make_head(out: Path, target: Path, version: int, seed: int = 0, draft_vocab: Optional[int] = None,
              aux: Optional[list[int]] = None, own_embeddings: bool = False) -> Path:
    """A random EAGLE head for `target`, in the released checkpoints' layout (SafeAILab's EAGLE-1: a Llama config,
    `fc` with a bias, no input norm, no final norm or head; EAGLE-3: `midlayer.*`, `d2t` / `t2d`)."""
    out.mkdir(parents=True, exist_ok=True)
    tcfg = json.loads((target / "config.json").read_text())
    h, vocab = tcfg["hidden_size"], tcfg["vocab_size"]
    g = torch.Generator().manual_seed(seed)
    layer = "midlayer" if version == 3 else "layers.0"
    qkv_in = 2 * h if version == 3 else h
    w = {f"{layer}.self_attn.q_proj.weight": _rnd(g, HEADS * HEAD_DIM, qkv_in, scale=0.3),
         f"{layer}.self_attn.k_proj.weight": _rnd(g, KV_HEADS * HEAD_DIM, qkv_in, scale=0.3),
         f"{layer}.self_attn.v_proj.weight": _rnd(g, KV_HEADS * HEAD_DIM, qkv_in),
         f"{layer}.self_attn.o_proj.weight": _rnd(g, h, HEADS * HEAD_DIM),
         f"{layer}.mlp.gate_proj.weight": _rnd(g, INTER, h), f"{layer}.mlp.up_proj.weight": _rnd(g, INTER, h),
         f"{layer}.mlp.down_proj.weight": _rnd(g, h, INTER),
         f"{layer}.post_attention_layernorm.weight": _rnd(g, h, scale=0.3, mean=1.0)}
    cfg = {"model_type": "llama", "hidden_size": h, "num_attention_heads": HEADS, "num_key_value_heads": KV_HEADS,
           "head_dim": HEAD_DIM, "intermediate_size": INTER, "num_hidden_layers": 1, "vocab_size": vocab,
           "rms_norm_eps": EPS, "rope_theta": THETA, "max_position_embeddings": 512, "hidden_act": "silu",
           "tie_word_embeddings": False, "torch_dtype": "float32"}
    if version == 3:
        dv = draft_vocab or vocab
        ids = torch.sort(torch.randperm(vocab, generator=g)[:dv]).values if draft_vocab else torch.arange(vocab)
        w.update({f"{layer}.input_layernorm.weight": _rnd(g, h, scale=0.3, mean=1.0),
                  f"{layer}.hidden_norm.weight": _rnd(g, h, scale=0.3, mean=1.0),
                  "norm.weight": _rnd(g, h, scale=0.3, mean=1.0), "fc.weight": _rnd(g, h, 3 * h, scale=0.1),
                  "lm_head.weight": _rnd(g, dv, h, scale=0.5), "d2t": ids - torch.arange(dv),
                  "t2d": torch.zeros(vocab, dtype=torch.bool).index_fill_(0, ids, True)})
        cfg.update(architectures=["LlamaForCausalLMEagle3"], draft_vocab_size=dv)
        if aux is not None:
            cfg["eagle_config"] = {"eagle_aux_hidden_state_layer_ids": aux}
    else:
        w.update({"fc.weight": _rnd(g, h, 2 * h, scale=0.15), "fc.bias": _rnd(g, h, scale=0.05)})
        cfg.update(architectures=["LlamaForCausalLM"])
    if own_embeddings:
        w["embed_tokens.weight"] = _rnd(g, vocab, h, scale=0.5)
    save_file({k: v.contiguous() for k, v in w.items()}, out / "model.safetensors", metadata={"format": "pt"})
    (out / "config.json").write_text(json.dumps(cfg))
    return out


# ---------------------------------------------------------------------------------------------- the reference
def _rms(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + EPS) * w


def _rope(x: torch.Tensor) -> torch.Tensor:
    """[T, heads, D] rotated at positions 0..T-1 (neox halves)."""
    inv = 1.0 / THETA ** (torch.arange(0, HEAD_DIM, 2, dtype=torch.float64) / HEAD_DIM)
    ang = torch.arange(x.shape[0], dtype=torch.float64)[:, None] * inv[None]
    cos, sin = torch.cat([ang.cos()] * 2, -1)[:, None], torch.cat([ang.sin()] * 2, -1)[:, None]
    a, b = x.chunk(2, dim=-1)
    return x * cos + torch.cat([-b, a], -1) * sin


def _attention(w: dict, layer: str, a: torch.Tensor) -> torch.Tensor:
    t = a.shape[0]
    q = _rope((a @ w[f"{layer}.self_attn.q_proj.weight"].T).view(t, HEADS, HEAD_DIM))
    k = _rope((a @ w[f"{layer}.self_attn.k_proj.weight"].T).view(t, KV_HEADS, HEAD_DIM))
    v = (a @ w[f"{layer}.self_attn.v_proj.weight"].T).view(t, KV_HEADS, HEAD_DIM)
    k, v = k.repeat_interleave(HEADS // KV_HEADS, 1), v.repeat_interleave(HEADS // KV_HEADS, 1)
    scores = torch.einsum("qhd,khd->hqk", q, k) / HEAD_DIM ** 0.5
    scores = scores.masked_fill(torch.ones(t, t, dtype=torch.bool).triu(1), float("-inf"))
    o = torch.einsum("hqk,khd->qhd", scores.softmax(-1), v).reshape(t, HEADS * HEAD_DIM)
    return o @ w[f"{layer}.self_attn.o_proj.weight"].T


def _mlp(w: dict, layer: str, x: torch.Tensor) -> torch.Tensor:
    gate, up = x @ w[f"{layer}.mlp.gate_proj.weight"].T, x @ w[f"{layer}.mlp.up_proj.weight"].T
    return (torch.nn.functional.silu(gate) * up) @ w[f"{layer}.mlp.down_proj.weight"].T


class Reference:
    """The head's proposals for a sequence, computed whole (no cache) in float64 from transformers' target."""

    def __init__(self, head: Path, target: Path) -> None:
        import transformers as tf
        from safetensors.torch import load_file
        self.w = {k: v.double() if v.is_floating_point() else v for k, v in load_file(head / "model.safetensors").items()}
        self.cfg = json.loads((head / "config.json").read_text())
        self.version = 3 if "Eagle3" in self.cfg["architectures"][0] else 1
        self.target = tf.AutoModelForCausalLM.from_pretrained(target, dtype=torch.float32).eval()
        n = self.target.config.num_hidden_layers
        self.aux = (self.cfg.get("eagle_config") or {}).get("eagle_aux_hidden_state_layer_ids") or [2, n // 2, n - 3]
        self.embed = self.w.get("embed_tokens.weight", self.target.model.embed_tokens.weight.detach().double())
        self.head = self.target.lm_head.weight.detach().double()

    def features(self, tokens: list[int]) -> torch.Tensor:
        """The target's features of each position: EAGLE-3's three streams through fc, EAGLE-1's final states."""
        with torch.no_grad():
            out = self.target.model(torch.tensor([tokens]), output_hidden_states=True)
        if self.version == 1:
            return out.last_hidden_state[0].double()
        streams = torch.cat([out.hidden_states[i][0] for i in self.aux], -1).double()
        return streams @ self.w["fc.weight"].T

    def forward(self, ids: list[int], feats: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        w, e = self.w, self.embed[torch.tensor(ids)]
        if self.version == 3:
            layer = "midlayer"
            a = torch.cat([_rms(e, w[f"{layer}.input_layernorm.weight"]), _rms(feats, w[f"{layer}.hidden_norm.weight"])], -1)
            resid = feats + _attention(w, layer, a)
            pre = resid + _mlp(w, layer, _rms(resid, w[f"{layer}.post_attention_layernorm.weight"]))
            return _rms(pre, w["norm.weight"]) @ w["lm_head.weight"].T, pre
        layer = "layers.0"
        x = torch.cat([e, feats], -1) @ w["fc.weight"].T + w["fc.bias"]
        resid = x + _attention(w, layer, x)
        pre = resid + _mlp(w, layer, _rms(resid, w[f"{layer}.post_attention_layernorm.weight"]))
        return pre @ self.head.T, pre

    def proposals(self, seq: list[int], count: int) -> list[tuple[int, float]]:
        """(token, gap between its logit and the runner-up's) for the `count` drafts after `seq` (whose last token
        is the newest known one): position i reads token i + 1 and feature i."""
        feats = self.features(seq[:-1])
        ids = list(seq[1:])
        out = []
        for _ in range(count):
            logits, pre = self.forward(ids, feats)
            top = logits[-1].topk(2)
            tok = int(top.indices[0])
            if self.version == 3:
                tok += int(self.w["d2t"][tok])
            out.append((tok, float(top.values[0] - top.values[1])))
            ids.append(tok)
            feats = torch.cat([feats, pre[-1:]])
        return out


# ---------------------------------------------------------------------------------------------- tests
def spy_proposals(llm: LLM) -> list:
    """Record every proposing pass: (request ids, the last known token's position, counts, proposals)."""
    drafter = llm.engine.runner.drafter
    calls: list = []
    inner = drafter.propose

    def propose(plan):
        out = inner(plan)
        calls.append((list(plan.req_ids), plan.passes[0].positions + 1, plan.counts.copy(), out.cpu()))
        return out
    drafter.propose = propose
    return calls


def assert_proposals_match(ref, calls: list, sequences: dict[str, list[int]]) -> int:
    """Each recorded proposal equals `ref.proposals` (a reference's) for its request's tokens up to then, except
    near-ties; returns how many were compared."""
    checked = 0
    for req_ids, known, counts, proposed in calls:
        for r, rid in enumerate(req_ids):
            seq = sequences[rid][:int(known[r]) + 1]
            for j, (tok, gap) in enumerate(ref.proposals(seq, int(counts[r]))):
                if gap > 1e-4:  # (a near-tie may go either way in float32)
                    assert int(proposed[r, j]) == tok, f"request {rid} at {known[r]}, draft {j}"
                    checked += 1
    return checked


@pytest.mark.parametrize("version,kw", [
    (3, {}), (3, dict(draft_vocab=200, aux=[1, 4, 6])), (1, {}), (3, dict(own_embeddings=True))],
    ids=["eagle3", "eagle3-draft-vocab", "eagle1", "eagle3-own-embeddings"])
def test_proposals_match_reference_and_output_matches_transformers(target, tmp_path, version, kw) -> None:
    head = make_head(tmp_path / "head", target, version, seed=7, **kw)
    llm = LLM(str(target), dtype="float32", speculative_model=str(head), num_speculative_tokens=K)
    assert type(llm.engine.runner.drafter).__name__ == "EagleDrafter"
    calls = spy_proposals(llm)
    outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS],
                        SamplingParams(max_tokens=MAX_NEW, min_tokens=MAX_NEW, temperature=0.0))
    got = [o.outputs[0].token_ids for o in outs]
    assert got == hf_greedy(target, PROMPTS, MAX_NEW)
    sequences = {o.request_id: p + o.outputs[0].token_ids for o, p in zip(outs, PROMPTS)}
    assert sum(len(c[0]) for c in calls) >= len(PROMPTS) * 3, "too few proposing steps to test anything"
    assert assert_proposals_match(Reference(head, target), calls[:6], sequences) >= 20
    e = llm.engine
    assert e.num_draft_tokens > 0
    e.scheduler.check_invariants()
    assert e.kv.pool.num_free == e.kv.num_blocks


def test_chunked_prefill_preemption_and_sampling(target, tmp_path) -> None:
    """Prompts prefilled in chunks and requests preempted (a small KV pool): proposals still match the reference
    (the head's cache was filled chunk by chunk, and again after recomputation); sampled requests run too."""
    head = make_head(tmp_path / "head", target, 3, seed=9)
    llm = LLM(str(target), dtype="float32", speculative_model=str(head), num_speculative_tokens=K,
              max_num_batched_tokens=16, block_size=8, num_kv_blocks=16)
    calls = spy_proposals(llm)
    prompts = PROMPTS[:4] + [list(range(200, 230)), list(range(60, 90))]
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts],
                        SamplingParams(max_tokens=MAX_NEW, min_tokens=MAX_NEW, temperature=0.0))
    assert [o.outputs[0].token_ids for o in outs] == hf_greedy(target, prompts, MAX_NEW)
    assert llm.engine.scheduler.num_preemptions > 0, "the pool was big enough: nothing was preempted"
    sequences = {o.request_id: p + o.outputs[0].token_ids for o, p in zip(outs, prompts)}
    assert assert_proposals_match(Reference(head, target), calls[-8:], sequences) >= 10
    sampled = llm.generate([{"prompt_token_ids": p} for p in prompts],
                           SamplingParams(max_tokens=MAX_NEW, temperature=1.0, seed=3, ignore_eos=True))
    assert all(len(o.outputs[0].token_ids) == MAX_NEW for o in sampled)
    e = llm.engine
    e.scheduler.check_invariants()
    assert e.kv.pool.num_free == e.kv.num_blocks


def test_wrong_heads_refused(target, tmp_path) -> None:
    head = make_head(tmp_path / "head", target, 3)
    cfg = json.loads((head / "config.json").read_text())
    (head / "config.json").write_text(json.dumps(dict(cfg, vocab_size=cfg["vocab_size"] + 8)))
    with pytest.raises(ValueError, match="vocabulary"):
        LLM(str(target), dtype="float32", speculative_model=str(head), num_speculative_tokens=K)
    (head / "config.json").write_text(json.dumps(dict(cfg, eagle_config={"eagle_aux_hidden_state_layer_ids": [1, 2, 9]})))
    with pytest.raises(ValueError, match="EAGLE-3 reads 3 distinct target layers"):
        LLM(str(target), dtype="float32", speculative_model=str(head), num_speculative_tokens=K)
    (head / "config.json").write_text(json.dumps(dict(cfg, eagle_config={"eagle_aux_hidden_state_layer_ids": [1, 2, 2]})))
    with pytest.raises(ValueError, match="3 distinct"):  # (the target would return two streams)
        LLM(str(target), dtype="float32", speculative_model=str(head), num_speculative_tokens=K)
    from streamer.models.gpt2 import GPT2LMHeadModel
    from streamer.spec_decode.eagle import check_target
    with pytest.raises(ValueError, match="Llama layer loop; GPT2LMHeadModel is not"):
        check_target(object.__new__(GPT2LMHeadModel), "GPT2LMHeadModel")


def test_compiled_target(target, tmp_path) -> None:
    """A compiled target returns its features beside its hidden states from the same graph."""
    head = make_head(tmp_path / "head", target, 3, seed=11)
    llm = LLM(str(target), dtype="float32", speculative_model=str(head), num_speculative_tokens=K,
              enforce_eager=False)
    assert llm.engine.runner.compiled
    calls = spy_proposals(llm)
    outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS[:3]],
                        SamplingParams(max_tokens=MAX_NEW, min_tokens=MAX_NEW, temperature=0.0))
    assert [o.outputs[0].token_ids for o in outs] == hf_greedy(target, PROMPTS[:3], MAX_NEW)
    sequences = {o.request_id: p + o.outputs[0].token_ids for o, p in zip(outs, PROMPTS)}
    assert assert_proposals_match(Reference(head, target), calls[:4], sequences) >= 10


def test_server(target, tmp_path) -> None:
    """`streamer serve --speculative-model HEAD` takes an EAGLE head as it takes a draft model."""
    import httpx
    import openai

    from tests.server_utils import LiveServer, metric
    head = make_head(tmp_path / "head", target, 1, seed=5)
    want = hf_greedy(target, PROMPTS[:2], MAX_NEW)
    with LiveServer(target, speculative_model=str(head), num_speculative_tokens=K) as server:
        client = openai.OpenAI(base_url=server.base_url, api_key="none")
        for prompt, tokens in zip(PROMPTS[:2], want):
            out = client.completions.create(model=server.model_name, prompt=prompt, max_tokens=MAX_NEW,
                                            temperature=0.0, extra_body={"ignore_eos": True, "return_token_ids": True})
            assert out.choices[0].token_ids == tokens
        prom = httpx.get(server.url + "/metrics", timeout=30).text
        assert metric(prom, "vllm:spec_decode_num_draft_tokens_total") > 0
        server.wait_idle()


def test_trained_demo_head_tool(tmp_path) -> None:
    """tools/train_eagle_head.py writes an EAGLE-3 head that loads and drafts for the demo model (a smoke run:
    two steps on a few files; a real run's acceptance is in bench/RESULTS.md)."""
    import sys
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tools"))
    from train_eagle_head import main
    main(["--out", str(tmp_path / "head"), "--steps", "2", "--batch-size", "1", "--seq-len", "32", "--max-files", "3"])
    cfg = json.loads((tmp_path / "head" / "config.json").read_text())
    assert cfg["architectures"] == ["LlamaForCausalLMEagle3"]
    params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    plain = LLM(dtype="float32").generate(["def f(x):"], params)[0].outputs[0].token_ids
    llm = LLM(dtype="float32", speculative_model=str(tmp_path / "head"), num_speculative_tokens=2)
    assert llm.generate(["def f(x):"], params)[0].outputs[0].token_ids == plain
    assert llm.engine.num_draft_tokens > 0
