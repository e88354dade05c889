"""Checkpoints shipped inside kvflow (see README.md beside this file for how they were trained).

`bundled_model_dir("target")` is the default model of `kvflow demo` and of every command whose
MODEL argument is omitted, so a first run needs nothing downloaded.
"""

from __future__ import annotations

from pathlib import Path

from kvflow.errors import ModelLoadError

ASSETS_DIR = Path(__file__).resolve().parent
BUNDLED_MODELS = {"target": "tiny-target", "draft": "tiny-draft"}


def bundled_model_dir(name: str = "target") -> Path:
    if name not in BUNDLED_MODELS:
        raise ModelLoadError(f"no bundled model {name!r}; bundled: {', '.join(BUNDLED_MODELS)}")
    path = ASSETS_DIR / BUNDLED_MODELS[name]
    if not (path / "config.json").is_file():
        raise ModelLoadError(
            f"the bundled {name} model is not in this kvflow build ({path}); pass a checkpoint directory"
        )
    return path


def shared_css() -> str:
    """kvflow.css: the one look of the dashboard and the bench and doctor HTML reports."""
    return (ASSETS_DIR / "kvflow.css").read_text()
