"""What every model family declares: the `Family` base class, the token layouts and the block sites."""

from __future__ import annotations

import enum
import operator
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from diffusers.models.attention import AttentionModuleMixin
from diffusers.models.attention_processor import Attention, AttnProcessor, AttnProcessor2_0, MochiAttention

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
    #: `hidden_states` are image tokens followed by others (padding, text), and so is the output
    #: (Z-Image's unified sequence).
    IMAGE_FIRST = "image_first"
    #: As `JOINT` (image tokens as `hidden_states`, text as `encoder_hidden_states`, output `(image, text)`),
    #: but the processor attends over the image tokens then the text, so an attention mask (and rotary
    #: tables that cover the text) over the whole sequence open with the image (HunyuanVideo's blocks).
    JOINT_IMAGE_FIRST = "joint_image_first"
    #: As `JOINT_IMAGE_FIRST`, but `hidden_states` open with other tokens ahead of the grid's (FramePack's history
    #: latents), each passed as a row of its own (as `TEXT_FIRST` passes the text): the processor attends over those,
    #: the grid's, then the text. The block's span is `Span.TRAILING`.
    JOINT_IMAGE_FIRST_HISTORY = "joint_image_first_history"
    #: `hidden_states` are the image tokens, and `rotary_emb` holds `(cos, sin)` tables of shape
    #: `(1, N, 1, D)`, one row per token (Wan's 3-D rotary embeddings), or as the family's `Rotary` says (one
    #: tensor of rotations with `pair=False`: Kandinsky's); the output is one tensor.
    ROTARY = "rotary"


class Span(enum.Enum):
    """Where the image grid's tokens sit in a block's `hidden_states` input (the merge metric)."""

    #: The input is the grid's tokens and nothing else.
    WHOLE = "whole"
    #: The grid's tokens come first; others follow (Qwen-Image-Edit's reference image, Z-Image's text).
    LEADING = "leading"
    #: Other tokens (the text) come first; the grid's tokens close the input (FLUX.2's and Chroma's
    #: single-stream blocks, which get text and image already concatenated), or are followed by the
    #: model's tail only (`ModelState.tail`: FLUX.2's reference images).
    TRAILING = "trailing"


@dataclass(frozen=True)
class Rotary:
    """How a family's attention processors receive rotary positions, so merged rows can keep theirs.

    Attributes:
        name / position: the processor's keyword, and its position after `hidden_states`.
        covers_text: True where the tables cover the attention's whole sequence, text included (FLUX:
            `(cos, sin)` over text then image tokens); False where the first table covers the image
            tokens alone and any others are left as they are (Qwen-Image: `(image, text)`).
        batched: True where the tables carry a batch axis, `(B, S, ...)` (Z-Image), or `(1, S, ...)` for the whole
            batch (Helios's pipeline); else `(S, ...)` for the whole batch.
        text_table: with `covers_text=False`, True where the tables after the first are the other tokens'
            own, left as they are (Qwen-Image's `(image, text)`); False where every table covers the image
            tokens alone and all follow the merged rows (HunyuanVideo's `(cos, sin)`, each `(N_image, D)`).
        pair: True where the processor gets a `(cos, sin)` pair of tables; False where it gets one tensor whose
            rows (after the batch axis, with `batched`) are the tokens' rotations, whatever follows them
            (Kandinsky's 2x2 rotation matrices, `(N, 1, D/2, 2, 2)` or `(B, N, 1, D/2, 2, 2)`). `Layout.ROTARY`
            only.
        key_name / key_position: where the processor takes the keys' rotation as an argument of its own
            (Kandinsky 6's `rotary_emb_kv`, Lumina-Next's `key_rotary_emb`), or None. In a merged self-attention the
            keys are the merged rows too, so that table follows them as the queries' does. `Layout.ROTARY` with
            `pair=False`, and the layouts of joint_attention.py where the keys' table is the very queries' table
            (Lumina-Next passes one table as both; a table of its own there leaves the attention unmerged).
        nested: True where the processor gets `(image, text)`, each a `(cos, sin)` pair (the text's may be None),
            the image's over the image tokens alone (JoyImage-Edit's `(vis_freqs, txt_freqs)`): the image's pair
            follows the merged rows, the text's is left as it is. Joint layouts only.
        entries: where the processor gets its tables as a dict, the keys of those that follow the merged rows, each
            gathered alike (AnyFlow's `{"query": ..., "key": ...}`, one tensor twice: gathered once); empty where it
            gets tensors. `Layout.ROTARY` with `pair=False` only.
        heads_axis: True where each table is `(1, 1, N, ...)`, a batch and a heads axis ahead of the tokens', for
            the whole batch (AnyFlow's complex `(1, 1, N, D/2)`): gathered, `(B, 1, M, ...)`. `Layout.ROTARY` with
            `pair=False` only.
        sequence_dim: with `batched`, the tables' token axis: 1 for `(B, S, ...)`; 2 where a head axis comes
            first, `(B, 1, S, ...)` (PRX's one tensor of 2x2 rotations, `(B, 1, N, D/2, 2, 2)`). Joint layouts
            only.
        indexed: True where the processor gets `(tables, indices)`: rotary tables per axis and, per axis, each
            token's row in them, `(1, N)` or `(N,)` (Allegro's `((t, h, w) tables, (t, h, w) positions)`). The
            tables stay as they are and the indices follow the merged rows, `(B, M)`. `Layout.ROTARY` only.
    """

    name: str = "image_rotary_emb"
    position: int = 2
    covers_text: bool = True
    batched: bool = False
    text_table: bool = True
    pair: bool = True
    key_name: str | None = None
    key_position: int = 3
    nested: bool = False
    entries: tuple[str, ...] = ()
    heads_axis: bool = False
    sequence_dim: int = 1
    indexed: bool = False


