"""GPT-2's byte-level alphabet, shared by the tokenizer wrapper and the converters that build byte-level
tokenizers (mistral_format.py): a leaf module, so neither has to import the other for it."""
from __future__ import annotations


def byte_level_chars() -> dict[str, int]:
    """GPT-2's byte-level alphabet, character -> byte: printable bytes stand for themselves, the other 68 for
    chr(256 + k) in byte order."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    chars = {chr(b): b for b in printable}
    extra = 0
    for b in range(256):
        if b not in printable:
            chars[chr(256 + extra)] = b
            extra += 1
    return chars
