"""LLM.generate's progress line (vLLM's use_tqdm): prompts done out of all, counted when all n sequences end."""
from __future__ import annotations

import io
import re

import pytest

from streamer import LLM, SamplingParams
from streamer.progress import GenerateProgress


def test_progress_line_counts_prompts_and_tokens(llama_dir, monkeypatch: pytest.MonkeyPatch) -> None:
    out = io.StringIO()
    made: list[GenerateProgress] = []

    def spy(seqs: dict[str, int]) -> GenerateProgress:
        made.append(GenerateProgress(seqs, out=out))
        return made[-1]

    monkeypatch.setattr("streamer.llm.GenerateProgress", spy)
    with LLM(str(llama_dir), dtype="float32", max_num_seqs=3) as llm:
        outs = llm.generate(["a b", "c d e", "f", "g h"], SamplingParams(max_tokens=5, n=2, ignore_eos=True),
                            use_tqdm=True)
        assert len(made) == 1
        p = made[0]
        assert (p.done, p.total) == (4, 4) and not p.left
        assert p.output_tokens == sum(len(c.token_ids) for o in outs for c in o.outputs) == 40
        assert p.input_tokens == sum(len(o.prompt_token_ids) for o in outs)
        text = out.getvalue()
        assert text.endswith("\n") and text.count("4/4") == 1
        done = [int(m) for m in re.findall(r"(\d+)/4", text)]
        assert done == sorted(done) and done[-1] == 4
        llm.generate(["x"], SamplingParams(max_tokens=2))  # not a terminal: no line
        llm.generate(["x"], SamplingParams(max_tokens=2), use_tqdm=False)
        assert len(made) == 1