@dataclass(frozen=True)
class AttentionSite:
    """An attention module to wrap: whether it is cross-attention and how its tokens are laid out.

    `built_with` is the processor class the model builds this module with, where that is not its
    class's default (`class_default_processor`): SD3 builds its `Attention` modules with
    `JointAttnProcessor2_0`. A `ToMeProcessor()` made without an inner processor runs that one.
    `mask_at` / `rotary_at`: where its module passes the attention mask and the rotary tables to the
    processor, as positions after `hidden_states` when passed positionally (`rotary_at` None: the
    family's `Rotary.position`). FLUX.2's single-stream attention passes `(mask, rotary)`, not
    `(text, mask, rotary)`. A processor that names its mask other than `attention_mask` is declared with
    `mask_at=(position, keyword)` (HiDream's `hidden_states_masks`; `mask_where`).
    """

    module: torch.nn.Module
    is_cross: bool
    layout: Layout = Layout.IMAGE
    built_with: type | None = None
    mask_at: int | tuple[int, str] = 1
    rotary_at: int | None = None


@dataclass(frozen=True)
class BlockSite:
    """A block whose raw `hidden_states` input (image tokens, where `span` says) is the merge metric.

    `sequence_first`: the block's input is `(S, B, C)`, sequence first (ERNIE-Image's blocks; their attention
    module still gets `(B, S, C)`); the metric is its `(B, S, C)` view. Such a site declares where the grid's
    tokens sit (`span` other than `WHOLE`, which takes the input as it comes).
    """

    module: torch.nn.Module
    attentions: tuple[AttentionSite, ...]
    feed_forward: torch.nn.Module | None
    span: Span = Span.WHOLE
    sequence_first: bool = False

    def __post_init__(self) -> None:
        if self.sequence_first and self.span is Span.WHOLE:
            raise ValueError("Expected a span other than Span.WHOLE on a sequence-first block, but got Span.WHOLE.")

    def metric(
        self, hidden_states: torch.Tensor, grid_tokens: int, tail: int = 0, sharded: bool = False
    ) -> torch.Tensor:
        """The grid's `grid_tokens` tokens (every frame's) of the block input `hidden_states` `(B, S, C)` (a view).

        `tail`: tokens after the grid's in a `Span.TRAILING` input (`ModelState.tail`: FLUX.2's reference
        images, which follow the text and the generated image's tokens). `sharded`: the forward runs under
        context parallelism, `grid_tokens` being this rank's run (a site whose input splits otherwise can say so).

        Example:
            >>> site = BlockSite(torch.nn.Identity(), (), None, Span.TRAILING)
            >>> site.metric(torch.arange(5.0).view(1, 5, 1), 3).flatten().tolist()
            [2.0, 3.0, 4.0]
            >>> site.metric(torch.arange(5.0).view(1, 5, 1), 2, tail=1).flatten().tolist()
            [2.0, 3.0]
            >>> first = BlockSite(torch.nn.Identity(), (), None, Span.LEADING, sequence_first=True)
            >>> first.metric(torch.arange(10.0).view(5, 2, 1), 3)[1].flatten().tolist()  # (S=5, B=2) -> sample 1
            [1.0, 3.0, 5.0]
        """
        if self.sequence_first and hidden_states.ndim == 3:
            hidden_states = hidden_states.transpose(0, 1)
        if self.span is Span.WHOLE or hidden_states.ndim != 3 or hidden_states.shape[1] <= grid_tokens:
            return hidden_states
        if self.span is Span.LEADING:
            return hidden_states[:, :grid_tokens]
        end = hidden_states.shape[1] - tail
        return hidden_states[:, end - grid_tokens : end]


