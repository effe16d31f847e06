"""Checkpoint loading: clear errors for every way a folder can be wrong; dummy weights at real sizes."""
from __future__ import annotations

import json
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from streamer import LLM, SamplingParams


def _copy(src, dst):
    shutil.copytree(src, dst)
    return dst


def test_missing_folder(tmp_path):
    with pytest.raises(FileNotFoundError, match="model folder not found"):
        LLM(str(tmp_path / "nope"))


def test_missing_config(llama_dir, tmp_path):
    d = _copy(llama_dir, tmp_path / "m")
    (d / "config.json").unlink()
    with pytest.raises(FileNotFoundError, match="config.json"):
        LLM(str(d))


def test_missing_weights(llama_dir, tmp_path):
    d = _copy(llama_dir, tmp_path / "m")
    (d / "model.safetensors").unlink()
    with pytest.raises(FileNotFoundError, match="safetensors"):
        LLM(str(d))


def test_unsupported_architecture(llama_dir, tmp_path):
    d = _copy(llama_dir, tmp_path / "m")
    cfg = json.loads((d / "config.json").read_text())
    cfg["architectures"] = ["T5ForConditionalGeneration"]  # (an encoder-decoder)
    (d / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match="unsupported architecture.*T5ForConditionalGeneration"):
        LLM(str(d))


