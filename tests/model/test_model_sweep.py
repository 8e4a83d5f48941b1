"""The model sweep on the installed transformers release: every causal-LM class that declares a flash-attention
path is built tiny and trained one step under CP (2 gloo ranks) against non-CP (``hfpatch.release.sweep.run``). No class
may end silent (CP ran and differs) or unnamed (an exception that is not an hfpatch error); at most 5% may be
"not built". The head-parallel columns (``run.HEAD_PARALLEL_COLUMNS``: kernel "ulysses" on 2 ranks, "usp:2x2" on 4,
each on its subset of model types) run the same check on the release MODELS.md was generated with; none of their
classes may be silent or unnamed either. On that release the table must be current, columns included (``hfpatch models
--write``), and so must the heads table's rows of its CI subset (``run.HEADS_CHECKED_IN_CI``: sequence and token
classifiers, QA heads, vision-language models on text and PEFT rows of representative model types), whose whole
table (``hfpatch models --write``) has no silent or unnamed row.
"""
from __future__ import annotations

import importlib.util

import pytest

from _paths import ROOT
import hfpatch.errors as errors
from hfpatch.release.sweep import table
from hfpatch.release.sweep.catalog import HEADS
from hfpatch.release.sweep.run import (HEAD_PARALLEL_COLUMNS, HEADS_CHECKED_IN_CI, VERDICTS, Verdict, run_columns,
                                      run_sweep)

MODELS_MD = ROOT / "MODELS.md"
NOT_BUILT_SHARE = 0.05
# The vision-language models of the heads table are built from composite configs (a text and a vision tower) that
# the tiny builder shrinks generically: 17 of 62 classes of 5.24 do not build or run that way (configs whose
# validators refuse the shrink, forwards that require image inputs; each reason is in MODELS.md). A regression
# guard: no more than that share.
VLM_NOT_BUILT_SHARE = 0.3


@pytest.fixture(scope="module")
def verdicts():
    return run_sweep(world_size=2)


def _columns_release():
    """The release MODELS.md (and so its head-parallel columns) was generated on."""
    return table.parse(MODELS_MD.read_text())[0]


@pytest.fixture(scope="module")
def columns():
    """The head-parallel columns, on MODELS.md's release only: they are that table's, and on the other releases of
    the matrix tests/attention/test_head_parallel.py checks both kernels end to end (a column costs as much CPU as
    the sweep)."""
    import transformers

    return run_columns() if transformers.__version__ == _columns_release() else []


@pytest.fixture(scope="module")
def heads():
    """The heads table's verdicts (sequence and token classification, QA, vision-language models on text, PEFT) of
    its CI subset (``run.HEADS_CHECKED_IN_CI``), on MODELS.md's release only (the table is that release's;
    tests/model/test_heads.py checks the heads' mechanisms on every release of the matrix)."""
    import transformers

    if transformers.__version__ != _columns_release():
        return None
    return run_sweep(world_size=2, heads=True, model_types=HEADS_CHECKED_IN_CI)


def test_no_class_is_silent_or_unnamed(verdicts, columns, heads):
    defects = [f"{v.class_name} ({v.model_type}{'' if v.head == 'causal-lm' else ', ' + v.head}) under {v.kernel}: "
               f"{v.verdict}: {v.detail}" for v in verdicts + columns + (heads or [])
               if v.verdict in ("silent", "unnamed")]
    assert not defects, "\n".join(defects)


def test_the_heads_table_covers_every_head(heads):
    """Every head of the catalog has classes in the sweep, and each sequence classifier is exact or refused by name
    (a pooled head never trains silently: hfpatch.model.heads)."""
    if heads is None:
        pytest.skip(f"the heads table runs on MODELS.md's release, {_columns_release()}")
    expected = set(HEADS) - (set() if importlib.util.find_spec("peft") else {"peft-lora"})
    assert {v.head for v in heads} == expected, sorted(expected ^ {v.head for v in heads})
    table_rows = table.parse_heads(MODELS_MD.read_text())
    for head in expected:  # the whole table (hfpatch models --write): few classes not built
        rows = [verdict for key, verdict in table_rows.items() if key[0] == head]
        share = NOT_BUILT_SHARE if head != "conditional-generation" else VLM_NOT_BUILT_SHARE
        assert rows and rows.count("not built") <= share * len(rows), (head, rows.count("not built"), len(rows))
        assert not {"silent", "unnamed"} & set(rows), (head, sorted(set(rows)))
    pooled = [v for v in heads if v.head == "sequence-classification" and v.verdict not in ("exact", "refused")]
    assert not pooled, pooled


def test_each_column_ran_its_subset_under_its_kernel(verdicts, columns):
    """Every class of a column's model types that the sweep has gets that column's verdict, under its kernel."""
    import transformers

    if transformers.__version__ != _columns_release():
        pytest.skip(f"the head-parallel columns run on MODELS.md's release, {_columns_release()}; installed "
                    f"{transformers.__version__}")
    for kernel, (_, model_types) in HEAD_PARALLEL_COLUMNS.items():
        want = {(v.model_type, v.class_name) for v in verdicts if v.model_type in model_types}
        got = {(v.model_type, v.class_name) for v in columns if v.kernel == kernel}
        assert got == want and want, (kernel, sorted(want ^ got))


