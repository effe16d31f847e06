"""Sampling parameters: validation, seeded reproducibility, top-k/p, penalties, logprobs, stops."""
from __future__ import annotations

import math

import pytest
import torch

from streamer import LLM, SamplingParams
from streamer.worker.sampler import PenaltyBatch, apply_penalties, apply_top_k_top_p


@pytest.fixture(scope="module")
def llm(llama_dir) -> LLM:
    return LLM(str(llama_dir), dtype="float32")


@pytest.mark.parametrize("field,value", [
    ("temperature", float("nan")), ("temperature", -0.5), ("temperature", float("inf")),
    ("top_p", 0.0), ("top_p", 1.5), ("top_k", 0), ("top_k", -2), ("top_k", 2.5), ("min_p", -0.1), ("min_p", 1.1),
    ("max_tokens", 0), ("n", 0), ("presence_penalty", 3.0), ("frequency_penalty", float("nan")),
    ("repetition_penalty", 0.0), ("logprobs", 21), ("seed", 1.5), ("min_tokens", -1), ("stop", [""]),
    ("stop_token_ids", [-1]), ("max_tokens", True), ("logit_bias", {"5": 1.0}), ("logit_bias", {5: 100.5}),
    ("logit_bias", {5: float("nan")}), ("logit_bias", {-3: 1.0}), ("allowed_token_ids", []),
    ("allowed_token_ids", [1, -2]), ("logit_bias", [1, 2]), ("logit_bias", "x"), ("allowed_token_ids", 5),
    ("allowed_token_ids", "12"), ("bad_words", "word"), ("bad_words", [" "]), ("bad_words", [5]),
    # Values that pass naive checks but would overflow on the device (int64 seeds, float32 tensors).
    ("stop", 5), ("stop_token_ids", 5),
    ("seed", 2 ** 64), ("seed", -2 ** 63 - 1), ("repetition_penalty", 1e300), ("temperature", 1e300), ("top_p", True),
])
def test_invalid_params_name_the_field(field, value):
    with pytest.raises(ValueError, match=field):
        SamplingParams(**{field: value})


def test_wrong_argument_types_are_named(llm):
    with pytest.raises(ValueError, match="sampling_params must be a SamplingParams"):
        llm.generate("x", {"max_tokens": 3})
    with pytest.raises(ValueError, match="prompts must be"):
        llm.generate(5)
    from streamer import BeamSearchParams  # (exported beside SamplingParams)
    assert llm.beam_search("x", BeamSearchParams(beam_width=2, max_tokens=2))[0].sequences


def test_negative_seeds_are_seeds(llm):
    """Any 64-bit seed, as vLLM takes (a client sending seed -1 gets a reproducible draw, not a 400)."""
    def draw(seed: int) -> list[int]:
        params = SamplingParams(max_tokens=12, temperature=1.0, seed=seed, n=2, ignore_eos=True)
        return [c.token_ids for c in llm.generate([[5, 6, 7]], params)[0].outputs]
    first = draw(-1)
    assert draw(-1) == first and first[0] != first[1]
    assert draw(-2 ** 63) != first


def test_prompt_validation_says_the_limit(llm):
    limit = llm.engine.max_model_len
    with pytest.raises(ValueError, match="empty"):
        llm.generate([[]], SamplingParams())
    with pytest.raises(ValueError, match=f"max_model_len is {limit}"):
        llm.generate([[5] * (limit + 3)], SamplingParams())
    with pytest.raises(ValueError, match=f"max_tokens may be at most {limit - 10}"):
        llm.generate([[5] * 10], SamplingParams(max_tokens=limit))
    with pytest.raises(ValueError, match=r"token ids must be integers in \[0, "):
        llm.generate([[5, 10 ** 6]], SamplingParams())
    # A bad prompt in a batch adds nothing: the engine is left idle and whole.
    with pytest.raises(ValueError):
        llm.generate([[5, 6], []], SamplingParams())
    assert not llm.engine.has_unfinished()
    assert llm.engine.kv.pool.num_free == llm.engine.kv.num_blocks


