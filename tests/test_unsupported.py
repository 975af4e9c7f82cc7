"""`set_attn_processor(ToMeProcessor(...))` on models of no supported family: ToMe says so once, the output is the
model's own bit for bit, and `remove_tome` leaves a model that runs as it was built.

Tiny random-weight models from configs (diffusers' own test sizes): the latent upscaler's K-UNet, Sana's ControlNet
(Sana's blocks, linear attention, processors of its own) and Kandinsky 2.2's UNet (added-K/V attention).
"""

from __future__ import annotations

import warnings
from collections.abc import Callable

import pytest
import torch
from diffusers import (
    SanaControlNetModel,
    UNet2DConditionModel,
)

import tome_processors as tp
from tome_processors import ToMeProcessor
from tome_processors.families import find_family
from tome_processors.hooks import attention_modules

from leftovers import hooks_left, tome_attributes_left


def _noise(*shape: int, seed: int = 0) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed))


def latent_upscaler_unet() -> tuple[torch.nn.Module, dict]:
    """`StableDiffusionLatentUpscalePipeline`'s UNet: K-blocks (`KAttentionBlock`, no `BasicTransformerBlock`)."""
    torch.manual_seed(0)
    model = UNet2DConditionModel(
        act_fn="gelu",
        attention_head_dim=8,
        norm_num_groups=None,
        block_out_channels=[32, 32, 64, 64],
        time_cond_proj_dim=160,
        conv_in_kernel=1,
        conv_out_kernel=1,
        cross_attention_dim=32,
        down_block_types=("KDownBlock2D", "KCrossAttnDownBlock2D", "KCrossAttnDownBlock2D", "KCrossAttnDownBlock2D"),
        in_channels=8,
        mid_block_type=None,
        only_cross_attention=False,
        out_channels=5,
        resnet_time_scale_shift="scale_shift",
        time_embedding_type="fourier",
        timestep_post_act="gelu",
        up_block_types=("KCrossAttnUpBlock2D", "KCrossAttnUpBlock2D", "KCrossAttnUpBlock2D", "KUpBlock2D"),
    ).eval()
    inputs = dict(
        sample=_noise(1, 8, 16, 16),
        timestep=torch.tensor([0.5]),
        encoder_hidden_states=_noise(1, 4, 32, seed=1),
        timestep_cond=_noise(1, 160, seed=2),
    )
    return model, inputs


def sana_controlnet() -> tuple[torch.nn.Module, dict]:
    """Sana's ControlNet: Sana's blocks (linear self-attention) in a model of its own class (Sana's family is
    `SanaTransformer2DModel`'s). Its input and output projections are built zeroed: drawn here, so its blocks reach the
    output."""
    torch.manual_seed(0)
    model = SanaControlNetModel(
        in_channels=4,
        out_channels=4,
        num_attention_heads=2,
        attention_head_dim=4,
        num_layers=2,
        num_cross_attention_heads=2,
        cross_attention_head_dim=4,
        cross_attention_dim=8,
        caption_channels=8,
        sample_size=8,
    ).eval()
    with torch.no_grad():
        for parameter in (*model.input_block.parameters(), *model.controlnet_blocks.parameters()):
            parameter.normal_(0.0, 0.1)
    return model, dict(
        hidden_states=_noise(1, 4, 8, 8),
        encoder_hidden_states=_noise(1, 5, 8, seed=1),
        timestep=torch.tensor([500]),
        controlnet_cond=_noise(1, 4, 8, 8, seed=2),
    )


def kandinsky22_unet() -> tuple[torch.nn.Module, dict]:
    """Kandinsky 2.2's decoder UNet: `SimpleCrossAttn` blocks, attention with added keys and values."""
    torch.manual_seed(0)
    model = UNet2DConditionModel(
        in_channels=4,
        out_channels=8,
        addition_embed_type="image",
        down_block_types=("ResnetDownsampleBlock2D", "SimpleCrossAttnDownBlock2D"),
        up_block_types=("SimpleCrossAttnUpBlock2D", "ResnetUpsampleBlock2D"),
        mid_block_type="UNetMidBlock2DSimpleCrossAttn",
        block_out_channels=(32, 64),
        layers_per_block=1,
        encoder_hid_dim=32,
        encoder_hid_dim_type="image_proj",
        cross_attention_dim=32,
        attention_head_dim=4,
        resnet_time_scale_shift="scale_shift",
        class_embed_type=None,
    ).eval()
    inputs = dict(
        sample=_noise(1, 4, 16, 16),
        timestep=torch.tensor([500]),
        encoder_hidden_states=None,
        added_cond_kwargs={"image_embeds": _noise(1, 32, seed=1)},
    )
    return model, inputs


