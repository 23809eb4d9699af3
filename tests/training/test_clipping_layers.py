"""Fast clipping for any model of Dense, EinsumDense, Embedding, LayerNormalization,
MultiHeadAttention, EmbeddingBag and PositionEmbedding layers: per-example norms and the clipped sum
against vectorized per-example gradients clipped one by one, rows of weight 0 included, for tf_keras
and Keras 3 models (the `keras_lib` fixture); models with other trainable layers fall back to
per-example gradients, naming the layers."""

from __future__ import annotations

import logging

import numpy as np
import pytest

pytest.importorskip("tensorflow")

import keras  # noqa: E402  (Keras 3)

from madp.core.errors import InputError  # noqa: E402
from madp.core.randomness import SecretKey  # noqa: E402
from madp.training import clipping, ghost_clipping, norm_formulas, text  # noqa: E402
from madp.training.ghost_clipping import (  # noqa: E402
    ghost_clippable,
    ghost_clipped_sum,
    ghost_norms,
    unsupported_layers,
)
from madp.training.preparation import tf, tf_keras  # noqa: E402
from madp.training.queries import DpSgdQuery  # noqa: E402
from madp.training.steps import PrivateStep  # noqa: E402

pytestmark = [pytest.mark.tf]
ROWS = 10
WEIGHT = np.array([1.0, 0.0, 0.5, 1.0, 2.0, 0.0, 1.0, 0.3, 1.0, 1.0], np.float32)  # rows 1 and 5: padding
layers = tf_keras.layers
KEY = SecretKey.from_seed(1, "training noise")


def reference(model, loss, x, y, weight) -> tuple[list[np.ndarray], np.ndarray]:
    """Per-example gradients of weight_i * loss_i, one tape per example, and their global norms."""
    rows = []
    for i in range(len(weight)):
        with tf.GradientTape() as tape:
            one = loss(y[i : i + 1], model(x[i : i + 1], training=True))[0] * weight[i]
        gradients = tape.gradient(one, model.trainable_variables, unconnected_gradients=tf.UnconnectedGradients.ZERO)
        rows.append([np.asarray(tf.convert_to_tensor(g)) for g in gradients])  # a lookup's IndexedSlices: dense
    per_example = [np.stack(variable) for variable in zip(*rows)]
    norms = np.sqrt(sum(np.sum(g.reshape(len(weight), -1) ** 2, axis=1) for g in per_example))
    return per_example, norms


def check(model, x, y, weight=WEIGHT, loss=text.softmax_loss) -> None:
    """Norms and the clipped sum at a clip norm that clips some rows and not others."""
    assert ghost_clippable(model), unsupported_layers(model)
    x, y = tf.constant(x), tf.constant(y)
    per_example, norms = reference(model, loss, x, y, weight)
    assert np.all(norms[weight == 0] == 0)
    clip = float(np.median(norms[weight > 0]))
    assert (norms > clip * 1.01).any() and ((norms < clip * 0.99) & (weight > 0)).any()
    np.testing.assert_allclose(ghost_norms(model, loss, x, y, tf.constant(weight)), norms, rtol=1e-4, atol=1e-6)
    summed = ghost_clipped_sum(model, loss, x, y, tf.constant(weight), clip)
    assert len(summed) == len(model.trainable_variables)
    assert all(got.shape == v.shape for got, v in zip(summed, model.trainable_variables))
    assert_clipped_sum(summed, per_example, norms, clip)


def check_step(model, x, y, keras_lib=keras, loss=text.softmax_loss) -> list[np.ndarray]:
    """A private step without noise, at the median norm as clip norm, against per-example gradients
    clipped one by one (rows of `WEIGHT`); returns those per-example gradients."""
    x, y = tf.constant(x), tf.constant(y)
    per_example, norms = reference(model, loss, x, y, WEIGHT)
    clip = float(np.median(norms[WEIGHT > 0]))
    step = PrivateStep(model, loss, keras_lib.optimizers.SGD(0.0), DpSgdQuery(clip, 0.0, KEY), 1.0)
    assert step.fast
    assert_clipped_sum(step.privatized_gradient(x, y, tf.constant(WEIGHT)), per_example, norms, clip)
    return per_example


def assert_clipped_sum(summed, per_example, norms, clip) -> None:
    """`summed` is sum_i min(1, clip / ||g_i||) g_i of the per-example gradients g_i."""
    factor = np.minimum(1.0, clip / np.maximum(norms, 1e-30))
    for got, g in zip(summed, per_example):
        np.testing.assert_allclose(np.asarray(got), np.tensordot(factor, g, 1), rtol=1e-4, atol=1e-6)


def data(shape, classes: int = 3, seed: int = 0, vocabulary: int | None = None):
    rng = np.random.default_rng(seed)
    if vocabulary:
        x = rng.integers(0, vocabulary, (ROWS, *shape)).astype(np.int32)
    else:
        x = rng.normal(size=(ROWS, *shape)).astype(np.float32) * rng.uniform(0.2, 3.0, (ROWS,) + (1,) * len(shape))
    return x, rng.integers(0, classes, ROWS).astype(np.int32)


