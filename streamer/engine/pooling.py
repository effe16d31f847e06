"""Pooling requests: embeddings and classification. A request that pools the model's final hidden states over its
prompt instead of generating.

The prompt is computed like any other (chunked, batched with generating requests, prefix-cached where that cannot
change the result); the runner sums, per request and per chunk, the hidden states the pooling method takes (the
last prompt token's, the first one's, or all of them), and the engine adds the chunks up and finishes the request
with the embedding once its prompt is done. No token is sampled.

A sequence-classification model (`*ForSequenceClassification`: classifiers, reward models, cross-encoder rerankers)
pools the last token, as transformers' does, and the runner applies its `score` head to that hidden state; the
engine turns the logits into probabilities (`Classifier`). A cross-encoder (one label) scores a pair of texts run
through it as one prompt (`encode_pair`).
"""
from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Optional

if TYPE_CHECKING:
    from streamer.tokenizer.tokenizer import Tokenizer

POOLING = ("last", "mean", "cls")
POOL_CODE = {"last": 1, "mean": 2, "cls": 3}  # InputBatch's per-row code (0: not pooling)
# What a pooling request computes: an embedding, a classifier's label probabilities, or a cross-encoder's score of a
# pair (a one-label classifier's, with the activation its sentence-transformers config names).
TASKS = ("embed", "classify", "score")


@dataclass
class PoolingParams:
    """pooling: "last" (the last prompt token's hidden state), "mean" (over all prompt tokens) or "cls" (the first
    token's); None = the model's own (sentence-transformers' pooling config, else "last"). normalize: L2-normalise
    the result. dimensions: keep the first N components (Matryoshka embeddings), normalised after cutting.
    task: one of TASKS; None = the model's own ("classify" for a sequence-classification model, else "embed").
    activation: classify / score: softmax over the labels (sigmoid for one label) as vLLM's; False = the raw
    logits."""

    pooling: Optional[str] = None
    normalize: bool = True
    dimensions: Optional[int] = None
    # keep only the prompt's last N tokens (as SamplingParams'); an encoder's first N - 1 and its last ([SEP])
    truncate_prompt_tokens: Optional[int] = None
    task: Optional[str] = None
    activation: bool = True

    def __post_init__(self) -> None:
        if self.pooling is not None and self.pooling not in POOLING:
            raise ValueError(f"pooling must be one of {POOLING}, got {self.pooling!r}")
        if self.task is not None and self.task not in TASKS:
            raise ValueError(f"task must be one of {TASKS}, got {self.task!r}")
        for name in ("normalize", "activation"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"{name} must be true or false, got {getattr(self, name)!r}")
        for name in ("dimensions", "truncate_prompt_tokens"):
            d = getattr(self, name)
            if d is not None and (not isinstance(d, int) or isinstance(d, bool) or d < 1):
                raise ValueError(f"{name} must be a positive integer, got {d!r}")

    def for_task(self, task: str) -> "PoolingParams":
        """These parameters for a call that does `task` (LLM.embed, classify, score), which a task set already
        must match."""
        if self.task not in (None, task):
            raise ValueError(f"task is {self.task!r}, but this call does {task!r}")
        return dataclasses.replace(self, task=task)


def default_pooling(model_dir: Path, fallback: str = "last") -> str:
    """The pooling a sentence-transformers checkpoint declares (`modules.json` -> its Pooling module's config),
    else `fallback`: "last" for a decoder (what decoder embedding models such as Qwen3-Embedding use), "cls" for an
    encoder (BERT's first token)."""
    try:
        modules = json.loads((model_dir / "modules.json").read_text())
        for m in modules:
            if m.get("type", "").endswith("Pooling"):
                cfg = json.loads((model_dir / m.get("path", "") / "config.json").read_text())
                for key, name in (("pooling_mode_lasttoken", "last"), ("pooling_mode_mean_tokens", "mean"),
                                  ("pooling_mode_cls_token", "cls")):
                    if cfg.get(key):
                        return name
    except (OSError, ValueError, AttributeError, TypeError):
        pass
    return fallback


def st_max_seq_length(model_dir: Path) -> Optional[int]:
    """sentence-transformers' `max_seq_length` (sentence_bert_config.json): it truncates every input there, so an
    embedding of a longer text would not be the one it computes. None if the checkpoint sets none."""
    try:
        value = json.loads((model_dir / "sentence_bert_config.json").read_text()).get("max_seq_length")
    except (OSError, ValueError, AttributeError):
        return None
    return int(value) if isinstance(value, int) and not isinstance(value, bool) and value > 0 else None


def embedding_width(model: Any) -> int:
    """The width of the final hidden states an embedding pools, which `dimensions` may not exceed: the model's
    `output_width` where its family narrows them after the layers (OPT-350m's project_out: 512 of 1024), else its
    hidden size."""
    return getattr(model, "output_width", None) or model.cfg.hidden_size


