"""Edit models with reference images beside the generated one, and other transformers of diffusers 0.42.1:

- `JoyImageEditTransformer3DModel` (JoyImage-Edit) and `JoyImageEditPlusTransformer3DModel` (JoyImage-Edit Plus):
  double-stream blocks over the generated image's tokens, then the reference images', and the text;
- `OmniGenTransformer2DModel` (OmniGen): one decoder over the prompt (with any input images' tokens spliced in), a
  time token and the generated image's tokens, under a causal mask that lets the image attend to everything;
- `MotifVideoTransformer3DModel` (Motif-Video): HunyuanVideo's kind of double- then single-stream blocks;
- `AnyFlowTransformer3DModel` (AnyFlow): Wan 2.1's blocks under a flow-map timestep embedding;
- `DreamLiteTransformer2DModel` (DreamLite): the spatial transformer of DreamLite's UNet.

Only the generated image's (or video's) tokens merge; reference images, input images and the text are rows of their
own. `AnyFlowFARTransformer3DModel` is refused (`REFUSED`).
"""

from __future__ import annotations

import warnings
import weakref
from typing import Any

import torch
from diffusers import (
    AnyFlowFARTransformer3DModel,
    AnyFlowTransformer3DModel,
    DreamLiteTransformer2DModel,
    JoyImageEditPlusTransformer3DModel,
    JoyImageEditTransformer3DModel,
    MotifVideoTransformer3DModel,
    OmniGenTransformer2DModel,
)
from diffusers.models.transformers.transformer_anyflow import AnyFlowCrossAttnProcessor
from diffusers.models.transformers.transformer_omnigen import OmniGenAttnProcessor2_0

from .._similarity import is_compiling
from ..arguments import argument
from .base import AttentionSite, BlockSite, Family, Layout, Rotary, Span, Stack
from .dit import PixArtFamily
from .flux import FluxFamily
from .hunyuanvideo import HunyuanVideoFamily
from .wan import WanFamily


class JoyImageEditFamily(Family):
    """`JoyImageEditTransformer3DModel` (JoyImage-Edit): double-stream blocks (`double_blocks`).

    Its pipeline passes `(B, items, C, T, H, W)`: the image to edit, then the generated image's noise (text-to-image:
    the noise alone). The model moves the generated image first and patches the items as frames of one latent, so the
    blocks get the generated image's `h x w` tokens, then the reference's (`Span.LEADING`): those pass through as rows
    of their own. Each block's attention gets the image tokens and the text apart and attends over image then text
    (`Layout.JOINT_IMAGE_FIRST`); its rotary argument is `((cos, sin), text tables)`, the image's `(N, D)` tables over
    every image token and the text's (None unless `rope_type="mrope"`) left as they are (`Rotary(nested=True)`). No
    mask. The grid is `(H / 2, W / 2)` of one frame (the released `patch_size` is `[1, 2, 2]`); a clip of several
    latent frames has no image grid and merges nothing. The pipeline passes the scheduler's 0..1000 timestep, and
    calls the model once per guidance branch.

    Example:
        >>> from tome_processors.families import FAMILIES
        >>> FAMILIES["joyimage_edit"]().rotary.nested
        True
    """

    name = "joyimage_edit"
    model_class = JoyImageEditTransformer3DModel
    # The module passes (encoder_hidden_states, image_rotary_emb) by position: no mask at position 2.
    stacks = (Stack("double_blocks", Layout.JOINT_IMAGE_FIRST, feed_forward="img_mlp", span=Span.LEADING, mask_at=2),)
    needs_row_token = True
    rotary = Rotary(position=1, covers_text=False, nested=True)
    timestep_position = 1
    merge_only = True  # joint attention computes its keys and values inside the processor
    guidance_in_batch = False  # called once per guidance branch
    vae_scale_factor = 8  # Wan 2.1's VAE; `config.patch_size` `[1, 2, 2]` makes a token of 2 x 2 latent pixels
    # Borrowed from FLUX.1 (joint text-image attention with rotary positions); not measured on this model.
    defaults: dict[str, Any] = dict(FluxFamily.defaults)
    presets: dict[str, dict[str, Any]] = FluxFamily.presets

    def token_grid(self, model: torch.nn.Module, args: tuple, kwargs: dict) -> tuple[int, int] | None:
        x = argument(args, kwargs, 0, "hidden_states")
        if not isinstance(x, torch.Tensor) or x.ndim not in (5, 6):
            return None
        p_t, p_h, p_w = (int(p) for p in model.config.patch_size)
        if int(x.shape[-3]) // p_t != 1:  # each item's frames: one for an image
            return None
        return int(x.shape[-2]) // p_h, int(x.shape[-1]) // p_w


