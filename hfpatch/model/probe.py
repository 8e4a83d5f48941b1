"""The whole-model probe of ``apply(model=)``: the model's CP forward against its non-CP forward on the same
whole sequence, module by module, so that whatever mixes tokens in a way no rule of ``model_audit`` knows (a
future release's new mixer, a user's custom module, positions taken from the input's length) is refused before
the first step, naming the first module whose output diverges.

The probe measures CP, not the dtype's rounding. Comparing free-running forwards cannot tell the two apart at
real depth: a bf16 model's rounding compounds through every layer (the free-running CP forward of an 8B Llama
differs from its non-CP forward by 5% of the largest value at layer 13, all of it rounding), while a CP error may
be smaller than that. So the CP forward is
*teacher-forced*: every module gets, in place of its own sequence-shaped inputs, this rank's shard of what the
same module received in the non-CP forward, and each comparison covers one step of computation only.

One probe: random token ids (the same on every rank), ``tokens_per_rank`` x world size of them, one row. A
vision-language model whose images hfpatch scatters (``hfpatch.model.multimodal``) is probed with two images in
that row, straddling shard boundaries (``hfpatch.model.probe_images``: the row grows to hold them): both forwards
encode them, and the CP forward's modules that run before the sequence is sharded (the token embedding, the
scatter, the multimodal positions) see the whole row, so they are compared with the whole non-CP tensors, the
text model's with this rank's shard of them.

1. non-CP: every rank runs the model on the whole row with the switch in ``"local"`` mode (plain attention on
   the whole sequence: what the flash path computes without a CP group), recording each module call's
   sequence-shaped floating-point inputs (``(1, S, ...)`` tensors among its arguments, or one tuple level down:
   hidden states, rotary tables) and its output;
2. CP: every rank runs its shard (``inputs.shard_inputs``, the layout of a batch step) in ``"ring"`` mode. At
   each module call, before the module runs, each recorded input is compared with what the caller passed (the
   *input* check: it covers the caller's own code between its submodules), then replaced by the non-CP input's
   shard; when the module returns, its output is compared with the non-CP output's shard (the *output* check:
   the module's own computation on identical inputs). Integer inputs (token ids, position ids) are never
   replaced: positions off by a shard reach the rotary or position module and show in its output;
3. an error is the largest difference relative to the largest non-CP value of that tensor, on this rank's
   tokens; one all-reduce (max) makes the verdict the same on every rank.

Each compared tensor thus carries the rounding of one module (or of one caller's code between two of its
modules), whatever the depth, while a module that sees only its shard, reads the input's length or gets wrong
positions or masks is off by far more on the tokens past a shard boundary. The first check in execution order
(an input when its module starts, an output when it ends: inner modules come before the ones that contain them)
whose error exceeds the tolerance of the model's dtype (``ring_kernels.tolerances``, comparison
``model_probe``) is named in a ``ModelDivergence``. An input that is sequence-shaped in the non-CP forward but not
this rank's shard of it in the CP forward is left as it is and not compared (a head-major tensor whose head count
equals the sequence length); an output with no comparable CP counterpart is a divergence. Runs under
``torch.no_grad()`` with every module in eval mode (no dropout, deterministic routing), restoring each module's
training flag afterwards; costs two forwards of the model on a few tokens and one copy of each recorded input
and output in the model's dtype (benchmarks/model_probe_cost.py measures both).
"""
from __future__ import annotations

import contextlib
import dataclasses
import inspect
import math
from dataclasses import dataclass
from typing import Any, Optional, Tuple

import torch
import torch.distributed as dist

from hfpatch import inputs as _inputs
from hfpatch.attention.context import make_usp_groups
from hfpatch.model import heads as _heads, router_loss
from hfpatch.model.probe_images import ProbeImages, probe_images
from hfpatch.model.positions import position_kwargs
from hfpatch import modes
from hfpatch.errors import HfpatchError, ModelDivergence, VerificationError
from ring_kernels.tolerances import tolerance

__all__ = ["ProbeResult", "probe_model", "PROBE_TOKENS_PER_RANK", "probe_tolerance"]

PROBE_TOKENS_PER_RANK = 8
_SEED = 20261124  # the same token ids on every rank, whatever the global seed

Location = Tuple[Any, ...]  # ("arg", i) / ("kw", name), + (j,) one tuple level down


