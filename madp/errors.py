"""The one error madp reports to users: bad input, options or outputs, with a message that names
the file, row, option or output and says why."""
from __future__ import annotations


class InputError(ValueError):
    """Bad input or options, with a message that names the file, row and reason."""
