"""A free TCP port, for the tests that start a gloo process group on 127.0.0.1."""

import socket


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on now (for a gloo group's rendezvous)."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]