@dataclass(frozen=True)
class ProbeResult:
    """``worst``: the largest relative error over the compared tensors (max over ranks); ``compared``: how many
    module inputs and outputs were compared; ``tokens``: the probe's whole sequence length; ``dtype``: the model's
    dtype; ``worst_at``: the check with the largest error ("output of model.layers.3.self_attn", ...);
    ``labels_refusal``: why ``model(labels=)`` cannot be made equal to the model's own non-CP loss (its loss is
    not the token-mean cross-entropy of its logits), or None; ``labels_alignment``: how the model's own loss pairs
    logits with labels -- "shifted" (HF's causal-LM one-token shift) or "aligned" (each position scored against its
    own label, no shift: the BART-family and Whisper causal LMs); ``outputs``: the fields of the model's own output
    that were compared whole (a pooled score, a loss) or as this rank's tokens (logits), on every rank;
    ``images``: how many images both forwards encoded and scattered (``hfpatch.model.probe_images``; 0 for a
    text-only model)."""

    worst: float
    compared: int
    tokens: int
    dtype: torch.dtype
    worst_at: str = ""
    labels_refusal: Optional[str] = None
    labels_alignment: str = "shifted"
    outputs: Tuple[str, ...] = ()
    images: int = 0


def probe_tolerance(dtype: torch.dtype) -> float:
    """The relative error the probe allows one module (or one caller's code) of a model of ``dtype``."""
    name = str(dtype).replace("torch.", "")
    return tolerance("model_probe", name if name in _PROBE_DTYPES else "float32", "module").bound


_PROBE_DTYPES = ("float64", "float32", "bfloat16", "float16")


@dataclass
class _Check:
    """One comparison of the probe: the input at ``location`` of a module call, or its output (location None)."""

    path: str
    cls: str
    location: Optional[Location]
    expected: torch.Tensor  # the non-CP tensor, whole sequence, the model's dtype
    field: Optional[str] = None  # a field of the model's own output ("logits", "loss", "hidden_states[2]")

    def describe(self) -> str:
        if self.field is not None:
            return f"output field {self.field!r} of the model"
        what = "output" if self.location is None else f"input {_location_text(self.location)}"
        return f"{what} of {self.path or '<the model>'}"


def _location_text(location: Location) -> str:
    where, key, *inner = location
    text = f"{key}" if where == "kw" else f"#{key}"
    return text + (f"[{inner[0]}]" if inner else "")


