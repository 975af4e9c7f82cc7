"""A `ToMeProcessor` answers type checks for the processor it wraps, and keeps working as one.

The checks are those diffusers' own IP-Adapter model tests make, on a tiny UNet and a tiny FLUX.1 transformer
with IP-Adapter weights loaded (state dicts built here, with random weights, in the layout of the published
adapters): `attn2.processor.__class__.__name__ in ("IPAdapterAttnProcessor", "IPAdapterAttnProcessor2_0")` and
`isinstance(p, FluxIPAdapterAttnProcessor)` over `model.attn_processors`.
"""

from __future__ import annotations

import copy
import inspect
import io
import pickle

import pytest
import torch
from diffusers import FluxTransformer2DModel
from diffusers.models.attention_processor import AttnProcessor2_0, IPAdapterAttnProcessor2_0
from diffusers.models.transformers.transformer_flux import FluxAttnProcessor, FluxIPAdapterAttnProcessor

import tome_processors as tp
from tome_processors import ToMeProcessor

from models import CROSS_DIM, run_unet, tiny_unet, unet_inputs

pytestmark = pytest.mark.usefixtures("one_thread")

IMAGE_DIM = 24  # the image encoder's embedding width the tiny adapters take


def unet_ip_adapter_state_dict(unet) -> dict:
    """An IP-Adapter (4 image tokens) for `unet`: `ip_adapter` numbers the cross-attention layers as the
    published adapters do (1, 3, 5, ... in `attn_processors` order), `image_proj` maps an image embedding to 4
    tokens of the UNet's text width."""
    torch.manual_seed(1)
    layers, key_id = {}, 1
    for name in unet.attn_processors:
        if name.endswith("attn1.processor"):
            continue
        hidden = unet.get_submodule(name.removesuffix(".processor")).to_out[0].out_features
        layers[f"{key_id}.to_k_ip.weight"] = torch.randn(hidden, CROSS_DIM) * 0.1
        layers[f"{key_id}.to_v_ip.weight"] = torch.randn(hidden, CROSS_DIM) * 0.1
        key_id += 2
    return {"image_proj": image_projection(CROSS_DIM), "ip_adapter": layers}


def image_projection(text: int) -> dict:
    """The adapter's image projection: an image embedding to 4 tokens of width `text` (seeded by the caller)."""
    return {
        "proj.weight": torch.randn(4 * text, IMAGE_DIM) * 0.1,
        "proj.bias": torch.zeros(4 * text),
        "norm.weight": torch.ones(text),
        "norm.bias": torch.zeros(text),
    }


def tiny_flux() -> FluxTransformer2DModel:
    torch.manual_seed(0)
    return FluxTransformer2DModel(
        patch_size=1, in_channels=4, num_layers=1, num_single_layers=1, attention_head_dim=16, num_attention_heads=2,
        joint_attention_dim=32, pooled_projection_dim=32, axes_dims_rope=(4, 6, 6),
    ).eval()  # fmt: skip


def flux_ip_adapter_state_dict(model: FluxTransformer2DModel) -> dict:
    """A FLUX.1 IP-Adapter (4 image tokens): `ip_adapter` numbers the double-stream blocks from 0, with biases."""
    torch.manual_seed(1)
    width, text = model.inner_dim, model.config.joint_attention_dim
    layers = {}
    for key_id in range(len(model.transformer_blocks)):
        for name in ("to_k_ip", "to_v_ip"):
            layers[f"{key_id}.{name}.weight"] = torch.randn(width, text) * 0.1
            layers[f"{key_id}.{name}.bias"] = torch.zeros(width)
    return {"image_proj": image_projection(text), "ip_adapter": layers}


def flux_inputs(h: int = 4, w: int = 6) -> dict:
    g = torch.Generator().manual_seed(0)
    img_ids = torch.zeros(h * w, 3)
    img_ids[:, 1], img_ids[:, 2] = torch.arange(h * w) // w, torch.arange(h * w) % w
    return {
        "hidden_states": torch.randn(1, h * w, 4, generator=g),
        "encoder_hidden_states": torch.randn(1, 5, 32, generator=g),
        "pooled_projections": torch.randn(1, 32, generator=g),
        "timestep": torch.tensor([0.5]),
        "img_ids": img_ids,
        "txt_ids": torch.zeros(5, 3),
        "joint_attention_kwargs": {"ip_adapter_image_embeds": [torch.randn(1, 1, IMAGE_DIM, generator=g)]},
    }


