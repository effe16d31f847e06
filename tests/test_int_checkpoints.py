"""4-/8-bit weight-only checkpoints (GPTQ v1, AutoAWQ GEMM, compressed-tensors pack-quantized) load and run as the
weights they encode: the engine's greedy output (and prompt log-probabilities) on a quantized folder equal
transformers' on the same weights dequantized by tests/int_checkpoints.py (written from the formats' public sources,
independently of the engine) and saved as a plain fp32 checkpoint. The written files themselves are checked against
each format's known facts."""
from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

pytest.importorskip("transformers")

from streamer import LLM, SamplingParams  # noqa: E402
from streamer.models.layers import PackableLinear  # noqa: E402
from tests.checkpoints import hf_greedy  # noqa: E402
from tests.int_checkpoints import AWQ_ORDER, LINEARS, pack, write_int_checkpoint  # noqa: E402

PROMPTS = [[5, 17, 33, 9, 100], [40, 41, 42] * 9, list(range(60, 100))]
CASES = {
    "gptq-4bit-sym-g32": dict(fmt="gptq", bits=4, group_size=32, sym=True),
    "gptq-4bit-asym-g64": dict(fmt="gptq", bits=4, group_size=64, sym=False),
    "gptq-4bit-channel": dict(fmt="gptq", bits=4, group_size=None, sym=True),
    # asymmetric: the zero points as well as the scales follow g_idx
    "gptq-4bit-desc-act": dict(fmt="gptq", bits=4, group_size=32, sym=False, desc_act=True),
    # q/k/v (and gate/up) in one act order, as GPTQ gives linears with the same input: those stay 4-bit too
    "gptq-4bit-desc-act-shared": dict(fmt="gptq", bits=4, group_size=32, sym=True, desc_act=True, shared_order=True),
    "gptq-8bit-sym-g32": dict(fmt="gptq", bits=8, group_size=32, sym=True),
    "gptq-8bit-channel": dict(fmt="gptq", bits=8, group_size=None, sym=True),  # int8 kernels (W8A16)
    "ct-8bit-channel-asym": dict(fmt="compressed-tensors", bits=8, group_size=None, sym=False),  # + offsets
    "awq-g32": dict(fmt="awq", group_size=32, sym=False),
    "awq-g64-sharded": dict(fmt="awq", group_size=64, sym=False, sharded=True),
    "ct-sym-g32": dict(fmt="compressed-tensors", group_size=32, sym=True),
    "ct-asym-g32": dict(fmt="compressed-tensors", group_size=32, sym=False),
    "ct-channel": dict(fmt="compressed-tensors", group_size=None, sym=True),
    "ct-actorder-group": dict(fmt="compressed-tensors", group_size=32, sym=True, desc_act=True, shared_order=True),
}
# Which linears keep their codes: all, but none of grouped 8-bit checkpoints (channel-wise ones run the int8
# kernels), and where q/k/v (gate/up) each have their own act order, only o_proj and down_proj (one input order
# cannot serve the fused qkv / gate_up layer: dequantized).
INT4_SHARE = {"gptq-8bit-sym-g32": 0.0, "gptq-4bit-desc-act": 0.5}
# AutoAWQ's unpacker (awq/utils/packing_utils.py): output column j of a run of 8 sits in nibble AWQ_REVERSE_ORDER[j].
AWQ_REVERSE_ORDER = (0, 4, 1, 5, 2, 6, 3, 7)


def _write(llama_dir: Path, tmp_path: Path, case: str) -> tuple[Path, Path]:
    out_dir, ref_dir = tmp_path / "quant", tmp_path / "ref"
    write_int_checkpoint(llama_dir, out_dir, ref_dir, **CASES[case])
    return out_dir, ref_dir


def _hf_prompt_logprobs(model_dir: Path) -> torch.Tensor:
    """transformers' log-probability of each prompt token after the first, all prompts concatenated (fp32)."""
    import transformers as tf
    model = tf.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    out = []
    with torch.no_grad():
        for p in PROMPTS:
            ids = torch.tensor([p])
            lp = torch.log_softmax(model(ids).logits[0, :-1].float(), dim=-1)
            out.append(lp.gather(1, ids[0, 1:, None])[:, 0])
    return torch.cat(out)


def _prompt_logprobs(llm: LLM) -> torch.Tensor:
    params = SamplingParams(max_tokens=1, prompt_logprobs=0, temperature=0.0)
    outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], params)
    return torch.tensor([o.prompt_logprobs[i][p[i]].logprob for p, o in zip(PROMPTS, outs) for i in range(1, len(p))])


@pytest.fixture(scope="module")
def unquantized(llama_dir):
    return hf_greedy(llama_dir, PROMPTS, 8), _hf_prompt_logprobs(llama_dir)


