"""The clipped gradient sum sum_i g_i min(1, clip / ||g_i||) of one step, two ways.

- `per_example_gradients` then `queries.clip_and_sum`: any model, one gradient per example
  (vectorized), memory rows x parameters.
- `ghost_clipped_sum`: any model (Sequential or functional, tf_keras or Keras 3) whose trainable layers are Dense,
  EinsumDense, Embedding, LayerNormalization (also the projections inside MultiHeadAttention),
  EmbeddingBag, PositionEmbedding, ScaledGradientDense, RmsNorm or TiedEmbedding (the pretrained
  causal LM's), without per-example gradients of the model ("ghost clipping" and book-keeping:
  Goodfellow 2015; Lee & Kifer 2021; Li et al. 2022; Bu et al. 2023).
  Each example's forward pass runs with those layers' calls tapped (`_tapped`: the same output,
  computed from the layer's weights, recording its input and its output before any activation), its
  backward pass gives the loss gradients d_i at those outputs (not at the weights), vectorized over
  the batch as per-example gradients are (each example a batch of its own, so no call can mix rows:
  `gradient_pieces`), and each variable's
  per-example gradient g_i is a product of a row's inputs and output gradients, so its norm comes
  from them alone (A_i: a row's inputs at its T positions, [T, p]; D_i: the output gradients there):
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
  A layer called several times adds its calls' gradients (positions concatenated). The clipped
  sum is then formed from the same inputs and output gradients scaled by the rows' clip factors,
  without a second backward pass (TF Privacy's fast-gradient-clipping registry gives the norms,
  then backpropagates a reweighted loss again, and knows no madp layers). A Sequential of an
  optional EmbeddingBag then Dense layers on vectors runs its layers one by one instead
  (`_dense_stack_clipped_sum`, the same norms). Any other trainable layer, one whose call is not
  the formula's (Keras 3's LoRA, quantized, rematerialized or RMS-scaled layers) and any trainable
  variable no layer owns (`unsupported_layers`) send the model to per-example gradients.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import logging
import math
from collections.abc import Callable, Iterator
from typing import Any

from madp.core.errors import InputError
from madp.training import load_tensorflow
from madp.training.pretrained import RmsNorm, TiedEmbedding
from madp.training.queries import kept_rows
from madp.training.text import EmbeddingBag, PositionEmbedding, ScaledGradientDense

tf = load_tensorflow()
import keras  # noqa: E402  (Keras 3: `import keras` beside TensorFlow's legacy tf_keras)
import tf_keras  # noqa: E402

log = logging.getLogger("madp.train")

# Each layer kind of both Kerases: tf_keras and Keras 3 layers of a kind have the same weights and
# call, so one norm formula serves both.
DENSE = (tf_keras.layers.Dense, keras.layers.Dense)
EINSUM_DENSE = (tf_keras.layers.EinsumDense, keras.layers.EinsumDense)
EMBEDDING = (tf_keras.layers.Embedding, keras.layers.Embedding)
LAYER_NORMALIZATION = (tf_keras.layers.LayerNormalization, keras.layers.LayerNormalization)


def per_example_gradients(model, loss_fn, x, y, weight):
    """Gradient of weight_i * loss_i for every example i (rows of weight 0 give zeros), each example
    through the model alone (`each_example`)."""

    def one(example):
        xi, yi, wi = example
        with tf.GradientTape() as tape:
            loss = example_loss(loss_fn, yi, model(one_row(xi), training=True)) * wi
        gradients = tape.gradient(loss, model.trainable_variables, unconnected_gradients=tf.UnconnectedGradients.ZERO)
        return [tf.convert_to_tensor(g) for g in gradients]  # an embedding's IndexedSlices as a dense tensor

    return each_example(model, one, (x, y, weight))


LOSS_NOT_PER_ROW = "the loss gives one number for the whole batch"


def example_loss(loss_fn, yi, outputs):
    """The loss of one example from the model's outputs on it (a batch of one): what `loss_fn` gives
    its row, summed (one number, or one per output)."""
    losses = loss_fn(yi[None], outputs)
    if losses.shape.rank == 0:
        raise InputError(
            f'{LOSS_NOT_PER_ROW}: it must give one loss per row (a Keras loss built with reduction="none")'
        )
    return tf.reduce_sum(losses[0])


def one_row(xi):
    """An example's inputs (one row of an array, or of each array of a dict) as a batch of one."""
    return tf.nest.map_structure(lambda t: t[None], xi)


