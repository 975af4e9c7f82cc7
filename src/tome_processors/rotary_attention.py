"""Merged self-attention over video tokens with one rotary table row per token (Wan's, LTX-Video's and Kandinsky's
3-D rotary embeddings).

Wan's processor gets `rotary_emb = (cos, sin)`, each `(1, N, 1, D)`; LTX-Video's gets `image_rotary_emb =
(cos, sin)`, each `(B, N, D)` (its family declares that with `Rotary(batched=True)`), and LTX-2's `query_rotary_emb`
the same, or with its `rope_type="split"` each `(B, H, N, D')`, heads first: the rotation of every token, which
the processor applies to the queries and keys. With the tokens merged, a row keeps the rotation
of the token it is kept at (`TokenMerge.row_token`: its destination, or itself when nothing was merged into
it), as Flux's rows do (see joint_attention.py): a rotation is exact only at a real position. The merge is
per sample, so the tables become `(B, M, 1, D)` (Wan's, which the processor broadcasts over the heads as it
did the shared table), `(B, M, D)` or `(B, H, M, D')`: the whole batch runs in one call. Kandinsky's processors
get one tensor of 2x2 rotation matrices instead of a pair, `(N, 1, D/2, 2, 2)` (Kandinsky 6, and again as the keys'
`rotary_emb_kv`) or `(B, N, 1, D/2, 2, 2)` (Kandinsky 5), declared with `Rotary(pair=False)`: its rows are gathered
alike, `(B, M, 1, D/2, 2, 2)`. AnyFlow's gets a dict of complex tables `{"query": ..., "key": ...}`, each
`(1, 1, N, D/2)` (`Rotary(pair=False, entries=("query", "key"), heads_axis=True)`): each entry is gathered,
`(B, 1, M, D/2)`, one gather where both entries are one tensor. Allegro's processor gets per-axis tables and each
token's row in them, `(tables, (t, h, w))` with each index tensor `(1, N)`, declared with `Rotary(indexed=True)`:
the tables stay, the indices are taken at the merged rows, `(B, M)`, which the processor's lookup turns into one
rotation per sample and row.
"""

from __future__ import annotations

from typing import Any

import torch

from ._similarity import is_compiling
from .arguments import argument, replace_argument
from .joint_attention import sample_index as _sample_index
from .merge import TokenMerge
from .skips import Skip

_ROTARY = (2, "rotary_emb")  # position after hidden_states (encoder_hidden_states, attention_mask, rotary_emb)


def run_with_rotary(
    processor: Any, slot: Any, attn: torch.nn.Module, hidden_states: torch.Tensor, args: tuple, kwargs: dict
) -> Any:
    """Run `processor.inner` on the merged tokens with each row's rotary tables (see module doc)."""
    inner = processor.inner
    merge = processor._merge_for(slot, hidden_states, args, kwargs)
    spec = slot.block.model.rotary  # None: Wan's `rotary_emb`
    if spec is not None and spec.indexed:  # per-axis tables and each token's row in them (Allegro's)
        return _run_with_indices(inner, slot, merge, attn, hidden_states, args, kwargs, spec)
    if spec is not None and not spec.pair:  # one tensor of rotations (Kandinsky's)
        return _run_with_rotations(inner, slot, merge, attn, hidden_states, args, kwargs, spec)
    where = (spec.position, spec.name) if spec is not None else _ROTARY
    batched = spec is not None and spec.batched
    rotary = argument(args, kwargs, *where)
    if merge is None or (
        rotary is not None and (merge.row_token is None or not _fits(rotary, merge.batch, merge.num_tokens, batched))
    ):
        if merge is not None:  # (None: `_merge_for` said why)
            slot.skip(Skip.ROTARY, hidden_states)
        return inner(attn, hidden_states, *args, **kwargs)
    if rotary is not None:
        heads_first = batched and rotary[0].ndim == 4  # LTX-2's split tables, (B, H, N, D')
        args, kwargs = replace_argument(
            args, kwargs, *where, merged_rotary(rotary, merge, slot.block.model, heads_first=heads_first)
        )
    return merge.unmerge(inner(attn, merge.merge(hidden_states), *args, **kwargs))


