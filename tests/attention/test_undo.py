"""hfpatch.undo: the undo stack removes newest first, removes every part even when one fails and then names each
failure, refuses a second removal; an install inside ``AllOrNothing`` is undone newest first when it raises (quietly:
the install's own error propagates) and kept once ``pop_all()`` hands it over; every installer of the model wing
returns one object whose ``remove()`` restores exactly what was there and raises on a second call; one marker
recognises hfpatch's wrappers."""
from __future__ import annotations

import logging
import types
from unittest import mock

import pytest
import torch

from hfpatch.cli.demo_models import build_model
from hfpatch.errors import AlreadyRemoved, PatchError, RemovalFailed
from hfpatch.undo import AllOrNothing, Removable, UndoStack, is_wrapper, mark_wrapper
from hfpatch.model import positions as model_positions
from hfpatch.model.inputs_guard import install_inputs_guard
from hfpatch.model.labels import install_labels_hook
from hfpatch.model.routing import FLASH_IMPLEMENTATION, route_model


class _Part:
    def __init__(self, name: str, log: list, error: BaseException | None = None) -> None:
        self.name, self.log, self.error = name, log, error

    def remove(self) -> None:
        self.log.append(self.name)
        if self.error is not None:
            raise self.error


def test_parts_are_removed_newest_first_and_push_returns_the_part():
    log: list = []
    undo = UndoStack("the test")
    first = _Part("first", log)
    assert undo.push(first) is first and isinstance(first, Removable)
    undo.callback(lambda: log.append("callback"), "a callback")
    undo.push(_Part("last", log))
    assert len(undo) == 3
    undo.remove()
    assert log == ["last", "callback", "first"] and undo.removed and len(undo) == 0


def test_every_part_is_removed_even_when_one_fails_then_the_failure_is_named():
    log: list = []
    cause = OSError("the second part failed")
    undo = UndoStack("the test", _Part("a", log), _Part("b", log, cause), _Part("c", log))
    with pytest.raises(RemovalFailed) as info:
        undo.remove()
    assert log == ["c", "b", "a"]
    assert isinstance(info.value, PatchError) and info.value.__cause__ is cause
    assert info.value.failures == [("_Part", cause)] and info.value.what == "the test"
    assert "the test was removed, but not cleanly" in str(info.value) and "the second part failed" in str(info.value)


def test_several_failures_are_grouped():
    log: list = []
    errors = [ValueError("one"), RuntimeError("two")]
    undo = UndoStack("the test")
    undo.push(_Part("a", log, errors[0]), "part a")
    undo.push(_Part("b", log, errors[1]), "part b")
    with pytest.raises(RemovalFailed) as info:
        undo.remove()
    assert log == ["b", "a"]
    assert [label for label, _ in info.value.failures] == ["part b", "part a"]
    group = info.value.__cause__
    assert isinstance(group, ExceptionGroup) and list(group.exceptions) == errors[::-1]
    assert "part b: RuntimeError: two" in str(info.value) and "part a: ValueError: one" in str(info.value)


def test_an_interrupt_still_lets_every_part_be_removed():
    log: list = []
    undo = UndoStack("the test", _Part("a", log), _Part("b", log, KeyboardInterrupt()))
    with pytest.raises(KeyboardInterrupt):
        undo.remove()
    assert log == ["b", "a"]


def test_removing_twice_is_an_error_and_so_is_installing_after_removal():
    undo = UndoStack("the test", _Part("a", []))
    undo.remove()
    with pytest.raises(AlreadyRemoved, match="the test was already removed") as info:
        undo.remove()
    assert info.value.what == "the test"
    with pytest.raises(AlreadyRemoved, match="would never be removed"):
        undo.push(_Part("late", []))


# ------------------------------------------------------------------------------------------------ AllOrNothing


def test_a_failed_install_is_undone_newest_first_and_its_error_propagates_unchanged():
    log: list = []
    cause = ValueError("the third step failed")
    with pytest.raises(ValueError) as info:
        with AllOrNothing("the test") as undo:
            undo.push(_Part("first", log))
            undo.callback(lambda: log.append("second"), "the second step")
            raise cause
    assert info.value is cause and cause.__cause__ is None and cause.__context__ is None
    assert log == ["second", "first"] and undo.removed and len(undo) == 0


