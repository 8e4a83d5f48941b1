"""Model heads under context parallelism (``hfpatch.model.heads``): every output a user reads is the non-CP one on
every rank, or the model is refused by name.

- Sequence classifiers, reward and value models (``*ForSequenceClassification``, ``num_labels`` 2 and 1): the
  pooled scores on every rank, the loss with labels, and every gradient summed over the ranks equal the non-CP
  ones, for batch rows padded on the right and on the left, with ``pad_token_id`` set and unset, and for a packed
  row; Llama and Qwen2 (transformers' two pooling code paths share one rule per release).
- The whole-model probe compares the pooled output: with hfpatch's pooling taken out (the bug it fixes: each rank
  pools its own last token), ``apply(model=)`` refuses the model naming the output field.
- Token classifiers: per-token scores and the model's own loss from ``shard_inputs`` labels are exact.
- QA heads: start / end logits exact on every rank; ``start_positions`` refused by name under CP.
- A pooled head whose rule hfpatch does not reproduce is refused at ``apply`` by name (``pooled-head``).
"""
from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

import hfpatch
from _dist import run_world
from hfpatch.model import attach
from hfpatch.errors import ModelDivergence, UnsupportedArgument, UnsupportedModel
from hfpatch.model import heads
from hfpatch.model.probe import probe_tolerance
from ring_kernels.tolerances import assert_close, tolerance

FORWARD = tolerance("cp", torch.float32, "out")
LOSS = tolerance("cp", torch.float32, "loss")
GRAD = tolerance("cp", torch.float32, "grad")
SEQ = 16
PAD = 0


def _config(family: str, **overrides):
    import transformers

    shape = dict(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=2, max_position_embeddings=128)
    shape.update(overrides)
    return {"llama": transformers.LlamaConfig, "qwen2": transformers.Qwen2Config}[family](**shape)


def _build(family: str, head: str, **overrides):
    import transformers

    torch.manual_seed(0)
    cls = getattr(transformers, {"llama": "Llama", "qwen2": "Qwen2"}[family] + head)
    return cls(_config(family, **overrides)).float()


def _rows(padding: str):
    """Two rows of SEQ tokens (ids 1..63), padded on the right or the left with PAD, or unpadded."""
    g = torch.Generator().manual_seed(7)
    ids = torch.randint(1, 64, (2, SEQ), generator=g)
    if padding == "right":
        ids[0, 11:] = PAD          # row 0's last real token sits in the zigzag middle: rank 1's chunk
    elif padding == "left":
        ids[1, :5] = PAD
    return ids


def _labels(num_labels: int, batch: int):
    g = torch.Generator().manual_seed(11)
    return torch.randn(batch, generator=g) if num_labels == 1 else torch.randint(0, num_labels, (batch,), generator=g)


def _grads(model, summed: bool):
    out = {}
    for name, p in model.named_parameters():
        g = (p.grad if p.grad is not None else torch.zeros_like(p)).clone()
        if summed:
            dist.all_reduce(g)
        out[name] = g
    return out


def _classifier_inputs(padding, rows):
    """(input_ids, position_ids or None, the non-CP reference's input_ids and position_ids) of one case."""
    ids = _rows(padding)[:rows]
    if padding != "packed":
        return ids, None, ids, None
    docs = [5, 7, 4]   # one row of three documents: the row's last token is the last document's
    pos = torch.cat([torch.arange(n) for n in docs]).unsqueeze(0)
    last = docs[-1]    # documents attend to themselves only: the last document alone is the non-CP computation
    return ids, pos, ids[:, -last:], torch.arange(last)[None]


