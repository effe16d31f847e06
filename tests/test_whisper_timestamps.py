"""Whisper's decoding rules (streamer/multimodal/speech.py DecodeRules, the sampler's SpeechMasks): a prompt without
<|notimestamps|> writes timestamps, and the engine's greedy tokens equal those of transformers' own logits processors
(WhisperTimeStamp, SuppressTokensAtBegin) on a tiny checkpoint whose vocabulary ends in the 1,501 timestamp tokens;
sampled outputs keep every rule; segments are read from the timestamps; timestamps never show in the text."""
from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from streamer import LLM, SamplingParams
from streamer.multimodal.speech import DecodeRules, Segment, timestamp_segments
from tests.whisper_checkpoints import hf_greedy, make_whisper, tone

TIMESTAMPED = "<|startoftranscript|><|en|><|transcribe|>"
PLAIN = TIMESTAMPED + "<|notimestamps|>"


@pytest.fixture(scope="module")
def stamped_dir(tmp_path_factory) -> Path:
    return make_whisper(tmp_path_factory.mktemp("whisper-ts"), timestamps=True)


def _prompt(audio, text: str = TIMESTAMPED) -> dict:
    return {"prompt": text, "multi_modal_data": {"audio": (audio, 16000)}}


def _audios(n: int) -> list:
    return [tone(1.0 + 0.7 * i, 200.0 + 150.0 * i, seed=i) for i in range(n)]


def _rules(llm: LLM, prompt_ids: list[int]) -> DecodeRules:
    rules = llm.engine.speech.rules(llm.engine.tokenizer, prompt_ids)
    assert rules is not None
    return rules


def _keeps_rules(tokens: list[int], rules: DecodeRules, max_initial: int) -> None:
    """Every rule of a timestamped output: a timestamp first (at most max_initial), never <|notimestamps|>,
    timestamps never go back (a closed pair's end is not reused), at most two in a row, and a closing pair
    followed by text or the end."""
    begin = rules.timestamp_begin
    assert tokens[0] >= begin and tokens[0] - begin <= max_initial
    assert rules.no_timestamps not in tokens
    stamps = [t for t in tokens if t >= begin]
    assert stamps == sorted(stamps)
    for i in range(2, len(tokens)):
        if tokens[i - 2] >= begin and tokens[i - 1] >= begin:  # a closed pair: text (or the end) follows
            assert tokens[i] < begin
            if i >= 3 and tokens[i - 3] < begin:  # (text, then the pair: the next segment starts after it)
                later = [t for t in tokens[i:] if t >= begin]
                assert not later or later[0] > tokens[i - 1]


def test_timestamps_match_transformers(stamped_dir):
    """Greedy, batched: transformers' tokens through its own logits processors, for each clip."""
    audios = _audios(5)
    llm = LLM(str(stamped_dir), dtype="float32", num_kv_blocks=96, max_num_seqs=8)
    outs = llm.generate([_prompt(a) for a in audios], SamplingParams(max_tokens=40, temperature=0.0))
    prompt_ids = outs[0].prompt_token_ids
    assert len(prompt_ids) == 3
    got = [o.outputs[0].token_ids for o in outs]
    assert got == [hf_greedy(stamped_dir, a, prompt_ids, 40, rules=True) for a in audios]
    rules = _rules(llm, prompt_ids)
    assert rules.timestamps
    begin = rules.timestamp_begin
    assert len({tuple(g) for g in got}) >= 3
    for tokens, out in zip(got, outs):
        _keeps_rules(tokens, rules, 50)
        assert sum(t >= begin for t in tokens) >= 4  # (several segments)
        assert "<|" not in out.outputs[0].text  # timestamps are no text
        assert out.outputs[0].text == llm.engine.tokenizer.decode([t for t in tokens if t < begin])
    # Some segment holds several text tokens: the likelier-timestamp rule does not always fire
    segments = [s for g in got for s in llm.engine.speech.segments(g, rules, 0.0, 30.0)]
    assert max(len(s.token_ids) for s in segments) >= 2
    assert llm.engine.kv.pool.num_free == llm.engine.kv.pool.num_blocks


