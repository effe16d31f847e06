"""Small real tokenizers for tests and self-benchmarks, trained in-process (nothing is downloaded)."""
from __future__ import annotations

import random
from pathlib import Path

from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers, processors, trainers


def _corpus(seed: int = 0, lines: int = 400) -> list[str]:
    rng = random.Random(seed)
    letters = "abcdefghijklmnopqrstuvwxyz" * 3 + "éüß中文字😀" + "0123456789.,!?'"
    words = ["".join(rng.choice(letters) for _ in range(rng.randint(1, 9))) for _ in range(800)]
    return [" ".join(rng.choice(words) for _ in range(rng.randint(3, 25))) for _ in range(lines)]


def make_tokenizer(folder: str | Path, kind: str = "bytelevel", vocab_size: int = 600) -> Path:
    """Writes FOLDER/tokenizer.json: "bytelevel" (GPT-2 style BPE) or "metaspace" (Llama/SentencePiece style
    BPE with a BOS post-processor). Returns the folder."""
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    specials = ["<s>", "</s>", "<unk>"]
    if kind == "bytelevel":
        tok = Tokenizer(models.BPE())
        tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
        tok.decoder = decoders.ByteLevel()
        alphabet = pre_tokenizers.ByteLevel.alphabet()
    elif kind == "metaspace":
        tok = Tokenizer(models.BPE(unk_token="<unk>", byte_fallback=True))
        tok.normalizer = normalizers.NFKC()
        tok.pre_tokenizer = pre_tokenizers.Metaspace()
        tok.decoder = decoders.Sequence([decoders.ByteFallback(), decoders.Metaspace()])
        alphabet = [f"<0x{b:02X}>" for b in range(256)]
    else:
        raise ValueError(f"unknown tokenizer kind {kind!r}")
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=specials, initial_alphabet=alphabet,
                                  show_progress=False)
    tok.train_from_iterator(_corpus(), trainer)
    if kind == "metaspace":
        bos = tok.token_to_id("<s>")
        tok.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", bos)])
    tok.save(str(folder / "tokenizer.json"))
    return folder
