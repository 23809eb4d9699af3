"""Text models that learn nothing about the data before training: no vocabulary, no statistics.

A vocabulary or label set built from the private records would be released with the model, so
- the classifier reads hashed word unigrams and bigrams: FarmHash Fingerprint64 of each n-gram
  (TensorFlow's `to_hash_bucket_fast`, a public function, stable across processes and versions)
  into `buckets` rows of an embedding bag (its rows weighed 1 / sqrt(n)), then a softmax layer
  (fastText) whose gradient counts half in DP-SGD's clipping;
  with a public pretrained model (`--pretrained`), the bag is a linear model of the n-grams and a
  softmax layer on a frozen feature of the model's token embeddings (`TokenFeatures`) adds to it;
- the language model reads UTF-8 bytes (a public 256-symbol vocabulary plus a start symbol):
  a small causal Transformer predicting each next byte.
Text is checked here (UTF-8, not empty) so the trainer can name or skip the bad rows.
"""

from __future__ import annotations

import dataclasses
import math
import re
import sys
from typing import Protocol

import numpy as np

from madp.training import load_tensorflow

tf = load_tensorflow()
import tf_keras  # noqa: E402

START_BYTE = 256  # the LM's start symbol, after the 256 byte values
BYTE_VOCABULARY = 257
NOT_UTF8 = "text_not_utf8"
EMPTY_TEXT = "empty_text"
UNKNOWN_LABEL = "label_not_in_labels"
_WORD = r"[^\p{L}\p{N}]+"  # anything but letters and digits separates words
_LETTER_OR_DIGIT = re.compile(r"[^\W_]")  # what str.isalnum accepts, searched in C
RARE_TOKEN_RANK = 1000  # TokenFeatures: token t weighs t / (t + RARE_TOKEN_RANK)
COMMON_DIRECTIONS = 3  # TokenFeatures: the principal directions of the embeddings left out
NGRAMS, PRETRAINED = "ngrams", "pretrained"  # the classifier's inputs with --pretrained
# The classifier's bag width (--width). 64 rather than 32: under DP-SGD at epsilon 8 it lifted accuracy
# by 0.2 to 1.6 points (the mean of two noise seeds) on a second sample of PyPI's packages, CPython's
# changelog (1000 and 250 steps) and Debian's packages, and changed it by at most 0.2 without privacy
# (docs/history.md, "Choosing the text defaults on real text").
CLASSIFIER_WIDTH = 64
# The gradient of the classifier's softmax layer counts half in each example's clipped gradient and in the step
# (`ScaledGradientDense`; its output is unchanged): under DP-SGD most examples' gradients are clipped, the layer's
# few weights (width x classes) learn from every example while each bag row learns only from the texts that hold its
# n-gram, so the clip norm goes further on the bag. At epsilon 8 after 1000 steps of 256 it lifted accuracy by 0.3
# to 0.4 points (the mean of two noise seeds) on a second sample of PyPI's packages, CPython's changelog and
# Debian's packages, and moved it by -0.2 on the changelog after 250 steps; 0.35 did about as well after 1000 steps
# and worse after 250 (-0.7), 0.7 gained 0.1 to 0.3 on all four (docs/history.md, "Choosing the text defaults on
# real text"). Adam, the default, moves each weight by the ratio of its gradient's running mean to its root mean
# square, which a constant factor leaves as it was: without privacy only the L2 penalty (--l2), added to the halved
# gradient, weighs twice as much on the layer (-0.6 to +0.4 points on the same corpora).
CLASSIFIER_HEAD_GRADIENT_SCALE = 0.5
# The bytes of a text the classifier reads per n-gram it keeps (`hashed_ngrams`): an English word and its
# separator take about 6; a run of CJK characters between two punctuation marks, tens.
GRAM_BYTES = 256


# --- checking and encoding text -----------------------------------------------------------------


def text_problems(texts: np.ndarray) -> np.ndarray:
    """Per text (bytes): "" if usable, else why not (not UTF-8, or no letter or digit at all)."""
    problems = np.full(len(texts), "", dtype=object)
    for row, text in enumerate(texts):
        try:
            decoded = bytes(text).decode("utf-8")
        except UnicodeDecodeError:
            problems[row] = NOT_UTF8
            continue
        if not _LETTER_OR_DIGIT.search(decoded):
            problems[row] = EMPTY_TEXT
    return problems


