"""Figures of a learned model's free decoding: duplicate blocks, ROUGE-L, log-likelihood, aggregates."""

from __future__ import annotations

import itertools
import json
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pasta_jax.decode.api import chat_text
from pasta_jax.eval.learned import answer_figures, blocks_of, figure_lines, learned_figures, misnumbered, numbered_lists
from pasta_jax.eval.quality import answer_logprob
from pasta_jax.lang.metrics import duplicate_block_pairs, lcs_length, ngram_overlap, rouge_l
from pasta_jax.model.gemma import Gemma, causal_mask
from tests.tiny import tiny_model

words = st.lists(st.sampled_from("abc"), max_size=7)


def brute_lcs(a, b) -> int:
  for size in range(min(len(a), len(b)), 0, -1):
    subs = {tuple(a[i] for i in idx) for idx in itertools.combinations(range(len(a)), size)}
    if any(tuple(b[i] for i in idx) in subs for idx in itertools.combinations(range(len(b)), size)):
      return size
  return 0


@settings(max_examples=60, deadline=None)
@given(words, words)
def test_lcs_equals_brute_force(a, b):
  assert lcs_length(a, b) == brute_lcs(a, b)


def test_rouge_l_bounds():
  assert rouge_l("The cat sat.", "the cat sat") == 1.0
  assert rouge_l("dogs bark", "cats meow") == 0.0
  assert 0.0 < rouge_l("the cat sat on a mat", "a cat sat there") < 1.0


def test_duplicate_blocks_are_counted_per_sibling_pair():
  same = "1. Eat a variety of fruits and vegetables."
  other = "2. Sleep at least eight hours every night."
  assert duplicate_block_pairs([same, same, other]) == (1, 3)
  assert duplicate_block_pairs([same, other]) == (0, 1)
  assert duplicate_block_pairs([same]) == (0, 0)
  assert duplicate_block_pairs(["Rest.", "rest"]) == (1, 1)  # short blocks compare whole
  assert ngram_overlap(same, same + " " + other) == 1.0  # contained in a longer block: a duplicate


@settings(max_examples=40, deadline=None)
@given(st.lists(st.sampled_from(["a", "b", "c", "d"]), min_size=1, max_size=12),
       st.lists(st.sampled_from(["a", "b", "c", "d"]), min_size=1, max_size=12))
def test_overlap_is_symmetric_and_bounded(a, b):
  x, y = " ".join(a), " ".join(b)
  assert ngram_overlap(x, y) == ngram_overlap(y, x)
  assert 0.0 <= ngram_overlap(x, y) <= 1.0


def _run(annotated: str, threads: int, finished: bool = True, text: str = "x") -> dict:
  return dict(annotated=annotated, text=text, threads=threads, finished=finished)


def test_answer_figures_and_aggregates():
  dup = '<promise topic="a" tokens="10"/><async>Eat more fruit now.</async><promise topic="b" tokens="10"/>' \
        '<async>Eat more fruit now.</async><sync/>Done.'
  broken = '<promise topic="a" tokens="10"/><async>cut off'
  assert blocks_of(broken) is None and blocks_of(dup) == ["Eat more fruit now.", "Eat more fruit now."]
  fig = answer_figures(_run(dup, 3), reference="Eat more fruit")
  assert (fig["forks"], fig["well_formed"], fig["duplicate_pairs"], fig["sibling_pairs"]) == (2, True, 1, 1)
  speed = {k: {"geometric": 1.5, "arithmetic": 1.6} for k in ("realized_speedup", "theoretical_speedup",
                                                              "parallelism")}
  results = {"methods": [{"name": "p", "speed": speed}], "prompts": [
      {"id": "1", "instruction": "q1", "runs": {"p": _run(dup, 3), "b": _run("plain", 1)}},
      {"id": "2", "instruction": "q2", "runs": {"p": _run(broken, 2, finished=False), "b": _run("plain", 1)}}]}
  records = [{"id": "1", "reference": "Eat more fruit"}, {"id": "2", "reference": "Sleep well"}]
  scored = []
  figures = learned_figures(results, records, "p", "b", scorer=lambda prompt, text: scored.append(text) or (
      -3.0 if text in ("Eat more fruit", "Sleep well") else -1.0))
  p, b = figures["pasta"], figures["baseline"]
  assert (p["fork_rate"], p["well_formed"], p["truncated"], p["duplicate_rate"]) == (1.0, 1.0, 0.5, 1.0)
  # a cut inside a block is the budget's doing; a malformed tag before the cut is the model's
  assert answer_figures(_run(broken, 2, finished=False), "")["well_formed"]
  assert not answer_figures(_run(broken, 2, finished=True), "")["well_formed"]
  bad_length = '<promise topic="a" tokens="15"/><async>text'
  assert not answer_figures(_run(bad_length, 2, finished=False), "")["well_formed"]
  assert (b["fork_rate"], b["well_formed"], b["duplicate_rate"]) == (0.0, 1.0, 0.0)
  assert figures["realized_over_theoretical"] == 1.0 and p["logprob"] == -1.0 and b["logprob"] == -1.0
  # the reference answers are scored once per prompt, as the anchor column
  assert figures["reference"] == {"logprob": -3.0, "n": 2} and sorted(scored).count("Eat more fruit") == 1
  table = "\n".join(figure_lines(figures))
  assert "| log p per token under Baseline-SFT | -1.0000 | -1.0000 | -3.0000 |" in table
  assert "| log p per token under base | -1.0000 |" in "\n".join(figure_lines({**figures, "scorer": "base"}))
  assert "| fork rate | 1.000 | 0.000 | - |" in table


