"""``python -m engine.sglang plan --cluster FILE [--allow-unsafe-kernel-profile]``: print the command lines."""

from __future__ import annotations

import argparse
import shlex
import sys

from engine.sglang.plan import UnsafeProfile, plan


def main() -> None:
    p = argparse.ArgumentParser(prog="python -m engine.sglang")
    sub = p.add_subparsers(dest="cmd", required=True)
    pl = sub.add_parser("plan", help="print the SGLang worker command lines of a cluster file; starts nothing")
    pl.add_argument("--cluster", required=True)
    pl.add_argument("--allow-unsafe-kernel-profile", action="store_true")
    a = p.parse_args()
    try:
        workers = plan(a.cluster, a.allow_unsafe_kernel_profile)
    except (UnsafeProfile, ValueError) as exc:
        sys.exit(f"plan refused: {exc}")
    for w in workers:
        print(f"# {w['name']} ({w['role']}) -> {w['url']}")
        for warning in w["warnings"]:
            print(f"# WARNING (allowed): {warning}")
        env = " ".join(f"{k}={shlex.quote(v)}" for k, v in sorted(w["env"].items()))
        print(f"{env} {shlex.join(w['command'])}\n")


if __name__ == "__main__":
    main()
