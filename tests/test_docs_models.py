"""docs/models.md and the model registry (streamer/models/registry.py) agree: every architecture name the registry
accepts is in the page's tables and every name in them is accepted, each row's Modalities cell is what the registry
says the name does, its bold notes are the capabilities the registry declares for it, the counts in the page's opening
are the registry's, and the GGUF table is models/gguf.py's. Reads the tables only; no model is built or loaded."""
from __future__ import annotations

import re
from pathlib import Path
from typing import NamedTuple

from streamer.models import registry

MODELS_MD = Path(__file__).resolve().parent.parent / "docs" / "models.md"
# The bold notes, and the registry capability each one stands for
NOTES = {"recurrent state": lambda m: m.recurrent_state, "MLA": lambda m: m.mla,
         "MTP drafts": lambda m: m.mtp is not None, "no tensor parallelism": lambda m: bool(m.no_tensor_parallel)}


class Row(NamedTuple):
    name: str
    cells: list[str]


def documented() -> dict[str, list[Row]]:
    """The rows of docs/models.md's tables, by the table's first header cell ("Architecture" or "GGUF
    architecture"); each row's name is the one `code` span of its first cell."""
    tables: dict[str, list[Row]] = {}
    header = None
    for line in MODELS_MD.read_text().splitlines():
        if not line.startswith("|"):
            header = None
            continue
        # (a cell may hold an escaped pipe, `<\|image\|>`)
        cells = [c.strip() for c in re.split(r"(?<!\\)\|", line.strip().strip("|"))]
        if header is None:
            header = cells[0]
            tables.setdefault(header, [])
        elif not set(cells[0]) <= set("-: "):
            names = re.findall(r"`([^`]+)`", cells[0])
            assert len(names) == 1, f"docs/models.md: a table row names one architecture in its first cell: {line}"
            tables[header].append(Row(names[0], cells))
    return tables


def accepted() -> dict[str, tuple[str, set[str]]]:
    """Every config.json name the registry accepts -> (its Modalities cell, its bold notes). A vision-language name
    has its own inputs and no notes (those of its text model depend on the checkpoint's text_config)."""
    out: dict[str, tuple[str, set[str]]] = {}
    for name, model, how in registry.names():
        if model is None:
            assert isinstance(how, registry.VisionLanguage)
            out[name] = (", ".join(how.inputs), set())
            continue
        if name in registry.VISION_LANGUAGE:
            continue  # (Gemma 4's: listed as a vision-language model; without a vision_config, its text model)
        assert isinstance(how, registry.Served)
        inputs = ", ".join(model.inputs)
        modality = {registry.EMBED: "embeddings", registry.CLASSIFY: "classification", registry.DRAFT: "draft tokens",
                    }.get(how.task, inputs if "text" in model.inputs else f"{inputs} → text")
        out[name] = (modality, {note for note, has in NOTES.items() if has(model)})
    return out


def test_every_accepted_architecture_is_documented_once() -> None:
    tables = documented()
    assert set(tables) == {"Architecture", "GGUF architecture"}, sorted(tables)
    rows = [r.name for r in tables["Architecture"]]
    twice = sorted({n for n in rows if rows.count(n) > 1})
    assert not twice, f"listed more than once in docs/models.md: {twice}"
    missing = set(accepted()) - set(rows)
    assert not missing, f"in streamer/models/registry.py but not in docs/models.md's tables: {sorted(missing)}"
    extra = set(rows) - set(accepted())
    assert not extra, f"in docs/models.md but not accepted by streamer/models/registry.py: {sorted(extra)}"


def test_modalities_and_notes_are_the_registrys() -> None:
    """The Modalities column says what the registry serves the name as; the bold notes are exactly the
    capabilities it declares (recurrent state, MLA, an MTP head, a refusal of tensor parallelism)."""
    want = accepted()
    wrong = []
    for row in documented()["Architecture"]:
        modality, notes = want[row.name]
        shown = set()
        for bold in re.findall(r"\*\*([^*]+)\*\*", row.cells[3]):
            shown |= {n.strip() for n in bold.split(",")}
        if row.cells[2] != modality:
            wrong.append(f"{row.name}: Modalities {row.cells[2]!r}, the registry's {modality!r}")
        if shown != notes:
            wrong.append(f"{row.name}: bold notes {sorted(shown)}, the registry's {sorted(notes)}")
    assert not wrong, "docs/models.md disagrees with streamer/models/registry.py:\n" + "\n".join(wrong)


def test_the_counts_are_the_registrys() -> None:
    text = " ".join(MODELS_MD.read_text().split())
    names = accepted()
    generative = [n for n, (modality, _) in names.items()
                  if modality not in ("embeddings", "classification", "draft tokens")]
    assert f"serves {len(generative)} generative Hugging Face architecture names" in text, len(generative)
    assert f"({len(names)} in all, speculative heads included)" in text, len(names)


def test_gguf_table_is_gguf_py() -> None:
    from streamer.models.gguf import ARCHITECTURES
    rows = documented()["GGUF architecture"]
    assert {r.name for r in rows} == set(ARCHITECTURES), "docs/models.md's GGUF table vs streamer/models/gguf.py"
    for row in rows:
        loaded_as = ARCHITECTURES[row.name].architecture
        assert row.cells[1] == f"`{loaded_as}`", row
        assert registry.entry(loaded_as).task == registry.GENERATE, row
