"""Speculative decoding with drafts from token history, no draft model: n-gram drafts from the request's own tokens
(prompt lookup), from the output the request predicts (`propose_predicted`), and with `speculative_method="suffix"`
from earlier requests' outputs as well (`SuffixIndex`: SuffixDecoding's drafts).

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

import bisect
from collections import deque

import numpy as np


def propose_ngram(tokens: np.ndarray, k: int, min_n: int, max_n: int) -> list[int]:
    """k tokens that followed the latest earlier occurrence of the sequence's last n tokens (the longest n in
    [min_n, max_n] that occurred before), or [] if none did. `tokens`: the sequence so far, 1-D.

    A copy that runs into the present continues from its own start, as LZ77 copies do: in a loop of period p
    the latest match is p tokens back, and the draft goes on around the loop instead of stopping after p."""
    return ngram_match(tokens, k, min_n, max_n)[0]


def ngram_match(tokens: np.ndarray, k: int, min_n: int, max_n: int) -> tuple[list[int], int]:
    """`propose_ngram`'s drafts and the length n of the match they follow (0: none)."""
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
            return [ahead[i % period] for i in range(k)], n
    return [], 0


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


class SuffixIndex:
    """SuffixDecoding's drafts (Oliaro et al., 2024; vLLM's `method="suffix"`): agents, tool calls and repeated
    queries make outputs that earlier requests already made. The index holds the outputs of the last
    `max_sequences` finished requests (each after its prompt's last `max_depth` tokens: the same chat template's end
    then drafts an output's first tokens). A request's draft follows the longest suffix of its tokens (up to
    `max_depth`) that occurs there: every occurrence of that suffix votes for the next token, the most frequent one
    is drafted and the voters that disagree drop out, while the drafted tokens' estimated probability (the product of
    their vote shares) stays >= `min_prob`, up to `factor` times the match length tokens (longer matches earn longer
    drafts).

    SuffixDecoding keeps a suffix tree; this keeps the token stream (one array, -1 between sequences) and a hash
    index of its bigrams, which in Python costs far less memory than a node per suffix and token: the occurrences of
    the request's last two tokens (the latest `MAX_CANDIDATES`) are extended backwards together, vectorised, to find
    the longest matches. Eviction drops the oldest sequence; the array and index are rebuilt once half is dead."""

    MAX_CANDIDATES = 512

    def __init__(self, max_sequences: int, max_depth: int, capacity: int = 1 << 12) -> None:
        self.max_sequences, self.max_depth = max_sequences, max_depth
        self.tokens = np.full(capacity, -1, dtype=np.int64)  # the stream; -1 past its end and between sequences
        self.size = 0  # stream length used
        self.base = 0  # absolute position of tokens[0] (positions in `index` and `spans` are absolute)
        self.index: dict[int, list[int]] = {}  # bigram key -> absolute positions of the token after each occurrence
        self.spans: deque[tuple[int, int]] = deque()  # absolute [start, end) of each cached sequence, oldest first
        self.live = 0  # absolute position where the oldest cached sequence starts (everything before is evicted)

    def __len__(self) -> int:
        return len(self.spans)

    def add(self, seq: np.ndarray) -> None:
        """Cache a finished request's tokens (its prompt's end and its output); evicts the oldest beyond the cap."""
        if self.max_sequences == 0 or len(seq) < 3:
            return
        n = len(seq)
        if self.size + n + 1 > len(self.tokens):
            self._compact(extra=n + 1)
        start = self.base + self.size
        self.tokens[self.size:self.size + n] = seq
        self.size += n + 1  # (the -1 after it ends every continuation there)
        self._index(seq, start)
        self.spans.append((start, start + n))
        while len(self.spans) > self.max_sequences:
            self.live = self.spans.popleft()[1] + 1

    def _index(self, seq: np.ndarray, start: int) -> None:
        keys = (seq[:-2] << 32 | seq[1:-1]).tolist()  # bigram i, i + 1 -> the token at i + 2 follows it
        index = self.index
        for i, key in enumerate(keys, start + 2):
            found = index.get(key)
            if found is None:
                index[key] = [i]
            else:
                found.append(i)

    def _compact(self, extra: int) -> None:
        """Drop the evicted part of the stream, grow it if the live part needs room, rebuild the index."""
        live = self.spans[0][0] if self.spans else self.base + self.size
        kept = self.tokens[live - self.base:self.size].copy()
        capacity = len(self.tokens)
        while len(kept) + extra > capacity // 2:
            capacity *= 2
        self.tokens = np.full(capacity, -1, dtype=np.int64)
        self.tokens[:len(kept)] = kept
        self.base, self.size, self.index = live, len(kept), {}
        for a, b in self.spans:
            self._index(self.tokens[a - live:b - live], a)

    def propose(self, context: np.ndarray, k: int, factor: float, min_prob: float) -> tuple[list[int], int]:
        """Up to k draft tokens after `context` (a request's tokens so far, 1-D) and the length of the match they
        follow (0: none)."""
        if len(context) < 2 or not self.spans:
            return [], 0
        found = self.index.get(int(context[-2]) << 32 | int(context[-1]))
        if not found:
            return [], 0
        cut = bisect.bisect_left(found, self.live)  # (occurrences in evicted sequences: dropped lazily)
        if cut:
            del found[:cut]
        if not found:
            return [], 0
        after = np.asarray(found[-self.MAX_CANDIDATES:], dtype=np.int64) - self.base
        match = self._match_lengths(context, after)
        best = int(match.max())
        pos = after[match == best]
        budget = min(k, max(1, int(factor * best)))
        draft: list[int] = []
        prob = 1.0
        while len(draft) < budget:
            nxt = self.tokens[pos]
            votes = nxt[nxt >= 0]
            if len(votes) == 0:
                break
            values, counts = np.unique(votes, return_counts=True)
            top = int(counts.argmax())
            prob *= counts[top] / len(nxt)  # (voters whose sequence ended here count against it)
            if prob < min_prob:
                break
            draft.append(int(values[top]))
            pos = pos[nxt == values[top]] + 1
        return draft, best

    def _match_lengths(self, context: np.ndarray, after: np.ndarray) -> np.ndarray:
        """For each occurrence (the stream index of the token after it), how many of the context's last tokens (up
        to max_depth) it matches: 2 (the bigram) and more, extended backwards (a -1 or the stream's start stops it)."""
        match = np.full(len(after), 2, dtype=np.int64)
        alive = np.ones(len(after), dtype=bool)
        for j in range(3, min(self.max_depth, len(context)) + 1):
            at = after - j
            alive &= at >= 0
            alive[alive] = self.tokens[at[alive]] == context[-j]
            if not alive.any():
                break
            match += alive
        return match
