"""Paired per-answer ratios of two `bench.interpreter` outputs (after over before, geometric means).

  python docs/results/archive/one_decode_core_before_after/paired.py BEFORE.txt AFTER.txt
"""

import math
import sys

COLUMNS = ("t_ann", "t_twin", "realized")


def rows(path: str) -> dict[str, dict[str, float]]:
  header, out = None, {}
  for line in open(path):
    parts = line.split()
    if parts[:1] == ["id"]:
      header = parts
    elif header and len(parts) == len(header) and parts[0].isdigit():
      out[parts[0]] = {c: float(parts[header.index(c)]) for c in COLUMNS}
  return out


def geomean(xs: list[float]) -> float:
  return math.exp(sum(map(math.log, xs)) / len(xs))


def main(before_path: str, after_path: str) -> None:
  before, after = rows(before_path), rows(after_path)
  ids = sorted(before.keys() & after.keys(), key=int)
  print(f"{len(ids)} answers in both runs")
  for c in COLUMNS:
    ratios = [after[i][c] / before[i][c] for i in ids]
    print(f"{c:>9} after/before: geomean {geomean(ratios):.3f}, range {min(ratios):.3f} .. {max(ratios):.3f}, "
          f"after higher in {sum(r > 1 for r in ratios)} of {len(ids)}")


if __name__ == "__main__":
  main(*sys.argv[1:3])