MODELS: dict[str, Callable[[], tuple[torch.nn.Module, dict]]] = {
    "latent-upscaler": latent_upscaler_unet,
    "sana-controlnet": sana_controlnet,
    "kandinsky22": kandinsky22_unet,
}


def run(model: torch.nn.Module, inputs: dict) -> torch.Tensor:
    with torch.no_grad():
        out = model(**inputs)[0]
    return torch.stack(out) if isinstance(out, (list, tuple)) else out  # a ControlNet: one sample per block


@pytest.mark.parametrize("inner", [False, True], ids=["without-inner", "with-inner"])
@pytest.mark.parametrize("name", sorted(MODELS))
def test_tome_on_an_unsupported_model_says_so_once_and_changes_nothing(name, inner):
    model, inputs = MODELS[name]()
    assert find_family(model) is None
    with pytest.raises(ValueError, match=f"but got {type(model).__name__}, for which none is declared"):
        tp.apply_tome(model)
    built = {key: type(processor) for key, processor in model.attn_processors.items()}
    plain = run(model, inputs)
    if inner:
        model.set_attn_processor({key: ToMeProcessor(p, ratio=0.5) for key, p in model.attn_processors.items()})
    else:
        model.set_attn_processor(ToMeProcessor(ratio=0.5))
    with pytest.warns(UserWarning, match=f"ToMe merges nothing in {type(model).__name__}") as told:
        first = run(model, inputs)
    assert len([w for w in told if "ToMe merges nothing" in str(w.message)]) == 1
    assert "docs/families.md" in str(told[0].message)  # where every model's family, or why none, is listed
    assert torch.equal(first, plain)  # the model's own processors ran, unchanged
    with warnings.catch_warnings():
        warnings.simplefilter("error", UserWarning)  # said once
        assert torch.equal(run(model, inputs), plain)
    assert not tp.is_tome_applied(model)  # nothing merges: ToMe does not claim to be on
    tp.remove_tome(model)
    assert {key: type(processor) for key, processor in model.attn_processors.items()} == built
    assert torch.equal(run(model, inputs), plain)
    assert hooks_left(model) == 0 and tome_attributes_left(model) == []


def test_remove_tome_before_any_call_puts_the_built_processors_back():
    model, inputs = sana_controlnet()
    built = {key: type(processor) for key, processor in model.attn_processors.items()}
    plain = run(model, inputs)
    model.set_attn_processor(ToMeProcessor(ratio=0.5))
    tp.remove_tome(model)
    assert {key: type(processor) for key, processor in model.attn_processors.items()} == built
    assert torch.equal(run(model, inputs), plain)


def test_a_processor_it_cannot_tell_raises_at_the_first_attention_call_before_any_runs(monkeypatch):
    model, inputs = kandinsky22_unet()

    def unbuildable(*args, **kwargs):
        raise RuntimeError("this model cannot be built on the meta device")

    monkeypatch.setattr(type(model), "from_config", unbuildable)
    model.set_attn_processor(ToMeProcessor(ratio=0.5))
    entered: list[torch.nn.Module] = []
    for attn in attention_modules(model):
        attn.register_forward_pre_hook(lambda module, args: entered.append(module))
    with pytest.raises(ValueError, match="Expected ToMeProcessor to know the processor to run on Attention"):
        run(model, inputs)
    assert len(entered) == 1  # raised at the first attention module, whose processor ran nothing
    processors = dict(model.attn_processors)
    with pytest.raises(ValueError, match="Expected to know the processor UNet2DConditionModel builds"):
        tp.remove_tome(model)
    assert dict(model.attn_processors) == processors  # nothing changed