def test_zero_biases_of_old_gptq_writers_are_dropped(llama_dir, tmp_path):
    """Older AutoGPTQ versions wrote a zero `bias` for every quantized linear, even for models without biases
    (TheBloke's Llama checkpoints): they load; a non-zero bias with no place in the model is still refused."""
    from safetensors.torch import save_file
    out_dir, ref_dir = _write(llama_dir, tmp_path, "gptq-4bit-sym-g32")
    state = load_file(str(out_dir / "model.safetensors"))
    scales = [n for n in state if n.endswith(".scales")]
    state.update({n.replace(".scales", ".bias"): torch.zeros(state[n].shape[1], dtype=torch.float16) for n in scales})
    save_file(state, str(out_dir / "model.safetensors"))
    with LLM(str(out_dir), dtype="float32") as llm:
        params = SamplingParams(max_tokens=8, temperature=0.0, min_tokens=8)
        got = [o.outputs[0].token_ids for o in llm.generate([{"prompt_token_ids": p} for p in PROMPTS], params)]
    assert got == hf_greedy(ref_dir, PROMPTS, 8)
    state[scales[0].replace(".scales", ".bias")][0] = 1.0
    save_file(state, str(out_dir / "model.safetensors"))
    with pytest.raises(ValueError, match="unexpected tensor.*bias"):
        LLM(str(out_dir), dtype="float32")


@pytest.mark.parametrize("family,fmt", [("qwen3_moe", "gptq"), ("mixtral", "awq")])
def test_moe_experts_stay_4bit(make_ckpt, tmp_path, family, fmt):
    """A sparse MLP whose experts are all 4-bit computes with them (one int4 matmul pair per expert with tokens)
    and matches transformers on the dequantized experts; Qwen3-MoE's dense layer and the attention too."""
    from streamer.models.moe import SparseMoE
    src = make_ckpt(family, family=family)
    out_dir, ref_dir = tmp_path / "quant", tmp_path / "ref"
    write_int_checkpoint(src, out_dir, ref_dir, fmt, group_size=32, sym=False)
    want = hf_greedy(ref_dir, PROMPTS, 8)
    assert want != hf_greedy(src, PROMPTS, 8), "quantization must change something to prove much"
    with LLM(str(out_dir), dtype="float32", max_num_batched_tokens=16) as llm:  # chunks: many tokens per expert
        params = SamplingParams(max_tokens=8, temperature=0.0, min_tokens=8)
        got = [o.outputs[0].token_ids for o in llm.generate([{"prompt_token_ids": p} for p in PROMPTS], params)]
        model = llm.engine.runner.model
        moes = [m for m in model.modules() if isinstance(m, SparseMoE)]
        linears = [m for m in model.modules() if isinstance(m, PackableLinear)]
    assert got == want
    assert moes and all(m.int4 is not None and m.w13.numel() == 0 for m in moes)
    assert all(m.qweight is not None for m in linears)


@pytest.mark.parametrize("case", list(CASES))
def test_int_checkpoint_matches_transformers_on_dequantized_weights(llama_dir, tmp_path, unquantized, case):
    out_dir, ref_dir = _write(llama_dir, tmp_path, case)
    want, want_lp = hf_greedy(ref_dir, PROMPTS, 8), _hf_prompt_logprobs(ref_dir)
    with LLM(str(out_dir), dtype="float32") as llm:
        params = SamplingParams(max_tokens=8, temperature=0.0, min_tokens=8)
        got = [o.outputs[0].token_ids for o in llm.generate([{"prompt_token_ids": p} for p in PROMPTS], params)]
        got_lp = _prompt_logprobs(llm)
        linears = [m for m in llm.engine.runner.model.modules() if isinstance(m, PackableLinear)]
        int4 = sum(m.qweight is not None for m in linears)
    assert int4 == len(linears) * INT4_SHARE.get(case, 1.0), "4-bit (channel-wise 8-bit) layers keep their codes"
    assert got == want
    err = (got_lp - want_lp).abs().max().item()
    assert err < 1e-3, err
    # The test proves something only if the quantization shows: at 4 bits transformers' own greedy continuation
    # changes; at 8 bits it does not on this model (log-probabilities move by ~0.02), so there the engine's
    # log-probabilities must sit far closer to the dequantized model's than to the unquantized one's.
    orig, orig_lp = unquantized
    assert want != orig or (got_lp - orig_lp).abs().max() > 10 * max(err, 1e-4)


def _tensors(folder: Path) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    """Every tensor of a folder, and the file each came from."""
    tensors, where = {}, {}
    for f in sorted(folder.glob("*.safetensors")):
        for name, t in load_file(str(f)).items():
            tensors[name], where[name] = t, f.name
    return tensors, where


