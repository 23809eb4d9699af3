"""Elements made of arrays, sized by the bytes of their arrays.

`sys.getsizeof` of a plain object counts its header only: a record partition of 60 MB of arrays
measures 56 bytes. Runners and schedulers that size the elements they hold by `sys.getsizeof` to
place, balance and spill work then see no cost in moving one, and move it where a task is idle
rather than run the task where its data is.
"""

from __future__ import annotations

import sys

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

_ARRAYS = (np.ndarray, pa.Array, pa.ChunkedArray, pa.Table, pa.RecordBatch)


def _held_bytes(value: object) -> int:
    """The bytes `value` holds: an array's or table's buffers, or `sys.getsizeof` of anything else
    (a nested `Columnar` included)."""
    return value.nbytes if isinstance(value, _ARRAYS) else sys.getsizeof(value)


class Columnar:
    """A dataclass of arrays (and small values) whose size is its fields' `_held_bytes`.

    >>> import sys, dataclasses, numpy as np
    >>> @dataclasses.dataclass
    ... class Keys(Columnar):
    ...     keys: np.ndarray
    >>> sys.getsizeof(Keys(np.zeros(1000, np.int64))) > 8000
    True
    """

    def __sizeof__(self) -> int:
        return object.__sizeof__(self) + sum(_held_bytes(value) for value in vars(self).values())


def dense_codes(values: pa.Array) -> tuple[np.ndarray, pa.Array]:
    """(per value the index of its value in `distinct`, int64; `distinct`, each value once, in no
    promised order) of ids without nulls. Integer ids are sorted, where Arrow's `dictionary_encode`
    builds a hash table: on a partition's 2M user ids (1.3M distinct) that took 200 MB and 0.5 s
    against 50 MB and 0.25 s.

    >>> codes, distinct = dense_codes(pa.array([7, 3, 7]))
    >>> codes.tolist(), distinct.to_pylist()
    ([1, 0, 1], [3, 7])
    """
    if not pa.types.is_integer(values.type):
        encoded = pc.dictionary_encode(values)
        return encoded.indices.to_numpy(zero_copy_only=False).astype(np.int64), encoded.dictionary
    plain = values.to_numpy()
    order = np.argsort(plain, kind="stable")
    ascending = plain[order]
    starts = np.ones(len(ascending), dtype=bool)
    np.not_equal(ascending[1:], ascending[:-1], out=starts[1:])
    running = np.cumsum(starts, dtype=np.int64)
    running -= 1
    codes = np.empty(len(plain), dtype=np.int64)
    codes[order] = running
    return codes, pa.array(ascending[starts], type=values.type)
