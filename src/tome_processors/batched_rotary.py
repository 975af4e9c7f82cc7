"""Rotary tables, one per sample, for a whole batch in one attention call.

The merge is per sample, so a merged row of sample 0 and the same row of sample 1 are kept at different
token positions, and each sample needs its own rotary table. diffusers' `apply_rotary_emb` takes one
`(S, D)` table for the whole batch and views it as `(1, S, 1, D)` (`sequence_dim=1`: queries `(B, S, H, D)`,
as Flux's processors call it) or `(1, 1, S, D)` (`sequence_dim=2`); a `(B, S, D)` table viewed that way
would not broadcast. `SampleTables` holds `(B, S, D)` and answers those two views with `(B, S, 1, D)` and
`(B, 1, S, D)`: the rotation multiplies each sample's queries and keys by its own rows, element by element
the same products as a call per sample, in one call for the batch. Qwen-Image's `apply_rotary_emb_qwen` takes
its complex `(S, D)` image table (Qwen-Image 2.1's: the whole sequence's) as `table.unsqueeze(1)`, `(S, 1, D)`
against queries `(B, S, H, D)`; `SampleTables` answers that with `(B, S, 1, D)`. JoyImage-Edit's processor views its
`(S, D)` tables as `table.view(1, S, 1, D)` against queries `(B, S, H, D)`; `SampleTables` answers with `(B, S, 1, D)`.
MiniMax-H3's processor reads the table's width (`table.shape[-1]`, the rotated channels) and casts it
(`table.to(dtype)`) before the `[None, :, None, :]` view: `SampleTables` answers with one sample's shape `(S, D)`
and tables cast alike.

Only processors whose code is known to use the table through those views get one (`takes_sample_tables`);
any other processor is run one sample at a time with a plain table (`joint_attention`), so a processor
that reads the table some other way stays right.

Mochi's processor multiplies its queries and keys `(B, S, heads, D/2)` by its `(S, heads, D/2)` tables element by
element, with no view: a table per sample, `(B, S, heads, D/2)`, broadcasts there as it is (`takes_broadcast_tables`;
`sample_tables(..., broadcast=True)` gives the plain gathered tensors).
"""

from __future__ import annotations

from typing import Any

import torch
from diffusers.models.attention_processor import (
    CogVideoXAttnProcessor2_0,
    FusedCogVideoXAttnProcessor2_0,
    HunyuanAttnProcessor2_0,
    MochiAttnProcessor2_0,
)
from diffusers.models.transformers.transformer_bria import BriaAttnProcessor
from diffusers.models.transformers.transformer_bria_fibo import BriaFiboAttnProcessor
from diffusers.models.transformers.transformer_cogview4 import CogView4AttnProcessor
from diffusers.models.transformers.transformer_cosmos import CosmosAttnProcessor2_0
from diffusers.models.transformers.transformer_easyanimate import EasyAnimateAttnProcessor2_0
from diffusers.models.transformers.transformer_flux import FluxAttnProcessor, FluxIPAdapterAttnProcessor
from diffusers.models.transformers.transformer_flux2 import Flux2AttnProcessor, Flux2ParallelSelfAttnProcessor
from diffusers.models.transformers.transformer_flux3 import Flux3AttnProcessor
from diffusers.models.transformers.transformer_glm_image import GlmImageAttnProcessor
from diffusers.models.transformers.transformer_hunyuan_video import HunyuanVideoAttnProcessor2_0
from diffusers.models.transformers.transformer_hunyuan_video15 import HunyuanVideo15AttnProcessor2_0
from diffusers.models.transformers.transformer_hunyuanimage import HunyuanImageAttnProcessor
from diffusers.models.transformers.transformer_joyimage import JoyImageAttnProcessor
from diffusers.models.transformers.transformer_krea2 import Krea2AttnProcessor
from diffusers.models.transformers.transformer_longcat_image import LongCatImageAttnProcessor
from diffusers.models.transformers.transformer_minimax_h3 import MiniMaxH3AttnProcessor
from diffusers.models.transformers.transformer_motif_video import MotifVideoAttnProcessor2_0
from diffusers.models.transformers.transformer_nucleusmoe_image import NucleusMoEAttnProcessor2_0
from diffusers.models.transformers.transformer_omnigen import OmniGenAttnProcessor2_0
from diffusers.models.transformers.transformer_ovis_image import OvisImageAttnProcessor
from diffusers.models.transformers.transformer_qwenimage import QwenDoubleStreamAttnProcessor2_0
from diffusers.models.transformers.transformer_qwenimage21 import QwenImage21AttnProcessor, QwenImage21FlexAttnProcessor

__all__ = [
    "BROADCAST_TABLE_PROCESSORS",
    "SAMPLE_TABLE_PROCESSORS",
    "SampleTables",
    "sample_tables",
    "takes_broadcast_tables",
    "takes_sample_tables",
]

