"""Multi-GPU / multi-node training through ``accelerate launch``.

:func:`accelerate_config` writes the config that ``accelerate launch --config_file`` reads
(DDP, or FSDP2 wrapping each decoder layer); :func:`launch_commands` gives the command for
every machine as an argument list (run with ``subprocess.run(cmd)``, never through a shell).
The launched processes run ``archsearch train`` with the same flags and output folder; the
training loop reads the process group from accelerate.
"""

from __future__ import annotations

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


def launch_commands(config_path: str | Path, train_args: list[str], num_machines: int = 1,
                    python: str | None = None) -> list[list[str]]:
    """One ``accelerate launch ... -m archsearch train ARGS`` argument list per machine rank."""
    base = [python or sys.executable, "-m", "accelerate.commands.launch",
            "--config_file", str(config_path)]
    tail = ["-m", "archsearch", "train", *train_args]
    if num_machines == 1:
        return [base + tail]
    return [base + ["--machine_rank", str(r)] + tail for r in range(num_machines)]
