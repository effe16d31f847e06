"""Does every model family compile whole? Builds each test-checkpoint family (tests/checkpoints.py, plus the
families that test modules register), starts `LLM(enforce_eager=False)`, generates 4 tokens and prints whether
the runner stayed compiled and how many graph breaks Dynamo counted. A family that falls back to eager (a compile
error) or breaks its graph (a host sync in its forward) shows here before a user sees it.

    python bench/compile_sweep.py [FAMILY ...]        # default: all; checkpoints cached under /tmp/compile_sweep
"""
from __future__ import annotations

import glob
import importlib
import os
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def main() -> None:
    for f in sorted(glob.glob(str(ROOT / "tests" / "test_*.py"))):  # (modules that register families)
        if "register_family" in Path(f).read_text():
            importlib.import_module(f"tests.{os.path.basename(f)[:-3]}")
    import torch._dynamo
    import torch._dynamo.utils as dyn

    from streamer import LLM, SamplingParams
    from tests.checkpoints import EXTRA_FAMILIES, FAMILIES, make_checkpoint

    root = Path("/tmp/compile_sweep")
    root.mkdir(exist_ok=True)
    for family in sys.argv[1:] or list(FAMILIES) + sorted(EXTRA_FAMILIES):
        try:
            path = root / family
            if not (path / "config.json").exists():
                make_checkpoint(path, family=family)
            breaks = sum(dyn.counters["graph_break"].values())
            with LLM(str(path), dtype="float32", enforce_eager=False) as llm:
                llm.generate([{"prompt_token_ids": [5, 6, 7]}], SamplingParams(max_tokens=4, temperature=0))
                compiled = llm.engine.runner.compiled
            print(f"{family:24s} compiled={compiled} graph_breaks={sum(dyn.counters['graph_break'].values()) - breaks}",
                  flush=True)
            torch._dynamo.reset()
        except Exception as e:  # (keep going: one family's failure must not hide the rest)
            print(f"{family:24s} ERROR {type(e).__name__}: {str(e)[:150]}", flush=True)


if __name__ == "__main__":
    main()