#: Processors that apply their rotary tables only with `apply_rotary_emb(x, (cos, sin), sequence_dim=1)`
#: (FLUX.1 and Chroma, FLUX.2, FLUX.3, Krea 2, LongCat-Image, HunyuanVideo and 1.5, HunyuanImage 2.1, Motif-Video,
#: Bria, Bria Fibo, Ovis-Image, GLM-Image) or its default `sequence_dim=2` (CogVideoX, ConsisID and CogView 3 Plus,
#: fused or not; CogView 4 and Cosmos's self-attention, `use_real_unbind_dim=-2`; OmniGen; EasyAnimate's video tokens;
#: Hunyuan-DiT's `HunyuanAttnProcessor2_0`), `apply_rotary_emb_qwen(x, table, use_real=False)` and its like,
#: `table.unsqueeze(1)` (Qwen-Image, Qwen-Image 2.1, whose processors must see the whole batch at once: the first
#: step's call stores the batch's keys and values in its cache; Nucleus-MoE-Image), `table.view(1, S, 1, D)`
#: (JoyImage-Edit), or MiniMax-H3's `_apply_rotary_emb` (`cos.shape[-1]`, `cos.to(dtype)[None, :, None, :]`). Exact
#: types: a subclass may read the table some other way.
SAMPLE_TABLE_PROCESSORS: frozenset[type] = frozenset(
    {
        CogVideoXAttnProcessor2_0,
        CogView4AttnProcessor,
        CosmosAttnProcessor2_0,
        EasyAnimateAttnProcessor2_0,
        FusedCogVideoXAttnProcessor2_0,
        FluxAttnProcessor,
        FluxIPAdapterAttnProcessor,
        Flux2AttnProcessor,
        Flux2ParallelSelfAttnProcessor,
        Flux3AttnProcessor,
        HunyuanVideoAttnProcessor2_0,
        HunyuanVideo15AttnProcessor2_0,
        Krea2AttnProcessor,
        LongCatImageAttnProcessor,
        HunyuanImageAttnProcessor,
        JoyImageAttnProcessor,
        MotifVideoAttnProcessor2_0,
        OmniGenAttnProcessor2_0,
        HunyuanAttnProcessor2_0,
        MiniMaxH3AttnProcessor,
        QwenDoubleStreamAttnProcessor2_0,
        QwenImage21AttnProcessor,
        QwenImage21FlexAttnProcessor,
        BriaAttnProcessor,
        BriaFiboAttnProcessor,
        OvisImageAttnProcessor,
        GlmImageAttnProcessor,
        NucleusMoEAttnProcessor2_0,
    }
)

#: Processors that use their `(S, ...)` rotary tables only in element-wise products with queries and keys laid out
#: `(B, S, ...)`, so a table per sample, `(B, S, ...)`, broadcasts as it is (Mochi's `x_even * cos - x_odd * sin` over
#: `(B, S, heads, D/2)`). Exact types, as above.
BROADCAST_TABLE_PROCESSORS: frozenset[type] = frozenset({MochiAttnProcessor2_0})

_ALL = slice(None)
_SEQUENCE_DIM_1 = (None, _ALL, None, _ALL)  # `apply_rotary_emb(..., sequence_dim=1)`: (S, D) -> (1, S, 1, D)
_SEQUENCE_DIM_2 = (None, None, _ALL, _ALL)  # `sequence_dim=2`: (S, D) -> (1, 1, S, D)


