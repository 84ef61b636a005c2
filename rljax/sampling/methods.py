"""Sampling methods: pure functions over ``logits_BxV``.

Each truncation returns logits with the removed tokens set to ``-inf``; they
compose in the order the sampler applies them (temperature, top-k, top-p,
min-p, the order of Hugging Face's logits warpers). ``sample_tokens`` draws
from the result and also returns the log-probability of the drawn token under
that truncated, renormalised distribution, which is what importance
corrections against the sampler need.

Example:
  >>> import jax, jax.numpy as jnp
  >>> logits = jnp.log(jnp.array([[0.5, 0.3, 0.15, 0.05]]))
  >>> top_p(logits, 0.7)   # keeps 0.5 and 0.3: 0.5 < 0.7 <= 0.8
  Array([[-0.6931472, -1.2039728,       -inf,       -inf]], dtype=float32)
"""

from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp

_NEG_INF = -jnp.inf


def apply_temperature(logits_BxV: jax.Array, temperature: float) -> jax.Array:
  """``logits / temperature`` in fp32."""
  return logits_BxV.astype(jnp.float32) / temperature


def top_k(logits_BxV: jax.Array, k: int) -> jax.Array:
  """Keeps the ``k`` largest logits (ties with the k-th are kept too)."""
  k = min(int(k), logits_BxV.shape[-1])
  kth = jax.lax.top_k(logits_BxV, k)[0][..., -1:]
  return jnp.where(logits_BxV >= kth, logits_BxV, _NEG_INF)


def top_p(logits_BxV: jax.Array, p: float) -> jax.Array:
  """Nucleus: the smallest set of most likely tokens with total mass >= ``p``."""
  sorted_desc = jnp.sort(logits_BxV, axis=-1)[..., ::-1]
  probs = jax.nn.softmax(sorted_desc, axis=-1)
  mass_before = jnp.cumsum(probs, axis=-1) - probs
  keep_sorted = mass_before < p
  # The smallest kept logit is the threshold (the top token is always kept).
  threshold = jnp.min(jnp.where(keep_sorted, sorted_desc, jnp.inf), axis=-1,
                      keepdims=True)
  return jnp.where(logits_BxV >= threshold, logits_BxV, _NEG_INF)


def min_p(logits_BxV: jax.Array, p: float) -> jax.Array:
  """Keeps tokens whose probability is at least ``p`` times the top one's."""
  log_ratio = logits_BxV - jnp.max(logits_BxV, axis=-1, keepdims=True)
  return jnp.where(log_ratio >= jnp.log(p), logits_BxV, _NEG_INF)


def _batched(key: jax.Array) -> bool:
  """Whether ``key`` is a batch of keys (typed ``[B]``, or raw ``[B, 2]``)."""
  if jax.dtypes.issubdtype(key.dtype, jax.dtypes.prng_key):
    return key.ndim > 0
  return key.ndim > 1


