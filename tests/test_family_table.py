"""Every family of the table (`tests/family_cases/`) through the same checks, as a user runs it.

On the tiny model: ToMe at 0.5 merges in the declared attention calls (the attention kernel gets fewer tokens) and
changes the output, finite; ratio 0 and `remove_tome` give the plain model's output bit for bit; a batch of two
equals two batches of one (each sample keeps its own merge and rotary positions); each preset merges; the forward
reads nothing back from the device and adds at most 60 aten ops per merged attention. On the tiny pipeline: a
whole call twice with one seed, with `apply_tome`, with `set_attn_processor(ToMeProcessor(...))` where the model
has it, and with `pipe.enable_tome()`; the same image both times, another than without ToMe, and the plain image
back after removal; `explain_tome` counts the tokens the model gets at the call's size.
"""

from __future__ import annotations

import collections
from typing import Any

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

import tome_processors as tp
from tome_processors.apply import denoiser_of
from tome_processors.families import family_of

from family_cases import CASES, FamilyCase

SYNC_OPS = {"_local_scalar_dense", "item", "nonzero", "is_nonzero", "equal", "lift_fresh"}
#: At most this many aten ops added per merged attention call (the hot path's budget per merged block).
MAX_OPS_PER_MERGE = 60


class AttentionRecorder(TorchDispatchMode):
    """Records `(query tokens, key tokens)` of every attention kernel call, and counts every aten op by name."""

    def __init__(self) -> None:
        super().__init__()
        self.calls: list[tuple[int, int]] = []
        self.ops: collections.Counter[str] = collections.Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func.overloadpacket.__name__
        self.ops[name] += 1
        if "scaled_dot_product" in name:
            self.calls.append((int(args[0].shape[-2]), int(args[1].shape[-2])))
        return func(*args, **(kwargs or {}))


def forward(case: FamilyCase, model: torch.nn.Module, inputs: dict) -> torch.Tensor:
    with torch.no_grad():
        return case.output(model(**inputs))


def recorded(case: FamilyCase, model: torch.nn.Module, inputs: dict) -> tuple[torch.Tensor, AttentionRecorder]:
    recorder = AttentionRecorder()
    handles = record_linear_attention(case, model, recorder)
    try:
        with recorder:
            out = forward(case, model, inputs)
    finally:
        for handle in handles:
            handle.remove()
    return out, recorder


def record_linear_attention(case: FamilyCase, model: torch.nn.Module, recorder: AttentionRecorder) -> list:
    """Hooks that record `(query tokens, key tokens)` of each call of the case's attention modules that run no SDPA
    kernel (`FamilyCase.linear_attentions`), in call order with the kernel calls: the tokens `to_q` and `to_k` get."""
    handles = []
    for attn in case.linear_attentions(model) if case.linear_attentions is not None else ():
        queries: list[int] = []

        def query(module, args, queries=queries):
            queries.append(int(args[0].shape[-2]))

        def key(module, args, queries=queries):
            recorder.calls.append((queries.pop(), int(args[0].shape[-2])))

        handles += [attn.to_q.register_forward_pre_hook(query), attn.to_k.register_forward_pre_hook(key)]
    return handles


def merged_calls(plain: AttentionRecorder, merged: AttentionRecorder) -> int:
    assert len(plain.calls) == len(merged.calls), "ToMe changed the number of attention calls"
    return sum(p != m for p, m in zip(plain.calls, merged.calls, strict=True))


@pytest.fixture(scope="module")
def built() -> dict[str, torch.nn.Module]:
    """Each case's model, built once (every test removes what it applied)."""
    return {}


def model_of(case: FamilyCase, built: dict) -> torch.nn.Module:
    if case.name not in built:
        built[case.name] = case.build()
    model = built[case.name]
    tp.remove_tome(model)
    return model


