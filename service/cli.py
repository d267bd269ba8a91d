"""The ``multicomposite`` command line."""

from __future__ import annotations

import argparse
import json
import sys

import registry


def _serve(args: argparse.Namespace) -> int:
    import uvicorn

    from service.main import create_app

    uvicorn.run(create_app(), host=args.host, port=args.port, log_level="info")
    return 0


def _select(args: argparse.Namespace) -> int:
    try:
        decision = registry.select(args.op, stack=args.stack, batched=[b for b in args.batched.split(",") if b],
                                   dtype=args.dtype, policy=args.policy)
    except registry.SelectionError as error:
        print(f"multicomposite select: {error}", file=sys.stderr)
        return 2
    print(json.dumps({
        "op": decision.op, "composite": decision.composite, "kind": decision.kind, "reason": decision.reason,
        "alternatives": [vars(v) for v in decision.alternatives],
    }, indent=2))
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="multicomposite", description=__doc__)
    commands = parser.add_subparsers(dest="command", required=True)
    serve = commands.add_parser("serve", help="serve the HTTP API")
    serve.add_argument("--host", default="127.0.0.1")
    serve.add_argument("--port", type=int, default=8000)
    serve.set_defaults(run=_serve)
    select = commands.add_parser("select", help="print the decision for an op under a stack")
    select.add_argument("op")
    select.add_argument("--stack", default="")
    select.add_argument("--batched", default="")
    select.add_argument("--dtype", default=None)
    select.add_argument("--policy", default="auto")
    select.set_defaults(run=_select)
    args = parser.parse_args(argv)
    return args.run(args)


if __name__ == "__main__":
    sys.exit(main())
