"""Speculative decoding: n-gram and suffix drafts, a draft model, EAGLE / MTP heads."""
