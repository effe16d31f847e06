#!/usr/bin/env python3
"""Train an EAGLE-3 head for the embedded demo model, so that EAGLE drafting can be measured on a real pair
(no trained head for any model can be downloaded here).

The head reads three of the demo model's residual streams (the inputs of layers 1, 2 and 3: `fc` fuses them) and
the embedding of the next token, and is trained to match the demo model's own next-token distribution. Training
unrolls it for `--ttt` steps as it drafts (EAGLE-3's "training-time test"): step s drafting from position r + s
reads the head's own output feature of step s - 1 and attends to step 0's keys up to r and to one key of each later
step, what the runner's passes see. The data is the demo model's training text (the stdlib's
source, tools/train_demo_model.py), in windows of `--seq-len` tokens.

    python tools/train_eagle_head.py --out /tmp/demo-eagle3 --steps 300    # ~10 min on 2 idle cores
    streamer generate --speculative-model /tmp/demo-eagle3 --num-speculative-tokens 3 --prompt "def f(x):"

The folder is an EAGLE-3 checkpoint in the released layout (config.json with LlamaForCausalLMEagle3,
`midlayer.*`, `fc`, `norm`, `lm_head`, `d2t` / `t2d`; the embeddings are the target's).
"""
from __future__ import annotations

import argparse
import json
import pathlib
import sys
import sysconfig
import time

import torch
import torch.nn as nn
import torch.nn.functional as F

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tools"))

from train_demo_model import (  # noqa: E402
    MLP,
    RMSNorm,
    TinyLlama,
    encode_stream,
    is_validation,
    rope_cos_sin,
    rotate_half,
    stdlib_files,
)

AUX = [1, 2, 3]  # the demo model's 4 layers: EAGLE-3's default (2, L // 2, L - 3) would read layer 2 twice


def load_target(folder: pathlib.Path) -> TinyLlama:
    from safetensors.torch import load_file
    cfg = json.loads((folder / "config.json").read_text())
    model = TinyLlama(cfg)
    weights = {k: v.float() for k, v in load_file(folder / "model.safetensors").items()}
    model.load_state_dict(weights)
    return model.eval().requires_grad_(False)


