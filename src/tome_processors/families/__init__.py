"""Model families: where the blocks are, where the image tokens are, and each family's defaults.

Everything that differs between a UNet and a diffusion transformer lives here, so the hooks and
the processor stay generic. A family answers four questions about a model:

1. Which blocks hold attention over image tokens, and how each attention module lays out its
   tokens (`Layout`): image tokens alone, image tokens with the text passed separately (joint
   attention), or text and image tokens concatenated with the text first.
2. The token grid of the current forward, read from the model's arguments.
3. The timestep of the current forward, on the 0..1000 scale.
4. The default `ToMeConfig` fields and the presets (`"exact"`, `"balanced"`, `"fast"`), chosen per family
   from measured speed and quality (docs/options.md); `ToMeConfig.for_model` builds configs from them.

Supported: UNets (any model with `BasicTransformerBlock`s inside `Transformer2DModel`s, as before),
`PixArtTransformer2DModel`, `SD3Transformer2DModel`, `FluxTransformer2DModel`, `Flux2Transformer2DModel`,
`ChromaTransformer2DModel`, `QwenImageTransformer2DModel`, `ZImageTransformer2DModel`, and the video models
`WanTransformer3DModel` (and its derivatives `SkyReelsV2Transformer3DModel`, `WanVACETransformer3DModel`,
`WanAnimateTransformer3DModel`, `ChronoEditTransformer3DModel`, `HeliosTransformer3DModel`),
`LTXVideoTransformer3DModel`, `LTX2VideoTransformer3DModel`,
`HunyuanVideoTransformer3DModel`,
`HunyuanVideo15Transformer3DModel`, the FLUX-like `Krea2Transformer2DModel`, `Flux3Transformer2DModel` and
`LongCatImageTransformer2DModel`, the single-stream `QwenImage21Transformer2DModel` and
`ErnieImageTransformer2DModel`, the image models `HunyuanImageTransformer2DModel` and
`HiDreamImageTransformer2DModel`, the video models `Kandinsky5Transformer3DModel` and
`Kandinsky6Transformer3DModel`, the video models `CosmosTransformer3DModel`, `MiniMaxH3Transformer3DModel`,
`AllegroTransformer3DModel`, `EasyAnimateTransformer3DModel` and `LatteTransformer3DModel` (its spatial blocks), and
Stable Video Diffusion's `UNetSpatioTemporalConditionModel` (its spatial blocks). Some models are refused with the
reason (`REFUSED`: Kandinsky 6's super-resolution transformer, whose attention is block-sparse; Cosmos 3 and Mochi,
whose attention ToMe cannot reach). docs/families.md is the recipe for adding one.

Example:
    >>> from tome_processors.families import family_of
    >>> family_of(pixart_transformer).name  # doctest: +SKIP
    'pixart'
"""

from __future__ import annotations

from typing import Any

import torch

from .base import (
    AttentionSite,
    BlockSite,
    Family,
    Layout,
    Rotary,
    Span,
    Stack,
    class_default_processor,
    is_mergeable_attention,
    mask_where,
    max_downsample_for_levels,
)
from .chroma import ChromaFamily, Flux2Family
from .dit import PixArtFamily, SD3Family
from .flux import FluxFamily, IdsGridFamily, grid_from_ids
from .fluxlike import Flux3Family, Krea2Family, LongCatImageFamily
from .hunyuanvideo import HunyuanVideo15Family, HunyuanVideoFamily
from .hyimage_hidream import HiDreamImageFamily, HunyuanImageFamily
from .kandinsky import REFUSED as _KANDINSKY_REFUSED
from .kandinsky import Kandinsky5Family, Kandinsky6Family, KandinskyFamily
from .ltx import LTXVideoFamily
from .ltx2 import LTX2Family
from .qwen_ernie import ErnieImageFamily, QwenImage21Family
from .qwenimage import QwenImageFamily
from .svd import SVDFamily, spatio_temporal_blocks
from .unet import UNetFamily, attention_levels, spatial_transformer_blocks
from .video_more import REFUSED as _VIDEO_MORE_REFUSED
from .video_more import AllegroFamily, CosmosFamily, EasyAnimateFamily, LatteFamily, MiniMaxH3Family
from .wan import SkyReelsV2Family, WanFamily, WanVACEFamily
from .wan_derived import ChronoEditFamily, HeliosFamily, WanAnimateFamily
from .zimage import ZImageFamily

