"""Build small, deterministic Hugging Face tokenizer folders for tests (no downloads).

Two flavours, both trained with `tokenizers` on the built-in multilingual CORPUS:
- byte-level BPE (GPT-2 / Llama-3 style): every byte is a symbol, so emoji and CJK characters that the few
  merges do not cover are split across several tokens;
- sentencepiece-style BPE (Llama-2 / Mistral style): Metaspace "▁" words, byte_fallback to <0xNN> tokens for
  characters outside a deliberately small alphabet.
Vocabularies stay tiny (default 512) so that the toy models built on them stay tiny too.
"""
from __future__ import annotations

import json
from collections import Counter
from pathlib import Path
from typing import Any

from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, processors, trainers

CORPUS = """\
The quick brown fox jumps over the lazy dog. The dog did not care; it was asleep in the sun.
Once upon a time, in a small village by the sea, there lived an old fisherman and his wife.
Every morning he went out in his boat, and every evening he came back with the day's catch.
Large language models generate text one token at a time, and a server streams the text as it is produced.
A request may stop early when the model emits the end-of-sequence token, or when a stop string appears.
Hello, world! How are you today? I am fine, thank you. What time is it? It is half past seven.
Numbers: 0 1 2 3 4 5 6 7 8 9 10 42 100 256 1024 3.14159 2.71828 -17 +8 1e-5 99%.

def fibonacci(n: int) -> int:
    if n < 2:
        return n
    return fibonacci(n - 1) + fibonacci(n - 2)

class Stack:
    def __init__(self) -> None:
        self.items: list[int] = []

    def push(self, item: int) -> None:
        self.items.append(item)

    def pop(self) -> int:
        return self.items.pop()

for i in range(10):
    print(f"value={i} square={i * i}")
result = {"name": "streamer", "tokens": [1, 2, 3], "ok": True, "ratio": 0.5}
if __name__ == "__main__":
    import sys; sys.exit(main())

Le café est très chaud, mais la crème brûlée est délicieuse. Où est la bibliothèque ? À bientôt !
Über den Wolken muss die Freiheit wohl grenzenlos sein. Die Straße ist schön, größer und grüner.
El niño comió una manzana en la mañana. ¿Cómo estás? ¡Muy bien, señor! La canción es pequeña.
São Paulo é uma cidade enorme; a educação e a informação são importantes. Açúcar, pão, coração.
Tiếng Việt có nhiều dấu: người, được, những, thương, nước, Hà Nội, phở bò rất ngon.
Zażółć gęślą jaźń. Příliš žluťoučký kůň úpěl ďábelské ódy. Ærøskøbing, smørrebrød, Ålborg.
Привет, мир! Как дела? Москва — столица России. Ελληνικά: Καλημέρα κόσμε, ευχαριστώ πολύ.

你好，世界！今天天气很好，我们去公园散步吧。人工智能正在改变世界，语言模型可以写诗和代码。
中文分词很有意思：北京大学的学生在图书馆里学习。我爱吃饺子和面条。谢谢你的帮助！
日本語のテキストです。東京は大きな都市で、桜の季節はとても美しいです。ありがとうございます。
ひらがなとカタカナ、そして漢字を使います。今日は何曜日ですか？コーヒーを一杯ください。
한국어 문장입니다. 안녕하세요! 서울은 아름다운 도시입니다. 감사합니다. 좋은 하루 보내세요.
العربية: مرحبا بالعالم. שלום עולם. हिन्दी: नमस्ते दुनिया। ไทย: สวัสดีชาวโลก

Emoji time: 😀 😃 😄 😁 😆 🙂 🙃 😉 😊 🚀 🎉 🔥 ❤️ 👍 👋 🌍 🌸 🍕 🐍 ✨ ⭐ ☕ 🤖 🦀 🧠
Families and flags: 👨‍👩‍👧‍👦 👩🏽‍💻 🇫🇷 🇯🇵 🏳️‍🌈 — combined sequences use zero-width joiners.
Math and symbols: ∑ ∫ √ ∞ ≈ ≠ ≤ ≥ π λ Ω µ € £ ¥ © ® ™ → ← ↑ ↓ • … “quotes” ‘single’ « guillemets ».
The end. 結束。끝. Fin. Ende. Конец. 🏁
"""

CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{% for message in messages %}"
    "{{ '<|' + message['role'] + '|>\\n' + message['content'] }}"
    "{% if message['role'] == 'assistant' %}{{ eos_token }}{% endif %}"
    "{{ '\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|assistant|>\\n' }}{% endif %}"
)

# Characters kept as whole symbols by the sentencepiece-style tokenizer; rarer ones go through <0xNN> bytes.
_SP_ALPHABET = 120


def _corpus_lines() -> list[str]:
    return [line for line in CORPUS.splitlines() if line.strip()]


def _special(content: str) -> AddedToken:
    return AddedToken(content, special=True, normalized=False)