def run_flux(model, inputs: dict) -> torch.Tensor:
    with torch.no_grad():
        return model(**{**inputs, "joint_attention_kwargs": dict(inputs["joint_attention_kwargs"])}).sample


def unet_ip_forward(unet, inputs) -> torch.Tensor:
    sample, timestep, text, _ = inputs
    embeds = torch.randn(sample.shape[0], 1, IMAGE_DIM, generator=torch.Generator().manual_seed(3))
    return run_unet(unet, sample, timestep, text, {"image_embeds": [embeds]})


def test_a_wrapper_answers_for_the_processor_it_wraps():
    wrapper = ToMeProcessor(AttnProcessor2_0(), ratio=0.5)
    assert issubclass(type(wrapper), ToMeProcessor) and isinstance(wrapper, ToMeProcessor)
    assert wrapper.__class__ is AttnProcessor2_0 and isinstance(wrapper, AttnProcessor2_0)
    # Not a module, as `AttnProcessor2_0` is not: an attention module holds it as a plain attribute.
    assert not isinstance(wrapper, torch.nn.Module) and repr(wrapper).startswith("ToMeProcessor(inner=AttnProcessor2_0")
    assert ToMeProcessor().__class__ is ToMeProcessor  # nothing wrapped yet: itself
    # Copies and pickles are ToMe processors around a copy of the inner one.
    buffer = io.BytesIO()
    torch.save(wrapper, buffer)
    buffer.seek(0)
    for copied in (copy.deepcopy(wrapper), pickle.loads(pickle.dumps(wrapper)), torch.load(buffer, weights_only=False)):
        assert issubclass(type(copied), ToMeProcessor) and copied.__class__ is AttnProcessor2_0
        assert copied.config == wrapper.config and copied.inner is not wrapper.inner


def test_a_subclass_runs_its_own_forward_and_shows_the_inner_signature():
    # A call of a ToMe processor runs its class's `forward` (the call is a copy of it, carrying the inner's signature).
    calls = []

    class CountingToMe(ToMeProcessor):
        def forward(self, attn, hidden_states, *args, **kwargs):
            calls.append(attn)
            return super().forward(attn, hidden_states, *args, **kwargs)

    unet = tiny_unet("sd15")
    inputs = unet_inputs(unet)
    plain = run_unet(unet, *inputs)
    unet.set_attn_processor(CountingToMe(AttnProcessor2_0(), ratio=0.5))
    first = run_unet(unet, *inputs)
    assert len(calls) == len(unet.attn_processors) and not torch.equal(first, plain)
    processor = next(iter(unet.attn_processors.values()))
    assert isinstance(processor, CountingToMe) and processor.__class__ is AttnProcessor2_0
    assert list(inspect.signature(processor.__call__).parameters) == list(
        inspect.signature(AttnProcessor2_0().__call__).parameters
    )
    assert torch.equal(run_unet(unet, *inputs), first) and len(calls) == 2 * len(unet.attn_processors)


def test_a_subclass_whose_forward_is_no_plain_function_is_called_through_it():
    calls = []

    class Logged:  # a callable descriptor, as a decorator might leave `forward`
        def __get__(self, processor, owner=None):
            if processor is None:
                return self

            def bound(*args, **kwargs):
                calls.append(args[0])
                return ToMeProcessor.forward(processor, *args, **kwargs)

            return bound

    class LoggedToMe(ToMeProcessor):
        forward = Logged()

    unet = tiny_unet("sd15")
    inputs = unet_inputs(unet)
    unet.set_attn_processor(ToMeProcessor(AttnProcessor2_0(), ratio=0.5))
    expected = run_unet(unet, *inputs)
    unet.set_attn_processor(LoggedToMe(AttnProcessor2_0(), ratio=0.5))
    assert torch.equal(run_unet(unet, *inputs), expected) and len(calls) == len(unet.attn_processors)


