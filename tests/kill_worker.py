"""One resumable stage on a tiny model, in its own process, so tests/test_kill_resume.py can SIGKILL it at a chosen
write ($PASTA_KILL_AT, `pasta_jax.model.runfiles.kill_due`) and run it again until it finishes.

  python -m tests.kill_worker STAGE OUT_DIR      (STAGE: records, sft, bonbon, medusa)

Every stage is a pure function of its folder: running it again after a kill resumes it, and the files it ends with
must equal those of a run never killed. The test also calls `run` in its own process (the uninterrupted run and the
last resume), so both processes must compute alike: the suite's matmul precision is set here as in conftest.
"""

from __future__ import annotations

import contextlib
import json
import math
import sys
from pathlib import Path

import jax

jax.config.update("jax_default_matmul_precision", "highest")  # as tests/conftest.py: the same numbers in-process

SFT_STEPS = 6
TINY_ENV = "PASTA_KILL_TINY"  # tiny_model()'s params, saved once by the test (`save_tiny`): a worker skips the init


def _items(tree: dict, prefix: tuple = ()):
  """(path, leaf) in the dicts' own order, which code that walks the params (the LoRA init's keys) follows."""
  for key, value in tree.items():
    yield from _items(value, prefix + (key,)) if isinstance(value, dict) else [(prefix + (key,), value)]


def save_tiny(path: Path) -> Path:
  from flax import serialization

  from tests.tiny import tiny_model
  model = tiny_model()
  items = [(keys, jax.device_get(leaf)) for keys, leaf in _items(model.params)]  # (jax.tree.map sorts the keys)
  path.write_bytes(serialization.msgpack_serialize({"source": model.source, "paths": [list(p) for p, _ in items],
                                                    "leaves": [leaf for _, leaf in items]}))
  return path


def tiny():
  """tests.tiny.tiny_model(): read from $PASTA_KILL_TINY when the test saved it, else built (the same arrays)."""
  import os

  from tests.tiny import tiny_model
  path = os.environ.get(TINY_ENV)
  if not path:
    return tiny_model()
  import jax.numpy as jnp
  from flax import serialization

  from pasta_jax.model.config import get_config
  from pasta_jax.model.load import LoadedModel
  from tests.tiny import CharTokenizer
  saved = serialization.msgpack_restore(Path(path).read_bytes())
  params: dict = {}
  for keys, leaf in zip(saved["paths"], saved["leaves"]):
    node = params
    for key in keys[:-1]:
      node = node.setdefault(key, {})
    node[keys[-1]] = jnp.asarray(leaf)
  return LoadedModel(get_config("tiny-gemma3"), params, CharTokenizer(), saved["source"])


@contextlib.contextmanager
def patched(*changes):
  """(object, attribute, value) set for the stage and put back after: the test also runs stages in its own process."""
  saved = [(obj, name, getattr(obj, name)) for obj, name, _ in changes]
  for obj, name, value in changes:
    setattr(obj, name, value)
  try:
    yield
  finally:
    for obj, name, value in saved:
      setattr(obj, name, value)


def _pool(out: Path) -> Path:
  """The records stage's training pool: answers with lists (which the structural annotator forks) and without."""
  path = out / "pool.jsonl"
  if not path.exists():
    rows = []
    for i in range(8):
      items = "\n".join(f"{k + 1}. red fish {k}{i}" for k in range(2 + i % 2))
      output = f"Fish:\n{items}\nDone." if i % 4 else f"A plain answer {i}."
      rows.append({"id": str(i), "instruction": f"List fish {i}", "output": output})
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
  return path


def records(out: Path) -> None:
  """`train.recipe`'s records stage (annotate, keep what fits, hold out a split), the tiny char tokenizer's."""
  from pasta_jax.model import load
  from pasta_jax.model.load import LoadedModel
  from tests.tiny import CharTokenizer
  from train import recipe
  char = LoadedModel(None, None, CharTokenizer(), "char")  # the stage reads only the tokenizer
  with patched((load, "load_model", lambda *args, **kwargs: char)):
    recipe.main(["--out", str(out), "--stages", "records", "--pools", str(_pool(out)), "--seq-len", "256",
                 "--num-threads", "4", "--held-out", "0.25", "--group-blocks", "0", "--min-saving", "1"])


