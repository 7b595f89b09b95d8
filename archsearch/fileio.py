"""Safe file I/O: atomic writes, append-only logs that survive a torn last line, output checks.

Every file the project writes goes through :func:`atomic_write` (a temporary file in the same
folder, flushed and renamed over the target), so a kill leaves either the old or the new
content, never half a file. Append-only logs (JSONL) are appended one whole line per write and
read back with :func:`read_jsonl_lines`, which skips a torn last line and says so.
Every file a user names is read through :func:`read_text`: UTF-8 text, or one clear error.
:func:`check_output` refuses an output path of the wrong kind before any work is done.
Files are written with the mode a plain ``open`` would give (0666 less the umask), so a report
or a law is as readable by the group as the user's umask allows.
"""

from __future__ import annotations

import contextlib
import csv
import io
import json
import os
import tempfile
from pathlib import Path
from typing import IO, Any, Callable, Iterator

from archsearch.errors import ArchsearchError
from archsearch.logs import get_logger

# torn lines and unreadable state files: warnings on the console and in the study log
_log = get_logger("files")


def _umask() -> int:
    """The process's umask: from /proc where the kernel shows it (reading it there changes
    nothing, so no other thread can create a file under a wrong one), else set and set back."""
    with contextlib.suppress(OSError, ValueError):
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("Umask:"):
                return int(line.split()[1], 8)
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


def follow_umask(path: str | Path) -> None:
    """Give ``path`` (a file, or a folder and everything under it) the modes a plain ``open`` and
    ``mkdir`` would have given under the process's umask (0666 / 0777 less it), whoever wrote it:
    safetensors writes weights 0600 and ``tempfile`` makes folders 0700, which would leave a
    group-shared run (umask 002) unreadable or unwritable by the group."""
    mask = _umask()
    p = Path(path)
    for q in [p, *(sorted(p.rglob("*")) if p.is_dir() else [])]:
        if q.is_symlink():
            continue
        want = (0o777 if q.is_dir() else 0o666) & ~mask
        if q.is_file() and q.stat().st_mode & 0o111:  # an executable stays executable
            want = 0o777 & ~mask
        with contextlib.suppress(OSError):
            if q.stat().st_mode & 0o777 != want:
                os.chmod(q, want)


def default_cache_dir() -> Path:
    """The project's cache folder ($ARCHSEARCH_CACHE or ~/.cache/archsearch): tokenizers, packed
    token arrays, lm-eval's task index."""
    env = os.environ.get("ARCHSEARCH_CACHE")
    return Path(env) if env else Path.home() / ".cache" / "archsearch"


def read_text(path: str | Path, what: str | None = None) -> str:
    """The file at ``path`` as UTF-8 text (a UTF-8 byte-order mark is dropped); a binary file, a
    UTF-16 one or any other encoding is one clear error naming ``what`` (default: the path)."""
    p = Path(path)
    data = p.read_bytes()
    where, name = (what, f"{str(p)!r} is") if what and what != str(p) else (str(p), "is")
    fix = "save it as UTF-8 text; a binary, UTF-16 or Latin-1 file cannot be read"
    if data.startswith((b"\xff\xfe", b"\xfe\xff")) or b"\x00" in data:
        kind = "UTF-16 text" if data.startswith((b"\xff\xfe", b"\xfe\xff")) else "a binary file"
        raise ArchsearchError(where, f"{name} {kind}, not UTF-8 text", fix)
    try:
        return data.decode("utf-8-sig")
    except UnicodeDecodeError as e:
        raise ArchsearchError(where, f"{name} not UTF-8 text (byte 0x{data[e.start]:02x} at offset {e.start})",
                              fix) from None


@contextlib.contextmanager
def atomic_open(path: str | Path, mode: str = "w", **kw: Any) -> Iterator[IO]:
    """Open a temporary file next to ``path``; on success it replaces ``path`` in one rename.
    The file gets a plain ``open``'s mode (0666 less the umask), not mkstemp's private 0600."""
    p = Path(path)
    if p.exists() and not p.is_file() and not p.is_dir():  # the rename would replace a device (/dev/null)
        raise ArchsearchError(str(p), "is not a regular file (a device, pipe or socket)", "give a file path")
    p.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{p.name}.", suffix=".tmp", dir=p.parent)
    try:
        os.fchmod(fd, 0o666 & ~_umask())
        with os.fdopen(fd, mode, **kw) as fh:
            yield fh
            fh.flush()
            os.fsync(fh.fileno())
        os.replace(tmp, p)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
        raise


def atomic_write(path: str | Path, data: str | bytes) -> Path:
    """Write ``data`` (text or bytes) to ``path`` atomically; returns the path."""
    with atomic_open(path, "wb" if isinstance(data, bytes) else "w") as fh:
        fh.write(data)
    return Path(path)


def write_json(path: str | Path, obj: Any, **kw: Any) -> Path:
    """``obj`` as indented JSON, atomically."""
    kw.setdefault("indent", 2)
    return atomic_write(path, json.dumps(obj, **kw) + "\n")


