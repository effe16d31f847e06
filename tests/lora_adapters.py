"""PEFT LoRA adapters for the tests' tiny checkpoints, written by `peft` itself, and PEFT's greedy output as the
oracle. PEFT starts B at zero (an adapter that changes nothing): the tests' adapters get random A and B."""
from __future__ import annotations

from pathlib import Path
from typing import Optional

import torch

ALL_LINEARS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def make_adapter(base: Path, out: Path, seed: int, r: int, alpha: float, targets: list[str],
                 std: float = 0.3, **lora_kwargs) -> Path:
    """A PEFT folder (adapter_config.json + adapter_model.safetensors) for the checkpoint `base`."""
    import peft
    import transformers as tf
    if (out / "adapter_config.json").exists():
        return out
    model = tf.AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32)
    cfg = peft.LoraConfig(r=r, lora_alpha=alpha, target_modules=targets, lora_dropout=0.0, **lora_kwargs)
    pm = peft.get_peft_model(model, cfg)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in pm.named_parameters():
            if "lora_" in name:
                p.copy_(torch.randn(p.shape, generator=g) * std)
    pm.save_pretrained(out)
    return out


def peft_greedy(base: Path, adapter: Optional[Path], prompts: list[list[int]], max_new_tokens: int,
                ) -> list[list[int]]:
    """transformers + PEFT greedy continuations (fp32, one prompt at a time, EOS banned as `ignore_eos` would)."""
    import peft
    import transformers as tf
    model = tf.AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32)
    if adapter is not None:
        model = peft.PeftModel.from_pretrained(model, adapter)
    model.eval()
    outs = []
    with torch.no_grad():
        for p in prompts:
            ids = torch.tensor([p])
            gen = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_new_tokens,
                                 min_new_tokens=max_new_tokens, do_sample=False, pad_token_id=0)
            outs.append(gen[0, len(p):].tolist())
    return outs
