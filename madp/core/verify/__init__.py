"""Independent checks of a bounding output (no user over its bound, no unknown selected id) and of
batches (re-derived from the records, the selection and the batch files: no user of the selection
over K, only selected records, within their copies; each row's content that of its record; the
rows the format says each file and step hold; min-sep between a user's participations,
participations, sizes).

Deliberately shares no code with the reader, the kernels, the engines or the batch writer: it
re-reads the input with plain pyarrow / json, the batches with protobuf, and counts contributions
with Python dictionaries. Its modules import no other module of madp, only each other
(`tests/properties/test_import_graph.py` checks it), so this package is the whole of what a reviewer reads to
trust the two verifiers:

- `records`: the input records, read by the row rules of docs/how-to/your-data.md; `user_ids`: what a string user id
  shows and the addresses it holds (--user-ids email);
- `outputs`: a madp output's report.json, the files it lists (sizes and SHA-256), the selection;
- `buckets`: items partitioned by a hash of a key into buckets on disk, one held in memory at a time;
- `bound`: `verify_bound`, and the bound over a selection that both verifiers check;
- `tfrecords`: TFRecord files and their tf.train.Example rows, read with protobuf alone;
- `batch_rows`: the batch files' rows, checked by what the batch format says of each;
- `batches`: `verify_batches`.

Names with a leading underscore are the package's own: its modules share them, no module outside it
imports them (tests do, to read batch files).
"""

from madp.core.verify.batches import verify_batches
from madp.core.verify.bound import verify_bound
from madp.core.verify.tfrecords import read_tfrecord

__all__ = ["read_tfrecord", "verify_batches", "verify_bound"]
