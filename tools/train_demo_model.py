#!/usr/bin/env python3
"""Train streamer's embedded demo model: a tiny Llama that writes Python, from the stdlib's own source.

Everything it needs is already on any machine that has Python: the training text is the standard
library's ``*.py`` files (``sysconfig.get_paths()["stdlib"]``, minus tests and generated tables),
split into train / validation *by file*. It trains

* a byte-level BPE tokenizer with ``tokenizers`` (any text round-trips), and
* a LlamaForCausalLM-shaped model (RMSNorm, rotary embeddings, SwiGLU MLP, grouped-query attention,
  tied embeddings) written here in plain torch, trained on the CPU with AdamW and a cosine schedule,

and writes a standard Hugging Face checkpoint folder (config.json, model.safetensors in bfloat16 with
HF parameter names, tokenizer.json, tokenizer_config.json with a chat template, generation_config.json)
that both streamer and ``transformers`` load.

The run is reproducible from ``--seed`` (same stdlib, same torch build, same ``--threads``). The loss
curve goes to stdout and to a TSV file. The defaults are the shipped model's settings:

    python tools/train_demo_model.py                       # -> streamer/default_model/, docs/demo_model_loss.tsv
    python tools/train_demo_model.py --benchmark 5         # time a few steps, train nothing
    python tools/train_demo_model.py --out /tmp/m --steps 20 --max-files 40 --vocab-size 512 \\
        --hidden-size 64 --num-layers 2 --loss-log /tmp/m/loss.tsv   # a smoke run in seconds
"""
from __future__ import annotations

import argparse
import hashlib
import json
import math
import os
import pathlib
import platform
import random
import sys
import sysconfig
import time

import torch
import torch.nn as nn
import torch.nn.functional as F

BOS = "<|begin_of_text|>"
EOS = "<|end_of_text|>"
SPECIAL_TOKENS = [BOS, EOS]  # ids 0 and 1

# Directories of the stdlib that are not "library source": tests, IDLE's tests, codec tables, and
# whatever pip installed next to it.
EXCLUDED_DIRS = {"site-packages", "dist-packages", "test", "tests", "idle_test", "encodings", "__pycache__"}
MAX_FILE_BYTES = 256 * 1024  # drops generated blobs such as pydoc_data/topics.py

# A comment-style chat format for a code model: system and user turns become "# ..." comment lines,
# assistant turns are code ending in the end-of-text token. The generation prompt is the code that
# follows the comment, so it adds nothing.
CHAT_TEMPLATE = (
    "{{- bos_token }}"
    "{%- for message in messages %}"
    "{%- if message['role'] == 'assistant' %}"
    "{{- message['content'] + eos_token }}"
    "{%- else %}"
    "{%- for line in message['content'].split('\\n') %}"
    "{{- '# ' + line + '\\n' }}"
    "{%- endfor %}"
    "{%- endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '' }}{%- endif %}"
)

SAMPLE_PROMPTS = [
    "def fibonacci(n):",
    "import os\n\n\ndef list_python_files(path):",
    "class Stack:\n    def __init__(self):",
]


# --------------------------------------------------------------------------------------------- data
def stdlib_files(stdlib: pathlib.Path, max_files: int | None = None) -> list[tuple[str, str]]:
    """(relative posix path, text) for the stdlib's library source, sorted by path."""
    out = []
    for p in sorted(stdlib.rglob("*.py"), key=lambda q: q.relative_to(stdlib).as_posix()):
        rel = p.relative_to(stdlib)
        if set(rel.parts[:-1]) & EXCLUDED_DIRS or not p.is_file():
            continue
        try:
            if p.stat().st_size > MAX_FILE_BYTES:
                continue
            text = p.read_bytes().decode("utf-8")
        except (OSError, UnicodeDecodeError):
            continue
        text = text.replace("\r\n", "\n")
        if text.strip():
            out.append((rel.as_posix(), text))
        if max_files is not None and len(out) >= max_files:
            break
    return out


def is_validation(relpath: str, val_fraction: float, seed: int) -> bool:
    """Split by file with a hash of its path: stable whatever else the stdlib holds."""
    h = hashlib.sha256(f"{seed}:{relpath}".encode()).digest()
    return int.from_bytes(h[:8], "big") / 2**64 < val_fraction


