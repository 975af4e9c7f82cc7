"""What every model family declares: the `Family` base class, the token layouts and the block sites."""

from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import Any

import torch
from diffusers.models.attention_processor import Attention

from ..arguments import argument


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
    #: `hidden_states` are the image tokens, and `rotary_emb` holds `(cos, sin)` tables of shape
    #: `(1, N, 1, D)`, one row per token (Wan's 3-D rotary embeddings); the output is one tensor.
    ROTARY = "rotary"


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
        video: True where the token grid has frames (`token_grid` gives `(frames, h, w)`), so windows
            may span frames (`ToMeConfig.st`).
    """

    name = "family"
    needs_row_token = False
    video = False
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
            >>> from tome_processors.families import FAMILIES
            >>> FAMILIES["sd3"]().preset_options("balanced")["share_level"]
            True
        """
        return {**self.defaults, **self.presets[name]}

    def token_grid(self, model: torch.nn.Module, args: tuple, kwargs: dict) -> tuple[int, ...] | None:
        """`(h, w)` image tokens of this forward (`(frames, h, w)` on a video family), or None when the call gives
        no grid."""
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
        if not self.video and getattr(config, "st", 1) != 1:
            raise ValueError(
                f"Expected st=1 on {type(model).__name__} (an image model: its tokens have no frames), but got "
                f"st={config.st}."
            )
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
