"""Run the model sweep: every catalog class, built tiny, trained one step under CP against non-CP.

Per class, on every rank of a gloo group (``check_class``):

1. build it tiny (``tiny.build_tiny``; ``NotBuilt`` -> verdict "not built");
2. ``hfpatch.apply(group, model=model)`` -- audit, switch, numeric and whole-model probes; a named hfpatch error
   here is the verdict "refused";
3. non-CP: the model on the whole batch in switch mode ``"local"`` (plain attention on the whole sequence, the
   flash path's semantics), ``model(input_ids, position_ids, labels=input_ids).loss`` (the model's own loss) and
   its gradients;
4. CP: ``patch.shard_inputs`` and ``model(..., labels=<its labels>).loss``, backward, the gradients summed over
   the group; a named hfpatch error before the backward is "refused" as well;
5. compare: **exact** when |loss_cp - loss| <= ``LOSS_RTOL`` x |loss| and, for every parameter,
   max |g_cp - g| <= ``GRAD_RTOL`` x max |g| of that parameter (plus ``GRAD_FLOOR`` x the largest gradient of the
   model, so that parameters whose gradient is rounding noise compare by the model's scale).

Anything else is a defect the sweep reports: "silent" (CP ran and differs) or "unnamed" (an exception that is
not an hfpatch error, under CP only). The ranks agree on each verdict (the worst over ranks).

The head-parallel columns (``HEAD_PARALLEL_COLUMNS``, ``run_columns``) run the same check under
``apply(kernel="ulysses")`` on 2 ranks and ``apply(kernel="usp:2x2")`` on 4, on a representative subset of the
classes: a full column costs as much as the whole sweep.
"""
from __future__ import annotations

import time
import traceback
from dataclasses import asdict, dataclass
from typing import Optional

import torch
import torch.distributed as dist

import hfpatch
from hfpatch.errors import HfpatchError, ModelDivergence, UnsupportedArgument, UnsupportedModel
from hfpatch import inputs
from hfpatch.model import router_loss
from hfpatch.model.positions import position_kwargs
from hfpatch.release.sweep.catalog import CatalogEntry, flash_causal_lm_classes, flash_head_classes
from hfpatch.release.sweep.tiny import NotBuilt, build_tiny, training_inputs, training_labels
from ring_kernels.tolerances import tolerance
from ring_kernels.world import DistributedFailure, report, run_world

__all__ = ["Verdict", "VERDICTS", "LOSS_RTOL", "GRAD_RTOL", "GRAD_FLOOR", "HEAD_PARALLEL_COLUMNS", "HEADS_CHECKED_IN_CI",
           "check_class",
           "run_sweep", "run_columns"]

# The sweep's entries of the project's tolerance table (ring_kernels.tolerances, quoted in docs/user-guide.md).
LOSS_RTOL = tolerance("sweep", torch.float32, "loss").bound
GRAD_RTOL = tolerance("sweep", torch.float32, "grad").bound
GRAD_FLOOR = tolerance("sweep", torch.float32, "grad").floor
SEQ_LEN = 32
BATCH = 2
# Worst first: the ranks agree on the verdict of the lowest rank in this order.
VERDICTS = ("unnamed", "silent", "not built", "refused", "exact")
# MODELS.md's head-parallel columns: kernel -> (world size, the model types it checks). Each is a representative
# subset -- the attention features (GQA; a sliding window with softcap; sinks with a sliding window and MoE; learned
# positions and Conv1D projections; a decoder scored on aligned labels) and a model of every sequence-mixer family
# for Ulysses; a plain decoder, the sinks and a hybrid for USP -- because a full column under Ulysses takes as long
# as the whole sweep (146 classes on 2 ranks: 46 s of CPU against 41), and USP runs 4 ranks.
HEAD_PARALLEL_COLUMNS = {
    "ulysses": (2, ("llama", "gemma2", "gpt_oss", "gpt2", "bart", "lfm2", "qwen3_next", "kimi_linear", "bamba",
                    "jamba", "minimax", "recurrent_gemma", "zaya")),
    "usp:2x2": (4, ("llama", "gpt_oss", "bamba")),
}


