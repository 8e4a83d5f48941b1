"""The mixture-of-experts load-balancing loss under context parallelism, made equal to the non-CP one.

With ``output_router_logits=True`` a MoE causal LM (Mixtral, Qwen2-MoE, Qwen3-MoE, OLMoE, GraniteMoE, gpt-oss, ...)
returns ``aux_loss``, transformers' ``load_balancing_loss_func`` of its router logits, and with labels adds
``router_aux_loss_coef * aux_loss`` to its loss. That function is a product of two means over the tokens of the
batch -- the share of top-k assignments each expert got, and each expert's mean routing probability -- so a rank
that computes it from its own shard gets another number. Here both means are taken over the whole CP group: each
rank sums its tokens' assignments (counts) and routing probabilities, the sums and the token count are all-reduced
(the probabilities differentiably: the gradient flows into this rank's tokens only, like ``inputs.reduce_loss``),
and the product of the global means is the non-CP value on every rank.

What is recognised (``recognise``), per release, as the other registries recognise code:

- the modeling module's ``load_balancing_loss_func`` has a fingerprint listed in ``READ`` (the releases whose
  function was read: every one computes the same math; 5.19 onwards accumulates per layer);
- the model's ``forward`` calls it once, as ``load_balancing_loss_func(<router logits>, self.<experts>,
  self.<top k>[, attention_mask])``, and adds ``self.<coefficient> * aux_loss`` to its loss.

Anything else keeps the named refusal of ``output_router_logits=True`` under CP (``hfpatch.model.audit``), with the
reason. For a recognised model ``install`` rebinds the modeling module's ``load_balancing_loss_func`` to
``aux_loss`` below while the patch is live (the model's own function in switch modes "local" and "original", and
without CP): the model's output ``aux_loss`` is then the non-CP value whoever reads it (the model's own loss, TRL's
SFTTrainer, the user), and the loss ``hfpatch.model.labels`` computes adds the coefficient times it, as the model
does.

Tokens the non-CP run does not count weigh 0, as the release's function weighs rows by the attention mask: the
model's own mask where it passes one, else the step's ``token_weights`` (``hfpatch.integrations`` records its end
padding and the batch's dropped padding mask there).

Gradients follow the loss's convention (``hfpatch.model.labels``): by default the value is the non-CP value on
every rank and the gradient reaches this rank's router probabilities only, so the parameter gradients SUMMED over
the CP group are the non-CP ones; inside ``averaged_over_group()`` the gradient is the CP size times that, so that
gradients AVERAGED over the group are the non-CP ones (the value stays the non-CP value).
"""
from __future__ import annotations

import ast
import functools
import inspect
import sys
import textwrap
import threading
from dataclasses import dataclass
from typing import Any, Callable, Optional, Union

import torch
import torch.distributed as dist

from hfpatch.mixers.family import forward_fingerprint
from hfpatch.model.wrappers import inner_model
from hfpatch.modes import current_mode
from hfpatch.undo import mark_wrapper

__all__ = ["READ", "RouterLoss", "recognise", "recognise_class", "requested", "install", "aux_loss"]

# load_balancing_loss_func fingerprints (``hfpatch.mixers.family.forward_fingerprint``) -> the releases it was read
# in. Every one computes num_experts x sum_e (share of the top-k assignments to e) x (mean probability of e) over
# the rows of every layer, padding rows weighted out by the attention mask.
READ = {
    "31b4e9853bc82c12": "4.43",
    "f25c1a505cd619a9": "4.44 - 4.46",
    "80df4d29dbf27b6f": "4.47 - 4.52",
    "4b8c8158c2488f23": "4.53 - 4.57",
    "62b654d3837eb081": "5.0 - 5.18",
    "f2eb3803315590b1": "5.19 - 5.23",
    "07198857a28994f1": "5.24",
}
_FUNCTION = "load_balancing_loss_func"


@dataclass(frozen=True)
class RouterLoss:
    """How a model class computes its load-balancing loss: ``experts`` and ``top_k``, the attribute paths (from the
    model) of the number of experts and of the experts each token is routed to; ``coefficient``, that of the
    coefficient its loss adds the aux loss with (None: its forward adds none)."""

    experts: str
    top_k: str
    coefficient: Optional[str]

    def read(self, model: torch.nn.Module, path: str) -> Any:
        value = model
        for name in path.split("."):
            value = getattr(value, name)
        return value


