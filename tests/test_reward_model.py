"""Reward models (rljax.models.reward_model): scores, HF import and export.

Parity: tiny random ``*ForSequenceClassification`` models of three families
(weights moved away from their init), saved by ``transformers``, read by
``load_hf_reward_model``; rljax scores a left-padded batch, transformers each
row alone and a right-padded batch (its own last-non-pad pooling).
"""

import functools
import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from rljax import models, sampling
from rljax.models import reward_model as rm
from tests.hf_extra import requires_hf
from tests.test_hf import _COMMON, VOCAB, _hf

requires_torch = requires_hf("torch", "transformers")

PAD = VOCAB - 1  # never drawn in the prompts below


def _configs():
  _, t = _hf()
  return {
      "llama": (t.LlamaForSequenceClassification, t.LlamaConfig(
          num_hidden_layers=2, rope_theta=500_000.0, **_COMMON)),
      "qwen2": (t.Qwen2ForSequenceClassification, t.Qwen2Config(
          num_hidden_layers=2, rope_theta=1_000_000.0, **_COMMON)),
      "gemma2": (t.Gemma2ForSequenceClassification, t.Gemma2Config(
          num_hidden_layers=2, sliding_window=4, query_pre_attn_scalar=24,
          attn_logit_softcapping=5.0, final_logit_softcapping=3.0,
          **_COMMON)),
  }


NUM_LABELS = {"llama": 1, "qwen2": 1, "gemma2": 2}


def _hf_model(name):
  torch, _ = _hf()
  cls, config = _configs()[name]
  config.num_labels = NUM_LABELS[name]
  config.pad_token_id = PAD
  config._attn_implementation = "eager"  # pylint: disable=protected-access
  torch.manual_seed(len(name))
  model = cls(config).eval()
  with torch.no_grad():
    for p in model.parameters():
      if p.ndim == 1:
        p.add_(0.1 * torch.randn_like(p))
      else:
        p.normal_(0.0, 0.15)
  return model


@pytest.fixture(scope="module", params=["llama", "qwen2", "gemma2"])
def family(request, tmp_path_factory):
  name = request.param
  model = _hf_model(name)
  path = str(tmp_path_factory.mktemp(f"rm_{name}"))
  model.save_pretrained(path)
  config, params = rm.load_hf_reward_model(path)
  return name, model, path, config, params


PROMPTS = [np.random.RandomState(0).randint(0, PAD, size=n) for n in (3, 9, 12)]


@functools.lru_cache(maxsize=None)
def _scores_fn(config):
  return jax.jit(functools.partial(rm.scores, config=config))


def _hf_scores(model, rows):
  torch, _ = _hf()
  with torch.no_grad():
    return np.stack([model(torch.tensor(r[None])).logits[0].numpy()
                     for r in rows])


@requires_torch
def test_scores_match_transformers_on_a_left_padded_batch(family):
  name, model, _, config, params = family
  assert config.num_labels == NUM_LABELS[name]
  assert "lm_head" not in params["decoder"]
  tokens, mask = sampling.pad_prompts([list(p) for p in PROMPTS], (16,),
                                      pad_id=PAD)
  ours = np.asarray(_scores_fn(config)(params, tokens_BxT=tokens,
                                       input_mask_BxT=mask))
  assert ours.shape == (3, NUM_LABELS[name])
  np.testing.assert_allclose(ours, _hf_scores(model, PROMPTS), atol=1e-4,
                             rtol=0)
  # transformers' own batch: right-padded with the pad id, its pooling.
  torch, _ = _hf()
  right = np.full((3, 12), PAD)
  for i, p in enumerate(PROMPTS):
    right[i, :len(p)] = p
  with torch.no_grad():
    batch = model(torch.tensor(right),
                  attention_mask=torch.tensor(right != PAD).long()).logits
  np.testing.assert_allclose(ours, batch.numpy(), atol=1e-4, rtol=0)


@requires_torch
def test_export_round_trip_is_exact_and_transformers_reloads_it(
    family, tmp_path):
  _, transformers = _hf()
  name, model, _, config, params = family
  files = rm.save_hf_reward_model(tmp_path, config, params,
                                  extra_config={"pad_token_id": PAD},
                                  max_shard_size=40_000)
  assert "model.safetensors.index.json" in files
  config2, params2 = rm.load_hf_reward_model(tmp_path)
  assert config2 == config
  jax.tree.map(np.testing.assert_array_equal, params2, params)
  reloaded = transformers.AutoModelForSequenceClassification.from_pretrained(
      tmp_path, attn_implementation="eager").eval()
  assert type(reloaded) is type(model)
  np.testing.assert_allclose(_hf_scores(reloaded, PROMPTS),
                             _hf_scores(model, PROMPTS), atol=1e-5, rtol=0)


