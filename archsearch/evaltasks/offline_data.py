"""Dataset loader for the offline tasks (lm-eval's ``custom_dataset``).

lm-eval hands ``data_files`` to ``datasets.load_dataset`` as given, so a relative path would
resolve against the caller's working directory. The YAML names the file instead and this
loader finds it next to itself, wherever the package is installed. lm-eval also passes the
task's metadata as keyword arguments; they are not needed here.
"""

import json
from pathlib import Path

import datasets

DATA_DIR = Path(__file__).resolve().parent / "data"


def load(data_file: str, **_metadata) -> datasets.DatasetDict:
    path = DATA_DIR / data_file
    with path.open(encoding="utf-8") as f:
        rows = [json.loads(line) for line in f if line.strip()]
    return datasets.DatasetDict({"test": datasets.Dataset.from_list(rows)})
