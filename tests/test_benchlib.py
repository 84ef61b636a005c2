"""Benchmark records: figures with the commit and machine they belong to."""

import json
import os
import subprocess

import pytest

from launch import benchlib

ROOT = os.path.join(os.path.dirname(__file__), "..")


def test_write_record_names_the_commit_config_and_machine(tmp_path):
  path = benchlib.write_record("bench_x", {"tokens_per_s": 123.5},
                               str(tmp_path), {"preset": "tiny"})
  record = json.loads(open(path).read())
  head = subprocess.run(["git", "rev-parse", "HEAD"], cwd=ROOT,
                        capture_output=True, text=True).stdout.strip()
  assert record["commit"] == (head or "unknown")
  assert os.path.basename(path) == f"bench_x-{(head or 'unknown')[:12]}.json"
  assert record["figures"] == {"tokens_per_s": 123.5}
  assert record["config"] == {"preset": "tiny"}
  assert record["machine"]["cpu_count"] == os.cpu_count()
  assert isinstance(record["dirty"], bool)


def test_the_roofline_is_the_best_rate_over_sizes(monkeypatch):
  """``matmul_flops_per_s`` keeps the fastest size's rate: one low reading
  (a host slowed for a moment) must not become the peak."""
  rates = {}
  calls = []

  def fake_best_time(fn, a, repeats):
    n = a.shape[0]
    calls.append((n, repeats))
    return 2 * n ** 3 / rates[n]

  monkeypatch.setattr(benchlib, "best_time", fake_best_time)
  rates.update({64: 500e9, 128: 400e9})
  assert benchlib.matmul_flops_per_s(sizes=(64, 128), repeats=3) == (
      pytest.approx(500e9, rel=1e-12))
  assert calls == [(64, 3), (128, 3)]
  rates.update({64: 300e9, 128: 450e9})
  assert benchlib.matmul_flops_per_s(sizes=(64, 128), repeats=3) == (
      pytest.approx(450e9, rel=1e-12))