@dataclass(frozen=True)
class Stack:
    """One list of blocks of a model, declared: where it is and how its attention lays out the tokens.

    Attributes:
        blocks: the model's attribute that holds the blocks (an `nn.ModuleList`); a dotted path reaches into
            submodules (`"mode_blocks.image"`: FLUX.3's image blocks, in an `nn.ModuleDict`).
        layout: how the blocks' attention receives the image tokens (`Layout`).
        attention: the block's attribute that holds the attention module; a dotted path where the list holds
            wrappers around the blocks (HiDream's `"block.attn1"`).
        feed_forward: the block's feed-forward attribute (merged with `merge_mlp`; dotted as `attention`), or None.
        span: where the grid's tokens sit in the block's input (`Span`).
        mask_at / rotary_at / built_with: see `AttentionSite`.
        sequence_first: the blocks get `(S, B, C)` inputs (see `BlockSite`).
    """

    blocks: str
    layout: Layout
    attention: str = "attn"
    feed_forward: str | None = None
    span: Span = Span.WHOLE
    mask_at: int | tuple[int, str] = 1
    rotary_at: int | None = None
    built_with: type | None = None
    sequence_first: bool = False

    def sites(self, model: torch.nn.Module) -> list[BlockSite]:
        """A `BlockSite` for every block of this stack in `model` (none where the model has no such list)."""
        sites = []
        blocks: Any = model
        for part in self.blocks.split("."):
            blocks = getattr(blocks, part, None)
        for block in blocks or ():
            attention = AttentionSite(
                operator.attrgetter(self.attention)(block),
                False,
                self.layout,
                self.built_with,
                mask_at=self.mask_at,
                rotary_at=self.rotary_at,
            )
            ff = _attribute(block, self.feed_forward) if self.feed_forward else None
            sites.append(BlockSite(block, (attention,), ff, self.span, self.sequence_first))
        return sites


def _attribute(module: torch.nn.Module, path: str) -> Any:
    """`module`'s attribute at the dotted `path`, or None where a step is missing."""
    for name in path.split("."):
        module = getattr(module, name, None)
    return module


def mask_where(mask_at: int | tuple[int, str]) -> tuple[int, str]:
    """`(position after hidden_states, keyword)` of the attention mask a processor gets, from a site's `mask_at`
    (`AttentionSite`): a position alone means the keyword `attention_mask`.

    Example:
        >>> mask_where(1), mask_where((0, "hidden_states_masks"))
        ((1, 'attention_mask'), (0, 'hidden_states_masks'))
    """
    return mask_at if isinstance(mask_at, tuple) else (mask_at, "attention_mask")


def is_attention_module(module: torch.nn.Module) -> bool:
    """Whether `module` is an attention module that holds a processor: `Attention` (UNets, PixArt, SD3), one of the
    newer `AttentionModuleMixin` modules (`FluxAttention`, ...), or Mochi's `MochiAttention` (a plain module that
    calls its `processor` attribute).

    Example:
        >>> is_attention_module(Attention(query_dim=8)), is_attention_module(torch.nn.Linear(1, 1))
        (True, False)
    """
    return isinstance(module, (Attention, AttentionModuleMixin, MochiAttention)) and hasattr(module, "processor")


