"""madp: user-level differentially private ML data preparation for multi-user records."""

__version__ = "0.1.0"
