"""The model registry (streamer/models/registry.py, issue 45): every entry names a class that exists, the
capabilities it declares are the class's, and loading one model imports that model's file and no other family's."""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from streamer.models import registry

ROOT = Path(__file__).resolve().parents[1]


def test_every_entry_names_its_class() -> None:
    for arch, model in registry.MODELS.items():
        cls = model.model_class()
        assert cls.__name__ == model.cls, arch
        assert cls.__module__ == f"streamer.models.{model.module}", arch
    from streamer.models.vlm import VisionLanguageMixin
    for arch, vl in registry.VISION_LANGUAGE.items():
        assert issubclass(vl.mixin_class(), VisionLanguageMixin), arch


def test_declared_capabilities_are_the_classes() -> None:
    """Recurrent state is what the hybrid mixin gives (state slots, Whisper's too); the own tensor-parallel check is the class's
    `check_tensor_parallel`; MLA is DeepSeek's attention; a family with an MTP head has a generative decoder."""
    from streamer.models.deepseek import DeepseekForCausalLM
    for arch, model in registry.MODELS.items():
        cls = model.model_class()
        # (Whisper's encoder output rides the same state slots)
        slots = model.recurrent_state or model.kind == registry.ENCODER_DECODER
        assert slots == bool(getattr(cls, "is_hybrid", False)), arch
        assert (model.tensor_parallel == registry.OWN_CHECK) == hasattr(cls, "check_tensor_parallel"), arch
        assert model.tensor_parallel in (registry.HEADS, registry.OWN_CHECK), arch
        assert model.mla == issubclass(cls, DeepseekForCausalLM), arch
        if model.mtp is not None:
            assert model.kind == registry.DECODER, arch
        assert model.kind in (registry.DECODER, registry.ENCODER, registry.ENCODER_DECODER, registry.DRAFT_HEAD)
        for served in model.served:
            assert served.task in (registry.GENERATE, registry.EMBED, registry.CLASSIFY, registry.DRAFT), served
            if served.task == registry.GENERATE:  # (a vision-language checkpoint served as its text model)
                assert served.name.endswith("ForConditionalGeneration") and model.kind == registry.DECODER


def test_vision_language_text_models_are_registered() -> None:
    from streamer.models.config import _TEXT_DEFAULTS
    assert set(_TEXT_DEFAULTS) <= set(registry.TEXT_MODEL_TYPES)
    for model_type, arch in registry.TEXT_MODEL_TYPES.items():
        assert registry.entry(arch).task == registry.GENERATE, model_type
    for arch, vl in registry.VISION_LANGUAGE.items():
        text = vl.default_text_config.get("model_type")
        assert text is None or text in registry.TEXT_MODEL_TYPES, arch


def test_unknown_names() -> None:
    with pytest.raises(ValueError, match="no model class for architecture 'NoSuchForCausalLM'"):
        registry.entry("NoSuchForCausalLM")
    assert registry.served("NoSuchForCausalLM") is None
    assert registry.served("LlamaForSequenceClassification")[0].architecture == "LlamaForCausalLM"


def test_tensor_parallel_rules() -> None:
    """The registry's rule refuses before anything is built: a refused family, heads that do not split, and (its
    own check) a hybrid's recurrent heads."""
    from streamer.models.config import ModelConfig
    base = dict(vocab_size=64, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                num_key_value_heads=2)
    llama = ModelConfig.from_dict(dict(base, architectures=["LlamaForCausalLM"]))
    registry.entry(llama.architecture).check_tensor_parallel(llama, 2)
    registry.entry(llama.architecture).check_tensor_parallel(llama, 4)  # (kv heads replicated)
    with pytest.raises(ValueError, match="does not split the model's 4 attention heads"):
        registry.entry(llama.architecture).check_tensor_parallel(llama, 3)
    olmo = ModelConfig.from_dict(dict(base, architectures=["Olmo2ForCausalLM"]))
    with pytest.raises(ValueError, match="Olmo2ForCausalLM does not support tensor parallelism"):
        registry.entry(olmo.architecture).check_tensor_parallel(olmo, 2)
    mamba = ModelConfig.from_dict(dict(vocab_size=64, hidden_size=64, num_hidden_layers=2, num_heads=6,
                                       head_dim=16, n_groups=1, state_size=16, architectures=["Mamba2ForCausalLM"]))
    registry.entry(mamba.architecture).check_tensor_parallel(mamba, 2)
    with pytest.raises(ValueError, match="does not divide"):
        registry.entry(mamba.architecture).check_tensor_parallel(mamba, 4)


def test_loading_one_model_imports_no_other_family() -> None:
    """The engine, the server and the CLI import no model file but Llama's (the base every family builds on) and the
    EAGLE head's (the drafter's); building a model imports its own file, and what that file imports."""
    code = """
import sys
import streamer.cli, streamer.engine.async_engine, streamer.llm, streamer.server.app
from streamer.models import loader, registry
from streamer.models.config import ModelConfig
files = {f"streamer.models.{m.module}" for m in registry.MODELS.values()} | {"streamer.models.vlm", "streamer.models.mtp"}
print(sorted(files & set(sys.modules)))
cfg = ModelConfig.from_dict(dict(architectures=["Olmo2ForCausalLM"], vocab_size=64, hidden_size=64,
                                 intermediate_size=128, num_hidden_layers=2, num_attention_heads=4))
loader.model_class(cfg)
print(sorted(files & set(sys.modules)))
"""
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, check=True)
    before, after = out.stdout.strip().splitlines()
    assert before == str(["streamer.models.eagle", "streamer.models.llama"]), before
    # (OLMo 2's file imports Gemma 3's norm)
    assert after == str(["streamer.models.eagle", "streamer.models.gemma3", "streamer.models.llama",
                         "streamer.models.olmo2"]), after