# The heads table's model types CI checks against MODELS.md on every run (tests/model/test_model_sweep.py): the
# whole heads sweep takes about as long as the causal-LM sweep and its columns together (3 minutes on 2 cores), so,
# as for the head-parallel columns, CI runs a representative subset -- last-token pooling (llama, qwen2, gpt2;
# gemma3, whose head only hands its arguments to transformers' shared classifier forward), an encoder's refused
# pooler and its per-token heads (bert, distilbert), vision-language models (qwen2_vl with its multimodal rotary
# sections, llava), MoE (mixtral) and the PEFT rows of those types -- and `hfpatch models --write` / `--check` the
# whole table.
HEADS_CHECKED_IN_CI = ("llama", "qwen2", "gpt2", "gemma3", "bert", "distilbert", "qwen2_vl", "llava", "mixtral")


@dataclass(frozen=True)
class Verdict:
    """One class's result. ``verdict`` in ``VERDICTS``; ``detail``: the refusal's error class and first sentence,
    the reason it was not built, or the mismatch; ``loss_error`` / ``grad_error``: relative errors (exact and
    silent only); ``seconds``: wall time of the class on rank 0; ``kernel``: ``hfpatch.apply``'s kernel."""

    model_type: str
    class_name: str
    verdict: str
    detail: str = ""
    loss_error: Optional[float] = None
    grad_error: Optional[float] = None
    seconds: float = 0.0
    kernel: str = "auto"
    head: str = "causal-lm"

    def to_json(self) -> dict:
        return asdict(self)


def _first_sentence(exc: BaseException, limit: int = 220) -> str:
    text = " ".join(str(exc).split())
    cut = text.find(". ")
    text = text if cut < 0 else text[:cut + 1]
    return f"{type(exc).__name__}: {text[:limit]}"


def _refusal(exc: BaseException) -> str:
    """A refusal in a table cell: the error class and what it names."""
    if isinstance(exc, UnsupportedModel):
        kinds = sorted({f.kind for f in exc.findings})
        return (f"UnsupportedModel ({', '.join(kinds)}): {exc.module_path or '<model>'} ({exc.module_class})"
                + (f" and {len(exc.findings) - 1} more" if len(exc.findings) > 1 else ""))
    if isinstance(exc, ModelDivergence):
        return f"ModelDivergence: {exc.module_path or '<model output>'} ({exc.module_class}), error {exc.error:.2g}"
    if isinstance(exc, UnsupportedArgument):
        reason = exc.reason.split(". ")[0].rstrip(".")
        return f"UnsupportedArgument: {exc.parameter}: {reason}"
    return _first_sentence(exc)


def _inputs(vocab: int):
    generator = torch.Generator().manual_seed(1234)
    return torch.randint(0, vocab, (BATCH, SEQ_LEN), generator=generator)


def _vocab(model) -> int:
    config = model.config.get_text_config() if hasattr(model.config, "get_text_config") else model.config
    return int(getattr(config, "vocab_size", None) or model.get_input_embeddings().num_embeddings)


def _loss_of(output) -> torch.Tensor:
    loss = output.loss if hasattr(output, "loss") else None
    if loss is None:
        raise RuntimeError("the model returned no loss for labels=")
    return loss


def _grads(model, group=None) -> dict:
    grads = {}
    for name, p in model.named_parameters():
        if not p.requires_grad:
            continue
        g = torch.zeros_like(p) if p.grad is None else p.grad.detach().clone()
        if group is not None:
            dist.all_reduce(g, group=group)
        grads[name] = g
    return grads


def _row_labels(model) -> torch.Tensor:
    """A sequence classifier's labels, one per row (a float score for a one-label regression head)."""
    num_labels = int(getattr(model.config, "num_labels", 2))
    generator = torch.Generator().manual_seed(99)
    if num_labels == 1:
        return torch.randn(BATCH, generator=generator)
    return torch.randint(0, num_labels, (BATCH,), generator=generator)


