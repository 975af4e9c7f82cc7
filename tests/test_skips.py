"""Every path on which an attention ToMe was asked to merge in runs unmerged says so: once per model and cause, naming
the module and the cause (a warning), or, for causes the configuration chose, at DEBUG; an error under
`strict_skips()`.

Each case runs a tiny model twice; a forward hook on one attention module calls its processor once more, inside the
block's forward (where the block's merge context is live), with the input that takes the path.
"""

from __future__ import annotations

import logging
import warnings
from collections.abc import Callable
from typing import Any

import pytest
import torch

import tome_processors as tp
from tome_processors.arguments import argument
from tome_processors.context import SLOT_ATTR
from tome_processors.pays import THRESHOLDS, pays_table
from tome_processors.skips import Skip, ToMeSkipError, ToMeSkipWarning

from models import run_unet, tiny_unet, unet_inputs
from test_dit import flux_inputs, sd3_inputs, tiny_flux, tiny_sd3
from test_dit import run as run_transformer
from test_video import tiny_wan, wan_inputs

#: A poke: `(attention module, its processor, the hidden states it got, the other arguments by name)`.
Poke = Callable[[torch.nn.Module, Any, torch.Tensor, dict], None]


def unet_case(config: dict, poke: Poke | None, where: str = "down_blocks.0.attentions.0.transformer_blocks.0.attn1"):
    """A tiny SD1.5-shaped UNet with ToMe(`config`), poked at `where`; returns (model, one forward)."""
    unet = tiny_unet("sd15")
    tp.apply_tome(unet, **config)
    inputs = unet_inputs(unet)
    return unet, where, poke, lambda: run_unet(unet, *inputs)


def transformer_case(build: Callable, inputs: dict, where: str, poke: Poke | None):
    model = build()
    tp.apply_tome(model, ratio=0.5)
    return model, where, poke, lambda: run_transformer(model, inputs)


def _unordered_ids() -> dict:
    inputs = flux_inputs(batch=1)
    inputs["img_ids"] = inputs["img_ids"].flip(0)  # not row-major: no grid
    return inputs


def _names(module: torch.nn.Module, args: tuple, kwargs: dict, names: tuple[str, ...]) -> dict:
    return {name: argument(args, kwargs, i, name) for i, name in enumerate(names)}


def _without_block_input(attn: torch.nn.Module, processor: Any, hidden: torch.Tensor, others: dict) -> None:
    block = getattr(attn, SLOT_ATTR).block
    saved = (block.metric, block.merged_config, block.merge)
    block.metric, block.merged_config, block.merge = None, None, None
    try:
        processor(attn, hidden)
    finally:
        block.metric, block.merged_config, block.merge = saved


def _as_image(attn: torch.nn.Module, processor: Any, hidden: torch.Tensor, others: dict) -> None:
    b, n, c = hidden.shape
    side = int(n**0.5)
    processor(attn, hidden.transpose(1, 2).reshape(b, c, side, side))


def _mask(attn: torch.nn.Module, processor: Any, hidden: torch.Tensor, others: dict) -> None:
    processor(attn, hidden, attention_mask=torch.zeros(hidden.shape[0], 1, hidden.shape[1]))


def _fewer_tokens(attn: torch.nn.Module, processor: Any, hidden: torch.Tensor, others: dict) -> None:
    processor(attn, hidden[:, :-6], **others)


def _text_in_self(attn: torch.nn.Module, processor: Any, hidden: torch.Tensor, others: dict) -> None:
    processor(attn, hidden, encoder_hidden_states=hidden)


def _pooled_in_joint(attn: torch.nn.Module, processor: Any, hidden: torch.Tensor, others: dict) -> None:
    tp.ToMeProcessor(processor.inner, mode="downsample_kv")(attn, hidden, **others)


def _short_rotary(name: str) -> Poke:
    def poke(attn: torch.nn.Module, processor: Any, hidden: torch.Tensor, others: dict) -> None:
        cos, sin = others[name]
        cut = (slice(None), slice(0, -1)) if cos.ndim == 4 else (slice(0, -1),)  # Wan's (1, N, 1, D); Flux's (S, D)
        processor(attn, hidden, **{**others, name: (cos[cut], sin[cut])})

    return poke


SD3_ATTN, FLUX_ATTN, WAN_ATTN = "transformer_blocks.0.attn", "transformer_blocks.0.attn", "blocks.0.attn1"
JOINT = ("hidden_states", "encoder_hidden_states")
FLUX = ("hidden_states", "encoder_hidden_states", "attention_mask", "image_rotary_emb")
WAN = ("hidden_states", "encoder_hidden_states", "attention_mask", "rotary_emb")