def test_timestamps_with_plain_requests_and_sampling(stamped_dir):
    """Timestamped and plain requests share batches; sampled timestamped outputs keep the rules too."""
    audios = _audios(3)
    llm = LLM(str(stamped_dir), dtype="float32", num_kv_blocks=128, max_num_seqs=8)
    prompts = [_prompt(a, t) for a in audios for t in (TIMESTAMPED, PLAIN)]
    greedy = llm.generate(prompts, SamplingParams(max_tokens=24, temperature=0.0))
    for out, a in zip(greedy, [a for a in audios for _ in range(2)]):
        assert out.outputs[0].token_ids == hf_greedy(stamped_dir, a, out.prompt_token_ids, 24, rules=True)
    plain_rules = _rules(llm, greedy[1].prompt_token_ids)
    assert not plain_rules.timestamps
    sampled = llm.generate([_prompt(audios[0])], SamplingParams(max_tokens=40, temperature=1.0, seed=3, n=6))[0]
    rules = _rules(llm, sampled.prompt_token_ids)
    assert len({tuple(o.token_ids) for o in sampled.outputs}) >= 3
    for o in sampled.outputs:
        _keeps_rules(list(o.token_ids), rules, 50)
    assert llm.engine.kv.pool.num_free == llm.engine.kv.pool.num_blocks


def test_generation_config_rules(stamped_dir, tmp_path):
    """begin_suppress_tokens bans the first token; max_initial_timestamp_index bounds the first timestamp; both
    read from generation_config.json, as transformers reads them."""
    folder = tmp_path / "tuned"
    shutil.copytree(stamped_dir, folder)
    audio = tone(1.5)
    first_plain = hf_greedy(stamped_dir, audio, _ids(stamped_dir, PLAIN), 1, rules=True)[0]
    first_stamp = hf_greedy(stamped_dir, audio, _ids(stamped_dir, TIMESTAMPED), 1, rules=True)[0]
    gen_path = folder / "generation_config.json"
    gen = json.loads(gen_path.read_text())
    begin = gen["no_timestamps_token_id"] + 1
    assert first_stamp - begin > 2  # (so that the bound below changes it)
    gen.update(begin_suppress_tokens=[first_plain], max_initial_timestamp_index=2)
    gen_path.write_text(json.dumps(gen))
    llm = LLM(str(folder), dtype="float32", num_kv_blocks=64, max_num_seqs=4)
    outs = llm.generate([_prompt(audio, PLAIN), _prompt(audio)], SamplingParams(max_tokens=12, temperature=0.0))
    plain, stamped = (o.outputs[0].token_ids for o in outs)
    assert plain[0] != first_plain and plain == hf_greedy(folder, audio, outs[0].prompt_token_ids, 12, rules=True)
    assert begin <= stamped[0] <= begin + 2
    assert stamped == hf_greedy(folder, audio, outs[1].prompt_token_ids, 12, rules=True)


def _ids(folder: Path, text: str) -> list[int]:
    from streamer.tokenizer.tokenizer import Tokenizer
    return Tokenizer.from_pretrained(folder).encode(text, add_special_tokens=False)


def test_no_rules_without_the_task_or_timestamp_tokens(stamped_dir):
    """Language detection's prompt (<|startoftranscript|> alone) gets no rules; a vocabulary without timestamp
    tokens decodes without them whatever the prompt says."""
    llm = LLM(str(stamped_dir), dtype="float32", num_kv_blocks=32, max_num_seqs=2)
    speech, tok = llm.engine.speech, llm.engine.tokenizer
    assert speech.rules(tok, _ids(stamped_dir, "<|startoftranscript|>")) is None
    assert speech.rules(tok, _ids(stamped_dir, "<|startoftranscript|><|en|>")) is None
    speech.vocab_size = speech.timestamp_ids(tok, llm.engine.vocab_size).start  # (as if it had none)
    assert not speech.rules(tok, _ids(stamped_dir, TIMESTAMPED)).timestamps


def test_bans_follow_the_output():
    r = DecodeRules(eos=10, no_timestamps=19, begin_suppress=(3, 10), timestamps=True, max_initial=5)
    V, b = 100, 20
    assert r.bans([], V) == [(3, 4), (10, 11), (19, 20), (0, b), (b + 6, V)]
    assert r.bans([b + 1], V) == [(19, 20), (b, V), (b, b + 2)]  # the opening timestamp: text next
    assert r.bans([b + 1, 5], V) == [(19, 20), (b, b + 2)]  # text: more text, or a later timestamp
    assert r.bans([b + 1, 5, b + 7], V) == [(19, 20), (0, 10), (b, b + 7)]  # closed by b+7: it may open the next
    assert r.bans([b + 1, 5, b + 7, b + 7], V) == [(19, 20), (b, V), (b, b + 8)]  # a pair: text (or end) next
    plain = DecodeRules(eos=10, no_timestamps=19, begin_suppress=(3,), timestamps=False, max_initial=None)
    assert plain.bans([], V) == [(3, 4)] and plain.bans([5], V) == []