class JoyImageEditPlusFamily(JoyImageEditFamily):
    """`JoyImageEditPlusTransformer3DModel` (JoyImage-Edit Plus, several reference images of their own sizes).

    Its pipeline passes patches, `(B, max_patches, C, 1, 2, 2)`: per sample the generated image's `h x w`, then each
    reference image's, padded to the batch's longest; `shape_list` holds each sample's `(t, h, w)` per item, the
    generated image's first. The blocks' attention is JoyImage-Edit's with rotary tables `(cos, sin)` per sample,
    `(B, max_patches, D)`, over the image tokens alone (`Rotary(batched=True, text_table=False)`), and a mask over the
    image tokens then the text, `(B, 1, 1, S)`: it masks the padding patches (after the references) and the text's
    padding, never a generated image's token (`masks_text_only`), so it is cut to the merged rows. Both guidance
    branches go in one batch.
    """

    name = "joyimage_edit_plus"
    model_class = JoyImageEditPlusTransformer3DModel
    rotary = Rotary(position=1, covers_text=False, text_table=False, batched=True)
    masks_text_only = True
    guidance_in_batch = True

    def token_grid(self, model: torch.nn.Module, args: tuple, kwargs: dict) -> tuple[int, int] | None:
        x = argument(args, kwargs, 0, "hidden_states")
        shapes = argument(args, kwargs, 4, "shape_list")
        if not isinstance(x, torch.Tensor) or x.ndim != 6 or not shapes or not shapes[0]:
            return None
        generated = {tuple(int(v) for v in sample[0]) for sample in shapes if sample}
        if len(generated) != 1:  # one grid for the batch: every sample generates the same size
            return None
        frames, h, w = generated.pop()
        return (h, w) if frames == 1 and 0 < h * w <= x.shape[1] else None


class OmniGenFamily(Family):
    """`OmniGenTransformer2DModel` (OmniGen): one Phi-3 decoder (`layers`) over one sequence.

    The sequence is the prompt's tokens, with any input images' tokens spliced in where the prompt names them, a time
    token, then the generated image's `h x w` tokens (`Layout.TEXT_FIRST`, `Span.TRAILING`): only the generated
    image's merge; every other token is a row of its own. Each block's attention is called as cross-attention to its
    own tokens (`encoder_hidden_states` is `hidden_states`): its keys and values are the merged rows too. The rotary
    tables `(cos, sin)`, `(S, D)`, cover the whole sequence (the first sample's positions, as the model uses them).

    The mask `(B, S, S)`: the prompt (and time token) attends causally, each input image and the generated image
    attend within themselves, the generated image to everything but left padding. Its generated image's rows are all
    alike and so are its columns within each row, so it is cut to the merged rows (`masks_text_only`). A mask where
    they are not (generated images of several sizes in one batch, whose padding patches are masked) cannot be cut:
    such a forward merges nothing, and says so once (`token_grid`, reading the mask once per mask tensor the pipeline
    passes). Its pipeline's scheduler runs `t` from 0 (noise) to 1 and passes all guidance branches in one batch.
    """

    name = "omnigen"
    model_class = OmniGenTransformer2DModel
    stacks = (
        Stack(
            "layers", Layout.TEXT_FIRST, attention="self_attn", span=Span.TRAILING, built_with=OmniGenAttnProcessor2_0
        ),
    )
    needs_row_token = True
    rotary = Rotary()  # `image_rotary_emb`, `(cos, sin)` over the whole sequence
    masks_text_only = True  # see the class doc: checked by `token_grid`
    timestep_position = 1
    merge_only = True
    vae_scale_factor = 8  # SDXL's VAE; the model's `patch_size` 2 makes a token of 2 x 2 latent pixels
    # Borrowed from FLUX.1 (text and image tokens in one attention, rotary positions); not measured on this model.
    defaults: dict[str, Any] = dict(FluxFamily.defaults)
    presets: dict[str, dict[str, Any]] = FluxFamily.presets

    def __init__(self) -> None:
        self._last: tuple[weakref.ref, object, int, bool] | None = None
        self._warned = False

    def __getstate__(self) -> dict:  # a copy reads its mask afresh (the last read holds a weak reference)
        return {**vars(self), "_last": None}

    def timestep(self, args: tuple, kwargs: dict) -> object:
        """The noise level on the 0..1000 scale: `(1 - t) * 1000` of the model's `t` (0 at pure noise)."""
        t = argument(args, kwargs, self.timestep_position, self.timestep_name)
        return None if t is None else (1 - t) * 1000.0

    def token_grid(self, model: torch.nn.Module, args: tuple, kwargs: dict) -> tuple[int, int] | None:
        grid = super().token_grid(model, args, kwargs)
        mask = argument(args, kwargs, 5, "attention_mask")
        if grid is None or not isinstance(mask, torch.Tensor):
            return grid
        tokens = grid[0] * grid[1]
        lines_up = _mask_outside_the_graph(self, mask, tokens) if is_compiling() else self._mask_lines_up(mask, tokens)
        if lines_up:
            return grid
        if not self._warned:
            self._warned = True
            warnings.warn(
                f"ToMe merges nothing in this {type(model).__name__} call: expected an attention mask whose last "
                f"{tokens} rows (the generated image's) are alike and alike over its last {tokens} columns, but got "
                f"one of shape {tuple(mask.shape)} that is not.",
                UserWarning,
                stacklevel=2,
            )
        return None

    def _mask_lines_up(self, mask: torch.Tensor, tokens: int) -> bool:
        last = self._last
        # Pipelines pass the same mask every step: read once. A version counter tells an in-place change; inference
        # tensors have none, so there the storage and shape stand for it.
        version = (-1, mask.data_ptr(), tuple(mask.shape)) if mask.is_inference() else mask._version
        if last is not None and last[0]() is mask and last[1:3] == (version, tokens):
            return last[3]
        lines_up = grid_block_is_uniform(mask, tokens)
        self._last = (weakref.ref(mask), version, tokens, lines_up)
        return lines_up


