"""The noise of DP-SGD and DP-BandMF as TensorFlow Privacy `DPQuery`s.

Both clip each record (a per-example gradient) to `l2_norm_clip` and sum; the noise is drawn from
a stateless generator keyed by (noise key, step, variable) (`variable_stream`). The 128-bit noise key is secret (fresh
entropy per run, see `madp.core.randomness`): replicas share it in memory and so draw the same z_t
without talking, and no output holds it. Both queries draw the same z_t for the same key:
- `DpSgdQuery`: sum + z_t, z_t ~ N(0, (sigma * clip)^2 I) (a GaussianSumQuery with seeded noise);
- `BandMfQuery`: sum + w_t with w = C^-1 z for the lower-triangular banded Toeplitz C of bands
  c_0..c_{b-1} (b-min-sep paper, Sec. 2.3): w_t = (z_t - sum_{j>=1} c_j w_{t-j}) / c_0, so the
  global state keeps the last b-1 noise vectors. With one band (c_0 = 1) w_t = z_t: DP-SGD.
"""

from __future__ import annotations

import collections

import numpy as np

from madp.core.randomness import SecretKey
from madp.training import load_tensorflow

tf = load_tensorflow()
from tensorflow_privacy.privacy.dp_query import dp_query, gaussian_query  # noqa: E402


def key_tensor(key: SecretKey):
    """The noise key as the shape-[2] int64 seed of TensorFlow's stateless generators."""
    return tf.constant(np.array(key.words, dtype=np.uint64).view(np.int64))


_PHILOX = 1  # tf.random.Algorithm.PHILOX: Philox-4x32-10, a 64-bit key and a 128-bit counter


def variable_stream(key, step, index: int):
    """(Philox key [1], counter [2]) of variable `index`'s noise at `step`: one Philox block keyed by
    the noise key's word 0 at counter (step * 2^32 + index, word 1) gives the variable's own 128 bits.
    So every bit of the 128-bit key counts, and two (step, variable) pairs share a stream with
    probability 2^-128. TensorFlow's V2 random ops take 64-bit key and counter words, under XLA too;
    its seeded ops do not (`stateless_normal` keeps 32 bits of each int64 seed word under XLA, and
    `stateless_fold_in` with an int gives an int32 seed, 32 secret bits per variable and step)."""
    words = tf.bitcast(key, tf.uint64)
    position = tf.bitwise.bitwise_or(
        tf.bitwise.left_shift(tf.cast(step, tf.uint64), tf.constant(32, tf.uint64)), tf.constant(index, tf.uint64)
    )
    derived = tf.raw_ops.StatelessRandomUniformFullIntV2(
        shape=[2], key=words[:1], counter=tf.stack([position, words[1]]), alg=_PHILOX, dtype=tf.uint64
    )
    return derived[:1], tf.stack([tf.constant(0, tf.uint64), derived[1]])


def stateless_noise(template, stddev, key, step):
    """z_t: independent N(0, stddev^2) entries shaped like `template`, keyed by (key, step, variable)
    (`variable_stream`). Inside an XLA program the normals are other draws of the same law."""
    leaves = tf.nest.flatten(template)
    noise = []
    for index, leaf in enumerate(leaves):
        stream_key, counter = variable_stream(key, step, index)
        z = tf.raw_ops.StatelessRandomNormalV2(
            shape=tf.shape(leaf), key=stream_key, counter=counter, alg=_PHILOX, dtype=leaf.dtype
        )
        noise.append(z * tf.cast(stddev, leaf.dtype))
    return tf.nest.pack_sequence_as(template, noise)


