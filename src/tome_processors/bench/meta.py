"""Where a measurement ran: device and dtype choice, package versions, the machine.

Shared by `tome-processors bench`, `eval` and `quality`, so each is written once.

Example:
    >>> resolve_dtype("auto", torch.device("cpu"))
    torch.float32
    >>> package_version("surely-not-installed-anywhere") is None
    True
"""

from __future__ import annotations

import importlib.metadata
import os
import platform
import sys
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch

from .. import __version__

__all__ = [
    "constructed_on",
    "cpu_name",
    "dtype_name",
    "machine",
    "package_version",
    "resolve_device",
    "resolve_dtype",
    "synchronize",
    "timed",
    "versions",
]


def package_version(distribution: str) -> str | None:
    """The installed version of a distribution (`importlib.metadata`), or None when it is not installed."""
    try:
        return importlib.metadata.version(distribution)
    except importlib.metadata.PackageNotFoundError:
        return None


def versions() -> dict[str, str | None]:
    """The versions a measurement ran with: Python, torch, diffusers, tomesd and this library.

    This library's comes from the code that is running (`tome_processors.__version__`, which is also what the
    distribution is built with), so a run from a source tree reports it too.

    Example:
        >>> import tome_processors
        >>> versions()["tome_processors"] == tome_processors.__version__
        True
    """
    return {
        "python": sys.version.split()[0],
        "torch": torch.__version__,
        "diffusers": package_version("diffusers"),
        "tomesd": package_version("tomesd"),
        "tome_processors": __version__,
    }


def resolve_device(name: str) -> torch.device:
    """`"auto"`: CUDA when torch sees one, else the CPU; anything else as `torch.device(name)`."""
    if name != "auto":
        return torch.device(name)
    return torch.device("cuda") if torch.cuda.is_available() else torch.device("cpu")


def resolve_dtype(name: str, device: torch.device) -> torch.dtype:
    """`"auto"`: float16 on CUDA, float32 elsewhere; anything else by its torch name (`"bfloat16"`).

    Example:
        >>> resolve_dtype("auto", torch.device("cuda"))
        torch.float16
        >>> resolve_dtype("bfloat16", torch.device("cpu"))
        torch.bfloat16
    """
    if name == "auto":
        return torch.float16 if device.type == "cuda" else torch.float32
    dtype = getattr(torch, name, None)
    if not isinstance(dtype, torch.dtype):
        raise ValueError(f"Expected a torch dtype name such as 'float16', but got {name!r}.")
    return dtype


@contextmanager
def constructed_on(device: torch.device | str, dtype: torch.dtype) -> Iterator[None]:
    """Modules constructed inside get their weights made on `device` in `dtype` (torch's default device and
    dtype, both put back on leaving): a model of billions of parameters never exists in float32 on the host.

    Only for models whose constructors give every tensor they compute an explicit dtype (rotary tables in
    float32 or float64): a table computed in the default dtype would be made in `dtype`, not cast from float32.

    Example:
        >>> with constructed_on("cpu", torch.bfloat16):
        ...     layer = torch.nn.Linear(2, 2)
        >>> layer.weight.dtype, torch.get_default_dtype()
        (torch.bfloat16, torch.float32)
    """
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with torch.device(device):
            yield
    finally:
        torch.set_default_dtype(previous)


def dtype_name(dtype: torch.dtype) -> str:
    """A dtype as the options and the metadata write it.

    Example:
        >>> dtype_name(torch.float16)
        'float16'
    """
    return str(dtype).replace("torch.", "")


def synchronize(device: torch.device) -> None:
    """Wait for the device's queued work (CUDA, MPS); nothing on the CPU."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    elif device.type == "mps":
        torch.mps.synchronize()


def timed(call: Callable[[], Any], device: torch.device) -> tuple[Any, float]:
    """`(call(), seconds)`, the device synchronised before and after so the time covers its work.

    Example:
        >>> timed(lambda: 2 + 2, torch.device("cpu"))[0]
        4
    """
    synchronize(device)
    start = time.perf_counter()
    out = call()
    synchronize(device)
    return out, time.perf_counter() - start


def cpu_name() -> str:
    """The CPU's model name (from /proc/cpuinfo where there is one)."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def machine(device: torch.device) -> str:
    """`platform; CPU or GPU name; CPU count`."""
    accelerator = torch.cuda.get_device_name(device) if device.type == "cuda" else cpu_name()
    return f"{platform.platform()}; {accelerator}; {os.cpu_count()} CPUs"
