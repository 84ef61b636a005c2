import jax
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

from rljax import sharding


def test_make_mesh_shapes_and_wildcard():
  mesh = sharding.make_mesh(data=2, fsdp=-1, tensor=2)
  assert dict(mesh.shape) == {"data": 2, "fsdp": 2, "tensor": 2}
  mesh1 = sharding.make_mesh(1, 1, 1, devices=jax.devices()[:1])
  assert mesh1.size == 1


@pytest.mark.parametrize("sizes, match", [
    ((3, 1, 1), "multiply to 3"),
    ((-1, -1, 1), "at most one axis"),
    ((0, 1, 1), "mesh.data=0"),
    ((3, -1, 1), "does not divide"),
])
def test_make_mesh_errors_name_the_problem(sizes, match):
  with pytest.raises(ValueError, match=match):
    sharding.make_mesh(*sizes)


def test_mesh_from_config_mapping():
  mesh = sharding.mesh_from_config({"data": 1, "fsdp": 4, "tensor": 2})
  assert dict(mesh.shape) == {"data": 1, "fsdp": 4, "tensor": 2}


def test_logical_to_spec_default_rules():
  assert sharding.logical_to_spec(("embed", "heads", "head_dim")) == P(
      "fsdp", "tensor", None)
  assert sharding.logical_to_spec(("batch", None)) == P(("data", "fsdp"), None)
  # A mesh axis is used once per array: the second claim is dropped.
  assert sharding.logical_to_spec(("heads", "mlp")) == P("tensor", None)


def test_logical_to_spec_drops_non_dividing_axes():
  mesh = sharding.make_mesh(1, 2, 4)
  spec = sharding.logical_to_spec(("embed", "kv_heads", "head_dim"),
                                  shape=(64, 2, 16), mesh=mesh)
  assert spec == P("fsdp", None, None)


def test_merge_rules_overrides_and_validates():
  rules = sharding.merge_rules({"embed": None, "new_axis": "tensor"})
  table = dict(rules)
  assert table["embed"] is None and table["new_axis"] == "tensor"
  assert table["mlp"] == "tensor"
  with pytest.raises(ValueError, match="mesh axis 'model' is unknown"):
    sharding.merge_rules({"embed": "model"})


def test_unknown_logical_axis_error():
  with pytest.raises(ValueError, match="logical axis 'foo' has no rule"):
    sharding.logical_to_spec(("foo",))


def test_shard_batch_and_divisibility_error():
  mesh = sharding.make_mesh(2, 2, 2)
  x = np.arange(8 * 3).reshape(8, 3)
  y = sharding.shard_batch({"x": x}, mesh)["x"]
  assert y.sharding.spec == P(("data", "fsdp"), None)
  np.testing.assert_array_equal(np.asarray(y), x)
  assert {s.data.shape for s in y.addressable_shards} == {(2, 3)}
  with pytest.raises(ValueError, match="batch=6 does not divide"):
    sharding.shard_batch({"x": np.zeros((6, 2))}, mesh)


def test_constrain_is_noop_without_mesh_and_applies_with_mesh():
  x = jax.numpy.ones((8, 4))
  assert sharding.constrain(x, ("batch", None)) is x
  mesh = sharding.make_mesh(2, 2, 2)
  with jax.set_mesh(mesh):
    y = jax.jit(lambda a: sharding.constrain(a * 2, ("batch", None)))(x)
  assert y.sharding.spec == P(("data", "fsdp"),) or y.sharding.spec == P(
      ("data", "fsdp"), None)


def _fsdp_params():
  mesh = sharding.make_mesh(data=1, fsdp=8, tensor=1)
  fsdp = jax.sharding.NamedSharding(mesh, P("fsdp"))
  params = {"layer": {"kernel": jax.device_put(np.ones((16, 4), np.float32),
                                               fsdp)},
            "scale": jax.device_put(np.ones((4,), np.float32),
                                    jax.sharding.NamedSharding(mesh, P()))}
  return mesh, fsdp, params


def test_adam_moments_are_sharded_as_their_params():
  import optax  # pylint: disable=import-outside-toplevel
  mesh, fsdp, params = _fsdp_params()
  opt = optax.adam(1e-3)
  state = sharding.init_like_params(opt.init, params, mesh)
  for moments in (state[0].mu, state[0].nu):
    assert moments["layer"]["kernel"].sharding.spec == fsdp.spec
    assert moments["scale"].sharding.spec == P()
  assert state[0].count.sharding.spec == P()
  # The control: plain jax.jit leaves the zeros replicated on every device,
  # so the test above can fail.
  with jax.set_mesh(mesh):
    plain = jax.jit(opt.init)(params)
  assert plain[0].mu["layer"]["kernel"].sharding.spec == P()


def test_a_leaf_sharded_like_a_param_needs_its_path_and_its_shape():
  mesh, fsdp, params = _fsdp_params()
  tree = {"mu": {"layer": {"kernel": jax.ShapeDtypeStruct((16, 4),
                                                          np.float32)}},
          # same name, other shape (a factored statistic): replicated
          "v_row": {"layer": {"kernel": jax.ShapeDtypeStruct((16,),
                                                             np.float32)}},
          # same shape, a path no param has: replicated
          "other": jax.ShapeDtypeStruct((16, 4), np.float32)}
  out = sharding.shardings_like_params(tree, params, mesh)
  assert out["mu"]["layer"]["kernel"].spec == fsdp.spec
  assert out["v_row"]["layer"]["kernel"].spec == P()
  assert out["other"].spec == P()
