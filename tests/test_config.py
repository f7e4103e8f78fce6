"""Model configs: presets are consistent, bad configs name their problem, counts match real params."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pasta_jax.model.config import PRESETS, GemmaConfig, get_config
from pasta_jax.model.gemma import Gemma, causal_mask


@pytest.mark.parametrize("name", [n for n in PRESETS if n.startswith("tiny")])
def test_param_count_matches_initialized_params(name):
  cfg = get_config(name)
  params = jax.eval_shape(Gemma(cfg).init, jax.random.key(0), jnp.ones((1, 4), jnp.int32),
                          jnp.arange(4)[None], causal_mask(1, 4))
  assert sum(int(np.prod(x.shape)) for x in jax.tree.leaves(params)) == cfg.param_count()


@pytest.mark.parametrize("name,billions", [("gemma1-2b", 2.51), ("gemma1-7b", 8.54), ("gemma2-2b", 2.61),
                                           ("gemma2-9b", 9.24), ("gemma3-270m", 0.268), ("gemma3-1b", 1.0),
                                           ("gemma3-4b", 3.88), ("gemma3-12b", 11.77), ("gemma3-27b", 27.0)])
def test_preset_sizes_match_published(name, billions):
  # Published sizes (text decoder, tied embedding counted once), within 2%.
  assert get_config(name).param_count() / 1e9 == pytest.approx(billions, rel=0.02)


def test_family_features():
  g1, g2, g3 = get_config("gemma1-7b"), get_config("gemma2-9b"), get_config("gemma3-1b")
  assert set(g1.layer_kinds) == {"global"} and g1.attn_logit_softcap is None and not g1.use_qk_norm
  assert g2.layer_kinds[:2] == ("local", "global") and g2.final_logit_softcap == 30.0
  assert g3.layer_kinds[:6] == ("local",) * 5 + ("global",) and g3.use_qk_norm
  assert g3.rope_base_local == 10_000 and g3.rope_base_global == 1_000_000


def test_bad_configs_name_the_problem():
  base = get_config("tiny-gemma3")
  with pytest.raises(ValueError, match="not a multiple of num_kv_heads"):
    GemmaConfig(**{**base.__dict__, "num_kv_heads": 3})
  with pytest.raises(ValueError, match="layer_kinds has 2 entries for 3 layers"):
    GemmaConfig(**{**base.__dict__, "layer_kinds": ("local", "global")})
  with pytest.raises(ValueError, match="unknown model config 'gemma9'"):
    get_config("gemma9")
