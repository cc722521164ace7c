"""Output files written the way careful tools write them.

Every file trnsim writes for a user (traces, sweep results, reports) goes through here, so the
rules hold everywhere:

* a regular file is replaced atomically: the new content goes to a temporary file in the same
  directory, which is renamed over the target only once it is complete, so a crash, a full disk
  or a reader opening it meanwhile never sees half a file;
* a symlink is followed: the file it points to is replaced and the link stays;
* anything that is not a regular file (a FIFO, a device, a socket, a directory) is refused with
  one line, never replaced and never opened (opening a FIFO would block until a reader comes);
* a new file gets the user's normal mode (``0666`` less the umask), a replaced one keeps its
  mode;
* a missing parent directory is created when the file is written, for every output alike
  (``--trace``, ``--metrics``, ``--plot``, sweep results), and only then: a run that fails
  leaves no directory behind; its nearest existing ancestor is checked up front;
* the path is checked *before* a long run starts (:func:`check_output` or
  :class:`AtomicOutput`), so a trace that cannot be written costs a one-line error, not the run.

:func:`lock_exclusive` takes an advisory lock on an open file so that two processes appending
to one results file refuse each other instead of interleaving their rows.

Errors are :class:`OutputError`: one line naming the user's path (never the temporary file) and
what went wrong.
"""

from __future__ import annotations

import errno
import os
import secrets
import stat
from pathlib import Path
from typing import IO, Any, Callable

from .loader import file_kind

__all__ = ["OutputError", "AtomicOutput", "check_output", "write_atomic", "lock_exclusive", "reserve_all"]


class OutputError(ValueError):
    """An output file cannot be written where the user asked. The message is one line."""


def _reason(e: OSError) -> str:
    return e.strerror or type(e).__name__


def _target(path: str | os.PathLike[str], what: str, missing_dirs: bool = False
            ) -> tuple[Path, os.stat_result | None]:
    """The file ``path`` names once symlinks are followed, and its stat (None: it does not exist
    yet). Refuses what is not a regular file, a missing directory (unless ``missing_dirs``: the
    caller creates it; then its nearest existing ancestor must be a writable directory), and
    symlink loops."""
    shown = os.fspath(path)
    if not shown:
        raise OutputError(f"{what}: expected a file path, got an empty one")
    real = Path(os.path.realpath(shown))
    try:
        st = os.lstat(real)
    except FileNotFoundError:
        st = None
    except OSError as e:
        raise OutputError(f"{what} {shown}: cannot write it ({_reason(e)})") from None
    if st is not None and stat.S_ISLNK(st.st_mode):  # realpath stops inside a loop
        raise OutputError(f"{what} {shown}: cannot write it (a symlink loop)")
    if st is not None and not stat.S_ISREG(st.st_mode):
        raise OutputError(f"{what} {shown}: it is {file_kind(st.st_mode)}, not a regular file; give a file path")
    parent = real.parent
    try:
        pst = os.stat(parent)
    except FileNotFoundError:
        if not missing_dirs:
            raise OutputError(f"{what} {shown}: its directory {parent} does not exist") from None
        top = parent
        while not os.path.lexists(top) and top != top.parent:
            top = top.parent
        if not top.is_dir():
            raise OutputError(f"{what} {shown}: {top} is not a directory") from None
        if not os.access(top, os.W_OK | os.X_OK):
            raise OutputError(f"{what} {shown}: cannot create {parent} (Permission denied)") from None
        return real, None
    except OSError as e:
        raise OutputError(f"{what} {shown}: cannot write it ({_reason(e)})") from None
    if not stat.S_ISDIR(pst.st_mode):
        raise OutputError(f"{what} {shown}: {parent} is not a directory")
    return real, st


def _create_temp(real: Path, shown: str, what: str) -> tuple[int, Path]:
    """An exclusive new file beside ``real``: mode 0666 less the umask (the kernel applies it)."""
    for _ in range(100):
        tmp = real.with_name(f".{real.name}.{secrets.token_hex(4)}.tmp")
        try:
            fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_CLOEXEC", 0), 0o666)
        except FileExistsError:
            continue
        except OSError as e:
            raise OutputError(f"{what} {shown}: cannot write it ({_reason(e)})") from None
        return fd, tmp
    raise OutputError(f"{what} {shown}: cannot write it (no free temporary name in {real.parent})")  # pragma: no cover


def check_output(path: str | os.PathLike[str], what: str = "output", *, missing_dirs: bool = False) -> Path:
    """Check now that ``path`` can be written later; returns the file it names (symlinks
    followed). Creates nothing: an existing file is opened for appending and closed, a new one
    is tried as a temporary file beside it, which is removed at once. With ``missing_dirs`` the
    directory may not exist yet (the caller will create it)."""
    shown = os.fspath(path)
    real, st = _target(path, what, missing_dirs)
    if st is None and not real.parent.is_dir():
        return real
    if st is not None:
        try:
            os.close(os.open(real, os.O_WRONLY | os.O_APPEND | getattr(os, "O_NONBLOCK", 0)))
        except OSError as e:
            raise OutputError(f"{what} {shown}: cannot write it ({_reason(e)})") from None
        return real
    fd, tmp = _create_temp(real, shown, what)
    os.close(fd)
    os.unlink(tmp)
    return real