def test_segments():
    r = DecodeRules(eos=10, no_timestamps=19, begin_suppress=(), timestamps=True, max_initial=None)
    b = 20
    # <|0.00|> 1 2 <|1.00|><|1.00|> 3 <|2.00|> <|2.50|> 4 [end of text]
    tokens = [b, 1, 2, b + 50, b + 50, 3, b + 100, b + 125, 4, 10]
    assert timestamp_segments(tokens, r, 0.02, offset=30.0, end=33.0) == [
        Segment(30.0, 31.0, [1, 2], [1, 2]), Segment(31.0, 32.0, [3], [5]), Segment(32.5, 33.0, [4], [8])]
    # A timestamp past the piece's end is capped; a segment without text is dropped; no timestamps at all: one
    assert timestamp_segments([b, b, b + 10, 5, b + 400], r, 0.02, end=4.0) == [Segment(0.2, 4.0, [5], [3])]
    assert timestamp_segments([5, 6], r, 0.02, offset=1.0, end=2.0) == [Segment(1.0, 2.0, [5, 6], [0, 1])]


@pytest.mark.parametrize("slices", [True, False])
def test_masks_equal_transformers_processor(slices):
    """The host's bans plus the sampler's rule mask exactly what transformers' WhisperTimeStamp and
    SuppressTokensAtBegin processors mask, for random outputs so far and random logits; both the sliced (CPU)
    and the masked (GPU) way."""
    import torch
    from transformers import GenerationConfig
    from transformers.generation.logits_process import (
        SuppressTokensAtBeginLogitsProcessor,
        WhisperTimeStampLogitsProcessor,
    )

    from streamer.worker.sampler import SpeechMasks, apply_speech_masks
    eos, no_ts, vocab, prompt = 40, 49, 50 + 60, [41, 42, 43]
    begin = no_ts + 1
    rules = DecodeRules(eos=eos, no_timestamps=no_ts, begin_suppress=(7, eos), timestamps=True, max_initial=5)
    gen = GenerationConfig(eos_token_id=eos, no_timestamps_token_id=no_ts, max_initial_timestamp_index=5)
    rng = torch.Generator().manual_seed(0)
    outputs = []
    for _ in range(24):  # random outputs that keep the rules: each token drawn from what the rules allow
        out = []
        for _ in range(int(torch.randint(0, 12, (1,), generator=rng))):
            allowed = torch.ones(vocab, dtype=torch.bool)
            for lo, hi in rules.bans(out, vocab):
                allowed[lo:hi] = False
            choices = allowed.nonzero().flatten()
            out.append(int(choices[torch.randint(len(choices), (1,), generator=rng)]))
        outputs.append(out)
    outputs.sort(key=len)
    for length in sorted({len(o) for o in outputs}):
        group = [o for o in outputs if len(o) == length]
        logits = torch.randn(len(group), vocab, generator=rng) * 3
        logits[:, begin:] -= torch.rand(len(group), 1, generator=rng) * 6  # (timestamps likelier in some rows)
        ids = torch.tensor([prompt + o for o in group])
        want = SuppressTokensAtBeginLogitsProcessor([7, eos], len(prompt))(ids, logits.clone())
        want = WhisperTimeStampLogitsProcessor(gen, begin_index=len(prompt))(ids, want)
        bans = [(i, lo, hi) for i, o in enumerate(group) for lo, hi in rules.bans(o, vocab)]
        t = lambda xs: torch.tensor(xs, dtype=torch.int64)  # noqa: E731
        m = SpeechMasks(t(list(range(len(group)))), t([b[0] for b in bans]), t([b[1] for b in bans]),
                        t([b[2] for b in bans]), begin)
        got = apply_speech_masks(logits.clone(), m, slices=slices)
        assert torch.equal(torch.isinf(got), torch.isinf(want)), length
        assert torch.equal(got[~torch.isinf(got)], want[~torch.isinf(want)])