def utf8_prefix(text: str | bytes, limit: int) -> bytes:
    """The first `limit` bytes of a text's UTF-8 (a str is encoded), less a character the cut would
    split (it started within the last 3 bytes); reads `limit` + 1 bytes (characters, for a str) at most."""
    head = text[: limit + 1]
    data = head.encode("utf-8") if isinstance(head, str) else bytes(head)
    if len(data) <= limit:
        return data
    end = limit
    while end > limit - 3 and data[end] & 0xC0 == 0x80:  # a continuation byte: its character began before
        end -= 1
    return data[:end]


def hashed_ngrams(texts, buckets: int, max_tokens: int, order: int, *, prefix: int) -> np.ndarray:
    """int32 [n, max_tokens]: 1 + FarmHash64(n-gram) mod (buckets - 1) of each text's lower-cased
    word n-grams of 1 to `order` words (unigrams, then bigrams, ...), each word cut to its first
    `prefix` characters (0: whole words), cut at max_tokens, padded with 0 (the bag skips 0).

    Each text is read up to its first max_tokens x GRAM_BYTES bytes (`utf8_prefix`). A text of
    max_tokens words or more has max_tokens n-grams, its first max_tokens words, so every text gives
    the n-grams of its whole self unless its first max_tokens words (and the start of the next) take
    more than GRAM_BYTES bytes each on average; the work on a text is bounded whatever its length."""
    cut = [utf8_prefix(value, max_tokens * GRAM_BYTES) for value in texts]
    text = tf.strings.lower(tf.constant(cut, tf.string), encoding="utf-8")
    words = tf.strings.split(tf.strings.strip(tf.strings.regex_replace(text, _WORD, " ")))
    if prefix:
        words = tf.strings.substr(words, 0, prefix, unit="UTF8_CHAR")
    grams = tf.concat([words, *(tf.strings.ngrams(words, n, separator=" ") for n in range(2, order + 1))], axis=1)
    ids = tf.strings.to_hash_bucket_fast(grams, buckets - 1) + 1
    return ids.to_tensor(0, shape=[None, max_tokens]).numpy().astype(np.int32)


class Tokenizer(Protocol):
    """What `TokenFeatures` needs of a tokenizer (`bpe_tokenizer.BpeTokenizer`): a text's token ids."""

    def encode(self, text: str | bytes, limit: int | None = None) -> list[int]: ...


@dataclasses.dataclass(frozen=True)
class TokenFeatures:
    """A text's feature from a pretrained model's token embeddings E [vocabulary, width], frozen: it
    is computed from the public model and the text alone, as the hashed n-grams are.

        f(text) = g / |g|,   g = sum over the text's tokens t of w_t R[t],
        R = (Ê - mean(Ê)) (I - V V^T),   w_t = t / (t + RARE_TOKEN_RANK),

    Ê the L2-normalized rows of E, mean(Ê) their mean over the vocabulary, V the COMMON_DIRECTIONS
    top principal directions of Ê - mean(Ê). A mean of token embeddings is dominated by what every
    text shares; centering, removing the common directions ("all-but-the-top") and down-weighing
    frequent tokens keep what tells texts apart. A byte-level BPE vocabulary numbers its tokens in
    merge order, most frequent first, so the id t stands in for a token frequency that no private
    text may supply. Chosen on CPython's changelog (benchmarks/text_defaults.py), among: no
    weighing, a rank of 300, 1000 or 3000, 0 or 3 directions removed (a mean over the training
    texts centered better but is a statistic of the private records)."""

    tokenizer: Tokenizer
    rows: np.ndarray  # w_t R[t], float32 [vocabulary, width]

    @classmethod
    def of(cls, tokenizer: Tokenizer, embeddings: np.ndarray) -> TokenFeatures:
        # float32 arrays (a Llama 3 table is 128k x 2048), the mean and covariance in float64
        table = np.asarray(embeddings, dtype=np.float32)
        unit = table / np.maximum(np.linalg.norm(table, axis=1, keepdims=True), 1e-12)
        mean = unit.mean(axis=0, dtype=np.float64)
        covariance = (unit.T @ unit).astype(np.float64) - len(unit) * np.outer(mean, mean)
        _, directions = np.linalg.eigh(covariance)  # ascending eigenvalues
        common = directions[:, -COMMON_DIRECTIONS:].astype(np.float32)
        centered = unit - mean.astype(np.float32)
        centered -= (centered @ common) @ common.T
        ids = np.arange(len(centered), dtype=np.float32)
        centered *= (ids / (ids + RARE_TOKEN_RANK))[:, None]
        return cls(tokenizer, centered)

    @property
    def width(self) -> int:
        return int(self.rows.shape[1])

    def __call__(self, texts, max_tokens: int) -> np.ndarray:
        """float32 [n, width]: f of each text's first max_tokens tokens (zeros for a text of none)."""
        features = np.zeros((len(texts), self.width), dtype=np.float32)
        for row, value in enumerate(texts):
            ids = self.tokenizer.encode(value, limit=max_tokens)  # reads only the prefix those tokens can come from
            if ids:
                features[row] = self.rows[ids].sum(axis=0)
        norms = np.linalg.norm(features, axis=1, keepdims=True)
        return features / np.where(norms > 0, norms, 1.0)


