"""Results files of the commands: written whole or not at all, read back row by row, one writer at a time.

`write_atomically` replaces a file in one step (an interrupted run leaves the old file or the new
one, never a cut-short line); `load_results` reads a ``.jsonl`` file of result rows and sets
aside the lines it cannot read; `OutputLock` keeps a second run out of an output folder.
"""

from __future__ import annotations

import csv
import errno
import io
import json
import os
import socket
import sys
import time
from pathlib import Path
from typing import Any

from ..errors import KVPolicyError


def write_atomically(path: Path, text: str) -> None:
    """Write ``text`` to ``path`` whole or not at all: a temporary file beside it, flushed, then renamed over it.

    An interrupted run (Ctrl-C, SIGTERM, SIGKILL, a power cut after the rename) leaves either the old file or
    the new one, never a cut-short line. A path that cannot be written raises KVPolicyError naming it.
    """
    temporary = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
        if path.is_dir():
            raise IsADirectoryError(errno.EISDIR, "it is a folder", str(path))
        with temporary.open("w", encoding="utf-8", newline="") as file:
            file.write(text)
            file.flush()
            os.fsync(file.fileno())
        os.replace(temporary, path)
    except BaseException as error:  # Ctrl-C included: leave no temporary file behind
        temporary.unlink(missing_ok=True)
        if isinstance(error, OSError):
            raise KVPolicyError(f"cannot write {str(path)!r}: {error.strerror or error}; remove it or choose another "
                                "--out") from None
        raise


class OutputLock:
    """A lock file in an output folder that holds the pid of the run writing there.

    A second run into the same folder is refused with a message naming the first (its pid); a lock left by a
    process that no longer runs (killed) is taken over. Use as a context manager; the lock goes on exit.
    """

    def __init__(self, folder: Path, what: str = "kvpolicy"):
        self.path = folder / ".kvpolicy.lock"
        self.what = what
        self.held = False

    def __enter__(self) -> OutputLock:
        mine = f"{os.getpid()} {socket.gethostname()} {time.strftime('%Y-%m-%dT%H:%M:%S')} {self.what}\n"
        for _ in range(5):
            try:
                descriptor = os.open(self.path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
            except FileExistsError:
                self._refuse_or_take_over()
                continue
            except OSError as error:
                raise KVPolicyError(f"cannot create {str(self.path)!r}: {error.strerror or error}; choose another --out") \
                    from None
            with os.fdopen(descriptor, "w") as file:
                file.write(mine)
            self.held = True
            return self
        raise KVPolicyError(f"cannot take the lock {str(self.path)!r}: other runs keep taking it; choose another --out")

    def _refuse_or_take_over(self) -> None:
        try:
            fields = self.path.read_text(encoding="utf-8", errors="replace").split(maxsplit=3)
            pid_text, host, since, holder = [*fields, "", "", "", ""][:4]
        except FileNotFoundError:
            return  # released meanwhile: try again
        except OSError as error:
            raise KVPolicyError(f"cannot read the lock {str(self.path)!r}: {error.strerror or error}") from None
        pid = int(pid_text) if pid_text.isdigit() else None
        if pid is not None and (host != socket.gethostname() or _running(pid)):
            raise KVPolicyError(
                f"{str(self.path.parent)!r} is in use by another {holder.strip() or 'run'} (pid {pid} on {host}, since {since}): "
                f"wait for it to finish or choose another --out; if that run is gone, delete {str(self.path)!r}"
            )
        stale = self.path.with_name(f"{self.path.name}.stale.{os.getpid()}")
        try:  # only one of several runs that found the same stale lock gets to rename it
            os.rename(self.path, stale)
            stale.unlink(missing_ok=True)
        except FileNotFoundError:
            pass

    def __exit__(self, *exc: Any) -> None:
        if not self.held:
            return
        self.held = False
        try:
            if self.path.read_text(encoding="utf-8").split()[0] == str(os.getpid()):
                self.path.unlink()
        except (OSError, IndexError):
            pass


def _running(pid: int) -> bool:
    """True if a process ``pid`` exists on this machine (ours or another user's)."""
    if pid == os.getpid() or os.name == "nt":  # Windows: os.kill would end it; take the lock as held
        return True
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    except OSError:
        return False
    return True


#: what every row of a results file must hold, and its type; a row without them is recomputed
ROW_FIELDS = {"key": str, "task": str, "recipe": str, "budget": (str, type(None))}


def load_results(path: Path) -> list[dict[str, Any]]:
    """The readable rows of a results file. Lines that are not a JSON row with the fields of `ROW_FIELDS` (a
    line cut short by an older version's interrupted run, a bad byte, a missing field) are set aside in
    ``results.jsonl.unreadable``, named on stderr, and their rows recomputed."""
    if not path.exists():
        return []
    if not path.is_file():
        raise KVPolicyError(f"{str(path)!r} is a folder (or not a file), so no results can be kept there: "
                            "remove it or choose another --out")
    try:
        data = path.read_bytes()
    except OSError as error:
        raise KVPolicyError(f"cannot read {str(path)!r}: {error.strerror or error}; fix it or choose another --out") \
            from None
    rows, unreadable = [], []
    for line in data.split(b"\n"):
        if not line.strip():
            continue
        try:
            row = json.loads(line.decode("utf-8"))
        except ValueError:  # UnicodeDecodeError included
            unreadable.append(line)
            continue
        if isinstance(row, dict) and all(isinstance(row.get(k), t) for k, t in ROW_FIELDS.items()):
            rows.append(row)
        else:
            unreadable.append(line)
    if unreadable:
        aside = path.with_name(path.name + ".unreadable")
        try:
            with aside.open("ab") as file:
                file.write(b"".join(line + b"\n" for line in unreadable))
        except OSError:
            aside = None
        print(f"kvpolicy: note: {len(unreadable)} unreadable line(s) of {path} "
              f"{f'moved to {aside}' if aside else 'dropped'}; their rows are recomputed", file=sys.stderr)
        write_jsonl(path, rows)
    return rows


def write_jsonl(path: Path, rows: list[dict[str, Any]]) -> None:
    """The whole results file, written atomically (an interrupted run leaves the previous one intact)."""
    write_atomically(path, "".join(json.dumps(row, default=str) + "\n" for row in rows))


def write_csv(path: Path, rows: list[dict[str, Any]]) -> None:
    fields = list(dict.fromkeys(key for row in rows for key in row))
    text = io.StringIO()
    writer = csv.DictWriter(text, fieldnames=fields)
    writer.writeheader()
    for row in rows:
        writer.writerow({k: json.dumps(v) if isinstance(v, (dict, list)) else v for k, v in row.items()})
    write_atomically(path, text.getvalue())
