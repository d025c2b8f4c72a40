"""Datasets of the diff_tiny tasks, read from the JSON-lines files beside this module (no download, no HF cache).

lm-eval calls a task's `custom_dataset` with the task's metadata and dataset_kwargs; `file` names the data file.
"""

import json
from pathlib import Path

from datasets import Dataset, DatasetDict


def load(file, **_):
    with open(Path(__file__).parent / file, encoding="utf-8") as f:
        rows = [json.loads(line) for line in f if line.strip()]
    return DatasetDict({"test": Dataset.from_list(rows)})