def requested(model: torch.nn.Module, kwargs: dict) -> bool:
    """Whether this call returns the load-balancing loss: ``output_router_logits`` given, else the config's."""
    given = kwargs.get("output_router_logits")
    if given is not None:
        return bool(given)
    config = getattr(model, "config", None)
    return bool(getattr(config, "output_router_logits", False))


def recognise(model: torch.nn.Module) -> Union[RouterLoss, str]:
    """The ``RouterLoss`` of ``model``'s class (a wrapper's: of the transformers model inside), or why it is not
    recognised (module docstring)."""
    return recognise_class(type(inner_model(model)))


@functools.lru_cache(maxsize=None)
def recognise_class(cls: type) -> Union[RouterLoss, str]:
    """``recognise`` of a model class, read once per class (``recognise_class.cache_clear()`` reads again)."""
    module = sys.modules.get(cls.__module__)
    function = getattr(module, _FUNCTION, None)
    if function is None:
        return f"{cls.__name__}'s module ({cls.__module__}) has no {_FUNCTION}"
    fingerprint = forward_fingerprint(function)
    if fingerprint not in READ:
        return (f"{cls.__module__}.{_FUNCTION} (fingerprint {fingerprint}) is not a load-balancing loss hfpatch has "
                f"read (read: transformers {', '.join(READ.values())})")
    try:
        tree = ast.parse(textwrap.dedent(inspect.getsource(inspect.unwrap(cls.forward))))
    except (OSError, TypeError, SyntaxError) as exc:
        return f"{cls.__name__}.forward's source cannot be read ({exc})"
    calls = [node for node in ast.walk(tree) if isinstance(node, ast.Call)
             and isinstance(node.func, ast.Name) and node.func.id == _FUNCTION]
    if len(calls) != 1:
        return f"{cls.__name__}.forward calls {_FUNCTION} {len(calls)} times (read: once)"
    arguments = list(calls[0].args) + [keyword.value for keyword in calls[0].keywords]
    paths = [_self_path(node) for node in arguments[1:3]]
    if len(arguments) < 3 or None in paths:
        return f"{cls.__name__}.forward passes {_FUNCTION} its number of experts or top-k otherwise than from self"
    mask = arguments[3:4]
    if mask and not (isinstance(mask[0], ast.Name) and mask[0].id == "attention_mask"):
        return f"{cls.__name__}.forward passes {_FUNCTION} a mask other than its attention_mask"
    return RouterLoss(experts=paths[0], top_k=paths[1], coefficient=_coefficient(tree))


def _self_path(node: ast.AST) -> Optional[str]:
    """"a.b" for the expression ``self.a.b``, else None."""
    names = []
    while isinstance(node, ast.Attribute):
        names.append(node.attr)
        node = node.value
    return ".".join(reversed(names)) if isinstance(node, ast.Name) and node.id == "self" and names else None


def _coefficient(tree: ast.AST) -> Optional[str]:
    """The path of ``self.<coefficient>`` in the forward's ``loss += self.<coefficient> * aux_loss...``."""
    for node in ast.walk(tree):
        if isinstance(node, ast.AugAssign) and isinstance(node.op, ast.Add) and isinstance(node.value, ast.BinOp) \
                and isinstance(node.value.op, ast.Mult):
            uses_aux = any(isinstance(n, ast.Name) and n.id == "aux_loss" for n in ast.walk(node.value.right))
            path = _self_path(node.value.left)
            if uses_aux and path is not None:
                return path
    return None


class _Rebound:
    """One modeling module's ``load_balancing_loss_func`` rebound by ``install``, for ``models`` models: the last
    ``remove()`` puts the release's function back (if the name still holds the wrapper)."""

    def __init__(self, module, original: Callable, wrapper: Callable) -> None:
        self.module, self.original, self.wrapper, self.models = module, original, wrapper, 0


_REBOUND: dict = {}   # modeling module name -> its _Rebound while any model of it is installed


class _Inside(threading.local):
    """Per thread: how many forwards of installed models are running (the rebound function computes the group's
    loss only inside one: another model of the same class, off the patch, keeps its own)."""

    def __init__(self) -> None:
        self.depth = 0


_inside = _Inside()


def _enter(module, args) -> None:
    _inside.depth += 1


def _leave(module, args, output) -> None:
    _inside.depth -= 1


