r"""Held-out accuracy of a trained run: greedy, avg@k, pass@k, maj@k.

  python -m launch.evaluate --workdir=/tmp/rljax_demo --num_samples=8 \
      --output=/tmp/rljax_demo/eval.json

Uses the run's task, held-out split, reward functions and sampler settings;
a run with an environment (``env.name``) is evaluated on whole episodes, the
environment stepped in this process.
Prints an aligned table of the metrics, then the same metrics as JSON;
``--output`` also writes the JSON to a file.
"""

import json

from absl import flags
import jax

from launch import cli
from rljax import sampling
from rljax import rollout as rollout_lib
from rljax.train import build, evaluation, load_policy
from rljax.train import policy as policy_lib

_WORKDIR = flags.DEFINE_string("workdir", None, "a training run directory",
                               required=True)
_STEP = flags.DEFINE_integer("step", None, "checkpoint step (default latest)")
_NUM = flags.DEFINE_integer("num_samples", 8, "samples per prompt (k)")
_EXAMPLES = flags.DEFINE_integer("num_examples", None,
                                 "held-out prompts (default: the run's)")
_SEED = flags.DEFINE_integer("seed", 0, "PRNG seed")
_OUTPUT = flags.DEFINE_string("output", None, "also write the JSON here")


def _table(results):
  """One ``name  value`` line per metric in computation order, aligned."""
  width = max(len(name) for name in results)
  return "\n".join(
      f"{name:<{width}}  {value:.4f}" if isinstance(value, float)
      else f"{name:<{width}}  {value}" for name, value in results.items())


def main(argv):
  del argv
  cli.setup_logging()
  policy = load_policy(_WORKDIR.value, _STEP.value)
  config = policy.config
  if _EXAMPLES.value:
    config.eval.num_examples = _EXAMPLES.value
  _, _, heldout = build.load_task(config)
  tok = policy.tokenizer
  results = {"step": policy.step}
  config.env.num_workers = 0
  runner = build.env_runner(config)
  try:
    with build.make_evaluator(
        config, num_workers=0, tokenizer=tok,
        load_judge=policy_lib.load_judge) as evaluator:
      for label, k, greedy in (("greedy_", 1, True), ("", _NUM.value, False)):
        sc = build.sampler_config(config, tok, k, greedy=greedy)
        fn = sampling.make_sampler(policy.model_config, sc)
        episodes = None if runner is None else rollout_lib.MultiTurnSampler(
            policy.model_config, sc,
            build.turn_config(config, tok, runner.stop_strings), runner, tok,
            sc.prompt_buckets, observation_role=config.env.observation_role)
        results.update(evaluation.evaluate(
            policy.params, fn, tok, heldout, evaluator,
            jax.random.key(_SEED.value), num_samples=k,
            buckets=sc.prompt_buckets, eos_ids=sc.eos_ids,
            correctness_reward=build.correctness_reward(config),
            prefix=f"eval/{label}", episodes=episodes))
  finally:
    if runner is not None:
      runner.close()
  text = json.dumps(results, indent=2, sort_keys=True)
  print(_table(results))
  print(text)
  if _OUTPUT.value:
    with open(_OUTPUT.value, "w") as f:
      f.write(text + "\n")


if __name__ == "__main__":
  cli.run(main)