def _unpack(x: torch.Tensor, bits: int, dim: int) -> torch.Tensor:
    """Unsigned ints of an int32 tensor along dim: field i (bits [i * bits, (i + 1) * bits)) of element n becomes
    element n * (32 // bits) + i."""
    shifts = torch.arange(0, 32, bits)
    v = (x.to(torch.int64).movedim(dim, -1)[..., None] >> shifts) & (2 ** bits - 1)
    return v.flatten(-2).movedim(-1, dim)


def _dequantize(fmt: str, t: dict[str, torch.Tensor], base: str, bits: int, group_size: int | None) -> torch.Tensor:
    """A linear's fp32 weight [out, in] decoded from its files as each format's loaders do."""
    if fmt == "gptq":
        w = _unpack(t[f"{base}.qweight"], bits, 0)  # [in, out]
        zeros = _unpack(t[f"{base}.qzeros"], bits, 1) + 1  # v1: stored zero - 1
        g = t[f"{base}.g_idx"].long()
        return ((w - zeros[g]).float() * t[f"{base}.scales"].float()[g]).T
    if fmt == "awq":
        def unpack_awq(x: torch.Tensor) -> torch.Tensor:
            v = _unpack(x, 4, 1)
            return v.reshape(v.shape[0], -1, 8)[:, :, list(AWQ_REVERSE_ORDER)].flatten(1)
        w, zeros = unpack_awq(t[f"{base}.qweight"]), unpack_awq(t[f"{base}.qzeros"])  # [in, out], [groups, out]
        g = torch.arange(w.shape[0]) // (group_size or w.shape[0])
        return ((w - zeros[g]).float() * t[f"{base}.scales"].float()[g]).T
    offset = 2 ** (bits - 1)  # compressed-tensors: signed values stored + 2^(bits-1)
    w = _unpack(t[f"{base}.weight_packed"], bits, 1) - offset  # [out, in]
    out, cols = t[f"{base}.weight_shape"].tolist()
    w = w[:out, :cols]
    scale = t[f"{base}.weight_scale"].float()  # [out, groups]
    zp = t.get(f"{base}.weight_zero_point")  # absent: symmetric, zero point 0
    zp = torch.zeros(scale.shape, dtype=torch.int64) if zp is None else _unpack(zp, bits, 0)[:out] - offset
    g = t.get(f"{base}.weight_g_idx")
    g = torch.arange(cols) // (group_size or cols) if g is None else g.long()
    return (w - zp[:, g]).float() * scale[:, g]


def test_packing_known_values():
    # GPTQ qweight: input rows 0..7 of one output column, value j in bits 4j.. -> 0x76543210
    assert pack(torch.arange(8)[:, None], 4, dim=0).item() == 0x76543210
    # AWQ: output columns 0..7 in nibble order 0 2 4 6 1 3 5 7 -> 0x75316420
    assert pack(torch.arange(8)[None, :], 4, dim=1, order=AWQ_ORDER).item() == 0x75316420
    # compressed-tensors pack_to_int32's docstring: 8-bit [1, 2] -> unsigned [129, 130] (+ zero padding) -> 33409
    assert pack(torch.tensor([[129, 130, 0, 0]]), 8, dim=1).item() == 33409
    # the top field set: the int32 is negative (the same bits)
    assert pack(torch.full((1, 8), 15), 4, dim=1).item() == -1
    assert _unpack(pack(torch.arange(16).reshape(2, 8) % 16, 4, dim=1), 4, 1).tolist() == [list(range(8)),
                                                                                           list(range(8, 16))]


