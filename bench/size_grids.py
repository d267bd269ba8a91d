"""The grids of sizes ``python -m bench.reference sizes`` measures (``registry/core/reference_costs.json``): one per op
with a size signature (``define_op(..., sizes=...)``), each naming its numeric axes, the values of its categorical
sizes (one grid each), and how to build a batch of per-sample inputs at a point; the ops with the generic signature
(``registry.core.cost.batch_and_numel``) get theirs from OpInfo's samples (``opinfo_grid``).

Every point is timed under vmap (``forward`` over the batch) and, where the grid differentiates, vmap(grad) (the
gradient of ``forward(...).square().sum()`` with respect to the ``differentiable`` inputs; the ``shared`` inputs
unbatched), natively and with each composite pinned, in the same interleaved rounds.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import torch
from torch import func

Point = Mapping[str, int]
Fixed = Mapping[str, "bool | int | str"]
# (per-sample forward, batched inputs, argnums of the differentiable ones)
Case = tuple[Callable[..., torch.Tensor], tuple[torch.Tensor, ...], tuple[int, ...]]
Inputs = Callable[[Point, Fixed, torch.Generator], Case]  # (point, categorical sizes, generator) -> the case


@dataclass(frozen=True)
class SizeGrid:
    """One op's grid: its axes (each size's measured values, ascending), its categorical variants, the inputs at a
    point, and which points are too large to measure (the selector takes the nearest measured neighbour's ratio)."""

    op: str
    axes: dict[str, tuple[int, ...]]
    variants: tuple[dict[str, bool | int | str], ...]
    inputs: Inputs
    too_large: Callable[[Point], bool]
    # Positions of the inputs every sample shares (vmap's in_dims None: a layer's weight under per-sample gradients);
    # the others are batched along their first dimension.
    shared: tuple[int, ...] = ()
    workloads: tuple[str, ...] = ("vmap", "vmap(grad)")  # what it is timed under (bench.reference's SIZES_WORKLOADS)


# --- scaled_dot_product_attention: per-sample (1, heads, length, head_dim) queries, keys and values -----------------


def _attention_inputs(at: Point, fixed: Fixed, g: torch.Generator
                      ) -> Case:
    batch, heads, length, head_dim = at["batch"], at["heads"], at["length"], at["head_dim"]
    q, k, v = (torch.randn(batch, 1, heads, length, head_dim, generator=g) for _ in range(3))
    attention = torch.nn.functional.scaled_dot_product_attention
    if not fixed["mask"]:
        return (lambda q, k, v: attention(q, k, v)), (q, k, v), (0, 1, 2)
    keep = torch.ones(batch, 1, 1, 1, length, dtype=torch.bool)
    for b in range(batch):
        keep[b, ..., length - (b % max(length // 2, 1)):] = False  # each sample its own padding (never all keys)
    return (lambda q, k, v, m: attention(q, k, v, attn_mask=m)), (q, k, v, keep), (0, 1, 2)


ATTENTION = SizeGrid(
    op="scaled_dot_product_attention",
    axes={"batch": (1, 4, 16, 64, 256), "length": (8, 32, 128, 512), "heads": (2, 8), "head_dim": (16, 64)},
    variants=({"mask": False, "rank": 4}, {"mask": True, "rank": 4}),
    inputs=_attention_inputs,
    # at such sizes the fused kernel dominates every composite alike
    too_large=lambda at: 4 * at["batch"] * at["heads"] * at["length"] ** 2 * at["head_dim"] > 3e8,
)


# --- ctc_loss: per-sample (steps, 1, classes) log-probabilities and (1, labels) targets -------------------------------


CTC_CLASSES = 16


def _ctc_inputs(at: Point, fixed: Fixed, g: torch.Generator
                ) -> Case:
    batch, steps, labels = at["batch"], at["steps"], at["labels"]
    log_probs = torch.randn(batch, steps, 1, CTC_CLASSES, generator=g).log_softmax(-1)
    targets = torch.randint(1, CTC_CLASSES, (batch, 1, labels), generator=g)
    input_lengths, target_lengths = torch.tensor([steps]), torch.tensor([labels])

    def forward(log_probs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        return torch.nn.functional.ctc_loss(log_probs, targets, input_lengths, target_lengths)

    return forward, (log_probs, targets), (0,)


CTC_LOSS = SizeGrid(
    op="ctc_loss",
    axes={"batch": (1, 4, 16, 64, 256), "steps": (16, 64, 256), "labels": (4, 16, 64)},
    variants=({},),
    inputs=_ctc_inputs,
    too_large=lambda at: 2 * at["labels"] > at["steps"],  # not a CTC problem: the labels do not fit the steps
)


# --- pdist: per-sample (rows, features) ------------------------------------------------------------------------------


def _pdist_inputs(at: Point, fixed: Fixed, g: torch.Generator
                  ) -> Case:
    rows = torch.randn(at["batch"], at["rows"], at["features"], generator=g)
    return torch.nn.functional.pdist, (rows,), (0,)


PDIST = SizeGrid(
    op="pdist",
    axes={"batch": (1, 4, 16, 64, 256), "rows": (8, 32, 128), "features": (4, 64)},
    variants=({},),
    inputs=_pdist_inputs,
    # the composite's pairs: batch x rows^2 / 2 x features elements, twice
    too_large=lambda at: at["batch"] * at["rows"] ** 2 // 2 * at["features"] > 3e7,
)


# --- multi_margin_loss: per-sample (rows, classes) scores and (rows,) targets -------------------------------------


def _multi_margin_inputs(at: Point, fixed: Fixed, g: torch.Generator) -> Case:
    batch, rows, classes = at["batch"], at["rows"], at["classes"]
    scores = torch.randn(batch, rows, classes, generator=g)
    targets = torch.randint(0, classes, (batch, rows), generator=g)
    return torch.nn.functional.multi_margin_loss, (scores, targets), (0,)


MULTI_MARGIN_LOSS = SizeGrid(
    op="multi_margin_loss",
    axes={"batch": (1, 4, 16, 64, 256), "rows": (1, 16), "classes": (4, 32, 256)},
    variants=({},),
    inputs=_multi_margin_inputs,
    too_large=lambda at: False,
)


# --- multilabel_margin_loss: per-sample (rows, classes) scores and -1-terminated label lists --------------------------


def _multilabel_margin_inputs(at: Point, fixed: Fixed, g: torch.Generator) -> Case:
    batch, rows, classes = at["batch"], at["rows"], at["classes"]
    scores = torch.randn(batch, rows, classes, generator=g)
    labels = torch.randint(0, classes, (batch, rows, classes), generator=g)
    labels[..., max(classes // 4, 1):] = -1  # a quarter of the classes listed, then the terminator
    return torch.nn.functional.multilabel_margin_loss, (scores, labels), (0,)


MULTILABEL_MARGIN_LOSS = SizeGrid(
    op="multilabel_margin_loss",
    axes={"batch": (1, 4, 16, 64, 256), "rows": (1, 16), "classes": (4, 32)},
    variants=({},),
    inputs=_multilabel_margin_inputs,
    # the composite's (rows, labels, classes) comparisons per sample
    too_large=lambda at: at["batch"] * at["rows"] * at["classes"] ** 2 > 3e7,
)


# --- ormqr: per-sample (rows, rows) reflectors, their (rows,) scales and a (rows, columns) matrix ------------------


def _ormqr_inputs(at: Point, fixed: Fixed, g: torch.Generator) -> Case:
    batch, rows, columns = at["batch"], at["rows"], at["columns"]
    reflectors, scales = torch.geqrf(torch.randn(batch, rows, rows, generator=g))
    return torch.ormqr, (reflectors, scales, torch.randn(batch, rows, columns, generator=g)), (0, 1, 2)


ORMQR = SizeGrid(
    op="ormqr",
    axes={"batch": (1, 4, 16, 64, 256), "rows": (4, 32), "columns": (4, 32)},
    variants=({},),
    inputs=_ormqr_inputs,
    too_large=lambda at: False,
)


# --- bilinear: per-sample (rows, features) inputs, a shared (out, features, features) weight and (out,) bias --------


def _bilinear_inputs(at: Point, fixed: Fixed, g: torch.Generator) -> Case:
    batch, rows, features, out = at["batch"], at["rows"], at["features"], at["out"]
    x1, x2 = (torch.randn(batch, rows, features, generator=g) for _ in range(2))
    weight, bias = torch.randn(out, features, features, generator=g), torch.randn(out, generator=g)
    return torch.nn.functional.bilinear, (x1, x2, weight, bias), (0, 1, 2, 3)


BILINEAR = SizeGrid(
    op="bilinear",
    axes={"batch": (1, 4, 16, 64, 256), "rows": (1, 16), "features": (8, 64), "out": (4, 32)},
    variants=({},),
    inputs=_bilinear_inputs,
    # each sample's weight gradient: batch x out x features^2 elements
    too_large=lambda at: at["batch"] * at["out"] * at["features"] ** 2 > 3e7,
    shared=(2, 3),  # per-sample gradients of the layer's own weight and bias
)


def bucket(numel: int) -> int:
    """A positive element count rounded down to a power of two: the generic signature's bucket of it."""
    return 1 << (numel.bit_length() - 1)


# --- _upsample_nearest_exact{1,2,3}d: per-sample (1, channels, *spatial) inputs doubled (the generic signature) -----


def _upsample_grid(spatial: int) -> SizeGrid:
    """F.interpolate(mode="nearest-exact") doubling a per-sample (1, 2, side, ...) input: OpInfo's one entry serves
    the three ops, so each gets a grid of its own over the generic signature's axes (batch, elements per sample)."""
    sides = {1: (8, 512), 2: (4, 32), 3: (2, 8)}[spatial]  # about 16 and 1,000-2,000 elements per sample

    def inputs(at: Point, fixed: Fixed, g: torch.Generator) -> Case:
        side = next(s for s in sides if bucket(2 * s ** spatial) == at["numel"])
        x = torch.randn(at["batch"], 1, 2, *(side,) * spatial, generator=g)
        return (lambda t: torch.nn.functional.interpolate(t, scale_factor=2, mode="nearest-exact")), (x,), (0,)

    numels = tuple(bucket(2 * s ** spatial) for s in sides)
    return SizeGrid(op=f"_upsample_nearest_exact{spatial}d", axes={"batch": (1, 4, 16, 64, 256), "numel": numels},
                    variants=({"batched": "input"},), inputs=inputs, too_large=lambda at: False)


GRIDS: dict[str, SizeGrid] = {grid.op: grid for grid in (ATTENTION, CTC_LOSS, PDIST, MULTI_MARGIN_LOSS,
                                                           MULTILABEL_MARGIN_LOSS, ORMQR, BILINEAR,
                                                           *(_upsample_grid(spatial) for spatial in (1, 2, 3)))}


# --- the generic grid: an op on its OpInfo sample, at each batch size (registry.core.cost.batch_and_numel) -----------

# The ops whose signature is the generic one (define_op(..., sizes=cost.batch_and_numel)): their composites cost
# more than vmap's loop over a few of OpInfo's small samples, and less over many.
OPINFO_GRID_OPS = (
    "histc", "histogram", "index_reduce", "isin", "max_unpool2d", "max_unpool3d", "nonzero_static", "put", "renorm",
    "segment_reduce", "special_airy_ai", "special_log_ndtr",
    *(f"special_{kind}_polynomial_{letter}" for kind in ("chebyshev", "shifted_chebyshev") for letter in "tuvw"),
    "special_hermite_polynomial_h", "special_hermite_polynomial_he", "special_laguerre_polynomial_l",
    "special_legendre_polynomial_p",
)
OPINFO_BATCHES = (1, 4, 16, 64, 256)


def opinfo_grid(op: str) -> SizeGrid:
    """``op`` on OpInfo's samples, its input batched, at each of ``OPINFO_BATCHES``: the ``numel`` axis holds the
    smallest and the largest per-sample input among its samples (each rounded down to a power of two, what
    ``batch_and_numel`` reads), each timed on the first sample of that size; the variant names the batched argument,
    so its costs decide only calls batched the same way and no larger (``registry.core.cost.MEASURED_ONLY_AXES``);
    under vmap(grad) only where every chosen sample has something to differentiate."""
    from registry.core.registration import OPS, load
    from registry.harness import opinfo
    from registry.harness import opinfo_cases as cases

    load()
    entry = opinfo.entries(op)[0]
    by_size: dict[int, tuple[Any, Any]] = {}  # numel bucket -> the first (sample, probe case) of that size
    for sample in cases.pick_samples(entry, torch.float32, cases.ALL_SAMPLES):
        probe = cases.SurveyCase(entry, sample, "input", 2)
        if not probe.batched or cases.static_reason(probe, "vmap", torch.float32) is not None:
            continue
        numel = probe.per_sample[0][0].numel()
        if numel:
            by_size.setdefault(bucket(numel), (sample, probe))
    if not by_size:
        raise ValueError(f"opinfo_grid({op}): no OpInfo sample of {cases.entry_id(entry)} batches its input")
    sizes = sorted({min(by_size), max(by_size)})
    samples = {size: by_size[size][0] for size in sizes}

    def inputs(at: Point, fixed: Fixed, g: torch.Generator) -> Case:
        case = cases.SurveyCase(entry, samples[at["numel"]], "input", at["batch"])
        batched = tuple(torch.stack([values[j] for values in case.per_sample]) for j in range(len(case.batched)))

        def forward(*values: torch.Tensor) -> Any:
            out = case.call(values)
            floating = case.differentiable_outputs(out)
            return floating[0] if floating else out

        return forward, batched, tuple(j for j, leaf in enumerate(case.batched) if leaf in case.diff)

    differentiable = all(
        probe.diff and cases.static_reason(probe, "vmap(grad)", torch.float32) is None
        and probe.differentiable_outputs(probe.call(probe.per_sample[0]))
        and _native_runs(inputs({"batch": 2, "numel": size}, {}, torch.Generator()), "vmap(grad)")
        for size, probe in ((size, by_size[size][1]) for size in sizes))
    return SizeGrid(op=op, axes={"batch": OPINFO_BATCHES, "numel": tuple(sizes)},
                    variants=({"batched": OPS[op].tensor_args[0]},), inputs=inputs, too_large=lambda at: False,
                    workloads=("vmap", "vmap(grad)") if differentiable else ("vmap",))


def _native_runs(case: Case, workload: str) -> bool:
    """Whether PyTorch's own op runs ``case`` under ``workload`` (index_reduce's prod raises under vmap(grad): there
    the rules, not costs, decide)."""
    import registry

    forward, batched, differentiable = case
    try:
        with warnings.catch_warnings(), registry.use(policy="native"):
            warnings.simplefilter("ignore")  # vmap's loop
            runnable(forward, differentiable, workload)(*batched)
    except Exception:
        return False
    return True


def grid_of(op: str) -> SizeGrid:
    """``op``'s grid: its own in ``GRIDS``, or the generic one for ``OPINFO_GRID_OPS``."""
    return GRIDS[op] if op in GRIDS else opinfo_grid(op)


def runnable(forward: Callable[..., torch.Tensor], differentiable: tuple[int, ...], workload: str,
             shared: tuple[int, ...] = (), count: int | None = None) -> Callable[..., Any]:
    """``forward`` over the batch under ``workload``: vmap, or vmap(grad) of its squared sum; of its ``count``
    inputs, those at ``shared`` are shared by the samples (unbatched)."""
    in_dims = tuple(None if i in shared else 0 for i in range(count or 0)) if shared else 0
    if workload == "vmap":
        return func.vmap(forward, in_dims=in_dims)
    return func.vmap(func.grad(lambda *t: forward(*t).square().sum(), argnums=differentiable), in_dims=in_dims)
