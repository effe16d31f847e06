"""Speculative decoding with a checkpoint's own multi-token-prediction layer (speculative_method="mtp";
streamer/models/mtp.py over streamer/spec_decode/eagle.py's runner): every proposal equals a reference built from
transformers' own DeepSeek-V3 / GLM-4.5 decoder layer loaded with the MTP weights, and greedy output stays
transformers'. Checkpoints without the layer, and families without one, are refused."""
from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from streamer import LLM, SamplingParams
from tests.checkpoints import hf_greedy
from tests.test_eagle import assert_proposals_match, spy_proposals

PROMPTS = [[5, 6, 7, 8, 9, 5, 6, 7, 8, 9, 5, 6], list(range(20, 40)) * 2, [300, 12, 450, 3], list(range(100, 150))]
MAX_NEW = 16
K = 2


def with_mtp_layer(src: Path, out: Path, seed: int = 0, own_head: bool = True) -> Path:
    """A copy of `src` with an MTP layer, as the released checkpoints store it: model.layers.<num_layers>.* (a
    decoder layer of the last layer's kind, enorm, hnorm, eh_proj, shared_head.norm / .head, embed_tokens), in a
    shard of its own. own_head=False: without shared_head.head and embed_tokens (the target's serve)."""
    shutil.copytree(src, out)
    cfg = json.loads((src / "config.json").read_text())
    n, h, vocab = cfg["num_hidden_layers"], cfg["hidden_size"], cfg["vocab_size"]
    g = torch.Generator().manual_seed(seed)
    weights = load_file(src / "model.safetensors")
    last = f"model.layers.{n - 1}."
    mtp = {}
    for name, t in weights.items():
        if name.startswith(last):
            noise = torch.randn(t.shape, generator=g) * (0.3 if "norm" in name else t.float().std().item() or 0.05)
            mtp[f"model.layers.{n}." + name[len(last):]] = (t.float() + noise).to(t.dtype)
    p = f"model.layers.{n}."
    mtp.update({p + "enorm.weight": 1 + 0.3 * torch.randn(h, generator=g),
                p + "hnorm.weight": 1 + 0.3 * torch.randn(h, generator=g),
                p + "eh_proj.weight": 0.15 * torch.randn(h, 2 * h, generator=g),
                p + "shared_head.norm.weight": 1 + 0.3 * torch.randn(h, generator=g),
                p + "shared_head.head.weight": 0.5 * torch.randn(vocab, h, generator=g),
                p + "embed_tokens.weight": 0.5 * torch.randn(vocab, h, generator=g)})
    if not own_head:
        del mtp[p + "shared_head.head.weight"], mtp[p + "embed_tokens.weight"]
    save_file(mtp, out / "model-mtp.safetensors", metadata={"format": "pt"})
    return out


