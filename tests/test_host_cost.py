"""What a forward costs the host: no host-device syncs, few ops per merged block, one compiled graph.

On a GPU, eager diffusion is bound by the host, so a plugin's cost is its op count and its syncs. These
tests count aten ops with a `TorchDispatchMode` on CPU (deterministic: no timing). A host sync shows up as
`_local_scalar_dense`, `item`, `nonzero`, `is_nonzero`, `equal` or `lift_fresh` (a tensor made from
Python data, a blocking copy on CUDA).
"""

from __future__ import annotations

import collections
import contextlib

import pytest
import torch
from diffusers import UNet2DConditionModel
from torch.utils._python_dispatch import TorchDispatchMode

import tome_processors as tp
from tome_processors import context as context_module

from models import CROSS_DIM, unet_inputs
from test_dit import flux_inputs, pixart_inputs, sd3_inputs, tiny_flux, tiny_pixart, tiny_sd3

SYNC_OPS = {"_local_scalar_dense", "item", "nonzero", "is_nonzero", "equal", "lift_fresh"}


class OpCounter(TorchDispatchMode):
    """Counts every aten op dispatched inside it, by name."""

    def __init__(self) -> None:
        super().__init__()
        self.ops: collections.Counter[str] = collections.Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops[func.overloadpacket.__name__] += 1
        return func(*args, **(kwargs or {}))


def unet(blocks_per_level: int = 1) -> UNet2DConditionModel:
    """SD1.5-shaped; `blocks_per_level=2` has SD1.5's five merged blocks at the first level."""
    torch.manual_seed(0)
    return UNet2DConditionModel(
        sample_size=16,
        layers_per_block=blocks_per_level,
        norm_num_groups=8,
        cross_attention_dim=CROSS_DIM,
        block_out_channels=(32, 48, 64),
        down_block_types=("CrossAttnDownBlock2D", "CrossAttnDownBlock2D", "DownBlock2D"),
        up_block_types=("UpBlock2D", "CrossAttnUpBlock2D", "CrossAttnUpBlock2D"),
        attention_head_dim=8,
    ).eval()


def unet_call_inputs(model: UNet2DConditionModel, timestep=500) -> dict:
    sample, _, text, _ = unet_inputs(model, batch=2, height=32, width=32)
    return {"sample": sample, "timestep": torch.tensor(timestep), "encoder_hidden_states": text}


FAMILIES = {
    # name: (model builder, inputs, timestep key)
    "unet": (unet, lambda model: unet_call_inputs(model)),
    "pixart": (tiny_pixart, lambda model: pixart_inputs()),
    "sd3": (tiny_sd3, lambda model: sd3_inputs()),
    "flux": (tiny_flux, lambda model: flux_inputs()),
}

OPTIONS = [
    pytest.param({}, id="default"),
    pytest.param({"use_rand": False}, id="fixed"),
    pytest.param({"share_level": True}, id="share_level"),
    pytest.param({"recompute_every": 2}, id="recompute_every"),
    pytest.param({"merge_mlp": True, "merge_crossattn": True}, id="all-flags"),
    pytest.param({"level_ratios": {1: 0.5, 2: 0.3}}, id="level_ratios"),
    pytest.param({"similarity_dtype": "bfloat16"}, id="bf16"),
]


def forward(model: torch.nn.Module, inputs: dict) -> torch.Tensor:
    with torch.no_grad():
        return model(**inputs).sample


def count_ops(model: torch.nn.Module, inputs: dict) -> tuple[collections.Counter[str], int]:
    """Aten ops of one forward, and how many blocks merged in it (oneDNN off: the GPU's code path)."""
    merged: set[int] = set()
    original = context_module.BlockState.merge_for

    def recording(self, config):
        merge = original(self, config)
        if merge is not None:
            merged.add(id(self))
        return merge

    with pytest.MonkeyPatch.context() as patch, torch.backends.mkldnn.flags(enabled=False):
        patch.setattr(context_module.BlockState, "merge_for", recording)
        with OpCounter() as counter:
            forward(model, inputs)
    return counter.ops, len(merged)


@contextlib.contextmanager
def cuda_sync_errors():
    """Where CUDA is present, any synchronising CUDA call raises (the dispatch count is the CPU's proxy)."""
    if torch.cuda.is_available():
        torch.cuda.set_sync_debug_mode("error")
    try:
        yield
    finally:
        if torch.cuda.is_available():
            torch.cuda.set_sync_debug_mode("default")


