"""Ghost clipping's norm formulas: for each variable of a tapped layer call, its per-example
gradient g_i as a product of the row's recorded inputs and output gradients (a `Piece`), which gives
||g_i||^2 (`squares`) and the clipped sum sum_i f_i g_i (`clipped_sum`) without forming g_i
(A_i: a row's inputs at its T positions, [T, p]; D_i: the output gradients there):
- Dense and EinsumDense kernels: g_i = A_i^T D_i, ||g_i||^2 = ||a_i||^2 ||d_i||^2 for one
  position, else <A_i A_i^T, D_i D_i^T>_F or ||A_i^T D_i||^2, whichever costs less;
  biases: g_i = sum_t d_it; a ScaledGradientDense's D_i are its output gradients times its scale;
- Embedding: g_i = sum_t onehot(id_it) d_it^T, ||g_i||^2 = sum_{t,s} [id_it = id_is] d_it.d_is;
- EmbeddingBag (output sum_t w_it E[id_it]): sum_v c_iv e_v d_i^T with c_iv the summed weight
  of id v in row i: ||g_i||^2 = ||d_i||^2 sum_v c_iv^2;
- LayerNormalization: gamma sum_t x_hat_it * d_it, beta sum_t d_it (x_hat the normalized input);
  RmsNorm: scale sum_t x_hat_it * d_it (x_hat = x / sqrt(mean(x^2) + eps)); PositionEmbedding: d_i;
- TiedEmbedding, looked up (L_i, as Embedding) and the LM head (logits H_i E^T: O_i = A_i^T H_i,
  A_i the logits' gradients): ||L_i + O_i||^2 = ||L_i||^2 + ||O_i||^2 + 2 sum_{t,s} A_i[s, id_it]
  (h_is . d_it).
The sums whose terms cancel where a row's positions pull its gradient in opposite directions
(ghost norms, lookups of one id at several positions, the tied head's cross term) are formed in
float64 and bounded above by the most rounding can have taken off them (`_cancelling`), and the
clipped sums of those pieces are formed in float64 too: no row adds more than C.
A layer called several times adds its calls' gradients (positions concatenated: `merged_piece`).
"""

from __future__ import annotations

import dataclasses
import functools
import math
from collections.abc import Callable
from typing import Any

from madp.training import load_tensorflow
from madp.training.pretrained import RmsNorm, TiedEmbedding
from madp.training.text import EmbeddingBag, PositionEmbedding, ScaledGradientDense

tf = load_tensorflow()
import keras  # noqa: E402  (Keras 3: `import keras` beside TensorFlow's legacy tf_keras)
import tf_keras  # noqa: E402

# Each layer kind of both Kerases: tf_keras and Keras 3 layers of a kind have the same weights and
# call, so one norm formula serves both.
DENSE = (tf_keras.layers.Dense, keras.layers.Dense)
EINSUM_DENSE = (tf_keras.layers.EinsumDense, keras.layers.EinsumDense)
EMBEDDING = (tf_keras.layers.Embedding, keras.layers.Embedding)
LAYER_NORMALIZATION = (tf_keras.layers.LayerNormalization, keras.layers.LayerNormalization)


def bag_weight_squares(bag: EmbeddingBag, ids):
    """sum_v c_iv^2 per row, c_iv the summed weight of id v in row i. The bag weighs every id of a row
    alike (w_i), so c_iv = w_i k_iv with k_iv the copies of v, and sum_v k_v^2 = sum_t (2 r_t + 1)
    over the row's ids, r_t the copies of id_t before it once the row is sorted."""
    ordered = tf.sort(ids, axis=1)
    earlier = tf.range(tf.shape(ordered)[1]) - tf.searchsorted(ordered, ordered, side="left")
    weights = bag.token_weights(ordered)
    return tf.reduce_sum(tf.square(weights) * (2.0 * tf.cast(earlier, tf.float32) + 1.0), axis=1)


