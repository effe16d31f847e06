"""Batch transcription: streamer's engine vs transformers' `generate` on the same Whisper checkpoint.

A Whisper model at a real size (whisper-tiny's or whisper-base's shapes, random weights, float32) is written once
by transformers. Both transcribe the same N clips of audio (10 s each) with the same English transcription prompt,
greedily, every clip decoding exactly `--tokens` tokens (eos ignored / min_new_tokens), so both do the same work;
best of two runs each.
transformers runs them in batches of `--hf-batch` (padded, as its pipeline would); streamer takes them all at once
and batches them itself. Prints one table: seconds, clips a second and output tokens a second, and how many clips'
tokens agree between the two. With `--timestamps`, streamer also runs the clips with timestamps (the prompt without
<|notimestamps|>: Whisper's timestamp rules on every step), for the cost of those rules.

    python bench/whisper_throughput.py --size tiny --clips 32 --tokens 64 [--timestamps]
"""
from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

SIZES = {"tiny": dict(d_model=384, layers=4, heads=6), "base": dict(d_model=512, layers=6, heads=8)}
REPEAT = 2
PROMPT = "<|startoftranscript|><|en|><|transcribe|><|notimestamps|>"


def make_model(folder: Path, size: str) -> None:
    """Whisper at `size`'s shapes with random weights, and a tokenizer with a real multilingual Whisper's ids
    (tests/whisper_checkpoints.py whisper_layout_tokenizer: every id decodes to text)."""
    import json

    from transformers import WhisperConfig, WhisperFeatureExtractor, WhisperForConditionalGeneration

    from tests.whisper_checkpoints import whisper_layout_tokenizer
    s = SIZES[size]
    ids = whisper_layout_tokenizer(folder)
    eot, sot = ids["<|endoftext|>"], ids["<|startoftranscript|>"]
    cfg = WhisperConfig(vocab_size=51865, num_mel_bins=80, d_model=s["d_model"], encoder_layers=s["layers"],
                        decoder_layers=s["layers"], encoder_attention_heads=s["heads"],
                        decoder_attention_heads=s["heads"], encoder_ffn_dim=4 * s["d_model"],
                        decoder_ffn_dim=4 * s["d_model"], bos_token_id=eot, eos_token_id=eot, pad_token_id=eot,
                        decoder_start_token_id=sot, suppress_tokens=[], begin_suppress_tokens=[])
    torch.manual_seed(0)
    WhisperForConditionalGeneration(cfg).save_pretrained(folder, safe_serialization=True)
    WhisperFeatureExtractor(feature_size=80).save_pretrained(folder)
    gen = {"decoder_start_token_id": sot, "eos_token_id": eot, "pad_token_id": eot, "bos_token_id": eot,
           "is_multilingual": True, "no_timestamps_token_id": ids["<|notimestamps|>"],
           "max_initial_timestamp_index": 50, "max_length": 448, "begin_suppress_tokens": [], "suppress_tokens": [],
           "task_to_id": {t: ids[f"<|{t}|>"] for t in ("transcribe", "translate")},
           "lang_to_id": {k: v for k, v in ids.items() if k not in ("<|endoftext|>", "<|startoftranscript|>")
                          and not k.strip("<|>").startswith(("translate", "transcribe", "startof", "nospeech",
                                                             "notimestamps"))}}
    (folder / "generation_config.json").write_text(json.dumps(gen, indent=2))


def clips(n: int) -> list[np.ndarray]:
    from tests.whisper_checkpoints import tone
    return [tone(10.0, 150.0 + 37.0 * i, seed=i) for i in range(n)]


