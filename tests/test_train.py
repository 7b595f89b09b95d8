"""Training: configs, schedule, data, a tiny real run, resume after a kill, bad input.

Tiny shapes (2 layers, 64 wide, sequences of 64) on the real Shakespeare corpus with a
2048-token BPE. The tokenizer and packed data are cached (content-keyed) under
$ARCHSEARCH_CACHE or ~/.cache/archsearch, so only the first session pays for them.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from archsearch.arch import ArchSpec
from archsearch.errors import ArchsearchError
from archsearch.trainers.config import HPARAMS, DataConfig, SweepConfig, TrainConfig

REPO = Path(__file__).resolve().parent.parent
# three heads of 32 at width 64: the method's kind of shape (heads do not divide the width;
# exported as Mistral, the same math), so every training test trains one
SPEC = ArchSpec(n_layers=2, hidden_size=64, n_heads=3, n_kv_heads=1, head_dim=32, ffn=192,
                vocab_size=2048)
DATA = DataConfig(source="shakespeare", tokenizer="bpe:2048", seq_len=64)
# 150 steps of 16 x 64 tokens; a checkpoint every 25 steps
TRAIN = TrainConfig(tokens=150 * 16 * 64, global_batch_size=16, lr=3e-3, checkpoint_interval=25,
                    eval_batches=8, log_interval=5)
ARCH_FLAGS = ["--layers", "2", "--hidden-size", "64", "--heads", "3", "--kv-heads", "1",
              "--head-dim", "32", "--ffn", "192", "--vocab-size", "2048"]
TRAIN_FLAGS = ["--tokens", str(150 * 16 * 64), "--global-batch-size", "16", "--lr", "3e-3",
               "--checkpoint-interval", "25", "--eval-batches", "8", "--seq-len", "64",
               "--data", "shakespeare", "--tokenizer", "bpe:2048"]


# -- configs and schedule (no torch) ------------------------------------------------------------

def test_presets_fill_unset_fields_and_keep_explicit_ones():
    tc = TrainConfig(hparams="297m", tokens=1e9)
    assert (tc.global_batch_size, tc.lr, tc.warmup_steps, tc.min_lr_ratio) == (512, 8e-4, 500, 0.1)
    assert TrainConfig(hparams="80m", lr=1e-4).lr == 1e-4
    assert [HPARAMS[k].lr for k in ("80m", "145m", "297m", "1b", "3b")] == [1.5e-3, 1e-3, 8e-4, 6e-4, 6e-4]
    assert TrainConfig().global_batch_size == 32 and TrainConfig().lr == 1.5e-3


@pytest.mark.parametrize("kw, field", [
    ({"tokens": 1e6, "tokens_per_param": 20}, "train.tokens/tokens_per_param"),
    ({"global_batch_size": 32, "micro_batch_size": 5}, "train.micro_batch_size"),
    ({"hparams": "7b"}, "train.hparams"),
    ({"dtype": "fp8"}, "train.dtype"),
    ({"betas": (0.9, 1.5)}, "train.betas"),
    ({"log_with": "neptune"}, "train.log_with"),
    ({"log_with": ["tensorboard", "comet"]}, "train.log_with[1]"),
])
def test_bad_train_config_names_the_field(kw, field):
    with pytest.raises(ArchsearchError) as e:
        TrainConfig(**kw)
    assert e.value.field == field


def test_sweep_config_from_yaml_names_bad_keys(tmp_path):
    from archsearch.configio import load_config

    cfg = load_config(SweepConfig, REPO / "configs" / "sweep-demo.yaml")
    assert cfg.train.tokens_per_param == 2 and cfg.data.seq_len == 128
    bad = tmp_path / "s.yaml"
    bad.write_text("name: x\nparams: [1e5]\nhidden_over_sqrt_n: [0.2]\nmlp_to_attn: [1]\n"
                   "train: {tokens_per_param: 2, lrr: 0.1}\n")
    with pytest.raises(ArchsearchError, match=r"train\.lrr.*did you mean 'lr'"):
        load_config(SweepConfig, bad)


def _lr_by_hand(step: int, steps: int, warmup: int, lr: float, min_ratio: float) -> float:
    """The schedule as the trainer wrote it by hand before it took transformers': linear warm-up
    to ``lr`` at step ``warmup - 1``, then a cosine from ``lr`` at step ``warmup`` down to
    ``min_ratio x lr`` at the last step."""
    if warmup and step < warmup:
        return lr * (step + 1) / warmup
    span = max(1, steps - warmup - 1)
    progress = min(1.0, (step - warmup) / span)
    return lr * (min_ratio + (1 - min_ratio) * 0.5 * (1 + math.cos(math.pi * progress)))


@pytest.mark.parametrize("steps, warm, min_ratio", [(100, 10, 0.1), (150, 15, 0.1), (37, 3, 0.0),
                                                    (12, 11, 0.1), (10, 0, 0.2), (2, 1, 0.1), (1, 0, 0.1)])
def test_lr_schedule_is_the_warmup_cosine_floor_at_every_step(steps, warm, min_ratio):
    import torch

    from archsearch.trainers.loop import lr_schedule

    lr = 3e-3
    opt = torch.optim.AdamW([torch.nn.Parameter(torch.zeros(2))], lr=lr)
    factor = lr_schedule(opt, steps, warm, min_ratio)
    got = [lr * factor(s) for s in range(steps)]
    for s, g in enumerate(got):
        assert g == pytest.approx(_lr_by_hand(s, steps, warm, lr, min_ratio), rel=1e-12, abs=0), s
    if warm:
        assert got[0] == pytest.approx(lr / warm, rel=1e-12) and got[warm - 1] == pytest.approx(lr, rel=1e-12)
    if steps - warm > 1:
        assert got[warm] == pytest.approx(lr, rel=1e-12)
        assert got[-1] == pytest.approx(min_ratio * lr, rel=1e-12)
    assert all(a >= b for a, b in zip(got[warm:], got[warm + 1:]))


# -- data ---------------------------------------------------------------------------------------

def test_packed_data_is_deterministic_exact_and_split_by_work():
    from archsearch.trainers.data import prepare_data

    d = prepare_data(DATA)
    assert d.vocab_size == 2048
    assert d.n_train_seqs == len(d.train_tokens) // 64 and d.n_val_seqs > 100
    a, b = d.train_batch(100, 8, seed=0), d.train_batch(100, 8, seed=0)
    assert (a == b).all() and a.shape == (8, 64)
    assert not (a == d.train_batch(100, 8, seed=1)).all()
    # one epoch visits every chunk exactly once
    n = d.n_train_seqs
    assert sorted(d._perm(0, 0)) == list(range(n))
    text_val = d.tokenizer.decode(d.val_tokens[:2000])
    assert "HAMLET" in text_val.upper()
    assert set(d.info["val_works"]) == {"hamlet", "julius_caesar", "tempest"}


def test_local_jsonl_source_and_text_field(tmp_path):
    from archsearch.trainers.data import prepare_data

    f = tmp_path / "docs.jsonl"
    f.write_text("".join(json.dumps({"body": f"document {i} says hello world " * 20}) + "\n"
                         for i in range(40)))
    d = prepare_data(DataConfig(source=str(f), tokenizer="bpe:300", seq_len=16, text_field="body",
                                val_fraction=0.1, cache_dir=str(tmp_path / "cache")))
    assert d.info["documents"] == 40 and "every 10th" in d.info["val_rule"]
    assert len(d.train_tokens) > 0 and len(d.val_tokens) > 0
    with pytest.raises(ArchsearchError, match="text_field"):
        prepare_data(DataConfig(source=str(f), tokenizer="bpe:300", seq_len=16,
                                cache_dir=str(tmp_path / "cache")))


# -- a tiny real run ------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def done_run(tmp_path_factory):
    from archsearch.trainers import train

    out = tmp_path_factory.mktemp("runs") / "full"
    rec = train(SPEC, TRAIN, DATA, out, progress=False)
    return out, rec


def test_tiny_run_learns_and_writes_a_loadable_model(done_run):
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    out, rec = done_run
    assert rec["status"] == "ok", rec.get("reason")
    # uniform guessing is ln(2048) = 7.62 nats; 150 small steps must get far below it
    assert rec["final_eval_loss"] < math.log(2048) - 1.5
    assert rec["tokens"] == 150 * 16 * 64 and rec["steps"] == 150
    assert rec["smoothed_train_loss"] < math.log(2048) - 1.0
    assert rec["tokens_per_s"] > 0 and 0 < rec["mfu"] < 1
    assert rec["provenance"]["versions"]["torch"] and rec["device"] == "cpu"
    assert rec["dtype"] == "float32" and rec["attn_implementation"] == "sdpa"
    assert json.loads((out / "run.json").read_text())["final_eval_loss"] == rec["final_eval_loss"]
    model = AutoModelForCausalLM.from_pretrained(out / "model")
    tok = AutoTokenizer.from_pretrained(out / "model")
    assert len(tok) == 2048 and model.config.num_hidden_layers == 2
    ids = torch.tensor([tok("To be, or not to be")["input_ids"]])
    assert torch.isfinite(model(input_ids=ids).logits).all()


def test_finished_run_is_skipped(done_run):
    from archsearch.trainers import train

    out, rec = done_run
    before = (out / "metrics.jsonl").read_text()
    t = time.perf_counter()
    again = train(SPEC, TRAIN, DATA, out, progress=False)
    assert again == json.loads((out / "run.json").read_text()) and time.perf_counter() - t < 2
    assert (out / "metrics.jsonl").read_text() == before


@pytest.mark.slow
def test_resume_after_kill_matches_uninterrupted(done_run, tmp_path):
    """Really kill (SIGKILL) a CLI run after its second checkpoint, then run it again."""
    from archsearch.trainers import train

    out = tmp_path / "killed"
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    proc = subprocess.Popen([sys.executable, "-m", "archsearch", "train", *ARCH_FLAGS, *TRAIN_FLAGS,
                             "--out", str(out), "--no-progress"], cwd=REPO, env=env,
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    deadline = time.time() + 240
    while time.time() < deadline and proc.poll() is None:
        if (out / "checkpoints" / "step_00000050" / "state.json").is_file():
            break
        time.sleep(0.05)
    assert proc.poll() is None, f"run ended before the kill: {proc.stderr.read().decode()[-2000:]}"
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    assert json.loads((out / "run.json").read_text())["status"] == "running"
    rec = train(SPEC, TRAIN, DATA, out, progress=False)
    assert rec["status"] == "ok" and rec["resumed_from_step"] >= 50
    # Data order and LR are functions of the step, and model/optimizer/RNG are restored, so on
    # the same CPU and thread count the resumed run should match to float rounding. Tolerance:
    # 1e-3 nats absolute.
    full = done_run[1]
    assert abs(rec["final_eval_loss"] - full["final_eval_loss"]) < 1e-3, (rec["final_eval_loss"], full["final_eval_loss"])
    assert abs(rec["smoothed_train_loss"] - full["smoothed_train_loss"]) < 1e-3


def test_a_save_cut_short_leaves_the_last_checkpoint_and_the_resume_is_exact(done_run, tmp_path, monkeypatch):
    """A process that dies inside a checkpoint save (accelerate has written part of it) leaves
    the previous checkpoint the one a rerun resumes from, and the resumed run ends bit for bit
    where the uninterrupted one did (same process, same threads)."""
    from accelerate import Accelerator

    from archsearch.trainers import train

    class Killed(BaseException):
        pass

    real, saves = Accelerator.save_state, []

    def dies_in_the_second_save(self, output_dir=None, **kw):
        saves.append(output_dir)
        if len(saves) == 2:
            Path(output_dir).mkdir(parents=True, exist_ok=True)
            (Path(output_dir) / "model.safetensors").write_bytes(b"torn")
            raise Killed
        return real(self, output_dir, **kw)

    monkeypatch.setattr(Accelerator, "save_state", dies_in_the_second_save)
    out = tmp_path / "cut"
    with pytest.raises(Killed):
        train(SPEC, TRAIN, DATA, out, progress=False)
    monkeypatch.undo()
    assert sorted(p.name for p in (out / "checkpoints").iterdir()) == [".tmp_step_00000050", "step_00000025"]
    rec = train(SPEC, TRAIN, DATA, out, progress=False)
    assert rec["status"] == "ok" and rec["resumed_from_step"] == 25
    full = done_run[1]
    for key in ("final_eval_loss", "smoothed_train_loss"):
        assert rec[key] == full[key], key
    assert sorted(p.name for p in (out / "checkpoints").iterdir()) == ["step_00000125"]


def test_a_checkpoint_of_the_earlier_layout_is_refused_by_name(done_run, tmp_path):
    import shutil

    from archsearch.trainers import train

    out = tmp_path / "old"
    shutil.copytree(done_run[0], out)
    rec = json.loads((out / "run.json").read_text())
    (out / "run.json").write_text(json.dumps({**rec, "status": "running"}))
    ckpt = next((out / "checkpoints").iterdir())
    for f in ckpt.iterdir():
        if f.name != "state.json":
            f.unlink()
    (ckpt / "model.pt").write_bytes(b"")
    before = _snapshot(out)
    with pytest.raises(ArchsearchError, match="model.pt") as e:
        train(SPEC, TRAIN, DATA, out, progress=False)
    assert e.value.field == "out" and "--overwrite" in str(e.value)
    assert _snapshot(out) == before


def _half_finished(done_run, out: Path) -> Path:
    """A copy of the finished run marked as killed half-way (its last checkpoint kept)."""
    import shutil

    shutil.copytree(done_run[0], out)
    rec = json.loads((out / "run.json").read_text())
    (out / "run.json").write_text(json.dumps({**rec, "status": "running"}))
    return out


@pytest.mark.parametrize("tc, dc, named", [
    (dataclasses.replace(TRAIN, lr=TRAIN.lr / 2), DATA, "train.lr"),
    (dataclasses.replace(TRAIN, global_batch_size=8), DATA, "train.global_batch_size"),
    (dataclasses.replace(TRAIN, warmup_steps=3), DATA, "train.warmup_steps"),
    (TRAIN, dataclasses.replace(DATA, seq_len=32), "data.seq_len"),
    (TRAIN, dataclasses.replace(DATA, tokenizer="bpe:1024"), "data.tokenizer"),
])
def test_a_run_resumed_with_other_settings_is_refused(done_run, tmp_path, tc, dc, named):
    """The run's fingerprint (its trajectory's settings, stored in run.json) is checked on resume:
    a half-finished run is never continued with another learning rate, batch, warm-up or data."""
    from archsearch.trainers import train

    out = _half_finished(done_run, tmp_path / "half")
    before = _snapshot(out)
    with pytest.raises(ArchsearchError, match=named.replace(".", r"\.")) as e:
        train(SPEC, tc, dc, out, progress=False)
    assert e.value.field == "out" and "--overwrite" in str(e.value)
    assert _snapshot(out) == before


@pytest.mark.parametrize("damage", ["truncate-weights", "truncate-optimizer", "state-json"])
def test_a_damaged_checkpoint_is_named_before_any_work(done_run, tmp_path, damage):
    from archsearch.trainers import train

    out = _half_finished(done_run, tmp_path / "torn")
    ckpt = sorted((out / "checkpoints").iterdir())[-1]
    name = {"truncate-weights": "model.safetensors", "truncate-optimizer": "optimizer.bin",
            "state-json": "state.json"}[damage]
    data = (ckpt / name).read_bytes()
    (ckpt / name).write_bytes(data[: len(data) // 2])
    before = _snapshot(out)
    with pytest.raises(ArchsearchError, match=name) as e:
        train(SPEC, TRAIN, DATA, out, progress=False)
    assert e.value.field == "out" and str(ckpt) in e.value.fix
    assert _snapshot(out) == before


def test_a_run_folder_follows_the_umask(tmp_path):
    """Under umask 002 every file and folder a run writes is group-writable, the weights and the
    checkpoints included (safetensors writes 0600 of its own)."""
    from archsearch.trainers import train

    out = tmp_path / "shared"
    old = os.umask(0o002)
    try:
        rec = train(SPEC, dataclasses.replace(TRAIN, tokens=10 * 16 * 64, checkpoint_interval=5, warmup_steps=2),
                    DATA, out, progress=False)
    finally:
        os.umask(old)
    assert rec["status"] == "ok"
    assert (out / "model" / "model.safetensors").is_file() and list((out / "checkpoints").iterdir())
    private = [str(p.relative_to(out)) for p in out.rglob("*") if not p.stat().st_mode & 0o020]
    assert not private, f"not group-writable under umask 002: {private}"


# -- bad input leaves earlier runs intact --------------------------------------------------------

def _snapshot(out: Path) -> dict[str, bytes]:
    return {str(p.relative_to(out)): p.read_bytes() for p in sorted(out.rglob("*")) if p.is_file()}


@pytest.mark.parametrize("spec, tc, dc, field", [
    (SPEC, TrainConfig(tokens=1000, global_batch_size=16), DATA, "train.tokens"),
    (SPEC.replace(vocab_size=32000), TRAIN, DATA, "vocab_size"),
    (SPEC, TRAIN, DataConfig(source="no_such_dataset", seq_len=64), "data.source"),
    (SPEC, TRAIN, DataConfig(source="hf:no-such-org/no-such-dataset", seq_len=64), "data.source"),
    (SPEC, TrainConfig(tokens=20 * 16 * 64, global_batch_size=16, warmup_steps=20), DATA,
     "train.warmup_steps"),
])
def test_bad_input_is_a_clear_error_and_leaves_runs_intact(done_run, spec, tc, dc, field):
    from archsearch.trainers import train

    out, _ = done_run
    before = _snapshot(out)
    with pytest.raises(ArchsearchError) as e:
        train(spec, tc, dc, out.parent / "bad", progress=False)
    assert e.value.field == field, str(e.value)
    assert e.value.fix, "the error must say how to fix it"
    assert not (out.parent / "bad").exists()
    assert _snapshot(out) == before


def test_cli_architecture_that_does_not_build(tmp_path, capsys, monkeypatch):
    # in this process (the CLI's main, exit code and stderr as a subprocess would give them): a
    # subprocess would spend minutes of a loaded machine importing transformers for one error line
    import archsearch.cli.train as cli_train
    import archsearch.trainers.data as data
    from archsearch.cli import main

    def no_work(*a, **kw):  # both are refused before the data (or the tokenizer) is prepared
        raise AssertionError("data prepared before the bad input was refused")

    monkeypatch.setattr(cli_train, "prepare_data", no_work)
    monkeypatch.setattr(data, "prepare_data", no_work)

    rc = main(["train", "--layers", "2", "--hidden-size", "64", "--heads", "3", "--kv-heads", "2",
               "--head-dim", "32", "--ffn", "192", "--vocab-size", "2048", "--tokens", "1e5",
               "--out", str(tmp_path / "x")])
    err = capsys.readouterr().err
    assert rc == 2 and "n_kv_heads" in err and "Traceback" not in err
    rc = main(["train", *ARCH_FLAGS[:-2], "--vocab-size", "32000", "--tokens", "1e5", "--seq-len", "64",
               "--out", str(tmp_path / "y")])
    err = capsys.readouterr().err
    assert rc == 2 and "vocab_size" in err and "--match-vocab" in err and "Traceback" not in err
    assert not (tmp_path / "x").exists() and not (tmp_path / "y").exists()


def test_divergence_stops_the_run_as_failed(tmp_path):
    from archsearch.trainers import train

    tc = TrainConfig(tokens=40 * 16 * 64, global_batch_size=16, lr=10.0, warmup_steps=1,
                     eval_batches=2)
    # the config refuses a learning rate over 10; the loop must still catch a run that diverges
    # (from any cause): force one past the check
    object.__setattr__(tc, "lr", 30.0)
    rec = train(SPEC, tc, DATA, tmp_path / "div", progress=False)
    assert rec["status"] == "failed"
    assert "non-finite" in rec["reason"] or "diverged" in rec["reason"]
    assert rec["tokens_trained"] < rec["tokens"]
    assert not (tmp_path / "div" / "model").exists()


@pytest.mark.slow
def test_log_with_tensorboard_through_accelerate(tmp_path):
    pytest.importorskip("tensorboard")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    from archsearch.trainers import train

    tc = TrainConfig(tokens=10 * 16 * 64, global_batch_size=16, lr=3e-3, eval_batches=2, log_interval=5,
                     log_with="tensorboard")
    rec = train(SPEC, tc, DATA, tmp_path / "tb", progress=False)
    assert rec["status"] == "ok" and tc.log_with == ("tensorboard",)
    events = list((tmp_path / "tb" / "tracking").rglob("events.out.tfevents.*"))
    assert events, "accelerate's TensorBoard tracker wrote nothing"
    scalars = set()
    for ev in events:
        acc = EventAccumulator(str(ev.parent))
        acc.Reload()
        scalars |= set(acc.Tags()["scalars"])
    assert {"loss", "smoothed_loss", "eval_loss", "lr"} <= scalars, scalars


# -- sweep --------------------------------------------------------------------------------------

def test_sweep_skips_done_runs_and_records_failures(tmp_path):
    from archsearch.rundata import read_runs
    from archsearch.trainers import run_sweep
    from archsearch.candidates import BuildSettings

    cfg = SweepConfig(
        name="t", params=[6e4], n_layers=2, hidden_over_sqrt_n=[0.25, 0.6], mlp_to_attn=[1.0],
        gqa=2, head_dim=32, build=BuildSettings(hidden_multiple=32, ffn_multiple=32, tolerance=0.1, on_r_drift="flag"),
        train=TrainConfig(tokens=30 * 8 * 64, global_batch_size=8, lr=3e-3, eval_batches=2),
        data=DATA)
    rows = run_sweep(cfg, tmp_path, progress=False)
    # 0.6 * sqrt(6e4) -> hidden 160 leaves no room within 10% of N: recorded, not trained
    assert len(rows) == 1 and rows[0].status == "ok" and rows[0].loss_kind == "eval"
    fails = [json.loads(x) for x in (tmp_path / "failures.jsonl").read_text().splitlines()]
    assert len(fails) == 1 and fails[0]["stage"] == "build" and "params" in fails[0]["reason"]
    table = read_runs(tmp_path / "runs.csv")
    assert [r.run_id for r in table] == [rows[0].run_id] and table[0].loss == pytest.approx(rows[0].loss)
    run_json = tmp_path / "runs" / rows[0].run_id / "run.json"
    stamp = run_json.stat().st_mtime_ns
    t = time.perf_counter()
    again = run_sweep(cfg, tmp_path, progress=False)
    assert run_json.stat().st_mtime_ns == stamp and time.perf_counter() - t < 15
    assert [r.loss for r in again] == [r.loss for r in rows]


# -- launch ---------------------------------------------------------------------------------------

def test_launch_writes_config_and_valid_multi_node_commands(cli, tmp_path):
    import yaml
    from accelerate.commands.launch import launch_command_parser

    out = tmp_path / "big"
    r = cli("train", "--preset", "llama-3.2-1b", "--tokens", "2e10", "--hparams", "1b", "--launch",
            "--num-processes", "16", "--num-machines", "2", "--main-process-ip", "10.0.0.1",
            "--fsdp", "--out", str(out))
    assert r.returncode == 0, r.stderr
    cfg = yaml.safe_load((out / "accelerate_config.yaml").read_text())
    assert cfg["distributed_type"] == "FSDP" and cfg["num_processes"] == 16
    assert cfg["fsdp_config"]["fsdp_transformer_layer_cls_to_wrap"] == "LlamaDecoderLayer"
    cmds = [line.split() for line in r.stdout.splitlines() if not line.startswith("#")]
    assert len(cmds) == 2
    for rank, cmd in enumerate(cmds):
        assert cmd[:2] == ["accelerate", "launch"]  # printed as a person types it
        ns = launch_command_parser().parse_args(cmd[2:])  # accelerate's own parser accepts it
        assert ns.machine_rank == rank and ns.config_file == str(out / "accelerate_config.yaml")
        assert ns.module and ns.training_script == "archsearch"
        assert "--launch" not in ns.training_script_args and "--hparams" in ns.training_script_args
        assert ns.training_script_args[-2:] == ["--out", str(out)]
    # several nodes: an sbatch script, one launcher per node, its rank from Slurm
    script = (out / "launch.sbatch").read_text()
    assert "#SBATCH --nodes=2" in script and "#SBATCH --gpus-per-node=8" in script
    assert '--machine_rank "$SLURM_NODEID"' in script and "srun bash -c" in script
    assert subprocess.run(["bash", "-n", str(out / "launch.sbatch")]).returncode == 0


def test_launch_uses_the_user_s_accelerate_config(tmp_path, monkeypatch, capsys):
    """Without --num-processes, the user's `accelerate config` default is used as it is: no config
    written, accelerate reads its own default (no --config_file)."""
    from accelerate.commands.config import config_args

    from archsearch.cli import main

    mine = tmp_path / "default_config.yaml"
    monkeypatch.setattr(config_args, "default_config_file", str(mine))
    out = tmp_path / "run"
    args = ["train", "--preset", "tiny", "--tokens", "1e4", "--launch", "--out", str(out)]
    assert main(args) == 2  # none yet: --num-processes is required, and accelerate config named
    assert "accelerate config" in capsys.readouterr().err
    mine.write_text("compute_environment: LOCAL_MACHINE\nnum_processes: 2\n")
    assert main(args) == 0
    cap = capsys.readouterr()
    assert cap.out.startswith("accelerate launch -m archsearch train ") and "--config_file" not in cap.out
    assert f"using your accelerate config {mine}" in cap.err and not (out / "accelerate_config.yaml").exists()


@pytest.mark.slow
def test_a_compiled_run_computes_the_eager_run_and_resumes_either_way(tmp_path, monkeypatch):
    """train.compile: the model is compiled in place (nn.Module.compile), so its steps are the eager
    run's to float rounding; its weights keep their names (the saved model loads as any other); a
    checkpoint it wrote resumes without compile, the same run (compile is not part of a run's
    identity); the first step, which pays the compile, is timed apart. Compiled here by dynamo and
    AOTAutograd with eager kernels (torch's aot_eager backend): inductor's own kernels cost ~40 s of CPU
    more, and the GPU checks' rehearsal (tests/test_gpu_checks.py) trains through them."""
    import torch
    from transformers import AutoModelForCausalLM

    from archsearch.trainers import train

    compile_module = torch.nn.Module.compile
    monkeypatch.setattr(torch.nn.Module, "compile",
                        lambda self, *a, **kw: compile_module(self, *a, **{"backend": "aot_eager", **kw}))

    tc = TRAIN.replace(tokens=12 * 16 * 64, checkpoint_interval=6, log_interval=1)
    eager = train(SPEC, tc, DATA, tmp_path / "eager", progress=False)
    frames = torch._dynamo.utils.counters["frames"]["ok"]
    rec = train(SPEC, tc.replace(compile=True), DATA, tmp_path / "compiled", progress=False)
    assert torch._dynamo.utils.counters["frames"]["ok"] > frames, "nothing was compiled"
    assert rec["status"] == "ok"
    assert rec["train_config"]["compile"] is True and eager["train_config"]["compile"] is False
    losses = [[r["loss"] for r in map(json.loads, (tmp_path / n / "metrics.jsonl").read_text().splitlines())
               if "loss" in r] for n in ("eager", "compiled")]
    assert len(losses[0]) == 12 and losses[1] == pytest.approx(losses[0], rel=1e-3)
    assert rec["final_eval_loss"] == pytest.approx(eager["final_eval_loss"], rel=1e-3)
    assert rec["first_step_s"] > 0 and rec["steady_tokens_per_s"] > 0
    model = AutoModelForCausalLM.from_pretrained(tmp_path / "compiled" / "model")
    assert not any("_orig_mod" in k for k in model.state_dict())
    # the compiled run's checkpoint at step 6, resumed eagerly: accepted, and the same run
    half = tmp_path / "half"
    shutil.copytree(tmp_path / "compiled", half)
    state = json.loads((half / "run.json").read_text())
    (half / "run.json").write_text(json.dumps({**state, "status": "running"}))
    shutil.rmtree(half / "model")
    again = train(SPEC, tc, DATA, half, progress=False)
    assert again["resumed_from_step"] == 6 and again["train_config"]["compile"] is False
    assert again["final_eval_loss"] == pytest.approx(eager["final_eval_loss"], rel=1e-3)


@pytest.mark.gpu
def test_gpu_compiled_run_in_bf16(tmp_path):
    """The compiled step on a GPU (bf16 autocast, fused AdamW), against the eager one."""
    from archsearch.trainers import train

    tc = TRAIN.replace(checkpoint_interval=None)
    eager = train(SPEC, tc, DATA, tmp_path / "eager", progress=False)
    rec = train(SPEC, tc.replace(compile=True), DATA, tmp_path / "compiled", progress=False)
    assert rec["status"] == "ok" and rec["dtype"] == "bfloat16" and rec["train_config"]["compile"] is True
    assert rec["final_eval_loss"] == pytest.approx(eager["final_eval_loss"], abs=0.05)


@pytest.mark.gpu
def test_gpu_run_uses_bf16(tmp_path):
    from archsearch.trainers import train

    rec = train(SPEC, TRAIN.replace(checkpoint_interval=None), DATA, tmp_path / "gpu", progress=False)
    assert rec["status"] == "ok" and rec["dtype"] == "bfloat16" and rec["device"] != "cpu"
    assert rec["final_eval_loss"] < math.log(2048) - 1.5


def test_hparams_per_level_applies_the_method_table():
    from archsearch.trainers.config import SweepConfig, TrainConfig

    cfg = SweepConfig(name="s", params=[8e7, 1.45e8, 2.97e8], hidden_over_sqrt_n=[0.07], mlp_to_attn=[2.0],
                      train=TrainConfig(tokens_per_param=100), hparams_per_level=["80m", "145m", "297m"])
    assert [cfg.train_for(i).lr for i in range(3)] == [1.5e-3, 1e-3, 8e-4]
    assert [cfg.train_for(i).global_batch_size for i in range(3)] == [256, 256, 512]
    assert cfg.train_for(2).warmup_steps == 500 and cfg.train_for(2).min_lr_ratio == 0.1
    with pytest.raises(ArchsearchError, match="hparams_per_level"):
        SweepConfig(name="s", params=[8e7, 1.45e8], hidden_over_sqrt_n=[0.07], mlp_to_attn=[2.0],
                    train=TrainConfig(tokens_per_param=100), hparams_per_level=["80m"])


def test_lora_finetune_from_a_trained_model(done_run, cli, tmp_path):
    """--init-from + --lora-rank: peft adapters on the attention only, the rest frozen; the
    saved model is the merged one and the adapter is kept beside it."""
    import torch
    from safetensors.torch import load_file

    pytest.importorskip("peft")
    src, base = done_run
    out = tmp_path / "lora"
    flags = ["--tokens", str(20 * 8 * 64), "--global-batch-size", "8", "--lr", "1e-3", "--seq-len", "64",
             "--data", "shakespeare", "--tokenizer", "bpe:2048", "--eval-batches", "4"]
    r = cli("train", "--init-from", str(src / "model"), "--lora-rank", "4", "--lora-targets", "q_proj,v_proj",
            *flags, "--out", str(out), "--no-progress", "--json")
    assert r.returncode == 0, r.stderr
    rec = json.loads((out / "run.json").read_text())
    assert rec["status"] == "ok" and rec["init_from"] == str(src / "model")
    # rank 4 on q (64 -> 96) and v (64 -> 32) in 2 layers: 2 * 4 * ((64 + 96) + (64 + 32))
    assert rec["lora"]["trainable_params"] == 2 * 4 * (160 + 96)
    # it starts from the trained weights: far below a fresh model's loss (ln 2048 = 7.6)
    assert rec["final_eval_loss"] < base["final_eval_loss"] + 0.3
    assert (out / "model" / "adapter" / "adapter_config.json").is_file()
    before, after = load_file(src / "model" / "model.safetensors"), load_file(out / "model" / "model.safetensors")
    mlp = "model.layers.0.mlp.down_proj.weight"
    assert torch.equal(before[mlp], after[mlp])  # frozen
    q = "model.layers.0.self_attn.q_proj.weight"
    assert not torch.equal(before[q], after[q])  # adapters merged in


def test_lora_flags_are_checked():
    with pytest.raises(ArchsearchError, match="train.lora_targets"):
        TrainConfig(tokens=1e4, lora_rank=4, lora_targets="lm_head")
    with pytest.raises(ArchsearchError, match="train.lora_rank"):
        TrainConfig(tokens=1e4, lora_rank=0)
    with pytest.raises(ArchsearchError, match="train.init_from"):
        TrainConfig(tokens=1e4, init_from="/nonexistent")
