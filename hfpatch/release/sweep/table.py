"""MODELS.md: the model sweep's verdicts as a table a user looks their model up in, and its staleness check.

The file is generated (``hfpatch models --write``), never hand-edited. Its header names the transformers and torch
releases it was produced with; ``stale(verdicts, text, columns)`` lists every class whose verdict differs from the
file (and classes only one side has), in the main column and in each head-parallel column
(``run.HEAD_PARALLEL_COLUMNS``: a verdict for the classes of its subset, an empty cell for the others), which the
sweep's test runs whenever the installed release is the file's.
"""
from __future__ import annotations

import re
from collections import Counter
from typing import Iterable

from hfpatch import version_gates
from hfpatch.mixers import FAMILIES
from hfpatch.model import multimodal
from hfpatch.release.sweep.run import GRAD_RTOL, HEAD_PARALLEL_COLUMNS, LOSS_RTOL, VERDICTS, Verdict

__all__ = ["render", "parse", "parse_columns", "parse_heads", "heads_section", "stale", "counts_line"]

_RELEASE = re.compile(r"^Generated on transformers (\S+), torch (\S+)")
_ROW = re.compile(r"^\| `([^`]+)` \| `([^`]+)` \| \*\*([a-z ]+)\*\* \|")
_CELL = re.compile(r"(?<!\\)\|")     # a cell boundary: a pipe not escaped by _cell
_HEADER = "| model type | class | verdict |"
_MEANING = {
    "exact": "CP loss and every gradient equal the non-CP run (fp32: loss within "
             f"{LOSS_RTOL:g} relative, each gradient within {GRAD_RTOL:g} of its largest entry).",
    "refused": "`hfpatch.apply(model=)` (or the first CP forward, before any backward) raises a named hfpatch "
               "error saying why; with `on_unsupported=\"fallback\"` the model trains without CP.",
    "not built": "the sweep could not build a tiny instance from the class's own config, or the model fails "
                 "without CP; the reason is given.",
    "silent": "CP ran and differs from non-CP without an error: a defect; the sweep's test fails on it.",
    "unnamed": "an exception that is not an hfpatch error, under CP only: a defect; the sweep's test fails on it.",
}


def counts_line(verdicts: Iterable[Verdict]) -> str:
    counts = Counter(v.verdict for v in verdicts)
    total = sum(counts.values())
    return f"{total} classes: " + ", ".join(f"{counts.get(k, 0)} {k}" for k in reversed(VERDICTS))


def render(verdicts: list[Verdict], *, transformers_version: str, torch_version: str, world_size: int,
           columns: Iterable[Verdict] = (), heads: Iterable[Verdict] = ()) -> str:
    """The text of MODELS.md for ``verdicts`` (sorted by model type and class), the head-parallel ``columns``'
    verdicts (``run.run_columns``) and the heads table's (``run.run_sweep(heads=True)``; no section without)."""
    rows = sorted(verdicts, key=lambda v: (v.model_type, v.class_name))
    kernels = list(HEAD_PARALLEL_COLUMNS)
    cells = {(v.model_type, v.class_name, v.kernel): v for v in columns}
    lines = [
        "# Models: which causal-LM classes train exactly under hfpatch CP",
        "",
        f"Generated on transformers {transformers_version}, torch {torch_version} by `hfpatch models --write` "
        "(do not edit by hand).",
        "",
        f"Every causal-LM class of the auto mapping that declares a flash-attention path, built tiny from its own "
        f"config class (random weights, fp32), trained one step on {world_size} CPU ranks (gloo) with "
        "`hfpatch.apply(group, model=model)`, `patch.shard_inputs` and `model(..., labels=...)`, against the same "
        "model on the whole batch without CP. " + counts_line(rows) + ".",
        "",
    ]
    lines += [f"- **{name}**: {_MEANING[name]}" for name in reversed(VERDICTS)]
    lines += ["", _columns_paragraph(list(cells.values())), ""]
    lines += [f"{_HEADER} {' | '.join(kernels)} | why |", "|---|---|---|" + "---|" * len(kernels) + "---|"]
    for v in rows:
        found = [cells.get((v.model_type, v.class_name, kernel)) for kernel in kernels]
        why = [v.detail.splitlines()[0]] if v.detail else []
        why += [f"{c.kernel}: {c.detail.splitlines()[0]}" for c in found if c is not None and c.detail]
        verdicts = "".join(f"{c.verdict if c is not None else ''} | " for c in found)
        lines.append(f"| `{v.model_type}` | `{v.class_name}` | **{v.verdict}** | {verdicts}{_cell('; '.join(why))} |")
    heads = list(heads)
    return "\n".join(lines + [""] + (heads_section(heads, world_size) + [""] if heads else []) + images_section()
                     + [""] + mixer_section()) + "\n"


