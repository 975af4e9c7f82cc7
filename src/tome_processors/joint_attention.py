"""Merged attention where image tokens sit next to text tokens (SD3 joint attention, Flux).

Only the image tokens are merged; text tokens reach the inner processor whole and its text output
is returned as it is. The layouts (see `families.Layout`):

- JOINT: `processor(attn, image, text, mask, rotary, ...)` returning `(image, text, ...)`. The image
  tokens are merged, the image output(s) unmerged, the text output untouched. JOINT_IMAGE_FIRST: the same
  call, where the processor attends over the image then the text (HunyuanVideo), so a mask over the whole
  sequence is cut at its start, and rotary tables over the whole sequence (`Rotary.covers_text`: HiDream's)
  keep the text's positions after the merged rows'. JOINT_IMAGE_FIRST_HISTORY: the same call, where the image input
  opens with other tokens ahead of the grid's (FramePack's history latents), each merged as a row of its own, as
  TEXT_FIRST merges the text.
- TEXT_FIRST: `processor(attn, cat(text, image), None, mask, rotary)` returning `cat(text, image)`.
  The merge covers the whole sequence, each text token a row of its own ahead of the image rows
  (`TokenMerge.text_rows`): the text goes through merge and unmerge unchanged, and nothing is sliced
  off and put back. The model's tail (`ModelState.tail`: FLUX.2's reference images, after the generated
  image's tokens) passes the same way, each token a row of its own after the image rows. A module that passes its
  tokens again as `encoder_hidden_states` (Lumina's self-attention: keys and values from the same tokens) gets the
  merged tokens there too. A cross-attention's mask over its keys is left as it is.

Rotary embeddings (Flux) cover text then image positions. A merged row keeps the rotation of the token
it is kept at (`TokenMerge.row_token`: its destination, or itself when nothing was merged into it):
a rotation is exact only at a real position, and averaging cosines and sines of several positions
gives no rotation at all. The merge is per sample, so the rows of two samples sit at different
positions. Where the inner processor is known to take a table per sample (diffusers' Flux, FLUX.2,
HunyuanVideo and Qwen-Image processors), the whole batch goes in one call with `batched_rotary.SampleTables` (Mochi's,
which multiplies by its tables element by element: plain `(B, M, ...)` tables);
batched tables (`Rotary.batched`, Z-Image) are gathered for the whole batch; any other processor is run one
sample at a time with plain `(S, D)` tables. Where the image's tables come as a pair inside the argument
(`Rotary.nested`: JoyImage-Edit's `((cos, sin), text tables)`), that pair follows the rows and the rest is passed on.

A text-first attention whose module passes the same tensor as `hidden_states` and `encoder_hidden_states` (OmniGen's
self-attention, called as cross-attention to itself) gets the merged tokens as both: its keys and values are the
merged rows, as its queries are.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

import torch

from .arguments import argument, replace_argument
from .batched_rotary import sample_tables, takes_broadcast_tables, takes_sample_tables
from .families import Layout, Rotary, mask_where
from .merge import TokenMerge, positions
from .skips import Skip

_FLUX_ROTARY = Rotary()  # FLUX.1's: `image_rotary_emb`, (cos, sin) over text then image, one for the batch
#: The image's `(cos, sin)` inside a nested argument (`Rotary.nested`): both tables follow the merged rows.
_IMAGE_PAIR = Rotary(covers_text=False, text_table=False)
#: The layouts whose image tokens come as `hidden_states` and the text as `encoder_hidden_states`.
_JOINT = (Layout.JOINT, Layout.JOINT_IMAGE_FIRST, Layout.JOINT_IMAGE_FIRST_HISTORY)
#: Masks over the attention's keys that processors take by keyword beside `attention_mask`, `(B, S)`: Qwen-Image
#: 2.1's `key_valid`. They are refused or cut as the attention mask is.
KEY_MASKS = ("key_valid",)


def run_with_text(
    processor: Any, slot: Any, attn: torch.nn.Module, hidden_states: torch.Tensor, args: tuple, kwargs: dict
) -> Any:
    """Run `processor.inner` with the image tokens merged and the text tokens whole (see module doc)."""
    inner = processor.inner
    if processor.config.mode != "merge":  # K/V pooling cannot reach inside joint attention
        slot.skip(Skip.KV_JOINT)
        return inner(attn, hidden_states, *args, **kwargs)
    model = slot.block.model
    spec = model.rotary or _FLUX_ROTARY
    metric = slot.block.metric
    grid_tokens = metric.shape[1] if isinstance(metric, torch.Tensor) and metric.ndim == 3 else -1
    extra = hidden_states.shape[1] - grid_tokens  # tokens beside the grid's in `hidden_states`
    if grid_tokens < 0 or extra < 0:
        slot.skip(Skip.NO_BLOCK_INPUT if grid_tokens < 0 else Skip.FEWER_TOKENS, hidden_states)
        return inner(attn, hidden_states, *args, **kwargs)
    masked = model.masks_text_only
    at = (slot.rotary_at if slot.rotary_at is not None else spec.position, spec.name)  # where the tables are
    if slot.layout in _JOINT:
        text = argument(args, kwargs, 0, "encoder_hidden_states")
        text_len = int(text.shape[1]) if isinstance(text, torch.Tensor) else 0
        text_first = slot.layout is Layout.JOINT
        # Positions of the text in rotary tables that cover it: ahead of the image's, or after them (image first:
        # each text position keeps its row of the table, after the merged rows').
        ahead = text_len if spec.covers_text and text_first else 0
        after = text_len if spec.covers_text and not text_first else 0
        if slot.layout is Layout.JOINT_IMAGE_FIRST_HISTORY:  # `extra` tokens ahead of the grid's, a row each
            merge = processor._merge_for(slot, hidden_states, args, kwargs, extra, text_rows=True, mask_fits=masked)
            lead, tail = extra, text_len  # the mask's sequence
        else:  # `extra` tokens after the grid's (Qwen-Image-Edit's reference image)
            merge = processor._merge_for(slot, hidden_states, args, kwargs, ahead, tail=extra, mask_fits=masked)
            lead, tail = (text_len, extra) if text_first else (0, extra + text_len)
        if merge is None or not _rotary_fits(spec, at, args, kwargs, ahead + merge.num_tokens + after, merge.batch):
            if merge is not None:  # (None: `_merge_for` said why)
                slot.skip(Skip.ROTARY, hidden_states)
            return inner(attn, hidden_states, *args, **kwargs)
        args, kwargs = _merged_mask(args, kwargs, slot.mask_at, lead, tail, merge)
        out = _call(inner, attn, merge.merge(hidden_states), args, kwargs, merge, spec, at, after)
        return _unmerge_joint(out, merge)

    # A cross-attention's mask is over its keys (the text), which are not merged: it stays as it is, and any other
    # mask there leaves the attention unmerged (`_merge_for`).
    masked = masked and not slot.is_cross
    if slot.layout is Layout.IMAGE_FIRST:  # the grid's tokens, then `extra` others
        merge = processor._merge_for(slot, hidden_states, args, kwargs, tail=extra, mask_fits=masked)
        lead = 0
    else:  # TEXT_FIRST: text tokens, then the grid's, then the model's tail (FLUX.2's reference images)
        tail = model.tail
        lead = extra - tail
        if lead < 0:
            slot.skip(Skip.FEWER_TOKENS, hidden_states)
            return inner(attn, hidden_states, *args, **kwargs)
        merge = processor._merge_for(
            slot, hidden_states, args, kwargs, lead, text_rows=True, tail=tail, mask_fits=masked
        )
    if merge is None or not _rotary_fits(spec, at, args, kwargs, hidden_states.shape[1], merge.batch):
        if merge is not None:  # (None: `_merge_for` said why)
            slot.skip(Skip.ROTARY, hidden_states)
        return inner(attn, hidden_states, *args, **kwargs)
    if masked:
        args, kwargs = _merged_mask(args, kwargs, slot.mask_at, lead, extra - lead, merge)
    merged = merge.merge(hidden_states)
    if argument(args, kwargs, 0, "encoder_hidden_states") is hidden_states:
        # A self-attention whose module passes its tokens again as the keys' (OmniGen's, Lumina's): the merged ones.
        args, kwargs = replace_argument(args, kwargs, 0, "encoder_hidden_states", merged)
    out = _call(inner, attn, merged, args, kwargs, merge, spec, at)
    if isinstance(out, tuple):  # a processor that returns more: the first output holds the tokens
        return (merge.unmerge(out[0]), *out[1:])
    return merge.unmerge(out)


def _merged_mask(
    args: tuple, kwargs: dict, mask_at: int | tuple[int, str], lead: int, tail: int, merge: TokenMerge
) -> tuple[tuple, dict]:
    """`args` / `kwargs` with the attention mask and any key masks (`KEY_MASKS`) cut to the merged sequence.

    The attention's sequence is `lead` tokens (text), the grid's, then `tail` others. Only families whose
    masks mask text tokens alone get here with a mask (`masks_text_only`; `_merge_for` refuses others):
    every grid position holds the same value, so the lead and tail positions are kept exactly and grid
    positions are dropped, as many as the merge removes (slices: no copy, no host sync). A mask over the lead
    and tail alone (HunyuanVideo 1.5's over the text, which its processor pads over the image itself) is left
    as it is. A mask over more keys than the attention's tokens (Qwen-Image 2.1's cached steps: the cached
    prefix's keys, then the grid's) loses the grid's last positions, as one over a lead and the grid does. A mask
    that opens with the grid and stops short of the tail (HiDream's over the image tokens and their padding, not
    the text) is cut at its start all the same. `mask_at`: the site's (`mask_where`).
    """
    position, name = mask_where(mask_at)
    mask = argument(args, kwargs, position, name)
    if isinstance(mask, torch.Tensor) and mask.shape[-1] != lead + tail:
        args, kwargs = replace_argument(args, kwargs, position, name, _cut_mask(mask, lead, tail, merge))
    for key_mask in KEY_MASKS:
        keys = kwargs.get(key_mask)
        if isinstance(keys, torch.Tensor) and keys.shape[-1] != lead + tail:
            kwargs = {**kwargs, key_mask: _cut_mask(keys, lead, tail, merge)}
    return args, kwargs


def _cut_mask(mask: torch.Tensor, lead: int, tail: int, merge: TokenMerge) -> torch.Tensor:
    """`mask` less as many of the grid's positions as the merge removes (see `_merged_mask`)."""
    length, removed = mask.shape[-1], merge.num_tokens - merge.num_rows
    if tail and lead:  # both kept: the lead and the grid's first rows, then the tail
        cut = torch.cat([mask[..., : length - tail - removed], mask[..., length - tail :]], dim=-1)
        if mask.ndim >= 3 and mask.shape[-2] == length:
            cut = torch.cat([cut[..., : length - tail - removed, :], cut[..., length - tail :, :]], dim=-2)
        return cut
    # Nothing after the grid: drop its last positions; nothing ahead of it: its first.
    keep = slice(0, length - removed) if not tail else slice(removed, length)
    cut = mask[..., keep]
    if mask.ndim >= 3 and mask.shape[-2] == length:  # a (query, key) mask: the queries too
        cut = cut[..., keep, :]
    return cut


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


