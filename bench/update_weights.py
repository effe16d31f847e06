"""In-place weight updates (`LLM.update_weights`) vs starting a new engine, on the shared ~90M-parameter bench
checkpoint (bench/make_bench_model.py) and a copy of it with noise added to every weight (a tenth of its
spread: the "next training step"): the time to swap weights each way (median of 3), the time to start an engine on the new checkpoint, and a
check that the updated engine writes what a fresh engine on the new checkpoint writes.

    python bench/update_weights.py
"""
from __future__ import annotations

import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

sys.path.insert(0, str(Path(__file__).resolve().parent))
from make_bench_model import DEFAULT_DIR  # noqa: E402

from streamer import LLM, SamplingParams  # noqa: E402


def main() -> None:
    old = DEFAULT_DIR
    if not (old / "config.json").exists():
        sys.exit("run bench/make_bench_model.py first")
    with tempfile.TemporaryDirectory() as tmp:
        new = Path(tmp) / "next"
        shutil.copytree(old, new)
        for f in new.glob("*.safetensors"):
            torch.manual_seed(0)
            save_file({k: (v.float() + torch.randn(v.shape) * v.float().std() * 0.1).to(v.dtype)
                       for k, v in load_file(f).items()}, f, metadata={"format": "pt"})
        prompts = [{"prompt_token_ids": list(range(10 + i, 74 + i))} for i in range(4)]
        params = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
        llm = LLM(str(old))
        before = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
        swaps = []
        for target in (new, old, new, old, new):
            t = time.perf_counter()
            llm.update_weights(str(target))
            swaps.append(time.perf_counter() - t)
        got = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
        t = time.perf_counter()
        fresh = LLM(str(new))
        start = time.perf_counter() - t
        want = [o.outputs[0].token_ids for o in fresh.generate(prompts, params, use_tqdm=False)]
        assert got == want, "the updated engine and a fresh one on the new weights disagree"
        assert got != before, "the new weights write the old tokens: the check would not discriminate"
    print("| what | seconds |\n|---|---:|")
    print(f"| update_weights (median of {len(swaps)} swaps) | {statistics.median(swaps):.2f} |")
    print(f"| a new engine on the new checkpoint (LLM(...)) | {start:.2f} |")
    print(f"ratio: {start / statistics.median(swaps):.1f}x faster in place; same tokens as the fresh engine")


if __name__ == "__main__":
    main()
