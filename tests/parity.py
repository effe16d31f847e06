"""What the engine-vs-transformers parity tests share: random prompts, the engine's greedy tokens (banning EOS as
hf_greedy's min_new_tokens does), cached transformers references, and prompt logprobs compared position by
position."""
from __future__ import annotations

import json
import random
import shutil
from pathlib import Path
from typing import Callable, Optional

import numpy as np
import pytest
import torch

from streamer import LLM, SamplingParams
from tests.checkpoints import hf_greedy


def random_prompts(n: int, seed: int, min_len: int = 2, max_len: int = 60, vocab: int = 500) -> list[list[int]]:
    """n prompts of min_len .. max_len - 1 token ids in [3, vocab) (clear of the test tokenizers' specials)."""
    rng = random.Random(seed)
    return [[rng.randrange(3, vocab) for _ in range(rng.randrange(min_len, max_len))] for _ in range(n)]


def prompts_of_lengths(lengths: tuple[int, ...], seed: int, vocab: int = 500) -> list[list[int]]:
    """One prompt of each length, token ids in [3, vocab) (the recurrent families' tests choose lengths around
    their conv window and scan chunks)."""
    rng = random.Random(seed)
    return [[rng.randrange(3, vocab) for _ in range(n)] for n in lengths]


def greedy(llm: LLM, prompts: list[list[int]], max_new: int) -> list[list[int]]:
    """The engine's greedy tokens. min_tokens = max_tokens bans EOS at every position, as hf_greedy's
    min_new_tokens does (ignore_eos alone would let EOS be the argmax, where transformers picks the next best)."""
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], greedy_params(max_new))
    return [o.outputs[0].token_ids for o in outs]


def reference_cache(ckpt: Callable[[str], Path], prompts: list[list[int]], max_new: int,
                    min_distinct: Optional[int] = None) -> Callable[[str], list[list[int]]]:
    """name -> transformers' greedy tokens for `prompts` on ckpt(name), computed once per name. `min_distinct`:
    refuse a degenerate reference (one that would not tell models apart): every prompt's continuation different,
    and more than min_distinct distinct tokens per prompt on average."""
    cache: dict[str, list[list[int]]] = {}

    def ref(name: str) -> list[list[int]]:
        if name not in cache:
            cache[name] = hf_greedy(ckpt(name), prompts, max_new)
            if min_distinct is not None:
                assert len({tuple(r) for r in cache[name]}) == len(prompts), "degenerate reference"
                assert sum(len(set(r)) for r in cache[name]) > min_distinct * len(prompts), "degenerate reference"
        return cache[name]
    return ref


def family_checkpoints(make_ckpt: Callable[..., Path], prefix: str) -> Callable[..., Path]:
    """(family, name suffix, **config overrides) -> the checkpoint folder `{prefix}{family}{name}`, built once."""
    def get(family: str, name: str = "", **overrides: object) -> Path:
        return make_ckpt(f"{prefix}{family}{name}", family=family, **overrides)
    return get


def family_references(ckpt: Callable[..., Path], prompts: list[list[int]],
                      max_new: int) -> Callable[..., list[list[int]]]:
    """`ckpt`'s arguments -> transformers' greedy tokens for `prompts`, computed once per family + name (the
    overrides go with the name). A degenerate reference (continuations alike, or repeating a token) is refused."""
    cache: dict[str, list[list[int]]] = {}

    def get(family: str, name: str = "", **overrides: object) -> list[list[int]]:
        key = family + name
        if key not in cache:
            refs = cache[key] = hf_greedy(ckpt(family, name, **overrides), prompts, max_new)
            assert len({tuple(r) for r in refs}) > len(prompts) - 2, "degenerate reference"
            assert sum(len(set(r)) for r in refs) > 2 * len(prompts), "degenerate reference"
        return cache[key]
    return get