def functional(inputs, outputs, keras_lib=tf_keras):
    keras_lib.utils.set_random_seed(3)
    return keras_lib.Model(inputs, outputs)


@pytest.fixture(params=["tf_keras", "keras3"])
def keras_lib(request):
    """The Keras a test builds its model with: tf_keras or Keras 3 (`import keras`), whose layers of
    the same kinds clip by the same formulas."""
    return tf_keras if request.param == "tf_keras" else keras


@pytest.fixture(params=["per-row", "ghost"])
def kernel_norms(request, monkeypatch):
    """Both ways to a kernel's norms over positions: g_i formed per row, and the ghost norm."""
    if request.param == "ghost":
        monkeypatch.setattr(norm_formulas, "PER_ROW_LIMIT", 0)


def test_dense_on_vectors_and_on_sequences(kernel_norms, keras_lib):
    keras_lib.utils.set_random_seed(3)
    inputs, layers = keras_lib.Input((5, 4)), keras_lib.layers
    hidden = layers.Dense(6, activation="tanh")(inputs)  # per position: T = 5
    flat = layers.Dense(7, activation="relu")(layers.Flatten()(hidden))
    check(keras_lib.Model(inputs, layers.Dense(3, use_bias=False)(flat)), *data((5, 4)))


def test_the_dense_stack_path_takes_only_what_it_clips_exactly():
    """madp's path for a tf_keras Sequential of Dense layers takes vectors, Dense layers of that class
    exactly and all of them trainable. Over a sequence each layer's per-example gradient sums its
    positions' outer products, which that path took for rows of their own (a crash, or where the
    widths allowed it, a row adding up to 1.88 C); a subclass's call may differ (a masked kernel); a
    frozen layer's gradient would count in the norms; a layer placed twice is listed once (that path
    computed another model). The general path clips them."""
    tf_keras.utils.set_random_seed(1)
    stack = tf_keras.Sequential([tf_keras.Input((4, 4)), layers.Dense(4), layers.Dense(4)])
    assert not ghost_clipping._is_dense_stack(stack)
    check(stack, *data((4, 4), classes=4), loss=lambda y, out: text.softmax_loss(y, tf.reduce_mean(out, axis=1)))

    class Masked(layers.Dense):
        pass

    frozen = layers.Dense(4, trainable=False)
    assert ghost_clipping._is_dense_stack(tf_keras.Sequential([tf_keras.Input((4,)), layers.Dense(4), layers.Dense(4)]))
    assert not ghost_clipping._is_dense_stack(tf_keras.Sequential([tf_keras.Input((4,)), Masked(4), layers.Dense(4)]))
    assert not ghost_clipping._is_dense_stack(tf_keras.Sequential([tf_keras.Input((4,)), frozen, layers.Dense(4)]))
    twice = layers.Dense(4)
    stacked_twice = tf_keras.Sequential([tf_keras.Input((4,)), twice, twice, layers.Dense(3)])
    assert not ghost_clipping._is_dense_stack(stacked_twice)
    check(stacked_twice, *data((4,)))


@pytest.mark.parametrize("keras_lib_name", ["tf_keras", "keras3"])
def test_a_loss_of_one_column_per_row_weighs_each_example_once(keras_lib_name):
    """tf.nn.sigmoid_cross_entropy_with_logits with labels [n, 1] gives [n, 1]: times the rows'
    weights [n] it broadcast to [n, n] in the Dense stack's path (every row weighed by the batch's
    total weight: a row of weight 0 added 0.84 C, one example moved the sum by 1.8 C)."""
    keras_lib = tf_keras if keras_lib_name == "tf_keras" else keras
    keras_lib.utils.set_random_seed(0)
    model = keras_lib.Sequential([keras_lib.Input((4,)), keras_lib.layers.Dense(3, "tanh"), keras_lib.layers.Dense(1)])
    x, y = data((4,), classes=2)
    y = y[:, None].astype(np.float32)

    def loss(labels, logits):
        return tf.nn.sigmoid_cross_entropy_with_logits(labels=labels, logits=logits)

    check_step(model, x, y, keras_lib, loss)


def test_a_loss_of_one_number_per_batch_is_refused_clearly():
    """A Keras loss object reduces the batch to one number by default: neither path can tell one
    example's loss from it, and the step says so before any noise or update."""
    model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(3)])
    x, y = data((4,))
    for fast in (True, False):
        loss = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
        step = PrivateStep(model, loss, keras.optimizers.SGD(0.0), DpSgdQuery(1.0, 0.0, KEY), 1.0, fast=fast)
        with pytest.raises(InputError, match=r"one number for the whole batch.*reduction=\"none\""):
            step(tf.constant(x), tf.constant(y), tf.constant(WEIGHT))


