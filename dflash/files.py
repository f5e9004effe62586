"""Crash-safe writes and inter-process locks: the one implementation the whole package uses.

- ``atomic_write(path, data)``: a file that is either its old content or the new one, whatever
  moment the process dies at (temp file in the same directory, fsync, ``os.replace``, fsync of the
  directory).
- ``atomic_file(path)``: the same for content written as a stream (e.g. a JSONL corpus).
- ``atomic_directory(path)``: a directory filled in a temp sibling, then put in place. Replacing an
  existing directory uses ``renameat2(RENAME_EXCHANGE)`` (Linux), which swaps the two names in one
  step, so ``path`` always holds a complete old or new version. Where the exchange is not
  available the old directory is moved aside first; a kill between the two renames leaves it as
  ``.<name>.old-<pid>``, which the next ``atomic_directory(path)`` puts back before doing anything.
- ``append_line(path, line)``: one ``O_APPEND`` write of a whole line, then fsync: a crash can
  tear only the line being written, never an earlier one; a write the disk cannot take (full disk,
  quota, file size limit) is undone, so the file holds the whole line or none of it, and the error
  names the file and the cause. ``drop_torn_tail(path)`` removes a line torn by a crash before a
  writer resumes.
- ``DiskFull``: what every write above raises when the disk refuses it (no space, a quota, a file
  size limit): one line naming the path, the cause, the free space there and the fix (the caller's
  ``fix``, e.g. the config field that moves the file to another disk); nothing partial is left.
  ``disk_full_error`` recognises a full disk in any exception (an ``OSError``, or the text of
  safetensors', tokenizers' and torch's own errors for it).
- ``file_digest(path)``: size and sha256 of a file (every byte, or evenly spaced blocks of a huge
  one); ``digest_files``/``digest_problems`` record and check them for a directory of cache files.
- ``file_lock(path)``: an exclusive ``flock``; the kernel releases it when the holder dies
  (``blocking=False``: fail at once when another process holds it).
- ``NoFollowFileHandler``: a log file that is never opened through a symbolic link.

Files are made readable like any other file the user creates (mode ``0o666 & ~umask``;
safetensors alone would write 0600).
"""

from __future__ import annotations

import ctypes
import errno
import fcntl
import hashlib
import logging
import os
import shutil
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import IO

_RENAME_EXCHANGE = 2
_AT_FDCWD = -100
_HASH_CHUNK = 1 << 20
SAMPLE_BLOCKS = 256
"""Blocks of ``_HASH_CHUNK`` bytes a sampled digest reads (head, tail and evenly spaced between)."""


def fsync_path(path: str | os.PathLike[str]) -> None:
    """fsync a file or a directory (a directory's fsync makes the renames inside it durable)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


def make_public(path: str | os.PathLike[str]) -> None:
    """Give ``path`` (recursively for a directory) the mode a plain ``open``/``mkdir`` would."""
    mask = _umask()
    p = Path(path)
    if p.is_dir():
        os.chmod(p, 0o777 & ~mask)
        for child in p.rglob("*"):
            os.chmod(child, (0o777 if child.is_dir() else 0o666) & ~mask)
    else:
        os.chmod(p, 0o666 & ~mask)


def _temp_sibling(path: Path, kind: str) -> Path:
    return path.with_name(f".{path.name}.{kind}-{os.getpid()}-{uuid.uuid4().hex[:8]}")


_FULL_CAUSES = {
    errno.ENOSPC: "no space left on device",
    errno.EDQUOT: "disk quota exceeded",
    errno.EFBIG: "file too large (a file size limit, ulimit -f)",
}
_FULL_TEXTS = {
    "no space left on device": errno.ENOSPC,
    "os error 28": errno.ENOSPC,
    "disk quota exceeded": errno.EDQUOT,
    "os error 122": errno.EDQUOT,
    "file too large": errno.EFBIG,
    "os error 27": errno.EFBIG,
}
"""How safetensors, tokenizers (Rust ``io::Error``) and others word a full disk in their own errors."""
LOW_SPACE_BYTES = 64 << 20
"""Below this much free space a failed write is taken for a full disk whatever its error says (torch's
own message for ENOSPC is ``[enforce fail at inline_container.cc] unexpected pos``)."""
DEFAULT_FIX = "free space there, or put it on a larger disk"


def cache_fix(field: str) -> str:
    """The fix of a full disk under one of dflash's caches, ``field`` being the config field of it."""
    return (
        f"free space there, or move the cache to a larger disk: {field}=<dir> (or DFLASH_CACHE_DIR=<dir>, "
        "the root of every dflash cache)"
    )


