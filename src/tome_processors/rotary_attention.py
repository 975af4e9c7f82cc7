"""Merged self-attention over video tokens with one rotary table row per token (Wan's 3-D rotary embeddings).

Wan's processor gets `rotary_emb = (cos, sin)`, each `(1, N, 1, D)`: the rotation of every token, which it
applies to the queries and keys. With the tokens merged, a row keeps the rotation of the token it is kept at
(`TokenMerge.row_token`: its destination, or itself when nothing was merged into it), as Flux's rows do
(see joint_attention.py): a rotation is exact only at a real position. The merge is per sample, so the
tables become `(B, M, 1, D)`, which the processor broadcasts over the heads as it did the shared table: the
whole batch runs in one call.
"""

from __future__ import annotations

from typing import Any

import torch

from .arguments import argument, replace_argument
from .merge import TokenMerge

_ROTARY = (2, "rotary_emb")  # position after hidden_states (encoder_hidden_states, attention_mask, rotary_emb)


def run_with_rotary(
    processor: Any, slot: Any, attn: torch.nn.Module, hidden_states: torch.Tensor, args: tuple, kwargs: dict
) -> Any:
    """Run `processor.inner` on the merged tokens with each row's rotary tables (see module doc)."""
    inner = processor.inner
    merge = processor._merge_for(slot, hidden_states, args, kwargs)
    rotary = argument(args, kwargs, *_ROTARY)
    if merge is None or (rotary is not None and (merge.row_token is None or not _fits(rotary, merge.num_tokens))):
        return inner(attn, hidden_states, *args, **kwargs)
    if rotary is not None:
        args, kwargs = replace_argument(args, kwargs, *_ROTARY, merged_rotary(rotary, merge))
    return merge.unmerge(inner(attn, merge.merge(hidden_states), *args, **kwargs))


def _fits(rotary: Any, num_tokens: int) -> bool:
    """`(cos, sin)` tables of shape `(1, num_tokens, 1, D)` (else the tokens are not merged)."""
    return isinstance(rotary, (tuple, list)) and all(
        isinstance(t, torch.Tensor) and t.ndim == 4 and t.shape[0] == 1 and t.shape[1] == num_tokens and t.shape[2] == 1
        for t in rotary
    )


def merged_rotary(rotary: tuple | list, merge: TokenMerge) -> Any:
    """The `(1, N, 1, D)` tables of `rotary` at every sample's `merge.row_token`: `(B, M, 1, D)` each.

    Kept on the merge: a merge shared by several blocks (`share_level`) gathers its tables once per forward.

    Example:
        >>> from tome_processors.merge import bipartite_soft_matching_2d
        >>> merge = bipartite_soft_matching_2d(torch.eye(4)[None], 1, 4, 2, 1, 1, with_row_token=True)
        >>> cos = torch.arange(4.0).view(1, 4, 1, 1)
        >>> merged_rotary((cos, cos), merge)[0].flatten().tolist()  # row 0 kept at token 0, row 1 at ...
        [0.0, 2.0, 3.0]
    """
    kept = merge.rotary
    if kept and kept[0] is rotary:
        return kept[1]
    tables = type(rotary)(
        torch.nn.functional.embedding(merge.row_token, table.reshape(table.shape[1], table.shape[3])).unsqueeze(2)
        for table in rotary
    )
    kept[:] = [rotary, tables]
    return tables
