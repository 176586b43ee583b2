"""``python -m loadtest SUBCOMMAND``."""

from __future__ import annotations

import argparse

from loadtest import agents, bench, billing, storm


def main() -> None:
    parser = argparse.ArgumentParser(prog="python -m loadtest")
    sub = parser.add_subparsers(dest="cmd", required=True)
    bench.add_parser(sub)
    storm.add_parser(sub)
    agents.add_parser(sub)
    billing.add_parser(sub)
    args = parser.parse_args()
    args.func(args)


if __name__ == "__main__":
    main()
