"""The clipped gradient sum sum_i g_i min(1, clip / ||g_i||) of one step, two ways.

- `per_example_gradients` (here) then `queries.clip_and_sum`: any model, one gradient per example
  (vectorized), memory rows x parameters.
- `ghost_clipping.ghost_clipped_sum`: models of the layers it has norm formulas for
  (`norm_formulas`), without per-example gradients of the model.

Both run each example through the model as a batch of its own (`each_example`, `example_loss`,
`one_row`), refusing a model that writes into its variables in its call; `user_averages` turns
either's per-example records into user-level clipping's.
"""

from __future__ import annotations

import logging

from madp.core.errors import InputError
from madp.training import load_tensorflow

tf = load_tensorflow()

log = logging.getLogger("madp.train")


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
    writes, which is refused (`_written_variables`)."""
    signature: list = []

    def traced(example):
        outputs = one(example)
        written = _written_variables(model)
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


def _written_variables(model) -> list[str]:
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
