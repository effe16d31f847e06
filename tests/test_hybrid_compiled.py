"""Hybrid and recurrent models compiled (enforce_eager=False): a lone request's decode step runs as one graph, the
recurrent layers' conv and state update inline beside the attention, and gives transformers' greedy tokens (fp32);
prefix caching's state checkpoints taken while decoding are copied before the graph; batches run eagerly on the
same states; nothing recompiles after warm-up and every state slot goes back to its pool."""
from __future__ import annotations

import pytest

import tests.test_mamba1  # noqa: F401  (registers the mamba1 family)
import tests.test_recurrent_families  # noqa: F401  (registers the lfm2 family)
from streamer import LLM
from tests.checkpoints import hf_greedy
from tests.parity import assert_state_freed, greedy, prompts_of_lengths

MAX_NEW = 12  # (past a block of 8: a 1-token prompt's decode crosses a block boundary, where its state is saved)


# Gated DeltaNet + gated attention + MoE; Mamba2 + attention + MoE; Mamba v1 alone; LFM2's short conv + attention
@pytest.mark.parametrize("family", ["qwen3_next", "granitemoehybrid", "mamba1", "lfm2"])
def test_compiled_decode_matches_transformers(make_ckpt, family):
    _check_compiled(make_ckpt(f"compiled_{family}", family=family))


def test_compiled_nemotron_h_has_no_graph_break(ckpt_root):
    """Nemotron-H: Mamba2 + NoPE attention + relu2 MLP + MoE layers (ungated relu2 experts through the opaque
    expert op: a per-expert loop over the step's experts would break the graph at its host sync)."""
    import torch._dynamo.utils as dyn

    from tests.test_nemotron_h import make_nemotron_h
    path = ckpt_root / "nemotron_h"
    breaks = sum(dyn.counters["graph_break"].values())
    _check_compiled(path if (path / "config.json").exists() else make_nemotron_h(path))
    assert sum(dyn.counters["graph_break"].values()) == breaks, dict(dyn.counters["graph_break"])


def _check_compiled(path) -> None:
    import torch._dynamo.utils as dyn
    prompts = prompts_of_lengths((1, 5, 17, 33), seed=3)
    ref = hf_greedy(path, prompts, MAX_NEW)
    llm = LLM(str(path), dtype="float32", enforce_eager=False, block_size=8)
    runner = llm.engine.runner
    assert runner.compiled and llm.engine.prefix_caching
    graphs = dyn.counters["stats"]["unique_graphs"]
    inline, copies = [], []
    real_inputs, real_prepare = runner._decode_inputs, runner.model.prepare_states

    def decode_inputs(step):
        d = real_inputs(step)
        inline.append(d is not None and d.state_slots is not None)
        return d
    runner._decode_inputs = decode_inputs
    runner.model.prepare_states = lambda pairs, fresh: copies.append(len(pairs)) or real_prepare(pairs, fresh)

    alone = [greedy(llm, [p], MAX_NEW)[0] for p in prompts]  # each request alone: its decode steps in the graph
    assert alone == ref
    assert sum(inline) >= len(prompts) * (MAX_NEW - 1), "the lone decode steps did not run in the graph"
    assert any(copies), "no state checkpoint was copied before a compiled step: the test would not check them"
    assert greedy(llm, prompts, MAX_NEW) == ref  # together: batches run eagerly over the same states
    assert greedy(llm, prompts[2:3], MAX_NEW) == ref[2:3]  # again alone, from its prefix's saved state
    assert dyn.counters["stats"]["unique_graphs"] == graphs, "recompiled after warm-up"
    assert len({tuple(r) for r in ref}) == len(ref), "degenerate reference: the test would not discriminate"
    assert_state_freed(llm)

