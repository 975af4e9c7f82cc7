"""`tome-processors bench`: a row whose method merges nothing in its forwards says so, and why.

The engine counts the tokens through the model's linear layers in each method's first forward; a method that
merges or pools anything sends fewer than the baseline. On the `--quick` model on the CPU the presets merge
nothing (the pays rule), while an explicit ratio merges.
"""

from __future__ import annotations

import json

import pytest
import torch

from tome_processors.bench.engine import BenchSettings, Method, Row, count_linear_tokens, run_benchmark
from tome_processors.bench.methods import baseline_method
from tome_processors.bench.report import IDLE_MARK, idle_reason, markdown_table
from tome_processors.cli.main import main


def halve_tokens(model: torch.nn.Module) -> None:
    """A toy merge: the second layer gets every other token, and its output is copied back to both."""
    model[1].register_forward_pre_hook(lambda module, args: (args[0][:, ::2],))
    model[1].register_forward_hook(lambda module, args, out: out.repeat_interleave(2, dim=1))


def look_only(model: torch.nn.Module) -> None:
    """A method that is on the model and changes nothing (a merge the pays rule turned off)."""
    model[1].register_forward_pre_hook(lambda module, args: None)


def take_off(model: torch.nn.Module) -> None:
    model[1]._forward_pre_hooks.clear()
    model[1]._forward_hooks.clear()


@pytest.mark.parametrize("compiled", [False, True])
def test_the_engine_tells_from_the_forward_whether_a_method_merged(compiled):
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 4))
    x = torch.randn(1, 8, 4, generator=torch.Generator().manual_seed(0))
    methods = [
        baseline_method(),
        Method("halves", "toy", 0.5, halve_tokens, take_off),
        Method("looks", "toy", 0.5, look_only, take_off),
    ]
    settings = BenchSettings(rounds=1, measure_memory=False, host_cost=False, progress=False)
    if compiled:
        settings = BenchSettings(
            rounds=1, measure_memory=False, host_cost=False, progress=False, compile="default", compile_backend="eager"
        )
    rows = run_benchmark(model, methods, lambda m: m(x), settings)
    assert [row.linear_tokens for row in rows] == [16, 8 + 4, 16]
    assert [row.merges for row in rows] == [None, True, False]
    assert count_linear_tokens(model, lambda: model(x))[1] == 16 and not model[1]._forward_pre_hooks


def test_a_row_that_merges_nothing_is_marked_and_its_footnote_says_where_its_columns_come_from():
    base = Row("baseline", "baseline", None, 1.0, 1.0, 0.0, linear_tokens=10)
    idle = Row("ours fast", "ours fast", None, 1.0, 1.0, 0.0, linear_tokens=10, merges=False)
    idle.settings = {"pays_only": True}
    idle.idle = idle_reason(idle, "cpu", ("trained eps change %",))
    merged = Row("ours r=0.5", "ours", 0.5, 0.8, 1.25, 0.02, linear_tokens=6, merges=True)
    lines = markdown_table([base, idle, merged]).splitlines()
    assert lines[3].startswith(f"| ours fast {IDLE_MARK} |") and lines[4].startswith("| ours r=0.5 |")
    assert lines[-1].startswith(f"{IDLE_MARK} ours fast: merges nothing in these forwards")
    assert "pays rule" in lines[-1] and "on cpu" in lines[-1] and "pays_only=False" in lines[-1]
    assert "trained eps change % there come from the trained model with merging forced on" in lines[-1]
    assert IDLE_MARK not in markdown_table([base, merged])


@pytest.mark.pays_rule  # the real table: the tests' session merges wherever a config selects
def test_quick_bench_says_which_rows_merge_nothing_and_why(tmp_path, capsys):
    path = tmp_path / "bench.json"
    argv = ["bench", "--quick", "--threads", "1", "--rounds", "1", "--no-progress", "--no-trained-quality"]
    argv += ["--ratios", "0.5", "--presets", "exact", "--modes", "none", "--no-tomesd", "--json", str(path)]
    assert main(argv) == 0
    printed = capsys.readouterr().out
    rows = {row["name"]: row for row in json.loads(path.read_text())["rows"]}
    assert list(rows) == ["baseline", "ours r=0.5", "ours exact r=0.5"]
    preset, explicit, base = rows["ours exact r=0.5"], rows["ours r=0.5"], rows["baseline"]
    # Measured in the forwards: the preset's tokens are the baseline's, the explicit ratio's fewer.
    assert preset["linear_tokens"] == base["linear_tokens"] and preset["merges"] is False
    assert explicit["linear_tokens"] < base["linear_tokens"] and explicit["merges"] is True
    assert preset["rel_error"] == 0.0 and explicit["rel_error"] > 0.0
    assert "pays rule" in preset["idle"] and "on cpu" in preset["idle"] and explicit["idle"] is None
    assert f"| ours exact r=0.5 {IDLE_MARK} |" in printed and "| ours r=0.5 |" in printed
    assert f"{IDLE_MARK} ours exact r=0.5: merges nothing in these forwards" in printed
