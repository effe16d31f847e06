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
    cmd = [sys.executable, "-m", "streamer", "chat", "--model", str(llama_dir), "--dtype", "float32", "--enforce-eager",
           "--max-tokens", "6", "--temperature", "0", "--system", "be brief"]
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


def test_unset_sampling_flags_take_the_models_recommendation():
    """As a chat client gets it: generation_config.json's values where no flag is given, the flags' where given."""
    from streamer.cli import _chat_params, build_parser
    args = build_parser().parse_args(["chat", "--top-p", "0.5"])
    p = _chat_params(args, {"temperature": 0.6, "top_k": 20, "top_p": 0.95})
    assert (p.temperature, p.top_k, p.top_p, p.max_tokens, p.min_p) == (0.6, 20, 0.5, 512, 0.0)
    p = _chat_params(args, {})
    assert (p.temperature, p.top_k, p.top_p) == (1.0, -1, 0.5)


def test_chat_survives_a_turn_past_max_model_len(llama_dir):
    """A message that makes the conversation too long for max_model_len is an error for that turn only (on stderr):
    the session goes on (exit 0) and the refused message is not in the history the next turns render."""
    from streamer import LLM, SamplingParams
    cmd = [sys.executable, "-m", "streamer", "chat", "--model", str(llama_dir), "--dtype", "float32", "--enforce-eager",
           "--max-tokens", "6", "--temperature", "0", "--max-model-len", "128"]
    too_long = " ".join(["word"] * 100)
    p = subprocess.run(cmd, input=f"hello there\n{too_long}\nand then?\n/reset\n{too_long}\nhi\n",
                       capture_output=True, text=True, timeout=300, cwd=REPO,
                       env={**os.environ, "PYTHONPATH": str(REPO)})
    assert p.returncode == 0, p.stderr
    assert p.stderr.count("streamer chat: error: prompt is") == 2, p.stderr
    assert "Traceback" not in p.stderr
    params = SamplingParams(max_tokens=6, temperature=0.0)
    with LLM(str(llama_dir), dtype="float32", enforce_eager=True, max_model_len=128) as llm:
        def reply(*turns: str) -> str:
            roles = ["user", "assistant"] * len(turns)
            return llm.chat([{"role": r, "content": t} for r, t in zip(roles, turns)], params)[0].outputs[0].text
        first = reply("hello there")
        second = reply("hello there", first, "and then?")  # (without the refused message)
        last = reply("hi")
    assert p.stdout == f"{first}\n{second}\n{last}\n"