def assert_logprobs_match(llm: LLM, path: Path, prompts: list[list[int]], top: int = 10, tol: float = 1e-4) -> None:
    """At every prompt position, the logprobs of the engine's `top` most likely tokens (and of the prompt's own
    token) within `tol` of transformers' on the same checkpoint (fp32)."""
    import transformers
    model = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts],
                        SamplingParams(max_tokens=1, temperature=0.0, prompt_logprobs=top))
    for p, out in zip(prompts, outs):
        with torch.no_grad():
            want = model(torch.tensor([p])).logits[0].log_softmax(-1)
        for i, entry in enumerate(out.prompt_logprobs[1:]):
            err = max(abs(lp.logprob - want[i, t].item()) for t, lp in entry.items())
            assert err < tol, f"position {i + 1} of a {len(p)}-token prompt: {err}"


# Whole prompts in one step, and prompts prefilled in chunks of at most 16 tokens over blocks of 8, beside other
# requests' decodes: `@PREFILL_MODES` runs a test (taking `engine_args`) both ways.
PREFILL_MODES = pytest.mark.parametrize("engine_args", [{}, dict(max_num_batched_tokens=16, block_size=8)],
                                        ids=["whole-prefill", "chunked-prefill"])


def assert_matches_transformers(llm: LLM, path: Path, prompts: list[list[int]], ref: list[list[int]],
                                max_new: int) -> None:
    """The engine's greedy tokens for a batch and for a lone request equal transformers' (`ref`), and so do the
    first two prompts' logprobs."""
    assert greedy(llm, prompts, max_new) == ref
    assert greedy(llm, prompts[1:2], max_new) == ref[1:2]
    assert_logprobs_match(llm, path, prompts[:2])


def greedy_params(max_new: int) -> SamplingParams:
    """`greedy`'s sampling parameters (for requests added to an engine directly)."""
    return SamplingParams(max_tokens=max_new, min_tokens=max_new, temperature=0.0)


def assert_state_freed(llm: LLM) -> None:
    """A hybrid model's engine after its requests: the scheduler's invariants hold (the state pool's too), every KV
    block and every state slot is free again, and no sequence is left."""
    e = llm.engine
    e.scheduler.check_invariants()
    assert e.kv.pool.num_free == e.kv.num_blocks
    assert e.kv.state is not None and e.kv.state.num_free == e.kv.state.num_slots, "a state slot leaked"
    assert not e.kv.state.slot_of and not e.seqs


# ---------------------------------------------------------------- tokens with their logprobs (the VLM parity tests)
def tokens_and_logprobs(outs) -> list[tuple[list[int], list[float]]]:
    """Each output's tokens and each token's own logprob (generated with logprobs >= 0)."""
    return [(o.outputs[0].token_ids, [lp[t].logprob for t, lp in zip(o.outputs[0].token_ids, o.outputs[0].logprobs)])
            for o in outs]


def assert_outputs_match(got, want, atol: float = 2e-4) -> None:
    """Equal tokens, and logprobs within atol, output by output (tokens_and_logprobs' form)."""
    for (tokens, lps), (want_tokens, want_lps) in zip(got, want, strict=True):
        assert tokens == want_tokens
        assert np.allclose(lps, want_lps, atol=atol), (lps, want_lps)


def logprob_gap(got, want) -> float:
    """The largest logprob difference between two such lists."""
    return max(np.abs(np.array(lp) - np.array(w)).max() for (_, lp), (_, w) in zip(got, want))


def checkpoint_variant(src: Path, dst: Path, config: dict | None = None, weights=None) -> Path:
    """A copy of checkpoint `src` with config.json keys replaced and / or its tensors changed by weights(dict)."""
    if not (dst / "config.json").exists():
        shutil.copytree(src, dst)
        if config:
            cfg = json.loads((dst / "config.json").read_text())
            cfg.update(config)
            (dst / "config.json").write_text(json.dumps(cfg))
        if weights is not None:
            from safetensors.torch import load_file, save_file
            f = dst / "model.safetensors"
            tensors = load_file(f)
            weights(tensors)
            save_file(tensors, f, metadata={"format": "pt"})
    return dst
