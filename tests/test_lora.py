"""LoRA adapters: greedy output with each adapter equals transformers + PEFT on the same adapter folder, for
batches that mix adapters (and the base model) in one step, through every path the engine takes."""
from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

pytest.importorskip("peft")

from streamer import LLM, LoRARequest, SamplingParams  # noqa: E402
from streamer.models import lora as L  # noqa: E402
from tests.lora_adapters import ALL_LINEARS, make_adapter, peft_greedy  # noqa: E402

PROMPTS = [[5, 17, 33, 9, 100], [40, 41, 42] * 9, [7, 8], list(range(60, 100))]
MAX_NEW = 8


@pytest.fixture(scope="session")
def adapters(llama_dir, tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("loras")
    return {
        # every linear, rank 8
        "all": make_adapter(llama_dir, root / "all", 1, r=8, alpha=16, targets=ALL_LINEARS),
        # attention only, rank 4, rsLoRA scaling (alpha / sqrt(r)) and a per-module alpha
        "attn": make_adapter(llama_dir, root / "attn", 2, r=4, alpha=8, targets=["q_proj", "v_proj", "o_proj"],
                             use_rslora=True, alpha_pattern={"o_proj": 2}),
        # MLP only, rank 2
        "mlp": make_adapter(llama_dir, root / "mlp", 3, r=2, alpha=4, targets=["gate_proj", "down_proj"]),
    }


@pytest.fixture(scope="session")
def oracle(llama_dir, adapters) -> dict:
    out = {None: peft_greedy(llama_dir, None, PROMPTS, MAX_NEW)}
    for name, path in adapters.items():
        out[name] = peft_greedy(llama_dir, path, PROMPTS, MAX_NEW)
    assert all(out[name] != out[None] for name in adapters), "an adapter that changes nothing proves nothing"
    return out


def _generate(llm: LLM, names: list, adapters: dict[str, Path]) -> list[list[int]]:
    """Every prompt with every adapter in `names` (None: the base model), all in one generate() call."""
    params = SamplingParams(max_tokens=MAX_NEW, temperature=0.0, ignore_eos=True)
    prompts = [{"prompt_token_ids": p} for _ in names for p in PROMPTS]
    loras = [None if n is None else LoRARequest(n, str(adapters[n])) for n in names for _ in PROMPTS]
    return [o.outputs[0].token_ids for o in llm.generate(prompts, params, lora_request=loras)]


def _expected(oracle: dict, names: list) -> list[list[int]]:
    return [t for n in names for t in oracle[n]]


def _all_returned(llm: LLM) -> None:
    core = llm.engine
    assert core.kv.pool.num_free == core.kv.num_blocks
    assert sum(core.scheduler.lora_slots.users) == 0


@pytest.mark.parametrize("mode", ["eager", "compiled", "compiled-unpacked"])
def test_mixed_batch_matches_peft(llama_dir, adapters, oracle, mode):
    # compiled: linears are packed oneDNN ops that add their LoRA output inside; unpacked: the `lora_add_` op.
    kw = {"eager": dict(enforce_eager=True), "compiled": dict(enforce_eager=False),
          "compiled-unpacked": dict(enforce_eager=False, cpu_weight_packing=False)}[mode]
    names = [None, "all", "attn", "mlp"]
    with LLM(str(llama_dir), dtype="float32", enable_lora=True, max_loras=3, max_lora_rank=8, **kw) as llm:
        assert _generate(llm, names, adapters) == _expected(oracle, names)
        _all_returned(llm)


def test_one_slot_many_adapters_with_chunking_and_preemption(llama_dir, adapters, oracle):
    # One slot for three adapters: requests wait for it and adapters are swapped in and out between steps; a
    # small token budget splits prompts over steps, and a small pool preempts.
    names = ["all", None, "attn", "mlp", "all"]
    with LLM(str(llama_dir), dtype="float32", enable_lora=True, max_loras=1, max_lora_rank=8,
             max_num_batched_tokens=12, num_kv_blocks=16, block_size=4) as llm:
        assert _generate(llm, names, adapters) == _expected(oracle, names)
        assert llm.engine.scheduler.num_preemptions > 0
        _all_returned(llm)


def test_prefix_cache_keeps_adapters_apart(llama_dir, adapters, oracle):
    with LLM(str(llama_dir), dtype="float32", enable_lora=True, max_lora_rank=8, block_size=4) as llm:
        kv = llm.engine.kv
        seen: set = set()
        for names in ([None], ["all"], ["attn"], ["all"]):  # the same prompts: only the last may hit
            hits = kv.prefix_hits
            assert _generate(llm, names, adapters) == _expected(oracle, names)
            assert (kv.prefix_hits > hits) == (names[0] in seen)
            seen.add(names[0])
        _all_returned(llm)


def test_reregistered_name_gets_the_new_weights(llama_dir, adapters, oracle):
    with LLM(str(llama_dir), dtype="float32", enable_lora=True, max_lora_rank=8, block_size=4) as llm:
        llm.add_lora("x", str(adapters["all"]))
        params = SamplingParams(max_tokens=MAX_NEW, temperature=0.0, ignore_eos=True)
        run = lambda: [o.outputs[0].token_ids for o in llm.generate(  # noqa: E731
            [{"prompt_token_ids": p} for p in PROMPTS], params, lora_request="x")]
        assert run() == oracle["all"]
        llm.remove_lora("x")
        with pytest.raises(ValueError, match="unknown LoRA adapter 'x'"):
            run()
        llm.add_lora("x", str(adapters["mlp"]))  # same name, same prompts: the cached blocks are the old adapter's
        assert run() == oracle["mlp"]
        _all_returned(llm)


def test_fused_phi3_targets_match_peft(make_ckpt, tmp_path):
    # Phi-3 checkpoints fuse q/k/v and gate/up, so its adapters target qkv_proj / gate_up_proj: B's rows split.
    base = make_ckpt("phi3", family="phi3")
    adapter = make_adapter(base, tmp_path / "phi", 4, r=4, alpha=8,
                           targets=["qkv_proj", "o_proj", "gate_up_proj", "down_proj"])
    expected = peft_greedy(base, adapter, PROMPTS, MAX_NEW)
    assert expected != peft_greedy(base, None, PROMPTS, MAX_NEW)
    with LLM(str(base), dtype="float32", enable_lora=True) as llm:
        params = SamplingParams(max_tokens=MAX_NEW, temperature=0.0, ignore_eos=True)
        outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], params,
                            lora_request=LoRARequest("phi", str(adapter)))
        assert [o.outputs[0].token_ids for o in outs] == expected


