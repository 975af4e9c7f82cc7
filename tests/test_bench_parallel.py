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
