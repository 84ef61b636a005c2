"""benchmarks/HISTORY.md is generated from the records (launch/benchmark_history.py)."""

import json

import pytest

from launch import benchmark_history


def test_the_committed_history_is_the_records():
  with open(benchmark_history.HISTORY, encoding="utf-8") as f:
    committed = f.read()
  assert committed == benchmark_history.render(
      benchmark_history.read_records()), (
          "benchmarks/HISTORY.md is stale: run python -m "
          "launch.benchmark_history")


def test_a_hand_written_record_renders_its_row(tmp_path):
  record = {"name": "bench_x", "commit": "abcdef0123456789", "dirty": True,
            "time": "2026-01-02T03:04:05+0000",
            "machine": {"cpu": {"model_name": "CPU X", "family": "6",
                                "model": "7"}},
            "figures": {"baseline": {"total_s": 2.0}, "ratio_total": 1.23456,
                        "flag": True, "n": 3, "nan": float("nan")}}
  (tmp_path / "bench_x-abcdef012345.json").write_text(json.dumps(record))
  (tmp_path / "bench_y-1.json").write_text(json.dumps(
      {"name": "bench_y", "figures": {}, "commit": "1"}))
  page = benchmark_history.render(benchmark_history.read_records(tmp_path))
  assert ("| 2026-01-02 | abcdef012345+ | CPU X (family 6, model 7) | "
          "`ratio_total` 1.235, `baseline.total_s` 2, `n` 3 | "
          "`bench_x-abcdef012345.json` |") in page.splitlines()
  assert page.index("## bench_x") < page.index("## bench_y")
  assert "| ? | 1 | ? | - | `bench_y-1.json` |" in page.splitlines()


@pytest.mark.parametrize("text", ['{"name": "bench_x", "figu', "[1, 2]"])
def test_a_half_written_record_is_named(tmp_path, text):
  (tmp_path / "bench_x-1.json").write_text(text)
  with pytest.raises(ValueError, match="bench_x-1.json"):
    benchmark_history.read_records(tmp_path)