_HEADS_HEADER = "| head | model type | class | verdict | why |"
_HEAD_ROW = re.compile(r"^\| ([a-z-]+) \| `([^`]+)` \| `([^`]+)` \| \*\*([a-z ]+)\*\* \|")
_HEAD_MEANING = {
    "sequence-classification": "pooled scores (one per row, the last non-pad token) and the loss of row labels",
    "token-classification": "per-token scores and the loss of `shard_inputs` labels (each token its own label)",
    "question-answering": "start and end logits per token, through a fixed weighted sum (the span loss with "
                          "`start_positions` is refused under CP by name)",
    "conditional-generation": "a vision-language model on text input, trained as a causal LM",
    "peft-lora": "the causal LM with a LoRA adapter on every linear layer, given to `apply` as the `PeftModel`",
    "moe-aux-loss": "a mixture-of-experts causal LM with `output_router_logits=True` and `router_aux_loss_coef=0.5`: "
                    "its loss adds the load-balancing loss, whose token statistics CP must take over the whole "
                    "group (`hfpatch.model.router_loss`)",
}


def heads_section(heads: list[Verdict], world_size: int) -> list[str]:
    """The lines of MODELS.md's heads table: every class of ``catalog.flash_head_classes`` with its verdict."""
    rows = sorted(heads, key=lambda v: (list(_HEAD_MEANING).index(v.head), v.model_type, v.class_name))
    lines = ["## Heads: sequence and token classification, QA, vision-language models on text, PEFT, MoE aux loss",
             "",
             f"Every class of transformers' sequence-classification, token-classification and question-answering "
             f"auto mappings, and every vision-language `*ForConditionalGeneration` class, that declares a "
             f"flash-attention path, a LoRA adapter on representative causal LMs, and every mixture-of-experts "
             f"causal LM with its load-balancing loss on: built tiny and trained one step "
             f"on {world_size} CPU ranks as above, each by what its head outputs, compared on every rank (loss and "
             f"every gradient). " + counts_line(rows) + ".", ""]
    lines += [f"- **{head}**: {meaning}." for head, meaning in _HEAD_MEANING.items()]
    lines += ["", _HEADS_HEADER, "|---|---|---|---|---|"]
    for v in rows:
        why = v.detail.splitlines()[0] if v.detail else ""
        lines.append(f"| {v.head} | `{v.model_type}` | `{v.class_name}` | **{v.verdict}** | {_cell(why)} |")
    return lines


def parse_heads(text: str) -> dict:
    """{(head, model_type, class_name): verdict} of the heads table in ``text``."""
    return {(m.group(1), m.group(2), m.group(3)): m.group(4)
            for m in map(_HEAD_ROW.match, text.splitlines()) if m}


def _columns_paragraph(columns: list[Verdict]) -> str:
    runs = "; ".join(f"`{kernel}` on {world} CPU ranks, {len(types)} model types ({', '.join(types)})"
                     for kernel, (world, types) in HEAD_PARALLEL_COLUMNS.items())
    counts = "; ".join(f"`{kernel}`: " + counts_line(v for v in columns if v.kernel == kernel)
                       for kernel in HEAD_PARALLEL_COLUMNS)
    return ("Head-parallel columns: the same step with `hfpatch.apply(group, model=model, kernel=...)` -- Ulysses, "
            "which splits the query heads over the group, and USP (`usp:2x2`: Ulysses groups of 2 consecutive ranks x "
            f"a ring of 2 across them) -- on a representative subset only: {runs}. A full column takes as long as "
            f"the whole sweep; an empty cell was not run (`hfpatch models --kernel ulysses --classes NAME` runs one "
            f"class). {counts}.")


def images_section() -> list[str]:
    """The lines of MODELS.md's images section: the families ``hfpatch.model.multimodal`` scatters images for, and
    how each row form fares, on any release."""
    lines = ["## Images under CP: vision-language models", "",
             f"`hfpatch.model.multimodal`, from transformers {version_gates.TRANSFORMERS_IMAGES_UNDER_CP}: every rank "
             "encodes every image, the features are written over the placeholders of the whole row (and Qwen's 3-D "
             "rotary positions numbered over it), and only then is the row cut to each rank's tokens, so an image "
             "may straddle two ranks. The families below are exact -- the loss and every gradient, vision tower "
             "included -- in `tests/model/test_vlm_images.py` (2 and 4 ranks, fp32). Images in every other "
             "vision-language family (Gemma-3's image spans attend bidirectionally), and video and audio inputs, "
             "are refused by name (`hfpatch.model.inputs_guard`); every family's text path is in the heads table "
             "above.", "",
             "| family | batch rows | packed rows |", "|---|---|---|"]
    for family in multimodal.FAMILIES:
        lines.append(f"| `{family}` | exact | exact |")
    later = [f"`{family}` from transformers {multimodal.first_release(family)}" for family in multimodal.FAMILIES
             if multimodal.first_release(family) != version_gates.TRANSFORMERS_IMAGES_UNDER_CP]
    if later:
        lines += ["", "Later first releases (before them, images of the family are refused by name): "
                  + ", ".join(later) + "."]
    return lines


