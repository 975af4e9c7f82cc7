"""Run a function on several CPU processes joined by gloo, as diffusers' context and tensor parallelism expect.

Test-only patches, applied in the workers alone: `torch.accelerator.device_count` returns 1 (diffusers picks the
device as `rank % device_count()`), the CPU is one of diffusers' tensor-parallel devices, and the native attention
backend returns the log-sum-exp that ring attention combines blocks with
(`aten._scaled_dot_product_flash_attention_for_cpu`; diffusers' own native op returns none).
"""

from __future__ import annotations

import os
import socket
import traceback
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from tome_processors.bench.parallel import cpu_stand_ins


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_ranks(function: Callable[[int, int], Any], world_size: int = 2, timeout: float = 600.0) -> list[Any]:
    """`function(rank, world_size)` on `world_size` spawned processes (one thread each); each rank's result, in
    rank order. Results must pickle (send NumPy arrays, not tensors). A failure on any rank raises here with its
    traceback."""
    context = mp.get_context("spawn")
    results = context.Queue()
    port = _free_port()
    processes = [
        context.Process(target=_worker, args=(rank, world_size, port, function, results)) for rank in range(world_size)
    ]
    for process in processes:
        process.start()
    gathered: dict[int, Any] = {}
    try:
        for _ in processes:
            rank, ok, value = results.get(timeout=timeout)
            if not ok:
                raise RuntimeError(f"rank {rank} failed:\n{value}")
            gathered[rank] = value
    finally:
        for process in processes:
            process.join(timeout=30)
            if process.is_alive():
                process.kill()
    return [gathered[rank] for rank in range(world_size)]


def _worker(rank: int, world_size: int, port: int, function: Callable, results: Any) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    try:
        patch_for_cpu()
        dist.init_process_group("gloo", rank=rank, world_size=world_size)
        try:
            value = function(rank, world_size)
        finally:
            dist.destroy_process_group()
        results.put((rank, True, value))
    except BaseException:  # noqa: BLE001 - reported to the parent with its traceback
        results.put((rank, False, traceback.format_exc()))


def patch_for_cpu() -> None:
    """The test-only patches (module doc): the parallel bench's CPU stand-ins, set in this worker alone."""
    cpu_stand_ins()