def byte_sequences(texts, max_length: int) -> tuple[np.ndarray, np.ndarray]:
    """(inputs, targets), int32 [n, max_length]: the first max_length bytes of each text as targets
    (-1 past its end), each shifted right behind the start symbol as inputs (0 past the end)."""
    n = len(texts)
    targets = np.full((n, max_length), -1, dtype=np.int32)
    for row, text in enumerate(texts):
        data = np.frombuffer(bytes(text)[:max_length], dtype=np.uint8)
        targets[row, : len(data)] = data
    inputs = np.concatenate([np.full((n, 1), START_BYTE, np.int32), np.maximum(targets[:, :-1], 0)], axis=1)
    return inputs, targets


# --- models -------------------------------------------------------------------------------------


@tf_keras.saving.register_keras_serializable(package="madp")
class EmbeddingBag(tf_keras.layers.Layer):
    """The embedding rows of a row's ids, id 0 (padding) left out, summed with weights w_t:
    sum_t w_t E[id_t]. `normalization` "sqrt" (the default) weighs each of a row's n ids 1 / sqrt(n),
    so the bag is E's rows against the row's L2-normalized presence vector, as a linear model on the
    same n-grams sees them; "mean" weighs them 1 / n (the layer of models saved before 2026-11-26).

    Why sqrt: each embedding row's gradient is w_t times the layer's output gradient, so for a text of
    n = 100 n-grams 1 / n makes it 10 times smaller than 1 / sqrt(n) does, and DP-SGD's noise, the
    same on every coordinate, drowns it: on CPython's changelog (benchmarks/text_defaults.py,
    k = 4, 1000 steps of 256, epsilon 8) the private classifier predicted the majority class only
    (49.7%, against 75.3% for a linear model); with 1 / sqrt(n), 56.9%, and 75.4% non-privately."""

    def __init__(self, buckets: int, dimension: int, normalization: str = "sqrt", **kwargs):
        super().__init__(**kwargs)
        if normalization not in ("sqrt", "mean"):
            raise ValueError(f"EmbeddingBag normalization must be 'sqrt' or 'mean', got {normalization!r}")
        self.buckets, self.dimension, self.normalization = buckets, dimension, normalization

    def build(self, input_shape) -> None:
        self.embeddings = self.add_weight(
            name="embeddings",
            shape=(self.buckets, self.dimension),
            initializer=tf_keras.initializers.RandomUniform(-0.05, 0.05),
        )

    def token_weights(self, ids):
        """w_t for each non-padding id (1 / sqrt(n) or 1 / n, n the row's non-padding ids), else 0."""
        present = tf.cast(ids > 0, tf.float32)
        count = tf.maximum(tf.reduce_sum(present, axis=1, keepdims=True), 1.0)
        return present / (tf.sqrt(count) if self.normalization == "sqrt" else count)

    def call(self, ids):
        rows = tf.gather(self.embeddings, ids)  # bfloat16 under mixed precision
        return tf.einsum("nt,ntd->nd", tf.cast(self.token_weights(ids), rows.dtype), rows)

    def get_config(self) -> dict:
        # a model saved without the key (before 2026-11-26) loads with the mean it was trained with
        return {
            **super().get_config(),
            "buckets": self.buckets,
            "dimension": self.dimension,
            "normalization": self.normalization,
        }

    @classmethod
    def from_config(cls, config: dict):
        return cls(**{"normalization": "mean", **config})


def _gradient_times(x, scale: float):
    """x, whose gradient is multiplied by `scale` on its way back."""

    @tf.custom_gradient
    def scaled(value):
        return tf.identity(value), lambda upstream: upstream * scale

    return scaled(tf.convert_to_tensor(x))  # a variable read here, outside, is a tensor inside


