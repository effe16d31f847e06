"""Compile every kernel for a GPU target on a machine without a GPU, and report its resource usage.

    python -m streamer_kernels.aot [--arch 90] [--quick] [--json out.json]

Triton's compiler (TTIR -> TTGIR -> LLVM -> PTX -> cubin, with its bundled ptxas) needs no device: only the
launcher does. Installing a stand-in driver that reports the wanted target, and turning every launch into a
`warmup` (compile, do not run), lets the real host wrappers run end to end on CPU tensors, so exactly the
specialisations the engine would launch get compiled. That catches what the interpreter cannot (code-generation
errors, shared memory overflows) and shows registers / spills / shared memory per variant, which is how the
launch configurations were sized without a GPU at hand.

Must run in a process where TRITON_INTERPRET is unset (the tests start it as a subprocess).
"""
from __future__ import annotations

import argparse
import contextlib
import json
import os
import re
import subprocess
import sys
import tempfile
from dataclasses import asdict, dataclass
from typing import Any, Callable, Iterator

import torch

from streamer_kernels import _utils


@dataclass
class CompiledVariant:
    kernel: str
    case: str
    num_warps: int
    num_stages: int
    shared_bytes: int
    registers: int
    spill_bytes: int
    mma: str  # tensor-core instruction family in the PTX: wgmma (Hopper), mma (Ampere+), or none


class _FakeDriver:
    """Just enough of triton.runtime.driver's active driver for JITFunction.run(warmup=True)."""

    def __init__(self, target: Any) -> None:
        self.target = target

    def get_current_device(self) -> int:
        return 0

    def get_current_stream(self, device: Any = None) -> int:
        return 0

    def get_current_target(self) -> Any:
        return self.target

    def get_active_torch_device(self) -> torch.device:
        return torch.device("cpu")

    def is_active(self) -> bool:
        return True


# Shared memory one program may take (the opt-in maximum) by compute capability: A100 163 KB, H100/H200 and B200
# 227 KB, consumer GPUs (sm_86/89/120) 99 KB.
_SHARED_MEMORY = {80: 163 * 1024, 87: 163 * 1024, 90: 227 * 1024, 100: 227 * 1024}


@contextlib.contextmanager
def compile_only(arch: int) -> Iterator[list[Any]]:
    """Within the block, kernel[grid](...) compiles for sm_<arch> and returns without launching. Yields the
    list the compiled kernels are appended to."""
    if os.environ.get("TRITON_INTERPRET", "0") not in ("0", ""):
        raise RuntimeError("streamer_kernels.aot needs TRITON_INTERPRET unset")
    from triton.backends.compiler import GPUTarget
    from triton.runtime import driver
    from triton.runtime.jit import JITFunction

    compiled: list[Any] = []
    original = JITFunction.__getitem__

    def getitem(self: JITFunction, grid: Any) -> Callable[..., Any]:
        def launch(*args: Any, **kwargs: Any) -> None:
            compiled.append(self.run(*args, grid=grid, warmup=True, **kwargs))
        return launch

    driver.set_active(_FakeDriver(GPUTarget("cuda", arch, 32)))
    JITFunction.__getitem__ = getitem  # type: ignore[method-assign]
    _utils.COMPILE_TARGET = (arch, _SHARED_MEMORY.get(arch, 99 * 1024))  # launch shapes as on that GPU
    try:
        yield compiled
    finally:
        _utils.COMPILE_TARGET = None
        JITFunction.__getitem__ = original  # type: ignore[method-assign]
        try:
            driver.reset_active()
        except RuntimeError:  # no real driver on this machine: leave the stand-in
            pass


def _ptxas_usage(ptx: str, arch: int) -> tuple[int, int]:
    """(registers per thread, spill bytes) from the bundled ptxas -v."""
    from triton.backends.nvidia.compiler import get_ptxas

    ptxas = get_ptxas(arch).path
    with tempfile.TemporaryDirectory() as tmp:
        src = os.path.join(tmp, "k.ptx")
        with open(src, "w") as f:
            f.write(ptx)
        suffix = "a" if arch >= 90 else ""
        res = subprocess.run([ptxas, f"-arch=sm_{arch}{suffix}", "-v", src, "-o", os.path.join(tmp, "k.o")],
                             capture_output=True, text=True)
    text = res.stdout + res.stderr
    regs = re.search(r"Used (\d+) registers", text)
    spills = re.findall(r"(\d+) bytes spill stores", text)
    return (int(regs.group(1)) if regs else -1), sum(int(s) for s in spills)


