"""The earlier paper's scoped mode on the real Gemma 3 270M (CPU, greedy, batch 1): forced replays of scoped
annotations, and how much the synchronous prefix changes the model's predictions.

LIMA answers (their first ~200 tokens) are annotated with the paper's structural rule (a list is a
`<scope>`, each item's elaboration an `<async>` block, nested lists nested scopes:
`pasta_jax.data.structural_scoped`). For each answer:
  - realized speedup: time(tag-free twin replayed) / time(scoped answer replayed), both through the same
    interpreter (`Scoped`, "pasta-v0"), each the second of two runs, against the trace's theoretical speedup
    (content tokens / critical path);
  - identical: both replays finish and their clean texts equal the twin's text;
  - changed predictions (the paper's section 5.1 filter keeps answers under 20%): the share of the answer's
    content tokens whose greedy prediction differs between the training forward with the scoped mask and
    positions (each token sees its synchronous prefix) and the plain causal forward over the clean text.

  python -m bench.scoped [--limit 20] [--answer-tokens 200] [--lanes 8]
Last line: RESULT realized_over_theoretical=... identical=N/N changed_predictions=...
"""

from __future__ import annotations

import argparse

import jax.numpy as jnp
import numpy as np
from tqdm import tqdm

from bench.common import second_of_two, table
from bench.replay import add_replay_flags, first, replay_answers
from pasta_jax.data.structural_scoped import annotate_scoped
from pasta_jax.decode import api
from pasta_jax.errors import TagError
from pasta_jax.lang import scoped
from pasta_jax.lang.layout import plain_layout
from pasta_jax.lang.metrics import arithmetic_mean, geometric_mean
from pasta_jax.lang.scoped_layout import scoped_layout
from pasta_jax.methods import Scoped, generate
from pasta_jax.model.gemma import Gemma
from pasta_jax.model.load import load_model


def candidates(model, path: str, answer_tokens: int, prompt_bucket: int, limit: int):
  """(id, prompt, prompt ids, scoped answer) for LIMA answers that get at least one block."""
  lang = api.LangTokenizer(model.tokenizer)
  scoped_answers = ((answer_id, prompt, ids, annotate_scoped(answer, lambda s: len(lang.encode(s))))
                    for answer_id, prompt, ids, answer in replay_answers(model, path, answer_tokens, prompt_bucket))
  return first((item for item in scoped_answers if item[3] is not None), limit,
               f"no answer in {path} has a prompt of padded length {prompt_bucket} and a list to annotate")


def changed_predictions(model, ids: list[int], annotated: str) -> tuple[int, int]:
  """(content tokens whose greedy prediction changes under the synchronous prefix, content tokens)."""
  lang, vocab = api.LangTokenizer(model.tokenizer), model.tokenizer.tag_vocab()
  answer = scoped.encode(scoped.parse(annotated), lang.encode, vocab)
  layout = scoped_layout(ids, answer, vocab)
  content = scoped.compose_ids(answer, vocab)
  plain = plain_layout(ids, content, vocab.eos_ids[0])
  apply = Gemma(model.config).apply

  def predictions(lay):
    logits = apply(model.params, jnp.asarray(lay.tokens)[None], jnp.asarray(lay.positions)[None],
                   lay.mask()[None]).logits
    return np.asarray(jnp.argmax(logits[0], axis=-1))

  # The query that predicts each content token is its predecessor in its own thread's stream.
  scoped_pred = predictions(layout)
  n, tags = int(layout.valid.sum()), vocab.tag_ids | set(vocab.eos_ids)
  predicted_by = {}
  for u in np.unique(layout.thread[:n]):
    stream = np.flatnonzero(layout.thread[:n] == u)
    predicted_by.update(zip(stream[1:].tolist(), stream[:-1].tolist()))
  by_target = [scoped_pred[predicted_by[j]] for j in range(len(ids), n) if int(layout.tokens[j]) not in tags]
  plain_pred = predictions(plain)[len(ids) - 1: len(ids) - 1 + len(content)]
  assert len(by_target) == len(content), (len(by_target), len(content))
  return int(np.sum(np.asarray(by_target) != plain_pred)), len(content)


def measure(model, prompt: str, ids: list[int], annotated: str, args) -> dict:
  kw = dict(max_new_tokens=args.new_tokens)
  method = Scoped(lanes=args.lanes)
  twin_text = scoped.compose_text(annotated)
  ann = second_of_two(lambda: generate(model, [prompt], method, forced_answers=[annotated], **kw)[0])
  twin = second_of_two(lambda: generate(model, [prompt], method, forced_answers=[twin_text], **kw)[0])
  changed, content = changed_predictions(model, ids, annotated)
  items = scoped.parse(annotated)
  return dict(tokens=twin.content_tokens, blocks=len(ann.threads) - 1, depth=max(scoped.depth(items)),
              steps=ann.steps, twin_steps=twin.steps, stalls=ann.stalls, t_ann=ann.seconds, t_twin=twin.seconds,
              realized=twin.seconds / ann.seconds, theoretical=ann.theoretical_speedup, changed=changed / content,
              ok=ann.finished and twin.finished and ann.text == twin.text == twin_text)


COLUMNS = ("id", "tokens", "blocks", "depth", "steps", "twin_steps", "stalls", "t_ann", "t_twin", "realized",
           "theoretical", "changed", "ok")


def parse_args(argv=None) -> argparse.Namespace:
  parser = argparse.ArgumentParser(prog="bench.scoped", description=__doc__.split("\n\n")[0])
  add_replay_flags(parser, limit=20)
  return parser.parse_args(argv)


def main(argv=None):
  args = parse_args(argv)
  model = load_model(args.model or "base")
  items = list(candidates(model, args.data, args.answer_tokens, args.prompt_bucket, args.limit))
  rows = []
  for answer_id, prompt, ids, annotated in tqdm(items, desc="answers"):
    try:
      rows.append(dict(id=answer_id, **measure(model, prompt, ids, annotated, args)))
    except TagError as err:  # counted, never dropped silently
      print(f"answer {answer_id}: {err}")
      rows.append(dict(id=answer_id, ok=False))
  good = [r for r in rows if "realized" in r]
  print(table(good, COLUMNS))
  means = {k: geometric_mean(r[k] for r in good) for k in ("realized", "theoretical")}
  changed = arithmetic_mean(r["changed"] for r in good)
  identical = sum(r["ok"] for r in rows)
  print(f"geometric means: realized={means['realized']:.3f}, theoretical={means['theoretical']:.3f}; "
        f"changed predictions {changed:.3f} (mean; {sum(r['changed'] < 0.2 for r in good)}/{len(good)} under the "
        f"paper's 20% filter); {identical}/{len(rows)} replays finished with identical clean text")
  print(f"RESULT realized_over_theoretical={means['realized'] / means['theoretical']:.3f} "
        f"identical={identical}/{len(rows)} changed_predictions={changed:.3f}")


if __name__ == "__main__":
  main()
