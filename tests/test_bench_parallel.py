"""`tome-processors bench --parallel`: ranks spawned on the CPU, seconds per forward and the collectives' bytes; the
memory a rank is estimated to take, checked before any is spawned, and a rank killed mid-run named with its signal."""

from __future__ import annotations

import json

import pytest

import dying_rank
from tome_processors.bench.parallel import ParallelSpec, parse_parallel, run_parallel_bench
from tome_processors.cli.main import main


@pytest.mark.parametrize(
    ("text", "spec"),
    [
        ("ulysses=2", ParallelSpec(ulysses=2)),
        ("ring=2", ParallelSpec(ring=2)),
        ("ulysses=2,ring=2", ParallelSpec(ulysses=2, ring=2)),
        ("tp=2", ParallelSpec(tp=2)),
    ],
)
def test_parallel_specs_parse(text, spec):
    assert parse_parallel(text) == spec
    assert parse_parallel(str(spec)) == spec


@pytest.mark.parametrize("text", ["ulysses=1", "pipeline=2", "tp=2,ulysses=2", "ring", "ring=2,ring=2"])
def test_bad_parallel_specs_are_refused(text):
    with pytest.raises(ValueError, match="Expected"):
        parse_parallel(text)


def test_an_architecture_without_a_plan_is_refused_before_anything_is_spawned():
    with pytest.raises(ValueError, match="context-parallel plan"):
        run_parallel_bench(parse_parallel("ulysses=2"), "sd3", ["balanced"], quick=True)
    with pytest.raises(ValueError, match="tensor-parallel plan"):
        run_parallel_bench(parse_parallel("tp=2"), "wan", ["balanced"], quick=True)


def test_ulysses_rows_count_the_bytes_merging_saves(tmp_path, capsys):
    # The quick Wan under Ulysses-2: ToMe at 0.5 merges each rank's tokens (the presets' pays rule keeps them off
    # at this size), so its all-to-alls carry fewer tokens than the baseline's.
    path = tmp_path / "parallel.json"
    code = main(
        ["bench", "--parallel", "ulysses=2", "--arch", "wan", "--quick", "--presets", "balanced", "--ratios", "0.5",
         "--rounds", "1", "--json", str(path)]
    )  # fmt: skip
    assert code == 0
    printed = capsys.readouterr().out
    assert "| baseline |" in printed and "| r=0.5 |" in printed and "2 ranks on cpu" in printed
    rows = {row["name"]: row for row in json.loads(path.read_text())["rows"]}
    base, merged, preset = rows["baseline"], rows["r=0.5"], rows["balanced"]
    assert base["collective_bytes"] > 0 and base["collective_calls"] > 0
    assert merged["query_tokens"] < base["query_tokens"]
    assert merged["collective_bytes"] < base["collective_bytes"]
    assert merged["change"] > 0
    # A row that merges nothing moves the same bytes and changes nothing.
    assert preset["query_tokens"] == base["query_tokens"] and preset["collective_bytes"] == base["collective_bytes"]
    assert len(merged["seconds"]) == 1 and merged["seconds"][0] > 0
    # Counted, each byte once: per block, Ulysses' four all-to-alls (queries, keys, values, output) of the tokens the
    # rank's self-attention holds, and the gather of the rank's output (4 channels x 1 x 2 x 2 patch per token).
    for row in (base, merged):
        per_block = 4 * row["query_tokens"] * row["attention_width"] * row["element_size"]
        gathered = base["query_tokens"] * 16 * row["element_size"]
        assert row["collective_bytes"] == per_block * row["blocks"] + gathered


def _bench_json(path, rows, parallel=None):
    meta = {"parallel": parallel} if parallel else {}
    path.write_text(json.dumps({"meta": meta, "rows": rows}))
    return str(path)


