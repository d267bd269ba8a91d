"""``multicomposite select``: the decision for an op under a stack, and every alternative's verdict."""

from __future__ import annotations

import argparse

from registry.core.policies import POLICIES
from service import cli_output as out
from service.cli import arguments
from service.cli_output import UsageError


def run(args: argparse.Namespace) -> int:
    import torch

    import registry
    from service.models import DecisionPublic
    from service.validation import InputError, check_dtype_under_stack, parse_device, parse_shapes

    try:
        check_dtype_under_stack(getattr(torch, args.dtype) if args.dtype else None, args.stack)
        device = parse_device(args.device, (args.device.split(":")[0],)) if args.device else None
        decision = registry.select(args.op, stack=args.stack, batched=[b for b in args.batched.split(",") if b],
                                   dtype=args.dtype, device=device, numel=args.numel, policy=args.policy,
                                   pins={args.op: args.pin} if args.pin else None, shapes=parse_shapes(args.shapes),
                                   batch_size=args.batch_size, native_batch_rules=args.native_batch_rules)
    except (registry.SelectionError, InputError) as error:
        raise UsageError(str(error)) from None
    answer = DecisionPublic.of(decision).model_dump()
    if args.json:
        out.print_json(answer)
        return 0
    print(f"{answer['op']} under {answer['stack'] or 'no transform'}: {answer['composite']} ({answer['kind']})")
    print(f"reason: {answer['reason']}")
    if decision.speedup is not None:
        print(f"speedup over native: {decision.speedup:.2f}x")
    out.print_table(("alternative", "kind", "verdict", "why"),
                    [(v.composite, v.kind, "valid" if v.ok else "invalid", v.reason) for v in decision.alternatives])
    return 0


def configure(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("op", type=arguments.op, help="the op, e.g. index_fill (multicomposite ops lists them)")
    parser.add_argument("--stack", type=arguments.stack, default=(), help="transforms, outermost first: vmap(grad) "
                        "or vmap,grad (default: none)")
    parser.add_argument("--batched", default="", help="comma-separated tensor arguments batched at the innermost "
                        "vmap, e.g. self,value")
    parser.add_argument("--dtype", default=None, type=arguments.any_dtype, help="the arguments' dtype, e.g. float32")
    parser.add_argument("--device", default=None, type=arguments.device, help="the device type: cpu, cuda")
    parser.add_argument("--numel", default=None, type=arguments.positive_int, help="elements per sample (picks the "
                        "profiled size nearest to it)")
    parser.add_argument("--policy", default="auto", choices=POLICIES,
                        help=f"how to choose: {', '.join(POLICIES)} (default: auto)")
    parser.add_argument("--pin", default=None, help="force a kind or composite for this op, e.g. functional")
    parser.add_argument("--shapes", default=None, help="each tensor argument's per-sample shape, for an op decided by "
                        "its cost at the call's sizes: query:1x2x16x16,key:1x2x16x16,value:1x2x16x16")
    parser.add_argument("--batch-size", default=1, type=arguments.non_negative_int,
                        help="the samples the first tensor argument stands for (default: 1)")
    parser.add_argument("--native-batch-rules", action="store_true", help="weigh PyTorch's kernel with this "
                        "package's C++ batching rule, as use() on the C++ routing backend runs it")
    arguments.add_json(parser, "the decision")
    parser.set_defaults(run=run)