def test_dense_called_twice_shares_its_gradient(keras_lib):
    inputs, layers = keras_lib.Input((4,)), keras_lib.layers
    shared = layers.Dense(4, activation="tanh")
    model = functional(inputs, layers.Dense(3)(shared(shared(inputs)) + inputs), keras_lib)
    check(model, *data((4,)))


@pytest.mark.parametrize(
    "equation,bias_axes,output_shape",
    [
        ("abc,cde->abde", "de", (5, 2, 3)),  # a MultiHeadAttention projection
        ("abcd,cde->abe", "e", (5, 4)),  # its output projection
        ("abc,cd->adb", "d", (6, 5)),  # output axes in another order
        ("abc,dc->abd", None, (5, 6)),  # kernel axes in another order
        ("...b,bc->...c", "c", (6,)),  # ellipsis
        ("abc,cd->ad", "d", (6,)),  # a summed sequence axis
    ],
)
def test_einsum_dense(equation, bias_axes, output_shape, kernel_norms, keras_lib):
    shape = (5, 2, 4) if equation.startswith("abcd") else (5, 4)
    inputs, layers = keras_lib.Input(shape), keras_lib.layers
    projected = layers.EinsumDense(equation, output_shape, bias_axes=bias_axes, activation="tanh")(inputs)
    if equation == "abc,cd->ad":  # the summed axis makes this equation unsupported
        model = functional(inputs, layers.Dense(3)(projected), keras_lib)
        assert not ghost_clippable(model)
        assert "einsum_dense" in unsupported_layers(model)[0]
        return
    model = functional(inputs, layers.Dense(3)(layers.Flatten()(projected)), keras_lib)
    check(model, *data(shape))


def test_per_example_gradients_where_they_cannot_be_vectorized(caplog):
    """TensorFlow cannot vectorize the gradient of Keras 3's EinsumDense with a bias on an inner axis
    (its converter fails): the per-example path (user-level clipping, models with other layers) then
    takes one example after another, says so, and gives the same gradients."""
    inputs, layers = keras.Input((5, 4)), keras.layers
    projected = layers.EinsumDense("abc,cd->adb", (6, 5), bias_axes="d")(inputs)
    model = functional(inputs, layers.Dense(3)(layers.Flatten()(projected)), keras)
    x, y = data((5, 4))
    with caplog.at_level(logging.WARNING, logger="madp.train"):
        got = clipping.per_example_gradients(model, text.softmax_loss, tf.constant(x), tf.constant(y), WEIGHT)
    assert "one example at a time" in caplog.text
    for g, expected in zip(got, reference(model, text.softmax_loss, x, y, WEIGHT)[0], strict=True):
        np.testing.assert_allclose(np.asarray(g), expected, rtol=1e-5, atol=1e-6)


def test_embedding_with_repeated_ids(keras_lib):
    inputs, layers = keras_lib.Input((6,), dtype="int32"), keras_lib.layers
    pooled = layers.GlobalAveragePooling1D()(layers.Embedding(7, 4)(inputs))  # 6 ids from 7: repeats
    check(functional(inputs, layers.Dense(3)(pooled), keras_lib), *data((6,), vocabulary=7))


def test_keras3_embedding_of_negative_ids():
    """Keras 3 looks up id -1 as the table's last row: the norms count it as that row's id."""
    inputs, layers = keras.Input((6,), dtype="int32"), keras.layers
    pooled = layers.GlobalAveragePooling1D()(layers.Embedding(7, 4)(inputs))
    x, y = data((6,), vocabulary=7)
    check(functional(inputs, layers.Dense(3)(pooled), keras), np.where(x % 2 == 0, x - 7, x), y)


def test_keras3_layer_normalization_over_axes_of_both_signs_falls_back():
    """Keras 3 keeps axis=[1, -1] as [-1, 1] (tf_keras makes them positive): its weights' shape then
    follows the axes in another order than the formula's."""
    inputs, layers = keras.Input((3, 5)), keras.layers
    normalized = layers.LayerNormalization(axis=[1, -1])(inputs)
    model = functional(inputs, layers.Dense(3)(layers.Flatten()(normalized)), keras)
    assert "axes of both signs" in unsupported_layers(model)[0]


@pytest.mark.parametrize("axis", [-1, [1, 2], 1])
def test_layer_normalization(axis, keras_lib):
    inputs, layers = keras_lib.Input((5, 4)), keras_lib.layers
    normalized = layers.LayerNormalization(axis=axis)(layers.Dense(4)(inputs))
    check(functional(inputs, layers.Dense(3)(layers.Flatten()(normalized)), keras_lib), *data((5, 4)))


def test_multi_head_attention(kernel_norms, keras_lib):
    inputs, layers = keras_lib.Input((5, 4)), keras_lib.layers
    attended = layers.MultiHeadAttention(2, 3)(inputs, inputs)
    pooled = layers.GlobalAveragePooling1D()(attended)
    check(functional(inputs, layers.Dense(3)(pooled), keras_lib), *data((5, 4)))


