"""Tensor parallelism (two CPU processes, gloo) for the hybrid and pure recurrent families: each rank holds half of
every recurrent layer's heads (conv channels, state) and so half of each state slot, and the greedy tokens equal the
single-process engine's and transformers' (fp32), with prompts of different lengths prefilled in small chunks beside
other requests' decodes. B/C groups fewer than the ranks are shared by them (their grouped norm summed over ranks).
Configs whose recurrent heads do not split are refused, naming the field, before any worker starts."""
from __future__ import annotations

from pathlib import Path
from typing import Callable

import pytest

pytest.importorskip("transformers")  # the checkpoints and the oracle

import tests.test_mamba1  # noqa: E402,F401  (registers the mamba1 / falcon_mamba checkpoint families)
import tests.test_recurrent_families  # noqa: E402,F401  (registers mamba2 / falcon_h1 / lfm2 / lfm2_moe)
from streamer import LLM  # noqa: E402
from tests.checkpoints import hf_greedy  # noqa: E402
from tests.parity import assert_state_freed, checkpoint_variant, greedy, prompts_of_lengths  # noqa: E402
from tests.test_nemotron_h import make_nemotron_h  # noqa: E402

MAX_NEW = 6
# A lone token (decode from a fresh state), shorter than the conv window, several chunks of 8 (chunked prefill)
LENGTHS = (1, 3, 9, 17, 30)
ENGINE = dict(dtype="float32", max_num_batched_tokens=8)

# name -> how to build its checkpoint (make_ckpt, ckpt_root); names as the families' own test modules give them, so
# one session builds each once
CHECKPOINTS: dict[str, Callable[..., Path]] = {
    "granite_moe": lambda make, root: make("granitemoehybrid", family="granitemoehybrid"),
    # one B/C group for two ranks: replicated, the gated norm's group split over them
    "granite_dense_1group": lambda make, root: make(
        "granitemoehybrid_dense", family="granitemoehybrid", num_local_experts=0, position_embedding_type="rope",
        mamba_n_groups=1, layer_types=["attention", "mamba", "mamba", "attention"]),
    "bamba": lambda make, root: make("bamba", family="bamba"),
    "nemotron_h": lambda make, root: (root / "nemotron_h" if (root / "nemotron_h" / "config.json").exists()
                                      else make_nemotron_h(root / "nemotron_h")),
    "qwen3_next": lambda make, root: make("qwen3_next", family="qwen3_next"),
    # Qwen3.5's in_proj_qkv split by its parts (q, k, v), z / b / a by rows
    "qwen3_5_moe": lambda make, root: make("qwen3_5_moe", family="qwen3_5_moe"),
    "mamba2": lambda make, root: make("recurrent_mamba2", family="mamba2"),
    "falcon_h1": lambda make, root: make("recurrent_falcon_h1", family="falcon_h1"),
    # the norm before the gate, one group for two ranks
    "falcon_h1_norm_1group": lambda make, root: make("recurrent_falcon_h1_norm_1group", family="falcon_h1",
                                                     mamba_rms_norm=True, mamba_norm_before_gate=True,
                                                     mamba_n_groups=1),
    "lfm2": lambda make, root: make("recurrent_lfm2", family="lfm2"),
    "lfm2_moe": lambda make, root: make("recurrent_lfm2_moe", family="lfm2_moe"),
    "mamba1": lambda make, root: make("mamba1_mamba1", family="mamba1"),
    "falcon_mamba": lambda make, root: make("mamba1_falcon_mamba", family="falcon_mamba"),
}
# where the B/C groups are replicated, a rank's state is more than half of the whole
SHARED_GROUPS = ("granite_dense_1group", "falcon_h1_norm_1group")


@pytest.fixture(scope="module")
def prompts() -> list[list[int]]:
    return prompts_of_lengths(LENGTHS, seed=7)


@pytest.fixture(scope="module")
def ckpt(make_ckpt, ckpt_root):
    return lambda name: CHECKPOINTS[name](make_ckpt, ckpt_root)


def _run(path: Path, prompts: list[list[int]], tp: int) -> tuple[list[list[int]], int]:
    """Greedy tokens, and the bytes of one state slot on rank 0."""
    with LLM(str(path), tensor_parallel_size=tp, **ENGINE) as llm:
        out = greedy(llm, prompts, MAX_NEW)
        assert_state_freed(llm)
        per_slot = llm.engine.runner.model.state_bytes_per_slot(llm.engine.runner.dtype)
        if tp > 1:
            assert llm.engine.runner.tp_workers is not None and len(llm.engine.runner.tp_workers.procs) == tp - 1
    return out, per_slot


@pytest.mark.parametrize("name", list(CHECKPOINTS))
def test_tp2_matches_one_process_and_transformers(ckpt, prompts, name):
    path = ckpt(name)
    want = hf_greedy(path, prompts, MAX_NEW)
    assert len({tuple(r) for r in want}) > 2, "degenerate reference: the test would not discriminate"
    one, whole = _run(path, prompts, 1)
    two, half = _run(path, prompts, 2)
    assert one == want
    assert two == want
    if name in SHARED_GROUPS:
        assert whole / 2 < half < whole, "each rank holds its heads' state (and the B/C group they share)"
    else:
        assert 2 * half == whole, "each rank holds half of each state slot"


def test_nemotron_h_experts_split_over_ranks(ckpt):
    """Nemotron-H's routed experts split along their intermediate size, as its shared expert does: each rank holds
    a slice of every expert, and sums its slices' outputs before one all-reduce a layer (their tokens match
    transformers in test_tp2_matches_one_process_and_transformers)."""
    with LLM(str(ckpt("nemotron_h")), tensor_parallel_size=2, **ENGINE) as llm:
        moe = next(layer.mlp for layer in llm.engine.runner.model.layers if layer.kind == "moe")
        assert moe.expert_shapes == ((4, 16, 64), (4, 64, 16)), "half of each expert a rank (moe_intermediate 32)"


# (checkpoint, config changes, the field the error names)
REFUSALS = [
    ("mamba2", {"num_heads": 7}, "num_heads"),
    ("mamba2", {"num_heads": 6, "n_groups": 3}, "n_groups"),  # 3 groups neither split over 2 ranks nor shared
    ("nemotron_h", {"mamba_num_heads": 9}, "mamba_num_heads"),
    ("nemotron_h", {"moe_intermediate_size": 33}, "moe_intermediate_size"),  # (its experts split too)
    ("granite_moe", {"mamba_n_heads": 5}, "mamba_n_heads"),
    ("granite_moe", {"num_attention_heads": 3}, "num_attention_heads"),
    ("qwen3_next", {"linear_num_key_heads": 1}, "linear_num_key_heads"),
    ("lfm2", {"hidden_size": 63}, "hidden_size"),
    ("mamba1", {"intermediate_size": 127}, "intermediate_size"),
]


@pytest.mark.parametrize("name,change,field", REFUSALS, ids=[f"{n}-{f}" for n, _, f in REFUSALS])
def test_unsplittable_configs_refused_before_workers_start(ckpt, monkeypatch, name, change, field):
    base = ckpt(name)
    path = checkpoint_variant(base, base.parent / f"{base.name}_tp_{field}", config=change)

    def no_workers(*args, **kwargs):
        raise AssertionError("a tensor-parallel worker was started before the config was checked")

    monkeypatch.setattr("streamer.worker.model_runner.TensorParallelWorkers", no_workers)
    with pytest.raises(ValueError, match=rf"\b{field}\b"):
        LLM(str(path), tensor_parallel_size=2, **ENGINE)
