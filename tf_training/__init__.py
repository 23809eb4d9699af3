"""DP-SGD and DP-BandMF training on materialized batches (TensorFlow + TensorFlow Privacy).

The Python API, on the batches `madp bound` and `madp batch` (or the `madp.beam` transforms) wrote:
`open_batches` reads them, `read_steps` gives their steps in order (`steps_dataset`: as a
tf.data.Dataset), `calibrate` computes the privacy
plan (mechanism, sigma, epsilon, delta) of training on them, and `make_private` turns a Keras model,
a per-row loss and an optimizer into the private step of that plan (`make_non_private`: a baseline).
`madp train` is this loop with evaluation and outputs around it; the private step enters its training
in the trainings ledger of the batches' selection and composes with the earlier ones there::

    from madp.training import calibrate, load_tensorflow, make_private, open_batches, read_steps

    tf = load_tensorflow()  # TensorFlow with legacy Keras (tf_keras), as madp trains
    import tf_keras

    batches = open_batches("demo-output/batches")  # after `make demo`
    plan = calibrate(batches, epsilon=8, delta=1e-5, bands=8)
    model = tf_keras.Sequential([tf_keras.layers.Dense(1, input_shape=(16,))])

    def loss(labels, logits):  # one loss per row
        labels = tf.cast(labels[:, None], tf.float32)
        return tf.nn.sigmoid_cross_entropy_with_logits(labels=labels, logits=logits)[:, 0]

    step = make_private(model, loss, tf_keras.optimizers.SGD(0.5), plan)
    for rows in read_steps(batches, ["features", "label"]):  # every step, in order, named by its rows
        step(rows["features"], rows["label"], rows["weight"], index=rows["step"])
    print(step.plan.epsilon, step.plan.delta, step.plan.private)

TensorFlow is an optional dependency (`pip install -e '.[train]'` plus `tensorflow-privacy`
installed with --no-deps, see the Makefile); `load_tensorflow` imports it the way that works with
tf-keras 2.21 and TF Privacy 0.9: legacy Keras, and TF Privacy's modules imported one by one
(its package import pulls in modules whose pinned dependencies break TF 2.21). Importing this
package does not import TensorFlow (`madp run` reads privacy plans without it): the API's names
load it on first use.
"""

from __future__ import annotations

import importlib
import os
import sys
from typing import Any

__all__ = [
    "Batches",
    "NonPrivateStep",
    "PrivacyPlan",
    "PrivateTrainingStep",
    "calibrate",
    "compute_precision",
    "labels_read_from_data",
    "load_tensorflow",
    "make_non_private",
    "make_private",
    "open_batches",
    "pretrained_is_public",
    "privacy_json",
    "read_steps",
    "steps_dataset",
]


def load_tensorflow():
    """Import TensorFlow with legacy Keras (tf-keras) and without TF Privacy's eager package import.

    As madp trains: TF_USE_LEGACY_KERAS=1 (unless the environment says otherwise), TensorFlow's oneDNN
    CPU kernels off (TF_ENABLE_ONEDNN_OPTS=1 turns them back on), and TF Privacy's modules imported one
    by one. Import TensorFlow through it, before Keras, in a program that uses `madp.training`.

    Args:
        None.

    Returns:
        The `tensorflow` module.

    Raises:
        madp.core.errors.InputError: TensorFlow is not installed (the message says how to install it).

    Example:
        >>> from madp.training import load_tensorflow
        >>> tf = load_tensorflow()
        >>> import tf_keras  # legacy Keras, as madp trains
        >>> int(tf.reduce_sum(tf.ones([2, 3])))
        6
    """
    os.environ.setdefault("TF_USE_LEGACY_KERAS", "1")
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    # TensorFlow 2.21's oneDNN CPU kernels corrupted the heap in their thread pool ("free(): invalid
    # pointer", an abort) in a Keras 3 Transformer's private step on an AMD EPYC machine whose AVX-512
    # oneDNN does not fully use; TF_ENABLE_ONEDNN_OPTS=1 in the environment turns them back on.
    os.environ.setdefault("TF_ENABLE_ONEDNN_OPTS", "0")
    sys.skip_tf_privacy_import = True  # TF Privacy's __init__ imports modules that need old dependencies
    try:
        import tensorflow as tf
    except ImportError as error:
        from madp.core.errors import InputError

        raise InputError(
            "training needs TensorFlow: pip install -e '.[train]' && "
            "pip install --no-deps tensorflow-privacy==0.9.0 (or run `make test` once)"
        ) from error
    return tf


def __getattr__(name: str) -> Any:
    """The API's names, from `madp.training.api` on first use (it imports TensorFlow). By name, not by
    an import statement: the API's modules import this package for `load_tensorflow`, and the package
    forwards to them only once it is fully imported, so there is no import cycle to guard against."""
    if name in __all__:
        return getattr(importlib.import_module("madp.training.api"), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
