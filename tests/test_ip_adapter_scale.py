"""IP-Adapter scales with ToMe on: a write of `processor.scale` reaches the processor ToMe wraps.

diffusers finds IP-Adapter processors by `isinstance` and writes their `scale` (`set_ip_adapter_scale` on
FLUX and SD3, its own UNet tests); a `ToMeProcessor` answers that check for its inner processor, so the write
must land there. The UNet checks follow diffusers' `test_ip_adapter` / `test_ip_adapter_plus`: two adapters
loaded, the second one's scale set to 0, the output equals the first adapter's alone.
"""

from __future__ import annotations

import copy
import pickle
import types
import warnings

import pytest
import torch
from diffusers.loaders.ip_adapter import FluxIPAdapterMixin
from diffusers.models.attention_processor import Attention, AttnProcessor2_0, IPAdapterAttnProcessor2_0
from diffusers.models.embeddings import IPAdapterPlusImageProjection
from diffusers.models.transformers.transformer_flux import FluxIPAdapterAttnProcessor

import tome_processors as tp
from test_composition import EMBED_DIM, ip_adapter_state_dict
from test_default_inner import flux_ip_adapter_state_dict, flux_ip_call, forward
from tome_processors import ToMeProcessor

from models import CROSS_DIM, tiny_unet, unet_inputs
from test_dit import tiny_flux

#: The Resampler's width in the made-up IP-Adapter Plus (diffusers' loader reads heads as `to_q` rows / 64).
PLUS_HIDDEN = 16


def ip_adapter_plus_state_dict(unet: torch.nn.Module, seed: int = 0) -> dict:
    """A random IP-Adapter Plus (a Resampler of 4 layers to 4 tokens) for `unet`, in the checkpoint's key layout
    that diffusers' loader converts (`layers.{i}.0.to_kv`, `layers.{i}.1.{0,1,3}`, ...)."""
    torch.manual_seed(seed)
    resampler = IPAdapterPlusImageProjection(
        embed_dims=EMBED_DIM, output_dims=CROSS_DIM, hidden_dims=PLUS_HIDDEN, dim_head=64, heads=1, num_queries=4
    )
    weights = resampler.state_dict()
    image_proj: dict[str, torch.Tensor] = {}
    for key, value in weights.items():
        if not key.startswith("layers."):
            image_proj[key] = value
            continue
        _, layer, rest = key.split(".", 2)
        if rest.startswith("attn.to_v"):
            continue  # stored with to_k as one `to_kv`
        stored = {
            "ln0.": "0.norm1.",
            "ln1.": "0.norm2.",
            "attn.to_q.": "0.to_q.",
            "attn.to_out.0.": "0.to_out.",
            "ff.0.": "1.0.",
            "ff.1.net.0.proj.": "1.1.",
            "ff.1.net.2.": "1.3.",
        }
        if rest.startswith("attn.to_k"):
            value = torch.cat([value, weights[key.replace("to_k", "to_v")]])
            rest = rest.replace("attn.to_k", "0.to_kv")
        else:
            prefix = next(old for old in stored if rest.startswith(old))
            rest = stored[prefix] + rest[len(prefix) :]
        image_proj[f"layers.{layer}.{rest}"] = value
    return {"image_proj": image_proj, "ip_adapter": ip_adapter_state_dict(unet, seed)["ip_adapter"]}


def second_adapter(state: dict) -> dict:
    """Another adapter of the same shapes (every weight + 1, as diffusers' tests make theirs)."""
    return {part: {key: value + 1.0 for key, value in weights.items()} for part, weights in state.items()}


def load(unet: torch.nn.Module, states: list[dict]) -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        unet._load_ip_adapter_weights(states)


def embeds(kind: str, adapters: int, images: int = 1) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(9)
    one = torch.randn(2, 1, EMBED_DIM, generator=g) if kind == "plain" else torch.randn(2, 1, 1, EMBED_DIM, generator=g)
    repeat = (1, images, 1) if kind == "plain" else (1, images, 1, 1)
    return [one.repeat(*repeat)] * adapters


def run(unet: torch.nn.Module, image_embeds: list[torch.Tensor] | None) -> torch.Tensor:
    sample, timestep, text, _ = unet_inputs(unet)
    added = None if image_embeds is None else {"image_embeds": image_embeds}
    with torch.no_grad():
        return unet(sample, timestep, encoder_hidden_states=text, added_cond_kwargs=added).sample


def scale_experiment(kind: str, ratio: float | None) -> dict[str, torch.Tensor]:
    """diffusers' UNet IP-Adapter check, on a UNet with ToMe at `ratio` (None: without ToMe)."""
    unet = tiny_unet("sd15")
    if ratio is not None:
        tp.apply_tome(unet, ratio=ratio)
    first = ip_adapter_state_dict(unet) if kind == "plain" else ip_adapter_plus_state_dict(unet)
    second = second_adapter(first)
    out = {"none": run(unet, None)}
    load(unet, [first])
    out["first"] = run(unet, embeds(kind, 1))
    load(unet, [second])
    out["second"] = run(unet, embeds(kind, 1))
    load(unet, [first, second])
    for processor in unet.attn_processors.values():
        if isinstance(processor, IPAdapterAttnProcessor2_0):  # ToMe's processors answer for their inner one
            processor.scale = [1.0, 0.0]
    inners = [getattr(p, "inner", p) for p in unet.attn_processors.values()]
    assert all(p.scale == [1.0, 0.0] for p in inners if isinstance(p, IPAdapterAttnProcessor2_0))
    assert all("scale" not in vars(p) for p in unet.attn_processors.values() if isinstance(p, ToMeProcessor))
    out["both, second at 0"] = run(unet, embeds(kind, 2, images=2))
    return out


