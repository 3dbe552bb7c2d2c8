"""Per config and graph, the device time measured alone over the predicted device time of a corpus's
nodes whose class path contains a tag (median, least, most), from a `graphopt calibrate --corpus`
samples file (split timing: steps with a measured device time). No device needed. Usage:
    python benchmarks/diag/diag_corpus_class_ratios.py SAMPLES.json.gz TAG [TAG ...]"""

import statistics
import sys
from collections import defaultdict

from graphopt.cost.opclass import class_name
from graphopt.tools.corpus_fit import Corpus


def ratios(path: str, tags: list[str]) -> dict:
    corpus = Corpus.load(path)
    out = defaultdict(list)
    for run in corpus.runs:
        for step in run.steps:
            if step.shape < 0 or not step.device_m or not step.device_s:
                continue
            cls = corpus.shapes[step.shape].cls
            if all(t in cls for t in tags):
                out[(run.config, run.source, class_name(cls))].append(step.device_m / step.device_s)
    return out


if __name__ == "__main__":
    for (config, source, cls), v in sorted(ratios(sys.argv[1], sys.argv[2:]).items()):
        print(f"{config:24} {source:9} {cls:32} n={len(v):3} median {statistics.median(v):6.2f} "
              f"range {min(v):.2f}-{max(v):.2f}")
