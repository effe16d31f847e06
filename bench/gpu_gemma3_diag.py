"""Where Gemma 3's image prompts part from transformers on a GPU: a diagnosis for the GPU check.

    python bench/gpu_gemma3_diag.py          # on the GPU machine; gpu_check.sh runs it when the Gemma 3 test fails

On the H200 of 2026-12-04 tests/test_multimodal.py::test_gemma3_images_attend_both_ways_as_in_transformers failed:
one image prompt's logprobs were 1.3e-3 off transformers' (CPU, float32), the others within 2e-4; on CPU the test
passes with either attention backend. This runs the same tiny checkpoint and prompts through the engine in several
configurations (and transformers on the GPU too) and prints, per configuration, each prompt's largest logprob
difference from transformers on CPU, so one run says which part (attention backend, compile / CUDA graphs, async
scheduling, the device itself, or transformers' own GPU numerics) the difference follows.

Ruled out on CPU since (session 33): the split-KV decode path. Under the Triton interpreter, with the device's 132
SMs faked and decode forced to the 64 splits a CUDA graph captures with, all four prompts match transformers within
1.2e-6 (as they do unsplit).
"""
from __future__ import annotations

import sys
import tempfile
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from streamer import LLM, SamplingParams  # noqa: E402
from tests.checkpoints import hf_gemma3_greedy, make_gemma3_vlm_checkpoint  # noqa: E402
from tests.parity import tokens_and_logprobs  # noqa: E402
from tests.test_multimodal import GEMMA_PROMPT, images  # noqa: E402


def main() -> int:
    device = "cuda" if torch.cuda.is_available() else "cpu"
    root = Path(tempfile.mkdtemp())
    model_dir = make_gemma3_vlm_checkpoint(root / "gemma3_vlm")
    ims = images(3, seed=9)
    prompts = [{"prompt": GEMMA_PROMPT, "multi_modal_data": {"image": im}} for im in ims]
    prompts.append({"prompt": "<start_of_turn>user\nno picture<end_of_turn>\n<start_of_turn>model\n"})
    params = SamplingParams(max_tokens=4, temperature=0.0, logprobs=0)
    variants = {
        "cpu, torch backend (the CPU test)": dict(device="cpu"),
        f"{device}, defaults": dict(device=device),
        f"{device}, torch attention backend": dict(device=device, attention_backend="torch"),
        f"{device}, eager (no compile, no graphs)": dict(device=device, enforce_eager=True),
        f"{device}, no async scheduling": dict(device=device, async_scheduling=False),
        f"{device}, one prompt a step": dict(device=device, max_num_seqs=1),
    }
    results: dict[str, list[tuple[list[int], list[float]]]] = {}
    ids_and_images = None
    for name, kw in variants.items():
        try:
            llm = LLM(str(model_dir), dtype="float32", num_kv_blocks=64, **kw)
            outs = llm.generate(prompts, params)
        except Exception as e:  # (a variant that cannot run is itself a finding)
            print(f"{name}: {type(e).__name__}: {e}"[:300], flush=True)
            continue
        results[name] = tokens_and_logprobs(outs)
        if ids_and_images is None:
            ids_and_images = [(o.prompt_token_ids, [im]) for o, im in zip(outs, ims)] + [(outs[-1].prompt_token_ids, [])]
        del llm
    assert ids_and_images is not None, "no variant ran"
    want = hf_gemma3_greedy(model_dir, ids_and_images, 4)
    if device == "cuda":
        results["transformers on cuda"] = hf_gemma3_greedy(model_dir, ids_and_images, 4, device="cuda")
    print(f"\n{'configuration':44} " + " ".join(f"{'prompt ' + str(i):>10}" for i in range(len(want)))
          + "   (max |logprob - transformers on CPU|; * = other tokens)")
    for name, got in results.items():
        cells = []
        for (tokens, lps), (want_tokens, want_lps) in zip(got, want):
            diff = float(np.abs(np.array(lps) - np.array(want_lps)).max())
            cells.append(f"{diff:9.1e}{'*' if tokens != want_tokens else ' '}")
        print(f"{name:44} " + " ".join(cells), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
