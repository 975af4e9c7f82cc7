"""Token merging math: bipartite soft matching on a 2-D token grid.

Pure tensor functions; nothing here knows about diffusers. Shapes use B (batch), N (tokens),
C (channels), M (tokens left after merging) and a token grid of h rows by w columns, row-major.

A merge is described by one index per token, the row of the merged tensor that the token goes
into. Merging is then a sum into rows divided by the row sizes (`index_add_`), and unmerging is a
single `index_select` that copies each row back to every token that went into it. Neither needs
`scatter_reduce` or `gather`, which are missing or wrong on some backends (MPS, DirectML, ONNX).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from functools import cache, lru_cache

import torch

__all__ = [
    "TokenMerge",
    "bipartite_soft_matching_2d",
    "grid_partition",
    "pool_tokens",
    "window_choice",
]


@dataclass(frozen=True)
class TokenMerge:
    """A computed merge: which row of the merged tensor each token goes to.

    Attributes:
        token_row: `(B * N,)` long, the flat row (`b * M + m`) that token `n` of sample `b` goes into.
        row_size: `(B * M, 1)` the number of tokens in each merged row, in the metric's dtype.
        batch: B.
        num_tokens: N.
        num_rows: M.
        row_token: `(B, M)` long or None, the token each row is kept at: its destination, or the
            one token of a row that nothing was merged into. Positional encodings of merged rows
            (rotary embeddings) follow this token.
    """

    token_row: torch.Tensor
    row_size: torch.Tensor
    batch: int
    num_tokens: int
    num_rows: int
    row_token: torch.Tensor | None = None

    def merge(self, x: torch.Tensor) -> torch.Tensor:
        """`(B, N, C)` -> `(B, M, C)`: each row is the mean of the tokens that went into it."""
        B, N, C = x.shape
        if (B, N) != (self.batch, self.num_tokens):
            raise ValueError(
                f"Expected tokens of shape ({self.batch}, {self.num_tokens}, C), but got {tuple(x.shape)}."
            )
        summed = x.new_zeros(B * self.num_rows, C).index_add_(0, self.token_row, x.reshape(B * N, C))
        return (summed / self.row_size.to(x.dtype)).view(B, self.num_rows, C)

    def unmerge(self, y: torch.Tensor) -> torch.Tensor:
        """`(B, M, C)` -> `(B, N, C)`: every token gets a copy of its row."""
        B, M, C = y.shape
        return y.reshape(B * M, C).index_select(0, self.token_row).view(B, self.num_tokens, C)


@lru_cache(maxsize=64)
def _fixed_partition(h: int, w: int, sx: int, sy: int, device: torch.device) -> tuple[torch.Tensor, ...]:
    # Top-left destinations depend only on the grid: cache them per (grid, device).
    return _partition(h, w, sx, sy, torch.zeros(h // sy, w // sx, dtype=torch.long, device=device))


def _partition(h: int, w: int, sx: int, sy: int, choice: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    hsy, wsx = h // sy, w // sx
    device = choice.device
    # Position of each window's destination: window origin + (choice // sx, choice % sx).
    rows = torch.arange(hsy, device=device).view(hsy, 1) * sy + torch.div(choice, sx, rounding_mode="floor")
    cols = torch.arange(wsx, device=device).view(1, wsx) * sx + choice % sx
    dst_idx = (rows * w + cols).reshape(-1)
    is_dst = torch.zeros(h * w, dtype=torch.bool, device=device)
    is_dst[dst_idx] = True
    # Sorted destinations keep window order; rows/columns left over at the edges are sources. A stable
    # sort of the flags lists sources, then destinations, each ascending; unlike `nonzero` its output
    # size is known in advance, so torch.compile keeps one graph.
    order = torch.argsort(is_dst.to(torch.int32), stable=True)
    num_src = h * w - hsy * wsx
    return order[num_src:], order[:num_src]


def grid_partition(
    h: int, w: int, sx: int, sy: int, choice: torch.Tensor | None = None, device: torch.device | str = "cpu"
) -> tuple[torch.Tensor, torch.Tensor]:
    """Split an `h x w` token grid into destinations (one per full `sy x sx` window) and sources.

    Args:
        choice: `(h // sy, w // sx)` long in `[0, sx * sy)`, the destination's place within each
            window (row-major); `None` takes the top-left token of every window.

    Returns:
        `(dst_idx, src_idx)`: ascending flat token indices, `h//sy * w//sx` destinations and the
        rest as sources.

    Example:
        >>> dst, src = grid_partition(2, 4, sx=2, sy=2)
        >>> dst.tolist(), src.tolist()
        ([0, 2], [1, 3, 4, 5, 6, 7])
    """
    if choice is None:
        return _fixed_partition(h, w, sx, sy, torch.device(device))
    return _partition(h, w, sx, sy, choice)


def window_choice(hsy: int, wsx: int, windows: int, key: torch.Tensor) -> torch.Tensor:
    """A reproducible pseudo-random destination per window, drawn without any RNG state.

    A counter-based hash of `(key, window index)`, computed with int64 tensor ops that never
    overflow, so it runs on any device, inside `torch.compile`, and never touches the global RNG.

    Args:
        hsy, wsx: windows per column and per row.
        windows: the number of choices per window (`sx * sy`).
        key: long scalar tensor mixing the seed, the timestep and the block.

    Returns:
        `(hsy, wsx)` long in `[0, windows)`.
    """
    mask32 = 0xFFFFFFFF
    x = torch.arange(hsy * wsx, device=key.device, dtype=torch.long)
    x = (x * 0x2545F491 + key) & mask32
    for multiplier in (0x7FEB352D, 0x46B1A4A5):  # two rounds of a 32-bit xorshift-multiply mix
        x = x ^ (x >> 15)
        x = (x * multiplier) & mask32  # < 2^32 * 2^31, no int64 overflow
    x = x ^ (x >> 16)
    return (x % windows).view(hsy, wsx)


def _identity(batch: int, num_tokens: int, device: torch.device, dtype: torch.dtype) -> TokenMerge:
    rows = torch.arange(batch * num_tokens, device=device)
    row_token = torch.arange(num_tokens, device=device).expand(batch, num_tokens)
    return TokenMerge(
        rows, torch.ones(batch * num_tokens, 1, device=device, dtype=dtype), batch, num_tokens, num_tokens, row_token
    )


def bipartite_soft_matching_2d(
    metric: torch.Tensor,
    h: int,
    w: int,
    sx: int,
    sy: int,
    r: int,
    choice: torch.Tensor | None = None,
    similarity_dtype: torch.dtype | None = None,
    with_row_token: bool = False,
) -> TokenMerge:
    """Merge `r` source tokens into their most similar destinations (ToMe for SD's matching).

    Destinations are one token per `sy x sx` window (`choice`, or the top-left); the others are
    sources. Each source's best destination is found by cosine similarity of `metric`, and the `r`
    sources with the highest best-similarity are merged into it by mean. The same partition is
    used for the whole batch; the matching is per sample.

    Args:
        metric: `(B, N, C)` with `N == h * w`, the tokens to compare.
        h, w: the token grid, row-major.
        sx, sy: the window width and height.
        r: how many tokens to remove; clipped to the number of sources.
        choice: see `grid_partition`.
        similarity_dtype: compute the similarity matrix in this dtype (e.g. bfloat16, faster on
            CPUs with native bfloat16) to choose each source's destination; the chosen pairs are
            then scored in the metric's dtype for the ranking. None: the metric's dtype.
        with_row_token: also record `TokenMerge.row_token` (for positional encodings that follow
            merged rows, as Flux's rotary embeddings); it costs a sort, so it is off by default.

    Returns:
        A `TokenMerge` to merge and unmerge any `(B, N, C)` tensor of the same tokens.

    Example:
        >>> metric = torch.tensor([[[1.0, 0], [1, 0], [0, 1], [0, 1]]])  # a 1 x 4 grid
        >>> m = bipartite_soft_matching_2d(metric, h=1, w=4, sx=2, sy=1, r=2)
        >>> m.merge(torch.arange(4.0).view(1, 4, 1)).flatten().tolist()
        [0.5, 2.5]
    """
    B, N, _ = metric.shape
    if N != h * w:
        raise ValueError(f"Expected {h * w} tokens for a {h}x{w} grid, but got {N}.")
    if r <= 0 or h // sy == 0 or w // sx == 0:
        return _identity(B, N, metric.device, metric.dtype)

    with torch.no_grad():
        dst_idx, src_idx = grid_partition(h, w, sx, sy, choice, metric.device)
        num_dst, num_src = dst_idx.numel(), src_idx.numel()
        r = min(r, num_src)

        # Cosine similarity: normalise the destinations, and divide each source's best score by its
        # norm afterwards (cheaper than normalising every source row). The clamp keeps zero vectors finite.
        eps = torch.finfo(metric.dtype).tiny
        # Advanced indexing, not `index_select(1, ...)`: the same copy, several times faster on CPU.
        dst = metric[:, dst_idx]
        dst = dst / dst.norm(dim=-1, keepdim=True).clamp_min(eps)
        src = metric[:, src_idx]
        choose_dtype = None if similarity_dtype == metric.dtype else similarity_dtype
        best_score, best_dst = _best_match(src, dst, choose_dtype)  # (B, num_src)
        best_score = best_score / src.norm(dim=-1).clamp_min(eps)

        merged_src = best_score.topk(r, dim=-1).indices  # (B, r)
        is_merged = torch.zeros(B, num_src, dtype=torch.bool, device=metric.device)
        is_merged.scatter_(1, merged_src, True)

        # Rows: unmerged sources first (in token order), then one row per destination.
        num_unmerged = num_src - r
        unmerged_row = torch.cumsum(~is_merged, dim=1) - 1
        src_row = torch.where(is_merged, best_dst + num_unmerged, unmerged_row)
        dst_row = torch.arange(num_unmerged, num_unmerged + num_dst, device=metric.device).expand(B, num_dst)

        num_rows = num_unmerged + num_dst
        token_row = torch.empty(B, N, dtype=torch.long, device=metric.device)
        token_row[:, src_idx] = src_row
        token_row[:, dst_idx] = dst_row
        token_row += torch.arange(B, device=metric.device).view(B, 1) * num_rows
        token_row = token_row.view(-1)

        row_size = torch.zeros(B * num_rows, 1, device=metric.device, dtype=metric.dtype)
        row_size.index_add_(0, token_row, torch.ones(B * N, 1, device=metric.device, dtype=metric.dtype))

        if not with_row_token:  # only positional encodings that follow merged rows need it
            return TokenMerge(token_row, row_size, B, N, num_rows)
        # The token each row is kept at, in row order: the unmerged sources, then the destinations.
        # A stable sort of the merged flags lists the unmerged sources first, in token order (and,
        # unlike a boolean mask, has a size known in advance).
        unmerged_first = torch.argsort(is_merged.to(torch.int32), dim=1, stable=True)[:, :num_unmerged]
        kept_src = src_idx.index_select(0, unmerged_first.reshape(-1)).view(B, num_unmerged)
        row_token = torch.cat([kept_src, dst_idx.expand(B, num_dst)], dim=1)
    return TokenMerge(token_row, row_size, B, N, num_rows, row_token)


@cache
def _onednn_linear_works(dtype: torch.dtype) -> bool:
    # oneDNN's GEMM (`torch.ops.mkldnn._linear_pointwise`, a private op) ran these shapes about twice as
    # fast as the default float32 BLAS call on some CPUs (AMD EPYC with MKL), with float32 accuracy. It
    # is private and its dtypes depend on the CPU, so check once per dtype that it runs and agrees
    # with `matmul` before relying on it.
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


def _use_cpu_gemm(src: torch.Tensor, dtype: torch.dtype) -> bool:
    # Only where it computes what `matmul` would: on CPU, outside torch.compile and CPU autocast
    # (which would change `matmul`'s dtype), with oneDNN switched on, and on a non-empty input.
    return (
        src.device.type == "cpu"
        and src.numel() > 0
        and not _is_compiling()
        and not _cpu_autocast_enabled()
        and torch.backends.mkldnn.enabled
        and _onednn_linear_works(dtype)
    )


def _is_compiling() -> bool:
    compiler = getattr(torch, "compiler", None)
    if compiler is not None and hasattr(compiler, "is_compiling"):  # torch >= 2.3
        return compiler.is_compiling()
    return torch._dynamo.is_compiling()


def _cpu_autocast_enabled() -> bool:
    try:
        return torch.is_autocast_enabled("cpu")  # torch >= 2.4
    except TypeError:
        return torch.is_autocast_cpu_enabled()


def _best_match(
    src: torch.Tensor, dst: torch.Tensor, choose_dtype: torch.dtype | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """For every source row, its best destination by `src @ dst.T` and that score: `(B, S)` twice.

    With `choose_dtype`, the destination is chosen on scores computed in that (cheaper) dtype, and
    the chosen pair is then scored in the inputs' dtype, so the ranking of sources stays exact.
    """
    if not _use_cpu_gemm(src, choose_dtype or src.dtype):
        if choose_dtype is None:
            return (src @ dst.transpose(-1, -2)).max(dim=-1)
        best_dst = (src.to(choose_dtype) @ dst.to(choose_dtype).transpose(-1, -2)).max(dim=-1).indices
        return _pair_scores(src, dst, best_dst), best_dst
    # Per sample, in chunks of source rows small enough that each chunk's scores (and, with
    # `choose_dtype`, its rows for the exact re-scoring) are still in cache when they are read again
    # (measured: about 15% faster than one GEMM then one `max`).
    values, indices = [], []
    for sample_src, sample_dst in zip(src, dst.contiguous(), strict=True):
        weight = sample_dst if choose_dtype is None else sample_dst.to(choose_dtype)
        for chunk in sample_src.split(_CHUNK_ROWS):
            chunk = chunk.contiguous()
            scores = torch.ops.mkldnn._linear_pointwise(
                chunk if choose_dtype is None else chunk.to(choose_dtype), weight, None, "none", [], ""
            )
            if choose_dtype is None:
                best = scores.max(dim=-1)
                values.append(best.values)
                indices.append(best.indices)
            else:
                best_dst = scores.max(dim=-1).indices
                values.append((chunk * sample_dst[best_dst]).sum(dim=-1))
                indices.append(best_dst)
    return torch.cat(values).view(src.shape[:2]), torch.cat(indices).view(src.shape[:2])


def _pair_scores(src: torch.Tensor, dst: torch.Tensor, best_dst: torch.Tensor) -> torch.Tensor:
    """`src[b, s] . dst[b, best_dst[b, s]]` for every source: `(B, S)`."""
    B, num_dst = dst.shape[:2]
    flat = (best_dst + torch.arange(B, device=dst.device).view(B, 1) * num_dst).view(-1)
    chosen = dst.reshape(B * num_dst, -1).index_select(0, flat).view(src.shape)
    return (src * chosen).sum(dim=-1)


_CHUNK_ROWS = 512


def level_downsample(latent_tokens: int, num_tokens: int) -> int:
    """tomesd's downsample factor of a block: `ceil(sqrt(H*W // N))`."""
    return int(math.ceil(math.sqrt(latent_tokens // num_tokens)))


def pool_tokens(x: torch.Tensor, h: int, w: int, factor: int, kind: str = "avg") -> torch.Tensor:
    """Downsample a `(B, h*w, C)` token grid by `factor` per side: `(B, ceil(h/f)*ceil(w/f), C)`.

    `"avg"` averages each `factor x factor` window (partial windows at the edges average what they
    hold); `"nearest"` keeps each window's top-left token.

    Example:
        >>> x = torch.arange(8.0).view(1, 8, 1)  # a 2 x 4 grid
        >>> pool_tokens(x, 2, 4, 2).flatten().tolist()
        [2.5, 4.5]
        >>> pool_tokens(x, 2, 4, 2, "nearest").flatten().tolist()
        [0.0, 2.0]
    """
    B, N, C = x.shape
    if N != h * w:
        raise ValueError(f"Expected {h * w} tokens for a {h}x{w} grid, but got {N}.")
    if factor <= 1:
        return x
    grid = x.view(B, h, w, C)
    if kind == "nearest":
        return grid[:, ::factor, ::factor].reshape(B, -1, C)
    if kind != "avg":
        raise ValueError(f'Expected kind "avg" or "nearest", but got {kind!r}.')
    pooled = torch.nn.functional.avg_pool2d(grid.permute(0, 3, 1, 2), factor, ceil_mode=True, count_include_pad=False)
    return pooled.flatten(2).transpose(1, 2)