@torch.compiler.disable
def _mask_outside_the_graph(family: OmniGenFamily, mask: torch.Tensor, tokens: int) -> bool:
    return family._mask_lines_up(mask, tokens)


def grid_block_is_uniform(mask: torch.Tensor, tokens: int) -> bool:
    """Whether a `(..., S, S)` (or `(..., 1, S)`) mask holds one value over its last `tokens` columns in each row, and
    its last `tokens` rows are alike: merged rows there keep it exact when cut (one host read).

    Example:
        >>> omnigen_like = torch.ones(5, 5).tril()
        >>> omnigen_like[2:] = 1  # causal, but the last 3 tokens attend to everything
        >>> grid_block_is_uniform(omnigen_like, 3), grid_block_is_uniform(torch.ones(5, 5).tril(), 3)
        (True, False)
        >>> omnigen_like[:, -1] = 0  # a padding patch masked
        >>> grid_block_is_uniform(omnigen_like, 3)
        False
    """
    if mask.shape[-1] < tokens:
        return False
    columns = mask[..., -tokens:]
    alike = columns == columns[..., -1:]
    if mask.ndim >= 2 and mask.shape[-2] == mask.shape[-1]:
        rows = mask[..., -tokens:, :]
        return bool(alike.all()) and bool((rows == rows[..., -1:, :]).all())
    return bool(alike.all())


class MotifVideoFamily(HunyuanVideoFamily):
    """`MotifVideoTransformer3DModel` (Motif-Video, text- and image-to-video): HunyuanVideo's layout.

    Its double-stream (`transformer_blocks`) and single-stream blocks (`single_transformer_blocks`, including any
    decoder blocks at the end, which attend to the encoder blocks' video tokens in the text's place, unmasked) call
    their attention with the video tokens and the text (with image-to-video's image embeddings ahead of it) apart;
    the processor attends over video then text and rotates the video part with `(cos, sin)`, each `(N_video, D)`. The
    mask covers the video (all valid) then the text's padding. `cross_attn` (the text cross-attention of released
    configs with `enable_text_cross_attention_*`) takes the block's attention output as queries and is not declared:
    it runs on every token. The grid is the latent `(B, C, F, H, W)` over `patch_size_t` and `patch_size`; the
    pipeline's guider calls the model once per guidance branch with the scheduler's 0..1000 timestep.
    """

    name = "motif_video"
    model_class = MotifVideoTransformer3DModel
    stacks = (
        Stack("transformer_blocks", Layout.JOINT_IMAGE_FIRST, feed_forward="ff"),
        Stack("single_transformer_blocks", Layout.JOINT_IMAGE_FIRST),
    )


