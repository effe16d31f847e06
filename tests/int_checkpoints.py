"""Tiny 4-/8-bit weight-only quantized checkpoints, written independently of streamer from the formats' public sources:

- "gptq": AutoGPTQ / GPTQModel checkpoint_format "gptq" (v1), what transformers + optimum load
  (AutoGPTQ auto_gptq/nn_modules/qlinear/qlinear_cuda_old.py and qlinear_cuda.py `QuantLinear.pack`,
  auto_gptq/quantization/gptq.py for act-order's g_idx, auto_gptq/quantization/config.py for the config);
- "awq": AutoAWQ GEMM (awq/modules/linear/gemm.py `WQLinear_GEMM.from_linear`, awq/utils/packing_utils.py);
- "compressed-tensors": llm-compressor's W4A16 / W8A16 "pack-quantized" (compressed_tensors/compressors/
  quantized_compressors/pack_quantized.py `pack_to_int32`, quantization/utils/helpers.py `calculate_qparams`,
  quantization/lifecycle/initialize.py for the scale's dtype).

Every decoder linear is quantized round-to-nearest per group of input columns (no calibration: the layout is what is
being tested, not GPTQ's or AWQ's search). Beside the quantized folder goes a plain fp32 twin whose linear weights are
(q - zero) * scale, computed from exactly the integers and scales written, so transformers can serve as the oracle.
Embeddings, norms and lm_head stay fp32 in both (real tools keep them unquantized too, in the model's dtype).
"""
from __future__ import annotations

import json
import shutil
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

# The quantized linears: attention and MLP projections, and each MoE expert's (Qwen3-MoE's experts.E.gate_proj...,
# Mixtral's block_sparse_moe.experts.E.w1 / w3 / w2); routers, embeddings, norms and the LM head stay as they are.
LINEARS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj", "w1", "w2", "w3")
# AutoAWQ packs eight output columns c0..c7 of one int32 as nibbles (low to high) c0 c2 c4 c6 c1 c3 c5 c7
# (WQLinear_GEMM.from_linear: order_map = [0, 2, 4, 6, 1, 3, 5, 7]; its unpacker undoes it with
# AWQ_REVERSE_ORDER = [0, 4, 1, 5, 2, 6, 3, 7]).
AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)
FORMATS = ("gptq", "awq", "compressed-tensors")


def copy_tokenizer(src: Path, dst: Path) -> None:
    for f in Path(src).iterdir():
        if f.name.startswith("tokenizer") or f.name in ("special_tokens_map.json", "generation_config.json"):
            shutil.copy(f, Path(dst) / f.name)