def test_keras3_layers_whose_call_is_not_the_formula_fall_back_and_are_named():
    """A Keras 3 layer with LoRA (trainable low-rank factors beside a frozen kernel), a quantized one,
    a rematerialized one, RMS-scaled layer normalization, and variables no layer owns: each keeps the
    model off the fast path, named, rather than clipping or training the wrong weights."""
    inputs, layers = keras.Input((4,)), keras.layers
    lora, quantized = layers.Dense(4, name="lora"), layers.Dense(4, name="int8")
    with keras.RematScope(mode="full"):
        remat = layers.Dense(4, name="remat")
    rms = layers.LayerNormalization(rms_scaling=True, name="rms")
    model = functional(inputs, layers.Dense(3)(rms(remat(quantized(lora(inputs))))), keras)
    assert [name.split(" ")[0] for name in unsupported_layers(model)] == ["remat", "rms"]
    lora.enable_lora(2)
    quantized.quantize("int8")
    assert [name.split(" ")[0] for name in unsupported_layers(model)] == ["lora", "int8", "remat", "rms"]

    class Scaled(keras.Model):  # a weight of the model itself: the model is named, with its variable
        def __init__(self):
            super().__init__()
            self.dense = layers.Dense(3)
            self.scale = self.add_weight(shape=(), initializer="ones", name="scale")

        def call(self, x):
            return self.dense(x) * self.scale

    scaled = Scaled()
    scaled(np.zeros((1, 4), np.float32))
    assert [name.split(" ")[0] for name in unsupported_layers(scaled)] == [scaled.name]


@pytest.mark.parametrize("normalization", ["sqrt", "mean"])
def test_embedding_bag_in_a_functional_model_and_called_twice(normalization):
    inputs = tf_keras.Input((6,), dtype=tf.int32)
    bag = text.EmbeddingBag(9, 4, normalization)
    x, y = data((6,), vocabulary=9)
    check(functional(inputs, layers.Dense(3)(bag(inputs))), x, y)
    check(functional(inputs, layers.Dense(3)(tf.concat([bag(inputs), bag(inputs[:, :3])], axis=1))), x, y)


def test_a_scaled_gradient_dense_layer_in_a_functional_model(kernel_norms):
    """The general path clips a ScaledGradientDense (over vectors and over positions) by the Dense
    formula with its output gradients times its scale, as the per-example reference's tape does."""
    inputs = tf_keras.Input((5, 4))
    hidden = text.ScaledGradientDense(6, gradient_scale=0.3, activation="tanh")(inputs)
    check(functional(inputs, text.ScaledGradientDense(3, gradient_scale=0.5)(layers.Flatten()(hidden))), *data((5, 4)))


def transformer_classifier(vocabulary: int, length: int, width: int, heads: int, classes: int, keras_lib=tf_keras):
    """Embedding (+ positions: madp's PositionEmbedding is a tf_keras layer), one pre-norm encoder
    block, mean pooling, a softmax layer."""
    inputs, layers = keras_lib.Input((length,), dtype="int32"), keras_lib.layers
    x = layers.Embedding(vocabulary, width)(inputs)
    x = text.PositionEmbedding()(x) if keras_lib is tf_keras else x
    normalized = layers.LayerNormalization()(x)
    x = x + layers.MultiHeadAttention(heads, width // heads)(normalized, normalized)
    hidden = layers.EinsumDense("abc,cd->abd", (None, 2 * width), bias_axes="d", activation="gelu")(
        layers.LayerNormalization()(x)
    )
    x = x + layers.Dense(width)(hidden)
    pooled = layers.GlobalAveragePooling1D()(layers.LayerNormalization()(x))
    return keras_lib.Model(inputs, layers.Dense(classes)(pooled))


def test_transformer_encoder_classifier(kernel_norms, keras_lib):
    keras_lib.utils.set_random_seed(5)
    check(transformer_classifier(11, 6, 8, 2, 3, keras_lib), *data((6,), vocabulary=11))


def test_byte_language_model():
    rng = np.random.default_rng(1)
    x, y = text.byte_sequences(["héllo wörld"[: rng.integers(2, 12)].encode() for _ in range(ROWS)], 8)
    tf_keras.utils.set_random_seed(2)
    model, loss = text.byte_lm(8, 8, 1, 2)
    check(model, x, y, loss=loss)


def test_mixed_precision_clips_each_row_in_float32(keras_lib):
    """Under mixed precision (layers in bfloat16), each row's clipped gradient is formed in float32
    from that row alone, for either Keras: a row above the clip norm adds exactly C, and the step's
    clipped sum is the sum of its rows' clipped alone (a bfloat16 product over the batch would round
    the sum, so that one row could move it by more than C)."""
    from madp.training.steps import compute_precision, float32_outputs

    loss = float32_outputs(text.softmax_loss)  # as the private step takes it: the model's outputs in float32
    keras_lib.utils.set_random_seed(5)
    with compute_precision(True):
        model = transformer_classifier(11, 6, 8, 2, 3, keras_lib)
    assert model.layers[-1].compute_dtype == "bfloat16" and model.layers[-1].kernel.dtype == "float32"
    x, y = (tf.constant(t) for t in data((6,), vocabulary=11, seed=2))
    norms = np.asarray(ghost_norms(model, loss, x, y, tf.constant(WEIGHT)))
    clip = 0.5 * float(norms[WEIGHT > 0].min())  # every row of weight > 0 clipped

    def clipped(weight):
        summed = ghost_clipped_sum(model, loss, x, y, tf.constant(weight), clip)
        assert all(g.dtype == tf.float32 for g in summed)
        return [np.asarray(g, np.float64) for g in summed]

    total, rows = clipped(WEIGHT), []
    for j in range(ROWS):
        rows.append(clipped(np.where(np.arange(ROWS) == j, WEIGHT, 0).astype(np.float32)))
        norm = np.sqrt(sum(np.sum(g**2) for g in rows[-1]))
        assert norm == 0 if WEIGHT[j] == 0 else abs(norm / clip - 1) < 1e-5
    for got, *parts in zip(total, *rows, strict=True):
        np.testing.assert_allclose(got, sum(parts), rtol=1e-5, atol=1e-6 * np.abs(got).max())


def test_private_step_takes_the_fast_path_and_matches_per_example_clipping(keras_lib):
    x, y = data((6,), vocabulary=11, seed=4)
    results = []
    for fast in (True, False):
        keras_lib.utils.set_random_seed(5)
        model = transformer_classifier(11, 6, 8, 2, 3, keras_lib)
        step = PrivateStep(
            model, text.softmax_loss, keras_lib.optimizers.SGD(0.0), DpSgdQuery(0.05, 0.0, KEY), 8.0, fast=fast
        )
        assert step.fast == fast
        results.append(step.privatized_gradient(tf.constant(x), tf.constant(y), tf.constant(WEIGHT)))
    for a, b in zip(*results):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-4, atol=1e-6)


