"""`tome-processors bench --parallel`: ranks spawned on the CPU, seconds per forward and the collectives' bytes."""

from __future__ import annotations

import json

import pytest

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