def test_max_tokens_none_fills_the_context(llm):
    limit = llm.engine.max_model_len
    out = llm.generate([[5] * (limit - 4)], SamplingParams(max_tokens=None, ignore_eos=True))[0].outputs[0]
    assert len(out.token_ids) == 4 and out.finish_reason == "length"


def _ids(llm, prompts, params):
    return [o.outputs[0].token_ids for o in llm.generate(prompts, params)]


def test_seeded_sampling_independent_of_batch(llm):
    p = SamplingParams(max_tokens=12, temperature=1.0, seed=1234, ignore_eos=True)
    alone = _ids(llm, [[7, 8, 9]], p)[0]
    others = SamplingParams(max_tokens=20, temperature=0.8, ignore_eos=True)
    mixed = llm.generate([[1, 2, 3, 4, 5], [7, 8, 9], [11] * 30], [others, p, others])
    assert mixed[1].outputs[0].token_ids == alone
    assert _ids(llm, [[7, 8, 9]], p)[0] == alone
    assert _ids(llm, [[7, 8, 9]], p.clone(seed=99))[0] != alone


def test_top_k_1_is_greedy(llm):
    greedy = _ids(llm, [[3, 4, 5, 6]], SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True))
    topk1 = _ids(llm, [[3, 4, 5, 6]], SamplingParams(max_tokens=10, temperature=1.5, top_k=1, ignore_eos=True))
    assert greedy == topk1
    tiny_p = _ids(llm, [[3, 4, 5, 6]], SamplingParams(max_tokens=10, temperature=1.5, top_p=1e-6, ignore_eos=True))
    assert greedy == tiny_p


def test_n_samples(llm):
    out = llm.generate("def f(x):", SamplingParams(n=3, max_tokens=8, temperature=1.0, seed=3, ignore_eos=True))[0]
    assert [c.index for c in out.outputs] == [0, 1, 2]
    assert len({tuple(c.token_ids) for c in out.outputs}) > 1
    assert all(len(c.token_ids) == 8 for c in out.outputs)


def test_logprobs(llm):
    out = llm.generate([[3, 4, 5]], SamplingParams(max_tokens=6, temperature=0.0, logprobs=3, ignore_eos=True))[0]
    c = out.outputs[0]
    assert len(c.logprobs) == 6
    total = 0.0
    for tok, entry in zip(c.token_ids, c.logprobs):
        assert tok in entry and entry[tok].rank == 1  # greedy picks the most likely token
        ranked = sorted((lp.rank, lp.logprob) for t, lp in entry.items())
        assert [r for r, _ in ranked] == [1, 2, 3]
        assert all(a >= b for (_, a), (_, b) in zip(ranked, ranked[1:]))
        assert entry[tok].logprob <= 0 and isinstance(entry[tok].decoded_token, str)
        total += entry[tok].logprob
    assert math.isclose(c.cumulative_logprob, total, rel_tol=1e-5)


def test_stop_token_ids_and_min_tokens(llm):
    base = _ids(llm, [[3, 4, 5]], SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True))[0]
    stop_tok = base[4]
    out = llm.generate([[3, 4, 5]], SamplingParams(max_tokens=10, temperature=0.0, stop_token_ids=[stop_tok]))
    c = out[0].outputs[0]
    first = base.index(stop_tok)
    assert c.token_ids == base[:first + 1] and c.finish_reason == "stop" and c.stop_reason == stop_tok
    # min_tokens bans the stop token until enough tokens exist.
    c2 = llm.generate([[3, 4, 5]], SamplingParams(max_tokens=10, temperature=0.0, stop_token_ids=[stop_tok],
                                                  min_tokens=first + 2))[0].outputs[0]
    assert stop_tok not in c2.token_ids[:first + 2]


def test_stop_string_truncates_text(llm):
    p = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
    full = llm.generate(["hello"], p)[0].outputs[0].text
    assert len(full) > 8
    stop = full[5:8]
    cut = full.index(stop)
    c = llm.generate(["hello"], p.clone(stop=[stop]))[0].outputs[0]
    assert c.text == full[:cut] and c.finish_reason == "stop" and c.stop_reason == stop
    c = llm.generate(["hello"], p.clone(stop=[stop], include_stop_str_in_output=True))[0].outputs[0]
    assert c.text == full[:cut + len(stop)]


