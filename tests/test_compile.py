"""torch.compile path: same tokens as eager, and no recompilation after warm-up whatever the batch shape."""
from __future__ import annotations

import random

import pytest
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
    runner = compiled.engine.runner
    inline_steps = []
    real_decode_inputs = runner._decode_inputs
    runner._decode_inputs = lambda step: inline_steps.append(real_decode_inputs(step)) or inline_steps[-1]
    # Varied batch shapes: single decodes, chunked prefills, mixed steps.
    got = [o.outputs[0].token_ids for o in compiled.generate([{"prompt_token_ids": p} for p in prompts], params)]
    got1 = compiled.generate([{"prompt_token_ids": prompts[0]}], params)[0].outputs[0].token_ids
    assert got == ref and got1 == ref[0]
    assert any(d is not None for d in inline_steps), "a lone request's decode never ran inline in the graph"
    assert dyn.counters["stats"]["unique_graphs"] == frames_after_warmup, "recompiled after warm-up"
    assert compiled.engine.runner.model.layers[0].self_attn.use_op
    assert torch.is_inference_mode_enabled() is False


def test_background_compile_serves_eagerly_then_compiled(llama_dir):
    """`compile_in_background` (serve's default on CPU): the engine answers at once, eagerly, while a thread
    compiles the model, then runs compiled; the same tokens all along, and no other thread compiles meanwhile."""
    from streamer.worker import compile_cache
    params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    prompts = [{"prompt_token_ids": p} for p in ([5, 6, 7, 8], list(range(3, 40)), [9])]
    ref = [o.outputs[0].token_ids for o in LLM(str(llama_dir), dtype="float32", enforce_eager=True)
           .generate(prompts, params)]
    llm = LLM(str(llama_dir), dtype="float32", enforce_eager=False, compile_in_background=True)
    runner = llm.engine.runner
    while_compiling = [o.outputs[0].token_ids for o in llm.generate(prompts, params)]
    assert runner.compile_done.wait(900), "the background compile never finished"
    assert runner.compiled and runner.forward is not runner.model
    assert compile_cache.may_compile()  # (released: other threads compile again)
    after = [o.outputs[0].token_ids for o in llm.generate(prompts, params)]
    lone = llm.generate(prompts[:1], params)[0].outputs[0].token_ids  # (a lone decode: the inline graph)
    assert while_compiling == ref and after == ref and lone == ref[0]


def test_compile_hold_lets_only_the_compiling_thread_compile():
    import threading

    from streamer.worker import compile_cache
    seen: dict[str, bool] = {}
    compile_cache.hold_compiles()
    try:
        assert not compile_cache.may_compile()

        def compiler() -> None:
            compile_cache.claim_compiles()
            seen["compiler"] = compile_cache.may_compile()
            t = threading.Thread(target=lambda: seen.setdefault("other", compile_cache.may_compile()))
            t.start()
            t.join()
        t = threading.Thread(target=compiler)
        t.start()
        t.join()
        assert seen == {"compiler": True, "other": False} and not compile_cache.may_compile()
    finally:
        compile_cache.release_compiles()
    assert compile_cache.may_compile()


def test_failed_compilation_falls_back_to_eager(llama_dir, monkeypatch, caplog):
    """Without a working compiler (or on an Inductor bug) the engine still starts, eagerly, and says why."""
    def broken_compile(model, **kwargs):
        def forward(*args, **kw):
            raise RuntimeError("no C++ compiler found")
        return forward

    from streamer.attention import torch_backend
    # The CPU decode kernel's compile state is process-wide: restore it afterwards (monkeypatch.undo).
    monkeypatch.setattr(torch_backend, "_compiled_decode", torch_backend._compiled_decode)
    monkeypatch.setattr(torch_backend, "_compile_failed", torch_backend._compile_failed)
    monkeypatch.setattr(torch, "compile", broken_compile)
    prompts = [{"prompt_token_ids": [5, 6, 7, 8]}]
    params = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
    llm = LLM(str(llama_dir), dtype="float32", enforce_eager=False)
    assert not llm.engine.runner.compiled and "running the model eagerly" in caplog.text
    monkeypatch.undo()
    ref = LLM(str(llama_dir), dtype="float32", enforce_eager=True)
    assert (llm.generate(prompts, params)[0].outputs[0].token_ids
            == ref.generate(prompts, params)[0].outputs[0].token_ids)


