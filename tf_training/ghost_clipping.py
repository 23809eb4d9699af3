"""The clipped gradient sum sum_i g_i min(1, clip / ||g_i||) of one step without per-example
gradients of the model (`ghost_clipped_sum`: "ghost clipping" and book-keeping: Goodfellow 2015;
Lee & Kifer 2021; Li et al. 2022; Bu et al. 2023), for any model (Sequential or functional, tf_keras
or Keras 3) whose trainable layers are Dense, EinsumDense, Embedding, LayerNormalization (also the
projections inside MultiHeadAttention), EmbeddingBag, PositionEmbedding, ScaledGradientDense, RmsNorm
or TiedEmbedding (the pretrained causal LM's), and which layers those are (`unsupported_layers`).

Each example's forward pass runs with those layers' calls tapped (`_tapped`: the same output,
computed from the layer's weights, recording its input and its output before any activation), its
backward pass gives the loss gradients d_i at those outputs (not at the weights), vectorized over
the batch as per-example gradients are (each example a batch of its own, so no call can mix rows:
`_gradient_pieces`), and each variable's per-example gradient g_i is a product of a row's inputs and
output gradients, so its norm comes from them alone (`norm_formulas`). The clipped sum is then
formed from the same inputs and output gradients scaled by the rows' clip factors, without a second
backward pass (TF Privacy's fast-gradient-clipping registry gives the norms, then backpropagates a
reweighted loss again, and knows no madp layers). A Sequential of an optional EmbeddingBag then
Dense layers on vectors runs its layers one by one instead (`_dense_stack_clipped_sum`, the same
norms). Any other trainable layer, one whose call is not the formula's (Keras 3's LoRA, quantized,
rematerialized or RMS-scaled layers) and any trainable variable no layer owns (`unsupported_layers`)
send the model to per-example gradients (`clipping.per_example_gradients`).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

from madp.training import load_tensorflow
from madp.training.clipping import each_example, example_loss, one_row
from madp.training.norm_formulas import (
    DENSE,
    EINSUM_DENSE,
    EMBEDDING,
    LAYER_NORMALIZATION,
    Piece,
    bag_gradient,
    bag_weight_squares,
    einsum_axes,
    layer_norm_shape,
    layer_pieces,
    merged_piece,
    output_gradients,
    piece_norms,
)
from madp.training.pretrained import RmsNorm, TiedEmbedding
from madp.training.queries import kept_rows
from madp.training.text import EmbeddingBag, PositionEmbedding, ScaledGradientDense

tf = load_tensorflow()
import keras  # noqa: E402  (Keras 3: `import keras` beside TensorFlow's legacy tf_keras)
import tf_keras  # noqa: E402

# Keras' activations that act on each row alone (softmax over its last axis): any other function
# may mix a batch's rows, and the stack runs its layers on the whole batch
ROW_WISE_ACTIVATIONS = frozenset(
    tf_keras.activations.get(name)
    for name in ("linear", "relu", "relu6", "elu", "selu", "gelu", "sigmoid", "hard_sigmoid", "tanh", "softmax")
    + ("softplus", "softsign", "swish", "exponential")
)


STACK_DENSE = (tf_keras.layers.Dense, ScaledGradientDense)  # exactly these classes


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
    narrower Dense layer scatters that layer's output gradients (`bag_gradient`)."""
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
            output_norms = tf.reduce_sum(tf.square(output_gradients(layer, d)), axis=1)
            squares.append((tf.reduce_sum(tf.square(a), axis=1) + (1.0 if layer.use_bias else 0.0)) * output_norms)
    factor = tf.minimum(1.0, l2_norm_clip / tf.maximum(tf.sqrt(tf.add_n(squares)), 1e-30))
    gradients = {}
    for index, (layer, a, d) in enumerate(zip(model.layers, inputs, deltas)):
        scaled = d * factor[:, None]
        if isinstance(layer, EmbeddingBag):
            gradients[id(layer.embeddings)] = bag_gradient(
                layer, a, scaled, model.layers[index + 1 :], deltas[index + 1 :], factor
            )
            continue
        scaled = output_gradients(layer, scaled)
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
        return _einsum_problem(*einsum_axes(layer.equation, len(inputs.replace("...", "")) + 1))
    if isinstance(layer, LAYER_NORMALIZATION):
        axes = [layer.axis] if isinstance(layer.axis, int) else list(layer.axis)
        if 0 in axes or axes != sorted(axes) or len({a < 0 for a in axes}) > 1:
            return f"axis {layer.axis}: the batch axis, unsorted axes or axes of both signs"
    return None


def unsupported_layers(model, on_tpu: bool = False) -> list[str]:
    """The trainable layers of `model` that keep it off the fast clipping path, as "name (Class): why".
    On a TPU only a stack of Dense layers takes it: the other norms sum terms that can cancel, which
    the fast path sums in float64 (`norm_formulas._cancelling`), and TPUs have none."""
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
        shape = layer_norm_shape(layer, x.shape.rank)
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


def _gradient_pieces(model, loss_fn, x, y, weight) -> list[Piece]:
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
        for piece in layer_pieces(layer, a, tf.cast(d, tf.float32)):
            if id(piece.variable) in trainable:
                by_variable.setdefault(id(piece.variable), []).append(piece)
    return [merged_piece(pieces) for pieces in by_variable.values()]


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
    return piece_norms(_gradient_pieces(model, loss_fn, x, y, weight))


def ghost_clipped_sum(model, loss_fn, x, y, weight, l2_norm_clip):
    """sum_i g_i min(1, clip / ||g_i||) for a `ghost_clippable` model, from each layer's inputs and
    output gradients (the module docstring's norms); a variable no call reached gets zeros."""
    if _is_dense_stack(model) and not isinstance(x, dict) and tf.TensorShape(x.shape).rank == 2:
        return _dense_stack_clipped_sum(model, loss_fn, x, y, weight, l2_norm_clip)
    pieces = _gradient_pieces(model, loss_fn, x, y, weight)
    norms = piece_norms(pieces)
    factor = tf.minimum(1.0, l2_norm_clip / tf.maximum(norms, 1e-30))
    sums = {id(piece.variable): piece.clipped_sum(factor) for piece in pieces}
    return [sums[id(v)] if id(v) in sums else tf.zeros(v.shape, v.dtype) for v in model.trainable_variables]