WRITES_VARIABLES = "writes into variables in its call"


def each_example(model, one, examples):
    """one(example) for every example, stacked: vectorized, or one example after another where
    TensorFlow cannot vectorize it (its converter fails on the gradient of Keras 3's EinsumDense with a
    bias on an inner axis), as the log says. Each example runs through the model as a batch of its own
    either way, so nothing the model's call does across its batch (a transpose, a reshape, a statistic
    over the rows) can bring one example's values into another's, except through a variable the call
    writes, which is refused (`written_variables`)."""
    signature: list = []

    def traced(example):
        outputs = one(example)
        written = written_variables(model)
        if written:
            raise InputError(
                f"model {model.name} {WRITES_VARIABLES}: {', '.join(written)} (a statistic of the data kept across "
                f"calls: through it the step's examples reach each other's gradients, and it is saved with the "
                f"model without noise); keep such layers out of a private model"
            )
        signature[:] = [tf.nest.map_structure(lambda t: tf.TensorSpec(t.shape, t.dtype), outputs)]
        return outputs

    try:
        return tf.vectorized_map(traced, examples)
    except Exception as error:  # TensorFlow's converter fails with several kinds of errors
        if not signature:  # the model or the loss failed on the example, not the converter
            raise
        why = [line.strip() for line in str(error).splitlines() if line.strip()][-1][:300]
        log.warning("model %s: one example at a time (not vectorized: %s)", model.name, why)
        return tf.map_fn(one, examples, fn_output_signature=signature[0])


def written_variables(model) -> list[str]:
    """The names of the variables of `model` (random generators' seed states aside) that an op of the
    graph being traced writes: a layer's running statistic (as BatchNormalization's) assigned in its call."""
    seeds = {
        id(generator.state)
        for layer in model._flatten_layers(include_self=True, recursive=True)
        for generator in getattr(layer, "_seed_generators", [])
    }
    by_handle = {id(_handle(v)): v for v in model.variables if id(v) not in seeds}
    graph = tf.compat.v1.get_default_graph()
    names = set()
    for op in graph.get_operations():
        if op.type in ("AssignVariableOp", "AssignAddVariableOp", "AssignSubVariableOp") or (
            op.type.startswith("ResourceScatter")
        ):
            variable = by_handle.get(id(_captured(op.inputs[0], graph)))
            if variable is not None:
                names.add(getattr(variable, "path", None) or variable.name)
    return sorted(names)


def _handle(variable):
    """A variable's resource handle (a Keras 3 variable holds a TensorFlow one)."""
    return variable.handle if hasattr(variable, "handle") else variable.value.handle


def _captured(tensor, graph):
    """What `tensor` of a function's graph captures, through the functions it is traced in: a
    variable's handle is captured into each."""
    while hasattr(graph, "captures") and hasattr(graph, "outer_graph"):
        outer = {id(internal): external for external, internal in graph.captures}
        if id(tensor) not in outer:
            break
        tensor, graph = outer[id(tensor)], graph.outer_graph
    return tensor


def user_averages(gradients, weight, groups):
    """User-level clipping's records: per group (user), the average of its rows' per-example
    `gradients` by their `weight`, and the group's total weight (0 for a group no row has)."""
    count = tf.shape(weight)[0]  # static where shapes are (TPU): groups < rows
    totals = tf.math.unsorted_segment_sum(weight, groups, count)
    averages = [
        tf.math.unsorted_segment_sum(g, groups, count)
        / tf.reshape(tf.maximum(totals, 1.0), [-1] + [1] * (len(g.shape) - 1))
        for g in gradients
    ]
    return averages, totals


def bag_weight_squares(bag: EmbeddingBag, ids):
    """sum_v c_iv^2 per row, c_iv the summed weight of id v in row i. The bag weighs every id of a row
    alike (w_i), so c_iv = w_i k_iv with k_iv the copies of v, and sum_v k_v^2 = sum_t (2 r_t + 1)
    over the row's ids, r_t the copies of id_t before it once the row is sorted."""
    ordered = tf.sort(ids, axis=1)
    earlier = tf.range(tf.shape(ordered)[1]) - tf.searchsorted(ordered, ordered, side="left")
    weights = bag.token_weights(ordered)
    return tf.reduce_sum(tf.square(weights) * (2.0 * tf.cast(earlier, tf.float32) + 1.0), axis=1)