def output_gradients(layer, d):
    """A Dense layer's output gradients as its weights' gradients take them: times a
    ScaledGradientDense's scale (its kernel's g_i = a_i (s d_i)^T, its bias's s d_i)."""
    return d * layer.gradient_scale if isinstance(layer, ScaledGradientDense) else d


def bag_gradient(bag: EmbeddingBag, ids, scaled, later_layers, later_deltas, factor):
    """sum_i sum_t w_it e_(id_it) d_i^T (rows already scaled by their clip factors), scattered row by
    token. A next Dense layer with K of fewer units than the bag's width gets its own output
    gradients scattered instead, then times K^T (d_i = d'_i K^T, as the bag feeds it linearly): the
    scatter, the costly part, moves fewer numbers."""
    narrow, kernel = scaled, None
    if later_layers and later_layers[0].units < bag.dimension:
        narrow, kernel = later_deltas[0] * factor[:, None], later_layers[0].kernel
    token_rows = tf.reshape(bag.token_weights(ids)[:, :, None] * narrow[:, None, :], [-1, narrow.shape[-1]])
    summed = tf.math.unsorted_segment_sum(token_rows, tf.reshape(ids, [-1]), bag.buckets)
    return summed if kernel is None else tf.matmul(summed, kernel, transpose_b=True)


def einsum_axes(equation: str, rank: int) -> tuple[str, str, str]:
    """(input, kernel, output) axis letters of an EinsumDense equation, "..." spelled out as the
    input's leading axes (rank: the input's)."""
    inputs, rest = equation.split(",")
    kernel, output = rest.split("->")
    if "..." in inputs:
        spare = [c for c in "ABCDEFGHIJKLMNOPQRSTUVWXYZ" if c not in equation]
        filler = "".join(spare[: rank - len(inputs) + 3])
        inputs, output = inputs.replace("...", filler), output.replace("...", filler)
    return inputs, kernel, output


def layer_norm_shape(layer, rank: int) -> list[int]:
    """The shape gamma and beta broadcast to, from the first normalized axis on (1 elsewhere)."""
    axes = [a % rank for a in layer.axis]
    sizes = iter((layer.gamma if layer.scale else layer.beta).shape)
    return [next(sizes) if k in axes else 1 for k in range(min(axes), rank)]


PER_ROW_LIMIT = 1 << 18  # entries of one row's kernel gradient formed per row (1 MiB of float32)

# Per-variable pieces: each holds what one variable's per-example gradients g_i are made of, gives
# ||g_i||^2 (`squares`, shape [n]) and sum_i f_i g_i (`clipped_sum`) for clip factors f.


