"""The embedded demo model (streamer/default_model/, trained by tools/train_demo_model.py).

* the packaged checkpoint is a standard HF Llama folder: names, dtypes, config, tokenizer, chat template;
* `transformers` loads it and streamer's engine gives the same greedy tokens (fp32);
* a wheel built from the source carries it and an installed copy finds it outside the source tree;
* the training script's own model is exactly HF's Llama (same logits) and a run is reproducible.
"""
from __future__ import annotations

import importlib.util
import json
import os
import pathlib
import shutil
import subprocess
import sys
import zipfile

import pytest

from streamer import demo_model
from streamer.demo_model import REQUIRED_FILES, DemoModelMissingError, default_model_path

REPO = pathlib.Path(__file__).resolve().parent.parent
PROMPTS = [
    "def fibonacci(n):",
    "import os\n\n\ndef list_python_files(path):",
    "class Stack:\n    def __init__(self):",
    "    for i in range(",
]
MAX_TOKENS = 32


def _load_training_module():
    path = REPO / "tools" / "train_demo_model.py"
    if not path.is_file():
        pytest.skip("tools/train_demo_model.py is not in this tree (installed-package run)")
    spec = importlib.util.spec_from_file_location("train_demo_model", path)
    mod = importlib.util.module_from_spec(spec)
    sys.modules.setdefault("train_demo_model", mod)
    spec.loader.exec_module(mod)
    return mod


@pytest.fixture(scope="module")
def model_dir() -> pathlib.Path:
    return default_model_path()


@pytest.fixture(scope="module")
def hf_model(model_dir):
    transformers = pytest.importorskip("transformers")
    import torch

    model = transformers.AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32)
    model.eval()
    tok = transformers.AutoTokenizer.from_pretrained(str(model_dir))
    return model, tok


def _hf_greedy(model, tok, prompt: str, max_new_tokens: int) -> tuple[list[int], list[int]]:
    import torch

    ids = tok(prompt)["input_ids"]
    with torch.no_grad():
        out = model.generate(torch.tensor([ids]), attention_mask=torch.ones(1, len(ids), dtype=torch.long),
                             max_new_tokens=max_new_tokens, do_sample=False, eos_token_id=tok.eos_token_id,
                             pad_token_id=tok.eos_token_id)
    return ids, out[0, len(ids):].tolist()


def _until_eos(ids: list[int], eos: int) -> list[int]:
    return ids[:ids.index(eos)] if eos in ids else list(ids)


# ------------------------------------------------------------------------------------ the checkpoint
def test_default_model_path_is_a_complete_folder(model_dir):
    assert model_dir.is_dir() and model_dir.is_absolute()
    for name in REQUIRED_FILES + ("generation_config.json",):
        assert (model_dir / name).is_file(), name
        assert os.access(model_dir / name, os.R_OK)
    size = sum(f.stat().st_size for f in model_dir.iterdir() if f.is_file())
    assert size < 15 * 2**20, f"the shipped demo model is {size / 2**20:.1f} MiB"
    assert default_model_path() == model_dir  # cached, stable


def test_config_is_a_standard_llama(model_dir):
    cfg = json.loads((model_dir / "config.json").read_text())
    assert cfg["architectures"] == ["LlamaForCausalLM"]
    assert cfg["model_type"] == "llama"
    assert cfg["torch_dtype"] in ("bfloat16", "float16")
    assert cfg["tie_word_embeddings"] is True
    assert cfg["hidden_act"] == "silu"
    assert cfg["max_position_embeddings"] >= 512
    assert cfg["num_attention_heads"] % cfg["num_key_value_heads"] == 0
    gen = json.loads((model_dir / "generation_config.json").read_text())
    assert gen["bos_token_id"] == cfg["bos_token_id"] and gen["eos_token_id"] == cfg["eos_token_id"]


