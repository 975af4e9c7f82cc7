"""Stand-in ranks for the parallel bench's spawner (`bench.parallel._spawn`): rank 1 is killed by SIGKILL, as the
operating system kills a process that runs the machine out of memory. The standard library only, so that a spawned
rank starts at once (a real rank imports torch and diffusers)."""

from __future__ import annotations

import os
import signal
import time
from typing import Any

#: What rank 0 reports when its peer is gone: gloo's error from its next collective.
GLOO_ERROR = (
    'Traceback (most recent call last):\n  File "parallel.py", line 1, in _rank_main\n'
    "RuntimeError: [gloo/transport/tcp/pair.cc:534] Connection closed by peer [127.0.0.1]:29500"
)


def killed_beside_a_failing_rank(rank: int, world: int, port: int, request: Any, queue: Any) -> None:
    """Rank 1 is killed; rank 0 then reports gloo's error, as a real rank 0 does."""
    if rank == 1:
        os.kill(os.getpid(), signal.SIGKILL)
    time.sleep(0.3)
    queue.put((rank, False, GLOO_ERROR))


def killed_beside_a_waiting_rank(rank: int, world: int, port: int, request: Any, queue: Any) -> None:
    """Rank 1 is killed; rank 0 waits on (a collective that never returns)."""
    if rank == 1:
        os.kill(os.getpid(), signal.SIGKILL)
    time.sleep(60)


def both_failing(rank: int, world: int, port: int, request: Any, queue: Any) -> None:
    """Each rank reports an error of its own and exits as a rank does after its report (code 0)."""
    queue.put((rank, False, f"Traceback (most recent call last):\nValueError: rank {rank}'s own error"))
