"""Tiny BERT-family encoder checkpoints for tests (random weights, saved by transformers), with a WordPiece tokenizer
trained here: BERT's [CLS] / [SEP] template (a pair's second text is token type 1), or RoBERTa's <s> / </s> one."""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Optional

import torch
from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers, processors, trainers

from tests.tokenizer_factory import CORPUS

_SPECIALS = {"bert": dict(pad="[PAD]", unk="[UNK]", cls="[CLS]", sep="[SEP]", mask="[MASK]"),
             "modernbert": dict(pad="[PAD]", unk="[UNK]", cls="[CLS]", sep="[SEP]", mask="[MASK]"),
             "roberta": dict(cls="<s>", pad="<pad>", sep="</s>", unk="<unk>", mask="<mask>")}
_SPECIALS["mpnet"] = _SPECIALS["t5"] = _SPECIALS["roberta"]


def make_wordpiece_tokenizer(out_dir: Path, family: str, vocab_size: int = 400) -> int:
    """A lower-casing WordPiece tokenizer with the family's special tokens and pair template; returns its size."""
    sp = _SPECIALS[family]
    tok = Tokenizer(models.WordPiece(unk_token=sp["unk"]))
    tok.normalizer = normalizers.BertNormalizer(lowercase=True)
    tok.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
    tok.train_from_iterator(CORPUS.splitlines(), trainers.WordPieceTrainer(vocab_size=vocab_size,
                                                                           special_tokens=list(sp.values())))
    cls, sep = sp["cls"], sp["sep"]
    ids = [(cls, tok.token_to_id(cls)), (sep, tok.token_to_id(sep))]
    if family == "bert":
        tok.post_processor = processors.TemplateProcessing(single=f"{cls} $A {sep}",
                                                           pair=f"{cls} $A {sep} $B:1 {sep}:1", special_tokens=ids)
    elif family == "modernbert":
        tok.post_processor = processors.TemplateProcessing(single=f"{cls} $A {sep}", pair=f"{cls} $A {sep} $B {sep}",
                                                           special_tokens=ids)
    else:
        tok.post_processor = processors.TemplateProcessing(single=f"{cls} $A {sep}",
                                                           pair=f"{cls} $A {sep} {sep} $B {sep}", special_tokens=ids)
    tok.decoder = decoders.WordPiece()
    out_dir.mkdir(parents=True, exist_ok=True)
    tok.save(str(out_dir / "tokenizer.json"))
    config = {f"{k}_token": v for k, v in sp.items()}
    config.update(tokenizer_class="BertTokenizerFast" if family == "bert" else "PreTrainedTokenizerFast",
                  do_lower_case=True, model_max_length=64)
    (out_dir / "tokenizer_config.json").write_text(json.dumps(config))
    return tok.get_vocab_size()


