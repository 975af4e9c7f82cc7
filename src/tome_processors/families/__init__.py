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

The families: UNets (any model with `BasicTransformerBlock`s inside `Transformer2DModel`s), Stable Video
Diffusion's spatial blocks, and the image and video transformers of `FAMILIES`; the classes ToMe refuses, each with
why, in `REFUSED`. `coverage.coverage()` lists every image and video transformer diffusers ships with its family or
reason (docs/families.md carries the table), and `register_family` adds a family of your own.

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
    is_attention_module,
    is_mergeable_attention,
    mask_where,
    max_downsample_for_levels,
    set_processor,
)
from .chroma import ChromaFamily, Flux2Family
from .cog import CogVideoXFamily, CogView3PlusFamily, CogView4Family, ConsisIDFamily
from .dit import PixArtFamily, SD3Family
from .edit_more import REFUSED as _EDIT_MORE_REFUSED
from .edit_more import (
    AnyFlowFamily,
    DreamLiteFamily,
    JoyImageEditFamily,
    JoyImageEditPlusFamily,
    MotifVideoFamily,
    OmniGenFamily,
)
from .flux import FluxFamily, IdsGridFamily, grid_from_ids
from .fluxlike import Flux3Family, Krea2Family, LongCatImageFamily
from .hunyuanvideo import HunyuanVideo15Family, HunyuanVideoFamily
from .hyimage_hidream import HiDreamImageFamily, HunyuanImageFamily
from .image_more import (
    BriaFamily,
    BriaFibo2Family,
    BriaFiboFamily,
    GlmImageFamily,
    Ideogram4Family,
    NucleusMoEImageFamily,
    OvisImageFamily,
    PRXFamily,
)
from .kandinsky import REFUSED as _KANDINSKY_REFUSED
from .kandinsky import Kandinsky5Family, Kandinsky6Family, KandinskyFamily
from .ltx import LTXVideoFamily
from .ltx2 import LTX2Family
from .lumina_dit import (
    AuraFlowFamily,
    DiTFamily,
    HunyuanDiTFamily,
    HunyuanVideoFramepackFamily,
    Lumina2Family,
    LuminaNextFamily,
)
from .qwen_ernie import ErnieImageFamily, QwenImage21Family
from .qwenimage import QwenImageFamily
from .sana import REFUSED as _SANA_REFUSED
from .sana import SanaFamily, SanaVideoFamily
from .svd import SVDFamily, spatio_temporal_blocks
from .unet import UNetFamily, attention_levels, spatial_transformer_blocks
from .video_more import REFUSED as _VIDEO_MORE_REFUSED
from .video_more import AllegroFamily, CosmosFamily, EasyAnimateFamily, LatteFamily, MiniMaxH3Family, MochiFamily
from .wan import SkyReelsV2Family, WanFamily, WanVACEFamily
from .wan_derived import REFUSED as _WAN_DERIVED_REFUSED
from .wan_derived import ChronoEditFamily, HeliosFamily, WanAnimateFamily
from .zimage import ZImageFamily

__all__ = [
    "FAMILIES",
    "AttentionSite",
    "BlockSite",
    "ChromaFamily",
    "ChronoEditFamily",
    "CogVideoXFamily",
    "CogView3PlusFamily",
    "CogView4Family",
    "ConsisIDFamily",
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
    "Layout",
    "LongCatImageFamily",
    "PixArtFamily",
    "QwenImage21Family",
    "QwenImageFamily",
    "Rotary",
    "SD3Family",
    "SVDFamily",
    "SkyReelsV2Family",
    "Span",
    "REFUSED",
    "REGISTERED",
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
    "register_family",
    "set_processor",
    "unregister_family",
    "why_no_family",
    "grid_from_ids",
    "is_attention_module",
    "is_mergeable_attention",
    "mask_where",
    "max_downsample_for_levels",
    "spatial_transformer_blocks",
    "spatio_temporal_blocks",
    "SanaFamily",
    "SanaVideoFamily",
    "AnyFlowFamily",
    "DreamLiteFamily",
    "JoyImageEditFamily",
    "JoyImageEditPlusFamily",
    "MotifVideoFamily",
    "OmniGenFamily",
    "AuraFlowFamily",
    "DiTFamily",
    "HunyuanDiTFamily",
    "HunyuanVideoFramepackFamily",
    "Lumina2Family",
    "LuminaNextFamily",
    "BriaFamily",
    "BriaFibo2Family",
    "BriaFiboFamily",
    "GlmImageFamily",
    "Ideogram4Family",
    "NucleusMoEImageFamily",
    "OvisImageFamily",
    "PRXFamily",
    "AllegroFamily",
    "CosmosFamily",
    "EasyAnimateFamily",
    "LatteFamily",
    "MiniMaxH3Family",
    "MochiFamily",
]


#: The library's own families by name (the UNet family, which matches any model with spatial transformer blocks,
#: last). Adding a `Family` subclass here supports it.
_OWN: dict[str, type[Family]] = {
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
        CogVideoXFamily,
        ConsisIDFamily,
        CogView3PlusFamily,
        CogView4Family,
        SanaFamily,
        SanaVideoFamily,
        JoyImageEditFamily,
        JoyImageEditPlusFamily,
        OmniGenFamily,
        MotifVideoFamily,
        AnyFlowFamily,
        DreamLiteFamily,
        Lumina2Family,
        LuminaNextFamily,
        AuraFlowFamily,
        DiTFamily,
        HunyuanDiTFamily,
        HunyuanVideoFramepackFamily,
        BriaFamily,
        BriaFiboFamily,
        BriaFibo2Family,
        GlmImageFamily,
        Ideogram4Family,
        NucleusMoEImageFamily,
        PRXFamily,
        OvisImageFamily,
        CosmosFamily,
        MiniMaxH3Family,
        AllegroFamily,
        EasyAnimateFamily,
        LatteFamily,
        MochiFamily,
        SVDFamily,
        UNetFamily,
    )
}
#: Every declared family by name, in the order `find_family` tries them: the ones registered with
#: `register_family` first, then the library's own (the UNet family, which matches any model with spatial
#: transformer blocks, last).
FAMILIES: dict[str, type[Family]] = dict(_OWN)