def _run_with_rotations(
    inner: Any,
    slot: Any,
    merge: TokenMerge | None,
    attn: torch.nn.Module,
    hidden_states: torch.Tensor,
    args: tuple,
    kwargs: dict,
    spec: Any,
) -> Any:
    """`run_with_rotary` where the processor gets one tensor of per-token rotations (`Rotary(pair=False)`), and with
    `spec.key_name` the keys' own: each table that is there is taken at the merged rows (see `merged_rotations`)."""
    if merge is None:  # `_merge_for` said why
        return inner(attn, hidden_states, *args, **kwargs)
    places = [(spec.position, spec.name)]
    if spec.key_name is not None:
        places.append((spec.key_position, spec.key_name))
    values = [argument(args, kwargs, *place) for place in places]
    present = [table for value in values if value is not None for table in _tables_of(value, spec)]
    if present and (
        merge.row_token is None
        or not all(_fits_rotations(t, merge.batch, merge.num_tokens, spec.batched, spec.heads_axis) for t in present)
    ):
        slot.skip(Skip.ROTARY, hidden_states)
        return inner(attn, hidden_states, *args, **kwargs)
    for place, value in zip(places, values, strict=True):
        if value is not None:
            args, kwargs = replace_argument(args, kwargs, *place, _merged_value(value, merge, spec))
    return merge.unmerge(inner(attn, merge.merge(hidden_states), *args, **kwargs))


def _run_with_indices(
    inner: Any,
    slot: Any,
    merge: TokenMerge | None,
    attn: torch.nn.Module,
    hidden_states: torch.Tensor,
    args: tuple,
    kwargs: dict,
    spec: Any,
) -> Any:
    """`run_with_rotary` where the processor gets `(tables, indices)` (`Rotary(indexed=True)`): the indices of every
    axis are taken at the merged rows (`merged_indices`), the tables passed as they are."""
    if merge is None:  # `_merge_for` said why
        return inner(attn, hidden_states, *args, **kwargs)
    where = (spec.position, spec.name)
    rotary = argument(args, kwargs, *where)
    if rotary is not None:
        if merge.row_token is None or not _fits_indices(rotary, merge.num_tokens):
            slot.skip(Skip.ROTARY, hidden_states)
            return inner(attn, hidden_states, *args, **kwargs)
        args, kwargs = replace_argument(args, kwargs, *where, merged_indices(rotary, merge))
    return merge.unmerge(inner(attn, merge.merge(hidden_states), *args, **kwargs))


def _fits_indices(rotary: Any, num_tokens: int) -> bool:
    """`(tables, indices)` whose indices are integer tensors of `num_tokens` rows each, `(1, N)` or `(N,)`.

    Example:
        >>> tables, rows = (torch.zeros(4, 2),), (torch.arange(6)[None], torch.arange(6))
        >>> _fits_indices((tables, rows), 6), _fits_indices((tables, rows), 5), _fits_indices(rows, 6)
        (True, False, False)
    """
    if not (isinstance(rotary, (tuple, list)) and len(rotary) == 2 and isinstance(rotary[1], (tuple, list))):
        return False
    return all(
        isinstance(t, torch.Tensor)
        and not t.is_floating_point()
        and t.shape[-1] == num_tokens
        and (t.ndim == 1 or (t.ndim == 2 and t.shape[0] == 1))
        for t in rotary[1]
    )


def merged_indices(rotary: tuple | list, merge: TokenMerge) -> Any:
    """`(tables, indices)` with each axis's indices `(1, N)` (or `(N,)`) at every sample's `merge.row_token`:
    `(B, M)` each; the tables as they are.

    A merged row is rotated as the token it is kept at (module doc). The result is kept on the merge, keyed by the
    first index tensor (a merge shared by several blocks, `share_level`, gathers once per forward).

    Example:
        >>> from tome_processors.merge import bipartite_soft_matching_2d
        >>> merge = bipartite_soft_matching_2d(torch.eye(4)[None], 1, 4, 2, 1, 1, with_row_token=True)
        >>> tables, indices = merged_indices(("tables", (torch.arange(10, 14)[None],)), merge)
        >>> tables, indices[0].tolist()  # rows kept at tokens 0, 2 and 3
        ('tables', [[10, 12, 13]])
    """
    tables, indices = rotary
    keep = not is_compiling()
    kept = merge.rotary
    if keep and kept and len(kept[0]) == 1 and kept[0][0] is indices[0]:
        return kept[1]
    gathered = type(indices)(t.reshape(-1)[merge.row_token.to(t.device)] for t in indices)
    result = type(rotary)((tables, gathered))
    if keep:
        kept[:] = [(indices[0],), result]
    return result