@pytest.mark.parametrize("kind", ["plain", "plus"])
@pytest.mark.parametrize("ratio", [0.0, 0.5])
def test_unet_ip_adapter_scale_written_on_the_processor_reaches_the_inner_one(kind, ratio):
    out = scale_experiment(kind, ratio)
    assert not torch.allclose(out["none"], out["first"], atol=1e-4, rtol=1e-4)
    assert not torch.allclose(out["first"], out["second"], atol=1e-4, rtol=1e-4)
    # The second adapter at scale 0 adds nothing: ignored, its full share would show.
    assert torch.allclose(out["both, second at 0"], out["first"], atol=1e-4, rtol=1e-4)
    if ratio == 0.0:  # ToMe at ratio 0 is the plain UNet, scale writes included
        plain = scale_experiment(kind, None)
        assert all(torch.equal(out[key], plain[key]) for key in plain)


def flux_with_adapter(ratio: float | None) -> torch.nn.Module:
    model = tiny_flux()
    if ratio is not None:
        tp.apply_tome(model, ratio=ratio)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model._load_ip_adapter_weights(flux_ip_adapter_state_dict(model))
    return model


def set_flux_scale(model: torch.nn.Module, scale: float) -> None:
    # FluxPipeline.set_ip_adapter_scale reads nothing of the pipeline but its transformer.
    FluxIPAdapterMixin.set_ip_adapter_scale(types.SimpleNamespace(transformer=model), scale)


@pytest.mark.parametrize("ratio", [0.0, 0.5])
def test_flux_set_ip_adapter_scale_changes_the_inner_scale_and_the_output(ratio):
    model, plain = flux_with_adapter(ratio), flux_with_adapter(None)
    full = forward(model, flux_ip_call())
    outputs = {1.0: full}
    for scale in (0.0, 0.4):
        set_flux_scale(model, scale)
        set_flux_scale(plain, scale)
        ip = [p for p in model.attn_processors.values() if isinstance(p, FluxIPAdapterAttnProcessor)]
        assert ip and all(isinstance(p, ToMeProcessor) and p.inner.scale == [scale] for p in ip)
        outputs[scale] = forward(model, flux_ip_call())
        if ratio == 0.0:
            assert torch.equal(outputs[scale], forward(plain, flux_ip_call()))
    assert not torch.allclose(outputs[0.0], full, atol=1e-5)
    assert not torch.allclose(outputs[0.4], outputs[0.0], atol=1e-5)


class ScaledProcessor:
    """A user's processor with a scale of its own."""

    def __init__(self) -> None:
        self.scale = 1.0

    def __call__(self, attn, hidden_states, encoder_hidden_states=None, attention_mask=None, temb=None):
        return AttnProcessor2_0()(attn, hidden_states, encoder_hidden_states, attention_mask, temb) * self.scale


def test_writes_and_deletes_of_other_names_reach_the_inner_processor_and_own_names_stay():
    inner = ScaledProcessor()
    processor = ToMeProcessor(inner, ratio=0.5)
    processor.scale = 2.0
    processor.note = "set by a user"
    assert inner.scale == 2.0 and inner.note == "set by a user" and processor.scale == 2.0
    assert "scale" not in vars(processor) and "note" not in vars(processor)
    del processor.note
    assert not hasattr(inner, "note") and not hasattr(processor, "note")
    config = tp.ToMeConfig(ratio=0.3)
    processor.config = config  # its own: stays on the wrapper
    assert processor.config is config and "config" not in vars(inner)
    for copied in (copy.deepcopy(processor), pickle.loads(pickle.dumps(processor))):
        assert copied.inner.scale == 2.0 and copied.scale == 2.0 and copied.config == config
        copied.scale = 3.0
        assert copied.inner.scale == 3.0 and inner.scale == 2.0
    attn = Attention(query_dim=8)
    x = torch.randn(1, 4, 8)
    with torch.no_grad():
        assert torch.allclose(processor(attn, x), 2.0 * AttnProcessor2_0()(attn, x))


def test_without_an_inner_processor_a_write_stays_and_goes_to_every_processor_it_builds():
    processor = ToMeProcessor()
    attn = Attention(query_dim=8)
    with torch.no_grad():
        processor(attn, torch.randn(1, 4, 8))  # a module outside any model: runs a processor built for it
    built = processor._built.get(attn)
    assert type(built) is AttnProcessor2_0
    processor.scale = 0.5
    assert processor.scale == 0.5 and built.scale == 0.5  # already built: handed on
    assert processor.built_inner(Attention(query_dim=8)).scale == 0.5  # built later: too
    del processor.scale
    assert not hasattr(processor, "scale")
