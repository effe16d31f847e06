"""The audio encoder Qwen2-Audio puts in front of its language model (Qwen2AudioEncoder): Whisper's encoder (two
convolutions over 30 s of log-mel features, the second of stride 2, learned positions, pre-LayerNorm layers with
an unbiased k projection) followed by an average pool of 2 and a final LayerNorm, so a clip of L valid mel frames
gives ((L - 1) // 2 + 1 - 2) // 2 + 1 feature rows (Qwen2AudioProcessor's count of <|AUDIO|> tokens).

transformers runs the layers over all 1,500 positions of the padded 30 s with the padding's keys masked; the rows
past the clip are then dropped. Here the layers run over the clip's positions alone: a key mask and a cut give the
same rows, and a 5 s clip costs a sixth of the attention and MLP work. The convolutions still read the padded
features whole, since the last valid position's window reaches into the padding.

Built from the vision encoders' layer (streamer/models/vision.py: plain linears, never packed, quantized or
LoRA'd): a Whisper layer is the same computation under other names (`_target` maps them).
"""
from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from streamer.models.vision import ACTIVATIONS, EncoderLayer, LayerNorm, VisionSpec, _holder, _param, load_fused

# Qwen2AudioEncoderConfig's defaults (Qwen2-Audio-7B's encoder: Whisper large-v3's shape).
AUDIO_DEFAULTS: dict[str, Any] = dict(num_mel_bins=128, encoder_layers=32, encoder_attention_heads=20,
                                      encoder_ffn_dim=5120, d_model=1280, activation_function="gelu",
                                      max_source_positions=1500, scale_embedding=False)
_EPS = 1e-5  # (nn.LayerNorm's default, as transformers builds them)


def audio_tokens(frames: int) -> int:
    """Feature rows (<|AUDIO|> tokens) of a clip whose features hold `frames` valid mel frames."""
    return ((frames - 1) // 2 + 1 - 2) // 2 + 1


class AudioTower(nn.Module):
    def __init__(self, audio_config: dict[str, Any]) -> None:
        super().__init__()
        c = {**AUDIO_DEFAULTS, **{k: v for k, v in audio_config.items() if v is not None}}
        if c["activation_function"] not in ACTIVATIONS:
            raise ValueError(f"unsupported audio activation_function {c['activation_function']!r}; supported: "
                             f"{sorted(ACTIVATIONS)}")
        width, heads = int(c["d_model"]), int(c["encoder_attention_heads"])
        if width % heads:
            raise ValueError(f"audio d_model {width} is not divisible by encoder_attention_heads {heads}")
        self.width, self.heads, self.ffn = width, heads, int(c["encoder_ffn_dim"])
        self.num_mel_bins = int(c["num_mel_bins"])
        self.positions = int(c["max_source_positions"])
        self.frames = 2 * self.positions  # mel frames: the second convolution halves them
        self.embed_scale = width ** 0.5 if c["scale_embedding"] else 1.0
        spec = VisionSpec("qwen2_audio_encoder", width, self.ffn, int(c["encoder_layers"]), heads,
                          0, 1, _EPS, c["activation_function"], 0)
        self.conv1 = _holder(_param(width, self.num_mel_bins, 3), _param(width))
        self.conv2 = _holder(_param(width, width, 3), _param(width))
        self.embed_positions = _holder(_param(self.positions, width))
        self.layers = nn.ModuleList(EncoderLayer(spec) for _ in range(spec.num_layers))
        self.layer_norm = LayerNorm(width, _EPS)

    def forward(self, features: torch.Tensor, frames: int) -> torch.Tensor:
        """One clip's log-mel features [mels, 3000] (padded to 30 s, as the feature extractor pads them), of which
        the first `frames` hold the clip -> its feature rows [audio_tokens(frames), width]."""
        if tuple(features.shape) != (self.num_mel_bins, self.frames):
            raise ValueError(f"the audio encoder takes [{self.num_mel_bins}, {self.frames}] log-mel features, got "
                             f"{list(features.shape)}")
        if not 3 <= frames <= self.frames:  # (3 frames make the first feature row)
            raise ValueError(f"an audio clip must hold 3 to {self.frames} mel frames, got {frames}")
        w = self.conv1.weight
        x = F.gelu(F.conv1d(features[None].to(w.device, w.dtype), w, self.conv1.bias, padding=1))
        x = F.gelu(F.conv1d(x, self.conv2.weight, self.conv2.bias, stride=2, padding=1))
        valid = (frames - 1) // 2 + 1  # positions the clip reaches after the stride-2 convolution
        x = x[0, :, :valid].T * self.embed_scale + self.embed_positions.weight[:valid]
        x = x[None]
        for layer in self.layers:
            x = layer(x)
        x = F.avg_pool1d(x.transpose(1, 2), 2, 2).transpose(1, 2)  # (drops an odd last position, as transformers)
        return self.layer_norm(x[0])

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        """Copy checkpoint tensors (transformers' names, relative to the tower) into the parameters; the k
        projection, which has no bias, gets a zero one. Returns the names of the parameters filled."""
        def with_k_bias() -> Iterable[tuple[str, torch.Tensor]]:
            for name, t in weights:
                yield name, t
                if name.endswith("self_attn.k_proj.weight"):
                    yield name.removesuffix("weight") + "bias", t.new_zeros(t.shape[0])
        return load_fused(dict(self.named_parameters()), with_k_bias(), _target, "audio tower")


_QKV = {"q_proj": 0, "k_proj": 1, "v_proj": 2}
# Whisper's layer names -> the vision layer's
_LAYER_NAMES = {"self_attn_layer_norm": "layer_norm1", "final_layer_norm": "layer_norm2", "fc1": "mlp.fc1",
                "fc2": "mlp.fc2", "self_attn.out_proj": "self_attn.out_proj"}


def _target(name: str) -> tuple[str, int | None]:
    """(our parameter name, q/k/v block) for a checkpoint name relative to the tower."""
    parts = name.split(".")
    if parts[0] != "layers" or len(parts) < 4:
        return name, None
    prefix, rest = ".".join(parts[:2]), ".".join(parts[2:-1])
    if rest.startswith("self_attn.") and parts[3] in _QKV:
        return f"{prefix}.self_attn.qkv_proj.{parts[-1]}", _QKV[parts[3]]
    return f"{prefix}.{_LAYER_NAMES.get(rest, rest)}.{parts[-1]}", None
