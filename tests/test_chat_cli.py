"""`streamer chat`: lines in, replies streamed out, the history rendered with the model's chat template."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def test_chat_keeps_history_and_resets(llama_dir):
    """Each reply is what LLM.chat gives for the conversation so far (greedy); /reset starts over, /exit ends."""
    from streamer import LLM, SamplingParams
    cmd = [sys.executable, "-m", "streamer", "chat", str(llama_dir), "--dtype", "float32", "--enforce-eager",
           "--max-tokens", "6", "--system", "be brief"]
    p = subprocess.run(cmd, input="hello there\nand then?\n/reset\nand then?\n/exit\nnever read\n",
                       capture_output=True, text=True, timeout=300, cwd=REPO,
                       env={**os.environ, "PYTHONPATH": str(REPO)})
    assert p.returncode == 0, p.stderr
    params = SamplingParams(max_tokens=6, temperature=0.0)
    system = {"role": "system", "content": "be brief"}
    with LLM(str(llama_dir), dtype="float32", enforce_eager=True) as llm:
        def reply(*turns: str) -> str:
            roles = ["user", "assistant"] * len(turns)
            return llm.chat([system, *({"role": r, "content": t} for r, t in zip(roles, turns))],
                            params)[0].outputs[0].text
        first = reply("hello there")
        second = reply("hello there", first, "and then?")
        fresh = reply("and then?")
    assert second != fresh  # (so the history shows)
    assert p.stdout == f"{first}\n{second}\n{fresh}\n"
