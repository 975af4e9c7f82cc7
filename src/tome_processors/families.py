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
`PixArtTransformer2DModel`, `SD3Transformer2DModel` and `FluxTransformer2DModel`.

Example:
    >>> from tome_processors.families import family_of
    >>> family_of(pixart_transformer).name  # doctest: +SKIP
    'pixart'
"""

from __future__ import annotations

import enum
import warnings
import weakref
from dataclasses import dataclass
from typing import Any

import torch
from diffusers import FluxTransformer2DModel, PixArtTransformer2DModel, SD3Transformer2DModel
from diffusers.models.attention import BasicTransformerBlock
from diffusers.models.attention_processor import Attention
from diffusers.models.transformers.transformer_2d import Transformer2DModel

from ._similarity import is_compiling
from .arguments import argument

__all__ = [
    "FAMILIES",
    "AttentionSite",
    "BlockSite",
    "Family",
    "Layout",
    "family_of",
    "find_family",
    "max_downsample_for_levels",
]


class Layout(enum.Enum):
    """How an attention module receives the image tokens."""

    #: `hidden_states` are the image tokens; the output is one tensor of them.
    IMAGE = "image"
    #: `hidden_states` are the image tokens, the text comes as `encoder_hidden_states`, and the output
    #: is `(image, text, ...)` (SD3 `JointAttnProcessor2_0`, Flux double-stream blocks).
    JOINT = "joint"
    #: `hidden_states` are text tokens followed by image tokens, and so is the output (Flux
    #: single-stream blocks).
    TEXT_FIRST = "text_first"


@dataclass(frozen=True)
class AttentionSite:
    """An attention module to wrap: whether it is cross-attention and how its tokens are laid out."""

    module: torch.nn.Module
    is_cross: bool
    layout: Layout = Layout.IMAGE


@dataclass(frozen=True)
class BlockSite:
    """A block whose raw `hidden_states` input (image tokens) is the merge metric."""

    module: torch.nn.Module
    attentions: tuple[AttentionSite, ...]
    feed_forward: torch.nn.Module | None


def is_mergeable_attention(attn: Any) -> bool:
    # Residual/group-norm attention (the VAE's) works on 4-D maps with a residual added inside the
    # processor: merging there would add the residual to merged tokens.
    return (
        isinstance(attn, Attention)
        and not getattr(attn, "residual_connection", False)
        and getattr(attn, "group_norm", None) is None
        and getattr(attn, "spatial_norm", None) is None
    )


def spatial_transformer_blocks(model: torch.nn.Module) -> list[BasicTransformerBlock]:
    """The `BasicTransformerBlock`s that attend over image tokens, in module order.

    Only blocks inside a `Transformer2DModel` count: the same block class inside temporal
    transformers (AnimateDiff motion modules) attends over frames, and merging would mix them.
    """
    blocks: list[BasicTransformerBlock] = []
    for module in model.modules():
        if isinstance(module, Transformer2DModel):
            blocks.extend(b for b in module.transformer_blocks if isinstance(b, BasicTransformerBlock))
    return blocks


def attention_levels(model: torch.nn.Module) -> list[int]:
    """Downsample factors of the UNet levels whose down block has attention (e.g. [1, 2, 4] on SD1.5)."""
    down_blocks = getattr(model, "down_blocks", None)
    if down_blocks is None:
        return []
    return [2**i for i, block in enumerate(down_blocks) if len(getattr(block, "attentions", None) or []) > 0]


class Family:
    """What ToMe needs to know about one kind of model. Subclasses fill in the details.

    Attributes:
        name: short name (`"unet"`, `"pixart"`, `"sd3"`, `"flux"`).
        input_name / input_position: the model's input that the token grid is read from.
        timestep_position: where the model's `timestep` argument sits when passed by position.
        timestep_scale: multiplies the timestep onto the 0..1000 scale (Flux passes 0..1).
        merge_only: True where only `mode="merge"` works (joint attention computes its keys and
            values inside the processor from the same tokens as the queries, so K/V pooling cannot
            be passed in from outside).
        defaults: the family's default `ToMeConfig` fields (what `apply_tome(model)` uses).
        presets: `ToMeConfig` fields per preset name, applied over `defaults`.
        needs_row_token: True where positional encodings must follow merged rows (Flux's rotary
            embeddings), so every merge records `TokenMerge.row_token`.
    """

    name = "family"
    needs_row_token = False
    input_name = "hidden_states"
    input_position = 0
    timestep_position = 2
    timestep_scale = 1.0
    merge_only = False
    defaults: dict[str, Any] = {}
    presets: dict[str, dict[str, Any]] = {}

    def matches(self, model: torch.nn.Module) -> bool:
        raise NotImplementedError

    def blocks(self, model: torch.nn.Module) -> list[BlockSite]:
        raise NotImplementedError

    def auto_downsample(self, model: torch.nn.Module) -> int:
        """What `max_downsample="auto"` means: every transformer block works at the patch grid."""
        return 1

    def preset_options(self, name: str, model: torch.nn.Module | None = None) -> dict[str, Any]:
        """The `ToMeConfig` fields of preset `name` on `model` (or on the family's usual layout), defaults included.

        Example:
            >>> FAMILIES["sd3"]().preset_options("balanced")["share_level"]
            True
        """
        return {**self.defaults, **self.presets[name]}

    def token_grid(self, model: torch.nn.Module, args: tuple, kwargs: dict) -> tuple[int, int] | None:
        """`(h, w)` image tokens of this forward, or None when the call gives no grid."""
        patch = int(getattr(model.config, "patch_size", 1) or 1)
        x = argument(args, kwargs, self.input_position, self.input_name)
        if not isinstance(x, torch.Tensor) or x.ndim != 4:
            return None
        return int(x.shape[-2]) // patch, int(x.shape[-1]) // patch

    def timestep(self, args: tuple, kwargs: dict) -> object:
        """The timestep of this forward on the 0..1000 scale (tensor, number or None)."""
        t = argument(args, kwargs, self.timestep_position, "timestep")
        if t is None or self.timestep_scale == 1.0:
            return t
        return t * self.timestep_scale

    def check_config(self, model: torch.nn.Module, config: Any) -> None:
        """Raise a `ValueError` for options of `config` (a `ToMeConfig`) this family cannot honour.

        `config` is not typed as `ToMeConfig`: config.py builds configs from the families' tables, so
        this module does not import it.
        """
        if self.merge_only and config.mode != "merge":
            raise ValueError(
                f'Expected mode="merge" on {type(model).__name__} (its joint attention computes keys and values '
                f"from the same tokens as the queries), but got mode={config.mode!r}."
            )


def max_downsample_for_levels(first_level: int, levels: int) -> int:
    """The `max_downsample` that merges `levels` attention levels from the first (the model's `auto_downsample`).

    Example:
        >>> max_downsample_for_levels(1, 2), max_downsample_for_levels(2, 2)  # SD1.5, SDXL
        (2, 4)
    """
    return first_level * 2 ** (levels - 1)


class UNetFamily(Family):
    """UNets (SD1.x, SD2.x, SDXL) and any model with `BasicTransformerBlock`s in `Transformer2DModel`s."""

    name = "unet"
    input_name = "sample"
    timestep_position = 1
    defaults: dict[str, Any] = {}  # tomesd's defaults
    presets: dict[str, dict[str, Any]] = {
        "exact": {},
        "balanced": {"mode": "downsample_kv", "kv_pool": "nearest"},
        # The first two attention levels: max_downsample from the model's first level (preset_options).
        "fast": {"mode": "downsample_kv", "kv_pool": "nearest", "kv_factor": 4},
    }

    def preset_options(self, name: str, model: torch.nn.Module | None = None) -> dict[str, Any]:
        options = super().preset_options(name, model)
        if name == "fast":
            first_level = self.auto_downsample(model) if model is not None else 1
            options["max_downsample"] = max_downsample_for_levels(first_level, 2)
        return options

    def matches(self, model: torch.nn.Module) -> bool:
        return bool(spatial_transformer_blocks(model))

    def blocks(self, model: torch.nn.Module) -> list[BlockSite]:
        sites = []
        for block in spatial_transformer_blocks(model):
            attentions = tuple(
                AttentionSite(attn, is_cross)
                for attn, is_cross in ((block.attn1, block.only_cross_attention), (block.attn2, True))
                if attn is not None and is_mergeable_attention(attn)
            )
            sites.append(BlockSite(block, attentions, getattr(block, "ff", None)))
        return sites

    def auto_downsample(self, model: torch.nn.Module) -> int:
        levels = attention_levels(model)
        return min(levels) if levels else 1

    def token_grid(self, model: torch.nn.Module, args: tuple, kwargs: dict) -> tuple[int, int] | None:
        sample = argument(args, kwargs, 0, "sample")
        if not isinstance(sample, torch.Tensor) or sample.ndim < 4:
            return None
        return int(sample.shape[-2]), int(sample.shape[-1])


#: PixArt's and SD3's presets. Measured on the trained DiT (docs/options.md): merging the feed-forward too
#: (`merge_mlp`) costs 2.5x ToMe's change at 0.5 already at ratio 0.3, so the presets share one matching per
#: forward instead.
_DIT_PRESETS: dict[str, dict[str, Any]] = {
    "exact": {},
    "balanced": {"ratio": 0.4, "share_level": True},
    "fast": {"ratio": 0.7, "share_level": True},
}


class PixArtFamily(Family):
    """`PixArtTransformer2DModel`: `BasicTransformerBlock`s (ada_norm_single) over the patch grid."""

    name = "pixart"
    timestep_position = 2
    defaults: dict[str, Any] = {"ratio": 0.4}
    presets = _DIT_PRESETS

    def matches(self, model: torch.nn.Module) -> bool:
        return isinstance(model, PixArtTransformer2DModel)

    def blocks(self, model: torch.nn.Module) -> list[BlockSite]:
        sites = []
        for block in model.transformer_blocks:
            attentions = [AttentionSite(block.attn1, bool(block.only_cross_attention))]
            if block.attn2 is not None:
                attentions.append(AttentionSite(block.attn2, True))
            sites.append(BlockSite(block, tuple(attentions), getattr(block, "ff", None)))
        return sites


class SD3Family(Family):
    """`SD3Transformer2DModel`: `JointTransformerBlock`s; the text stream is never merged."""

    name = "sd3"
    timestep_position = 3
    merge_only = True
    defaults: dict[str, Any] = {"ratio": 0.4}
    presets = _DIT_PRESETS

    def matches(self, model: torch.nn.Module) -> bool:
        return isinstance(model, SD3Transformer2DModel)

    def blocks(self, model: torch.nn.Module) -> list[BlockSite]:
        sites = []
        for block in model.transformer_blocks:
            attentions = [AttentionSite(block.attn, False, Layout.JOINT)]
            if getattr(block, "attn2", None) is not None:  # SD3.5 dual attention: image tokens only
                attentions.append(AttentionSite(block.attn2, False, Layout.IMAGE))
            sites.append(BlockSite(block, tuple(attentions), block.ff))
        return sites


class FluxFamily(Family):
    """`FluxTransformer2DModel`: double-stream (joint) then single-stream (text first) blocks.

    The model gets packed tokens `(B, N, C)`, so the grid comes from `img_ids` (rows in column 1,
    columns in column 2, row-major from 0, as the Flux pipelines build them). Inputs whose `img_ids`
    are not one such grid (e.g. Kontext's appended reference image) are not merged.
    """

    name = "flux"
    needs_row_token = True
    timestep_position = 3
    timestep_scale = 1000.0  # the Flux pipelines pass sigma (0..1) as the timestep
    merge_only = True
    defaults: dict[str, Any] = {"ratio": 0.3}
    presets: dict[str, dict[str, Any]] = {
        "exact": {},
        # Lower ratios than PixArt's and SD3's: a merged row also loses its tokens' rotary positions.
        "balanced": {"share_level": True},
        "fast": {"ratio": 0.5, "share_level": True},
    }

    def __init__(self) -> None:
        self._last: tuple[weakref.ref, object, int, tuple[int, int] | None] | None = None
        self._warned = False

    def matches(self, model: torch.nn.Module) -> bool:
        return isinstance(model, FluxTransformer2DModel)

    def blocks(self, model: torch.nn.Module) -> list[BlockSite]:
        sites = [BlockSite(b, (AttentionSite(b.attn, False, Layout.JOINT),), b.ff) for b in model.transformer_blocks]
        sites += [
            BlockSite(b, (AttentionSite(b.attn, False, Layout.TEXT_FIRST),), None)
            for b in model.single_transformer_blocks
        ]
        return sites

    def token_grid(self, model: torch.nn.Module, args: tuple, kwargs: dict) -> tuple[int, int] | None:
        x = argument(args, kwargs, 0, "hidden_states")
        ids = argument(args, kwargs, 4, "img_ids")
        if not isinstance(x, torch.Tensor) or x.ndim != 3 or not isinstance(ids, torch.Tensor):
            return None
        given = ids  # the object the pipeline passes every step (a 3-D one is sliced below)
        last = self._last
        if is_compiling():  # reading ids is a host sync torch.compile cannot trace: the grid an eager call read
            return last[3] if last is not None and last[2] == x.shape[1] else None
        # Pipelines pass the same img_ids every step: read them once. A version counter tells an in-place
        # change; inference tensors have none, so there the storage and shape stand for it.
        version = (-1, given.data_ptr(), tuple(given.shape)) if given.is_inference() else given._version
        if last is not None and last[0]() is given and last[1:3] == (version, x.shape[1]):
            return last[3]
        if ids.ndim == 3:
            ids = ids[0]
        grid = grid_from_ids(ids, int(x.shape[1]))
        self._last = (weakref.ref(given), version, int(x.shape[1]), grid)
        if grid is None and not self._warned:
            self._warned = True
            warnings.warn(
                f"ToMe merges nothing in this {type(model).__name__} call: expected img_ids numbering the rows and "
                f"columns of one row-major grid of the {int(x.shape[1])} image tokens, but got img_ids of shape "
                f"{tuple(ids.shape)} that do not.",
                UserWarning,
                stacklevel=2,
            )
        return grid


def grid_from_ids(ids: torch.Tensor, num_tokens: int) -> tuple[int, int] | None:
    """`(h, w)` when `ids[:, 1]` / `ids[:, 2]` number the rows / columns of a row-major grid of `num_tokens`.

    Example:
        >>> ids = torch.zeros(2, 3, 3)
        >>> ids[..., 1] = torch.arange(2)[:, None]
        >>> ids[..., 2] = torch.arange(3)[None]
        >>> grid_from_ids(ids.view(6, 3), 6)
        (2, 3)
        >>> grid_from_ids(ids.view(6, 3).flip(0), 6) is None
        True
    """
    if ids.ndim != 2 or ids.shape[0] != num_tokens or ids.shape[1] < 3 or num_tokens == 0:
        return None
    rows, cols = ids[:, 1].round().long(), ids[:, 2].round().long()
    h, w = int(rows.max()) + 1, int(cols.max()) + 1
    if h * w != num_tokens:
        return None
    expected = torch.arange(num_tokens, device=ids.device)
    return (h, w) if torch.equal(rows * w + cols, expected) else None


#: Every supported family by name, in the order `find_family` tries them (the UNet family, which
#: matches any model with spatial transformer blocks, last). Adding a `Family` subclass here supports it.
FAMILIES: dict[str, type[Family]] = {cls.name: cls for cls in (PixArtFamily, SD3Family, FluxFamily, UNetFamily)}

#: Diffusion transformers that ToMe does not know, named in the error so users see why.
_SUPPORTED = "UNet2DConditionModel (or a model with BasicTransformerBlock in Transformer2DModel), " + ", ".join(
    ("PixArtTransformer2DModel", "SD3Transformer2DModel", "FluxTransformer2DModel")
)


def find_family(model: torch.nn.Module) -> Family | None:
    """A fresh `Family` for `model`, or None when ToMe does not support it."""
    for cls in FAMILIES.values():
        family = cls()
        if family.matches(model):
            return family
    return None


def family_of(model: Any) -> Family:
    """The `Family` of `model`; a `ValueError` naming the model's class when it is not supported."""
    family = find_family(model) if isinstance(model, torch.nn.Module) else None
    if family is None:
        raise ValueError(f"Expected a supported model family ({_SUPPORTED}), but got {type(model).__name__}.")
    return family