@pytest.mark.parametrize("ratio", [0.0, 0.5])
def test_unet_ip_adapter_checks_see_the_ip_adapter_processors(ratio):
    plain = tiny_unet("sd15")
    plain._load_ip_adapter_weights([unet_ip_adapter_state_dict(plain)])
    unet = tiny_unet("sd15")
    tp.apply_tome(unet, ratio=ratio)
    # diffusers' `_load_ip_adapter_weights` makes the self-attention's new processors with
    # `attn_processors[name].__class__()`: they are the plain ones it sees, and ToMe wraps them again.
    unet._load_ip_adapter_weights([unet_ip_adapter_state_dict(unet)])
    assert tp.is_tome_applied(unet)
    assert unet.config.encoder_hid_dim_type == "ip_image_proj" and unet.encoder_hid_proj is not None
    block = unet.down_blocks[0].attentions[0].transformer_blocks[0]
    # The checks of diffusers' `test_load_ip_adapter`, `test_ip_adapter` and `test_ip_adapter_plus`:
    assert block.attn2.processor.__class__.__name__ in ("IPAdapterAttnProcessor", "IPAdapterAttnProcessor2_0")
    assert all(issubclass(type(attn.processor), ToMeProcessor) for attn in (block.attn1, block.attn2))
    assert block.attn1.processor.__class__ is AttnProcessor2_0
    assert all(isinstance(p, ToMeProcessor) for p in unet.attn_processors.values())
    crosses = [p for name, p in unet.attn_processors.items() if name.endswith("attn2.processor")]
    assert crosses and all(isinstance(p, IPAdapterAttnProcessor2_0) for p in crosses)
    # Around a processor with weights it is a submodule, as the IP-Adapter processor is without ToMe: the
    # weights keep their names in `state_dict()` and move with `.to()`.
    assert isinstance(block.attn2.processor, torch.nn.Module) and "processor" in block.attn2._modules
    assert unet.state_dict().keys() == plain.state_dict().keys()
    copy.deepcopy(plain).load_state_dict(unet.state_dict(), strict=True)  # and load both ways
    copy.deepcopy(unet).load_state_dict(plain.state_dict(), strict=True)
    assert any(".attn2.processor.to_k_ip." in key for key in unet.state_dict())
    unet.to(torch.float64)
    assert block.attn2.processor.to_k_ip[0].weight.dtype == torch.float64
    unet.to(torch.float32)

    inputs = unet_inputs(unet, batch=2)
    out, reference = unet_ip_forward(unet, inputs), unet_ip_forward(plain, inputs)
    assert torch.isfinite(out).all()
    if ratio == 0:
        assert torch.equal(out, reference)
    else:
        assert not torch.allclose(out, reference, atol=1e-5)
        expected = copy.deepcopy(plain)
        tp.apply_tome(expected, ratio=ratio)  # ToMe applied after loading: the same merges
        torch.testing.assert_close(out, unet_ip_forward(expected, inputs), rtol=0, atol=1e-6)
    tp.remove_tome(unet)
    assert torch.equal(unet_ip_forward(unet, inputs), reference)
    assert block.attn2.processor.__class__ is type(block.attn2.processor) is IPAdapterAttnProcessor2_0


def test_unet_ip_adapter_after_set_attn_processor_and_enable_tome(tmp_path):
    unet = tiny_unet("sd15")
    unet.set_attn_processor(ToMeProcessor(ratio=0.5))  # no inner processor: `__class__` is ToMeProcessor itself
    inputs = unet_inputs(unet, batch=2)
    run_unet(unet, *inputs)  # attached at the first forward
    unet._load_ip_adapter_weights([unet_ip_adapter_state_dict(unet)])
    assert tp.is_tome_applied(unet)
    attn2 = unet.down_blocks[0].attentions[0].transformer_blocks[0].attn2
    assert attn2.processor.__class__.__name__ == "IPAdapterAttnProcessor2_0"
    assert issubclass(type(attn2.processor), ToMeProcessor)
    assert torch.isfinite(unet_ip_forward(unet, inputs)).all()


@pytest.mark.parametrize("ratio", [0.0, 0.5])
def test_flux_ip_adapter_check_finds_the_ip_adapter_processors(ratio):
    plain = tiny_flux()
    plain._load_ip_adapter_weights([flux_ip_adapter_state_dict(plain)])
    model = tiny_flux()
    tp.apply_tome(model, ratio=ratio)
    model._load_ip_adapter_weights([flux_ip_adapter_state_dict(model)])
    assert tp.is_tome_applied(model)
    processors = model.attn_processors.values()
    # The check of diffusers' Flux IP-Adapter test:
    assert any(isinstance(p, FluxIPAdapterAttnProcessor) for p in processors)
    assert all(issubclass(type(p), ToMeProcessor) for p in processors)
    single = model.single_transformer_blocks[0].attn.processor
    assert single.__class__ is FluxAttnProcessor and not isinstance(single, FluxIPAdapterAttnProcessor)

    inputs = flux_inputs()
    out, reference = run_flux(model, inputs), run_flux(plain, inputs)
    assert torch.isfinite(out).all()
    if ratio == 0:
        assert torch.equal(out, reference)
    else:
        assert not torch.allclose(out, reference, atol=1e-5)
    tp.remove_tome(model)
    assert torch.equal(run_flux(model, inputs), reference)
