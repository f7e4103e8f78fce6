"""One small rule object per decoding method (see base.py); the step driver is `decode/step.py`."""

from pasta_jax.decode.rules.apar import AparRules
from pasta_jax.decode.rules.base import Rules, StepFeed
from pasta_jax.decode.rules.medusa import MedusaRules
from pasta_jax.decode.rules.pasta import PastaRules
from pasta_jax.decode.rules.pasta_tree import PastaTreeRules
from pasta_jax.decode.rules.scoped import ScopedRules
from pasta_jax.decode.rules.sequential import SequentialRules
from pasta_jax.decode.rules.sot import SotRules
from pasta_jax.decode.rules.superposed import SuperposedRules

__all__ = ["AparRules", "MedusaRules", "PastaRules", "PastaTreeRules", "Rules", "ScopedRules", "SequentialRules",
           "SotRules", "StepFeed", "SuperposedRules"]