def test_weights_use_hf_names_and_the_declared_dtype(model_dir):
    import torch
    from safetensors import safe_open

    cfg = json.loads((model_dir / "config.json").read_text())
    d, layers = cfg["hidden_size"], cfg["num_hidden_layers"]
    hd = cfg.get("head_dim") or d // cfg["num_attention_heads"]
    expected = {"model.embed_tokens.weight": (cfg["vocab_size"], d), "model.norm.weight": (d,)}
    for i in range(layers):
        p = f"model.layers.{i}."
        expected.update({
            p + "input_layernorm.weight": (d,),
            p + "post_attention_layernorm.weight": (d,),
            p + "self_attn.q_proj.weight": (cfg["num_attention_heads"] * hd, d),
            p + "self_attn.k_proj.weight": (cfg["num_key_value_heads"] * hd, d),
            p + "self_attn.v_proj.weight": (cfg["num_key_value_heads"] * hd, d),
            p + "self_attn.o_proj.weight": (d, cfg["num_attention_heads"] * hd),
            p + "mlp.gate_proj.weight": (cfg["intermediate_size"], d),
            p + "mlp.up_proj.weight": (cfg["intermediate_size"], d),
            p + "mlp.down_proj.weight": (d, cfg["intermediate_size"]),
        })
    dtype = getattr(torch, cfg["torch_dtype"])
    with safe_open(str(model_dir / "model.safetensors"), framework="pt") as f:
        assert set(f.keys()) == set(expected)  # no lm_head: tied
        for name, shape in expected.items():
            t = f.get_tensor(name)
            assert tuple(t.shape) == shape, name
            assert t.dtype == dtype, name
            assert torch.isfinite(t.float()).all(), name
    n_params = sum(torch.Size(s).numel() for s in expected.values())
    assert 1_000_000 < n_params < 10_000_000


def test_tokenizer_round_trips_and_adds_one_bos(model_dir):
    from tokenizers import Tokenizer

    cfg = json.loads((model_dir / "config.json").read_text())
    tok = Tokenizer.from_file(str(model_dir / "tokenizer.json"))
    assert tok.get_vocab_size() == cfg["vocab_size"]
    assert tok.token_to_id("<|begin_of_text|>") == cfg["bos_token_id"]
    assert tok.token_to_id("<|end_of_text|>") == cfg["eos_token_id"]
    for text in ["def fibonacci(n):\n\tif n < 2:\n        return n\r\n", "naïve café – 日本語 🙂\x00\x7f", "  ", ""]:
        ids = tok.encode(text).ids
        assert ids[0] == cfg["bos_token_id"] and cfg["bos_token_id"] not in ids[1:]
        assert tok.decode(ids, skip_special_tokens=True) == text
        assert tok.encode(text, add_special_tokens=False).ids == ids[1:]


def test_tokenizer_config_and_chat_template(model_dir):
    pytest.importorskip("jinja2")
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    tc = json.loads((model_dir / "tokenizer_config.json").read_text())
    assert tc["bos_token"] == "<|begin_of_text|>" and tc["eos_token"] == "<|end_of_text|>"
    assert tc["add_bos_token"] is True
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)  # as transformers renders it
    template = env.from_string(tc["chat_template"])
    messages = [{"role": "system", "content": "You write Python."},
                {"role": "user", "content": "Compute Fibonacci numbers.\nUse a loop."}]
    text = template.render(messages=messages, add_generation_prompt=True, bos_token=tc["bos_token"],
                           eos_token=tc["eos_token"])
    assert text == "<|begin_of_text|># You write Python.\n# Compute Fibonacci numbers.\n# Use a loop.\n"
    text = template.render(messages=messages + [{"role": "assistant", "content": "x = 1\n"}],
                           add_generation_prompt=False, bos_token=tc["bos_token"], eos_token=tc["eos_token"])
    assert text.endswith("# Use a loop.\nx = 1\n<|end_of_text|>")


def test_missing_checkpoint_is_a_clear_error(tmp_path, monkeypatch):
    monkeypatch.setattr(demo_model, "_cached", None)
    monkeypatch.setattr(demo_model.importlib.resources, "files", lambda pkg: tmp_path)
    with pytest.raises(DemoModelMissingError, match="demo model is missing.*config.json"):
        default_model_path()
    (tmp_path / "default_model").mkdir()
    with pytest.raises(FileNotFoundError, match="model.safetensors"):
        default_model_path()


