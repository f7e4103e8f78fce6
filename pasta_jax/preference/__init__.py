"""Preference data for BoNBoN (the later paper, section 4): sample, score, keep best and worst.

  sampling.py   N answers per prompt at temperature T from the batched interpreter, and the
                Baseline-SFT model's greedy answer
  scoring.py    theoretical speedup vs the baseline answer, judged quality, score = speedup + lambda * quality
  build.py      the resumable pipeline: samples.jsonl -> judged pairs.jsonl
  reference.py  the reference model's log p(y|x) of each pair, computed once and stored with it
  dataset.py    pairs -> `PairBatch`es by optimizer step, for the trainer
"""