def test_other_trainable_layers_fall_back_and_are_named(caplog):
    inputs = tf_keras.Input((6, 4))
    convolved = layers.Conv1D(3, 2, name="conv")(inputs)
    normalized = layers.PReLU(name="prelu")(layers.Dense(3)(inputs))  # (BatchNormalization is refused outright)
    pooled = layers.Concatenate()([layers.Flatten()(convolved), layers.Flatten()(normalized)])
    model = functional(inputs, layers.Dense(3)(pooled))
    assert [name.split(" ")[0] for name in unsupported_layers(model)] == ["conv", "prelu"]
    with caplog.at_level(logging.INFO, logger="madp.train"):
        step = PrivateStep(model, text.softmax_loss, tf_keras.optimizers.SGD(0.0), DpSgdQuery(1.0, 0.0, KEY), 8)
    assert not step.fast
    lines = [r.getMessage() for r in caplog.records if r.name == "madp.train"]
    assert len(lines) == 1 and "conv (Conv1D" in lines[0] and "prelu (PReLU" in lines[0]
    x, y = data((6, 4))
    assert len(step.privatized_gradient(tf.constant(x), tf.constant(y), tf.constant(WEIGHT))) == 7


def test_layers_that_see_several_rows_for_one_example_are_never_clipped_per_row(caplog):
    """A Dense inside TimeDistributed (which folds the time steps into rows when the batch size is not
    static) or after a reshape of the batch axis sees T rows for one example: clipped per row, one
    example would add up to T C to the sum. A wrapper sends the model to per-example gradients, as
    does a layer whose call sees several rows for one example, or a number known only as the step runs
    (a reshape in the model's call, here with time steps of a fixed and of any length), found as the
    step is traced: each example's gradient clipped to C, as checked with examples whose time steps
    agree."""
    steps, width, clip = 8, 4, 1.0

    def loss(y, out):
        return 0.5 * tf.square(out[:, 0] - y)

    def pooled(inputs, scores):
        return functional(inputs, layers.GlobalAveragePooling1D()(scores))

    def norm(summed):
        return np.sqrt(sum(float(np.sum(np.square(g))) for g in summed))

    inputs = tf_keras.Input((steps, width))
    wrapped = pooled(inputs, layers.TimeDistributed(layers.Dense(1), name="per_step")(inputs))
    assert [name.split(" ")[0] for name in unsupported_layers(wrapped)] == ["per_step"]
    rows = np.repeat(np.random.default_rng(0).normal(size=(1, 1, width)).astype(np.float32), steps, axis=1)
    x, y, weight = map(tf.constant, (np.repeat(rows, 3, axis=0), np.full(3, 100.0, np.float32), np.ones(3, np.float32)))
    step = PrivateStep(wrapped, loss, tf_keras.optimizers.SGD(0.0), DpSgdQuery(clip, 0.0, KEY), 1.0)
    assert not step.fast
    assert norm(step.privatized_gradient(x, y, weight)) <= 3 * clip * (1 + 1e-5)

    def time_steps_as_rows(inputs):
        folded = layers.Lambda(lambda t: tf.reshape(t, [-1, width]))(inputs)
        scores = layers.Lambda(lambda ts: tf.reshape(ts[0], [-1, tf.shape(ts[1])[1], 1]))(
            [layers.Dense(1, name="scores")(folded), inputs]
        )
        return pooled(inputs, scores)

    reshaped = time_steps_as_rows(inputs)
    step = PrivateStep(reshaped, loss, tf_keras.optimizers.SGD(0.0), DpSgdQuery(clip, 0.0, KEY), 1.0)
    assert step.fast  # nothing in its layers shows the reshape: the step's trace does
    with caplog.at_level(logging.WARNING, logger="madp.train"):
        summed = step.privatized_gradient(x, y, weight)
    assert "per-example gradients" in caplog.text and "scores (8 rows)" in caplog.text
    assert 3 * clip * (1 - 1e-5) <= norm(summed) <= 3 * clip * (1 + 1e-5)
    with pytest.raises(ghost_clipping.NoFastClipping, match=r"scores \(8 rows\)"):
        ghost_clipping.ghost_clipped_sum(reshaped, loss, x, y, weight, clip)

    any_length = time_steps_as_rows(tf_keras.Input((None, width)))
    step = PrivateStep(any_length, loss, tf_keras.optimizers.SGD(0.0), DpSgdQuery(clip, 0.0, KEY), 1.0)
    caplog.clear()
    for length in (8, 5, 6):  # traced again for time steps of any length: the rows known only as the step runs
        with caplog.at_level(logging.WARNING, logger="madp.train"):
            summed = step.privatized_gradient(x[:, :length], y, weight)
        assert 3 * clip * (1 - 1e-5) <= norm(summed) <= 3 * clip * (1 + 1e-5)
    assert "scores (8 rows)" in caplog.text and "scores (unknown rows)" in caplog.text
    unknown = [tf.TensorSpec([None, None, width]), tf.TensorSpec([None]), tf.TensorSpec([None])]
    ghost = tf.function(
        lambda *t: ghost_clipping.ghost_clipped_sum(any_length, loss, *t, clip), input_signature=unknown
    )
    with pytest.raises(ghost_clipping.NoFastClipping, match=r"scores \(unknown rows\)"):
        ghost.get_concrete_function()


