"""InputErrors that a step meets on a worker, kept as files for the driver: a distributed engine
relays a worker's exception as its own error (a runner's or a JVM's traceback), so the step writes
the one-line error under an errors folder and the driver raises it as the local engine would."""

from __future__ import annotations

import contextlib
import uuid
from collections.abc import Callable, Iterable, Iterator

from madp.core import storage
from madp.core.errors import InputError


def _write_bytes(path: str, data: bytes) -> None:
    storage.write_whole(path, lambda handle: handle.write(data))


@contextlib.contextmanager
def keeping_input_errors(
    errors_dir: str | None,
    write_bytes: Callable[[str, bytes], None] = _write_bytes,
    join: Callable[[str, str], str] = storage.join,
) -> Iterator[None]:
    """Around a step's work: an InputError raised in it is written under `errors_dir` (when there is
    one: a pipeline of one's own may leave it out and see the engine's exception) through
    `write_bytes` (default: `madp.core.storage`'s file systems), then raised."""
    try:
        yield
    except InputError as error:
        if errors_dir is not None:
            write_bytes(join(errors_dir, f"{uuid.uuid4().hex}.txt"), str(error).encode())
        raise


def kept_input_error(messages: Iterable[str]) -> InputError | None:
    """The error to raise for the InputErrors the steps kept (the first by its message, when several
    steps met one), or None where they kept none."""
    ordered = sorted(messages)
    return InputError(ordered[0]) if ordered else None


def kept_messages(errors_dir: str) -> list[str]:
    """The messages kept under `errors_dir` through `madp.core.storage` (none where it does not exist)."""
    if storage.kind(errors_dir) != "directory":
        return []
    return [storage.read_text(path) for path in storage.list_files(errors_dir)]