def pack(v: torch.Tensor, bits: int, dim: int, order: tuple[int, ...] | None = None) -> torch.Tensor:
    """Unsigned `bits`-bit integers packed 32 // bits to an int32 along `dim`: of each run of 32 // bits consecutive
    elements, element order[i] goes to bits [i * bits, (i + 1) * bits) (order: 0, 1, 2, ... unless given)."""
    per = 32 // bits
    assert v.min() >= 0 and v.max() < 2 ** bits and v.shape[dim] % per == 0
    order = order or tuple(range(per))
    v = v.to(torch.int64).movedim(dim, -1)
    v = v.reshape(*v.shape[:-1], v.shape[-1] // per, per)
    packed = sum(v[..., o] << (bits * i) for i, o in enumerate(order))
    packed = torch.where(packed >= 2 ** 31, packed - 2 ** 32, packed)  # the same 32 bits, read as a signed int32
    return packed.to(torch.int32).movedim(-1, dim).contiguous()


def quantize_rtn(w: torch.Tensor, bits: int, g_idx: torch.Tensor, sym: bool, scale_dtype: torch.dtype,
                 min_zero: int = 0) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Round-to-nearest of w [out, in] with column k in group g_idx[k]: (q [out, in], scale [out, groups] in
    scale_dtype, zero [out, groups]), q and zero unsigned in [0, 2^bits - 1], w ~ (q - zero[:, g_idx]) * scale.

    As GPTQ's Quantizer and compressed-tensors' calculate_qparams: each group's range includes 0;
    symmetric: scale = 2 * absmax / (2^bits - 1), zero = 2^(bits-1) (compressed-tensors: absmax / ((2^bits - 1) / 2)
    with signed zero 0, the same numbers); asymmetric: scale = (max - min) / (2^bits - 1), zero = round(-min / scale).
    The scale is rounded to scale_dtype first (fp16 in GPTQ / AWQ files) and the integers computed with that value."""
    maxq = 2 ** bits - 1
    groups = int(g_idx.max()) + 1
    lo = torch.stack([w[:, g_idx == g].amin(dim=1) for g in range(groups)], dim=1).clamp(max=0)
    hi = torch.stack([w[:, g_idx == g].amax(dim=1) for g in range(groups)], dim=1).clamp(min=0)
    scale = (2 * torch.maximum(-lo, hi) if sym else hi - lo) / maxq
    scale = scale.to(scale_dtype)
    scale = torch.where(scale > 0, scale, torch.finfo(scale_dtype).tiny)  # an all-zero group: any positive scale
    s = scale.float()
    if sym:
        zero = torch.full_like(lo, 2 ** (bits - 1), dtype=torch.int64)
    else:
        zero = torch.round(-lo / s).clamp(min_zero, maxq).to(torch.int64)
    q = (torch.round(w / s[:, g_idx]) + zero[:, g_idx]).clamp(0, maxq).to(torch.int64)
    return q, scale, zero


def group_index(cols: int, group_size: int | None, act_order: bool, gen: torch.Generator) -> torch.Tensor:
    """g_idx [cols]: the group of each input column. Act-order (GPTQ desc_act, compressed-tensors actorder "group")
    quantizes the columns in a permuted order (by the Hessian's diagonal; here a seeded random permutation) and
    groups consecutive columns of that order, so g_idx[k] = (position of column k in the order) // group_size;
    the weights themselves stay in the original column order (gptq.py: g_idx = g_idx[invperm])."""
    gs = group_size or cols
    assert cols % gs == 0, (cols, gs)
    rank = torch.randperm(cols, generator=gen) if act_order else torch.arange(cols)
    g_idx = torch.empty(cols, dtype=torch.int64)
    g_idx[rank] = torch.arange(cols) // gs
    return g_idx


def quantization_config(fmt: str, bits: int, group_size: int | None, sym: bool, desc_act: bool) -> dict:
    if fmt == "gptq":  # AutoGPTQ BaseQuantizeConfig.to_dict(), as it lands in config.json's quantization_config
        return {"bits": bits, "group_size": group_size or -1, "damp_percent": 0.01, "desc_act": desc_act,
                "static_groups": False, "sym": sym, "true_sequential": True, "model_name_or_path": None,
                "model_file_base_name": "model", "quant_method": "gptq", "checkpoint_format": "gptq"}
    if fmt == "awq":  # AutoAWQ AwqConfig.to_transformers_dict()
        return {"quant_method": "awq", "zero_point": not sym, "group_size": group_size or -1, "bits": bits,
                "version": "gemm", "modules_to_not_convert": None}
    weights = {"actorder": "group" if desc_act else None, "block_structure": None, "dynamic": False,
               "group_size": group_size, "num_bits": bits, "observer": "minmax", "observer_kwargs": {},
               "scale_dtype": None, "strategy": "group" if group_size else "channel", "symmetric": sym, "type": "int",
               "zp_dtype": None if sym else "torch.int8"}
    return {"config_groups": {"group_0": {"format": "pack-quantized", "input_activations": None,
                                          "output_activations": None, "targets": ["Linear"], "weights": weights}},
            "format": "pack-quantized", "global_compression_ratio": None, "ignore": ["lm_head"],
            "kv_cache_scheme": None, "quant_method": "compressed-tensors", "quantization_status": "compressed",
            "sparsity_config": {}, "transform_config": {}, "version": "0.12.2"}


def _quantized_tensors(fmt: str, base: str, bits: int, q: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor,
                       g_idx: torch.Tensor, sym: bool, desc_act: bool) -> dict[str, torch.Tensor]:
    """One linear's tensors in `fmt` from q [out, in], scale [out, groups], zero [out, groups] (unsigned)."""
    if fmt == "gptq":
        return {
            # [in / (32/bits), out]: packed along the INPUT dim, input row 8r + j of a column in bits 4j.. (4-bit)
            f"{base}.qweight": pack(q.T, bits, dim=0),
            # [groups, out / (32/bits)]: packed along the output dim, storing zero - 1: v1's off-by-one, which the
            # kernels undo with `zeros + 1` (qlinear_cuda_old.py: `zeros -= 1` before packing). A symmetric 4-bit
            # checkpoint's qzeros are thus all 0x77777777. v1 cannot store zero 0: quantize_rtn(min_zero=1).
            f"{base}.qzeros": pack(zero.T - 1, bits, dim=1),
            f"{base}.scales": scale.T.contiguous(),  # fp16 [groups, out]
            f"{base}.g_idx": g_idx.to(torch.int32),  # [in]: i // group_size, or act-order's permuted groups
        }
    if fmt == "awq":
        return {
            # [in, out / 8]: packed along the OUTPUT dim, in AWQ_ORDER; no off-by-one on the zeros
            f"{base}.qweight": pack(q.T, bits, dim=1, order=AWQ_ORDER),
            f"{base}.qzeros": pack(zero.T, bits, dim=1, order=AWQ_ORDER),  # [groups, out / 8]
            f"{base}.scales": scale.T.contiguous(),  # fp16 [groups, out]
        }
    # compressed-tensors quantizes to SIGNED ints (q - 2^(bits-1) in [-2^(bits-1), 2^(bits-1) - 1]) and pack_to_int32
    # adds 2^(bits-1) back before packing, so the stored fields are the unsigned q and zero here.
    out = {
        # [out, in / (32/bits)]: packed along the INPUT dim, column 8p + i of a row in bits 4i.. (4-bit)
        f"{base}.weight_packed": pack(q, bits, dim=1),
        # [out, groups] ([out, 1] per channel), in the observed weight's dtype: fp32 for an fp32 model
        # (initialize_qparams: scale_dtype = observed_dtype); bf16 checkpoints carry bf16 scales
        f"{base}.weight_scale": scale.contiguous(),
        f"{base}.weight_shape": torch.tensor(list(q.shape)),  # int64: torch.tensor(weight.shape) in compress_weight
    }
    if not sym:  # [ceil(out / (32/bits)), groups]: packed along dim 0 (output rows); absent when symmetric
        out[f"{base}.weight_zero_point"] = pack(zero, bits, dim=0)
    if desc_act:
        out[f"{base}.weight_g_idx"] = g_idx.to(torch.int32)
    return out


SAME_INPUT = {"q_proj": "qkv", "k_proj": "qkv", "v_proj": "qkv", "gate_proj": "gate_up", "up_proj": "gate_up"}


def write_int_checkpoint(src: Path, out_dir: Path, ref_dir: Path, fmt: str, bits: int = 4,
                         group_size: int | None = 32, sym: bool = True, desc_act: bool = False, sharded: bool = False,
                         seed: int = 0, shared_order: bool = False) -> None:
    """Quantize the fp32 checkpoint `src` into `out_dir` in `fmt` ("gptq", "awq", "compressed-tensors"), with bits
    4 or 8 (AWQ: 4), groups of `group_size` input columns (None: one per output channel), symmetric or not (AWQ:
    asymmetric), act-order groups (gptq desc_act / compressed-tensors actorder "group") and two shards if asked, the
    parts of each linear spread over both. `ref_dir` gets the dequantized fp32 twin. `shared_order`: linears that
    read the same input (q/k/v, gate/up) share one act-order permutation, as real GPTQ gives them (one Hessian, the
    same input's); otherwise each linear draws its own."""
    assert fmt in FORMATS and bits in (4, 8)
    assert fmt != "awq" or (bits == 4 and not sym and not desc_act), "AutoAWQ GEMM: 4-bit, zero_point, no act-order"
    assert fmt != "compressed-tensors" or not desc_act or group_size, "actorder 'group' needs the group strategy"
    src, out_dir, ref_dir = Path(src), Path(out_dir), Path(ref_dir)
    state = load_file(str(src / "model.safetensors"))
    gen = torch.Generator().manual_seed(seed)
    scale_dtype = torch.float32 if fmt == "compressed-tensors" else torch.float16
    quant, ref = {}, {}
    orders: dict[tuple[str, str], torch.Tensor] = {}
    for name, w in state.items():
        base, _, leaf = name.rpartition(".")
        if leaf != "weight" or base.rpartition(".")[2] not in LINEARS:
            quant[name] = ref[name] = w
            continue
        layer, _, proj = base.rpartition(".")
        key = (layer, SAME_INPUT.get(proj, proj)) if shared_order else (base, "")
        g_idx = orders[key] if key in orders else orders.setdefault(key, group_index(w.shape[1], group_size, desc_act,
                                                                                     gen))
        q, scale, zero = quantize_rtn(w.float(), bits, g_idx, sym, scale_dtype, min_zero=1 if fmt == "gptq" else 0)
        ref[name] = (q - zero[:, g_idx]).float() * scale.float()[:, g_idx]
        quant.update(_quantized_tensors(fmt, base, bits, q, scale, zero, g_idx, sym, desc_act))

    cfg = json.loads((src / "config.json").read_text())
    cfg.pop("quantization_config", None)
    for d in (out_dir, ref_dir):
        d.mkdir(parents=True)
        copy_tokenizer(src, d)
    (ref_dir / "config.json").write_text(json.dumps(cfg, indent=2))
    save_file(ref, str(ref_dir / "model.safetensors"))
    cfg["quantization_config"] = quantization_config(fmt, bits, group_size, sym, desc_act)
    (out_dir / "config.json").write_text(json.dumps(cfg, indent=2))
    if not sharded:
        save_file(quant, str(out_dir / "model.safetensors"), metadata={"format": "pt"})
        return
    # Alternate the sorted names between the shards: X.qweight, X.qzeros, X.scales land in different files.
    files = ("model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors")
    weight_map = {n: files[i % 2] for i, n in enumerate(sorted(quant))}
    for f in files:
        save_file({n: quant[n] for n in weight_map if weight_map[n] == f}, str(out_dir / f), metadata={"format": "pt"})
    total = sum(t.numel() * t.element_size() for t in quant.values())
    (out_dir / "model.safetensors.index.json").write_text(
        json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map}, indent=2))