# ---------------------------------------------------------------------------------------- tokenizer
def train_tokenizer(texts: list[str], vocab_size: int):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    tok = Tokenizer(models.BPE(unk_token=None, fuse_unk=False, byte_fallback=False))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=2,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(texts, trainer=trainer, length=len(texts))
    bos_id = tok.token_to_id(BOS)
    # Like Llama 3's tokenizer.json: encode(add_special_tokens=True) prepends BOS.
    tok.post_processor = processors.Sequence([
        processors.ByteLevel(trim_offsets=False),
        processors.TemplateProcessing(
            single=f"{BOS}:0 $A:0",
            pair=f"{BOS}:0 $A:0 {BOS}:1 $B:1",
            special_tokens=[(BOS, bos_id)],
        ),
    ])
    return tok


# -------------------------------------------------------------------------------------------- model
class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x):  # as LlamaRMSNorm: normalise in fp32, scale in the input dtype
        dtype = x.dtype
        x = x.float()
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x.to(dtype)


def rope_cos_sin(seq_len: int, head_dim: int, theta: float, device=None):
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64, device=device).float() / head_dim))
    freqs = torch.outer(torch.arange(seq_len, device=device).float(), inv_freq)
    emb = torch.cat((freqs, freqs), dim=-1)  # HF's non-interleaved ("rotate_half") layout
    return emb.cos(), emb.sin()


def rotate_half(x):
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