def test_penalties_match_naive_reference():
    torch.manual_seed(0)
    B, V = 3, 11
    logits = torch.randn(B, V)
    prompt = [[1, 2], [3], [4, 4]]
    output = [[2, 2, 5], [], [6]]
    pres, freq, rep = [0.5, 0.0, -1.0], [0.3, 1.0, 0.0], [1.3, 1.0, 0.7]
    counts = torch.zeros(B, V)
    seen = torch.zeros(B, V, dtype=torch.bool)
    for b in range(B):
        for t in output[b]:
            counts[b, t] += 1
        seen[b, prompt[b] + output[b]] = True
    pen = PenaltyBatch(torch.tensor(pres)[:, None], torch.tensor(freq)[:, None], torch.tensor(rep)[:, None],
                       counts, seen)
    got = apply_penalties(logits, pen)
    want = logits.clone()
    for b in range(B):
        for t in set(prompt[b] + output[b]):
            want[b, t] = want[b, t] / rep[b] if want[b, t] > 0 else want[b, t] * rep[b]
        for t in set(output[b]):
            want[b, t] -= freq[b] * output[b].count(t) + pres[b]
    torch.testing.assert_close(got, want)


def test_logit_bias_and_allowed_token_ids(llm):
    prompts = [[9, 10, 11, 12], [30, 31]]
    greedy = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
    base = _ids(llm, prompts, greedy)
    # +100 forces a token; -100 on everything the row produced makes it produce something else. The other
    # request of the batch is untouched.
    forced = llm.generate([{"prompt_token_ids": p} for p in prompts],
                          [greedy.clone(logit_bias={77: 100.0}), greedy])
    assert forced[0].outputs[0].token_ids == [77] * 6 and forced[1].outputs[0].token_ids == base[1]
    banned = _ids(llm, prompts[:1], greedy.clone(logit_bias={t: -100.0 for t in base[0]}))[0]
    assert not set(banned) & set(base[0])
    # A small bias shifts the race without deciding it: sampled tokens keep varying.
    allowed = [5, 6, 7]
    outs = _ids(llm, [prompts[0]] * 4, SamplingParams(max_tokens=12, temperature=1.0, allowed_token_ids=allowed,
                                                      logit_bias={5: 0.5}, ignore_eos=True, seed=3))
    assert all(set(o) <= set(allowed) for o in outs) and len({t for o in outs for t in o}) > 1
    # Token ids past the vocabulary are refused up front, naming the field.
    vocab = llm.engine.vocab_size
    with pytest.raises(ValueError, match="^logit_bias"):
        llm.generate([prompts[0]], greedy.clone(logit_bias={vocab: 1.0}))
    with pytest.raises(ValueError, match="^allowed_token_ids"):
        llm.generate([prompts[0]], greedy.clone(allowed_token_ids=[1, vocab + 5]))
    # Only stop tokens allowed, and min_tokens bans them: every logit would be -inf.
    with pytest.raises(ValueError, match="^allowed_token_ids holds only stop tokens"):
        llm.generate([prompts[0]], greedy.clone(allowed_token_ids=[50], stop_token_ids=[50], min_tokens=2))


def _completes(seqs: list[list[int]], ids: list[int]) -> list[int]:
    """Positions of `ids` at which a token finishes one of `seqs` (the earlier tokens all from `ids`)."""
    return [i for i in range(len(ids)) for s in seqs if i + 1 >= len(s) and ids[i + 1 - len(s):i + 1] == s]