# sentence-transformers' Dense activations -> ours (its default, when a config names none, is Tanh)
_DENSE_ACTIVATIONS = {"torch.nn.modules.linear.Identity": "none", "torch.nn.modules.activation.Tanh": "tanh"}


@dataclass(frozen=True)
class DenseProjection:
    """sentence-transformers' Dense modules after the pooling (EmbeddingGemma's 768 -> 3072 -> 768), in order: each
    act(W x + b), applied to the pooled vector on the host (one small matrix-vector product a request), before
    `dimensions` cuts it and it is normalised."""

    layers: tuple[tuple[Any, Any, str], ...]  # (weight [out, in] float64, bias [out] or None, activation)

    @property
    def out_features(self) -> int:
        return int(self.layers[-1][0].shape[0])

    def __call__(self, vec: Any) -> Any:
        import numpy as np
        for weight, bias, act in self.layers:
            vec = weight @ vec + (bias if bias is not None else 0.0)
            if act == "tanh":
                vec = np.tanh(vec)
        return vec

    @classmethod
    def load(cls, model_dir: Path) -> Optional["DenseProjection"]:
        """The checkpoint's Dense modules (modules.json), None if it has none; ValueError for one we cannot run."""
        try:
            modules = json.loads((model_dir / "modules.json").read_text())
        except (OSError, ValueError):
            return None
        layers = []
        for m in modules if isinstance(modules, list) else []:
            if isinstance(m, dict) and str(m.get("type", "")).endswith(".Dense"):
                layers.append(_dense_layer(model_dir / m.get("path", "")))
        return cls(tuple(layers)) if layers else None


def _dense_layer(folder: Path) -> tuple[Any, Any, str]:
    import numpy as np
    cfg = json.loads((folder / "config.json").read_text())
    name = cfg.get("activation_function") or "torch.nn.modules.activation.Tanh"
    if name not in _DENSE_ACTIVATIONS:
        raise ValueError(f"{folder}: the Dense module's activation {name} is not supported "
                         f"({', '.join(_DENSE_ACTIVATIONS)} are)")
    from streamer.models.weight_files import first_existing, load_tensors
    tensors = load_tensors(first_existing(folder, "model.safetensors", "pytorch_model.bin"))
    weight = tensors["linear.weight"].double().numpy()
    if tuple(weight.shape) != (cfg["out_features"], cfg["in_features"]):
        raise ValueError(f"{folder}: linear.weight is {list(weight.shape)}, the config says "
                         f"[{cfg['out_features']}, {cfg['in_features']}]")
    bias = tensors.get("linear.bias")
    return np.ascontiguousarray(weight), None if bias is None else bias.double().numpy(), _DENSE_ACTIVATIONS[name]


def finish_embedding(total: Any, count: int, params: PoolingParams,
                     projection: Optional[DenseProjection] = None) -> list[float]:
    """The pooled vector from the summed hidden states (numpy float64 [H]): averaged, projected (the checkpoint's
    Dense modules), cut to `dimensions`, normalised. (numpy is imported here: `import streamer` stays light.)"""
    import numpy as np
    vec = total / max(count, 1)
    if projection is not None:
        vec = projection(vec)
    if params.dimensions is not None:
        vec = vec[:params.dimensions]
    if params.normalize:
        vec = vec / (np.linalg.norm(vec) or 1.0)
    return vec.tolist()


def finish_pooled(total: Any, count: int, params: PoolingParams, classifier: Optional["Classifier"],
                  projection: Optional[DenseProjection] = None) -> list[float]:
    """A pooling request's result from its summed chunks: the embedding, or (classify, score) the classifier's
    output from the logits the runner's head made of the last token's hidden state."""
    if params.task in ("classify", "score"):
        assert classifier is not None  # (resolve_pooling refuses these tasks on other models)
        return classifier.finish(total, params)
    return finish_embedding(total, count, params, projection)


# A cross-encoder's activation as sentence-transformers names it (config.json's sentence_transformers.activation_fn
# or sbert_ce_default_activation_function) -> ours; None: the classifier's own (vLLM reads them the same way).
_ST_ACTIVATIONS: dict[str, Optional[str]] = {"torch.nn.modules.linear.Identity": "none",
                                             "torch.nn.modules.activation.Sigmoid": None,
                                             "torch.nn.modules.activation.Softmax": None}