@pytest.mark.parametrize("family,name,targets", [
    ("starcoder2", "dfa_starcoder2", ["q_proj", "v_proj", "c_fc", "c_proj"]),
    ("arcee", "arcee_b", ["q_proj", "o_proj", "up_proj", "down_proj"]),
])
def test_gateless_mlp_targets_match_peft(make_ckpt, tmp_path, family, name, targets):
    """MLPs without a gate (StarCoder2's c_fc / c_proj, Arcee's lone up_proj) take adapters too."""
    import tests.test_dense_families_a  # noqa: F401  (registers the starcoder2 test family)
    import tests.test_dense_families_b  # noqa: F401  (and arcee)
    base = make_ckpt(name, family=family)
    adapter = make_adapter(base, tmp_path / family, 5, r=4, alpha=8, targets=targets)
    expected = peft_greedy(base, adapter, PROMPTS, MAX_NEW)
    assert expected != peft_greedy(base, None, PROMPTS, MAX_NEW)
    with LLM(str(base), dtype="float32", enable_lora=True) as llm:
        params = SamplingParams(max_tokens=MAX_NEW, temperature=0.0, ignore_eos=True)
        outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], params,
                            lora_request=LoRARequest(family, str(adapter)))
        assert [o.outputs[0].token_ids for o in outs] == expected


def test_tensor_parallel_matches_peft(llama_dir, adapters, oracle):
    # Column layers split B's rows (and A stays whole), row layers split A's columns; the partial sums meet in
    # the all-reduce. The workers read the adapter folders themselves.
    names = ["attn", None, "all"]
    with LLM(str(llama_dir), dtype="float32", enable_lora=True, max_loras=2, max_lora_rank=8,
             tensor_parallel_size=2) as llm:
        assert _generate(llm, names, adapters) == _expected(oracle, names)


def test_gathered_weights_equal_grouped_matmuls(monkeypatch):
    # The CUDA-graph path gathers each token's adapter weights; the default groups tokens by adapter.
    from streamer.models.layers import ColumnParallelLinear, ParallelContext
    monkeypatch.setattr(ParallelContext, "size", 1)  # (an engine built earlier in this process may have left 2)
    monkeypatch.setattr(ParallelContext, "rank", 0)
    torch.manual_seed(0)
    layer = ColumnParallelLinear(24, [16, 8, 8])
    w = L.LoRAWeights(layer, slots=4, rank=4)
    w.a.normal_()
    w.b.normal_()
    w.clear(0)
    x = torch.randn(7, 24)
    slots = torch.tensor([0, 2, 2, 1, 3, 0, 2])
    grouped = torch.zeros(7, 32)
    groups = [(s, torch.nonzero(slots == s).flatten()) for s in (1, 2, 3)]
    with L.lora_context(L.LoRAStep(slots, groups)):
        L.add_lora(grouped, x, w)
    gathered = torch.zeros(7, 32)
    with L.lora_context(L.LoRAStep(slots, gather=True)):
        L.add_lora(gathered, x, w)
    expected = torch.stack([x[i] @ w.a[s].T @ w.b[s].T for i, s in enumerate(slots.tolist())])
    torch.testing.assert_close(grouped, expected)
    torch.testing.assert_close(gathered, expected)
    assert grouped[0].abs().sum() == 0 and grouped[1].abs().sum() > 0


