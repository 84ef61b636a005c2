"""Groups of unequal size: any group transform, rows tagged with group ids.

The advantage transforms take group-contiguous rewards ``[K * G]`` and a
``mask_N`` that marks padding, so a group of ``g < G`` samples is ``G - g``
masked slots. When an allocator gives prompts different numbers of samples
under a fixed row budget (VIGOR's variance-guided allocation, sGPO's ``1/p``
group sizes, prompt selection's refills), the rows instead come as a flat
batch of ``N`` samples with a group id each. ``by_group_ids`` runs any chain
on such a batch: it scatters the rows into the padded ``[K, G_max]`` layout
(masked where a group has fewer samples), runs the chain with
``group_size=G_max`` and ``mask_N``, and gathers each row's advantage back.
Every statistic of every group transform then sees exactly its group's
samples: the advantages equal those of each group computed on its own
(``tests/test_advantages_grouping.py``, for every per-group preset).

Per-row extra arguments (``lengths_N``, ``seq_log_ratio_N``, ``tokens_NxT``,
``completion_mask_NxT``, ``token_rewards_NxT``: any array whose leading axis
is ``N``) are scattered the same way; other extra arguments pass through.
"""

from __future__ import annotations


import jax
import jax.numpy as jnp
import numpy as np
import optax

from rljax.advantages._common import _Tx


def group_slots(group_ids_N: jax.Array, num_groups: int,
                max_group_size: int) -> tuple[jax.Array, jax.Array]:
  """Each row's slot in the padded ``[num_groups, max_group_size]`` layout.

  A row's slot is ``id * max_group_size + rank``, its rank the number of
  earlier rows with its id (rows keep their order within a group). Returns
  ``(slot_N int32, kept_N bool)``: ``kept_N`` is False for a row whose id
  is outside ``[0, num_groups)`` or whose rank is ``>= max_group_size``
  (such a row gets advantage 0).
  """
  ids = jnp.asarray(group_ids_N, jnp.int32)
  n = ids.shape[0]
  earlier = jnp.tril(jnp.ones((n, n), bool), -1)
  rank = jnp.sum((ids[:, None] == ids[None, :]) & earlier, 1, dtype=jnp.int32)
  kept = (ids >= 0) & (ids < num_groups) & (rank < max_group_size)
  slot = jnp.where(kept, ids * max_group_size + rank, 0)
  return slot, kept


def by_group_ids(inner: _Tx, num_groups: int, max_group_size: int) -> _Tx:
  """``inner`` on groups of unequal size (see the module docstring).

  Args:
    inner: any advantage chain (its ``group_size`` is ``max_group_size``).
    num_groups: ``K``, the number of groups (static).
    max_group_size: ``G_max``, the largest group (static).

  The update takes ``group_ids_N`` (int ``[N]``, required; ``N`` need not be
  ``K * G_max``) and the optional ``mask_N``; ``group_size`` is ignored.
  The state is ``inner``'s, initialised on the padded layout.
  """
  if num_groups < 1 or max_group_size < 1:
    raise ValueError(f"by_group_ids: num_groups={num_groups} and "
                     f"max_group_size={max_group_size} must be >= 1.")
  m = num_groups * max_group_size

  def padded(x, slot, kept, fill):
    shape = (m,) + x.shape[1:]
    target = jnp.full(shape, fill, x.dtype)
    # Rows that are not kept write to an extra slot, dropped after.
    index = jnp.where(kept, slot, m)
    out = jnp.concatenate([target, jnp.full((1,) + x.shape[1:], fill,
                                            x.dtype)], 0)
    return out.at[index].set(x)[:m]

  def init_fn(rewards):
    shape = (m,) + tuple(np.shape(rewards))[1:]
    return inner.init(jnp.zeros(shape, jnp.asarray(rewards).dtype))

  def update_fn(rewards, state, params=None, *, group_ids_N=None,
                mask_N=None, group_size=None, **extra_args):
    del group_size
    if group_ids_N is None:
      raise ValueError("by_group_ids: the extra argument group_ids_N (int "
                       "[N], each row's group) is required.")
    rewards = jnp.asarray(rewards)
    n = rewards.shape[0]
    if np.shape(group_ids_N) != (n,):
      raise ValueError(f"by_group_ids: group_ids_N has shape "
                       f"{np.shape(group_ids_N)}; the rewards have {n} rows.")
    slot, kept = group_slots(group_ids_N, num_groups, max_group_size)
    valid = kept if mask_N is None else kept & jnp.asarray(mask_N, bool)
    extra = {k: (padded(jnp.asarray(v), slot, kept, 0)
                 if hasattr(v, "shape") and np.ndim(v) >= 1
                 and np.shape(v)[0] == n else v)
             for k, v in extra_args.items()}
    adv, state = inner.update(
        padded(rewards, slot, kept, 0), state, params,
        group_size=max_group_size,
        mask_N=padded(valid, slot, kept, False), **extra)
    out = jnp.take(adv, slot, axis=0)
    out = jnp.where(jnp.reshape(valid, (n,) + (1,) * (out.ndim - 1)), out, 0)
    return out.astype(adv.dtype), state

  return optax.GradientTransformationExtraArgs(init_fn, update_fn)


__all__ = ["by_group_ids", "group_slots"]
