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
    """The test-only patches (module doc)."""
    import diffusers.hooks.tensor_parallel as tensor_parallel
    import diffusers.models.attention_dispatch as dispatch

    torch.accelerator.device_count = lambda: 1
    if "cpu" not in tensor_parallel._SUPPORTED_TP_DEVICES:
        tensor_parallel._SUPPORTED_TP_DEVICES = (*tensor_parallel._SUPPORTED_TP_DEVICES, "cpu")
    dispatch._native_attention_forward_op = _attention_with_lse


def _attention_with_lse(
    ctx: Any,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attn_mask: torch.Tensor | None = None,
    dropout_p: float = 0.0,
    is_causal: bool = False,
    scale: float | None = None,
    enable_gqa: bool = False,
    return_lse: bool = False,
    _save_ctx: bool = True,
    _parallel_config: Any = None,
) -> Any:
    """diffusers' native forward op, `(B, S, H, D)` in and out, with the log-sum-exp `(B, S, H)` where asked."""
    query, key, value = (x.permute(0, 2, 1, 3) for x in (query, key, value))
    if not return_lse:
        out = torch.nn.functional.scaled_dot_product_attention(
            query, key, value, attn_mask=attn_mask, dropout_p=dropout_p, is_causal=is_causal, scale=scale
        )
        return out.permute(0, 2, 1, 3)
    if attn_mask is not None and attn_mask.dtype == torch.bool:  # the CPU kernel takes an additive mask only
        attn_mask = torch.zeros(attn_mask.shape, dtype=query.dtype).masked_fill(~attn_mask, float("-inf"))
    elif attn_mask is not None:
        attn_mask = attn_mask.to(query.dtype)
    if attn_mask is not None:
        attn_mask = attn_mask.expand(query.shape[0], query.shape[1], query.shape[2], key.shape[2])
    out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
        query, key, value, dropout_p, is_causal, attn_mask=attn_mask, scale=scale
    )
    out = out.permute(0, 2, 1, 3)
    return out, lse.transpose(1, 2)
