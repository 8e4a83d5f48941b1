"""The harness of the sequence-mixer tests (tests/mixers/): one gloo world per test module runs all of the module's
cases, and each case is one pytest test.

Spawning a world costs seconds per rank (each rank imports torch and transformers), far more than a mixer case
on tiny shapes, so a module declares its cases (``Case``) as ``CASES`` and the ``world`` fixture
(tests/mixers/conftest.py, through ``run_module_world``) runs them in one world of ``WORLD_SIZE`` (4) ranks: a
4-rank case on the whole world, the 2-rank cases on the pairs of ranks (0, 1) and (2, 3) at the same time (split
between the pairs by ``weight``), a 1-rank case (no collective) on one rank, the ranks taking turns. A case is
``fn(group, *args)``, a module-level function, collective over ``group``; it raises on a failure (its assertion
messages name the case's kind, layout, dtype and tensor) and returns a value (which must pickle) or
``Skip(reason)``, the same on every rank. Each rank writes every case's outcome to a file as soon as it has one;
``WorldOutcome.check(name)`` turns the outcome into the test's: passed, failed with the rank's traceback, skipped,
or "did not run" when the world stopped on an earlier failure (the peers of a failed collective cannot go on: the
world stops at the first failure).

Shared pieces of the mixer cases: the catalog entries of named classes (found without importing every model
class), the registry's recognition and refusal by fingerprint, the sweep's ``check_class`` on real HF classes
(``kernel_and_class_cases``: the cases every module of kinds starts with), a CP training step against the model's
non-CP run (``cp_step``) on packed rows and on the rows of the release modules (test_mixers_*_releases.py, which
run worlds of their own), switch mode "reference" on a tiny model, and
``compare_exchange``: a kernel's CP form on one layout against the whole sequence, outputs and gradients:

- fp32: the CP form in fp32 against the whole sequence in fp32, within the ``cp`` entries of
  ``ring_kernels.tolerances`` (outputs: relative 1e-5; each input's gradient: 2e-5 of its largest entry);
- bf16: the CP form on bf16 inputs against the whole sequence in float64 on the same (bf16-valued) inputs: its
  error may exceed the error of the same kernel run on the whole sequence in bf16 by at most the ``kernel`` bf16
  entry (outputs 1e-2, gradients 2e-2, relative to the largest entry): what CP adds (each output rounded once
  more: the zero-start output, then the corrected one; summaries composed in fp32) is bounded by the kernel
  tolerance, while the kernel's own bf16 rounding is the release's (transformers' SSD scan in bf16 is 0.4 off in
  the gradient of a dt that bf16 rounding moves across dt_limit's clamp, on the whole sequence as under CP).
  Gradients are summed over the ranks in fp32.
"""
from __future__ import annotations

import dataclasses
import functools
import os
import pickle
import time
import traceback
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Optional

import pytest
import torch
import torch.distributed as dist

from _dist import DistributedFailure, run_world
import hfpatch
from hfpatch.mixers import recognise
from hfpatch.mixers.segments import SegmentPlan, segments_of_layout
from hfpatch.model.audit import audit
from hfpatch.release.sweep.catalog import CatalogEntry, declares_flash
from hfpatch.release.sweep.run import GRAD_FLOOR, GRAD_RTOL, LOSS_RTOL, check_class
from hfpatch.release.sweep.tiny import build_tiny
from ring_kernels.layout import local_positions, shard
from ring_kernels.tolerances import assert_close, relative_error, tolerance

WORLD_SIZE = 4
# Seconds for the whole world (pytest-timeout stops a test at 600).
WORLD_TIMEOUT_S = 540.0

# ------------------------------------------------------------------------------------ the world of a module


@dataclass(frozen=True)
class Case:
    """``name``: the test id; ``ranks``: 1, 2 or 4; ``fn(group, *args)``: module-level; ``weight``: its rough cost
    (the 2-rank cases are split between the two pairs by it); ``due()``: module-level, None where the case runs on
    this release, else the ``Skip`` it gives instead (``fn`` then does not run)."""

    name: str
    ranks: int
    fn: Callable
    args: tuple = ()
    weight: float = 1.0
    due: Optional[Callable] = None


class Skip(str):
    """A case's result meaning "skipped here": the string is the reason."""


def with_due(due: Callable, cases: list) -> list:
    """``cases``, each run only where ``due()`` is None (``Case.due``)."""
    return [dataclasses.replace(case, due=due) for case in cases]