def _image_part(spec: Rotary, rotary: Any) -> tuple[Rotary, Any, Any]:
    """`(spec, tables, put_back)`: where the image's pair sits inside the argument (`Rotary.nested`), that pair, a
    spec under which both its tables follow the merged rows, and a function that puts merged tables back in the
    argument's place; else the argument as it is (`put_back` None).

    Example:
        >>> cos, sin, text = torch.zeros(4, 2), torch.ones(4, 2), torch.ones(3, 2)
        >>> spec, image, put_back = _image_part(Rotary(nested=True), ((cos, sin), text))
        >>> image[0] is cos, spec.text_table, put_back("merged")[1] is text
        (True, False, True)
    """
    if not spec.nested or not isinstance(rotary, (tuple, list)) or not rotary:
        return spec, rotary, None
    return replace(_IMAGE_PAIR, batched=spec.batched), rotary[0], lambda image: type(rotary)((image, *rotary[1:]))


def _gathered(spec: Rotary, tables: list[torch.Tensor]) -> list[torch.Tensor]:
    """The tables that follow the merged rows: all of them, or the image's alone (`Rotary.covers_text`,
    `Rotary.text_table`)."""
    return tables if spec.covers_text or not spec.text_table else tables[:1]


def _rotary_fits(spec: Rotary, at: tuple[int, str], args: tuple, kwargs: dict, num_positions: int, batch: int) -> bool:
    """No rotary embeddings, or tables with one row per position the merge counts (else: do not merge)."""
    rotary = argument(args, kwargs, *at)
    keys = argument(args, kwargs, spec.key_position, spec.key_name) if spec.key_name is not None else None
    if keys is not None and keys is not rotary:
        return False  # a keys' table of its own: only the very queries' table follows the merged keys (`_call`)
    if rotary is None:
        return True
    spec, rotary, _ = _image_part(spec, rotary)
    tables = _gathered(spec, _rotary_tables(rotary))
    if spec.batched:  # (B or 1, S, ...): Z-Image's (B, S, D/2), ERNIE-Image's (B, S, 1, D), HiDream's (B, S, 1, D/2, 2,
        # 2), Helios's (1, S, 2D) for the whole batch; PRX's (B, 1, S, D/2, 2, 2) (`Rotary.sequence_dim` 2)
        dim = spec.sequence_dim
        return all(
            isinstance(t, torch.Tensor)
            and t.ndim >= max(3, dim + 1)
            and t.shape[0] in (1, batch)
            and t.shape[dim] == num_positions
            for t in tables
        )
    # (S, ...) for the whole batch, a row per position: Flux's (S, D), Mochi's (S, heads, D/2) (gathered along dim 0)
    return all(isinstance(t, torch.Tensor) and t.ndim >= 2 and t.shape[0] == num_positions for t in tables)


