"""Mistral's own checkpoint format (streamer/tokenizer/mistral_format.py): params.json, consolidated.safetensors in Meta's
rotary layout, and Mistral's real tokenizer files as mistral_common bundles them (tekken.json of Mistral-Nemo /
Pixtral, the SentencePiece tokenizer.model.v3 / .v7 of Mistral-7B-v0.3 and Mistral-Large-2411). The tekken BPE
encodes as mistral_common's Tekkenizer; a tiny model written in that format generates the tokens transformers gives
the same weights in its own format; chat prompts are mistral_common's encode_chat_completion, id for id."""
from __future__ import annotations

import json
import os
import random
import shutil
from pathlib import Path

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from streamer import LLM, SamplingParams
from streamer.tokenizer.mistral_format import tekken_tokenizer
from streamer.tokenizer.tokenizer import Tokenizer

mistral_common = pytest.importorskip("mistral_common")
tf = pytest.importorskip("transformers")
pytest.importorskip("sentencepiece")

from mistral_common.protocol.instruct.messages import AssistantMessage, SystemMessage, UserMessage  # noqa: E402
from mistral_common.protocol.instruct.request import ChatCompletionRequest  # noqa: E402
from mistral_common.tokens.tokenizers.mistral import MistralTokenizer  # noqa: E402
from mistral_common.tokens.tokenizers.tekken import Tekkenizer  # noqa: E402

DATA = Path(os.path.dirname(mistral_common.__file__)) / "data"
TEKKEN = DATA / "tekken_240911.json"
SPM = {"v3": DATA / "mistral_instruct_tokenizer_240323.model.v3", "v7": DATA / "mistral_instruct_tokenizer_241114.model.v7"}
PARTS = ["Hello", " world", "東京", "😀", " ", "  ", "\n", "\t", "1234567", "def f(x):", "ß", "é", "Ａ", "'s", "don't",
         "\r\n", "   x", "[INST]", "Привет", "∑"]


@pytest.fixture(scope="module")
def tekken():
    return tekken_tokenizer(TEKKEN)[0], Tekkenizer.from_file(TEKKEN)


@settings(max_examples=300, deadline=None)
@given(text=st.lists(st.sampled_from(PARTS), max_size=16).map("".join))
def test_tekken_encodes_as_mistral_common(tekken, text):
    ours, theirs = tekken
    ids = ours.encode(text, add_special_tokens=False).ids
    if "[INST]" in text:  # (a special token in the text: matched whole here, as transformers' tokenizer.json does)
        assert ours.token_to_id("[INST]") in ids
        return
    assert ids == theirs.encode(text, bos=False, eos=False)
    assert ours.decode(ids) == theirs.decode(ids)


def test_tekken_specials_take_the_first_ids(tekken):
    ours, theirs = tekken
    assert [ours.token_to_id(t) for t in ("<unk>", "<s>", "</s>", "[INST]", "[/INST]")] == \
        [theirs.unk_id, theirs.bos_id, theirs.eos_id, 3, 4]
    assert ours.get_vocab_size() == theirs.n_words == 131072