# --------------------------------------------------------------------------
# Pure JAX

CONFIG = rm.RewardModelConfig(models.get_preset("tiny"), num_labels=1)


@pytest.fixture(scope="module")
def tiny_params():
  params = rm.init_params(CONFIG, jax.random.key(0))
  kernel = jax.random.normal(jax.random.key(1), (CONFIG.decoder.d_model, 1))
  return {"decoder": params["decoder"], "score": {"kernel": kernel}}


def test_last_token_index_is_the_rightmost_real_position():
  mask = np.array([[0, 1, 1, 0], [1, 0, 0, 0], [0, 0, 0, 0], [1, 1, 1, 1]],
                  bool)
  want = [max([i for i in range(4) if m[i]], default=0) for m in mask]
  np.testing.assert_array_equal(rm.last_token_index(jnp.asarray(mask)), want)


def test_a_padded_row_scores_as_the_row_alone(tiny_params):
  rows = [[5, 6, 7], [8, 9, 10, 11, 12]]
  tokens, mask = sampling.pad_prompts(rows, (8,))
  batch = np.asarray(rm.scores(tiny_params, CONFIG, tokens, mask))
  for i, row in enumerate(rows):
    t = jnp.asarray([row])
    hidden, _ = models.Decoder(CONFIG.decoder).apply(
        {"params": tiny_params["decoder"]}, t,
        jnp.arange(len(row))[None])
    want = np.asarray(hidden[0, -1], np.float64) @ np.asarray(
        tiny_params["score"]["kernel"], np.float64)
    np.testing.assert_allclose(batch[i], want, rtol=2e-5, atol=2e-5)


def test_fresh_head_scores_zero_and_a_policy_decoder_loses_its_lm_head():
  decoder_config = models.get_preset("tiny").replace(tie_embeddings=False)
  policy = models.init_params(decoder_config, jax.random.key(0))
  assert "lm_head" in policy
  config = rm.RewardModelConfig(decoder_config)
  assert config.decoder.tie_embeddings
  params = rm.init_params(config, None, decoder=policy)
  assert "lm_head" not in params["decoder"]
  tokens, mask = sampling.pad_prompts([[1, 2, 3]], (4,))
  np.testing.assert_array_equal(rm.scores(params, config, tokens, mask), 0.0)


@pytest.mark.parametrize("num_labels", [0, -1, 1.5, True])
def test_bad_num_labels_is_a_clear_error(num_labels):
  with pytest.raises(ValueError, match="num_labels"):
    rm.RewardModelConfig(models.get_preset("tiny"), num_labels=num_labels)


def test_causal_lm_checkpoint_is_refused_with_a_hint(tmp_path, tiny_params):
  models.save_hf_checkpoint(tmp_path, CONFIG.decoder, tiny_params["decoder"])
  with pytest.raises(ValueError, match="LlamaForCausalLM.*a causal LM.*"
                     "load_hf_checkpoint"):
    rm.load_hf_reward_model(tmp_path)


def _edit(path, **changes):
  file = path / "config.json"
  hf = json.loads(file.read_text())
  hf.update(changes)
  file.write_text(json.dumps(hf))


def test_score_shape_against_id2label_and_bad_labels(tmp_path, tiny_params):
  rm.save_hf_reward_model(tmp_path, CONFIG, tiny_params)
  config, params = rm.load_hf_reward_model(tmp_path)
  assert config == CONFIG
  jax.tree.map(np.testing.assert_array_equal, params, tiny_params)
  _edit(tmp_path, id2label={"0": "a", "1": "b"})
  with pytest.raises(ValueError, match=r"'score.weight' has shape \[1, 64\], "
                     r"but config.json implies \[2, 64\]"):
    rm.load_hf_reward_model(tmp_path)
  _edit(tmp_path, id2label={})
  with pytest.raises(ValueError, match="id2label=.*non-empty"):
    rm.load_hf_reward_model(tmp_path)


def test_export_refuses_params_of_another_shape(tmp_path, tiny_params):
  bad = {"decoder": tiny_params["decoder"],
         "score": {"kernel": jnp.zeros((CONFIG.decoder.d_model, 3))}}
  with pytest.raises(ValueError, match="score/kernel.*has shape"):
    rm.save_hf_reward_model(tmp_path, CONFIG, bad)
