"""The in-memory engines: the core kernels on the whole data as one partition (bounding, batching),
and the batch report both engines write. `beam_pipelines/` is the same layer on Beam."""
