"""The scoped form's training data: the earlier paper's structural rule, and records laid out for `scoped_sft`."""

from __future__ import annotations

import json

import numpy as np
import pytest

from pasta_jax.data.encode import EncodeConfig, encode_example, prompt_token_ids
from pasta_jax.data.structural_scoped import annotate_scoped
from pasta_jax.lang import scoped
from pasta_jax.lang.layout import pad_layout
from pasta_jax.lang.scoped_layout import scoped_layout
from pasta_jax.training.config import TrainConfig
from tests.tiny import CharTokenizer

ANSWER = ("Three fuels:\n"
          "1. **Coal**: a fossil fuel mined from the ground, burned in plants.\n"
          "2. **Wood**: renewable when forests regrow.\n"
          "   - Oak: dense and slow to burn, good for heating.\n"
          "   - Pine: light and resinous, quick to light.\n"
          "3. Paper - burns fast but gives little heat.\n\n"
          "All three release carbon.")


def words(text: str) -> int:
  return len(text.split())


def test_lists_become_scopes_and_elaborations_blocks():
  annotated = annotate_scoped(ANSWER, words, min_block=3)
  assert scoped.compose_text(annotated) == ANSWER  # every character where it was
  items = scoped.parse(annotated)
  assert scoped.depth(items) == (2, 2)  # the nested list is a scope inside the Wood block
  assert annotated.startswith("Three fuels:\n<scope>1. **Coal**:<promise/><async> a fossil fuel")
  assert "<scope>   - Oak:<promise/><async>" in annotated
  assert annotated.endswith("</scope>\n\nAll three release carbon.")
  assert annotate_scoped("Just prose, no list.", words) is None


def test_short_elaborations_stay_in_the_thread():
  assert annotate_scoped("Pick:\n- a: b\n- c: d\n", words, min_block=4) is None


def test_scoped_sft_lays_out_the_scoped_answer():
  tok = CharTokenizer()
  vocab = tok.tag_vocab()
  record = {"id": "x", "instruction": "Name fuels", "input": "", "output": ANSWER,
            "scoped": annotate_scoped(ANSWER, words, min_block=3)}
  config = EncodeConfig(seq_len=1024, num_threads=8, objective="scoped_sft", chat=False)
  got = encode_example(record, tok, vocab, config)
  ids = scoped.encode(scoped.parse(record["scoped"]), lambda s: tok.encode(s, add_bos=False), vocab)
  want = pad_layout(scoped_layout(prompt_token_ids(tok, "Name fuels", False), ids, vocab), 1024, 8)
  for field in ("tokens", "positions", "thread", "horizon", "targets", "loss_mask"):
    np.testing.assert_array_equal(getattr(got, field), getattr(want, field), err_msg=field)
  assert TrainConfig(objective="scoped_sft").objective == "scoped_sft"


def test_scoped_sft_annotates_with_the_scoped_rule(tmp_path):
  from train import sft
  data = tmp_path / "pool.jsonl"
  rows = [{"id": str(i), "instruction": f"q{i}", "input": "",
           "output": ANSWER if i % 2 else "Just prose."} for i in range(4)]
  data.write_text("".join(json.dumps(r) + "\n" for r in rows))
  args = sft.parse_args(["--data", str(data), "--data-dir", str(tmp_path / "tfds"), "--out", str(tmp_path / "o"),
                         "--objective", "scoped_sft", "--only-annotated"])
  train, _ = sft.training_records(args, CharTokenizer())
  assert sorted(r["id"] for r in train) == ["1", "3"]
  assert all(scoped.compose_text(r["scoped"]) == ANSWER for r in train)


@pytest.mark.parametrize("text", ["<scope>a<promise/><async>b</async>", "x <promise/><async>y</async>"])
def test_malformed_scoped_records_are_refused_by_name(text):
  tok = CharTokenizer()
  record = {"id": "bad7", "instruction": "q", "input": "", "output": "x", "scoped": text}
  with pytest.raises(Exception, match="bad7"):
    encode_example(record, tok, tok.tag_vocab(), EncodeConfig(objective="scoped_sft", chat=False))