class _Probe:
    """Hooks on every module. ``record`` (non-CP) keeps each call's sequence-shaped inputs and output as
    ``checks`` in execution order; ``force`` (CP) compares the same calls' tensors with this rank's shard of
    them and replaces the inputs by it (module docstring)."""

    def __init__(self, model: torch.nn.Module) -> None:
        self.checks: list[_Check] = []
        self.errors: list[float] = []
        self._inputs: dict[tuple[str, int], list[int]] = {}  # (path, call) -> indices of its input checks
        self._outputs: dict[tuple[str, int], int] = {}
        self._calls: dict[tuple[str, str], int] = {}
        self._forcing = False
        self.seq_len: Optional[int] = None
        self.index: Optional[torch.Tensor] = None
        self._fields = 0  # checks from here on: the fields of the model's own output (``_floating_fields``)
        self._whole = 0   # the whole sequence's length (set by ``probe_model``)
        # set when the CP forward runs part of the model on the whole row (images scattered before the sequence
        # is sharded): there a call with whole-row tensors is compared with the whole non-CP tensors
        self.whole_rows_under_cp = False
        self._handles = []
        for name, module in model.named_modules():
            cls = type(module).__name__
            self._handles.append(module.register_forward_pre_hook(self._before(name, cls), with_kwargs=True))
            self._handles.append(module.register_forward_hook(self._after(name, cls), with_kwargs=True))

    def record(self, model, seq_len: int, **kwargs) -> None:
        self._calls, self._forcing, self.seq_len = {}, False, seq_len
        output = model(**kwargs)
        self.seq_len = None
        self._fields = len(self.checks)
        self.checks.extend(_Check("", type(model).__name__, None, value.detach().clone(), field=name)
                           for name, value in _floating_fields(output))

    def field_shape(self, name: str) -> Optional[torch.Size]:
        """The shape of the recorded model output's field ``name``, or None."""
        shapes = [c.expected.shape for c in self.checks[self._fields:] if c.field == name]
        return shapes[0] if shapes else None

    def force(self, model, index: torch.Tensor, **kwargs) -> None:
        self._calls, self._forcing, self.index = {}, True, index
        self.errors = [-1.0 if c.location is not None else math.inf for c in self.checks]
        self.seq_len = index.numel()
        output = model(**kwargs)
        self.seq_len = None
        got = dict(_floating_fields(output))
        for i in range(self._fields, len(self.checks)):
            check = self.checks[i]
            expected = check.expected
            if _along(expected, self._whole):  # a per-token field: this rank's tokens of it
                expected = expected.index_select(1, index)
            elif expected.dim() >= 2 and expected.shape[0] == self._whole:
                # a per-token field with the batch of one flattened into its rows (a MoE model's router logits)
                expected = expected.index_select(0, index)
            value = got.get(check.field)
            if isinstance(value, torch.Tensor) and value.shape == expected.shape:
                self.errors[i] = _relative(value, expected)

    def _call(self, name: str, phase: str) -> int:
        call = self._calls.get((name, phase), 0)
        self._calls[(name, phase)] = call + 1
        return call

    def _before(self, name: str, cls: str):
        def hook(module, args, kwargs):
            if self.seq_len is None:
                return None
            found = self._on_sequence(args, kwargs)
            if not found:
                return None
            call = self._call(name, "in")
            floating = [(loc, t) for loc, t in found if t.is_floating_point() or t.is_complex()]
            if not self._forcing:
                self._inputs[(name, call)] = list(range(len(self.checks), len(self.checks) + len(floating)))
                self.checks.extend(_Check(name, cls, loc, t.detach().clone()) for loc, t in floating)
                return None
            args, kwargs = list(args), dict(kwargs)
            for i in self._inputs.get((name, call), ()):
                check = self.checks[i]
                got = _at(args, kwargs, check.location)
                expected = self._expected(check.expected, got)
                if isinstance(got, torch.Tensor) and got.shape == expected.shape:
                    self.errors[i] = _relative(got, expected)
                    _put(args, kwargs, check.location, expected.to(got.dtype))
            return tuple(args), kwargs
        return hook

    def _after(self, name: str, cls: str):
        def hook(module, args, kwargs, output):
            if self.seq_len is None:
                return None
            tensor = _first_tensor(output)
            if not (self._on_sequence(args, kwargs) or _is_sequence(tensor, self.seq_len)
                    or (self._whole_allowed() and _is_sequence(tensor, self._whole))):
                return None
            call = self._call(name, "out")
            if not self._forcing:
                if _is_sequence(tensor, self.seq_len):
                    self._outputs[(name, call)] = len(self.checks)
                    self.checks.append(_Check(name, cls, None, tensor.detach().clone()))
                return None
            i = self._outputs.get((name, call))
            if i is not None:
                expected = self._expected(self.checks[i].expected, tensor)
                if isinstance(tensor, torch.Tensor) and tensor.shape == expected.shape:
                    self.errors[i] = _relative(tensor, expected)
            return None
        return hook

    def _whole_allowed(self) -> bool:
        return self._forcing and self.whole_rows_under_cp and self._whole != self.seq_len

    def _on_sequence(self, args, kwargs) -> list[tuple[Location, torch.Tensor]]:
        """The call's sequence-shaped inputs: of this forward's length; in a CP forward that runs part of the model
        on the whole row, of the whole row's length where it has none of this rank's."""
        found = _sequence_inputs(args, kwargs, self.seq_len)
        if not found and self._whole_allowed():
            found = _sequence_inputs(args, kwargs, self._whole)
        return found

    def _expected(self, recorded: torch.Tensor, got: Any) -> torch.Tensor:
        """What a CP tensor ``got`` is compared with: the whole non-CP tensor when ``got`` spans the whole row (a
        module before the sequence is sharded), else this rank's tokens of it."""
        if self._whole_allowed() and _along(got, self._whole):
            return recorded
        return recorded.index_select(1, self.index)

    def remove(self) -> None:
        for handle in self._handles:
            handle.remove()


def _is_sequence(value: Any, seq_len: int) -> bool:
    """A floating-point or complex ``(1, seq_len, ...)`` tensor: hidden states, a rotary table, logits."""
    return (isinstance(value, torch.Tensor) and (value.is_floating_point() or value.is_complex())
            and _along(value, seq_len))


