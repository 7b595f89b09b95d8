"""The ``archsearch`` command.

Subcommands live one module per area in this package (``arch.py``, ``laws.py``, ...). Each
module defines ``register(subparsers)``, which adds its subcommands with
``set_defaults(func=handler)``; a handler takes the parsed args and returns an exit code.
Modules are discovered here, so adding a command touches only its own file. Registration must
stay cheap: heavy imports (torch, engines) belong inside the handlers.

User errors (:class:`ArchsearchError`) print one line and exit 2, with no traceback.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib
import os
import pkgutil
import signal
import sys
import traceback
from collections.abc import Iterator

from archsearch import __version__
from archsearch.cli._common import finite_float, json_stdout
from archsearch.cli._examples import epilog
from archsearch.configio import redact
from archsearch.errors import ArchsearchError
from archsearch.figures import figures_mode
from archsearch.logs import configure


class _Parser(argparse.ArgumentParser):
    def error(self, message: str):  # one line, exit 2, like every other user error
        self.exit(2, f"{self.prog}: error: {message} (see {self.prog} --help)\n")

    def add_argument(self, *args, **kwargs):
        # no flag of ours means anything at NaN or infinity: refuse them at parse time
        if kwargs.get("type") is float:
            kwargs["type"] = finite_float
        return super().add_argument(*args, **kwargs)

    def format_help(self) -> str:
        # the examples block keeps its lines as written (argparse would re-wrap them)
        epilog, self.epilog = self.epilog, None
        try:
            text = super().format_help()
        finally:
            self.epilog = epilog
        return text + (f"\n{epilog}\n" if epilog else "")

    def add_argument_group(self, *args, **kwargs):
        group = super().add_argument_group(*args, **kwargs)
        plain = group.add_argument

        def add_argument(*a, **kw):
            if kw.get("type") is float:
                kw["type"] = finite_float
            return plain(*a, **kw)

        group.add_argument = add_argument
        return group


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="archsearch",
                     description="Search for inference-efficient LLM decoder shapes.")
    parser.add_argument("--version", action="version", version=f"archsearch {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", parser_class=_Parser)
    for mod in sorted(pkgutil.iter_modules(__path__), key=lambda m: m.name):
        if mod.name.startswith("_"):
            continue
        module = importlib.import_module(f"{__name__}.{mod.name}")
        module.register(sub)
    _add_examples(parser)
    _add_verbosity(parser)
    return parser


def subcommands(parser: argparse.ArgumentParser, prefix: str = "") -> Iterator[tuple[str, argparse.ArgumentParser]]:
    """Every (sub)command's parser, named as typed: ("arch describe", parser), ..."""
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for name, p in action.choices.items():
                yield f"{prefix}{name}", p
                yield from subcommands(p, f"{prefix}{name} ")


def _add_verbosity(parser: argparse.ArgumentParser) -> None:
    """``-q/--quiet`` and ``-v/--verbose`` on every command (archsearch.logs); absent unless given,
    so a subcommand's parser never resets its parent's."""
    for _, p in subcommands(parser):
        if p.get_default("func") is None:
            continue
        g = p.add_argument_group("messages").add_mutually_exclusive_group()
        g.add_argument("-q", "--quiet", action="store_const", const=-1, dest="verbosity", default=argparse.SUPPRESS,
                       help="only warnings and errors on stderr (the study log keeps the progress lines)")
        g.add_argument("-v", "--verbose", action="store_const", const=1, dest="verbosity",
                       default=argparse.SUPPRESS,
                       help="debug lines, and other libraries' messages (transformers, vLLM, Optuna) on stderr")


def _add_examples(parser: argparse.ArgumentParser) -> None:
    for name, p in subcommands(parser):
        p.epilog = epilog(name)


