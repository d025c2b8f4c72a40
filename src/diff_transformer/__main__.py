"""`python -m diff_transformer`: the `diff-transformer` command (as `python -m diff_transformer.cli`)."""

import sys

from diff_transformer.cli import run_as_process


sys.exit(run_as_process())