def _along(value: Any, seq_len: int) -> bool:
    return isinstance(value, torch.Tensor) and value.dim() >= 2 and value.shape[0] == 1 and value.shape[1] == seq_len


def _sequence_inputs(args, kwargs, seq_len: int) -> list[tuple[Location, torch.Tensor]]:
    """The ``(1, seq_len, ...)`` tensors (token ids and positions included) among a call's arguments, and one plain
    tuple/list level down. A call with none is not on the sequence (the CP form of a mixer projecting a few
    boundary tokens) and is neither counted nor compared, in either forward."""
    found = []
    for location, value in [(("arg", i), a) for i, a in enumerate(args)] + [(("kw", k), v) for k, v in kwargs.items()]:
        if _along(value, seq_len):
            found.append((location, value))
        elif type(value) in (tuple, list):
            found.extend((location + (j,), item) for j, item in enumerate(value) if _along(item, seq_len))
    return found


def _floating_fields(output: Any) -> list[tuple[str, torch.Tensor]]:
    """Every floating-point tensor of what the model returned, by name: a ModelOutput's fields ("logits",
    "loss", ...), a tuple's items ("#1"), one tuple level down ("hidden_states[2]")."""
    if isinstance(output, torch.Tensor):
        items = [("output", output)]
    elif hasattr(output, "items"):
        items = list(output.items())
    elif isinstance(output, (tuple, list)):
        items = [(f"#{i}", value) for i, value in enumerate(output)]
    else:
        return []
    found = []
    for name, value in items:
        values = [(name, value)] if isinstance(value, torch.Tensor) else [
            (f"{name}[{j}]", item) for j, item in enumerate(value)] if isinstance(value, (tuple, list)) else []
        found.extend((key, tensor) for key, tensor in values
                     if isinstance(tensor, torch.Tensor) and (tensor.is_floating_point() or tensor.is_complex()))
    return found


def _at(args: list, kwargs: dict, location: Location) -> Any:
    where, key, *inner = location
    container = args if where == "arg" else kwargs
    if (where == "arg" and key >= len(args)) or (where == "kw" and key not in kwargs):
        return None
    value = container[key]
    if inner:
        return value[inner[0]] if type(value) in (tuple, list) and inner[0] < len(value) else None
    return value


def _put(args: list, kwargs: dict, location: Location, tensor: torch.Tensor) -> None:
    where, key, *inner = location
    container = args if where == "arg" else kwargs
    if inner:
        items = list(container[key])
        items[inner[0]] = tensor
        tensor = type(container[key])(items)
    container[key] = tensor


def _relative(got: torch.Tensor, expected: torch.Tensor) -> float:
    """max|got - expected| / max|expected| in float64 (complex tables compared as real pairs); NaN counts as inf."""
    got, expected = (torch.view_as_real(t) if t.is_complex() else t for t in (got, expected))
    got, expected = got.detach().double(), expected.detach().double()
    error = (got - expected).abs().max().item() / max(expected.abs().max().item(), 1e-30)
    return math.inf if math.isnan(error) else error


def _first_tensor(output: Any) -> Optional[torch.Tensor]:
    """The tensor a module returned: the output itself, the first element of a tuple, the logits of a ModelOutput
    that has them, or its first field."""
    if isinstance(output, torch.Tensor):
        return output
    if isinstance(getattr(output, "logits", None), torch.Tensor):
        return output.logits
    if isinstance(output, (tuple, list)) and output:
        return output[0] if isinstance(output[0], torch.Tensor) else None
    if hasattr(output, "to_tuple"):
        values = output.to_tuple()
        return values[0] if values and isinstance(values[0], torch.Tensor) else None
    return None


def _device_and_dtype(model: torch.nn.Module) -> tuple[torch.device, torch.dtype]:
    for p in model.parameters():
        if p.is_floating_point():
            return p.device, p.dtype
    return torch.device("cpu"), torch.float32


def _vocab_size(model: torch.nn.Module) -> int:
    config = getattr(model, "config", None)
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    size = getattr(text, "vocab_size", None) or getattr(config, "vocab_size", None)
    if not isinstance(size, int) or size < 1:
        embeddings = model.get_input_embeddings() if hasattr(model, "get_input_embeddings") else None
        size = getattr(embeddings, "num_embeddings", 2)
    return size


def _training_flags(model: torch.nn.Module) -> list[tuple[torch.nn.Module, bool]]:
    return [(m, m.training) for m in model.modules()]