#: Model classes ToMe refuses, each with why: `family_of` (and so `apply_tome`, `enable_tome`, `explain_tome`) raises
#: that instead of naming the supported families. No family matches them.
REFUSED: dict[type, str] = {
    **_KANDINSKY_REFUSED,
    **_WAN_DERIVED_REFUSED,
    **_SANA_REFUSED,
    **_EDIT_MORE_REFUSED,
    **_VIDEO_MORE_REFUSED,
}


#: Families declared with `register_family`, by name: `find_family` tries them before the library's own.
REGISTERED: dict[str, type[Family]] = {}

#: Where a refused model's error and a model of no family's error send the user.
FAMILIES_PAGE = "docs/families.md"


def register_family(family: type[Family], *, replace: bool = False) -> type[Family]:
    """Declare a family of your own: ToMe then merges in its models (`apply_tome`, `enable_tome`,
    `set_attn_processor(ToMeProcessor(...))`), tried before the library's families. Usable as a decorator.

    The family must name itself (`name`), say which models it matches (`model_class`, or its own `matches`) and
    where their blocks are (`stacks`, or its own `blocks`); see docs/families.md, "A family of your own".

    Args:
        family: a `Family` subclass.
        replace: replace a registered family of the same name (the library's own cannot be replaced; declare
            yours under another name, it is tried first).

    Raises:
        TypeError / ValueError: for a family that is not a `Family` subclass, or lacks a name, a way to match its
            models or its blocks, or whose name is taken; nothing is registered then.

    Example:
        >>> from diffusers import PixArtTransformer2DModel
        >>> class MyPixArt(Family):
        ...     name = "my_pixart"
        ...     model_class = PixArtTransformer2DModel
        ...     stacks = (Stack("transformer_blocks", Layout.IMAGE, attention="attn1"),)
        >>> register_family(MyPixArt) is MyPixArt, "my_pixart" in FAMILIES
        (True, True)
        >>> unregister_family("my_pixart")
    """
    if not (isinstance(family, type) and issubclass(family, Family)):
        raise TypeError(f"Expected a Family subclass, but got {family!r}.")
    name = family.name
    if not isinstance(name, str) or not name or name == Family.name:
        raise ValueError(f'Expected a family with a name of its own (`name = "my_model"`), but got {name!r}.')
    if family.model_class is None and family.matches is Family.matches:
        raise ValueError(f"Expected family {name!r} to say which models it matches (`model_class`, or `matches`).")
    if not family.stacks and family.blocks is Family.blocks:
        raise ValueError(f"Expected family {name!r} to say where its blocks are (`stacks`, or `blocks`).")
    if name in FAMILIES and not (replace and name in REGISTERED):
        raise ValueError(
            f"Expected a family name not taken, but got {name!r}, which "
            + ("is registered already: pass replace=True." if name in REGISTERED else "is the library's own.")
        )
    REGISTERED[name] = family
    FAMILIES.clear()
    FAMILIES.update({**REGISTERED, **_OWN})
    return family


def unregister_family(name: str) -> None:
    """Forget a family declared with `register_family` (its models are then matched as before it).

    Raises:
        ValueError: for a name no `register_family` call declared.
    """
    if name not in REGISTERED:
        raise ValueError(f"Expected the name of a family declared with register_family, but got {name!r}.")
    del REGISTERED[name]
    FAMILIES.clear()
    FAMILIES.update({**REGISTERED, **_OWN})


def find_family(model: torch.nn.Module) -> Family | None:
    """A fresh `Family` for `model` (a registered one first), or None when none is declared for it."""
    for cls in FAMILIES.values():
        family = cls()
        if family.matches(model):
            return family
    return None


def why_no_family(model: Any) -> str:
    """Why ToMe merges nothing in `model`, of no declared family: the reason ToMe refuses its class (`REFUSED`), or
    that no family is declared for it; and where to read more (docs/families.md).

    Example:
        >>> why_no_family(torch.nn.Linear(1, 1))[:60]
        'Expected a model of a declared family, but got Linear, for w'
    """
    for refused, why in REFUSED.items():
        if isinstance(model, refused):
            return f"{why} ({FAMILIES_PAGE} lists every diffusers model ToMe merges in, and why not.)"
    return (
        f"Expected a model of a declared family, but got {type(model).__name__}, for which none is declared. "
        f"{FAMILIES_PAGE} lists every diffusers model ToMe merges in (and why not, for the others), and shows how to "
        "declare a family of your own in about 15 lines (register_family, or apply_tome(model, family=...))."
    )


def family_of(model: Any) -> Family:
    """The `Family` of `model`; a `ValueError` that says why where there is none (`why_no_family`)."""
    family = find_family(model) if isinstance(model, torch.nn.Module) else None
    if family is None:
        raise ValueError(why_no_family(model))
    return family