class _Installed:
    """What ``install`` returns: ``remove()`` takes the model's forward hooks off and releases its hold on its
    module's rebinding."""

    def __init__(self, rebound: _Rebound, hooks: list) -> None:
        self.rebound, self.hooks = rebound, hooks

    def remove(self) -> None:
        for hook in self.hooks:
            hook.remove()
        rebound = self.rebound
        rebound.models -= 1
        if rebound.models == 0:
            if getattr(rebound.module, _FUNCTION, None) is rebound.wrapper:
                setattr(rebound.module, _FUNCTION, rebound.original)
            _REBOUND.pop(rebound.module.__name__, None)


def install(model: torch.nn.Module, ctx_of: Callable[[], Any], averaged_now: Callable[[], bool]
            ) -> Optional[_Installed]:
    """Rebind the load-balancing loss of ``model``'s modeling module to the group's (module docstring), for the
    calls made inside ``model``'s forward (other models of its class keep the release's), or None when the model
    has none hfpatch recognises. ``ctx_of()``: the live ``RingContext`` or None; ``averaged_now()``:
    whether this thread runs inside ``averaged_over_group()`` (the gradient convention)."""
    if isinstance(recognise(model), str):
        return None
    module = sys.modules[type(inner_model(model)).__module__]
    rebound = _REBOUND.get(module.__name__)
    if rebound is None:
        original = getattr(module, _FUNCTION)

        @functools.wraps(original)
        def load_balancing_loss_func(gate_logits, num_experts=None, top_k=2, attention_mask=None):
            ctx = ctx_of() if _inside.depth else None
            if ctx is None or ctx.world_size < 2 or current_mode() in ("local", "original") \
                    or not isinstance(gate_logits, tuple):
                return original(gate_logits, num_experts, top_k, attention_mask)
            if attention_mask is None:
                attention_mask = _step_weights(ctx, gate_logits)
            return aux_loss(ctx, gate_logits, num_experts, top_k, attention_mask, averaged=averaged_now())

        rebound = _REBOUND[module.__name__] = _Rebound(module, original, mark_wrapper(load_balancing_loss_func))
        setattr(module, _FUNCTION, rebound.wrapper)
    rebound.models += 1
    hooks = [model.register_forward_pre_hook(_enter), model.register_forward_hook(_leave, always_call=True)]
    return _Installed(rebound, hooks)


def _step_weights(ctx: Any, router_logits) -> Optional[torch.Tensor]:
    """The step's token weights (``StepState.token_weights``: 0 on tokens the non-CP run does not count) when they
    describe these router logits' rows, else None."""
    step = ctx.step
    weights = getattr(step, "token_weights", None)
    if weights is None or weights.numel() * router_logits[0].shape[-1] != router_logits[0].numel():
        return None
    return weights


def aux_loss(ctx: Any, router_logits, num_experts: int, top_k: int, attention_mask: Optional[torch.Tensor], *,
             averaged: bool = False) -> torch.Tensor:
    """The load-balancing loss of the whole CP group's tokens (module docstring), on every rank. ``router_logits``:
    the model's per-layer router logits of this rank's tokens, each (rows, experts); ``attention_mask``: this rank's
    mask (B, S_local) or None; ``averaged``: the gradient convention of ``averaged_over_group()``."""
    device = router_logits[0].device
    counts = torch.zeros(num_experts, dtype=torch.float32, device=device)
    probabilities = torch.zeros(num_experts, dtype=torch.float32, device=device)
    rows = torch.zeros((), dtype=torch.float32, device=device)
    weights = None if attention_mask is None else attention_mask.reshape(-1).to(device=device, dtype=torch.float32)
    for layer in router_logits:
        routing = torch.softmax(layer.to(device).reshape(-1, num_experts).float(), dim=-1)
        _, selected = torch.topk(routing, top_k, dim=-1)
        weight = torch.ones(routing.shape[0], device=device) if weights is None else weights
        counts = counts.scatter_add(0, selected.reshape(-1), weight.repeat_interleave(top_k))
        probabilities = probabilities + (routing * weight[:, None]).sum(dim=0)
        rows = rows + weight.sum()
    totals = torch.cat([counts, rows.reshape(1)]).detach()
    world = ctx.world_size if ctx is not None else 1
    if world > 1:
        dist.all_reduce(totals, group=ctx.group)
        summed = probabilities.detach().clone()
        dist.all_reduce(summed, group=ctx.group)
        probabilities = probabilities + (summed - probabilities.detach())   # the gradient: this rank's tokens only
    rows = totals[-1].clamp(min=1)
    loss = num_experts * torch.sum((totals[:-1] / rows) * (probabilities / rows))
    if averaged and world > 1:
        loss = world * loss - (world - 1) * loss.detach()                   # the value unchanged, the gradient x C
    return loss
