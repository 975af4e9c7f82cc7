"""`ToMeProcessor()` without an inner processor: each module runs the processor its model builds it with.

Also every other path that makes or swaps processors with such a processor there: IP-Adapter loading
(diffusers re-creates processors by class, with no arguments), `set_default_attn_processor`,
`fuse_qkv_projections`, `set_attention_backend`.
"""

from __future__ import annotations

import copy
import warnings

import pytest
import torch
from diffusers.models.attention_dispatch import AttentionBackendName
from diffusers.models.attention_processor import (
    AttnProcessor,
    AttnProcessor2_0,
    IPAdapterAttnProcessor2_0,
    JointAttnProcessor2_0,
)
from diffusers.models.transformers.transformer_flux import FluxAttnProcessor, FluxIPAdapterAttnProcessor

import tome_processors as tp
from test_composition import EMBED_DIM, ip_adapter_state_dict
from test_wan_derivatives import tiny_skyreels_v2, tiny_wan_vace, vace_inputs
from tome_processors import ToMeConfig, ToMeProcessor
from tome_processors.apply import inner_processor
from tome_processors.families import FAMILIES, find_family
from tome_processors.hooks import attention_modules

from family_cases import CASES as TABLE_CASES
from models import run_unet, tiny_unet, unet_inputs
from pipelines import svd_inputs, tiny_svd_unet
from test_dit import TEXT_DIM, flux_inputs, pixart_inputs, sd3_inputs, tiny_flux, tiny_pixart, tiny_sd3
from test_hunyuanvideo import hunyuanvideo15_inputs, hunyuanvideo_inputs, tiny_hunyuanvideo, tiny_hunyuanvideo15
from test_ltx import ltx_inputs, tiny_ltx
from test_ltx2 import ltx2_inputs, tiny_ltx2
from test_new_families import CASES
from test_video import tiny_wan, wan_inputs

#: One case of each new image family (tests/test_new_families.py).
NEW_FAMILY_CASES = ("qwenimage", "flux2", "chroma", "zimage")

#: A tiny model of every family, with its call. A family added to FAMILIES needs a row here.
MODELS = {
    "unet": (
        lambda: tiny_unet("sd15"),
        lambda model: dict(zip(("sample", "timestep", "encoder_hidden_states"), unet_inputs(model)[:3], strict=True)),
    ),
    "pixart": (tiny_pixart, lambda model: pixart_inputs()),
    "sd3": (tiny_sd3, lambda model: sd3_inputs()),  # with SD3.5's dual attention in block 0
    "flux": (tiny_flux, lambda model: flux_inputs()),
    "svd": (tiny_svd_unet, lambda model: svd_inputs()),
    "wan": (tiny_wan, lambda model: wan_inputs()),
    "skyreels_v2": (tiny_skyreels_v2, lambda model: wan_inputs()),
    "wan_vace": (tiny_wan_vace, lambda model: vace_inputs()),
    "ltx": (tiny_ltx, lambda model: ltx_inputs()),
    "ltx2": (tiny_ltx2, lambda model: ltx2_inputs()),
    "hunyuanvideo": (tiny_hunyuanvideo, lambda model: hunyuanvideo_inputs()),
    "hunyuanvideo15": (tiny_hunyuanvideo15, lambda model: hunyuanvideo15_inputs()),
    **{name: (CASES[name].build, lambda model, name=name: CASES[name].inputs()) for name in NEW_FAMILY_CASES},
}
# Every other family from the family table (tests/family_cases/): its first case.
for _case in TABLE_CASES.values():
    MODELS.setdefault(_case.family, (_case.build, lambda model, case=_case: case.inputs()))
#: Families whose models have no `set_attn_processor` (`apply_tome` is the way).
WITHOUT_SET_ATTN_PROCESSOR = {"zimage"} | {case.family for case in TABLE_CASES.values() if not case.set_attn_processor}


def forward(model: torch.nn.Module, inputs: dict) -> torch.Tensor:
    with torch.no_grad():
        out = model(**inputs)
    return out.sample if hasattr(out, "sample") else out[0]