def _fused_experts(w: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Per-expert tensors (the checkpoint's layout) stacked as transformers' modules hold them."""
    e = sorted({int(k.split(".")[2]) for k in w if k.startswith("mlp.experts.")})
    if not e:
        return w
    out = {k: v for k, v in w.items() if not k.startswith("mlp.experts.")}
    out["mlp.experts.gate_up_proj"] = torch.stack([torch.cat([w[f"mlp.experts.{i}.gate_proj.weight"],
                                                              w[f"mlp.experts.{i}.up_proj.weight"]]) for i in e])
    out["mlp.experts.down_proj"] = torch.stack([w[f"mlp.experts.{i}.down_proj.weight"] for i in e])
    return out


class Reference:
    """The MTP layer's proposals, computed whole (no cache) by transformers' decoder layer in fp32."""

    def __init__(self, path: Path) -> None:
        import transformers as tf
        self.target = tf.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
        config = self.target.config
        n = config.num_hidden_layers
        config._attn_implementation = "eager"
        layer_cls = type(self.target.model.layers[-1])
        self.layer = layer_cls(config, n).eval()
        w = load_file(path / "model-mtp.safetensors")
        p = f"model.layers.{n}."
        own = ("enorm", "hnorm", "eh_proj", "shared_head", "embed_tokens")
        missing, unexpected = self.layer.load_state_dict(
            _fused_experts({k[len(p):]: v for k, v in w.items() if k[len(p):].split(".")[0] not in own}), strict=False)
        assert not unexpected and not [m for m in missing if "bias" not in m or "correction" in m], (missing, unexpected)
        self.w = {k[len(p):]: v for k, v in w.items() if k[len(p):].split(".")[0] in own}
        self.w.setdefault("embed_tokens.weight", self.target.model.embed_tokens.weight.detach())
        self.w.setdefault("shared_head.head.weight", self.target.lm_head.weight.detach())
        self.eps = config.rms_norm_eps

    def _rms(self, x: torch.Tensor, name: str) -> torch.Tensor:
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps) * self.w[name]

    def forward(self, ids: list[int], feats: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        t = len(ids)
        e = self.w["embed_tokens.weight"][torch.tensor(ids)]
        e[0] = 0.0  # (position 0's embedding is zeroed, as vLLM's DeepSeek MTP does)
        x = torch.cat([self._rms(e, "enorm.weight"), self._rms(feats, "hnorm.weight")], -1) @ self.w["eh_proj.weight"].T
        pos = torch.arange(t)[None]
        mask = torch.full((t, t), float("-inf")).triu(1)[None, None]
        with torch.no_grad():
            stream = self.layer(x[None], attention_mask=mask, position_ids=pos,
                                position_embeddings=self.target.model.rotary_emb(x[None], pos))
            stream = stream[0] if isinstance(stream, tuple) else stream
        stream = stream[0]
        return self._rms(stream, "shared_head.norm.weight") @ self.w["shared_head.head.weight"].T, stream

    def proposals(self, seq: list[int], count: int) -> list[tuple[int, float]]:
        with torch.no_grad():
            feats = self.target.model(torch.tensor([seq[:-1]])).last_hidden_state[0]
        ids, out = list(seq[1:]), []
        for _ in range(count):
            logits, stream = self.forward(ids, feats)
            top = logits[-1].topk(2)
            out.append((int(top.indices[0]), float(top.values[0] - top.values[1])))
            ids.append(out[-1][0])
            feats = torch.cat([feats, stream[-1:]])
        return out


@pytest.mark.parametrize("family,own_head", [("deepseek_v3", True), ("glm4_moe", True), ("deepseek_v3", False)])
def test_proposals_match_reference_and_output_matches_transformers(make_ckpt, tmp_path, family, own_head) -> None:
    path = with_mtp_layer(make_ckpt(family, family=family), tmp_path / family, seed=3, own_head=own_head)
    llm = LLM(str(path), dtype="float32", speculative_method="mtp", num_speculative_tokens=K)
    calls = spy_proposals(llm)
    outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS],
                        SamplingParams(max_tokens=MAX_NEW, min_tokens=MAX_NEW, temperature=0.0))
    assert [o.outputs[0].token_ids for o in outs] == hf_greedy(path, PROMPTS, MAX_NEW)
    sequences = {o.request_id: p + o.outputs[0].token_ids for o, p in zip(outs, PROMPTS)}
    assert assert_proposals_match(Reference(path), calls[:4], sequences) >= 12
    e = llm.engine
    assert e.num_draft_tokens > 0
    e.scheduler.check_invariants()
    assert e.kv.pool.num_free == e.kv.num_blocks


def test_refused_without_a_layer_or_a_family(make_ckpt) -> None:
    with pytest.raises(ValueError, match="has no multi-token-prediction layer"):
        LLM(str(make_ckpt("deepseek_v3", family="deepseek_v3")), dtype="float32", speculative_method="mtp",
            num_speculative_tokens=K)
    with pytest.raises(ValueError, match="LlamaForCausalLM has none"):
        LLM(str(make_ckpt("llama", family="llama")), dtype="float32", speculative_method="mtp", num_speculative_tokens=K)
    with pytest.raises(ValueError, match="num_speculative_tokens >= 1"):
        LLM(str(make_ckpt("llama", family="llama")), dtype="float32", speculative_method="mtp")
    with pytest.raises(ValueError, match="speculative_method must be 'mtp'"):
        LLM(str(make_ckpt("llama", family="llama")), dtype="float32", speculative_method="eagle",
            num_speculative_tokens=K)


# ------------------------------------------------------------------ Qwen3-Next: `mtp.*` beside a hybrid target
def with_qwen3_next_mtp(src: Path, out: Path, seed: int = 0) -> Path:
    """A copy of a Qwen3-Next checkpoint with its MTP module as the released ones store it: mtp.layers.0.* (a
    full-attention layer: here the target's layer 1, the tiny model's one, with noise), mtp.fc,
    mtp.pre_fc_norm_embedding / _hidden and mtp.norm (zero-centred norms), in a shard of its own."""
    shutil.copytree(src, out)
    cfg = json.loads((src / "config.json").read_text())
    assert cfg["layer_types"][1] == "full_attention"
    h = cfg["hidden_size"]
    g = torch.Generator().manual_seed(seed)
    mtp = {}
    for name, t in load_file(src / "model.safetensors").items():
        if name.startswith("model.layers.1."):
            noise = torch.randn(t.shape, generator=g) * (0.3 if "norm" in name else t.float().std().item() or 0.05)
            mtp["mtp.layers.0." + name[len("model.layers.1."):]] = (t.float() + noise).to(t.dtype)
    mtp.update({"mtp.fc.weight": 0.15 * torch.randn(h, 2 * h, generator=g),
                "mtp.pre_fc_norm_embedding.weight": 0.3 * torch.randn(h, generator=g),
                "mtp.pre_fc_norm_hidden.weight": 0.3 * torch.randn(h, generator=g),
                "mtp.norm.weight": 0.3 * torch.randn(h, generator=g)})
    save_file(mtp, out / "model-mtp.safetensors", metadata={"format": "pt"})
    (out / "config.json").write_text(json.dumps(dict(cfg, num_nextn_predict_layers=1)))
    return out


class Qwen3NextReference(Reference):
    """Qwen3-Next's MTP proposals, computed whole by transformers' decoder layer (a full-attention one, as vLLM
    builds it) and its target in fp32: fc over [normed embedding, normed target state], the layer, the final norm;
    the target's LM head reads it, and it is the next pass's feature. Zero-centred norms, no position zeroed."""

    def __init__(self, path: Path) -> None:
        import transformers as tf
        self.target = tf.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
        config = self.target.config
        config._attn_implementation = "eager"
        self.layer = type(self.target.model.layers[1])(config, 1).eval()
        w = load_file(path / "model-mtp.safetensors")
        missing, unexpected = self.layer.load_state_dict(
            _fused_experts({k[len("mtp.layers.0."):]: v for k, v in w.items() if k.startswith("mtp.layers.0.")}),
            strict=False)
        assert not unexpected and not missing, (missing, unexpected)
        self.w = {k[len("mtp."):]: v for k, v in w.items() if not k.startswith("mtp.layers.")}
        self.eps = config.rms_norm_eps

    def _rms(self, x: torch.Tensor, name: str) -> torch.Tensor:
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps) * (1 + self.w[name])

    def forward(self, ids: list[int], feats: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        t = len(ids)
        e = self.target.model.embed_tokens.weight[torch.tensor(ids)]
        x = torch.cat([self._rms(e, "pre_fc_norm_embedding.weight"), self._rms(feats, "pre_fc_norm_hidden.weight")],
                      -1) @ self.w["fc.weight"].T
        pos = torch.arange(t)[None]
        mask = torch.full((t, t), float("-inf")).triu(1)[None, None]
        with torch.no_grad():
            stream = self.layer(x[None], attention_mask=mask, position_ids=pos,
                                position_embeddings=self.target.model.rotary_emb(x[None], pos))[0]
            out = self._rms(stream, "norm.weight")
            return out @ self.target.lm_head.weight.T, out


def test_qwen3_next_mtp_drafts_for_its_hybrid_model(make_ckpt, tmp_path) -> None:
    """The proposals equal the reference's, and greedy output stays transformers' while rejected drafts roll the
    target's recurrent state back. The checkpoint without `mtp.*` is refused."""
    import tests.test_recurrent_families  # noqa: F401  (registers the qwen3_next test family)
    src = make_ckpt("qwen3_next_mtp_src", family="qwen3_next")
    with pytest.raises(ValueError, match="mtp.fc.weight not found"):
        LLM(str(src), dtype="float32", speculative_method="mtp", num_speculative_tokens=K)
    assert_drafts_for_hybrid(with_qwen3_next_mtp(src, tmp_path / "qwen3_next", seed=3), "Qwen3NextMTP",
                             Qwen3NextReference)


@pytest.mark.parametrize("family", ["qwen3_5", "qwen3_5_moe"])
def test_qwen3_5_mtp_drafts_for_its_hybrid_model(make_ckpt, tmp_path, family) -> None:
    """Qwen3.5 (dense and MoE) stores its MTP module as Qwen3-Next does: the same head drafts for it."""
    src = make_ckpt(f"{family}_mtp_src", family=family)
    assert_drafts_for_hybrid(with_qwen3_next_mtp(src, tmp_path / family, seed=4), "Qwen3NextMTP",
                             Qwen3NextReference)


def assert_drafts_for_hybrid(path: Path, head: str, reference: type) -> None:
    """`head` drafts for the hybrid model at `path`: every proposal equals `reference`'s, greedy output stays
    transformers' while rejected drafts roll the target's state back, and everything is freed."""
    llm = LLM(str(path), dtype="float32", speculative_method="mtp", num_speculative_tokens=K)
    assert type(llm.engine.runner.drafter.model).__name__ == head
    calls = spy_proposals(llm)
    outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS],
                        SamplingParams(max_tokens=MAX_NEW, min_tokens=MAX_NEW, temperature=0.0))
    assert [o.outputs[0].token_ids for o in outs] == hf_greedy(path, PROMPTS, MAX_NEW)
    sequences = {o.request_id: p + o.outputs[0].token_ids for o, p in zip(outs, PROMPTS)}
    assert assert_proposals_match(reference(path), calls, sequences) >= 20
    e = llm.engine
    assert e.num_draft_tokens > 0 and e.kv.snapshots.num_rollbacks > 0
    e.scheduler.check_invariants()
    assert e.kv.pool.num_free == e.kv.num_blocks and e.kv.state.num_free == e.kv.state.num_slots


