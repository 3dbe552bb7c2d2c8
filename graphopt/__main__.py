"""python -m graphopt: the command line (graphopt.tools.cli)."""
import sys

from .tools.cli import main

sys.exit(main())