def _span_weights() -> tuple[torch.Tensor, torch.Tensor]:
    """Fixed positive weights on every token's start and end logits: a QA head is trained on their weighted sum of
    squares (its span loss is refused under CP; the logits, per token, are what CP must get right). Positive terms:
    the sum's relative error is bounded by its terms', as a cross-entropy's is."""
    generator = torch.Generator().manual_seed(98)
    return (torch.rand(BATCH, SEQ_LEN, generator=generator) + 0.5,
            torch.rand(BATCH, SEQ_LEN, generator=generator) + 0.5)


def _step_loss(model, head: str, ids, positions, labels, index=None, ctx=None) -> torch.Tensor:
    """The loss of one step of ``head`` on the tokens ``ids`` (this rank's under CP: ``index`` their global
    positions, ``labels`` the shard's labels): the model's own loss, or a QA head's weighted logits summed over
    the group (``ctx``)."""
    common = dict(**position_kwargs(model, positions), **training_inputs(model, ids))
    if head == "question-answering":
        output = model(input_ids=ids, **common)
        start, end = _span_weights()
        if index is not None:
            start, end = start.index_select(1, index), end.index_select(1, index)
        local = (output.start_logits.float() ** 2 * start).sum() + (output.end_logits.float() ** 2 * end).sum()
        return local if ctx is None else inputs.global_loss_sum(ctx, local)
    output = model(input_ids=ids, labels=labels, use_cache=False, **common)
    if head == "moe-aux-loss" and getattr(output, "aux_loss", None) is None:
        raise RuntimeError("the model returned no aux_loss: its load-balancing loss did not run")
    return _loss_of(output)


def _labels_for(model, head: str, ids) -> torch.Tensor:
    if head == "sequence-classification":
        return _row_labels(model)
    if head == "token-classification":
        return ids % int(getattr(model.config, "num_labels", 2))
    return training_labels(model, ids)


def _non_cp_step(model, ids, head: str = "causal-lm") -> tuple[float, dict]:
    model.zero_grad(set_to_none=True)
    positions = torch.arange(ids.shape[1])[None].expand_as(ids)
    with hfpatch.switch("local"):
        loss = _step_loss(model, head, ids, positions, _labels_for(model, head, ids))
        loss.backward()
    return loss.item(), _grads(model)


def _cp_step(patch, model, ids, group, head: str = "causal-lm") -> tuple[float, dict]:
    model.zero_grad(set_to_none=True)
    per_token = head not in ("sequence-classification", "question-answering")
    # a causal LM's labels are its token ids (a MusicGen decoder's own loss takes one copy per codebook, which
    # shard_inputs refuses, and the sweep reports); a token classifier's are its tags
    token_labels = _labels_for(model, head, ids) if head == "token-classification" else ids
    batch = patch.shard_inputs(ids, labels=token_labels if per_token else None)
    labels = batch["labels"] if per_token else _labels_for(model, head, ids)
    index = batch["position_ids"][0] if head == "question-answering" else None
    loss = _step_loss(model, head, batch["input_ids"], batch["position_ids"], labels, index=index, ctx=patch.ctx)
    loss.backward()
    return loss.item(), _grads(model, group)


def _build(entry: CatalogEntry, build_tiny) -> torch.nn.Module:
    """The tiny model of ``entry`` as its head trains it: without dropout (the config's are 0 already, a
    classifier's own default is not), a sequence classifier with a pad token (transformers pools batch rows only
    with one), a PEFT row with LoRA on every linear layer; ``NotBuilt`` as ``build_tiny``."""
    model = build_tiny(entry)
    for module in model.modules():  # a head's own dropout (a classifier's default 0.1): the steps compare exactly
        if isinstance(module, torch.nn.Dropout):
            module.p = 0.0
    if entry.head == "sequence-classification":
        text = model.config.get_text_config() if hasattr(model.config, "get_text_config") else model.config
        if getattr(text, "pad_token_id", None) is None:
            text.pad_token_id = model.config.pad_token_id = 0
    if entry.head == "moe-aux-loss":
        _balance_experts(model)
    if entry.head == "peft-lora":
        import peft  # deferred (peft): only the PEFT rows, only where it is installed

        torch.manual_seed(0)
        model = peft.get_peft_model(model, peft.LoraConfig(r=4, lora_alpha=8, lora_dropout=0.0,
                                                           target_modules="all-linear", init_lora_weights=False))
    return model


