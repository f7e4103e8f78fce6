"""APAR training layout == APAR decode replay: for APAR answers (nested forks included), the per-token
logits of one training forward with the layout's mask equal the logits the interpreter's APAR mode
produces when it force-replays the same answer, to 1e-4 (fp32). Same rule, same positions."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest

from pasta_jax.decode.config import InterpreterConfig
from pasta_jax.decode.loop import run_interpreter
from pasta_jax.decode.rules import AparRules
from pasta_jax.lang import apar_tree as tree
from pasta_jax.lang.apar_layout import apar_layout
from tests.test_replay import VOCAB, random_params

F, C, E = VOCAB.apar_fork, VOCAB.apar_child, 1
PROMPT = [2, 30, 31, 32]
ANSWERS = {
    "flat": [40, 41, F, C, 50, 51, 52, E, 42, F, C, 60, 61, E, 43, 44],
    "nested": [40, F, C, 50, F, C, 70, 71, E, 51, 52, E, 41, 42, F, C, 60, E, 43],
    "none": [40, 41, 42],
}


def tree_record_indices(records: np.ndarray, parents: np.ndarray) -> list[int]:
  """Record indices in tree order (lang.apar_tree.tree_order, by index instead of token)."""
  own = {u: [i for i in range(len(records)) if records[i, 2] == u] for u in set(records[:, 2].tolist())}
  kids: dict[int, list[int]] = {}
  for thread, parent in enumerate(parents.tolist()):
    if parent >= 0 and thread in own:
      kids.setdefault(parent, []).append(thread)

  def walk(u):
    out, children = [], iter(kids.get(u, []))
    for i in own[u]:
      out.append(i)
      if records[i, 3] == F:
        child = next(children, None)
        if child is not None:
          out += walk(child)
    return out

  return walk(0)


@pytest.mark.parametrize("answer", list(ANSWERS))
@pytest.mark.parametrize("family", ["tiny-gemma1", "tiny-gemma3"])
def test_apar_training_forward_equals_decode_replay(answer, family):
  ids = ANSWERS[answer]
  config, model, params = random_params(family)
  layout = apar_layout(PROMPT, ids, VOCAB, eos_id=E)
  mask = layout.mask()[None]
  logits = model.apply(params, jnp.asarray(layout.tokens)[None], jnp.asarray(layout.positions)[None], mask).logits
  logits = np.asarray(logits[0])

  scripts = tree.thread_scripts(tree.parse_tree(ids, VOCAB), VOCAB, lanes=4, max_threads=8)
  cfg = InterpreterConfig(vocab=VOCAB, lanes=4, max_threads=8, pool_slots=64, max_steps=64, rules=AparRules(),
                          record_logits=True)
  pool_spec = (config.num_layers, config.num_kv_heads, config.head_dim, jnp.float32)
  [run] = run_interpreter(model.apply, params, [PROMPT], cfg, vocab_size=config.vocab_size, pool_spec=pool_spec,
                          scripts=[scripts])
  order = tree_record_indices(run.records, run.parents)
  # The answer rows of the layout are the records in tree order, token for token and position for position.
  answer_rows = list(range(len(PROMPT), int(layout.valid.sum())))
  assert [int(layout.tokens[j]) for j in answer_rows] == [int(run.records[i, 3]) for i in order]
  assert [int(layout.positions[j]) for j in answer_rows] == [int(run.records[i, 4]) for i in order]
  # Each record's logits came from its thread's previous token: the layout row whose target it is.
  predicted_by = {}
  for thread in set(layout.thread[: len(layout.tokens)].tolist()):
    rows = [j for j in range(int(layout.valid.sum())) if layout.thread[j] == thread]
    predicted_by.update({b: a for a, b in zip(rows, rows[1:])})
  compared = 0
  for j, i in zip(answer_rows, order):
    if layout.tokens[j] == C:
      continue  # inserted by the interpreter: no logits, and nothing predicts it in training
    np.testing.assert_allclose(run.logits[i], logits[predicted_by[j]], atol=1e-4, rtol=1e-4)
    compared += 1
  assert compared == len(answer_rows) - ids.count(C)


def test_children_never_seen_and_child_token_never_learned():
  layout = apar_layout(PROMPT, ANSWERS["nested"], VOCAB, eos_id=E)
  m = np.asarray(layout.mask())
  n = int(layout.valid.sum())
  for q in range(n):
    for k in range(n):
      if m[q, k] and layout.thread[k] != layout.thread[q]:
        assert layout.thread[k] < layout.thread[q]  # only ancestors (numbered earlier) are ever seen
  main_rows = [j for j in range(n) if layout.thread[j] == 0]
  assert not m[np.ix_(main_rows, [j for j in range(n) if layout.thread[j] != 0])].any()
  assert C not in layout.targets[layout.loss_mask].tolist()


def test_the_trainer_learns_apar_format_data(tmp_path):
  """APAR training is the same trainer on APAR-format records: the loss goes down."""
  from pasta_jax.data.apar_format import apar_records
  from pasta_jax.data.encode import EncodeConfig
  from pasta_jax.data.pipeline import layout_dataset
  from pasta_jax.training.config import TrainConfig
  from pasta_jax.training.trainer import Trainer
  from tests.tiny import tiny_model

  model = tiny_model()
  records = [{"id": str(i), "instruction": f"Tips {i}",
              "output": "Tips:\n1. Sleep: go to bed early.\n2. Food: eat light meals.\n3. Move: walk daily.\n"}
             for i in range(8)]
  rows, kinds = apar_records(records)
  assert kinds["ordered_list"] == 8
  encode = EncodeConfig(seq_len=160, num_threads=4, objective="apar_sft")
  data = layout_dataset(rows, model.tokenizer, model.tokenizer.tag_vocab(), encode, batch_size=4, seed=0, epochs=4,
                        progress=False)
  config = TrainConfig(model="tiny", batch_size=4, seq_len=160, num_threads=4, learning_rate=3e-3, epochs=4,
                       objective="apar_sft", save_every=100)
  trainer = Trainer(config, model, data, tmp_path, check_memory=False, progress=False)
  losses = trainer.run().losses
  assert len(losses) == 8 and losses[-1] < 0.7 * losses[0]
