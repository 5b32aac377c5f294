"""The ``ffstate`` command line. Today: ``ffstate bench codec``; serve, status and demo arrive with the
daemon and trainer (see the README's roadmap)."""

from __future__ import annotations

import argparse
import logging
import sys


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="ffstate", description="Bit-exact in-memory replication of training state.")
    parser.add_argument("-v", "--verbose", action="store_true", help="debug logging")
    sub = parser.add_subparsers(dest="command", required=True)
    bench = sub.add_parser("bench", help="benchmarks; each writes JSON and a PNG under bench/results/")
    which = bench.add_subparsers(dest="benchmark", required=True)
    from ffstate.bench import codec as codec_bench

    p = which.add_parser("codec", help="codec throughput vs plain copy, compression vs zlib-1, on AdamW state")
    codec_bench.add_arguments(p)
    p.set_defaults(run=codec_bench.main)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=logging.DEBUG if args.verbose else logging.INFO,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    return args.run(args)


if __name__ == "__main__":
    sys.exit(main())
