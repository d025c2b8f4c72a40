"""`python -m diff_transformer.cli`: the `diff-transformer` command."""

import sys

from . import run_as_process


sys.exit(run_as_process())