def _tables_of(value: Any, spec: Any) -> list[Any]:
    """The tables of a rotary argument: the tensor itself, or with `Rotary.entries` each declared entry of its dict
    (None where one is missing, or where the argument is no dict: such tables do not fit)."""
    if not spec.entries:
        return [value]
    return [value.get(name) if isinstance(value, dict) else None for name in spec.entries]


def _merged_value(value: Any, merge: TokenMerge, spec: Any) -> Any:
    """A rotary argument with its tables at the merged rows: the tensor, or each declared entry of its dict (the
    others kept)."""
    if not spec.entries:
        return merged_rotations(value, merge, spec.batched, spec.heads_axis)
    merged = dict(value)
    for name in spec.entries:
        merged[name] = merged_rotations(value[name], merge, spec.batched, spec.heads_axis)
    return merged


def _fits_rotations(table: Any, batch: int, num_tokens: int, batched: bool, heads_axis: bool = False) -> bool:
    """A tensor of `num_tokens` rows (after a batch axis of `batch`, with `batched`; after a batch and a heads axis
    of 1 each, with `heads_axis`), as `merged_rotations` takes.

    Example:
        >>> one, batched = torch.zeros(6, 1, 4, 2, 2), torch.zeros(2, 6, 1, 4, 2, 2)
        >>> _fits_rotations(one, 2, 6, batched=False), _fits_rotations(batched, 2, 6, batched=True)
        (True, True)
        >>> _fits_rotations(one[:5], 2, 6, batched=False), _fits_rotations((one, one), 2, 6, batched=False)
        (False, False)
        >>> _fits_rotations(torch.zeros(1, 1, 6, 4), 2, 6, batched=False, heads_axis=True)
        True
    """
    if not isinstance(table, torch.Tensor):
        return False
    if heads_axis:
        return table.ndim >= 3 and table.shape[0] == 1 and table.shape[1] == 1 and table.shape[2] == num_tokens
    if batched:
        return table.ndim >= 2 and table.shape[0] == batch and table.shape[1] == num_tokens
    return table.ndim >= 1 and table.shape[0] == num_tokens


def merged_rotations(
    table: torch.Tensor, merge: TokenMerge, batched: bool = False, heads_axis: bool = False
) -> torch.Tensor:
    """A tensor of per-token rotations `(N, ...)` (with `batched`, `(B, N, ...)`, one per sample) at every sample's
    `merge.row_token`: `(B, M, ...)`, one gather. With `heads_axis`, `(1, 1, N, ...)` for the whole batch (AnyFlow's):
    `(B, 1, M, ...)`.

    A merged row is rotated as the token it is kept at (module doc). The result is kept on the merge, keyed by the
    table (as `merged_rotary` keeps its tables): Kandinsky 6's self-attention passes the same table for its queries
    and its keys, and a merge shared by several blocks (`share_level`) gathers once per forward.

    Example:
        >>> from tome_processors.merge import bipartite_soft_matching_2d
        >>> merge = bipartite_soft_matching_2d(torch.eye(4)[None], 1, 4, 2, 1, 1, with_row_token=True)
        >>> rotations = torch.arange(4.0).view(4, 1, 1, 1)
        >>> merged_rotations(rotations, merge).flatten().tolist()  # rows kept at tokens 0, 2 and 3
        [0.0, 2.0, 3.0]
    """
    keep = not is_compiling()
    kept = merge.rotary
    if keep and kept and len(kept[0]) == 1 and kept[0][0] is table:
        return kept[1]
    if heads_axis:
        gathered = table[0, 0][merge.row_token].unsqueeze(1)
    elif batched:
        gathered = table[_sample_index(merge.batch, table.device), merge.row_token]
    else:
        gathered = table[merge.row_token]
    if keep:
        kept[:] = [(table,), gathered]
    return gathered