def mixer_section() -> list[str]:
    """The lines of MODELS.md's sequence-mixer section: every entry of the mixer registry
    (``hfpatch.mixers.families``) with the releases and model types it was read and tested on, on any release."""
    lines = ["## Sequence mixers hfpatch runs under CP, by release", "",
             "The mixer registry's entries (`hfpatch/mixers/families/`), whatever release is installed: a mixer module "
             "is run under CP only when its class, its forward's fingerprint and its kernels' parameters match one of "
             "them; any other is refused by name. *kernel names*: the forward calls kernels by module-level names, "
             "which hfpatch rebinds; *CP form*: the release computes the recurrence inline and hfpatch replaces the "
             "method by a CP form written for that code.", "",
             "| family | mixer | how | releases: model types |", "|---|---|---|---|"]
    for family in FAMILIES:
        how = "CP form of `" + "`, `".join(name for name, _ in family.replaces) + "`" if family.replaces \
            else "kernel names"
        for releases in family.forwards.values():
            lines.append(f"| `{family.name}` | {_cell(family.mixer)} | {how} | {_cell(releases)} |")
    return lines


def _cell(text: str) -> str:
    return text.replace("|", "\\|")


def parse_columns(text: str) -> dict:
    """{(model_type, class_name, kernel): verdict} of the head-parallel columns' non-empty cells in ``text``."""
    kernels: list = []
    found = {}
    for line in text.splitlines():
        if line.startswith(_HEADER):
            kernels = [c.strip() for c in _CELL.split(line)[4:-2]]
            continue
        row = _ROW.match(line)
        if row and kernels:
            values = [c.strip() for c in _CELL.split(line)[4:4 + len(kernels)]]
            found.update({(row.group(1), row.group(2), k): v for k, v in zip(kernels, values) if v})
    return found


def parse(text: str) -> tuple[str | None, dict]:
    """(transformers release of the file or None, {(model_type, class_name): verdict})."""
    release = None
    table = {}
    for line in text.splitlines():
        match = _RELEASE.match(line)
        if match:
            release = match.group(1)
        row = _ROW.match(line)
        if row:
            table[(row.group(1), row.group(2))] = row.group(3)
    return release, table


def stale(verdicts: list[Verdict], text: str, columns: Iterable[Verdict] = (),
          heads: Iterable[Verdict] | None = None, *, heads_of: tuple | None = None) -> list[str]:
    """Every difference between ``verdicts`` (and the head-parallel ``columns``' verdicts, and the heads table's
    ``heads`` when given: None leaves that table unchecked) and the tables in ``text``, as readable lines (empty:
    current). ``heads_of``: the model types ``heads`` covers (a subset sweep: ``run.HEADS_CHECKED_IN_CI``); the
    table's rows of other types are then not compared."""
    _, table = parse(text)
    fresh = {(v.model_type, v.class_name): v.verdict for v in verdicts}
    out = []
    for key in sorted(set(table) | set(fresh)):
        old, new = table.get(key), fresh.get(key)
        if old != new:
            out.append(f"{key[0]} / {key[1]}: MODELS.md says {old or 'nothing'}, the sweep says {new or 'nothing'}")
    cells, fresh_cells = parse_columns(text), {(v.model_type, v.class_name, v.kernel): v.verdict for v in columns}
    for key in sorted(set(cells) | set(fresh_cells)):
        old, new = cells.get(key), fresh_cells.get(key)
        if old != new:
            out.append(f"{key[0]} / {key[1]} under {key[2]}: MODELS.md says {old or 'nothing'}, the sweep says "
                       f"{new or 'nothing'}")
    if heads is not None:
        rows, fresh_rows = parse_heads(text), {(v.head, v.model_type, v.class_name): v.verdict for v in heads}
        if heads_of is not None:
            rows = {key: verdict for key, verdict in rows.items() if key[1] in heads_of}
        for key in sorted(set(rows) | set(fresh_rows)):
            old, new = rows.get(key), fresh_rows.get(key)
            if old != new:
                out.append(f"{key[1]} / {key[2]} as {key[0]}: MODELS.md says {old or 'nothing'}, the sweep says "
                           f"{new or 'nothing'}")
    if "\n".join(images_section()) not in text:
        out.append("the images section differs from hfpatch.model.multimodal's families")
    if "\n".join(mixer_section()) not in text:
        out.append("the sequence-mixer section differs from the mixer registry's entries")
    return out