class BatchMixing:
    """Models that mix the rows of their batch, in ways no row count shows: subclassed models whose
    call makes each row its predecessor's (a roll over the batch), centres the rows on the batch's
    mean, or runs a Dense layer time-major when the sequence is as long as the batch; and stacks of
    Dense layers (madp's own clipping path for them in tf_keras) whose loss, or a layer's activation,
    adds half the previous row's values to each row's."""

    @staticmethod
    def loss(kind: str):
        if kind != "loss over the batch":
            return text.softmax_loss
        return lambda y, logits: text.softmax_loss(y, logits + keras.ops.roll(logits, 1, axis=0) / 2)

    @staticmethod
    def model(keras_lib, kind: str):
        ops = keras.ops  # TensorFlow's ops for a tf_keras model as well
        keras_lib.utils.set_random_seed(4)
        if kind in ("loss over the batch", "activation over the batch"):
            mixing = (lambda t: t + ops.roll(t, 1, axis=0) / 2) if kind == "activation over the batch" else None
            hidden = keras_lib.layers.Dense(4, activation=mixing)
            return keras_lib.Sequential([keras_lib.Input((ROWS * 5,)), hidden, keras_lib.layers.Dense(3)])

        class Mixing(keras_lib.Model):
            def __init__(self):
                super().__init__()
                self.hidden, self.scores = keras_lib.layers.Dense(4), keras_lib.layers.Dense(3)

            def call(self, x):
                if kind == "roll":
                    x = ops.roll(x, 1, axis=0)
                elif kind == "batch mean":
                    x = x - ops.mean(x, axis=0, keepdims=True)
                elif kind == "time-major transpose":
                    return self.scores(ops.mean(ops.transpose(self.hidden(ops.transpose(x, (1, 0, 2))), (1, 0, 2)), 1))
                return self.scores(ops.mean(self.hidden(x), axis=1))

        return Mixing()


