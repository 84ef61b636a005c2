"""The launchers (evaluate, sample, export) on one tiny finished run.

Each launcher runs in a real subprocess, as a user would type it.
"""

import json
import os
import shutil
import stat
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import launch
import rljax
from rljax import models, tokenizers, train
from tests.hf_extra import requires_hf

ROOT = os.path.join(os.path.dirname(__file__), "..")


def _run(module, *flags):
  env = dict(os.environ)
  env.pop("XLA_FLAGS", None)  # one CPU device, like a user's run
  proc = subprocess.run([sys.executable, "-m", module, *flags], cwd=ROOT,
                        env=env, capture_output=True, text=True, timeout=600)
  assert proc.returncode == 0, proc.stdout + proc.stderr
  return proc.stdout


def _run_failing(module, *flags):
  """``(stdout, stderr)`` of a launcher that must exit with an error."""
  env = dict(os.environ)
  env.pop("XLA_FLAGS", None)
  proc = subprocess.run([sys.executable, "-m", module, *flags], cwd=ROOT,
                        env=env, capture_output=True, text=True, timeout=600)
  assert proc.returncode != 0, proc.stdout + proc.stderr
  return proc.stdout, proc.stderr


@pytest.fixture(scope="module")
def workdir(finished_tiny_run):
  """The session's finished tiny main-job run (tests/conftest.py)."""
  return finished_tiny_run[0]


@pytest.mark.slow
def test_train_writes_its_record_named_after_the_config_and_seed(workdir):
  """The main job's config records as ``train_seed<N>-<commit>.json`` (other
  configs as ``<config stem>_seed<N>``), with the before/after figures."""
  names = [n for n in os.listdir(workdir) if n.endswith(".json")
           and n != "config.json"]
  assert len(names) == 1 and names[0].startswith("train_seed0-"), names
  with open(os.path.join(workdir, names[0])) as f:
    record = json.load(f)
  assert set(record["figures"]["before"]) == set(record["figures"]["after"])
  assert record["config"]["seed"] == 0
  # The launcher re-executed itself on huge pages where the host has them.
  tunables = record["machine"]["glibc_tunables"]
  env = {k: v for k, v in os.environ.items() if k != "GLIBC_TUNABLES"}
  if launch.huge_pages_env(env) is None:
    assert "hugetlb" not in tunables, tunables
  else:
    assert launch.HUGE_PAGES_TUNABLE in tunables.split(":"), tunables


def test_huge_pages_env_adds_the_tunable_once_and_keeps_the_others():
  if launch.huge_pages_env({}) is None:
    pytest.skip("no glibc or transparent huge pages off on this host")
  assert launch.huge_pages_env({"A": "1"}) == {
      "A": "1", "GLIBC_TUNABLES": "glibc.malloc.hugetlb=1"}
  assert launch.huge_pages_env({"GLIBC_TUNABLES": "glibc.malloc.arena_max=2"})[
      "GLIBC_TUNABLES"] == "glibc.malloc.arena_max=2:glibc.malloc.hugetlb=1"
  # Already there (as set or re-executed), or turned off: nothing to change.
  assert launch.huge_pages_env(
      {"GLIBC_TUNABLES": "glibc.malloc.hugetlb=0"}) is None
  assert launch.huge_pages_env({"RLJAX_HUGE_PAGES": "0"}) is None


def test_an_in_process_import_never_re_executes():
  """Importing ``launch`` (tests, notebooks) leaves the process alone: only
  ``python -m launch.<name>`` re-executes."""
  code = ("import os, sys; pid = os.getpid(); import launch; "
          "print(pid == os.getpid(), os.environ.get('GLIBC_TUNABLES', ''))")
  env = {k: v for k, v in os.environ.items()
         if k not in ("GLIBC_TUNABLES", "RLJAX_HUGE_PAGES")}
  out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env,
                       capture_output=True, text=True, timeout=60, check=True)
  assert out.stdout.split() == ["True"], out.stdout


@pytest.mark.slow
def test_evaluate_prints_a_table_and_writes_the_json(workdir, tmp_path):
  output = str(tmp_path / "eval.json")
  stdout = _run("launch.evaluate", f"--workdir={workdir}", "--num_samples=2",
                f"--output={output}")
  with open(output) as f:
    results = json.load(f)
  metrics = {k: v for k, v in results.items() if k != "step"}
  assert results["step"] == 3
  assert set(metrics) == {
      "eval/greedy_accuracy", "eval/greedy_avg@1", "eval/greedy_pass@1",
      "eval/greedy_maj@1", "eval/greedy_completion_length",
      "eval/accuracy", "eval/avg@2", "eval/pass@1", "eval/pass@2",
      "eval/maj@2", "eval/completion_length"}
  for name, value in metrics.items():
    if not name.endswith("completion_length"):
      assert 0.0 <= value <= 1.0, (name, value)
  # Unbiased pass@1 is the mean single-sample accuracy.
  assert results["eval/pass@1"] == pytest.approx(results["eval/accuracy"])
  assert results["eval/pass@1"] <= results["eval/pass@2"]
  table = {line.split()[0]: line for line in stdout.splitlines()
           if line.startswith("eval/")}
  assert set(table) == set(metrics)
  assert len({line.rindex(" ") for line in table.values()}) == 1  # aligned