# ------------------------------------------------------------------------------------------------ a checkpoint
def _meta_layout(w: torch.Tensor, heads: int) -> torch.Tensor:
    """transformers' half-split rotary rows back to Meta's interleaved pairs (what consolidated files hold)."""
    rows = w.shape[0]
    return w.view(heads, 2, rows // heads // 2, *w.shape[1:]).transpose(1, 2).reshape(w.shape)


def _mistral_name(hf: str) -> str:
    names = {"model.embed_tokens.weight": "tok_embeddings.weight", "model.norm.weight": "norm.weight",
             "lm_head.weight": "output.weight"}
    if hf in names:
        return names[hf]
    parts = {"self_attn.q_proj": "attention.wq", "self_attn.k_proj": "attention.wk", "self_attn.v_proj": "attention.wv",
             "self_attn.o_proj": "attention.wo", "input_layernorm": "attention_norm",
             "post_attention_layernorm": "ffn_norm", "mlp.gate_proj": "feed_forward.w1",
             "mlp.down_proj": "feed_forward.w2", "mlp.up_proj": "feed_forward.w3"}
    layer, rest = hf.removeprefix("model.layers.").split(".", 1)
    module, kind = rest.rsplit(".", 1)
    return f"layers.{layer}.{parts[module]}.{kind}"


def _native_tensors(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """A transformers state dict as a consolidated file holds it (Mixtral's fused experts split per expert)."""
    out = {}
    for name, t in state.items():
        if name.endswith("q_proj.weight"):
            t = _meta_layout(t, 4)
        elif name.endswith("k_proj.weight"):
            t = _meta_layout(t, 2)
        layer = name.removeprefix("model.layers.").split(".", 1)[0]
        if name.endswith("mlp.experts.gate_up_proj"):  # [E, 2 * I, H]: gate rows, then up rows
            inter = t.shape[1] // 2
            for e in range(t.shape[0]):
                out[f"layers.{layer}.feed_forward.experts.{e}.w1.weight"] = t[e, :inter].contiguous()
                out[f"layers.{layer}.feed_forward.experts.{e}.w3.weight"] = t[e, inter:].contiguous()
        elif name.endswith("mlp.experts.down_proj"):
            for e in range(t.shape[0]):
                out[f"layers.{layer}.feed_forward.experts.{e}.w2.weight"] = t[e].contiguous()
        elif name.endswith("mlp.gate.weight"):
            out[f"layers.{layer}.feed_forward.gate.weight"] = t
        else:
            out[_mistral_name(name)] = t.contiguous()
    return out


def write_checkpoints(root: Path, tokenizer_file: Path, vocab: int, experts: int = 0) -> tuple[Path, Path]:
    """The same random tiny Mistral (Mixtral with `experts`) twice: transformers' format (the oracle) and
    Mistral's."""
    from safetensors.torch import save_file
    hf, native = root / "hf", root / "native"
    shape = dict(vocab_size=vocab, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                 num_attention_heads=4, num_key_value_heads=2, head_dim=16, rope_theta=1e6,
                 max_position_embeddings=512, rms_norm_eps=1e-5, initializer_range=0.08, sliding_window=None,
                 tie_word_embeddings=False)
    cfg = tf.MixtralConfig(**shape, num_local_experts=experts, num_experts_per_tok=2) if experts else \
        tf.MistralConfig(**shape)
    torch.manual_seed(0)
    model = tf.AutoModelForCausalLM.from_config(cfg)
    if experts:  # (transformers initialises fused expert weights to zero: give them values)
        for name, p in model.named_parameters():
            if ".experts." in name:
                torch.nn.init.normal_(p, std=0.08)
    model.save_pretrained(hf)
    native.mkdir()
    tensors = _native_tensors(model.state_dict())
    tensors["vision_encoder.patch_conv.weight"] = torch.zeros(4, 3, 2, 2)  # (skipped: text only)
    save_file(tensors, native / "consolidated.safetensors", metadata={"format": "pt"})
    params = {"dim": 64, "n_layers": 2, "head_dim": 16, "hidden_dim": 128, "n_heads": 4, "n_kv_heads": 2,
              "rope_theta": 1e6, "norm_eps": 1e-5, "vocab_size": vocab, "max_seq_len": 512,
              "vision_encoder": {"hidden_size": 4}}
    if experts:
        params["moe"] = {"num_experts": experts, "num_experts_per_tok": 2}
    (native / "params.json").write_text(json.dumps(params))
    shutil.copy(tokenizer_file, native / tokenizer_file.name)
    return hf, native


@pytest.fixture(scope="module")
def ckpts(tmp_path_factory):
    return write_checkpoints(tmp_path_factory.mktemp("mistral"), TEKKEN, 131072)


def _same_tokens(hf: Path, native: Path) -> None:
    prompt = "The quick brown fox, 東京 and 😀"
    ids = [1] + Tekkenizer.from_file(TEKKEN).encode(prompt, bos=False, eos=False)
    model = tf.AutoModelForCausalLM.from_pretrained(hf, dtype=torch.float32)
    t = torch.tensor([ids])
    want = model.generate(t, attention_mask=torch.ones_like(t), max_new_tokens=10, min_new_tokens=10,
                          do_sample=False, pad_token_id=11)[0, len(ids):].tolist()
    with LLM(str(native), dtype="float32", max_model_len=512) as llm:
        out = llm.generate(prompt, SamplingParams(max_tokens=10, min_tokens=10, temperature=0.0))[0]
    assert out.prompt_token_ids == ids
    assert list(out.outputs[0].token_ids) == want


def test_a_mistral_format_checkpoint_generates_transformers_tokens(ckpts):
    _same_tokens(*ckpts)


def test_a_mixtral_in_mistral_format(tmp_path):
    _same_tokens(*write_checkpoints(tmp_path, TEKKEN, 131072, experts=4))


CONVERSATIONS = [
    [{"role": "user", "content": "Hello there"}],
    [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hello there"},
     {"role": "assistant", "content": "Hi!"}, {"role": "user", "content": "What is 2+2?\n\nThink."}],
]
_MESSAGES = {"system": SystemMessage, "user": UserMessage, "assistant": AssistantMessage}


def _theirs(path: Path, messages: list[dict]) -> list[int]:
    request = ChatCompletionRequest(messages=[_MESSAGES[m["role"]](content=m["content"]) for m in messages])
    return MistralTokenizer.from_file(str(path)).encode_chat_completion(request).tokens


@pytest.mark.parametrize("conversation", CONVERSATIONS)
def test_chat_prompts_are_mistral_commons(ckpts, conversation):
    with LLM(str(ckpts[1]), dtype="float32", max_model_len=512) as llm:
        out = llm.chat(conversation, SamplingParams(max_tokens=1))[0]
    assert out.prompt_token_ids == _theirs(TEKKEN, conversation)


@pytest.mark.parametrize("version", ["v3", "v7"])
def test_sentencepiece_mistral_tokenizers(version, tmp_path):
    """tokenizer.model.v3 / .v7: encodes as SentencePiece (bundled real files), chats as mistral_common."""
    import sentencepiece as spm
    folder = tmp_path / version
    folder.mkdir()
    shutil.copy(SPM[version], folder / f"tokenizer.model.{version}")
    (folder / "params.json").write_text("{}")
    tok = Tokenizer.from_pretrained(folder)
    sp = spm.SentencePieceProcessor(model_file=str(SPM[version]))
    rng = random.Random(0)
    for _ in range(200):
        text = "".join(rng.choice([p for p in PARTS if p != "[INST]"]) for _ in range(rng.randint(1, 10)))
        if text[0].isspace():  # (not legacy, as chat needs: a leading space is the dummy prefix, as in
            continue           # transformers' Metaspace "first"; SentencePiece would add one more)
        assert tok.encode(text) == [sp.bos_id()] + sp.encode(text), text
    for conversation in CONVERSATIONS:
        from streamer.server.chat_template import ChatTemplate
        text = ChatTemplate.from_tokenizer(tok).render(conversation)
        assert tok.encode(text, add_special_tokens=False) == _theirs(SPM[version], conversation)


def test_both_formats_in_one_folder_load_transformers_files(ckpts, tmp_path):
    """Repos that ship both (config.json + model.safetensors beside consolidated.safetensors) load the former."""
    hf, native = ckpts
    both = tmp_path / "both"
    shutil.copytree(hf, both)
    shutil.copy(native / "consolidated.safetensors", both / "consolidated.safetensors")
    shutil.copy(native / "tekken_240911.json", both / "tekken.json")
    with LLM(str(both), dtype="float32", max_model_len=512) as llm:
        a = llm.generate({"prompt_token_ids": [1, 500, 600]}, SamplingParams(max_tokens=6, temperature=0.0))
    with LLM(str(native), dtype="float32", max_model_len=512) as llm:
        b = llm.generate({"prompt_token_ids": [1, 500, 600]}, SamplingParams(max_tokens=6, temperature=0.0))
    assert a[0].outputs[0].token_ids == b[0].outputs[0].token_ids


def test_params_it_cannot_serve_are_named(tmp_path):
    (tmp_path / "params.json").write_text(json.dumps({"dim": 64, "n_layers": 2, "n_heads": 4, "hidden_dim": 128,
                                                      "vocab_size": 1000, "yarn": {"factor": 4}}))
    with pytest.raises(ValueError, match="yarn not supported in Mistral's format"):
        LLM(str(tmp_path))
    (tmp_path / "params.json").write_text(json.dumps({"dim": 64, "n_layers": 2, "n_heads": 4, "hidden_dim": 128,
                                                      "vocab_size": 1000, "moe": {"num_experts": 4}}))
    with pytest.raises(ValueError, match="moe must give num_experts and num_experts_per_tok"):
        LLM(str(tmp_path))


def test_served_with_the_openai_client(ckpts):
    """`streamer serve` on the Mistral-format folder: chat streams, and its prompt is mistral_common's."""
    import openai

    from tests.server_utils import LiveServer
    conversation = CONVERSATIONS[1]
    with LiveServer(ckpts[1], max_model_len=512) as live:
        client = openai.OpenAI(base_url=live.base_url, api_key="x", max_retries=0, timeout=120)
        stream = client.chat.completions.create(model=live.model_name, messages=conversation, max_tokens=5,
                                                temperature=0.0, stream=True,
                                                stream_options={"include_usage": True})
        chunks = list(stream)
    usage = chunks[-1].usage
    assert usage is not None and usage.prompt_tokens == len(_theirs(TEKKEN, conversation))
    assert usage.completion_tokens == 5 or chunks[-2].choices[0].finish_reason == "stop"
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)


def test_weight_updates_are_refused_by_name(ckpts):
    with LLM(str(ckpts[1]), dtype="float32", max_model_len=512) as llm:
        with pytest.raises(ValueError, match="Mistral's format"):
            llm.update_weights(ckpts[1])
        out = llm.generate({"prompt_token_ids": [1, 500]}, SamplingParams(max_tokens=2, temperature=0.0))
    assert len(out[0].outputs[0].token_ids) == 2  # (and it still serves)


def test_vllms_mistral_switches(ckpts):
    """vLLM's command line for these models (--tokenizer-mode / --config-format / --load-format mistral) runs as
    it is; on a folder without params.json the switches are refused by name."""
    from streamer.cli import build_parser
    from streamer.config import EngineConfig
    args = build_parser().parse_args(["serve", str(ckpts[1]), "--tokenizer-mode", "mistral", "--config-format",
                                      "mistral", "--load-format", "mistral"])
    from streamer.cli import engine_kwargs
    cfg = EngineConfig.from_kwargs(str(ckpts[1]), **engine_kwargs(args))
    assert cfg.load_format == "auto"
    with pytest.raises(ValueError, match="tokenizer_mode 'mistral' needs a folder in Mistral's format"):
        EngineConfig.from_kwargs(str(ckpts[0]), tokenizer_mode="mistral")


def _tekken_version(version: str, out: Path) -> Path:
    """The bundled tekken file as a newer version: its special tokens listed (as v7+ files list them)."""
    from mistral_common.tokens.tokenizers.base import SpecialTokens
    data = json.loads(TEKKEN.read_text())
    data["config"] = dict(data["config"], version=version)
    think = int(version[1:]) >= 13  # ([THINK] tokens: only v13 files have them)
    names = [t.value for t in SpecialTokens if think or t.value not in ("[THINK]", "[/THINK]")]
    data["special_tokens"] = [{"rank": i, "token_str": t, "is_control": True} for i, t in enumerate(names)]
    data.pop("image", None)
    out.write_text(json.dumps(data))
    return out


TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "Weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}}}}}]
WITH_TOOLS = [
    {"role": "system", "content": "Be brief."}, {"role": "user", "content": "Weather in Paris?"},
    {"role": "assistant", "content": None, "tool_calls": [{"id": "abcdefghi", "type": "function", "function": {
        "name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
    {"role": "tool", "tool_call_id": "abcdefghi", "content": "sunny"},
    {"role": "assistant", "content": "Sunny."}, {"role": "user", "content": "Thanks"}]


def _theirs_with_tools(path: Path) -> list[int]:
    from mistral_common.protocol.instruct.messages import ToolMessage
    from mistral_common.protocol.instruct.tool_calls import Function, FunctionCall, Tool, ToolCall
    call = ToolCall(id="abcdefghi", function=FunctionCall(name="get_weather", arguments='{"city": "Paris"}'))
    messages = [SystemMessage(content="Be brief."), UserMessage(content="Weather in Paris?"),
                AssistantMessage(content=None, tool_calls=[call]),
                ToolMessage(content="sunny", tool_call_id="abcdefghi"), AssistantMessage(content="Sunny."),
                UserMessage(content="Thanks")]
    tools = [Tool(function=Function(**TOOLS[0]["function"]))]
    request = ChatCompletionRequest(messages=messages, tools=tools)
    return MistralTokenizer.from_file(str(path)).encode_chat_completion(request).tokens


@pytest.mark.parametrize("version", ["v7", "v11", "v13"])
def test_newer_tekken_versions_chat_with_tools_as_mistral_common(ckpts, version, tmp_path):
    """System prompt, a tool call (v7's JSON list, v11's name[CALL_ID]id[ARGS], v13's name[ARGS]), its result
    and the tools' list where each version puts it: the prompt mistral_common encodes, id for id."""
    folder = tmp_path / version
    folder.mkdir()
    for name in ("params.json", "consolidated.safetensors"):
        (folder / name).symlink_to(ckpts[1] / name)
    tekken = _tekken_version(version, folder / "tekken.json")
    with LLM(str(folder), dtype="float32", max_model_len=512) as llm:
        out = llm.chat(WITH_TOOLS, SamplingParams(max_tokens=1), tools=TOOLS)[0]
    assert out.prompt_token_ids == _theirs_with_tools(tekken)


def test_a_params_json_without_weights(tmp_path):
    (tmp_path / "params.json").write_text(json.dumps({"dim": 64, "n_layers": 2, "n_heads": 4, "hidden_dim": 128,
                                                      "vocab_size": 1000}))
    (tmp_path / "consolidated.00.pth").write_bytes(b"")
    shutil.copy(TEKKEN, tmp_path / "tekken.json")
    with pytest.raises(FileNotFoundError, match="no consolidated\\*.safetensors weights"):
        LLM(str(tmp_path), dtype="float32")


@pytest.mark.parametrize("content", ['{"vocab": []}', '{"config": {"default_num_special_tokens": 2, '
                                     '"default_vocab_size": 4, "pattern": "."}, "vocab": [{"rank": 0}, {}]}',
                                     "[1, 2]", "not json"])
def test_a_broken_tekken_file_is_named(tmp_path, content):
    (tmp_path / "tekken.json").write_text(content)
    (tmp_path / "params.json").write_text("{}")
    with pytest.raises(ValueError, match="tekken"):
        Tokenizer.from_pretrained(tmp_path)
