"""Attaching without a process-wide hook, standing down by itself, where the context lives."""

from __future__ import annotations

import copy
import pickle

import pytest
import torch
from diffusers.hooks import HookRegistry
from diffusers.models.attention_processor import AttnProcessor, AttnProcessor2_0
from torch.nn.modules import module as torch_module

import tome_processors as tp
from tome_processors import ToMeProcessor
from tome_processors.hooks import attention_modules, context_of

from models import run_unet, tiny_unet, unet_inputs
from pipelines import tiny_vae
from test_dit import pixart_inputs, run, tiny_pixart


def leftovers(model: torch.nn.Module) -> list[str]:
    """Everything ToMe could leave on a model that never had hooks: torch hooks, registries, forwards, attributes."""
    found = []
    for name, m in model.named_modules():
        found += [f"{name}: hook"] * (len(m._forward_pre_hooks) + len(m._forward_hooks))
        found += [f"{name}.{attr}" for attr in vars(m) if attr.startswith("_tome")]
        found += [f"{name}.{attr}" for attr in ("forward", "_diffusers_hook") if attr in vars(m)]
    return found


def global_hooks() -> int:
    return sum(
        len(hooks)
        for hooks in (
            torch_module._global_forward_pre_hooks,
            torch_module._global_forward_hooks,
            torch_module._global_backward_pre_hooks,
            torch_module._global_backward_hooks,
        )
    )


@pytest.fixture
def unet():
    return tiny_unet("sd15")


def test_a_new_processor_installs_nothing_process_wide(unet):
    before = global_hooks()
    processor = ToMeProcessor(ratio=0.5)
    other = tiny_unet("sd15", seed=1)
    inputs = unet_inputs(other)
    baseline = run_unet(other, *inputs)
    assert global_hooks() == before
    assert torch.equal(run_unet(other, *inputs), baseline) and leftovers(other) == []
    unet.set_attn_processor(processor)
    run_unet(unet, *unet_inputs(unet))
    assert global_hooks() == before and tp.is_tome_applied(unet)
    assert leftovers(other) == []  # the other model was never touched


@pytest.mark.parametrize("keyword", [False, True])
def test_first_forward_after_set_attn_processor_merges_as_apply_tome(unet, keyword):
    inputs = unet_inputs(unet, 2, 20, 12)
    baseline = run_unet(unet, *inputs)
    tp.apply_tome(unet, ratio=0.5, use_rand=True, merge_mlp=True)
    expected = run_unet(unet, *inputs)  # random destinations keyed by the timestep: it must be seen
    tp.remove_tome(unet)
    assert leftovers(unet) == []

    unet.set_attn_processor(ToMeProcessor(ratio=0.5, use_rand=True, merge_mlp=True))
    assert not tp.is_tome_applied(unet)
    first = run_unet(unet, *inputs, keyword=keyword)
    assert not torch.equal(first, baseline)
    assert torch.equal(first, expected)
    assert torch.equal(run_unet(unet, *inputs, keyword=keyword), expected)
    tp.remove_tome(unet)
    assert leftovers(unet) == [] and torch.equal(run_unet(unet, *inputs), baseline)


@pytest.mark.parametrize("how", ["set_attn_processor", "apply_tome"])
def test_context_stands_down_when_no_tome_processor_is_left(unet, how):
    inputs = unet_inputs(unet)
    baseline = run_unet(unet, *inputs)
    if how == "apply_tome":
        tp.apply_tome(unet, ratio=0.5, merge_mlp=True)
    else:
        unet.set_attn_processor(ToMeProcessor(ratio=0.5, merge_mlp=True))
    merged = run_unet(unet, *inputs)
    assert not torch.equal(merged, baseline) and leftovers(unet) != []

    unet.set_attn_processor(AttnProcessor2_0())
    assert not tp.is_tome_applied(unet)  # off at once; the hooks go at the next forward
    assert torch.equal(run_unet(unet, *inputs), baseline)  # that forward is already plain
    assert not tp.is_tome_applied(unet)
    assert leftovers(unet) == []  # nothing of ToMe runs any more
    assert torch.equal(run_unet(unet, *inputs), baseline)

    unet.set_attn_processor(ToMeProcessor(ratio=0.5, merge_mlp=True))  # and it can come back
    assert torch.equal(run_unet(unet, *inputs), merged)


def test_context_stays_while_some_module_holds_a_tome_processor(unet):
    inputs = unet_inputs(unet)
    tp.apply_tome(unet, ratio=0.5)
    first = attention_modules(unet)[0]
    first.set_processor(AttnProcessor2_0())  # the module the check looks at first
    tp_out = run_unet(unet, *inputs)
    assert tp.is_tome_applied(unet)
    for attn in attention_modules(unet)[1:]:
        attn.set_processor(AttnProcessor2_0())
    plain = run_unet(unet, *inputs)
    assert not torch.equal(tp_out, plain) and not tp.is_tome_applied(unet) and leftovers(unet) == []


