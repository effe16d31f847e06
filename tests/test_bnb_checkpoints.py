"""bitsandbytes checkpoints (streamer/models/bnb.py): tiny models quantized and saved by transformers +
bitsandbytes (NF4 with double quantization, FP4 without, LLM.int8()), as QLoRA fine-tunes and unsloth's *-bnb-4bit
models ship. Each weight dequantizes to what bitsandbytes computes from it (4-bit: bit for bit); transformers'
float model with those weights gives the quantized model's logits; the engine's greedy tokens equal that model's;
a weight whose parts are in another shard than its codes loads; a missing part is named."""
from __future__ import annotations

import importlib.util
import json
import shutil
from pathlib import Path

import pytest
import torch

from streamer import LLM, SamplingParams
from streamer.models.bnb import dequantizing_bnb
from streamer.models.loader import iter_weights, weight_files

tf = pytest.importorskip("transformers")
if importlib.util.find_spec("bitsandbytes") is None:
    pytest.skip("bitsandbytes is not installed", allow_module_level=True)


@pytest.fixture(scope="module")
def bnb():
    """(imported only when the tests run: it imports triton, which the kernel tests, collected in the same
    process, must import first, under TRITON_INTERPRET=1)"""
    import bitsandbytes
    return bitsandbytes

PROMPTS = [[1, 5, 9, 20, 33, 7], [3, 100, 41, 8]]
MODES = {"nf4": dict(load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_use_double_quant=True,
                     bnb_4bit_compute_dtype=torch.float32),
         "fp4": dict(load_in_4bit=True, bnb_4bit_quant_type="fp4", bnb_4bit_compute_dtype=torch.float32),
         "int8": dict(load_in_8bit=True)}


def quantized(source: Path, out: Path, mode: str) -> Path:
    if not (out / "config.json").exists():
        model = tf.AutoModelForCausalLM.from_pretrained(source, device_map="cpu", dtype=torch.float32,
                                                        quantization_config=tf.BitsAndBytesConfig(**MODES[mode]))
        model.save_pretrained(out)
        for f in source.glob("tokenizer*"):
            shutil.copy(f, out / f.name)
    return out


@pytest.fixture(scope="module")
def ckpts(make_ckpt, tmp_path_factory, bnb):
    root = tmp_path_factory.mktemp("bnb")
    llama, phi3 = make_ckpt("llama", family="llama"), make_ckpt("phi3", family="phi3")
    return {"llama-nf4": quantized(llama, root / "llama-nf4", "nf4"),
            "phi3-fp4": quantized(phi3, root / "phi3-fp4", "fp4"),  # (fused qkv / gate_up: split after dequant)
            "llama-int8": quantized(llama, root / "llama-int8", "int8"),
            "llama": llama, "phi3": phi3}


def _ours(folder: Path) -> dict[str, torch.Tensor]:
    qc = json.loads((folder / "config.json").read_text())["quantization_config"]
    return dict(dequantizing_bnb(iter_weights(weight_files(folder)), qc))


@pytest.mark.parametrize("name", ["llama-nf4", "phi3-fp4"])
def test_4bit_weights_dequantize_as_bitsandbytes_does(ckpts, bnb, name):
    model = tf.AutoModelForCausalLM.from_pretrained(ckpts[name], device_map="cpu", dtype=torch.float32)
    ours = _ours(ckpts[name])
    linears = [(n, m) for n, m in model.named_modules() if isinstance(m, bnb.nn.Linear4bit)]
    assert len(linears) >= 7  # every projection of the two layers was quantized
    for n, m in linears:
        want = bnb.functional.dequantize_4bit(m.weight.data, m.weight.quant_state)
        assert torch.equal(ours[f"{n}.weight"], want.to(ours[f"{n}.weight"].dtype)), n
    assert all(not k.endswith(("absmax", "quant_map")) and "quant_state" not in k for k in ours)


def test_int8_weights_dequantize_as_bitsandbytes_does(ckpts, bnb):
    model = tf.AutoModelForCausalLM.from_pretrained(ckpts["llama-int8"], device_map="cpu")
    ours = _ours(ckpts["llama-int8"])
    linears = [(n, m) for n, m in model.named_modules() if isinstance(m, bnb.nn.Linear8bitLt)]
    assert len(linears) >= 7
    for n, m in linears:
        want = bnb.functional.int8_vectorwise_dequant(m.weight.data, m.weight.SCB)
        assert torch.allclose(ours[f"{n}.weight"], want.float(), rtol=1e-6, atol=0), n
    assert not any(k.endswith((".SCB", ".weight_format")) for k in ours)


def _greedy(model, prompts: list[list[int]], n: int) -> list[list[int]]:
    outs = []
    for ids in prompts:
        t = torch.tensor([ids])
        gen = model.generate(t, attention_mask=torch.ones_like(t), max_new_tokens=n, min_new_tokens=n,
                             do_sample=False, pad_token_id=0)
        outs.append(gen[0, len(ids):].tolist())
    return outs