@pytest.mark.parametrize(
    "kind", ["roll", "batch mean", "time-major transpose", "loss over the batch", "activation over the batch"]
)
def test_a_model_that_mixes_its_batchs_rows_moves_the_sum_by_at_most_c_per_example(kind, keras_lib, caplog):
    """The attacker's view of the released sum (a private step without noise): the sums of a batch
    with and without one example differ by at most C, and no other example's term moves. Run on the
    whole batch at once, the roll put example j's inputs into row j + 1 (2 C between neighbours), the
    batch mean moved every row, and the transpose (T = n) passed the row count while each row held all
    examples' values, and the stack of Dense layers took its loss on the whole batch: each example now
    runs through the model and the loss alone, and the transpose, which leaves T rows of one example
    in the Dense layer's call, takes per-example gradients."""
    clip = 0.05
    x, y = data((ROWS, 5))  # as many time steps as rows
    model = BatchMixing.model(keras_lib, kind)
    if kind in ("loss over the batch", "activation over the batch"):
        x = x.reshape(ROWS, -1)
        assert ghost_clipping._is_dense_stack(model) == (keras_lib is tf_keras and kind == "loss over the batch")
    model(x)
    assert ghost_clippable(model)
    step = PrivateStep(model, BatchMixing.loss(kind), keras_lib.optimizers.SGD(0.0), DpSgdQuery(clip, 0.0, KEY), 1.0)

    def released(rows):
        summed = step.privatized_gradient(tf.constant(x[rows]), tf.constant(y[rows]), tf.ones(len(rows)))
        return np.concatenate([np.ravel(np.asarray(g, np.float64)) for g in summed])

    with caplog.at_level(logging.WARNING, logger="madp.train"):
        everyone = released(np.arange(ROWS))
    assert ("per-example gradients" in caplog.text) == (kind == "time-major transpose")
    alone = [released(np.array([j])) for j in range(ROWS)]
    assert max(np.linalg.norm(term) for term in alone) == pytest.approx(clip, rel=1e-5)  # every example clipped
    np.testing.assert_allclose(everyone, np.sum(alone, axis=0), rtol=1e-4, atol=1e-7)
    for j in (0, ROWS - 1):
        without = released(np.delete(np.arange(ROWS), j))
        assert np.linalg.norm(everyone - without) <= clip * (1 + 1e-5)


def test_a_layer_recomputed_by_keras_remat_takes_per_example_gradients(caplog):
    """keras.remat(layer) in a model's call recomputes the layer's output in the backward pass, so the
    output its tapped call recorded has no path to the loss, and fast clipping would give the layer's
    weights no gradient. The step's trace shows it, and the step takes per-example gradients."""

    class Recomputed(keras.Model):
        def __init__(self):
            super().__init__()
            self.hidden = keras.layers.Dense(4, activation="tanh", name="hidden")
            self.scores = keras.layers.Dense(3, name="scores")

        def call(self, x):
            return self.scores(keras.remat(self.hidden)(x))

    keras.utils.set_random_seed(5)
    model = Recomputed()
    x, y = data((5,))
    model(x)
    with caplog.at_level(logging.WARNING, logger="madp.train"):
        per_example = check_step(model, x, y)
    assert "hidden (output not reaching the loss)" in caplog.text
    assert all(np.any(g != 0) for g in per_example)


@pytest.mark.parametrize("fast", [True, False])
def test_a_layer_that_writes_into_a_variable_in_its_call_is_refused(keras_lib, fast):
    """A running statistic kept in a variable and assigned in a layer's call (as BatchNormalization
    keeps, in a custom layer): through it the step's examples reached each other's gradients on both
    paths (one example moved the sum by up to 2.45 C in a review), and the variable, saved with the
    model, holds the data without noise. The step refuses it before any noise or update; a Keras 3
    Dropout's seed state, which it writes too, is no statistic of the data and trains."""

    class Running(keras_lib.layers.Layer):
        def build(self, shape):
            self.mean = self.add_weight(name="mean", shape=(shape[-1],), initializer="zeros", trainable=False)

        def call(self, x, training=None):
            if training:
                self.mean.assign(0.5 * self.mean + 0.5 * tf.reduce_mean(x, axis=0))
            return x - self.mean

    x, y = data((4,))
    for refused in (True, False):
        inputs = keras_lib.Input((4,))
        hidden = keras_lib.layers.Dropout(0.3)(keras_lib.layers.Dense(4)(inputs))
        model = functional(inputs, keras_lib.layers.Dense(3)(Running()(hidden) if refused else hidden), keras_lib)
        optimizer = keras_lib.optimizers.SGD(0.1)
        step = PrivateStep(model, text.softmax_loss, optimizer, DpSgdQuery(1.0, 0.0, KEY), 1.0, fast=fast)
        before = [np.asarray(v) for v in model.trainable_variables]
        if refused:
            with pytest.raises(InputError, match=r"writes into variables in its call: running(_\d+)?/mean"):
                step(tf.constant(x), tf.constant(y), tf.constant(WEIGHT))
            assert all(np.array_equal(b, np.asarray(v)) for b, v in zip(before, model.trainable_variables))
        else:
            step(tf.constant(x), tf.constant(y), tf.constant(WEIGHT))
            assert not all(np.array_equal(b, np.asarray(v)) for b, v in zip(before, model.trainable_variables))


