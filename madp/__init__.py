"""madp: user-level differentially private ML data preparation for multi-user records.

One function per step, each taking its command's options as keyword arguments and returning what the
step reports: `bound` (contribution bounding), `batch` (the training batches), `calibrate` (the
privacy plan), `train` (DP-SGD or DP-BandMF) and `recommend_k` (the contribution bound to choose).
`import madp` imports none of them, nor Beam or TensorFlow: each name loads its step on first use.
`madp.training` holds the lower-level training API, `madp.accounting` the accountant, `madp.beam` the
steps as Beam transforms to embed in a pipeline of one's own.
"""

from __future__ import annotations

from typing import Any

__version__ = "0.1.0"
__all__ = ["batch", "bound", "calibrate", "recommend_k", "train"]


def __getattr__(name: str) -> Any:
    """The step functions (`madp.stages`), imported on first use (PEP 562) so that `import madp`, which
    every module of the package runs first, stays cheap."""
    if name in __all__:
        from madp import stages

        return getattr(stages, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted([*globals(), *__all__])
