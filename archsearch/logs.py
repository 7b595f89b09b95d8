"""The project's messages, through :mod:`logging`.

Progress lines and warnings go to the ``archsearch`` logger (:func:`get_logger`), shown on
stderr as written (``[search] trial 3 ...``): the level is the CLI's ``--quiet`` (warnings only)
or ``--verbose`` (debug, and other libraries' messages too). While a study runs, :func:`study_log`
also appends them, with time, level and logger, to ``STUDY/study.log``.

Other libraries (transformers, datasets, Optuna, vLLM, lm-eval, accelerate) attach their own
console handlers and progress bars; :func:`tame_libraries`, also run as each is first imported,
removes their console handlers and bars so their records reach the root logger: while a study runs,
its study log keeps their warnings and the console shows none; outside a study the console shows
their warnings, named by library; ``--verbose`` shows everything they log. Python warnings go the
same way.
"""

from __future__ import annotations

import contextlib
import importlib.abc
import importlib.util
import logging
import os
import sys
import warnings
from collections.abc import Iterator
from pathlib import Path

LOGGER_NAME = "archsearch"
STUDY_LOG = "study.log"
# libraries whose console handlers and progress bars would interleave with the project's lines
LIBRARIES = ("transformers", "datasets", "huggingface_hub", "optuna", "vllm", "lm_eval", "accelerate",
             "torch", "sglang", "py.warnings")
# progress bars switched off through the environment the libraries read at import (where the
# user has not set it); engines run in their own processes, whose output goes to their own log files
_ENV = {"HF_DATASETS_DISABLE_PROGRESS_BARS": "1", "HF_HUB_DISABLE_PROGRESS_BARS": "1"}
_FILE_FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"


class _Stderr(logging.StreamHandler):
    """A console handler that writes to the current ``sys.stderr`` (a test's capture, or stderr
    itself under ``--json``), not the one that was there when it was made."""

    def __init__(self) -> None:
        super().__init__()

    @property
    def stream(self):
        return sys.stderr

    @stream.setter
    def stream(self, value) -> None:  # StreamHandler.__init__ assigns it; the property decides
        pass


class _StudyFile(logging.FileHandler):
    """``study.log`` in a study folder, opened on the first record once the folder exists (so a
    config refused before any work writes nothing)."""

    def __init__(self, folder: Path) -> None:
        self.folder = folder
        super().__init__(folder / STUDY_LOG, mode="a", encoding="utf-8", delay=True)
        self.setFormatter(logging.Formatter(_FILE_FORMAT))

    def emit(self, record: logging.LogRecord) -> None:
        if self.stream is None and not self.folder.is_dir():
            return
        super().emit(record)


_console = _Stderr()
_console.setFormatter(logging.Formatter("%(message)s"))
_project = logging.getLogger(LOGGER_NAME)
_project.addHandler(_console)
_project.setLevel(logging.INFO)
_project.propagate = False  # the project's lines are shown once, as written
_library_console = _Stderr()  # other libraries on the console, named as such
_library_console.setFormatter(logging.Formatter("%(levelname)s %(name)s: %(message)s"))
_studies_open = [0]  # study logs open now: they take the libraries' warnings off the console


def _library_record(record: logging.LogRecord) -> bool:
    """Other libraries' records on the console: all of them with ``--verbose``; otherwise their
    warnings, and only while no study log keeps them."""
    return _library_console.level < logging.WARNING or _studies_open[0] == 0


_library_console.addFilter(_library_record)


def _capture_warnings() -> None:
    """Python warnings to the ``py.warnings`` logger, even where something (a test runner's
    ``catch_warnings``) put its own ``showwarning`` back since the last call."""
    if warnings.showwarning is not getattr(logging, "_showwarning", None):
        logging.captureWarnings(False)
        logging.captureWarnings(True)


def get_logger(name: str) -> logging.Logger:
    """The logger of one part of the project (``archsearch.search``, ``archsearch.train``)."""
    return logging.getLogger(f"{LOGGER_NAME}.{name}")


