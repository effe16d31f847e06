"""Whisper in the engine (models/whisper.py, streamer/multimodal/speech.py): greedy tokens equal transformers' on a tiny
checkpoint written by transformers, batched with other requests' audio, across chunked prefills and preemptions
(the encoder runs again on return), with the cross-attention's K / V read through a view of the slots' span or
gathered; bad prompts are ValueErrors naming the problem; every state slot and KV block comes back."""
from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from streamer import LLM, SamplingParams
from tests.whisper_checkpoints import hf_greedy, make_whisper, tone

PROMPT = "<|startoftranscript|><|en|><|transcribe|><|notimestamps|>"


@pytest.fixture(scope="module")
def whisper_dir(tmp_path_factory) -> Path:
    return make_whisper(tmp_path_factory.mktemp("whisper"))


def _audios(n: int) -> list[np.ndarray]:
    return [tone(1.0 + 0.7 * i, 200.0 + 150.0 * i, seed=i) for i in range(n)]


def _prompt(audio: np.ndarray, text: str = PROMPT) -> dict:
    return {"prompt": text, "multi_modal_data": {"audio": (audio, 16000)}}


def _expected(folder: Path, audios: list[np.ndarray], prompt_ids: list[int], n: int) -> list[list[int]]:
    return [hf_greedy(folder, a, prompt_ids, n) for a in audios]


def _check_clean(llm: LLM) -> None:
    eng = llm.engine
    assert eng.kv.pool.num_free == eng.kv.pool.num_blocks
    assert not eng.kv.req_blocks
    assert eng.kv.state is not None and eng.kv.state.num_free == eng.runner.num_state_slots


def test_matches_transformers_batched(whisper_dir, monkeypatch):
    from streamer.models import whisper
    monkeypatch.setattr(whisper, "ENCODER_BATCH", 2)  # (5 clips start in one step: encoded 2, 2, 1)
    audios = _audios(5)
    llm = LLM(str(whisper_dir), dtype="float32", num_kv_blocks=64, max_num_seqs=8)
    outs = llm.generate([_prompt(a) for a in audios], SamplingParams(max_tokens=24, temperature=0.0))
    prompt_ids = outs[0].prompt_token_ids
    assert len(prompt_ids) == 4  # the special tokens as written: nothing added around them
    got = [o.outputs[0].token_ids for o in outs]
    assert got == _expected(whisper_dir, audios, prompt_ids, 24)
    assert len({tuple(g) for g in got}) >= 3  # (the audio decides: different audio, different tokens)
    _check_clean(llm)


def test_chunked_prefill_preemption_and_gathered_slots(whisper_dir, monkeypatch):
    """A long decoder prompt (previous text) prefilled in chunks of 8 tokens, 6 requests on 3 state slots and a KV
    pool too small for all (preemptions: their encoders run again); then with the slots always gathered."""
    from streamer.worker import model_runner
    audios = _audios(6)
    previous = "<|startofprev|> The quick brown fox"
    llm = LLM(str(whisper_dir), dtype="float32", num_kv_blocks=12, block_size=4, max_num_seqs=3,
              max_num_batched_tokens=8, enable_chunked_prefill=True)
    params = SamplingParams(max_tokens=16, temperature=0.0)
    outs = llm.generate([_prompt(a, previous + PROMPT) for a in audios], params)
    prompt_ids = outs[0].prompt_token_ids
    assert 16 < len(prompt_ids) <= 48  # (several chunks)
    assert llm.engine.scheduler.num_preemptions > 0
    expected = _expected(whisper_dir, audios, prompt_ids, 16)
    assert [o.outputs[0].token_ids for o in outs] == expected
    assert llm.engine.runner.model.layers[0].encoder_attn.k_state.shape[0] == 4  # 3 slots + the warm-up's
    _check_clean(llm)
    monkeypatch.setattr(model_runner, "_dense_span", lambda slots, fewest=2: None)
    outs = llm.generate([_prompt(a, previous + PROMPT) for a in audios], params)
    assert [o.outputs[0].token_ids for o in outs] == expected
    _check_clean(llm)