# ------------------------------------------------------------------ Nemotron-H: `mtp.layers.<i>.*` blocks
def with_nemotron_h_mtp(src: Path, out: Path, seed: int = 0) -> Path:
    """A copy of the Nemotron-H test checkpoint with an MTP module as NVIDIA stores it (mtp_hybrid_override_pattern
    "*E"): mtp.layers.0 an attention block (the target's layer 1, with noise) with enorm / hnorm / eh_proj,
    mtp.layers.1 a MoE block (layer 4, with noise) with final_layernorm."""
    shutil.copytree(src, out)
    cfg = json.loads((src / "config.json").read_text())
    h = cfg["hidden_size"]
    g = torch.Generator().manual_seed(seed)
    weights = {}
    for f in src.glob("*.safetensors"):
        weights.update(load_file(f))
    mtp = {}
    for target, mine in ((1, 0), (4, 1)):
        p = f"backbone.layers.{target}."
        for name, t in weights.items():
            if name.startswith(p):
                noise = torch.randn(t.shape, generator=g) * (0.3 if "norm" in name else t.float().std().item() or 0.05)
                mtp[f"mtp.layers.{mine}." + name[len(p):]] = (t.float() + noise).to(t.dtype)
    mtp.update({"mtp.layers.0.enorm.weight": 1 + 0.3 * torch.randn(h, generator=g),
                "mtp.layers.0.hnorm.weight": 1 + 0.3 * torch.randn(h, generator=g),
                "mtp.layers.0.eh_proj.weight": 0.15 * torch.randn(h, 2 * h, generator=g),
                "mtp.layers.1.final_layernorm.weight": 1 + 0.3 * torch.randn(h, generator=g)})
    save_file(mtp, out / "model-mtp.safetensors", metadata={"format": "pt"})
    (out / "config.json").write_text(json.dumps(dict(cfg, num_nextn_predict_layers=1,
                                                     mtp_hybrid_override_pattern="*E")))
    return out


