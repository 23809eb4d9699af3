"""A pretrained Llama-architecture causal language model in tf_keras, read from a GGUF file
(llama.cpp's format: `gguf_file`) or a keras-hub preset directory (what `save_to_preset` writes:
`keras_hub_preset`), without llama.cpp or keras-hub.

- `read_pretrained(path)`: the configuration (`LlamaConfig`), the byte-level BPE tokenizer
  (`bpe_tokenizer.BpeTokenizer`) and, read when loaded, the weights, from whichever format `path` holds.
- `llama_model(config)`: the architecture in tf_keras: token embedding, N blocks of RMSNorm ->
  grouped-query causal self-attention with rotary position embeddings -> residual, RMSNorm ->
  SwiGLU MLP -> residual, then a final RMSNorm and the LM head (the embedding, transposed, when the
  file has no `output.weight`). Projections are plain Dense layers; the custom layers (RMSNorm, the
  weightless rotary attention, the tied embedding, LoRA's adapted projection) are registered for
  model.keras, which names this module as theirs.
- `load_weights(model, pretrained)`: the file's tensors into that model.
"""

from __future__ import annotations

import math
import os
from typing import Any

import numpy as np

from madp.core.errors import OptionError
from madp.training import load_tensorflow, text
from madp.training.bpe_tokenizer import BpeTokenizer
from madp.training.gguf_file import check_gguf_file, read_gguf
from madp.training.keras_hub_preset import preset_json, read_preset
from madp.training.pretrained_files import LlamaConfig, Pretrained

tf = load_tensorflow()
import tf_keras  # noqa: E402


def read_pretrained(path: str) -> Pretrained:
    """The configuration and tokenizer of a Llama-architecture model in a GGUF file or a keras-hub
    preset directory (InputError if it is missing, unreadable, or holds another architecture or
    tokenizer); its weights are read by `layer_weights()`. Each format's reader checks what it reads
    before any model is built (`gguf_file.read_gguf`, `keras_hub_preset.read_preset`)."""
    if os.path.isdir(path):
        return read_preset(path)
    return read_gguf(path)


def check_pretrained_path(path: str) -> None:
    """`read_pretrained`'s first checks, which read no more than a header or config.json: a GGUF file,
    or a directory with a JSON config.json. `madp train` makes them before it hashes the model's files,
    so that a path holding no model is refused at once."""
    if os.path.isdir(path):
        preset_json(path, "config.json")
        return
    check_gguf_file(path)


@tf_keras.saving.register_keras_serializable(package="madp")
class RmsNorm(tf_keras.layers.Layer):
    """Llama's normalization: x / sqrt(mean(x^2) + epsilon) * scale, no centering and no bias."""

    def __init__(self, epsilon: float = 1e-5, **kwargs):
        super().__init__(**kwargs)
        self.epsilon = epsilon

    def build(self, input_shape) -> None:
        self.scale = self.add_weight(name="scale", shape=(int(input_shape[-1]),), initializer="ones")

    def normalized(self, x):
        """x / sqrt(mean(x^2) + epsilon), before the scale (ghost clipping records it); the mean of
        squares in float32 under mixed precision (bfloat16 keeps 8 bits of a sum of width squares)."""
        wide = tf.cast(x, tf.float32)
        scale = tf.math.rsqrt(tf.reduce_mean(tf.square(wide), axis=-1, keepdims=True) + self.epsilon)
        return tf.cast(wide * scale, x.dtype)

    def call(self, x):
        return self.normalized(x) * self.scale

    def get_config(self) -> dict:
        return {**super().get_config(), "epsilon": self.epsilon}