# Keras' activations that act on each row alone (softmax over its last axis): any other function
# may mix a batch's rows, and the stack runs its layers on the whole batch
ROW_WISE_ACTIVATIONS = frozenset(
    tf_keras.activations.get(name)
    for name in ("linear", "relu", "relu6", "elu", "selu", "gelu", "sigmoid", "hard_sigmoid", "tanh", "softmax")
    + ("softplus", "softsign", "swish", "exponential")
)


STACK_DENSE = (tf_keras.layers.Dense, ScaledGradientDense)  # exactly these classes


def _output_gradients(layer, d):
    """A Dense layer's output gradients as its weights' gradients take them: times a
    ScaledGradientDense's scale (its kernel's g_i = a_i (s d_i)^T, its bias's s d_i)."""
    return d * layer.gradient_scale if isinstance(layer, ScaledGradientDense) else d


def _is_dense_stack(model) -> bool:
    """Whether `model` is a Sequential of an optional first EmbeddingBag and Dense (or
    ScaledGradientDense) layers of row-wise activations, built for inputs of rank 2 (one vector or one
    list of ids per example; over sequences, each Dense layer's per-example gradient sums the positions'
    outer products, which the general path clips)."""
    if not isinstance(model, tf_keras.Sequential) or not model.layers or not model.built:
        return False
    if len(tf.TensorShape(model.input_shape)) != 2:
        return False
    # each layer trainable and called once (a layer placed twice is listed once)
    if not all(layer.trainable and len(layer.inbound_nodes) == 1 for layer in model.layers):
        return False
    first, *rest = model.layers
    # these classes exactly: a subclass's call may differ (a masked kernel, a weight of its own)
    return type(first) in (EmbeddingBag, *STACK_DENSE) and all(
        type(layer) in STACK_DENSE and layer.activation in ROW_WISE_ACTIVATIONS
        for layer in model.layers[type(first) is EmbeddingBag :]
    )


def float32_despite_policy(model) -> bool:
    """Whether the private steps of `model` compute in float32 although some of its layers compute in
    another dtype (Keras' mixed policy): a stack of Dense layers alone clips on a path that multiplies
    the float32 inputs by the float32 weights (`_dense_stack_clipped_sum`). An EmbeddingBag's call in
    that path follows the policy, so a stack that starts with one does not count."""
    return (
        _is_dense_stack(model)
        and not isinstance(model.layers[0], EmbeddingBag)
        and any(layer.compute_dtype != "float32" for layer in model.layers)
    )


def _dense_stack_clipped_sum(model, loss_fn, x, y, weight, l2_norm_clip):
    """sum_i g_i min(1, clip / ||g_i||) for a `_is_dense_stack` model: the layers run one by one on
    their weights (no tapped calls) over the batch, each row alone, and the loss is taken of each
    example alone (`each_example`: a loss that mixes a batch's rows sees one); a bag followed by a
    narrower Dense layer scatters that layer's output gradients (`_bag_gradient`)."""
    with tf.GradientTape() as tape:
        inputs, outputs, a = [], [], x
        for layer in model.layers:
            if isinstance(layer, EmbeddingBag):  # the stack runs in float32, the policy's compute dtype aside
                z = tf.cast(layer(a), tf.float32)
            else:  # as Keras casts its inputs (float64 arrays, say)
                a = tf.cast(a, tf.float32)
                z = tf.matmul(a, layer.kernel) + (layer.bias if layer.use_bias else 0.0)
            inputs.append(a)
            outputs.append(z)
            a = z if isinstance(layer, EmbeddingBag) else layer.activation(z)
        losses = each_example(model, lambda example: example_loss(loss_fn, example[0], example[1][None]), (y, a))
        loss = tf.reduce_sum(losses * weight)
    deltas = tape.gradient(loss, outputs, unconnected_gradients=tf.UnconnectedGradients.ZERO)
    inputs, deltas = finite_rows_only(inputs, deltas)
    squares = []
    for layer, a, d in zip(model.layers, inputs, deltas):
        if isinstance(layer, EmbeddingBag):
            squares.append(tf.reduce_sum(tf.square(d), axis=1) * bag_weight_squares(layer, a))
        else:
            output_norms = tf.reduce_sum(tf.square(_output_gradients(layer, d)), axis=1)
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
        scaled = _output_gradients(layer, scaled)
        gradients[id(layer.kernel)] = tf.matmul(a, scaled, transpose_a=True)
        if layer.use_bias:
            gradients[id(layer.bias)] = tf.reduce_sum(scaled, axis=0)
    return [gradients[id(v)] for v in model.trainable_variables]


