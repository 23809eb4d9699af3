"""DP-SGD and DP-BandMF training on materialized batches (TensorFlow + TensorFlow Privacy).

TensorFlow is an optional dependency (`pip install -e '.[train]'` plus `tensorflow-privacy`
installed with --no-deps, see the Makefile); `load_tensorflow` imports it the way that works with
tf-keras 2.21 and TF Privacy 0.9: legacy Keras, and TF Privacy's modules imported one by one
(its package import pulls in modules whose pinned dependencies break TF 2.21).
"""

from __future__ import annotations

import os
import sys


def load_tensorflow():
    """Import TensorFlow with legacy Keras (tf-keras) and without TF Privacy's eager package import."""
    os.environ.setdefault("TF_USE_LEGACY_KERAS", "1")
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
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
