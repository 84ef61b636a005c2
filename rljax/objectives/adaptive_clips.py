"""PPO clips whose interval adapts: per token to `pi_old`'s probability
(DCPO, BandPO), per batch to balance positive and negative advantages
(BAPO), or per token to its staleness against the sampler (SAT). Each gives `c = r * [not clipped]` for the interval `[low, high]`:

    clipped = (A > 0 and r > high) or (A < 0 and r < low)
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from rljax.objectives._common import (
    _Tx, _advantages, _check_bxt, _check_positive, _logprobs, _mask, _out,
    _stateless)

BAND_DIVERGENCES = ("tv", "chi2", "kl")


def _clip_coefficient(r, a, low, high):
  clipped = ((a > 0) & (r > high)) | ((a < 0) & (r < low))
  return jnp.where(clipped, 0.0, r)


def dcpo_clip(eps_low: float = 0.2, eps_high: float = 0.28,
              clip_ratio_c: float = 10.0) -> _Tx:
  """DCPO's dynamic-adaptive clip: bounds from `q = pi_old(token)`.

      low  = (1 + sqrt(max(1 - 4 eps_low / q, 0))) / 2
      high = min((1 + sqrt(1 + 4 eps_high / q)) / 2, max(clip_ratio_c, 10))
      c    = r * [not clipped],  then 0 where A < 0 and r > clip_ratio_c

  (the dual clip of its `clip_type="dynamic"`). A rare token (small `q`)
  may move further up than a likely one. Needs `old_logprobs_BxT`. Paper
  settings (`recipe/dcpo/run_dcpo.sh`): eps 0.2 / 0.28, `clip_ratio_c=10`.

  References:
    Yang et al., "DCPO: Dynamic Clipping Policy Optimization",
    https://arxiv.org/abs/2509.02333; lime-RL/DCPO
    `verl/trainer/ppo/core_algos.py` (`get_clip_low_high`,
    `compute_policy_loss_dcpo`).
  """
  fn = "dcpo_clip"
  _check_positive(fn, "eps_low", eps_low)
  _check_positive(fn, "eps_high", eps_high)
  _check_positive(fn, "clip_ratio_c", clip_ratio_c)

  def update_fn(ratio_BxT, state, params=None, *, advantages_BxT=None,
                old_logprobs_BxT=None, **extra_args):
    del params, extra_args
    ratio_BxT = _check_bxt(fn, "ratio_BxT", ratio_BxT)
    a = _advantages(fn, advantages_BxT, ratio_BxT.shape)
    q = jnp.exp(_logprobs(fn, "old_logprobs_BxT", old_logprobs_BxT,
                          ratio_BxT.shape))
    r = ratio_BxT.astype(jnp.float32)
    low = (1 + jnp.sqrt(jnp.maximum(1 - 4 * eps_low / q, 0.0))) / 2
    high = jnp.minimum((1 + jnp.sqrt(1 + 4 * eps_high / q)) / 2,
                       jnp.maximum(clip_ratio_c, 10.0))
    c = _clip_coefficient(r, a, low, high)
    c = jnp.where((a < 0) & (r > clip_ratio_c), 0.0, c)
    return _out(c, ratio_BxT), state

  return _stateless(update_fn)


def _band_kl_bounds(p, delta, iterations=50):
  """BandPO's KL band by bisection (its `universal_bisection_solver`).

  `g(r) = p f(r) + (1 - p) f((1 - r p) / (1 - p))`, `f(u) = u - 1 - log u`;
  the upper bound solves `g = delta` on `[1, 1/p]`, the lower on `[0, 1]`;
  `1/p` (resp. 0) where `g` stays below `delta` there (saturation).
  """
  f = lambda u: u - 1.0 - jnp.log(u)

  def g(r):
    comp = (1.0 - r * p) / (1.0 - p)
    return (p * f(jnp.maximum(r, 1e-12))
            + (1.0 - p) * f(jnp.maximum(comp, 1e-12)))

  def bisect(lo, hi, rising):
    def body(_, bounds):
      lo, hi = bounds
      mid = 0.5 * (lo + hi)
      below = g(mid) < delta
      go_up = below if rising else ~below
      return jnp.where(go_up, mid, lo), jnp.where(go_up, hi, mid)
    lo, hi = jax.lax.fori_loop(0, iterations, body, (lo, hi))
    return 0.5 * (lo + hi)

  upper = bisect(jnp.ones_like(p), 1.0 / p, rising=True)
  upper = jnp.where(g(1.0 / p) <= delta, 1.0 / p, upper)
  lower = bisect(jnp.zeros_like(p), jnp.ones_like(p), rising=False)
  lower = jnp.where(g(jnp.zeros_like(p)) <= delta, 0.0, lower)
  return lower, upper


def band_clip(divergence: str = "tv", delta: float = 0.05,
              eps_low: float | None = 0.2, eps_high: float | None = 0.28,
              upper_max: float = 100.0) -> _Tx:
  """BandPO: the PPO interval implied by an f-divergence ball around `pi_old`.

  With `p = pi_old(token)` (closed forms of the paper's Prop. 4):

      tv:    low = max(1 - delta / p, 0),            high = min(1 + delta / p, 1 / p)
      chi2:  low = max(1 - sqrt(delta (1-p) / p), 0), high = min(1 + sqrt(...), 1 / p)
      kl:    the roots of p f(r) + (1-p) f((1 - r p) / (1 - p)) = delta,
             f(u) = u - 1 - log u, by 50 bisection steps (no closed form)

  then the reference code's relaxation (skipped if `eps_low`/`eps_high`
  is None): `low = min(low, 1 - eps_low)`, `high = max(high, 1 + eps_high)`,
  and `low` in `[0, 1]`, `high` in `[1, upper_max]`; near `p = 1`
  (`p > 1 - 1e-6`) the limits `high = 1`, `low = 1 - delta` (tv) or 1
  (chi2) or `exp(-delta)` (kl) before relaxation. `c = r * [not clipped]`,
  no dual clip. The reference code stops bisecting once every interval is
  below 1e-6 wide; here the 50 steps always run (a difference below 1e-6).

  References:
    Li et al., "BandPO: Bridging Trust Regions and Ratio Clipping via
    Probability-Aware Bounds for LLM Reinforcement Learning",
    https://arxiv.org/abs/2603.04918; OpenMOSS/BandPO
    `verl/bandpo/band/band.py` (`band`, defaults `delta=0.05`, relaxation
    on, `upper_bound_max=100`).
  """
  fn = "band_clip"
  if divergence not in BAND_DIVERGENCES:
    raise ValueError(f"{fn}: divergence={divergence!r}; accepted: "
                     f"{BAND_DIVERGENCES}.")
  _check_positive(fn, "delta", delta)

  def update_fn(ratio_BxT, state, params=None, *, advantages_BxT=None,
                old_logprobs_BxT=None, **extra_args):
    del params, extra_args
    ratio_BxT = _check_bxt(fn, "ratio_BxT", ratio_BxT)
    a = _advantages(fn, advantages_BxT, ratio_BxT.shape)
    p = jnp.exp(jnp.clip(_logprobs(fn, "old_logprobs_BxT", old_logprobs_BxT,
                                   ratio_BxT.shape), -700.0, 0.0))
    r = ratio_BxT.astype(jnp.float32)
    if divergence == "kl":
      low, high = _band_kl_bounds(p, delta)
      r_star = jnp.exp(-delta)
    else:
      width = (delta / p if divergence == "tv"
               else jnp.sqrt(delta * (1 - p) / p))
      low = jnp.maximum(1 - width, 0.0)
      high = jnp.minimum(1 + width, 1 / p)
      r_star = jnp.maximum(1 - delta, 0.0) if divergence == "tv" else 1.0
    near_one = p > 1 - 1e-6
    high = jnp.where(near_one, 1.0, high)
    low = jnp.where(near_one, r_star, low)
    near_zero = p < 1e-6
    high = jnp.where(near_zero, 1 / jnp.maximum(p, 1e-12), high)
    low = jnp.where(near_zero, 0.0, low)
    if eps_low is not None:
      low = jnp.minimum(low, 1 - eps_low)
    if eps_high is not None:
      high = jnp.maximum(high, 1 + eps_high)
    low = jnp.clip(low, 0.0, 1.0)
    high = jnp.clip(high, 1.0, upper_max)
    return _out(_clip_coefficient(r, a, low, high), ratio_BxT), state

  return _stateless(update_fn)


def _bapo_schedule(low, low_max, low_step, high, high_max, high_step):
  """The (low, high) pairs BAPO tries, in order (its two while loops)."""
  pairs = [(low, high)]
  while low < low_max and low_step > 0:
    low = min(low + low_step, low_max)
    pairs.append((low, high))
  while high < high_max and high_step > 0:
    high = min(high + high_step, high_max)
    pairs.append((low, high))
  return pairs


def bapo_clip(target: float = 1.0, low: tuple[float, float] = (0.6, 0.9),
              high: tuple[float, float] = (1.2, 3.0), step: float = 0.05,
              clip_ratio_c: float = 3.0, eps: float = 1e-8) -> _Tx:
  """BAPO: widen the clip until positive advantages weigh `target` times
  the negative ones.

  With explicit ratio bounds (not `1 +- eps`), for each candidate interval
  in order — the lower bound raised by `step` from `low[0]` to `low[1]`,
  then the upper bound raised from `high[0]` to `high[1]` —

      e_t  = min(r, high) * A  if A >= 0,   max(r, low) * A  otherwise
      rho  = sum_valid max(e, 0) / (sum_valid max(-e, 0) + eps)   (inf if no
             negative part)

  the first interval with `rho >= target` is used (the last one if none);
  then `c = r * [not clipped]` with PPO's rule and the dual clip
  (`c = 0` where A < 0 and r > clip_ratio_c). The search pools the tokens
  the transform receives (one microbatch in `rljax.train`; the reference
  code all-reduces its per-micro-batch sums over data-parallel ranks).
  Paper settings (README): target 1 (a positive share of 0.5), lower
  bound in [0.6, 0.9], upper in [1.2, 3.0]; `step` and `clip_ratio_c` are
  the reference code's defaults.

  References:
    Xi et al., "BAPO: Stabilizing Off-Policy Reinforcement Learning for LLMs
    via Balanced Policy Optimization with Adaptive Clipping",
    https://arxiv.org/abs/2510.18927; WooooDyy/BAPO
    `recipe/bapo/policy_loss.py` (`compute_policy_loss_bapo`).
  """
  fn = "bapo_clip"
  for name, value in (("step", step), ("clip_ratio_c", clip_ratio_c)):
    _check_positive(fn, name, value)
  if not (0 < low[0] <= low[1] <= 1 <= high[0] <= high[1]):
    raise ValueError(f"{fn}: low={low!r}, high={high!r}: need "
                     "0 < low[0] <= low[1] <= 1 <= high[0] <= high[1].")
  pairs = _bapo_schedule(low[0], low[1], step, high[0], high[1], step)
  lows = jnp.array([p[0] for p in pairs], jnp.float32)
  highs = jnp.array([p[1] for p in pairs], jnp.float32)

  def update_fn(ratio_BxT, state, params=None, *, advantages_BxT=None,
                mask_BxT=None, **extra_args):
    del params, extra_args
    ratio_BxT = _check_bxt(fn, "ratio_BxT", ratio_BxT)
    a = _advantages(fn, advantages_BxT, ratio_BxT.shape)
    mask = _mask(fn, mask_BxT, ratio_BxT.shape)
    r = ratio_BxT.astype(jnp.float32)
    # e for every candidate: [K, B, T].
    e = jnp.where(a >= 0, jnp.minimum(r, highs[:, None, None]),
                  jnp.maximum(r, lows[:, None, None])) * a
    e = jnp.where(mask, e, 0.0)
    pos = jnp.sum(jnp.maximum(e, 0.0), (1, 2))
    neg = jnp.sum(jnp.maximum(-e, 0.0), (1, 2))
    rho = jnp.where(neg <= 0, jnp.inf, pos / (neg + eps))
    ok = rho >= target
    k = jnp.where(jnp.any(ok), jnp.argmax(ok), len(pairs) - 1)
    c = _clip_coefficient(r, a, lows[k], highs[k])
    c = jnp.where((a < 0) & (r > clip_ratio_c), 0.0, c)
    return _out(c, ratio_BxT), state

  return _stateless(update_fn)


def sat_clip(eps_low: float = 0.2, eps_high: float = 0.2,
             quantile: float = 0.9, exponent: float = 2.0) -> _Tx:
  """SAT's staleness-adaptive trust region: PPO's clip, contracted on the
  side of the staleness for the batch's most stale tokens.

  With ``d = sg(log pi_theta - log mu)`` (the sampled log-ratio to the
  behaviour policy ``mu``, i.e. ``sampler_logprobs_BxT``) and ``q`` the
  empirical ``quantile`` of ``|d|`` over the valid tokens of the batch the
  transform sees (``inf{x : frac(|d| <= x) >= quantile}``):

      psi(u) = 1 / (1 + (u / q)^exponent)                (Hill kernel)
      c_+ = psi(max(d, 0)),  c_- = psi(max(-d, 0))   where q > 0 and |d| > q
      c_+ = c_- = 1                                  elsewhere
      low = 1 - eps_low * c_-,  high = 1 + eps_high * c_+
      c = r * [not clipped]  (A > 0 and r > high, or A < 0 and r < low)

  Only the endpoint on the sign of ``d`` shrinks, so the interval always
  lies inside PPO's and ordinary tokens (``|d| <= q``) keep it. The clipped
  ratio ``r`` is the input ratio (``pi_theta / pi_old``); with
  ``rl.old_logprobs="sampler"`` that is the ratio to the sampler, as on the
  authors' page. ``q`` is pooled over the tokens the transform sees (one
  microbatch), as the page's per-micro-batch quantile; with no valid token
  or ``q = 0`` it is plain PPO. Needs ``old_logprobs_BxT`` and
  ``sampler_logprobs_BxT``. The page's GSPO variant (the sequence ratio for
  both ``r`` and ``d``) is not built.

  Args:
    eps_low, eps_high: the nominal PPO interval (page defaults 0.2 / 0.2).
    quantile: the level of the staleness gate (page: 0.9).
    exponent: the Hill kernel's exponent (page: 2).

  References:
    Yang et al., "Stale but Stable: Staleness-Adaptive Trust Regions for
    Stabilizing Asynchronous RL", https://arxiv.org/abs/2607.18722; Eqs.
    3.1-3.6 of the authors' project page (jyyang26.github.io,
    stable_async_analysis); their code (github.com/jyyang26/SAT) was not
    available to read.
  """
  fn = "sat_clip"
  _check_positive(fn, "eps_low", eps_low)
  _check_positive(fn, "eps_high", eps_high)
  _check_positive(fn, "exponent", exponent)
  if isinstance(quantile, (int, float)) and not 0 < quantile <= 1:
    raise ValueError(f"{fn}: quantile={quantile!r} must be in (0, 1].")

  def update_fn(ratio_BxT, state, params=None, *, advantages_BxT=None,
                mask_BxT=None, old_logprobs_BxT=None, sampler_logprobs_BxT=None,
                **extra_args):
    del params, extra_args
    ratio_BxT = _check_bxt(fn, "ratio_BxT", ratio_BxT)
    shape = ratio_BxT.shape
    a = _advantages(fn, advantages_BxT, shape)
    mask = _mask(fn, mask_BxT, shape)
    old = _logprobs(fn, "old_logprobs_BxT", old_logprobs_BxT, shape)
    mu = _logprobs(fn, "sampler_logprobs_BxT", sampler_logprobs_BxT, shape)
    r = ratio_BxT.astype(jnp.float32)
    d = jax.lax.stop_gradient(jnp.log(jnp.maximum(r, 1e-30)) + old - mu)
    abs_d = jnp.where(mask, jnp.abs(d), jnp.inf).reshape(-1)
    n = jnp.sum(mask)
    # The smallest |d| with at least `quantile` of the valid tokens at or
    # below it: the ceil(quantile * n)-th smallest (1-based).
    k = jnp.clip(jnp.ceil(quantile * n - 1e-6).astype(jnp.int32) - 1, 0,
                 abs_d.size - 1)
    q = jnp.where(n > 0, jnp.sort(abs_d)[k], 0.0)
    gate = (q > 0) & (jnp.abs(d) > q) & mask
    safe_q = jnp.where(q > 0, q, 1.0)
    psi = lambda u: 1.0 / (1.0 + (u / safe_q) ** exponent)
    c_plus = jnp.where(gate, psi(jnp.maximum(d, 0.0)), 1.0)
    c_minus = jnp.where(gate, psi(jnp.maximum(-d, 0.0)), 1.0)
    c = _clip_coefficient(r, a, 1.0 - eps_low * c_minus,
                          1.0 + eps_high * c_plus)
    return _out(c, ratio_BxT), state

  return _stateless(update_fn)