AUX_LOSS_COEFFICIENT = 0.5   # large enough that a wrong load-balancing loss moves the loss and the router gradients


def _balance_experts(model) -> None:
    """Turn a MoE model's load-balancing loss on: ``output_router_logits`` in its configs, and its coefficient
    (where ``hfpatch.model.router_loss`` reads from where the forward takes it) ``AUX_LOSS_COEFFICIENT``. An
    unrecognised loss keeps its own coefficient: apply refuses it by name."""
    text = model.config.get_text_config() if hasattr(model.config, "get_text_config") else model.config
    for config in {id(c): c for c in (model.config, text)}.values():
        config.output_router_logits = True
        config.router_aux_loss_coef = AUX_LOSS_COEFFICIENT
    found = router_loss.recognise(model)
    if not isinstance(found, str) and found.coefficient is not None:
        *parents, name = found.coefficient.split(".")
        owner = found.read(model, ".".join(parents)) if parents else model
        setattr(owner, name, AUX_LOSS_COEFFICIENT)


def _compare(loss_cp, grads_cp, loss_ref, grads_ref) -> tuple[float, float, str]:
    """(loss error, worst gradient error, mismatch text or "")."""
    loss_error = abs(loss_cp - loss_ref) / max(abs(loss_ref), 1e-30)
    largest = max((g.abs().max().item() for g in grads_ref.values() if g.numel()), default=0.0)
    worst, worst_name = 0.0, ""
    for name, ref in grads_ref.items():
        if not ref.numel():
            continue
        bound = GRAD_RTOL * ref.abs().max().item() + GRAD_FLOOR * largest
        error = (grads_cp[name] - ref).abs().max().item()
        ratio = error / bound if bound > 0 else (0.0 if error == 0 else float("inf"))
        if ratio > worst or ratio != ratio:
            worst, worst_name = ratio if ratio == ratio else float("inf"), name
    problems = []
    if not loss_error <= LOSS_RTOL:
        problems.append(f"loss {loss_cp:.8g} vs non-CP {loss_ref:.8g} (relative {loss_error:.2e})")
    if worst > 1.0:
        problems.append(f"gradient of {worst_name} off by {worst:.3g} x its tolerance")
    return loss_error, worst, "; ".join(problems)


def check_class(entry: CatalogEntry, group, *, kernel: str = "auto") -> Verdict:
    """The verdict of one class (module docstring). Collective over ``group``; every rank returns the same."""
    start = time.perf_counter()
    local = _check_here(entry, group, kernel, hfpatch, HfpatchError, NotBuilt, build_tiny)
    local = Verdict(**{**asdict(local), "seconds": round(time.perf_counter() - start, 3)})
    every: list = [None] * dist.get_world_size(group)
    dist.all_gather_object(every, local.to_json(), group=group)
    return Verdict(**min(every, key=lambda v: VERDICTS.index(v["verdict"])))