@pytest.mark.parametrize("case", list(CASES))
def test_written_files_follow_the_format(llama_dir, tmp_path, case):
    kw = CASES[case]
    fmt, bits, gs, sym = kw["fmt"], kw.get("bits", 4), kw["group_size"], kw["sym"]
    desc_act = kw.get("desc_act", False)
    out_dir, ref_dir = _write(llama_dir, tmp_path, case)
    src = load_file(str(llama_dir / "model.safetensors"))
    t, where = _tensors(out_dir)
    ref = load_file(str(ref_dir / "model.safetensors"))
    cfg, ref_cfg = (json.loads((d / "config.json").read_text()) for d in (out_dir, ref_dir))
    qc = cfg.pop("quantization_config")
    assert cfg == ref_cfg and "quantization_config" not in ref_cfg
    assert (out_dir / "tokenizer.json").exists() and (ref_dir / "tokenizer.json").exists()
    if fmt == "gptq":
        assert qc["quant_method"] == "gptq" and qc["checkpoint_format"] == "gptq"
        assert (qc["bits"], qc["group_size"], qc["sym"], qc["desc_act"]) == (bits, gs or -1, sym, desc_act)
    elif fmt == "awq":
        assert qc == {"quant_method": "awq", "zero_point": True, "group_size": gs, "bits": 4, "version": "gemm",
                      "modules_to_not_convert": None}
    else:
        assert (qc["quant_method"], qc["format"], qc["quantization_status"]) == ("compressed-tensors",
                                                                                 "pack-quantized", "compressed")
        assert qc["ignore"] == ["lm_head"]
        group = qc["config_groups"]["group_0"]
        assert group["targets"] == ["Linear"] and group["input_activations"] is None
        w = group["weights"]
        assert (w["num_bits"], w["type"], w["symmetric"], w["group_size"], w["dynamic"]) == (bits, "int", sym, gs,
                                                                                               False)
        assert w["strategy"] == ("group" if gs else "channel") and w["actorder"] == ("group" if desc_act else None)

    per = 32 // bits
    bases = sorted(n[:-len(".weight")] for n in src if n.endswith(".weight") and n.split(".")[-2] in LINEARS)
    assert len(bases) == 14
    for name, value in src.items():  # everything else passes through, fp32
        if name[:-len(".weight")] not in bases:
            assert torch.equal(t[name], value) and torch.equal(ref[name], value)
    for base in bases:
        rows, cols = src[f"{base}.weight"].shape
        groups = cols // (gs or cols)
        parts = {n[len(base) + 1:]: v for n, v in t.items() if n.startswith(base + ".")}
        shapes = {k: (tuple(v.shape), v.dtype) for k, v in parts.items()}
        if fmt == "gptq":
            assert shapes == {"qweight": ((cols // per, rows), torch.int32),
                              "qzeros": ((groups, rows // per), torch.int32),
                              "scales": ((groups, rows), torch.float16), "g_idx": ((cols,), torch.int32)}
            if sym:  # zero 2^(bits-1), stored minus one in every field: 0x77777777 / 0x7F7F7F7F
                assert (parts["qzeros"] == {4: 0x77777777, 8: 0x7F7F7F7F}[bits]).all()
            assert torch.equal(parts["g_idx"].long(), torch.arange(cols) // (gs or cols)) or desc_act
        elif fmt == "awq":
            assert shapes == {"qweight": ((cols, rows // 8), torch.int32), "qzeros": ((groups, rows // 8), torch.int32),
                              "scales": ((groups, rows), torch.float16)}
        else:
            want = {"weight_packed": ((rows, cols // per), torch.int32),
                    "weight_scale": ((rows, groups), torch.float32)}
            if not sym:
                want["weight_zero_point"] = ((-(-rows // per), groups), torch.int32)
            if desc_act:
                want["weight_g_idx"] = ((cols,), torch.int32)
            shape = parts["weight_shape"]
            assert shape.dtype in (torch.int32, torch.int64) and shape.tolist() == [rows, cols]
            assert {k: v for k, v in shapes.items() if k != "weight_shape"} == want
        if desc_act:  # act-order: every group still has group_size columns, just not consecutive ones
            g = parts.get("g_idx", parts.get("weight_g_idx")).long()
            assert not torch.equal(g, torch.arange(cols) // gs)
            assert torch.equal(torch.bincount(g), torch.full((groups,), gs))
        if kw.get("sharded"):
            assert len({where[f"{base}.{k}"] for k in parts}) == 2, "a linear's parts should span both shards"
        deq = _dequantize(fmt, t, base, bits, gs)
        torch.testing.assert_close(deq, ref[f"{base}.weight"], rtol=0, atol=0)
        w = src[f"{base}.weight"]
        rel = ((deq - w).norm() / w.norm()).item()  # round-to-nearest's own error: ~10% at 4 bits, <1% at 8
        assert rel < (0.15 if bits == 4 else 0.01), rel
    if kw.get("sharded"):
        index = json.loads((out_dir / "model.safetensors.index.json").read_text())
        assert index["weight_map"] == where and len(set(where.values())) == 2


def _patched(folder: Path, **changes) -> Path:
    cfg = json.loads((folder / "config.json").read_text())
    cfg["quantization_config"].update(changes)
    (folder / "config.json").write_text(json.dumps(cfg, indent=2))
    return folder


def test_unsupported_int_checkpoints_are_refused(llama_dir, tmp_path):
    # A 3-bit GPTQ config (on 4-bit tensors: the loader must refuse on the config, not misread them) and an AutoAWQ
    # GEMV one (a different packing: qweight [out, in / 8]).
    write_int_checkpoint(llama_dir, tmp_path / "gptq", tmp_path / "gptq-ref", "gptq")
    write_int_checkpoint(llama_dir, tmp_path / "awq", tmp_path / "awq-ref", "awq", sym=False)
    for folder in (_patched(tmp_path / "gptq", bits=3), _patched(tmp_path / "awq", version="gemv")):
        with pytest.raises(ValueError):
            LLM(str(folder), dtype="float32")
