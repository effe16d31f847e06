"""Qwen2-Audio (audio clips in prompts: streamer/multimodal/audio_prompts.py, models/audio_tower.py, models/vlm.py
Qwen2AudioMixin) against transformers, which is only a test oracle here: the encoder's rows for clips of several
lengths, the features and token counts Qwen2AudioProcessor makes, and greedy generation (tokens and logprobs) with
one clip, two clips in a prompt, a clip past 30 s, chunked prefill cutting through a clip and prefix caching; the
errors a bad prompt gets; LLM.chat with OpenAI's input_audio parts."""
from __future__ import annotations

import base64
import json

import numpy as np
import pytest
import torch

from streamer import LLM, SamplingParams
from streamer.models.audio_tower import AudioTower, audio_tokens
from streamer.multimodal.audio_prompts import AudioPrompts, as_clips, hash_clip
from tests.checkpoints import hf_qwen2_audio_greedy, make_qwen2_audio_checkpoint
from tests.test_multimodal import check_freed
from tests.test_server_audio import wav_bytes

transformers = pytest.importorskip("transformers")

RATE = 16_000
PROMPT = ("<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n<|im_start|>user\n"
          "Audio 1: <|audio_bos|><|AUDIO|><|audio_eos|>\nWhat is this?<|im_end|>\n<|im_start|>assistant\n")
AUDIO_ID = 512  # <|AUDIO|>: the first token added after the test tokenizer's 512 (checked by `audio_id`)
TWO = PROMPT.replace("What is", "Audio 2: <|audio_bos|><|AUDIO|><|audio_eos|>\nAnd what is")


def noise(seconds: float, seed: int) -> np.ndarray:
    return (np.random.default_rng(seed).standard_normal(int(seconds * RATE)) * 0.1).astype(np.float32)


def tone(seconds: float, hz: float) -> np.ndarray:
    t = np.arange(int(seconds * RATE)) / RATE
    return (0.3 * np.sin(2 * np.pi * hz * t)).astype(np.float32)


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory: pytest.TempPathFactory):
    return make_qwen2_audio_checkpoint(tmp_path_factory.mktemp("qwen2_audio"))


@pytest.fixture(scope="module", autouse=True)
def audio_id(ckpt) -> int:
    """The checkpoint's <|AUDIO|> id (the tests below write it as AUDIO_ID)."""
    token = json.loads((ckpt / "config.json").read_text())["audio_token_index"]
    assert token == AUDIO_ID
    return token


@pytest.fixture(scope="module")
def llm(ckpt) -> LLM:
    return LLM(str(ckpt), dtype="float32", max_model_len=2048)


def _greedy(llm: LLM, prompts: list[dict], n: int = 8) -> list[tuple[list[int], list[int], list[float]]]:
    outs = llm.generate(prompts, SamplingParams(max_tokens=n, temperature=0, logprobs=0, ignore_eos=True))
    return [(list(o.prompt_token_ids), list(o.outputs[0].token_ids),
             [next(iter(lp.values())).logprob for lp in o.outputs[0].logprobs]) for o in outs]


def _check_against_hf(ckpt, ours, clips_per_prompt) -> None:
    ref = hf_qwen2_audio_greedy(ckpt, [(p, clips) for (p, _, _), clips in zip(ours, clips_per_prompt)], 8)
    for (_, tokens, lps), (ref_tokens, ref_lps) in zip(ours, ref):
        assert tokens == ref_tokens
        np.testing.assert_allclose(lps, ref_lps, atol=2e-3)


# ---------------------------------------------------------------------------------------------------- the encoder

def test_tower_matches_transformers_for_clips_of_several_lengths() -> None:
    from transformers import Qwen2AudioEncoder, Qwen2AudioEncoderConfig
    cfg = dict(d_model=32, encoder_layers=2, encoder_attention_heads=4, encoder_ffn_dim=64, num_mel_bins=16,
               max_source_positions=1500)
    torch.manual_seed(0)
    ref = Qwen2AudioEncoder(Qwen2AudioEncoderConfig(**cfg)).eval()
    with torch.no_grad():
        for p in ref.parameters():  # every weight random (norms' too), so that each shows in the output
            p.normal_(0.0, 0.3)
    ours = AudioTower(cfg)
    assert ours.load_weights(ref.state_dict().items()) == {n for n, _ in ours.named_parameters()}
    features = torch.randn(3, 16, 3000, generator=torch.Generator().manual_seed(1))
    for frames in (3, 4, 5, 501, 2999, 3000):
        positions = (frames - 1) // 2 + 1
        keys = torch.arange(1500) < positions
        mask = torch.zeros(1, 1, 1500, 1500).masked_fill(~keys, float("-inf"))  # (padding keys masked)
        with torch.no_grad():
            expected = ref(features[:1], attention_mask=mask).last_hidden_state[0, :audio_tokens(frames)]
            got = ours(features[0], frames)
        assert got.shape == (audio_tokens(frames), 32)
        torch.testing.assert_close(got, expected, atol=2e-5, rtol=1e-4)