def run_streamer(folder: Path, audio: list[np.ndarray], tokens: int, prompt: str = PROMPT,
                 ) -> tuple[float, list[list[int]]]:
    from streamer import LLM, SamplingParams
    llm = LLM(str(folder), dtype="float32", max_num_seqs=len(audio), kv_cache_memory=8 << 30)
    params = SamplingParams(max_tokens=tokens, temperature=0.0, ignore_eos=True)
    prompts = [{"prompt": prompt, "multi_modal_data": {"audio": (a, 16000)}} for a in audio]
    best = float("inf")
    for _ in range(REPEAT):  # (the first run also makes oneDNN's kernels for these shapes: best of REPEAT)
        t = time.perf_counter()
        outs = llm.generate(prompts, params, use_tqdm=False)
        best = min(best, time.perf_counter() - t)
    return best, [list(o.outputs[0].token_ids) for o in outs]


def run_transformers(folder: Path, audio: list[np.ndarray], tokens: int, batch: int,
                     prompt_ids: list[int]) -> tuple[float, list[list[int]]]:
    from transformers import WhisperFeatureExtractor, WhisperForConditionalGeneration
    model = WhisperForConditionalGeneration.from_pretrained(folder, torch_dtype=torch.float32).eval()
    fe = WhisperFeatureExtractor.from_pretrained(folder)

    def go(part: list[np.ndarray], n: int) -> list[list[int]]:
        feats = torch.from_numpy(fe(part, sampling_rate=16000, return_tensors="np").input_features)
        start = torch.tensor([prompt_ids] * len(part))
        with torch.inference_mode():
            seq = model.generate(input_features=feats, decoder_input_ids=start, max_new_tokens=n,
                                 min_new_tokens=n, do_sample=False)
        return [row[len(prompt_ids):].tolist() for row in seq]
    best = float("inf")
    for _ in range(REPEAT):
        t = time.perf_counter()
        out = [row for i in range(0, len(audio), batch) for row in go(audio[i:i + batch], tokens)]
        best = min(best, time.perf_counter() - t)
    return best, out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--size", choices=sorted(SIZES), default="tiny")
    ap.add_argument("--clips", type=int, default=32)
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--hf-batch", type=int, default=16)
    ap.add_argument("--timestamps", action="store_true", help="also run streamer with timestamps")
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp)
        make_model(folder, args.size)
        from tokenizers import Tokenizer
        tok = Tokenizer.from_file(str(folder / "tokenizer.json"))
        prompt_ids = [tok.token_to_id(t) for t in ("<|startoftranscript|>", "<|en|>", "<|transcribe|>",
                                                    "<|notimestamps|>")]
        audio = clips(args.clips)
        hf_s, hf_out = run_transformers(folder, audio, args.tokens, args.hf_batch, prompt_ids)
        st_s, st_out = run_streamer(folder, audio, args.tokens)
        ts_s = run_streamer(folder, audio, args.tokens, PROMPT.replace("<|notimestamps|>", ""))[0] \
            if args.timestamps else None
        # transformers' generate bans eos until min_new_tokens (ignore_eos does not): the tokens to agree with are
        # its model's plain greedy ones, one forward a token, up to its eos
        from tests.whisper_checkpoints import hf_greedy
        checked = min(args.clips, 4)
        agree = sum(st_out[i][:len(ref)] == ref
                    for i, ref in enumerate(hf_greedy(folder, audio[i], prompt_ids, args.tokens)
                                            for i in range(checked)))
    n_tok = args.clips * args.tokens
    print(f"whisper-{args.size} shapes, random weights, fp32; {args.clips} clips of 10 s, {args.tokens} tokens each")
    print(f"{'engine':<28}{'seconds':>9}{'clips/s':>9}{'tok/s':>9}{'vs hf':>8}")
    rows = [(f"transformers (batch {args.hf_batch})", hf_s), ("streamer", st_s)]
    for name, s in rows + ([("streamer, timestamps", ts_s)] if ts_s is not None else []):
        print(f"{name:<28}{s:>9.2f}{args.clips / s:>9.2f}{n_tok / s:>9.1f}{hf_s / s:>7.2f}x")
    print(f"streamer's tokens = transformers' greedy forward's (up to its eos): {agree}/{checked} clips checked")


if __name__ == "__main__":
    main()