def _rotary_angles(length, head_dim: int, base: float):
    """(cos, sin) [length, head_dim] of position p and frequency base^(-2i/head_dim), i < head_dim/2,
    repeated for the two halves of a head that are rotated together."""
    frequencies = base ** (-np.arange(0, head_dim, 2, dtype=np.float64) / head_dim)
    angles = tf.cast(tf.range(length), tf.float32)[:, None] * tf.constant(frequencies, tf.float32)[None, :]
    angles = tf.concat([angles, angles], axis=-1)
    return tf.cos(angles), tf.sin(angles)


def _rotate_halves(x, cos, sin):
    """RoPE in Hugging Face's layout: x * cos + (-x2, x1) * sin, with x1, x2 the halves of a head."""
    first, second = tf.split(x, 2, axis=-1)
    cos, sin = tf.cast(cos, x.dtype), tf.cast(sin, x.dtype)  # bfloat16 under mixed precision
    return x * cos + tf.concat([-second, first], axis=-1) * sin


@tf_keras.saving.register_keras_serializable(package="madp")
class RotaryCausalAttention(tf_keras.layers.Layer):
    """Causal softmax attention of projected queries, keys and values ([n, T, heads * head_dim] and
    [n, T, kv_heads * head_dim]): rotary position embeddings on queries and keys, query head h reads
    K/V head h // (heads / kv_heads) (grouped-query attention). No weights: the projections around
    it are Dense layers."""

    def __init__(self, heads: int, kv_heads: int, head_dim: int, rope_base: float, **kwargs):
        super().__init__(**kwargs)
        self.heads, self.kv_heads, self.head_dim, self.rope_base = heads, kv_heads, head_dim, rope_base

    def call(self, inputs):
        queries, keys, values = inputs
        length = tf.shape(queries)[1]
        group = self.heads // self.kv_heads
        cos, sin = _rotary_angles(length, self.head_dim, self.rope_base)
        cos, sin = cos[:, None, :], sin[:, None, :]  # broadcast over heads
        q = _rotate_halves(tf.reshape(queries, [-1, length, self.heads, self.head_dim]), cos, sin)
        k = _rotate_halves(tf.reshape(keys, [-1, length, self.kv_heads, self.head_dim]), cos, sin)
        v = tf.reshape(values, [-1, length, self.kv_heads, self.head_dim])
        q = tf.reshape(q, [-1, length, self.kv_heads, group, self.head_dim])  # head h = (h // group, h % group)
        scores = tf.einsum("nqkgd,nskd->nkgqs", q, k) / math.sqrt(self.head_dim)
        causal = tf.linalg.band_part(tf.ones([length, length], tf.bool), -1, 0)  # query q sees keys s <= q
        scores = tf.where(causal, scores, tf.constant(-1e9, scores.dtype))
        # softmax over [n, heads, T, T], not [n, kv_heads, group, T, T]: TensorFlow's softmax takes at
        # most 5 dimensions, and per-example gradients (vectorized_map) add one
        # in float32 under mixed precision, as the loss's softmax
        rows = tf.reshape(tf.cast(scores, tf.float32), [-1, self.heads, length, length])
        weights = tf.reshape(tf.cast(tf.nn.softmax(rows), scores.dtype), tf.shape(scores))
        attended = tf.einsum("nkgqs,nskd->nqkgd", weights, v)
        return tf.reshape(attended, [-1, length, self.heads * self.head_dim])

    def get_config(self) -> dict:
        return {
            **super().get_config(),
            "heads": self.heads,
            "kv_heads": self.kv_heads,
            "head_dim": self.head_dim,
            "rope_base": self.rope_base,
        }


@tf_keras.saving.register_keras_serializable(package="madp")
class TiedEmbedding(tf_keras.layers.Layer):
    """A token embedding that is also the LM head: ids -> rows of E, or (reverse) vectors -> x E^T.
    Not a subclass of Embedding, so that clipping does not take its two uses for a lookup alone."""

    def __init__(self, vocabulary: int, width: int, **kwargs):
        super().__init__(**kwargs)
        self.vocabulary, self.width = vocabulary, width

    def build(self, input_shape) -> None:
        self.embeddings = self.add_weight(
            name="embeddings",
            shape=(self.vocabulary, self.width),
            initializer=tf_keras.initializers.RandomNormal(stddev=0.02),
        )

    def call(self, inputs, reverse: bool = False):
        if reverse:
            return tf.einsum("ntd,vd->ntv", inputs, self.embeddings)
        return tf.gather(self.embeddings, tf.cast(inputs, tf.int32))

    def get_config(self) -> dict:
        return {**super().get_config(), "vocabulary": self.vocabulary, "width": self.width}


