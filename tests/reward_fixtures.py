"""Misbehaving reward functions for the training-loop tests (module-level so
that spawned reward workers can import them)."""

import time


def raises(prompts, completions, **fields):
  raise RuntimeError("this reward function always fails")


def hangs(prompts, completions, **fields):
  time.sleep(60)
  return [1.0] * len(completions)


def returns_none(prompts, completions, **fields):
  return [None] * len(completions)


def parity(prompts, completions, **fields):
  """1 for completions of odd length: a reward with variance in every group."""
  return [float(len(c) % 2) for c in completions]


def none_on_first_row(prompts, completions, **fields):
  """None for the first sample of the batch (used with `raises` to make one
  row whose every reward failed)."""
  return [None] + [1.0] * (len(completions) - 1)