def _fits(rotary: Any, batch: int, num_tokens: int, batched: bool = False) -> bool:
    """`(cos, sin)` tables of shape `(1, num_tokens, 1, D)`, or with `batched` `(batch, num_tokens, D)` or
    `(batch, H, num_tokens, D)` (else the tokens are not merged)."""
    if not (
        isinstance(rotary, (tuple, list)) and len(rotary) == 2 and all(isinstance(t, torch.Tensor) for t in rotary)
    ):
        return False
    if rotary[0].shape != rotary[1].shape:
        return False
    shape = tuple(rotary[0].shape)
    if batched:
        return len(shape) in (3, 4) and shape[0] == batch and shape[-2 if len(shape) == 4 else 1] == num_tokens
    return len(shape) == 4 and shape[0] == 1 and shape[1] == num_tokens and shape[2] == 1


def merged_rotary(rotary: tuple | list, merge: TokenMerge, state: Any = None, heads_first: bool = False) -> Any:
    """The `(1, N, 1, D)` tables `(cos, sin)` at every sample's `merge.row_token`: `(B, M, 1, D)` each (`(B, N, D)`
    tables, one per sample: `(B, M, D)`; with `heads_first`, `(B, H, N, D)` tables, one per sample and head:
    `(B, H, M, D)`, views of one gather).

    Both are gathered at once from one `(N, 1, 2D)` (or `(B, N, 2D)`) table, made once per forward and kept on
    `state` (the model's `ModelState`, whose forward passes the same tables to every block), and the result is
    kept on the merge: a merge shared by several blocks (`share_level`) gathers once per forward. Both are
    keyed by the `cos` and `sin` tensors, not by the tuple that holds them: torch.compile tells tensors apart
    by identity (a guard), but cannot compare tuples by identity, so a block compiled alone (regional
    compilation) would break its graph at a tuple's `is`.

    Example:
        >>> from tome_processors.merge import bipartite_soft_matching_2d
        >>> merge = bipartite_soft_matching_2d(torch.eye(4)[None], 1, 4, 2, 1, 1, with_row_token=True)
        >>> cos = torch.arange(4.0).view(1, 4, 1, 1)
        >>> merged_rotary((cos, -cos), merge)[1].flatten().tolist()  # rows kept at tokens 0, 2 and 3
        [-0.0, -2.0, -3.0]
    """
    # Compiled, nothing is kept from one block for the next: a block that finds what an earlier one kept runs
    # other code than the first (two graphs per size for blocks compiled alone); the compiler sees the repeats.
    keep = not is_compiling()
    kept = merge.rotary
    if keep and kept and _same_tables(kept[0], rotary):
        return kept[1]
    if keep and state is not None and state.rotary_tables and _same_tables(state.rotary_tables[0], rotary):
        table = state.rotary_tables[1]
    else:
        cos, sin = rotary
        table = torch.cat([cos, sin], dim=-1)
        if heads_first:  # (B, N, H, 2D): the tokens second, as every other table has them
            table = table.transpose(1, 2)
        elif table.ndim == 4:
            table = table[0]  # (N, 1, 2D)
        # else one (N, 2D) per sample
        if keep and state is not None:
            state.rotary_tables = (tuple(rotary), table)
    if rotary[0].ndim == 3 or heads_first:  # one table per sample (LTX-Video, LTX-2): (B, N, ...) at (B, M) positions
        gathered = table[_sample_index(merge.batch, table.device), merge.row_token]
        gathered = gathered.transpose(1, 2) if heads_first else gathered  # (B, H, M, 2D)
    else:
        gathered = table[merge.row_token]  # (B, M, 1, 2D) in one gather
    tables = type(rotary)(gathered.chunk(2, dim=-1))
    if keep:
        kept[:] = [tuple(rotary), tables]
    return tables


def _same_tables(key: tuple, rotary: tuple | list) -> bool:
    """Whether `key` holds the very tensors of `rotary` (`(cos, sin)`), compared one by one.

    Tensor identity is what torch.compile can trace (it guards on it); a tuple's is not (a graph break).

    Example:
        >>> cos, sin = torch.zeros(1), torch.ones(1)
        >>> _same_tables((cos, sin), [cos, sin]), _same_tables((cos, sin), (cos, cos))
        (True, False)
    """
    return key[0] is rotary[0] and key[1] is rotary[1]