def test_exact_promise_lengths_are_well_formed_in_the_mode_that_writes_them():
  """Pred-1x answers promise exact lengths: well-formed at its step (1), malformed at Pred-10x's; learned_figures
  reads the method's answers at its step and the baseline's at the default."""
  exact = '<promise topic="a" tokens="12"/><async>Eat more fruit.</async><sync/>Done.'
  assert not answer_figures(_run(exact, 2), "")["well_formed"]
  assert answer_figures(_run(exact, 2), "", length_step=1)["well_formed"]
  speed = {k: {"geometric": 1.0, "arithmetic": 1.0} for k in ("realized_speedup", "theoretical_speedup",
                                                              "parallelism")}
  results = {"methods": [{"name": "p", "speed": speed}], "prompts": [
      {"id": "1", "instruction": "q", "runs": {"p": _run(exact, 2), "b": _run(exact, 2)}}]}
  figures = learned_figures(results, [{"id": "1", "reference": "x"}], "p", "b", length_step=1)
  assert (figures["pasta"]["well_formed"], figures["baseline"]["well_formed"]) == (1.0, 0.0)
  assert learned_figures(results, [{"id": "1", "reference": "x"}], "p", "b")["pasta"]["well_formed"] == 0.0


def test_repeated_list_items_are_counted_in_the_clean_text_of_both_models():
  text = "Tips:\n1. Eat more fruit every day.\n2. Eat more fruit every day.\n3. Sleep eight hours a night.\n"
  fig = answer_figures(_run(text, 1, text=text), reference="")
  assert (fig["repeated_item_pairs"], fig["item_pairs"], fig["has_list"]) == (1, 3, True)
  plain = answer_figures(_run("no list here", 1, text="no list here"), "")
  assert (plain["item_pairs"], plain["has_list"]) == (0, False)


@pytest.mark.parametrize("text, lists, wrong", [
    ("1. a\n2. b\n3. c\n", [[1, 2, 3]], False),
    ("1. a\n2. b\n2. c\n3. d\n", [[1, 2, 2, 3]], True),  # main lost count after a forked group
    ("1. a\n3. b\n", [[1, 3]], True),
    ("Pros:\n1. a\n2. b\n\nCons:\n1. c\n2. d\n", [[1, 2], [1, 2]], False),  # each list counts on its own
    ("- a\n- b\n", [], False),
    ("1. only one\n", [], False),
])
def test_misnumbered_lists(text, lists, wrong):
  assert numbered_lists(text) == lists and misnumbered(text) == wrong
  fig = answer_figures(_run(text, 1, text=text), reference="")
  assert (fig["numbered"], fig["misnumbered"]) == (bool(lists), wrong)


def test_answer_logprob_equals_an_independent_forward():
  model = tiny_model()
  prompt, answer = "Hi", "ok go"
  mean, count = answer_logprob(model, prompt, answer, bucket=16)
  tok = model.tokenizer
  prompt_ids = tok.encode(chat_text(tok, prompt), add_bos=True)  # the project's one chat format
  answer_ids = tok.encode(answer, add_bos=False) + [tok.eos_ids[0]]
  ids = jnp.asarray([prompt_ids + answer_ids])
  length = ids.shape[1]
  logits = Gemma(model.config).apply(model.params, ids, jnp.arange(length)[None], causal_mask(1, length)).logits
  logp = jax.nn.log_softmax(logits[0], axis=-1)
  picked = [float(logp[i - 1, int(ids[0, i])]) for i in range(len(prompt_ids), length)]
  assert count == len(answer_ids)
  assert math.isclose(mean, float(np.mean(picked)), rel_tol=1e-5)


def test_quality_pareto_plots_every_model_and_the_baseline(tmp_path):
  from pasta_jax.eval.learned_plot import _short, plot_quality_pareto
  base = {"rouge_l": 0.13, "logprob": -0.9}
  figures = {"pasta:runs/a/bonbon_l1/round_1/train/model": {"n": 3, "realized": 1.5, "baseline": base,
                                                          "pasta": {"rouge_l": 0.12, "logprob": -1.2}},
             "pasta:b": {"n": 3, "realized": 1.2, "baseline": base, "pasta": {"rouge_l": 0.1, "logprob": math.nan}}}
  path = plot_quality_pareto(figures, tmp_path / "p.png")
  assert (tmp_path / "p.png").read_bytes()[:4] == b"\x89PNG" and path.endswith("p.png")
  assert _short("pasta:runs/a/bonbon_l1/round_1/train/model") == "a/bonbon_l1" and _short("pasta:b") == "b"
  with pytest.raises(ValueError, match="no models"):
    plot_quality_pareto({}, tmp_path / "q.png")