def _bos_template(bos: str, bos_id: int) -> processors.TemplateProcessing:
    return processors.TemplateProcessing(single=f"{bos}:0 $A:0", pair=f"{bos}:0 $A:0 {bos}:1 $B:1",
                                         special_tokens=[(bos, bos_id)])


def _write_config(out_dir: Path, tok: Tokenizer, config: dict[str, Any]) -> Path:
    out_dir.mkdir(parents=True, exist_ok=True)
    tok.save(str(out_dir / "tokenizer.json"))
    decoder = {
        str(i): {"content": t.content, "lstrip": t.lstrip, "normalized": t.normalized, "rstrip": t.rstrip,
                 "single_word": t.single_word, "special": t.special}
        for i, t in sorted(tok.get_added_tokens_decoder().items())
    }
    full = {"tokenizer_class": "PreTrainedTokenizerFast", "added_tokens_decoder": decoder,
            "chat_template": CHAT_TEMPLATE, "model_max_length": 4096, "clean_up_tokenization_spaces": False,
            **config}
    (out_dir / "tokenizer_config.json").write_text(json.dumps(full, indent=2, ensure_ascii=False) + "\n")
    return out_dir


def make_bytelevel_tokenizer(out_dir: Path, vocab_size: int = 512) -> Path:
    """GPT-2 / Llama-3 style byte-level BPE with <|begin_of_text|>, <|end_of_text|>, <|pad|>."""
    specials = ["<|begin_of_text|>", "<|end_of_text|>", "<|pad|>"]
    if not 256 + len(specials) < vocab_size <= 1024:
        raise ValueError(f"vocab_size must be in ({256 + len(specials)}, 1024], got {vocab_size}")
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, min_frequency=2, show_progress=False,
                                  special_tokens=[_special(s) for s in specials],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(_corpus_lines(), trainer=trainer)
    bos = specials[0]
    tok.post_processor = processors.Sequence([processors.ByteLevel(trim_offsets=False),
                                              _bos_template(bos, tok.token_to_id(bos))])
    return _write_config(Path(out_dir), tok, {
        "bos_token": bos, "eos_token": specials[1], "pad_token": specials[2], "add_bos_token": True,
        "add_eos_token": False,
    })


def _trained_sp_model(budget: int) -> tuple[dict[str, int], list[tuple[str, str]]]:
    """Train the word-piece part (alphabet + merges) of the sentencepiece-style model."""
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="always", split=True)
    # Pick the alphabet here: the trainer's own limit_alphabet breaks frequency ties in hash order (not reproducible).
    counts = Counter(CORPUS.replace(" ", "▁").replace("\n", ""))
    alphabet = sorted(counts, key=lambda c: (-counts[c], c))[:min(_SP_ALPHABET, budget // 2)]
    trainer = trainers.BpeTrainer(vocab_size=budget, min_frequency=2, show_progress=False,
                                  limit_alphabet=len(alphabet), initial_alphabet=alphabet)
    tok.train_from_iterator(_corpus_lines(), trainer=trainer)
    model = json.loads(tok.to_str())["model"]
    merges = [tuple(m.split(" ", 1)) if isinstance(m, str) else tuple(m) for m in model["merges"]]
    return model["vocab"], merges  # type: ignore[return-value]


def make_sentencepiece_tokenizer(out_dir: Path, vocab_size: int = 512) -> Path:
    """Llama-2 / Mistral style: <unk>, <s>, </s>, 256 <0xNN> byte tokens, then "▁"-words with byte fallback."""
    specials = ["<unk>", "<s>", "</s>"]
    reserved = len(specials) + 256
    if not reserved + 64 <= vocab_size <= 1024:
        raise ValueError(f"vocab_size must be in [{reserved + 64}, 1024], got {vocab_size}")
    trained, merges = _trained_sp_model(vocab_size - reserved)
    vocab = {s: i for i, s in enumerate(specials)}
    vocab.update({f"<0x{b:02X}>": len(specials) + b for b in range(256)})
    for piece, _ in sorted(trained.items(), key=lambda kv: kv[1]):
        vocab.setdefault(piece, len(vocab))
    tok = Tokenizer(models.BPE(vocab=vocab, merges=merges, unk_token="<unk>", byte_fallback=True, fuse_unk=True))
    tok.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="first", split=True)
    tok.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(),
                                     decoders.Strip(" ", 1, 0)])
    tok.add_special_tokens([_special(s) for s in specials])
    tok.post_processor = _bos_template("<s>", vocab["<s>"])  # as in HF's Llama-2 / Mistral tokenizer.json
    return _write_config(Path(out_dir), tok, {
        "bos_token": {"content": "<s>", "lstrip": False, "normalized": False, "rstrip": False,
                      "single_word": False, "__type": "AddedToken"},
        "eos_token": "</s>", "unk_token": "<unk>", "pad_token": None, "add_bos_token": True,
        "add_eos_token": False, "legacy": False,
    })
