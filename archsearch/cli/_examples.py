"""Example command lines shown at the end of each subcommand's ``--help`` (``examples:``).

One table for every command so the examples read alike and one test
(tests/test_help_examples.py) runs them all, from the repository root, against the files the
repository ships. A line that trains, measures or evaluates a model ends with the marker
``# slow: WHY``; the test skips exactly those (it never guesses), and runs every other line.
Outputs go to relative names outside ``results/`` so that running an example writes nothing
into the repository's recorded results.
"""

from __future__ import annotations

SLOW = "# slow:"

_DEMO_RUNS = "results/examples/demo-cpu/proxies/runs.csv"
_DEMO_FIT = f"--data {_DEMO_RUNS} --law conditional-multiplicative --reference best-observed --size-tolerance 0.15"
_DEMO_SHAPES = "--head-dim 32 --hidden-multiple 32 --ffn-multiple 32 --tolerance 0.15 --vocab-size 2048"

EXAMPLES: dict[str, list[str]] = {
    "arch describe": [
        "archsearch arch describe --preset llama-3.2-1b",
        "archsearch arch describe --layers 16 --hidden-size 2048 --heads 32 --kv-heads 8 --ffn 8192 --json",
    ],
    "arch build": [
        "archsearch arch build --params 1B --layers 16 --hidden-over-sqrt-n 0.06 --mlp-to-attn 3 --gqa 4 --out cand",
    ],
    "arch list": ["archsearch arch list"],
    "bench": [
        "archsearch bench --backend analytic --preset llama-3.2-1b --device-spec H200 --batch-sizes 16,32 "
        "--input-len 4096 --output-len 1024",
        "archsearch bench --backend vllm --preset tiny --batch-sizes 1,8 --input-len 128 --output-len 64 "
        f"--repeats 3 --json   {SLOW} measures with vLLM",
    ],
    "calibrate": [
        "archsearch calibrate --table configs/calibration/published-throughput.csv --device H200 --engine vllm "
        f"--out h200-vllm.json   {SLOW} refits every model variant once per held-out shape and batch size",
    ],
    "estimate": [
        "archsearch estimate --arch llama-3.2-1b --tokens 20B --gpus 8xH100",
        "archsearch estimate --preset qwen3-0.6b --tokens 12B --gpus 8xH200 --tp 2 --json",
    ],
    "estimate fit": [f"archsearch estimate fit --data {_DEMO_RUNS} --out time_law.json"],
    "estimate batch-laws": ["archsearch estimate batch-laws --data results/batch-laws/timings.jsonl "
                            "--holdout results/batch-laws/holdout.jsonl --out batch_laws.json"],
    "estimate memory": ["archsearch estimate memory --arch qwen3-0.6b --gpus H200 --batch 64 --input-len 4096"],
    "eval": [
        "archsearch eval --list-tasks",
        f"archsearch eval --model smollm2-135m --tasks offline --limit 100 --json   {SLOW} evaluates a model",
    ],
    "fit": [f"archsearch fit {_DEMO_FIT} --out law.json --plots plots"],
    "solve": [
        f"archsearch solve --law results/examples/demo-cpu/law.json --params 2e5 --tokens 3e5 --layers 2 {_DEMO_SHAPES}",
        f"archsearch solve --law results/examples/demo-cpu/law.json --params 2e5 --tokens 3e5 --layers 2 {_DEMO_SHAPES} "
        "--out solved",
    ],
    "validate": [f"archsearch validate {_DEMO_FIT} --protocol progressive"],
    "migrate": ["archsearch migrate results/examples/paper-1b-rehearsal --dry-run"],
    "plan": [f"archsearch plan --candidates tiny smollm2-135m --max-tpot-s 0.05 --max-peak-memory-gib 4 "
             f"--out plan   {SLOW} measures every candidate"],
    "profile": [f"archsearch profile --study results/my-study --out profile.json   "
                f"{SLOW} needs a study that ran jobs (its startups.json)"],
    "search": [
        "archsearch search --config configs/demo-cpu.yaml --print-config optuna.n_shapes=12 params=200K",
        "archsearch search --config configs/paper-1b.yaml --dry-run --gpus 8xH100",
        f"archsearch search --config configs/demo-cpu.yaml   {SLOW} trains proxies and measures shapes",
    ],
    "train": [
        "archsearch train --print-config --tokens 5e5 train.lr=2e-3 data.seq_len=256",
        "archsearch train --preset tiny --tokens 1e6 --out runs/tiny --launch --num-processes 8",
        f"archsearch train --arch solved --tokens 5e5 --out runs/chosen   {SLOW} trains",
    ],
    "sweep": [
        "archsearch sweep --config configs/sweep-demo.yaml --print-config train.lr=2e-3 seeds=[0,1]",
        f"archsearch sweep --config configs/sweep-demo.yaml --out runs/sweep   {SLOW} trains the proxies",
    ],
}

# the ``KEY.SUB=VALUE`` example in the overrides' help, per command with a config
OVERRIDE_EXAMPLES = {"search": "optuna.n_shapes=12 params=200K", "train": "train.lr=2e-3 data.seq_len=256",
                     "sweep": "train.lr=2e-3 seeds=[0,1]"}


def epilog(command: str) -> str | None:
    """The ``examples:`` block of ``command``'s help ("arch describe", "estimate fit", ...)."""
    lines = EXAMPLES.get(command)
    return "examples:\n" + "\n".join(f"  {line}" for line in lines) if lines else None