def append_line(path: str | Path, line: str) -> None:
    """Append one whole line in a single write (a torn tail is dropped by the reader)."""
    p = Path(path)
    p.parent.mkdir(parents=True, exist_ok=True)
    _heal_torn_tail(p)
    with p.open("a") as fh:
        fh.write(line.rstrip("\n") + "\n")
        fh.flush()
        os.fsync(fh.fileno())


def _heal_torn_tail(p: Path) -> None:
    """Cut a last line without its newline (a write killed half-way) before appending."""
    try:
        with p.open("rb+") as fh:
            fh.seek(0, os.SEEK_END)
            size = fh.tell()
            if size == 0:
                return
            fh.seek(size - 1)
            if fh.read(1) == b"\n":
                return
            data = fh.seek(0) or fh.read()
            keep = data.rfind(b"\n") + 1
            _log.warning(f"archsearch: {p}: dropped a torn last line ({size - keep} bytes) left by an "
                         "interrupted write")
            fh.truncate(keep)
    except FileNotFoundError:
        return


def read_json_tolerant(path: str | Path, what: str) -> dict[str, Any] | None:
    """A JSON state file, or None (with a line on stderr) where it is cut short by a killed
    write or otherwise unreadable: whatever it recorded is redone."""
    if not Path(path).is_file():
        return None
    try:
        data = json.loads(Path(path).read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        _log.warning(f"archsearch: {path} is not valid JSON ({e}): {what} is treated as absent and redone")
        return None
    return data if isinstance(data, dict) else None


def read_jsonl_lines(path: str | Path, what: str | None = None) -> list[Any]:
    """The parsed lines of an append-only JSONL log. A torn last line (an interrupted append)
    is skipped with a message; a broken line elsewhere is an error naming the line."""
    p = Path(path)
    if not p.exists():
        return []
    lines = read_text(p, what).splitlines()
    out = []
    for i, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            out.append(json.loads(line))
        except json.JSONDecodeError as e:
            if i == len(lines):
                _log.warning(f"archsearch: {p}: skipped a torn last line {i} (an interrupted write); "
                             "it is redone")
                continue
            raise ArchsearchError(what or f"{p}:{i}", f"line {i} is not valid JSON ({e.msg})",
                                  "fix or delete that line") from None
    return out


def truncate_jsonl(path: str | Path, keep: Callable[[Any], bool]) -> None:
    """Rewrite an append-only JSONL log (atomically) without the records ``keep`` rejects, e.g.
    the lines a killed run logged after its last checkpoint, which the resumed run logs again.
    A torn last line goes too; a missing log is left missing."""
    p = Path(path)
    if not p.exists():
        return
    recs = read_jsonl_lines(p)
    kept = [r for r in recs if keep(r)]
    if len(kept) < len(recs) or not p.read_bytes().endswith(b"\n"):
        atomic_write(p, "".join(json.dumps(r) + "\n" for r in kept))


def read_table(path: Path, what: str) -> list[Any]:
    """The rows of a user's ``.csv`` (dicts by header) or JSON-lines file; a broken line is an
    error naming ``what`` and the line."""
    text = read_text(path, what)
    if path.suffix == ".csv":
        header = next(csv.reader(io.StringIO(text, newline="")), [])
        twice = sorted({c for c in header if header.count(c) > 1})
        if twice:  # a DictReader keeps the last column of a name, silently
            raise ArchsearchError(f"{what} columns", f"{twice} appear more than once in the header",
                                  "keep one column of each name")
        return list(csv.DictReader(io.StringIO(text, newline="")))
    rows = []
    for i, line in enumerate(text.splitlines(), 1):
        if line.strip():
            try:
                rows.append(json.loads(line, object_pairs_hook=lambda pairs, i=i: _one_of_each(pairs, what, i)))
            except json.JSONDecodeError as e:
                raise ArchsearchError(f"{what} line {i}", f"is not valid JSON ({e.msg})",
                                      "one JSON object per line") from None
    return rows


def _one_of_each(pairs: list[tuple[str, Any]], what: str, line: int) -> dict[str, Any]:
    """A JSON object's pairs as a dict, refusing a key given twice (json keeps the last, silently)."""
    out: dict[str, Any] = {}
    for k, v in pairs:
        if k in out:
            raise ArchsearchError(f"{what} line {line}", f"the key {k!r} is given twice", "keep one")
        out[k] = v
    return out


def write_table(path: str | Path, rows: list[dict[str, Any]], first: tuple[str, ...] = ()) -> Path:
    """``rows`` as CSV, atomically: the columns are ``first``, then every other key in order of
    appearance; a missing or None value is an empty cell."""
    with atomic_open(path, "w", newline="") as fh:
        w = csv.DictWriter(fh, fieldnames=list(dict.fromkeys([*first, *(k for r in rows for k in r)])))
        w.writeheader()
        w.writerows(rows)
    return Path(path)


def _path_limits(p: Path) -> tuple[int, int]:
    """(longest name, longest path) in bytes on the file system ``p`` would be made on."""
    for parent in (p.absolute(), *p.absolute().parents):
        with contextlib.suppress(OSError, ValueError):  # a name over the limit: its stat fails too
            return os.pathconf(parent, "PC_NAME_MAX"), os.pathconf(parent, "PC_PATH_MAX")
    return 255, 4096


def check_path(flag: str, path: str | Path) -> Path:
    """The one check of a path a user names for output, before any work: not empty (``''`` would
    be the current folder), no NUL byte, no name longer than the file system takes (255 bytes on
    most) and not longer as a whole than the system's limit (4096 bytes on Linux). Returns it."""
    text = os.fspath(path)
    if not text.strip():
        raise ArchsearchError(flag, "is empty (it would write into the current folder)",
                              "give a path, e.g. runs/my-run (or '.' for the current folder)")
    if "\x00" in text:
        raise ArchsearchError(flag, "holds a NUL byte", "give a plain path")
    p = Path(text)
    name_max, path_max = _path_limits(p)
    long = next((part for part in p.parts if len(os.fsencode(part)) > name_max), None)
    if long is not None:
        raise ArchsearchError(flag, f"the name {long[:40]!r}... is {len(os.fsencode(long))} bytes, over this file "
                              f"system's limit of {name_max}", "give shorter folder and file names")
    if len(os.fsencode(str(p.absolute()))) >= path_max:
        raise ArchsearchError(flag, f"the path is {len(os.fsencode(str(p.absolute())))} bytes, over the system's "
                              f"limit of {path_max - 1}", "give a shorter path")
    return p


def check_output(flag: str, path: str | Path | None, kind: str = "file") -> None:
    """Refuse, before any work, an output ``path`` that cannot be written as a ``kind``
    ("file" or "dir"): an empty or over-long path (:func:`check_path`), a link to nothing, an
    existing folder where a file goes, a device, pipe or socket (which the atomic write's rename
    would replace), a file where a folder goes, or a parent that is a file."""
    if path is None:
        return
    p = check_path(flag, path)
    if p.is_symlink() and not p.exists():
        raise ArchsearchError(flag, f"{str(p)!r} is a link to nothing ({os.readlink(p)!r})",
                              "give another path, or remove the link")
    if kind == "file" and p.is_dir():
        raise ArchsearchError(flag, f"{str(p)!r} is a folder", "give a file path")
    if kind == "file" and p.exists() and not p.is_file():
        # a device, a pipe or a socket: a file is written beside it and renamed over it, replacing it
        # (as root, /dev/null itself)
        raise ArchsearchError(flag, f"{str(p)!r} is not a regular file (a device, pipe or socket)",
                              "give a file path")
    if kind == "dir" and p.exists() and not p.is_dir():
        raise ArchsearchError(flag, f"{str(p)!r} is a file", "give a folder path (new or existing)")
    for parent in p.absolute().parents:
        if parent.exists():
            if not parent.is_dir():
                raise ArchsearchError(flag, f"{str(parent)!r} is a file, so {str(p)!r} cannot be made",
                                      "give a path under a folder")
            if not os.access(parent, os.W_OK):
                raise ArchsearchError(flag, f"cannot write under {str(parent)!r} (permission denied)",
                                      "give a writable path")
            break


def check_name(field: str, name: Any) -> str:
    """``name``, a name that becomes one folder or file under a folder the user chose (a study, a
    sweep): not empty, not ``.`` or ``..``, no path separator, not absolute, no control
    character, so it cannot leave that folder or land on the folder itself."""
    fix = "give a plain name such as 'my-study' (letters, digits, '-', '_', '.')"
    if not isinstance(name, str) or not name.strip():
        raise ArchsearchError(field, f"{name!r} is not a name", fix)
    if name in (".", "..") or any(c in name for c in "/\\") or os.path.isabs(name):
        raise ArchsearchError(field, f"{name!r} would be a path, not a name in its folder", fix)
    if any(ord(c) < 32 or c == "\x7f" for c in name) or name != name.strip():
        raise ArchsearchError(field, f"{name!r} holds control characters or surrounding spaces", fix)
    if len(os.fsencode(name)) > 200:  # a folder name, and files are named after it (<name>.lock, ...)
        raise ArchsearchError(field, f"{name[:40]!r}... is {len(os.fsencode(name))} bytes long, over the 200 a "
                              "folder name may take here (file systems take 255, with room for suffixes)", fix)
    return name


def check_input_file(flag: str, path: str | Path) -> Path:
    """An existing regular file, or a clear error naming ``flag``."""
    p = Path(path)
    if p.is_dir():
        raise ArchsearchError(flag, f"{str(p)!r} is a folder", "give a file")
    if not p.is_file():
        raise ArchsearchError(flag, f"no such file {str(p)!r}")
    return p