def _write(folder: Path, config: dict, tensors: dict) -> Path:
    from safetensors.torch import save_file
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "adapter_config.json").write_text(json.dumps(config))
    save_file(tensors, str(folder / "adapter_model.safetensors"))
    return folder


def test_bad_adapters_are_refused_and_the_engine_keeps_serving(llama_dir, adapters, oracle, tmp_path):
    q = "base_model.model.model.layers.0.self_attn.q_proj"
    ok = {f"{q}.lora_A.weight": torch.zeros(4, 64), f"{q}.lora_B.weight": torch.zeros(64, 4)}
    cfg = {"peft_type": "LORA", "r": 4, "lora_alpha": 8}
    bad = {
        "no adapter_config.json": (tmp_path / "empty", None),
        "DoRA": (_write(tmp_path / "dora", {**cfg, "use_dora": True}, ok), None),
        "modules_to_save": (_write(tmp_path / "mts", {**cfg, "modules_to_save": ["lm_head"]}, ok), None),
        "above max_lora_rank 8": (_write(tmp_path / "big", cfg, {f"{q}.lora_A.weight": torch.zeros(16, 64),
                                                                  f"{q}.lora_B.weight": torch.zeros(64, 16)}), None),
        "LoRA on 'lm_head' is not supported": (_write(tmp_path / "head", cfg, {
            "base_model.model.lm_head.lora_A.weight": torch.zeros(4, 64),
            "base_model.model.lm_head.lora_B.weight": torch.zeros(512, 4)}), None),
        "q_proj: lora_A has 32 inputs": (_write(tmp_path / "shape", cfg, {
            f"{q}.lora_A.weight": torch.zeros(4, 32), f"{q}.lora_B.weight": torch.zeros(64, 4)}), None),
        "lora_A without its pair": (_write(tmp_path / "half", cfg, {f"{q}.lora_A.weight": torch.zeros(4, 64)}), None),
    }
    (tmp_path / "empty").mkdir()
    with LLM(str(llama_dir), dtype="float32", enable_lora=True, max_lora_rank=8) as llm:
        for message, (folder, _) in bad.items():
            with pytest.raises(ValueError, match=message):
                llm.add_lora("bad", str(folder))
            assert "bad" not in llm.engine.loras
        with pytest.raises(ValueError, match="unknown LoRA adapter 'nope'"):
            llm.generate("hi", SamplingParams(max_tokens=2), lora_request="nope")
        names = ["all", None]
        assert _generate(llm, names, adapters) == _expected(oracle, names)
        with pytest.raises(ValueError, match="already loaded from"):
            llm.generate("hi", SamplingParams(max_tokens=2), lora_request=LoRARequest("all", str(adapters["mlp"])))
        _all_returned(llm)
    with LLM(str(llama_dir), dtype="float32") as llm:
        with pytest.raises(ValueError, match="enable_lora=True"):
            llm.generate("hi", SamplingParams(max_tokens=2), lora_request=LoRARequest("all", str(adapters["all"])))