def probe_model(model: torch.nn.Module, patch: Any, *, tokens_per_rank: int = PROBE_TOKENS_PER_RANK,
                tolerance: Optional[float] = None) -> ProbeResult:
    """Run the probe (module docstring) on ``model`` over ``patch.ctx.group``; raise ``ModelDivergence`` naming the
    first diverging module input or output, or return the ``ProbeResult``. ``patch``: the ``hfpatch.Patch`` the
    model is on; the probe runs on a context of its own (``dataclasses.replace`` of the patch's, with its own step,
    and its own group where ``_group_for`` makes one: ``patch.running_on``), so the patch's step is untouched.
    ``tolerance``: relative error allowed per compared tensor (default: ``probe_tolerance`` of the model's dtype).
    Collective: every rank of the group must call it. The model's forward must already reach the installed wrapper
    (``apply(model=)`` switches it first). An exception inside either forward propagates (on every rank: the inputs
    and the model are the same on all of them)."""
    ctx = patch.ctx
    device, dtype = _device_and_dtype(model)
    tolerance = probe_tolerance(dtype) if tolerance is None else tolerance
    seq = tokens_per_rank * ctx.world_size
    generator = torch.Generator().manual_seed(_SEED)
    ids = torch.randint(0, _vocab_size(model), (1, seq), generator=generator).to(device)
    labels = _heads.probe_labels(model, 1, generator)  # a pooled head's loss is compared too
    extra = {} if labels is None else {"labels": labels.to(device)}
    images = probe_images(model, seq, ctx.world_size, _vocab_size(model), generator)
    row = ids if images is None else images.ids.to(device)
    no_cache = _no_cache(model)
    flags = _training_flags(model)
    probe = _Probe(model)
    probe._whole = row.shape[1]
    probe.whole_rows_under_cp = images is not None
    group = _group_for(ctx, device)
    heads = ctx.heads
    probe_ctx = dataclasses.replace(ctx)   # its own step: the patch's is untouched
    try:
        if group is not ctx.group:
            if heads is not None and heads.ulysses_group is not None:
                # USP's subgroups of the probe's gloo group (made by every rank of it, as the group was)
                heads = make_usp_groups(group, heads.ulysses, heads.ring, backend="gloo")
            # auto's head-parallel groups belong to the CP group: on its own group the probe plans the ring
            probe_ctx = dataclasses.replace(ctx, group=group, heads=heads, machine=None)
        model.eval()
        with patch.running_on(probe_ctx), torch.no_grad():
            with modes.switch("local"), _named_failure(model, "non-CP"):
                probe.record(model, row.shape[1], input_ids=row, **no_cache, **extra,
                             **_row_inputs(model, images, row, torch.arange(row.shape[1], device=device)[None]))
            text = ids if images is None else images.text.to(device)  # the same length, no image token
            labels_alignment, labels_refusal = _own_loss_check(model, text, tolerance=tolerance,
                                                               logits_shape=probe.field_shape("logits"))
            batch = _inputs.shard_inputs(probe_ctx, row)
            index = batch["position_ids"][0].to(device)  # the global token indices this rank holds, in its order
            with modes.switch("ring"), _named_failure(model, "CP"):
                probe.force(model, index, input_ids=batch["input_ids"], **no_cache, **extra,
                            **_row_inputs(model, images, batch["input_ids"], batch["position_ids"]))
        errors = torch.tensor(probe.errors, dtype=torch.float64)
        if errors.numel():
            errors = _all_max(errors, group, device)
    finally:
        probe.remove()
        if heads is not ctx.heads:
            dist.destroy_process_group(heads.ulysses_group)
            dist.destroy_process_group(heads.ring_group)
        if group is not ctx.group:
            dist.destroy_process_group(group)
        for module, training in flags:
            module.training = training
    values = errors.tolist()
    bad = [i for i, e in enumerate(values) if not e <= tolerance]
    if bad:
        check = probe.checks[bad[0]]
        raise ModelDivergence(_message(model, check, values[bad[0]], tolerance, dtype, ctx),
                              module_path=check.path, module_class=check.cls, error=values[bad[0]],
                              tolerance=tolerance, dtype=dtype, check=check.describe())
    compared = [i for i, e in enumerate(values) if e >= 0.0]
    worst = max(compared, key=lambda i: values[i], default=None)
    return ProbeResult(worst=values[worst] if worst is not None else 0.0, compared=len(compared),
                       tokens=row.shape[1], dtype=dtype,
                       worst_at=probe.checks[worst].describe() if worst is not None else "",
                       labels_refusal=labels_refusal, labels_alignment=labels_alignment,
                       outputs=tuple(c.field for c in probe.checks[probe._fields:]),
                       images=0 if images is None else images.count)


