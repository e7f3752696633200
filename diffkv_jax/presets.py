"""Per-model DiffKV thresholds chosen by ``scripts/calibrate.py``.

A preset is a small JSON file: the DiffKV options (``alpha_high``,
``alpha_low``, ...) plus how they were chosen. Lookup order for a model name:

1. ``$DIFFKV_JAX_PRESETS/<name>.json`` (default ``~/.cache/diffkv-jax/presets``),
   where ``calibrate.py`` writes;
2. the presets shipped in ``diffkv_jax/presets/<name>.json``.

``--kv diffkv`` applies the preset of the model it serves unless thresholds
are given explicitly.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

SHIPPED_DIR = Path(__file__).with_name("presets")
#: Options a preset may set (the rest of a DiffKV configuration stays at its defaults).
PRESET_OPTIONS = ("alpha_high", "alpha_low", "window", "obs_window", "low_tier")


def user_dir() -> Path:
    return Path(os.environ.get("DIFFKV_JAX_PRESETS",
                               Path.home() / ".cache" / "diffkv-jax" / "presets"))


def _file_name(model: str) -> str:
    safe = "".join(c if c.isalnum() or c in "-_." else "_" for c in model.lower())
    return f"{safe}.json"


def save_preset(model: str, options: dict[str, Any], provenance: dict[str, Any],
                directory: str | os.PathLike | None = None) -> Path:
    """Write the preset of ``model``; returns its path."""
    unknown = set(options) - set(PRESET_OPTIONS)
    if unknown:
        raise ValueError(f"not preset options: {sorted(unknown)}")
    path = Path(directory or user_dir()) / _file_name(model)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({"model": model, "options": options,
                                "provenance": provenance}, indent=1) + "\n")
    return path


def load_preset(model: str) -> tuple[dict[str, Any], Path] | None:
    """``(options, path)`` of the first preset found for ``model``, or None."""
    for directory in (user_dir(), SHIPPED_DIR):
        path = Path(directory) / _file_name(model)
        if path.is_file():
            data = json.loads(path.read_text())
            options = {k: v for k, v in data.get("options", {}).items() if k in PRESET_OPTIONS}
            return options, path
    return None
