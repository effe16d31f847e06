"""Tokenizers: the fast tokenizer wrapper and converters from older formats (slow tokenizers, sentencepiece models, Mistral's tekken)."""