class Attention(nn.Module):
    def __init__(self, cfg: dict):
        super().__init__()
        d, hd = cfg["hidden_size"], cfg["head_dim"]
        self.nh, self.nkv, self.hd = cfg["num_attention_heads"], cfg["num_key_value_heads"], hd
        self.q_proj = nn.Linear(d, self.nh * hd, bias=False)
        self.k_proj = nn.Linear(d, self.nkv * hd, bias=False)
        self.v_proj = nn.Linear(d, self.nkv * hd, bias=False)
        self.o_proj = nn.Linear(self.nh * hd, d, bias=False)

    def forward(self, x, cos, sin):
        b, t, _ = x.shape
        q = self.q_proj(x).view(b, t, self.nh, self.hd).transpose(1, 2)
        k = self.k_proj(x).view(b, t, self.nkv, self.hd).transpose(1, 2)
        v = self.v_proj(x).view(b, t, self.nkv, self.hd).transpose(1, 2)
        q = q * cos + rotate_half(q) * sin
        k = k * cos + rotate_half(k) * sin
        if self.nkv != self.nh:  # HF's repeat_kv: query head i reads kv head i // (nh / nkv)
            k = k.repeat_interleave(self.nh // self.nkv, dim=1)
            v = v.repeat_interleave(self.nh // self.nkv, dim=1)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.o_proj(y.transpose(1, 2).reshape(b, t, self.nh * self.hd))


class MLP(nn.Module):
    def __init__(self, cfg: dict):
        super().__init__()
        d, i = cfg["hidden_size"], cfg["intermediate_size"]
        self.gate_proj = nn.Linear(d, i, bias=False)
        self.up_proj = nn.Linear(d, i, bias=False)
        self.down_proj = nn.Linear(i, d, bias=False)

    def forward(self, x):
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class DecoderLayer(nn.Module):
    def __init__(self, cfg: dict):
        super().__init__()
        self.input_layernorm = RMSNorm(cfg["hidden_size"], cfg["rms_norm_eps"])
        self.self_attn = Attention(cfg)
        self.post_attention_layernorm = RMSNorm(cfg["hidden_size"], cfg["rms_norm_eps"])
        self.mlp = MLP(cfg)

    def forward(self, x, cos, sin):
        x = x + self.self_attn(self.input_layernorm(x), cos, sin)
        return x + self.mlp(self.post_attention_layernorm(x))


class Backbone(nn.Module):  # named like HF's LlamaModel so state_dict keys come out as "model.*"
    def __init__(self, cfg: dict):
        super().__init__()
        self.embed_tokens = nn.Embedding(cfg["vocab_size"], cfg["hidden_size"])
        self.layers = nn.ModuleList(DecoderLayer(cfg) for _ in range(cfg["num_hidden_layers"]))
        self.norm = RMSNorm(cfg["hidden_size"], cfg["rms_norm_eps"])


class TinyLlama(nn.Module):
    """LlamaForCausalLM with tied embeddings; parameter names match Hugging Face's."""

    def __init__(self, cfg: dict):
        super().__init__()
        self.cfg = cfg
        self.model = Backbone(cfg)
        cos, sin = rope_cos_sin(cfg["max_position_embeddings"], cfg["head_dim"], cfg["rope_theta"])
        self.register_buffer("rope_cos", cos, persistent=False)
        self.register_buffer("rope_sin", sin, persistent=False)

    def init_weights(self, generator: torch.Generator) -> None:
        std = self.cfg["initializer_range"]
        resid_std = std / math.sqrt(2 * self.cfg["num_hidden_layers"])  # GPT-2 style residual scaling
        for name, p in self.named_parameters():
            if name.endswith("norm.weight"):
                nn.init.ones_(p)
            elif name.endswith(("o_proj.weight", "down_proj.weight")):
                nn.init.normal_(p, 0.0, resid_std, generator=generator)
            else:
                nn.init.normal_(p, 0.0, std, generator=generator)

    def forward(self, ids):
        t = ids.shape[1]
        cos, sin = self.rope_cos[:t], self.rope_sin[:t]
        x = self.model.embed_tokens(ids)
        for layer in self.model.layers:
            x = layer(x, cos, sin)
        x = self.model.norm(x)
        return x @ self.model.embed_tokens.weight.t()  # tied lm_head

    @torch.no_grad()
    def greedy(self, ids: list[int], max_new_tokens: int, eos_id: int) -> list[int]:
        out = list(ids)
        for _ in range(max_new_tokens):
            window = out[-self.cfg["max_position_embeddings"]:]
            nxt = int(self(torch.tensor([window]))[0, -1].argmax())
            out.append(nxt)
            if nxt == eos_id:
                break
        return out[len(ids):]


# ------------------------------------------------------------------------------------------ training
def lr_at(step: int, total: int, warmup: int, peak: float, min_ratio: float) -> float:
    if step < warmup:
        return peak * (step + 1) / warmup
    progress = (step - warmup) / max(1, total - warmup)
    return peak * (min_ratio + (1 - min_ratio) * 0.5 * (1 + math.cos(math.pi * progress)))


@torch.no_grad()
def evaluate(model: TinyLlama, windows: torch.Tensor, batch_size: int) -> float:
    model.eval()
    total, n = 0.0, 0
    for i in range(0, len(windows), batch_size):
        w = windows[i:i + batch_size]
        logits = model(w[:, :-1])
        total += F.cross_entropy(logits.reshape(-1, logits.shape[-1]), w[:, 1:].reshape(-1), reduction="sum").item()
        n += w[:, 1:].numel()
    model.train()
    return total / n


def fixed_windows(stream: torch.Tensor, seq_len: int, count: int) -> torch.Tensor:
    """Up to `count` non-overlapping windows of seq_len + 1 tokens spread evenly over `stream`."""
    n = (len(stream) - 1) // seq_len
    if n < 1:
        raise SystemExit(f"not enough tokens ({len(stream)}) for one window of {seq_len + 1}")
    idx = torch.linspace(0, n - 1, steps=min(count, n)).round().long().unique()
    return torch.stack([stream[i * seq_len:i * seq_len + seq_len + 1] for i in idx.tolist()])


def encode_stream(tok, texts: list[str], bos_id: int, eos_id: int) -> torch.Tensor:
    ids: list[int] = []
    for enc in tok.encode_batch(texts, add_special_tokens=False):
        ids.append(bos_id)
        ids.extend(enc.ids)
        ids.append(eos_id)
    return torch.tensor(ids, dtype=torch.long)


def save_checkpoint(out: pathlib.Path, model: TinyLlama, tok, cfg: dict, dtype: torch.dtype, summary: dict) -> None:
    from safetensors.torch import save_file

    out.mkdir(parents=True, exist_ok=True)
    dtype_name = str(dtype).removeprefix("torch.")
    state = {k: v.detach().to(dtype).contiguous() for k, v in model.state_dict().items()}  # lm_head is tied: not saved
    save_file(state, str(out / "model.safetensors"), metadata={"format": "pt"})
    os.chmod(out / "model.safetensors", 0o644)  # safetensors creates it 0600; package data must be world-readable

    bos_id, eos_id = tok.token_to_id(BOS), tok.token_to_id(EOS)
    config = {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "vocab_size": cfg["vocab_size"],
        "hidden_size": cfg["hidden_size"],
        "intermediate_size": cfg["intermediate_size"],
        "num_hidden_layers": cfg["num_hidden_layers"],
        "num_attention_heads": cfg["num_attention_heads"],
        "num_key_value_heads": cfg["num_key_value_heads"],
        "head_dim": cfg["head_dim"],
        "hidden_act": "silu",
        "max_position_embeddings": cfg["max_position_embeddings"],
        "rms_norm_eps": cfg["rms_norm_eps"],
        "rope_theta": cfg["rope_theta"],
        "rope_scaling": None,
        "attention_bias": False,
        "attention_dropout": 0.0,
        "mlp_bias": False,
        "initializer_range": cfg["initializer_range"],
        "pretraining_tp": 1,
        "tie_word_embeddings": True,
        "use_cache": True,
        "bos_token_id": bos_id,
        "eos_token_id": eos_id,
        "torch_dtype": dtype_name,
    }
    (out / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    (out / "generation_config.json").write_text(
        json.dumps({"bos_token_id": bos_id, "eos_token_id": eos_id}, indent=2) + "\n")

    tok.save(str(out / "tokenizer.json"))
    added = {str(tok.token_to_id(t)): {"content": t, "lstrip": False, "normalized": False, "rstrip": False,
                                        "single_word": False, "special": True} for t in SPECIAL_TOKENS}
    tokenizer_config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": BOS,
        "eos_token": EOS,
        "pad_token": None,
        "unk_token": None,
        "add_bos_token": True,
        "add_eos_token": False,
        "clean_up_tokenization_spaces": False,
        "model_max_length": cfg["max_position_embeddings"],
        "model_input_names": ["input_ids", "attention_mask"],
        "added_tokens_decoder": added,
        "chat_template": CHAT_TEMPLATE,
    }
    (out / "tokenizer_config.json").write_text(json.dumps(tokenizer_config, indent=2) + "\n")
    (out / "special_tokens_map.json").write_text(json.dumps({"bos_token": BOS, "eos_token": EOS}, indent=2) + "\n")
    (out / "training_summary.json").write_text(json.dumps(summary, indent=2) + "\n")


def parse_args(argv=None):
    here = pathlib.Path(__file__).resolve().parent.parent
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", type=pathlib.Path, default=here / "streamer" / "default_model")
    p.add_argument("--loss-log", type=pathlib.Path, default=here / "docs" / "demo_model_loss.tsv")
    p.add_argument("--stdlib", type=pathlib.Path, default=pathlib.Path(sysconfig.get_paths()["stdlib"]))
    p.add_argument("--max-files", type=int, default=None, help="use only the first N files (smoke runs)")
    p.add_argument("--val-fraction", type=float, default=0.02)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--threads", type=int, default=2, help="torch.set_num_threads (results depend on it)")
    p.add_argument("--vocab-size", type=int, default=4096)
    p.add_argument("--hidden-size", type=int, default=256)
    p.add_argument("--intermediate-size", type=int, default=None, help="default: 8/3 * hidden, rounded to 64")
    p.add_argument("--num-layers", type=int, default=4)
    p.add_argument("--num-heads", type=int, default=4)
    p.add_argument("--num-kv-heads", type=int, default=2)
    p.add_argument("--max-position-embeddings", type=int, default=1024)
    p.add_argument("--rope-theta", type=float, default=10000.0)
    p.add_argument("--seq-len", type=int, default=512)
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--amp", choices=["bf16", "none"], default="bf16",
                   help="bf16 autocast for the matmuls (fp32 master weights); ~1.6x faster on CPUs with avx512_bf16")
    p.add_argument("--steps", type=int, default=1000)
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--min-lr-ratio", type=float, default=0.1)
    p.add_argument("--warmup", type=int, default=None, help="default: 5%% of --steps")
    p.add_argument("--weight-decay", type=float, default=0.1)
    p.add_argument("--grad-clip", type=float, default=1.0)
    p.add_argument("--log-every", type=int, default=10)
    p.add_argument("--eval-every", type=int, default=50)
    p.add_argument("--eval-windows", type=int, default=64)
    p.add_argument("--save-dtype", choices=["bfloat16", "float16", "float32"], default="bfloat16")
    p.add_argument("--sample-tokens", type=int, default=64, help="greedy tokens per sample prompt at the end")
    p.add_argument("--benchmark", type=int, default=0, metavar="N", help="time N training steps and exit")
    return p.parse_args(argv)


def main(argv=None) -> dict:
    args = parse_args(argv)
    t_start = time.time()
    torch.set_num_threads(args.threads)
    random.seed(args.seed)
    torch.manual_seed(args.seed)

    # ---- data
    files = stdlib_files(args.stdlib, args.max_files)
    if len(files) < 2:
        raise SystemExit(f"found {len(files)} usable .py files under {args.stdlib}")
    val = [(p, t) for p, t in files if is_validation(p, args.val_fraction, args.seed)]
    train = [(p, t) for p, t in files if not is_validation(p, args.val_fraction, args.seed)]
    if not val:  # tiny --max-files runs: hold out the last file
        val, train = train[-1:], train[:-1]
    print(f"data: {args.stdlib} -> {len(train)} train files ({sum(len(t) for _, t in train):,} chars), "
          f"{len(val)} validation files ({sum(len(t) for _, t in val):,} chars)", flush=True)
    print("validation files: " + ", ".join(p for p, _ in val), flush=True)

    # ---- tokenizer (trained on the training split only)
    t0 = time.time()
    tok = train_tokenizer([t for _, t in train], args.vocab_size)
    bos_id, eos_id = tok.token_to_id(BOS), tok.token_to_id(EOS)
    vocab_size = tok.get_vocab_size()
    train_ids = encode_stream(tok, [t for _, t in train], bos_id, eos_id)
    val_ids = encode_stream(tok, [t for _, t in val], bos_id, eos_id)
    n_chars = sum(len(t) for _, t in train)
    print(f"tokenizer: vocab {vocab_size}, {len(train_ids):,} train tokens ({n_chars / len(train_ids):.2f} chars/token), "
          f"{len(val_ids):,} validation tokens, {time.time() - t0:.1f}s", flush=True)

    # ---- model
    hidden = args.hidden_size
    inter = args.intermediate_size or int(64 * math.ceil(hidden * 8 / 3 / 64))
    cfg = {
        "vocab_size": vocab_size, "hidden_size": hidden, "intermediate_size": inter,
        "num_hidden_layers": args.num_layers, "num_attention_heads": args.num_heads,
        "num_key_value_heads": args.num_kv_heads, "head_dim": hidden // args.num_heads,
        "max_position_embeddings": args.max_position_embeddings, "rms_norm_eps": 1e-5,
        "rope_theta": args.rope_theta, "initializer_range": 0.02,
    }
    model = TinyLlama(cfg)
    model.init_weights(torch.Generator().manual_seed(args.seed))
    n_params = sum(p.numel() for p in model.parameters())
    n_embed = model.model.embed_tokens.weight.numel()
    print(f"model: {json.dumps(cfg)}", flush=True)
    print(f"parameters: {n_params:,} ({n_params - n_embed:,} without the tied embedding)", flush=True)

    decay = [p for n, p in model.named_parameters() if p.ndim >= 2]
    no_decay = [p for n, p in model.named_parameters() if p.ndim < 2]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": args.weight_decay},
                             {"params": no_decay, "weight_decay": 0.0}],
                            lr=args.lr, betas=(0.9, 0.95), eps=1e-8)
    steps = args.benchmark or args.steps
    warmup = args.warmup if args.warmup is not None else max(1, steps // 20)
    gen = torch.Generator().manual_seed(args.seed + 1)
    offsets = torch.arange(args.seq_len + 1)
    val_windows = fixed_windows(val_ids, args.seq_len, args.eval_windows)
    train_eval_windows = fixed_windows(train_ids, args.seq_len, args.eval_windows)

    log = None
    if not args.benchmark:
        args.loss_log.parent.mkdir(parents=True, exist_ok=True)
        log = open(args.loss_log, "w")
        log.write("step\ttokens\tlr\ttrain_loss\tval_loss\telapsed_s\n")

    # ---- train
    model.train()
    t_train = time.time()
    smooth = None
    val_loss = float("nan")
    for step in range(steps):
        lr = lr_at(step, steps, warmup, args.lr, args.min_lr_ratio)
        for g in opt.param_groups:
            g["lr"] = lr
        starts = torch.randint(0, len(train_ids) - args.seq_len - 1, (args.batch_size,), generator=gen)
        batch = train_ids[starts[:, None] + offsets]
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=args.amp == "bf16"):
            logits = model(batch[:, :-1])
        loss = F.cross_entropy(logits.float().reshape(-1, vocab_size), batch[:, 1:].reshape(-1))
        opt.zero_grad(set_to_none=True)
        loss.backward()
        if args.grad_clip:
            torch.nn.utils.clip_grad_norm_(model.parameters(), args.grad_clip)
        opt.step()
        lv = loss.item()
        smooth = lv if smooth is None else 0.95 * smooth + 0.05 * lv
        done = step + 1
        if args.benchmark:
            if step == 0:
                t_first = time.time()
            continue
        is_eval = done % args.eval_every == 0 or done == steps
        if is_eval:
            val_loss = evaluate(model, val_windows, args.batch_size)
        if done % args.log_every == 0 or is_eval or step == 0:
            el = time.time() - t_train
            val_str = f"{val_loss:.4f}" if is_eval else ""
            log.write(f"{done}\t{done * args.batch_size * args.seq_len}\t{lr:.6g}\t{lv:.4f}\t{val_str}\t{el:.1f}\n")
            log.flush()
            eta = el / done * (steps - done)
            print(f"step {done:5d}/{steps}  lr {lr:.2e}  loss {lv:.4f} (smoothed {smooth:.4f})"
                  + (f"  val {val_loss:.4f}" if is_eval else "") + f"  {el:.0f}s elapsed, eta {eta:.0f}s", flush=True)

    if args.benchmark:
        per = (time.time() - t_first) / max(1, steps - 1)
        print(f"benchmark: {per:.3f} s/step ({args.batch_size * args.seq_len / per:,.0f} tokens/s) "
              f"with {args.threads} thread(s); {args.steps} steps would take ~{per * args.steps / 60:.1f} min", flush=True)
        return {"seconds_per_step": per}
    log.close()
    train_seconds = time.time() - t_train

    # ---- final numbers, measured on the weights as shipped (rounded to the save dtype)
    save_dtype = getattr(torch, args.save_dtype)
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(p.to(save_dtype).float())
    final_train = evaluate(model, train_eval_windows, args.batch_size)
    final_val = evaluate(model, val_windows, args.batch_size)
    print(f"final ({args.save_dtype} weights): train loss {final_train:.4f}, validation loss {final_val:.4f}; "
          f"training took {train_seconds / 60:.1f} min", flush=True)

    samples = {}
    model.eval()
    for prompt in SAMPLE_PROMPTS:
        ids = tok.encode(prompt).ids  # with BOS
        new = model.greedy(ids, args.sample_tokens, eos_id)
        samples[prompt] = tok.decode(new, skip_special_tokens=True)
        print(f"--- greedy sample ---\n{prompt}{samples[prompt]}\n---", flush=True)

    summary = {
        "command": "python tools/train_demo_model.py " + " ".join(sys.argv[1:] if argv is None else argv),
        "seed": args.seed,
        "threads": args.threads,
        "python": platform.python_version(),
        "torch": torch.__version__,
        "train_files": len(train),
        "validation_files": [p for p, _ in val],
        "train_tokens": len(train_ids),
        "validation_tokens": len(val_ids),
        "parameters": n_params,
        "steps": steps,
        "batch_size": args.batch_size,
        "seq_len": args.seq_len,
        "amp": args.amp,
        "tokens_seen": steps * args.batch_size * args.seq_len,
        "peak_lr": args.lr,
        "final_train_loss": round(final_train, 4),
        "final_validation_loss": round(final_val, 4),
        "last_step_train_loss_smoothed": round(smooth, 4),
        "training_seconds": round(train_seconds, 1),
        "total_seconds": round(time.time() - t_start, 1),
    }
    save_checkpoint(args.out, model, tok, cfg, save_dtype, summary)
    print(f"wrote {args.out} ({sum(f.stat().st_size for f in args.out.iterdir()) / 2**20:.1f} MiB); "
          f"loss curve in {args.loss_log}", flush=True)
    summary["samples"] = samples
    return summary


if __name__ == "__main__":
    main()
