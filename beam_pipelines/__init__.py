"""madp's bounding and batching as Apache Beam transforms, to embed in a pipeline of one's own.

- `ReadRecords` (madp's input files) or `RecordsFromRows` (any PCollection of rows, with the
  `RecordExtractors` that give each row's id, users and content) make the record chunks;
- `BoundContributions` bounds them, or rows with their `RecordExtractors`: the selection shards,
  rejects, counts and the final control;
- `MinSepSample` samples the batches (b-min-sep Poisson sampling) from the records (or rows with
  their `RecordExtractors`) and a selection.

Each class's docstring gives its contract. `madp bound` and `madp batch` (`bound.py`, `batch.py`)
are these transforms with madp's I/O around them.
"""

from madp.beam.bound_contributions import BoundContributions, BoundSelection
from madp.beam.min_sep_sample import MinSepSample, SampledBatches
from madp.beam.record_chunks import ReadRecords, RecordExtractors, RecordsFromRows

__all__ = [
    "BoundContributions",
    "BoundSelection",
    "MinSepSample",
    "ReadRecords",
    "RecordExtractors",
    "RecordsFromRows",
    "SampledBatches",
]