def _classifier_cases(family, num_labels, pad_token_id, cases):
    """One model on the ring, each (padding, rows) case a step: pooled scores and loss on every rank, gradients
    summed over the ranks, against the same model's eager non-CP step."""
    overrides = dict(num_labels=num_labels, pad_token_id=pad_token_id)
    reference = _build(family, "ForSequenceClassification", attn_implementation="eager", **overrides)
    model = _build(family, "ForSequenceClassification", **overrides)
    with hfpatch.apply(dist.group.WORLD, model=model) as patch:
        for padding, rows in cases:
            label = f"{family} num_labels={num_labels} pad={pad_token_id} {padding} x{rows}"
            ids, pos, ref_ids, ref_pos = _classifier_inputs(padding, rows)
            labels = _labels(num_labels, ids.shape[0])
            reference.zero_grad(set_to_none=True)
            ref = reference(input_ids=ref_ids, position_ids=ref_pos, labels=labels)
            ref.loss.backward()
            ref_grads = _grads(reference, summed=False)
            model.zero_grad(set_to_none=True)
            batch = patch.shard_inputs(ids, position_ids=pos)
            out = model(input_ids=batch["input_ids"], position_ids=batch["position_ids"], labels=labels,
                        use_cache=False)
            assert out.logits.shape == ref.logits.shape, label
            assert_close(out.logits.detach(), ref.logits.detach(), FORWARD, f"{label}: pooled scores, rank "
                         f"{dist.get_rank()}")
            assert_close(out.loss.detach(), ref.loss.detach(), LOSS, f"{label}: loss, rank {dist.get_rank()}")
            out.loss.backward()
            grads = _grads(model, summed=True)
            for name, expected in ref_grads.items():
                assert_close(grads[name], expected, GRAD, f"{label}: gradient of {name}")


def _classifiers(rank, world):
    batch_rows = [("right", 2), ("left", 2), ("none", 2)]
    for family in ("llama", "qwen2"):
        for num_labels in (2, 1):
            _classifier_cases(family, num_labels, PAD, batch_rows + ([("packed", 1)] if family == "llama" else []))
    _classifier_cases("llama", 1, None, [("none", 1)])  # no pad token: HF pools one row only, its last token


def _probe_sees_the_pooled_output(rank, world):
    model = _build("llama", "ForSequenceClassification", num_labels=2, pad_token_id=PAD)
    original = attach.install_pooled_head
    attach.install_pooled_head = lambda *args, **kwargs: None  # each rank pools its own last token
    try:
        with pytest.raises(ModelDivergence) as info:
            hfpatch.apply(dist.group.WORLD, model=model)
    finally:
        attach.install_pooled_head = original
    assert "output field" in info.value.check and "of the model" in info.value.check, info.value.check
    assert hfpatch.active_patch() is None
    with hfpatch.apply(dist.group.WORLD, model=model) as patch:  # with it: accepted, the pooled fields compared
        assert set(patch.probe.outputs) == {"loss", "logits"}, patch.probe.outputs
        assert patch.probe.worst <= probe_tolerance(torch.float32), patch.probe


def _token_and_span_heads(rank, world):
    ids = _rows("none")
    g = torch.Generator().manual_seed(3)
    tags = torch.randint(0, 3, ids.shape, generator=g)
    reference = _build("llama", "ForTokenClassification", num_labels=3, classifier_dropout=0.0)
    ref = reference(input_ids=ids, labels=tags)
    ref.loss.backward()
    ref_grads = _grads(reference, summed=False)
    model = _build("llama", "ForTokenClassification", num_labels=3, classifier_dropout=0.0)
    with hfpatch.apply(dist.group.WORLD, model=model) as patch:
        assert patch.labels_alignment == "aligned", patch.labels_alignment
        batch = patch.shard_inputs(ids, labels=tags)
        index = batch["position_ids"][0]
        out = model(input_ids=batch["input_ids"], position_ids=batch["position_ids"], labels=batch["labels"])
        assert_close(out.logits.detach(), ref.logits.detach().index_select(1, index), FORWARD, f"token scores, rank {rank}")
        assert_close(out.loss.detach(), ref.loss.detach(), LOSS, f"token classification loss, rank {rank}")
        out.loss.backward()
        grads = _grads(model, summed=True)
    for name, expected in ref_grads.items():
        assert_close(grads[name], expected, GRAD, f"token classification: gradient of {name}")

    qa_ref = _build("llama", "ForQuestionAnswering")(input_ids=ids)
    qa = _build("llama", "ForQuestionAnswering")
    with hfpatch.apply(dist.group.WORLD, model=qa) as patch:
        batch = patch.shard_inputs(ids)
        index = batch["position_ids"][0]
        out = qa(input_ids=batch["input_ids"], position_ids=batch["position_ids"])
        for name in ("start_logits", "end_logits"):
            assert_close(out[name].detach(), qa_ref[name].detach().index_select(1, index), FORWARD, f"{name}, rank {rank}")
        with pytest.raises(UnsupportedArgument, match="start_positions"):
            qa(input_ids=batch["input_ids"], position_ids=batch["position_ids"],
               start_positions=torch.zeros(2, dtype=torch.long), end_positions=torch.ones(2, dtype=torch.long))