@dataclasses.dataclass
class _Outer:
    """g_i = A_i^T D_i, reshaped to the variable: A_i [T, p] the layer's inputs at T positions, D_i
    [T, q] its output gradients there (Dense, EinsumDense kernels; T = 1 for one vector per row)."""

    variable: Any
    a: Any  # [n, T, p]
    d: Any  # [n, T, q]
    to_variable: Callable[[Any], Any]  # [p, q] -> the variable's shape

    def per_row(self) -> bool:
        """Whether to form g_i = A_i^T D_i per row (n T p q products, n p q numbers) rather than the
        ghost norm (n T^2 (p + q) products, n T^2 numbers): when that costs fewer products and a row's
        g_i has at most `PER_ROW_LIMIT` entries."""
        steps, p, q = self.a.shape[1], self.a.shape[2], self.d.shape[2]
        return steps is not None and steps > 1 and p * q < steps * (p + q) and p * q <= PER_ROW_LIMIT

    @functools.cached_property
    def rows(self):
        """g_i = A_i^T D_i of every row, [n, p, q] (formed once for `squares` and `clipped_sum`)."""
        return tf.matmul(self.a, self.d, transpose_a=True)

    def squares(self):
        """T = 1: ||a_i||^2 ||d_i||^2; else ||A_i^T D_i||_F^2 of the rows `clipped_sum` adds
        (`per_row`), or an upper bound on the ghost norm (`ghost_squares`)."""
        if self.a.shape[1] == 1:
            return tf.reduce_sum(tf.square(self.a), axis=[1, 2]) * tf.reduce_sum(tf.square(self.d), axis=[1, 2])
        if self.per_row():
            return tf.reduce_sum(tf.square(self.rows), axis=[1, 2])
        return self.ghost_squares()

    def ghost_squares(self):
        """An upper bound on <A_i A_i^T, D_i D_i^T>_F = ||A_i^T D_i||_F^2 (`_cancelling`)."""
        a, d = _wide(self.a), _wide(self.d)
        grams_a, grams_d = tf.matmul(a, a, transpose_b=True), tf.matmul(d, d, transpose_b=True)
        # |<a_s, a_t> <d_s, d_t>| <= ||a_s|| ||a_t|| ||d_s|| ||d_t|| (Cauchy-Schwarz): their sum is
        # (sum_t ||a_t|| ||d_t||)^2
        magnitudes = tf.square(tf.reduce_sum(tf.norm(a, axis=2) * tf.norm(d, axis=2), axis=1))
        return _cancelling(grams_a * grams_d, magnitudes, self.a.shape[2] + self.d.shape[2])

    def clipped_sum(self, factor):
        """sum_i f_i g_i of the rows' g_i (`per_row`), or `wide_sum`."""
        if self.per_row():
            return self.to_variable(tf.tensordot(factor, self.rows, 1))
        return tf.cast(self.wide_sum(factor), tf.float32)

    def wide_sum(self, factor):
        """sum_i f_i A_i^T D_i as one [nT, p]^T [nT, q] product in float64 (`_cancelling`), reshaped."""
        p, q = self.a.shape[2], self.d.shape[2]
        d = _wide(self.d) * _wide(factor)[:, None, None]
        return self.to_variable(tf.matmul(tf.reshape(_wide(self.a), [-1, p]), tf.reshape(d, [-1, q]), transpose_a=True))


@dataclasses.dataclass
class _Lookup:
    """g_i = sum_t onehot(id_it) d_it^T: an embedding table looked up at T ids per row."""

    variable: Any
    ids: Any  # [n, T]
    d: Any  # [n, T, width]

    def squares(self):
        """||g_i||^2 = sum_{t,s} [id_it = id_is] d_it . d_is (rows of one id add up before squaring),
        an upper bound (`_cancelling`)."""
        if self.ids.shape[1] == 1:
            return tf.reduce_sum(tf.square(self.d), axis=[1, 2])
        d = _wide(self.d)
        same = tf.cast(self.ids[:, :, None] == self.ids[:, None, :], d.dtype)
        norms = tf.norm(d, axis=2)
        magnitudes = tf.reduce_sum(same * norms[:, :, None] * norms[:, None, :], axis=[1, 2])
        return _cancelling(same * tf.matmul(d, d, transpose_b=True), magnitudes, self.d.shape[2])

    def clipped_sum(self, factor):
        """sum_i f_i g_i (`wide_sum`)."""
        return tf.cast(self.wide_sum(factor), tf.float32)

    def wide_sum(self, factor):
        """sum_i f_i g_i in float64 (`_cancelling`): the rows f_i d_it added up by id."""
        width = self.d.shape[2]
        rows = tf.reshape(_wide(self.d) * _wide(factor)[:, None, None], [-1, width])
        return tf.math.unsorted_segment_sum(rows, tf.reshape(self.ids, [-1]), self.variable.shape[0])