def test_pop_all_hands_every_step_to_the_owner_and_leaves_nothing_to_undo():
    log: list = []
    with AllOrNothing("the test") as undo:
        undo.push(_Part("first", log), "part one")
        undo.push(_Part("second", log), "part two")
        kept = undo.pop_all()
    assert log == [] and len(undo) == 0 and not undo.removed
    assert type(kept) is UndoStack and kept.what == "the test" and len(kept) == 2
    kept.remove()  # the owner's remove(): newest first, as if it had recorded them itself
    assert log == ["second", "first"]
    with pytest.raises(AlreadyRemoved):
        kept.remove()


def test_a_block_left_without_pop_all_undoes_what_it_recorded():
    log: list = []
    with AllOrNothing("the test") as undo:
        undo.push(_Part("first", log))
    assert log == ["first"] and undo.removed
    with pytest.raises(AlreadyRemoved, match="nothing left to hand over"):
        undo.pop_all()


def test_a_step_that_fails_to_undo_is_logged_and_the_install_error_still_propagates(caplog):
    log: list = []
    cause = ValueError("the install failed")
    undo_error = OSError("the first step cannot be undone")
    with caplog.at_level(logging.ERROR, logger="hfpatch"), pytest.raises(ValueError) as info:
        with AllOrNothing("the test") as undo:
            undo.push(_Part("first", log, undo_error), "part one")
            undo.push(_Part("second", log), "part two")
            raise cause
    assert info.value is cause and log == ["second", "first"]  # every step undone, even after one failed
    [record] = [r for r in caplog.records if r.name == "hfpatch"]
    assert "undoing a failed install of the test also failed" in record.getMessage()
    logged = record.exc_info[1]
    assert isinstance(logged, RemovalFailed) and logged.failures == [("part one", undo_error)]
    assert logged.__cause__ is undo_error


def test_an_interrupt_while_undoing_still_propagates_after_every_step():
    log: list = []
    with pytest.raises(KeyboardInterrupt) as info:
        with AllOrNothing("the test") as undo:
            undo.push(_Part("first", log))
            undo.push(_Part("second", log, KeyboardInterrupt()))
            raise ValueError("the install failed")
    assert log == ["second", "first"] and isinstance(info.value.__context__, ValueError)


def test_one_marker_for_every_wrapper():
    def wrapper():
        return None

    assert not is_wrapper(wrapper) and not is_wrapper(None) and not is_wrapper(mock.Mock())
    assert mark_wrapper(wrapper) is wrapper and is_wrapper(wrapper)
    assert is_wrapper(types.MethodType(wrapper, object()))  # a method bound from a marked function


# ------------------------------------------------------------------------------------ the model wing's installers


class _Echo(torch.nn.Module):
    def forward(self, input_ids=None, labels=None, **kwargs):
        return input_ids


def _hooks(model: torch.nn.Module) -> int:
    return sum(len(m._forward_hooks) + len(m._forward_pre_hooks) for m in model.modules())


@pytest.mark.parametrize("install", [
    lambda model: install_labels_hook(model, lambda: None),
    lambda model: install_inputs_guard(model, lambda: None),
    lambda model: model_positions.install(model, lambda: None),
], ids=["labels", "inputs_guard", "positions"])
def test_each_hook_installer_returns_one_removable(install):
    model = _Echo()
    installed = install(model)
    assert isinstance(installed, Removable)
    installed.remove()
    assert _hooks(model) == 0
    with pytest.raises(AlreadyRemoved):
        installed.remove()


def test_route_model_returns_one_removable():
    model = build_model("llama")
    before = model.config._attn_implementation
    routing = route_model(model, lambda *a, **k: None)
    assert isinstance(routing, Removable) and model.config._attn_implementation == FLASH_IMPLEMENTATION
    routing.remove()
    assert model.config._attn_implementation == before
    with pytest.raises(AlreadyRemoved):
        routing.remove()
