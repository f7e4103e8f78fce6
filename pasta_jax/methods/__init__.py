"""Decoding methods as values, declared once each (see base.py), and the public decode API over them.

  from pasta_jax.methods import Pasta, generate
  generate(model, ["Give three tips for staying healthy."], Pasta(lanes=4))
"""

from pasta_jax.methods.apar import Apar
from pasta_jax.methods.base import Capabilities, Layout, Method, Setup
from pasta_jax.methods.medusa import Medusa, Propd
from pasta_jax.methods.pasta import Pasta
from pasta_jax.methods.pasta_trees import PastaTrees
from pasta_jax.methods.registry import METHODS, names, prepared, register, resolve
from pasta_jax.methods.runs import generate, generate_ids, prepare_run, stream, stream_ids
from pasta_jax.methods.scoped import Scoped
from pasta_jax.methods.sequential import Sequential
from pasta_jax.methods.sot import Sot
from pasta_jax.methods.superposed import Superposed

__all__ = ["METHODS", "Apar", "Capabilities", "Layout", "Medusa", "Method", "Pasta", "PastaTrees", "Propd", "Scoped",
           "Sequential", "Setup", "Sot", "Superposed", "generate", "generate_ids", "names", "prepare_run", "prepared",
           "register", "resolve", "stream", "stream_ids"]