def finite_rows_only(inputs: list, deltas: list) -> tuple[list, list]:
    """The layers' recorded inputs and output gradients with every row that holds a NaN or infinite
    value in any of them set to zero (integer inputs, such as ids, kept): such a row's gradient norm is
    not finite, and its clip factor times its values would put NaN into the sum (0 * inf), so one
    record could turn the released model to NaN. Zeroed, it adds nothing, as a row of weight 0; the
    guarantee covers any row's contribution of norm at most C, none included."""
    floating = [t for t in [*inputs, *deltas] if t is not None and t.dtype.is_floating]
    if not floating:
        return inputs, deltas
    finite = tf.reduce_all(
        tf.stack([tf.reduce_all(tf.reshape(tf.math.is_finite(t), [tf.shape(t)[0], -1]), axis=1) for t in floating]),
        axis=0,
    )

    def zeroed(t):
        return t if t is None or not t.dtype.is_floating else kept_rows(t, finite)

    return [zeroed(t) for t in inputs], [zeroed(t) for t in deltas]


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


# --- any model of supported layers: tapped layer calls ------------------------------------------

SUPPORTED = (
    *DENSE,
    *EINSUM_DENSE,
    *EMBEDDING,
    *LAYER_NORMALIZATION,
    EmbeddingBag,
    PositionEmbedding,
    RmsNorm,
    ScaledGradientDense,
    TiedEmbedding,
)


def _own_variables(layer) -> list:
    """The variables `layer` itself created, not its sublayers' (tf_keras and Keras 3 name the list
    differently)."""
    own = getattr(layer, "_trainable_weights", None)
    return list(own if own is not None else getattr(layer, "_trainable_variables", []))


def _trainable_layers(model) -> list:
    """The layers of `model` (itself and nested ones, such as a MultiHeadAttention's EinsumDense
    projections) that own some of its trainable variables."""
    trainable = {id(v) for v in model.trainable_variables}
    return [
        layer
        for layer in model._flatten_layers(include_self=True, recursive=True)
        if any(id(v) in trainable for v in _own_variables(layer))
    ]


def _einsum_axes(equation: str, rank: int) -> tuple[str, str, str]:
    """(input, kernel, output) axis letters of an EinsumDense equation, "..." spelled out as the
    input's leading axes (rank: the input's)."""
    inputs, rest = equation.split(",")
    kernel, output = rest.split("->")
    if "..." in inputs:
        spare = [c for c in "ABCDEFGHIJKLMNOPQRSTUVWXYZ" if c not in equation]
        filler = "".join(spare[: rank - len(inputs) + 3])
        inputs, output = inputs.replace("...", filler), output.replace("...", filler)
    return inputs, kernel, output


def _einsum_problem(inputs: str, kernel: str, output: str) -> str | None:
    """Why an EinsumDense equation is not a per-example matrix product a_i K (None if it is): the
    input's first axis must be the output's and not the kernel's, every kernel axis either summed
    (input only) or kept (output only), every other axis in both input and output."""
    if any(len(set(s)) != len(s) for s in (inputs, kernel, output)):
        return f"equation {inputs},{kernel}->{output} repeats an axis"
    if not inputs or not output or inputs[0] != output[0] or inputs[0] in kernel:
        return f"equation {inputs},{kernel}->{output} has no batch axis first"
    if set(kernel) != set(inputs) ^ set(output):
        return f"equation {inputs},{kernel}->{output} is not a product of input and kernel"
    return None