class DiskFull(OSError):
    """A write the disk refused (no space, a quota or a file size limit). ``str()`` is one line:
    the path, the cause, the free space there and the fix; ``errno`` is the cause's."""


def free_bytes(path: str | os.PathLike[str]) -> int | None:
    """Free bytes (for this user) on the file system of ``path`` or of its nearest existing parent."""
    p = Path(path).absolute()
    while not p.exists() and p != p.parent:
        p = p.parent
    try:
        return shutil.disk_usage(p).free
    except OSError:
        return None


def human_bytes(n: float) -> str:
    """``12 MiB``, ``3.4 GiB``, ``512 B``."""
    for unit, size in (("TiB", 2**40), ("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if n >= size:
            return f"{n / size:.3g} {unit}" if n < 10 * size else f"{n / size:.0f} {unit}"
    return f"{n:.0f} B"


def _full_errno(err: BaseException) -> int | None:
    """The errno of a full disk in ``err`` or the exceptions it was raised from, else None."""
    seen: set[int] = set()
    e: BaseException | None = err
    while e is not None and id(e) not in seen:
        seen.add(id(e))
        if isinstance(e, OSError) and e.errno in _FULL_CAUSES:
            return e.errno
        text = str(e).lower()
        for needle, code in _FULL_TEXTS.items():
            if needle in text:
                return code
        e = e.__cause__ or e.__context__
    return None


def disk_full_error(
    err: BaseException, path: str | os.PathLike[str], fix: str = DEFAULT_FIX
) -> DiskFull | None:
    """``err`` as a :class:`DiskFull` naming ``path`` when it is a full disk (its errno or its text
    says so, or it is an error without an errno, such as torch's, and less than
    :data:`LOW_SPACE_BYTES` is free there), else None."""
    if isinstance(err, DiskFull):
        return err
    free = free_bytes(path)
    code = _full_errno(err)
    unexplained = isinstance(err, RuntimeError) or (isinstance(err, OSError) and err.errno is None)
    if code is None and not (unexplained and free is not None and free < LOW_SPACE_BYTES):
        return None
    code = code or errno.ENOSPC
    room = f"{human_bytes(free)} free there" if free is not None else "free space unknown"
    out = DiskFull(f"writing {path} failed: {_FULL_CAUSES[code]} ({room}); {fix}")
    out.errno = code
    return out


@contextmanager
def naming_full_disk(path: str | os.PathLike[str], fix: str = DEFAULT_FIX) -> Iterator[None]:
    """Inside: a write that fails on a full disk raises :class:`DiskFull` naming ``path``."""
    try:
        yield
    except Exception as e:
        full = disk_full_error(e, path, fix)
        if full is None or full is e:
            raise
        raise full from None


@contextmanager
def atomic_file(
    path: str | os.PathLike[str], mode: str = "w", encoding: str | None = "utf-8", *, fix: str = DEFAULT_FIX
) -> Iterator[IO]:
    """Open a temp sibling of ``path`` for writing; on a clean exit it replaces ``path`` atomically.

    On an exception the temp file is removed and ``path`` is untouched; a full disk is raised as
    :class:`DiskFull` naming ``path`` and ``fix`` (what to do besides freeing space).
    """
    path = Path(path)
    with naming_full_disk(path, fix):
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = _temp_sibling(path, "tmp")
        try:
            with open(tmp, mode, encoding=None if "b" in mode else encoding) as fh:
                yield fh
                fh.flush()
                os.fsync(fh.fileno())
            make_public(tmp)
            os.replace(tmp, path)
            fsync_path(path.parent)
        except BaseException:
            tmp.unlink(missing_ok=True)
            raise


def atomic_write(path: str | os.PathLike[str], data: bytes | str, *, fix: str = DEFAULT_FIX) -> Path:
    """Write ``data`` to ``path`` atomically (see :func:`atomic_file`); returns ``path``."""
    with atomic_file(path, "wb", fix=fix) as fh:
        fh.write(data.encode() if isinstance(data, str) else data)
    return Path(path)


def _exchange(a: Path, b: Path) -> bool:
    """Swap two existing paths in one step (Linux renameat2 RENAME_EXCHANGE); False if unsupported."""
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        fn = libc.renameat2
    except (OSError, AttributeError):
        return False
    rc = fn(_AT_FDCWD, os.fsencode(a), _AT_FDCWD, os.fsencode(b), _RENAME_EXCHANGE)
    if rc == 0:
        return True
    err = ctypes.get_errno()
    if err in (errno.EINVAL, errno.ENOSYS, errno.ENOTSUP, errno.EOPNOTSUPP):
        return False
    raise OSError(err, os.strerror(err), str(b))


def _restore_interrupted(final: Path) -> None:
    """Put back the old copy of ``final`` left by a replace that died between its two renames."""
    if final.exists():
        return
    olds = sorted(final.parent.glob(f".{final.name}.old-*"), key=lambda p: p.stat().st_mtime)
    if olds:
        os.rename(olds[-1], final)
        fsync_path(final.parent)


def _fsync_tree(root: Path) -> None:
    for p in sorted(root.rglob("*"), reverse=True):
        fsync_path(p)
    fsync_path(root)


@contextmanager
def atomic_directory(path: str | os.PathLike[str], *, fix: str = DEFAULT_FIX) -> Iterator[Path]:
    """Yield an empty temp directory; on a clean exit it becomes ``path`` (replacing any old one).

    Every file is fsynced before the directory is put in place. On an exception the temp
    directory is removed and ``path`` is untouched; a full disk is raised as :class:`DiskFull`
    naming ``path`` and ``fix``.
    """
    final = Path(path)
    with naming_full_disk(final, fix):
        final.parent.mkdir(parents=True, exist_ok=True)
        _restore_interrupted(final)
        tmp = _temp_sibling(final, "tmp")
        tmp.mkdir()
        try:
            yield tmp
            make_public(tmp)
            _fsync_tree(tmp)
            if not final.exists():
                os.rename(tmp, final)
            elif _exchange(tmp, final):
                shutil.rmtree(tmp)  # now the old content
            else:
                old = _temp_sibling(final, "old")
                os.rename(final, old)
                os.rename(tmp, final)
                shutil.rmtree(old)
            fsync_path(final.parent)
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise


def _write_failure(path: str | os.PathLike[str], err: OSError, written: int, total: int) -> OSError:
    """The error of an append the file system refused, in words (a full disk is a :class:`DiskFull`)."""
    cause = {
        errno.ENOSPC: "no space left on device: free disk space",
        errno.EDQUOT: "disk quota exceeded: free space or raise the quota",
        errno.EFBIG: "file too large (a file size limit, ulimit -f)",
        errno.EIO: "I/O error (EIO; on some file systems this is also how a full disk shows)",
    }.get(err.errno or 0, os.strerror(err.errno or errno.EIO))
    undone = "the partial line was removed" if written else "nothing was written"
    message = f"appending to {path} failed after {written} of {total} bytes: {cause}; {undone}, earlier lines are intact"
    if err.errno not in _FULL_CAUSES:
        return OSError(err.errno or errno.EIO, message)
    free = free_bytes(path)
    full = DiskFull(f"{message} ({human_bytes(free) if free is not None else 'unknown'} free there)")
    full.errno = err.errno
    return full


def append_line(path: str | os.PathLike[str], line: str, *, follow_symlinks: bool = True) -> None:
    """Append one line (a newline is added) with a single write, then fsync. With
    ``follow_symlinks=False`` a symbolic link at ``path`` is never written through (``OSError``
    ELOOP: the files of a run directory).

    All or nothing: when the file system takes only part of the line (a full disk, a quota or a
    file size limit) the rest is retried once to learn the cause, then the file is cut back to its
    old end and an ``OSError`` names the file and the cause (``no space left on device``, ...).
    Assumes one appender per file (the run's writers each own theirs)."""
    data = (line.rstrip("\n") + "\n").encode()
    flags = os.O_WRONLY | os.O_APPEND | os.O_CREAT | (0 if follow_symlinks else os.O_NOFOLLOW)
    fd = os.open(path, flags, 0o666)
    written = 0
    try:
        try:
            written = os.write(fd, data)
            if written != len(data):
                written += os.write(fd, data[written:])
                if written != len(data):
                    raise OSError(errno.EIO, "short write")
            os.fsync(fd)
        except OSError as err:
            if written:
                os.ftruncate(fd, os.lseek(fd, 0, os.SEEK_CUR) - written)
            raise _write_failure(path, err, written, len(data)) from None
    finally:
        os.close(fd)


def drop_torn_tail(path: str | os.PathLike[str]) -> int:
    """Cut an append-only file after its last newline (a line torn by a crash during
    :func:`append_line`), fsync it, and return the number of bytes removed (0 if none or no file)."""
    p = Path(path)
    if not p.exists():
        return 0
    size = p.stat().st_size
    with open(p, "rb+") as fh:
        keep, block = size, 1 << 16
        while keep > 0:
            start = max(0, keep - block)
            fh.seek(start)
            chunk = fh.read(keep - start)
            nl = chunk.rfind(b"\n")
            if nl >= 0:
                keep = start + nl + 1
                break
            keep = start
        if keep == size:
            return 0
        fh.truncate(keep)
        fh.flush()
        os.fsync(fh.fileno())
    return size - keep


class LockHeld(BlockingIOError):
    """A non-blocking ``file_lock`` found the lock taken; ``holder`` is what its holder wrote."""

    def __init__(self, path: Path, holder: str) -> None:
        super().__init__(f"{path} is locked by {holder}")
        self.path, self.holder = path, holder


@contextmanager
def file_lock(
    path: str | os.PathLike[str], *, blocking: bool = True, holder: str | None = None
) -> Iterator[None]:
    """Exclusive inter-process ``flock`` on ``path`` (created if missing, never through a symbolic
    link: ``O_NOFOLLOW``). Blocks until it is free, or with ``blocking=False`` raises ``LockHeld``
    (a ``BlockingIOError``) carrying the holder's note. ``holder``: a note (who holds it) written
    into the file while the lock is held. The kernel releases the lock when the process dies."""
    path = Path(path)
    with naming_full_disk(path):
        path.parent.mkdir(parents=True, exist_ok=True)
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o666)
    with os.fdopen(fd, "r+") as fh:
        try:
            fcntl.flock(fh, fcntl.LOCK_EX if blocking else fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            fh.seek(0)
            raise LockHeld(path, fh.read().strip() or "unknown") from None
        try:
            if holder is not None:
                fh.seek(0)
                fh.truncate()
                fh.write(holder)
                fh.flush()
            yield
        finally:
            fcntl.flock(fh, fcntl.LOCK_UN)


class NoFollowFileHandler(logging.FileHandler):
    """A log file handler that never opens its file through a symbolic link (``O_NOFOLLOW``).

    A link at the log's path is not opened: the handler writes nothing and ``refused`` is set, so
    the run's directory check (``dflash.train.run_dir.run_dir_problems``) stops the launch naming
    the link before anything else is written. Hydra's job logging uses it for the rank logs."""

    refused = False

    def _open(self):
        try:
            fd = os.open(self.baseFilename, os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_NOFOLLOW, 0o666)
        except OSError as e:
            if e.errno != errno.ELOOP:
                raise
            self.refused = True
            return open(os.devnull, "a", encoding=self.encoding)
        return os.fdopen(fd, "a", encoding=self.encoding, errors=self.errors)


def file_digest(
    path: str | os.PathLike[str],
    *,
    sample_above: int | None = None,
    blocks: int | None = None,
    block_bytes: int = _HASH_CHUNK,
) -> dict[str, int | str]:
    """``{"size", "sha256"}`` of a file: sha256 of every byte, or, for a file over ``sample_above``
    bytes (and over ``blocks x block_bytes``), of its size and ``blocks`` (default
    ``SAMPLE_BLOCKS``, what :func:`digest_problems` checks) blocks of ``block_bytes`` (the first, the last and evenly spaced ones between), marked ``"sampled": 1``. A sampled digest
    catches truncation, a replaced or re-saved file and damage to any sampled block, not a few bytes
    changed between blocks: for files whose full hash on every load would cost more than the load
    (tens of GB read by every rank)."""
    size = os.path.getsize(path)
    blocks = SAMPLE_BLOCKS if blocks is None else blocks
    sampled = sample_above is not None and size > max(sample_above, blocks * block_bytes)
    out: dict[str, int | str] = {
        "size": size,
        "sha256": _sha256(path, size, blocks if sampled else 0, block_bytes),
    }
    if sampled:
        out["sampled"] = 1
    return out


def _sha256(path: str | os.PathLike[str], size: int, blocks: int, block_bytes: int) -> str:
    """sha256 of the whole file (``blocks == 0``), or of its size and ``blocks`` sampled blocks."""
    h = hashlib.sha256()
    with open(path, "rb") as fh:
        if not blocks:
            while chunk := fh.read(_HASH_CHUNK):
                h.update(chunk)
            return h.hexdigest()
        h.update(f"{size}\0".encode())
        last = size - block_bytes
        for k in range(blocks):
            fh.seek(last * k // (blocks - 1))
            h.update(fh.read(block_bytes))
    return h.hexdigest()


def digest_files(
    directory: str | os.PathLike[str], names: list[str], *, sample_above: int | None = None
) -> dict[str, dict[str, int | str]]:
    """``name -> file_digest`` of each file ``names`` lists in ``directory`` (what a cache entry
    records when it is built, to check with :func:`digest_problems` when it is loaded)."""
    return {n: file_digest(Path(directory) / n, sample_above=sample_above) for n in names}


def digest_problems(directory: str | os.PathLike[str], recorded: object) -> list[str]:
    """What differs between the files of ``directory`` and the digests :func:`digest_files`
    recorded (missing, size, content), one line per file naming it; ``["... no content hashes"]``
    when ``recorded`` is not such a record. Empty when every file matches."""
    d = Path(directory)
    if not isinstance(recorded, dict) or not recorded:
        return [f"{d}: no content hashes recorded (damaged, or written by an older dflash)"]
    problems = []
    for name, want in recorded.items():
        p = d / str(name)
        if not isinstance(want, dict) or not isinstance(want.get("size"), int) or "/" in str(name):
            problems.append(f"{p}: bad hash record {want!r}")
        elif not p.is_file():
            problems.append(f"{p}: missing")
        elif (size := p.stat().st_size) != want["size"]:
            problems.append(f"{p}: {size} bytes, {want['size']} when it was written (truncated or replaced)")
        elif _sha256(p, size, SAMPLE_BLOCKS if want.get("sampled") else 0, _HASH_CHUNK) != want.get("sha256"):
            problems.append(f"{p}: content differs from when it was written (sha256 mismatch)")
    return problems