DEVICES = ["cpu", *(["cuda"] if torch.cuda.is_available() else [])]


def on_device(model: torch.nn.Module, inputs: dict, device: str) -> tuple[torch.nn.Module, dict]:
    moved = {k: v.to(device) if isinstance(v, torch.Tensor) else v for k, v in inputs.items()}
    return model.to(device), moved


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("family", sorted(FAMILIES))
@pytest.mark.parametrize("options", OPTIONS)
def test_no_host_sync_in_a_forward(family, options, device, one_thread):
    build, make_inputs = FAMILIES[family]
    model = build()
    model, inputs = on_device(model, make_inputs(model), device)
    baseline_ops, _ = count_ops(model, inputs)
    if device == "cuda":
        try:
            with cuda_sync_errors():
                forward(model, inputs)
        except RuntimeError as error:  # the sync would not be ToMe's
            pytest.skip(f"the {family} model syncs on CUDA without ToMe: {error}")
    tp.apply_tome(model, **options)
    forward(model, inputs)  # the first forward may fill caches
    with cuda_sync_errors():
        for _ in range(2):  # a computing step and, with recompute_every, a reusing one
            ops, merged = count_ops(model, inputs)
            assert merged > 0 or options.get("recompute_every"), "nothing merged: the test would prove nothing"
            syncs = {name: ops[name] - baseline_ops[name] for name in SYNC_OPS if ops[name] > baseline_ops[name]}
            assert syncs == {}, f"host syncs in a {family} forward with {options}: {syncs}"


def test_no_host_sync_with_k_v_pooling(one_thread):
    model = unet()
    inputs = unet_call_inputs(model)
    tp.apply_tome(model, mode="downsample_kv")
    forward(model, inputs)
    ops, _ = count_ops(model, inputs)
    assert not any(ops[name] for name in SYNC_OPS)


def test_ratio_schedule_reads_the_timestep_once_per_forward(one_thread):
    # The one host read left: a ratio that follows the timestep changes the merged shape with it.
    model = unet()
    inputs = unet_call_inputs(model)
    baseline_ops, _ = count_ops(model, inputs)
    tp.apply_tome(model, ratio_start=0.6)
    forward(model, inputs)
    ops, _ = count_ops(model, inputs)
    assert ops["_local_scalar_dense"] - baseline_ops["_local_scalar_dense"] == 1
    assert not any(ops[name] > baseline_ops[name] for name in SYNC_OPS - {"_local_scalar_dense"})


# Models with the real number of merged blocks (SD1.5: five at the first level, PixArt-alpha 28, SD3 24,
# Flux 19 + 38), tiny otherwise: what a forward sets up once is shared by as many blocks as in the real one.
REAL_BLOCK_COUNTS = {
    "unet": (lambda: unet(2), unet_call_inputs),
    "pixart": (lambda: tiny_pixart(28), lambda model: pixart_inputs()),
    "sd3": (lambda: tiny_sd3(24), lambda model: sd3_inputs()),
    # Flux as its pipeline runs it: batch 1 (guidance-distilled, no CFG batch).
    "flux": (lambda: tiny_flux(19, 38), lambda model: flux_inputs(batch=1)),
}
BUDGETS = [
    # (family, options, most aten ops per merged block)
    pytest.param("unet", {}, 30, id="unet"),
    pytest.param("pixart", {}, 30, id="pixart"),
    pytest.param("sd3", {}, 30, id="sd3"),
    pytest.param("unet", {"share_level": True}, 25, id="unet-share_level"),
    pytest.param("pixart", {"share_level": True}, 12, id="pixart-share_level"),
    pytest.param("sd3", {"share_level": True}, 12, id="sd3-share_level"),
    # Over the 30-op target by the rotary tables gathered for the merged rows and the text tokens cut off
    # and put back in every block: held here so that it does not grow. (A batch of several runs attention
    # one sample at a time: each sample's rotary positions follow its own merge.)
    pytest.param("flux", {}, 38, id="flux"),
    pytest.param("flux", {"share_level": True}, 14, id="flux-share_level"),
]