@pytest.mark.slow
def test_sample_prints_the_prompt_and_its_completions(workdir):
  stdout = _run("launch.sample", f"--workdir={workdir}", "--prompt=12+34=",
                "--num_samples=2")
  lines = stdout.strip().splitlines()
  assert lines[0] == "=== '12+34='"
  assert len(lines) == 3 and all(line.startswith("  ") for line in lines[1:])


@pytest.mark.slow
def test_export_hf_loads_back_to_the_run_params(workdir, tmp_path):
  out = str(tmp_path / "hf")
  _run("launch.export", f"--workdir={workdir}", "--format=hf", f"--out={out}")
  policy = train.load_policy(workdir)
  config, params = models.load_hf_checkpoint(out)
  assert config.num_layers == policy.model_config.num_layers
  assert config.d_model == policy.model_config.d_model
  expected = jax.device_get(policy.params)
  got = jax.device_get(params)
  assert jax.tree.structure(got) == jax.tree.structure(expected)
  for g, e in zip(jax.tree.leaves(got), jax.tree.leaves(expected)):
    np.testing.assert_array_equal(np.asarray(g, np.float32),
                                  np.asarray(e, np.float32))


def _rljax_logits(policy, ids):
  """``[T, V]`` float32 logits of one sequence, from the rljax model."""
  tokens = jnp.asarray([ids], jnp.int32)
  logits, _ = models.Decoder(policy.model_config).apply(
      {"params": policy.params}, tokens, jnp.arange(len(ids))[None],
      return_logits=True)
  return np.asarray(logits[0], np.float32)


def _rljax_greedy(policy, ids, max_new_tokens):
  """Greedy completion by full forward passes (no cache): argmax of the
  rljax model's last logits, until EOS or ``max_new_tokens``."""
  eos = policy.tokenizer.eos_id
  out = []
  for _ in range(max_new_tokens):
    out.append(int(np.argmax(_rljax_logits(policy, ids + out)[-1])))
    if out[-1] == eos:
      break
  return out


@requires_hf("torch", "transformers", "tokenizers")
@pytest.mark.slow
def test_export_hf_by_default_loads_in_transformers_as_the_policy(workdir):
  """``--format=hf`` without ``--out`` writes ``<workdir>/export/hf``, which
  ``AutoModelForCausalLM`` / ``AutoTokenizer`` load: the prompts' ids are
  those the policy was trained on (BOS first), the logits and greedy
  completions are the rljax model's."""
  import torch
  import transformers

  stdout = _run("launch.export", f"--workdir={workdir}", "--format=hf")
  out = os.path.join(workdir, "export", "hf")
  assert f"AutoTokenizer.from_pretrained({out!r})" in stdout
  policy = train.load_policy(workdir)
  tok = transformers.AutoTokenizer.from_pretrained(out)
  model = transformers.AutoModelForCausalLM.from_pretrained(out).eval()
  _, _, heldout = train.build.load_task(policy.config)
  prompts = ["12+34=", "7+8=", "99+0="] + [e["prompt"] for e in heldout[:3]]
  expected = tokenizers.encode_prompts(policy.tokenizer, prompts)
  assert all(ids[0] == policy.tokenizer.bos_id for ids in expected)
  for prompt, ids in zip(prompts, expected):
    assert tok(prompt)["input_ids"] == ids, prompt
    with torch.no_grad():
      logits = model(torch.tensor([ids])).logits[0].numpy()
    np.testing.assert_allclose(logits, _rljax_logits(policy, ids), atol=1e-4,
                               rtol=0)
    want = _rljax_greedy(policy, ids, 6)
    with torch.no_grad():
      got = model.generate(torch.tensor([ids]),
                           attention_mask=torch.ones(1, len(ids), dtype=int),
                           do_sample=False, max_new_tokens=6)[0, len(ids):]
    assert got.tolist()[:len(want)] == want, prompt
    text = [i for i in want if i != policy.tokenizer.eos_id]
    assert (tok.decode(want, skip_special_tokens=True)
            == policy.tokenizer.decode(text)), want
  with open(os.path.join(out, "config.json")) as f:
    config = json.load(f)
  assert (config["bos_token_id"], config["eos_token_id"],
          config["pad_token_id"]) == (tok.bos_token_id, tok.eos_token_id,
                                      tok.pad_token_id) == (2, 3, 0)
  with open(os.path.join(out, "generation_config.json")) as f:
    generation = json.load(f)
  assert generation["eos_token_id"] == policy.tokenizer.eos_id
  for name in os.listdir(out):
    mode = stat.S_IMODE(os.stat(os.path.join(out, name)).st_mode)
    assert mode & 0o044, (name, oct(mode))  # not the 0o600 of a tempfile


