"""What every model family declares: the `Family` base class, the token layouts and the block sites."""

from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from diffusers.models.attention import AttentionModuleMixin
from diffusers.models.attention_processor import Attention, AttnProcessor, AttnProcessor2_0

from .._similarity import is_compiling
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


@dataclass(frozen=True)
class AttentionSite:
    """An attention module to wrap: whether it is cross-attention and how its tokens are laid out.

    `built_with` is the processor class the model builds this module with, where that is not its
    class's default (`class_default_processor`): SD3 builds its `Attention` modules with
    `JointAttnProcessor2_0`. A `ToMeProcessor()` made without an inner processor runs that one.
    """

    module: torch.nn.Module
    is_cross: bool
    layout: Layout = Layout.IMAGE
    built_with: type | None = None


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


def class_default_processor(attn: torch.nn.Module) -> type | None:
    """The processor class `attn`'s class builds it with by default, or None where the class alone cannot tell.

    `Attention` builds `AttnProcessor2_0` (`AttnProcessor` without `scale_qk`), but models build its
    joint and added-K/V variants with processors of their own; the newer attention classes
    (`FluxAttention`, ...) name theirs in `_default_processor_cls`.

    Example:
        >>> from diffusers.models.attention_processor import Attention
        >>> class_default_processor(Attention(query_dim=8)).__name__
        'AttnProcessor2_0'
        >>> class_default_processor(Attention(query_dim=8, added_kv_proj_dim=8)) is None
        True
    """
    if isinstance(attn, Attention):
        if getattr(attn, "added_kv_proj_dim", None) is not None or getattr(attn, "context_pre_only", None) is not None:
            return None  # joint or added-K/V attention: each model builds it with a processor of its choosing
        sdpa = hasattr(F, "scaled_dot_product_attention") and getattr(attn, "scale_qk", True)
        return AttnProcessor2_0 if sdpa else AttnProcessor
    default = getattr(type(attn), "_default_processor_cls", None)
    return default if isinstance(attn, AttentionModuleMixin) and isinstance(default, type) else None


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

    def built_processor(self, model: torch.nn.Module, attn: torch.nn.Module) -> type | None:
        """The processor class `model` builds its attention module `attn` with, or None where unknown.

        A block site's `built_with`, else the class's default (`class_default_processor`). A family whose
        models build attention with another processor declares it on its sites (tests/test_default_inner.py
        checks every family against freshly built models).
        """
        for site in self.blocks(model):
            for attention in site.attentions:
                if attention.module is attn and attention.built_with is not None:
                    return attention.built_with
        return class_default_processor(attn)

    def preset_options(self, name: str, model: torch.nn.Module | None = None) -> dict[str, Any]:
        """The `ToMeConfig` fields of preset `name` on `model` (or on the family's usual layout), defaults included.

        Example:
            >>> from tome_processors.families import FAMILIES
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

    def generation_marker(self, args: tuple, kwargs: dict) -> torch.Tensor | None:
        """A tensor of this forward whose storage is one for every forward of a generation and new in the next,
        or None where the call tells nothing.

        Pipelines call the model with views of `scheduler.timesteps` (`for t in timesteps`, `t.expand(batch)`,
        img2img's `timesteps[t_start:]`) and every `scheduler.set_timesteps` makes a new tensor, so the
        schedule the timestep views marks the generation. A timestep that views no schedule (a tensor made
        for the call, a number) tells nothing. Only host metadata is read; nothing under `torch.compile`.

        Example:
            >>> from tome_processors.families import FAMILIES
            >>> schedule = torch.tensor([999.0, 500.0, 1.0])
            >>> unet = FAMILIES["unet"]()
            >>> unet.generation_marker((None, next(iter(schedule))), {}) is not None
            True
            >>> unet.generation_marker((None, torch.tensor(500.0)), {}) is None
            True
        """
        if is_compiling():
            return None
        timestep = argument(args, kwargs, self.timestep_position, "timestep")
        return timestep if views_a_schedule(timestep) else None

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


def views_a_schedule(timestep: object) -> bool:
    """Whether `timestep` is a view of a 1-D tensor of several timesteps (host metadata only).

    Example:
        >>> schedule = torch.tensor([999.0, 500.0, 1.0])
        >>> views_a_schedule(schedule[2]), views_a_schedule(schedule[1].expand(2)), views_a_schedule(torch.tensor(1.0))
        (True, True, False)
    """
    if not isinstance(timestep, torch.Tensor) or timestep.numel() == 0:
        return False
    base = timestep._base
    if base is not None:
        return base.ndim == 1
    # Inference tensors keep no `_base`: a tensor that spans less than its storage is a view of more.
    span = 1 + sum((size - 1) * stride for size, stride in zip(timestep.shape, timestep.stride(), strict=True))
    return timestep.untyped_storage().nbytes() > span * timestep.element_size()


def max_downsample_for_levels(first_level: int, levels: int) -> int:
    """The `max_downsample` that merges `levels` attention levels from the first (the model's `auto_downsample`).

    Example:
        >>> max_downsample_for_levels(1, 2), max_downsample_for_levels(2, 2)  # SD1.5, SDXL
        (2, 4)
    """
    return first_level * 2 ** (levels - 1)