def _kept_rotary(rotary: Any, merge: TokenMerge, after: int = 0) -> list:
    """`[source table, tables per call or None, SampleTables or None, after]`, kept on the merge.

    A merge shared by several blocks (`share_level`) gathers its tables once per forward. The list object is
    shared with the merge's `with_text_rows` (the same positions).
    """
    source = _rotary_tables(rotary)[0]
    kept = merge.rotary
    if len(kept) != 4 or kept[0] is not source or kept[3] != after:
        kept[:] = [source, None, None, after]
    return kept


def _positions(merge: TokenMerge, after: int) -> torch.Tensor:
    """`merge.row_token`, then the `after` positions that follow the merged tokens' (the text of an image-first
    joint attention whose rotary tables cover it), each at its own position: `(B, rows + after)`."""
    if not after:
        return merge.row_token
    start, row_token = merge.num_tokens, merge.row_token
    following = positions(start + after, row_token.device)[start:].expand(merge.batch, after)
    return torch.cat([row_token, following], dim=1)


def _merged_rotary(spec: Rotary, rotary: Any, merge: TokenMerge, after: int = 0) -> list[Any]:
    """The rotary tables at `merge.row_token` (the text positions, then each row's kept token, then the `after`
    positions): one entry per sample, or one for the whole batch where the tables are batched (`Rotary.batched`)."""
    kept = _kept_rotary(rotary, merge, after)
    if kept[1] is not None:
        return kept[1]
    tables = _rotary_tables(rotary)
    row_token = _positions(merge, after)
    # Gathered on the merge's device, where tables made on the host (CogView 4's) go: no read back of the positions.
    follow = [t.to(row_token.device) for t in _gathered(spec, tables)]
    if spec.batched:  # (B, S, D) tables: one lookup along the sequence for the whole batch
        samples = sample_index(merge.batch, row_token.device)
        # A table of batch 1 serves every sample: each sample's rows are gathered from it.
        alone = sample_index(merge.batch, row_token.device, alike=True)
        gathered = [_gathered_rows(t, samples if t.shape[0] == merge.batch else alone, row_token, spec) for t in follow]
        per_call = [_rebuilt(rotary, gathered + tables[len(follow) :])]
    else:
        per_call = []
        for sample_positions in row_token.unbind(0):
            sample_tables_ = [t.index_select(0, sample_positions) for t in follow]
            per_call.append(_rebuilt(rotary, sample_tables_ + tables[len(follow) :]))
    kept[1] = per_call
    return per_call


