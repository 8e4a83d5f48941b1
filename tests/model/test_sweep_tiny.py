"""The sweep's tiny builds: every catalog class of the installed transformers builds tiny within the time budget
(or is ``NotBuilt`` with a reason, at most 5 % of the catalog), runs an eager forward on (2, 32) token ids to
finite logits of shape (2, 32, TINY_VOCAB), and a hybrid keeps an attention layer and every mixer kind it has.

Each class is built once (module cache) and shared by the tests that need it.
"""
from __future__ import annotations

import time

import pytest

import torch

from hfpatch.release.sweep.catalog import CatalogEntry, flash_causal_lm_classes
from hfpatch.release.sweep.tiny import (
    HYBRID_KINDS, TINY_VOCAB, NotBuilt, build_tiny, layer_kinds, tiny_config, training_inputs)

# Measured on 2 shared CPU cores (transformers 5.23): median ~0.02 s, max ~0.4 s. The budget leaves room for
# a loaded machine; a class that takes seconds has a size the shrink missed.
BUILD_BUDGET_S = 3.0
NOT_BUILT_SHARE = 0.05
BATCH, SEQ = 2, 32
ATTENTION_KINDS = {"full_attention", "sliding_attention", "chunked_attention", "hybrid"}

CATALOG = flash_causal_lm_classes()
_BUILDS: dict[CatalogEntry, tuple[torch.nn.Module | None, float, str | None]] = {}


@pytest.fixture(autouse=True, scope="module")
def _quiet_transformers():
    """Tiny configs trip many harmless warnings; one of them (4.48's "use_cache False but cache_implementation
    hybrid", Gemma2/Cohere2) passes arguments its format string has no place for, which pytest's log capture
    turns into a TypeError. Errors only, restored after the module."""
    from transformers.utils import logging as hf_logging

    before = hf_logging.get_verbosity()
    hf_logging.set_verbosity_error()
    yield
    hf_logging.set_verbosity(before)


def _build(entry: CatalogEntry):
    """(model or None, seconds, NotBuilt reason or None), built once per entry."""
    if entry not in _BUILDS:
        start = time.perf_counter()
        try:
            model, reason = build_tiny(entry), None
        except NotBuilt as exc:
            model, reason = None, exc.reason
        _BUILDS[entry] = (model, time.perf_counter() - start, reason)
    return _BUILDS[entry]


def _ids(entry: CatalogEntry):
    return pytest.param(entry, id=f"{entry.model_type}-{entry.class_name}")


ENTRIES = [_ids(e) for e in CATALOG]


def test_catalog_is_sorted_unique_and_keeps_import_errors():
    keys = [(e.model_type, e.class_name) for e in CATALOG]
    assert keys == sorted(keys) and len(set(keys)) == len(keys)
    assert len(CATALOG) >= 20  # 30 on 4.43.4, 42 on 4.48.3, 147 on 5.23, 151 on 5.24
    for entry in CATALOG:
        assert entry.config_class_name, entry
        if entry.import_error is None:
            assert entry.model_class().__name__ == entry.class_name


@pytest.mark.parametrize("entry", ENTRIES)
def test_builds_within_budget_or_says_why(entry):
    model, seconds, reason = _build(entry)
    if model is None:
        assert reason and reason.strip(), entry
        return
    assert seconds < BUILD_BUDGET_S, f"{entry.class_name} took {seconds:.2f} s to build"
    assert type(model).__name__ == entry.class_name
    assert model.training
    assert all(p.dtype == torch.float32 for p in model.parameters())


def test_not_built_share():
    not_built = {e.model_type: _build(e)[2] for e in CATALOG if _build(e)[0] is None}
    assert len(not_built) <= NOT_BUILT_SHARE * len(CATALOG), not_built