def clip_and_sum(l2_norm_clip, per_example):
    """sum_i g_i min(1, clip / ||g_i||) over a batch of per-example structures (leading axis i):
    `preprocess_record` then sum for every record, in one vectorized computation (the record-wise
    clip_by_global_norm has no vectorized form in TF and would loop over records)."""
    leaves = tf.nest.flatten(per_example)
    squares = tf.add_n([tf.reduce_sum(tf.reshape(tf.square(leaf), [tf.shape(leaf)[0], -1]), axis=1) for leaf in leaves])
    # A record whose gradient holds a NaN or inf (or whose squared norm overflows) adds nothing: its
    # clip factor times its values would put NaN into the sum (0 * inf), the whole model's released.
    finite = tf.math.is_finite(squares)
    factor = tf.where(finite, tf.minimum(1.0, l2_norm_clip / tf.maximum(tf.sqrt(squares), 1e-30)), 0.0)
    summed = [tf.tensordot(factor, kept_rows(leaf, finite), axes=1) for leaf in leaves]
    return tf.nest.pack_sequence_as(per_example, summed)


def kept_rows(t, keep):
    """`t` (leading axis: rows) with the rows where `keep` is false set to zero."""
    rows = tf.reshape(keep, tf.concat([tf.shape(keep), tf.ones([tf.rank(t) - 1], tf.int32)], 0))
    return tf.where(rows, t, tf.zeros_like(t))


class DpSgdQuery(gaussian_query.GaussianSumQuery):
    """Clip each record to `l2_norm_clip`, sum, add z_t ~ N(0, (noise_multiplier * clip)^2 I)."""

    _GlobalState = collections.namedtuple("_GlobalState", ["l2_norm_clip", "stddev", "key", "step"])

    def __init__(self, l2_norm_clip: float, noise_multiplier: float, key: SecretKey):
        super().__init__(l2_norm_clip, l2_norm_clip * noise_multiplier)
        self._key = key

    def initial_global_state(self):
        return self._GlobalState(
            tf.constant(self._l2_norm_clip, tf.float32),
            tf.constant(self._stddev, tf.float32),
            key_tensor(self._key),
            tf.constant(0, tf.int64),
        )

    def derive_sample_params(self, global_state):
        return global_state.l2_norm_clip

    def get_noised_result(self, sample_state, global_state):
        noise = stateless_noise(sample_state, global_state.stddev, global_state.key, global_state.step)
        result = tf.nest.map_structure(tf.add, sample_state, noise)
        return result, global_state._replace(step=global_state.step + 1), None


class BandMfQuery(dp_query.SumAggregationDPQuery):
    """Clip and sum like `DpSgdQuery`; add w_t = (C^-1 z)_t for a banded Toeplitz C."""

    _GlobalState = collections.namedtuple("_GlobalState", ["l2_norm_clip", "stddev", "key", "step", "history"])

    def __init__(self, l2_norm_clip: float, noise_multiplier: float, key: SecretKey, coefficients, template):
        """`coefficients`: c_0..c_{b-1} (c_0 > 0); `template`: tensors shaped like a record."""
        if not len(coefficients) or coefficients[0] <= 0:
            raise ValueError("BandMF needs at least one band, with c_0 > 0")
        self._clipping = DpSgdQuery(l2_norm_clip, noise_multiplier, key)
        self._coefficients = [float(c) for c in coefficients]
        self._template = template

    def initial_global_state(self):
        clip_state = self._clipping.initial_global_state()
        history = tuple(
            tf.nest.map_structure(lambda t: tf.zeros(t.shape, t.dtype), self._template) for _ in self._coefficients[1:]
        )
        return self._GlobalState(*clip_state, history=history)

    def derive_sample_params(self, global_state):
        return global_state.l2_norm_clip

    def preprocess_record(self, params, record):
        return self._clipping.preprocess_record(params, record)

    def get_noised_result(self, sample_state, global_state):
        z = stateless_noise(sample_state, global_state.stddev, global_state.key, global_state.step)
        leaves = tf.nest.flatten(z)
        for lag, band in enumerate(self._coefficients[1:]):
            past = tf.nest.flatten(global_state.history[lag])
            leaves = [leaf - band * old for leaf, old in zip(leaves, past)]
        c0 = self._coefficients[0]
        w = tf.nest.pack_sequence_as(z, [leaf / c0 for leaf in leaves])
        history = ((w,) + global_state.history[:-1]) if global_state.history else ()
        result = tf.nest.map_structure(tf.add, sample_state, w)
        return result, global_state._replace(step=global_state.step + 1, history=history), None
