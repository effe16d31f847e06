"""Tiny Whisper checkpoints for tests, as transformers writes them (random weights, no downloads): config.json and
model.safetensors from WhisperForConditionalGeneration, preprocessor_config.json from WhisperFeatureExtractor, and a
byte-level BPE tokenizer trained here with Whisper's special tokens after its vocabulary, plus the
generation_config.json fields Whisper checkpoints ship (lang_to_id, task_to_id, ...)."""
from __future__ import annotations

import json
from pathlib import Path

import numpy as np
from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, trainers

from tests.tokenizer_factory import _corpus_lines, _special

LANGUAGES = ("en", "de", "fr")
TIMESTAMPS = 1501
SPECIALS = ["<|endoftext|>", "<|startoftranscript|>", *(f"<|{lang}|>" for lang in LANGUAGES), "<|translate|>",
            "<|transcribe|>", "<|startoflm|>", "<|startofprev|>", "<|nospeech|>", "<|notimestamps|>"]


def _tokenizer(out: Path, vocab_size: int, timestamps: bool) -> dict[str, int]:
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, min_frequency=2, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(_corpus_lines(), trainer=trainer)
    tok.add_special_tokens([_special(s) for s in SPECIALS])
    if timestamps:  # <|0.00|> .. <|30.00|> right after <|notimestamps|>, as plain added tokens (the Hub's files)
        tok.add_tokens([AddedToken(f"<|{i * 0.02:.2f}|>", special=False, normalized=False)
                        for i in range(TIMESTAMPS)])
    out.mkdir(parents=True, exist_ok=True)
    tok.save(str(out / "tokenizer.json"))
    ids = {s: tok.token_to_id(s) for s in SPECIALS}
    (out / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "PreTrainedTokenizerFast", "bos_token": "<|endoftext|>", "eos_token": "<|endoftext|>",
        "pad_token": "<|endoftext|>", "model_max_length": 1024,
        "added_tokens_decoder": {str(i): {"content": s, "special": True, "lstrip": False, "rstrip": False,
                                          "normalized": False, "single_word": False} for s, i in ids.items()}}))
    return ids


# Weight multipliers by name fragment (else 4): sharper cross-attention makes the tokens depend on the audio
SCALES = {"encoder_attn.q_proj": 12.0, "encoder_attn.k_proj": 12.0}


def make_whisper(out: Path, seed: int = 0, d_model: int = 64, layers: int = 2, heads: int = 4,
                 multilingual: bool = True, source_positions: int = 1500, timestamps: bool = False) -> Path:
    """A tiny Whisper in `out`. With `timestamps`, its vocabulary ends in Whisper's 1,501 timestamp tokens (else it
    ends at <|notimestamps|>, as some converted checkpoints' tokenizers do)."""
    import torch
    from transformers import WhisperConfig, WhisperFeatureExtractor, WhisperForConditionalGeneration
    ids = _tokenizer(out, 320, timestamps)
    vocab = max(ids.values()) + 1 + (TIMESTAMPS if timestamps else 0)
    sot, eot = ids["<|startoftranscript|>"], ids["<|endoftext|>"]
    cfg = WhisperConfig(vocab_size=vocab, num_mel_bins=80, d_model=d_model, encoder_layers=layers,
                        decoder_layers=layers, encoder_attention_heads=heads, decoder_attention_heads=heads,
                        encoder_ffn_dim=2 * d_model, decoder_ffn_dim=2 * d_model, max_source_positions=source_positions,
                        max_target_positions=64, bos_token_id=eot, eos_token_id=eot, pad_token_id=eot,
                        decoder_start_token_id=sot, suppress_tokens=[], begin_suppress_tokens=[])
    torch.manual_seed(seed)
    model = WhisperForConditionalGeneration(cfg).eval()
    with torch.no_grad():  # larger than the 0.02 init, so that the outputs depend on the audio and the prompt
        for name, p in model.named_parameters():
            if p.dim() > 1:  # (the cross-attention's output most: it carries the audio into the decoder)
                p.mul_(next((v for k, v in SCALES.items() if k in name), 4.0))
        if timestamps:  # smaller timestamp embeddings (tied to the output): a random model then writes several
            model.model.decoder.embed_tokens.weight[-TIMESTAMPS:] *= 0.5  # text tokens between timestamps, not one
    model.save_pretrained(out, safe_serialization=True)
    WhisperFeatureExtractor(feature_size=80).save_pretrained(out)
    gen_path = out / "generation_config.json"
    gen = json.loads(gen_path.read_text()) if gen_path.is_file() else {}
    gen.pop("_from_model_config", None)  # (transformers would drop the Whisper fields below; real files lack it)
    gen.update(decoder_start_token_id=sot, eos_token_id=eot, is_multilingual=multilingual,
               no_timestamps_token_id=ids["<|notimestamps|>"], max_initial_timestamp_index=50,
               task_to_id={"transcribe": ids["<|transcribe|>"], "translate": ids["<|translate|>"]})
    if multilingual:
        gen["lang_to_id"] = {f"<|{lang}|>": ids[f"<|{lang}|>"] for lang in LANGUAGES}
    gen_path.write_text(json.dumps(gen, indent=2))
    return out