def _row_inputs(model, images: Optional[ProbeImages], ids: torch.Tensor, positions: torch.Tensor) -> dict:
    """The inputs of a probe forward besides the token ids: the position ids (``positions``, where the forward
    takes them) of a text-only row; a row with images gets the image inputs and its per-token image inputs for
    ``ids``, and no position ids: the model numbers its own (multimodal) positions over the whole row, as it does
    without CP."""
    if images is None:
        return position_kwargs(model, positions)
    _, dtype = _device_and_dtype(model)
    moved = {k: v.to(ids.device, dtype) if v.is_floating_point() else v.to(ids.device)
             for k, v in images.inputs.items()}
    return {**moved, **images.per_token(ids)}



def _no_cache(model: torch.nn.Module) -> dict:
    """``{"use_cache": False}`` for a forward that takes it (by name or through ``**kwargs``), else ``{}`` (a QA or
    classification head of a release whose forward has no cache)."""
    try:
        parameters = inspect.signature(model.forward).parameters.values()
    except (TypeError, ValueError):
        return {"use_cache": False}
    takes = any(p.name == "use_cache" or p.kind is p.VAR_KEYWORD for p in parameters)
    return {"use_cache": False} if takes else {}


def _own_loss_check(model, ids: torch.Tensor, *, tolerance: float, logits_shape: Optional[torch.Size]
                    ) -> tuple[str, Optional[str]]:
    """(alignment, refusal) of the model's own non-CP ``model(ids, labels=ids).loss``: ("shifted", None) when it is
    the token-mean cross-entropy of its logits with HF's one-token shift, ("aligned", None) when it is that without
    a shift (each position against its own label) -- the two losses ``hfpatch.model.labels`` computes under CP --, else
    ("shifted", the reason it is neither: a model that shifts twice, adds a term, or fails with labels). The labels
    are the probe's token ids modulo the number of classes the logits score (the vocabulary of a causal LM, the
    labels of a token classifier). A head without per-token logits (a pooled head: ``hfpatch.model.heads``
    computes its loss) is not checked here."""
    if _heads.head_of(model).kind != "per-token":
        return "shifted", None
    if not (logits_shape is not None and len(logits_shape) == 3 and tuple(logits_shape[:2]) == tuple(ids.shape)):
        return "shifted", None  # no per-token logits (a span head): nothing a token loss could match
    positions = position_kwargs(model, torch.arange(ids.shape[1], device=ids.device)[None])
    targets_of = ids % logits_shape[-1]
    try:
        with modes.switch("local"):
            output = model(input_ids=ids, labels=targets_of, **_no_cache(model), **positions)
    except Exception as exc:  # the model's own labels path; CP's loss path is ours
        return "shifted", f"model(labels=...) fails even without CP ({type(exc).__name__}: {exc})"
    loss = getattr(output, "loss", None) if not isinstance(output, tuple) else output[0]
    if not isinstance(loss, torch.Tensor) or loss.dim() != 0:
        return "shifted", None  # no loss of its own to match: hfpatch's loss is the causal-LM loss
    loss = loss - _router_term(model, output)
    expected = {}
    try:
        logits = output.logits if hasattr(output, "logits") else output[1]
        for alignment, targets in (("shifted", _inputs.shift_labels(targets_of)), ("aligned", targets_of)):
            loss_sum, count = _inputs.token_loss_sum(logits, targets)
            expected[alignment] = (loss_sum / count.clamp(min=1)).item()
            if abs(loss.item() - expected[alignment]) / max(abs(expected[alignment]), 1e-30) <= tolerance:
                return alignment, None
    except Exception as exc:  # logits the token loss cannot score: the model's loss is not a token loss of them
        return "shifted", (f"{type(model).__name__}'s own loss for labels= is not a token cross-entropy hfpatch "
                           f"can compute from its logits ({type(exc).__name__}: {exc}).")
    return "shifted", (
        f"{type(model).__name__}'s own loss for labels= ({loss.item():.6g}) is neither the token-mean causal-LM "
        f"cross-entropy of its logits with a one-token shift ({expected['shifted']:.6g}) nor without one "
        f"({expected['aligned']:.6g}): it shifts differently or adds a term, which hfpatch cannot reproduce across "
        "a sharded sequence.")