def test_every_family_knows_the_processor_its_attention_is_built_with():
    assert set(MODELS) == set(FAMILIES)
    for name, (build, _) in MODELS.items():
        model = build()
        family = find_family(model)
        assert family is not None and family.name == name
        for attn in attention_modules(model):
            assert family.built_processor(model, attn) is type(attn.processor), (name, type(attn).__name__)


@pytest.mark.parametrize("ratio", [0.0, 0.5])
@pytest.mark.parametrize("family", sorted(MODELS))
def test_set_attn_processor_alone_works_on_every_family(family, ratio):
    build, call = MODELS[family]
    model = build()
    if not hasattr(model, "set_attn_processor"):  # Z-Image's transformer has none: apply_tome is the way
        assert family in WITHOUT_SET_ATTN_PROCESSOR
        return
    inputs = call(model)
    plain = forward(model, inputs)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # ratio 0 merges nothing, and says so
        tp.apply_tome(model, ratio=ratio)
        expected = forward(model, inputs)
        tp.remove_tome(model)
        model.set_attn_processor(ToMeProcessor(ratio=ratio))
        first = forward(model, inputs)
    assert torch.equal(first, expected) and torch.equal(forward(model, inputs), expected)
    assert torch.equal(first, plain) == (ratio == 0)
    # Modules ToMe merges nothing in (SVD's temporal attention) keep `inner=None` and run the built-with one.
    built = {type(inner_processor(model, attn)) for attn in attention_modules(model)}
    assert built == {type(p) for p in dict(build().attn_processors).values()}
    tp.remove_tome(model)
    assert torch.equal(forward(model, inputs), plain)
    assert {type(p) for p in model.attn_processors.values()} == built  # the built-with processors back


def test_remove_before_the_first_call_puts_the_built_processors_back():
    model = tiny_sd3()
    model.set_attn_processor(ToMeProcessor(ratio=0.5))
    tp.remove_tome(model)
    assert {type(p) for p in model.attn_processors.values()} == {JointAttnProcessor2_0}


def test_a_module_whose_processor_cannot_be_told_raises_before_running():
    model = tiny_sd3()
    block = model.transformer_blocks[0]
    block.attn.set_processor(ToMeProcessor(ratio=0.5))
    hidden = torch.randn(1, 16, 16)
    text = torch.randn(1, 5, 16)
    temb = torch.randn(1, 16)
    # Called outside its model: no family tells that SD3 builds it with JointAttnProcessor2_0.
    with pytest.raises(ValueError, match=r"Expected ToMeProcessor to know the processor.*Pass it"):
        block(hidden, text, temb)
    block.attn.set_processor(ToMeProcessor(JointAttnProcessor2_0(), ratio=0.5))  # what the error asks for
    with torch.no_grad():
        out = block(hidden, text, temb)
    block.attn.set_processor(JointAttnProcessor2_0())
    with torch.no_grad():
        assert torch.equal(out[1], block(hidden, text, temb)[1])  # outside a model: nothing merged


def test_processor_made_with_no_arguments_takes_the_configuration_on_the_model():
    model, inputs = tiny_pixart(), pixart_inputs()
    tp.apply_tome(model, ratio=0.3, use_rand=False)
    expected = forward(model, inputs)
    model.set_attn_processor(ToMeProcessor())  # as diffusers re-creates processors by class
    assert torch.equal(forward(model, inputs), expected)
    assert all(attn.processor.config == ToMeConfig(ratio=0.3, use_rand=False) for attn in attention_modules(model))
    model.set_attn_processor(ToMeProcessor(ratio=0.5))  # a configuration of its own is its own
    assert not torch.equal(forward(model, inputs), expected)
    assert all(attn.processor.config.ratio == 0.5 for attn in attention_modules(model))


# ---------------------------------------------------------------- IP-Adapter loaded after ToMe