@dataclasses.dataclass
class _Bag:
    """g_i = sum_t w_it e_(id_it) d_i^T: an EmbeddingBag called once, d_i its output gradient."""

    variable: Any
    bag: Any
    ids: Any  # [n, T]
    d: Any  # [n, width]

    def squares(self):
        """||g_i||^2 = ||d_i||^2 sum_v c_iv^2, c_iv the summed weight of id v in row i."""
        return tf.reduce_sum(tf.square(self.d), axis=1) * bag_weight_squares(self.bag, self.ids)

    def clipped_sum(self, factor):
        """sum_i f_i g_i, scattered row by token (`bag_gradient`)."""
        return bag_gradient(self.bag, self.ids, self.d * factor[:, None], [], [], factor)

    def as_lookup(self) -> _Lookup:
        """The same gradient as a lookup with output gradient w_it d_i at each token (for a bag called
        more than once, whose calls' gradients add up)."""
        weights = self.bag.token_weights(self.ids)
        return _Lookup(self.variable, self.ids, weights[:, :, None] * self.d[:, None, :])


@dataclasses.dataclass
class _Rows:
    """g_i itself, [n, *variable shape]: biases, LayerNormalization's gamma and beta, position
    embeddings (each no larger than a row's activations)."""

    variable: Any
    g: Any

    def squares(self):
        """||g_i||^2 summed over the variable's entries."""
        return tf.reduce_sum(tf.reshape(tf.square(self.g), [tf.shape(self.g)[0], -1]), axis=1)

    def clipped_sum(self, factor):
        """sum_i f_i g_i."""
        return tf.tensordot(factor, self.g, 1)


@dataclasses.dataclass
class _Tied:
    """g_i = L_i + O_i: a TiedEmbedding's table looked up (L_i = sum_t onehot(id_it) d_it^T) and used
    as the LM head (logits H_i E^T: O_i = A_i^T H_i, A_i [S, vocabulary] the logits' gradients, H_i
    [S, width] the head's inputs). ||g_i||^2 = ||L_i||^2 + ||O_i||^2 + 2 <L_i, O_i>, and
    <L_i, O_i> = sum_{t,s} A_i[s, id_it] (h_is . d_it): the vocabulary is never summed over."""

    lookup: _Lookup
    outer: _Outer

    @property
    def variable(self):
        return self.lookup.variable

    def squares(self):
        """||L_i||^2 + ||O_i||^2 + 2 <L_i, O_i>, each an upper bound (`_cancelling`); the head's by
        the ghost norm, as `clipped_sum` adds the exact product (never a float32 per-row g_i)."""
        picked = _wide(tf.gather(self.outer.a, self.lookup.ids, axis=2, batch_dims=1))  # [n, S, T]: A_i[s, id_it]
        heads, looked_up = _wide(self.outer.d), _wide(self.lookup.d)
        dots = tf.matmul(heads, looked_up, transpose_b=True)  # [n, S, T]: h_is . d_it
        norms = tf.norm(heads, axis=2)[:, :, None] * tf.norm(looked_up, axis=2)[:, None, :]
        spread = tf.reduce_sum(tf.abs(picked) * norms, axis=[1, 2])
        cross = _cancelling(picked * dots, spread, self.lookup.d.shape[2], bound=False)
        return tf.maximum(self.lookup.squares() + self.outer.ghost_squares() + 2.0 * cross, 0.0)

    def clipped_sum(self, factor):
        """L + O, added in float64 as they are formed: they cancel too."""
        return tf.cast(self.lookup.wide_sum(factor) + self.outer.wide_sum(factor), tf.float32)


Piece = _Outer | _Lookup | _Bag | _Rows | _Tied

# A ghost norm is a sum of T^2 terms that cancel where a row's positions pull its gradient in opposite
# directions, so its rounding error scales with the terms, not with the norm: in float32 one row whose
# two positions nearly cancel got a norm far below its gradient's and added 200 C to the sum. The
# terms are formed and summed in float64, where a product of float32 numbers is exact, and the bound
# adds the most that rounding can have taken off. The clipped sums of such pieces are formed in
# float64 too: in float32 a row's large terms, cancelling only in the end, would round away the other
# rows' terms added to the same partial sums.
FLOAT64_ROUNDING = 2.0**-53  # unit roundoff of float64


def _wide(t):
    """t in float64, for the sums that cancel (a TPU has no float64: `ghost_clipping.unsupported_layers`)."""
    return tf.cast(t, tf.float64)


