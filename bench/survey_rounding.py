"""``python -m bench.survey_rounding ENTRY ...``: which float32 differences of the survey are rounding.

For every float32 case of the named op_db entries (the survey's samples, both batching variants, its six stacks,
natively), the result under the stack is compared with its reference outside any transform, and the same case is
run again with its float32 tensors cast to float64 (the same per-sample values, tangents and cotangents). Where the
float64 twin agrees with its own reference (at float64's tolerance), a float32 difference is rounding; where the twin
is wrong too, the float32 result is wrong. Each difference is measured relative to the reference's largest value,
what the survey's float32 tolerance (``comparison.TOLERANCES["derivatives"]``) bounds: this prints, per class, the
largest difference measured so, and the cases the tolerance would misjudge.
"""

from __future__ import annotations

import argparse
import math
import warnings
from typing import Any

import torch
from torch.testing._internal.opinfo.core import SampleInput  # noqa: PLC2701 - the OpInfo database
from torch.utils._pytree import tree_flatten, tree_map  # noqa: PLC2701 - PyTorch's pytree

from registry.harness import case_stacks, comparison, opinfo_cases
from registry.harness.outcomes import Outcome

STRICT_FLOAT32 = (1e-4, 1e-4)  # the survey's earlier float32 bound, per entry (rtol, atol): what it flagged


def _to_float64(sample: Any) -> Any:
    def widen(value: Any) -> Any:
        return value.double() if isinstance(value, torch.Tensor) and value.dtype == torch.float32 else value

    return SampleInput(tree_map(widen, sample.input), args=tree_map(widen, sample.args),
                       kwargs=tree_map(widen, sample.kwargs), output_process_fn_grad=sample.output_process_fn_grad)


def _result(stack: str, case: Any, dtype: torch.dtype) -> tuple[Outcome, Any, Any] | None:
    """(the survey's outcome, the result, its reference) of one case natively; None where it cannot be checked."""
    ref = case_stacks.Reference(case)
    outcome = case_stacks.check_case(stack, case, ref, dtype, inside_use=False, timeout_s=20.0)
    if outcome.status in ("unsupported", "error"):
        return None
    actual = case_stacks.run_stack(stack, case)
    if stack in ("jacrev", "jacfwd"):
        actual = case_stacks.project_jacobian(actual, case)
    return outcome, actual, case_stacks.reference(stack, ref)


def _of_largest(actual: Any, expected: Any) -> tuple[float, float]:
    """(the largest difference relative to its tensor's largest reference value, the largest absolute difference)."""
    relative = absolute = 0.0
    actual_leaves, expected_leaves = tree_flatten(actual)[0], tree_flatten(expected)[0]
    if len(actual_leaves) != len(expected_leaves):
        return math.inf, math.inf
    for a, e in zip(actual_leaves, expected_leaves, strict=True):
        if not isinstance(e, torch.Tensor) or not e.dtype.is_floating_point or e.numel() == 0:
            continue
        if not isinstance(a, torch.Tensor) or a.shape != e.shape:
            return math.inf, math.inf
        a, e = a.detach().double(), e.detach().double()
        keep = e.isfinite()
        diff = (a - e).abs().masked_fill(~keep, 0).nan_to_num(nan=math.inf)
        largest = e.masked_fill(~keep, 0).abs().max().item()
        absolute = max(absolute, diff.max().item())
        relative = max(relative, diff.max().item() / largest if largest > 0 else (math.inf if diff.max() > 0 else 0))
    return relative, absolute


def _strictly_flagged(actual: Any, expected: Any) -> bool:
    rtol, atol = STRICT_FLOAT32
    for a, e in zip(tree_flatten(actual)[0], tree_flatten(expected)[0], strict=False):
        if isinstance(e, torch.Tensor) and e.dtype.is_floating_point and isinstance(a, torch.Tensor) \
                and a.shape == e.shape and a.dtype == e.dtype:
            keep = e.isfinite()
            if not torch.allclose(a.masked_fill(~keep, 0), e.masked_fill(~keep, 0), rtol=rtol, atol=atol,
                                  equal_nan=True):
                return True
    return False


def measure(names: list[str], limit_samples: int) -> list[dict[str, Any]]:
    """One record per float32 case that the earlier strict bound flags or the survey calls a mismatch."""
    records = []
    for entry in opinfo_cases.select_entries(opinfo_cases.op_db(), names):
        if torch.float32 not in entry.supported_dtypes("cpu"):
            continue
        with warnings.catch_warnings(), torch.random.fork_rng(devices=[]):
            warnings.simplefilter("ignore")
            torch.manual_seed(opinfo_cases.SEED)
            for index, sample in enumerate(opinfo_cases.pick_samples(entry, torch.float32, limit_samples)):
                random = opinfo_cases.sample_is_random(entry, sample)
                for batching in opinfo_cases.BATCHINGS:
                    case = opinfo_cases.prepare_case(entry, sample, batching, opinfo_cases.DEFAULT_BATCH, random)
                    twin = opinfo_cases.prepare_case(entry, _to_float64(sample), batching,
                                                     opinfo_cases.DEFAULT_BATCH, random)
                    if isinstance(case, Outcome) or isinstance(twin, Outcome):
                        continue
                    for stack in case_stacks.SURVEY_STACKS:
                        found = _result(stack, case, torch.float32)
                        if found is None:
                            continue
                        outcome, actual, expected = found
                        if outcome.status != "mismatch" and not _strictly_flagged(actual, expected):
                            continue
                        twin_found = _result(stack, twin, torch.float64)
                        relative, absolute = _of_largest(actual, expected)
                        records.append({"entry": opinfo_cases.entry_id(entry), "sample": index,
                                        "batching": batching, "stack": stack, "survey": outcome.status,
                                        "detail": outcome.detail, "twin": None if twin_found is None
                                        else twin_found[0].status, "of_largest": relative, "abs": absolute})
    return records


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("entries", nargs="+", help="op_db entries ('add', 'scatter_reduce.prod')")
    parser.add_argument("--limit-samples", type=int, default=25)
    args = parser.parse_args()
    records = measure(args.entries, args.limit_samples)
    rtol, atol = comparison.TOLERANCES["derivatives"].bounds(torch.float32)
    for record in records:
        kind = {"ok": "rounding", "slow": "rounding", "mismatch": "wrong"}.get(record["twin"] or "", "no twin")
        record["kind"] = kind
        print(f"{kind:9s} survey {record['survey']:8s} {record['entry']} sample {record['sample']} "
              f"{record['batching']} {record['stack']}: {record['of_largest']:.3g} of the largest value, "
              f"{record['abs']:.3g} absolute {record['detail'][:80]}")
    for kind in ("rounding", "wrong", "no twin"):
        these = [r for r in records if r["kind"] == kind]
        flagged = sum(r["survey"] == "mismatch" for r in these)
        finite = [r["of_largest"] for r in these if math.isfinite(r["of_largest"])]
        print(f"{kind}: {len(these)} float32 cases flagged by rtol/atol {STRICT_FLOAT32}, {flagged} mismatching at "
              f"the survey's float32 tolerance ({rtol:g} of the largest value + {atol:g}); the largest finite "
              f"difference {max(finite, default=0):.3g} of the largest value")


if __name__ == "__main__":
    main()
