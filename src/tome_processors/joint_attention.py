"""Merged attention where image tokens sit next to text tokens (SD3 joint attention, Flux).

Only the image tokens are merged; text tokens reach the inner processor whole and its text output
is returned as it is. Two layouts (see `families.Layout`):

- JOINT: `processor(attn, image, text, mask, rotary, ...)` returning `(image, text, ...)`. The image
  tokens are merged, the image output(s) unmerged, the text output untouched.
- TEXT_FIRST: `processor(attn, cat(text, image), None, mask, rotary)` returning `cat(text, image)`.
  The merge covers the whole sequence, each text token a row of its own ahead of the image rows
  (`TokenMerge.text_rows`): the text goes through merge and unmerge unchanged, and nothing is sliced
  off and put back.

Rotary embeddings (Flux) cover text then image positions. A merged row keeps the rotation of the token
it is kept at (`TokenMerge.row_token`: its destination, or itself when nothing was merged into it):
a rotation is exact only at a real position, and averaging cosines and sines of several positions
gives no rotation at all. The merge is per sample, so the rows of two samples sit at different
positions. Where the inner processor is known to take a table per sample (diffusers' Flux and FLUX.2
processors), the whole batch goes in one call with `batched_rotary.SampleTables`; any other processor
is run one sample at a time with plain `(S, D)` tables.
"""

from __future__ import annotations

from typing import Any

import torch

from .arguments import argument, replace_argument
from .batched_rotary import sample_tables, takes_sample_tables
from .families import Layout
from .merge import TokenMerge

_ROTARY = (2, "image_rotary_emb")  # position after hidden_states, and keyword name


def run_with_text(
    processor: Any, slot: Any, attn: torch.nn.Module, hidden_states: torch.Tensor, args: tuple, kwargs: dict
) -> Any:
    """Run `processor.inner` with the image tokens merged and the text tokens whole (see module doc)."""
    inner = processor.inner
    if processor.config.mode != "merge":  # K/V pooling cannot reach inside joint attention
        return inner(attn, hidden_states, *args, **kwargs)
    if slot.layout is Layout.JOINT:
        text = argument(args, kwargs, 0, "encoder_hidden_states")
        text_len = int(text.shape[1]) if isinstance(text, torch.Tensor) else 0
        merge = processor._merge_for(slot, hidden_states, args, kwargs, text_len)
        if merge is None or not _rotary_fits(args, kwargs, text_len + merge.num_tokens):
            return inner(attn, hidden_states, *args, **kwargs)
        return _unmerge_joint(_call(inner, attn, merge.merge(hidden_states), args, kwargs, merge), merge)

    metric = slot.block.metric
    text_len = hidden_states.shape[1] - (metric.shape[1] if isinstance(metric, torch.Tensor) else 0)
    if metric is None or metric.ndim != 3 or text_len < 0:
        return inner(attn, hidden_states, *args, **kwargs)
    merge = processor._merge_for(slot, hidden_states, args, kwargs, text_len, text_rows=True)
    if merge is None or not _rotary_fits(args, kwargs, hidden_states.shape[1]):
        return inner(attn, hidden_states, *args, **kwargs)
    out = _call(inner, attn, merge.merge(hidden_states), args, kwargs, merge)
    if isinstance(out, tuple):  # a processor that returns more: the first output holds the tokens
        return (merge.unmerge(out[0]), *out[1:])
    return merge.unmerge(out)


def _unmerge_joint(out: Any, merge: TokenMerge) -> Any:
    if isinstance(out, torch.Tensor):
        return merge.unmerge(out)
    # (image, text, extra image outputs such as Flux IP-Adapter's): the text output stays as it is.
    image, text, *extra = out
    extra = [
        merge.unmerge(x) if isinstance(x, torch.Tensor) and x.ndim == 3 and x.shape[1] == merge.num_rows else x
        for x in extra
    ]
    return type(out)((merge.unmerge(image), text, *extra))


