"""Data at scale: a token budget that would repeat the source is refused before any training,
with the numbers, unless ``data.max_epochs`` allows it."""

from __future__ import annotations

import numpy as np
import pytest

from archsearch.candidates import BuildSettings
from archsearch.errors import ArchsearchError
from archsearch.trainers.config import DataConfig, SweepConfig, TrainConfig
from archsearch.trainers.data import PreparedData, check_epochs


def _data(train_tokens: int, seq_len: int = 10) -> PreparedData:
    return PreparedData(tokenizer=None, train_tokens=np.zeros(train_tokens, np.uint16),
                        val_tokens=np.zeros(100, np.uint16), seq_len=seq_len, info={"source": "corpus-x"})


def test_check_epochs_refuses_repetition_with_the_numbers():
    d = _data(1005)  # 100 whole sequences: 1,000 usable tokens
    check_epochs(d, 1000, 1.0, "run r")  # exactly one pass is fine
    with pytest.raises(ArchsearchError, match=r"data\.max_epochs: run r needs 2,500 training tokens but "
                                              r"corpus-x holds 1,000 \(2\.50 epochs > max_epochs=1\)"):
        check_epochs(d, 2500, 1.0, "run r")
    check_epochs(d, 2500, 2.5, "run r")  # allowed explicitly


def test_max_epochs_must_be_positive():
    with pytest.raises(ArchsearchError, match="data.max_epochs"):
        DataConfig(max_epochs=0)


def test_sweep_over_a_small_source_fails_before_training(tmp_path):
    from archsearch.trainers import run_sweep

    f = tmp_path / "small.txt"
    f.write_text("".join(f"line {i}: {i % 97} quick foxes jump over {i * 7} lazy dogs.\n" for i in range(800)))
    data = DataConfig(source=str(f), tokenizer="bpe:300", seq_len=16, cache_dir=str(tmp_path / "cache"))
    cfg = SweepConfig(name="s", params=[6e4], n_layers=2, hidden_over_sqrt_n=[0.25], mlp_to_attn=[1.0], gqa=2,
                      head_dim=32, build=BuildSettings(hidden_multiple=32, ffn_multiple=32, tolerance=0.1, on_r_drift="flag"),
                      train=TrainConfig(tokens_per_param=10.0, global_batch_size=8), data=data)
    with pytest.raises(ArchsearchError, match=r"data\.max_epochs: sweep s's largest run needs 6\d\d,\d{3} "
                                              r"training tokens .* epochs > max_epochs=1"):
        run_sweep(cfg, tmp_path / "sweep", progress=False)
    assert not (tmp_path / "sweep" / "runs").exists()  # nothing trained
