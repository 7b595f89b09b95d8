"""Multi-GPU / multi-node training through ``accelerate launch``.

:func:`accelerate_config` writes the config that ``accelerate launch --config_file`` reads
(DDP, or FSDP2 wrapping each decoder layer), unless the user's own ``accelerate config`` default
is used (:func:`user_accelerate_config`); :func:`launch_commands` gives the command for every
machine as an argument list (run with ``subprocess.run(cmd)``, never through a shell), and
:func:`sbatch_script` a Slurm batch script for several nodes.
The launched processes run ``archsearch train`` with the same flags and output folder; the
training loop reads the process group from accelerate.
"""

from __future__ import annotations

import shlex
import sys
from pathlib import Path
from typing import Any

import yaml

from archsearch.arch import ArchSpec, hf_family
from archsearch.errors import ArchsearchError
from archsearch.fileio import atomic_write

# the decoder-layer class FSDP wraps, per family (transformers class names)
_LAYER_CLASS = {"llama": "LlamaDecoderLayer", "qwen2": "Qwen2DecoderLayer",
                "qwen3": "Qwen3DecoderLayer", "olmo2": "Olmo2DecoderLayer",
                "mistral": "MistralDecoderLayer"}


def accelerate_config(spec: ArchSpec, *, num_processes: int, num_machines: int = 1,
                      main_process_ip: str | None = None, main_process_port: int = 29500,
                      fsdp: bool = False, mixed_precision: str = "bf16") -> dict[str, Any]:
    """The accelerate YAML config as a dict. ``num_processes`` is the total over all machines."""
    if num_processes < 1:
        raise ArchsearchError("--num-processes", f"must be >= 1, got {num_processes}")
    if num_machines < 1:
        raise ArchsearchError("--num-machines", f"must be >= 1, got {num_machines}")
    if num_processes % num_machines:
        raise ArchsearchError("--num-processes", f"{num_processes} processes do not split evenly over "
                              f"{num_machines} machines", "give the total, e.g. 8 GPUs x 2 nodes = 16")
    if num_machines > 1 and not main_process_ip:
        raise ArchsearchError("--main-process-ip", "is required with more than one machine",
                              "the address of the rank-0 machine, reachable from the others")
    cfg: dict[str, Any] = {
        "compute_environment": "LOCAL_MACHINE",
        "distributed_type": "FSDP" if fsdp else ("MULTI_GPU" if num_processes > 1 else "NO"),
        "mixed_precision": mixed_precision,
        "num_processes": num_processes,
        "num_machines": num_machines,
        "machine_rank": 0,
        "gpu_ids": "all",
        "use_cpu": False,
        "downcast_bf16": "no",
        "rdzv_backend": "static",
        "same_network": True,
        "main_training_function": "main",
    }
    if num_machines > 1:
        cfg.update({"main_process_ip": main_process_ip, "main_process_port": main_process_port})
    if fsdp:
        cfg["fsdp_config"] = {
            "fsdp_version": 2,
            "fsdp_auto_wrap_policy": "TRANSFORMER_BASED_WRAP",
            "fsdp_transformer_layer_cls_to_wrap": _LAYER_CLASS[hf_family(spec)],
            "fsdp_reshard_after_forward": True,
            # sharded optimizer checkpoints (the model is saved whole by the loop)
            "fsdp_state_dict_type": "SHARDED_STATE_DICT",
            # every rank loads full weights before wrapping (how the loop resumes)
            "fsdp_cpu_ram_efficient_loading": False,
            "fsdp_offload_params": False,
            "fsdp_activation_checkpointing": False,
        }
    return cfg


def write_accelerate_config(path: str | Path, cfg: dict[str, Any]) -> Path:
    return atomic_write(path, yaml.safe_dump(cfg, sort_keys=False))


# how the commands are printed for a person: accelerate's own console script
ACCELERATE_LAUNCH = ("accelerate", "launch")


def user_accelerate_config() -> Path | None:
    """The user's default accelerate config (what ``accelerate config`` wrote, where ``accelerate
    launch`` reads it without ``--config_file``), or None."""
    from accelerate.commands.config.config_args import default_config_file

    path = Path(default_config_file)
    return path if path.is_file() else None


def launch_commands(config_path: str | Path | None, train_args: list[str], num_machines: int = 1,
                    python: str | None = None, program: tuple[str, ...] | None = None) -> list[list[str]]:
    """One ``accelerate launch ... -m archsearch train ARGS`` argument list per machine rank.
    ``config_path`` None: accelerate's default config (the user's ``accelerate config``).
    ``program``: how accelerate is started (default this Python's ``-m accelerate.commands.launch``,
    which runs in this environment; :data:`ACCELERATE_LAUNCH` to print it for a person)."""
    base = list(program or (python or sys.executable, "-m", "accelerate.commands.launch"))
    if config_path is not None:
        base += ["--config_file", str(config_path)]
    tail = ["-m", "archsearch", "train", *train_args]
    if num_machines == 1:
        return [base + tail]
    return [base + ["--machine_rank", str(r)] + tail for r in range(num_machines)]


def sbatch_script(config_path: str | Path, train_args: list[str], *, num_machines: int, num_processes: int,
                  main_process_port: int, out: str | Path) -> str:
    """A Slurm batch script that runs the launch on ``num_machines`` nodes: one ``accelerate
    launch`` per node (``srun``, one task each), its rank from ``SLURM_NODEID`` and the rank-0
    address from the allocation's first node. Every argument is shell-quoted."""
    per_node = num_processes // num_machines
    cmd = shlex.join([*ACCELERATE_LAUNCH, "--config_file", str(config_path), "--num_machines", str(num_machines),
                      "--num_processes", str(num_processes), "--main_process_port", str(main_process_port)])
    train = shlex.join(["-m", "archsearch", "train", *train_args])
    return "\n".join([
        "#!/bin/bash",
        "# written by archsearch train --launch: submit with `sbatch` (edit the partition, account and time)",
        "#SBATCH --job-name=archsearch-train",
        f"#SBATCH --nodes={num_machines}",
        "#SBATCH --ntasks-per-node=1",
        f"#SBATCH --gpus-per-node={per_node}",
        f"#SBATCH --output={shlex.quote(str(Path(out) / 'slurm-%j.out'))}",
        "set -euo pipefail",
        'MAIN_PROCESS_IP=$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n 1)',
        "export MAIN_PROCESS_IP",
        "# one launcher per node; quoted whole, so that each node's own shell reads its SLURM_NODEID",
        "srun bash -c " + shlex.quote(f'{cmd} --machine_rank "$SLURM_NODEID" --main_process_ip "$MAIN_PROCESS_IP" {train}'),
        ""])