def _cancelling(terms, spread, width: int | None, bound: bool = True):
    """sum_{s,t} terms[i, s, t] (float64) for every row i, plus the most its rounding can have taken
    off, as float32 (`bound`: at least 0). Each term is a product of dot products of length `width`
    (or fewer), so it is off by at most (width + 1) u times its magnitude bound, whose row sum is
    `spread`, and summing T then S terms adds at most (S + T) u times the terms' absolute sum (any
    order of additions: Higham, Accuracy and Stability of Numerical Algorithms, eq. 3.5); doubled for
    the second-order terms and the rounding of the bound itself."""
    length = tf.cast(tf.shape(terms)[1] + tf.shape(terms)[2], tf.float64)
    magnitude = spread + tf.reduce_sum(tf.abs(terms), axis=[1, 2])
    slack = 2.0 * FLOAT64_ROUNDING * ((width or 1) + 1 + length) * magnitude
    total = tf.reduce_sum(tf.reduce_sum(terms, axis=2), axis=1) + slack
    total = tf.maximum(total, 0.0) if bound else total
    return tf.cast(total + tf.abs(total) * 2.0**-22, tf.float32)  # rounded up to float32, not to nearest


def _row_sums(t, shape: list[int]):
    """Per-row gradient [n, *shape] of a variable broadcast-added (as `shape`, aligned with t's last
    axes) to t [n, ...] whose gradient is given: t summed over the axes the variable is broadcast along."""
    lead = t.shape.rank - len(shape)
    axes = list(range(1, lead)) + [lead + k for k, size in enumerate(shape) if size == 1 and t.shape[lead + k] != 1]
    summed = tf.reduce_sum(t, axis=axes, keepdims=True) if axes else t
    return tf.reshape(summed, [-1, *shape])


def _rows_of(t, steps: int | None, width: int):
    """t as [n, T, width] (T static when known)."""
    return tf.reshape(t, [tf.shape(t)[0], -1 if steps is None else steps, width])


def _static_product(sizes) -> int | None:
    """The product of static sizes, None if one is unknown."""
    total = 1
    for size in sizes:
        if size is None:
            return None
        total *= size
    return total


def _einsum_pieces(layer, a, d) -> list[Piece]:
    """EinsumDense: the kernel as A_i^T D_i with the input's summed axes P as columns of A_i, the
    output's kernel axes Q as columns of D_i, and the axes both share (after the batch) as T; the
    bias as its row sums."""
    inputs, kernel, output = einsum_axes(layer.equation, a.shape.rank)
    shared = [c for c in inputs[1:] if c in output]
    summed, kept = [c for c in inputs if c in kernel], [c for c in output if c in kernel]
    sizes = dict(zip(kernel, layer.kernel.shape))
    p, q = math.prod(sizes[c] for c in summed), math.prod(sizes[c] for c in kept)
    steps = _static_product(a.shape[inputs.index(c)] for c in shared)

    def arranged(t, letters: str, order: list[str]):
        perm = [letters.index(c) for c in [letters[0], *order]]
        return t if perm == sorted(perm) else tf.transpose(t, perm)

    a_rows = _rows_of(arranged(a, inputs, shared + summed), steps, p)
    d_rows = _rows_of(arranged(d, output, shared + kept), steps, q)
    order = summed + kept
    perm = [order.index(c) for c in kernel]

    def to_variable(matrix):
        blocks = tf.reshape(matrix, [sizes[c] for c in order])
        return blocks if perm == sorted(perm) else tf.transpose(blocks, perm)

    pieces: list[Piece] = [_Outer(layer.kernel, a_rows, d_rows, to_variable)]
    if layer.bias is not None:
        pieces.append(_Rows(layer.bias, _row_sums(d, list(layer.bias.shape))))
    return pieces