@tf_keras.saving.register_keras_serializable(package="madp")
class ScaledGradientDense(tf_keras.layers.Dense):
    """A Dense layer whose output is Dense's, and whose kernel's and bias's gradients are
    `gradient_scale` times Dense's: in DP-SGD its per-example gradient weighs gradient_scale^2 in the
    norm that is clipped, so the clip norm goes further on the model's other layers (and under noise
    its own signal is that much smaller). Clipped on the fast paths by the Dense formula, each output
    gradient times the scale (`madp.training.clipping`). The scale is at most 1: the clipping's guard
    against non-finite rows (`finite_rows_only`) looks at the layer's output gradients before the
    scale, which then cannot make a finite one infinite."""

    def __init__(self, units: int, gradient_scale: float = 1.0, **kwargs):
        super().__init__(units, **kwargs)
        if not 0 < gradient_scale <= 1:  # above 1, s d could overflow float32 where d does not
            raise ValueError(f"ScaledGradientDense gradient_scale must be in (0, 1], got {gradient_scale!r}")
        self._gradient_scale = float(gradient_scale)

    @property
    def gradient_scale(self) -> float:
        """The factor on the weights' gradients: read-only, as the clipping paths take it as checked."""
        return self._gradient_scale

    def call(self, inputs):
        x = tf.cast(inputs, self.compute_dtype)
        z = tf.tensordot(x, _gradient_times(self.kernel, self.gradient_scale), [[x.shape.rank - 1], [0]])
        z = z + _gradient_times(self.bias, self.gradient_scale) if self.use_bias else z
        return self.activation(z) if self.activation is not None else z

    def get_config(self) -> dict:
        return {**super().get_config(), "gradient_scale": self.gradient_scale}


@tf_keras.saving.register_keras_serializable(package="madp")
class PositionEmbedding(tf_keras.layers.Layer):
    """Adds a learned vector per position to a [n, length, dimension] sequence."""

    def build(self, input_shape) -> None:
        self.positions = self.add_weight(
            name="positions",
            shape=tuple(input_shape[1:]),
            initializer=tf_keras.initializers.RandomNormal(stddev=0.02),
        )

    def call(self, x):
        return x + self.positions[: tf.shape(x)[1]]


def softmax_loss(labels, logits):
    """Per-example cross-entropy of integer class labels."""
    return tf.nn.sparse_softmax_cross_entropy_with_logits(
        labels=tf.cast(tf.reshape(labels, [-1]), tf.int32), logits=logits
    )


def _next_byte_loss(targets, logits):
    """Per-example mean next-byte cross-entropy (nats) over the example's bytes (targets >= 0)."""
    targets = tf.cast(targets, tf.int32)
    present = tf.cast(targets >= 0, tf.float32)
    entropy = tf.nn.sparse_softmax_cross_entropy_with_logits(labels=tf.maximum(targets, 0), logits=logits)
    return tf.reduce_sum(entropy * present, axis=-1) / tf.maximum(tf.reduce_sum(present, axis=-1), 1.0)


def text_classifier(buckets: int, dimension: int, max_tokens: int, classes: int, pretrained_width: int = 0):
    """(model, loss): hashed n-gram ids [n, max_tokens] -> embedding bag -> softmax over classes (a
    `ScaledGradientDense` whose gradient counts CLASSIFIER_HEAD_GRADIENT_SCALE times).

    With pretrained_width, the inputs are {NGRAMS: the ids, PRETRAINED: `TokenFeatures` [n,
    pretrained_width]}, and the logits are a linear model of each: a bag of width `classes` (a
    linear model on the L2-normalized n-gram presence) plus a softmax layer on the frozen feature.
    Why not the bag of `dimension` into one softmax layer beside the feature: under DP-SGD's noise
    the bag's rows drift, its output grows into a random vector larger than the unit feature, and
    clipping, which scales by the softmax layer's input norm, then shrinks what the feature teaches
    (CPython's changelog, epsilon 8: 0.611 and 0.593 in two runs; this form: docs/benchmarks.md, Text models)."""
    if pretrained_width:
        ngrams = tf_keras.Input(shape=(max_tokens,), dtype=tf.int32, name=NGRAMS)
        features = tf_keras.Input(shape=(pretrained_width,), dtype=tf.float32, name=PRETRAINED)
        logits = tf_keras.layers.Add()(
            [EmbeddingBag(buckets, classes)(ngrams), tf_keras.layers.Dense(classes)(features)]
        )
        return tf_keras.Model({NGRAMS: ngrams, PRETRAINED: features}, logits), softmax_loss
    model = tf_keras.Sequential(
        [
            tf_keras.Input(shape=(max_tokens,), dtype=tf.int32),
            EmbeddingBag(buckets, dimension),
            ScaledGradientDense(classes, gradient_scale=CLASSIFIER_HEAD_GRADIENT_SCALE),
        ]
    )
    return model, softmax_loss