def test_server_serves_adapters_by_model_name(llama_dir, adapters, oracle):
    import asyncio

    import httpx
    import openai

    from tests.server_utils import LiveServer
    with LiveServer(llama_dir, loras={"all": str(adapters["all"])}, allow_lora_updates=True, enable_lora=True,
                    max_lora_rank=8) as live:
        client = openai.AsyncOpenAI(base_url=live.base_url, api_key="unused", max_retries=0, timeout=120)
        body = {"ignore_eos": True, "return_token_ids": True}

        async def tokens(model: str, prompt: list[int], stream: bool) -> list[int]:
            r = await client.completions.create(model=model, prompt=prompt, max_tokens=MAX_NEW, temperature=0.0,
                                                stream=stream, extra_body=body)
            if not stream:
                assert r.model == model
                return r.choices[0].token_ids  # type: ignore[attr-defined]
            ids = []
            async for chunk in r:
                assert chunk.model == model
                ids += getattr(chunk.choices[0], "token_ids", None) or [] if chunk.choices else []
            return ids

        async def main() -> None:
            models = await client.models.list()
            assert [(m.id, getattr(m, "parent", None)) for m in models.data] == [(live.model_name, None),
                                                                                 ("all", live.model_name)]
            # Base and adapter requests at once, streamed and not: each gets its own model's tokens.
            jobs = [tokens(m, p, s) for m in (live.model_name, "all") for p in PROMPTS[:2] for s in (False, True)]
            got = await asyncio.gather(*jobs)
            want = [t for m in (None, "all") for t in oracle[m][:2] for _ in (0, 1)]
            assert got == want
            with pytest.raises(openai.NotFoundError) as e:
                await tokens("mlp", PROMPTS[0], False)
            assert e.value.body["code"] == "model_not_found"
            async with httpx.AsyncClient(base_url=live.url, timeout=60) as http:
                r = await http.post("/v1/load_lora_adapter", json={"lora_name": "mlp", "lora_path": "/nowhere"})
                assert r.status_code == 400 and r.json()["error"]["param"] == "lora_path"
                r = await http.post("/v1/load_lora_adapter",
                                    json={"lora_name": "mlp", "lora_path": str(adapters["mlp"])})
                assert r.status_code == 200, r.text
                assert await tokens("mlp", PROMPTS[0], True) == oracle["mlp"][0]
                r = await http.post("/v1/load_lora_adapter",
                                    json={"lora_name": "mlp", "lora_path": str(adapters["mlp"])})
                assert r.status_code == 400 and "already loaded" in r.json()["error"]["message"]
                r = await http.post("/v1/unload_lora_adapter", json={"lora_name": "mlp"})
                assert r.status_code == 200
                r = await http.post("/v1/unload_lora_adapter", json={"lora_name": "mlp"})
                assert r.status_code == 404
                text = (await http.get("/metrics")).text
                assert 'max_lora="4"' in text and "vllm:lora_requests_info" in text
            with pytest.raises(openai.NotFoundError):
                await tokens("mlp", PROMPTS[0], False)

        asyncio.run(main())
        state = live.pool_state()
        assert state["free"] == state["blocks"] and state["running"] == 0


def test_cli_generate_and_serve_flags(llama_dir, adapters, capsys):
    import os
    import subprocess
    import sys

    from streamer.cli import main
    from streamer.server.cli import parse_lora_module
    common = ["generate", "--model", str(llama_dir), "--dtype", "float32", "--num-kv-blocks", "64", "--prompt",
              "def f(x):", "--max-tokens", "8", "--ignore-eos"]
    assert main(common) == 0
    base = capsys.readouterr().out
    assert main([*common, "--lora", str(adapters["all"])]) == 0
    with_adapter = capsys.readouterr().out
    with LLM(str(llama_dir), dtype="float32", enable_lora=True, max_lora_rank=8) as llm:
        out = llm.generate("def f(x):", SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True),
                           lora_request=LoRARequest("all", str(adapters["all"])))[0].outputs[0].text
    assert with_adapter == "def f(x):" + out + "\n" and with_adapter != base
    assert main([*common, "--lora", "/nowhere"]) == 1
    assert "LoRA adapter folder not found" in capsys.readouterr().err

    assert parse_lora_module("a=/x/y") == ("a", "/x/y")
    assert parse_lora_module('{"name": "a", "path": "/x", "base_model_name": "m"}') == ("a", "/x")
    for bad in ("a", "=/x", "{}", '{"name": "a"}'):
        with pytest.raises(ValueError, match="--lora-modules"):
            parse_lora_module(bad)
    repo = Path(__file__).resolve().parents[1]
    env = {**os.environ, "PYTHONPATH": str(repo)}
    p = subprocess.run([sys.executable, "-m", "streamer", "serve", "--port", "0", "--lora-modules", "oops"],
                       cwd=repo, capture_output=True, text=True, timeout=120, env=env)
    assert p.returncode == 2 and p.stderr.startswith("streamer serve: error: --lora-modules") and "Traceback" not in p.stderr
    p = subprocess.run([sys.executable, "-m", "streamer", "serve", str(llama_dir), "--port", "0", "--enforce-eager",
                        "--lora-modules", "x=/nowhere"], cwd=repo, capture_output=True, text=True, timeout=300, env=env)
    assert p.returncode == 1 and "LoRA adapter folder not found: /nowhere" in p.stderr


