"""``registry.check`` on real models: each verdict, natively and inside ``use()``, against the per-sample
reference the harness's interpreter builds; the decisions, automatic functionalization and fallbacks it reports."""

from __future__ import annotations

import dataclasses
import json

import pytest
import torch

import registry
from registry.core import kernels
from registry.harness.check import CheckError, CheckReport
from service.check_examples import EXAMPLES


def _check(name: str, **options: object) -> CheckReport:
    example = EXAMPLES[name]
    fn, args = example.build()
    return registry.check(fn, *args, transform=example.transform, in_dims=example.in_dims, argnums=example.argnums,
                          rounds=1, **options)


def test_native_silently_wrong_and_use_right_is_said() -> None:
    report = _check("index-fill")
    assert report.native.verdict == "mismatch"
    assert report.native.error is None  # silent: nothing raised
    assert not report.native.differences[0].ok and report.native.differences[0].max_abs > 1
    assert report.use.verdict == "ok" and report.ok
    assert report.summary().startswith("native is silently wrong")
    index_fill = [d for d in report.decisions if d.op == "index_fill"]
    # The shipped reference profiles rank the C++ op first where it is built; the rules pick functional otherwise.
    chosen = "cpp_op" if kernels.fused_ops_available() else "functional"
    assert [(d.stack, d.batched, d.kind) for d in index_fill] == [("vmap(grad)", ("value",), chosen)]
    assert index_fill[0].calls >= 1
    assert ("reference profiles" if chosen == "cpp_op" else "native fails") in index_fill[0].reason
    text = str(report)
    assert "mismatch" in text and "index_fill" in text
    assert json.loads(json.dumps(report.to_json()))["native"]["verdict"] == "mismatch"


def test_native_loops_in_gpt2_and_use_does_not() -> None:
    pytest.importorskip("transformers")
    report = _check("gpt2-per-sample-grads")
    assert report.native.verdict == "slow"
    assert any("scaled_dot_product" in op for op in report.native.fallbacks)
    assert report.use.verdict == "ok"
    assert {d.op for d in report.decisions} >= {"scaled_dot_product_attention"}
    sdpa = [d for d in report.decisions if d.op == "scaled_dot_product_attention"]
    if report.use.fallbacks:  # at this size the selector keeps native's loop over the fused kernel, and says so
        assert all(d.kind == "native" for d in sdpa)
        assert any("scaled_dot_product_attention in vmap's per-sample loop by choice" in n for n in report.notes)
    assert len(report.use.differences) == len(dict(EXAMPLES["gpt2-per-sample-grads"].build()[1][0]))
    assert all(d.name.startswith("result['") for d in report.use.differences)


def test_lstm_native_loops_use_is_right() -> None:
    report = _check("lstm-per-sample-grads")
    assert report.native.verdict == "slow" and report.native.fallbacks
    assert report.use.verdict == "ok"
    assert "lstm" in {d.op for d in report.decisions}


def test_message_passing_native_raises_use_functionalizes() -> None:
    report = _check("gcn-per-sample-grads")
    assert report.native.verdict == "error"
    assert "index_add_" in report.native.error and report.native.error.startswith("RuntimeError: ")
    assert report.use.verdict == "ok"
    assert any(name.startswith("loss ") or name.startswith("forward ") for name in report.functionalized)


def test_pinn_hessian_is_ok_both_ways() -> None:
    report = _check("pinn-hessian")
    assert (report.native.verdict, report.use.verdict) == ("ok", "ok")
    assert report.tolerance == "derivatives" and "float64" in report.bounds
    assert all(t is not None and t > 0 for t in (report.native.time_s, report.use.time_s, report.reference.time_s))


def _raises(x: torch.Tensor) -> torch.Tensor:
    if x.dim() < 5:
        raise ValueError("this model needs 5-d inputs")
    return x.sum()


def test_a_function_that_raises_is_an_error_with_its_line() -> None:
    report = registry.check(_raises, torch.randn(3, 4), rounds=1)
    assert report.native.verdict == report.use.verdict == "error"
    assert report.use.error == "ValueError: this model needs 5-d inputs"
    assert report.use.where is not None and "test_check.py:" in report.use.where
    assert "raise ValueError" in report.use.where
    assert report.reference.error == "ValueError: this model needs 5-d inputs"
    assert not report.ok
    assert report.use.time_s is None  # nothing to time


