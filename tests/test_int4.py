"""4- and 8-bit weight-only compute (streamer/models/woq.py): torch's int4 / int8 kernels in the engine's layout
against the dequantized weights, and `quantization="int4"` / `"int8"` against transformers (and PEFT) running the
same rounded weights.
The checkpoint formats (GPTQ, AWQ, pack-quantized) are tested in test_int_checkpoints.py."""
from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

pytest.importorskip("transformers")

from streamer import LLM, LoRARequest, SamplingParams  # noqa: E402
from streamer.models import woq  # noqa: E402
from streamer.models.layers import PackableLinear  # noqa: E402
from streamer.models.woq import (  # noqa: E402
    INT8_KERNEL_ROWS,
    Int8Weight,
    Unpacked,
    kernel_group,
    pack_int4,
    pack_int8,
    quantize_rtn,
    quantize_rtn_int8,
)
from tests.checkpoints import hf_greedy  # noqa: E402

PROMPTS = [[5, 17, 33, 9, 100], [40, 41, 42] * 9, list(range(60, 100))]
GREEDY = SamplingParams(max_tokens=8, temperature=0.0, min_tokens=8)


def _random_unpacked(out: int, cols: int, groups: int, seed: int) -> Unpacked:
    g = torch.Generator().manual_seed(seed)
    return Unpacked(codes=torch.randint(0, 16, (out, cols), generator=g, dtype=torch.uint8),
                    scale=torch.rand(out, groups, generator=g) * 0.02 + 0.001,
                    zero=torch.randint(0, 16, (out, groups), generator=g).float())