def test_async_engine_first_use_from_concurrent_requests(llama_dir, adapters, oracle):
    import asyncio

    from streamer import AsyncEngine

    async def main() -> None:
        async with AsyncEngine(str(llama_dir), dtype="float32", enable_lora=True, max_lora_rank=8) as engine:
            params = SamplingParams(max_tokens=MAX_NEW, temperature=0.0, ignore_eos=True)
            lora = LoRARequest("all", str(adapters["all"]))  # not registered yet: every request races to load it
            outs = await asyncio.gather(*(engine.generate({"prompt_token_ids": p}, params, lora_request=lora)
                                          for p in PROMPTS))
            assert [o.outputs[0].token_ids for o in outs] == oracle["all"]
            assert list(engine.loras) == ["all"]
            streamed = []
            async for out in engine.stream({"prompt_token_ids": PROMPTS[1]}, params, lora_request="all"):
                streamed += out.token_ids
            assert streamed == oracle["all"][1]
            engine.remove_lora("all")
            with pytest.raises(ValueError, match="unknown LoRA adapter"):
                await engine.generate("x", params, lora_request="all")

    asyncio.run(main())


def test_half_precision_small_batches_use_fp32_twins(monkeypatch):
    # On CPU a bf16 model's LoRA matmuls for a few tokens run on fp32 copies of the slots (faster there); both
    # paths must give what the bf16 weights define, and the copies must follow every place/clear.
    from streamer.models.layers import ColumnParallelLinear, ParallelContext
    monkeypatch.setattr(ParallelContext, "size", 1)
    monkeypatch.setattr(ParallelContext, "rank", 0)
    torch.manual_seed(1)
    layer = ColumnParallelLinear(32, [16, 16]).to(torch.bfloat16)
    w = L.LoRAWeights(layer, slots=3, rank=4)
    assert w.twins
    for slot in (1, 2):
        for sub in (0, 1):
            w.place(slot, sub, torch.randn(3, 32), torch.randn(16, 3), "m")
    w.clear(2)
    w.place(2, 1, torch.randn(4, 32), torch.randn(16, 4), "m")
    x = torch.randn(5, 32).to(torch.bfloat16)
    slots = torch.tensor([1, 0, 2, 2, 1])
    groups = [(s, torch.nonzero(slots == s).flatten()) for s in (1, 2)]
    expected = torch.stack([x[i].float() @ w.a[s].float().T @ w.b[s].float().T
                            for i, s in enumerate(slots.tolist())])
    outs = []
    for twins in (True, False):
        w.twins = twins
        y = torch.zeros(5, 32, dtype=torch.bfloat16)
        with L.lora_context(L.LoRAStep(slots, groups)):
            L.add_lora(y, x, w)
        outs.append(y.float())
        assert (y.float() - expected).norm() / expected.norm() < 2e-2
    assert outs[0][1].abs().sum() == 0 and outs[0][2].abs().sum() > 0


def test_adapters_on_an_fp8_model(llama_dir, adapters):
    # FP8 weights (models/quant.py) and LoRA together: the adapter's output is added after the FP8 matmul, so its
    # effect survives quantization (prompt log-probabilities as with full-precision weights, within FP8's noise).
    params = SamplingParams(max_tokens=1, prompt_logprobs=0, temperature=0.0)
    lora = LoRARequest("all", str(adapters["all"]))

    def logprobs(**kw) -> torch.Tensor:
        with LLM(str(llama_dir), dtype="float32", enable_lora=True, max_lora_rank=8, **kw) as llm:
            outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], params, lora_request=lora)
        return torch.tensor([next(iter(e.values())).logprob for o in outs for e in o.prompt_logprobs[1:]])

    full, fp8 = logprobs(), logprobs(quantization="fp8")
    with LLM(str(llama_dir), dtype="float32", quantization="fp8") as llm:
        outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], params)
        base = torch.tensor([next(iter(e.values())).logprob for o in outs for e in o.prompt_logprobs[1:]])
    assert (fp8 - full).abs().mean() < 0.05
    assert (fp8 - base).abs().mean() > 5 * (fp8 - full).abs().mean()


@pytest.mark.parametrize("kw", [dict(num_speculative_tokens=3), dict(async_scheduling=True)],
                         ids=["speculative", "async-scheduling"])
def test_adapters_with_drafts_and_overlapped_steps(llama_dir, adapters, oracle, kw):
    # Drafts are verified through the adapter's layers; with async scheduling the next step is prepared (slots
    # included) while the previous one runs.
    names = ["attn", None, "all"]
    with LLM(str(llama_dir), dtype="float32", enable_lora=True, max_loras=2, max_lora_rank=8, **kw) as llm:
        assert _generate(llm, names, adapters) == _expected(oracle, names)
        _all_returned(llm)
