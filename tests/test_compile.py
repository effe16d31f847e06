"""torch.compile path: same tokens as eager, and no recompilation after warm-up whatever the batch shape."""
from __future__ import annotations

import random

import torch

from streamer import LLM, SamplingParams


def test_compiled_matches_eager_without_recompiling(llama_dir):
    import torch._dynamo.utils as dyn
    rng = random.Random(0)
    prompts = [[rng.randrange(3, 500) for _ in range(rng.randrange(1, 50))] for _ in range(12)]
    params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    eager = LLM(str(llama_dir), dtype="float32", enforce_eager=True)
    ref = [o.outputs[0].token_ids for o in eager.generate([{"prompt_token_ids": p} for p in prompts], params)]
    compiled = LLM(str(llama_dir), dtype="float32", enforce_eager=False, max_num_batched_tokens=40)
    assert compiled.engine.runner.compiled
    frames_after_warmup = dyn.counters["stats"]["unique_graphs"]
    assert frames_after_warmup >= 1, "the compile counter does not count: the recompile check would be vacuous"
    # Varied batch shapes: single decodes, chunked prefills, mixed steps.
    got = [o.outputs[0].token_ids for o in compiled.generate([{"prompt_token_ids": p} for p in prompts], params)]
    got1 = compiled.generate([{"prompt_token_ids": prompts[0]}], params)[0].outputs[0].token_ids
    assert got == ref and got1 == ref[0]
    assert dyn.counters["stats"]["unique_graphs"] == frames_after_warmup, "recompiled after warm-up"
    assert compiled.engine.runner.model.layers[0].self_attn.use_op
    assert torch.is_inference_mode_enabled() is False