#: (name, the cause it reports, the case, names of the poked module's arguments).
CASES = [
    ("not-tokens", Skip.NOT_TOKENS, lambda: unet_case({"ratio": 0.5}, _as_image), ()),
    ("mask", Skip.MASK, lambda: unet_case({"ratio": 0.5}, _mask), ()),
    ("mask-pooled", Skip.MASK, lambda: unet_case({"mode": "downsample_kv"}, _mask), ()),
    ("text-in-self-pooled", Skip.TEXT_IN_SELF, lambda: unet_case({"mode": "downsample_kv"}, _text_in_self), ()),
    ("no-grid-pooled", Skip.NO_GRID, lambda: unet_case({"mode": "downsample_kv"}, _fewer_tokens), ()),
    ("shape", Skip.SHAPE, lambda: unet_case({"ratio": 0.5}, _fewer_tokens), ()),
    ("no-block-input", Skip.NO_BLOCK_INPUT, lambda: unet_case({"ratio": 0.5}, _without_block_input), ()),
    # Level 2 (8 x 8 tokens) holds no 16 x 16 window; level 1 (16 x 16) does: no warning for the latent's grid.
    (
        "small-grid",
        Skip.SMALL_GRID,
        lambda: unet_case({"ratio": 0.5, "max_downsample": 2, "sx": 16, "sy": 16}, None),
        (),
    ),
    (
        "joint-pooled",
        Skip.KV_JOINT,
        lambda: transformer_case(tiny_sd3, sd3_inputs(), SD3_ATTN, _pooled_in_joint),
        JOINT,
    ),
    (
        "joint-fewer",
        Skip.FEWER_TOKENS,
        lambda: transformer_case(tiny_sd3, sd3_inputs(), SD3_ATTN, _fewer_tokens),
        JOINT,
    ),
    (
        "joint-rotary",
        Skip.ROTARY,
        lambda: transformer_case(tiny_flux, flux_inputs(), FLUX_ATTN, _short_rotary("image_rotary_emb")),
        FLUX,
    ),
    ("no-model-grid", Skip.NO_MODEL_GRID, lambda: transformer_case(tiny_flux, _unordered_ids(), FLUX_ATTN, None), ()),
    (
        "rotary",
        Skip.ROTARY,
        lambda: transformer_case(tiny_wan, wan_inputs(), WAN_ATTN, _short_rotary("rotary_emb")),
        WAN,
    ),
]


def poked(case: tuple, names: tuple[str, ...]) -> tuple[torch.nn.Module, Callable[[], Any]]:
    """The case's model with its poke hooked in, and one forward."""
    model, where, poke, forward = case
    if poke is not None:
        attn = model.get_submodule(where)

        def hook(module: torch.nn.Module, args: tuple, kwargs: dict, output: Any) -> None:
            others = _names(module, args, kwargs, names) if names else {}
            hidden = others.pop("hidden_states", None) if names else argument(args, kwargs, 0, "hidden_states")
            others = {k: v for k, v in others.items() if v is not None}
            try:
                poke(module, module.processor, hidden, others)
            except ToMeSkipError:
                raise
            except (RuntimeError, ValueError, IndexError):
                pass  # the inner processor on a broken input: only what ToMe said before it matters

        attn.register_forward_hook(hook, with_kwargs=True)
    return model, forward


@pytest.mark.parametrize(("name", "reason", "build", "names"), CASES, ids=[c[0] for c in CASES])
def test_every_skip_path_warns_once_naming_the_site_and_the_cause(name, reason, build, names, one_thread):
    model, forward = poked(build(), names)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        forward()
        forward()
    said = [str(w.message) for w in caught if issubclass(w.category, ToMeSkipWarning)]
    assert len(said) == 1, said
    assert reason.cause in said[0] and type(model).__name__ in said[0]
    if reason is not Skip.SMALL_GRID:  # the poked module is named
        assert ".attn" in said[0]


@pytest.mark.parametrize(("name", "reason", "build", "names"), CASES[:3] + CASES[-2:], ids=lambda v: str(v)[:20])
def test_strict_skips_turn_the_warning_into_an_error_at_every_call(name, reason, build, names, one_thread):
    _, forward = poked(build(), names)
    with tp.strict_skips():
        for _ in range(2):
            with pytest.raises(
                ToMeSkipError, match=f"Expected ToMe to merge the tokens of .*but got {reason.cause[:20]}"
            ):
                forward()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        forward()  # off again outside


@pytest.mark.parametrize(
    ("config", "reason"),
    [
        ({"ratio": 0.5}, Skip.FLAG_OFF),  # cross-attention with merge_crossattn off
        ({"ratio": 0.5}, Skip.LEVEL_OFF),  # the levels below max_downsample=1
        ({"ratio": 0.001}, Skip.NOTHING_TO_MERGE),
        ({"mode": "downsample_kv"}, Skip.KV_CROSS),
        ({"preset": "exact"}, Skip.PAYS),  # the real rule: merging never pays on the tiny UNet
    ],
    ids=lambda v: getattr(v, "name", None),
)
def test_causes_the_configuration_chose_are_logged_not_warned(config, reason, caplog, one_thread):
    with pays_table(THRESHOLDS), caplog.at_level(logging.DEBUG, logger="tome_processors.skips"):
        _, _, _, forward = unet_case(config, None)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            with tp.strict_skips():  # chosen causes never raise
                forward()
                forward()
    assert not [w for w in caught if issubclass(w.category, ToMeSkipWarning)]
    logged = [r.getMessage() for r in caplog.records if reason.cause in r.getMessage()]
    assert len(logged) == 1 and "as configured" in logged[0]


def test_one_frame_with_windows_of_two_frames_merges_as_an_image_without_a_warning(one_thread):
    """A 1-frame video (a Wan image, or a rank's run of rows under context parallelism) merges with st=1, so the
    too-few-frames warning is not given; 2 frames under st=3 still merge nothing and say so."""
    model = tiny_wan(1)
    tp.apply_tome(model, ratio=0.5, st=2, use_rand=False)
    seen = []
    model.blocks[0].attn1.to_q.register_forward_pre_hook(lambda _, args: seen.append(args[0].shape[1]))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        run_transformer(model, wan_inputs(batch=1, frames=1, h=8, w=8))
    assert seen == [8]  # 16 tokens merged to 8
    assert not [w for w in caught if issubclass(w.category, ToMeSkipWarning)]

    model = tiny_wan(1)
    tp.apply_tome(model, ratio=0.5, st=3, use_rand=False)
    with pytest.warns(ToMeSkipWarning, match="make no window of st=3"):
        run_transformer(model, wan_inputs(batch=1, frames=2, h=8, w=8))