def _gathered_rows(table: torch.Tensor, samples: torch.Tensor, row_token: torch.Tensor, spec: Rotary) -> torch.Tensor:
    """A batched table's rows at `row_token` `(B, M)` for each of `samples` `(B, 1)`, along its token axis
    (`Rotary.sequence_dim`: a head axis ahead of the tokens is brought behind them for the lookup, then put back).

    Example:
        >>> table = torch.arange(6.0).view(1, 1, 3, 2)  # (B, 1, S, D): PRX's layout, one sample
        >>> _gathered_rows(table, torch.zeros(1, 1, dtype=torch.long), torch.tensor([[2, 0]]), Rotary(sequence_dim=2))
        tensor([[[[4., 5.],
                  [0., 1.]]]])
    """
    if spec.sequence_dim == 1:
        return table[samples, row_token]
    return table.movedim(spec.sequence_dim, 1)[samples, row_token].movedim(1, spec.sequence_dim)


def _batched_rotary(spec: Rotary, rotary: Any, merge: TokenMerge, after: int = 0, broadcast: bool = False) -> Any:
    """The rotary tables at `merge.row_token` (then the `after` positions) for the whole batch at once
    (`batched_rotary.SampleTables`, or with `broadcast` plain `(B, M, ...)` tensors); a text table
    (`Rotary.text_table`) as it is."""
    kept = _kept_rotary(rotary, merge, after)
    if kept[2] is None or kept[2][0] is not broadcast:
        follow = len(_gathered(spec, _rotary_tables(rotary)))
        kept[2] = (broadcast, sample_tables(rotary, _positions(merge, after), follow, broadcast))
    return kept[2][1]