class AtomicOutput:
    """A file reserved before a long run and written atomically after it::

        out = AtomicOutput("trace.json", "--trace")   # refuses a FIFO/device/bad directory now
        ...                                            # the long run
        out.commit(lambda f: json.dump(doc, f))        # written to a temp, renamed over the target

    The temporary file exists from the reservation on (so a later failure to create it cannot
    happen); :meth:`discard` (or leaving a ``with`` block by an exception) removes it. ``text``
    selects a text (UTF-8) or binary file object for the writer.
    """

    def __init__(self, path: str | os.PathLike[str], what: str = "output", *, text: bool = True):
        self.shown = os.fspath(path)
        self.what = what
        self.text = text
        self.path, _ = _target(path, what, missing_dirs=True)
        self._done = False
        self._fd, self._tmp = -1, None
        if self.path.parent.is_dir():  # else made with the directory, at commit
            self._fd, self._tmp = _create_temp(self.path, self.shown, what)

    def commit(self, write: Callable[[IO[Any]], None]) -> Path:
        """Write the content with ``write(file)``, then rename it over the target."""
        if self._done:
            raise RuntimeError(f"{self.what} {self.shown}: already committed or discarded")
        self._done = True
        if self._tmp is None:
            try:
                self.path.parent.mkdir(parents=True, exist_ok=True)
            except OSError as e:
                raise OutputError(f"{self.what} {self.shown}: cannot create {self.path.parent} ({_reason(e)})") from None
            self._fd, self._tmp = _create_temp(self.path, self.shown, self.what)
        fd, self._fd = self._fd, -1
        try:
            with (os.fdopen(fd, "w", encoding="utf-8") if self.text else os.fdopen(fd, "wb")) as f:
                write(f)
                f.flush()
                # keep the mode of the file being replaced; a new file keeps the umask mode
                try:
                    st = os.stat(self.path)
                except FileNotFoundError:
                    st = None
                if st is not None and not stat.S_ISREG(st.st_mode):
                    # it became a FIFO/device while we ran: refuse rather than replace it
                    raise OutputError(f"{self.what} {self.shown}: it is {file_kind(st.st_mode)}, not a regular "
                                      f"file; give a file path")
                if st is not None:
                    os.fchmod(f.fileno(), stat.S_IMODE(st.st_mode))
            os.replace(self._tmp, self.path)
        except BaseException as e:
            self._unlink()
            if isinstance(e, OSError):
                raise OutputError(f"{self.what} {self.shown}: cannot write it ({_reason(e)})") from None
            raise
        return self.path

    def discard(self) -> None:
        """Give the reservation up: the temporary file goes, the target is untouched."""
        if self._done:
            return
        self._done = True
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1
        self._unlink()

    def _unlink(self) -> None:
        if self._tmp is None:
            return
        try:
            os.unlink(self._tmp)
        except FileNotFoundError:
            pass

    def __enter__(self) -> "AtomicOutput":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.discard()

    def __del__(self) -> None:  # a reservation dropped without commit leaves no temp behind
        try:
            self.discard()
        except Exception:  # pragma: no cover - interpreter shutdown
            pass


def reserve_all(makers: "list[Callable[[], AtomicOutput | None]]") -> "list[AtomicOutput | None]":
    """Reserve several outputs before a run (each maker returns an :class:`AtomicOutput` or
    None); if one is refused, the ones already reserved are given up and the error raised."""
    reserved: list[AtomicOutput | None] = []
    try:
        for make in makers:
            out = make()
            for earlier in reserved:  # two outputs renamed over one file: the last would win, silently
                if out is not None and earlier is not None and earlier.path == out.path:
                    out.discard()
                    raise OutputError(f"{earlier.what} and {out.what} name the same file {out.shown}; give each "
                                      f"output a file of its own")
            reserved.append(out)
    except BaseException:
        for out in reserved:
            if out is not None:
                out.discard()
        raise
    return reserved


def write_atomic(path: str | os.PathLike[str], write: Callable[[IO[Any]], None], what: str = "output", *,
                 text: bool = True) -> Path:
    """Check ``path``, write it with ``write(file)`` to a temporary file and rename it into
    place; see the module docstring for the rules. Returns the file written."""
    return AtomicOutput(path, what, text=text).commit(write)


def lock_exclusive(f: IO[Any], shown: str, what: str = "output", holder: str = "another process") -> None:
    """Take a non-blocking exclusive advisory lock on the open file ``f`` (held until it is
    closed); refuses with one line when ``holder`` has it. A no-op where POSIX locks do not
    exist."""
    try:
        import fcntl
    except ImportError:  # pragma: no cover - not POSIX
        return
    try:
        fcntl.flock(f.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError as e:
        if e.errno in (errno.EWOULDBLOCK, errno.EAGAIN, errno.EACCES):
            raise OutputError(f"{what} {shown}: {holder} is writing it; wait for it to finish or choose "
                              f"another file") from None
        if e.errno in (errno.ENOLCK, errno.EOPNOTSUPP, errno.EINVAL):  # e.g. a file system without locks
            return
        raise OutputError(f"{what} {shown}: cannot lock it ({_reason(e)})") from None