__all__ = [
    "FAMILIES",
    "AllegroFamily",
    "AttentionSite",
    "BlockSite",
    "ChromaFamily",
    "ChronoEditFamily",
    "CosmosFamily",
    "EasyAnimateFamily",
    "ErnieImageFamily",
    "Family",
    "Flux2Family",
    "Flux3Family",
    "FluxFamily",
    "HeliosFamily",
    "HiDreamImageFamily",
    "HunyuanVideo15Family",
    "HunyuanImageFamily",
    "HunyuanVideoFamily",
    "IdsGridFamily",
    "Kandinsky5Family",
    "Kandinsky6Family",
    "KandinskyFamily",
    "Krea2Family",
    "LTX2Family",
    "LTXVideoFamily",
    "LatteFamily",
    "Layout",
    "LongCatImageFamily",
    "MiniMaxH3Family",
    "PixArtFamily",
    "QwenImage21Family",
    "QwenImageFamily",
    "Rotary",
    "SD3Family",
    "SVDFamily",
    "SkyReelsV2Family",
    "Span",
    "REFUSED",
    "SUPPORTED",
    "Stack",
    "UNetFamily",
    "ZImageFamily",
    "WanAnimateFamily",
    "WanFamily",
    "WanVACEFamily",
    "attention_levels",
    "class_default_processor",
    "family_of",
    "find_family",
    "grid_from_ids",
    "is_mergeable_attention",
    "mask_where",
    "max_downsample_for_levels",
    "spatial_transformer_blocks",
    "spatio_temporal_blocks",
]


#: Every supported family by name, in the order `find_family` tries them (the UNet family, which
#: matches any model with spatial transformer blocks, last). Adding a `Family` subclass here supports it.
FAMILIES: dict[str, type[Family]] = {
    cls.name: cls
    for cls in (
        PixArtFamily,
        SD3Family,
        FluxFamily,
        Flux2Family,
        ChromaFamily,
        QwenImageFamily,
        ZImageFamily,
        WanFamily,
        SkyReelsV2Family,
        WanVACEFamily,
        WanAnimateFamily,
        ChronoEditFamily,
        HeliosFamily,
        LTXVideoFamily,
        LTX2Family,
        HunyuanVideoFamily,
        HunyuanVideo15Family,
        Krea2Family,
        Flux3Family,
        LongCatImageFamily,
        QwenImage21Family,
        ErnieImageFamily,
        HunyuanImageFamily,
        HiDreamImageFamily,
        Kandinsky5Family,
        Kandinsky6Family,
        CosmosFamily,
        MiniMaxH3Family,
        AllegroFamily,
        EasyAnimateFamily,
        LatteFamily,
        SVDFamily,
        UNetFamily,
    )
}

#: The model classes ToMe supports, named in the errors and warnings for any other model.
SUPPORTED = "UNet2DConditionModel (or a model with BasicTransformerBlock in Transformer2DModel), " + ", ".join(
    (
        "PixArtTransformer2DModel",
        "SD3Transformer2DModel",
        "FluxTransformer2DModel",
        "Flux2Transformer2DModel",
        "ChromaTransformer2DModel",
        "QwenImageTransformer2DModel",
        "ZImageTransformer2DModel",
        "WanTransformer3DModel",
        "SkyReelsV2Transformer3DModel",
        "WanVACETransformer3DModel",
        "WanAnimateTransformer3DModel",
        "ChronoEditTransformer3DModel",
        "HeliosTransformer3DModel",
        "LTXVideoTransformer3DModel",
        "LTX2VideoTransformer3DModel",
        "HunyuanVideoTransformer3DModel",
        "HunyuanVideo15Transformer3DModel",
        "Krea2Transformer2DModel",
        "Flux3Transformer2DModel",
        "LongCatImageTransformer2DModel",
        "QwenImage21Transformer2DModel",
        "ErnieImageTransformer2DModel",
        "HunyuanImageTransformer2DModel",
        "HiDreamImageTransformer2DModel",
        "Kandinsky5Transformer3DModel",
        "Kandinsky6Transformer3DModel",
        "CosmosTransformer3DModel",
        "MiniMaxH3Transformer3DModel",
        "AllegroTransformer3DModel",
        "EasyAnimateTransformer3DModel",
        "LatteTransformer3DModel",
        "UNetSpatioTemporalConditionModel",
    )
)


#: Model classes ToMe refuses, each with why: `family_of` (and so `apply_tome`, `enable_tome`, `explain_tome`) raises
#: that instead of naming the supported families. No family matches them.
REFUSED: dict[type, str] = {**_KANDINSKY_REFUSED, **_VIDEO_MORE_REFUSED}


def find_family(model: torch.nn.Module) -> Family | None:
    """A fresh `Family` for `model`, or None when ToMe does not support it."""
    for cls in FAMILIES.values():
        family = cls()
        if family.matches(model):
            return family
    return None


def family_of(model: Any) -> Family:
    """The `Family` of `model`; a `ValueError` naming the model's class when it is not supported (saying why where
    ToMe refuses it: `REFUSED`)."""
    family = find_family(model) if isinstance(model, torch.nn.Module) else None
    if family is None:
        for refused, why in REFUSED.items():
            if isinstance(model, refused):
                raise ValueError(why)
        raise ValueError(f"Expected a supported model family ({SUPPORTED}), but got {type(model).__name__}.")
    return family
