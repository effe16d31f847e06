"""In-place weight updates (`LLM.update_weights`) vs starting a new engine, on the shared ~90M-parameter bench
checkpoint (bench/make_bench_model.py) and a copy of it with noise added to every weight (a tenth of its
spread: the "next training step"): the time to swap weights each way (median of 5), from the folder or from state
dicts in memory, in bf16 and with weights rounded at load (int4, int8), against the time to start an engine on the
new checkpoint; and a check that the updated engine writes what a fresh engine on the new checkpoint writes.

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


def swap_times(llm: LLM, targets: list[object]) -> list[float]:
    times = []
    for target in targets:
        t = time.perf_counter()
        llm.update_weights(target)
        times.append(time.perf_counter() - t)
    return times


def case(old: Path, new: Path, prompts: list[dict], params: SamplingParams, in_memory: bool,
         **engine: object) -> tuple[float, float]:
    """(median in-place swap time, a fresh engine's start time) for one engine set-up, after checking that the
    updated engine writes what a fresh engine on the new checkpoint writes, and not what the old weights wrote."""
    llm = LLM(str(old), **engine)
    before = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
    if in_memory:  # a trainer's state dicts, already in memory
        old_w, new_w = ({k: v for f in d.glob("*.safetensors") for k, v in load_file(f).items()} for d in (old, new))
        swaps = swap_times(llm, [new_w, old_w, new_w, old_w, new_w])
    else:
        swaps = swap_times(llm, [str(new), str(old), str(new), str(old), str(new)])
    got = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
    del llm
    t = time.perf_counter()
    fresh = LLM(str(new), **engine)
    start = time.perf_counter() - t
    want = [o.outputs[0].token_ids for o in fresh.generate(prompts, params, use_tqdm=False)]
    assert got == want, "the updated engine and a fresh one on the new weights disagree"
    assert got != before, "the new weights write the old tokens: the check would not discriminate"
    return statistics.median(swaps), start


def main() -> None:
    old = DEFAULT_DIR
    if not (old / "config.json").exists():
        sys.exit("run bench/make_bench_model.py first")
    cases = {"bf16, from the checkpoint folder": ({}, False),
             "bf16, from state dicts in memory": ({}, True),
             "quantization=int4 (rounded again), from the folder": ({"quantization": "int4"}, False),
             "quantization=int8 (rounded again), from the folder": ({"quantization": "int8"}, False)}
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        new = Path(tmp) / "next"
        shutil.copytree(old, new)
        for f in new.glob("*.safetensors"):
            torch.manual_seed(0)
            save_file({k: (v.float() + torch.randn(v.shape) * v.float().std() * 0.1).to(v.dtype)
                       for k, v in load_file(f).items()}, f, metadata={"format": "pt"})
        prompts = [{"prompt_token_ids": list(range(10 + i, 74 + i))} for i in range(4)]
        params = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
        for name, (engine, in_memory) in cases.items():
            rows.append((name, *case(old, new, prompts, params, in_memory, **engine)))
    print("| engine, new weights from | update_weights (median of 5 swaps), s | a new engine, s | ratio |")
    print("|---|---:|---:|---:|")
    for name, swap, start in rows:
        print(f"| {name} | {swap:.2f} | {start:.2f} | {start / swap:.0f}x |")
    print("each case: the updated engine writes the same greedy tokens as a fresh engine on the new checkpoint")


if __name__ == "__main__":
    main()
