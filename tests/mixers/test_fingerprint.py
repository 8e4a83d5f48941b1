"""The mixer registry's fingerprints are the same on every Python: ``family.canonical_dump`` writes a syntax
tree by one fixed rule, which is ``ast.dump(annotate_fields=False)``'s text on Python 3.11 (the registry's keys
were read there), and on any other Python gives the committed digests of every modeling file of the CI pin."""
from __future__ import annotations

import ast
import json
import sys

import pytest

import _fingerprint_corpus as corpus
from _release import skip_unless_ci_pin
from hfpatch.mixers.family import canonical_dump, forward_fingerprint

ON_311 = sys.version_info[:2] == (3, 11)

# source -> canonical text: optional None fields left out (the fields after them named), Constant(None) and
# MatchSingleton(None) kept, empty lists kept, f-string parts, positional-only and keyword-only arguments.
CASES = {
    "def f(a, /, b: int = 1, *args, c=None, **kw) -> None:\n    return None":
        "Module([FunctionDef('f', arguments([arg('a')], [arg('b', Name('int', Load()))], arg('args'), [arg('c')], "
        "[Constant(None)], arg('kw'), [Constant(1)]), [Return(Constant(None))], [], Constant(None))], [])",
    "class C(B):\n    x: int = 0":
        "Module([ClassDef('C', [Name('B', Load())], [], [AnnAssign(Name('x', Store()), Name('int', Load()), "
        "Constant(0), 1)], [])], [])",
    "from . import a as b\ntry:\n    pass\nexcept E:\n    pass":
        "Module([ImportFrom(names=[alias('a', 'b')], level=1), Try([Pass()], [ExceptHandler(Name('E', Load()), "
        "body=[Pass()])], [], [])], [])",
    "match x:\n    case None:\n        y = f'{x!r:>{w}}'":
        "Module([Match(Name('x', Load()), [match_case(MatchSingleton(None), body=[Assign([Name('y', Store())], "
        "JoinedStr([FormattedValue(Name('x', Load()), 114, JoinedStr([Constant('>'), FormattedValue(Name('w', "
        "Load()), -1)]))]))])])], [])",
}


@pytest.mark.parametrize("source", list(CASES), ids=range(len(CASES)))
def test_canonical_text_of_each_rule(source):
    assert canonical_dump(ast.parse(source)) == CASES[source]


def test_empty_fstring_parts_do_not_count():
    """3.12's parser writes ``f'{x:>{w}}'``'s format spec with a trailing ``Constant('')`` that 3.11 and 3.13 do not:
    the tree with it added reads the same."""
    source = "y = f'{x!r:>{w}}'"
    tree = ast.parse(source)
    tree.body[0].value.values[0].format_spec.values.append(ast.Constant(""))
    assert canonical_dump(tree) == canonical_dump(ast.parse(source))


@pytest.mark.skipif(not ON_311, reason="ast.dump's text is the canonical one only on Python 3.11; other Pythons "
                                       "are held to the committed digests (test_corpus_digests)")
def test_canonical_text_is_ast_dump_of_python_311():
    """On 3.11 the rule reproduces ``ast.dump(annotate_fields=False)`` on every modeling file of the CI pin: so the
    registry's keys, read with it, keep their values. (Under the older releases of the matrix, their mixer entries'
    keys are held by the model sweep, which recognises each hybrid by them.) The same pass checks the committed
    digests (``test_corpus_digests``' check, which therefore runs on the other Pythons only)."""
    skip_unless_ci_pin("the comparison over every modeling file")
    record = _committed_corpus()
    differ, digests = [], {}
    for path in corpus.modeling_files():
        tree = ast.parse(path.read_text(encoding="utf-8"))
        text = canonical_dump(tree)
        if text != ast.dump(tree, annotate_fields=False):
            differ.append(corpus.relative(path))
        digests[corpus.relative(path)] = corpus.digest(text)
    assert len(digests) > 100
    assert differ == []
    assert set(digests) == set(record["files"])
    assert [name for name, key in digests.items() if record["files"][name] != key] == []


@pytest.mark.skipif(ON_311, reason="on Python 3.11 test_canonical_text_is_ast_dump_of_python_311 checks the digests "
                                   "in its pass over the modeling files")
def test_corpus_digests():
    """Every modeling file of the CI pin has, on this Python, the canonical digest committed from Python 3.11."""
    skip_unless_ci_pin("the committed corpus digests")
    record = _committed_corpus()
    found = corpus.compute()
    assert set(found) == set(record["files"])
    assert [name for name, key in found.items() if record["files"][name] != key] == []


def _committed_corpus() -> dict:
    import transformers

    record = json.loads(corpus.CORPUS.read_text())
    assert record["transformers"] == transformers.__version__, (
        "the corpus is of another release than the CI pin: python -m tests.mixers._fingerprint_corpus --write "
        "(Python 3.11)")
    return record


def test_registry_key_of_a_known_forward():
    """The key of Qwen3.5's gated delta net forward on 5.24.0 (the registry's entry), whatever the Python."""
    skip_unless_ci_pin("the key of 5.24.0's forward")
    from transformers.models.qwen3_5 import modeling_qwen3_5

    assert forward_fingerprint(modeling_qwen3_5.Qwen3_5GatedDeltaNet.forward) == "f5ac25ccb08a27f6"


def test_canonical_dump_refuses_a_non_node():
    with pytest.raises(TypeError, match="expects an ast.AST node, got str"):
        canonical_dump("def f(): pass")