def test_tower_refuses_bad_input() -> None:
    tower = AudioTower(dict(d_model=8, encoder_layers=1, encoder_attention_heads=2, encoder_ffn_dim=16,
                            num_mel_bins=4))
    with pytest.raises(ValueError, match=r"\[4, 3000\]"):
        tower(torch.zeros(4, 2999), 100)
    with pytest.raises(ValueError, match="3 to 3000 mel frames"):
        tower(torch.zeros(4, 3000), 2)
    with pytest.raises(ValueError, match="not divisible"):
        AudioTower(dict(d_model=10, encoder_attention_heads=4))
    with pytest.raises(ValueError, match="activation_function"):
        AudioTower(dict(d_model=8, encoder_attention_heads=2, activation_function="swish_nope"))


# ---------------------------------------------------------------------------------------------------- the processor

@pytest.mark.parametrize("seconds", [0.03, 1.0, 2.5, 29.99, 30.0, 41.0])
def test_features_and_token_counts_match_the_processor(ckpt, seconds: float) -> None:
    fe = transformers.WhisperFeatureExtractor.from_pretrained(ckpt)
    clip = noise(seconds, seed=3)
    ref = fe(clip, sampling_rate=RATE, return_attention_mask=True, padding="max_length", return_tensors="pt")
    prompts = AudioPrompts(ckpt, AUDIO_ID, "<|AUDIO|>", 4)
    features, frames = prompts.process(clip)
    assert frames == int(ref["attention_mask"].sum())
    torch.testing.assert_close(features, ref["input_features"][0], atol=1e-4, rtol=1e-4)
    ids, inputs = prompts.expand([7, AUDIO_ID, 8], [clip])
    n = (((frames - 1) // 2 + 1) - 2) // 2 + 1  # Qwen2AudioProcessor's count
    assert ids == [7] + [AUDIO_ID] * n + [8]
    assert (inputs[0].offset, inputs[0].length, inputs[0].frames) == (1, n, frames)


def test_expand_keeps_an_expanded_run_and_refuses_a_wrong_one(ckpt) -> None:
    prompts = AudioPrompts(ckpt, AUDIO_ID, "<|AUDIO|>", 2)
    clip = noise(1.0, seed=4)
    n = audio_tokens(100)
    ids, inputs = prompts.expand([5] + [AUDIO_ID] * n + [6], [clip])
    assert ids == [5] + [AUDIO_ID] * n + [6] and inputs[0].offset == 1
    with pytest.raises(ValueError, match=f"exactly its {n} audio tokens"):
        prompts.expand([5] + [AUDIO_ID] * 3 + [6], [clip])
    with pytest.raises(ValueError, match="1 audio placeholder.*2 audio clip"):
        prompts.expand([5, AUDIO_ID, 6], [clip, clip])
    with pytest.raises(ValueError, match="at most 2 audio clips"):
        prompts.expand([AUDIO_ID, 5, AUDIO_ID, 6, AUDIO_ID], [clip] * 3)
    with pytest.raises(ValueError, match="too short"):
        prompts.expand([5, AUDIO_ID], [np.zeros(300, np.float32)])


def test_clip_hash_covers_features_and_length() -> None:
    f = torch.zeros(4, 8)
    assert hash_clip(f, 5) == hash_clip(f.clone(), 5)
    assert hash_clip(f, 5) != hash_clip(f, 6)
    assert hash_clip(f, 5) != hash_clip(f + 1, 5)


def test_as_clips_shapes() -> None:
    a = noise(0.5, 1)
    assert len(as_clips(a)) == 1 and len(as_clips([a, a])) == 2
    (resampled,) = as_clips((a, 8000))  # (samples, rate): resampled to 16 kHz
    assert abs(len(resampled) - 2 * len(a)) <= 1
    assert len(as_clips([(a, 16000), a])) == 2
    with pytest.raises(ValueError, match=r"multi_modal_data\['audio'\]"):
        as_clips("not audio")
    with pytest.raises(ValueError, match="NaN"):
        as_clips(np.array([0.0, np.nan], np.float32))


# ---------------------------------------------------------------------------------------------------- generation

def test_greedy_matches_transformers(ckpt, llm: LLM) -> None:
    clips = [noise(3.0, seed=1), tone(7.0, 440.0), noise(35.0, seed=2)]  # (the last cut at 30 s, as transformers)
    ours = _greedy(llm, [{"prompt": PROMPT, "multi_modal_data": {"audio": c}} for c in clips])
    assert [p.count(AUDIO_ID) for p, _, _ in ours] == [75, 175, 750]
    _check_against_hf(ckpt, ours, [[c] for c in clips])


def test_two_clips_in_one_prompt(ckpt, llm: LLM) -> None:
    clips = [tone(2.0, 220.0), noise(4.5, seed=5)]
    ours = _greedy(llm, [{"prompt": TWO, "multi_modal_data": {"audio": clips}}])
    assert ours[0][0].count(AUDIO_ID) == audio_tokens(200) + audio_tokens(450) == 50 + 112
    _check_against_hf(ckpt, ours, [clips])


def test_the_clip_steers_the_output(llm: LLM) -> None:
    """Same text, same length, other audio: other tokens (the clip's features reach the decoder)."""
    a, b = _greedy(llm, [{"prompt": PROMPT, "multi_modal_data": {"audio": c}}
                         for c in (noise(2.0, seed=8), tone(2.0, 880.0))])
    assert a[0] == b[0]
    assert a[1] != b[1]


def test_chunked_prefill_through_a_clip_and_prefix_caching(ckpt) -> None:
    """A 48-token budget cuts each clip's tokens across steps; a repeated clip is read from the prefix cache, and
    a clip of the same length with other audio is not."""
    small = LLM(str(ckpt), dtype="float32", max_model_len=2048, max_num_batched_tokens=48, block_size=16)
    clip, other = noise(3.0, seed=11), noise(3.0, seed=12)
    first = small.generate([{"prompt": PROMPT, "multi_modal_data": {"audio": clip}}],
                           SamplingParams(max_tokens=8, temperature=0, ignore_eos=True))[0]
    again, changed = small.generate([{"prompt": PROMPT, "multi_modal_data": {"audio": c}} for c in (clip, other)],
                                    SamplingParams(max_tokens=8, temperature=0, ignore_eos=True))
    at = list(first.prompt_token_ids).index(AUDIO_ID)  # (the clip's first token: blocks before it are text alone)
    assert again.num_cached_tokens >= at + 75 - 16 and changed.num_cached_tokens <= at
    assert list(again.outputs[0].token_ids) == list(first.outputs[0].token_ids)
    ref = hf_qwen2_audio_greedy(ckpt, [(list(first.prompt_token_ids), [clip]),
                                       (list(changed.prompt_token_ids), [other])], 8)
    assert [list(first.outputs[0].token_ids), list(changed.outputs[0].token_ids)] == [r[0] for r in ref]
    check_freed(small)


def test_clips_split_over_chunks_evicted_features_and_preemption(ckpt) -> None:
    """Prefill chunks of 16 tokens cut each clip's 50 tokens over steps; an encoder cache too small to keep
    anything makes every chunk encode its clip again; few KV blocks preempt requests (recomputed from scratch)."""
    llm = LLM(str(ckpt), dtype="float32", max_model_len=2048, max_num_batched_tokens=16, encoder_cache_bytes=0,
              num_kv_blocks=40, block_size=4)
    clips = [noise(2.0, seed=50 + i) for i in range(4)]
    ours = _greedy(llm, [{"prompt": PROMPT, "multi_modal_data": {"audio": c}} for c in clips], 12)
    ref = hf_qwen2_audio_greedy(ckpt, [(p, [c]) for (p, _, _), c in zip(ours, clips)], 12)
    assert [t for _, t, _ in ours] == [r for r, _ in ref]
    assert llm.engine.runner.encoder_cache.num_encoded > len(clips)  # chunks re-encoded their clips
    assert llm.engine.scheduler.num_preemptions > 0
    check_freed(llm)


def test_bad_prompts_get_clear_errors(llm: LLM) -> None:
    from PIL import Image
    clip = noise(1.0, seed=1)
    bad = [
        ({"prompt": PROMPT, "multi_modal_data": {"image": Image.new("RGB", (8, 8))}}, "takes no images or video"),
        ({"prompt": PROMPT, "multi_modal_data": {"audio": [clip, clip]}}, "1 audio placeholder"),
        ({"prompt": "no placeholder", "multi_modal_data": {"audio": clip}}, "0 audio placeholder"),
        ({"prompt": PROMPT, "multi_modal_data": {"audio": np.zeros(100, np.float32)}}, "too short"),
        ({"prompt": PROMPT, "multi_modal_data": {"audio": "x.wav"}}, r"multi_modal_data\['audio'\]"),
        ({"prompt": PROMPT}, "1 audio placeholder.*0 audio clip"),
    ]
    for prompt, message in bad:
        with pytest.raises(ValueError, match=message):
            llm.generate([prompt], SamplingParams(max_tokens=2))
    # and the engine serves on, with nothing left allocated
    assert len(_greedy(llm, [{"prompt": PROMPT, "multi_modal_data": {"audio": clip}}], 2)[0][1]) == 2
    check_freed(llm)


def test_text_and_vision_models_refuse_audio(tmp_path) -> None:
    from tests.checkpoints import make_checkpoint
    text = LLM(str(make_checkpoint(tmp_path / "text")), dtype="float32")
    with pytest.raises(ValueError, match="this model takes no audio"):
        text.generate([{"prompt": "hi", "multi_modal_data": {"audio": noise(1.0, 1)}}], SamplingParams(max_tokens=2))
    with pytest.raises(ValueError, match="takes no audio"):
        text.chat([{"role": "user", "content": [
            {"type": "input_audio", "input_audio": {"data": base64.b64encode(wav_bytes(noise(1.0, 1))).decode(),
                                                    "format": "wav"}},
            {"type": "text", "text": "hi"}]}], SamplingParams(max_tokens=2))


def test_chat_with_input_audio_and_audio_url(llm: LLM) -> None:
    clips = [noise(2.0, seed=21), tone(1.5, 300.0)]
    b64 = [base64.b64encode(wav_bytes(c)).decode() for c in clips]
    messages = [{"role": "user", "content": [
        {"type": "input_audio", "input_audio": {"data": b64[0], "format": "wav"}},
        {"type": "audio_url", "audio_url": {"url": f"data:audio/wav;base64,{b64[1]}"}},
        {"type": "text", "text": "What are these?"}]}]
    out = llm.chat(messages, SamplingParams(max_tokens=6, temperature=0, ignore_eos=True))[0]
    text = ("<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n<|im_start|>user\n"
            "Audio 1: <|audio_bos|><|AUDIO|><|audio_eos|>\nAudio 2: <|audio_bos|><|AUDIO|><|audio_eos|>\n"
            "What are these?<|im_end|>\n<|im_start|>assistant\n")
    ids = llm.tokenizer.encode(text, add_special_tokens=False)  # (the template's text: no BOS added)
    direct = llm.generate([{"prompt_token_ids": ids, "multi_modal_data": {"audio": clips}}],
                          SamplingParams(max_tokens=6, temperature=0, ignore_eos=True))[0]
    assert list(out.prompt_token_ids) == list(direct.prompt_token_ids)
    assert list(out.outputs[0].token_ids) == list(direct.outputs[0].token_ids)
    assert list(out.prompt_token_ids).count(AUDIO_ID) == audio_tokens(200) + audio_tokens(150)
    with pytest.raises(ValueError, match="input_audio"):
        llm.chat([{"role": "user", "content": [{"type": "input_audio", "input_audio": {"data": 5}}]}])


def test_cli_generate_with_audio(ckpt, llm: LLM, tmp_path, capsys: pytest.CaptureFixture[str]) -> None:
    """`streamer generate --audio FILE`: the same text as LLM.generate with the clip; a file that is not audio is
    an error, not a crash."""
    from streamer.cli import main
    clip = noise(1.5, seed=41)
    wav = tmp_path / "a.wav"
    wav.write_bytes(wav_bytes(clip))
    common = ["generate", "--model", str(ckpt), "--dtype", "float32", "--prompt", PROMPT, "--max-tokens", "6",
              "--ignore-eos"]
    assert main([*common, "--audio", str(wav)]) == 0
    out = llm.generate([{"prompt": PROMPT, "multi_modal_data": {"audio": clip}}],
                       SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True))[0].outputs[0].text
    assert capsys.readouterr().out == PROMPT + out + "\n"
    (tmp_path / "b.wav").write_bytes(b"not audio at all")
    assert main([*common, "--audio", str(tmp_path / "b.wav")]) == 1
    assert "streamer generate: error:" in capsys.readouterr().err
