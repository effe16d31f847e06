"""GPT-2 (GPT2LMHeadModel: openai-community/gpt2, gpt2-medium, -large, -xl, distilgpt2, and the many models trained in
its shape). GPTBigCode's decoder (models/gpt_bigcode.py: learned absolute positions, biased LayerNorms, a GELU MLP,
the head tied to `wte`) without multi-query attention, so its differences from Llama are GPTBigCode's, and:

- every head has its own k/v, and `c_attn`'s rows are [q; k; v] over all heads (not per head);
- the linears are transformers' Conv1D: weights stored [in, out], transposed here as they load;
- the MLP's GELU is `gelu_new` (tanh-approximated) by default;
- `scale_attn_by_inverse_layer_idx`: layer i's scores also divided by i + 1; `reorder_and_upcast_attn` only
  changes where transformers computes in fp32 (attention here already is);
- the Hub's original checkpoints name tensors without the `transformer.` prefix (`h.0.attn.c_attn.weight`).
"""
from __future__ import annotations

import re
from typing import Iterable

import torch

from streamer.models.gpt_bigcode import GPTBigCodeBlock, GPTBigCodeForCausalLM
from streamer.models.gpt_neox import renamed_lora_parts

# Conv1D weights, stored [in, out]
_CONV1D = re.compile(r"\.(attn\.c_attn|attn\.c_proj|mlp\.c_fc|mlp\.c_proj)\.weight$")


class GPT2Block(GPTBigCodeBlock):
    default_act = "gelu_new"


class GPT2LMHeadModel(GPTBigCodeForCausalLM):
    decoder_layer = GPT2Block
    per_head_qkv = False

    def rename_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> Iterable[tuple[str, torch.Tensor]]:
        def linear_layout() -> Iterable[tuple[str, torch.Tensor]]:
            for name, t in weights:
                if not name.startswith(("transformer.", "lm_head.")):
                    name = "transformer." + name
                if _CONV1D.search(name) and isinstance(t, torch.Tensor):
                    t = t.t()
                yield name, t
        return super().rename_weights(linear_layout())

    def lora_parts(self, module: str, b: torch.Tensor) -> list[tuple[str, torch.Tensor]]:
        """PEFT's B is [out, r] on a Conv1D too (its fan_in_fan_out only transposes merged weights): handed over
        as the checkpoint stores the module's weight, transposed, for rename_weights to turn back."""
        conv1d = _CONV1D.search(f"{module}.weight") is not None
        return renamed_lora_parts(self, module, b.t() if conv1d else b)
