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