@pytest.mark.slow
@pytest.mark.parametrize("run_files", [(), ("config.json", "tokenizer.model"),
                                       ("config.json", "tokenizer.model",
                                        "checkpoints/")])
def test_export_of_a_directory_that_is_not_a_run_is_one_line(
    workdir, tmp_path, run_files):
  """An empty directory, a run without ``checkpoints/``, and one whose
  ``checkpoints/`` is empty: one ``error:`` line naming ``--workdir``, no
  traceback, nothing written."""
  bad = tmp_path / "bad"
  bad.mkdir()
  for name in run_files:
    if name.endswith("/"):
      (bad / name).mkdir()
    else:
      shutil.copy(os.path.join(workdir, name), bad / name)
  stdout, stderr = _run_failing("launch.export", f"--workdir={bad}",
                                "--format=hf")
  assert "Traceback" not in stderr, stderr
  errors = [line for line in stderr.splitlines() if line.startswith("error:")]
  assert len(errors) == 1 and f"--workdir={bad}" in errors[0], stderr
  assert "checkpoint" in errors[0] or "config.json" in errors[0], errors
  assert not stdout and not (bad / "export").exists()


@pytest.mark.parametrize("module, override, says", [
    ("launch.train", "--config.rl.grup_size=16",
     "config has no field 'rl.grup_size'; did you mean config.rl.group_size"),
    ("launch.train_reward_model", "--config.rlx.group_size=16",
     "config has no field 'rlx.group_size'; did you mean "
     "config.rl.group_size?"),
    ("launch.train", "--config.rl.group_size=sixteen",
     "invalid literal for int()"),
])
def test_a_mistyped_config_field_is_one_line_with_the_closest_names(
    tmp_path, module, override, says):
  stdout, stderr = _run_failing(module, override, f"--workdir={tmp_path}/w")
  first, error = stderr.splitlines()  # what it builds, then the error
  assert f"rljax {rljax.__version__}: {module} with " in first, first
  assert error.startswith(f"error: {override}: ") and says in error, stderr
  assert not stdout and not os.path.exists(f"{tmp_path}/w")


@pytest.mark.slow
def test_a_model_override_the_config_does_not_set_is_added(tmp_path):
  """``:tiny`` sets no ``model.overrides``: a flag adds the key (a one-block
  decoder, read back from the checkpoint's parameters); a key the model
  config has no field for is one line naming the closest."""
  flags_ = ["--config=configs/arithmetic_grpo.py:tiny", "--config.rl.num_steps=1",
            "--config.sft.num_steps=0", "--config.eval.every=0"]
  _run("launch.train", *flags_, "--config.model.overrides.num_layers=1",
       f"--workdir={tmp_path}/one")
  params = train.load_policy(f"{tmp_path}/one").params
  assert sorted(k for k in params if k.startswith("layers_")) == ["layers_0"]
  _, stderr = _run_failing("launch.train", *flags_,
                           "--config.model.overrides.num_layerz=1",
                           f"--workdir={tmp_path}/typo")
  [error] = [line for line in stderr.splitlines() if line.startswith("error:")]
  assert ("model.overrides.num_layerz=1: the model config has no field "
          "'num_layerz'; did you mean num_layers?") in error, stderr
  assert "Traceback" not in stderr


def test_a_dict_fields_keys_and_verbosity_keep_their_ways(tmp_path):
  """Keys under a dict field (``task.kwargs``) are not mistakes; with
  ``--verbosity`` the mistyped field keeps ml_collections' traceback."""
  stdout, stderr = _run_failing(
      "launch.train", "--config.task.kwargs.max_digits=3",
      "--config.sampler.temprature=2", f"--workdir={tmp_path}/w")
  assert stderr.splitlines()[1].startswith(
      "error: --config.sampler.temprature=2: config has no field "
      "'sampler.temprature'; did you mean config.sampler.temperature"), stderr
  _, stderr = _run_failing("launch.train", "--config.sampler.temprature=2",
                           "--verbosity=0", f"--workdir={tmp_path}/w")
  assert "Traceback" in stderr and "temprature" in stderr