class Terminated(KeyboardInterrupt):
    """SIGTERM (``timeout``, ``kill``, a scheduler's preemption), raised where the process is, so
    it unwinds like Ctrl-C: cleanup runs (engine processes, which live in their own session, are
    stopped rather than orphaned; training saves what it saves on an interrupt)."""

    def __init__(self, signum: int):
        super().__init__(signum)
        self.signum = signum


def _terminate_like_interrupt():
    """Install the SIGTERM handler; returns the handler it replaced (``main`` puts it back, so a
    caller that runs ``main()`` in-process, a test runner among them, keeps its own)."""
    pid = os.getpid()

    def raise_terminated(signum, frame):
        if os.getpid() != pid:
            # a forked child (lm-eval's and the datasets' worker pools) inherits this handler: it
            # dies of the signal as it would without us, rather than unwinding our main loop
            signal.signal(signum, signal.SIG_DFL)
            os.kill(os.getpid(), signum)
            return
        raise Terminated(signum)

    try:
        return signal.signal(signal.SIGTERM, raise_terminated)
    except ValueError:  # not the main thread (main() called from a thread): leave it as it is
        return None


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if not getattr(args, "func", None):
        # a group without its subcommand (e.g. "archsearch arch"): show that group's help
        (getattr(args, "_group_parser", None) or parser).print_help()
        return 2
    configure(getattr(args, "verbosity", 0))
    previous = _terminate_like_interrupt()
    try:
        figures_mode()  # an unknown ARCHSEARCH_FIGURES refused before any work, not at the report
        with json_stdout(bool(getattr(args, "json", False))):
            rc = int(args.func(args) or 0)
        sys.stdout.flush()  # a closed pipe shows here, where it is handled, not at the interpreter's exit
        return rc
    except ArchsearchError as e:
        # one line, however long the underlying message (YAML errors span several)
        print("archsearch: error: " + " ".join(str(e).split()), file=sys.stderr)
        return 2
    except BrokenPipeError:
        return _closed_pipe()
    except UnicodeDecodeError as e:  # a file read past read_text: still one line, not a traceback
        print(f"archsearch: error: a file is not UTF-8 text ({e.reason} at byte {e.start}) "
              "(save it as UTF-8 text)", file=sys.stderr)
        return 2
    except OSError as e:  # a path the user named: missing, a folder, not writable, disk full
        where = e.filename if e.filename is not None else "file"
        print(f"archsearch: error: {where}: {e.strerror or e} (check the path and its permissions)",
              file=sys.stderr)
        return 2
    except Terminated as e:
        print(f"archsearch: terminated (signal {e.signum}); {interrupt_note(args)}", file=sys.stderr)
        return 128 + e.signum
    except KeyboardInterrupt:
        print(f"archsearch: interrupted; {interrupt_note(args)}", file=sys.stderr)
        return 130
    except Exception:  # a bug, not a user error: the traceback, with any URL's password masked
        print(redact(traceback.format_exc()), end="", file=sys.stderr)
        return 1
    finally:
        if previous is not None:
            signal.signal(signal.SIGTERM, previous)


# the commands whose work survives an interrupt and resumes when run again (README, Conventions);
# a command can say more through its parser's ``on_interrupt`` default (args -> line)
RESUMING = frozenset({"search", "sweep", "train", "plan"})  # plan: its measured grid points are kept


def interrupt_note(args: argparse.Namespace) -> str:
    """What an interrupted command kept, true for that command: it resumes, or nothing was kept."""
    own = getattr(args, "on_interrupt", None)
    if own is not None:
        return own(args)
    if getattr(args, "command", None) in RESUMING:
        return "run the same command again to resume"
    return "this command does not resume: run it again to start over"


def _closed_pipe() -> int:
    """The reader of stdout went away (``archsearch ... --json | head -c 10``): stop quietly
    with 141 (128 + SIGPIPE), as a POSIX tool killed by SIGPIPE does. Stdout now points at
    /dev/null so the interpreter's last flush does not complain."""
    with contextlib.suppress(OSError, ValueError):
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        os.close(devnull)
    return 141