def test_a_wrong_composite_inside_use_is_a_mismatch() -> None:
    """The composite use() picks made wrong on purpose: the check says use() mismatches, and native is wrong too."""
    example = EXAMPLES["index-fill"]
    fn, args = example.build()
    picked = next(d.composite for d in registry.check(fn, *args, rounds=1).decisions if d.op == "index_fill")
    original = registry.COMPOSITES["index_fill"][picked]

    def doubled(*values: object, **options: object) -> torch.Tensor:
        return original.fn(*values, **options) * 2

    try:
        with pytest.MonkeyPatch.context() as patch:
            # No redirect: the C++ routing would call the composite's C++ op, not the patched function.
            patch.setitem(registry.COMPOSITES["index_fill"], picked,
                          dataclasses.replace(original, fn=doubled, redirect=None))
            registry.clear_cache()  # a decision holds its composite's function: none made before the patch
            report = registry.check(fn, *args, rounds=1)
    finally:
        registry.clear_cache()
    assert [d.composite for d in report.decisions if d.op == "index_fill"] == [picked]
    assert report.use.verdict == "mismatch" and not report.ok
    assert report.summary() == "inside use() the result differs from the per-sample reference"
    assert registry.check(fn, *args, rounds=1).use.verdict == "ok"  # the composite restored


@pytest.mark.parametrize(("in_dims", "message"), [
    ((0, 0), "has 2 entries for 1 arguments"),
    (3, "out of range for argument 0's tensor of shape (4, 3)"),
    ("rows", "is not an int, None, or a tuple"),
    (None, "batches no argument"),
])
def test_bad_in_dims_is_one_clear_error(in_dims: object, message: str) -> None:
    with pytest.raises(CheckError, match=message.replace("(", r"\(").replace(")", r"\)")):
        registry.check(lambda x: x.sum(), torch.randn(4, 3), in_dims=in_dims)


def test_a_function_that_does_not_take_the_arguments() -> None:
    with pytest.raises(CheckError, match="does not take the 2 example arguments"):
        registry.check(lambda x: x.sum(), torch.randn(4, 3), torch.randn(4, 3))


def test_unknown_transform_and_policy() -> None:
    with pytest.raises(CheckError, match="unknown layer 'vamp'"):
        registry.check(lambda x: x.sum(), torch.randn(4, 3), transform="vamp(grad)")
    with pytest.raises(CheckError, match="unknown policy 'best'"):
        registry.check(lambda x: x.sum(), torch.randn(4, 3), policy="best")


def test_bert_native_loops_use_does_not() -> None:
    transformers = pytest.importorskip("transformers")
    config = transformers.BertConfig(vocab_size=50, hidden_size=16, num_hidden_layers=2, num_attention_heads=2,
                                     intermediate_size=32, max_position_embeddings=16, hidden_dropout_prob=0.0,
                                     attention_probs_dropout_prob=0.0, num_labels=3)
    torch.manual_seed(0)
    model = transformers.BertForSequenceClassification(config).eval()
    generator = torch.Generator().manual_seed(1)
    ids, labels = torch.randint(0, 50, (3, 8), generator=generator), torch.randint(0, 3, (3,), generator=generator)
    params = {name: p.detach() for name, p in model.named_parameters()}

    def loss(p: dict[str, torch.Tensor], x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return torch.func.functional_call(model, p, (), {"input_ids": x[None], "labels": y[None]}).loss

    report = registry.check(loss, params, ids, labels, in_dims=(None, 0, 0), rounds=1)
    assert report.native.verdict == "slow" and any("scaled_dot_product" in op for op in report.native.fallbacks)
    assert report.use.verdict == "ok" and report.ok


def _masked_attention(q: torch.Tensor) -> torch.Tensor:
    scores = q @ q.T
    future = torch.ones_like(scores).triu_(1)  # a causal mask written in place: vmap loops over triu_
    return (scores.masked_fill(future.bool(), -1e9).softmax(-1) @ q).pow(2).sum()


def test_an_uncovered_fallback_is_slow_in_both_and_named() -> None:
    report = registry.check(_masked_attention, torch.randn(4, 5, 3), rounds=1)
    assert report.native.verdict == report.use.verdict == "slow"
    assert report.native.fallbacks == report.use.fallbacks == ("aten::triu_",)
    assert not report.ok
    assert "vmap loops per sample for aten::triu_" in report.summary()
