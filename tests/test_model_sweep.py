"""The model sweep on the installed transformers release: every causal-LM class that declares a flash-attention
path is built tiny and trained one step under CP (2 gloo ranks) against non-CP (``hfpatch.release.sweep.run``). No class
may end silent (CP ran and differs) or unnamed (an exception that is not an hfpatch error); at most 5% may be
"not built". On the release MODELS.md was generated with, the table must be current (``hfpatch models --write``).
"""
from __future__ import annotations

from pathlib import Path

import pytest

import hfpatch.errors as errors
from hfpatch.release.sweep import table
from hfpatch.release.sweep.run import VERDICTS, Verdict, run_sweep

MODELS_MD = Path(__file__).resolve().parent.parent / "MODELS.md"
NOT_BUILT_SHARE = 0.05


@pytest.fixture(scope="module")
def verdicts():
    return run_sweep(world_size=2)


def test_no_class_is_silent_or_unnamed(verdicts):
    defects = [f"{v.class_name} ({v.model_type}): {v.verdict}: {v.detail}" for v in verdicts
               if v.verdict in ("silent", "unnamed")]
    assert not defects, "\n".join(defects)


def test_every_verdict_has_its_evidence(verdicts):
    assert verdicts, "the catalog is empty: the sweep checked nothing"
    for v in verdicts:
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


def test_models_md_is_current(verdicts):
    import transformers

    release, _ = table.parse(MODELS_MD.read_text())
    if release != transformers.__version__:
        pytest.skip(f"MODELS.md is for transformers {release}; installed {transformers.__version__}")
    differences = table.stale(verdicts, MODELS_MD.read_text())
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


def test_the_staleness_check_sees_a_changed_row_and_a_changed_mixer_entry():
    verdict = Verdict(model_type="llama", class_name="LlamaForCausalLM", verdict="exact", loss_error=0.0,
                      grad_error=0.0)
    text = table.render([verdict], transformers_version="5.23.0", torch_version="2.13.0", world_size=2)
    assert table.stale([verdict], text) == []
    assert table.stale([verdict], text.replace("**exact**", "**refused**")) == [
        "llama / LlamaForCausalLM: MODELS.md says refused, the sweep says exact"]
    first_entry = next(line for line in table.mixer_section() if line.startswith("| `"))
    assert table.stale([verdict], text.replace(first_entry, first_entry.replace("kernel names", "CP form"))) == [
        "the sequence-mixer section differs from the mixer registry's entries"]
