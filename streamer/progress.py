"""`LLM.generate`'s progress line on stderr (vLLM's `use_tqdm`): prompts done, and input / output tokens a second."""
from __future__ import annotations

import sys
import time
from typing import IO, Iterable, Optional

from streamer.engine.output_processor import SeqUpdate

BAR_WIDTH = 24
MIN_INTERVAL = 0.1  # seconds between redraws


class GenerateProgress:
    """Counts finished prompts from the engine's updates (a prompt is done when all its n sequences are)."""

    def __init__(self, seqs_per_prompt: dict[str, int], out: Optional[IO[str]] = None) -> None:
        self.left = dict(seqs_per_prompt)  # prompt id -> sequences still running
        self.total = len(self.left)
        self.done = 0
        self.input_tokens = self.output_tokens = 0
        self.out = out or sys.stderr
        self.start = self._last = time.monotonic()
        self._drawn_done = -1  # how many were done at the last redraw

    def update(self, updates: Iterable[SeqUpdate]) -> None:
        for u in updates:
            self.output_tokens += len(u.new_token_ids)
            if not u.finished:
                continue
            req = u.state.req
            rid = req.parent_id or req.request_id
            left = self.left.get(rid)
            if left is None:
                continue
            if left == 1:
                del self.left[rid]
                self.done += 1
                self.input_tokens += req.num_prompt_tokens
            else:
                self.left[rid] = left - 1
        now = time.monotonic()
        if now - self._last >= MIN_INTERVAL or self.done == self.total:
            self._last = now
            self.draw(now)

    def line(self, now: float) -> str:
        elapsed = max(now - self.start, 1e-9)
        frac = self.done / self.total if self.total else 1.0
        filled = int(frac * BAR_WIDTH)
        return (f"Processed prompts: {frac * 100:3.0f}%|{'#' * filled}{' ' * (BAR_WIDTH - filled)}| "
                f"{self.done}/{self.total} [{elapsed:.1f}s, {self.done / elapsed:.1f} prompts/s, "
                f"input: {self.input_tokens / elapsed:.0f} tok/s, output: {self.output_tokens / elapsed:.0f} tok/s]")

    def draw(self, now: float) -> None:
        self._drawn_done = self.done
        self.out.write("\r" + self.line(now))
        self.out.flush()

    def close(self) -> None:
        if self._drawn_done != self.done or self.done < self.total:  # (not when the last redraw showed the end)
            self.draw(time.monotonic())
        self.out.write("\n")
        self.out.flush()