@pytest.mark.parametrize("name", sorted(CASES))
def test_merges_at_half_and_removal_gives_the_plain_model(name, built):
    case = CASES[name]
    model = model_of(case, built)
    assert family_of(model).name == case.family
    inputs = case.inputs()
    plain, plain_calls = recorded(case, model, inputs)
    tp.apply_tome(model, ratio=0.5)
    merged, merged_record = recorded(case, model, inputs)
    assert merged_calls(plain_calls, merged_record) == case.merged_calls
    assert merged.shape == plain.shape and torch.isfinite(merged).all()
    assert not torch.allclose(merged, plain, atol=1e-5), "ToMe at 0.5 changed nothing"
    tp.remove_tome(model)
    assert torch.equal(forward(case, model, inputs), plain)
    tp.apply_tome(model, ratio=0.0)
    assert torch.equal(forward(case, model, inputs), plain)
    tp.remove_tome(model)


@pytest.mark.parametrize("name", sorted(CASES))
def test_each_sample_keeps_its_own_merge(name, built):
    # `use_rand=False`: a batch of two and two batches of one draw the same destinations.
    case = CASES[name]
    if not case.batch_independent:
        pytest.skip(case.why_not_independent)
    model = model_of(case, built)
    tp.apply_tome(model, ratio=0.5, use_rand=False)
    both = forward(case, model, case.inputs(batch=2))
    for b in range(2):
        one = _sample(case.inputs(batch=2), b)
        torch.testing.assert_close(forward(case, model, one)[0], both[b], rtol=1e-4, atol=1e-5)
    tp.remove_tome(model)


def _sample(inputs: dict, b: int) -> dict:
    def one(value: Any) -> Any:
        if isinstance(value, torch.Tensor) and value.ndim >= 1 and value.shape[0] == 2:
            return value[b : b + 1]
        if isinstance(value, list) and len(value) == 2:
            return value[b : b + 1]
        if isinstance(value, dict):
            return {k: one(v) for k, v in value.items()}
        return value

    return {key: one(value) for key, value in inputs.items()}


@pytest.mark.parametrize("name", sorted(CASES))
def test_each_preset_merges(name, built):
    case = CASES[name]
    model = model_of(case, built)
    inputs = case.inputs()
    plain, plain_calls = recorded(case, model, inputs)
    for preset in ("exact", "balanced", "fast"):
        tp.apply_tome(model, preset=preset)
        out, record = recorded(case, model, inputs)
        assert torch.isfinite(out).all() and merged_calls(plain_calls, record) > 0, preset
    tp.remove_tome(model)


@pytest.mark.parametrize("name", sorted(CASES))
def test_the_hot_path_reads_nothing_back_and_adds_few_ops(name, built):
    case = CASES[name]
    model = model_of(case, built)
    inputs = case.inputs()
    forward(case, model, inputs)  # warm: what is built once per grid is not counted
    _, plain = recorded(case, model, inputs)
    tp.apply_tome(model, ratio=0.5)
    forward(case, model, inputs)
    _, merged = recorded(case, model, inputs)
    tp.remove_tome(model)
    syncs = {op: n for op, n in merged.ops.items() if op in SYNC_OPS}
    plain_syncs = {op: n for op, n in plain.ops.items() if op in SYNC_OPS}
    assert syncs == plain_syncs, f"ToMe added host syncs: {syncs} against {plain_syncs}"
    added = sum(merged.ops.values()) - sum(plain.ops.values())
    assert added <= MAX_OPS_PER_MERGE * case.merged_calls, f"{added} aten ops for {case.merged_calls} merged calls"


# ---------------------------------------------------------------- whole pipeline calls

PIPELINE_CASES = sorted(name for name, case in CASES.items() if case.pipeline is not None)


def generate(pipe: Any, case: FamilyCase) -> torch.Tensor:
    generator = torch.Generator().manual_seed(0)
    with torch.no_grad():
        out = pipe(**case.pipeline.call_kwargs, generator=generator)
    for name in ("images", "frames", "videos"):
        value = getattr(out, name, None)
        if value is not None:
            return torch.as_tensor(value) if not isinstance(value, torch.Tensor) else value
    return out[0]