def test_the_several_gpu_model_reads_the_benches_and_prints_its_table(tmp_path, capsys, monkeypatch):
    import tome_processors.bench.parallel_model as model

    one_gpu = [
        _bench_json(tmp_path / f"l{n}.json", [
            {"name": "baseline", "family": "baseline", "seconds": 0.1 + 0.3 * n, "extra": {"attention %": 80.0}},
            {"name": "ours fast r=0.85", "family": "ours fast", "seconds": 0.1 + 0.075 * n,
             "extra": {"attention %": 20.0}},
        ])
        for n in (4, 8)
    ]  # fmt: skip
    counts = [
        _bench_json(tmp_path / f"p{p}.json", [
            {"name": "baseline", "query_tokens": 1200 // p}, {"name": "fast", "query_tokens": 300 // p},
        ], parallel=f"ring={p}")
        for p in (2, 4)
    ]  # fmt: skip
    clips = []
    monkeypatch.setattr(model, "one_process_kept", lambda *clip: clips.append(clip) or {"baseline": 1.0, "fast": 0.125})
    argv = ["--one-gpu", f"4={one_gpu[0]}", f"8={one_gpu[1]}", "--blocks", "40", "--counts", *counts]
    argv += ["--clip", "wan", "720", "1280", "81", "--attention-width", "100", "--link", "1"]
    assert model.main([*argv, "--heads", "40"]) == 0
    assert clips == [("wan", 720, 1280, 81, ["fast"])]
    lines = capsys.readouterr().out.splitlines()
    # 40 blocks: baseline 12.1 s (80% attention), fast 3.1 s (20%: 0.62 s) on one GPU. On 2 GPUs: 6.05 s of compute;
    # 4 tensors x 600 tokens x 100 x 2 bytes x 40 blocks, half of them out: 9.6 MB, 0.0096 s at 1 GB/s. A rank's
    # fast holds a quarter of its tokens where one process holds an eighth: its attention takes 4 x 0.62 s.
    assert "| 1 | 2 | baseline | 100.0% | 6.060 | 6.050 | 0.010 | 0.01 | 1.00x | 1.00x |" in lines
    assert "| 1 | 2 | fast | 25.0% | 2.482 | 2.480 | 0.002 | 0.00 | 2.44x | 3.90x |" in lines
    assert any(line.startswith("| 1 | 4 | fast |") for line in lines)
    with pytest.raises(SystemExit):
        model.main([*argv, "--heads", "6"])  # Ulysses over 4 GPUs needs heads / 4
    assert "divide the 6 heads" in capsys.readouterr().err


def test_the_model_fits_a_line_through_two_block_counts():
    from tome_processors.bench.parallel_model import OneGpuTime, whole_forward_seconds

    fitted = whole_forward_seconds({4: {"a": OneGpuTime(1.0, 0.2)}, 8: {"a": OneGpuTime(1.8, 0.4)}}, 40)
    assert fitted == {"a": OneGpuTime(8.2, 2.0)}
    assert whole_forward_seconds({40: {"a": OneGpuTime(3.0, 1.0)}}, 40) == {"a": OneGpuTime(3.0, 1.0)}
    with pytest.raises(ValueError, match="two block counts"):
        whole_forward_seconds({4: {"a": OneGpuTime(1.0, 0.0)}}, 40)


def test_one_process_holds_what_its_presets_keep_of_a_clip():
    from tome_processors.bench.parallel_model import one_process_kept

    # 480x832, 33 frames: the video presets' 2 x 2 x 2 windows keep 2 of 8 (balanced) or fewer (fast).
    kept = one_process_kept("wan", 480, 832, 33, ["balanced", "fast"])
    assert kept["baseline"] == 1.0 and kept["balanced"] == 0.25 and 0.125 <= kept["fast"] < kept["balanced"]


def _request(layers=None, frames=None, presets=("balanced",), spec="ulysses=2", arch="wan"):
    from tome_processors.bench.parallel import ParallelRequest

    return ParallelRequest(
        parse_parallel(spec), arch, presets, (), 1, 1, 480, 832, frames, layers, 1, 0, 1, "cpu", "float32",
        False,
    )  # fmt: skip


def test_a_rank_holds_its_copies_the_activations_of_its_tokens_and_its_process():
    from tome_processors.bench.rank_memory import (
        ACTIVATION_WIDTHS,
        GIB,
        PROCESS_BYTES,
        RankMemory,
        estimate_rank_memory,
    )

    # 1 B parameters, 2 rows (2 copies) in float32: 8 GB; 1,000 tokens x 1,000 wide x 40 widths x 4 bytes: 0.16 GB.
    memory = RankMemory(parameters=10**9, copies=2, element_size=4, tokens=1_000, width=1_000)
    assert ACTIVATION_WIDTHS == 40 and PROCESS_BYTES == GIB // 2
    assert (memory.weight_bytes, memory.activation_bytes) == (8 * 10**9, 160 * 10**6)
    assert memory.total_bytes == 8 * 10**9 + 160 * 10**6 + GIB // 2
    # bfloat16: the float32 build (4 bytes a parameter) is more than 1 copy at 2 bytes; 3 copies are more than it.
    assert RankMemory(10**9, 1, 2, 0, 1).weight_bytes == 4 * 10**9
    assert RankMemory(10**9, 3, 2, 0, 1).weight_bytes == 6 * 10**9
    # Wan2.1-1.3B under Ulysses-2: 480 x 832, 33 frames is 9 latent frames of 30 x 52 tokens, half of them a rank;
    # 81 frames is 21 latent frames. Each block adds its parameters to each copy.
    one = estimate_rank_memory(_request(layers=1))
    assert (one.copies, one.tokens, one.width, one.element_size) == (2, 9 * 30 * 52 // 2, 1536, 4)
    longer = estimate_rank_memory(_request(layers=1, frames=81))
    assert longer.tokens == 21 * 30 * 52 // 2 and longer.parameters == one.parameters
    assert longer.total_bytes - one.total_bytes == ACTIVATION_WIDTHS * (21 - 9) * 30 * 52 // 2 * 1536 * 4
    deeper = estimate_rank_memory(_request(layers=2))
    assert deeper.tokens == one.tokens and deeper.parameters > one.parameters
    assert deeper.total_bytes - one.total_bytes == 2 * 4 * (deeper.parameters - one.parameters)
    whole = estimate_rank_memory(_request())
    assert 1.40e9 < whole.parameters < 1.45e9  # Wan2.1-1.3B: 1.42 B
    # More rows, more copies; ring attention splits the tokens alike; tensor parallelism keeps them all.
    assert estimate_rank_memory(_request(layers=1, presets=("balanced", "fast"))).copies == 3
    assert estimate_rank_memory(_request(layers=1, spec="ring=2")).tokens == one.tokens


def test_the_refusal_names_the_estimate_and_sizes_that_fit():
    from tome_processors.bench.rank_memory import GIB, NotEnoughMemory, check_rank_memory, estimate_rank_memory

    # The whole Wan, 2 copies: 12.68 GiB a rank; 16 GiB for 2 ranks is 8 a rank. The weights alone are more than 8,
    # so fewer frames cannot help; fewer blocks can.
    with pytest.raises(NotEnoughMemory) as refused:
        check_rank_memory(_request(), available=16 * GIB)
    message = str(refused.value)
    assert "a rank would take about 12.68 GiB and 16.00 GiB is available, 8.00 GiB a rank" in message
    assert "2 copies of the model" in message and "7,020 tokens" in message
    layers = int(message.split("--layers ")[1].split(".")[0])
    assert estimate_rank_memory(_request(layers=layers)).total_bytes <= 8 * GIB
    assert estimate_rank_memory(_request(layers=layers + 1)).total_bytes > 8 * GIB
    assert "Not --frames alone" in message and "--ignore-memory-estimate" in message
    # One block at 81 frames: the activations (3.37 GiB) are what does not fit 3 GiB a rank: fewer frames do.
    with pytest.raises(NotEnoughMemory) as refused:
        check_rank_memory(_request(layers=1, frames=81), available=6 * GIB)
    message = str(refused.value)
    frames = int(message.split("--frames ")[1].split(".")[0].split(";")[0])
    assert frames < 81 and (frames - 1) % 4 == 0
    assert estimate_rank_memory(_request(layers=1, frames=frames)).total_bytes <= 3 * GIB
    assert estimate_rank_memory(_request(layers=1, frames=frames + 4)).total_bytes > 3 * GIB
    assert "--layers" not in message.split("What would fit")[1]  # it has one block already
    # What fits is let through, with its estimate.
    assert check_rank_memory(_request(layers=1), available=8 * GIB).tokens == 7020


def test_the_command_refuses_the_default_wan_run_before_spawning_a_rank(monkeypatch, capsys):
    import tome_processors.bench.parallel as parallel
    import tome_processors.bench.rank_memory as rank_memory

    monkeypatch.setattr(rank_memory, "available_memory", lambda: 8 * rank_memory.GIB)
    monkeypatch.setattr(parallel, "_spawn", lambda *args: pytest.fail("a rank was spawned"))
    with pytest.raises(SystemExit) as exited:
        main(["bench", "--parallel", "ulysses=2", "--arch", "wan"])  # every preset: 4 copies of the whole model
    assert exited.value.code == 2
    error = capsys.readouterr().err
    assert "a rank would take about 23.25 GiB and 8.00 GiB is available, 4.00 GiB a rank" in error, error
    assert "4 copies of the model" in error and "What would fit, each alone: --layers " in error
    # --ignore-memory-estimate goes on to spawn the ranks.
    spawned = []
    row = {"name": "baseline", "seconds": [1.0], "speedups": [1.0]}
    monkeypatch.setattr(parallel, "_spawn", lambda *args: spawned.append(args) or [[row]])
    assert main(["bench", "--parallel", "ulysses=2", "--arch", "wan", "--ignore-memory-estimate"]) == 0
    assert spawned and spawned[0][3] is None  # no estimate to report a death with


@pytest.mark.parametrize("target", ["killed_beside_a_failing_rank", "killed_beside_a_waiting_rank"])
def test_a_killed_rank_is_named_with_its_signal_and_the_estimate(target):
    from tome_processors.bench.parallel import RankDied, _spawn
    from tome_processors.bench.rank_memory import RankMemory

    memory = RankMemory(parameters=10**9, copies=2, element_size=4, tokens=1_000, width=1_000)  # 8.10 GiB
    with pytest.raises(RankDied) as died:
        _spawn(getattr(dying_rank, target), 2, None, memory)
    message = str(died.value)
    assert message.startswith("rank 1 of the 2 ranks of the parallel bench was killed by SIGKILL")
    assert "killed by the operating system, likely for memory: a rank was estimated at 8.10 GiB" in message
    if target == "killed_beside_a_failing_rank":  # gloo's error on rank 0 comes after, as a consequence
        assert message.endswith("rank 0: RuntimeError: [gloo/transport/tcp/pair.cc:534] Connection closed by peer "
                                "[127.0.0.1]:29500")  # fmt: skip


def test_a_rank_s_own_error_is_still_raised_with_its_traceback():
    from tome_processors.bench.parallel import RankDied, _spawn

    with pytest.raises(RuntimeError, match="rank 0 of the parallel bench failed:\nTraceback") as failed:
        _spawn(dying_rank.both_failing, 2, None)
    assert not isinstance(failed.value, RankDied)


def test_the_command_reports_a_dead_rank_as_an_error(monkeypatch, capsys):
    import tome_processors.cli.bench_command as bench_command
    from tome_processors.bench.parallel import RankDied

    def die(*args, **kwargs):
        raise RankDied("rank 1 of the 2 ranks of the parallel bench was killed by SIGKILL")

    monkeypatch.setattr(bench_command, "run_parallel_bench", die)
    assert main(["bench", "--parallel", "ulysses=2", "--arch", "wan", "--quick"]) == 1
    assert "error: rank 1 of the 2 ranks of the parallel bench was killed by SIGKILL" in capsys.readouterr().err
