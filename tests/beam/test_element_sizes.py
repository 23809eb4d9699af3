"""The elements our Beam pipelines pass between steps are sized by the bytes of their arrays, for the
runners and schedulers that place, balance and spill work by an element's size."""

from __future__ import annotations

import dataclasses
import sys

import pytest

pytestmark = [pytest.mark.beam]


def _dataclasses_of_arrays(module) -> list[type]:
    return [
        cls
        for cls in vars(module).values()
        if isinstance(cls, type)
        and dataclasses.is_dataclass(cls)
        and cls.__module__ == module.__name__
        and any(kind in str(field.type) for field in dataclasses.fields(cls) for kind in ("np.ndarray", "pa.Array"))
    ]


def test_every_element_of_arrays_is_sized_by_its_arrays():
    """`sys.getsizeof` of a plain object counts its header only: an element class that did not count
    its arrays measured 56 bytes for a 30 MB record partition, and a scheduler that sizes elements so
    moves such partitions to idle workers as if they cost nothing."""
    import numpy as np
    import pyarrow as pa

    from madp.beam import batch, batch_join, batch_sample
    from madp.core import batch_files, batch_steps, bound_steps, bounding, records
    from madp.core.columnar import Columnar

    travelling = [
        cls
        for module in (batch, batch_join, batch_sample, batch_steps, bound_steps)
        for cls in _dataclasses_of_arrays(module)
    ]
    travelling += [batch_files.FileRows, bounding.UserSide, records.RecordChunk]
    assert len(travelling) > 12
    assert [cls.__name__ for cls in travelling if not issubclass(cls, Columnar)] == []

    keys = np.arange(100_000, dtype=np.int64)
    partition = bound_steps.RecordPartition(3, keys, pa.array(keys), keys, keys, np.zeros(len(keys), bool))
    arrays = 4 * keys.nbytes + len(keys)
    assert arrays < sys.getsizeof(partition) < arrays + 1000