def tone(seconds: float, freq: float = 440.0, rate: int = 16000, seed: int = 0) -> np.ndarray:
    """A test signal: a tone with a little noise (float32 mono)."""
    t = np.arange(int(seconds * rate)) / rate
    rng = np.random.default_rng(seed)
    return (0.5 * np.sin(2 * np.pi * freq * t) + 0.05 * rng.standard_normal(len(t))).astype(np.float32)


def hf_greedy(folder: Path, audio: np.ndarray, prompt_ids: list[int], max_tokens: int,
              rules: bool = False) -> list[int]:
    """transformers' tokens for the prompt, greedily, one full forward a token (the oracle). With `rules`, through
    the logits processors transformers' Whisper generate applies (begin_suppress_tokens, and timestamps' unless
    the prompt says <|notimestamps|>), on the checkpoint's generation config."""
    import torch
    from transformers import GenerationConfig, WhisperFeatureExtractor, WhisperForConditionalGeneration
    from transformers.generation.logits_process import (
        SuppressTokensAtBeginLogitsProcessor,
        WhisperTimeStampLogitsProcessor,
    )
    model = WhisperForConditionalGeneration.from_pretrained(folder, torch_dtype=torch.float32).eval()
    fe = WhisperFeatureExtractor.from_pretrained(folder)
    feats = torch.from_numpy(fe(audio, sampling_rate=16000, return_tensors="np").input_features)
    eos = model.config.eos_token_id
    processors = []
    if rules:
        gen = GenerationConfig.from_pretrained(folder)
        if gen.begin_suppress_tokens:
            processors.append(SuppressTokensAtBeginLogitsProcessor(gen.begin_suppress_tokens, len(prompt_ids)))
        if gen.no_timestamps_token_id not in prompt_ids:
            processors.append(WhisperTimeStampLogitsProcessor(gen, begin_index=len(prompt_ids)))
    ids = list(prompt_ids)
    out: list[int] = []
    with torch.no_grad():
        enc = model.model.encoder(feats).last_hidden_state
        for _ in range(max_tokens):
            logits = model(encoder_outputs=(enc,), decoder_input_ids=torch.tensor([ids])).logits[:, -1]
            for p in processors:
                logits = p(torch.tensor([ids]), logits)
            t = int(logits[0].argmax())
            out.append(t)
            ids.append(t)
            if t == eos:
                break
    return out


def whisper_layout_tokenizer(out: Path, languages: int = 99) -> dict[str, int]:
    """A tokenizer with a real multilingual Whisper's ids (51,865 of them), for models at real sizes: 50,257 text
    tokens (the 256 byte-level characters, then made-up words that decode but no merge reaches), <|endoftext|> =
    50257, <|startoftranscript|>, `languages` language tokens (en first), the task tokens .. <|notimestamps|> =
    50363, then the 1,501 timestamps. Writes tokenizer.json and tokenizer_config.json; returns the specials' ids."""
    import string
    alphabet = pre_tokenizers.ByteLevel.alphabet()
    vocab = {c: i for i, c in enumerate(sorted(alphabet, key=lambda c: bytes_of(c)))}
    letters = string.ascii_lowercase
    n = 0
    while len(vocab) < 50257:
        word, k = "", n
        while True:
            word, k = letters[k % 26] + word, k // 26 - 1
            if k < 0:
                break
        n += 1
        if len(word) > 1:
            vocab["\u0120" + word] = len(vocab)
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    codes = ["en", "zh", "de", "es", "ru", "ko", "fr", "ja", "pt", "tr"]
    codes += [f"x{i:02d}" for i in range(languages - len(codes))]
    specials = ["<|endoftext|>", "<|startoftranscript|>", *(f"<|{c}|>" for c in codes[:languages]), "<|translate|>",
                "<|transcribe|>", "<|startoflm|>", "<|startofprev|>", "<|nospeech|>", "<|notimestamps|>"]
    tok.add_special_tokens([_special(s) for s in specials])
    tok.add_tokens([AddedToken(f"<|{i * 0.02:.2f}|>", special=False, normalized=False) for i in range(TIMESTAMPS)])
    out.mkdir(parents=True, exist_ok=True)
    tok.save(str(out / "tokenizer.json"))
    ids = {s: tok.token_to_id(s) for s in specials}
    (out / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "PreTrainedTokenizerFast", "bos_token": "<|endoftext|>", "eos_token": "<|endoftext|>",
        "pad_token": "<|endoftext|>", "model_max_length": 1024}))
    return ids


_PRINTABLE = list(range(33, 127)) + list(range(161, 173)) + list(range(174, 256))
# GPT-2's byte-level table: printable bytes stand for themselves, the others for chr(256 + i)
_BYTE_OF = {chr(b): b for b in _PRINTABLE} | {chr(256 + i): b for i, b in
                                              enumerate(b for b in range(256) if b not in _PRINTABLE)}


def bytes_of(c: str) -> int:
    """The byte a byte-level BPE character stands for."""
    return _BYTE_OF[c]
