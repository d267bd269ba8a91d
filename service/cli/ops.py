"""``multicomposite ops``: the covered ops and their composites."""

from __future__ import annotations

import argparse

from service import cli_output as out
from service.cli import arguments


def run(args: argparse.Namespace) -> int:
    import registry

    registry.load()
    names = args.op or list(registry.OPS)
    listed = [{"name": name, "doc": registry.OPS[name].doc, "tensor_args": list(registry.OPS[name].tensor_args),
               "entry_points": list(registry.OPS[name].qualified_entry_points),
               "composites": [{"name": c.name, "kind": c.kind, "doc": c.doc}
                              for c in registry.composites(name).values()]}
              for name in names]
    if args.json:
        out.print_json(listed)
        return 0
    out.print_table(("op", "composite", "kind", "doc"),
                    [(op["name"], c["name"], c["kind"], c["doc"]) for op in listed for c in op["composites"]])
    return 0


def configure(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--op", action="append", type=arguments.op,
                        help="only this op (repeatable; default: every covered op)")
    arguments.add_json(parser, "the ops, their tensor arguments, entry points and composites")
    parser.set_defaults(run=run)