def test_checkpoint_inside_a_zip_is_materialised(model_dir, tmp_path, monkeypatch):
    archive = tmp_path / "streamer.zip"
    with zipfile.ZipFile(archive, "w") as zf:
        for f in model_dir.iterdir():
            zf.write(f, f"streamer/default_model/{f.name}")
    monkeypatch.setattr(demo_model, "_cached", None)
    monkeypatch.setattr(demo_model.importlib.resources, "files", lambda pkg: zipfile.Path(archive, "streamer/"))
    path = default_model_path()
    assert path.is_dir() and path != model_dir
    assert (path / "model.safetensors").read_bytes() == (model_dir / "model.safetensors").read_bytes()


# ------------------------------------------------------------------------------------ the model runs
def test_transformers_greedy_writes_python(hf_model):
    model, tok = hf_model
    ids, new = _hf_greedy(model, tok, "def fibonacci(n):", 48)
    assert ids[0] == tok.bos_token_id and ids.count(tok.bos_token_id) == 1
    text = tok.decode(_until_eos(new, tok.eos_token_id), skip_special_tokens=True)
    # A 4M-parameter model trained for minutes does not write correct code, but it writes Python-shaped
    # text: a new line, an indented body, keywords.
    assert text.startswith("\n    "), repr(text)
    assert any(kw in text for kw in ("return", "if ", "for ", "self", "=")), repr(text)


def test_training_model_matches_transformers_on_the_shipped_weights(model_dir, hf_model):
    import torch
    from safetensors.torch import load_file

    T = _load_training_module()
    model, tok = hf_model
    cfg = json.loads((model_dir / "config.json").read_text())
    ours = T.TinyLlama({k: cfg[k] for k in (
        "vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
        "num_key_value_heads", "head_dim", "max_position_embeddings", "rms_norm_eps", "rope_theta",
        "initializer_range")})
    ours.load_state_dict({k: v.float() for k, v in load_file(str(model_dir / "model.safetensors")).items()})
    ours.eval()
    ids = torch.tensor([tok("\n".join(PROMPTS))["input_ids"]])
    with torch.no_grad():
        torch.testing.assert_close(ours(ids), model(ids).logits, rtol=1e-4, atol=1e-4)


def test_streamer_and_transformers_agree_on_greedy_tokens(model_dir, hf_model):
    try:
        from streamer.llm import LLM
    except ImportError as e:  # the engine lands separately
        pytest.skip(f"streamer.LLM is not available yet: {e}")
    from streamer import SamplingParams

    model, tok = hf_model
    llm = LLM(str(model_dir), dtype="float32")
    outs = llm.generate(PROMPTS, SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0))
    assert len(outs) == len(PROMPTS)
    for prompt, out in zip(PROMPTS, outs):
        ids, ref = _hf_greedy(model, tok, prompt, MAX_TOKENS)
        assert list(out.prompt_token_ids) == ids, prompt
        got = list(out.outputs[0].token_ids)
        assert _until_eos(got, tok.eos_token_id) == _until_eos(ref, tok.eos_token_id), prompt
        assert out.outputs[0].text == tok.decode(_until_eos(ref, tok.eos_token_id), skip_special_tokens=True)


