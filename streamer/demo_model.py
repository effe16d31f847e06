"""Where the embedded demo model lives.

streamer ships a tiny Llama-architecture checkpoint (a few MB, trained by ``tools/train_demo_model.py``
on the Python standard library's source) as package data in ``streamer/default_model/``, so that
``streamer serve`` and ``streamer generate`` work with no model argument on a machine that cannot
download anything. It writes small, plausible-looking Python; it is a demo and a test fixture, not a
useful assistant. See docs/demo_model.md.
"""
from __future__ import annotations

import atexit
import contextlib
import importlib.resources
import pathlib
import tempfile

DEFAULT_MODEL_NAME = "streamer-demo-pycode"  # what `streamer serve` reports as the model id by default
REQUIRED_FILES = ("config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json")

_exit_stack: contextlib.ExitStack | None = None
_cached: pathlib.Path | None = None


class DemoModelMissingError(FileNotFoundError):
    """The packaged demo checkpoint is not where it should be (a broken or partial install)."""


def default_model_path() -> pathlib.Path:
    """The folder of the packaged demo checkpoint, as a real directory on disk.

    A normal install (wheel, sdist or editable) keeps package data on disk, so this is the folder
    inside the installed package. When the package is imported from a zip, the folder is extracted
    to a temporary directory that lives until the interpreter exits.
    """
    global _exit_stack, _cached
    if _cached is not None and _cached.is_dir():
        return _cached
    resource = importlib.resources.files("streamer") / "default_model"
    if isinstance(resource, pathlib.Path):
        path = resource
    elif not resource.is_dir():
        path = pathlib.Path(str(resource))  # nothing there: reported below
    else:  # not a plain file system (e.g. zipimport): copy it out (as_file() takes folders only from 3.12)
        if _exit_stack is None:
            _exit_stack = contextlib.ExitStack()
            atexit.register(_exit_stack.close)
        path = pathlib.Path(_exit_stack.enter_context(tempfile.TemporaryDirectory(prefix="streamer-demo-model-")))
        for item in resource.iterdir():
            if item.is_file():
                (path / item.name).write_bytes(item.read_bytes())
    missing = [name for name in REQUIRED_FILES if not (path / name).is_file()]
    if missing:
        raise DemoModelMissingError(
            f"the embedded demo model is missing from this streamer install ({path}: no "
            f"{', '.join(missing)}). Reinstall streamer (its wheel carries streamer/default_model/), "
            "regenerate it with `python tools/train_demo_model.py` from a source checkout, "
            "or pass a model folder explicitly."
        )
    _cached = path.resolve()
    return _cached
