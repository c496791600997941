"""jax_hoccl's public names are the objects their defining modules hold: __init__.py only
re-exports, and the typing for partial-manual shard_maps (explicit_axes.typed_like) sits on
each op's definition, so internal callers, tests and go-to-definition see the same object."""
import importlib

import pytest

import jax_hoccl

# The ops that carry explicit_axes.typed_like at their definition.
TYPED = ("psum", "pmean", "pmax", "pmin", "all_gather", "all_to_all", "psum_scatter",
         "ppermute", "all_gather_start", "all_to_all_start", "ppermute_start", "psum_start",
         "psum_scatter_start", "all_gather_matmul", "matmul_reduce_scatter", "matmul_psum",
         "matmul_all_to_all", "embedding_all_to_all")

PUBLIC_CALLABLES = [n for n in jax_hoccl.__all__ if callable(getattr(jax_hoccl, n))]


@pytest.mark.parametrize("name", PUBLIC_CALLABLES)
def test_public_name_is_its_definition(name):
  obj = getattr(jax_hoccl, name)
  assert obj.__module__.startswith("jax_hoccl._src."), obj.__module__
  module = importlib.import_module(obj.__module__)
  assert getattr(module, obj.__name__) is obj, (
      f"jax_hoccl.{name} is not {obj.__module__}.{obj.__name__}")


@pytest.mark.parametrize("name", TYPED)
def test_typed_ops_are_decorated_at_definition(name):
  assert name in PUBLIC_CALLABLES
  assert getattr(getattr(jax_hoccl, name), "__wrapped__", None) is not None, name


def test_psum_is_the_definition():
  from jax_hoccl._src.ops import psum
  assert jax_hoccl.psum is psum.psum