def test_every_verdict_has_its_evidence(verdicts, columns, heads):
    assert verdicts, "the catalog is empty: the sweep checked nothing"
    for v in verdicts + columns + (heads or []):
        assert v.verdict in VERDICTS
        if v.verdict in ("refused", "not built"):
            assert v.detail, f"{v.class_name}: {v.verdict} without a reason"
        if v.verdict == "refused":
            name = v.detail.split(":", 1)[0].split(" ", 1)[0]
            assert issubclass(getattr(errors, name), errors.HfpatchError), v.detail
        if v.verdict == "exact":
            assert v.loss_error is not None and v.grad_error is not None


def test_few_classes_are_not_built(verdicts):
    not_built = [f"{v.class_name}: {v.detail}" for v in verdicts if v.verdict == "not built"]
    assert len(not_built) <= NOT_BUILT_SHARE * len(verdicts), "\n".join(not_built)


def test_models_md_is_current(verdicts, columns, heads):
    import transformers

    release, _ = table.parse(MODELS_MD.read_text())
    if release != transformers.__version__:
        pytest.skip(f"MODELS.md is for transformers {release}; installed {transformers.__version__}")
    differences = table.stale(verdicts, MODELS_MD.read_text(), columns, heads, heads_of=HEADS_CHECKED_IN_CI)
    assert not differences, "MODELS.md is stale (run `hfpatch models --write`):\n" + "\n".join(differences)


# Each mixer kind proven exact on the oldest release of the tox matrix that has a flash-capable family of it
# (the newest release's sweep covers every family). kind -> (release, causal-LM class).
MIXER_KINDS_ON_THEIR_OLDEST_RELEASE = {
    "selective_scan (Mamba)": ("4.43.4", "JambaForCausalLM"),
    "ssd (Mamba2)": ("4.48.3", "BambaForCausalLM"),
    "lightning": ("4.53.3", "MiniMaxForCausalLM"),
    "conv (short conv)": ("4.54.1", "Lfm2ForCausalLM"),
    "delta_rule (Gated DeltaNet)": ("5.0.0", "Qwen3NextForCausalLM"),
    "delta_rule (KDA)": ("5.19.0", "KimiLinearForCausalLM"),
    "rglru": ("5.19.0", "RecurrentGemmaForCausalLM"),
    "cca": ("5.19.0", "ZayaForCausalLM"),
}


def test_mixer_kinds_exact_on_their_oldest_release(verdicts):
    import transformers

    due = {kind: cls for kind, (release, cls) in MIXER_KINDS_ON_THEIR_OLDEST_RELEASE.items()
           if release == transformers.__version__}
    if not due:
        pytest.skip(f"no mixer kind has transformers {transformers.__version__} as its oldest matrix release")
    by_class = {v.class_name: v for v in verdicts}
    wrong = [f"{kind}: {cls}: {by_class[cls].verdict if cls in by_class else 'not in the sweep'}"
             f" {by_class[cls].detail if cls in by_class else ''}" for kind, cls in due.items()
             if cls not in by_class or by_class[cls].verdict != "exact"]
    assert not wrong, "\n".join(wrong)


def test_the_staleness_check_sees_a_changed_row_column_cell_and_mixer_entry():
    verdict = Verdict(model_type="llama", class_name="LlamaForCausalLM", verdict="exact", loss_error=0.0,
                      grad_error=0.0)
    text = table.render([verdict], transformers_version="5.23.0", torch_version="2.13.0", world_size=2)
    assert table.stale([verdict], text) == []
    assert table.stale([verdict], text.replace("**exact**", "**refused**")) == [
        "llama / LlamaForCausalLM: MODELS.md says refused, the sweep says exact"]
    assert table.stale([verdict], text.replace("| `llava` | exact | exact |", "| `llava` | exact | refused |")) == [
        "the images section differs from hfpatch.model.multimodal's families"]
    column = Verdict(model_type="llama", class_name="LlamaForCausalLM", verdict="exact", kernel="ulysses")
    with_column = table.render([verdict], transformers_version="5.23.0", torch_version="2.13.0", world_size=2,
                               columns=[column])
    assert table.stale([verdict], with_column, [column]) == []
    assert table.stale([verdict], with_column.replace("** | exact |", "** | refused |"), [column]) == [
        "llama / LlamaForCausalLM under ulysses: MODELS.md says refused, the sweep says exact"]
    assert table.stale([verdict], with_column) == [
        "llama / LlamaForCausalLM under ulysses: MODELS.md says exact, the sweep says nothing"]
    head = Verdict(model_type="llama", class_name="LlamaForSequenceClassification", verdict="exact",
                   head="sequence-classification")
    with_heads = table.render([verdict], transformers_version="5.23.0", torch_version="2.13.0", world_size=2,
                              heads=[head])
    assert table.stale([verdict], with_heads, heads=[head]) == [] and table.stale([verdict], with_heads) == []
    assert table.stale([verdict], with_heads.replace("`LlamaForSequenceClassification` | **exact**",
                                                     "`LlamaForSequenceClassification` | **refused**"),
                       heads=[head]) == ["llama / LlamaForSequenceClassification as sequence-classification: "
                                         "MODELS.md says refused, the sweep says exact"]
    first_entry = next(line for line in table.mixer_section() if line.startswith("| `"))
    assert table.stale([verdict], text.replace(first_entry, first_entry.replace("kernel names", "CP form"))) == [
        "the sequence-mixer section differs from the mixer registry's entries"]