def _placement(cases: list) -> dict:
    """name -> the world ranks that run the case (the same on every rank: computed from the list alone)."""
    placement, pair_load, turn = {}, [0.0, 0.0], 0
    for case in cases:
        if case.ranks == WORLD_SIZE:
            placement[case.name] = tuple(range(WORLD_SIZE))
        elif case.ranks == 2:
            pair = pair_load.index(min(pair_load))
            pair_load[pair] += case.weight
            placement[case.name] = (2 * pair, 2 * pair + 1)
        elif case.ranks == 1:
            placement[case.name] = (turn % WORLD_SIZE,)
            turn += 1
        else:
            raise ValueError(f"{case.name}: ranks must be 1, 2 or {WORLD_SIZE}, got {case.ranks}")
    return placement


def _record(out_dir: str, index: int, rank: int, outcome: tuple) -> None:
    path = Path(out_dir) / f"{index:03d}.{rank}.pkl"
    path.with_suffix(".tmp").write_bytes(pickle.dumps(outcome))
    os.replace(path.with_suffix(".tmp"), path)


def _run_cases(rank: int, world: int, cases: list, out_dir: str) -> int:
    """The world's function: this rank's cases in order, 1-rank first, then its pair's, then the whole world's."""
    from transformers.utils import logging as hf_logging

    hf_logging.set_verbosity_error()  # tiny configs trip many harmless warnings
    pairs = [dist.new_group([0, 1]), dist.new_group([2, 3])]  # every rank takes part in creating each group
    placement = _placement(cases)
    order = sorted((i for i, c in enumerate(cases) if rank in placement[c.name]), key=lambda i: cases[i].ranks)
    for index in order:
        case = cases[index]
        group = {1: None, 2: pairs[rank // 2], WORLD_SIZE: dist.group.WORLD}[case.ranks]
        try:
            value = case.due() if case.due is not None else None
            if value is None:
                value = case.fn(group, *case.args)
        except BaseException:
            _record(out_dir, index, rank, ("failed", traceback.format_exc(), time.time()))
            raise
        outcome = ("skipped", str(value)) if isinstance(value, Skip) else ("passed", value)
        _record(out_dir, index, rank, outcome + (time.time(),))
    return len(order)


class WorldOutcome:
    """The outcome of every case of one world (``run_module_world``)."""

    def __init__(self, cases: list, out_dir: Path, failure: Optional[str]) -> None:
        self.cases, self.out_dir, self.failure = {c.name: i for i, c in enumerate(cases)}, out_dir, failure
        self.placement = _placement(cases)

    def failed_cases(self) -> list:
        """The names of the cases that failed on some rank, the first failure first."""
        first = {}
        for name, index in self.cases.items():
            for path in self.out_dir.glob(f"{index:03d}.*.pkl"):
                status, _, when = pickle.loads(path.read_bytes())
                if status == "failed":
                    first[name] = min(when, first.get(name, when))
        return sorted(first, key=first.get)

    def check(self, name: str) -> list:
        """The case's test: fails with a rank's traceback, skips, or returns its value on each of its ranks."""
        if name not in self.cases:
            pytest.fail(f"{name} was not selected when the world ran", pytrace=False)
        index, records = self.cases[name], {}
        for rank in self.placement[name]:
            path = self.out_dir / f"{index:03d}.{rank}.pkl"
            if path.exists():
                records[rank] = pickle.loads(path.read_bytes())
        failed = {r: text for r, (status, text, _) in records.items() if status == "failed"}
        if failed:
            order = self.failed_cases()
            context = ("" if order == [name] else
                       f"\n(cases that failed in this world, the first first: {', '.join(order)}; a rank whose peer "
                       "had stopped fails with a closed connection)")
            pytest.fail("\n".join(f"{name}, rank {r} of ranks {self.placement[name]}:\n{text}"
                                  for r, text in sorted(failed.items())) + context, pytrace=False)
        if len(records) < len(self.placement[name]):
            order = self.failed_cases()
            why = (f"after {', '.join(order)} failed (see those tests)" if order
                   else f"({self.failure or 'no case failed'})")
            pytest.fail(f"{name} did not run: the world stopped {why}", pytrace=False)
        if all(status == "skipped" for status, _, _ in records.values()):
            pytest.skip(records[self.placement[name][0]][1])
        return [records[r][1] for r in self.placement[name]]


def run_module_world(cases: list, out_dir: Path, selected: Optional[set] = None) -> WorldOutcome:
    """Run ``cases`` (those named in ``selected``, or all) in one world of ``WORLD_SIZE`` gloo ranks."""
    chosen = [c for c in cases if selected is None or c.name in selected]
    failure = None
    try:
        run_world(WORLD_SIZE, _run_cases, chosen, str(out_dir), timeout=WORLD_TIMEOUT_S)
    except DistributedFailure as exc:
        failure = str(exc)
    return WorldOutcome(chosen, out_dir, failure)


def selected_cases(request, parameter: str = "name") -> set:
    """The case names of the module's tests that pytest will run (after -k / -m / node ids)."""
    return {item.callspec.params[parameter] for item in request.session.items
            if item.module is request.module and hasattr(item, "callspec") and parameter in item.callspec.params}


# ----------------------------------------------------------------------------------- catalog and registry


@functools.lru_cache(maxsize=None)
def _entries_of(names: tuple) -> dict:
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING_NAMES
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    found = {}
    for model_type, classes in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.items():
        for name in (classes,) if isinstance(classes, str) else classes:
            if name not in names:
                continue
            entry = CatalogEntry(model_type, name, CONFIG_MAPPING_NAMES.get(model_type))
            try:
                flash = declares_flash(entry.model_class())
            except Exception:  # noqa: BLE001 -- not importable here (the catalog records why): not one of ours
                continue
            if flash:
                found[name] = entry
    return dict(sorted(found.items()))


def entries(names) -> dict:
    """class name -> catalog entry, for the ``names`` this release has as flash-capable causal-LM classes (the
    sweep's catalog entries, found without importing every model class)."""
    return _entries_of(tuple(sorted(names)))


def catalog_entries(classes: dict) -> list:
    """The sweep's catalog entries of the ``classes`` (causal-LM class name -> (its model type, ...)) this release
    has, in that order, read from transformers' auto mappings (building the whole catalog imports every model)."""
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING_NAMES
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    return [CatalogEntry(model_type, name, CONFIG_MAPPING_NAMES[model_type])
            for name, (model_type, *_) in classes.items()
            if MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.get(model_type) == name]


def recognised_entries(classes: dict, absent: str) -> list:
    """``catalog_entries(classes)`` (causal-LM class name -> (model type, its mixer class, ...)), each checked:
    every mixer of its tiny model is one the registry recognises. Skips the calling test, saying ``absent``, where
    this release has none of the classes."""
    found = catalog_entries(classes)
    if not found:
        pytest.skip(absent)
    for entry in found:
        mixer_class = classes[entry.class_name][1]
        mixers = [m for m in build_tiny(entry).modules() if type(m).__name__ == mixer_class]
        assert mixers and all(recognise(m) is not None for m in mixers), \
            f"{entry.class_name}: this release's {mixer_class} is not in hfpatch's registry"
    return found


@functools.lru_cache(maxsize=None)
def is_recognised(class_name: str, names: tuple) -> bool:
    """Whether the registry recognises a mixer of ``class_name``'s tiny model (``names``: the module's classes)."""
    return bool(recognised(build_tiny(_entries_of(names)[class_name])))


@functools.lru_cache(maxsize=None)
def kernels_bound_by_name(class_name: str, names: tuple) -> bool:
    """Whether every mixer of ``class_name``'s tiny model is recognised by an entry that rebinds kernel names of
    its modeling module (no CP forms of its methods: ``MixerFamily.replaces``), as the newest releases write them;
    releases that compute the recurrence inline run through CP forms instead (their own test modules,
    tests/mixers/test_mixers_*_releases.py, check what those bind and restore)."""
    found = [recognise(m) for m in build_tiny(_entries_of(names)[class_name]).modules()]
    found = [r for r in found if r is not None]
    return bool(found) and all(not r.family.replaces for r in found)


def recognised(model) -> list:
    """The paths of ``model``'s modules that the mixer registry recognises."""
    return [name for name, m in model.named_modules() if recognise(m) is not None]


def with_changed_method(module, method: str) -> None:
    """Give ``module`` a class of the same name whose ``method`` is a pass-through: another release's code, as far
    as the registry's fingerprint can tell."""
    base = type(module)

    def changed(self, *args, **kwargs):
        return getattr(base, method)(self, *args, **kwargs)

    module.__class__ = type(base.__name__, (base,), {method: changed, "__module__": base.__module__})


def check_registry(entry, mixer_classes: tuple, changed: Optional[tuple] = None,
                   every_mixer_named: bool = True) -> str:
    """``entry``'s tiny model: on a release whose mixer code the registry lists, exactly the modules of
    ``mixer_classes`` are recognised and the audit finds no sequence mixer; ``changed`` = (path under the first
    mixer, method): that method changed makes the audit name the first mixer by its fingerprint. On another
    release, the audit refuses them by name (``every_mixer_named``: each mixer's path among its findings; else at
    least one sequence-mixer finding). Returns "recognised" or "refused"."""
    model = build_tiny(entry)
    mixers = [n for n, m in model.named_modules() if type(m).__name__ in mixer_classes]
    assert mixers, f"{entry.class_name}: no module of {mixer_classes}"
    if not recognised(model):  # a release the registry has not read: refused by name, never silent
        findings = audit(model)
        if every_mixer_named:
            assert {f.path for f in findings} >= set(mixers), (entry.class_name, findings)
        else:
            assert [f for f in findings if f.kind == "sequence-mixer"], (entry.class_name, findings)
        return "refused"
    assert recognised(model) == mixers, (entry.class_name, recognised(model), mixers)
    assert [f for f in audit(model) if f.kind == "sequence-mixer"] == [], entry.class_name
    if changed is not None:
        where, method = changed
        target = model.get_submodule(".".join(p for p in (mixers[0], where) if p))
        with_changed_method(target, method)
        finding = next(f for f in audit(model) if f.path == mixers[0])
        assert "fingerprint" in finding.reason, finding
        if where:  # a method of a module inside the mixer: the reason names that module
            assert where in finding.reason, finding
        else:
            assert finding.kind == "sequence-mixer", finding
    return "recognised"


def registry_case(group, class_name: str, names: tuple, mixer_classes: tuple,
                  changed: Optional[tuple] = ("", "forward"), every_mixer_named: bool = True):
    """The case ``registry-<class>``: ``check_registry`` on the class's tiny model (``names``: the module's
    classes), or skipped where this release has no flash-attention path for it."""
    found = entries(names)
    if class_name not in found:
        return Skip(f"{class_name} has no flash-attention path in this transformers release")
    return check_registry(found[class_name], mixer_classes, changed=changed, every_mixer_named=every_mixer_named)


# -------------------------------------------------------------------------------------- real HF classes


def check_classes(group, class_name: str, names: tuple, kernels: tuple):
    """The sweep's ``check_class`` of one class on ``group`` with each of ``kernels``: CP loss and every gradient
    equal to non-CP (the sweep's entries of ring_kernels.tolerances) where the registry recognises its mixers,
    refused by name where not."""
    found = _entries_of(names)
    if class_name not in found:
        return Skip(f"{class_name} has no flash-attention path in this transformers release")
    expected = "exact" if is_recognised(class_name, names) else "refused"
    for kernel in kernels:
        verdict = check_class(found[class_name], group, kernel=kernel)
        assert verdict.verdict == expected, f"{class_name} kernel={kernel}: expected {expected}, got {verdict}"
    return expected


DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


def kernel_and_class_cases(exchange: Callable, layouts: tuple, mixer_classes: dict, changed: Optional[dict] = None,
                           every_mixer_named: bool = True, four_ranks: tuple = ()) -> list:
    """The cases a module of mixer kinds starts with, in this order: ``exchange-<ranks>ranks-<layout>-<dtype>``
    (``exchange(group, layout, dtype)``) on every layout of ``layouts`` in fp32 and bf16 on 2 and 4 ranks; then for
    each class of ``mixer_classes`` (causal-LM class name -> its mixer classes) ``registry-<class>`` on one rank
    (``registry_case``; ``changed``: class name -> the (path, method) to change, default ("", "forward") for every
    class) and ``class-<class>-2ranks`` (``check_classes``, zigzag and contiguous); then ``class-<class>-4ranks``
    (zigzag) for each class of ``four_ranks``."""
    names = tuple(sorted(mixer_classes))
    return ([Case(f"exchange-{ranks}ranks-{layout.name}-{dt}", ranks, exchange, (layout, dtype))
             for ranks in (2, 4) for dt, dtype in DTYPES.items() for layout in layouts]
            + [Case(f"registry-{name}", 1, registry_case,
                    (name, names, mixer_classes[name], ("", "forward") if changed is None else changed.get(name),
                     every_mixer_named))
               for name in names]
            + [Case(f"class-{name}-2ranks", 2, check_classes, (name, names, ("auto", "ring")), weight=4)
               for name in names]
            + [Case(f"class-{name}-4ranks", 4, check_classes, (name, names, ("auto",))) for name in four_ranks])


@dataclass
class Step:
    """One CP training step against the model's non-CP run on the same rows (``cp_step``): the losses, every
    parameter's gradient of the non-CP run and the CP run's summed over the group (zeros for a parameter a rank's
    tokens did not reach), and the patch's mixer calls, (kernel role, switch mode) -> calls."""

    loss: torch.Tensor
    ref: torch.Tensor
    grads: dict
    ref_grads: dict
    calls: Counter

    @property
    def largest(self) -> float:
        """The largest entry of any non-CP gradient (the scale of a gradient's floor)."""
        return max(float(g.abs().max()) for g in self.ref_grads.values())

    def ran(self) -> list:
        """The kernel roles that ran in switch mode "ring", sorted."""
        return sorted({role for (role, mode), n in self.calls.items() if mode == "ring" and n})

    def check_sweep(self, what: str) -> None:
        """Loss and every gradient within the sweep's fp32 entries of ring_kernels.tolerances."""
        assert_close(self.loss, self.ref, tolerance("sweep", torch.float32, "loss"), f"{what} loss")
        for name, ref_grad in self.ref_grads.items():
            assert_close(self.grads[name], ref_grad, tolerance("sweep", torch.float32, "grad"), f"{what} d{name}",
                         largest=self.largest)

    def check_verdict_rule(self, where: tuple) -> None:
        """The sweep's verdict rule (hfpatch.release.sweep.run): |loss - ref| <= LOSS_RTOL x |ref|, and each
        gradient within GRAD_RTOL of its largest entry plus GRAD_FLOOR of the largest of all."""
        assert abs(self.loss.item() - self.ref.item()) <= LOSS_RTOL * abs(self.ref.item()), \
            (where, self.loss.item(), self.ref.item())
        for name, ref_grad in self.ref_grads.items():
            bound = GRAD_RTOL * ref_grad.abs().max() + GRAD_FLOOR * self.largest
            assert (self.grads[name] - ref_grad).abs().max() <= bound, (where, name)


def cp_step(group, model, kernel: str, ids: torch.Tensor, positions: torch.Tensor) -> Step:
    """``model`` trained one step on the rows ``ids`` (B, S) at ``positions`` (B, S) under ``hfpatch.apply(group,
    model=, kernel=)``, against its non-CP run on the same rows (switch mode "local", which runs the mixers over the
    whole rows, as HF's torch path does: a packed row's documents as one sequence). Every collective runs before
    the caller's assertions: a failed one must not strand a peer."""
    with hfpatch.apply(group, model=model, kernel=kernel) as patch:
        model.zero_grad(set_to_none=True)
        with hfpatch.switch("local"):
            ref = model(input_ids=ids, position_ids=positions, labels=ids, use_cache=False).loss
            ref.backward()
        ref_grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
        model.zero_grad(set_to_none=True)
        batch = patch.shard_inputs(ids, labels=ids, position_ids=positions)
        loss = model(input_ids=batch["input_ids"], position_ids=batch["position_ids"], labels=batch["labels"],
                     use_cache=False).loss
        loss.backward()
        calls = Counter(patch.mixers.calls)
        grads = {}
        for name in ref_grads:
            parameter = model.get_parameter(name)
            grads[name] = parameter.grad.clone() if parameter.grad is not None else torch.zeros_like(parameter)
            dist.all_reduce(grads[name], group=group)
    return Step(loss, ref, grads, ref_grads, calls)


def packed_step(group, model, kernel: str, lengths: list, what: str, roles: Optional[tuple] = None) -> list:
    """A packed row of documents of ``lengths`` (given by position_ids): ``cp_step``, loss and every gradient
    within the sweep's entries. Returns the kernel roles that ran in switch mode "ring", which must be ``roles``
    where given."""
    positions = torch.cat([torch.arange(n) for n in lengths])[None]
    ids = torch.randint(0, 128, (1, positions.shape[1]), generator=torch.Generator().manual_seed(5))
    step = cp_step(group, model, kernel, ids, positions)
    step.check_sweep(f"{what} kernel={kernel}")
    ran = step.ran()
    if roles is not None:
        assert ran == list(roles), f"{what} kernel={kernel}: ran {ran}, expected {list(roles)}"
    return ran


def with_lightning_blocks(model, block_size: int):
    """MiniMax's tiny model rebuilt (seed 0) with lightning blocks of ``block_size`` tokens, so that HF's block
    loop runs several (partial) blocks; any other model as it is."""
    if type(model).__name__ != "MiniMaxForCausalLM":
        return model
    config = model.config
    config.block_size = block_size
    torch.manual_seed(0)
    return type(model)(config)


def batch_or_packed_rows(world: int, packed: bool) -> tuple:
    """(input_ids, position_ids) of the release modules' steps: 2 rows of 8 tokens per rank on 2 ranks, 2 per rank
    on 4 (zigzag segments of one token); or one packed row of 3 documents (lengths 4, 2 and 6 x world)."""
    gen = torch.Generator().manual_seed(7)
    if packed:
        positions = torch.cat([torch.arange(n) for n in (4 * world, 2 * world, 6 * world)])[None]
    else:
        positions = torch.arange((8 if world == 2 else 2) * world).expand(2, -1)
    return torch.randint(0, 128, positions.shape, generator=gen), positions


def reference_mode(group, model, what: str) -> str:
    """Switch mode "reference" (the original kernels on the all-gathered sequence) gives the ring's logits;
    returns "equal"."""
    model = model.eval()
    ids = torch.randint(0, 128, (2, 8 * dist.get_world_size(group)), generator=torch.Generator().manual_seed(2))
    logits = {}
    with hfpatch.apply(group, model=model) as patch:
        batch = patch.shard_inputs(ids)
        for mode in ("ring", "reference"):
            with torch.no_grad(), hfpatch.switch(mode):
                logits[mode] = model(input_ids=batch["input_ids"], position_ids=batch["position_ids"],
                                     use_cache=False).logits
    assert_close(logits["ring"], logits["reference"], tolerance("cp", torch.float32, "out"),
                 f"{what}: ring vs reference logits")
    return "equal"


# --------------------------------------------------------------------------- a kernel's CP form vs whole


@dataclass(frozen=True)
class Layout:
    """One way to lay a row out over the ranks: ``layout`` ("zigzag" | "contiguous"), ``per_rank`` tokens per
    rank; ``starts``: the document starts of a packed row (batch 1) or None (a batch of 2 rows), multiplied by
    the world size when ``scale_starts``."""

    name: str
    layout: str
    per_rank: int
    starts: Optional[tuple] = None
    scale_starts: bool = True


class Exchange:
    """``layout`` on ``group``: this rank's ``SegmentPlan`` (checked against ``local_positions``) and its tokens
    of a whole-sequence tensor (``local``)."""

    def __init__(self, layout: Layout, group) -> None:
        self.group, self.layout = group, layout
        self.rank, self.world = dist.get_rank(group), dist.get_world_size(group)
        self.seq = layout.per_rank * self.world
        self.cu = None if layout.starts is None else torch.tensor(
            [s * (self.world if layout.scale_starts else 1) for s in layout.starts] + [self.seq], dtype=torch.int32)
        self.batch = 2 if self.cu is None else 1
        segments = segments_of_layout(layout.layout, self.world, layout.per_rank, self.cu)
        self.plan = SegmentPlan(segments, rank=self.rank, world_size=self.world, group=group,
                                layout=layout.layout, cu_seqlens=self.cu)
        mine = torch.cat([torch.arange(s.global_start, s.global_start + s.length) for s in self.plan.local])
        assert torch.equal(mine, local_positions(self.seq, group, layout=layout.layout, cu_seqlens=self.cu)), \
            f"{layout.name}: the segments disagree with ring_kernels.layout.local_positions"

    def local(self, x: torch.Tensor, dim: int) -> torch.Tensor:
        return shard(x, self.group, layout=self.layout.layout, dim=dim, cu_seqlens=self.cu)

    def describe(self, dtype: torch.dtype) -> str:
        return f"{self.layout.name}, {self.world} ranks, {str(dtype).removeprefix('torch.')}"


class Cast:
    """How a test's fp32 values become a run's inputs: ``dtype`` (the run's), rounded through ``through`` first
    (the reference of a bf16 run: the bf16 values in float64)."""

    def __init__(self, dtype: torch.dtype, through: Optional[torch.dtype] = None) -> None:
        self.dtype, self.through = dtype, through

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        """A new leaf of ``x``'s values in this cast's dtype, requiring grad."""
        x = x.detach()
        if self.through is not None:
            x = x.to(self.through)
        return x.to(self.dtype).clone().requires_grad_()

    def module(self, module: torch.nn.Module) -> torch.nn.Module:
        import copy

        module = copy.deepcopy(module)
        if self.through is not None:
            module = module.to(self.through)
        return module.to(self.dtype)


def compare_exchange(ex: Exchange, make: Callable, dtype: torch.dtype, kind: str) -> None:
    """One kernel's CP form against the whole sequence (module docstring): ``make(cast)`` -> (leaves: name ->
    tensor, ``run(ex or None)`` -> tuple of outputs (this rank's tokens, or the whole sequence's), the token dim of
    each output). Gradients flow from a fixed random weighting of the outputs; each leaf's is summed over ranks."""
    low = dtype != torch.float32
    ref_leaves, ref_run, dims = make(Cast(torch.float64, dtype) if low else Cast(torch.float32))
    whole = ref_run(None)
    gen = torch.Generator().manual_seed(7)
    weights = [torch.randn(o.shape, generator=gen).to(dtype).to(o.dtype) for o in whole]
    sum((o * w).sum() for o, w in zip(whole, weights)).backward()
    if low:  # the same kernel on the whole sequence in the low dtype: its own rounding error
        plain_leaves, plain_run, _ = make(Cast(dtype))
        plain = plain_run(None)
        sum((o * w.to(o.dtype)).sum() for o, w in zip(plain, weights)).backward()
    leaves, run, _ = make(Cast(dtype))
    cp = run(ex)
    sum((o * ex.local(w, d).to(o.dtype)).sum() for o, w, d in zip(cp, weights, dims)).backward()
    grads = {}
    for name, leaf in leaves.items():  # every collective before any assertion
        grads[name] = _grad(leaf)
        dist.all_reduce(grads[name], group=ex.group)
    what = f"{kind} ({ex.describe(dtype)}, rank {ex.rank})"
    for i, (o, w, d) in enumerate(zip(cp, whole, dims)):
        if low:
            _assert_adds_at_most(o, ex.local(plain[i].detach(), d), ex.local(w.detach(), d),
                                 tolerance("kernel", dtype, "out"), f"{what} output {i}")
        else:
            assert_close(o, ex.local(w.detach(), d), tolerance("cp", dtype, "out"), f"{what} output {i}")
    for name, ref in ref_leaves.items():
        if low:
            _assert_adds_at_most(grads[name], _grad(plain_leaves[name]), ref.grad, tolerance("kernel", dtype, "grad"),
                                 f"{what} d{name}")
        else:
            assert_close(grads[name], ref.grad, tolerance("cp", dtype, "grad"), f"{what} d{name}")


def _grad(leaf: torch.Tensor) -> torch.Tensor:
    return (leaf.grad if leaf.grad is not None else torch.zeros_like(leaf)).float()


def _assert_adds_at_most(actual, plain, expected, entry, what: str) -> None:
    """``actual`` (the CP result in a low dtype) is off ``expected`` (float64) by at most ``plain``'s error (the
    whole-sequence kernel in the same dtype) plus ``entry``'s bound, in ``entry``'s measure (max_relative)."""
    assert entry.measure == "max_relative" and not entry.floor, entry
    error, own = relative_error(actual, expected), relative_error(plain, expected)
    assert error <= own + entry.bound, (
        f"{what}: max|err| / max|expected| = {error:.3g} against float64 > the kernel's own {own:.3g} in "
        f"{entry.dtype} + {entry.bound:g} ({entry.comparison}/{entry.dtype}/{entry.quantity}: {entry.reason})")


def leaves_from(seed: int, cast: Cast, shapes: dict) -> dict:
    """name -> leaf: ``shapes`` maps each name to (shape, transform or None); values drawn from ``seed`` in
    order (standard normal, or ``transform(generator, shape)``), then cast."""
    gen = torch.Generator().manual_seed(seed)
    out = {}
    for name, (shape, transform) in shapes.items():
        value = torch.randn(*shape, generator=gen) if transform is None else transform(gen, shape)
        out[name] = cast(value)
    return out
