"""madp's bounding and batching as Apache Beam transforms, to embed in a pipeline of one's own.

- `ReadRecords` (madp's input files) or `RecordsFromRows` (any PCollection of rows, with a function
  that extracts each row's id and users) make the record chunks;
- `BoundContributions` bounds them: the selection shards, rejects, counts and the final control;
- `MinSepSample` samples the batches (b-min-sep Poisson sampling) from the records and a selection.

Each class's docstring gives its contract. `madp bound` and `madp batch` (`bound.py`, `batch.py`)
are these transforms with madp's I/O around them.
"""

from madp.beam.bound_contributions import BoundContributions, BoundSelection
from madp.beam.min_sep_sample import MinSepSample, SampledBatches
from madp.beam.record_chunks import ReadRecords, RecordsFromRows

__all__ = ["BoundContributions", "BoundSelection", "MinSepSample", "ReadRecords", "RecordsFromRows", "SampledBatches"]
