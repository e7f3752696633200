"""Threshold calibration: the choice rule and the preset files it writes."""

import json

import pytest

from diffkv_jax import presets
from scripts.calibrate import choose

ROWS = [
    dict(alpha_high=1, alpha_low=0.02, ppl_increase=0.005, agreement=0.97, memory_ratio=0.50),
    dict(alpha_high=1, alpha_low=0.1, ppl_increase=0.015, agreement=0.96, memory_ratio=0.44),
    dict(alpha_high=2, alpha_low=0.2, ppl_increase=0.030, agreement=0.93, memory_ratio=0.35),
    dict(alpha_high=2, alpha_low=0.1, ppl_increase=0.010, agreement=0.94, memory_ratio=0.40),
]


def test_choose_takes_least_memory_within_budget():
    assert choose(ROWS, 0.02, 0.95)["memory_ratio"] == 0.44
    # A looser agreement budget admits the 0.40 setting but not the 0.35 one (ppl +3%).
    assert choose(ROWS, 0.02, 0.90)["memory_ratio"] == 0.40
    assert choose(ROWS, 0.05, 0.90)["memory_ratio"] == 0.35
    assert choose(ROWS, 0.001, 0.99) is None


def test_choose_drops_settings_that_lose_passkeys():
    """A setting that loses keys the uncompressed cache retrieves is out, however small."""
    rows = [dict(r) for r in ROWS]
    rows[0]["retrieval"] = 0.8
    rows[1]["retrieval"] = 0.5  # the 0.44 setting loses half the keys
    rows[3]["retrieval"] = 1.0
    assert choose(rows, 0.02, 0.95, min_retrieval=1.0) is None
    assert choose(rows, 0.02, 0.90, min_retrieval=1.0)["memory_ratio"] == 0.40
    assert choose(rows, 0.02, 0.95, min_retrieval=0.5)["memory_ratio"] == 0.44
    # Rows without a retrieval entry (no passkeys asked) are not held to it.
    assert choose(ROWS, 0.02, 0.95, min_retrieval=1.0)["memory_ratio"] == 0.44


def test_calibration_passkeys_differ_from_the_evaluation_ones():
    """Same lengths and depths, other keys and haystacks (seed 1 against the evaluation's 0)."""
    from diffkv_jax.evaluation.datasets import load_passkey
    from scripts.calibrate import CALIBRATION_PASSKEY_SEED

    def encode(text):  # a word-level stand-in tokenizer
        return text.split()

    assert CALIBRATION_PASSKEY_SEED != 0
    cal = load_passkey(encode, lengths=(300,), seed=CALIBRATION_PASSKEY_SEED, limit=5)
    ev = load_passkey(encode, lengths=(300,), limit=5)
    assert {e.passkey for e in cal}.isdisjoint({e.passkey for e in ev})
    assert all(c.prompt != e.prompt for c, e in zip(cal, ev))


def test_preset_roundtrip_and_lookup_order(tmp_path, monkeypatch):
    monkeypatch.setenv("DIFFKV_JAX_PRESETS", str(tmp_path / "user"))
    assert presets.load_preset("no-such-model") is None
    path = presets.save_preset("My/Model", {"alpha_high": 2.0, "alpha_low": 0.1}, {"why": "test"})
    assert path.parent == tmp_path / "user"
    options, found = presets.load_preset("My/Model")
    assert options == {"alpha_high": 2.0, "alpha_low": 0.1} and found == path
    assert json.loads(path.read_text())["provenance"] == {"why": "test"}
    # The user's preset wins over a shipped one of the same name.
    shipped = tmp_path / "shipped"
    monkeypatch.setattr(presets, "SHIPPED_DIR", shipped)
    presets.save_preset("My/Model", {"alpha_high": 9.0, "alpha_low": 0.0}, {}, shipped)
    assert presets.load_preset("My/Model")[0]["alpha_high"] == 2.0
    path.unlink()
    assert presets.load_preset("My/Model")[0]["alpha_high"] == 9.0


def test_preset_rejects_unknown_options(tmp_path):
    with pytest.raises(ValueError, match="not preset options"):
        presets.save_preset("m", {"alpha_high": 1.0, "page_size": 8}, {}, tmp_path)


def test_cli_thresholds_come_from_the_preset_unless_given(tmp_path, monkeypatch):
    from diffkv_jax.cli import diffkv_thresholds

    monkeypatch.setenv("DIFFKV_JAX_PRESETS", str(tmp_path))
    monkeypatch.setattr(presets, "SHIPPED_DIR", tmp_path / "none")
    assert diffkv_thresholds("m", None, None) == {"alpha_high": 1.0, "alpha_low": 0.02,
                                                  "obs_window": 64}
    presets.save_preset("m", {"alpha_high": 2.0, "alpha_low": 0.1}, {})
    assert diffkv_thresholds("m", None, None) == {"alpha_high": 2.0, "alpha_low": 0.1,
                                                  "obs_window": 64}
    # Any threshold given on the command line turns the preset off.
    assert diffkv_thresholds("m", 1.5, None) == {"alpha_high": 1.5, "alpha_low": 0.02,
                                                 "obs_window": 64}
    # A preset calibrated with every prompt query counted keeps that window...
    presets.save_preset("m", {"alpha_high": 2.0, "alpha_low": 0.1, "obs_window": None}, {})
    assert diffkv_thresholds("m", None, None)["obs_window"] is None
    # ...unless --obs-window says otherwise (0: every query).
    assert diffkv_thresholds("m", None, None, 32)["obs_window"] == 32
    assert diffkv_thresholds("m", 1.0, None, 0)["obs_window"] is None


def test_shipped_preset_for_the_embedded_model(tmp_path, monkeypatch):
    monkeypatch.setenv("DIFFKV_JAX_PRESETS", str(tmp_path))  # no user presets
    options, path = presets.load_preset("smollm2-135m")
    assert path.parent == presets.SHIPPED_DIR
    assert options["alpha_high"] > options["alpha_low"] >= 0