class NemotronHReference(Reference):
    """Nemotron-H's MTP proposals, computed whole by transformers' blocks (built as the target's layers 1 and 4,
    loaded with the module's weights) in fp32, as vLLM runs the module: eh_proj over [enorm(embedding),
    hnorm(target state)], the blocks, final_layernorm; the target's LM head reads that, the next pass's feature."""

    def __init__(self, path: Path) -> None:
        import transformers as tf
        self.target = tf.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
        config = self.target.config
        config._attn_implementation = "eager"
        w = load_file(path / "model-mtp.safetensors")
        self.blocks = []
        for mine, target in ((0, 1), (1, 4)):
            block = type(self.target.model.layers[target])(config, target).eval()
            p = f"mtp.layers.{mine}."
            own = {k[len(p):]: v for k, v in w.items() if k.startswith(p)
                   and k[len(p):].split(".")[0] not in ("enorm", "hnorm", "eh_proj", "final_layernorm")}
            experts = sorted({int(k.split(".")[2]) for k in own if k.startswith("mixer.experts.")})
            for proj in ("up_proj", "down_proj") if experts else ():  # (transformers stacks them)
                own[f"mixer.experts.{proj}"] = torch.stack([own.pop(f"mixer.experts.{e}.{proj}.weight")
                                                            for e in experts])
            missing, unexpected = block.load_state_dict(own, strict=False)
            assert not unexpected and not missing, (missing, unexpected)
            self.blocks.append(block)
        self.w = {k.split(".", 3)[3]: v for k, v in w.items() if k.split(".")[3] in
                  ("enorm", "hnorm", "eh_proj", "final_layernorm")}
        self.eps = config.layer_norm_epsilon

    def forward(self, ids: list[int], feats: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        t = len(ids)
        e = self.target.model.embeddings.weight[torch.tensor(ids)]
        x = torch.cat([self._rms(e, "enorm.weight"), self._rms(feats, "hnorm.weight")], -1) @ self.w["eh_proj.weight"].T
        mask = torch.full((t, t), float("-inf")).triu(1)[None, None]
        with torch.no_grad():
            x = x[None]
            for block in self.blocks:
                x = block(x, attention_mask=mask, position_ids=torch.arange(t)[None])
                x = x[0] if isinstance(x, tuple) else x
            out = self._rms(x[0], "final_layernorm.weight")
            return out @ self.target.lm_head.weight.T, out


def test_nemotron_h_mtp_drafts_for_its_hybrid_model(ckpt_root, tmp_path) -> None:
    """The proposals equal the reference's, and greedy output stays transformers' while rejected drafts roll the
    target's Mamba state back."""
    from tests.test_nemotron_h import make_nemotron_h
    src = ckpt_root / "nemotron_h"
    src = src if (src / "config.json").exists() else make_nemotron_h(src)
    assert_drafts_for_hybrid(with_nemotron_h_mtp(src, tmp_path / "nemotron_h", seed=5), "NemotronHMTP",
                             NemotronHReference)