def cost_per_merged_block(family: str, options: dict) -> tuple[float, int, int]:
    """`(aten ops per merged block, merged blocks, host-sync ops)` of a forward after the first, on the
    family's model with its real number of merged blocks."""
    build, make_inputs = REAL_BLOCK_COUNTS[family]
    model = build()
    inputs = make_inputs(model)
    baseline_ops, _ = count_ops(model, inputs)
    tp.apply_tome(model, **options)
    forward(model, inputs)  # the first forward fills the per-grid caches
    ops, merged = count_ops(model, inputs)
    per_block = (sum(ops.values()) - sum(baseline_ops.values())) / max(merged, 1)
    syncs = sum(max(ops[name] - baseline_ops[name], 0) for name in SYNC_OPS)
    return per_block, merged, syncs


@pytest.mark.parametrize(("family", "options", "budget"), BUDGETS)
def test_aten_ops_per_merged_block_stay_within_budget(family, options, budget, one_thread):
    per_block, merged, syncs = cost_per_merged_block(family, options)
    assert merged >= 5 and syncs == 0
    assert per_block <= budget, f"{per_block:.1f} aten ops per merged block, budget {budget}"


def test_reusing_merges_costs_fewer_ops_than_computing_them(one_thread):
    model = unet(2)
    inputs = unet_call_inputs(model)
    tp.apply_tome(model)
    forward(model, inputs)
    computing = sum(count_ops(model, inputs)[0].values())
    tp.apply_tome(model, recompute_every=3)
    forward(model, inputs)  # step 0 computes; steps 1 and 2 reuse
    reusing = sum(count_ops(model, inputs)[0].values())
    assert reusing < computing - 5 * 15


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_compiles_in_one_graph_without_recompiling_across_steps(family, one_thread):
    import torch._dynamo

    build, make_inputs = FAMILIES[family]
    model = build()
    inputs = make_inputs(model)
    tp.apply_tome(model)
    timesteps = [999.0, 750.0, 500.0, 250.0] if family != "flux" else [1.0, 0.75, 0.5, 0.25]
    eager = []
    for t in timesteps:
        inputs["timestep"] = torch.full_like(torch.as_tensor(inputs["timestep"]), t)
        eager.append(forward(model, dict(inputs)))
    torch._dynamo.reset()
    compiled = torch.compile(model, fullgraph=True, backend="eager")  # graph breaks raise with fullgraph
    with torch._dynamo.config.patch(error_on_recompile=False):
        inputs["timestep"] = torch.full_like(torch.as_tensor(inputs["timestep"]), timesteps[0])
        torch.testing.assert_close(forward(compiled, dict(inputs)), eager[0], rtol=1e-4, atol=1e-5)
    with torch._dynamo.config.patch(error_on_recompile=True):
        for t, expected in zip(timesteps[1:], eager[1:], strict=True):
            inputs["timestep"] = torch.full_like(torch.as_tensor(inputs["timestep"]), t)
            torch.testing.assert_close(forward(compiled, dict(inputs)), expected, rtol=1e-4, atol=1e-5)
    torch._dynamo.reset()


def main() -> None:
    """Print what one forward costs the host per family and option: `python tests/test_host_cost.py`."""
    torch.set_num_threads(1)
    print("| family | options | aten ops per merged block | merged blocks | host-sync ops per forward |")
    print("|---|---|---|---|---|")
    for family in REAL_BLOCK_COUNTS:
        for options in ({}, {"use_rand": False}, {"share_level": True}, {"recompute_every": 2}):
            per_block, merged, syncs = cost_per_merged_block(family, options)
            print(f"| {family} | {options or 'default'} | {per_block:.1f} | {merged} | {syncs} |")


if __name__ == "__main__":
    main()


@pytest.mark.parametrize("three_d_ids", [False, True])
def test_flux_reads_its_grid_once_under_inference_mode(three_d_ids, one_thread):
    # Inference tensors have no version counter: the same img_ids object must still be read only once.
    model = tiny_flux()
    inputs = flux_inputs(batch=1)
    if three_d_ids:
        inputs["img_ids"] = inputs["img_ids"].unsqueeze(0)
    tp.apply_tome(model)
    with torch.inference_mode():
        inputs = {k: v.clone() if isinstance(v, torch.Tensor) else v for k, v in inputs.items()}
        model(**inputs)
        with OpCounter() as counter:
            model(**inputs)
    assert not any(counter.ops[name] for name in SYNC_OPS), {name: counter.ops[name] for name in SYNC_OPS}
