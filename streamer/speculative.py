"""Speculative decoding with n-gram drafts (prompt lookup): no draft model, just the request's own tokens (and, when
the request predicts its output, that prediction's: `propose_predicted`).

When the last few tokens of a sequence occurred before (in its prompt or its output), the tokens that followed
them then are a good guess for what follows now: code edits, extraction, summaries and repetitive text echo
their context. The engine proposes up to `num_speculative_tokens` such drafts for a request in decode; the next
step computes the request's last token and its drafts together (one forward pass over 1 + k tokens costs about
what one token costs when decoding is memory-bound) and samples at every one of those positions. Draft i is
accepted while the token sampled at its position equals it; the first token that differs (or the one after the
last draft) is kept as well, so a step yields 1 to k + 1 tokens.

With a draft that is one token for sure (q = one-hot), sampling from p and comparing is exactly the rejection
rule of speculative sampling (accept with probability p(draft); else draw from p without the draft, which is
what a draw from p that differs is), so outputs keep the model's distribution; greedy outputs are identical.
"""
from __future__ import annotations

import numpy as np


def propose_ngram(tokens: np.ndarray, k: int, min_n: int, max_n: int) -> list[int]:
    """k tokens that followed the latest earlier occurrence of the sequence's last n tokens (the longest n in
    [min_n, max_n] that occurred before), or [] if none did. `tokens`: the sequence so far, 1-D.

    A copy that runs into the present continues from its own start, as LZ77 copies do: in a loop of period p
    the latest match is p tokens back, and the draft goes on around the loop instead of stopping after p."""
    length = len(tokens)
    for n in range(min(max_n, length - 1), min_n - 1, -1):
        pattern = tokens[length - n:]
        # Windows that start early enough to be followed by at least one token.
        windows = np.lib.stride_tricks.sliding_window_view(tokens[:length - 1], n)
        hits = np.flatnonzero((windows == pattern).all(axis=1))
        if len(hits):
            start = int(hits[-1]) + n
            ahead = tokens[start:start + k].tolist()
            period = length - start
            return [ahead[i % period] for i in range(k)]
    return []


def propose_predicted(predicted: np.ndarray, output: np.ndarray, k: int, min_n: int, max_n: int,
                      cursor: int) -> tuple[list[int], int]:
    """Drafts from a predicted output (OpenAI's Predicted Outputs): before any output, its first k tokens; then the
    k tokens that follow where the output's last n tokens occur in it (the longest n in [min_n, max_n]), the first
    such place at or after `cursor` (where the previous alignment ended: an edited file is read in order) or else
    the last one. Returns (drafts, the new cursor: where the drafts start); ([], cursor) when nothing lines up."""
    if len(output) == 0:
        return predicted[:k].tolist(), 0
    for n in range(min(max_n, len(output)), min_n - 1, -1):
        if len(predicted) <= n:
            continue
        windows = np.lib.stride_tricks.sliding_window_view(predicted[:len(predicted) - 1], n)
        hits = np.flatnonzero((windows == output[len(output) - n:]).all(axis=1))
        if len(hits):
            ahead = hits[hits + n >= cursor]
            start = int(ahead[0] if len(ahead) else hits[-1]) + n
            return predicted[start:start + k].tolist(), start
    return [], cursor
