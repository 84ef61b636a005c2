"""Benchmark records: figures with the commit and machine they belong to."""

import json
import os
import subprocess

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
