"""The clipped gradient sum sum_i g_i min(1, clip / ||g_i||) of one step, two ways.

- `per_example_gradients` then `queries.clip_and_sum`: any model, one gradient per example
  (vectorized), memory rows x parameters.
- `ghost_clipped_sum`: a Sequential of an optional `EmbeddingBag` then Dense layers, without
  per-example gradients ("ghost clipping", Goodfellow 2015; Lee & Kifer 2021). A layer's
  per-example gradient is a product of its input a_i and the loss gradient d_i at its output,
  so its norm comes from a_i and d_i alone:
  - Dense: kernel a_i d_i^T, bias d_i: ||g_i||^2 = (||a_i||^2 + 1) ||d_i||^2;
  - EmbeddingBag (output sum_t w_it E[id_it]): sum_v c_iv e_v d_i^T with c_iv the summed weight
    of id v in row i: ||g_i||^2 = ||d_i||^2 sum_v c_iv^2.
  The clipped sum is then formed from the rows' a_i and d_i scaled by their clip factors.
"""

from __future__ import annotations

from madp.training import load_tensorflow
from madp.training.text import EmbeddingBag

tf = load_tensorflow()
import tf_keras  # noqa: E402


def per_example_gradients(model, loss_fn, x, y, weight):
    """Gradient of weight_i * loss_i for every example i (vectorized; rows of weight 0 give zeros)."""

    def one(example):
        xi, yi, wi = example
        with tf.GradientTape() as tape:
            loss = loss_fn(yi[None], model(xi[None], training=True))[0] * wi
        return tape.gradient(loss, model.trainable_variables)

    return tf.vectorized_map(one, (x, y, weight))


def ghost_clippable(model) -> bool:
    """Whether `model` is a Sequential of an optional first EmbeddingBag and Dense layers."""
    if not isinstance(model, tf_keras.Sequential) or not model.layers:
        return False
    first, *rest = model.layers
    return isinstance(first, (EmbeddingBag, tf_keras.layers.Dense)) and all(
        isinstance(layer, tf_keras.layers.Dense) for layer in rest
    )


def bag_weight_squares(bag: EmbeddingBag, ids):
    """sum_v c_iv^2 per row, c_iv the summed weight of id v in row i. The bag weighs every id of a row
    alike (w_i), so c_iv = w_i k_iv with k_iv the copies of v, and sum_v k_v^2 = sum_t (2 r_t + 1)
    over the row's ids, r_t the copies of id_t before it once the row is sorted."""
    ordered = tf.sort(ids, axis=1)
    earlier = tf.range(tf.shape(ordered)[1]) - tf.searchsorted(ordered, ordered, side="left")
    weights = bag.token_weights(ordered)
    return tf.reduce_sum(tf.square(weights) * (2.0 * tf.cast(earlier, tf.float32) + 1.0), axis=1)


def ghost_clipped_sum(model, loss_fn, x, y, weight, l2_norm_clip):
    """sum_i g_i min(1, clip / ||g_i||) for a `ghost_clippable` model, from each layer's inputs and
    output gradients (the module docstring's norms)."""
    with tf.GradientTape() as tape:
        inputs, outputs, a = [], [], x
        for layer in model.layers:
            if isinstance(layer, EmbeddingBag):
                z = layer(a)
            else:
                z = tf.matmul(a, layer.kernel) + (layer.bias if layer.use_bias else 0.0)
            inputs.append(a)
            outputs.append(z)
            a = z if isinstance(layer, EmbeddingBag) else layer.activation(z)
        loss = tf.reduce_sum(loss_fn(y, a) * weight)
    deltas = tape.gradient(loss, outputs)
    squares = []
    for layer, a, d in zip(model.layers, inputs, deltas):
        output_norms = tf.reduce_sum(tf.square(d), axis=1)
        if isinstance(layer, EmbeddingBag):
            squares.append(output_norms * bag_weight_squares(layer, a))
        else:
            squares.append((tf.reduce_sum(tf.square(a), axis=1) + (1.0 if layer.use_bias else 0.0)) * output_norms)
    factor = tf.minimum(1.0, l2_norm_clip / tf.maximum(tf.sqrt(tf.add_n(squares)), 1e-30))
    gradients = {}
    for index, (layer, a, d) in enumerate(zip(model.layers, inputs, deltas)):
        scaled = d * factor[:, None]
        if isinstance(layer, EmbeddingBag):
            gradients[id(layer.embeddings)] = _bag_gradient(
                layer, a, scaled, model.layers[index + 1 :], deltas[index + 1 :], factor
            )
            continue
        gradients[id(layer.kernel)] = tf.matmul(a, scaled, transpose_a=True)
        if layer.use_bias:
            gradients[id(layer.bias)] = tf.reduce_sum(scaled, axis=0)
    return [gradients[id(v)] for v in model.trainable_variables]


def _bag_gradient(bag: EmbeddingBag, ids, scaled, later_layers, later_deltas, factor):
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