@pytest.mark.parametrize("out,cols,groups", [(16, 64, 2), (48, 128, 2), (32, 256, 1), (64, 512, 1), (32, 96, 3),
                                             (16, 1024, 2)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_int4_kernel_matches_the_dequantized_weight(out, cols, groups, dtype):
    """Group sizes the kernels take directly (32, 64) and coarser ones they run as repeated finer groups (a whole
    row of 256 or 96, 512-column groups); a 3-D input and a single row."""
    u = _random_unpacked(out, cols, groups, seed=out + cols)
    w = pack_int4(u, dtype, torch.device("cpu"))
    assert w.group_size == kernel_group(cols, cols // groups if groups > 1 else -1)
    ref_w = u.dequantize(torch.float32)
    for shape in ((2, 3, cols), (1, cols)):
        x = torch.randn(*shape).to(dtype)
        got = w.matmul(x).float()
        want = x.float() @ ref_w.t()
        assert got.shape == (*shape[:-1], out)
        err = (got - want).norm() / want.norm()
        assert err < (1e-5 if dtype == torch.float32 else 2e-2), err


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_many_rows_dequantize_chunks(dtype, monkeypatch):
    """From DEQUANT_ROWS rows on, a CPU matmul dequantizes the weight 1,024 output rows at a time (in the blocks
    torch's CPU layout has on this machine: 64 rows with AVX-512, 32 with AVX2) and multiplies densely: 1,152 rows
    here, a full chunk and a partial one. Same result as the int4 kernel, which still takes fewer rows, and every
    row count when the dequantization may not be compiled (enforce_eager)."""
    calls = []
    real = woq._dequantize
    monkeypatch.setattr(woq, "_dequantize", lambda *a: calls.append(a[0].shape[0]) or real(*a))
    u = _random_unpacked(18 * 64, 256, 2, seed=7)
    w = pack_int4(u, dtype, torch.device("cpu"))
    rows = woq.DEQUANT_ROWS[dtype]
    for compile in (True, False):
        w.compile = compile
        for n in (rows - 1, rows, 300):
            x = torch.randn(n, 256).to(dtype)
            want = torch.ops.aten._weight_int4pack_mm_for_cpu(x, w.packed, w.group_size, w.scales_and_zeros).float()
            got = w.matmul(x).float()
            err = (got - want).norm() / want.norm()
            assert err < (1e-6 if dtype == torch.float32 else 1e-2), (n, err)
    block = woq.cpu_int4_block()
    assert block in (64, 32) and w.block_scales is not None
    chunk = 1024 // block
    assert calls == [chunk, 18 * 64 // block - chunk] * 2, calls  # (compiled, from `rows` rows on)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
def test_int4_kernel_on_cuda(llama_dir):
    """tinygemm's layout (two codes a byte, the even column high) and its scale/zero pairs, against the
    dequantized weight; then the engine on the GPU with every linear 4-bit."""
    dev = torch.device("cuda")
    for out, cols, groups in ((64, 128, 2), (256, 1024, 8), (128, 4096, 1)):
        u = _random_unpacked(out, cols, groups, seed=cols)
        w = pack_int4(u, torch.bfloat16, dev)
        x = torch.randn(5, cols, device=dev).bfloat16()
        want = x.float() @ u.dequantize(torch.float32).to(dev).t()
        err = (w.matmul(x).float() - want).norm() / want.norm()
        assert err < 2e-2, (out, cols, groups, err)
    with LLM(str(llama_dir), dtype="bfloat16", quantization="int4") as llm:
        outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], GREEDY)
        linears = [m for m in llm.engine.runner.model.modules() if isinstance(m, PackableLinear)]
        assert all(m.qweight is not None and m.qweight.packed.is_cuda for m in linears)
    assert all(len(o.outputs[0].token_ids) == 8 for o in outs)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
def test_int8_is_refused_on_cuda(llama_dir):
    with pytest.raises(ValueError, match="quantization='int8' runs on CPU only"):
        LLM(str(llama_dir), dtype="bfloat16", quantization="int8")


def test_rtn_rounding_hits_the_group_extremes():
    w = torch.randn(16, 64)
    u = quantize_rtn(w, 32)
    assert u.codes.dtype == torch.uint8 and int(u.codes.max()) <= 15
    err = (u.dequantize(torch.float32) - w).abs()
    step = u.scale.repeat_interleave(32, 1)
    assert bool((err <= step / 2 + 1e-6).all()), "every weight within half a step of its rounded value"
    assert bool((u.codes.view(16, 2, 32).amax(-1) == 15).all()), "each group's maximum maps to the top code"


def _rounded(src: Path, ref: Path) -> Path:
    """`src` with every decoder linear (MoE experts' too) replaced by what quantization="int4" computes with (the
    group the kernels take for 128 columns: 64 for the 64-wide inputs), as plain fp32 weights."""
    shutil.copytree(src, ref)
    state = load_file(str(src / "model.safetensors"))
    for name, w in state.items():
        if name.endswith("_proj.weight"):
            state[name] = quantize_rtn(w, kernel_group(w.shape[1], 128)).dequantize(torch.float32)
    save_file(state, str(ref / "model.safetensors"))
    return ref


@pytest.fixture(scope="module")
def rounded_dir(llama_dir, tmp_path_factory) -> Path:
    return _rounded(llama_dir, tmp_path_factory.mktemp("int4") / "rounded")


def _int4_bytes(llm: LLM) -> int:
    linears = [m for m in llm.engine.runner.model.modules() if isinstance(m, PackableLinear)]
    assert linears and all(m.qweight is not None and m.weight.numel() == 0 for m in linears)
    return sum(m.qweight.packed.numel() * m.qweight.packed.element_size() for m in linears)


def test_quantization_int4_matches_transformers_on_the_rounded_weights(llama_dir, rounded_dir):
    want = hf_greedy(rounded_dir, PROMPTS, 8)
    assert want != hf_greedy(llama_dir, PROMPTS, 8), "rounding to 4 bits must change something to prove much"
    with LLM(str(llama_dir), dtype="float32", quantization="int4", max_num_batched_tokens=16) as llm:
        got = [o.outputs[0].token_ids for o in llm.generate([{"prompt_token_ids": p} for p in PROMPTS], GREEDY)]
        packed = _int4_bytes(llm)
    assert got == want
    state = load_file(str(llama_dir / "model.safetensors"))
    fp32 = sum(w.numel() * 4 for name, w in state.items() if name.endswith("_proj.weight"))
    assert packed * 8 == fp32, "4 bits a weight, against fp32's 32"


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("symmetric", [True, False])
def test_int8_matmul_matches_the_dequantized_weight(dtype, symmetric):
    """Channel-wise 8-bit codes: `_weight_int8pack_mm` for a few bf16 rows, the codes converted and the output
    scaled for more rows (and fp32), over 1,024-row chunks (1,100 rows: a partial chunk); asymmetric zero points
    add sum(x) * offset."""
    g = torch.Generator().manual_seed(3)
    zero = torch.full((1100, 1), 128.0) if symmetric else torch.randint(100, 160, (1100, 1), generator=g).float()
    u = Unpacked(torch.randint(0, 256, (1100, 96), generator=g, dtype=torch.uint8),
                 torch.rand(1100, 1, generator=g) * 0.01 + 1e-3, zero)
    w = pack_int8(u, dtype, torch.device("cpu"))
    assert w.codes.dtype == torch.int8 and (w.offsets is None) == symmetric
    want_w = u.dequantize(torch.float32)
    for rows in (1, INT8_KERNEL_ROWS, INT8_KERNEL_ROWS + 1, 70):
        x = torch.randn(rows, 96).to(dtype)
        want = x.float() @ want_w.t()
        err = (w.matmul(x).float() - want).norm() / want.norm()
        assert err < (1e-5 if dtype == torch.float32 else 1e-2), (rows, err)


def test_quantization_int8_matches_transformers_on_the_rounded_weights(llama_dir, tmp_path):
    """quantization="int8" rounds every decoder linear per output channel (symmetric, 8 bits) and keeps int8
    codes, half of bf16's bytes; its tokens are transformers' on the same rounded weights."""
    ref = tmp_path / "rounded8"
    shutil.copytree(llama_dir, ref)
    state = load_file(str(llama_dir / "model.safetensors"))
    for name, t in state.items():
        if name.endswith("_proj.weight"):
            state[name] = quantize_rtn_int8(t).dequantize(torch.float32)
    save_file(state, str(ref / "model.safetensors"))
    with LLM(str(llama_dir), dtype="float32", quantization="int8", max_num_batched_tokens=16) as llm:
        got = [o.outputs[0].token_ids for o in llm.generate([{"prompt_token_ids": p} for p in PROMPTS], GREEDY)]
        linears = [m for m in llm.engine.runner.model.modules() if isinstance(m, PackableLinear)]
        assert linears and all(isinstance(m.qweight, Int8Weight) and m.weight.numel() == 0 for m in linears)
    assert got == hf_greedy(ref, PROMPTS, 8)


def test_int4_compiled_equals_eager(llama_dir):
    outs = []
    for eager in (True, False):
        with LLM(str(llama_dir), dtype="float32", quantization="int4", enforce_eager=eager) as llm:
            outs.append([o.outputs[0].token_ids
                         for o in llm.generate([{"prompt_token_ids": p} for p in PROMPTS], GREEDY)])
    assert outs[0] == outs[1]


def test_lora_adapters_on_int4_weights(llama_dir, rounded_dir, tmp_path):
    """An adapter over 4-bit weights gives what PEFT gives over the same rounded weights."""
    pytest.importorskip("peft")
    from tests.lora_adapters import ALL_LINEARS, make_adapter, peft_greedy
    adapter = make_adapter(llama_dir, tmp_path / "adapter", seed=3, r=4, alpha=8, targets=ALL_LINEARS, std=0.2)
    want = peft_greedy(rounded_dir, adapter, PROMPTS, 8)
    assert want != hf_greedy(rounded_dir, PROMPTS, 8), "the adapter must change something to prove much"
    with LLM(str(llama_dir), dtype="float32", quantization="int4", enable_lora=True, max_lora_rank=8) as llm:
        got = [o.outputs[0].token_ids for o in llm.generate(
            [{"prompt_token_ids": p} for p in PROMPTS], GREEDY, lora_request=LoRARequest("a", str(adapter)))]
    assert got == want


def test_int4_refuses_what_it_cannot_do():
    with pytest.raises(ValueError, match="quantization must be 'fp8', 'int4', 'int8' or 'none'"):
        LLM(quantization="int3")


@pytest.mark.parametrize("act_order", [False, True])
def test_int4_checkpoint_over_two_ranks(llama_dir, tmp_path, act_order):
    """Each rank takes its rows (q/k/v, gate/up) or its groups of columns (o_proj, down_proj) of the codes, scales
    and zeros. An act-order row-parallel layer cannot permute a slice of its input: it is dequantized instead."""
    from tests.int_checkpoints import write_int_checkpoint
    out_dir, ref_dir = tmp_path / "gptq", tmp_path / "ref"
    write_int_checkpoint(llama_dir, out_dir, ref_dir, "gptq", group_size=32, sym=False, desc_act=act_order,
                         shared_order=True)
    want = hf_greedy(ref_dir, PROMPTS, 8)
    with LLM(str(out_dir), dtype="float32", tensor_parallel_size=2) as llm:
        got = [o.outputs[0].token_ids for o in llm.generate([{"prompt_token_ids": p} for p in PROMPTS], GREEDY)]
        linears = {n.rsplit(".", 1)[-1]: m for n, m in llm.engine.runner.model.named_modules()
                   if isinstance(m, PackableLinear)}
    assert got == want
    assert {n: m.qweight is not None for n, m in linears.items()} == {
        "qkv_proj": True, "gate_up_proj": True, "o_proj": not act_order, "down_proj": not act_order}


def test_quantization_int4_rounds_moe_experts(make_ckpt, tmp_path):
    from streamer.models.moe import SparseMoE
    src = make_ckpt("qwen3_moe", family="qwen3_moe")
    ref = _rounded(src, tmp_path / "rounded")
    want = hf_greedy(ref, PROMPTS, 8)
    with LLM(str(src), dtype="float32", quantization="int4") as llm:
        got = [o.outputs[0].token_ids for o in llm.generate([{"prompt_token_ids": p} for p in PROMPTS], GREEDY)]
        moes = [m for m in llm.engine.runner.model.modules() if isinstance(m, SparseMoE)]
    assert moes and all(m.int4 is not None for m in moes)
    assert got == want


def test_int4_moe_checkpoint_over_two_ranks(make_ckpt, tmp_path):
    """Each rank holds its slice of every 4-bit expert (I = 64: 32 columns of down_proj a rank, one group)."""
    from streamer.models.moe import SparseMoE
    from tests.int_checkpoints import write_int_checkpoint
    src = make_ckpt("qwen3_moe_i64", family="qwen3_moe", moe_intermediate_size=64)
    out_dir, ref_dir = tmp_path / "gptq", tmp_path / "ref"
    write_int_checkpoint(src, out_dir, ref_dir, "gptq", group_size=32, sym=False)
    want = hf_greedy(ref_dir, PROMPTS, 8)
    with LLM(str(out_dir), dtype="float32", tensor_parallel_size=2) as llm:
        got = [o.outputs[0].token_ids for o in llm.generate([{"prompt_token_ids": p} for p in PROMPTS], GREEDY)]
        moes = [m for m in llm.engine.runner.model.modules() if isinstance(m, SparseMoE)]
    assert moes and all(m.int4 is not None for m in moes)
    assert got == want