@torch.no_grad()
def target_pass(model: TinyLlama, ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(the AUX layers' input streams, concatenated [B, T, 3H]; the next-token log-probabilities [B, T, V])."""
    t = ids.shape[1]
    cos, sin = model.rope_cos[:t], model.rope_sin[:t]
    x = model.model.embed_tokens(ids)
    aux = []
    for i, layer in enumerate(model.model.layers):
        if i in AUX:
            aux.append(x)
        x = layer(x, cos, sin)
    logits = model.model.norm(x) @ model.model.embed_tokens.weight.t()
    return torch.cat(aux, -1), logits.log_softmax(-1)


class Eagle3Head(nn.Module):
    """The head's layer, as streamer/models/eagle.py runs it, over [B, T] positions; attention takes keys and values
    given from outside (the training-time test's)."""

    def __init__(self, cfg: dict):
        super().__init__()
        h, hd = cfg["hidden_size"], cfg["head_dim"]
        self.nh, self.nkv, self.hd = cfg["num_attention_heads"], cfg["num_key_value_heads"], hd
        self.fc = nn.Linear(3 * h, h, bias=False)
        self.input_layernorm = RMSNorm(h, cfg["rms_norm_eps"])
        self.hidden_norm = RMSNorm(h, cfg["rms_norm_eps"])
        self.post_attention_layernorm = RMSNorm(h, cfg["rms_norm_eps"])
        self.norm = RMSNorm(h, cfg["rms_norm_eps"])
        self.q_proj = nn.Linear(2 * h, self.nh * hd, bias=False)
        self.k_proj = nn.Linear(2 * h, self.nkv * hd, bias=False)
        self.v_proj = nn.Linear(2 * h, self.nkv * hd, bias=False)
        self.o_proj = nn.Linear(self.nh * hd, h, bias=False)
        self.mlp = MLP(cfg)
        self.lm_head = nn.Linear(h, cfg["vocab_size"], bias=False)

    def qkv(self, embeds: torch.Tensor, feature: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor):
        b, t, _ = embeds.shape
        a = torch.cat([self.input_layernorm(embeds), self.hidden_norm(feature)], -1)
        q = self.q_proj(a).view(b, t, self.nh, self.hd).transpose(1, 2)
        k = self.k_proj(a).view(b, t, self.nkv, self.hd).transpose(1, 2)
        v = self.v_proj(a).view(b, t, self.nkv, self.hd).transpose(1, 2)
        q, k = q * cos + rotate_half(q) * sin, k * cos + rotate_half(k) * sin
        return q, k.repeat_interleave(self.nh // self.nkv, 1), v.repeat_interleave(self.nh // self.nkv, 1)

    def rest(self, feature: torch.Tensor, q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor,
             mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Attention over the given keys, the MLP: (logits, the output feature)."""
        b, _, t, _ = q.shape
        y = F.scaled_dot_product_attention(q, keys, values, attn_mask=mask)
        x = feature + self.o_proj(y.transpose(1, 2).reshape(b, t, self.nh * self.hd))
        pre = x + self.mlp(self.post_attention_layernorm(x))
        return self.lm_head(self.norm(pre)), pre


def ttt_masks(t: int, steps: int) -> list[torch.Tensor]:
    """Row r of step s drafts from position r + s (row r of step 0 at r reads the target's feature). Step s's
    [T, (s + 1) * T] mask over [step 0's keys, ..., step s's keys]: step 0's up to position r, and one key of each
    later step, its row r: what the runner's pass s attends to."""
    q = torch.arange(t)[:, None]
    k = torch.arange(t)[None]
    return [torch.cat([k <= q] + [k == q] * s, 1) for s in range(steps)]


def loss_of(head: Eagle3Head, target: TinyLlama, ids: torch.Tensor, steps: int) -> tuple[torch.Tensor, list[float]]:
    """The unrolled steps' mean soft cross-entropy against the target, and each step's top-1 agreement."""
    aux, target_lp = target_pass(target, ids)
    t = ids.shape[1] - steps  # rows with a label at every step
    cos, sin = rope_cos_sin(t + steps, head.hd, target.cfg["rope_theta"])
    embed = target.model.embed_tokens
    feature = head.fc(aux[:, :t])
    keys, values, total, agree = [], [], 0.0, []
    for s, mask in enumerate(ttt_masks(t, steps)):
        # row r at position r + s reads the token at r + s + 1 and drafts the one at r + s + 2
        q, k, v = head.qkv(embed(ids[:, s + 1:s + 1 + t]), feature, cos[s:s + t], sin[s:s + t])
        keys.append(k)
        values.append(v)
        logits, feature = head.rest(feature, q, torch.cat(keys, 2), torch.cat(values, 2), mask)
        want = target_lp[:, s + 1:s + 1 + t]  # the target's distribution for that token
        total = total + -(want.exp() * logits.log_softmax(-1)).sum(-1).mean()
        agree.append((logits.argmax(-1) == want.argmax(-1)).float().mean().item())
    return total / steps, agree


def save(out: pathlib.Path, head: Eagle3Head, cfg: dict) -> None:
    from safetensors.torch import save_file
    out.mkdir(parents=True, exist_ok=True)
    vocab = cfg["vocab_size"]
    sd = {k: v.detach().to(torch.bfloat16).contiguous() for k, v in head.state_dict().items()}
    names = {"fc.weight": "fc.weight", "norm.weight": "norm.weight", "lm_head.weight": "lm_head.weight"}
    weights = {}
    for k, v in sd.items():
        if k in names:
            weights[names[k]] = v
        elif k.startswith("mlp."):
            weights["midlayer." + k] = v
        elif k.endswith("_proj.weight"):
            weights["midlayer.self_attn." + k] = v
        else:
            weights["midlayer." + k] = v
    weights["d2t"] = torch.zeros(vocab, dtype=torch.int64)
    weights["t2d"] = torch.ones(vocab, dtype=torch.bool)
    save_file(weights, out / "model.safetensors", metadata={"format": "pt"})
    config = {"architectures": ["LlamaForCausalLMEagle3"], "model_type": "llama", "hidden_size": cfg["hidden_size"],
              "intermediate_size": cfg["intermediate_size"], "num_attention_heads": cfg["num_attention_heads"],
              "num_key_value_heads": cfg["num_key_value_heads"], "head_dim": cfg["head_dim"], "num_hidden_layers": 1,
              "vocab_size": vocab, "draft_vocab_size": vocab, "rms_norm_eps": cfg["rms_norm_eps"],
              "rope_theta": cfg["rope_theta"], "max_position_embeddings": cfg["max_position_embeddings"],
              "hidden_act": "silu", "tie_word_embeddings": False, "torch_dtype": "bfloat16",
              "eagle_config": {"eagle_aux_hidden_state_layer_ids": AUX}}
    (out / "config.json").write_text(json.dumps(config, indent=2) + "\n")


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--target", type=pathlib.Path, default=ROOT / "streamer" / "default_model")
    p.add_argument("--out", type=pathlib.Path, required=True)
    p.add_argument("--steps", type=int, default=300)
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--seq-len", type=int, default=256)
    p.add_argument("--ttt", type=int, default=3, help="drafting steps unrolled in training")
    p.add_argument("--lr", type=float, default=2e-3)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--max-files", type=int, default=None, help="read only this many stdlib files (smoke runs)")
    args = p.parse_args(argv)
    torch.manual_seed(args.seed)
    target = load_target(args.target)
    cfg = target.cfg
    from tokenizers import Tokenizer
    tok = Tokenizer.from_file(str(args.target / "tokenizer.json"))
    files = stdlib_files(pathlib.Path(sysconfig.get_paths()["stdlib"]), args.max_files)
    train = [t for path, t in files if not is_validation(path, 0.02, 0)]
    stream = encode_stream(tok, train, tok.token_to_id("<|begin_of_text|>"), tok.token_to_id("<|end_of_text|>"))
    head = Eagle3Head(cfg)
    with torch.no_grad():  # start near the target: its own output norm and head
        head.lm_head.weight.copy_(target.model.embed_tokens.weight)
        head.norm.weight.copy_(target.model.norm.weight)
    opt = torch.optim.AdamW(head.parameters(), lr=args.lr, betas=(0.9, 0.95), weight_decay=0.0)
    gen = torch.Generator().manual_seed(args.seed)
    span = args.seq_len + args.ttt + 1
    t0 = time.time()
    for step in range(args.steps):
        lr = args.lr * min(1.0, (step + 1) / 20) * (0.1 + 0.9 * (1 - step / args.steps))
        for g in opt.param_groups:
            g["lr"] = lr
        starts = torch.randint(0, len(stream) - span, (args.batch_size,), generator=gen)
        ids = stream[starts[:, None] + torch.arange(span)]
        loss, agree = loss_of(head, target, ids, args.ttt)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(head.parameters(), 1.0)
        opt.step()
        if step % 20 == 0 or step == args.steps - 1:
            print(f"step {step + 1}/{args.steps} loss {loss.item():.3f} top-1 agreement by step "
                  + " ".join(f"{a:.2f}" for a in agree) + f"  {time.time() - t0:.0f}s", flush=True)
    save(args.out, head, cfg)
    print(f"wrote {args.out}", flush=True)


if __name__ == "__main__":
    main()