def inverse_cdf_sample(key: jax.Array, logp_BxV: jax.Array) -> jax.Array:
  """Draws one token per row from ``exp(logp_BxV)`` with one uniform per row.

  ``key`` is one key, or one key per row (shape ``logp_BxV.shape[:-1]``):
  then row ``r`` draws from ``key[r]`` alone, whatever the other rows are
  (the sampler's per-row, per-column keys; continuous batching relies on it).

  ``jax.random.categorical`` draws ``B x V`` Gumbel variates per step, and
  generating that many random bits dominates a small model's decode step on
  CPU; the inverse CDF needs ``B`` uniforms. The CDF is taken in two levels,
  over ``~sqrt(V)`` blocks of ``~sqrt(V)`` tokens: the block whose cumulative
  mass passes ``u``, then the token inside it. XLA:CPU compiles a cumulative
  sum over ``V`` into a window sum of ``O(V^2)`` adds; two short ones cost
  ``O(V^1.5)``. The
  drawn block and token always have positive probability (each index is
  capped at the last positive one), so removed (``-inf``) tokens are never
  drawn, even when rounding puts ``u`` past the last partial sum.
  """
  b, v = logp_BxV.shape[:-1], logp_BxV.shape[-1]
  size = max(8, 1 << math.ceil(math.log2(math.sqrt(v))))
  nb = -(-v // size)
  probs = jnp.exp(logp_BxV.astype(jnp.float32))
  probs = jnp.pad(probs, [(0, 0)] * len(b) + [(0, nb * size - v)])
  blocks = probs.reshape(b + (nb, size))

  def first_past(cdf, u, positive):
    """The first index whose ``cdf`` exceeds ``u``, capped at the last
    index where ``positive``."""
    last = jnp.max(jnp.where(positive, jnp.arange(cdf.shape[-1]), 0), -1)
    return jnp.minimum(jnp.sum(cdf <= u, axis=-1), last)

  block_mass = jnp.sum(blocks, axis=-1)
  block_cdf = jnp.cumsum(block_mass, axis=-1)
  if _batched(key):  # one key per row: row r's draw depends on its key only
    u = jax.vmap(lambda k: jax.random.uniform(k, (1,)))(key.reshape(
        (-1,) + key.shape[len(b):])).reshape(b + (1,))
  else:
    u = jax.random.uniform(key, b + (1,))
  u = u * block_cdf[..., -1:]
  j = first_past(block_cdf, u, block_mass > 0)
  below = jnp.take_along_axis(block_cdf, j[..., None], -1) - jnp.take_along_axis(
      block_mass, j[..., None], -1)
  inside = jnp.take_along_axis(blocks, j[..., None, None], -2)[..., 0, :]
  i = first_past(jnp.cumsum(inside, axis=-1), u - below, inside > 0)
  return (j * size + i).astype(jnp.int32)


@dataclasses.dataclass(frozen=True)
class SamplingMethod:
  """How the next token is chosen (hashable: a static argument under jit).

  Attributes:
    temperature: divides the logits; ignored when ``greedy``.
    top_k: keep the k most likely tokens; None disables.
    top_p: nucleus mass; None disables.
    min_p: minimum probability relative to the top token; None disables.
    greedy: take the argmax.
    greedy_every: with ``k > 0``, row ``r`` of ``logits_BxV`` takes the
      argmax (sampler logprob 0) when ``r % k == k - 1``: the last row of
      each group of ``k`` group-contiguous rows. ReMax's greedy baseline
      sample per prompt, drawn in the same call as the group's samples.
  """

  temperature: float = 1.0
  top_k: int | None = None
  top_p: float | None = None
  min_p: float | None = None
  greedy: bool = False
  greedy_every: int = 0

  def __post_init__(self):
    if not self.greedy and not self.temperature > 0:
      raise ValueError(
          f"sampler.temperature={self.temperature!r}: a positive number is "
          "required (use greedy=True for argmax decoding).")
    if self.top_k is not None and (not isinstance(self.top_k, int)
                                   or self.top_k < 1):
      raise ValueError(
          f"sampler.top_k={self.top_k!r}: a positive integer or None.")
    if isinstance(self.greedy_every, bool) or not isinstance(
        self.greedy_every, int) or self.greedy_every < 0:
      raise ValueError(f"SamplingMethod.greedy_every={self.greedy_every!r}: "
                       "an integer >= 0 is required (0: off).")
    for name in ("top_p", "min_p"):
      value = getattr(self, name)
      if value is not None and not 0.0 < value <= 1.0:
        raise ValueError(f"sampler.{name}={value!r}: a number in (0, 1] or None.")

  def truncated_logits(self, logits_BxV: jax.Array) -> jax.Array:
    """Log-weights of the distribution actually sampled from (unnormalised)."""
    z = apply_temperature(logits_BxV, self.temperature)
    if self.top_k is not None:
      z = top_k(z, self.top_k)
    if self.top_p is not None and self.top_p < 1.0:
      z = top_p(z, self.top_p)
    if self.min_p is not None:
      z = min_p(z, self.min_p)
    return z

  def get_next_tokens(self, logits_BxV: jax.Array, key: jax.Array,
                      rows_B: jax.Array | None = None
                      ) -> tuple[jax.Array, jax.Array]:
    """Draws tokens; returns ``(tokens_B, logp_B)`` under the sampled distribution.

    ``key``: one key, or one per row (``inverse_cdf_sample``). ``rows_B``:
    the rollout row each logits row belongs to (``greedy_every`` reads it;
    default ``arange(B)``).
    """
    if self.greedy:
      return (jnp.argmax(logits_BxV, axis=-1).astype(jnp.int32),
              jnp.zeros(logits_BxV.shape[:-1], jnp.float32))
    z = self.truncated_logits(logits_BxV)
    logp = jax.nn.log_softmax(z, axis=-1)
    tokens = inverse_cdf_sample(key, logp)
    logp_B = jnp.take_along_axis(logp, tokens[..., None], -1)[..., 0]
    if self.greedy_every:
      row = jnp.arange(logits_BxV.shape[0]) if rows_B is None else rows_B
      row = row.reshape((-1,) + (1,) * (tokens.ndim - 1))
      argmax_row = row % self.greedy_every == self.greedy_every - 1
      tokens = jnp.where(argmax_row, jnp.argmax(logits_BxV, axis=-1).astype(
          jnp.int32), tokens)
      logp_B = jnp.where(argmax_row, 0.0, logp_B)
    return tokens, logp_B


def sample_tokens(logits_BxV: jax.Array, key: jax.Array,
                  method: SamplingMethod = SamplingMethod()):
  """Functional form of ``method.get_next_tokens``."""
  return method.get_next_tokens(logits_BxV, key)
