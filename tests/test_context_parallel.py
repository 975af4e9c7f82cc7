"""ToMe under diffusers' context parallelism (Ulysses, ring) and tensor parallelism, on two CPU processes.

Every scenario runs in one spawn of two ranks (`scenarios`, module fixture `ranks`); the tests read its results.
Each rank merges the tokens it holds, as the grid they form, with the same merged count on every rank; attention
stays global (diffusers' all-to-all / ring carry the merged tokens).
"""

from __future__ import annotations

import copy
import warnings
from typing import Any

import numpy as np
import pytest
import torch

from parallel_harness import run_ranks

RATIO = {"ratio": 0.5, "use_rand": False}
#: Families with a context-parallel plan in diffusers beside Wan and FLUX.1: Qwen-Image splits at its first block,
#: FLUX.2 and LTX-Video at the model's input.
OTHER_FAMILIES = {"qwenimage": 128, "flux2": 128, "ltx": 64}  # each with the image tokens a rank holds
#: How far a rank's merges may move the output from one process's, beside ToMe's own change, where sources match
#: destinations over the whole image (not within fixed windows): a source whose most similar destination is
#: another rank's merges elsewhere. On these random-weight models that moves the output by about as much as
#: merging does (0.95-1.1x measured).
GLOBAL_MATCHING_BOUND = 1.5


def _query_tokens(modules: list[torch.nn.Module]) -> tuple[list[int], list[Any]]:
    """Record the token count each module's `to_q` projects (the attention's queries), per call."""
    seen: list[int] = []
    handles = [
        module.to_q.register_forward_pre_hook(lambda _, args: seen.append(int(args[0].shape[1]))) for module in modules
    ]
    return seen, handles


def _wan(frames: int, h: int, w: int, num_layers: int = 2):
    from test_video import tiny_wan, wan_inputs

    model = tiny_wan(num_layers)
    model.set_attention_backend("native")
    inputs = wan_inputs(batch=1, frames=frames, h=h, w=w)
    return model, inputs


def _wan_variant(kind: str):
    """Wan 2.1 image-to-video (image tokens before the text in the cross-attention) or Wan 2.2 TI2V's timestep per
    token (the conditioning frame's at 0), 4 frames of 4 x 4 tokens."""
    from test_video import TEXT_DIM, tiny_wan, wan_inputs

    inputs = wan_inputs(batch=1, frames=4, h=8, w=8)
    if kind == "i2v":
        model = tiny_wan(2, image_dim=20)
        inputs["encoder_hidden_states_image"] = torch.randn(1, 3, 20, generator=torch.Generator().manual_seed(1))
        inputs["encoder_hidden_states"] = torch.randn(1, 512, TEXT_DIM)  # its processor takes the last 512 as text
    else:
        model = tiny_wan(2)
        timestep = torch.full((1, 4, 16), 700)
        timestep[:, 0] = 0  # the first frame is the given image's
        inputs["timestep"] = timestep.flatten(1)
    model.set_attention_backend("native")
    return model, inputs