def make_encoder_checkpoint(out_dir: Path, family: str = "bert", labels: Optional[tuple[str, ...]] = None,
                            pooling: Optional[str] = None, seed: int = 0, masked_lm: bool = False,
                            **overrides: Any) -> Path:
    """family "bert" | "roberta" (saved as XLM-RoBERTa) | "modernbert" (4 layers, the first and last global, the
    others local with a window of 4 either way) | "mpnet" (320 positions: distances past its bias's last bucket, 128)
    | "t5" (a T5EncoderModel, GELU-gated, its head size apart from d_model / heads);
    `labels`: a `*ForSequenceClassification` with those labels, else the bare encoder (`*Model`, an embedding
    model), or with `masked_lm` the `*ForMaskedLM` (as some sentence-transformers checkpoints are saved). `pooling`
    ("mean" | "cls"): a sentence-transformers Pooling module declaring it. Weights drawn wide (std 0.2), so that every
    part of the model shows in the output."""
    import transformers as tf
    vocab = make_wordpiece_tokenizer(out_dir, family)
    sizes: dict[str, Any] = dict(vocab_size=vocab, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                                 intermediate_size=128, max_position_embeddings=64)
    if family == "roberta":  # (positions from pad + 1 = 2: two more rows; one token type, as XLM-R's checkpoints)
        sizes.update(max_position_embeddings=66, type_vocab_size=1, pad_token_id=1, bos_token_id=0, eos_token_id=2)
    if family == "modernbert":
        sizes.update(intermediate_size=96, num_hidden_layers=4, max_position_embeddings=128, local_attention=8,
                     pad_token_id=0, cls_token_id=2, bos_token_id=2, sep_token_id=3, eos_token_id=3)
    if family == "mpnet":
        sizes.update(max_position_embeddings=322, pad_token_id=1, bos_token_id=0, eos_token_id=2)
    if family == "t5":  # (T5's names; d_kv x heads wider than d_model, as T5 allows)
        sizes = dict(vocab_size=vocab, d_model=64, d_kv=24, d_ff=128, num_layers=2, num_heads=4, n_positions=320,
                     feed_forward_proj="gated-gelu", pad_token_id=1, eos_token_id=2, decoder_start_token_id=1)
    if labels:
        sizes.update(id2label=dict(enumerate(labels)), label2id={name: i for i, name in enumerate(labels)})
    sizes.update(overrides)
    prefix = {"bert": "Bert", "roberta": "XLMRoberta", "modernbert": "ModernBert", "mpnet": "MPNet", "t5": "T5"}[family]
    config = getattr(tf, f"{prefix}Config")(**sizes)
    head = "ForSequenceClassification" if labels else "ForMaskedLM" if masked_lm else "Model"
    if family == "t5":
        head = "EncoderModel"
    cls = getattr(tf, prefix + head)
    torch.manual_seed(seed)
    model = cls(config).eval()
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0.0, 0.2)
    model.save_pretrained(out_dir)
    if pooling is not None:
        (out_dir / "modules.json").write_text(json.dumps([
            {"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"},
            {"idx": 1, "name": "1", "path": "1_Pooling", "type": "sentence_transformers.models.Pooling"}]))
        (out_dir / "1_Pooling").mkdir(exist_ok=True)
        (out_dir / "1_Pooling" / "config.json").write_text(json.dumps({
            "word_embedding_dimension": 64, "pooling_mode_cls_token": pooling == "cls",
            "pooling_mode_mean_tokens": pooling == "mean"}))
    return out_dir


def make_embeddinggemma_checkpoint(out_dir: Path, seed: int = 0) -> Path:
    """EmbeddingGemma's shape, tiny: a `Gemma3TextModel` with bidirectional attention (two sliding layers, window
    4, then a global one), saved with its sentence-transformers modules: mean pooling, Dense 64 -> 96 -> 64 (no
    bias, identity), normalisation."""
    import transformers as tf
    from safetensors.torch import save_file
    vocab = make_wordpiece_tokenizer(out_dir, "bert")
    config = tf.Gemma3TextConfig(vocab_size=vocab, hidden_size=64, intermediate_size=128, num_hidden_layers=3,
                                 num_attention_heads=4, num_key_value_heads=2, head_dim=16, sliding_window=4,
                                 layer_types=["sliding_attention", "sliding_attention", "full_attention"],
                                 use_bidirectional_attention=True, max_position_embeddings=128,
                                 query_pre_attn_scalar=16, pad_token_id=0, bos_token_id=2, eos_token_id=3)
    torch.manual_seed(seed)
    model = tf.Gemma3TextModel(config).eval()
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0.0, 0.2)
    model.save_pretrained(out_dir)
    modules = [{"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"},
               {"idx": 1, "name": "1", "path": "1_Pooling", "type": "sentence_transformers.models.Pooling"}]
    (out_dir / "1_Pooling").mkdir(exist_ok=True)
    (out_dir / "1_Pooling" / "config.json").write_text(json.dumps({"word_embedding_dimension": 64,
                                                                   "pooling_mode_mean_tokens": True}))
    for i, (n_in, n_out) in enumerate([(64, 96), (96, 64)], start=2):
        folder = out_dir / f"{i}_Dense"
        folder.mkdir(exist_ok=True)
        (folder / "config.json").write_text(json.dumps({
            "in_features": n_in, "out_features": n_out, "bias": False,
            "activation_function": "torch.nn.modules.linear.Identity"}))
        save_file({"linear.weight": torch.randn(n_out, n_in) / n_in ** 0.5}, str(folder / "model.safetensors"))
        modules.append({"idx": i, "name": str(i), "path": folder.name, "type": "sentence_transformers.models.Dense"})
    modules.append({"idx": 4, "name": "4", "path": "4_Normalize", "type": "sentence_transformers.models.Normalize"})
    (out_dir / "modules.json").write_text(json.dumps(modules))
    return out_dir
