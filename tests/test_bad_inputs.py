"""The bad-input table: malformed, absurd and edge inputs over every subcommand and config field.

Each case runs ``archsearch ARGV`` in-process in a folder holding valid fixture files and
asserts what the README promises: exit status 2, one line on stderr that names the field,
no traceback, within seconds (absurd sizes are refused by arithmetic, not by running out of
time), and nothing in the folder created, changed or removed. To add a case, add a row: the
argument list (``{d}`` is the fixture folder) and a fragment the error line must contain.
Config cases name a fixture config and the dotted keys to change in it.

``python tests/test_bad_inputs.py`` prints the count (the README's figure).
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import hashlib
import io
import json
import os
import signal
import sys
from pathlib import Path

import pytest
import yaml

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

LAW = {"law": "conditional-multiplicative",
       "coefficients": {"a0": 1.08, "a1": 0.05, "a2": 0.004, "b0": 0.97, "b1": 0.02, "b2": 0.04},
       "reference": {"law": "chinchilla",
                     "coefficients": {"E": 1.8, "A": 400, "alpha": 0.34, "B": 410, "beta": 0.28}}}

SWEEP = {"name": "s", "params": [100000], "n_layers": 2, "hidden_over_sqrt_n": [0.2],
         "mlp_to_attn": [1.5], "gqa": 2, "head_dim": 32,
         "build": {"hidden_multiple": 32, "ffn_multiple": 32, "tolerance": 0.15, "on_r_drift": "flag"},
         "train": {"tokens_per_param": 1.5, "global_batch_size": 16, "lr": 3.0e-3},
         "data": {"source": "shakespeare", "tokenizer": "bpe:2048", "seq_len": 128}}

STUDY = {"name": "st", "params": 200000, "tokens": 300000, "n_layers": 2, "vocab_size": 2048,
         "baseline": {"hidden_over_sqrt_n": 0.2, "mlp_to_attn": 3.0, "gqa": 2},
         "search_space": {"hidden_over_sqrt_n": [0.1, 0.4], "mlp_to_attn": [0.5, 5.0], "gqa": [1, 2],
                          "head_dim": 32, "build": {"hidden_multiple": 32, "ffn_multiple": 32, "tolerance": 0.15, "on_r_drift": "flag"}},
         "law": {"file": "law.json"},
         "measure": {"bench": {"backend": "analytic", "batch_sizes": [16], "input_len": 64, "output_len": 64}},
         "optuna": {"n_shapes": 2, "enqueue_solution": 1},
         "gqa_search": {"enabled": True, "baseline_gqa": 2}}

# the password every storage case carries: it must never be printed
SECRET = "hunter2-s3cret"
# a study that trains proxies: a storage refused at load must be refused before any is trained
_PROXIES = {"law.file": None, "proxy": {"sweep": SWEEP}}

TRAIN = {"train": {"tokens": 20000, "global_batch_size": 8, "lr": 3.0e-3},
         "data": {"source": "shakespeare", "tokenizer": "bpe:2048", "seq_len": 64}}

ARCH = ["--layers", "2", "--hidden-size", "128", "--heads", "4", "--kv-heads", "2", "--ffn", "256"]
BUILD = ["arch", "build", "--params", "1e6", "--layers", "4", "--hidden-over-sqrt-n", "0.2",
         "--mlp-to-attn", "2"]
SOLVE = ["solve", "--law", "{d}/law.json", "--params", "2e5", "--tokens", "3e5", "--layers", "2"]
FIT = ["fit", "--data", "{d}/runs.csv", "--law", "conditional-multiplicative",
       "--reference", "best-observed", "--no-r-filter"]
VALIDATE = ["validate", "--data", "{d}/runs.csv", "--law", "chinchilla"]
PLAN = ["plan", "--candidates", "tiny", "--out", "{d}/po"]
BENCH = ["bench", "--backend", "analytic", *ARCH, "--batch-sizes", "1"]
TRAIN_CMD = ["train", *ARCH, "--vocab-size", "2048", "--config", "{d}/train.yaml"]
EST = ["estimate", "--arch", "llama-3.2-1b", "--tokens", "20B"]
MEM = ["estimate", "memory", "--arch", "llama-3.2-1b"]

# HF config.json values of the wrong type: (the key named, the config.json's changed entries)
HF_GOOD = {"model_type": "llama", "num_attention_heads": 4, "hidden_size": 128, "num_hidden_layers": 2,
           "intermediate_size": 256, "vocab_size": 2048, "num_key_value_heads": 2}
HF_BAD = {"heads-text": ("num_attention_heads", {"num_attention_heads": "eight"}),
          "heads-null": ("num_attention_heads", {"num_attention_heads": None}),
          "heads-nan": ("num_attention_heads", {"num_attention_heads": float("nan")}),
          "layers-inf": ("num_hidden_layers", {"num_hidden_layers": float("inf")}),
          "hidden-list": ("hidden_size", {"hidden_size": [128]}),
          "model-type-list": ("model_type", {"model_type": ["llama"]}),
          "vocab-bool": ("vocab_size", {"vocab_size": True}),
          "eps-text": ("rms_norm_eps", {"rms_norm_eps": "small"}),
          "tie-text": ("tie_word_embeddings", {"tie_word_embeddings": "yes"}),
          "kv-text": ("num_key_value_heads", {"num_key_value_heads": "two"}),
          "kv-zero": ("num_key_value_heads", {"num_key_value_heads": 0}),
          "kv-not-divisor": ("num_key_value_heads", {"num_key_value_heads": 3}),
          "ffn-neg": ("intermediate_size", {"intermediate_size": -5}),
          "head-dim-text": ("head_dim", {"head_dim": "64"}),
          "head-dim-zero": ("head_dim", {"head_dim": 0}),
          "hidden-object": ("hidden_size", {"hidden_size": {}}),
          "layers-fraction": ("num_hidden_layers", {"num_hidden_layers": 2.5}),
          "rope-text": ("rope_theta", {"rope_theta": "big"}),
          "positions-text": ("max_position_embeddings", {"max_position_embeddings": "long"})}

# (case id, argv, fragment of the one error line: the field it names)
CLI_CASES = [
    # arch
    ("describe-no-arch", ["arch", "describe"], "architecture"),
    ("describe-unknown-preset", ["arch", "describe", "--preset", "nope"], "preset"),
    ("describe-zero-heads", ["arch", "describe", "--layers", "2", "--hidden-size", "128", "--heads", "0",
                             "--ffn", "256"], "heads"),
    ("describe-neg-layers", ["arch", "describe", "--layers", "-2", "--hidden-size", "128", "--heads", "4",
                             "--ffn", "256"], "layers"),
    ("describe-arch-dir-empty", ["arch", "describe", "--arch", "{d}/adir"], "adir"),
    ("describe-arch-broken-json", ["arch", "describe", "--arch", "{d}/broken.json"], "broken.json"),
    ("describe-arch-list-json", ["arch", "describe", "--arch", "{d}/list.json"], "list.json"),
    ("describe-two-sources", ["arch", "describe", "--preset", "tiny", *ARCH], "--preset"),
    ("describe-layers-text", ["arch", "describe", "--layers", "two"], "--layers"),
    ("build-params-inf", [*BUILD[:3], "inf", *BUILD[4:]], "--params"),
    ("build-params-nan", [*BUILD[:3], "nan", *BUILD[4:]], "--params"),
    ("build-params-huge", [*BUILD[:3], "1e30", *BUILD[4:]], "--params"),
    ("build-params-neg", [*BUILD[:3], "-1e6", *BUILD[4:]], "--params"),
    ("build-params-zero", [*BUILD[:3], "0", *BUILD[4:]], "--params"),
    ("build-params-tiny", [*BUILD[:3], "10", *BUILD[4:]], "params"),
    ("build-params-text", [*BUILD[:3], "lots", *BUILD[4:]], "--params"),
    ("build-layers-zero", [*BUILD[:5], "0", *BUILD[6:]], "--layers"),
    ("build-layers-huge", [*BUILD[:5], "100000000", *BUILD[6:]], "--layers"),
    ("build-ratio-inf", [*BUILD[:-1], "inf"], "--mlp-to-attn"),
    ("build-ratio-neg", [*BUILD[:-1], "-2"], "--mlp-to-attn"),
    ("build-x1-nan", [*BUILD[:7], "nan", *BUILD[8:]], "--hidden-over-sqrt-n"),
    ("build-x1-zero", [*BUILD[:7], "0", *BUILD[8:]], "--hidden-over-sqrt-n"),
    ("build-gqa-zero", [*BUILD, "--gqa", "0"], "--gqa"),
    ("build-head-dim-neg", [*BUILD, "--head-dim", "-64"], "--head-dim"),
    ("build-vocab-zero", [*BUILD, "--vocab-size", "0"], "--vocab-size"),
    ("build-multiple-zero", [*BUILD, "--hidden-multiple", "0"], "--hidden-multiple"),
    ("build-tolerance-neg", [*BUILD, "--tolerance", "-0.1"], "--tolerance"),
    ("build-out-is-file", [*BUILD, "--out", "{d}/afile.txt"], "--out"),
    ("build-out-under-file", [*BUILD, "--out", "{d}/afile.txt/sub"], "--out"),
    ("build-unknown-flag", [*BUILD, "--frobnicate", "3"], "unrecognized"),
    ("build-ambiguous-flag", [*BUILD, "--hidden", "3"], "--hidden"),
    ("arch-no-subcommand-typo", ["arch", "buidl"], "invalid choice"),
    # fit / validate
    ("fit-data-missing", [*FIT[:2], "{d}/nope.csv", *FIT[3:], "--out", "{d}/new.json"], "--data"),
    ("fit-data-dir", [*FIT[:2], "{d}/adir", *FIT[3:], "--out", "{d}/new.json"], "--data"),
    ("fit-data-empty", [*FIT[:2], "{d}/empty.csv", *FIT[3:], "--out", "{d}/new.json"], "data"),
    ("fit-data-txt", [*FIT[:2], "{d}/afile.txt", *FIT[3:], "--out", "{d}/new.json"], "--data"),
    ("fit-jsonl-scalar-line", [*FIT[:2], "{d}/scalar.jsonl", *FIT[3:], "--out", "{d}/new.json"],
     "scalar.jsonl"),
    ("fit-jsonl-broken-line", [*FIT[:2], "{d}/broken.jsonl", *FIT[3:], "--out", "{d}/new.json"],
     "broken.jsonl"),
    ("fit-csv-nan-loss", [*FIT[:2], "{d}/nanloss.csv", *FIT[3:], "--out", "{d}/new.json"], "loss"),
    ("fit-out-dir", [*FIT, "--out", "{d}/adir"], "--out"),
    ("fit-out-under-file", [*FIT, "--out", "{d}/afile.txt/law.json"], "--out"),
    ("fit-plots-file", [*FIT, "--out", "{d}/new.json", "--plots", "{d}/afile.txt"], "--plots"),
    ("fit-starts-zero", [*FIT, "--out", "{d}/new.json", "--starts", "0"], "--starts"),
    ("fit-bootstrap-neg", [*FIT, "--out", "{d}/new.json", "--bootstrap", "-1"], "--bootstrap"),
    ("fit-bootstrap-huge", [*FIT, "--out", "{d}/new.json", "--bootstrap", "1000000000"], "--bootstrap"),
    ("fit-jobs-zero", [*FIT, "--out", "{d}/new.json", "--jobs", "0"], "--jobs"),
    ("fit-huber-nan", [*FIT, "--out", "{d}/new.json", "--huber-delta", "nan"], "--huber-delta"),
    ("fit-huber-neg", [*FIT, "--out", "{d}/new.json", "--huber-delta", "-1"], "--huber-delta"),
    ("fit-r-range-reversed", [*FIT[:-1], "--out", "{d}/new.json", "--r-range", "5", "0.5"], "r_range"),
    ("fit-size-tol-neg", [*FIT, "--out", "{d}/new.json", "--size-tolerance", "-1"], "size_tolerance"),
    ("fit-reference-law-missing", [*FIT, "--out", "{d}/new.json", "--reference-law", "{d}/nope.json"],
     "nope.json"),
    ("fit-law-unknown", [*FIT[:4], "kaplan", *FIT[5:], "--out", "{d}/new.json"], "--law"),
    ("validate-out-dir", [*VALIDATE, "--out", "{d}/adir"], "--out"),
    ("validate-out-under-file", [*VALIDATE, "--out", "{d}/afile.txt/t.csv"], "--out"),
    ("validate-data-dir", ["validate", "--data", "{d}/adir", "--law", "chinchilla"], "--data"),
    # solve
    ("solve-law-missing", [*SOLVE[:2], "{d}/nope.json", *SOLVE[3:]], "nope.json"),
    ("solve-law-dir", [*SOLVE[:2], "{d}/adir", *SOLVE[3:]], "adir"),
    ("solve-law-broken", [*SOLVE[:2], "{d}/broken.json", *SOLVE[3:]], "broken.json"),
    ("solve-law-list", [*SOLVE[:2], "{d}/list.json", *SOLVE[3:]], "list.json"),
    ("solve-law-unknown-form", [*SOLVE[:2], "{d}/badform.json", *SOLVE[3:]], "badform.json"),
    ("solve-params-huge", [*SOLVE[:4], "1e30", *SOLVE[5:]], "--params"),
    ("solve-params-inf", [*SOLVE[:4], "inf", *SOLVE[5:]], "--params"),
    ("solve-params-neg", [*SOLVE[:4], "-5", *SOLVE[5:]], "--params"),
    ("solve-tokens-nan", [*SOLVE[:6], "nan", *SOLVE[7:]], "--tokens"),
    ("solve-tokens-zero", [*SOLVE[:6], "0", *SOLVE[7:]], "--tokens"),
    ("solve-layers-zero", [*SOLVE[:8], "0"], "--layers"),
    ("solve-layers-neg", [*SOLVE[:8], "-3"], "--layers"),
    ("solve-level-2", [*SOLVE, "--level", "2"], "--level"),
    ("solve-level-nan", [*SOLVE, "--level", "nan"], "--level"),
    ("solve-gqa-zero", [*SOLVE, "--gqa", "0"], "--gqa"),
    ("solve-target-neg", [*SOLVE, "--target-loss", "-1"], "--target-loss"),
    ("solve-tolerance-neg", [*SOLVE, "--tolerance", "-1"], "--tolerance"),
    ("solve-tp-missing", [*SOLVE, "--throughput", "{d}/nope.jsonl"], "--throughput"),
    ("solve-tp-broken-line", [*SOLVE, "--throughput", "{d}/broken.jsonl"], "--throughput"),
    ("solve-tp-scalar-line", [*SOLVE, "--throughput", "{d}/scalar.jsonl"], "--throughput"),
    ("solve-tp-nan", [*SOLVE, "--throughput", "{d}/nantp.jsonl"], "--throughput"),
    ("solve-tp-neg", [*SOLVE, "--throughput", "{d}/negtp.jsonl"], "--throughput"),
    ("solve-tp-dir", [*SOLVE, "--throughput", "{d}/adir"], "--throughput"),
    # bench
    ("bench-batch-zero", [*BENCH[:-1], "0"], "batch"),
    ("bench-batch-huge", ["bench", "--backend", "hf", *ARCH, "--batch-sizes", "100000000"], "batch"),
    ("bench-batch-text", [*BENCH[:-1], "a,b"], "--batch-sizes"),
    ("bench-input-neg", [*BENCH, "--input-len", "-1"], "input_len"),
    ("bench-input-huge", ["bench", "--backend", "vllm", *ARCH, "--input-len", "10000000000"], "input_len"),
    ("bench-output-zero", [*BENCH, "--output-len", "0"], "output_len"),
    ("bench-repeats-zero", [*BENCH, "--repeats", "0"], "repeats"),
    ("bench-timeout-neg", [*BENCH, "--timeout", "-5"], "timeout"),
    ("bench-timeout-nan", [*BENCH, "--timeout", "nan"], "--timeout"),
    ("bench-engine-arg-bad", [*BENCH, "--engine-arg", "novalue"], "--engine-arg"),
    ("bench-device-unknown", [*BENCH, "--device-spec", "Z9000"], "device"),
    ("bench-out-dir", [*BENCH, "--out", "{d}/adir"], "--out"),
    ("bench-log-dir", [*BENCH, "--log", "{d}/adir"], "--log"),
    ("bench-out-under-file", [*BENCH, "--out", "{d}/afile.txt/r.jsonl"], "--out"),
    ("bench-model-path-missing", ["bench", "--backend", "hf", "--model-path", "{d}/nope"], "--model-path"),
    # train / sweep
    ("train-tokens-huge", [*TRAIN_CMD, "--tokens", "1e15"], "tokens"),
    ("train-tokens-neg", [*TRAIN_CMD, "--tokens", "-1"], "tokens"),
    ("train-tokens-nan", [*TRAIN_CMD, "--tokens", "nan"], "--tokens"),
    ("train-lr-huge", [*TRAIN_CMD, "--lr", "1e300"], "lr"),
    ("train-lr-inf", [*TRAIN_CMD, "--lr", "inf"], "--lr"),
    ("train-batch-zero", [*TRAIN_CMD, "--global-batch-size", "0"], "global_batch_size"),
    ("train-micro-not-divisor", [*TRAIN_CMD, "--micro-batch-size", "3"], "micro_batch_size"),
    ("train-seq-len-one", [*TRAIN_CMD, "--seq-len", "1"], "seq_len"),
    ("train-seq-len-huge", [*TRAIN_CMD, "--seq-len", "1000000000"], "seq_len"),
    ("train-hparams-unknown", [*TRAIN_CMD, "--hparams", "7t"], "hparams"),
    ("train-data-missing", [*TRAIN_CMD, "--data", "{d}/nope.txt"], "data"),
    ("train-config-missing", [*TRAIN_CMD[:-1], "{d}/nope.yaml"], "--config"),
    ("train-config-broken", [*TRAIN_CMD[:-1], "{d}/broken.yaml"], "broken.yaml"),
    ("train-config-scalar-section", [*TRAIN_CMD[:-1], "{d}/train-scalar.yaml"], "train"),
    ("train-config-unknown-section", [*TRAIN_CMD[:-1], "{d}/train-unknown.yaml"], "unknown section"),
    ("train-out-file", [*TRAIN_CMD, "--out", "{d}/afile.txt"], "--out"),
    ("train-run-without-launch", [*TRAIN_CMD, "--run"], "--run"),
    ("train-launch-no-out", [*TRAIN_CMD, "--launch", "--num-processes", "2"], "--out"),
    ("sweep-config-missing", ["sweep", "--config", "{d}/nope.yaml"], "--config"),
    ("sweep-config-dir", ["sweep", "--config", "{d}/adir"], "--config"),
    ("sweep-config-empty", ["sweep", "--config", "{d}/empty.yaml"], "empty.yaml"),
    ("sweep-out-file", ["sweep", "--config", "{d}/sweep.yaml", "--out", "{d}/afile.txt"], "--out"),
    # search
    ("search-config-missing", ["search", "--config", "{d}/nope.yaml"], "--config"),
    ("search-config-broken", ["search", "--config", "{d}/broken.yaml"], "broken.yaml"),
    ("search-config-list", ["search", "--config", "{d}/list.yaml"], "list.yaml"),
    ("search-out-file", ["search", "--config", "{d}/study.yaml", "--out", "{d}/afile.txt"], "--out"),
    ("search-stage-unknown", ["search", "--config", "{d}/study.yaml", "--only", "train,cook"], "--only"),
    ("search-gpus-bad", ["search", "--config", "{d}/study.yaml", "--dry-run", "--gpus", "8xZ9"], "gpus"),
    ("search-profile-missing", ["search", "--config", "{d}/study.yaml", "--dry-run", "--profile", "{d}/nope.json"],
     "no such file"),
    ("search-profile-broken", ["search", "--config", "{d}/study.yaml", "--dry-run", "--profile", "{d}/broken.yaml"],
     "not JSON"),
    ("search-profile-not-one", ["search", "--config", "{d}/study.yaml", "--dry-run", "--profile", "{d}/law.json"],
     "not a machine profile"),
    ("profile-study-without-record", ["profile", "--study", "{d}", "--out", "{d}/p.json"], "startups.json"),
    ("profile-out-folder", ["profile", "--study", "{d}", "--out", "{d}"], "--out"),
    # eval / estimate
    ("eval-model-missing", ["eval", "--model", "{d}/nope"], "--model"),
    ("eval-no-model", ["eval"], "--model"),
    ("eval-limit-neg", ["eval", "--model", "smollm2-135m", "--limit", "-3"], "--limit"),
    ("eval-batch-zero", ["eval", "--model", "smollm2-135m", "--batch-size", "0"], "--batch-size"),
    ("eval-out-dir", ["eval", "--model", "smollm2-135m", "--out", "{d}/adir"], "--out"),
    ("eval-task-unknown", ["eval", "--model", "{d}/adir", "--tasks", "no_such_task_xyz"], "--model"),
    ("estimate-tokens-neg", [*EST[:-1], "-1"], "--tokens"),
    ("estimate-tokens-inf", [*EST[:-1], "inf"], "--tokens"),
    ("estimate-gpus-bad", [*EST, "--gpus", "0xH100"], "gpus"),
    ("estimate-gpus-unknown", [*EST, "--gpus", "8xZ9000"], "gpus"),
    ("estimate-mfu-2", [*EST, "--mfu", "2"], "mfu"),
    ("estimate-mfu-nan", [*EST, "--mfu", "nan"], "--mfu"),
    ("estimate-tp-zero", [*EST, "--tp", "0"], "tp"),
    ("estimate-price-neg", [*EST, "--price", "-1"], "price"),
    ("estimate-arch-missing", ["estimate", "--arch", "{d}/nope", "--tokens", "1e9"], "arch"),
    ("estimate-law-missing", [*EST, "--law", "{d}/nope.json"], "nope.json"),
    ("estimate-fit-out-dir", ["estimate", "fit", "--data", "{d}/runs.csv", "--out", "{d}/adir"], "--out"),
    ("estimate-memory-batch-zero", [*MEM, "--batch", "0"], "batch"),
    ("estimate-memory-tp-zero", [*MEM, "--tp", "0"], "tp"),
    ("top-unknown-command", ["frobnicate"], "invalid choice"),
    # KEY=VALUE overrides of a --config file (search, sweep, train)
    ("override-unknown-key", ["search", "--config", "{d}/study.yaml", "n_layer=3"], "n_layer"),
    ("override-no-equals", ["search", "--config", "{d}/study.yaml", "optuna.n_trials"], "optuna.n_trials"),
    ("override-bad-type", ["search", "--config", "{d}/study.yaml", "optuna.n_trials=many"], "optuna.n_trials"),
    ("override-nan", ["search", "--config", "{d}/study.yaml", "params=nan"], "params"),
    ("override-into-scalar", ["search", "--config", "{d}/study.yaml", "params.x=3"], "params"),
    ("override-sweep-neg", ["sweep", "--config", "{d}/sweep.yaml", "params=[-1]"], "params"),
    ("override-train-lr-inf", [*TRAIN_CMD, "train.lr=inf"], "train.lr"),
    # files named by newer flags
    ("bench-calibration-missing", [*BENCH, "--calibration", "{d}/nope.json"], "calibration"),
    ("bench-calibration-dir", [*BENCH, "--calibration", "{d}/adir"], "calibration"),
    ("bench-calibration-broken", [*BENCH, "--calibration", "{d}/broken.json"], "calibration"),
    ("bench-calibration-list", [*BENCH, "--calibration", "{d}/list.json"], "calibration"),
    ("estimate-batch-laws-missing", [*EST, "--batch-laws", "{d}/nope.json"], "batch"),
    # plan (limits: negative, NaN, unsatisfiable before any measurement)
    ("plan-tpot-negative", [*PLAN, "--max-tpot-s", "-1"], "--max-tpot-s"),
    ("plan-ttft-nan", [*PLAN, "--max-ttft-s", "nan"], "--max-ttft-s"),
    ("plan-memory-zero", [*PLAN, "--max-peak-memory-gib", "0"], "--max-peak-memory-gib"),
    ("plan-memory-unsatisfiable", [*PLAN, "--max-peak-memory-gib", "1e-9"], "weights alone take"),
    ("plan-finetune-unsatisfiable", [*PLAN, "--max-finetune-hours", "1e-12"], "fastest predicted"),
    ("plan-finetune-hours-inf", [*PLAN, "--max-finetune-hours", "inf"], "--max-finetune-hours"),
    ("plan-backend-analytic", ["plan", "--candidates", "tiny", "--out", "{d}/po", "--backend", "analytic"], "--backend"),
    ("plan-candidate-missing", ["plan", "--candidates", "{d}/nope", "--out", "{d}/po"], "--candidates"),
    ("plan-lora-target-unknown", [*PLAN, "--lora-targets", "lm_head"], "lora.targets"),
    ("plan-decode-one", [*PLAN, "--decode-lens", "1"], "decode_lens"),
    ("plan-torch-threads-vllm", [*PLAN, "--backend", "vllm", "--torch-threads", "1"], "--torch-threads"),
    ("plan-lora-calibration-missing", [*PLAN, "--lora-calibration", "{d}/nope.json"], "--lora-calibration"),
    ("plan-calibrate-lora-other-device", [*PLAN, "--calibrate-lora", "--finetune-device", "H100"], "--calibrate-lora"),
    ("plan-calibrate-lora-and-mfu", [*PLAN, "--calibrate-lora", "--mfu", "0.3"], "--mfu"),
    ("train-lora-targets-alone", ["train", *ARCH, "--tokens", "1e4", "--lora-targets", "q_proj"], "--lora-targets"),
    ("train-lora-rank-zero", ["train", *ARCH, "--tokens", "1e4", "--lora-rank", "0"], "--lora-rank"),
    ("train-init-from-missing", ["train", "--init-from", "{d}/nope", "--tokens", "1e4"], "nope"),
    ("estimate-batch-laws-broken", [*EST, "--batch-laws", "{d}/broken.json"], "batch"),
    ("batch-laws-data-missing", ["estimate", "batch-laws", "--data", "{d}/nope.jsonl", "--out", "{d}/l.json"],
     "nope.jsonl"),
    ("batch-laws-data-broken", ["estimate", "batch-laws", "--data", "{d}/broken.jsonl", "--out", "{d}/l.json"],
     "broken.jsonl"),
    ("batch-laws-data-empty", ["estimate", "batch-laws", "--data", "{d}/empty.csv", "--out", "{d}/l.json"],
     "empty.csv"),
    ("batch-laws-data-dir", ["estimate", "batch-laws", "--data", "{d}/adir", "--out", "{d}/l.json"], "adir"),
    ("batch-laws-out-dir", ["estimate", "batch-laws", "--data", "{d}/scalar.jsonl", "--out", "{d}/adir"], "--out"),
    ("eval-model-args-bad", ["eval", "--model", "smollm2-135m", "--model_args", "novalue"], "model_args"),
    ("eval-fewshot-neg", ["eval", "--model", "smollm2-135m", "--num_fewshot", "-1"], "num_fewshot"),
    # files that are not UTF-8 text (binary, UTF-16, Latin-1), wherever a file is read
    ("search-config-binary", ["search", "--config", "{d}/bin.yaml"], "bin.yaml"),
    ("search-config-utf16", ["search", "--config", "{d}/u16.yaml"], "u16.yaml"),
    ("sweep-config-latin1", ["sweep", "--config", "{d}/latin1.yaml"], "latin1.yaml"),
    ("train-config-binary", [*TRAIN_CMD[:-1], "{d}/bin.yaml"], "bin.yaml"),
    ("solve-law-utf16", [*SOLVE[:2], "{d}/u16.json", *SOLVE[3:]], "u16.json"),
    ("solve-law-binary", [*SOLVE[:2], "{d}/bin.json", *SOLVE[3:]], "bin.json"),
    ("fit-data-utf16", [*FIT[:2], "{d}/u16.csv", *FIT[3:], "--out", "{d}/new.json"], "u16.csv"),
    ("validate-data-binary", ["validate", "--data", "{d}/bin.jsonl", "--law", "chinchilla"], "bin.jsonl"),
    ("solve-tp-binary", [*SOLVE, "--throughput", "{d}/bin.jsonl"], "--throughput"),
    ("fit-reference-law-utf16", [*FIT, "--out", "{d}/new.json", "--reference-law", "{d}/u16.json"], "u16.json"),
    ("estimate-batch-laws-binary", [*EST, "--batch-laws", "{d}/bin.json"], "--batch-laws"),
    ("batch-laws-data-binary", ["estimate", "batch-laws", "--data", "{d}/bin.jsonl", "--out", "{d}/l.json"],
     "bin.jsonl"),
    ("describe-hf-config-utf16", ["arch", "describe", "--arch", "{d}/u16dir"], "config.json"),
    ("describe-arch-binary", ["arch", "describe", "--arch", "{d}/bin.json"], "bin.json"),
    ("bench-calibration-utf16", [*BENCH, "--calibration", "{d}/u16.json"], "calibration"),
    ("plan-lora-calibration-binary", [*PLAN, "--lora-calibration", "{d}/bin.json"], "--lora-calibration"),
    ("search-profile-binary", ["search", "--config", "{d}/study.yaml", "--dry-run", "--profile", "{d}/bin.json"],
     "profile"),
    ("search-time-law-binary", ["search", "--config", "{d}/study.yaml", "--dry-run", "--gpus", "8xH100",
                                "--time-law", "{d}/bin.json"], "--time-law"),
    ("search-time-law-not-one", ["search", "--config", "{d}/study.yaml", "--dry-run", "--gpus", "8xH100",
                                 "--time-law", "{d}/list.json"], "--time-law"),
    ("search-time-law-without-gpus", ["search", "--config", "{d}/study.yaml", "--dry-run", "--time-law",
                                      "{d}/law.json"], "--time-law"),
    ("override-unclosed-bracket", ["search", "--config", "{d}/study.yaml", "optuna.n_trials=["], "optuna.n_trials"),
    ("override-unclosed-brace", ["sweep", "--config", "{d}/sweep.yaml", "train={lr: 1"], "train"),
    ("eval-limit-nan", ["eval", "--model", "smollm2-135m", "--limit", "nan"], "--limit"),
    ("eval-limit-inf", ["eval", "--model", "smollm2-135m", "--limit", "inf"], "--limit"),
    ("eval-device-unknown", ["eval", "--model", "smollm2-135m", "--device", "tpu9"], "--device"),
    ("eval-device-absent", ["eval", "--model", "smollm2-135m", "--device", "cuda:99"], "--device"),
    # counts bounded by the machine or the method
    ("fit-starts-huge", [*FIT, "--out", "{d}/new.json", "--starts", "100000"], "--starts"),
    ("fit-jobs-huge", [*FIT, "--out", "{d}/new.json", "--jobs", "100000"], "--jobs"),
    ("train-cpu-threads-huge", [*TRAIN_CMD, "--cpu-threads", "100000"], "--cpu-threads"),
    ("train-layers-huge", ["train", "--layers", "100000", *ARCH[2:], "--vocab-size", "2048", "--config",
                           "{d}/train.yaml"], "layers"),
    ("describe-hidden-huge", ["arch", "describe", "--layers", "2", "--hidden-size", "100000000", "--heads", "4",
                              "--ffn", "256"], "hidden_size"),
    # silent wrong results, refused
    ("estimate-tokens-absurd", [*EST[:-1], "1e30"], "tokens"),
    ("solve-tp-duplicate-shape", [*SOLVE, "--throughput", "{d}/duptp.jsonl"], "--throughput"),
    ("fit-mixed-loss-kinds", [*FIT[:2], "{d}/mixed.csv", *FIT[3:], "--out", "{d}/new.json"], "loss_kind"),
    ("validate-mixed-loss-kinds", ["validate", "--data", "{d}/mixed.csv", "--law", "chinchilla"], "loss_kind"),
    ("fit-tokens-absurd", [*FIT[:2], "{d}/hugetokens.csv", *FIT[3:], "--out", "{d}/new.json"], "tokens"),
    ("solve-law-negative-factor", [*SOLVE[:2], "{d}/neglaw.json", *SOLVE[3:]], "coefficients"),
    ("solve-law-overflow", [*SOLVE[:2], "{d}/biglaw.json", *SOLVE[3:]], "coefficients"),
    ("fit-reference-law-negative-exponent", [*FIT, "--out", "{d}/new.json", "--reference-law", "{d}/negexp.json"],
     "alpha"),
    # remote code only where the project runs it (nowhere)
    ("bench-trust-remote-code", [*BENCH, "--engine-arg", "trust_remote_code=true"], "trust_remote_code"),
    # a run folder holding another run
    ("train-out-other-run", [*TRAIN_CMD, "--out", "{d}/otherrun"], "--out"),
    # an HF config.json read by type: every command that reads --arch DIR names the key
    *[(f"{cmd}-hf-{case}", [*argv[:i], "{d}/hf-" + case, *argv[i:]], key)
      for case, (key, _) in HF_BAD.items()
      for cmd, argv, i in (("describe", ["arch", "describe", "--arch"], 3),
                           ("estimate", ["estimate", "--tokens", "1e9", "--arch"], 5),
                           ("bench", [*BENCH[:3], "--batch-sizes", "1", "--arch"], 6),
                           ("train", ["train", "--config", "{d}/train.yaml", "--arch"], 4))],
    # bench records read by type
    ("calibrate-results-list-line", ["calibrate", "--results", "{d}/rec-list.jsonl", "--out", "{d}/c.json"],
     "rec-list.jsonl"),
    ("calibrate-results-scalar-line", ["calibrate", "--results", "{d}/rec-scalar.jsonl", "--out", "{d}/c.json"],
     "rec-scalar.jsonl"),
    ("calibrate-results-bare-object", ["calibrate", "--results", "{d}/rec-bare.jsonl", "--out", "{d}/c.json"],
     "backend"),
    ("calibrate-results-bad-batch", ["calibrate", "--results", "{d}/rec-batch.jsonl", "--out", "{d}/c.json"],
     "per_batch"),
    # YAML read within limits: duplicate keys (top level and nested), alias bombs, depth, huge integers
    ("search-yaml-duplicate-key", ["search", "--config", "{d}/dup.yaml"], "params"),
    ("search-yaml-duplicate-nested", ["search", "--config", "{d}/dup-nested.yaml"], "bootstrap"),
    ("search-yaml-alias-bomb", ["search", "--config", "{d}/bomb.yaml", "--print-config"], "aliases"),
    ("sweep-yaml-alias-bomb", ["sweep", "--config", "{d}/bomb.yaml"], "aliases"),
    ("search-yaml-recursive-alias", ["search", "--config", "{d}/recursive.yaml", "--print-config"], "alias"),
    ("search-yaml-huge-int", ["search", "--config", "{d}/bigint.yaml"], "digits"),
    ("search-yaml-deep", ["search", "--config", "{d}/deep.yaml"], "nested"),
    ("train-yaml-duplicate-key", [*TRAIN_CMD[:-1], "{d}/dup.yaml"], "params"),
    ("override-list-index", ["search", "--config", "{d}/study.yaml", "search_space.gqa.0=4"], "search_space.gqa"),
    # engine and model arguments normalised before the remote-code check
    ("bench-trust-remote-code-upper", [*BENCH, "--engine-arg", "TRUST_REMOTE_CODE=true"], "trust_remote_code"),
    ("bench-trust-remote-code-dashes", [*BENCH, "--engine-arg", "trust-remote-code=1"], "trust_remote_code"),
    ("bench-engine-arg-two-spellings", [*BENCH, "--engine-arg", "max-model-len=8", "--engine-arg",
                                        "max_model_len=9"], "max_model_len"),
    # one path check for every output path: empty, a name or a whole path over the system's limits
    ("train-out-empty", [*TRAIN_CMD, "--out", ""], "--out"),
    ("search-out-empty", ["search", "--config", "{d}/study.yaml", "--out", ""], "--out"),
    ("sweep-out-empty", ["sweep", "--config", "{d}/sweep.yaml", "--out", ""], "--out"),
    ("calibrate-out-empty", ["calibrate", "--results", "{d}/rec-list.jsonl", "--out", ""], "--out"),
    ("train-out-name-too-long", [*TRAIN_CMD, "--out", "{d}/" + "n" * 300], "--out"),
    ("bench-out-name-too-long", [*BENCH, "--out", "{d}/" + "n" * 300 + ".jsonl"], "--out"),
    ("plan-out-name-too-long", [*PLAN[:-1], "{d}/" + "n" * 256], "--out"),
    ("fit-out-path-too-long", [*FIT, "--out", "{d}/" + "/".join(["p" * 200] * 25) + "/law.json"], "--out"),
    ("search-out-path-too-long", ["search", "--config", "{d}/study.yaml", "--out", "{d}/" + "/".join(["p" * 250] * 20)],
     "--out"),
    # a study folder whose lock paths are of the wrong kind: refused before anything is written
    ("search-stage-lock-is-folder", ["search", "--config", "{d}/study.yaml", "--out", "{d}/lock-folder"], ".stage.lock"),
    ("search-locks-folder-is-file", ["search", "--config", "{d}/study.yaml", "--out", "{d}/locks-file"], "locks"),
    ("search-store-lock-is-folder", ["search", "--config", "{d}/study.yaml", "--out", "{d}/store-lock-folder"],
     "measurements.lock"),
    # counts bounded by what a run can do, the bound and its reason stated
    ("plan-repeats-huge", [*PLAN, "--repeats", "1000000000"], "repeats"),
    ("plan-warmup-huge", [*PLAN, "--warmup", "1000000000"], "warmup"),
    ("bench-repeats-huge", [*BENCH, "--repeats", "100000000"], "repeats"),
    ("bench-warmup-huge", [*BENCH, "--warmup", "1000000000"], "warmup"),
    ("eval-bootstrap-huge", ["eval", "--model", "smollm2-135m", "--bootstrap_iters", "1000000000000"],
     "bootstrap_iters"),
    ("estimate-gpus-huge", [*EST, "--gpus", "100000000xH100"], "gpus"),
    ("estimate-seq-len-beyond-positions", [*EST, "--seq-len", "1000000000"], "--seq-len"),
    ("estimate-memory-seq-len-beyond-positions", [*MEM, "--seq-len", "1000000000"], "--seq-len"),
    ("estimate-lora-rank-huge", [*EST, "--finetune", "lora", "--lora-rank", "1000000000"], "lora.rank"),
    ("train-launch-beyond-machine", [*TRAIN_CMD, "--launch", "--run", "--num-processes", "100000", "--out", "{d}/tl"],
     "--num-processes"),
    # data that would silently mix: refused, naming what the fit assumes
    ("train-data-latin1", [*TRAIN_CMD, "--data", "{d}/latin1.txt"], "latin1.txt"),
    ("fit-duplicate-row", [*FIT[:2], "{d}/duprow.csv", *FIT[3:], "--out", "{d}/new.json"], "repeats run"),
    ("fit-duplicate-column", [*FIT[:2], "{d}/dupcol.csv", *FIT[3:], "--out", "{d}/new.json"], "columns"),
    ("fit-jsonl-duplicate-key", [*FIT[:2], "{d}/dupkey.jsonl", *FIT[3:], "--out", "{d}/new.json"], "dupkey.jsonl"),
    ("fit-mixed-vocab", [*FIT[:2], "{d}/mixvocab.csv", *FIT[3:], "--out", "{d}/new.json"], "vocab_size"),
    ("validate-duplicate-row", ["validate", "--data", "{d}/duprow.csv", "--law", "chinchilla"], "repeats run"),
    ("calibrate-table-conflicting-rows", ["calibrate", "--table", "{d}/conflict.csv", "--out", "{d}/c.json"],
     "conflict.csv"),
    # a training run resumed with other settings, or from a damaged checkpoint
    ("train-resume-other-lr", [*TRAIN_CMD, "--out", "{d}/halfrun"], "train.lr"),
    ("train-resume-other-seq-len", [*TRAIN_CMD, "--lr", "0.001", "--seq-len", "32", "--out", "{d}/halfrun"],
     "data.seq_len"),
    ("train-resume-torn-weights", [*TRAIN_CMD, "--out", "{d}/tornrun"], "model.safetensors"),
    # held-out probes of each class (second round): other HF files, records, YAML forms, overrides,
    # resumed settings, counts, paths, corpora and spellings
    ("describe-hf-config-list", ["arch", "describe", "--arch", "{d}/hf-list"], "config.json"),
    ("describe-hf-config-null", ["arch", "describe", "--arch", "{d}/hf-null"], "config.json"),
    ("calibrate-results-null-line", ["calibrate", "--results", "{d}/rec-null.jsonl", "--out", "{d}/c.json"],
     "rec-null.jsonl"),
    ("calibrate-results-per-batch-text", ["calibrate", "--results", "{d}/rec-pb-str.jsonl", "--out", "{d}/c.json"],
     "per_batch"),
    ("calibrate-results-arch-list", ["calibrate", "--results", "{d}/rec-arch-list.jsonl", "--out", "{d}/c.json"],
     "architecture"),
    ("sweep-yaml-duplicate-key", ["sweep", "--config", "{d}/dup-sweep.yaml"], "n_layers"),
    ("search-yaml-python-tag", ["search", "--config", "{d}/tag.yaml"], "tag.yaml"),
    ("search-yaml-complex-key", ["search", "--config", "{d}/complexkey.yaml"], "complexkey.yaml"),
    ("search-yaml-number-key", ["search", "--config", "{d}/intkey.yaml"], "1"),
    ("search-yaml-tab-indent", ["search", "--config", "{d}/tabs.yaml"], "tabs.yaml"),
    ("search-yaml-deep-mapping", ["search", "--config", "{d}/deepmap.yaml"], "nested"),
    ("search-yaml-huge-negative-int", ["search", "--config", "{d}/bigint-neg.yaml"], "digits"),
    ("search-yaml-float-overflow", ["search", "--config", "{d}/bigfloat.yaml"], "tokens"),
    ("override-bracket-index", ["search", "--config", "{d}/study.yaml", "search_space.gqa[0]=4"], "search_space.gqa"),
    ("override-negative-index", ["search", "--config", "{d}/study.yaml", "search_space.gqa.-1=4"], "search_space.gqa"),
    ("override-empty-key", ["search", "--config", "{d}/study.yaml", "=3"], "="),
    ("override-alias", ["search", "--config", "{d}/study.yaml", "name=&a [*a]"], "name"),
    ("train-resume-other-batch", [*TRAIN_CMD, "--lr", "0.001", "--global-batch-size", "16", "--out", "{d}/halfrun"],
     "global_batch_size"),
    ("train-resume-other-tokens", [*TRAIN_CMD, "--lr", "0.001", "--tokens", "40000", "--out", "{d}/halfrun"],
     "token budget"),
    ("train-resume-other-shape", ["train", "--layers", "2", "--hidden-size", "256", "--heads", "4", "--kv-heads", "2",
                                  "--ffn", "256", "--vocab-size", "2048", "--config", "{d}/train.yaml", "--lr", "0.001",
                                  "--out", "{d}/halfrun"], "hidden"),
    ("estimate-tp-huge", [*EST, "--tp", "100000000"], "tp"),
    ("bench-batch-sizes-too-many", [*BENCH[:-1], ",".join(map(str, range(1, 201)))], "batch_sizes"),
    ("eval-fewshot-huge", ["eval", "--model", "smollm2-135m", "--num_fewshot", "100000000"], "num_fewshot"),
    ("fit-bootstrap-huge-float", [*FIT, "--out", "{d}/new.json", "--bootstrap", "1e9"], "bootstrap"),
    ("train-eval-batches-huge", [*TRAIN_CMD, "train.eval_batches=1000000000000"], "eval_batches"),
    ("train-log-interval-zero", [*TRAIN_CMD, "train.log_interval=0"], "log_interval"),
    ("search-gpus-huge", ["search", "--config", "{d}/study.yaml", "--dry-run", "--gpus", "100000000xH100"], "gpus"),
    ("train-num-processes-zero", [*TRAIN_CMD, "--launch", "--num-processes", "0", "--out", "{d}/tl"], "num-processes"),
    ("train-out-nul", [*TRAIN_CMD, "--out", "{d}/a\x00b"], "--out"),
    ("bench-out-nul", [*BENCH, "--out", "{d}/a\x00b.jsonl"], "--out"),
    ("search-out-newline", ["search", "--config", "{d}/study.yaml", "--out", "\n"], "--out"),
    ("search-out-spaces", ["search", "--config", "{d}/study.yaml", "--out", "   "], "--out"),
    ("train-out-dangling-link", [*TRAIN_CMD, "--out", "{d}/dangling"], "--out"),
    ("train-out-link-to-file", [*TRAIN_CMD, "--out", "{d}/tofile"], "--out"),
    ("fit-out-fifo", [*FIT, "--out", "{d}/fifo"], "--out"),
    ("bench-out-fifo", [*BENCH, "--out", "{d}/fifo"], "--out"),
    ("search-config-nul", ["search", "--config", "{d}/a\x00b.yaml"], "--config"),
    ("fit-data-nul", [*FIT[:2], "{d}/x\x00.csv", *FIT[3:], "--out", "{d}/new.json"], "--data"),
    ("train-data-nul-bytes", [*TRAIN_CMD, "--data", "{d}/nul.txt"], "nul.txt"),
    ("train-data-utf16", [*TRAIN_CMD, "--data", "{d}/u16.txt"], "u16.txt"),
    ("bench-trust-remote-code-mixed", [*BENCH, "--engine-arg", "Trust_Remote-Code=true"], "trust_remote_code"),
    ("bench-trust-remote-code-spaces", [*BENCH, "--engine-arg", " trust_remote_code =true"], "trust_remote_code"),
    ("eval-trust-remote-code-upper", ["eval", "--model", "smollm2-135m", "--model_args", "TRUST_REMOTE_CODE=1"],
     "trust_remote_code"),
    ("eval-trust-remote-code-spaced", ["eval", "--model", "smollm2-135m", "--model_args",
                                       "pretrained=x, trust_remote_code = True"], "trust_remote_code"),
    ("eval-trust-remote-code-dashes", ["eval", "--model", "smollm2-135m", "--model_args", "Trust-Remote-Code=True"],
     "trust_remote_code"),
]

# (case id, fixture config, {dotted key: new value; None deletes the key}, fragment)
CONFIG_CASES = [
    ("study-name-slash", "study", {"name": "a/b"}, "name"),
    ("study-params-nan", "study", {"params": float("nan")}, "params"),
    ("study-params-inf", "study", {"params": float("inf")}, "params"),
    ("study-params-huge", "study", {"params": 1e30}, "params"),
    ("study-params-str", "study", {"params": "lots"}, "params"),
    ("study-tokens-neg", "study", {"tokens": -1}, "tokens"),
    ("study-layers-zero", "study", {"n_layers": 0}, "n_layers"),
    ("study-layers-float", "study", {"n_layers": 2.5}, "n_layers"),
    ("study-unknown-key", "study", {"n_layer": 2}, "n_layer"),
    ("study-section-scalar", "study", {"measure": 3}, "measure"),
    ("study-section-list", "study", {"optuna": [1, 2]}, "optuna"),
    ("study-baseline-none", "study", {"baseline": {}}, "baseline"),
    ("study-baseline-gqa-zero", "study", {"baseline.gqa": 0}, "baseline.gqa"),
    ("study-target-slack", "study", {"target": {"slack": 5}}, "target.slack"),
    ("study-target-loss-nan", "study", {"target": {"loss": float("nan")}}, "target.loss"),
    ("study-space-reversed", "study", {"search_space.mlp_to_attn": [5.0, 0.5]}, "search_space.mlp_to_attn"),
    ("study-space-inf", "study", {"search_space.hidden_over_sqrt_n": [0.1, float("inf")]},
     "search_space.hidden_over_sqrt_n"),
    ("study-space-gqa-empty", "study", {"search_space.gqa": []}, "search_space.gqa"),
    ("study-space-gqa-neg", "study", {"search_space.gqa": [2, -1]}, "search_space.gqa"),
    ("study-space-step-neg", "study", {"search_space.mlp_to_attn_step": -0.5}, "search_space.mlp_to_attn_step"),
    ("study-space-head-dim-zero", "study", {"search_space.head_dim": 0}, "search_space.head_dim"),
    ("study-space-multiple-zero", "study", {"search_space.build.hidden_multiple": 0}, "search_space.build.hidden_multiple"),
    ("study-space-tolerance-neg", "study", {"search_space.build.tolerance": -0.1}, "search_space.build.tolerance"),
    ("study-proxy-runs-missing", "study", {"law.file": None, "proxy.runs": "nope.csv"}, "proxy.runs"),
    ("study-proxy-two-ways", "study", {"proxy": {"runs": "runs.csv", "sweep": SWEEP}}, "proxy"),
    ("study-proxy-sweep-bad", "study", {"law.file": None, "proxy": {"sweep": {**SWEEP, "params": [-1]}}},
     "proxy.sweep"),
    ("study-proxy-sweep-inf", "study", {"law.file": None, "proxy": {"sweep": {**SWEEP, "params": [float("inf")]}}},
     "proxy.sweep"),
    ("study-law-form", "study", {"law.form": "chinchilla"}, "law.form"),
    ("study-law-bootstrap-neg", "study", {"law.fit.bootstrap": -1}, "law.fit.bootstrap"),
    ("study-law-file-missing", "study", {"law.file": "nope.json"}, "law.file"),
    # the law block's fit is the fit's FitOptions: their checks name the field under law.fit
    ("study-law-r-range", "study", {"law.fit.r_range": [5.0, 0.5]}, "law.fit.r_range"),
    ("study-law-size-tol", "study", {"law.size_tolerance": 1.5}, "law.size_tolerance"),
    ("study-law-starts-zero", "study", {"law.fit.n_starts": 0}, "law.fit.n_starts"),
    ("study-law-reference-law", "study", {"law.fit.reference_law": {"law": "kaplan"}}, "law.fit.reference_law"),
    ("study-measure-backend", "study", {"measure.bench.backend": "tensorrt"}, "measure.bench.backend"),
    ("study-measure-batch-zero", "study", {"measure.bench.batch_sizes": [0]}, "measure.bench.batch"),
    ("study-measure-batch-huge", "study", {"measure.bench.backend": "hf", "measure.bench.batch_sizes": [10 ** 9]}, "measure.bench.batch"),
    ("study-measure-timeout-neg", "study", {"measure.bench.timeout_s": -1}, "measure.bench.timeout"),
    # measure.mode: online (tests/test_online_study.py: the rate and SLO no shape can meet, a port in use)
    ("study-online-analytic", "study", {"measure.mode": "online", "measure.rate": 1.0,
                                        "measure.slo": {"ttft_s": 2.0, "tpot_s": 0.2}}, "measure.bench.backend"),
    ("study-online-no-slo", "study", {"measure.bench.backend": "vllm", "measure.mode": "online", "measure.rate": 1.0},
     "measure.slo"),
    ("study-online-slo-zero", "study", {"measure.bench.backend": "vllm", "measure.mode": "online", "measure.rate": 1.0,
                                        "measure.slo": {"ttft_s": 0, "tpot_s": 0.2}}, "measure.slo.ttft_s"),
    ("study-online-rate-neg", "study", {"measure.bench.backend": "vllm", "measure.mode": "online", "measure.rate": -1,
                                        "measure.slo": {"ttft_s": 2.0, "tpot_s": 0.2}}, "measure.rate"),
    ("study-online-rate-offline", "study", {"measure.rate": 1.0}, "measure.rate"),
    ("study-online-mode-unknown", "study", {"measure.mode": "served"}, "measure.mode"),
    ("study-online-workload-target", "study", {"measure.targets": [{"name": "c", "workload": "chat",
                                                                    "backend": "vllm"}]}, "measure.mode"),
    ("study-optuna-trials-zero", "study", {"optuna.n_trials": 0}, "optuna.n_trials"),
    ("study-optuna-shapes-neg", "study", {"optuna.n_shapes": -3}, "optuna.n_shapes"),
    ("study-optuna-shapes-beyond-trials", "study", {"optuna.n_shapes": 5, "optuna.n_trials": 3}, "optuna.n_shapes"),
    ("study-optuna-sampler", "study", {"optuna.sampler": "grid"}, "optuna.sampler"),
    ("study-optuna-storage-bogus", "study", {"optuna.storage": "bogus://x"}, "optuna.storage"),
    ("study-gqa-baseline-zero", "study", {"gqa_search.baseline_gqa": 0}, "gqa_search.baseline_gqa"),
    ("study-limits-neg", "study", {"limits": {"max_ttft_s": -1}}, "limits.max_ttft_s"),
    ("study-eval-limit-neg", "study", {"evaluation": {"limit": -1}}, "evaluation.limit"),
    ("study-final-tokens-neg", "study", {"final_train": {"enabled": True, "tokens": -1}}, "final_train.tokens"),
    ("study-out-dotdot", "study", {"out": "../../escape"}, "out"),
    ("study-top-k-zero", "study", {"top_k": 0}, "top_k"),
    ("study-target-confidence", "study", {"target": {"confidence": 1.5}}, "target.confidence"),
    ("study-proxy-plan-unknown", "study", {"law.file": None, "proxy": {"sweep": SWEEP, "plan": "random"}},
     "proxy.plan"),
    ("study-proxy-active-runs", "study", {"law.file": None, "proxy": {"runs": "runs.csv", "plan": "active"}},
     "proxy.plan"),
    ("study-active-tolerance", "study", {"law.file": None, "proxy": {"sweep": SWEEP, "plan": "active",
                                                                     "active": {"tolerance": 0}}},
     "proxy.active.tolerance"),
    ("study-active-bootstrap", "study", {"law.file": None, "proxy": {"sweep": SWEEP, "plan": "active",
                                                                     "active": {"bootstrap": 3}}},
     "proxy.active.bootstrap"),
    ("study-active-budget-neg", "study", {"law.file": None, "proxy": {"sweep": SWEEP, "plan": "active",
                                                                      "active": {"budget_flops": -1}}},
     "proxy.active.budget_flops"),
    ("study-active-initial", "study", {"law.file": None, "proxy": {"sweep": SWEEP, "plan": "active",
                                                                   "active": {"initial": "lhs"}}},
     "proxy.active.initial"),
    ("study-active-level", "study", {"law.file": None, "proxy": {"sweep": SWEEP, "plan": "active",
                                                                 "active": {"level": float("nan")}}},
     "proxy.active.level"),
    ("study-active-unknown", "study", {"law.file": None, "proxy": {"sweep": SWEEP, "plan": "active",
                                                                   "active": {"tolerence": 0.1}}},
     "tolerence"),
    ("study-proxy-store-file", "study", {"law.file": None, "proxy": {"sweep": SWEEP, "store": "afile.txt"}},
     "proxy.store"),
    ("study-calibration-missing", "study", {"measure.calibration": "nope.json"}, "measure.calibration"),
    ("study-calibration-broken", "study", {"measure.calibration": "broken.json"}, "measure.calibration"),
    ("study-ci-level", "study", {"measure.paired.level": 1.5}, "measure.paired.level"),
    ("study-ci-halfwidth-neg", "study", {"measure.paired.rel_halfwidth": -0.03}, "measure.paired.rel_halfwidth"),
    ("study-min-rounds-zero", "study", {"measure.paired.min_rounds": 0}, "measure.paired.min_rounds"),
    ("study-max-below-min-rounds", "study", {"measure.paired.min_rounds": 8, "measure.paired.max_rounds": 4}, "rounds"),
    ("study-optuna-log-with", "study", {"optuna.log_with": "tensorbored"}, "optuna.log_with"),
    ("study-cluster-executor", "study", {"cluster": {"executor": "kubernetes"}}, "cluster.executor"),
    ("study-cluster-jobs-zero", "study", {"cluster": {"executor": "local", "jobs_at_once": 0}},
     "cluster.jobs_at_once"),
    ("study-cluster-gpus-neg", "study", {"cluster": {"executor": "local", "gpus_per_job": -1}},
     "cluster.gpus_per_job"),
    ("study-cluster-poll-nan", "study", {"cluster": {"executor": "local", "poll_s": float("nan")}},
     "cluster.poll_s"),
    ("study-cluster-timeout-zero", "study", {"cluster": {"executor": "local", "timeout_min": 0}},
     "cluster.timeout_min"),
    ("study-cluster-retries-neg", "study", {"cluster": {"executor": "local", "max_retries": -1}},
     "cluster.max_retries"),
    ("study-cluster-slurm-inline", "study", {"cluster": {"slurm": {"partition": "gpu"}}}, "cluster.slurm"),
    ("study-cluster-scalar", "study", {"cluster": "slurm"}, "cluster"),
    ("study-cluster-profile-binary", "study", {"cluster": {"profile": "bin.json"}}, "cluster.profile"),
    ("study-cluster-profile-missing", "study", {"cluster": {"profile": "nope.json"}}, "cluster.profile"),
    # names that become paths
    ("study-name-dotdot", "study", {"name": ".."}, "name"),
    ("study-name-dot", "study", {"name": "."}, "name"),
    ("study-name-absolute", "study", {"name": "/tmp"}, "name"),
    ("study-proxy-sweep-name-dotdot", "study", {"law.file": None, "proxy": {"sweep": {**SWEEP, "name": ".."}}},
     "proxy.sweep"),
    ("sweep-name-dot", "sweep", {"name": "."}, "sweep.name"),
    ("sweep-name-backslash", "sweep", {"name": "a\\b"}, "sweep.name"),
    # counts bounded by the method or the search space
    ("study-law-bootstrap-huge", "study", {"law.fit.bootstrap": 10 ** 9}, "law.fit.bootstrap"),
    ("study-law-starts-huge", "study", {"law.fit.n_starts": 10 ** 6}, "law.fit.n_starts"),
    ("study-active-bootstrap-huge", "study", {"law.file": None, "proxy": {"sweep": SWEEP, "plan": "active",
                                                                          "active": {"bootstrap": 10 ** 8}}},
     "proxy.active.bootstrap"),
    ("study-trials-beyond-the-box", "study", {"optuna.n_shapes": 1000}, "optuna.n_shapes"),
    # limits a study's measurements cannot show to hold
    ("study-limits-tpot", "study", {"limits": {"max_tpot_s": 1.0}}, "limits.max_tpot_s"),
    ("study-limits-memory", "study", {"limits": {"max_peak_memory_gib": 80}}, "limits.max_peak_memory_gib"),
    ("study-trust-remote-code", "study", {"measure.bench.engine_args": {"trust_remote_code": True}},
     "measure.bench.engine_args.trust_remote_code"),
    # storage URLs opened at load: before any proxy is trained, the password never shown
    ("study-storage-postgres-port", "study", {**_PROXIES, "optuna.storage": f"postgresql+psycopg://u:{SECRET}@127.0.0.1:1/db"},
     "optuna.storage"),
    ("study-storage-no-driver", "study", {**_PROXIES, "optuna.storage": f"mysql+nodriver://u:{SECRET}@127.0.0.1/db"},
     "optuna.storage"),
    ("study-storage-mysql", "study", {**_PROXIES, "optuna.storage": f"mysql://u:{SECRET}@127.0.0.1:1/db"},
     "optuna.storage"),
    ("study-storage-sqlite-no-folder", "study", {**_PROXIES, "optuna.storage": "sqlite:////no-such-dir-xyz/x.db"},
     "optuna.storage"),
    ("study-storage-sqlite-garbage", "study", {**_PROXIES, "optuna.storage": "sqlite:///afile.txt"}, "optuna.storage"),
    ("study-storage-journal-no-folder", "study", {**_PROXIES, "optuna.storage": "journal:a/b/c/j.log"},
     "optuna.storage"),
    ("study-storage-query-password", "study", {**_PROXIES, "optuna.storage":
                                              f"postgresql+psycopg://u@127.0.0.1:1/db?password={SECRET}"},
     "optuna.storage"),
    # counts bounded by what a run can do
    ("study-paired-max-rounds-huge", "study", {"measure.paired.max_rounds": 10 ** 9}, "measure.paired.max_rounds"),
    ("study-optuna-trials-huge", "study", {"optuna.n_trials": 10 ** 9}, "optuna.n_trials"),
    ("study-cluster-jobs-huge", "study", {"cluster": {"executor": "local", "jobs_at_once": 10 ** 9}},
     "cluster.jobs_at_once"),
    ("study-cluster-workers-huge", "study", {"cluster": {"executor": "local", "measure_workers": 10 ** 9}},
     "cluster.measure_workers"),
    ("study-law-max-iter-huge", "study", {"law.max_iter": 10 ** 12}, "law.max_iter"),
    ("study-measure-repeats-huge", "study", {"measure.repeats": 10 ** 8}, "measure.repeats"),
    ("sweep-params-inf", "sweep", {"params": [float("inf")]}, "params"),
    ("sweep-params-huge", "sweep", {"params": [1e30]}, "sweep.params"),
    ("sweep-params-str", "sweep", {"params": "many"}, "params"),
    ("sweep-layers-zero", "sweep", {"n_layers": 0}, "sweep.n_layers"),
    ("sweep-gqa-zero", "sweep", {"gqa": 0}, "sweep.gqa"),
    ("sweep-head-dim-neg", "sweep", {"head_dim": -32}, "sweep.head_dim"),
    ("sweep-seeds-empty", "sweep", {"seeds": []}, "sweep.seeds"),
    ("sweep-train-lr-nan", "sweep", {"train.lr": float("nan")}, "train.lr"),
    ("sweep-train-unknown", "sweep", {"train.learning_rate": 1e-3}, "train.learning_rate"),
    ("sweep-data-seq-zero", "sweep", {"data.seq_len": 0}, "data.seq_len"),
    ("sweep-build-tolerance-neg", "sweep", {"build.tolerance": -1}, "build.tolerance"),
    ("sweep-build-multiple-zero", "sweep", {"build.ffn_multiple": 0}, "build.ffn_multiple"),
    ("sweep-name-slash", "sweep", {"name": "../x"}, "sweep.name"),
    ("sweep-max-epochs-zero", "sweep", {"data.max_epochs": 0}, "data.max_epochs"),
    ("sweep-log-with-bad", "sweep", {"train.log_with": "tensorbored"}, "train.log_with"),
    ("sweep-health-min-batch", "sweep", {"health": {"min_batch": 0}}, "sweep.health.min_batch"),
    ("sweep-health-max-lr-neg", "sweep", {"health": {"max_lr": -1e-3}}, "sweep.health.max_lr"),
    ("sweep-health-retries-neg", "sweep", {"health": {"retries": -1}}, "sweep.health.retries"),
    ("sweep-health-tolerance-neg", "sweep", {"health": {"tolerance": -0.1}}, "sweep.health.tolerance"),
    ("sweep-health-per-level-len", "sweep", {"health": {"max_lr": [1e-2, 2e-2]}}, "sweep.health.max_lr"),
    ("sweep-health-scalar", "sweep", {"health": 3}, "health"),
    ("sweep-health-start-len", "sweep", {"health": {"start_batch": [16, 8]}}, "sweep.health.start_batch"),
    ("sweep-health-start-lr-zero", "sweep", {"health": {"start_lr": 0}}, "sweep.health.start_lr"),
    ("sweep-health-start-below-floor", "sweep", {"health": {"min_batch": 8, "start_batch": 4}},
     "sweep.health.start_batch"),
    ("sweep-health-start-above-ceiling", "sweep", {"health": {"max_lr": 1e-3, "start_lr": 2e-3}},
     "sweep.health.start_lr"),
    ("sweep-health-start-and-hparams", "sweep", {"hparams_per_level": ["80m"], "health": {"start_lr": 1e-3}},
     "sweep.health.start_lr"),
    ("train-config-tokens-huge", "train", {"train.tokens": 1e15}, "tokens"),
    ("train-warmup-neg", "train", {"train.warmup_steps": -1}, "train.warmup_steps"),
    ("train-betas-bad", "train", {"train.betas": [0.9, 1.5]}, "train.betas"),
    ("train-data-val-frac", "train", {"data.val_fraction": 1.5}, "data.val_fraction"),
    ("train-section-scalar", "train", {"data": 3}, "data"),
    ("train-max-epochs-neg", "train", {"data.max_epochs": -1}, "data.max_epochs"),
    ("train-log-with-bad", "train", {"train.log_with": ["tensorboard", "nope"]}, "train.log_with"),
    # held-out probes (second round): other secret forms, absurd counts in other fields, other paths
    ("study-storage-sslpassword", "study", {"optuna.storage": f"postgresql://u@localhost:1/db?sslpassword={SECRET}"},
     "optuna.storage"),
    ("study-storage-token", "study", {"optuna.storage": f"postgresql://localhost:1/db?token={SECRET}"}, "optuna.storage"),
    ("study-storage-upper-password", "study", {"optuna.storage": f"postgresql://localhost:1/db?PASSWORD={SECRET}"},
     "optuna.storage"),
    ("study-storage-encoded-key", "study", {"optuna.storage": f"postgresql://localhost:1/db?pass%77ord={SECRET}"},
     "optuna.storage"),
    ("study-storage-no-user", "study", {"optuna.storage": f"mysql+pymysql://:{SECRET}@localhost:1/db"}, "optuna.storage"),
    ("study-storage-ipv6", "study", {"optuna.storage": f"postgresql://u:{SECRET}@[::1]:1/db"}, "optuna.storage"),
    ("study-storage-at-in-password", "study", {"optuna.storage": f"postgresql://u:{SECRET}@x@localhost:1/db"},
     "optuna.storage"),
    ("study-storage-fragment", "study", {"optuna.storage": f"postgresql://localhost:1/db#password={SECRET}"},
     "optuna.storage"),
    ("study-storage-semicolon", "study", {"optuna.storage": f"postgresql://localhost:1/db?a=1;password={SECRET}"},
     "optuna.storage"),
    ("study-storage-api-key", "study", {"optuna.storage": f"postgresql://localhost:1/db?api-key={SECRET}"},
     "optuna.storage"),
    ("study-engine-args-remote-code", "study", {"measure.bench.engine_args": {"TRUST-REMOTE-CODE": True}},
     "trust_remote_code"),
    ("study-bench-repeats-huge", "study", {"measure.bench.repeats": 10**9}, "repeats"),
    ("study-paired-min-rounds-huge", "study", {"measure.paired.min_rounds": 10**9}, "min_rounds"),
    ("study-law-starts-1e9", "study", {"law.fit.n_starts": 10**9}, "n_starts"),
    ("study-law-bootstrap-1e12", "study", {"law.fit.bootstrap": 10**12}, "bootstrap"),
    ("study-n-shapes-huge", "study", {"optuna.n_shapes": 10**12}, "n_shapes"),
    ("study-enqueue-huge", "study", {"optuna.enqueue_solution": 10**9}, "enqueue_solution"),
    ("study-batch-size-huge", "study", {"measure.bench.batch_sizes": [10**9]}, "batch"),
    ("study-gqa-baseline-huge", "study", {"gqa_search.baseline_gqa": 10**9}, "baseline_gqa"),
    ("study-gqa-min-kv-heads-huge", "study", {"gqa_search.min_kv_heads": 10**9}, "min_kv_heads"),
    ("sweep-eval-batches-huge", "sweep", {"train.eval_batches": 10**12}, "eval_batches"),
    ("train-config-seq-len-huge", "train", {"data.seq_len": 10**12}, "seq_len"),
    ("train-micro-batch-huge", "train", {"train.micro_batch_size": 10**9}, "micro_batch_size"),
    ("study-out-nul", "study", {"out": "a\x00b"}, "out"),
    ("study-name-nul", "study", {"name": "a\x00b"}, "name"),
    ("study-name-long", "study", {"name": "n" * 300}, "name"),
    ("study-proxy-runs-folder", "study", {"law.file": None, "proxy.runs": "adir"}, "proxy.runs"),
    ("study-law-file-dangling", "study", {"law.file": "dangling"}, "law.file"),
]

CONFIG_CMDS = {"study": ["search", "--config", "{d}/case.yaml"],
               "sweep": ["sweep", "--config", "{d}/case.yaml"],
               "train": [*TRAIN_CMD[:-1], "{d}/case.yaml"]}
CONFIG_BASES = {"study": STUDY, "sweep": SWEEP, "train": TRAIN}


def _make_fixtures(d: Path) -> None:
    from archsearch.laws.synthetic import synthetic_runs
    from archsearch.rundata import write_runs

    runs = synthetic_runs("chinchilla", {"E": 1.8, "A": 400, "alpha": 0.34, "B": 410, "beta": 0.28},
                          sizes=(2e5, 4e5, 8e5), tokens_per_param=(10, 20))
    write_runs(d / "runs.csv", runs)
    (d / "law.json").write_text(json.dumps(LAW))
    (d / "badform.json").write_text(json.dumps({**LAW, "law": "kaplan"}))
    (d / "broken.json").write_text('{"law": "chinch')
    (d / "list.json").write_text("[1, 2]")
    (d / "empty.csv").write_text("")
    (d / "empty.yaml").write_text("")
    (d / "afile.txt").write_text("not a folder\n")
    (d / "adir").mkdir()
    (d / "adir" / "keep.txt").write_text("keep\n")
    good = json.dumps(runs[0].to_row())
    (d / "scalar.jsonl").write_text(good + "\n42\n")
    (d / "broken.jsonl").write_text(good + '\n{"n_layers": 2, "hidd\n' + good + "\n")
    rows = list(__import__("csv").DictReader(open(d / "runs.csv")))
    head = ",".join(rows[0])
    (d / "nanloss.csv").write_text(head + "\n" + ",".join("nan" if k == "loss" else v for k, v in rows[0].items()) + "\n")
    tp = {k: runs[0].to_row()[k] for k in ("n_layers", "hidden_size", "n_heads", "n_kv_heads", "head_dim", "ffn")}
    (d / "nantp.jsonl").write_text(json.dumps({**tp, "throughput": float("nan")}) + "\n")
    (d / "negtp.jsonl").write_text(json.dumps({**tp, "throughput": -5.0}) + "\n")
    (d / "broken.yaml").write_text("name: [unclosed\n")
    (d / "list.yaml").write_text("- 1\n- 2\n")
    (d / "study.yaml").write_text(yaml.safe_dump(STUDY))
    (d / "sweep.yaml").write_text(yaml.safe_dump(SWEEP))
    (d / "train.yaml").write_text(yaml.safe_dump(TRAIN))
    (d / "train-scalar.yaml").write_text("train: 5\n")
    (d / "train-unknown.yaml").write_text("optimizer: {lr: 1}\n")
    # not UTF-8 text: binary, UTF-16 (with its byte-order mark), Latin-1
    for name in ("bin.yaml", "bin.json", "bin.jsonl"):
        (d / name).write_bytes(b"\x89PNG\r\n\x1a\n\x00\x00\x00\rIHDR\x00\xff\xfe")
    (d / "u16.yaml").write_text(yaml.safe_dump(STUDY), encoding="utf-16")
    (d / "u16.json").write_text(json.dumps(LAW), encoding="utf-16")
    (d / "u16.csv").write_text((d / "runs.csv").read_text(), encoding="utf-16")
    (d / "latin1.yaml").write_bytes(yaml.safe_dump({**SWEEP, "name": "caf\u00e9"}, allow_unicode=True).encode("latin-1"))
    (d / "u16dir").mkdir()
    (d / "u16dir" / "config.json").write_text(json.dumps({"model_type": "llama"}), encoding="utf-16")
    # silent wrong results: a repeated shape, mixed loss kinds, an absurd budget, bad coefficients
    (d / "duptp.jsonl").write_text(json.dumps({**tp, "throughput": 10.0}) + "\n"
                                   + json.dumps({**tp, "throughput": 20.0}) + "\n")
    mixed = [dataclasses.replace(r, loss_kind="smoothed_train") if i % 2 else r for i, r in enumerate(runs)]
    write_runs(d / "mixed.csv", mixed)
    write_runs(d / "hugetokens.csv", runs[:-1])
    with open(d / "hugetokens.csv", "a") as fh:
        fh.write(",".join("1e300" if k == "tokens" else v for k, v in rows[0].items()) + "\n")
    (d / "neglaw.json").write_text(json.dumps({**LAW, "coefficients": {**LAW["coefficients"], "a0": -1.08}}))
    (d / "biglaw.json").write_text(json.dumps({**LAW, "coefficients": {**LAW["coefficients"], "a2": 1e308}}))
    (d / "negexp.json").write_text(json.dumps({"law": "chinchilla", "coefficients": {**LAW["reference"]["coefficients"],
                                                                                      "alpha": -0.34}}))
    # HF folders whose config.json holds a value of the wrong type
    for case, (_, changes) in HF_BAD.items():
        (d / f"hf-{case}").mkdir()
        (d / f"hf-{case}" / "config.json").write_text(json.dumps({**HF_GOOD, **changes}))
    # bench records that are not records
    (d / "rec-list.jsonl").write_text("[1, 2]\n")
    (d / "rec-scalar.jsonl").write_text("3\n")
    (d / "rec-bare.jsonl").write_text('{"a": 1}\n')
    (d / "rec-batch.jsonl").write_text(json.dumps({"backend": "hf", "settings": {}, "architecture": {},
                                                   "per_batch": [{"batch_size": "one"}]}) + "\n")
    # YAML beyond the loader's limits
    study = yaml.safe_dump(STUDY)
    (d / "dup.yaml").write_text(study + "params: 300000\n")
    (d / "dup-nested.yaml").write_text(study.replace("law:\n", "law:\n  bootstrap: 5\n  bootstrap: 7\n"))
    levels = "abcdefghi"
    (d / "bomb.yaml").write_text("".join(f"{a}: &{a} [" + ",".join([f"*{b}" if b else "x"] * 9) + "]\n"
                                         for b, a in zip(["", *levels], levels)))
    (d / "recursive.yaml").write_text(study + "loop: &x [1, *x]\n")
    (d / "bigint.yaml").write_text(study.replace("params: 200000", "params: " + "9" * 5000))
    (d / "deep.yaml").write_text(study.replace("params: 200000", "params: " + "[" * 1000 + "]" * 1000))
    from archsearch.arch import ArchSpec

    # data that would silently mix
    (d / "latin1.txt").write_bytes("Caf\u00e9 cr\u00e8me, na\u00efve.\n".encode("latin-1") * 50)
    lines = (d / "runs.csv").read_text().splitlines(keepends=True)
    (d / "duprow.csv").write_text("".join(lines + [lines[1]]))
    (d / "dupcol.csv").write_text("".join([lines[0].rstrip("\n") + ",loss\n"]
                                          + [ln.rstrip("\n") + ",9.9\n" for ln in lines[1:]]))
    (d / "dupkey.jsonl").write_text(good[:-1] + ', "loss": 9.9}\n')
    write_runs(d / "mixvocab.csv", [dataclasses.replace(r, arch=r.arch.replace(vocab_size=2048 * (1 + i % 2)))
                                    for i, r in enumerate(runs)])
    head = ("model,n_layers,hidden_size,n_heads,n_kv_heads,head_dim,ffn,vocab_size,tie_embeddings,device,engine,"
            "input_len,output_len,batch_size,output_tokens_per_s\n")
    row = "m,2,128,4,2,32,256,2048,false,H100,vllm,64,64,{b},{t}\n"
    (d / "conflict.csv").write_text(head + row.format(b=1, t=100) + row.format(b=8, t=700) + row.format(b=1, t=140))
    # a half-finished run (killed: status running) of the fixture's shape at lr 0.001, and one of the
    # same settings whose last checkpoint's weights file was cut short
    from archsearch.configio import from_dict, to_dict
    from archsearch.trainers.config import DataConfig, TrainConfig

    shape = ArchSpec(n_layers=2, hidden_size=128, n_heads=4, n_kv_heads=2, head_dim=32, ffn=256, vocab_size=2048)
    tc, dc = from_dict(TrainConfig, TRAIN["train"]), from_dict(DataConfig, TRAIN["data"])
    for name, lr in (("halfrun", 1e-3), ("tornrun", tc.lr)):
        (d / name).mkdir()
        (d / name / "run.json").write_text(json.dumps({
            "status": "running", "spec": shape.to_dict(), "tokens_target": tc.tokens, "seed": 0, "init_from": None,
            "train_config": to_dict(dataclasses.replace(tc, lr=lr)), "data_config": to_dict(dc)}))
    ckpt = d / "tornrun" / "checkpoints" / "step_00000002"
    ckpt.mkdir(parents=True)
    header = json.dumps({"w": {"dtype": "F32", "shape": [4], "data_offsets": [0, 16]}}).encode()
    (ckpt / "model.safetensors").write_bytes(len(header).to_bytes(8, "little") + header + b"\0" * 7)
    (ckpt / "state.json").write_text(json.dumps({"step": 2}))
    # study folders whose lock paths are of the wrong kind
    (d / "lock-folder" / ".stage.lock").mkdir(parents=True)
    (d / "locks-file").mkdir()
    (d / "locks-file" / "locks").write_text("")
    (d / "store-lock-folder" / "measurements.lock").mkdir(parents=True)
    # held-out probes (second round)
    for name, text in (("hf-list", "[]"), ("hf-null", "null")):
        (d / name).mkdir()
        (d / name / "config.json").write_text(text)
    (d / "rec-null.jsonl").write_text("null\n")
    (d / "rec-pb-str.jsonl").write_text(json.dumps({"backend": "hf", "settings": {}, "architecture": {},
                                                    "per_batch": "x"}) + "\n")
    (d / "rec-arch-list.jsonl").write_text(json.dumps({"backend": "hf", "settings": {}, "architecture": [1],
                                                       "per_batch": []}) + "\n")
    (d / "dup-sweep.yaml").write_text(yaml.safe_dump(SWEEP) + "n_layers: 4\n")
    (d / "tag.yaml").write_text(study + "x: !!python/object/apply:os.system ['true']\n")
    (d / "complexkey.yaml").write_text(study + "? [a, b]\n: 1\n")
    (d / "intkey.yaml").write_text(study + "1: 2\n")
    (d / "tabs.yaml").write_text("name: st\n\tparams: 3\n")
    (d / "deepmap.yaml").write_text(study.replace("params: 200000", "params: " + "{a: " * 1000 + "1" + "}" * 1000))
    (d / "bigint-neg.yaml").write_text(study.replace("tokens: 300000", "tokens: -" + "9" * 5000))
    (d / "bigfloat.yaml").write_text(study.replace("tokens: 300000", "tokens: 1e99999"))
    (d / "nul.txt").write_bytes(b"hello\x00world\n" * 100)
    (d / "u16.txt").write_text("hello world, a corpus\n" * 50, encoding="utf-16")
    (d / "dangling").symlink_to(d / "nowhere")
    (d / "tofile").symlink_to(d / "afile.txt")
    os.mkfifo(d / "fifo")  # a special file an output must not replace (as /dev/null would be, by root)
    # a finished run of another architecture and budget
    other = ArchSpec(n_layers=4, hidden_size=256, n_heads=4, n_kv_heads=4, head_dim=64, ffn=512, vocab_size=2048)
    (d / "otherrun").mkdir()
    (d / "otherrun" / "run.json").write_text(json.dumps({"status": "ok", "spec": other.to_dict(),
                                                         "tokens_target": 1e6, "seed": 0, "init_from": None}))


def _apply(base: dict, changes: dict) -> dict:
    cfg = copy.deepcopy(base)
    for dotted, value in changes.items():
        *parents, leaf = dotted.split(".")
        node = cfg
        for p in parents:
            node = node.setdefault(p, {})
        if value is None:
            node.pop(leaf, None)
        else:
            node[leaf] = value
    return cfg


def _snapshot(d: Path) -> dict[str, str]:
    out = {}
    for p in sorted(d.rglob("*")):
        rel = str(p.relative_to(d))
        out[rel] = hashlib.sha256(p.read_bytes()).hexdigest() if p.is_file() else "dir"
    return out


class _Timeout(Exception):
    pass


def run_case(d: Path, argv: list[str], seconds: int = 30) -> tuple[int, str, str]:
    """archsearch ARGV in-process in folder ``d``: (exit status, stdout, stderr)."""
    from archsearch.cli import main

    def on_alarm(*_):
        raise _Timeout(f"still running after {seconds} s: {argv}")

    argv = [a.replace("{d}", str(d)) for a in argv]
    out, err = io.StringIO(), io.StringIO()
    old = signal.signal(signal.SIGALRM, on_alarm)
    cwd = os.getcwd()
    signal.alarm(seconds)
    try:
        os.chdir(d)
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            try:
                rc = main(argv)
            except SystemExit as e:
                rc = e.code if isinstance(e.code, int) else 1
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, old)
        os.chdir(cwd)
    return rc, out.getvalue(), err.getvalue()


@pytest.fixture(scope="module")
def fixtures(tmp_path_factory):
    d = tmp_path_factory.mktemp("bad-inputs")
    _make_fixtures(d)
    return d


def _norm(text: str) -> str:
    """A field as a flag or as a config key: '--huber-delta' and 'huber_delta' match."""
    return text.lower().lstrip("-").replace("-", "_")


def _check(d: Path, argv: list[str], fragment: str) -> None:
    before = _snapshot(d)
    rc, out, err = run_case(d, argv)
    lines = [ln for ln in err.splitlines() if ln.strip()]
    assert SECRET not in out + err, "a storage password was printed"
    assert rc == 2, f"exit {rc}, stderr: {err[-2000:]}"
    assert "Traceback" not in err, err
    assert len(lines) == 1, f"expected one line, got: {err!r}"
    assert _norm(fragment) in _norm(lines[0]), f"{fragment!r} not named in: {lines[0]}"
    assert _snapshot(d) == before, "the failed command changed the folder"


@pytest.mark.parametrize("argv,fragment", [c[1:] for c in CLI_CASES], ids=[c[0] for c in CLI_CASES])
def test_cli_bad_input(fixtures, argv, fragment):
    _check(fixtures, argv, fragment)


@pytest.mark.parametrize("kind,changes,fragment", [c[1:] for c in CONFIG_CASES],
                         ids=[c[0] for c in CONFIG_CASES])
def test_config_bad_input(fixtures, kind, changes, fragment):
    case = fixtures / "case.yaml"
    case.write_text(yaml.safe_dump(_apply(CONFIG_BASES[kind], changes)))
    try:
        _check(fixtures, CONFIG_CMDS[kind], fragment)
    finally:
        case.unlink()


def test_table_is_unique():
    ids = [c[0] for c in CLI_CASES] + [c[0] for c in CONFIG_CASES]
    assert len(ids) == len(set(ids))


if __name__ == "__main__":
    import tempfile

    with tempfile.TemporaryDirectory() as tmp:
        d = Path(tmp)
        _make_fixtures(d)
        bad = []
        for cid, argv, frag in CLI_CASES:
            try:
                _check(d, argv, frag)
            except (AssertionError, Exception) as e:  # report every case, keep going
                bad.append((cid, str(e).splitlines()[0][:300] if str(e) else type(e).__name__))
        for cid, kind, changes, frag in CONFIG_CASES:
            (d / "case.yaml").write_text(yaml.safe_dump(_apply(CONFIG_BASES[kind], changes)))
            try:
                _check(d, CONFIG_CMDS[kind], frag)
            except (AssertionError, Exception) as e:
                bad.append((cid, str(e).splitlines()[0][:300] if str(e) else type(e).__name__))
            (d / "case.yaml").unlink()
        n = len(CLI_CASES) + len(CONFIG_CASES)
        for cid, why in bad:
            print(f"FAIL {cid}: {why}")
        print(json.dumps({"inputs_tried": n, "clean_errors": n - len(bad)}))