def unet_ip_call(unet) -> dict:
    sample, timestep, text, _ = unet_inputs(unet)
    embeds = torch.randn(2, 1, EMBED_DIM, generator=torch.Generator().manual_seed(9))
    return dict(
        sample=sample, timestep=timestep, encoder_hidden_states=text, added_cond_kwargs={"image_embeds": [embeds]}
    )


def load_unet_ip_adapter(unet) -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        unet._load_ip_adapter_weights([ip_adapter_state_dict(unet)])


@pytest.mark.parametrize("ratio", [0.0, 0.5])
def test_ip_adapter_loaded_after_tome_on_the_unet(ratio):
    plain = tiny_unet("sd15")
    load_unet_ip_adapter(plain)
    inputs = unet_ip_call(plain)
    ip_only = forward(plain, inputs)
    before = tiny_unet("sd15")  # IP-Adapter first, then ToMe
    load_unet_ip_adapter(before)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        tp.apply_tome(before, ratio=ratio)
        expected = forward(before, inputs)

        unet = tiny_unet("sd15")  # ToMe first, then the IP-Adapter, as `pipe.load_ip_adapter` does it
        tp.apply_tome(unet, ratio=ratio)
        load_unet_ip_adapter(unet)
        out = forward(unet, inputs)
    assert torch.isfinite(out).all()
    assert torch.equal(out, expected) and torch.equal(forward(unet, inputs), expected)
    assert torch.equal(out, ip_only) == (ratio == 0)
    # ToMe keeps wrapping through the loading (keeper.py): the same processors as loading first.
    processors = dict(unet.attn_processors)
    assert all(isinstance(p, ToMeProcessor) for p in processors.values())
    assert {type(p.inner) for p in processors.values()} == {AttnProcessor2_0, IPAdapterAttnProcessor2_0}
    assert all(p.config.ratio == ratio for p in processors.values())
    assert {n: type(p.inner) for n, p in processors.items()} == {
        n: type(p.inner) for n, p in before.attn_processors.items()
    }


def flux_ip_adapter_state_dict(model, seed: int = 0) -> dict:
    """A random Flux IP-Adapter (a linear image projection to 4 tokens, K/V weights per double block)."""
    g = torch.Generator().manual_seed(seed)
    cross, hidden = model.config.joint_attention_dim, model.inner_dim
    image_proj = {
        "proj.weight": torch.randn(4 * cross, EMBED_DIM, generator=g) * 0.3,
        "proj.bias": torch.zeros(4 * cross),
        "norm.weight": torch.ones(cross),
        "norm.bias": torch.zeros(cross),
    }
    ip_adapter = {}
    for key_id in range(len(model.transformer_blocks)):
        for name in ("to_k_ip", "to_v_ip"):
            ip_adapter[f"{key_id}.{name}.weight"] = torch.randn(hidden, cross, generator=g) * 0.3
            ip_adapter[f"{key_id}.{name}.bias"] = torch.zeros(hidden)
    return {"image_proj": image_proj, "ip_adapter": ip_adapter}


def flux_ip_call() -> dict:
    embeds = torch.randn(2, 1, EMBED_DIM, generator=torch.Generator().manual_seed(9))
    return dict(flux_inputs(), joint_attention_kwargs={"ip_adapter_image_embeds": [embeds]})


def flux_forward(model) -> torch.Tensor:
    return forward(model, flux_ip_call())  # fresh kwargs: the model pops the embeddings from them