def test_a_layer_called_inside_a_loop_takes_per_example_gradients(caplog):
    """A Dense layer inside an RNN's cell is called in the loop's own graph, whose tensors the fast
    path cannot take out (it crashed, inside tf.function): the step's trace finds it, and the step
    takes per-example gradients, checked against one tape per example."""

    class Cell(keras.layers.Layer):
        def __init__(self, **kwargs):
            super().__init__(**kwargs)
            self.state_size = 4
            self.dense = keras.layers.Dense(4, activation="tanh", name="cell_dense")

        def call(self, x, states):
            h = self.dense(keras.ops.concatenate([x, states[0]], axis=-1))
            return h, [h]

    keras.utils.set_random_seed(2)
    inputs = keras.Input((5, 3))
    model = keras.Model(inputs, keras.layers.Dense(3)(keras.layers.RNN(Cell())(inputs)))
    x, y = data((5, 3))
    with caplog.at_level(logging.WARNING, logger="madp.train"):
        check_step(model, x, y)
    assert "cell_dense (called inside a loop)" in caplog.text


@pytest.mark.parametrize("kind", ["dense stack", "ghost", "per-example"])
def test_a_row_whose_gradient_is_not_finite_adds_nothing(kind):
    """A label beyond what the loss can square (finite in float32) makes one row's gradient infinite;
    its clip factor 0 times inf would put NaN into the sum and the released model. The row adds
    nothing instead, as a row of weight 0 (the neighbouring relation's missing record)."""

    def loss(y, out):
        return 0.5 * tf.square(out[:, 0] - y)

    def model():
        tf_keras.utils.set_random_seed(2)
        if kind == "dense stack":
            return tf_keras.Sequential([tf_keras.Input((4,)), layers.Dense(3, activation="relu"), layers.Dense(1)])
        inputs = tf_keras.Input((4,))
        return tf_keras.Model(inputs, layers.Dense(1)(layers.LayerNormalization()(layers.Dense(3)(inputs))))

    x = np.random.default_rng(1).normal(size=(5, 4)).astype(np.float32) * 10
    y = np.array([1.0, 3e38, -1.0, 2.0, 0.5], np.float32)
    weight = np.ones(5, np.float32)
    summed = {}
    for case, (labels, weights) in {
        "huge": (y, weight),
        "left out": (np.where(y > 1e30, 0, y), weight * (y < 1e30)),
    }.items():
        step = PrivateStep(
            model(), loss, tf_keras.optimizers.SGD(0.0), DpSgdQuery(1.0, 0.0, KEY), 1.0, fast=kind != "per-example"
        )
        summed[case] = [
            np.asarray(g) for g in step.privatized_gradient(tf.constant(x), tf.constant(labels), tf.constant(weights))
        ]
    assert all(np.isfinite(g).all() for g in summed["huge"])
    for got, expected in zip(summed["huge"], summed["left out"]):
        np.testing.assert_allclose(got, expected, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("kind", ["dense over positions", "embedding lookup"])
def test_a_row_whose_positions_cancel_adds_at_most_c(kind):
    """A row whose two positions pull its gradient in nearly opposite directions: the ghost norm is a
    sum of terms 10^4 times the norm's square that cancel, and in float32 rounding took so much off
    that the row added up to 200 C to the clipped sum. Its contribution is now at most C."""
    width, clip = 8, 1.0
    rng = np.random.default_rng(0)
    if kind == "dense over positions":
        inputs = tf_keras.Input((2, width))
        model = tf_keras.Model(inputs, layers.Dense(width, use_bias=False)(inputs))
        a = rng.normal(size=width).astype(np.float32)
        x = np.stack([a, a])[None] * np.float32(1e3 / np.linalg.norm(a))  # the same input at both positions
        scale = 1e3
    else:
        inputs = tf_keras.Input((2,), dtype="int32")
        model = tf_keras.Model(inputs, layers.Embedding(5, width)(inputs))
        x, scale = np.array([[3, 3]], np.int32), 1e6  # the same id at both positions
    v = rng.normal(size=width).astype(np.float32)
    y = (v / np.linalg.norm(v) * scale)[None].astype(np.float32)
    contributions = []
    for cancel in 1e-4 * (1 + np.arange(12) / 7):

        def loss(y, out, cancel=cancel):  # output gradients y and -(1 - cancel) y at the two positions
            return tf.reduce_sum(out[:, 0] * y, -1) - (1 - cancel) * tf.reduce_sum(out[:, 1] * y, -1)

        weight = np.ones(1, np.float32)
        assert reference(model, loss, x, y, weight)[1][0] > 10 * clip, "the row's gradient is far above C"
        summed = ghost_clipped_sum(model, loss, tf.constant(x), tf.constant(y), tf.constant(weight), clip)
        contributions.append(np.sqrt(sum(np.sum(np.square(np.asarray(g), dtype=np.float64)) for g in summed)))
    assert max(contributions) <= clip * (1 + 1e-6) and min(contributions) > 0.99 * clip  # float32 sums