def _unsupported(layer) -> str | None:
    """Why `layer`'s per-example gradient norms are not computed from its inputs and output
    gradients here (None if they are). Exact types only: a subclass may change `call`."""
    if type(layer) not in SUPPORTED:
        return "no norm formula for this layer"
    if getattr(layer, "lora_enabled", False):
        return "LoRA enabled: no norm formula for its low-rank factors"
    if getattr(layer, "quantization_mode", None) is not None:
        return f"quantized ({layer.quantization_mode}): its call is not the layer's formula"
    if getattr(layer, "_remat_mode", None) is not None:
        return "rematerialized: its outputs are recomputed outside the recorded pass"
    if getattr(layer, "rms_scaling", False):
        return "rms_scaling: not the normalization the formula takes"
    if isinstance(layer, EINSUM_DENSE):
        inputs = layer.equation.split(",")[0]
        return _einsum_problem(*_einsum_axes(layer.equation, len(inputs.replace("...", "")) + 1))
    if isinstance(layer, LAYER_NORMALIZATION):
        axes = [layer.axis] if isinstance(layer.axis, int) else list(layer.axis)
        if 0 in axes or axes != sorted(axes) or len({a < 0 for a in axes}) > 1:
            return f"axis {layer.axis}: the batch axis, unsorted axes or axes of both signs"
    return None


def unsupported_layers(model, on_tpu: bool = False) -> list[str]:
    """The trainable layers of `model` that keep it off the fast clipping path, as "name (Class): why".
    On a TPU only a stack of Dense layers takes it: the other norms sum terms that can cancel, which
    the fast path sums in float64 (`_cancelling`), and TPUs have none."""
    if _is_dense_stack(model):
        return []
    if on_tpu:
        return [f"{model.name} (on a TPU: no float64 for the norms whose terms cancel)"]
    found = [
        f"{wrapper.name} ({type(wrapper).__name__}: a wrapper whose call may fold other axes into the batch's rows)"
        for wrapper in model._flatten_layers(include_self=False, recursive=True)
        if isinstance(wrapper, (tf_keras.layers.Wrapper, keras.layers.Wrapper)) and wrapper.trainable_weights
    ]
    layers = _trainable_layers(model)
    for layer in layers:
        reason = _unsupported(layer)
        if reason:
            found.append(f"{layer.name} ({type(layer).__name__}: {reason})")
    owned = {id(v) for layer in layers for v in _own_variables(layer)}
    ownerless = [v.name for v in model.trainable_variables if id(v) not in owned]
    if ownerless:  # the fast path would give them no gradient
        found.append(f"{model.name} ({type(model).__name__}: variables of no layer found: {', '.join(ownerless)})")
    return found


def ghost_clippable(model) -> bool:
    """Whether every trainable layer of `model` has a norm formula here (`unsupported_layers`)."""
    return not unsupported_layers(model)


def _forward(layer, inputs, reverse: bool = False):
    """(recorded input, output z whose gradient is recorded, layer output): the layer's call, with
    Dense and EinsumDense split before their activation, LayerNormalization's normalized input
    x_hat = (x - mean) / sqrt(var + eps) and RmsNorm's x_hat = x / sqrt(mean(x^2) + eps) kept, and a
    TiedEmbedding called as the LM head (`reverse`) recording its input vectors."""
    if isinstance(layer, DENSE):
        a = tf.cast(inputs, layer.compute_dtype)
        if a.shape.rank == 2:
            z = tf.matmul(a, layer.kernel)
        else:
            z = tf.tensordot(a, layer.kernel, [[a.shape.rank - 1], [0]])
        z = z + layer.bias if layer.use_bias else z
        return a, z, layer.activation(z) if layer.activation is not None else z
    if isinstance(layer, EINSUM_DENSE):
        a = tf.cast(inputs, layer.compute_dtype)
        z = tf.einsum(layer.equation, a, layer.kernel)
        z = z + layer.bias if layer.bias is not None else z
        return a, z, layer.activation(z) if layer.activation is not None else z
    if isinstance(layer, LAYER_NORMALIZATION):
        # in float32 under mixed precision too, as the layer's own call (its weights are not cast)
        x = tf.cast(inputs, tf.float32)
        mean, variance = tf.nn.moments(x, layer.axis, keepdims=True)
        x_hat = (x - mean) * tf.math.rsqrt(variance + layer.epsilon)
        shape = _layer_norm_shape(layer, x.shape.rank)
        z = x_hat * tf.reshape(layer.gamma, shape) if layer.scale else x_hat
        z = z + tf.reshape(layer.beta, shape) if layer.center else z
        return x_hat, z, tf.cast(z, layer.compute_dtype)
    if isinstance(layer, RmsNorm):
        x_hat = layer.normalized(tf.cast(inputs, layer.compute_dtype))
        z = x_hat * layer.scale
        return x_hat, z, z
    if isinstance(layer, TiedEmbedding) and reverse:
        a = tf.cast(inputs, layer.compute_dtype)
        z = type(layer).call(layer, a, reverse=True)
        return a, z, z
    if isinstance(layer, (*EMBEDDING, TiedEmbedding)) and inputs.dtype not in (tf.int32, tf.int64):
        inputs = tf.cast(inputs, tf.int32)
    z = type(layer).call(layer, inputs)  # (tied) Embedding, EmbeddingBag, PositionEmbedding: linear in the weights
    return (None if isinstance(layer, PositionEmbedding) else inputs), z, z