def test_direct_replacement_under_enable_tome_is_wrapped_again_before_the_check(unet):
    class FakePipeline:
        def __init__(self, unet):
            self.unet = unet

    inputs = unet_inputs(unet)
    pipe = tp.enable_tome(FakePipeline(unet), ratio=0.5)
    merged = run_unet(unet, *inputs)
    for attn in attention_modules(unet):  # past every model-level API: only the keeper's pre-hook sees it
        attn.set_processor(AttnProcessor())
    assert torch.allclose(run_unet(unet, *inputs), merged, atol=1e-5)
    assert tp.is_tome_applied(unet)
    assert {type(p.inner) for p in unet.attn_processors.values()} == {AttnProcessor}
    tp.disable_tome(pipe)
    assert leftovers(unet) == []


def test_context_lives_in_the_models_pre_hook_and_no_registry_is_made(unet):
    inputs = unet_inputs(unet)
    tp.apply_tome(unet, ratio=0.5, recompute_every=2)
    # A diffusers HookRegistry entry would rewrite `forward` with a function bound to this module, which a
    # deep copy keeps calling (issue 25): the context sits in a torch pre-hook object instead.
    assert "_diffusers_hook" not in vars(unet) and "forward" not in vars(unet)
    run_unet(unet, *inputs)
    context = context_of(unet)
    assert context is not None and context.model_state.latent_hw == (16, 16) and context.model_state.kept
    tp.new_generation(unet)
    assert context.model_state.latent_hw is None and context.model_state.kept == {}
    assert all(block.metric is None and block.merge is None for block in context.blocks)


def test_removal_keeps_a_registry_that_was_there_before(unet):
    inputs = unet_inputs(unet)
    baseline = run_unet(unet, *inputs)
    registry = HookRegistry.check_if_exists_or_initialize(unet)
    tp.apply_tome(unet)
    assert unet._diffusers_hook is registry and registry.hooks == {}
    assert not torch.equal(run_unet(unet, *inputs), baseline)
    tp.remove_tome(unet)
    assert unet._diffusers_hook is registry and registry.hooks == {}
    assert "forward" not in vars(unet) and torch.equal(run_unet(unet, *inputs), baseline)


def test_removal_keeps_a_forward_wrapped_over_ours(unet):
    inputs = unet_inputs(unet)
    baseline = run_unet(unet, *inputs)
    tp.apply_tome(unet)
    merged = run_unet(unet, *inputs)
    ours = unet.forward
    calls = []

    def wrapper(*args, **kwargs):  # as accelerate's offload hook wraps `forward`
        calls.append(1)
        return ours(*args, **kwargs)

    unet.forward = wrapper
    assert torch.equal(run_unet(unet, *inputs), merged)
    tp.remove_tome(unet)
    assert unet.forward is wrapper
    assert torch.equal(run_unet(unet, *inputs), baseline) and len(calls) == 2


def test_unmergeable_attention_is_remembered_and_passed_through():
    vae = tiny_vae()
    x = torch.randn(1, 3, 32, 32)
    processor = ToMeProcessor(ratio=0.5)
    with torch.no_grad():
        baseline = vae(x).sample
        vae.set_attn_processor(processor)
        assert torch.equal(vae(x).sample, baseline)
    attentions = attention_modules(vae)
    assert attentions and all(attn in processor._passed_through for attn in attentions)
    assert leftovers(vae) == []
    for clone in (copy.deepcopy(processor), pickle.loads(pickle.dumps(processor))):
        assert not any(attn in clone._passed_through for attn in attentions)  # copies start empty


def test_processor_called_outside_a_model_passes_through(unet):
    attn = attention_modules(unet)[0]
    processor = ToMeProcessor(ratio=0.5)
    attn.set_processor(processor)
    x = torch.randn(2, 256, attn.query_dim)
    with torch.no_grad():
        out = attn(x)
        attn.set_processor(AttnProcessor2_0())
        assert torch.equal(out, attn(x))
    assert attn not in processor._passed_through and leftovers(unet) == []


def test_compiled_first_call_attaches_before_tracing_and_merges_in_one_graph():
    model, inputs = tiny_pixart(), pixart_inputs()  # the smallest model to trace
    reference = tiny_pixart()
    baseline = run(reference, inputs)
    tp.apply_tome(reference, ratio=0.5)
    expected = run(reference, inputs)
    torch._dynamo.reset()
    model.set_attn_processor(ToMeProcessor(ratio=0.5))  # made after the reset: dynamo calls ToMe before tracing
    try:
        compiled = torch.compile(model, backend="eager", fullgraph=True)  # fullgraph: a graph break raises
        merged = run(compiled, inputs)
        assert tp.is_tome_applied(model) and not torch.allclose(merged, baseline, atol=1e-5)
        torch.testing.assert_close(merged, expected, rtol=1e-4, atol=1e-5)
        tp.remove_tome(model)
        assert leftovers(model) == []
    finally:
        torch._dynamo.reset()
