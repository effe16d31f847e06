"""Encoder embedding throughput: streamer's `LLM.embed` on a BERT-base-shaped encoder (random weights: 12 layers,
hidden 768, vocabulary 30,522; or with `--family mpnet` an MPNet-base-shaped one, all-mpnet-base-v2's shape, whose
attention adds a relative position bias) against transformers' model on the same checkpoint, batched as
sentence-transformers batches (sorted by length, 32 a batch, padded to the longest), side by side in one process.
Reports prompt tokens per second and the embeddings' largest disagreement (1 - cosine).

    python bench/encoder_embeddings.py [--family bert|mpnet] [--requests 256] [--min-len 16] [--max-len 256]
                                       [--rounds 3] [--dtype D] [--compile]
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import numpy as np  # noqa: E402
import torch  # noqa: E402

from streamer import LLM, PoolingParams  # noqa: E402

CACHE = Path.home() / ".cache/streamer-bench"
PAD = {"bert": 0, "mpnet": 1}  # (MPNet numbers positions from its pad id, 1: transformers must see real padding)


def make_model(path: Path, family: str) -> None:
    """A base-shaped BertModel / MPNetModel with random weights and a WordPiece tokenizer (the bench feeds token
    ids: the tokenizer only has to load; ids past its small vocabulary are still valid inputs)."""
    import transformers as tf
    if (path / "config.json").exists():
        return
    from tests.encoder_checkpoints import make_wordpiece_tokenizer
    make_wordpiece_tokenizer(path, "bert" if family == "bert" else "roberta")
    torch.manual_seed(0)
    if family == "bert":
        tf.BertModel(tf.BertConfig(vocab_size=30522, max_position_embeddings=512)).eval().save_pretrained(path)
    else:
        tf.MPNetModel(tf.MPNetConfig()).eval().save_pretrained(path)  # (all-mpnet-base-v2's shape)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--family", choices=sorted(PAD), default="bert")
    ap.add_argument("--model", default=None, help="default: ~/.cache/streamer-bench/<family>-base-random")
    ap.add_argument("--requests", type=int, default=256)
    ap.add_argument("--min-len", type=int, default=16)
    ap.add_argument("--max-len", type=int, default=256)
    ap.add_argument("--hf-batch", type=int, default=32)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--compile", action="store_true", help="torch.compile the model (LLM's CPU default: eager)")
    args = ap.parse_args()
    import transformers as tf
    args.model = args.model or str(CACHE / f"{args.family}-base-random")
    make_model(Path(args.model), args.family)
    pad = PAD[args.family]
    g = torch.Generator().manual_seed(0)
    lens = torch.randint(args.min_len, args.max_len + 1, (args.requests,), generator=g).tolist()
    # [CLS] random tokens [SEP], as a tokenizer frames a text
    prompts = [[2] + torch.randint(10, 30522, (n - 2,), generator=g).tolist() + [3] for n in lens]
    total = sum(lens)
    t0 = time.perf_counter()
    llm = LLM(args.model, dtype=args.dtype, enforce_eager=not args.compile,
              max_num_batched_tokens=4096, max_num_seqs=256)
    start_s = time.perf_counter() - t0
    hf = tf.AutoModel.from_pretrained(args.model, dtype=llm.engine.runner.dtype).eval()

    def run_streamer() -> np.ndarray:
        outs = llm.embed([{"prompt_token_ids": p} for p in prompts], PoolingParams(pooling="cls"))
        return np.asarray([o.embedding for o in outs])

    def run_hf() -> np.ndarray:
        order = sorted(range(len(prompts)), key=lambda i: len(prompts[i]))
        vecs: dict[int, np.ndarray] = {}
        with torch.no_grad():
            for lo in range(0, len(order), args.hf_batch):
                idx = order[lo:lo + args.hf_batch]
                batch = [prompts[i] for i in idx]
                width = max(map(len, batch))
                ids = torch.tensor([p + [pad] * (width - len(p)) for p in batch])
                mask = torch.tensor([[1] * len(p) + [0] * (width - len(p)) for p in batch])
                cls = hf(input_ids=ids, attention_mask=mask).last_hidden_state[:, 0].float()
                for i, v in zip(idx, torch.nn.functional.normalize(cls, dim=-1).numpy()):
                    vecs[i] = v
        return np.asarray([vecs[i] for i in range(len(prompts))])

    run_streamer()  # (first call: any remaining lazy set-up)
    times: dict[str, list[float]] = {"streamer": [], "transformers": []}
    results = {}
    for _ in range(args.rounds):  # interleaved, so that both see the same machine noise
        for name, fn in (("streamer", run_streamer), ("transformers", run_hf)):
            t = time.perf_counter()
            results[name] = fn()
            times[name].append(time.perf_counter() - t)
    worst = float((1 - (results["streamer"] * results["transformers"]).sum(1)).max())
    base = total / statistics.median(times["transformers"])
    print(f"{args.requests} prompts, {total} tokens ({args.min_len}-{args.max_len} each), "
          f"dtype {str(llm.engine.runner.dtype).removeprefix('torch.')}, compiled {llm.engine.runner.compiled}, "
          f"engine start {start_s:.1f} s; max(1 - cosine) vs transformers: {worst:.2e}")
    print(f"{'engine':<14}{'median s':>10}{'tok/s':>10}{'ratio':>8}")
    for name, ts in times.items():
        rate = total / statistics.median(ts)
        print(f"{name:<14}{statistics.median(ts):>10.2f}{rate:>10.0f}{rate / base:>8.2f}")
    llm.close()


if __name__ == "__main__":
    main()