def test_bad_words_bans_what_would_complete_them(llm):
    """A word the greedy output writes (as two tokens) is banned: the output is the same up to the token that would
    complete it, then differs there, and never holds the word's tokens; words of one token never appear; the
    other request of the batch is untouched."""
    from streamer.worker.sampler import bad_word_bans, bad_words_token_ids
    tok = llm.get_tokenizer()  # (vLLM's spelling)
    assert tok is llm.engine.tokenizer
    encode = lambda text: tok.encode(text, add_special_tokens=False)  # noqa: E731
    prompts = [[9, 10, 11, 12], [30, 31]]
    greedy = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
    base = _ids(llm, prompts, greedy)
    # A two-token window of the output that is how its text tokenizes (so the engine bans exactly these tokens).
    word = next(w for i in range(2, len(base[0]) - 1) for w in [tok.decode(base[0][i:i + 2])]
                if w.strip() and base[0][i:i + 2] in bad_words_token_ids([w], encode))
    seqs = bad_words_token_ids([word], encode)
    first = min(_completes(seqs, base[0]))
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], [greedy.clone(bad_words=[word]), greedy])
    out = outs[0].outputs[0].token_ids
    assert out[:first] == base[0][:first] and out[first] != base[0][first]
    assert _completes(seqs, out) == [] and outs[1].outputs[0].token_ids == base[1]
    single = tok.decode([base[0][0]])
    if single.strip() and [base[0][0]] in bad_words_token_ids([single], encode):
        out = _ids(llm, prompts[:1], greedy.clone(bad_words=[single]))[0]
        assert base[0][0] not in out
    # The rule itself: a sequence's last token is banned where the output ends with the rest of it.
    assert bad_word_bans([[4, 5, 6], [7]], [1, 4, 5]) == [6, 7]
    assert bad_word_bans([[4, 5, 6]], [4]) == [] and bad_word_bans([[4, 5, 6]], [5]) == []


def test_top_k_top_p_mask():
    logits = torch.tensor([[4.0, 3.0, 2.0, 1.0], [1.0, 2.0, 3.0, 4.0]])
    out = apply_top_k_top_p(logits, torch.tensor([2, 4]), torch.tensor([1.0, 0.5]))
    assert torch.isinf(out[0, 2:]).all() and torch.isfinite(out[0, :2]).all()
    # Row 2: softmax([1,2,3,4]) = [.03,.09,.24,.64]; the top token alone already covers p=0.5.
    assert torch.isfinite(out[1, 3]) and torch.isinf(out[1, :3]).all()


def test_top_p_one_keeps_every_token_beside_a_top_p_row():
    # A row with top_p=1.0 shares the batch with one that uses top-p, so it goes through the mask too: the
    # cumsum's rounding past 1.0 must not drop its tail (it dropped 98 tokens of row 0 here).
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(4, 4096, generator=g) * 3
    out = apply_top_k_top_p(logits, None, torch.tensor([1.0, 0.5, 1.0, 1.0]))
    assert torch.isfinite(out[[0, 2, 3]]).all()
    assert torch.isinf(out[1]).sum() > 4000


def test_frequency_penalty_changes_repetitive_output(llm):
    p = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True)
    base = _ids(llm, [[9, 9, 9]], p)[0]
    pen = _ids(llm, [[9, 9, 9]], p.clone(frequency_penalty=2.0, presence_penalty=2.0))[0]
    assert len(set(pen)) > len(set(base)) or pen != base


def _batch(B: int, *, top_k=None, top_p=None, min_p=None, temperature=None, generators=None):
    from streamer.worker.sampler import SamplingBatch
    gens = generators or [None] * B
    return SamplingBatch(temperature=torch.ones(B) if temperature is None else temperature, top_k=top_k,
                         top_p=top_p, min_p=min_p, generators=gens, all_greedy=False,
                         any_seeded=any(g is not None for g in gens), banned=None, penalties=None, max_logprobs=-1)


def _kept(logits: torch.Tensor, top_k, top_p, min_p) -> torch.Tensor:
    """The reference: the full sort-and-mask path's kept tokens."""
    probs = apply_top_k_top_p(logits, top_k, top_p).softmax(dim=-1)
    if min_p is not None:
        probs = probs * (probs >= min_p.unsqueeze(1) * probs.max(dim=-1, keepdim=True).values)
    return probs > 0