_SAMPLE_INDEX: dict[tuple, torch.Tensor] = {}


def sample_index(batch: int, device: torch.device, alike: bool = False) -> torch.Tensor:
    """`(batch, 1)`: each sample's index, made once per batch size and device (indexes a batched table); with
    `alike`, 0 for every sample (indexes a table of batch 1 that serves the whole batch)."""
    key = (batch, device, alike)
    index = _SAMPLE_INDEX.get(key)
    if index is None:
        made = torch.zeros(batch, dtype=torch.long, device=device) if alike else torch.arange(batch, device=device)
        index = _SAMPLE_INDEX[key] = made.view(batch, 1)
    return index


def _rebuilt(rotary: Any, tables: list[torch.Tensor]) -> Any:
    return type(rotary)(tables) if isinstance(rotary, (tuple, list)) else tables[0]


def _call(
    inner: Any,
    attn: torch.nn.Module,
    merged: torch.Tensor,
    args: tuple,
    kwargs: dict,
    merge: TokenMerge,
    spec: Rotary,
    where: tuple[int, str],
    after: int = 0,
) -> Any:
    """`inner` on the merged tokens, with the rotary tables at `where` taken at the merged rows' positions (then at
    the `after` positions that follow the merged tokens', as they are)."""
    rotary = argument(args, kwargs, *where)
    if rotary is None:
        return inner(attn, merged, *args, **kwargs)
    # The keys' table where the processor takes one, the queries' own (Lumina-Next's `key_rotary_emb`): the same rows.
    keys = (spec.key_position, spec.key_name) if spec.key_name else None
    if keys is not None and argument(args, kwargs, *keys) is not rotary:
        keys = None  # no keys' table (a cross-attention's); a table of its own is refused (`_rotary_fits`)
    spec, rotary, put_back = _image_part(spec, rotary)
    # A processor known to take a table per sample: the whole batch in one call.
    broadcast = takes_broadcast_tables(inner)
    if not spec.batched and (broadcast or takes_sample_tables(inner)):
        tables = _batched_rotary(spec, rotary, merge, after, broadcast)
        args, kwargs = _with_tables(args, kwargs, where, keys, put_back(tables) if put_back else tables)
        return inner(attn, merged, *args, **kwargs)
    per_call = _merged_rotary(spec, rotary, merge, after)
    if put_back is not None:
        per_call = [put_back(tables) for tables in per_call]
    batch = merge.batch
    if batch == 1 or spec.batched:
        args, kwargs = _with_tables(args, kwargs, where, keys, per_call[0])
        return inner(attn, merged, *args, **kwargs)
    outputs = []
    for b in range(batch):  # a processor not known to take a table per sample: one sample at a time
        sample_args = tuple(_sample(x, b, batch) for x in args)
        sample_kwargs = {k: _sample(v, b, batch) for k, v in kwargs.items()}
        sample_args, sample_kwargs = _with_tables(sample_args, sample_kwargs, where, keys, per_call[b])
        outputs.append(inner(attn, merged[b : b + 1], *sample_args, **sample_kwargs))
    if isinstance(outputs[0], torch.Tensor):
        return torch.cat(outputs)
    return type(outputs[0])(torch.cat(parts) if parts[0] is not None else None for parts in zip(*outputs, strict=True))


def _with_tables(
    args: tuple, kwargs: dict, where: tuple[int, str], keys: tuple[int, str] | None, tables: Any
) -> tuple[tuple, dict]:
    """`args` / `kwargs` with the rotary tables at `where` (and at `keys`, the keys' place, where given) set to
    `tables`."""
    args, kwargs = replace_argument(args, kwargs, *where, tables)
    return (args, kwargs) if keys is None else replace_argument(args, kwargs, *keys, tables)


def _sample(x: Any, b: int, batch: int) -> Any:
    """Sample `b` of a per-sample argument (a tensor with a leading batch axis, or a list of them)."""
    if isinstance(x, torch.Tensor):
        return x[b : b + 1] if x.ndim >= 1 and x.shape[0] == batch and batch > 1 else x
    if isinstance(x, list):
        return [_sample(item, b, batch) for item in x]
    return x
