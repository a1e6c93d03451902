"""One-line command-line errors: ``error: <what> (<the value>)``, exit status 2, no traceback.

Every job (``python -m srt.bench_one_batch``, ``python -m srt.eval.gpqa``) builds its parser with
`ArgumentParser` (argparse's own errors become one line too) and runs its body through
`run_cli`, which turns the errors a user can cause (bad flags, missing files, a model too big
for the device, ...) into that one line. ``--debug`` prints the traceback first.
"""

from __future__ import annotations

import argparse
import os
import sys
import traceback
from collections.abc import Callable, Sequence
from typing import Any, NoReturn

EXIT_USAGE = 2

# Exceptions that mean "the input was wrong", not "the program is broken".
USER_ERRORS: tuple[type[BaseException], ...] = (
    ValueError,
    NotImplementedError,  # a feature the model or the flags ask for and srt does not have
    TypeError,
    FileNotFoundError,
    NotADirectoryError,
    IsADirectoryError,
    PermissionError,
    UnicodeDecodeError,
)


class CLIError(ValueError):
    """A user error of a command line: printed as ``error: <what> (<value>)``.

    Parameters
    ----------
    what : what is wrong, naming the flag (``"--page-size must be >= 1"``).
    value : the offending value, shown in parentheses.
    """

    def __init__(self, what: str, value: Any) -> None:
        self.what = what
        self.value = value
        super().__init__(f"{what} ({value})")


def one_line(message: str) -> str:
    """``message`` with its line breaks folded into spaces."""
    return " ".join(str(message).split())


def error_line(exc: BaseException) -> str:
    """The ``error: ...`` line of an exception (its type named unless it is a CLIError)."""
    if isinstance(exc, CLIError):
        return f"error: {one_line(str(exc))}"
    text = one_line(str(exc)) or type(exc).__name__
    if isinstance(exc, (FileNotFoundError, NotADirectoryError, IsADirectoryError)) and (
        exc.filename is not None and str(exc.filename) not in text
    ):
        text = f"{text} ({exc.filename})"
    return f"error: {text}"


class ArgumentParser(argparse.ArgumentParser):
    """argparse with defaults shown in ``--help`` and a one-line ``error: ...`` on bad flags."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        kwargs.setdefault("formatter_class", argparse.ArgumentDefaultsHelpFormatter)
        super().__init__(*args, **kwargs)
        self.add_argument(
            "--debug", action="store_true", help="show the full traceback of an error"
        )

    def error(self, message: str) -> NoReturn:
        sys.stderr.write(f"error: {one_line(message)}\n")
        sys.exit(EXIT_USAGE)


def check_positive(flag: str, values: int | Sequence[int], minimum: int = 1) -> None:
    """Raise CLIError unless every value is >= minimum."""
    for v in [values] if isinstance(values, int) else values:
        if v < minimum:
            raise CLIError(f"{flag} must be >= {minimum}", v)


def add_model_impl_args(group: Any) -> None:
    """--model-impl and --model-file (an SGLang model file run unmodified through
    srt.compat.sglang's import remap) on a parser or argument group."""
    group.add_argument(
        "--model-impl",
        default="srt",
        choices=["srt", "sglang"],
        help="srt: srt's model files; sglang: SGLang's own model file given by --model-file",
    )
    group.add_argument(
        "--model-file",
        default=None,
        help="with --model-impl sglang: SGLang's model file (e.g. its llama.py, unmodified)",
    )


def check_model_impl_args(args: argparse.Namespace) -> None:
    """Raise CLIError for an inconsistent --model-impl / --model-file pair."""
    if args.model_impl == "sglang" and args.model_file is None:
        raise CLIError("--model-impl sglang needs --model-file PATH", args.model_impl)
    if args.model_file is not None:
        if args.model_impl != "sglang":
            raise CLIError("--model-file needs --model-impl sglang", args.model_file)
        if not os.path.isfile(args.model_file) or not args.model_file.endswith(".py"):
            raise CLIError("--model-file is not a .py file", args.model_file)


def add_prefix_cache_args(group: Any) -> None:
    """The prefix cache's and chunked prefill's flags (ServerArgs' fields of those names) on a
    parser or argument group."""
    group.add_argument(
        "--disable-radix-cache", action="store_true", help="no prefix cache: compute every prompt"
    )
    group.add_argument(
        "--disable-cascade-attn",
        action="store_true",
        help="decode reads every request's whole KV, even a prefix several requests share",
    )
    group.add_argument(
        "--chunked-prefill-size",
        type=int,
        default=None,
        help="prompt tokens per step of one request (-1: off; default: SGLang's per GPU)",
    )
    group.add_argument(
        "--decode-chunked-prefill-size",
        type=int,
        default=None,
        help="the chunk while other requests decode (default 256; -1: no cap)",
    )


def check_prefix_cache_args(args: argparse.Namespace) -> None:
    """Raise CLIError for a chunk size that is neither >= 1 nor -1."""
    for flag in ("chunked_prefill_size", "decode_chunked_prefill_size"):
        chunk = getattr(args, flag)
        if chunk is not None and chunk < 1 and chunk != -1:
            raise CLIError(f"--{flag.replace('_', '-')} must be >= 1, or -1 (off)", chunk)


def run_cli(body: Callable[[], int], debug: bool) -> int:
    """Run ``body``; a user error prints one ``error:`` line (and the traceback with --debug).

    Returns
    -------
    int : ``body``'s exit status, argparse's (0 after --help, 2 after a bad flag), or 2 after a
        user error. Other exceptions propagate.
    """
    try:
        return body()
    except SystemExit as e:  # argparse: --help, or a flag error already printed as one line
        return e.code if isinstance(e.code, int) else EXIT_USAGE
    except USER_ERRORS as e:
        if debug:
            traceback.print_exc()
        print(error_line(e), file=sys.stderr, flush=True)
        return EXIT_USAGE
    except KeyboardInterrupt:
        print("error: interrupted", file=sys.stderr)
        return 130


__all__ = [
    "ArgumentParser",
    "CLIError",
    "add_model_impl_args",
    "check_model_impl_args",
    "check_positive",
    "error_line",
    "one_line",
    "run_cli",
]