def test_cpu_fast_paths_sample_only_kept_tokens():
    from streamer.worker.sampler import CANDIDATE_TIERS, sample_cpu_fast
    torch.manual_seed(0)
    B, V = 9, 2000
    logits = torch.randn(B, V) * 4  # peaked, like an LM's
    logits[5] = torch.randn(V) * 0.01  # nearly flat: top_p=0.9 keeps ~1,800 tokens
    # top_k between the heads, then a top-p that cuts inside it: the 20 tokens hold ~60% of the mass, the first
    # 16 of them more than top_p of it, yet top-p must renormalise over the 20 (and keep ~8 of them, not ~13).
    logits[6] = torch.randn(V) * 0.01
    logits[6, :20] = 5.0 + torch.linspace(1.0, 0.0, 20)
    top_k = torch.tensor([5, V, V, 40, V, V, 20, V, 1000])
    top_p = torch.tensor([1.0, 0.9, 0.5, 0.8, 1.0, 0.9, 0.5, 0.3, 0.9])
    temperature = torch.tensor([1.0, 1.0, 1.0, 1.0, 0.7, 1.0, 1.0, 1.0, 1.0])
    temperature[7] = 0.0  # greedy: left to the caller
    kept = _kept(logits / temperature.clamp(min=1e-6).unsqueeze(1), top_k, top_p, None)
    batch = _batch(B, top_k=top_k, top_p=top_p, temperature=temperature)
    seen = [set() for _ in range(B)]
    scaled = logits / torch.where(temperature > 0, temperature, 1.0).unsqueeze(1)
    for _ in range(300):
        tok = sample_cpu_fast(scaled, batch)
        assert tok is not None
        for b in range(B):
            if tok[b] >= 0:
                assert kept[b, tok[b]], f"row {b} sampled a token the full mask drops"
                seen[b].add(int(tok[b]))
    assert tok[7] == -1 and tok[8] == -1  # greedy, and top-p after a top_k wider than the widest head
    assert all(seen[b] for b in (0, 1, 2, 3, 4, 5, 6)) and 1000 > CANDIDATE_TIERS[-1]
    assert len(seen[1]) > 1 and len(seen[5]) > 200  # the flat row draws from its wide nucleus
    # A head decides a row over its whole kept set, as the full path would.
    assert seen[0] == set(kept[0].nonzero().flatten().tolist())
    assert seen[6] == set(kept[6].nonzero().flatten().tolist())


@pytest.mark.parametrize("top_k,top_p,min_p", [(None, 0.7, None), (None, None, 0.2), (None, 0.9, 0.1),
                                               (None, None, None), (4, 0.8, None), (6, None, 0.1), (5, None, None),
                                               (12, 1.0, None)])
def test_cpu_fast_paths_follow_the_renormalised_distribution(top_k, top_p, min_p):
    """Thousands of identical rows in one call: the frequencies match the kept tokens' renormalised
    probabilities (total variation), as the full path's would. Tokens with tied probabilities at the edges
    would be decided by the sort's order; these logits have none."""
    from streamer.worker.sampler import sample_cpu_fast
    torch.manual_seed(1)
    B, V = 40000, 24
    row = torch.linspace(3.0, -2.0, V)[torch.randperm(V)]  # distinct values, shuffled
    logits = row.expand(B, V).contiguous()

    def full(x):
        return None if x is None else torch.full((B,), x, dtype=torch.int64 if isinstance(x, int) else torch.float32)

    batch = _batch(B, top_k=full(top_k), top_p=full(top_p), min_p=full(min_p))
    kept = _kept(logits[:1], *(t if t is None else t[:1] for t in (batch.top_k, batch.top_p, batch.min_p)))[0]
    want = torch.where(kept, row.softmax(dim=-1), 0.0)
    want = want / want.sum()
    tok = sample_cpu_fast(logits, batch)
    assert tok is not None and bool((tok >= 0).all())
    got = torch.bincount(tok, minlength=V).float() / B
    assert bool((got[~kept] == 0).all())
    assert 0.5 * (got - want).abs().sum() < 0.015, (got, want)
    assert int(kept.sum()) > 1  # (a real choice)


