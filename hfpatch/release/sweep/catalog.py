"""The catalog: every causal-LM class of the installed transformers that declares a flash-attention path, and the
heads table's classes (``flash_head_classes``: sequence and token classification, QA, vision-language models on
text, PEFT adapters).

Source of truth is transformers' own auto mapping ``MODEL_FOR_CAUSAL_LM_MAPPING_NAMES`` (model_type -> class name,
or a tuple of class names) and ``CONFIG_MAPPING_NAMES`` (model_type -> config class name); both exist under the
same names in every release from 4.43 to 5.x. A class *declares a flash path* when its ``_supports_flash_attn``
(5.x, and 4.5x after the rename) or ``_supports_flash_attn_2`` (4.43-4.5x) class attribute is true.

Contract: the result is sorted by (model_type, class_name); a class that cannot be imported is never dropped — it
is listed with ``import_error`` set (whether it declares a flash path is then unknown).
"""
from __future__ import annotations

import importlib
import sys
from dataclasses import dataclass

__all__ = ["CatalogEntry", "HEADS", "flash_causal_lm_classes", "flash_head_classes"]

# The heads table of MODELS.md: head -> the auto mapping that lists its classes (absent in a release: no classes).
# "conditional-generation": the vision-language models of the image-text-to-text mapping, trained on text input;
# "peft-lora": a causal LM of ``PEFT_MODEL_TYPES`` with a LoRA adapter on every linear layer (where peft is
# installed), given to apply as the PeftModel; "moe-aux-loss": every mixture-of-experts causal LM (its modeling
# module defines transformers' ``load_balancing_loss_func``) trained with its load-balancing loss on.
HEADS = {
    "sequence-classification": "MODEL_FOR_SEQUENCE_CLASSIFICATION_MAPPING_NAMES",
    "token-classification": "MODEL_FOR_TOKEN_CLASSIFICATION_MAPPING_NAMES",
    "question-answering": "MODEL_FOR_QUESTION_ANSWERING_MAPPING_NAMES",
    "conditional-generation": "MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING_NAMES",
    "peft-lora": "MODEL_FOR_CAUSAL_LM_MAPPING_NAMES",
    "moe-aux-loss": "MODEL_FOR_CAUSAL_LM_MAPPING_NAMES",
}
PEFT_MODEL_TYPES = ("llama", "qwen2", "mixtral")

# Both spellings, newest first: 4.43-4.5x name the flag `_supports_flash_attn_2`; later releases
# `_supports_flash_attn` (some keep the old name as an alias). Either one true means a flash path exists.
_FLASH_FLAGS = ("_supports_flash_attn", "_supports_flash_attn_2")


@dataclass(frozen=True)
class CatalogEntry:
    """One class: its ``model_type`` key, class name and config class name (``None`` when
    ``CONFIG_MAPPING_NAMES`` has no entry). ``import_error`` is ``"<ExceptionType>: <message>"`` when the class
    could not be imported from transformers, else ``None``. ``head``: what the sweep trains it as -- "causal-lm"
    (the main table), or one of ``HEADS`` (``flash_head_classes``)."""

    model_type: str
    class_name: str
    config_class_name: str | None
    import_error: str | None = None
    head: str = "causal-lm"

    @property
    def importable(self) -> bool:
        return self.import_error is None

    def model_class(self):
        """The class itself (imports it); raises the import error again when there is one."""
        return _import_class(self.model_type, self.class_name)

    def config_class(self):
        """The config class (imports it); ``LookupError`` when the mapping names none."""
        if self.config_class_name is None:
            raise LookupError(f"CONFIG_MAPPING_NAMES has no entry for model_type={self.model_type!r}")
        return _import_class(self.model_type, self.config_class_name)


def _mappings():
    """(causal-LM mapping, config mapping), both plain ``OrderedDict`` of names (no imports of model code)."""
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING_NAMES
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    return MODEL_FOR_CAUSAL_LM_MAPPING_NAMES, CONFIG_MAPPING_NAMES


def _import_class(model_type: str, name: str):
    """``transformers.<name>``; falls back to the model's own module for a name the top level does not export
    (the module path the auto classes themselves use)."""
    import transformers

    try:
        return getattr(transformers, name)
    except AttributeError:
        pass
    from transformers.models.auto.configuration_auto import model_type_to_module_name

    module = importlib.import_module(f"transformers.models.{model_type_to_module_name(model_type)}")
    try:
        return getattr(module, name)
    except AttributeError:
        raise ImportError(
            f"transformers has no {name!r} (neither at top level nor in {module.__name__}); "
            f"the auto mapping's entry for {model_type!r} names it") from None


def declares_flash(cls) -> bool:
    """True when ``cls`` has a flash-attention path by either flag spelling."""
    return any(bool(getattr(cls, flag, False)) for flag in _FLASH_FLAGS)


def _class_names(value) -> tuple[str, ...]:
    return (value,) if isinstance(value, str) else tuple(value)


def flash_causal_lm_classes() -> list[CatalogEntry]:
    """Every causal-LM class of the installed transformers that declares a flash path, plus every class that
    failed to import (``import_error`` set), sorted by (model_type, class_name)."""
    causal_lm, configs = _mappings()
    return _flash_entries(causal_lm, configs, "causal-lm")


def flash_head_classes() -> list[CatalogEntry]:
    """The heads table's classes (``HEADS``): every sequence-classification, token-classification and QA class,
    and every vision-language ``*ForConditionalGeneration`` class, that declares a flash path (plus those that
    failed to import), the PEFT rows where peft is installed, and every importable mixture-of-experts causal LM
    with a flash path; sorted by (head, model_type, class_name)."""
    import importlib.util

    from transformers.models.auto import modeling_auto

    _, configs = _mappings()
    entries = []
    for head, mapping in HEADS.items():
        names = getattr(modeling_auto, mapping, None) or {}
        if head == "peft-lora":
            if importlib.util.find_spec("peft") is None:
                continue
            names = {t: names[t] for t in PEFT_MODEL_TYPES if t in names}
        elif head == "conditional-generation":
            names = {t: tuple(n for n in _class_names(v) if n.endswith("ForConditionalGeneration"))
                     for t, v in names.items()}
        found = _flash_entries(names, configs, head)
        if head == "moe-aux-loss":   # the importable causal LMs whose module has a load-balancing loss
            found = [e for e in found if e.importable and _balances_experts(e)]
        entries += found
    entries.sort(key=lambda e: (list(HEADS).index(e.head), e.model_type, e.class_name))
    return entries


def _balances_experts(entry: CatalogEntry) -> bool:
    """Whether the class's modeling module defines transformers' MoE ``load_balancing_loss_func``."""
    return hasattr(sys.modules[entry.model_class().__module__], "load_balancing_loss_func")


def _flash_entries(mapping, configs, head: str) -> list[CatalogEntry]:
    entries = []
    for model_type, value in mapping.items():
        config_name = configs.get(model_type)
        for class_name in _class_names(value):
            try:
                cls = _import_class(model_type, class_name)
            except Exception as exc:  # noqa: BLE001 -- any import failure (a missing optional dependency raises
                # ImportError, the lazy module wraps others in RuntimeError) is recorded verbatim, never dropped.
                entries.append(CatalogEntry(model_type, class_name, config_name, f"{type(exc).__name__}: {exc}",
                                            head=head))
                continue
            if declares_flash(cls):
                entries.append(CatalogEntry(model_type, class_name, config_name, head=head))
    entries.sort(key=lambda e: (e.model_type, e.class_name))
    return entries
