"""Benchmark: loading every config of ``configs/`` with configio's reading against a reference.

Reads each ``configs/*.yaml`` (a study config through ``load_study_config``, a sweep config as a
``SweepConfig``) with this checkout's ``archsearch.configio.from_dict`` and with the one at git
revision ``--against`` (loaded from ``git show REV:archsearch/configio.py``), checks that both
give the same config (``to_dict`` and ``repr`` identical; exit status 1 otherwise), and times ``--repeats``
loads of each both ways, alternating, after one untimed load each (the first load of a config
type builds its validator once per process). Prints per config the median load time both ways
and their ratio, and appends one JSON line per config with provenance to
``results/bench/config_load.jsonl``. ``--cold N`` also times the first load of ``--cold-config``
in N fresh processes each way (this way's includes importing pydantic and building the
validator), one more line.

    python -m archsearch.benchmarks.scripts.bench_config_load [--against REV] [--repeats 20] [--cold 5]
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import yaml

from archsearch import configio
from archsearch.fileio import append_line

OUT = Path("results/bench/config_load.jsonl")
REVISION = "c00ce70"  # configio's own dict-to-dataclass walk, before it read through pydantic


def reference_configio(rev: str) -> Any:
    """``archsearch/configio.py`` at git revision ``rev`` as a module of its own."""
    src = subprocess.run(["git", "show", f"{rev}:archsearch/configio.py"], check=True, capture_output=True,
                         text=True).stdout
    path = Path(tempfile.mkdtemp()) / "configio_reference.py"
    path.write_text(src)
    spec = importlib.util.spec_from_file_location("configio_reference", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def loader(path: Path, from_dict: Any) -> Any:
    """A function that loads config ``path`` as the CLI does, converting with ``from_dict``."""
    from archsearch.search.config import StudyConfig, inherit_study_settings
    from archsearch.trainers.config import SweepConfig

    if "baseline" in (yaml.safe_load(path.read_text()) or {}):
        return lambda: from_dict(StudyConfig, inherit_study_settings(configio.load_yaml(path)))
    return lambda: from_dict(SweepConfig, configio.load_yaml(path))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--against", default=REVISION, help="git revision of the reference configio")
    ap.add_argument("--repeats", type=int, default=20)
    ap.add_argument("--out", type=Path, default=OUT)
    ap.add_argument("--cold", type=int, default=0, help="fresh processes each way for the first load")
    ap.add_argument("--cold-config", type=Path, default=Path("configs/demo-cpu.yaml"))
    ap.add_argument("--one", choices=["this", "reference"], help=argparse.SUPPRESS)  # child: one first load
    a = ap.parse_args(argv)
    if a.one:
        from_dict = configio.from_dict if a.one == "this" else reference_configio(a.against).from_dict
        load = loader(a.cold_config, from_dict)
        t = time.perf_counter()
        load()
        print((time.perf_counter() - t) * 1e3)
        return 0
    from archsearch.provenance import provenance

    ref = reference_configio(a.against)
    prov = provenance(extra_packages=["pydantic", "pydantic-core", "pyyaml"], device=False)
    differ = 0
    print(f"{'config':36s} {'reference ms':>12s} {'this ms':>9s} {'ratio':>6s}  same")
    for path in sorted(Path("configs").glob("*.yaml")):
        new, old = loader(path, configio.from_dict), loader(path, ref.from_dict)
        a_new, a_old = new(), old()  # also the untimed first loads
        # the same values of the same types (repr tells 5 from 5.0 and a tuple from a list)
        same = configio.to_dict(a_new) == configio.to_dict(a_old) and repr(a_new) == repr(a_old)
        differ += not same
        times: dict[str, list[float]] = {"this": [], "reference": []}
        for _ in range(a.repeats):
            for name, load in (("reference", old), ("this", new)):
                t = time.perf_counter()
                load()
                times[name].append(time.perf_counter() - t)
        med = {k: statistics.median(v) * 1e3 for k, v in times.items()}
        ratio = med["this"] / med["reference"]
        print(f"{path.name:36s} {med['reference']:12.2f} {med['this']:9.2f} {ratio:6.2f}  {same}")
        append_line(a.out, json.dumps({"bench": "config_load", "config": str(path), "repeats": a.repeats,
                            "against": a.against, "median_ms": med["this"],
                            "reference_median_ms": med["reference"],
                            "ratio": ratio, "same_config": same, "provenance": prov}))
    if a.cold:
        cold: dict[str, list[float]] = {"this": [], "reference": []}
        for _ in range(a.cold):
            for name in cold:
                argv1 = [sys.executable, "-m", "archsearch.benchmarks.scripts.bench_config_load", "--one", name,
                         "--against", a.against, "--cold-config", str(a.cold_config)]
                out = subprocess.run(argv1, check=True, capture_output=True, text=True).stdout
                cold[name].append(float(out))
        med = {k: statistics.median(v) for k, v in cold.items()}
        print(f"first load of {a.cold_config} in a fresh process (median of {a.cold}): reference "
              f"{med['reference']:.1f} ms, this {med['this']:.1f} ms")
        append_line(a.out, json.dumps({"bench": "config_load_first", "config": str(a.cold_config),
                                       "repeats": a.cold, "against": a.against, "median_ms": med["this"],
                                       "reference_median_ms": med["reference"], "provenance": prov}))
    print(f"{differ} config(s) differ" if differ else "every config reads the same both ways")
    return 1 if differ else 0


if __name__ == "__main__":
    sys.exit(main())