class SampleTables:
    """A rotary table per sample, `(B, S, D)`, where a processor takes one `(S, D)` table (see module doc).

    Example:
        >>> tables = SampleTables(torch.zeros(2, 5, 4))
        >>> tuple(tables[None, :, None, :].shape), tuple(tables[None, None, :, :].shape)
        ((2, 5, 1, 4), (2, 1, 5, 4))
        >>> tuple(tables.unsqueeze(1).shape)
        (2, 5, 1, 4)
        >>> tables.shape, tables.to(torch.float16).table.dtype  # one sample's shape; cast alike
        (torch.Size([5, 4]), torch.float16)
    """

    __slots__ = ("table",)

    def __init__(self, table: torch.Tensor) -> None:
        if table.ndim != 3:
            raise ValueError(f"Expected a rotary table per sample of shape (B, S, D), but got {tuple(table.shape)}.")
        self.table = table

    def __getitem__(self, key: Any) -> torch.Tensor:
        if key == _SEQUENCE_DIM_1:
            return self.table.unsqueeze(2)
        if key == _SEQUENCE_DIM_2:
            return self.table.unsqueeze(1)
        raise TypeError(
            f"Expected the view [None, :, None, :] or [None, None, :, :] that diffusers' apply_rotary_emb takes of a "
            f"rotary table, but got [{key}]."
        )

    @property
    def shape(self) -> torch.Size:
        """One sample's table's shape, `(S, D)`, as a processor that reads the table's width sees it."""
        return self.table.shape[1:]

    def to(self, *args: Any, **kwargs: Any) -> SampleTables:
        """The tables cast or moved alike (`torch.Tensor.to`'s arguments)."""
        return SampleTables(self.table.to(*args, **kwargs))

    def view(self, *shape: int) -> torch.Tensor:
        """JoyImage-Edit's view, `(S, D) -> (1, S, 1, D)`: `(B, S, 1, D)`, each sample's rows against its queries.

        Example:
            >>> tuple(SampleTables(torch.zeros(2, 5, 4)).view(1, 5, 1, 4).shape)
            (2, 5, 1, 4)
        """
        if shape != (1, self.table.shape[1], 1, self.table.shape[2]):
            raise TypeError(
                f"Expected the view (1, S, 1, D) that JoyImage-Edit's processor takes of a rotary table of S = "
                f"{self.table.shape[1]} rows of D = {self.table.shape[2]}, but got view{shape}."
            )
        return self.table.unsqueeze(2)

    def unsqueeze(self, dim: int) -> torch.Tensor:
        """Qwen-Image's view, `(S, D) -> (S, 1, D)`: `(B, S, 1, D)`, each sample's rows against its queries."""
        if dim != 1:
            raise TypeError(
                f"Expected the view unsqueeze(1) that diffusers' apply_rotary_emb_qwen takes of a rotary table, but "
                f"got unsqueeze({dim})."
            )
        return self.table.unsqueeze(2)


def takes_sample_tables(processor: Any) -> bool:
    """Whether `processor` may be given `SampleTables` for its rotary embeddings (see module doc).

    Example:
        >>> takes_sample_tables(FluxAttnProcessor()), takes_sample_tables(object())
        (True, False)
    """
    return type(processor) in SAMPLE_TABLE_PROCESSORS


def takes_broadcast_tables(processor: Any) -> bool:
    """Whether `processor` may be given plain rotary tables per sample, `(B, S, ...)`, where it takes `(S, ...)`
    (`BROADCAST_TABLE_PROCESSORS`).

    Example:
        >>> takes_broadcast_tables(MochiAttnProcessor2_0()), takes_broadcast_tables(FluxAttnProcessor())
        (True, False)
    """
    return type(processor) in BROADCAST_TABLE_PROCESSORS


def sample_tables(rotary: Any, row_token: torch.Tensor, follow: int | None = None, broadcast: bool = False) -> Any:
    """`rotary` (a table `(S, D)` or a tuple/list of them) at `row_token` `(B, R)`: `SampleTables` of `(B, R, D)`.

    `follow`: how many of the tables, from the first, cover the merged tokens (all by default); the others
    (Qwen-Image's text table) are passed on as they are. `broadcast`: tables `(S, ...)` of any rank, gathered as
    plain tensors `(B, R, ...)` (`takes_broadcast_tables`).

    Example:
        >>> cos, sin = torch.arange(6.0).view(3, 2), -torch.arange(6.0).view(3, 2)
        >>> per_sample = sample_tables((cos, sin), torch.tensor([[0, 2], [1, 0]]))
        >>> per_sample[0].table[1].tolist()
        [[2.0, 3.0], [0.0, 1.0]]
        >>> tuple(sample_tables(torch.zeros(3, 2, 4), torch.tensor([[0, 2], [1, 0]]), broadcast=True).shape)
        (2, 2, 2, 4)
    """
    every = _tables(rotary)
    follow = len(every) if follow is None else follow
    # One row lookup per table (`embedding`: one kernel, complex tables too) for the whole batch, on the merge's
    # device: CogView 4 builds its tables on the host, and the merged rows' positions stay where they were made.
    gathered = [_rows(t.to(row_token.device), row_token) for t in every[:follow]]
    tables = (gathered if broadcast else [SampleTables(t) for t in gathered]) + every[follow:]
    return type(rotary)(tables) if isinstance(rotary, (tuple, list)) else tables[0]


def _rows(table: torch.Tensor, row_token: torch.Tensor) -> torch.Tensor:
    """`table` `(S, ...)` at `row_token` `(B, R)`: `(B, R, ...)` (a table of more than two axes looked up flat)."""
    if table.ndim == 2:
        return torch.nn.functional.embedding(row_token, table)
    return torch.nn.functional.embedding(row_token, table.flatten(1)).unflatten(-1, table.shape[1:])


def _tables(rotary: Any) -> list[torch.Tensor]:
    return list(rotary) if isinstance(rotary, (tuple, list)) else [rotary]
