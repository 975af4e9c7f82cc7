"""apply_tome / remove_tome / ToMeProcessor on tiny random-weight UNets."""

from __future__ import annotations

import warnings

import pytest
import torch
from diffusers import AutoencoderKL
from diffusers.models.attention_processor import Attention, AttnProcessor, AttnProcessor2_0

import tome_processors as tp
from tome_processors import ToMeProcessor

from leftovers import hooks_left, tome_attributes_left
from models import run_unet, tiny_unet, unet_inputs
from pipelines import tiny_vae


@pytest.fixture
def unet():
    return tiny_unet("sd15")


def test_changes_output_and_remove_restores_bit_identical(unet):
    inputs = unet_inputs(unet, 2, 16, 24)
    processors = dict(unet.attn_processors)
    baseline = run_unet(unet, *inputs)

    tp.apply_tome(unet, ratio=0.5)
    merged = run_unet(unet, *inputs)
    assert tp.is_tome_applied(unet)
    assert all(isinstance(p, ToMeProcessor) for p in unet.attn_processors.values())
    assert not torch.allclose(merged, baseline, atol=1e-4)
    assert torch.isfinite(merged).all()

    tp.remove_tome(unet)
    assert torch.equal(run_unet(unet, *inputs), baseline)
    assert hooks_left(unet) == 0
    assert tome_attributes_left(unet) == []
    assert all(unet.attn_processors[k] is p for k, p in processors.items())
    assert not tp.is_tome_applied(unet)


def test_applying_twice_equals_applying_once(unet):
    inputs = unet_inputs(unet)
    tp.apply_tome(unet, ratio=0.4)
    once = run_unet(unet, *inputs)
    hooks_once = hooks_left(unet)
    tp.apply_tome(unet, ratio=0.4)
    assert hooks_left(unet) == hooks_once
    assert all(isinstance(p.inner, AttnProcessor2_0) for p in unet.attn_processors.values())
    assert torch.equal(run_unet(unet, *inputs), once)


def test_set_attn_processor_alone_matches_apply_tome(unet):
    inputs = unet_inputs(unet, 2, 20, 12)  # not square
    tp.apply_tome(unet, ratio=0.5)
    expected = run_unet(unet, *inputs)
    tp.remove_tome(unet)

    unet.set_attn_processor(ToMeProcessor(ratio=0.5))
    assert torch.equal(run_unet(unet, *inputs), expected)
    assert tp.is_tome_applied(unet)
    tp.remove_tome(unet)
    assert hooks_left(unet) == 0 and tome_attributes_left(unet) == []


def test_set_attn_processor_first_call_by_keyword_merges_at_once(unet):
    inputs = unet_inputs(unet)
    baseline = run_unet(unet, *inputs)
    tp.apply_tome(unet)
    expected = run_unet(unet, *inputs)
    tp.remove_tome(unet)

    unet.set_attn_processor(ToMeProcessor())
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # nothing to warn about: the first forward merges
        first = run_unet(unet, *inputs, keyword=True)
    assert not torch.equal(first, baseline)
    assert torch.equal(first, expected)
    assert torch.equal(run_unet(unet, *inputs, keyword=True), expected)
    tp.remove_tome(unet)
    assert all(not m._forward_pre_hooks for m in (unet, unet.conv_in, unet.time_proj))
    assert torch.equal(run_unet(unet, *inputs, keyword=True), baseline)


def test_keyword_and_positional_calls_agree(unet):
    inputs = unet_inputs(unet, 2, 16, 16)
    tp.apply_tome(unet)
    assert torch.equal(run_unet(unet, *inputs, keyword=True), run_unet(unet, *inputs))


def test_nothing_leaks_between_forwards_of_different_sizes(unet):
    shapes = [(2, 16, 16), (1, 12, 20), (3, 15, 13), (2, 8, 8), (2, 16, 16)]
    tp.apply_tome(unet, ratio=0.5)
    expected = []
    for shape in shapes:  # each on a freshly applied model
        tp.apply_tome(unet, ratio=0.5)
        expected.append(run_unet(unet, *unet_inputs(unet, *shape)))
    tp.apply_tome(unet, ratio=0.5)
    for shape, want in zip(shapes, expected, strict=True):
        assert torch.equal(run_unet(unet, *unet_inputs(unet, *shape)), want)


def test_random_destinations_are_reproducible_and_leave_global_rng_alone(unet):
    inputs = unet_inputs(unet)
    tp.apply_tome(unet, ratio=0.5, use_rand=True, seed=3)
    state = torch.get_rng_state()
    first = run_unet(unet, *inputs)
    second = run_unet(unet, *inputs)
    assert torch.equal(torch.get_rng_state(), state)
    assert torch.equal(first, second)

    tp.apply_tome(unet, ratio=0.5, use_rand=True, seed=4)
    assert not torch.equal(run_unet(unet, *inputs), first)
    tp.apply_tome(unet, ratio=0.5, use_rand=False)
    assert not torch.equal(run_unet(unet, *inputs), first)


def test_timestep_as_number_or_tensor_gives_the_same_merge(unet):
    sample, _, text, added = unet_inputs(unet)
    tp.apply_tome(unet, ratio=0.5, use_rand=True)
    base = run_unet(unet, sample, torch.tensor(500), text)
    tp.apply_tome(unet, ratio=0.5, use_rand=True)
    other = run_unet(unet, sample, 500.0, text)  # a number works as well as a tensor
    assert torch.equal(base, other)