def _layer_norm_shape(layer, rank: int) -> list[int]:
    """The shape gamma and beta broadcast to, from the first normalized axis on (1 elsewhere)."""
    axes = [a % rank for a in layer.axis]
    sizes = iter((layer.gamma if layer.scale else layer.beta).shape)
    return [next(sizes) if k in axes else 1 for k in range(min(axes), rank)]


@contextlib.contextmanager
def _tapped(layers: list, calls: dict[int, list]) -> Iterator[None]:
    """While inside, each of `layers` runs `_forward` and appends (input, z) to calls[id(layer)]."""

    def tap(layer, recorded: list):
        @tf.autograph.experimental.do_not_convert
        def call(inputs, *args, **kwargs):
            a, z, out = _forward(layer, inputs, bool(kwargs.get("reverse", False)))
            recorded.append((a, z))
            return out

        return call

    for layer in layers:
        object.__setattr__(layer, "call", tap(layer, calls[id(layer)]))
    try:
        yield
    finally:
        for layer in layers:
            object.__delattr__(layer, "call")


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
        """sum_i f_i g_i, scattered row by token (`_bag_gradient`)."""
        return _bag_gradient(self.bag, self.ids, self.d * factor[:, None], [], [], factor)

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
    """t in float64, for the sums that cancel (a TPU has no float64: `unsupported_layers`)."""
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
    inputs, kernel, output = _einsum_axes(layer.equation, a.shape.rank)
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


def _layer_pieces(layer, a, d) -> list[Piece]:
    """The pieces of one call of `layer`, from its recorded input a and output gradient d."""
    if isinstance(layer, DENSE):
        p, q = layer.kernel.shape
        steps = _static_product(a.shape[1:-1])
        d = _output_gradients(layer, d)
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
        shape = _layer_norm_shape(layer, a.shape.rank)
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


def _merged(pieces: list[Piece]) -> Piece:
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


