"""Host cost of one forward: what the host has to do besides waiting for the device.

An eager forward of a diffusion model at common sizes is bound by the host (Python, dispatch, kernel
launches) on a GPU, so a method that adds operators or makes the host wait for the device can be
slower there although it saves arithmetic. Counted on one forward:

- `aten_ops`: every aten operator the forward dispatches (views included), counted by a
  `TorchDispatchMode`; on any device. Ops inside a compiled graph's generated kernels are not seen,
  the graph's calls into aten (extern kernels) are.
- `sync_ops`: those among them that make the host wait for the device or copy Python data to it
  (`HOST_SYNC_OPS`: `.item()` / `float(t)` / `bool(t)`, `nonzero`, `torch.tensor(...)`, `equal`), and
  indexing with a boolean mask (`index (bool mask)`), whose result size the host must read back.
- CUDA only: `cuda_kernels`, the kernels the forward launches (`torch.profiler`, CUDA activity,
  memory copies and sets left out), and `cuda_syncs`, the synchronising CUDA calls
  (`torch.cuda.set_sync_debug_mode("warn")`, one warning each).

Example:
    >>> out, cost = measure_host_cost(lambda: torch.ones(3).sum().item(), torch.device("cpu"))
    >>> cost.sync_ops, cost.sync_op_names
    (1, {'_local_scalar_dense': 1})
"""

from __future__ import annotations

import warnings
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode

__all__ = ["BOOL_MASK_INDEX", "HOST_SYNC_OPS", "HostCost", "count_aten_ops", "measure_host_cost"]

#: aten ops (overload packets) that block the host on the device's result, or build a tensor from Python data.
HOST_SYNC_OPS = frozenset({"_local_scalar_dense", "item", "nonzero", "is_nonzero", "equal", "lift_fresh"})
#: The name boolean-mask indexing is counted under in `HostCost.sync_op_names`.
BOOL_MASK_INDEX = "index (bool mask)"


@dataclass
class HostCost:
    """What one forward cost the host (see the module docstring).

    Attributes:
        aten_ops: aten operators dispatched.
        sync_ops: of those, ops in `HOST_SYNC_OPS`.
        sync_op_names: `{op name: count}` of those.
        cuda_kernels: CUDA kernels launched, or None off CUDA.
        cuda_syncs: synchronising CUDA calls, or None off CUDA.
    """

    aten_ops: int
    sync_ops: int
    sync_op_names: dict[str, int] = field(default_factory=dict)
    cuda_kernels: int | None = None
    cuda_syncs: int | None = None


class _OpCounter(TorchDispatchMode):
    """Counts aten ops by overload packet name (`aten.mm.default` and `aten.mm.out` are both `mm`)."""

    def __init__(self) -> None:
        super().__init__()
        self.ops: Counter[str] = Counter()
        self.syncs: Counter[str] = Counter()

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        name = func._overloadpacket.__name__
        self.ops[name] += 1
        if name in HOST_SYNC_OPS:
            self.syncs[name] += 1
        elif name == "index" and len(args) > 1 and any(_is_mask(i) for i in args[1]):
            self.syncs[BOOL_MASK_INDEX] += 1
        return func(*args, **(kwargs or {}))


def _is_mask(index: Any) -> bool:
    return isinstance(index, torch.Tensor) and index.dtype in (torch.bool, torch.uint8)


def count_aten_ops(call: Callable[[], Any]) -> tuple[Any, Counter[str], Counter[str]]:
    """Run `call()` and count the aten ops it dispatches: `(its result, all ops, host-sync ops)` by name.

    Example:
        >>> _, ops, syncs = count_aten_ops(lambda: torch.ones(2, 2) @ torch.ones(2, 2))
        >>> ops["mm"], ops["ones"], sum(syncs.values())
        (1, 2, 0)
    """
    with _OpCounter() as counter:
        out = call()
    return out, counter.ops, counter.syncs


def _cuda_kernels(call: Callable[[], Any], device: torch.device) -> tuple[Any, int]:
    activities = [torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA]
    torch.cuda.synchronize(device)
    with torch.profiler.profile(activities=activities) as profile:
        out = call()
        torch.cuda.synchronize(device)
    kernels = 0
    for event in profile.events():
        if event.device_type == torch.autograd.DeviceType.CUDA and not event.name.startswith(("Memcpy", "Memset")):
            kernels += 1
    return out, kernels


def _cuda_syncs(call: Callable[[], Any], device: torch.device) -> tuple[Any, int]:
    torch.cuda.synchronize(device)
    previous = torch.cuda.get_sync_debug_mode()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            out = call()
        finally:
            torch.cuda.set_sync_debug_mode(previous)
    torch.cuda.synchronize(device)
    return out, sum("synchronizing" in str(w.message) for w in caught)


def measure_host_cost(call: Callable[[], Any], device: torch.device) -> tuple[Any, HostCost]:
    """Run `call()` (one forward) and count its host cost: `(its result, HostCost)`.

    Off CUDA the forward runs once, under the op counter. On CUDA it runs three times (op counter,
    profiler, sync debug mode), so that no instrument sees another's work; the last result is returned.
    """
    out, ops, syncs = count_aten_ops(call)
    cost = HostCost(aten_ops=sum(ops.values()), sync_ops=sum(syncs.values()), sync_op_names=dict(sorted(syncs.items())))
    if device.type == "cuda":
        del out
        out, cost.cuda_kernels = _cuda_kernels(call, device)
        del out
        out, cost.cuda_syncs = _cuda_syncs(call, device)
    return out, cost