@tf_keras.saving.register_keras_serializable(package="madp")
class LoraDense(tf_keras.layers.Layer):
    """A pretrained projection x W, frozen, plus a trainable low-rank update (LoRA, Hu et al. 2021):
    x W + (x A) B with A [n_in, rank] random and B [rank, n_out] zero, so the model starts as the
    pretrained one and only A and B are trained, clipped and noised. A and B are Dense layers, so
    ghost clipping's Dense formula gives their per-example gradient norms."""

    def __init__(self, units: int, rank: int, **kwargs):
        super().__init__(**kwargs)
        self.units, self.rank = units, rank
        self.base = tf_keras.layers.Dense(units, use_bias=False, trainable=False, name="base")
        # A uniform in +-1/sqrt(n_in) (the usual LoRA initialization), B zero
        spread = tf_keras.initializers.VarianceScaling(1 / 3, mode="fan_in", distribution="uniform")
        self.adapter_in = tf_keras.layers.Dense(rank, use_bias=False, kernel_initializer=spread, name="lora_a")
        self.adapter_out = tf_keras.layers.Dense(units, use_bias=False, kernel_initializer="zeros", name="lora_b")

    def call(self, x):
        return self.base(x) + self.adapter_out(self.adapter_in(x))

    def get_config(self) -> dict:
        return {**super().get_config(), "units": self.units, "rank": self.rank}


LORA_PROJECTIONS = ("attn_q", "attn_v")  # where --lora-rank puts adapters: the query and value projections


def _dense(units: int, name: str, activation: str | None = None, trainable: bool = True):
    # Llama has no biases
    return tf_keras.layers.Dense(units, use_bias=False, activation=activation, name=name, trainable=trainable)


def llama_model(config: LlamaConfig, length: int | None = None, lora_rank: int = 0):
    """A randomly initialized tf_keras model of the architecture: token ids [n, length] (int32) ->
    next-token logits [n, length, vocabulary]. Layers are named after the GGUF tensors they hold.
    With `lora_rank`, the query and value projections are `LoraDense` and nothing else is trainable."""
    c, trainable = config, not lora_rank  # with LoRA, only the adapters train

    def projection(units: int, block: int, kind: str, activation: str | None = None):
        name = f"blk_{block}_{kind}"
        if lora_rank and kind in LORA_PROJECTIONS:
            return LoraDense(units, lora_rank, name=name)
        return _dense(units, name, activation, trainable=trainable)

    ids = tf_keras.Input(shape=(length,), dtype=tf.int32, name="token_ids")
    if c.tied_output:
        embedding: Any = TiedEmbedding(c.vocabulary, c.width, name="token_embd", trainable=trainable)
    else:
        embedding = tf_keras.layers.Embedding(c.vocabulary, c.width, name="token_embd", trainable=trainable)
    x = embedding(ids)
    for i in range(c.layers):
        h = RmsNorm(c.norm_epsilon, name=f"blk_{i}_attn_norm", trainable=trainable)(x)
        q, k, v = (
            projection(c.heads * c.head_dim, i, "attn_q")(h),
            projection(c.kv_heads * c.head_dim, i, "attn_k")(h),
            projection(c.kv_heads * c.head_dim, i, "attn_v")(h),
        )
        attended = RotaryCausalAttention(c.heads, c.kv_heads, c.head_dim, c.rope_base, name=f"blk_{i}_attention")(
            [q, k, v]
        )
        out = projection(c.width, i, "attn_output")(attended)
        x = tf_keras.layers.Add(name=f"blk_{i}_attn_residual")([x, out])
        h = RmsNorm(c.norm_epsilon, name=f"blk_{i}_ffn_norm", trainable=trainable)(x)
        gated = tf_keras.layers.Multiply(name=f"blk_{i}_ffn_swiglu")(
            [projection(c.hidden, i, "ffn_gate", activation="silu")(h), projection(c.hidden, i, "ffn_up")(h)]
        )
        x = tf_keras.layers.Add(name=f"blk_{i}_ffn_residual")([x, projection(c.width, i, "ffn_down")(gated)])
    x = RmsNorm(c.norm_epsilon, name="output_norm", trainable=trainable)(x)
    logits = embedding(x, reverse=True) if c.tied_output else _dense(c.vocabulary, "output", trainable=trainable)(x)
    return tf_keras.Model(ids, logits, name="llama")