def _engine(folder: Path, n: int, **kw) -> list[list[int]]:
    with LLM(str(folder), dtype="float32", **kw) as llm:  # (min_tokens bans EOS as min_new_tokens does)
        outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS],
                            SamplingParams(max_tokens=n, min_tokens=n, temperature=0.0))
    return [list(o.outputs[0].token_ids) for o in outs]


def _dequantized_model(ckpts, name: str):
    """transformers' float model with the checkpoint's weights as bitsandbytes dequantizes them (greedy decoding on
    the quantized model itself flips near-ties of these flat random models: bitsandbytes' one-token matmul rounds
    differently from its many-token one)."""
    source = ckpts["phi3" if name.startswith("phi3") else "llama"]
    model = tf.AutoModelForCausalLM.from_pretrained(source, dtype=torch.float32)
    model.load_state_dict(_ours(ckpts[name]), strict=True)
    return model


@pytest.mark.parametrize("name", ["llama-nf4", "phi3-fp4", "llama-int8"])
def test_the_dequantized_model_is_what_bitsandbytes_computes(ckpts, name):
    quant = tf.AutoModelForCausalLM.from_pretrained(ckpts[name], device_map="cpu", dtype=torch.float32)
    ids = torch.tensor([PROMPTS[0]])
    # (bitsandbytes' CPU matmuls round the activations: to bf16 for 4-bit, to int8 for LLM.int8(). A wrong
    # code order or scale would be off by whole units.)
    tol = 5e-2
    with torch.no_grad():
        assert torch.allclose(quant(ids).logits, _dequantized_model(ckpts, name)(ids).logits, atol=tol, rtol=0)


@pytest.mark.parametrize("name", ["llama-nf4", "phi3-fp4", "llama-int8"])
def test_checkpoints_generate_the_dequantized_models_tokens(ckpts, name):
    assert _engine(ckpts[name], 10) == _greedy(_dequantized_model(ckpts, name), PROMPTS, 10)


def split_across_files(folder: Path, out: Path) -> Path:
    """The checkpoint re-saved as two shards, every weight's scales and code tables in the first and its codes and
    quant state in the second: the loader meets each weight's parts before its codes, in another file."""
    from safetensors.torch import load_file, save_file
    shutil.copytree(folder, out)
    tensors = load_file(out / "model.safetensors")
    (out / "model.safetensors").unlink()
    first = {k: v for k, v in tensors.items() if k.endswith(("absmax", "quant_map"))}
    shards = {"model-00001-of-00002.safetensors": first,
              "model-00002-of-00002.safetensors": {k: v for k, v in tensors.items() if k not in first}}
    for name, part in shards.items():
        save_file(part, out / name, metadata={"format": "pt"})
    index = {"metadata": {}, "weight_map": {k: name for name, part in shards.items() for k in part}}
    (out / "model.safetensors.index.json").write_text(json.dumps(index))
    return out


def test_parts_in_another_shard_before_their_codes(ckpts, tmp_path):
    folder = split_across_files(ckpts["llama-nf4"], tmp_path / "split")
    assert _engine(folder, 10) == _engine(ckpts["llama-nf4"], 10) == \
        _greedy(_dequantized_model(ckpts, "llama-nf4"), PROMPTS, 10)


def test_runtime_int8_on_a_4bit_checkpoint(ckpts, tmp_path):
    """quantization="int8" re-quantizes the dequantized weights: as it does the same weights saved in float."""
    plain = tmp_path / "plain"
    _dequantized_model(ckpts, "llama-nf4").save_pretrained(plain)
    for f in ckpts["llama"].glob("tokenizer*"):
        shutil.copy(f, plain / f.name)
    assert _engine(ckpts["llama-nf4"], 8, quantization="int8") == _engine(plain, 8, quantization="int8")


def test_a_missing_part_is_named(ckpts, tmp_path):
    from safetensors.torch import load_file, save_file
    folder = tmp_path / "broken"
    shutil.copytree(ckpts["llama-nf4"], folder)
    tensors = load_file(folder / "model.safetensors")
    del tensors["model.layers.1.mlp.up_proj.weight.nested_absmax"]
    save_file(tensors, folder / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(ValueError, match="parts missing.*model.layers.1.mlp.up_proj.weight"):
        LLM(str(folder), dtype="float32")


def test_a_config_that_sets_neither_bit_width(ckpts, tmp_path):
    folder = tmp_path / "cfg"
    shutil.copytree(ckpts["llama-nf4"], folder)
    cfg = json.loads((folder / "config.json").read_text())
    cfg["quantization_config"] = {"quant_method": "bitsandbytes"}
    (folder / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match="exactly one of load_in_4bit and load_in_8bit"):
        LLM(str(folder), dtype="float32")