class RecordingProcessor:
    """A user's processor with a keyword argument of its own."""

    def __init__(self):
        self.token_counts: list[int] = []
        self.gains: list[float] = []

    def __call__(self, attn, hidden_states, encoder_hidden_states=None, attention_mask=None, temb=None, gain=1.0):
        self.token_counts.append(hidden_states.shape[1])
        self.gains.append(gain)
        return AttnProcessor2_0()(attn, hidden_states, encoder_hidden_states, attention_mask, temb) * gain


def test_inner_processor_is_kept_and_gets_its_keyword_arguments(unet):
    recorder = RecordingProcessor()
    unet.set_attn_processor(recorder)
    sample, t, text, _ = unet_inputs(unet, 2, 16, 16)
    tp.apply_tome(unet, ratio=0.5)
    assert all(p.inner is recorder for p in unet.attn_processors.values())
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # diffusers warns when it drops an unknown keyword argument
        with torch.no_grad():
            unet(sample, t, encoder_hidden_states=text, cross_attention_kwargs={"gain": 0.5})
    assert recorder.gains and set(recorder.gains) == {0.5}
    # Self-attention at the full level (256 tokens) ran on 128 merged tokens; cross-attention unmerged.
    assert 128 in recorder.token_counts and 256 in recorder.token_counts
    tp.remove_tome(unet)
    assert all(p is recorder for p in unet.attn_processors.values())


def test_sdxl_is_merged_by_default_and_warns_when_told_to_skip_its_levels():
    unet = tiny_unet("sdxl")
    inputs = unet_inputs(unet)
    baseline = run_unet(unet, *inputs)
    tp.apply_tome(unet)
    assert not torch.allclose(run_unet(unet, *inputs), baseline, atol=1e-4)
    with pytest.warns(UserWarning, match="merges nothing"):
        tp.apply_tome(unet, max_downsample=1)
    assert torch.equal(run_unet(unet, *inputs), baseline)


def test_vae_attention_passes_straight_through():
    vae = tiny_vae()
    x = torch.randn(2, 3, 32, 32)
    with torch.no_grad():
        baseline = vae(x).sample
        vae.set_attn_processor(ToMeProcessor(ratio=0.75))
        assert torch.equal(vae(x).sample, baseline)
    assert any(isinstance(m, Attention) for m in vae.modules())


def test_model_without_spatial_attention_is_refused_before_anything_changes():
    vae = AutoencoderKL(norm_num_groups=8, block_out_channels=(16,), latent_channels=4)
    processors = dict(vae.attn_processors)
    with pytest.raises(ValueError, match="AutoencoderKL"):
        tp.apply_tome(vae)
    assert dict(vae.attn_processors) == processors and hooks_left(vae) == 0
    with pytest.raises(ValueError, match="Linear"):
        tp.apply_tome(torch.nn.Linear(2, 2))
    with pytest.raises(TypeError, match="pipeline"):
        tp.apply_tome(object())


def test_bad_options_raise_before_anything_changes(unet):
    inputs = unet_inputs(unet)
    baseline = run_unet(unet, *inputs)
    with pytest.raises(ValueError, match="Expected ratio"):
        tp.apply_tome(unet, ratio=0.9)
    with pytest.raises(TypeError, match="unknown"):
        tp.apply_tome(unet, ratoi=0.5)
    assert hooks_left(unet) == 0 and torch.equal(run_unet(unet, *inputs), baseline)


def test_processor_defaults_and_nesting():
    processor = ToMeProcessor()
    assert processor.inner is None  # each module's own processor, set at its first call (test_default_inner.py)
    assert processor.config == tp.ToMeConfig()
    wrapped = ToMeProcessor(ToMeProcessor(AttnProcessor()), ratio=0.3)
    assert isinstance(wrapped.inner, AttnProcessor) and wrapped.config.ratio == 0.3
    with pytest.raises(TypeError, match="callable"):
        ToMeProcessor(inner=3)


def test_pipeline_object_is_accepted():
    class FakePipeline:
        def __init__(self, unet):
            self.unet = unet

    unet = tiny_unet("sd15")
    pipe = FakePipeline(unet)
    assert tp.apply_tome(pipe) is pipe
    assert tp.is_tome_applied(pipe)
    tp.remove_tome(pipe)
    assert not tp.is_tome_applied(unet)


def test_set_attn_processor_that_merges_nothing_warns():
    unet = tiny_unet("sdxl")
    unet.set_attn_processor(ToMeProcessor(max_downsample=1))
    with pytest.warns(UserWarning, match="merges nothing"):
        run_unet(unet, *unet_inputs(unet))


def test_assigning_a_processor_directly_works_while_tome_is_on(unet):
    # As without ToMe: a processor without weights is a plain attribute (PAG pipelines assign them so).
    tp.apply_tome(unet, ratio=0.5)
    attn = unet.down_blocks[0].attentions[0].transformer_blocks[0].attn1
    assert "processor" not in attn._modules
    own = AttnProcessor2_0()
    attn.processor = own
    assert attn.processor is own and tp.is_tome_applied(unet)
    tp.remove_tome(unet)
    assert attn.processor is own