def _cases(quick: bool, only_dtype: str | None = None, arch: int = 90) -> Iterator[tuple[str, Callable[[], None]]]:
    """(name, thunk) pairs; each thunk calls a host wrapper the way the engine does."""
    from streamer_kernels.activation import silu_and_mul
    from streamer_kernels.attention import unified_attention
    from streamer_kernels.cache import reshape_and_cache
    from streamer_kernels.lora import lora_add
    from streamer_kernels.norm import fused_add_rms_norm, rms_norm
    from streamer_kernels.rotary import rotary_embedding

    dtypes = [torch.bfloat16] if quick else [torch.bfloat16, torch.float16, torch.float32]
    if only_dtype:
        dtypes = [getattr(torch, only_dtype)]
    head_dims = [64, 128, 256] if quick else [64, 80, 96, 128, 256]
    for dtype in dtypes:
        for head_dim in head_dims:
            for group, num_kv_heads in ([(4, 8)] if quick else [(4, 8), (1, 8), (8, 1)]):
                num_heads = group * num_kv_heads
                kv = torch.empty(2, 64, 16, num_kv_heads, head_dim, dtype=dtype)
                table = torch.zeros(4, 16, dtype=torch.int32)
                seq_lens = torch.full((4,), 200, dtype=torch.int32)
                for kind, q_lens in (("decode", 1), ("prefill", 50)):
                    num_tokens = 4 * q_lens
                    q = torch.empty(num_tokens, num_heads, head_dim, dtype=dtype)
                    qsl = torch.arange(5, dtype=torch.int32) * q_lens
                    # (window, splits, softcap, attention chunk)
                    variants = [(None, None, None, None)]
                    if kind == "decode":
                        variants.append((None, 8, None, None))
                    if head_dim == 128 and group == 4:
                        variants.append((1024, None, None, None))
                        # Llama 4's chunked local attention (its 8192-token chunks; split-KV for decode)
                        variants.append((None, 8 if kind == "decode" else None, None, 8192))
                    if head_dim == 256 and group == 4:  # Gemma 2's heads: attention logits soft-capped
                        # (decode with a window *and* splits spills 8 bytes on sm_80 with or without the cap)
                        variants.append((None, 8, 50.0, None) if kind == "decode" else (1024, None, 50.0, None))
                    for window, splits, cap, chunk in variants:
                        name = (f"attention {kind} {str(dtype)[6:]} D={head_dim} H={num_heads}/{num_kv_heads}"
                                + (" window" if window else "") + (f" splits={splits}" if splits else "")
                                + (" softcap" if cap else "") + (" chunked" if chunk else ""))

                        def thunk(q=q, kv=kv, qsl=qsl, table=table, window=window, splits=splits,
                                  q_lens=q_lens, cap=cap, chunk=chunk) -> None:
                            unified_attention(q, kv[0], kv[1], torch.empty_like(q), qsl, seq_lens, table,
                                              0.1, q_lens, 200, window, num_kv_splits=splits, logit_softcap=cap,
                                              attention_chunk=chunk)
                        yield name, thunk
                if head_dim == 128 and group == 4:
                    # A single sequence and a single token: integer arguments equal to 1 are specialised into
                    # constants by Triton, a different compile path than the batched cases.
                    q1 = torch.empty(1, num_heads, head_dim, dtype=dtype)
                    qsl1 = torch.tensor([0, 1], dtype=torch.int32)

                    def single(q1=q1, kv=kv, qsl1=qsl1, table=table) -> None:
                        unified_attention(q1, kv[0], kv[1], torch.empty_like(q1), qsl1, seq_lens[:1], table[:1],
                                          0.1, 1, 200, num_kv_splits=4)
                        unified_attention(q1, kv[0], kv[1], torch.empty_like(q1), qsl1, seq_lens[:1], table[:1],
                                          0.1, 1, 200, num_kv_splits=1)
                    yield f"attention decode {str(dtype)[6:]} D={head_dim} single sequence", single
                    # A mixed step as the engine launches it: the decodes apart (SUBSET short), then the chunks.
                    lens = [1, 50, 1, 50]
                    qm = torch.empty(sum(lens), num_heads, head_dim, dtype=dtype)
                    qslm = torch.tensor([0, 1, 51, 52, 102], dtype=torch.int32)

                    def mixed(qm=qm, kv=kv, qslm=qslm, table=table, lens=lens) -> None:
                        unified_attention(qm, kv[0], kv[1], torch.empty_like(qm), qslm, seq_lens, table, 0.1, 50,
                                          200, query_lens=lens)
                    yield f"attention mixed {str(dtype)[6:]} D={head_dim} decodes apart", mixed
        if arch >= 89 and dtype != torch.float32:  # an FP8 cache (kv_cache_dtype="fp8"; Triton's e4m3 needs sm_89+)
            fp8 = torch.empty(2, 64, 16, 8, 128, dtype=torch.float8_e4m3fn)
            for kind, q_lens in (("decode", 1), ("prefill", 50)):
                q8 = torch.empty(4 * q_lens, 32, 128, dtype=dtype)

                def fp8_thunk(q8=q8, q_lens=q_lens) -> None:
                    unified_attention(q8, fp8[0], fp8[1], torch.empty_like(q8), torch.arange(5, dtype=torch.int32)
                                      * q_lens, torch.full((4,), 200, dtype=torch.int32),
                                      torch.zeros(4, 16, dtype=torch.int32), 0.1, q_lens, 200)
                yield f"attention {kind} {str(dtype)[6:]} D=128 H=32/8 fp8 cache", fp8_thunk
        hidden = 4096
        x = torch.empty(8, hidden, dtype=dtype)
        w = torch.empty(hidden, dtype=dtype)
        yield f"rms_norm {str(dtype)[6:]} {hidden}", lambda x=x, w=w: rms_norm(x, w, 1e-5)
        yield f"fused_add_rms_norm {str(dtype)[6:]} {hidden}", lambda x=x, w=w: fused_add_rms_norm(x, x, w, 1e-5)
        gate_up = torch.empty(8, 2 * 14336, dtype=dtype)
        yield f"silu_and_mul {str(dtype)[6:]}", lambda g=gate_up: silu_and_mul(g)
        q = torch.empty(8, 32, 128, dtype=dtype)
        k = torch.empty(8, 8, 128, dtype=dtype)
        pos = torch.zeros(8, dtype=torch.int64)
        cache = torch.empty(100, 128, dtype=torch.float32)
        for neox in (True, False):
            yield (f"rotary {str(dtype)[6:]} neox={neox}",
                   lambda q=q, k=k, neox=neox: rotary_embedding(pos, q, k, cache, neox))
        # LoRA (decode graphs): Llama-3-8B's packed qkv at rank 16 (3 x 16 columns), and down_proj.
        for name, (k_in, n_out, r) in (("qkv", (4096, 6144, 48)), ("down", (14336, 4096, 16))):
            xs, ys = torch.empty(8, k_in, dtype=dtype), torch.empty(8, n_out, dtype=dtype)
            a_s, b_s = torch.empty(5, r, k_in, dtype=dtype), torch.empty(5, n_out, r, dtype=dtype)
            yield (f"lora_add {str(dtype)[6:]} {name}",
                   lambda xs=xs, ys=ys, a_s=a_s, b_s=b_s: lora_add(ys, xs, a_s, b_s, torch.ones(8, dtype=torch.int64)))
        kc = torch.empty(64, 16, 8, 128, dtype=dtype)
        yield (f"reshape_and_cache {str(dtype)[6:]}",
               lambda k=k, kc=kc: reshape_and_cache(k, k, kc, kc, torch.zeros(8, dtype=torch.int64)))
    # Fused MoE at decode (Qwen3-30B-A3B's 128 experts, top-8): the alignment kernel and both grouped GEMMs.
    from streamer_kernels.moe import fused_moe
    xm = torch.empty(8, 2048, dtype=torch.bfloat16)
    w13, w2 = torch.empty(128, 2 * 768, 2048, dtype=torch.bfloat16), torch.empty(128, 2048, 768, dtype=torch.bfloat16)
    ids = torch.zeros(8, 8, dtype=torch.int64)
    yield ("fused_moe bfloat16 E=128 k=8, 8 tokens",
           lambda: fused_moe(xm, w13, w2, torch.empty(8, 8, dtype=torch.bfloat16), ids))
    # One token, top-1: Triton compiles an int argument equal to 1 as a constant (a Python int, not a tensor),
    # which only compiled code sees (the interpreter passes it as it is).
    yield ("fused_moe bfloat16 E=128 k=1, 1 token",
           lambda: fused_moe(xm[:1], w13, w2, torch.empty(1, 1, dtype=torch.bfloat16), ids[:1, :1]))
    # The Triton sampler (sampling_backend="triton"): fp32 logits, every filter on, Llama 3's vocabulary.
    from streamer_kernels.sampling import top_k_top_p_sample
    logits, ones = torch.empty(8, 128256), torch.ones(8)
    yield ("top_k_top_p_sample vocab=128256",
           lambda: top_k_top_p_sample(logits, ones, torch.full((8,), 50), ones * 0.9, logits, ones * 0.1))