@pytest.mark.parametrize("family,overrides", [("mistral", {"sliding_window": 8}), ("qwen3", {})],
                         ids=["mistral-sliding-window", "qwen3-qk-norm"])
def test_inline_lone_decode_matches_eager(make_ckpt, family, overrides):
    """A lone request decodes inline in the compiled graph: same tokens as eager, past a sliding window too."""
    path = make_ckpt(f"inline-{family}", family=family, **overrides)
    prompt = [{"prompt_token_ids": [(7 * i) % 400 + 3 for i in range(20)]}]
    params = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True)
    ref = LLM(str(path), dtype="float32", enforce_eager=True).generate(prompt, params)[0].outputs[0].token_ids
    compiled = LLM(str(path), dtype="float32", enforce_eager=False)
    runner = compiled.engine.runner
    inline = []
    real = runner._decode_inputs
    runner._decode_inputs = lambda step: inline.append(real(step)) or inline[-1]
    assert compiled.generate(prompt, params)[0].outputs[0].token_ids == ref
    assert sum(d is not None for d in inline) == 15  # every decode step after the prefill


_START = """
import json, sys
from torch._dynamo.utils import counters
from streamer import LLM, SamplingParams
from streamer.models.layers import PackableLinear
llm = LLM(sys.argv[1], dtype="float32", enforce_eager=False)
linears = [m for m in llm.engine.runner.model.modules() if isinstance(m, PackableLinear)]
out = llm.generate([{"prompt_token_ids": [5, 9, 11, 3, 7]}], SamplingParams(max_tokens=6, temperature=0.0))
print(json.dumps({"hit": counters["inductor"]["fxgraph_cache_hit"], "miss": counters["inductor"]["fxgraph_cache_miss"],
                  "bypass": counters["inductor"]["fxgraph_cache_bypass"], "tokens": out[0].outputs[0].token_ids,
                  "linear_ops": bool(linears) and all(m.op_id is not None for m in linears),
                  "compiled": llm.engine.runner.compiled}))
"""


def test_compiled_cpu_graphs_are_cacheable(llama_dir, tmp_path):
    """On CPU the linears are opaque ops over prepacked weights (no freezing), so Inductor's on-disk FX-graph cache
    takes the model's graphs: a second process starts from it instead of compiling again."""
    import json
    import os
    import subprocess
    import sys

    env = dict(os.environ, TORCHINDUCTOR_CACHE_DIR=str(tmp_path / "inductor"))

    def start() -> tuple[dict, str]:
        done = subprocess.run([sys.executable, "-c", _START, str(llama_dir)], env=env, check=True,
                              capture_output=True, text=True)
        return json.loads(done.stdout.splitlines()[-1]), done.stderr

    (cold, _), (warm, _) = start(), start()
    assert cold["linear_ops"] and cold["bypass"] == 0 and cold["miss"] >= 2 and cold["hit"] == 0
    assert warm["bypass"] == 0 and warm["miss"] == 0 and warm["hit"] >= 2
    assert cold["tokens"] == warm["tokens"] and cold["compiled"] and warm["compiled"]

    # Every compiled module in the cache truncated (a process killed while writing them, or two building them at
    # once: CI once found one empty): the next start removes each as it fails to load, compiles again, and stays
    # compiled, the model and the CPU decode attention both.
    modules = list((tmp_path / "inductor").rglob("*.main.so"))
    assert modules
    for so in modules:
        so.write_bytes(b"")
    healed, log = start()
    assert healed["compiled"] and healed["tokens"] == cold["tokens"]
    assert "torch.compile: removed an unloadable file from Inductor's cache" in log
    assert "compiled CPU decode attention: removed an unloadable file" in log
    assert "running the model eagerly" not in log and "using the eager path" not in log
    assert all(so.stat().st_size > 0 for so in modules if so.exists())