@pytest.mark.parametrize("cache_bytes", [512 << 20, 0], ids=["encoder-cache", "no-cache"])
def test_preempted_requests_fill_again(whisper_dir, cache_bytes):
    """A preempted request computes its cross-attention K / V again on its return: from the encoder cache's copy of
    its audio's encoder output (each clip encoded once), or, with no room in the cache, by encoding again."""
    audios = _audios(4)
    llm = LLM(str(whisper_dir), dtype="float32", num_kv_blocks=10, block_size=4, max_num_seqs=4,
              encoder_cache_bytes=cache_bytes)
    model = llm.engine.runner.model
    encoded, filled = [], []
    encode, fill = model.encode, model.fill
    model.encode = lambda feats: (encoded.append(len(feats)), encode(feats))[1]
    model.fill = lambda slots, out: (filled.append(len(slots)), fill(slots, out))[1]
    outs = llm.generate([_prompt(a) for a in audios], SamplingParams(max_tokens=30, temperature=0.0))
    prompt_ids = outs[0].prompt_token_ids
    assert [o.outputs[0].token_ids for o in outs] == _expected(whisper_dir, audios, prompt_ids, 30)
    preemptions = llm.engine.scheduler.num_preemptions
    assert preemptions > 0  # 4 requests x 34 tokens do not fit 40 slots of KV
    assert sum(filled) == len(audios) + preemptions  # (a preempted one filled its slot again)
    assert sum(encoded) == (len(audios) if cache_bytes else len(audios) + preemptions)
    _check_clean(llm)


def test_the_same_audio_is_encoded_once(whisper_dir):
    """Requests for the same audio (another decoder prompt, a retry, n > 1 in another call) read one encoder
    output, also when they start in the same step; other audio is encoded."""
    llm = LLM(str(whisper_dir), dtype="float32", num_kv_blocks=64, max_num_seqs=8)
    model = llm.engine.runner.model
    encoded = []
    encode = model.encode
    model.encode = lambda feats: (encoded.append(len(feats)), encode(feats))[1]
    a, b = tone(2.0), tone(3.0, 330.0)
    params = SamplingParams(max_tokens=6, temperature=0.0)
    first = llm.generate([_prompt(a), _prompt(a), _prompt(b)], params)
    assert sum(encoded) == 2
    again = llm.generate([_prompt(a)], params)
    assert sum(encoded) == 2 and again[0].outputs[0].token_ids == first[0].outputs[0].token_ids
    _check_clean(llm)


def test_sampling_and_n(whisper_dir):
    """Seeded sampling is reproducible and n > 1 shares one prompt's audio."""
    llm = LLM(str(whisper_dir), dtype="float32", num_kv_blocks=64, max_num_seqs=8)
    params = SamplingParams(max_tokens=12, temperature=1.0, seed=7, n=3)
    a = llm.generate([_prompt(tone(2.0))], params)[0]
    b = llm.generate([_prompt(tone(2.0))], params)[0]
    assert [o.token_ids for o in a.outputs] == [o.token_ids for o in b.outputs]
    assert len(a.outputs) == 3 and all(len(o.token_ids) for o in a.outputs)
    _check_clean(llm)


def test_bad_prompts(whisper_dir):
    llm = LLM(str(whisper_dir), dtype="float32", num_kv_blocks=64, max_num_seqs=4)
    params = SamplingParams(max_tokens=4, temperature=0.0)
    with pytest.raises(ValueError, match="needs audio"):
        llm.generate([PROMPT], params)
    with pytest.raises(ValueError, match="multi_modal_data must be"):
        llm.generate([{"prompt": PROMPT, "multi_modal_data": {"image": tone(1.0)}}], params)
    with pytest.raises(ValueError, match="at most 30 s"):
        llm.generate([_prompt(tone(31.0))], params)
    with pytest.raises(ValueError):
        llm.generate([_prompt(np.zeros((2, 2, 2), dtype=np.float32))], params)
    # (and it goes on serving)
    out = llm.generate([_prompt(tone(1.0))], params)[0]
    assert len(out.outputs[0].token_ids) == 4
    _check_clean(llm)


def test_refuses_speculative_decoding(whisper_dir):
    with pytest.raises(ValueError, match="encoder-decoder"):
        LLM(str(whisper_dir), dtype="float32", num_kv_blocks=16, num_speculative_tokens=2)


def test_missing_tensor_is_named(whisper_dir, tmp_path):
    import shutil

    from safetensors.torch import load_file, save_file
    bad = tmp_path / "bad"
    shutil.copytree(whisper_dir, bad)
    tensors = load_file(str(bad / "model.safetensors"))
    del tensors["model.decoder.layers.1.encoder_attn.v_proj.weight"]
    save_file(tensors, str(bad / "model.safetensors"), metadata={"format": "pt"})
    with pytest.raises(ValueError, match=r"model\.decoder\.layers\.1\.encoder_attn\.v_proj\.weight"):
        LLM(str(bad), dtype="float32", num_kv_blocks=16)