def gradient_pieces(model, loss_fn, x, y, weight) -> list[Piece]:
    """Each example's forward pass through `model` with its trainable layers tapped (`_tapped`) and
    its backward pass to their outputs z (not to the weights), vectorized over the examples
    (`each_example`), then each trainable variable's piece. An example's loss is weight_i loss_i, so a
    row of weight 0 has d_i = 0: no norm, no gradient. Each example runs as a batch of its own, so row
    i of every recorded input and output gradient is example i's alone whatever the model's call does
    across its batch (run on the whole batch at once, a transpose that brought another axis of the
    batch's size to the front passed every row count and let one example add up to T C)."""
    layers = _trainable_layers(model)
    tapped: list = []  # (layer, whether its input is recorded) of each call, in order, as traced
    unreached: list = []  # the layers of calls whose output, as traced, has no path to the loss

    def one(example):
        xi, yi, wi = example
        calls: dict[int, list] = {id(layer): [] for layer in layers}
        with _tapped(layers, calls), tf.GradientTape() as tape:
            loss = example_loss(loss_fn, yi, model(one_row(xi), training=True)) * wi
        recorded = [(layer, a, z) for layer in layers for a, z in calls[id(layer)]]
        graph = tf.compat.v1.get_default_graph()
        looped = {f"{layer.name} (called inside a loop)" for layer, _, z in recorded if z.graph is not graph}
        if looped:  # its recorded tensors live inside the loop's own graph (tf.scan, an RNN's cell)
            raise NoFastClipping(", ".join(sorted(looped)))
        tapped[:] = [(layer, a is not None) for layer, a, _ in recorded]
        deltas = tape.gradient(loss, [z for *_, z in recorded])
        unreached[:] = sorted({layer.name for (layer, *_), d in zip(recorded, deltas) if d is None})
        deltas = [tf.zeros_like(z) if d is None else d for (*_, z), d in zip(recorded, deltas)]
        return [a for _, a, _ in recorded if a is not None], deltas

    inputs, deltas = each_example(model, one, (x, y, weight))  # each [n, rows of the call, ...]
    # a call's rows in an example's pass, as traced: anything but 1 (None: known only as the step runs)
    # and its rows would be pieces of one example's gradient, each clipped to C
    several = {
        f"{layer.name} ({d.shape[1] or 'unknown'} rows)" for (layer, _), d in zip(tapped, deltas) if d.shape[1] != 1
    }
    # a call whose output does not reach the loss (recomputed in the backward pass, as keras.remat
    # does, or unused) gives its weights no gradient here, though another path may
    unused = {f"{name} (output not reaching the loss)" for name in unreached}
    if several or unused:
        raise NoFastClipping(", ".join(sorted(several | unused)))
    inputs, deltas = finite_rows_only([a[:, 0] for a in inputs], [d[:, 0] for d in deltas])
    recorded = iter(inputs)
    trainable = {id(v) for v in model.trainable_variables}
    by_variable: dict[int, list[Piece]] = {}
    for (layer, has_input), d in zip(tapped, deltas):
        a = next(recorded) if has_input else None
        # Under mixed precision the pieces are still float32: each row's g_i, its norm and the
        # clipped sum are then computed in float32 from that row's own inputs and output gradients,
        # so rounding never mixes rows (a bfloat16 product over the batch would round the sum).
        a = tf.cast(a, tf.float32) if a is not None and a.dtype.is_floating else a
        for piece in _layer_pieces(layer, a, tf.cast(d, tf.float32)):
            if id(piece.variable) in trainable:
                by_variable.setdefault(id(piece.variable), []).append(piece)
    return [_merged(pieces) for pieces in by_variable.values()]


class NoFastClipping(Exception):
    """The calls of layers that the step's trace shows fast clipping cannot clip per example, as
    "name (why)": a call that sees several rows in one example's pass (a batch of one), or a number
    known only as the step runs (a wrapper such as TimeDistributed, or a reshape or a transpose in the
    model's call, brings time steps into the batch axis: clipped per row, one example would add up to
    T C), a call whose output does not reach the loss (`keras.remat(layer)` recomputes it in the
    backward pass: its weights would get no gradient), and a call inside a loop of the model's
    (tf.scan, an RNN's cell), whose recorded tensors cannot leave the loop. The step takes
    per-example gradients instead (`steps.PrivateStep`)."""


def ghost_norms(model, loss_fn, x, y, weight):
    """||g_i|| for every row: the square root of the pieces' squares summed over the variables."""
    return _norms(gradient_pieces(model, loss_fn, x, y, weight))


def _norms(pieces: list[Piece]):
    """sqrt of the pieces' squares summed over the variables (none below 0: a negative sum would be a
    NaN factor)."""
    return tf.sqrt(tf.maximum(tf.add_n([piece.squares() for piece in pieces]), 0.0))


def ghost_clipped_sum(model, loss_fn, x, y, weight, l2_norm_clip):
    """sum_i g_i min(1, clip / ||g_i||) for a `ghost_clippable` model, from each layer's inputs and
    output gradients (the module docstring's norms); a variable no call reached gets zeros."""
    if _is_dense_stack(model) and not isinstance(x, dict) and tf.TensorShape(x.shape).rank == 2:
        return _dense_stack_clipped_sum(model, loss_fn, x, y, weight, l2_norm_clip)
    pieces = gradient_pieces(model, loss_fn, x, y, weight)
    norms = _norms(pieces)
    factor = tf.minimum(1.0, l2_norm_clip / tf.maximum(norms, 1e-30))
    sums = {id(piece.variable): piece.clipped_sum(factor) for piece in pieces}
    return [sums[id(v)] if id(v) in sums else tf.zeros(v.shape, v.dtype) for v in model.trainable_variables]
