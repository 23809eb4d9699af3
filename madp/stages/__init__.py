"""One function per step of madp, the Python API the `madp` package exports: `bound`, `batch`,
`calibrate`, `train` and `recommend_k`. Each takes its command's options as keyword arguments, runs what
the command runs, and returns what the step reports; the commands (`madp.commands`) are these functions
with their arguments parsed. Importing this package imports neither Beam nor TensorFlow: a step imports
what its engine needs when it runs."""

from madp.stages.batching import batch
from madp.stages.bounding import bound
from madp.stages.calibrating import calibrate
from madp.stages.recommending import recommend_k
from madp.stages.training import train

__all__ = ["batch", "bound", "calibrate", "recommend_k", "train"]
