"""`streamer bench`: a load tester for any OpenAI-compatible streaming server.

Layout: datasets (prompts of exact token lengths), client (one-loop HTTP/1.1 + SSE client that only
timestamps reads), runner (arrivals, concurrency, warm-ups), metrics (vLLM bench definitions),
report (table, JSON, plot, compare), fake_server (scripted server for tests and the self-benchmark).
"""
from __future__ import annotations

from typing import Optional, Sequence

__all__ = ["main"]


def main(argv: Optional[Sequence[str]] = None) -> int:
    """Entry point for `streamer bench ...` (argv excludes the word "bench")."""
    from streamer.bench.cli import main as _main  # lazy: keep `import streamer.bench.metrics` light

    return _main(argv)