def configure(verbosity: int = 0) -> None:
    """Set the console: ``verbosity`` -1 (``--quiet``: warnings and errors), 0 (progress lines),
    1 (``--verbose``: debug lines, and other libraries' messages beside the project's)."""
    for k, v in _ENV.items():
        os.environ.setdefault(k, v)
    # the logger passes INFO on to the study log whatever the console shows; the console's handler filters
    _project.setLevel(logging.DEBUG if verbosity > 0 else logging.INFO)
    _console.setLevel(logging.WARNING if verbosity < 0 else logging.NOTSET)
    root = logging.getLogger()
    if _library_console not in root.handlers:  # (else Python's last-resort handler prints them bare)
        root.addHandler(_library_console)
    # --quiet: other libraries' warnings (lm-eval's, transformers') and progress bars off the console too
    _library_console.setLevel(logging.INFO if verbosity > 0 else logging.ERROR if verbosity < 0 else logging.WARNING)
    if verbosity > 0:
        root.setLevel(logging.INFO)
    _capture_warnings()
    tame_libraries()
    _install_import_hook()


def tame_libraries(names: tuple[str, ...] = LIBRARIES) -> None:
    """Remove the console handlers the named, already imported libraries attached to their
    loggers and let their records propagate to the root logger (the study log; the console only
    with ``--verbose``); switch off their progress bars."""
    for name in names:
        logger = logging.getLogger(name)
        for h in list(logger.handlers):
            if type(h) is logging.StreamHandler:  # a library's own console handler (not a file's)
                logger.removeHandler(h)
        logger.propagate = True
    mod = sys.modules.get("transformers.utils.logging")
    if mod is not None:
        mod.disable_progress_bar()
    mod = sys.modules.get("datasets.utils.tqdm")
    if mod is not None:
        mod.disable_progress_bars()
    mod = sys.modules.get("lm_eval.utils")
    if mod is not None and hasattr(mod, "_LOGGING_CONFIGURED"):
        # lm-eval adds its console handler when an evaluation starts, unless it has done so once
        mod._LOGGING_CONFIGURED = True


class _TameOnImport(importlib.abc.MetaPathFinder):
    """Runs :func:`tame_libraries` after a library's logging module is first imported, since a
    library attaches its console handler there (transformers, datasets, Optuna, lm-eval)."""

    MODULES = ("transformers.utils.logging", "datasets.utils.logging", "datasets.utils.tqdm",
               "optuna.logging", "lm_eval.utils")

    def find_spec(self, name, path, target=None):
        if name not in self.MODULES:
            return None
        sys.meta_path.remove(self)
        try:
            spec = importlib.util.find_spec(name)
        finally:
            sys.meta_path.insert(0, self)
        if spec is None or spec.loader is None or not hasattr(spec.loader, "exec_module"):
            return spec
        loader = spec.loader
        exec_module = loader.exec_module

        def exec_and_tame(module):
            exec_module(module)
            tame_libraries()

        loader.exec_module = exec_and_tame
        return spec


_hook = _TameOnImport()


def _install_import_hook() -> None:
    if _hook not in sys.meta_path:
        sys.meta_path.insert(0, _hook)


def _study_record(record: logging.LogRecord) -> bool:
    """The study log keeps the project's lines and other libraries' warnings."""
    return record.name.startswith(LOGGER_NAME) or record.levelno >= logging.WARNING


@contextlib.contextmanager
def study_log(folder: str | Path) -> Iterator[Path]:
    """While the block runs, the project's lines (INFO and above; DEBUG with ``--verbose``) and
    other libraries' warnings (Python warnings included) are appended to ``folder/study.log``."""
    folder = Path(folder)
    handler = _StudyFile(folder)
    handler.setLevel(_project.level)
    handler.addFilter(_study_record)
    root = logging.getLogger()
    _project.addHandler(handler)
    root.addHandler(handler)
    _studies_open[0] += 1
    _capture_warnings()
    tame_libraries()
    try:
        yield folder / STUDY_LOG
    finally:
        _studies_open[0] -= 1
        _project.removeHandler(handler)
        root.removeHandler(handler)
        handler.close()
