"""Token merging math: bipartite soft matching on a 2-D token grid (or a video's frames of one).

Pure tensor functions; nothing here knows about diffusers. Shapes use B (batch), N (tokens),
C (channels), M (tokens left after merging), S and D (sources and destinations) and a token grid of
h rows by w columns, row-major.

A merge is described by one index per token, the row of the merged tensor that the token goes
into. Merging is then a sum into rows divided by the row sizes (`index_add`), and unmerging is a
single row lookup (`embedding`, an `index_select`) that copies each row back to every token that went
into it. Neither needs
`scatter_reduce` or `gather`, which are missing or slow on some backends (on CPU `index_add_` ran
about 10x faster than `scatter_reduce(mean)` here).

Every op here is a kernel launch on a GPU, where eager diffusion is bound by the host: what depends only
on the grid (`Partition`) is built once and cached by the caller, the random destination choice is
drawn for many blocks at once (`GridLayout.partitions`), and nothing reads a tensor back to the host.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TypeVar

import torch

from ._similarity import best_match, is_compiling

__all__ = [
    "GridLayout",
    "Partition",
    "TokenMerge",
    "bipartite_soft_matching_2d",
    "fold_frames",
    "grid_partition",
    "match",
    "pool_tokens",
    "release_buffers",
    "window_choice",
    "window_mix",
]

_MASK32 = 0xFFFFFFFF
T = TypeVar("T")


class TokenMerge:
    """A computed merge: which row of the merged tensor each token goes to.

    The tokens are the grid's, or `text_rows` text tokens followed by the grid's (Flux's single-stream
    blocks, which attend over both at once): each text token is then a row of its own, ahead of the
    grid's rows, so the text passes through merge and unmerge unchanged and nothing is sliced off.

    Attributes:
        token_row: `(B * N,)` long, the flat row (`b * M + m`) that token `n` of sample `b` goes into.
        token_rows: `(B, N)`, the same per sample.
        row_size: `(B * M, 1)` the number of tokens in each merged row, in the metric's dtype.
        batch: B.
        num_tokens: N (`text_rows` plus the grid's tokens).
        num_rows: M.
        text: text tokens ahead of the grid's in the attention's sequence, for `row_token`.
        text_rows: text tokens among the merged tokens, each a row of its own (0 or `text`).
        tail: tokens after the grid's among the merged tokens, each a row of its own after the grid's rows
            (`with_tail_rows`; `match` with `tail`).
        row_token: `(B, text + M - text_rows)` long or None: for each token of the sequence that the
            attention sees (the text, then the grid's merged rows), the position its positional
            encoding is taken at: a text token's own, and for a row the token it is kept at (its
            destination, or the one token of a row that nothing was merged into), counted after the
            text. Positional encodings of merged rows (Flux's rotary embeddings) follow it.
        rotary: the rotary tables of `row_token`, kept by their user (shared with `with_text_rows`).
    """

    __slots__ = (
        "_with_tail",
        "_with_text",
        "batch",
        "num_rows",
        "num_tokens",
        "rotary",
        "row_size",
        "row_token",
        "text",
        "tail",
        "text_rows",
        "token_row",
        "token_rows",
    )

    def __init__(
        self,
        token_row: torch.Tensor,
        row_size: torch.Tensor,
        batch: int,
        num_tokens: int,
        num_rows: int,
        row_token: torch.Tensor | None = None,
        token_rows: torch.Tensor | None = None,
        text: int = 0,
        text_rows: int = 0,
        tail: int = 0,
    ) -> None:
        self.token_row = token_row
        # The same per sample, for `unmerge` (given when the caller has it, to save a view op).
        self.token_rows = token_row.view(batch, num_tokens) if token_rows is None else token_rows
        self.row_size = row_size
        self.batch = batch
        self.num_tokens = num_tokens
        self.num_rows = num_rows
        self.row_token = row_token
        self.text = text
        self.text_rows = text_rows
        self.tail = tail
        self.rotary: list = []
        self._with_text: TokenMerge | None = None
        self._with_tail: TokenMerge | None = None

    def merge(self, x: torch.Tensor) -> torch.Tensor:
        """`(B, N, C)` -> `(B, M, C)`: each row is the mean of the tokens that went into it."""
        B, N, C = x.shape
        if (B, N) != (self.batch, self.num_tokens):
            raise ValueError(
                f"Expected tokens of shape ({self.batch}, {self.num_tokens}, C), but got {tuple(x.shape)}."
            )
        zeros, flat = _zeros(B * self.num_rows, C, x.device, x.dtype), x.reshape(B * N, C)
        summed = _row_sum(zeros, self.token_row, flat)
        row_size = self.row_size if self.row_size.dtype == x.dtype else self.row_size.to(x.dtype)
        return (summed / row_size).view(B, self.num_rows, C)

    def unmerge(self, y: torch.Tensor) -> torch.Tensor:
        """`(B, M, C)` -> `(B, N, C)`: every token gets a copy of its row. A processor's output of more axes,
        `(B, M, ...)` (Lumina-Next's `(B, M, heads, head_dim)`), comes back as `(B, N, ...)`.

        Example:
            >>> merge = TokenMerge(torch.tensor([0, 0, 1]), torch.tensor([[2.0], [1.0]]), 1, 3, 2)
            >>> merge.unmerge(torch.arange(4.0).view(1, 2, 2, 1)).flatten().tolist()
            [0.0, 1.0, 0.0, 1.0, 2.0, 3.0]
        """
        if y.ndim != 3:
            return self.unmerge(y.flatten(2)).unflatten(2, y.shape[2:])
        B, M, C = y.shape
        # A lookup of rows by a `(B, N)` index: one gather kernel, and one op fewer than `index_select`
        # on the flat index and a reshape back (as fast on CPU).
        return torch.nn.functional.embedding(self.token_rows, y.reshape(B * M, C))

    def samples(self, start: int, stop: int) -> TokenMerge:
        """This merge of samples `start` to `stop` only (a feed-forward chunked over the batch calls each chunk apart).

        Example:
            >>> sizes = torch.tensor([[2.0], [1.0], [1.0], [2.0]])
            >>> merge = TokenMerge(torch.tensor([0, 0, 1, 2, 3, 3]), sizes, 2, 3, 2)
            >>> merge.samples(1, 2).merge(torch.tensor([[[1.0], [4.0], [6.0]]])).flatten().tolist()
            [1.0, 5.0]
        """
        if self.text_rows or self.tail:
            raise ValueError(
                f"Expected a merge of grid tokens only, but got {self.text_rows} text rows, {self.tail} tail."
            )
        M = self.num_rows
        token_rows = self.token_rows[start:stop] - start * M
        row_token = self.row_token[start:stop] if self.row_token is not None else None
        size = self.row_size[start * M : stop * M]
        return TokenMerge(
            token_rows.reshape(-1), size, stop - start, self.num_tokens, M, row_token, token_rows, self.text
        )

    def with_text_rows(self, text: int) -> TokenMerge:
        """This merge of the grid's tokens extended to `text` text tokens ahead of them, each a row of its own.

        Made once per merge and kept: a merge shared by many blocks (`share_level`) is extended once per
        forward, not in every block. `match` makes such a merge directly where none is shared.
        """
        if self.text_rows == text:
            return self
        if self.text_rows or self.tail:
            raise ValueError(
                f"Expected a merge of grid tokens only, but got one with {self.text_rows} text rows, {self.tail} tail."
            )
        extended = self._with_text
        if extended is not None and extended.text_rows == text:
            return extended
        B, N, M = self.batch, self.num_tokens, self.num_rows
        device = self.token_row.device
        # Sample b's rows now start at b * (text + M), its text rows first: the grid's move by (b + 1) * text.
        shift = _constant(("shift", B, text, device), lambda: (torch.arange(B, device=device).view(B, 1) + 1) * text)
        token_rows = torch.cat([_text_rows(B, text, M, device), self.token_rows + shift], dim=1)
        dtype = self.row_size.dtype
        key = ("text ones", B, text, device, dtype)
        ones = _constant(key, lambda: torch.ones(B, text, 1, device=device, dtype=dtype))
        row_size = torch.cat([ones, self.row_size.view(B, M, 1)], dim=1).view(B * (text + M), 1)
        row_token = self.row_token
        if row_token is not None and self.text != text:  # positions counted after another text length
            grid_rows = (row_token[:, self.text :] if self.text else row_token) + (text - self.text)
            leading = _constant(("text positions", B, text, device), lambda: positions(text, device).expand(B, text))
            row_token = torch.cat([leading, grid_rows], dim=1)
        extended = TokenMerge(
            token_rows.view(-1), row_size, B, text + N, text + M, row_token, token_rows, text, text_rows=text
        )
        if row_token is self.row_token:
            extended.rotary = self.rotary  # the same positions: the same rotary tables
        self._with_text = extended
        return extended

    def with_tail_rows(self, tail: int) -> TokenMerge:
        """This merge extended to `tail` tokens after the merged ones, each a row of its own, after the rows.

        For sequences where other tokens follow the grid's (a reference image's tokens, Z-Image's padding
        and text): they pass through merge and unmerge unchanged. Made once per merge and kept.

        Example:
            >>> merge = TokenMerge(torch.tensor([0, 0, 1]), torch.tensor([[2.0], [1.0]]), 1, 3, 2)
            >>> merge.with_tail_rows(2).merge(torch.tensor([[[1.0], [3.0], [5.0], [7.0], [9.0]]])).flatten().tolist()
            [2.0, 5.0, 7.0, 9.0]
        """
        if tail == self.tail:
            return self
        if self.tail:
            raise ValueError(f"Expected a merge without tail rows, but got one with {self.tail}.")
        extended = self._with_tail
        if extended is not None and extended.num_tokens == self.num_tokens + tail:
            return extended
        B, N, M = self.batch, self.num_tokens, self.num_rows
        device = self.token_row.device
        # Sample b's rows now start at b * (M + tail): its merged rows move by b * tail, its tail rows follow.
        moved = self.token_rows + _batch_offsets(B, tail, device) if B > 1 else self.token_rows
        token_rows = torch.cat([moved, _tail_rows(B, tail, M, device)], dim=1)
        ones = _constant(
            ("tail ones", B, tail, device, self.row_size.dtype),
            lambda: torch.ones(B, tail, 1, device=device, dtype=self.row_size.dtype),
        )
        row_size = torch.cat([self.row_size.view(B, M, 1), ones], dim=1).view(B * (M + tail), 1)
        row_token = self.row_token
        if row_token is not None:  # the tail's own positions, after the text and the grid's tokens
            start = self.text + N - self.text_rows
            row_token = torch.cat([row_token, _tail_positions(B, start, tail, device)], dim=1)
        extended = TokenMerge(
            token_rows.view(-1), row_size, B, N + tail, M + tail, row_token, token_rows, self.text, self.text_rows, tail
        )
        self._with_tail = extended
        return extended


@dataclass(frozen=True, eq=False)
class Partition:
    """Destinations (one per full `sy x sx` window) and sources of a token grid, for one block.

    Indices into the merged tokens count `text_rows` text tokens ahead of the grid's (see `TokenMerge`);
    `perm` and `dst_idx` count the grid's tokens alone.

    Attributes:
        perm: `(N,)` long, the source tokens then the destination tokens.
        dst_row: `(text_rows + N,)` (or expanded to `(B, text_rows + N)` for a batch) long: every
            token's first guess at its row: a text token's own, and a grid token's window (0 at the
            edges) after the text rows, which at a destination token is the row it heads in a merge,
            where destinations come first. `match` overwrites the sources' entries.
        src_idx: `(S,)` (or `(B, S)`) the sources, as indices into the merged tokens.
        dst_idx: `(D,)` the destinations, in window order.
        text: text tokens ahead of the grid's in the attention's sequence (for `TokenMerge.row_token`).
        text_rows: text tokens among the merged tokens (0 or `text`).
        lead: `(B, text + D)` or None: the positions that open every `row_token`: the text's, then the
            destinations' (counted after the text); made with the partition so a merge does not.
        layout: the `GridLayout` it was made from, or None: `match` takes `dst_row` from it with every
            sample's row offset already added (`GridLayout.dst_row`), so that a merge does not add them.
    """

    perm: torch.Tensor
    dst_row: torch.Tensor
    src_idx: torch.Tensor
    dst_idx: torch.Tensor
    text: int = 0
    text_rows: int = 0
    lead: torch.Tensor | None = None
    layout: GridLayout | None = field(default=None, repr=False)

    @property
    def num_src(self) -> int:
        return self.src_idx.shape[-1]

    @property
    def num_dst(self) -> int:
        return self.dst_idx.shape[-1]

    def leading_positions(self, batch: int) -> torch.Tensor:
        """`(batch, text + D)`: the text's positions, then the destinations' (see `lead`)."""
        if self.lead is not None:
            return self.lead
        dst = self.dst_idx.expand(batch, self.num_dst)
        if not self.text:
            return dst
        return torch.cat([positions(self.text, dst.device).expand(batch, self.text), dst + self.text], dim=1)

    def unbind(self) -> list[Partition]:
        """One partition per block of a stack of partitions (a leading block axis)."""
        tensors = [self.perm, self.dst_row, self.src_idx, self.dst_idx]
        if self.lead is not None:
            tensors.append(self.lead)
        per_block = zip(*(t.unbind(0) for t in tensors), strict=True)
        return [
            Partition(*fields[:4], self.text, self.text_rows, *fields[4:], layout=self.layout) for fields in per_block
        ]


@dataclass(frozen=True, eq=False)
class GridLayout:
    """What a grid's partitions are built from; depends only on the grid, so it is built once and cached.

    A video's grid has `frames` of `h x w` tokens (frame-major) and its windows span `st` frames too
    (`st x sy x sx`); an image's is one frame.

    Attributes:
        h, w, sx, sy: the grid and its windows.
        origins: `(1, W, 1)` each full window's first token (shaped to add to a `(K, W, places)` choice).
        place_order: `(places, places)` token offsets within a window: row c lists the places other
            than c, then c (sources, then the destination).
        edges: `(E,)` the tokens outside every full window (always sources).
        window_of_token: `(N,)` each token's window (0 at the edges): the row a destination heads,
            whichever place of its window it is at, so `Partition.dst_row` never depends on the choice.
        source_window: `(S,)` each source's window, in the order of every partition's sources (one
            place of every window after another, then the edges, which take the nearest full window):
            the destinations `match` compares a source with under window matching. The same for every
            choice of destinations.
        frames, st: the grid's frames and the frames a window spans.
        extra: tokens after the `frames x h x w` box, fewer than a frame (a row where the grid is one frame):
            the start of one more frame (row), all edges, each taking the full window nearest to its place
            in that frame (row). A context-parallel rank's run of tokens ends so (`parallel.LocalGrid.extra`).
    """

    h: int
    w: int
    sx: int
    sy: int
    origins: torch.Tensor
    place_order: torch.Tensor
    edges: torch.Tensor
    window_of_token: torch.Tensor
    source_window: torch.Tensor
    frames: int = 1
    st: int = 1
    extra: int = 0
    _batched: dict[tuple, torch.Tensor] = field(default_factory=dict, repr=False)

    @classmethod
    def build(
        cls,
        h: int,
        w: int,
        sx: int,
        sy: int,
        device: torch.device | str = "cpu",
        frames: int = 1,
        st: int = 1,
        extra: int = 0,
    ) -> GridLayout:
        """The layout of an `h x w` grid (of `frames` frames, then `extra` tokens) with `sy x sx` (`st x sy x sx`)
        windows on `device`.

        Example:
            >>> layout = GridLayout.build(2, 2, 2, 2, frames=3, st=2)  # one 2x2x2 window, the last frame left over
            >>> layout.origins.flatten().tolist(), layout.edges.tolist()
            ([0], [8, 9, 10, 11])
            >>> layout = GridLayout.build(2, 4, 2, 2, extra=3)  # two 2x2 windows, then 3 tokens of a third row
            >>> layout.edges.tolist(), layout.source_window[-3:].tolist()  # each goes to the window above it
            ([8, 9, 10], [0, 0, 1])
        """
        hw = h * w
        if not 0 <= extra < (hw if frames > 1 else w):
            raise ValueError(f"Expected fewer extra tokens than a {'frame' if frames > 1 else 'row'}, got {extra}.")
        device = torch.device(device)
        fst, hsy, wsx = frames // st, h // sy, w // sx
        origins = (
            torch.arange(fst).view(fst, 1, 1) * (st * hw)
            + torch.arange(hsy).view(1, hsy, 1) * (sy * w)
            + torch.arange(wsx).view(1, 1, wsx) * sx
        ).view(-1)
        offsets = [dt * hw + dy * w + dx for dt in range(st) for dy in range(sy) for dx in range(sx)]
        places = len(offsets)
        order = [[offsets[p] for p in range(places) if p != c] + [offsets[c]] for c in range(places)]
        covered = torch.zeros(frames, h, w, dtype=torch.bool)
        covered[: fst * st, : hsy * sy, : wsx * sx] = True
        # The uncovered tokens in order, as many as the grid leaves (a size the host knows: no boolean
        # indexing, whose data-dependent size a compiled graph could not hold when it builds the layout).
        covered = torch.cat([covered.view(-1), covered.new_zeros(extra)])
        num_edges = frames * hw + extra - fst * st * hsy * sy * wsx * sx
        edges = covered.to(torch.uint8).argsort(stable=True)[:num_edges]
        window_of_token = torch.zeros(frames, h, w, dtype=torch.long)
        window_of_token[: fst * st, : hsy * sy, : wsx * sx] = (
            torch.arange(fst * hsy * wsx)
            .view(fst, 1, hsy, 1, wsx, 1)
            .expand(fst, st, hsy, sy, wsx, sx)
            .reshape(fst * st, hsy * sy, wsx * sx)
        )
        # An edge token's nearest window: the one of the covered token its coordinates clamp to. The extra tokens
        # continue the last frame's rows into one more frame (one more row of a single frame).
        index = torch.arange(frames * hw + extra)
        if frames > 1:
            t, y, x = index // hw, index % hw // w, index % w
        else:
            t, y, x = torch.zeros_like(index), index // w, index % w
        nearest = window_of_token[t.clamp(max=fst * st - 1), y.clamp(max=hsy * sy - 1), x.clamp(max=wsx * sx - 1)]
        window_of_token = torch.cat([window_of_token.view(-1), window_of_token.new_zeros(extra)])
        windows = fst * hsy * wsx
        source_window = torch.cat([torch.arange(windows).repeat(places - 1), nearest[edges]])
        return cls(
            h,
            w,
            sx,
            sy,
            origins.view(1, -1, 1).to(device),
            torch.tensor(order, device=device),
            edges.to(device),
            window_of_token.to(device),
            source_window.to(device),
            frames,
            st,
            extra,
        )

    @property
    def places(self) -> int:
        return self.st * self.sx * self.sy

    @property
    def windows(self) -> int:
        return self.origins.shape[1]

    def dst_row(self, batch: int, text_rows: int = 0, rows: int = 0) -> torch.Tensor:
        """`(batch, text_rows + N)`: the text rows, then `window_of_token` after them; made once per batch size.

        With `rows`, sample b's entries are moved by `b * rows`: the flat rows of a merge with `rows` rows
        per sample (`match`'s, which then adds no offsets of its own).
        """

        def make() -> torch.Tensor:
            device = self.window_of_token.device
            if not text_rows:
                first_guess = self.window_of_token.expand(batch, -1)
            else:
                first_guess = torch.cat([torch.arange(text_rows, device=device), self.window_of_token + text_rows])
                first_guess = first_guess.expand(batch, -1)
            if batch == 1 or not rows:
                return first_guess
            return first_guess + torch.arange(batch, device=device).view(batch, 1) * rows

        return cached(self._batched, (batch, text_rows, rows if batch > 1 else 0), make)

    def partitions(self, choice: torch.Tensor, batch: int | None = None) -> Partition:
        """A stack of partitions, one per row of `choice` `(K, W)` (each window's destination place).

        A handful of ops however many blocks `K` holds; `Partition.unbind` splits them per block. With
        `batch`, the per-token tables come expanded to `(K, batch, ...)` once, not once per block.
        """
        K, W = choice.shape
        tokens = self.origins + self.place_order[choice]  # (K, W, places): sources, destination
        # Place-major: every window's first source, then every window's second, ..., then the destinations.
        perm = tokens.transpose(1, 2).reshape(K, -1)
        if self.edges.numel():  # rows and columns left over at the edges are sources too
            perm = torch.cat([perm[:, :-W], self.edges.expand(K, -1), perm[:, -W:]], dim=1)
        src_idx, dst_idx = perm.split((perm.shape[1] - W, W), dim=1)
        if batch is None:
            return Partition(perm, self.window_of_token.expand(K, -1), src_idx, dst_idx, layout=self)
        src_idx = src_idx.unsqueeze(1).expand(K, batch, src_idx.shape[1])
        return Partition(perm, self.dst_row(batch).expand(K, batch, -1), src_idx, dst_idx, layout=self)

    def fixed(self, batch: int | None = None) -> Partition:
        """Every window's top-left token as its destination (tomesd's `no_rand`)."""
        choice = torch.zeros(1, self.windows, dtype=torch.long, device=self.origins.device)
        return self.partitions(choice, batch).unbind()[0]

    def with_text(
        self, partition: Partition, batch: int, text: int, text_rows: int = 0, lead: bool = False
    ) -> Partition:
        """`partition` (one, or a stack from `partitions(choice, batch)`) for a sequence that opens with `text` tokens.

        `text_rows` of them (0 or `text`) are merged along, each a row of its own; with `lead`, the
        positions that open every `TokenMerge.row_token` are made here, once for the whole stack.
        """
        blocks = partition.dst_idx.shape[:-1]  # () for one partition, (K,) for a stack
        src_idx, dst_row = partition.src_idx, partition.dst_row
        if text_rows:
            src_idx = src_idx + text_rows
            dst_row = self.dst_row(batch, text_rows).expand(*blocks, batch, -1)
        leading = None
        if lead:
            device = partition.dst_idx.device
            dst = (partition.dst_idx + text if text else partition.dst_idx).unsqueeze(-2)
            dst = dst.expand(*blocks, batch, partition.num_dst)
            text_positions = positions(text, device).expand(*blocks, batch, text)
            leading = torch.cat([text_positions, dst], dim=-1) if text else dst
        return Partition(partition.perm, dst_row, src_idx, partition.dst_idx, text, text_rows, leading, self)


def grid_partition(
    h: int, w: int, sx: int, sy: int, choice: torch.Tensor | None = None, device: torch.device | str = "cpu"
) -> tuple[torch.Tensor, torch.Tensor]:
    """Split an `h x w` token grid into destinations (one per full `sy x sx` window) and sources.

    Args:
        choice: `(h // sy, w // sx)` long in `[0, sx * sy)`, the destination's place within each
            window (row-major); `None` takes the top-left token of every window.

    Returns:
        `(dst_idx, src_idx)`: destinations in window order and the rest as sources.

    Example:
        >>> dst, src = grid_partition(2, 4, sx=2, sy=2)
        >>> dst.tolist(), sorted(src.tolist())
        ([0, 2], [1, 3, 4, 5, 6, 7])
    """
    layout = GridLayout.build(h, w, sx, sy, device if choice is None else choice.device)
    partition = layout.fixed() if choice is None else layout.partitions(choice.reshape(1, -1)).unbind()[0]
    return partition.dst_idx, partition.src_idx


def window_mix(
    blocks: int, windows: int, seed: int, device: torch.device | str = "cpu"
) -> tuple[torch.Tensor, torch.Tensor]:
    """Two `(blocks, windows)` long tensors: per (seed, block, window) an odd multiplier and an offset.

    Built once per grid; `window_choice` turns it and a per-step key into destination places. Block
    `i`'s values do not depend on how many blocks are drawn, and every product stays below 2^63.
    """
    seed_hash = 0
    while True:  # every bit of a seed of any size, folded into 32
        seed_hash = (seed_hash * 0x9E3779B1 + (seed & _MASK32)) & _MASK32
        seed >>= 32
        if not seed:
            break
    x = (torch.arange(blocks * windows * 2, device=device, dtype=torch.long) + seed_hash) & _MASK32
    x = (x * 0x2545F491) & _MASK32
    for multiplier in (0x7FEB352D, 0x46B1A4A5):  # two rounds of a 32-bit xorshift-multiply mix
        x = x ^ (x >> 15)
        x = (x * multiplier) & _MASK32  # < 2^32 * 2^31
    x = x ^ (x >> 16)
    multiplier, offset = x.view(blocks, windows, 2).unbind(-1)
    return multiplier | 1, offset


def window_choice(mix: tuple[torch.Tensor, torch.Tensor], key: torch.Tensor | int, places: int) -> torch.Tensor:
    """A reproducible pseudo-random destination place per block and window, with no RNG state.

    `((a * key + b) >> 16) mod places` for the per-window hash values `(a, b)` of `window_mix`: five
    integer ops on the device for every block at once, so it runs inside torch.compile, never reads the
    key back to the host and never touches the global RNG.

    Args:
        mix: `window_mix(...)`, two `(K, W)` tensors.
        key: a long tensor of one element, or an int (from the timestep; `mix` holds the seed and block);
            its low 31 bits are used.
        places: destination places per window (`sx * sy`).

    Returns:
        `(K, W)` long in `[0, places)`.
    """
    multiplier, offset = mix
    return ((multiplier * (key & 0x7FFFFFFF) + offset) >> 16) % places  # < 2^32 * 2^31 + 2^32


def _identity(batch: int, num_tokens: int, device: torch.device, dtype: torch.dtype) -> TokenMerge:
    rows = torch.arange(batch * num_tokens, device=device)
    row_token = torch.arange(num_tokens, device=device).expand(batch, num_tokens)
    return TokenMerge(
        rows, torch.ones(batch * num_tokens, 1, device=device, dtype=dtype), batch, num_tokens, num_tokens, row_token
    )


def fold_frames(merge: TokenMerge, batch: int, frames: int) -> TokenMerge:
    """A merge made frame by frame (`frames` frames of each of `batch` samples as its batch) as one of the samples.

    Merging the frames as a batch of `batch * frames` gives every frame the same number of rows, so a
    merged frame's flat rows are already those of its sample (`b * frames * M + f * M + m`): only the
    per-sample views change, and `row_token` moves each frame's positions after the frames before it.

    Example:
        >>> frames = torch.tensor([[[1.0, 0], [1, 0]], [[0, 1], [1, 0]]])  # one sample: 2 frames of 1x2
        >>> per_frame = bipartite_soft_matching_2d(frames, h=1, w=2, sx=2, sy=1, r=1, with_row_token=True)
        >>> clip = fold_frames(per_frame, batch=1, frames=2)
        >>> clip.merge(torch.arange(4.0).view(1, 4, 1)).flatten().tolist(), clip.row_token.tolist()
        ([0.5, 2.5], [[0, 2]])
    """
    if merge.text or merge.text_rows:
        raise ValueError(f"Expected a merge of grid tokens only, but got one with {merge.text} text tokens.")
    if merge.batch != batch * frames:
        raise ValueError(f"Expected a merge of {batch * frames} frames, but got one of {merge.batch}.")
    n, m = merge.num_tokens, merge.num_rows
    row_token = merge.row_token
    if row_token is not None:
        device = row_token.device
        shift = _constant(
            ("frames", batch, frames, n, device),
            lambda: (torch.arange(batch * frames, device=device) % frames).view(-1, 1) * n,
        )
        row_token = (row_token + shift).view(batch, frames * m)
    token_rows = merge.token_rows.view(batch, frames * n)
    return TokenMerge(merge.token_row, merge.row_size, batch, frames * n, frames * m, row_token, token_rows)


def match(
    metric: torch.Tensor,
    partition: Partition,
    r: int,
    similarity_dtype: torch.dtype | None = None,
    with_row_token: bool = False,
    tail: int = 0,
    source_window: torch.Tensor | None = None,
) -> TokenMerge:
    """Merge the `r` sources most similar to a destination into it (the matching of ToMe for SD).

    Each source's best destination is found by cosine similarity of `metric` (among every destination,
    or only its own window's with `source_window`), and the `r` sources with the highest best
    similarity are merged into it by mean. Rows of the merged tensor: the partition's
    text rows (if any), the destinations, then the unmerged sources from most to least similar.

    Args:
        metric: `(B, N, C)`, the grid's tokens to compare.
        partition: the grid's destinations and sources (`GridLayout.fixed`, `GridLayout.partitions`,
            `GridLayout.with_text`).
        r: how many tokens to remove, at most the number of sources.
        similarity_dtype: choose each source's destination on scores in this dtype; see `best_match`.
        with_row_token: also record `TokenMerge.row_token` (for positional encodings that follow
            merged rows, as Flux's rotary embeddings).
        tail: tokens after the grid's in the merged tensor, each a row of its own after the grid's rows
            (the same merge as `with_tail_rows` makes, in one op more than the grid's alone).
        source_window: `(S,)` each source's one destination (`GridLayout.source_window`): window
            matching, a dot product per source instead of a product with every destination.
    """
    B, N, _ = metric.shape
    S, D = partition.num_src, partition.num_dst
    text, text_rows = partition.text, partition.text_rows
    M = text_rows + N - r
    with torch.no_grad():
        x = metric.index_select(1, partition.perm)  # one op where `metric[:, perm]` took two (slice, index)
        x = x / x.norm(dim=-1, keepdim=True)  # as tomesd: a zero token only changes which pair is chosen
        src, dst = x.split((S, D), dim=1)
        if source_window is None:
            best_score, best_dst = best_match(src, dst, similarity_dtype)
        else:  # each source's one destination: its window's
            best_score = (src * dst.index_select(1, source_window)).sum(dim=-1)
        order = best_score.argsort(dim=-1, descending=True)  # the sources from most to least similar
        # The ranked sources' destinations (a source's window is the same in every sample: one `take`).
        ranked_dst = best_dst.gather(1, order) if source_window is None else source_window.take(order)
        # Rows of sample b start at b * (M + tail): the first guesses (the layout's, made once per grid) and the
        # rank constants below come with those offsets, so no op adds them here.
        dst_row, src_idx, rows = partition.dst_row, partition.src_idx, M + tail
        if partition.layout is not None:
            dst_row = partition.layout.dst_row(B, text_rows, rows)
        else:  # a partition made by hand
            dst_row = dst_row.expand(B, -1) if dst_row.ndim == 1 else dst_row
            dst_row = dst_row + _batch_offsets(B, rows, metric.device) if B > 1 else dst_row
        if src_idx.ndim == 1:  # a partition made without `batch`
            src_idx = src_idx.expand(B, S)
        ranked_src = src_idx.gather(1, order)
        # In rank order, the r best go to their destination's row and the others follow the destinations:
        # row = base + merged * best destination, two constants per rank (one op where a second sort took four).
        merged, base = _rank_rows(S, D, r, text_rows, metric.device, B, rows)
        ranked_row = torch.addcmul(base, merged, ranked_dst)
        token_row = dst_row.scatter(1, ranked_src, ranked_row)
        if tail:  # each tail token a row of its own, after the grid's rows
            token_row = torch.cat([token_row, _tail_rows(B, tail, M, metric.device)], dim=1)
        flat_row = token_row.view(-1)
        ones = _ones(B * (text_rows + N + tail), metric.device, metric.dtype)
        row_size = _zeros(B * (M + tail), 1, metric.device, metric.dtype).index_add(0, flat_row, ones)
        row_token = None
        if with_row_token:
            kept_src = ranked_src[:, r:]
            if text != text_rows:  # positions count all the text, merged tokens only the text merged along
                kept_src = kept_src + (text - text_rows)
            parts = [partition.leading_positions(B), kept_src]
            if tail:  # the tail's own positions, after the text and the grid's tokens
                parts.append(_tail_positions(B, text + N, tail, metric.device))
            row_token = torch.cat(parts, dim=1)
    return TokenMerge(
        flat_row, row_size, B, text_rows + N + tail, M + tail, row_token, token_row, text, text_rows, tail
    )


def cached(cache: dict, key: tuple, make: Callable[[], T], limit: int = 16) -> T:
    """`cache[key]`, made by `make()` the first time; at most `limit` entries, the oldest dropped first.

    What depends only on a grid, batch size, device or dtype is made once this way instead of in every
    merge, and a server that sees many image sizes does not accumulate it. A compiled graph uses what is
    kept, and makes (in the graph) what is not, without keeping it: dynamo guards on what the graph read of
    the cache, so a value kept while tracing would fail that guard at the next call (one recompilation).
    """
    value = cache.get(key)
    if value is None:
        if is_compiling():  # made in the graph, not kept: a kept one fails the graph's guard on the cache once
            return make()
        value = make()
        if len(cache) >= limit:
            try:  # another thread may drop the same oldest entry meanwhile (a model serves concurrent forwards)
                del cache[next(iter(cache))]
            except (KeyError, RuntimeError, StopIteration):
                pass
        cache[key] = value
    return value


#: Small constant tensors (row offsets, ones, positions) shared by every merge of the process.
_CONSTANTS: dict[tuple, object] = {}


def _constant(key: tuple, make: Callable[[], torch.Tensor]) -> torch.Tensor:
    return cached(_CONSTANTS, key, make, limit=256)


def _batch_offsets(batch: int, rows: int, device: torch.device) -> torch.Tensor:
    return _constant(("offsets", batch, rows, device), lambda: torch.arange(batch, device=device).view(batch, 1) * rows)


def _ones(n: int, device: torch.device, dtype: torch.dtype) -> torch.Tensor:
    return _constant(("ones", n, device, dtype), lambda: torch.ones(n, 1, device=device, dtype=dtype))


def _row_sum(zeros: torch.Tensor, token_row: torch.Tensor, flat: torch.Tensor) -> torch.Tensor:
    """`zeros` with every row of `flat` added to row `token_row[i]`, in the same order on every run.

    The order of a float sum decides its last bits, so the sum must not depend on thread timing: on CUDA
    `index_add` adds with atomics (another result almost every run, measured on an H100) while an
    accumulating `index_put` sorts the index first and adds each row's tokens in order; on CPU it is the
    other way round (`index_put` accumulates from several threads at once, `index_add` does not).
    """
    if flat.device.type == "cuda":
        return zeros.index_put((token_row,), flat, accumulate=True)
    return zeros.index_add(0, token_row, flat)


#: Zero tensors that out-of-place `index_add` sums into: one op per merge where `new_zeros` and `index_add_`
#: took two. They can be megabytes each on a GPU (rows x channels), so few are kept, and removing ToMe from
#: a model lets them go (`release_buffers`).
_ZEROS: dict[tuple, torch.Tensor] = {}


def release_buffers() -> None:
    """Drop the kept zero tensors that merges sum into; the next merge makes its own again."""
    _ZEROS.clear()


def _zeros(rows: int, channels: int, device: torch.device, dtype: torch.dtype) -> torch.Tensor:
    """A `(rows, channels)` zero tensor, made once; never written to (`index_add` returns a new tensor)."""
    key = (rows, channels, device, dtype)
    return cached(_ZEROS, key, lambda: torch.zeros(rows, channels, device=device, dtype=dtype), limit=8)


def _rank_rows(
    sources: int, dsts: int, r: int, text_rows: int, device: torch.device, batch: int = 1, rows: int = 0
) -> tuple[torch.Tensor, torch.Tensor]:
    """Per rank: 1 where the source is merged (the r best), and the row it goes to less its destination's:
    `(S,)` each, or with `batch` > 1 the rows `(batch, S)`, sample b's moved by `b * rows` (its flat rows)."""

    def make() -> tuple[torch.Tensor, torch.Tensor]:
        rank = torch.arange(sources, device=device)
        merged = rank < r
        # Merged: text_rows + destination; kept: after the text and destination rows, in rank order.
        base = torch.where(merged, text_rows, rank + (text_rows + dsts - r))
        if batch > 1:
            base = base + torch.arange(batch, device=device).view(batch, 1) * rows
        return merged.long(), base

    key = ("ranks", sources, dsts, r, text_rows, device, batch, rows if batch > 1 else 0)
    return cached(_CONSTANTS, key, make, limit=256)


def _text_rows(batch: int, text: int, rows: int, device: torch.device) -> torch.Tensor:
    """`(batch, text)`: the flat row of each text token of each sample, `b * (text + rows) + t`."""
    return _constant(
        ("text rows", batch, text, rows, device),
        lambda: torch.arange(batch, device=device).view(batch, 1) * (text + rows) + torch.arange(text, device=device),
    )


def _tail_rows(batch: int, tail: int, rows: int, device: torch.device) -> torch.Tensor:
    """`(batch, tail)`: the flat row of each tail token of each sample, `b * (rows + tail) + rows + t`."""
    return _constant(
        ("tail rows", batch, tail, rows, device),
        lambda: (
            torch.arange(batch, device=device).view(batch, 1) * (rows + tail)
            + torch.arange(rows, rows + tail, device=device)
        ),
    )


def _tail_positions(batch: int, start: int, tail: int, device: torch.device) -> torch.Tensor:
    """`(batch, tail)`: `start + t` for each tail token (its row within a sample, or its position)."""
    return _constant(
        ("tail positions", batch, start, tail, device),
        lambda: torch.arange(start, start + tail, device=device).expand(batch, tail),
    )


def positions(n: int, device: torch.device) -> torch.Tensor:
    """`arange(n)` on `device`, made once."""
    return _constant(("arange", n, device), lambda: torch.arange(n, device=device))


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
    matching: str = "global",
) -> TokenMerge:
    """Merge `r` source tokens into their most similar destinations (ToMe for SD's matching).

    Destinations are one token per `sy x sx` window (`choice`, or the top-left); the others are
    sources. The same partition is used for the whole batch; the matching is per sample. A
    convenience over `match` that builds the partition on every call (the hooks cache it instead).

    Args:
        metric: `(B, N, C)` with `N == h * w`, the tokens to compare.
        h, w: the token grid, row-major.
        sx, sy: the window width and height.
        r: how many tokens to remove; clipped to the number of sources.
        choice: see `grid_partition`.
        similarity_dtype: see `match`.
        with_row_token: see `match`.
        matching: `"global"` or `"window"` (see `ToMeConfig.matching`).

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
    layout = GridLayout.build(h, w, sx, sy, metric.device)
    if choice is None:
        partition = layout.fixed()
    else:
        partition = layout.partitions(choice.reshape(1, -1).to(metric.device)).unbind()[0]
    source_window = layout.source_window if matching == "window" else None
    return match(metric, partition, min(r, partition.num_src), similarity_dtype, with_row_token, 0, source_window)


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
