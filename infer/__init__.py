"""Inference entry points, beside `train/`: thin commands over `pasta_jax`.

  python -m infer.generate --prompts FILE --out answers.jsonl   a file of prompts answered in batches (resumable)
  python -m infer.eval --out DIR [...]                          speed and quality of decoding methods (`pasta eval`)
  python -m infer.serve [...]                                   the HTTP server and its thread page (`pasta serve`)
"""