def test_pareto_points_take_the_asked_speed_and_skip_what_is_not_finite(tmp_path):
  from pasta_jax.eval.learned_plot import plot_series, series_points
  figures = {"pasta:a": {"realized": 1.4, "theoretical": 1.6, "fork_bias": 4.0, "pasta": {"rouge_l": 0.12}},
             "pasta:b": {"realized": 1.1, "theoretical": math.nan, "pasta": {"rouge_l": 0.10}},
             "pasta:c": {"realized": 1.2, "theoretical": 1.3, "pasta": {"rouge_l": math.nan}}}
  assert series_points(figures, "rouge_l", "theoretical") == [(1.6, 0.12, "pasta:a", 4.0)]
  assert series_points(figures, "rouge_l", "realized") == [(1.4, 0.12, "pasta:a", 4.0), (1.1, 0.10, "pasta:b", 0.0)]
  with pytest.raises(ValueError, match="speed must be one of"):
    plot_series({"": figures}, tmp_path / "p.png", speed="wall")


def _learned_json(path, n: int, rows: dict) -> str:
  base = {"rouge_l": 0.13, "logprob": -0.9, "truncated": 0.4, "duplicate_rate": 0.0}
  figures = {name: {"n": n, "realized": realized, "theoretical": realized + 0.1, "fork_bias": bias, "baseline": base,
                    "pasta": {"rouge_l": 0.12, "logprob": logprob, "truncated": 0.1, "duplicate_rate": 0.02}}
             for name, (realized, bias, logprob) in rows.items()}
  path.write_text(json.dumps(figures))
  return str(path)


def test_pareto_merges_the_base_scored_run_and_plots_every_series(tmp_path, capsys):
  """bench.pareto: each run a series; a second reading of a run under the base model becomes its own panel's
  values (row by row); the table lists every point; runs over different prompt counts are refused."""
  from bench import pareto
  sweep = _learned_json(tmp_path / "a.json", 4, {"pasta:l0": (1.6, 0.0, -1.3), "pasta:l8": (1.2, 0.0, -1.0)})
  under_base = _learned_json(tmp_path / "a_base.json", 4, {"pasta:l0": (1.6, 0.0, -1.7), "pasta:l8": (1.2, 0.0, -1.4)})
  knob = _learned_json(tmp_path / "k.json", 4, {"pasta:d": (1.5, 0.0, -1.1), "pasta:d@fork_bias=8": (1.4, 8.0, -1.2)})
  out = tmp_path / "plot" / "p.png"
  assert pareto.main(["--out", str(out), "--run", f"sweep={sweep},{under_base}", "--run", f"knob={knob}"]) == 0
  assert out.read_bytes()[:4] == b"\x89PNG"
  by_steps = tmp_path / "plot" / "steps.png"
  assert pareto.main(["--out", str(by_steps), "--speed", "theoretical", "--run", f"knob={knob}"]) == 0
  assert by_steps.read_bytes()[:4] == b"\x89PNG"
  rows = {line.split("|")[2].strip(): line for line in out.with_suffix(".md").read_text().splitlines()[4:]}
  assert "-1.700" in rows["`pasta:l0`"] and "-1.300" in rows["`pasta:l0`"]  # log p under the scorer, the base
  assert rows["`pasta:d@fork_bias=8`"].split("|")[3].strip() == "8" and rows["`pasta:d`"].endswith("| - |")
  other = _learned_json(tmp_path / "o.json", 5, {"pasta:x": (1.1, 0.0, -1.0)})
  with pytest.raises(SystemExit, match="different prompt counts"):
    pareto.main(["--out", str(out), "--run", f"sweep={sweep}", "--run", f"other={other}"])
  with pytest.raises(SystemExit, match="shares no row"):
    pareto.main(["--out", str(out), "--run", f"knob={knob},{under_base}"])
  # a row decoded after the base model's reading: left out of that panel only, and said
  partly = _learned_json(tmp_path / "p_base.json", 4, {"pasta:l0": (1.6, 0.0, -1.7)})
  assert pareto.main(["--out", str(out), "--run", f"sweep={sweep},{partly}"]) == 0
  assert "lacks rows ['pasta:l8']" in capsys.readouterr().out
  rows = {line.split("|")[2].strip(): line for line in out.with_suffix(".md").read_text().splitlines()[4:]}
  assert rows["`pasta:l8`"].endswith("| -1.000 | - |") and rows["`pasta:l0`"].endswith("| -1.300 | -1.700 |")