@pytest.fixture
def patched():
    tp.patch_pipelines()
    yield
    tp.unpatch_pipelines()


@pytest.fixture(scope="module")
def pipelines(tmp_path_factory) -> dict:
    """Each case's pipeline, built once."""
    return {"_dir": tmp_path_factory.mktemp("pipelines")}


def pipeline_of(case: FamilyCase, pipelines: dict) -> Any:
    if case.name not in pipelines:
        folder = pipelines["_dir"] / case.name
        folder.mkdir()
        pipelines[case.name] = case.pipeline.build(folder)
    pipe = pipelines[case.name]
    tp.remove_tome(pipe)
    return pipe


def twice_the_same_and_changed(pipe: Any, case: FamilyCase, plain: torch.Tensor) -> None:
    first, second = generate(pipe, case), generate(pipe, case)
    assert torch.isfinite(first).all() and torch.equal(first, second)
    assert not torch.allclose(first, plain, atol=1e-5), "ToMe changed nothing in the pipeline call"


@pytest.mark.parametrize("name", PIPELINE_CASES)
def test_pipeline_with_apply_tome(name, pipelines):
    case = CASES[name]
    pipe = pipeline_of(case, pipelines)
    plain = generate(pipe, case)
    tp.apply_tome(pipe, ratio=0.5)
    twice_the_same_and_changed(pipe, case, plain)
    tp.remove_tome(pipe)
    assert torch.equal(generate(pipe, case), plain)


@pytest.mark.parametrize("name", PIPELINE_CASES)
def test_pipeline_with_set_attn_processor(name, pipelines):
    case = CASES[name]
    if not case.set_attn_processor:
        pytest.skip("the model has no set_attn_processor: apply_tome and enable_tome only")
    pipe = pipeline_of(case, pipelines)
    plain = generate(pipe, case)
    denoiser = getattr(pipe, "transformer", None) or pipe.unet
    processors = denoiser.attn_processors
    denoiser.set_attn_processor(tp.ToMeProcessor(ratio=0.5))
    twice_the_same_and_changed(pipe, case, plain)
    denoiser.set_attn_processor(processors)
    assert torch.equal(generate(pipe, case), plain)


@pytest.mark.parametrize("name", PIPELINE_CASES)
def test_pipeline_with_enable_tome(name, pipelines, patched):
    case = CASES[name]
    pipe = pipeline_of(case, pipelines)
    plain = generate(pipe, case)
    pipe.enable_tome(ratio=0.5)
    twice_the_same_and_changed(pipe, case, plain)
    pipe.disable_tome()
    assert not tp.is_tome_applied(pipe)
    assert torch.equal(generate(pipe, case), plain)


@pytest.mark.parametrize("name", PIPELINE_CASES)
def test_explain_tome_counts_the_tokens_the_model_gets(name, pipelines):
    case = CASES[name]
    pipe = pipeline_of(case, pipelines)
    denoiser = denoiser_of(pipe)
    family = family_of(denoiser)
    seen = []

    def grid(module, args, kwargs):
        seen.append(family.token_grid(module, args, kwargs))

    handle = denoiser.register_forward_pre_hook(grid, with_kwargs=True)
    try:
        generate(pipe, case)
    finally:
        handle.remove()
    tokens = {int(torch.tensor(g).prod()) for g in seen if g is not None}
    assert len(tokens) == 1, f"the model got no one token grid: {seen}"
    rows = tp.explain_tome(
        pipe, case.pipeline.height, case.pipeline.width, num_frames=case.pipeline.num_frames, preset="balanced",
        print_table=False,
    )  # fmt: skip
    model_rows = [row for row in rows if row.model == type(denoiser).__name__]
    assert {row.tokens for row in model_rows if row.level == 1} == tokens
    assert sum(row.blocks for row in model_rows) == len(family.blocks(denoiser))