def byte_lm(max_length: int, dimension: int, layers: int, heads: int):
    """(model, loss): a causal Transformer over bytes, [n, max_length] inputs -> next-byte logits."""
    inputs = tf_keras.Input(shape=(max_length,), dtype=tf.int32)
    x = PositionEmbedding()(tf_keras.layers.Embedding(BYTE_VOCABULARY, dimension)(inputs))
    for _ in range(layers):
        attended = tf_keras.layers.MultiHeadAttention(heads, dimension // heads)(
            *[tf_keras.layers.LayerNormalization()(x)] * 2, use_causal_mask=True
        )
        x = x + attended
        hidden = tf_keras.layers.Dense(4 * dimension, activation="gelu")(tf_keras.layers.LayerNormalization()(x))
        x = x + tf_keras.layers.Dense(dimension)(hidden)
    logits = tf_keras.layers.Dense(BYTE_VOCABULARY)(tf_keras.layers.LayerNormalization()(x))
    return tf_keras.Model(inputs, logits), _next_byte_loss


# --- evaluation ---------------------------------------------------------------------------------


def classification_metrics(labels: np.ndarray, predicted: np.ndarray, names: list[str]) -> dict:
    """Accuracy, macro-F1 (mean over classes of 2 TP / (2 TP + FP + FN); 0 for a class never
    present nor predicted is left out) and per-class precision, recall, F1, support."""
    per_class, scores = {}, []
    for index, name in enumerate(names):
        tp = int(np.sum((predicted == index) & (labels == index)))
        fp = int(np.sum((predicted == index) & (labels != index)))
        fn = int(np.sum((predicted != index) & (labels == index)))
        f1 = 2 * tp / (2 * tp + fp + fn) if tp + fp + fn else None
        if f1 is not None:
            scores.append(f1)
        per_class[name] = {
            "precision": round(tp / (tp + fp), 6) if tp + fp else None,
            "recall": round(tp / (tp + fn), 6) if tp + fn else None,
            "f1": None if f1 is None else round(f1, 6),
            "support": tp + fn,
        }
    return {
        "accuracy": round(float(np.mean(predicted == labels)), 6) if len(labels) else None,
        "macro_f1": round(float(np.mean(scores)), 6) if scores else None,
        "per_class": per_class,
    }


def summed_sequence_loss(model, loss_fn, inputs: np.ndarray, targets: np.ndarray, rows_at_once: int) -> tuple:
    """(total loss in nats, tokens) of a sequence model over held-out texts, a few rows at a time
    (its outputs are [rows, length, vocabulary]): `loss_fn` gives each text's mean over its tokens
    (targets -1 past its end), which weighs by its length."""
    nats, count = 0.0, 0
    for start in range(0, len(inputs), rows_at_once):
        rows = targets[start : start + rows_at_once]
        per_text = np.asarray(loss_fn(rows, model(inputs[start : start + rows_at_once], training=False)))
        lengths = (rows >= 0).sum(axis=1)
        nats, count = nats + float(np.dot(per_text, lengths)), count + int(lengths.sum())
    return nats, count


def perplexity(nats: float) -> float:
    """exp(nats), a mean loss in nats as a perplexity; infinite beyond float's range (where math.exp
    raises: a model can be that bad), for the evaluation's finiteness check to name."""
    return math.exp(nats) if nats < math.log(sys.float_info.max) else math.inf


def byte_metrics(total_nats: float, total_bytes: int) -> dict:
    """Mean next-byte loss in nats, in bits per byte (nats / ln 2), and perplexity exp(nats)."""
    nats = total_nats / max(total_bytes, 1)
    return {
        "loss": round(nats, 6),
        "bits_per_byte": round(nats / math.log(2), 6),
        "perplexity": round(perplexity(nats), 4),
    }