def compile_all(arch: int, quick: bool, only_dtype: str | None = None) -> list[CompiledVariant]:
    out: list[CompiledVariant] = []
    with compile_only(arch) as compiled:
        for name, thunk in _cases(quick, only_dtype, arch):
            compiled.clear()
            thunk()
            for ck in compiled:
                ptx = ck.asm["ptx"]
                regs, spills = _ptxas_usage(ptx, arch)
                mma = "wgmma" if "wgmma.mma_async" in ptx else ("mma" if "mma.sync" in ptx else "none")
                md = ck.metadata
                out.append(CompiledVariant(kernel=md.name, case=name, num_warps=md.num_warps,
                                           num_stages=md.num_stages, shared_bytes=md.shared, registers=regs,
                                           spill_bytes=spills, mma=mma))
                print(json.dumps(asdict(out[-1])), flush=True)
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--arch", type=int, default=90, help="compute capability, e.g. 80 (A100) or 90 (H100/H200)")
    ap.add_argument("--quick", action="store_true", help="bf16 and a few head dims only")
    ap.add_argument("--dtype", default=None, help="only this dtype: bfloat16, float16 or float32")
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    variants = compile_all(args.arch, args.quick, args.dtype)
    if args.json:
        with open(args.json, "w") as f:
            json.dump([asdict(v) for v in variants], f)
    spilled = [v for v in variants if v.spill_bytes > 0]
    print(f"# {len(variants)} kernels compiled for sm_{args.arch}; {len(spilled)} spill registers", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
