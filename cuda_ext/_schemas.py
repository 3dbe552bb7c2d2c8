"""The op schemas, read from the one place they are written: the TORCH_LIBRARY(graphopt, m)
block of csrc/registration.cpp (each ``m.def("...")`` on one line)."""
from __future__ import annotations

import functools
import re
from pathlib import Path

REGISTRATION_CPP = Path(__file__).resolve().parent / "csrc" / "registration.cpp"
NAMESPACE = "graphopt"


@functools.lru_cache(maxsize=None)
def schemas() -> dict[str, str]:
    """{op name: schema string} in definition order."""
    text = REGISTRATION_CPP.read_text()
    m = re.search(r"TORCH_LIBRARY\(\s*graphopt\s*,\s*m\s*\)\s*\{(.*?)\n\}", text, re.S)
    if not m:
        raise RuntimeError(f"no TORCH_LIBRARY(graphopt, m) block in {REGISTRATION_CPP}")
    out: dict[str, str] = {}
    for s in re.findall(r'm\.def\(\s*"([^"]+)"', m.group(1)):
        out[s.split("(", 1)[0].strip()] = s
    if not out:
        raise RuntimeError(f"no m.def(...) schemas found in {REGISTRATION_CPP}")
    return out