def set_processor(attn: torch.nn.Module, processor: Any) -> None:
    """Put `processor` on the attention module `attn`: with its own `set_processor` where it has one (which registers a
    processor with weights as a submodule), else as its `processor` attribute (`MochiAttention`).

    Example:
        >>> attn = Attention(query_dim=8)
        >>> set_processor(attn, AttnProcessor()); type(attn.processor).__name__
        'AttnProcessor'
    """
    setter = getattr(attn, "set_processor", None)
    if callable(setter):
        setter(processor)
    else:
        attn.processor = processor


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
        timestep_position / timestep_name: where the model's timestep argument sits when passed by position, and
            its keyword (`"timestep"`; HiDream's `"timesteps"`).
        timestep_scale: multiplies the timestep onto the 0..1000 scale (Flux passes 0..1).
        merge_only: True where only `mode="merge"` works (joint attention computes its keys and
            values inside the processor from the same tokens as the queries, so K/V pooling cannot
            be passed in from outside).
        defaults: the family's default `ToMeConfig` fields (what `apply_tome(model)` uses).
        presets: `ToMeConfig` fields per preset name, applied over `defaults`.
        needs_row_token: True where positional encodings must follow merged rows (Flux's rotary
            embeddings), so every merge records `TokenMerge.row_token`.
        rotary: how the attention processors receive rotary positions (`Rotary`), where they do.
        masks_text_only: True where the model's attention masks mask text padding only, every image
            token a valid key (Chroma, Z-Image): such a mask is cut to the merged sequence instead of
            leaving the attention unmerged.
        model_class: the model class the family supports (`matches` checks it), for declared families.
        stacks: the model's block lists (`Stack`), in forward order, for declared families.

    A family of a joint text-image transformer is mostly a declaration: `model_class`, `stacks`,
    `rotary`, the timestep and the presets; `matches` and `blocks` come from them (docs/families.md).
        video: True where the token grid has frames (`token_grid` gives `(frames, h, w)`), so windows
            may span frames (`ToMeConfig.st`).
    """

    name = "family"
    needs_row_token = False
    rotary: Rotary | None = None
    masks_text_only = False
    model_class: type | None = None
    stacks: tuple[Stack, ...] = ()
    video = False
    input_name = "hidden_states"
    input_position = 0
    timestep_position = 2
    timestep_name = "timestep"
    timestep_scale = 1.0
    merge_only = False
    defaults: dict[str, Any] = {}
    presets: dict[str, dict[str, Any]] = {}
    #: Whether the family's pipelines run classifier-free guidance as one batch of both halves (the UNets, SVD,
    #: PixArt, SD3, LTX-Video, LTX-2, Z-Image). There, as in tomesd, an odd batch turns random destinations
    #: (`use_rand`) off. False where the pipelines call the model once per branch or without guidance, at batch 1
    #: (FLUX.1, FLUX.2, Chroma, Qwen-Image, Wan, HunyuanVideo): random destinations at every batch size.
    guidance_in_batch = True

    #: The processor class every attention module of the family's models is built with, where that is not the
    #: attention class's default (Qwen-Image's `Attention` modules: `QwenDoubleStreamAttnProcessor2_0`).
    built_with: type | None = None

    #: Pixels per latent pixel of the VAE the family's released pipelines use (`explain_tome` on a bare model;
    #: a pipeline's own `vae_scale_factor` wins): 8, 16 on HunyuanVideo 1.5, 32 on LTX.
    vae_scale_factor = 8
    #: Latent pixels per token side where the pipeline packs latents itself (FLUX: 2 x 2 latent pixels a token,
    #: the model's `patch_size` 1); None where the model's `config.patch_size` says it.
    pipeline_patch: int | None = None
    #: Pixel frames per latent frame of a video family's VAE (its stride in time): 4 on Wan, 8 on LTX.
    frames_per_latent = 4
    #: Latent frames the family's pipelines put ahead of the clip's in the model's input (Wan-Animate: the reference
    #: image's), which its token grid counts: `explain_tome` adds them to the clip's.
    extra_latent_frames = 0

    def latent_frames(self, num_frames: int, stride: int | None = None) -> int:
        """The latent frames the model gets for a clip of `num_frames` pixel frames (`explain_tome`): the first frame
        alone, then one latent frame per `stride` pixel frames (the pipeline's VAE's stride, else `frames_per_latent`),
        and the `extra_latent_frames` the pipelines put ahead of the clip's.

        Example:
            >>> from tome_processors.families import FAMILIES
            >>> FAMILIES["wan"]().latent_frames(81), FAMILIES["wan_animate"]().latent_frames(77)
            (21, 21)
        """
        stride = stride or self.frames_per_latent
        return 1 + (max(num_frames, 1) - 1) // stride + self.extra_latent_frames

    def matches(self, model: torch.nn.Module) -> bool:
        if self.model_class is None:
            raise NotImplementedError
        return isinstance(model, self.model_class)

    def blocks(self, model: torch.nn.Module) -> list[BlockSite]:
        if not self.stacks:
            raise NotImplementedError
        return [site for stack in self.stacks for site in stack.sites(model)]

    def auto_downsample(self, model: torch.nn.Module) -> int:
        """What `max_downsample="auto"` means: every transformer block works at the patch grid."""
        return 1

    def block_levels(self, model: torch.nn.Module, blocks: list[torch.nn.Module]) -> list[int]:
        """The downsample level of each of `blocks` (its tokens' grid below the model's): 1 for a transformer's."""
        return [1] * len(blocks)

    def built_processor(self, model: torch.nn.Module, attn: torch.nn.Module) -> type | None:
        """The processor class `model` builds its attention module `attn` with, or None where unknown.

        A block site's `built_with`, else the family's `built_with`, else the class's default
        (`class_default_processor`). A family whose models build attention with another processor declares it
        (tests/test_default_inner.py checks every family against freshly built models).
        """
        for site in self.blocks(model):
            for attention in site.attentions:
                if attention.module is attn and attention.built_with is not None:
                    return attention.built_with
        return self.built_with or class_default_processor(attn)

    def preset_options(self, name: str, model: torch.nn.Module | None = None) -> dict[str, Any]:
        """The `ToMeConfig` fields of preset `name` on `model` (or on the family's usual layout), defaults included.

        Example:
            >>> from tome_processors.families import FAMILIES
            >>> FAMILIES["sd3"]().preset_options("balanced")["share_level"]
            True
        """
        # Every preset merges only where it pays (pays.py); the family's defaults (tomesd's) merge everywhere.
        return {**self.defaults, **self.presets[name], "pays_only": True}

    def hinted_grid(
        self, model: torch.nn.Module, args: tuple, kwargs: dict, hint: tuple[int, int]
    ) -> tuple[int, ...] | None:
        """The token grid of a compiled forward where the pipeline noted the generation's grid (`hint`).

        Only families that read their grid from tensor values (`IdsGridFamily`) use the hint; the others
        read it from shapes and lists, which a graph holds.
        """
        return self.token_grid(model, args, kwargs)

    def grid_of_ids(self, ids: object) -> tuple[int, int] | None:
        """The grid that `ids`, a tensor a pipeline's `prepare_latents` returned, number; None for families
        that do not read their grid from tensor values (all but `IdsGridFamily`)."""
        return None

    def token_grid(self, model: torch.nn.Module, args: tuple, kwargs: dict) -> tuple[int, ...] | None:
        """`(h, w)` image tokens of this forward (`(frames, h, w)` on a video family), or None when the call gives
        no grid."""
        patch = int(getattr(model.config, "patch_size", 1) or 1)
        x = argument(args, kwargs, self.input_position, self.input_name)
        if not isinstance(x, torch.Tensor) or x.ndim != 4:
            return None
        return int(x.shape[-2]) // patch, int(x.shape[-1]) // patch

    def leading_tokens(self, args: tuple, kwargs: dict, grid: tuple[int, ...]) -> int | None:
        """Tokens the blocks get ahead of the grid's in one sequence that context parallelism splits with it
        (MiniMax-H3's text, conditions and audio ahead of its video), or None on families whose split sequence is
        the grid's tokens (and any `trailing_tokens`) alone (`parallel.local_grid`)."""
        return None

    def trailing_tokens(self, args: tuple, kwargs: dict, grid: tuple[int, ...]) -> int:
        """Tokens after the grid's in the model's image-token input (`ModelState.tail`): 0 but on families that
        take reference images after the generated one's tokens and say so (`IdsGridFamily.reference_tail`)."""
        return 0

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
        timestep = argument(args, kwargs, self.timestep_position, self.timestep_name)
        return timestep if views_a_schedule(timestep) else None

    def timestep(self, args: tuple, kwargs: dict) -> object:
        """The timestep of this forward on the 0..1000 scale (tensor, number or None)."""
        t = argument(args, kwargs, self.timestep_position, self.timestep_name)
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