def test_rejection_rows_left_over_go_to_the_full_path(monkeypatch):
    """A row still rejected after MAX_REJECTION_ROUNDS draws is sampled by the full path, not dropped."""
    import streamer.worker.sampler as sampler
    monkeypatch.setattr(sampler, "MAX_REJECTION_ROUNDS", 1)
    torch.manual_seed(2)
    B, V = 64, 500
    logits = torch.randn(B, V) * 0.01  # flat: top_p=0.05 keeps ~25 tokens, a first draw lands there 1 in 20
    top_p = torch.full((B,), 0.05)
    batch = _batch(B, top_p=top_p)
    fast = sampler.sample_cpu_fast(logits, batch)
    assert fast is not None and int((fast < 0).sum()) > B // 2
    tokens = sampler.Sampler()(logits, batch).token_ids
    kept = _kept(logits, None, top_p, None)
    assert bool((tokens >= 0).all()) and bool(kept.gather(1, tokens.unsqueeze(1)).all())


@pytest.mark.parametrize("params", [dict(top_k=20, top_p=1.0), dict(top_k=20, top_p=0.9), dict(top_k=None, top_p=0.5),
                                    dict(top_k=None, top_p=1.0, min_p=0.1)])
def test_seeded_row_draws_do_not_depend_on_batch_mates(params):
    """A seeded row's tokens depend on its seed alone: a fast path that decided it must not draw for it again in
    the full path (which runs when another row needs it), and it draws as many numbers whatever its batch mates
    ask for; otherwise its generator runs ahead and its later samples change."""
    from streamer.worker.sampler import Sampler
    torch.manual_seed(0)
    V = 2000
    peaked, flat = torch.randn(V) * 4, torch.randn(V) * 0.01
    # (3000: the full path; 50 with top-p: the seeded top_k=20, top_p=0.9 row's head tier, wider)
    mates = [(flat, 3000, 0.9, 0.0), (peaked, 50, 0.95, 0.0), (peaked, V, 0.3, 0.05)]

    def draws(with_mates: bool) -> list[int]:
        gen = torch.Generator().manual_seed(5)
        rows = [(peaked, params["top_k"] or V, params["top_p"], params.get("min_p", 0.0))]
        rows += mates if with_mates else []
        B = len(rows)
        min_p = torch.tensor([r[3] for r in rows]) if "min_p" in params else None
        batch = _batch(B, top_k=torch.tensor([r[1] for r in rows]), top_p=torch.tensor([r[2] for r in rows]),
                       min_p=min_p, generators=[gen] + [None] * (B - 1))
        return [int(Sampler()(torch.stack([r[0] for r in rows]), batch).token_ids[0]) for _ in range(20)]

    alone = draws(False)
    assert draws(True) == alone and len(set(alone)) > 1


@pytest.mark.parametrize("vocab", [1, 63, 64, 65, 200, 4103])
def test_inverse_cdf_matches_a_full_running_sum(vocab):
    """The two-level search lands where a full cumsum's would. Integer weights keep every sum exact, so the two
    must agree on every row, including rows of mostly zeros and draws at the very start and end."""
    from streamer.worker.sampler import inverse_cdf
    g = torch.Generator().manual_seed(vocab)
    rows = 300
    w = torch.randint(0, 6, (rows, vocab), generator=g).float()
    w[::3] *= torch.rand(rows // 3 if rows % 3 == 0 else rows // 3 + 1, vocab, generator=g) < 0.05  # sparse rows
    w[:, 0] += 1.0  # (no all-zero row)
    u = torch.rand(rows, generator=g)
    u[:5] = torch.tensor([0.0, 1e-7, 0.5, 1 - 2 ** -24, 0.999])
    want = torch.searchsorted(w.cumsum(dim=-1), (u * w.sum(dim=-1)).unsqueeze(1), right=True).squeeze(1)
    got = inverse_cdf(w, u)
    assert torch.equal(got, want.clamp(max=vocab - 1))
    assert bool((w.gather(1, got.unsqueeze(1)) > 0).all())  # never a zero-weight index
