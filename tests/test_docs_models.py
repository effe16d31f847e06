"""docs/models.md and the code agree on the supported architectures: every `architectures` name the engine accepts
(streamer/models/config.py, the EAGLE heads' names, the GGUF architectures) is in the page's tables, and every name in
those tables is accepted. Reads the lists only; no model is built or loaded."""
from __future__ import annotations

import re
from pathlib import Path

from streamer.models import config

MODELS_MD = Path(__file__).resolve().parent.parent / "docs" / "models.md"


def accepted_hf_architectures() -> set[str]:
    """The config.json `architectures` names ModelConfig.from_dict (and the EAGLE drafter) dispatch on."""
    from streamer.models.eagle import EAGLE1, EAGLE3_NAMES
    return (set(config.SUPPORTED_ARCHITECTURES) | set(config.MULTIMODAL_ARCHITECTURES)
            | set(config.TEXT_ONLY_ARCHITECTURES) | set(config.BACKBONES) | set(config.SEQUENCE_CLASSIFIERS)
            | set(config.ENCODER_ARCHITECTURES) | {EAGLE1, *EAGLE3_NAMES})


def accepted_gguf_architectures() -> set[str]:
    from streamer.models.gguf import ARCHITECTURES
    return set(ARCHITECTURES)


def documented() -> dict[str, set[str]]:
    """The names in the first column of docs/models.md's tables, by the table's first header cell
    ("Architecture" or "GGUF architecture")."""
    tables: dict[str, set[str]] = {}
    header = None
    for line in MODELS_MD.read_text().splitlines():
        if not line.startswith("|"):
            header = None
            continue
        first = line.strip("|").split("|")[0].strip()
        if header is None:
            header = first
            tables.setdefault(header, set())
        elif not set(first) <= set("-: "):
            names = re.findall(r"`([^`]+)`", first)
            assert len(names) == 1, f"docs/models.md: a table row names one architecture in its first cell: {line}"
            tables[header].add(names[0])
    return tables


def test_every_accepted_architecture_is_documented() -> None:
    tables = documented()
    assert set(tables) == {"Architecture", "GGUF architecture"}, sorted(tables)
    missing = accepted_hf_architectures() - tables["Architecture"]
    assert not missing, f"accepted by the code but not in docs/models.md's tables: {sorted(missing)}"
    missing = accepted_gguf_architectures() - tables["GGUF architecture"]
    assert not missing, f"GGUF architectures missing from docs/models.md: {sorted(missing)}"


def test_every_documented_architecture_is_accepted() -> None:
    tables = documented()
    extra = tables["Architecture"] - accepted_hf_architectures()
    assert not extra, f"in docs/models.md but not accepted by the code: {sorted(extra)}"
    extra = tables.get("GGUF architecture", set()) - accepted_gguf_architectures()
    assert not extra, f"GGUF architectures in docs/models.md that streamer/models/gguf.py does not read: {sorted(extra)}"


def test_documented_architectures_load_through_the_config() -> None:
    """Each generative name resolves through ModelConfig's dispatch tables to a model the loader has a class for
    (checked on the loader's table, not by building anything)."""
    from streamer.models.eagle import EAGLE3, EAGLE3_NAMES
    from streamer.models.loader import _MODEL_CLASSES
    for arch in documented()["Architecture"]:
        base = (config.TEXT_ONLY_ARCHITECTURES.get(arch) or config.BACKBONES.get(arch)
                or config.SEQUENCE_CLASSIFIERS.get(arch) or (EAGLE3 if arch in EAGLE3_NAMES else arch))
        if arch in config.MULTIMODAL_ARCHITECTURES or arch in config.ENCODER_ARCHITECTURES:
            continue  # (built from their text / encoder families: models/vlm.py, ENCODER_MODELS)
        assert base in _MODEL_CLASSES, f"{arch} ({base}) has no model class in streamer/models/loader.py"
    for model in config.ENCODER_MODELS:
        assert model in _MODEL_CLASSES, model
