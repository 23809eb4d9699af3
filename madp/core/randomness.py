"""The secret randomness a privacy guarantee rests on: which units a batch samples, and the noise.

Amplification by subsampling and the Gaussian mechanism hold only against an adversary who cannot
reproduce these draws. So by default their key is 128 bits of fresh entropy from the operating
system, drawn once per run, kept in memory and never written to an output, log or report. An
explicit seed derives the key reproducibly (for tests and debugging); the outputs then say
`FIXED_SEED` and a warning is logged, since anyone who knows the seed regenerates the draws.
"""

from __future__ import annotations

import dataclasses
import hashlib
import logging
import os

import numpy as np

from madp.core.hashing import siphash24

log = logging.getLogger("madp")
SECRET = "secret key (fresh entropy, never written)"
FIXED_SEED = "fixed seed - not private"
DETERMINISTIC = "deterministic schedule (no secret sampling needed)"
_MASK = 0xFFFFFFFFFFFFFFFF


@dataclasses.dataclass(frozen=True)
class SecretKey:
    """A 128-bit key (two 64-bit words); `seed` is the explicit seed it was derived from, if any."""

    words: tuple[int, int] = dataclasses.field(repr=False)
    seed: int | None = None

    @classmethod
    def fresh(cls) -> SecretKey:
        value = int.from_bytes(os.urandom(16), "little")
        return cls((value & _MASK, value >> 64))

    @classmethod
    def from_seed(cls, seed: int, purpose: str) -> SecretKey:
        """Reproducible: SHA-256 of (purpose, seed), so one seed gives independent keys per purpose."""
        digest = hashlib.sha256(f"madp/{purpose}/{seed}".encode()).digest()
        return cls((int.from_bytes(digest[:8], "little"), int.from_bytes(digest[8:16], "little")), seed)

    @classmethod
    def for_run(cls, seed: int | None, purpose: str, option: str) -> SecretKey:
        """Fresh entropy, or (with a warning) the key of an explicit seed given by `option`."""
        if seed is None:
            return cls.fresh()
        log.warning(
            "%s %d fixes the %s: anyone who knows it can regenerate it, so the result is NOT "
            "private (for tests and debugging only)",
            option,
            seed,
            purpose,
        )
        return cls.from_seed(seed, purpose)

    @property
    def status(self) -> str:
        """What the outputs say about this randomness: SECRET or FIXED_SEED."""
        return SECRET if self.seed is None else FIXED_SEED

    def subkey(self, stream: int) -> tuple[int, int]:
        """An independent 128-bit key for one use of this key (a keyed PRF of the stream number)."""
        words = siphash24(self.words, np.array([2 * stream, 2 * stream + 1], dtype=np.uint64))
        return int(words[0]), int(words[1])
