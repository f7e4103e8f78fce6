"""`pasta annotate` and `pasta data-stats` are wired: APAR-format output, and clear errors."""

from __future__ import annotations

import json

from pasta_jax.cli import main
from pasta_jax.data.apar_format import strip_apar


def test_annotate_apar_writes_rows(tmp_path, capsys):
  src = tmp_path / "in.jsonl"
  src.write_text(json.dumps({"id": "1", "instruction": "Tips?", "output":
                             "1. Sleep: go to bed on time.\n2. Food: eat light meals.\n3. Move: walk every day.\n"})
                 + "\n" + json.dumps({"id": "2", "instruction": "Hi", "output": "Hello."}) + "\n")
  out = tmp_path / "out.jsonl"
  assert main(["annotate", str(src), "--with", "apar", "--out", str(out)]) == 0
  rows = [json.loads(line) for line in out.read_text().splitlines()]
  assert [r["apar_kind"] for r in rows] == ["ordered_list", "unstructured"]
  assert strip_apar(rows[0]["apar"]) == rows[0]["output"] and rows[1]["apar"] is None
  assert "1/2 records annotated" in capsys.readouterr().out


def test_verify_needs_pasta_annotations(tmp_path, capsys):
  src = tmp_path / "in.jsonl"
  src.write_text(json.dumps({"id": "1", "instruction": "Hi", "output": "Hello."}) + "\n")
  assert main(["annotate", str(src), "--with", "apar", "--verify", "--out", str(tmp_path / "o.jsonl")]) == 2
  assert "--verify checks PASTA annotations" in capsys.readouterr().err


def test_data_stats_rejects_an_unknown_annotator(tmp_path, capsys):
  assert main(["data-stats", "lima", "--annotator", "magic", "--out", str(tmp_path)]) == 2
  assert "unknown annotator 'magic'" in capsys.readouterr().err
