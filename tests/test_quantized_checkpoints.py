"""FP8 checkpoints (transformers' block-wise "fp8", llm-compressor's "compressed-tensors" FP8) load by dequantizing:
the engine's greedy output on an FP8 folder equals transformers' on the same weights dequantized here, independently
of the engine's code, and saved as a plain checkpoint."""
from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

pytest.importorskip("transformers")

from streamer import LLM, SamplingParams  # noqa: E402
from tests.checkpoints import hf_greedy  # noqa: E402

PROMPTS = [[5, 17, 33, 9, 100], [40, 41, 42] * 9, list(range(60, 100))]
LINEARS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
FP8_MAX = 448.0


def _copy_tokenizer(src: Path, dst: Path) -> None:
    for f in src.iterdir():
        if f.name.startswith("tokenizer") or f.name in ("special_tokens_map.json", "generation_config.json"):
            shutil.copy(f, dst / f.name)


def _quantize_blocks(w: torch.Tensor, bo: int, bi: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(FP8 weight, scale_inv per block, the dequantized weight), block by block in plain loops."""
    out, cols = w.shape
    q = torch.empty(out, cols, dtype=torch.float8_e4m3fn)
    deq = torch.empty(out, cols)
    scales = torch.empty(-(-out // bo), -(-cols // bi))
    for i in range(scales.shape[0]):
        for j in range(scales.shape[1]):
            blk = w[i * bo:(i + 1) * bo, j * bi:(j + 1) * bi]
            s = blk.abs().max() / FP8_MAX
            scales[i, j] = s
            q[i * bo:(i + 1) * bo, j * bi:(j + 1) * bi] = (blk / s).to(torch.float8_e4m3fn)
            deq[i * bo:(i + 1) * bo, j * bi:(j + 1) * bi] = q[i * bo:(i + 1) * bo, j * bi:(j + 1) * bi].float() * s
    return q, scales, deq


def _quantize_rows(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    s = w.abs().amax(dim=1, keepdim=True) / FP8_MAX
    q = (w / s).to(torch.float8_e4m3fn)
    return q, s, q.float() * s


def _write(src: Path, fp8_dir: Path, ref_dir: Path, layout: str) -> None:
    state = load_file(str(src / "model.safetensors"))
    fp8, ref = {}, {}
    for name, w in state.items():
        if name.endswith(".weight") and name.split(".")[-2] in LINEARS:
            base = name[:-len(".weight")]
            if layout == "fp8":  # 48 x 48 blocks: the 64- and 128-wide matrices end in partial blocks
                q, s, deq = _quantize_blocks(w, 48, 48)
                fp8[name], fp8[f"{base}.weight_scale_inv"] = q, s
            else:
                q, s, deq = _quantize_rows(w)
                fp8[name], fp8[f"{base}.weight_scale"] = q, s
                fp8[f"{base}.input_scale"] = torch.tensor([0.01])
            ref[name] = deq
        else:
            fp8[name] = ref[name] = w
    cfg = json.loads((src / "config.json").read_text())
    for d in (fp8_dir, ref_dir):
        d.mkdir()
        _copy_tokenizer(src, d)
    (ref_dir / "config.json").write_text(json.dumps(cfg))
    save_file(ref, str(ref_dir / "model.safetensors"))
    if layout == "fp8":
        cfg["quantization_config"] = {"quant_method": "fp8", "activation_scheme": "dynamic", "fmt": "e4m3",
                                      "weight_block_size": [48, 48]}
        save_file(fp8, str(fp8_dir / "model.safetensors"))
    else:
        cfg["quantization_config"] = {
            "quant_method": "compressed-tensors", "format": "float-quantized", "ignore": ["lm_head"],
            "config_groups": {"group_0": {"targets": ["Linear"], "weights": {
                "type": "float", "num_bits": 8, "strategy": "channel", "symmetric": True}}}}
        # Two shards, every scale in the other shard from its weight (the loader pairs them up in any order).
        names = sorted(fp8)
        shards = {"model-00001-of-00002.safetensors": [n for n in names if "scale" in n],
                  "model-00002-of-00002.safetensors": [n for n in names if "scale" not in n]}
        for fname, keys in shards.items():
            save_file({k: fp8[k] for k in keys}, str(fp8_dir / fname))
        index = {"metadata": {}, "weight_map": {k: f for f, keys in shards.items() for k in keys}}
        (fp8_dir / "model.safetensors.index.json").write_text(json.dumps(index))
    (fp8_dir / "config.json").write_text(json.dumps(cfg))


@pytest.mark.parametrize("layout", ["fp8", "compressed-tensors"])
def test_fp8_checkpoint_matches_transformers_on_dequantized_weights(llama_dir, tmp_path, layout):
    fp8_dir, ref_dir = tmp_path / "fp8", tmp_path / "ref"
    _write(llama_dir, fp8_dir, ref_dir, layout)
    want = hf_greedy(ref_dir, PROMPTS, 8)
    assert want != hf_greedy(llama_dir, PROMPTS, 8), "quantization must change something for this to prove much"
    with LLM(str(fp8_dir), dtype="float32") as llm:
        params = SamplingParams(max_tokens=8, temperature=0.0, min_tokens=8)
        got = [o.outputs[0].token_ids for o in llm.generate([{"prompt_token_ids": p} for p in PROMPTS], params)]
    assert got == want


def test_unsupported_or_broken_quantization_is_refused(llama_dir, tmp_path):
    def folder(name: str, qc: dict, drop: str = "") -> Path:
        d = tmp_path / name
        d.mkdir()
        _copy_tokenizer(llama_dir, d)
        cfg = json.loads((llama_dir / "config.json").read_text())
        (d / "config.json").write_text(json.dumps({**cfg, "quantization_config": qc}))
        state = load_file(str(llama_dir / "model.safetensors"))
        key = "model.layers.0.self_attn.q_proj.weight"
        q, s, _ = _quantize_blocks(state[key], 32, 32)
        state[key], state[key + "_scale_inv"] = q, s
        state.pop(drop, None)
        save_file(state, str(d / "model.safetensors"))
        return d
    fp8 = {"quant_method": "fp8", "weight_block_size": [32, 32]}
    cases = [(folder("hqq", {"quant_method": "hqq", "nbits": 4}), "quantization method 'hqq' is not supported"),
             (folder("gptq3", {"quant_method": "gptq", "bits": 3}), "3-bit integer weights are not supported"),
             (folder("marlin", {"quant_method": "compressed-tensors", "format": "marlin-24"}),
              "format 'marlin-24' is not supported"),
             (folder("noscale", fp8, drop="model.layers.0.self_attn.q_proj.weight_scale_inv"),
              "FP8 weight.*without a scale: model.layers.0.self_attn.q_proj"),
             (folder("blocks", {**fp8, "weight_block_size": [16, 16]}), "do not fit a \\(64, 64\\) weight in 16 x 16")]
    for path, message in cases:
        with pytest.raises(ValueError, match=message):
            LLM(str(path), dtype="float32")


def _prompt_logprobs(llm: LLM) -> torch.Tensor:
    params = SamplingParams(max_tokens=1, prompt_logprobs=0, temperature=0.0)
    outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], params)
    return torch.tensor([next(iter(e.values())).logprob for o in outs for e in o.prompt_logprobs[1:]])


def test_fp8_linear_is_the_scaled_product():
    from streamer.models.quant import FP8, fp8_linear, quantize_weight_fp8
    g = torch.Generator().manual_seed(0)
    w = torch.randn(48, 32, generator=g) * torch.linspace(0.01, 3.0, 48)[:, None]  # rows of very different ranges
    x = torch.randn(5, 32, generator=g) * torch.tensor([0.01, 1.0, 10.0, 100.0, 1.0])[:, None]
    wt, sw = quantize_weight_fp8(w)
    assert wt.dtype == FP8 and wt.shape == (32, 48) and sw.shape == (1, 48)
    y = fp8_linear(x, wt, sw)
    sx = x.abs().amax(dim=1, keepdim=True) / torch.finfo(FP8).max
    xq = (x / sx).to(FP8).float() * sx
    torch.testing.assert_close(y, xq @ (wt.float() * sw), rtol=1e-5, atol=1e-5)
    assert ((y - x @ w.T).norm() / (x @ w.T).norm()) < 0.08  # FP8's own error, a few percent


@pytest.mark.parametrize("compiled", [False, True])
def test_fp8_compute_stays_close_to_the_model(llama_dir, compiled):
    # Weights in FP8 with per-channel scales, activations per token: the prompt's log-probabilities move by FP8's
    # rounding only (~0.1 at most here, where they spread over ~0.5).
    with LLM(str(llama_dir), dtype="float32") as llm:
        ref = _prompt_logprobs(llm)
    with LLM(str(llama_dir), dtype="float32", quantization="fp8", enforce_eager=not compiled) as llm:
        qkv = llm.engine.runner.model.layers[0].self_attn.qkv_proj
        assert qkv.fp8[0].dtype == torch.float8_e4m3fn and qkv.weight.numel() == 0
        got = _prompt_logprobs(llm)
        assert llm.engine.kv.pool.num_free == llm.engine.kv.num_blocks
    diff = (got - ref).abs()
    assert diff.max() < 0.3 and diff.mean() < 0.05, (diff.max(), diff.mean())


def test_fp8_checkpoint_computes_in_fp8_on_request(llama_dir, tmp_path):
    fp8_dir, ref_dir = tmp_path / "fp8", tmp_path / "ref"
    _write(llama_dir, fp8_dir, ref_dir, "fp8")
    with LLM(str(fp8_dir), dtype="float32") as llm:  # on CPU: dequantized by default
        assert not llm.engine.runner.fp8
        ref = _prompt_logprobs(llm)
    with LLM(str(fp8_dir), dtype="float32", quantization="fp8") as llm:
        assert llm.engine.runner.fp8
        diff = (_prompt_logprobs(llm) - ref).abs()
    assert diff.max() < 0.3 and diff.mean() < 0.05
    with pytest.raises(ValueError, match="quantization must be 'fp8', 'int4', 'int8' or 'none'"):
        LLM(str(llama_dir), quantization="nf4")
