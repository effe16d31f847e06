"""Every kernel compiles for real GPU targets (sm_80, sm_90) on this machine, GPU or not, without register
spills and within shared memory: catches code-generation errors that the CPU interpreter cannot see."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("triton")
ROOT = Path(__file__).resolve().parents[1]
# Usable shared memory per block (opt-in maximum): A100 163 KB, H100/H200 227 KB.
SMEM_LIMIT = {80: 163 * 1024, 90: 227 * 1024}


@pytest.mark.parametrize("arch", [80, 90])
def test_kernels_compile_for_gpu(arch: int, tmp_path: Path) -> None:
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}  # compiled mode in the child
    env.setdefault("TRITON_DEFAULT_FP_FUSION", "1")
    env["PYTHONPATH"] = str(ROOT) + os.pathsep + env.get("PYTHONPATH", "")
    out = tmp_path / "variants.json"
    res = subprocess.run([sys.executable, "-m", "streamer_kernels.aot", "--quick", "--arch", str(arch),
                          "--json", str(out)], cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert res.returncode == 0, res.stderr[-3000:]
    variants = json.loads(out.read_text())
    kernels = {v["kernel"] for v in variants}
    assert {"_unified_attention_kernel", "_reduce_kernel", "_reshape_and_cache_kernel", "_rms_norm_kernel",
            "_rotary_kernel", "_silu_and_mul_kernel", "_sample_kernel"} <= kernels
    for v in variants:
        assert v["spill_bytes"] == 0, f"register spills: {v}"
        assert v["shared_bytes"] <= SMEM_LIMIT[arch], f"too much shared memory: {v}"
        if v["kernel"] == "_unified_attention_kernel":
            assert v["mma"] != "none", f"attention without tensor cores: {v}"
            if arch >= 90 and "prefill" in v["case"]:
                assert v["mma"] == "wgmma", f"Hopper prefill should use wgmma: {v}"