def _flux(h: int = 8, w: int = 8):
    from test_dit import flux_inputs, tiny_flux

    model = tiny_flux()
    model.set_attention_backend("native")
    inputs = flux_inputs(batch=1, h=h, w=w)
    text = inputs["encoder_hidden_states"]  # text of an even length, which diffusers splits between the ranks
    inputs["encoder_hidden_states"] = torch.cat([text, text[:, :1]], dim=1)[:, : text.shape[1] // 2 * 2 + 2]
    inputs["txt_ids"] = torch.zeros(inputs["encoder_hidden_states"].shape[1], 3)
    return model, inputs


def _even_text(inputs: dict, length: int = 6) -> dict:
    """`inputs` with `length` text tokens (the tiny models' 7 do not split between two ranks), and Flux-style ids
    batched, as diffusers' plans split them."""
    out = dict(inputs)
    for key in ("encoder_hidden_states", "encoder_hidden_states_mask", "encoder_attention_mask"):
        if key in out:
            out[key] = out[key][:, :length]
    if "txt_ids" in out:
        out["txt_ids"] = out["txt_ids"][..., :length, :]
    return out


def _other_family(name: str):
    """The tiny model of another family with a context-parallel plan, and inputs of 16 x 16 image tokens (LTX: 2
    frames of 8 x 8) that split evenly."""
    if name == "qwenimage":
        from test_new_families import qwenimage_inputs, tiny_qwenimage

        model, inputs = tiny_qwenimage(), _even_text(qwenimage_inputs(batch=1, h=16, w=16))
    elif name == "flux2":
        from test_new_families import flux2_inputs, tiny_flux2

        model, inputs = tiny_flux2(), _even_text(flux2_inputs(batch=1, h=16, w=16))
        inputs["img_ids"], inputs["txt_ids"] = inputs["img_ids"][None], inputs["txt_ids"][None]
    elif name == "qwenimage-edit":
        from test_new_families import qwenimage_inputs, tiny_qwenimage

        model, inputs = tiny_qwenimage(), _even_text(qwenimage_inputs(batch=1, h=8, w=8, reference=(4, 4)))
    elif name == "flux2-reference":
        from test_new_families import flux2_inputs, tiny_flux2

        model, inputs = tiny_flux2(), _even_text(flux2_inputs(batch=1, h=8, w=8, reference=(4, 4)))
        inputs["img_ids"], inputs["txt_ids"] = inputs["img_ids"][None], inputs["txt_ids"][None]
    else:
        from test_ltx import ltx_inputs, tiny_ltx

        model, inputs = tiny_ltx(), _even_text(ltx_inputs(batch=1, frames=2, h=8, w=8))
        # diffusers' Ulysses attention does not split a text mask's heads (it fails with or without ToMe)
        inputs["encoder_attention_mask"] = None
    model.set_attention_backend("native")
    return model, inputs


def _first_attention(model: torch.nn.Module) -> list[torch.nn.Module]:
    from tome_processors.families import find_family

    return [find_family(model).blocks(model)[0].attentions[0].module]


def _forward(model: torch.nn.Module, inputs: dict) -> np.ndarray:
    with torch.no_grad():
        return model(**inputs, return_dict=False)[0].numpy()


def _case(build, parallel, tome_first: bool, attentions, **tome) -> dict:
    """One model: plain and ToMe outputs in one process, then under `parallel` with ToMe turned on before or after
    `enable_parallelism`; the query tokens of `attentions(model)` under it, and the warnings ToMe gave."""
    import tome_processors as tp

    model, inputs = build()
    solo = copy.deepcopy(model)
    plain = _forward(solo, inputs)
    tp.apply_tome(solo, **tome)
    solo_tome = _forward(solo, inputs)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        if tome_first:
            tp.apply_tome(model, **tome)
        model.enable_parallelism(config=parallel)
        parallel_plain = None
        if not tome_first:
            parallel_plain = _forward(model, inputs)
            tp.apply_tome(model, **tome)
        seen, handles = _query_tokens(attentions(model))
        out = _forward(model, inputs)
        again = _forward(model, inputs)
        for handle in handles:
            handle.remove()
        tp.remove_tome(model)
        removed = _forward(model, inputs)
    skips = [str(w.message) for w in caught if issubclass(w.category, tp.ToMeSkipWarning)]
    return dict(
        plain=plain,
        solo_tome=solo_tome,
        out=out,
        again=again,
        removed=removed,
        parallel_plain=parallel_plain,
        tokens=seen,
        skips=skips,
    )


def _wan_pipeline_case(how: str, two_experts: bool = False, parallel: Any = None) -> dict:
    """A tiny Wan pipeline's whole call, twice with one seed, with its transformer (both, Wan 2.2's two experts) under
    Ulysses-2 (or `parallel`) and ToMe turned on `how`, after `enable_parallelism`; the query tokens of each
    transformer's first block's self-attention."""
    import tempfile
    from pathlib import Path

    from diffusers import ContextParallelConfig

    import tome_processors as tp

    from test_video import generate, tiny_wan_pipeline

    pipe = tiny_wan_pipeline(Path(tempfile.mkdtemp()), two_experts=two_experts)
    transformers = [pipe.transformer] + ([pipe.transformer_2] if two_experts else [])
    for transformer in transformers:
        transformer.set_attention_backend("native")
        transformer.enable_parallelism(config=parallel or ContextParallelConfig(ulysses_degree=2))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        plain = generate(pipe)
        if how == "set_attn_processor":
            for transformer in transformers:
                transformer.set_attn_processor(tp.ToMeProcessor(ratio=0.5))
        else:
            tp.apply_tome(pipe, ratio=0.5)
        per_expert = [_query_tokens([transformer.blocks[0].attn1]) for transformer in transformers]
        first, second = generate(pipe), generate(pipe)
        for _, handles in per_expert:
            for handle in handles:
                handle.remove()
    skips = [str(w.message) for w in caught if issubclass(w.category, tp.ToMeSkipWarning)]
    seen = per_expert[0][0]
    return dict(plain=plain, first=first, second=second, tokens=seen, experts=[s for s, _ in per_expert], skips=skips)


def _op_counts_case(grid: tuple[int, int, int], **tome: Any) -> dict:
    """The aten ops and host syncs of one warm forward of a tiny Wan with `grid`, without and with ToMe, in one
    process and under Ulysses-2 (`bench.hostcost.count_aten_ops`)."""
    from diffusers import ContextParallelConfig

    import tome_processors as tp
    from tome_processors.bench.hostcost import count_aten_ops

    def counted(model: torch.nn.Module) -> tuple[int, dict]:
        _forward(model, inputs)  # the first forward builds the grid's layouts and partitions
        _, ops, syncs = count_aten_ops(lambda: _forward(model, inputs))
        return sum(ops.values()), dict(syncs)

    model, inputs = _wan(*grid)
    solo = copy.deepcopy(model)
    solo_plain = counted(solo)
    tp.apply_tome(solo, **tome)
    solo_tome = counted(solo)
    model.enable_parallelism(config=ContextParallelConfig(ulysses_degree=2))
    parallel_plain = counted(model)
    tp.apply_tome(model, **tome)
    return dict(solo_plain=solo_plain, solo_tome=solo_tome, parallel_plain=parallel_plain, parallel_tome=counted(model))


def _mixed_st_case() -> dict:
    """A tiny Wan of 5 frames (each rank's run counted in frames from mid-frame) with ToMe across frames (`st=2`),
    one attention's processor then replaced by one that merges frame by frame (`st=1`): what each attention got, and
    the warnings."""
    from diffusers import ContextParallelConfig

    import tome_processors as tp

    model, inputs = _wan(5, 8, 8)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        tp.apply_tome(model, st=2, **RATIO)
        model.enable_parallelism(config=ContextParallelConfig(ulysses_degree=2))
        model.blocks[1].attn1.set_processor(tp.ToMeProcessor(**RATIO))
        seen, handles = _query_tokens([block.attn1 for block in model.blocks])
        _forward(model, inputs)
        _forward(model, inputs)
        for handle in handles:
            handle.remove()
    skips = [str(w.message) for w in caught if issubclass(w.category, tp.ToMeSkipWarning)]
    return dict(tokens=seen, skips=skips)


def _flux_pipeline_case(parallel: Any = None, tome_first: bool = False) -> dict:
    """A tiny FLUX.1 pipeline's whole call (64 px: 4 x 4 tokens, 2 rows a rank under Ulysses), twice with one seed,
    with its transformer under Ulysses-2 (or `parallel`) and `pipe.enable_tome()` after `enable_parallelism` (or,
    `tome_first`, before: then also the call in one process with ToMe, `solo_tome`)."""
    import tempfile

    from diffusers import ContextParallelConfig

    import tome_processors as tp

    from pipelines import family_pipeline

    pipe, call = family_pipeline("flux", tempfile.mkdtemp())
    pipe.transformer.set_attention_backend("native")

    def generate():
        with torch.no_grad():
            return pipe(**call, generator=torch.Generator().manual_seed(0)).images

    def parallelize():
        pipe.transformer.enable_parallelism(config=parallel or ContextParallelConfig(ulysses_degree=2))

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        solo_tome = None
        if not tome_first:
            parallelize()
        plain = generate()
        tp.patch_pipelines()
        pipe.enable_tome(ratio=0.5)
        if tome_first:
            solo_tome = generate()
            parallelize()
        seen, handles = _query_tokens([pipe.transformer.transformer_blocks[0].attn])
        first, second = generate(), generate()
        for handle in handles:
            handle.remove()
    skips = [str(w.message) for w in caught if issubclass(w.category, tp.ToMeSkipWarning)]
    return dict(plain=plain, solo_tome=solo_tome, first=first, second=second, tokens=seen, skips=skips)


def scenarios(rank: int, world_size: int) -> dict:
    from tome_processors.pays import ALWAYS, pays_table

    with pays_table(ALWAYS):  # as conftest.py sets for every test: presets merge on tiny models too
        return _scenarios()


def _scenarios() -> dict:
    from diffusers import ContextParallelConfig, TensorParallelConfig

    def wan_attn1(model):
        return [block.attn1 for block in model.blocks]

    def flux_attn(model):
        return [model.transformer_blocks[0].attn]

    results = {}
    # Wan, 4 frames of 4 x 4 tokens: two whole frames per rank.
    for tome_first in (True, False):
        results[f"wan-ulysses-{tome_first}"] = _case(
            lambda: _wan(4, 8, 8), ContextParallelConfig(ulysses_degree=2), tome_first, wan_attn1, **RATIO
        )
    results["wan-ring"] = _case(lambda: _wan(4, 8, 8), ContextParallelConfig(ring_degree=2), True, wan_attn1, **RATIO)
    for kind in ("i2v", "ti2v"):
        results[f"wan-{kind}"] = _case(
            lambda kind=kind: _wan_variant(kind), ContextParallelConfig(ulysses_degree=2), True, wan_attn1, **RATIO
        )
    # 5 frames: each rank holds 10 rows of 4 tokens, the middle frame split between them.
    results["wan-mid-frame"] = _case(
        lambda: _wan(5, 8, 8), ContextParallelConfig(ulysses_degree=2), True, wan_attn1, **RATIO
    )
    results["wan-balanced"] = _case(
        lambda: _wan(4, 8, 8),
        ContextParallelConfig(ulysses_degree=2),
        True,
        wan_attn1,
        preset="balanced",
        use_rand=False,
    )
    # 3 frames of 5 x 6 tokens: 45 per rank, rank 1's run starting mid-row (as Wan's 720p clips on 2, 4 or 8 ranks).
    results["wan-mid-row"] = _case(
        lambda: _wan(3, 10, 12), ContextParallelConfig(ulysses_degree=2), True, wan_attn1, **RATIO
    )
    # The same 5 frames merged in 2-frame windows: 2 frames of 16 from each rank's first token, 8 tokens after them.
    results["wan-mid-frame-st2"] = _case(
        lambda: _wan(5, 8, 8), ContextParallelConfig(ulysses_degree=2), True, wan_attn1, st=2, **RATIO
    )
    for preset in ("balanced", "fast"):
        results[f"wan-mid-row-{preset}"] = _case(
            lambda: _wan(3, 6, 8),
            ContextParallelConfig(ulysses_degree=2),
            True,
            wan_attn1,
            preset=preset,
            use_rand=False,
        )
    # One frame of 1 x 12 tokens: 6 per rank, less than a row.
    results["wan-no-rows"] = _case(
        lambda: _wan(1, 2, 24), ContextParallelConfig(ulysses_degree=2), True, wan_attn1, **RATIO
    )
    # FLUX.1, 8 x 8 tokens: 4 rows per rank (and half of the text tokens).
    for tome_first in (True, False):
        results[f"flux-ulysses-{tome_first}"] = _case(
            _flux, ContextParallelConfig(ulysses_degree=2), tome_first, flux_attn, **RATIO
        )
    # FLUX.1, 5 x 4 tokens: 10 per rank, 2 rows and 2 after them (rank 1's from mid-row), in the joint attention.
    results["flux-mid-row"] = _case(
        lambda: _flux(5, 4), ContextParallelConfig(ulysses_degree=2), True, flux_attn, **RATIO
    )
    # The other families with a plan, and FLUX.2 and Qwen-Image-Edit with a reference image, whose tokens follow the
    # image's in the sequence diffusers splits.
    for name in (*OTHER_FAMILIES, "flux2-reference", "qwenimage-edit"):
        results[name] = _case(
            lambda name=name: _other_family(name),
            ContextParallelConfig(ulysses_degree=2),
            True,
            _first_attention,
            **RATIO,
        )
    results["flux-pipeline"] = _flux_pipeline_case()
    for how in ("apply_tome", "set_attn_processor"):
        results[f"wan-pipeline-{how}"] = _wan_pipeline_case(how)
    results["wan22-pipeline"] = _wan_pipeline_case("apply_tome", two_experts=True)
    results["wan-pipeline-ring"] = _wan_pipeline_case("apply_tome", parallel=ContextParallelConfig(ring_degree=2))
    results["flux-pipeline-tp"] = _flux_pipeline_case(TensorParallelConfig(tp_degree=2), tome_first=True)
    results["wan-mixed-st"] = _mixed_st_case()
    # The host's work of a forward: whole frames, frames from mid-frame with the part of a frame after them, a preset.
    results["ops-whole"] = _op_counts_case((4, 8, 8), **RATIO)
    results["ops-mid-frame"] = _op_counts_case((5, 8, 8), st=2, **RATIO)
    results["ops-balanced"] = _op_counts_case((5, 8, 8), preset="balanced")
    # Tensor parallelism: every rank holds every token.
    results["flux-tp"] = _case(_flux, TensorParallelConfig(tp_degree=2), True, flux_attn, **RATIO)
    return results


@pytest.fixture(scope="module")
def ranks() -> list[dict]:
    return run_ranks(scenarios, world_size=2)


def _change(a: np.ndarray, b: np.ndarray) -> float:
    """How far apart two outputs are: the norm of their difference (the largest entry alone is noisier)."""
    return float(np.linalg.norm(a - b))


@pytest.mark.parametrize("tome_first", [True, False], ids=["tome-first", "parallel-first"])
def test_wan_under_ulysses_merges_each_ranks_frames_and_equals_one_process(ranks, tome_first):
    for result in (rank[f"wan-ulysses-{tome_first}"] for rank in ranks):
        # Each rank holds 2 frames of 16 tokens: 32 queries unmerged, half merged, on every block and call.
        assert result["tokens"] and set(result["tokens"]) == {16}
        np.testing.assert_allclose(result["out"], result["solo_tome"], atol=1e-5)
        assert _change(result["out"], result["plain"]) > 1e-3  # ToMe changed it
        np.testing.assert_array_equal(result["out"], result["again"])
        np.testing.assert_array_equal(result["removed"], result["plain"] if tome_first else result["parallel_plain"])
        assert not result["skips"]
    np.testing.assert_array_equal(
        ranks[0][f"wan-ulysses-{tome_first}"]["out"], ranks[1][f"wan-ulysses-{tome_first}"]["out"]
    )


def test_wan_under_ring_attention_equals_one_process(ranks):
    for result in (rank["wan-ring"] for rank in ranks):
        assert set(result["tokens"]) == {16}
        np.testing.assert_allclose(result["out"], result["solo_tome"], atol=1e-5)
        assert not result["skips"]


@pytest.mark.parametrize("kind", ["i2v", "ti2v"])
def test_wan_image_to_video_and_a_timestep_per_token_under_ulysses_equal_one_process(ranks, kind):
    # Wan 2.1 I2V (image tokens in the cross-attention) and Wan 2.2 TI2V (diffusers' plan splits the timestep per
    # token with the tokens): each rank merges its 2 whole frames, as one process does.
    for result in (rank[f"wan-{kind}"] for rank in ranks):
        assert result["tokens"] and set(result["tokens"]) == {16}
        np.testing.assert_allclose(result["out"], result["solo_tome"], atol=1e-5)
        assert _change(result["out"], result["plain"]) > 1e-3
        np.testing.assert_array_equal(result["removed"], result["plain"])
        assert not result["skips"]
    np.testing.assert_array_equal(ranks[0][f"wan-{kind}"]["out"], ranks[1][f"wan-{kind}"]["out"])


def test_a_shard_that_starts_mid_frame_merges_as_rows(ranks):
    for result in (rank["wan-mid-frame"] for rank in ranks):
        # 40 tokens per rank (10 rows of 4) merged by half, alike on both ranks; no warning.
        assert set(result["tokens"]) == {20}
        assert not result["skips"]
        # Not what one process does (frame by frame), but a change of ToMe's own size.
        assert _change(result["out"], result["solo_tome"]) < 2 * _change(result["solo_tome"], result["plain"])
    np.testing.assert_array_equal(ranks[0]["wan-mid-frame"]["out"], ranks[1]["wan-mid-frame"]["out"])


def test_a_shard_that_starts_mid_frame_merges_windows_across_its_frames(ranks):
    for result in (rank["wan-mid-frame-st2"] for rank in ranks):
        # 2 x 2 x 2 windows over the first 32 of 40 tokens; the 8 after them are edges that may merge into the
        # window at their place one frame earlier, so half of all 40 go, as in one process.
        assert set(result["tokens"]) == {20}
        assert not result["skips"]
        assert _change(result["out"], result["solo_tome"]) < GLOBAL_MATCHING_BOUND * _change(
            result["solo_tome"], result["plain"]
        )
    np.testing.assert_array_equal(ranks[0]["wan-mid-frame-st2"]["out"], ranks[1]["wan-mid-frame-st2"]["out"])


def test_frame_by_frame_merging_of_a_shard_counted_from_mid_frame_says_so_once(ranks):
    for result in (rank["wan-mixed-st"] for rank in ranks):
        assert result["tokens"] == [20, 40, 20, 40]  # block 0 merges across frames; block 1 (st=1) cannot, twice
        assert len(result["skips"]) == 1, result["skips"]
        assert "blocks.1.attn1" in result["skips"][0] and "frame by frame (st=1)" in result["skips"][0]


def test_presets_merge_under_context_parallelism(ranks):
    for result in (rank["wan-balanced"] for rank in ranks):
        assert result["tokens"] and max(result["tokens"]) < 32
        assert not result["skips"]
        # Which sources merge is chosen per rank (the most similar of its own shard), not over the whole clip:
        # near one process, nearer than the preset's own change.
        assert _change(result["out"], result["solo_tome"]) < _change(result["solo_tome"], result["plain"])


def test_a_shard_that_starts_mid_row_merges_its_rows_and_the_rest(ranks):
    for result in (rank["wan-mid-row"] for rank in ranks):
        # 45 tokens per rank: 7 rows of 6 from the run's first token (rank 1's begin mid-row), 3 after them that may
        # merge into the windows above; 22 of the 45 merged away, alike on both ranks; no warning.
        assert set(result["tokens"]) == {23}
        assert not result["skips"]
        assert _change(result["out"], result["solo_tome"]) < GLOBAL_MATCHING_BOUND * _change(
            result["solo_tome"], result["plain"]
        )
        np.testing.assert_array_equal(result["removed"], result["plain"])
    np.testing.assert_array_equal(ranks[0]["wan-mid-row"]["out"], ranks[1]["wan-mid-row"]["out"])


@pytest.mark.parametrize("preset", ["balanced", "fast"])
def test_presets_merge_a_shard_that_starts_mid_row(ranks, preset):
    for result in (rank[f"wan-mid-row-{preset}"] for rank in ranks):
        assert result["tokens"] and max(result["tokens"]) < 18 and len(set(result["tokens"])) == 1
        assert not result["skips"]
        assert _change(result["out"], result["solo_tome"]) < GLOBAL_MATCHING_BOUND * _change(
            result["solo_tome"], result["plain"]
        )
    np.testing.assert_array_equal(ranks[0][f"wan-mid-row-{preset}"]["out"], ranks[1][f"wan-mid-row-{preset}"]["out"])


def test_a_shard_shorter_than_a_row_says_so_once_and_runs_unmerged(ranks):
    for result in (rank["wan-no-rows"] for rank in ranks):
        assert set(result["tokens"]) == {6}
        assert len(result["skips"]) == 1 and "context parallelism" in result["skips"][0], result["skips"]
        np.testing.assert_array_equal(result["removed"], result["plain"])  # removal: the model's own output


@pytest.mark.parametrize("tome_first", [True, False], ids=["tome-first", "parallel-first"])
def test_flux_under_ulysses_merges_each_ranks_rows(ranks, tome_first):
    for result in (rank[f"flux-ulysses-{tome_first}"] for rank in ranks):
        assert result["tokens"] and set(result["tokens"]) == {16}  # 32 image tokens per rank, half merged
        assert not result["skips"]
        # Rows merged per rank, not over the whole image (`GLOBAL_MATCHING_BOUND`).
        solo_change = _change(result["solo_tome"], result["plain"])
        assert _change(result["out"], result["solo_tome"]) < GLOBAL_MATCHING_BOUND * solo_change
        np.testing.assert_array_equal(result["out"], result["again"])
    np.testing.assert_array_equal(
        ranks[0][f"flux-ulysses-{tome_first}"]["out"], ranks[1][f"flux-ulysses-{tome_first}"]["out"]
    )


def test_flux_merges_a_shard_that_starts_mid_row_in_its_joint_attention(ranks):
    for result in (rank["flux-mid-row"] for rank in ranks):
        assert set(result["tokens"]) == {5}  # 2 rows of 4 and 2 tokens after them: half of the 10 merged away
        assert not result["skips"]
        assert _change(result["out"], result["solo_tome"]) < GLOBAL_MATCHING_BOUND * _change(
            result["solo_tome"], result["plain"]
        )
    np.testing.assert_array_equal(ranks[0]["flux-mid-row"]["out"], ranks[1]["flux-mid-row"]["out"])


@pytest.mark.parametrize("case", ["whole", "mid-frame", "balanced"])
def test_merging_a_shard_reads_nothing_back_and_adds_no_op_beyond_one_process(ranks, case):
    # The hot path under context parallelism: no host sync, and ToMe's aten ops per forward as in one process, but
    # one (the first block's metric cut to the rank's run, where diffusers splits at that block's input).
    for rank in ranks:
        counts = rank[f"ops-{case}"]
        assert all(not syncs for _, syncs in counts.values()), counts
        one_process = counts["solo_tome"][0] - counts["solo_plain"][0]
        parallel = counts["parallel_tome"][0] - counts["parallel_plain"][0]
        assert one_process > 0 and parallel <= one_process + 1, counts


def test_flux_under_tensor_parallelism_merges_as_one_process(ranks):
    for result in (rank["flux-tp"] for rank in ranks):
        assert set(result["tokens"]) == {32}  # every rank holds all 64 image tokens
        np.testing.assert_allclose(result["out"], result["solo_tome"], atol=1e-5)
        assert not result["skips"]


@pytest.mark.parametrize("name", OTHER_FAMILIES)
def test_other_families_with_a_parallel_plan_merge_each_ranks_tokens(ranks, name):
    for result in (rank[name] for rank in ranks):
        assert set(result["tokens"]) == {OTHER_FAMILIES[name] // 2}  # half of the rank's image tokens, every call
        assert not result["skips"]
        solo_change = _change(result["solo_tome"], result["plain"])
        assert _change(result["out"], result["solo_tome"]) < GLOBAL_MATCHING_BOUND * solo_change
    assert ranks[0][name]["tokens"] == ranks[1][name]["tokens"]
    np.testing.assert_array_equal(ranks[0][name]["out"], ranks[1][name]["out"])


@pytest.mark.parametrize("how", ["apply_tome", "set_attn_processor"])
def test_a_wan_pipeline_under_ulysses_merges_on_every_rank_the_same_video_twice(ranks, how):
    for result in (rank[f"wan-pipeline-{how}"] for rank in ranks):
        # 3 latent frames of 2 x 2 tokens: 6 per rank (the middle frame split), merged as 3 rows of 2.
        assert result["tokens"] and set(result["tokens"]) < {1, 2, 3, 4, 5}
        np.testing.assert_array_equal(result["first"], result["second"])
        assert _change(result["first"], result["plain"]) > 0
        assert not result["skips"]
    np.testing.assert_array_equal(ranks[0][f"wan-pipeline-{how}"]["first"], ranks[1][f"wan-pipeline-{how}"]["first"])


def test_a_wan22_pipeline_with_two_experts_under_ulysses_merges_in_both(ranks):
    # Wan 2.2 A14B's layout: `transformer` for the high-noise steps, `transformer_2` for the rest, each parallelized.
    for result in (rank["wan22-pipeline"] for rank in ranks):
        for expert in result["experts"]:
            assert expert and set(expert) < {1, 2, 3, 4, 5}  # each expert ran, merging its rank's 6 tokens
        np.testing.assert_array_equal(result["first"], result["second"])
        assert _change(result["first"], result["plain"]) > 0
        assert not result["skips"]
    np.testing.assert_array_equal(ranks[0]["wan22-pipeline"]["first"], ranks[1]["wan22-pipeline"]["first"])


def test_a_wan_pipeline_under_ring_attention_gives_the_video_ulysses_gives(ranks):
    for rank in ranks:
        result = rank["wan-pipeline-ring"]
        assert result["tokens"] and set(result["tokens"]) < {1, 2, 3, 4, 5}
        np.testing.assert_array_equal(result["first"], result["second"])
        assert not result["skips"]
        # The same shards merged alike; only how attention gathers the keys differs.
        np.testing.assert_allclose(result["first"], rank["wan-pipeline-apply_tome"]["first"], atol=1e-4)
    np.testing.assert_array_equal(ranks[0]["wan-pipeline-ring"]["first"], ranks[1]["wan-pipeline-ring"]["first"])


def test_a_flux_pipeline_under_tensor_parallelism_gives_one_process_image(ranks):
    for result in (rank["flux-pipeline-tp"] for rank in ranks):
        assert result["tokens"] and set(result["tokens"]) == {8}  # all 16 image tokens on every rank, half merged
        np.testing.assert_array_equal(result["first"], result["second"])
        np.testing.assert_allclose(result["first"], result["solo_tome"], atol=1e-4)
        assert _change(result["solo_tome"], result["plain"]) > 0
        assert not result["skips"]


def test_a_processor_set_after_enable_parallelism_attends_over_every_rank(ranks):
    # `set_attn_processor(ToMeProcessor(...))` after `enable_parallelism` runs the processors it builds under the
    # model's parallel config, as `apply_tome` keeps the ones it wraps: the same video both ways.
    for rank in ranks:
        np.testing.assert_allclose(
            rank["wan-pipeline-set_attn_processor"]["first"], rank["wan-pipeline-apply_tome"]["first"], atol=1e-5
        )


def test_a_flux_pipeline_under_ulysses_merges_on_every_rank_the_same_image_twice(ranks):
    for result in (rank["flux-pipeline"] for rank in ranks):
        assert result["tokens"] and set(result["tokens"]) == {4}  # 8 image tokens a rank, half merged
        np.testing.assert_array_equal(result["first"], result["second"])
        assert _change(result["first"], result["plain"]) > 0
        assert not result["skips"]
    np.testing.assert_array_equal(ranks[0]["flux-pipeline"]["first"], ranks[1]["flux-pipeline"]["first"])


@pytest.mark.parametrize("name", ["flux2-reference", "qwenimage-edit"])
def test_reference_image_tokens_under_context_parallelism_say_so_once_and_run_unmerged(ranks, name):
    for result in (rank[name] for rank in ranks):
        assert set(result["tokens"]) == {40}  # (64 + 16) / 2 image tokens a rank, none merged
        assert len(result["skips"]) == 1 and "reference images" in result["skips"][0], result["skips"]
        np.testing.assert_allclose(result["out"], result["plain"], atol=1e-5)