@pytest.mark.parametrize("entry", ENTRIES)
def test_eager_forward_gives_finite_logits_and_gradients(entry):
    model, _, reason = _build(entry)
    if model is None:
        pytest.skip(f"not built: {reason}")
    ids = torch.randint(0, TINY_VOCAB, (BATCH, SEQ), generator=torch.Generator().manual_seed(1234))
    model.zero_grad(set_to_none=True)
    logits = model(input_ids=ids, use_cache=False, **training_inputs(model, ids)).logits
    assert tuple(logits.shape) == (BATCH, SEQ, TINY_VOCAB)
    assert torch.isfinite(logits).all()
    # initializer_range 0.2: logits far from uniform (a wrong mask or window would change the loss visibly).
    assert logits.float().std() > 1e-3
    loss = torch.nn.functional.cross_entropy(logits[:, :-1].reshape(-1, TINY_VOCAB), ids[:, 1:].reshape(-1))
    loss.backward()
    grads = [p.grad for p in model.parameters() if p.grad is not None]
    assert grads and all(torch.isfinite(g).all() for g in grads)
    # Train mode and still deterministic: no dropout, layer drop, router jitter or sampling left.
    with torch.no_grad():
        again = model(input_ids=ids, use_cache=False, **training_inputs(model, ids)).logits
    assert torch.equal(again, logits.detach())
    model.zero_grad(set_to_none=True)


@pytest.mark.parametrize("entry", ENTRIES)
def test_tiny_config_is_tiny_and_consistent(entry):
    model, _, reason = _build(entry)
    if model is None:
        pytest.skip(f"not built: {reason}")
    config = model.config
    text = getattr(config, "text_config", None) or config
    assert getattr(text, "use_cache", False) is False
    vocab = getattr(text, "vocab_size", TINY_VOCAB)
    assert vocab == TINY_VOCAB
    for name in ("pad_token_id", "bos_token_id", "eos_token_id"):
        value = getattr(text, name, None)
        for tid in value if isinstance(value, list) else [value]:
            assert tid is None or 0 <= tid < vocab, (name, tid)
    for name, value in text.to_dict().items():
        if ("dropout" in name or "pdrop" in name) and isinstance(value, float):
            assert value == 0.0, (name, value)
        if name in ("sliding_window", "attention_window_size", "window_size") and value:
            assert value <= 8, (name, value)  # active on the CP test's 32-64 tokens
    assert sum(p.numel() for p in model.parameters()) < 5_000_000


@pytest.mark.parametrize("entry", [_ids(e) for e in CATALOG if e.model_type in HYBRID_KINDS])
def test_hybrid_keeps_attention_and_every_mixer_kind(entry):
    try:
        config = tiny_config(entry)
    except NotBuilt as exc:
        pytest.skip(f"not built: {exc.reason}")
    kinds = set(layer_kinds(config))
    assert kinds & ATTENTION_KINDS, kinds
    assert HYBRID_KINDS[entry.model_type] <= kinds, (HYBRID_KINDS[entry.model_type], kinds)


def test_same_seed_same_weights_other_seed_other_weights():
    entry = next(e for e in CATALOG if e.model_type == "llama")
    a, b, c = build_tiny(entry, seed=3), build_tiny(entry, seed=3), build_tiny(entry, seed=4)
    for (name, pa), pb, pc in zip(a.named_parameters(), b.parameters(), c.parameters()):
        assert torch.equal(pa, pb), name
    assert not all(torch.equal(pa, pc) for pa, pc in zip(a.parameters(), c.parameters()))
    # The generator outside is untouched (fork_rng).
    torch.manual_seed(7)
    expected = torch.rand(3)
    torch.manual_seed(7)
    build_tiny(entry)
    assert torch.equal(torch.rand(3), expected)


def test_dtype_is_honoured():
    entry = next(e for e in CATALOG if e.model_type == "llama")
    model = build_tiny(entry, dtype=torch.bfloat16)
    assert {p.dtype for p in model.parameters()} == {torch.bfloat16}


def test_not_built_carries_reason():
    exc = NotBuilt("because")
    assert isinstance(exc, RuntimeError) and exc.reason == "because" and "because" in str(exc)
