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