def test_missing_tensor_named(llama_dir, tmp_path):
    d = _copy(llama_dir, tmp_path / "m")
    w = load_file(d / "model.safetensors")
    del w["model.layers.1.self_attn.k_proj.weight"]
    save_file(w, d / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(ValueError, match=r"missing 1 tensor.*model\.layers\.1\.self_attn\.k_proj\.weight"):
        LLM(str(d))


def test_wrong_shape_named(llama_dir, tmp_path):
    d = _copy(llama_dir, tmp_path / "m")
    w = load_file(d / "model.safetensors")
    w["model.layers.0.mlp.down_proj.weight"] = torch.zeros(3, 3)
    save_file(w, d / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(ValueError, match=r"model\.layers\.0\.mlp\.down_proj\.weight.*shape \(3, 3\)"):
        LLM(str(d))


def test_shard_listed_in_index_missing(make_ckpt, tmp_path):
    src = make_ckpt("llama_sharded", family="llama", max_shard_size="20KB", seed=5)
    d = _copy(src, tmp_path / "m")
    next(d.glob("model-*.safetensors")).unlink()
    with pytest.raises(FileNotFoundError, match="lists shard"):
        LLM(str(d))


def test_dummy_weights_need_no_safetensors(llama_dir, tmp_path):
    d = _copy(llama_dir, tmp_path / "m")
    (d / "model.safetensors").unlink()
    llm = LLM(str(d), load_format="dummy", dtype="bfloat16")
    out = llm.generate("hello", SamplingParams(max_tokens=5, ignore_eos=True))[0].outputs[0]
    assert len(out.token_ids) == 5
    weights = [p for p in llm.engine.runner.model.parameters()]
    assert all(p.dtype == torch.bfloat16 for p in weights)
    assert all(torch.isfinite(p.float()).all() for p in weights)


def test_engine_config_errors(llama_dir):
    with pytest.raises(TypeError, match="unknown engine argument.*bogus"):
        LLM(str(llama_dir), bogus=1)
    with pytest.raises(ValueError, match="dtype"):
        LLM(str(llama_dir), dtype="float8")
    with pytest.raises(ValueError, match="attention_backend"):
        LLM(str(llama_dir), attention_backend="flash")
    with pytest.raises(ValueError, match="cpu_weight_packing"):
        LLM(str(llama_dir), cpu_weight_packing="no")  # a string would be truthy: refuse it
    with pytest.raises(ValueError, match="enforce_eager"):
        LLM(str(llama_dir), enforce_eager="yes")
    with pytest.raises(ValueError, match="async_scheduling"):
        LLM(str(llama_dir), async_scheduling="on")
    for bad in (0, -4096):
        with pytest.raises(ValueError, match="kv_cache_memory"):
            LLM(str(llama_dir), kv_cache_memory=bad)
    for bad in (-1, True, 2.5):
        with pytest.raises(ValueError, match="cuda_graph_max_batch"):
            LLM(str(llama_dir), cuda_graph_max_batch=bad)


# (field, a value EngineConfig must refuse): a wrong type or range would otherwise crash deep in the engine (a torch
# error, a tensor size mismatch) or be silently taken (a non-empty string is truthy, -1 a working bound)
BAD_ENGINE_ARGS = [
    ("max_model_len", 0), ("max_model_len", -5), ("max_model_len", 2.5), ("max_model_len", "100"),
    ("max_model_len", True),
    ("device", "tpu"), ("device", "cuda:"), ("device", "cuda:x"), ("device", "cpu:0"), ("device", None),
    ("device", 0),
    ("num_kv_blocks", 2.5), ("num_kv_blocks", True),
    ("seed", "abc"), ("seed", 1.5), ("seed", True), ("seed", 1 << 64), ("seed", -(1 << 63) - 1),
    ("kv_cache_memory", "1GB"), ("kv_cache_memory", float("nan")), ("kv_cache_memory", True),
    ("gpu_memory_utilization", "0.5"), ("gpu_memory_utilization", True),
    ("priority_aging", -1), ("priority_aging", "10"), ("priority_aging", float("inf")),
    ("max_itl_ms", -1), ("max_itl_ms", "100"), ("max_itl_ms", float("nan")), ("max_itl_ms", True),
    ("max_waiting", -1), ("max_waiting", 2.5), ("max_waiting", "8"),
    ("log_stats_interval", "x"), ("log_stats_interval", -1), ("log_stats_interval", float("nan")),
    ("block_size", True), ("max_num_batched_tokens", True), ("max_num_seqs", True),
    ("enable_prefix_caching", "no"), ("enable_prefix_caching", 0), ("enable_prefix_caching", None),
    ("enforce_eager", 1), ("async_scheduling", 0), ("state_checkpoints", True),
    ("model", 123), ("tokenizer", 1.0), ("speculative_model", ["a"]), ("generation_config", None),
    ("chat_template", 1),
    ("suffix_decoding_max_tree_depth", True), ("suffix_decoding_max_cached_requests", -1),
    ("suffix_decoding_max_spec_factor", "2"), ("suffix_decoding_min_token_prob", 2),
]


@pytest.mark.parametrize("field,bad", BAD_ENGINE_ARGS, ids=[f"{f}={v!r}" for f, v in BAD_ENGINE_ARGS])
def test_engine_config_refuses_bad_values(field, bad):
    """Each bad value is a ValueError naming the field, at EngineConfig (before anything loads)."""
    from streamer.config import EngineConfig
    with pytest.raises(ValueError, match=field):
        # (a speculative model would otherwise be refused for want of num_speculative_tokens)
        EngineConfig(**{field: bad}, **({"num_speculative_tokens": 2} if field == "speculative_model" else {}))


def test_engine_config_takes_good_values():
    """The edges still accepted: any 64-bit seed (as torch.manual_seed), a float byte count, aging 0 (off), paths."""
    from pathlib import Path

    from streamer.config import EngineConfig
    for kw in (dict(seed=-1), dict(seed=(1 << 64) - 1), dict(max_model_len=1), dict(max_model_len=None),
               dict(kv_cache_memory=2e9), dict(gpu_memory_utilization=1), dict(priority_aging=0),
               dict(priority_aging=2.5), dict(max_itl_ms=0), dict(max_itl_ms=150.5), dict(max_waiting=0), dict(log_stats_interval=10), dict(device="cpu"),
               dict(device="auto"), dict(enable_prefix_caching=False), dict(model=Path("/m"), tokenizer="/t"),
               dict(num_kv_blocks=1), dict(enforce_eager=False), dict(async_scheduling=None)):
        EngineConfig(**kw)


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a machine without CUDA")
@pytest.mark.parametrize("device", ["cuda", "cuda:0"])
def test_cuda_device_without_cuda_is_a_value_error(device):
    """device="cuda" where torch has no CUDA: a ValueError naming device, not torch's AssertionError at load."""
    from streamer.config import EngineConfig
    with pytest.raises(ValueError, match=r"device='cuda.*CUDA is not available"):
        EngineConfig(device=device)


CLI_BAD_ENGINE_ARGS = [("--max-model-len", "-5", "max_model_len"), ("--max-model-len", "0", "max_model_len"),
                       ("--device", "tpu", "device"), ("--priority-aging", "-1", "priority_aging")]
if not torch.cuda.is_available():
    CLI_BAD_ENGINE_ARGS.append(("--device", "cuda", "device"))


@pytest.mark.parametrize("command", ["generate", "chat"])
@pytest.mark.parametrize("flag,value,field", CLI_BAD_ENGINE_ARGS)
def test_cli_bad_engine_argument_is_one_line(command, flag, value, field):
    """`streamer generate` / `chat` with a bad engine flag: one error line naming the field, exit 1, no traceback."""
    import os
    import subprocess
    import sys
    from pathlib import Path
    repo = Path(__file__).resolve().parents[1]
    args = ["--prompt", "hi"] if command == "generate" else []
    p = subprocess.run([sys.executable, "-m", "streamer", command, *args, flag, value], cwd=repo, input="",
                       capture_output=True, text=True, timeout=120, env={**os.environ, "PYTHONPATH": str(repo)})
    assert p.returncode == 1, p.stderr
    assert "Traceback" not in p.stderr
    last = p.stderr.strip().splitlines()[-1]
    assert last.startswith(f"streamer {command}: error:") and field in last, p.stderr


def test_cpu_weight_packing_gives_the_same_tokens(llama_dir):
    """Eager CPU runs the linears on oneDNN-prepacked weights by default; tokens match the plain-weight path."""
    from streamer import LLM, SamplingParams
    from streamer.models.layers import PackableLinear, cpu_packing_supported

    if not cpu_packing_supported(torch.float32):
        pytest.skip("this torch build has no oneDNN")
    prompts = [{"prompt_token_ids": list(range(3, 3 + n))} for n in (1, 7, 40)]
    params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    outs = {}
    for packing in (True, False):
        llm = LLM(str(llama_dir), dtype="float32", cpu_weight_packing=packing)
        linears = [m for m in llm.engine.runner.model.modules() if isinstance(m, PackableLinear)]
        assert linears and all((m.packed is not None) == packing for m in linears)
        outs[packing] = [o.outputs[0].token_ids for o in llm.generate(prompts, params)]
    assert outs[True] == outs[False]


def test_moe_expert_tensors_named(make_ckpt, tmp_path):
    """A sparse MLP's experts load one by one into stacked weights: a missing or misshapen one is named."""
    src = make_ckpt("qwen3_moe", family="qwen3_moe")
    d = _copy(src, tmp_path / "m")
    w = load_file(d / "model.safetensors")
    good = dict(w)
    del w["model.layers.0.mlp.experts.2.up_proj.weight"]
    save_file(w, d / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(ValueError, match=r"missing 1 tensor.*model\.layers\.0\.mlp\.experts\.2\.up_proj\.weight"):
        LLM(str(d))
    good["model.layers.0.mlp.experts.1.down_proj.weight"] = torch.zeros(64, 3)
    save_file(good, d / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(ValueError, match=r"experts\.1\.down_proj\.weight.*\(64, 3\)"):
        LLM(str(d))
    # Mixtral's Hub names come back in the message as they are in the checkpoint.
    d2 = _copy(make_ckpt("mixtral", family="mixtral"), tmp_path / "x")
    w = load_file(d2 / "model.safetensors")
    del w["model.layers.1.block_sparse_moe.experts.3.w3.weight"]
    save_file(w, d2 / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(ValueError, match=r"missing 1 tensor.*model\.layers\.1\.block_sparse_moe\.experts\.3\.w3"):
        LLM(str(d2))


def test_gemma2_config_without_layer_types(make_ckpt, tmp_path):
    """A Gemma 2 config.json from before transformers 5 (no `layer_types`, a top-level `rope_theta`) reads as
    the same model: every second layer global, starting with a sliding one; one rotary base for all layers."""
    src = make_ckpt("gemma2", family="gemma2")
    d = _copy(src, tmp_path / "old")
    cfg = json.loads((d / "config.json").read_text())
    assert cfg.pop("layer_types") == ["sliding_attention", "full_attention"]
    cfg["rope_theta"] = cfg.pop("rope_parameters")["rope_theta"]
    (d / "config.json").write_text(json.dumps(cfg))
    prompts = [{"prompt_token_ids": list(range(3 + n, 3 + 2 * n))} for n in (5, 20, 40)]  # past the 16 window
    params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    outs = [[o.outputs[0].token_ids for o in LLM(str(p), dtype="float32").generate(prompts, params)]
            for p in (src, d)]
    assert outs[0] == outs[1]


@pytest.mark.parametrize("own_head", [True, False])
def test_tied_config_with_a_stored_head(llama_dir, tmp_path, own_head):
    """config.json says tie_word_embeddings but the checkpoint stores lm_head.weight (transformers 5 writes such
    configs): a head that differs from the embeddings is used, untied, as transformers does; a stored copy of the
    embeddings keeps the model tied."""
    from tests.checkpoints import hf_greedy
    d = _copy(llama_dir, tmp_path / "tied")
    state = load_file(str(d / "model.safetensors"))
    assert "lm_head.weight" in state, "the llama test checkpoint has its own head"
    if not own_head:
        state["lm_head.weight"] = state["model.embed_tokens.weight"].clone()
        save_file(state, str(d / "model.safetensors"))
    cfg = json.loads((d / "config.json").read_text())
    (d / "config.json").write_text(json.dumps(dict(cfg, tie_word_embeddings=True)))
    prompts = [[5, 17, 33, 9, 100], list(range(60, 90))]
    params = SamplingParams(max_tokens=8, min_tokens=8, temperature=0.0)
    with LLM(str(d), dtype="float32") as llm:
        got = [o.outputs[0].token_ids for o in llm.generate([{"prompt_token_ids": p} for p in prompts], params)]
        assert (llm.engine.runner.model.lm_head is not None) == own_head
    assert got == hf_greedy(d, prompts, 8)


_AVX2_ONLY = ("processor\t: 0\nvendor_id\t: GenuineIntel\nflags\t\t: fpu sse sse2 avx avx2 fma f16c\n\n"
              "processor\t: 1\nflags\t\t: fpu sse sse2 avx avx2 fma f16c\n")


@pytest.mark.parametrize("cpuinfo, native", [
    (_AVX2_ONLY, set()),
    ("flags\t\t: avx2 avx512f avx512bw avx512vl\n", set()),  # AVX512 without its bf16 extension: emulated
    ("flags\t\t: avx2 avx512f avx512_bf16\n", {torch.bfloat16}),
    ("flags\t\t: avx2 avx512f avx512_bf16 amx_bf16 amx_tile avx512_fp16\n", {torch.bfloat16, torch.float16}),
    ("flags\t\t: avx2 amx_fp16\n", {torch.float16}),
    ("processor\t: 0\nFeatures\t: fp asimd asimdhp bf16 i8mm\n", {torch.bfloat16}),  # aarch64 (BFMMLA)
    ("processor\t: 0\nFeatures\t: fp asimd asimdhp\n", set()),  # aarch64 without bf16; fp16 stays float32
    ("", set()),  # no flags line: the conservative answer
])
def test_native_dtypes_from_cpuinfo(cpuinfo, native):
    from streamer.worker.model_runner import native_dtypes_from_cpuinfo
    assert native_dtypes_from_cpuinfo(cpuinfo) == native


def test_cpu_native_dtypes_reads_proc_cpuinfo_or_answers_none(monkeypatch):
    import io

    from streamer.worker import model_runner

    def probe(opener):
        monkeypatch.setattr(model_runner, "open", opener, raising=False)  # (the module's `open`, not builtins')
        model_runner.cpu_native_dtypes.cache_clear()
        try:
            return model_runner.cpu_native_dtypes()
        finally:
            model_runner.cpu_native_dtypes.cache_clear()

    def unreadable(path, *a, **k):
        raise FileNotFoundError(path)

    opened = []
    assert probe(lambda path, *a, **k: opened.append(path) or io.StringIO(_AVX2_ONLY)) == frozenset()
    assert opened == ["/proc/cpuinfo"]
    assert probe(lambda *a, **k: io.StringIO("flags : avx2 amx_bf16\n")) == {torch.bfloat16}
    assert probe(unreadable) == frozenset()  # (macOS, Windows: no /proc/cpuinfo; float32, the safe side)


@pytest.mark.parametrize("checkpoint", ["bfloat16", "float16"])
def test_auto_dtype_on_cpu_follows_what_the_cpu_computes_natively(make_ckpt, monkeypatch, caplog, checkpoint):
    """dtype="auto" on CPU runs a bf16 (fp16) checkpoint in bf16 (fp16) only where the CPU computes it natively
    (avx512_bf16 / amx_bf16; avx512_fp16 / amx_fp16), else in float32, with one INFO line saying so; an explicit
    dtype is always honoured; on a GPU "auto" is the checkpoint's dtype whatever the CPU has."""
    import logging

    from streamer.worker import model_runner
    half = getattr(torch, checkpoint)
    path = make_ckpt(f"llama_{checkpoint}", family="llama", dtype=half, seed=3)
    cfg = json.loads((path / "config.json").read_text())
    assert cfg.get("torch_dtype", cfg.get("dtype")) == checkpoint  # (newer transformers write "dtype")
    short = {"bfloat16": "bf16", "float16": "fp16"}[checkpoint]
    line = f"dtype auto: the checkpoint is {checkpoint} but this CPU has no native {short}; running in float32"

    def runner_dtype(native, **kw):
        monkeypatch.setattr(model_runner, "cpu_native_dtypes", lambda: frozenset(native))
        caplog.clear()
        with caplog.at_level(logging.INFO, logger="streamer"):
            llm = LLM(str(path), device="cpu", enforce_eager=True, num_kv_blocks=16, **kw)
        return llm.engine.runner.dtype, [r.getMessage() for r in caplog.records if "dtype auto" in r.getMessage()]

    dtype, logged = runner_dtype(set())  # an AVX2-only CPU
    assert dtype == torch.float32 and len(logged) == 1 and logged[0].startswith(line)
    assert all(p.dtype == torch.float32 for p in _llm_params(path, native=set(), monkeypatch=monkeypatch))
    other = torch.float16 if half == torch.bfloat16 else torch.bfloat16
    assert runner_dtype({other}) == (torch.float32, [f"{line} (dtype={checkpoint!r} runs it as stored)"])
    assert runner_dtype({half}) == (half, [])  # native: the checkpoint's dtype, nothing said
    assert runner_dtype(set(), dtype=checkpoint) == (half, [])  # explicit: honoured, even where emulated
    assert runner_dtype({half}, dtype="float32") == (torch.float32, [])
    cfg = type("Cfg", (), {"torch_dtype": checkpoint})()
    assert model_runner.resolve_dtype("auto", cfg, torch.device("cuda")) == half  # (GPU: unchanged)
    assert model_runner.resolve_dtype("auto", type("Cfg", (), {"torch_dtype": "float32"})(),
                                      torch.device("cpu")) == torch.float32


def _llm_params(path, native, monkeypatch):
    from streamer.worker import model_runner
    monkeypatch.setattr(model_runner, "cpu_native_dtypes", lambda: frozenset(native))
    llm = LLM(str(path), device="cpu", enforce_eager=True, num_kv_blocks=16)
    out = llm.generate("hello", SamplingParams(max_tokens=3, ignore_eos=True))[0].outputs[0]
    assert len(out.token_ids) == 3
    return list(llm.engine.runner.model.parameters())