@dataclass(frozen=True)
class Classifier:
    """A sequence-classification model's output side: its labels and how its logits become probabilities, as vLLM
    does it: softmax over the labels, a sigmoid for one label; config.json's problem_type "regression" keeps the
    logits and "multi_label_classification" takes a sigmoid per label. A cross-encoder's score takes the activation
    its sentence-transformers config names, if any (`score_activation` None: one we do not know)."""

    architecture: str  # the checkpoint's, for messages
    labels: tuple[str, ...]  # config.json's id2label, by label id
    classify_activation: str  # "softmax" | "sigmoid" | "none"
    score_activation: Optional[str]
    pooling: str = "last"  # what its head reads: a decoder's last token, an encoder's first ("cls") or "mean"

    @classmethod
    def from_config(cls, raw: dict[str, Any], num_labels: Optional[int], pooling: str = "last",
                    ) -> Optional["Classifier"]:
        """None for a model that is not a sequence classifier (`num_labels` None)."""
        if num_labels is None:
            return None
        names = {int(k): str(v) for k, v in (raw.get("id2label") or {}).items()}
        own = "sigmoid" if num_labels == 1 else "softmax"
        problem = raw.get("problem_type")
        classify = {"regression": "none", "multi_label_classification": "sigmoid"}.get(problem or "", own)
        archs = raw.get("architectures") or ["a sequence classifier"]
        return cls(archs[0], tuple(names.get(i, f"LABEL_{i}") for i in range(num_labels)), classify,
                   _score_activation(raw, own), pooling)

    @property
    def num_labels(self) -> int:
        return len(self.labels)

    @property
    def is_cross_encoder(self) -> bool:
        """One label: /score and /rerank run each (query, document) pair through it."""
        return self.num_labels == 1

    def resolve(self, pooling: PoolingParams) -> PoolingParams:
        """A pooling request for this model, with its task (default "classify") and pooling filled in; ValueError
        for what it cannot do."""
        task = pooling.task or "classify"
        if task == "embed":
            raise ValueError(f"task 'embed': {self.architecture} is a sequence-classification model; it classifies "
                             "(or scores pairs, with one label) and makes no embeddings")
        if task == "score" and not self.is_cross_encoder:
            raise ValueError(f"task 'score' needs a cross-encoder (a classifier with one label); {self.architecture} "
                             f"has {self.num_labels} labels")
        if task == "score" and self.score_activation is None:
            raise ValueError(f"task 'score': the model's cross-encoder activation is not supported; supported: "
                             f"{', '.join(_ST_ACTIVATIONS)}")
        if pooling.pooling not in (None, self.pooling):
            which = {"last": "the last token", "cls": "the first token", "mean": "the mean of all tokens"}
            raise ValueError(f"pooling must be {self.pooling!r} for this sequence-classification model (its head "
                             f"reads {which[self.pooling]}), got {pooling.pooling!r}")
        if pooling.dimensions is not None:
            raise ValueError("dimensions is for embeddings; a classifier's output has one value per label")
        return dataclasses.replace(pooling, task=task, pooling=self.pooling)

    def finish(self, logits: Any, params: PoolingParams) -> list[float]:
        """The request's output from the head's logits (numpy float64 [labels])."""
        import numpy as np
        act = (self.score_activation if params.task == "score" else self.classify_activation) or "none"
        if not params.activation or act == "none":
            return logits.tolist()
        if act == "sigmoid":
            return (0.5 * (1.0 + np.tanh(0.5 * logits))).tolist()  # (a sigmoid that cannot overflow)
        e = np.exp(logits - logits.max())
        return (e / e.sum()).tolist()

    def label(self, probs: list[float]) -> str:
        """The most likely label's name (id2label)."""
        return self.labels[max(range(len(probs)), key=probs.__getitem__)]


def _score_activation(raw: dict[str, Any], own: str) -> Optional[str]:
    """The cross-encoder activation the sentence-transformers config names (`own` when it names none or the
    classifier's own), None for one we do not know."""
    name = ((raw.get("sentence_transformers") or {}).get("activation_fn")
            or raw.get("sbert_ce_default_activation_function"))
    if name is None:
        return own
    if name not in _ST_ACTIVATIONS:
        return None
    return _ST_ACTIVATIONS[name] or own


def encode_pair(tokenizer: "Tokenizer", text_1: str, text_2: str) -> list[int]:
    """A cross-encoder's prompt: both texts as one sequence (`Tokenizer.encode_pair`)."""
    for name, text in (("text_1", text_1), ("text_2", text_2)):
        if not isinstance(text, str):
            raise ValueError(f"{name} must be a string, got {type(text).__name__}")
    return tokenizer.encode_pair(text_1, text_2)


def pair_up(text_1: list[str], text_2: list[str]) -> list[tuple[str, str]]:
    """vLLM's score pairs: the one text_1 with each text_2, or text_1[i] with text_2[i]."""
    if len(text_1) == 1:
        return [(text_1[0], t) for t in text_2]
    if len(text_1) != len(text_2):
        raise ValueError(f"text_1 holds {len(text_1)} texts and text_2 {len(text_2)}: give one text_1, or as many "
                         "as text_2")
    return list(zip(text_1, text_2))