class AnyFlowFamily(WanFamily):
    """`AnyFlowTransformer3DModel` (AnyFlow, bidirectional flow-map sampling): Wan 2.1's blocks (`blocks`).

    Each block's `attn1` is self-attention over the video tokens; its rotary argument is a dict of complex tables,
    `{"query": f, "key": f}` with `f` `(1, 1, N, D/2)` (`Rotary(entries=..., heads_axis=True)`): a merged row keeps
    its kept token's rotation. `attn2` is cross-attention to the text, built with `AnyFlowCrossAttnProcessor`. The
    latent comes frames first, `(B, F, C, H, W)`; the timestep is one per frame, `(B, F)` (0 on a video's context
    frames): the last frame's is the noise level. Both guidance branches go in one batch.

    Example:
        >>> from tome_processors.families import FAMILIES
        >>> FAMILIES["anyflow"]().rotary.entries
        ('query', 'key')
    """

    name = "anyflow"
    model_class = AnyFlowTransformer3DModel
    rotary = Rotary(name="rotary_emb", position=2, pair=False, entries=("query", "key"), heads_axis=True)
    guidance_in_batch = True

    def _site(self, block: torch.nn.Module) -> BlockSite:
        attentions = (
            AttentionSite(block.attn1, False, Layout.ROTARY),
            AttentionSite(block.attn2, True, Layout.IMAGE, AnyFlowCrossAttnProcessor),
        )
        return BlockSite(block, attentions, block.ffn)

    def token_grid(self, model: torch.nn.Module, args: tuple, kwargs: dict) -> tuple[int, int, int] | None:
        x = argument(args, kwargs, self.input_position, self.input_name)
        if not isinstance(x, torch.Tensor) or x.ndim != 5:
            return None
        p_t, p_h, p_w = model.config.patch_size
        return int(x.shape[1]) // p_t, int(x.shape[3]) // p_h, int(x.shape[4]) // p_w

    def timestep(self, args: tuple, kwargs: dict) -> object:
        """The last frame's timestep, `(B,)` (the scheduler's 0..1000), of a `(B, F)` timestep."""
        t = argument(args, kwargs, self.timestep_position, self.timestep_name)
        return t[:, -1] if isinstance(t, torch.Tensor) and t.ndim == 2 else t


class DreamLiteFamily(Family):
    """`DreamLiteTransformer2DModel` (DreamLite): `BasicTransformerBlockDreamLite`s over the continuous input's grid.

    Each block's `attn1` attends over the image tokens (absent where `use_self_attention=False`: nothing of that block
    merges but with `merge_crossattn`), `attn2` to the text; `ff` is merged with `merge_mlp`. The grid is the input
    `(B, C, H, W)` itself (no patches). DreamLite's pipeline calls this model inside its own UNet
    (`DreamLiteUNetModel`, of no family): `apply_tome` goes on each such transformer, whose grid is the UNet level's.
    """

    name = "dreamlite"
    model_class = DreamLiteTransformer2DModel
    timestep_position = 2
    # Borrowed from PixArt (self-attention over the image tokens alone, cross-attention to the text); not measured on
    # this model.
    defaults: dict[str, Any] = dict(PixArtFamily.defaults)
    presets: dict[str, dict[str, Any]] = PixArtFamily.presets

    def blocks(self, model: torch.nn.Module) -> list[BlockSite]:
        sites = []
        for block in model.transformer_blocks:
            attentions = []
            if block.attn1 is not None:
                attentions.append(AttentionSite(block.attn1, bool(block.only_cross_attention)))
            if block.attn2 is not None:
                attentions.append(AttentionSite(block.attn2, True))
            sites.append(BlockSite(block, tuple(attentions), block.ff))
        return sites


#: Refused with why (`families.REFUSED`).
REFUSED: dict[type, str] = {
    AnyFlowFARTransformer3DModel: (
        "Expected a model whose attention ToMe can merge, but got AnyFlowFARTransformer3DModel: its causal "
        "self-attention (AnyFlowCausalAttnProcessor) runs flex attention under a BlockMask built over the FAR chunk "
        "layout (compressed context frames, then full frames, padded to 128), which cannot be cut to merged tokens, "
        "and keeps a KV cache per block that the cache step fills by token counts (kv_cache_flag's "
        "num_full_tokens and num_compressed_tokens) and each next chunk reads back as keys ahead of its own, rotated "
        "with a table over all of them: merged tokens would line up with neither. ToMe cannot merge in this model; "
        "AnyFlowTransformer3DModel (bidirectional) is supported."
    )
}