def _pooled_rule_refused(rank, world):
    import transformers

    class MeanPooledForSequenceClassification(transformers.LlamaPreTrainedModel):
        """A user's head: the mean of the last hidden states over the sequence, scored."""

        def __init__(self, config):
            super().__init__(config)
            self.model = transformers.LlamaModel(config)
            self.head = torch.nn.Linear(config.hidden_size, config.num_labels)

        def forward(self, input_ids=None, position_ids=None, **kwargs):
            hidden = self.model(input_ids=input_ids, position_ids=position_ids, **kwargs).last_hidden_state
            return transformers.modeling_outputs.SequenceClassifierOutput(logits=self.head(hidden.mean(1)))

    model = MeanPooledForSequenceClassification(_config("llama", num_labels=2))
    with pytest.raises(UnsupportedModel) as info:
        hfpatch.apply(dist.group.WORLD, model=model)
    assert [f.kind for f in info.value.findings] == ["pooled-head"], info.value.findings
    assert "MeanPooledForSequenceClassification" in str(info.value)
    assert hfpatch.active_patch() is None


def _world(rank, world):
    _classifiers(rank, world)
    _probe_sees_the_pooled_output(rank, world)
    _token_and_span_heads(rank, world)
    _pooled_rule_refused(rank, world)


def test_heads_match_non_cp_on_every_rank():
    run_world(2, _world, timeout=300.0)


def test_head_of_reads_the_pooling_rule():
    import transformers

    for cls in (transformers.LlamaForSequenceClassification, transformers.Qwen2ForSequenceClassification):
        model = cls(_config("llama" if "Llama" in cls.__name__ else "qwen2", num_labels=2))
        head = heads.head_of(model)
        assert head.kind == "last-token" and head.score == "score", head
        assert head.rule in (heads.RIGHTMOST_NON_PAD, heads.BEFORE_FIRST_PAD)
    assert heads.head_of(_build("llama", "ForCausalLM")).kind == "per-token"


@pytest.mark.parametrize("rule", [heads.RIGHTMOST_NON_PAD, heads.BEFORE_FIRST_PAD])
def test_pooled_index_is_transformers_rule_on_the_whole_row(rule):
    """One rank (a group of one) holding the whole row: the index equals transformers' own formula for it."""
    run_world(1, _pooled_index_world, rule)


def _pooled_index_world(rank, world, rule):
    ids = torch.tensor([[5, 6, 7, 0, 0, 0], [0, 0, 4, 5, 6, 7], [1, 2, 3, 4, 5, 6], [1, 0, 3, 0, 5, 0]])
    index = torch.arange(ids.shape[1])
    got = heads.pooled_index(rule, ids, 0, index, ids.shape[1], ids.shape[0], dist.group.WORLD)
    if rule == heads.RIGHTMOST_NON_PAD:
        expected = (index * (ids != 0)).argmax(-1)
    else:
        expected = (torch.eq(ids, 0).int().argmax(-1) - 1) % ids.shape[1]
    assert got.tolist() == expected.tolist(), (got, expected)
