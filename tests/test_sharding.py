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


@pytest.mark.parametrize("sizes, rows", [((2, 4, 1), 8), ((2, 2, 2), 8),
                                         ((1, 1, 8), 2), ((2, 2, 2), 3)])
def test_embedding_lookup_and_its_gradient_match_numpy(sizes, rows):
  """Rows split over data x fsdp (or whole: 3 rows split no way, and the
  partitioner takes them), the table
  over fsdp on the model axis and over tensor on the vocabulary (8 of 16
  rows per part; tensor=8 splits 16 into 2-row parts): every row and the
  table's gradient are NumPy's gather and scatter-add."""
  v, d, t = 16, 8, 5
  rng = np.random.default_rng(0)
  table = rng.normal(size=(v, d)).astype(np.float32)
  tokens = rng.integers(0, v, (rows, t)).astype(np.int32)
  cot = rng.normal(size=(rows, t, d)).astype(np.float32)
  want_grad = np.zeros_like(table)
  np.add.at(want_grad, tokens, cot)
  mesh = sharding.make_mesh(*sizes)
  with jax.set_mesh(mesh):
    spec = sharding.logical_to_spec(("vocab", "embed"), shape=table.shape,
                                    mesh=mesh)
    placed = jax.device_put(table, jax.sharding.NamedSharding(mesh, spec))
    fn = jax.jit(lambda w, ids: sharding.embedding_lookup(w, ids))
    np.testing.assert_array_equal(np.asarray(fn(placed, tokens)),
                                  table[tokens])
    grad = jax.jit(jax.grad(lambda w: jax.numpy.sum(
        sharding.embedding_lookup(w, tokens) * cot)))(placed)
  np.testing.assert_allclose(np.asarray(grad), want_grad, rtol=1e-5,
                             atol=1e-6)
  assert sharding.embedding_lookup(table, tokens).shape == (rows, t, d)
