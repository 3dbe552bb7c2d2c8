"""Per config and graph, the device time measured alone over the predicted device time of a corpus's
nodes whose class path contains a tag (median, least, most), from a `graphopt calibrate --corpus`
samples file (split timing: steps with a measured device time). No device needed. Usage:
    python benchmarks/diag/diag_corpus_class_ratios.py SAMPLES.json.gz TAG [TAG ...]"""

import gzip
import json
import statistics
import sys
from collections import defaultdict


def ratios(path: str, tags: list[str]) -> dict:
    d = json.load(gzip.open(path))
    classes, shapes = d["classes"], d["shapes"]
    out = defaultdict(list)
    for run in d["runs"]:
        for step in run["steps"]:
            if step[0] < 0 or len(step) != 8 or not step[7] or not step[2]:
                continue
            cls = classes[shapes[step[0]][0]]
            if all(t in cls.split("/") for t in tags):
                out[(run["config"], run["source"], cls)].append(step[7] / step[2])
    return out


if __name__ == "__main__":
    for (config, source, cls), v in sorted(ratios(sys.argv[1], sys.argv[2:]).items()):
        print(f"{config:24} {source:9} {cls:32} n={len(v):3} median {statistics.median(v):6.2f} "
              f"range {min(v):.2f}-{max(v):.2f}")