def layer_pieces(layer, a, d) -> list[Piece]:
    """The pieces of one call of `layer`, from its recorded input a and output gradient d."""
    if isinstance(layer, DENSE):
        p, q = layer.kernel.shape
        steps = _static_product(a.shape[1:-1])
        d = output_gradients(layer, d)
        pieces: list[Piece] = [_Outer(layer.kernel, _rows_of(a, steps, p), _rows_of(d, steps, q), lambda m: m)]
        return pieces + ([_Rows(layer.bias, _row_sums(d, [q]))] if layer.use_bias else [])
    if isinstance(layer, EINSUM_DENSE):
        return _einsum_pieces(layer, a, d)
    if isinstance(layer, RmsNorm):  # output x_hat * scale: g_i = sum_t x_hat_it * d_it
        return [_Rows(layer.scale, _row_sums(a * d, list(layer.scale.shape)))]
    if isinstance(layer, TiedEmbedding) and a.dtype.is_floating:  # the LM head: logits H E^T, g_i = D_i^T H_i
        vocabulary, width = layer.embeddings.shape
        steps = _static_product(a.shape[1:-1])
        return [_Outer(layer.embeddings, _rows_of(d, steps, vocabulary), _rows_of(a, steps, width), lambda m: m)]
    if isinstance(layer, LAYER_NORMALIZATION):
        shape = layer_norm_shape(layer, a.shape.rank)
        pieces = []
        if layer.scale:
            pieces.append(_Rows(layer.gamma, tf.reshape(_row_sums(a * d, shape), [-1, *layer.gamma.shape])))
        if layer.center:
            pieces.append(_Rows(layer.beta, tf.reshape(_row_sums(d, shape), [-1, *layer.beta.shape])))
        return pieces
    if isinstance(layer, EmbeddingBag):
        return [_Bag(layer.embeddings, layer, a, d)]
    if isinstance(layer, PositionEmbedding):  # output x + P[:T]: g_i = d_i, zero past T
        padding = [[0, 0], [0, layer.positions.shape[0] - tf.shape(d)[1]]] + [[0, 0]] * (d.shape.rank - 2)
        return [_Rows(layer.positions, tf.pad(d, padding))]
    vocabulary, width = layer.embeddings.shape
    steps = _static_product(a.shape[1:])
    ids = tf.reshape(a, [tf.shape(a)[0], -1 if steps is None else steps])
    ids = tf.where(ids < 0, ids + tf.cast(vocabulary, ids.dtype), ids)  # Keras 3's lookup takes -1 as the last row
    return [_Lookup(layer.embeddings, ids, _rows_of(d, steps, width))]


def merged_piece(pieces: list[Piece]) -> Piece:
    """One piece for a variable used by several calls of its layer (g_i the sum of the calls'):
    positions concatenated (outer products, lookups), rows added; a table both looked up and used as
    an output projection (TiedEmbedding) is `_Tied`."""
    if len(pieces) == 1:
        return pieces[0]
    pieces = [piece.as_lookup() if isinstance(piece, _Bag) else piece for piece in pieces]
    outers = [p for p in pieces if isinstance(p, _Outer)]
    lookups = [p for p in pieces if isinstance(p, _Lookup)]
    outer = lookup = None
    if outers:
        a, d = tf.concat([p.a for p in outers], axis=1), tf.concat([p.d for p in outers], axis=1)
        outer = _Outer(outers[0].variable, a, d, outers[0].to_variable)
    if lookups:
        ids, d = tf.concat([p.ids for p in lookups], axis=1), tf.concat([p.d for p in lookups], axis=1)
        lookup = _Lookup(lookups[0].variable, ids, d)
    if outer is not None and lookup is not None:
        return _Tied(lookup, outer)
    if outer is not None:
        return outer
    if lookup is not None:
        return lookup
    return _Rows(pieces[0].variable, tf.add_n([p.g for p in pieces if isinstance(p, _Rows)]))


def piece_norms(pieces: list[Piece]):
    """sqrt of the pieces' squares summed over the variables (none below 0: a negative sum would be a
    NaN factor)."""
    return tf.sqrt(tf.maximum(tf.add_n([piece.squares() for piece in pieces]), 0.0))