def _check_here(entry, group, kernel, hfpatch, HfpatchError, NotBuilt, build_tiny) -> Verdict:
    same = dict(model_type=entry.model_type, class_name=entry.class_name, kernel=kernel, head=entry.head)
    if entry.import_error:
        return Verdict(**same, verdict="not built", detail=f"import fails: {entry.import_error}")
    try:
        model = _build(entry, build_tiny)
    except NotBuilt as exc:
        return Verdict(**same, verdict="not built", detail=exc.reason)
    ids = _inputs(_vocab(model))
    try:
        patch = hfpatch.apply(group, model=model, kernel=kernel)
    except HfpatchError as exc:
        if entry.head != "causal-lm" and getattr(exc, "forward", None) == "non-CP":
            # the heads table: the tiny model fails without CP (a composite config the shrink breaks); the causal
            # table keeps such a class refused by the probe, as it always did
            return Verdict(**same, verdict="not built", detail=f"the model fails without CP: {_first_sentence(exc)}")
        return Verdict(**same, verdict="refused", detail=_refusal(exc))
    except Exception as exc:  # the defect the sweep exists to find: reported, never raised
        return Verdict(**same, verdict="unnamed", detail=f"apply: {_first_sentence(exc)}\n{traceback.format_exc()}")
    try:
        try:
            loss_ref, grads_ref = _non_cp_step(model, ids, entry.head)
        except Exception as exc:
            return Verdict(**same, verdict="not built", detail=f"non-CP step fails: {_first_sentence(exc)}")
        try:
            loss_cp, grads_cp = _cp_step(patch, model, ids, group, entry.head)
        except HfpatchError as exc:
            return Verdict(**same, verdict="refused", detail=_refusal(exc))
        except Exception as exc:
            return Verdict(**same, verdict="unnamed",
                           detail=f"CP step: {_first_sentence(exc)}\n{traceback.format_exc()}")
    finally:
        patch.remove()
    loss_error, grad_error, mismatch = _compare(loss_cp, grads_cp, loss_ref, grads_ref)
    return Verdict(**same, verdict="silent" if mismatch else "exact", detail=mismatch,
                   loss_error=loss_error, grad_error=grad_error)


# ------------------------------------------------------------------------------------------ the world


def _rank_main(rank: int, world: int, names: Optional[list], kernel: str, model_types: Optional[tuple] = None,
               heads: bool = False) -> None:
    """One rank of the sweep's world: check every catalog class (or those in ``names``, of ``model_types``; the
    heads table's with ``heads``); rank 0 reports each verdict as it is reached."""
    from transformers.utils import logging as hf_logging

    hf_logging.set_verbosity_error()  # tiny configs trip many harmless warnings
    catalog = flash_head_classes() if heads else flash_causal_lm_classes()
    for entry in [e for e in catalog if (names is None or e.class_name in names)
                  and (model_types is None or e.model_type in model_types)]:
        verdict = check_class(entry, dist.group.WORLD, kernel=kernel)
        if rank == 0:
            report(verdict.to_json())


def run_sweep(*, world_size: int = 2, classes: Optional[list[str]] = None, kernel: str = "auto",
              model_types: Optional[tuple] = None, progress=None, heads: bool = False) -> list[Verdict]:
    """Spawn ``world_size`` CPU processes (gloo) and check every catalog class (or those named in ``classes``, of
    ``model_types``; with ``heads``, the heads table's: ``catalog.flash_head_classes``) under
    ``apply(kernel=kernel)``; returns the verdicts in catalog order. ``progress(verdict)`` is called as each
    arrives. Raises ``RuntimeError`` with the failing rank's traceback if a rank dies (a defect
    of the sweep itself)."""
    verdicts: list[Verdict] = []

    def arrived(rank: int, payload: dict) -> None:
        verdicts.append(Verdict(**payload))
        if progress is not None:
            progress(verdicts[-1])

    try:
        run_world(world_size, _rank_main, classes, kernel, model_types, heads, timeout=None, group_timeout=300.0,
                  on_report=arrived)
    except DistributedFailure as exc:
        raise RuntimeError(f"the model sweep's world failed after {len(verdicts)} classes:\n{exc}") from exc
    return verdicts


def run_columns(*, progress=None) -> list[Verdict]:
    """The verdicts of MODELS.md's head-parallel columns: each kernel of ``HEAD_PARALLEL_COLUMNS`` on its world
    size and model types (``run_sweep``)."""
    verdicts: list[Verdict] = []
    for kernel, (world_size, model_types) in HEAD_PARALLEL_COLUMNS.items():
        verdicts += run_sweep(world_size=world_size, kernel=kernel, model_types=model_types, progress=progress)
    return verdicts
