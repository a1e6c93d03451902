"""``python -m srt.bench_serving`` (see srt/bench_serving/__init__.py)."""

import sys

from srt.bench_serving.cli import cli_main

if __name__ == "__main__":
    sys.exit(cli_main())
