"""``--json`` prints JSON alone on stdout: everything else that would reach stdout goes to stderr.

Libraries write to stdout behind the caller's back (vLLM's logger, a child process that inherits
file descriptor 1, C code). :func:`stdout_to_stderr` points descriptor 1 and ``sys.stdout`` at stderr
for the duration of the work; the command prints its JSON after the block, on the restored stdout.
"""

from __future__ import annotations

import contextlib
import os
import sys
from collections.abc import Iterator


@contextlib.contextmanager
def stdout_to_stderr(enabled: bool = True) -> Iterator[None]:
    """While active, this process's stdout (``sys.stdout`` and descriptor 1, which child processes
    inherit) writes to stderr. A logger that binds ``sys.stdout`` inside the block keeps stderr."""
    if not enabled:
        yield
        return
    sys.stdout.flush()
    saved_fd = os.dup(1)
    saved_stream = sys.stdout
    os.dup2(2, 1)
    sys.stdout = sys.stderr
    try:
        yield
    finally:
        sys.stderr.flush()
        sys.stdout = saved_stream
        os.dup2(saved_fd, 1)
        os.close(saved_fd)
