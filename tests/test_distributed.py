"""rljax.distributed in one process: the identity path and the checks that
run before ``jax.distributed`` starts (the multi-process behaviour is
tests/test_multihost.py's)."""

import jax
import numpy as np
import pytest

from rljax import distributed, sharding


def test_one_process_group_is_the_identity():
  group = distributed.ProcessGroup()
  assert (group.index, group.count, group.primary, group.single) == (
      0, 1, True, True)
  mesh = sharding.make_mesh(data=2, fsdp=4)
  assert group.block(mesh) == (0, 1)
  x = np.arange(12).reshape(6, 2)
  assert group.global_array(x, mesh) is x  # the jitted function places it
  np.testing.assert_array_equal(group.gather_rows(x, mesh), x)
  assert group.rows(mesh, 6) == slice(0, 6)
  y = jax.device_put(np.arange(16).reshape(8, 2),
                     sharding.batch_sharding(mesh, 2))
  np.testing.assert_array_equal(group.local_rows(y),
                                np.arange(16).reshape(8, 2))
  assert group.gather_json({"a": 1}) == [{"a": 1}]
  assert group.max_int(3) == 3 and group.any(True) and not group.all(False)
  assert group.from_primary("x") == "x"
  group.check_same_config({"rl": {"kl_coef": 0.1}})  # nothing to compare
  group.raise_any(None)
  with pytest.raises(RuntimeError, match="^boom$"):
    group.raise_any("boom")
  assert group.collectives == {"count": 0, "seconds": 0.0}


@pytest.mark.parametrize("kwargs, match", [
    ({"coordinator_address": "127.0.0.1:1234"}, "lacks"),
    ({"coordinator_address": "127.0.0.1:1234", "num_processes": 2},
     r"lacks \['process_id'\]"),
    ({"coordinator_address": "h:1", "num_processes": 2, "process_id": 2},
     "--process_id=2 with --num_processes=2"),
    ({"heartbeat_timeout_s": 0}, "--heartbeat_timeout_s=0"),
])
def test_initialize_refuses_partial_or_wrong_flags(kwargs, match):
  with pytest.raises(ValueError, match=match):
    distributed.initialize(**kwargs)


def test_batch_ways():
  mesh = sharding.make_mesh(data=2, fsdp=2, tensor=2)
  assert sharding.batch_ways(mesh) == 4
