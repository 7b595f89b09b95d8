"""Check that every study config under configs/ loads to the same values here as in another
checkout (an older version, which may read them flat): each side loads its own configs/*.yaml in
its own interpreter and prints ``to_dict`` of each; the other side's, nested as this version
nests them (archsearch.configio.nest_components), must build the same StudyConfig as this one's.

    python scripts/compare_config_values.py /path/to/older/checkout

Prints one line per config and exits 1 on any difference.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from archsearch.configio import from_dict, nest_components
from archsearch.search.config import StudyConfig, load_study_config

HERE = Path(__file__).resolve().parent.parent
DUMP = """
import json, sys
from pathlib import Path
from archsearch.configio import to_dict
from archsearch.search.config import load_study_config
out = {}
for p in sorted(Path("configs").glob("*.yaml")):
    try:
        out[p.name] = to_dict(load_study_config(p))
    except Exception as e:  # a sweep config, not a study's
        out[p.name] = None
print(json.dumps(out, default=str))
"""


def dump(checkout: Path) -> dict:
    env = {**os.environ, "PYTHONPATH": str(checkout)}
    res = subprocess.run([sys.executable, "-c", DUMP], cwd=checkout, env=env, capture_output=True, text=True,
                         check=True)
    return json.loads(res.stdout.strip().splitlines()[-1])


def main() -> int:
    other = Path(sys.argv[1]).resolve()
    theirs = dump(other)
    os.chdir(HERE)
    bad = 0
    for name, old in theirs.items():
        path = HERE / "configs" / name
        if old is None:
            print(f"{name}: not a study config in {other}, skipped")
            continue
        mine = load_study_config(path)
        same = from_dict(StudyConfig, nest_components(StudyConfig, old)[0]) == mine
        bad += not same
        print(f"{name}: {'same values' if same else 'DIFFERENT'}")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
