"""The performance sweep: models nobody wrote a pattern for, one process each, against eager and
torch.compile (graphopt.tools.perf_sweep; --help for the options)."""

import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from graphopt.tools.perf_sweep import main  # noqa: E402

if __name__ == "__main__":
    raise SystemExit(main())
