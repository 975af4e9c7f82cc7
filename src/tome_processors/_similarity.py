"""Every source's most similar destination: one batched GEMM, or oneDNN's GEMM on CPU.

The one module that calls private torch ops. On CPU, oneDNN's GEMM (`torch.ops.mkldnn._linear_pointwise`)
ran these shapes faster than the default BLAS call (`bmm`) on some CPUs (AMD EPYC with MKL) with float32
accuracy; it is private and its dtypes depend on the CPU, so it is checked once per dtype and used only
where it computes what `bmm` would. Everywhere else (CUDA, MPS, under torch.compile) it is one `bmm` and
one `max`: few ops matter more than FLOPs there.

`cpu_path(t)` says whether a tensor takes that CPU path.
"""

from __future__ import annotations

from functools import cache

import torch

__all__ = ["best_match", "cpu_path", "is_compiling"]


def best_match(
    src: torch.Tensor, dst: torch.Tensor, choose_dtype: torch.dtype | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """For every source row, its best destination by `src @ dst.T` and that score: `(B, S)` twice.

    Args:
        src: `(B, S, C)`.
        dst: `(B, D, C)`.
        choose_dtype: choose each source's destination on scores computed in this (cheaper) dtype,
            then score the chosen pair in the inputs' dtype, so the ranking of sources stays exact.

    Example:
        >>> src = torch.tensor([[[1.0, 0.0], [0.0, 2.0]]])
        >>> dst = torch.tensor([[[0.0, 1.0], [1.0, 0.0]]])
        >>> [t.tolist() for t in best_match(src, dst)]
        [[[1.0, 2.0]], [[1, 0]]]
    """
    if choose_dtype == src.dtype:
        choose_dtype = None
    if _use_cpu_gemm(src, choose_dtype or src.dtype):
        return _cpu_best_match(src, dst, choose_dtype)
    if choose_dtype is None:
        return torch.bmm(src, dst.mT).max(dim=-1)
    best_dst = torch.bmm(src.to(choose_dtype), dst.to(choose_dtype).mT).max(dim=-1).indices
    return _pair_scores(src, dst, best_dst), best_dst


def _pair_scores(src: torch.Tensor, dst: torch.Tensor, best_dst: torch.Tensor) -> torch.Tensor:
    """`src[b, s] . dst[b, best_dst[b, s]]` for every source: `(B, S)`."""
    chosen = dst.gather(1, best_dst.unsqueeze(-1).expand(-1, -1, dst.shape[-1]))
    return (src * chosen).sum(dim=-1)


def _cpu_best_match(
    src: torch.Tensor, dst: torch.Tensor, choose_dtype: torch.dtype | None
) -> tuple[torch.Tensor, torch.Tensor]:
    # One GEMM and one `max` per sample, not per chunk of rows: on a CPU shared with other work, every
    # parallel region waits for all its threads, and chunks of 512 rows multiplied the regions by six
    # (measured: the whole merge overhead of SD1.5 at 512 px, 0.77x tomesd's instead of 1.18x, 2 threads
    # on a loaded 2-core VM; 0.62x instead of 0.64x on one thread).
    values, indices = [], []
    for sample_src, sample_dst in zip(src, dst, strict=True):
        sample_src, sample_dst = sample_src.contiguous(), sample_dst.contiguous()
        if choose_dtype is None:
            best = torch.ops.mkldnn._linear_pointwise(sample_src, sample_dst, None, "none", [], "").max(dim=-1)
            values.append(best.values)
            indices.append(best.indices)
        else:
            weight = sample_dst.to(choose_dtype)
            scores = torch.ops.mkldnn._linear_pointwise(sample_src.to(choose_dtype), weight, None, "none", [], "")
            best_dst = scores.max(dim=-1).indices
            values.append((sample_src * sample_dst[best_dst]).sum(dim=-1))
            indices.append(best_dst)
    return torch.stack(values), torch.stack(indices)


def _use_cpu_gemm(src: torch.Tensor, dtype: torch.dtype) -> bool:
    # Only where it computes what `bmm` would: on the CPU path, with a dtype oneDNN computes exactly, and on
    # a non-empty input.
    return src.numel() > 0 and cpu_path(src) and _onednn_linear_works(dtype)


def cpu_path(tensor: torch.Tensor) -> bool:
    """Whether work on `tensor` takes the CPU path: on CPU, oneDNN switched on, outside torch.compile and CPU autocast.

    Everything else (CUDA, MPS, compiled graphs, and CPU with `torch.backends.mkldnn` off, which the host-cost
    tests use to count the GPU's ops) takes the path with the fewest ops.

    Example:
        >>> with torch.backends.mkldnn.flags(enabled=False):
        ...     cpu_path(torch.ones(2))
        False
    """
    return (
        tensor.device.type == "cpu"
        and torch.backends.mkldnn.enabled
        and not is_compiling()
        and not _cpu_autocast_enabled()
    )


@cache
def _onednn_linear_works(dtype: torch.dtype) -> bool:
    if dtype not in (torch.float32, torch.bfloat16):
        return False
    if not (torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_linear_pointwise")):
        return False
    a = torch.linspace(-1, 1, 96).view(8, 12).to(dtype)
    b = torch.linspace(1, -0.5, 60).view(5, 12).to(dtype)
    try:
        with torch.autocast("cpu", enabled=False):  # the reference must be computed in `dtype`
            out = torch.ops.mkldnn._linear_pointwise(a, b, None, "none", [], "")
            reference = a @ b.T
    except (RuntimeError, NotImplementedError):
        return False
    tolerance = 1e-5 if dtype == torch.float32 else 2e-2
    return bool(torch.allclose(out.float(), reference.float(), rtol=tolerance, atol=tolerance))


def is_compiling() -> bool:
    """Whether torch.compile is tracing the caller."""
    compiler = getattr(torch, "compiler", None)
    if compiler is not None and hasattr(compiler, "is_compiling"):  # torch >= 2.3
        return compiler.is_compiling()
    return torch._dynamo.is_compiling()


def _cpu_autocast_enabled() -> bool:
    try:
        return torch.is_autocast_enabled("cpu")  # torch >= 2.4
    except TypeError:
        return torch.is_autocast_cpu_enabled()