def sft(out: Path) -> None:
  """Full fine-tuning (Orbax checkpoints every 2 steps, metrics per step, the model exported as a checkpoint) into
  the recipe's pasta_sft folder, skipped when the recipe counts the stage done."""
  from pasta_jax.training.trainer import Trainer
  from tests import train_worker, training_data
  from train import recipe
  if recipe._done(out, "pasta_sft"):
    return
  model = tiny()
  data = train_worker.cyclic(training_data.batches(model.tokenizer), SFT_STEPS)
  trainer = Trainer(train_worker.CONFIG, model, data, out / "pasta_sft", check_memory=False, progress=False)
  trainer._mfu = lambda tokens, seconds: 0.0
  trainer.run()


class LongerIsBetter:
  """A deterministic judge: prefers the longer answer."""

  name = "longer"

  def compare(self, instruction, first, second):
    from pasta_jax.judges.base import Verdict
    return Verdict(1 / (1 + math.exp(-(len(first) - len(second)) / 5)))


ANSWERS = [
    'Two:<promise topic="a" tokens="10"/><async>one fish</async><promise topic="b" tokens="10"/>'
    '<async>two fish</async><sync/>done',
    "one fish, two fish, red fish. done",
    'Fish:<promise topic="r" tokens="10"/><async>red</async><sync/>blue fish',
]


def scripted(model, annotated: str):
  """The Sample the interpreter gives for a finished answer, without decoding (the stage's files are the point)."""
  import re

  from pasta_jax.decode.tokenizing import LangTokenizer
  from pasta_jax.lang import metrics, tokens
  from pasta_jax.preference.sampling import Sample
  vocab = model.tokenizer.tag_vocab()
  ids = tokens.encode_answer(annotated, LangTokenizer(model.tokenizer), vocab) + [vocab.eos_ids[0]]
  content = len(tokens.strip_token_ids(ids, vocab)) - 1
  return Sample(annotated, re.sub(r"<[^>]*>", "", annotated), tuple(ids), metrics.critical_path(ids, vocab), content,
                True)


def scripted_sample(model, prompts, cfg, *, seed):
  """Prompt i of the run's sample j is ANSWERS[(2i + j + seed) % 3]: a prompt sampled in another run (another seed,
  another place in it) gets other samples, as a real sampler's would be."""
  return [[scripted(model, ANSWERS[(2 * i + j + seed) % 3]) for j in range(cfg.num_samples)]
          for i in range(len(prompts))]


def scripted_greedy(model, prompts, cfg):
  return [scripted(model, "one fish two fish") for _ in prompts]


def bonbon(out: Path) -> None:
  """One BoNBoN round: sampling (2 prompts per run, scripted), judging through the verdict cache, scores and
  pairs, the reference log-probs, BoNBoN on a LoRA adapter, its export."""
  from pasta_jax.judges import CachedJudge
  from pasta_jax.preference.build import Samplers
  from pasta_jax.preference.config import PreferenceConfig
  from pasta_jax.preference.rounds import run_rounds
  from pasta_jax.training.config import TrainConfig
  start = tiny()
  prompts = [{"id": f"r{i}", "instruction": f"Fish {i}", "output": "a reference answer"} for i in range(4)]
  pref = PreferenceConfig(num_samples=3, max_new_tokens=48, lanes=4, requests_per_run=6)
  train = TrainConfig(model="tiny", batch_size=2, seq_len=112, num_threads=4, learning_rate=1e-3, epochs=2,
                      bonbon_beta=1.0, save_every=1, lora_rank=2, train_rows=())
  judge_for = lambda folder: CachedJudge(LongerIsBetter(), Path(folder) / "verdicts.jsonl")  # noqa: E731
  results = run_rounds(1, "start", start, prompts, judge_for, pref, train, out / "bonbon", load=lambda path: start,
                       samplers=Samplers(sample=scripted_sample, greedy=scripted_greedy), progress=False)
  assert results[0].model_dir is not None


def medusa(out: Path) -> None:
  """`train.medusa`: self-distillation (2 prompts per batch), heads on the cached hidden states, calibration."""
  from pasta_jax.training.medusa import distill
  from train import medusa as command
  model = tiny()
  with patched((command, "load_model", lambda *args, **kwargs: model),
               (distill, "prompts_from_pools", lambda count: [f"Count from {i}" for i in range(count)])):
    command.main(["--out", str(out / "medusa"), "--prompts", "6", "--batch", "2", "--new-tokens", "8", "--heads", "2",
                  "--train-batch", "4", "--draft-vocab", "0", "--held-out", "0.34", "--top-k", "2"])


STAGES = {"records": records, "sft": sft, "bonbon": bonbon, "medusa": medusa}


def run(stage: str, out: str | Path) -> None:
  STAGES[stage](Path(out))


if __name__ == "__main__":
  run(sys.argv[1], sys.argv[2])