# ----------------------------------------------------------------------------------------- packaging
@pytest.mark.slow
def test_wheel_ships_the_checkpoint_and_the_installed_package_finds_it(tmp_path):
    if not (REPO / "pyproject.toml").is_file():
        pytest.skip("not a source checkout")
    src = tmp_path / "src"  # build from a copy: never write build/ or *.egg-info into the shared tree
    src.mkdir()
    for name in ("pyproject.toml", "LICENSE", "README.md"):
        if (REPO / name).is_file():
            shutil.copy2(REPO / name, src / name)
    if not (src / "README.md").exists():
        (src / "README.md").write_text("streamer\n")
    for pkg in ("streamer", "streamer_kernels"):
        if (REPO / pkg).is_dir():
            shutil.copytree(REPO / pkg, src / pkg, ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))
    wheels = tmp_path / "wheels"
    subprocess.run([sys.executable, "-m", "pip", "wheel", str(src), "--no-deps", "--no-build-isolation",
                    "--no-index", "-q", "-w", str(wheels)], check=True, cwd=tmp_path)
    (wheel,) = wheels.glob("streamer-*.whl")
    with zipfile.ZipFile(wheel) as zf:
        names = set(zf.namelist())
        for name in REQUIRED_FILES + ("generation_config.json",):
            assert f"streamer/default_model/{name}" in names, name
        shipped = zf.read("streamer/default_model/model.safetensors")
    assert shipped == (default_model_path() / "model.safetensors").read_bytes()

    # Install it somewhere unrelated and ask it, from outside the source tree, where its model is.
    site = tmp_path / "site"
    subprocess.run([sys.executable, "-m", "pip", "install", "--no-deps", "--no-index", "-q", "--target", str(site),
                    str(wheel)], check=True, cwd=tmp_path)
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTHONSAFEPATH")}
    env["PYTHONPATH"] = str(site)
    probe = ("import json, streamer, streamer.demo_model as d; p = d.default_model_path(); "
             "print(json.dumps([streamer.__file__, str(p), json.loads((p / 'config.json').read_text())['model_type']]))")
    out = subprocess.run([sys.executable, "-c", probe], check=True, cwd=tmp_path, env=env,
                         capture_output=True, text=True).stdout
    pkg_file, path, model_type = json.loads(out.strip().splitlines()[-1])
    assert pathlib.Path(pkg_file).resolve().is_relative_to(site.resolve())
    assert pathlib.Path(path).resolve().is_relative_to(site.resolve())
    assert model_type == "llama"


# ------------------------------------------------------------------------------------- the trainer
def _smoke_args(out: pathlib.Path) -> list[str]:
    return ["--out", str(out), "--loss-log", str(out / "loss.tsv"), "--max-files", "30", "--vocab-size", "400",
            "--hidden-size", "64", "--num-layers", "2", "--num-heads", "4", "--num-kv-heads", "2",
            "--max-position-embeddings", "128", "--seq-len", "32", "--batch-size", "4", "--steps", "12",
            "--eval-every", "6", "--eval-windows", "8", "--threads", "1", "--sample-tokens", "4", "--seed", "3"]


def test_training_script_smoke_run_is_reproducible_and_hf_loadable(tmp_path):
    import torch

    T = _load_training_module()
    a, b = tmp_path / "a", tmp_path / "b"
    sa = T.main(_smoke_args(a))
    sb = T.main(_smoke_args(b))
    for name in ("model.safetensors", "tokenizer.json", "config.json", "tokenizer_config.json"):
        assert (a / name).read_bytes() == (b / name).read_bytes(), name
    assert sa["final_validation_loss"] == sb["final_validation_loss"]
    rows = (a / "loss.tsv").read_text().splitlines()
    assert rows[0].split("\t")[:5] == ["step", "tokens", "lr", "train_loss", "val_loss"]
    assert rows[-1].split("\t")[0] == "12" and rows[-1].split("\t")[4]  # last row carries a validation loss

    transformers = pytest.importorskip("transformers")
    hf = transformers.AutoModelForCausalLM.from_pretrained(str(a), dtype=torch.float32).eval()
    tok = transformers.AutoTokenizer.from_pretrained(str(a))
    assert type(hf).__name__ == "LlamaForCausalLM"
    from safetensors.torch import load_file

    cfg = json.loads((a / "config.json").read_text())
    ours = T.TinyLlama({k: cfg[k] for k in (
        "vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
        "num_key_value_heads", "head_dim", "max_position_embeddings", "rms_norm_eps", "rope_theta",
        "initializer_range")}).eval()
    ours.load_state_dict({k: v.float() for k, v in load_file(str(a / "model.safetensors")).items()})
    ids = torch.tensor([tok("def f(x):\n    return x + 1\n")["input_ids"]])
    with torch.no_grad():
        torch.testing.assert_close(ours(ids), hf(ids).logits, rtol=1e-4, atol=1e-4)