@pytest.mark.parametrize("ratio", [0.0, 0.5])
def test_ip_adapter_loaded_after_tome_on_flux(ratio):
    plain = tiny_flux()
    plain._load_ip_adapter_weights(flux_ip_adapter_state_dict(plain))
    ip_only = flux_forward(plain)
    model = tiny_flux()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        tp.apply_tome(model, ratio=ratio)
        model._load_ip_adapter_weights(flux_ip_adapter_state_dict(model))  # as FluxPipeline.load_ip_adapter does
        out = flux_forward(model)  # raised AttributeError 'FluxAttention' object has no attribute 'spatial_norm'
    assert torch.isfinite(out).all() and torch.equal(flux_forward(model), out)
    assert torch.equal(out, ip_only) == (ratio == 0)
    processors = dict(model.attn_processors)
    single = [p for name, p in processors.items() if name.startswith("single_transformer_blocks")]
    assert single and all(type(p.inner) is FluxAttnProcessor and p.config.ratio == ratio for p in single)
    double = [p for name, p in processors.items() if name.startswith("transformer_blocks")]
    assert double and all(type(p.inner) is FluxIPAdapterAttnProcessor for p in double)  # ToMe stays around them
    before = tiny_flux()  # IP-Adapter first, then ToMe: the same
    before._load_ip_adapter_weights(flux_ip_adapter_state_dict(before))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        tp.apply_tome(before, ratio=ratio)
    assert torch.equal(flux_forward(before), out)
    assert TEXT_DIM == model.config.joint_attention_dim


# ---------------------------------------------------------------- other paths that swap processors


def test_set_default_attn_processor_with_a_processor_set_alone():
    model, inputs = tiny_pixart(), pixart_inputs()
    model.set_attn_processor(ToMeProcessor(ratio=0.5))
    merged = forward(model, inputs)
    model.set_default_attn_processor()  # diffusers' own swap after the first forward: ToMe stays around it
    out = forward(model, inputs)
    assert tp.is_tome_applied(model) and {type(p.inner) for p in model.attn_processors.values()} == {AttnProcessor}
    torch.testing.assert_close(out, merged, rtol=1e-4, atol=1e-5)
    reference = tiny_pixart()
    reference.set_default_attn_processor()
    tp.apply_tome(reference, ratio=0.5)
    assert torch.equal(out, forward(reference, inputs))

    unet = tiny_unet("sd15")  # the UNet's checks the plain processors, as without ToMe
    inputs = unet_inputs(unet)
    unet.set_attn_processor(ToMeProcessor(ratio=0.5))
    merged = run_unet(unet, *inputs)
    unet.set_default_attn_processor()
    assert {type(p.inner) for p in unet.attn_processors.values()} == {AttnProcessor}
    torch.testing.assert_close(run_unet(unet, *inputs), merged, rtol=1e-4, atol=1e-5)


# Not SD3 here: diffusers' fused joint processor fails on SD3.5's image-only second attention, ToMe or not.
@pytest.mark.parametrize("family", ["unet", "pixart", "flux"])
def test_fuse_and_unfuse_qkv_projections_with_a_processor_set_alone(family):
    build, call = MODELS[family]
    model = build()
    inputs = call(model)
    model.set_attn_processor(ToMeProcessor(ratio=0.5))
    merged = forward(model, inputs)
    model.fuse_qkv_projections()
    assert torch.isfinite(forward(model, inputs)).all()
    model.unfuse_qkv_projections()
    torch.testing.assert_close(forward(model, inputs), merged)


def test_set_attention_backend_before_the_first_call_reaches_the_built_processors():
    model, inputs = tiny_flux(), flux_inputs()
    tp.apply_tome(model, ratio=0.5)
    expected = forward(model, inputs)
    tp.remove_tome(model)
    model.set_attn_processor(ToMeProcessor(ratio=0.5))
    model.set_attention_backend("native")
    torch.testing.assert_close(forward(model, inputs), expected)
    inners = [p.inner for p in model.attn_processors.values()]
    assert all(type(p) is FluxAttnProcessor and p._attention_backend == AttentionBackendName.NATIVE for p in inners)
    model.reset_attention_backend()
    assert all(p._attention_backend is None for p in inners)


def test_copies_of_a_processor_without_inner_start_empty():
    processor = ToMeProcessor(ratio=0.5)
    model, inputs = tiny_pixart(), pixart_inputs()
    processor.built_inner(attention_modules(model)[0])
    clone = copy.deepcopy(processor)
    assert clone.inner is None and clone.config == processor.config and len(clone._built._processors) == 0
    model.set_attn_processor(clone)
    assert torch.isfinite(forward(model, inputs)).all()