def load_weights(model, pretrained: Pretrained) -> None:
    """Set `llama_model(pretrained.config)`'s weights to the pretrained ones (InputError on a shape mismatch)."""
    for name, values in pretrained.layer_weights().items():
        layer = model.get_layer(name)
        layer = layer.base if isinstance(layer, LoraDense) else layer  # the adapters keep their initialization
        expected = [tuple(w.shape) for w in layer.get_weights()]
        if expected != [v.shape for v in values]:
            raise OptionError(
                "{pretrained} {0}: layer {1} expects shapes {2}, the file holds {3}",
                pretrained.path,
                name,
                expected,
                [v.shape for v in values],
            )
        layer.set_weights(values)


def pretrained_model(pretrained: Pretrained, length: int | None = None, lora_rank: int = 0):
    """`llama_model` of the pretrained configuration with its weights (and LoRA adapters of `lora_rank`)."""
    model = llama_model(pretrained.config, length, lora_rank)
    load_weights(model, pretrained)
    return model


def next_token_loss(targets, logits):
    """Per-example mean next-token cross-entropy (nats) over the example's tokens (targets >= 0)."""
    targets = tf.cast(targets, tf.int32)
    present = tf.cast(targets >= 0, tf.float32)
    logits = tf.cast(logits, tf.float32)  # a softmax over the vocabulary in float32 under mixed precision
    entropy = tf.nn.sparse_softmax_cross_entropy_with_logits(labels=tf.maximum(targets, 0), logits=logits)
    return tf.reduce_sum(entropy * present, axis=-1) / tf.maximum(tf.reduce_sum(present, axis=-1), 1.0)


def _token_metrics(total_nats: float, total_tokens: int) -> dict:
    """Mean next-token loss in nats and perplexity exp(loss), over `total_tokens` tokens."""
    nats = total_nats / max(total_tokens, 1)
    return {"loss": round(nats, 6), "perplexity": round(text.perplexity(nats), 4), "tokens": total_tokens}


def mean_token_loss(model, inputs: np.ndarray, targets: np.ndarray, rows_at_once: int = 8) -> dict:
    """`_token_metrics` of a model on (inputs, targets), a few rows at a time (logits are [rows, T, V])."""
    return _token_metrics(*text.summed_sequence_loss(model, next_token_loss, inputs, targets, rows_at_once))


def greedy_continuation(model, tokenizer: BpeTokenizer, prompt: str, new_tokens: int) -> str:
    """The prompt's most likely next `new_tokens` tokens, one at a time (no cache: for checks, not serving)."""
    ids = [tokenizer.bos, *tokenizer.encode(prompt)]
    for _ in range(new_tokens):
        logits = model(np.array([ids], np.int32), training=False)
        ids.append(int(np.argmax(np.asarray(logits)[0, -1])))
    return tokenizer.decode(ids[len(tokenizer.encode(prompt)) + 1 :])