def _router_term(model, output) -> float:
    """The load-balancing term a MoE model's own loss adds (``router_aux_loss_coef`` x ``aux_loss``) where
    ``hfpatch.model.router_loss`` recognises it (under CP ``hfpatch.model.labels`` adds the group's), else 0."""
    aux = getattr(output, "aux_loss", None) if not isinstance(output, tuple) else None
    found = router_loss.recognise(model) if isinstance(aux, torch.Tensor) else None
    if found is None or isinstance(found, str) or found.coefficient is None:
        return 0.0
    return float(found.read(model, found.coefficient)) * aux.item()


def _forward_failed(which: str, message: str) -> VerificationError:
    """The ``VerificationError`` of a probe forward that raised; ``.forward``: "non-CP" or "CP" (a model that fails
    without CP is not a CP refusal: the model sweep reports it as not built)."""
    error = VerificationError(message)
    error.forward = which
    return error


@contextlib.contextmanager
def _named_failure(model: torch.nn.Module, which: str):
    """An exception of the model's own code during a probe forward becomes a ``VerificationError`` that says which
    forward failed (the cause chained); hfpatch's own errors (a refusal naming its argument) pass unchanged."""
    try:
        yield
    except HfpatchError:
        raise
    except Exception as exc:
        raise _forward_failed(which,
            f"whole-model probe: {type(model).__name__}'s {which} forward raised {type(exc).__name__}: {exc}. "
            + ("Under CP the model's code fails where it runs fine on the whole sequence, so hfpatch cannot train "
               "it under context parallelism; nothing is left installed. Fix: train it without CP "
               "(apply(..., on_unsupported='fallback'))." if which == "CP" else
               "The model fails on the flash-attention path even without CP, so hfpatch cannot check it; nothing is "
               "left installed. Fix: make model(input_ids, position_ids=...) run with attn_implementation="
               "'flash_attention_2', or pass verify='fast' to skip this probe.")
        ) from exc


def _group_for(ctx: Any, device: torch.device):
    """The group the probe's CP forward exchanges over: the CP group, or, for a model still on the CPU (a Trainer
    before FSDP moves it) with a CP group whose backend has no CPU transport (NCCL), a gloo group of the same
    ranks made for the probe (every rank of the CP group makes it: apply is collective over that group)."""
    if device.type != "cpu" or cpu_capable(ctx.group):
        return ctx.group
    ranks = dist.get_process_group_ranks(ctx.group if ctx.group is not None else dist.group.WORLD)
    return dist.new_group(ranks, backend="gloo", use_local_synchronization=True)


def cpu_capable(group) -> bool:
    """Whether ``group``'s backend exchanges CPU tensors (gloo or MPI, alone or as a "cpu:" part of a mixed
    backend); NCCL alone does not."""
    backend = str(dist.get_backend(group)).lower()
    return any(name in backend for name in ("gloo", "mpi", "cpu:"))


def _all_max(errors: torch.Tensor, group, device: torch.device) -> torch.Tensor:
    on_device = errors.to(device)
    dist.all_reduce(on_device, op=dist.ReduceOp.MAX, group=group)
    return on_device.cpu()


def _message(model, check: _Check, error: float, tolerance: float, dtype, ctx) -> str:
    size = "no comparable output under CP" if error == math.inf else f"relative error {error:.3g} > {tolerance:g}"
    culprit = ("This module (or one it reads from) mixes tokens along the sequence outside the patched attention "
               "or numbers positions by the input's length" if check.location is None else
               "The code that computed this input (the forward of the module that called it, between its "
               "submodules) mixes tokens along the sequence or numbers positions by the input's length")
    return (f"whole-model probe: {type(model).__name__}'s CP forward differs from its non-CP forward first at the "
            f"{check.describe()} ({check.cls}): {size} ({dtype}, {ctx.world_size} ranks, kernel {ctx.variant}; "
            f"each module compared on the non-CP run's inputs, so this is not rounding carried through layers). "
            f"{culprit}, so training under CP would be silently wrong; nothing is left installed. Fix: train this "
            "model without context parallelism (apply(..., on_unsupported='fallback')), or, if you know the "
            "difference is harmless, apply(..., verify='fast') skips this probe.")
