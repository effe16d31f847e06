"""Host overhead per engine step: scheduling + batch preparation + sampling + detokenization, with the model
replaced by an instant stub (it returns random logits), at 1, 64, 256 and 1,024 running requests.

    python bench/host_overhead.py [--model DIR] [--sizes 1,64,256,1024] [--steps 50]

Every request decodes (the prompt is prefilled before timing starts), so each timed step has exactly N
running requests. Prints milliseconds per step, split into schedule / execute (prep + stub + sampling) /
process (append, stop checks, detokenization).
"""
from __future__ import annotations

import argparse
import random
import time

import torch


def stub_model(runner) -> None:
    """Replace the forward pass by something that costs ~nothing but keeps shapes (and greedy decisions varied)."""
    hidden_size = runner.model_cfg.hidden_size
    vocab = runner.model_cfg.vocab_size
    gen = torch.Generator().manual_seed(0)
    # Peaked like a real LM's logits (a uniform row would make top-p keep most of the vocabulary); made
    # once, so that the stub itself costs nothing per step.
    table = torch.randn(4096, vocab, generator=gen) * 4.0

    def forward(input_ids, positions, kv_caches):
        return torch.zeros(input_ids.shape[0], hidden_size)

    def compute_logits(hidden):
        return table[:hidden.shape[0]]

    runner.model.forward = forward
    runner.model.compute_logits = compute_logits


def measure(model: str | None, n: int, steps: int, seed: int, sampling: str = "greedy") -> dict[str, float]:
    from streamer import SamplingParams
    from streamer.config import EngineConfig
    from streamer.engine.llm_engine import LLMEngine
    engine = LLMEngine(EngineConfig(model=model, dtype="float32", load_format="dummy", max_num_seqs=max(n, 1),
                                    max_num_batched_tokens=max(8192, n * 8), num_kv_blocks=n * 8 + 64,
                                    enable_prefix_caching=True))
    stub_model(engine.runner)
    rng = random.Random(seed)
    vocab = engine.model_config.vocab_size
    params = (SamplingParams(max_tokens=steps + 10, temperature=0.0, ignore_eos=True) if sampling == "greedy" else
              SamplingParams(max_tokens=steps + 10, temperature=0.8, top_p=0.95, ignore_eos=True))
    for i in range(n):
        engine.add_request(f"r{i}", [rng.randrange(vocab) for _ in range(16)], params)
    while engine.scheduler.num_waiting:  # prefill everyone first
        engine.step()
    t_sched = t_exec = t_proc = 0.0
    for _ in range(steps):
        t0 = time.perf_counter()
        sched = engine.scheduler.schedule()
        t1 = time.perf_counter()
        result = engine.runner.execute(engine.prepare(sched))
        t2 = time.perf_counter()
        engine.process(sched, result)
        t3 = time.perf_counter()
        assert len(sched.scheduled) == n
        t_sched, t_exec, t_proc = t_sched + t1 - t0, t_exec + t2 - t1, t_proc + t3 - t2
    ms = 1000.0 / steps
    return {"schedule": t_sched * ms, "execute": t_exec * ms, "process": t_proc * ms,
            "total": (t_sched + t_exec + t_proc) * ms}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None, help="checkpoint folder (default: the embedded demo model)")
    ap.add_argument("--sizes", default="1,64,256,1024")
    ap.add_argument("--steps", type=int, default=50)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    torch.set_num_threads(1)
    print(f"{'sampling':<22} {'running':>8} {'schedule ms':>12} {'execute ms':>11} {'process ms':>11} "
          f"{'total ms/step':>14}")
    for sampling in ("greedy", "temp 0.8, top_p 0.95"):
        for n in (int(x) for x in args.sizes.split(",")):
            r = measure(args.model, n, args.steps, args.seed, "greedy" if sampling == "greedy" else "top_p")
            print(f"{sampling:<22} {n:>8} {r['schedule']:>12.3f} {r['execute']:>11.3f} {r['process']:>11.3f} "
                  f"{r['total']:>14.3f}")


if __name__ == "__main__":
    main()
