"""Two verl launches' weight syncs made to overlap: loaded at interpreter start (Python imports
``sitecustomize`` from PYTHONPATH) by every process of a launch that has this folder on PYTHONPATH.

With ``OVERLAP_ENV`` naming a folder shared by two launches, verl's weight-sync sender
(``BucketedWeightSender._init_socket``, in the training worker) waits before its n-th bind until
the other launch's sender has reached its n-th bind too (a file ``{n}-{pid}`` each in the folder),
so the two launches bind their sockets within milliseconds of each other at every sync, where two
independent launches overlap only by chance. Unset: nothing changes. A sender that waits
``WAIT_S`` in vain goes on and leaves ``{n}-{pid}.alone``, which the test reads as a failure.
"""

import os
import sys
import time

OVERLAP_ENV = "TOP_TEST_OVERLAP_WEIGHT_SYNC"
PARTIES, WAIT_S, POLL_S = 2, 300.0, 0.002
SENDER_MODULE = "verl.workers.rollout.vllm_rollout.bucketed_weight_transfer"


def _rendezvous(folder: str, n: int) -> None:
    mine = f"{n}-{os.getpid()}"
    open(os.path.join(folder, mine), "w").close()
    deadline = time.monotonic() + WAIT_S
    while sum(1 for name in os.listdir(folder) if name.split("-")[0] == str(n) and "." not in name) < PARTIES:
        if time.monotonic() > deadline:
            open(os.path.join(folder, mine + ".alone"), "w").close()
            return
        time.sleep(POLL_S)


def _overlap(module) -> None:
    sender = module.BucketedWeightSender
    original = sender._init_socket
    folder, syncs = os.environ[OVERLAP_ENV], [0]

    def _init_socket(self):
        syncs[0] += 1
        _rendezvous(folder, syncs[0])
        return original(self)

    sender._init_socket = _init_socket


class _AfterSenderImport:
    """Runs :func:`_overlap` right after verl's sender module is executed."""

    def find_spec(self, fullname, path, target=None):
        if fullname != SENDER_MODULE:
            return None
        sys.meta_path.remove(self)
        for finder in sys.meta_path:
            spec = finder.find_spec(fullname, path, target) if hasattr(finder, "find_spec") else None
            if spec is not None:
                break
        else:
            return None
        exec_module = spec.loader.exec_module

        def exec_then_overlap(module):
            exec_module(module)
            _overlap(module)

        spec.loader.exec_module = exec_then_overlap
        return spec


if os.environ.get(OVERLAP_ENV):
    sys.meta_path.insert(0, _AfterSenderImport())