def _rotary_tables(rotary: Any) -> list[torch.Tensor]:
    return list(rotary) if isinstance(rotary, (tuple, list)) else [rotary]


def _rotary_fits(args: tuple, kwargs: dict, num_positions: int) -> bool:
    """No rotary embeddings, or tables with one row per text and image token (else: do not merge)."""
    rotary = argument(args, kwargs, *_ROTARY)
    if rotary is None:
        return True
    tables = _rotary_tables(rotary)
    return all(isinstance(t, torch.Tensor) and t.ndim == 2 and t.shape[0] == num_positions for t in tables)


def _kept_rotary(rotary: Any, merge: TokenMerge) -> list:
    """`[source table, tables per sample or None, SampleTables or None]`, kept on the merge.

    A merge shared by several blocks (`share_level`) gathers its tables once per forward. The list object is
    shared with the merge's `with_text_rows` (the same positions).
    """
    source = _rotary_tables(rotary)[0]
    kept = merge.rotary
    if not kept or kept[0] is not source:
        kept[:] = [source, None, None]
    return kept


def _merged_rotary(rotary: Any, merge: TokenMerge) -> list[Any]:
    """Per sample, the rotary tables at `merge.row_token`: the text positions, then each row's kept token."""
    kept = _kept_rotary(rotary, merge)
    if kept[1] is None:
        tables = _rotary_tables(rotary)
        per_sample = []
        for sample_positions in merge.row_token.to(tables[0].device).unbind(0):
            gathered = [t.index_select(0, sample_positions) for t in tables]
            per_sample.append(type(rotary)(gathered) if isinstance(rotary, (tuple, list)) else gathered[0])
        kept[1] = per_sample
    return kept[1]


def _batched_rotary(rotary: Any, merge: TokenMerge) -> Any:
    """The rotary tables at `merge.row_token` for the whole batch at once (`batched_rotary.SampleTables`)."""
    kept = _kept_rotary(rotary, merge)
    if kept[2] is None:
        kept[2] = sample_tables(rotary, merge.row_token)
    return kept[2]


def _call(inner: Any, attn: torch.nn.Module, merged: torch.Tensor, args: tuple, kwargs: dict, merge: TokenMerge) -> Any:
    rotary = argument(args, kwargs, *_ROTARY)
    if rotary is None:
        return inner(attn, merged, *args, **kwargs)
    batch = merge.batch
    if takes_sample_tables(inner):  # the whole batch in one call, a table per sample
        args, kwargs = replace_argument(args, kwargs, *_ROTARY, _batched_rotary(rotary, merge))
        return inner(attn, merged, *args, **kwargs)
    per_sample = _merged_rotary(rotary, merge)
    if batch == 1:
        args, kwargs = replace_argument(args, kwargs, *_ROTARY, per_sample[0])
        return inner(attn, merged, *args, **kwargs)
    outputs = []
    for b in range(batch):  # a processor not known to take a table per sample: one sample at a time
        sample_args = tuple(_sample(x, b, batch) for x in args)
        sample_kwargs = {k: _sample(v, b, batch) for k, v in kwargs.items()}
        sample_args, sample_kwargs = replace_argument(sample_args, sample_kwargs, *_ROTARY, per_sample[b])
        outputs.append(inner(attn, merged[b : b + 1], *sample_args, **sample_kwargs))
    if isinstance(outputs[0], torch.Tensor):
        return torch.cat(outputs)
    return type(outputs[0])(torch.cat(parts) if parts[0] is not None else None for parts in zip(*outputs, strict=True))


def _sample(x: Any, b: int, batch: int) -> Any:
    """Sample `b` of a per-sample argument (a tensor with a leading batch axis, or a list of them)."""
    if isinstance(x, torch.Tensor):
        return x[b : b + 1] if x.ndim >= 1 and x.shape[0] == batch and batch > 1 else x
    if isinstance(x, list):
        return [_sample(item, b, batch) for item in x]
    return x
