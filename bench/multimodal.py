"""Image prompts on a vision-language model: what an image costs, and what the encoder and prefix caches save.

    python bench/multimodal.py [--requests 16] [--text-tokens 32] [--tokens 32] [--rounds 3]

The model: LLaVA over the 90M bench model's text shapes (bench/make_bench_model.py) with a CLIP ViT-B/16 encoder
at 224 pixels (196 image tokens, 86M parameters), dummy weights in bf16, built once under
~/.cache/streamer-bench/llava-90m. Side by side in each round, `--requests` requests of `--text-tokens` text plus:
- "image, cold": a new image each (encoded, then prefilled);
- "image, repeated": the same requests again (the prefix cache holds their blocks: little to compute);
- "image, new text": the same images under other text (the encoder cache holds their features; the prefix cache
  has nothing, the text differing from the first token on): a cold request's cost less the encoder's;
- "text only": a prompt of the same length without an image (the encoder's share of the cold cost).
Reported: seconds per batch (median of rounds) and each case's ratio to "text only".
"""
from __future__ import annotations

import argparse
import json
import shutil
import statistics
import sys
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from streamer import LLM, SamplingParams  # noqa: E402

BENCH = Path.home() / ".cache" / "streamer-bench"
CLIP_B16 = {"model_type": "clip_vision_model", "hidden_size": 768, "intermediate_size": 3072,
            "num_hidden_layers": 12, "num_attention_heads": 12, "image_size": 224, "patch_size": 16}


def build_model(text_dir: Path, out: Path) -> Path:
    """The text model's config and tokenizer with `<image>` added, wrapped in a LLaVA config (dummy weights)."""
    if (out / "config.json").exists():
        return out
    from tokenizers import AddedToken, Tokenizer
    out.mkdir(parents=True, exist_ok=True)
    tok = Tokenizer.from_file(str(text_dir / "tokenizer.json"))
    tok.add_special_tokens([AddedToken("<image>", special=True, normalized=False)])
    tok.save(str(out / "tokenizer.json"))
    image_id = tok.token_to_id("<image>")
    shutil.copy(text_dir / "tokenizer_config.json", out / "tokenizer_config.json")
    text = json.loads((text_dir / "config.json").read_text())
    text["vocab_size"] = max(text["vocab_size"], image_id + 1)
    config = {"architectures": ["LlavaForConditionalGeneration"], "model_type": "llava", "dtype": "bfloat16",
              "image_token_index": image_id, "text_config": text, "vision_config": CLIP_B16,
              "vision_feature_layer": -2, "vision_feature_select_strategy": "default",
              "projector_hidden_act": "gelu", "tie_word_embeddings": text.get("tie_word_embeddings", False)}
    (out / "config.json").write_text(json.dumps(config, indent=2))
    (out / "preprocessor_config.json").write_text(json.dumps({
        "image_processor_type": "CLIPImageProcessor", "size": {"shortest_edge": 224},
        "crop_size": {"height": 224, "width": 224}}))
    return out


def images(n: int, seed: int) -> list:
    from PIL import Image
    rng = np.random.default_rng(seed)
    return [Image.fromarray(rng.integers(0, 256, (300, 400, 3), dtype=np.uint8)) for _ in range(n)]


def text_ids(llm: LLM, n: int, length: int, seed: int) -> list[list[int]]:
    rng = np.random.default_rng(seed)
    vocab = llm.engine.model_config.vocab_size - 1  # (not the image token)
    return [rng.integers(10, vocab, length).tolist() for _ in range(n)]


def timed(llm: LLM, prompts: list, params: SamplingParams) -> float:
    t = time.perf_counter()
    llm.generate(prompts, params)
    return time.perf_counter() - t


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--text-model", default=str(BENCH / "llama-90m"))
    ap.add_argument("--requests", type=int, default=16)
    ap.add_argument("--text-tokens", type=int, default=32)
    ap.add_argument("--tokens", type=int, default=32)
    ap.add_argument("--rounds", type=int, default=3)
    args = ap.parse_args()
    path = build_model(Path(args.text_model), BENCH / "llava-90m")
    llm = LLM(str(path), load_format="dummy", dtype="bfloat16")
    image_id = llm.engine.model_config.image_token_id
    n_img = llm.engine.image_prompts.tokens_per_image  # type: ignore[union-attr]
    params = SamplingParams(max_tokens=args.tokens, temperature=0.0, ignore_eos=True)
    n = args.requests
    cases: dict[str, list[float]] = {k: [] for k in ("text only", "image, cold", "image, repeated",
                                                     "image, new text")}
    llm.generate([{"prompt_token_ids": text_ids(llm, 1, 8, 0)[0] + [image_id],
                   "multi_modal_data": {"image": images(1, 0)}}], params)  # warm-up
    for r in range(args.rounds):
        seed = 1000 * (r + 1)
        texts, other = text_ids(llm, n, args.text_tokens, seed), text_ids(llm, n, args.text_tokens, seed + 1)
        ims = images(n, seed)
        with_image = [{"prompt_token_ids": t + [image_id], "multi_modal_data": {"image": im}}
                      for t, im in zip(texts, ims)]
        cases["text only"].append(timed(llm, [{"prompt_token_ids": t} for t in
                                              text_ids(llm, n, args.text_tokens + n_img, seed + 2)], params))
        cases["image, cold"].append(timed(llm, with_image, params))
        cases["image, repeated"].append(timed(llm, with_image, params))
        cases["image, new text"].append(timed(llm, [{"prompt_token_ids": t + [image_id],
                                                     "multi_modal_data": {"image": im}}
                                                    for t, im in zip(other, ims)], params))
    stats = llm.engine.runner.encoder_cache
    base = statistics.median(cases["text only"])
    print(f"# {n} requests x ({args.text_tokens} text + {n_img} image tokens), {args.tokens} output tokens; "
          f"{args.rounds} rounds; images encoded: {stats.num_encoded}")
    print("| case | s per batch (median) | vs text only |")
    print("| --- | --- | --- |")
    for name, times in cases.items():
        med = statistics.median(times)
        print(f"| {name} | {med:.2f} | {med / base:.2f}x |")


if __name__ == "__main__":
    main()
