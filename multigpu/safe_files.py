"""Every file the project creates or appends to, written without following a planted symbolic link.

On a shared file system another user may create, in a folder a run writes to
(a save-dir, a sweep dir, a log dir), a symbolic link named like a file the run
is about to write: `.run.lock`, `torchrun.log`, `results.jsonl`,
`launch_command.sh`, ... Writing through it would change (or make executable)
the file the link points to, one of the victim's choosing. So every write goes
through here:

- `open_no_follow` / `open_fd`: appends, locks, logs, streams, opened with
  O_NOFOLLOW, so the kernel itself refuses a link as the file's last component;
- `replacing`: whole files, written under a temporary name in the same folder
  and renamed over the name (a rename replaces a link, never its target);
- `make_folder`: the folders the project names itself inside a user's folder
  (`<save-dir>/tb`, a sweep's run folders), where a planted link is refused too;
- `replace_folder` / `linked_copy`: a sharded checkpoint folder, written whole under a temporary
  name and renamed into place (a rename replaces a link, never its target).

A planted link is refused with one line (`UsageError`, exit 2) naming it and
what it points to; the link and its target are left untouched. Links the user
names (`--save-dir`, `--log-dir`, the folders above a file) are followed.

    python -m multigpu.safe_files write FILE [--executable] < TEXT

writes FILE for the launcher (launch_command.sh, its SLURM script) the same way.
"""

from __future__ import annotations

import contextlib
import errno
import os
import shutil
import stat
import sys
import tempfile
from collections.abc import Iterator, Sequence
from typing import IO, Any, Callable

from multigpu.errors import UsageError

TMP_SUFFIX = ".tmp"  # a whole file's unfinished content: `<name>.<random>.tmp` in the file's folder
OLD_SUFFIX = ".old" + TMP_SUFFIX  # a folder being replaced, between replace_folder's two renames
# open()'s modes as flags; every one of them creates the file, and none follows a final link.
_FLAGS = {
    "w": os.O_WRONLY | os.O_CREAT | os.O_TRUNC,
    "a": os.O_WRONLY | os.O_CREAT | os.O_APPEND,
    "x": os.O_WRONLY | os.O_CREAT | os.O_EXCL,
}


def link_refusal(path: str) -> UsageError:
    """The one line that refuses to write through the symbolic link `path`."""
    try:
        target = os.readlink(path)
    except OSError:
        target = "?"
    return UsageError(
        f"refusing to write {path}: it is a symbolic link (to {target}); remove it or choose another path"
    )


def refuse_link(path: str) -> None:
    """UsageError (one line) when `path` is a symbolic link, dangling or not."""
    if os.path.islink(path):
        raise link_refusal(path)


def open_fd(path: str, flags: int, perms: int = 0o666) -> int:
    """`os.open(path, flags | O_NOFOLLOW, perms)`; a symbolic link at `path` is refused in one line."""
    try:
        return os.open(path, flags | os.O_NOFOLLOW, perms)
    except OSError as error:
        # ELOOP on Linux and macOS, EMLINK on FreeBSD (also ELOOP for a loop above the last component);
        # EEXIST with O_EXCL, which never follows a link either.
        if error.errno in (errno.ELOOP, errno.EMLINK, errno.EEXIST) and os.path.islink(path):
            raise link_refusal(path) from None
        raise


def open_no_follow(path: str, mode: str = "w", perms: int = 0o666, **open_args: Any) -> IO:
    """`open(path, mode, **open_args)` for writing ('w', 'a' or 'x', with 'b' for bytes) that refuses a
    symbolic link at `path` instead of writing to its target."""
    fd = open_fd(path, _FLAGS[mode.replace("b", "")], perms)
    try:
        return os.fdopen(fd, mode, **open_args)
    except BaseException:
        os.close(fd)
        raise


@contextlib.contextmanager
def replacing(
    path: str,
    mode: str = "wb",
    perms: int | None = None,
    sync_folder: bool = False,
    before_rename: Callable[[], None] | None = None,
    **open_args: Any,
) -> Iterator[IO]:
    """A file for the whole new content of `path`: written under a temporary name in the same folder,
    fsynced and renamed over `path` when the block ends without an error, so readers and a crash see
    the old file or the new one, never part of it. A failed block leaves no temporary file.

    `perms`: the file's mode (default: an ordinary file's, 0o666 less the umask). `sync_folder`: fsync
    the folder too, so the rename survives a power cut. `before_rename` runs between the fsync and the
    rename (the test-only fault injector kills the process there). A symbolic link at `path` is refused.
    """
    refuse_link(path)
    directory = os.path.dirname(os.path.abspath(path))
    handle, tmp_path = _temporary(path)
    try:
        with os.fdopen(handle, mode, **open_args) as file:
            yield file
            file.flush()
            os.fsync(file.fileno())
            os.fchmod(file.fileno(), ordinary_mode() if perms is None else perms)  # mkstemp makes 0600
        if before_rename is not None:
            before_rename()
        os.replace(tmp_path, path)
    except BaseException:
        if os.path.lexists(tmp_path):
            os.unlink(tmp_path)
        raise
    if sync_folder:
        _sync_folder(directory)


def create_once(path: str, data: bytes | str, perms: int | None = None) -> bool:
    """Create `path` holding `data`, whole from the instant it appears, unless something (a link too) is
    there already: False then, and nothing is changed. Of several processes creating it at once, exactly
    one gets True (a temporary file hard-linked to the name: link() fails on any existing name)."""
    refuse_link(path)
    handle, tmp_path = _temporary(path)
    try:
        with os.fdopen(handle, "wb") as file:
            file.write(data.encode() if isinstance(data, str) else data)
            os.fchmod(file.fileno(), ordinary_mode() if perms is None else perms)
        os.link(tmp_path, path)
        return True
    except FileExistsError:
        return False
    finally:
        os.unlink(tmp_path)


def _temporary(path: str) -> tuple[int, str]:
    """A new file (descriptor, name) beside `path`: `<name>.<random>.tmp`, created exclusively, mode 0600."""
    directory = os.path.dirname(os.path.abspath(path))
    return tempfile.mkstemp(prefix=os.path.basename(path) + ".", suffix=TMP_SUFFIX, dir=directory)


def write_atomically(path: str, data: bytes | str, perms: int | None = None) -> None:
    """Replace `path` with `data` (text is UTF-8) through `replacing`: whole, never through a link."""
    open_args: dict[str, Any] = {"encoding": "utf-8"} if isinstance(data, str) else {}
    with replacing(path, "w" if isinstance(data, str) else "wb", perms, **open_args) as file:
        file.write(data)


def ordinary_mode(executable: bool = False) -> int:
    """The mode `open()` (or `chmod +x` after it) gives a new file: 0o666 (0o777) less the umask."""
    mask = os.umask(0)
    os.umask(mask)
    return (0o777 if executable else 0o666) & ~mask


def make_folder(path: str, inside: str | None = None) -> None:
    """Create the folder `path` and its parents where they are missing.

    `inside`: a folder the user named that holds `path` (the save-dir of `<save-dir>/tb`, the sweep
    dir of its run folders). The folders below it are the project's own names, so a symbolic link
    there was planted: refused in one line, before anything is created through it. None: every part
    of `path` is the user's, and links in it are followed.
    """
    below = os.path.relpath(path, inside) if inside is not None else os.pardir
    if inside is None or below == os.pardir or below.startswith(os.pardir + os.sep):  # all the user's
        os.makedirs(path, exist_ok=True)
        return
    os.makedirs(inside, exist_ok=True)
    current = inside
    for part in below.split(os.sep):
        if part == os.curdir:
            continue
        current = os.path.join(current, part)
        try:
            os.mkdir(current)  # never follows a link: one there makes it fail, and is then refused
        except FileExistsError:
            refuse_link(current)
            if not stat.S_ISDIR(os.stat(current).st_mode):
                raise NotADirectoryError(errno.ENOTDIR, os.strerror(errno.ENOTDIR), current) from None


def replace_folder(new: str, path: str) -> None:
    """Put the complete folder `new` at its sibling `path`, replacing the folder there: that one is renamed
    to `<path>.old.tmp`, `new` to `path`, and only then the old one deleted. A kill between the two renames
    leaves the old one under that name (checkpoint.remove_unfinished puts it back); a link at `path` is
    renamed away, its target untouched."""
    old = path + OLD_SUFFIX
    if os.path.lexists(old):
        remove(old)
    if os.path.lexists(path):
        os.rename(path, old)
    os.rename(new, path)
    _sync_folder(os.path.dirname(os.path.abspath(path)))
    if os.path.lexists(old):
        remove(old)


def linked_copy(folder: str, copy: str) -> None:
    """A copy of `folder`'s files at `copy` (a new folder) as hard links: no bytes copied; a file is never
    changed once written, so the two cannot drift. Copied where the file system has no hard links."""
    os.mkdir(copy)
    for entry in os.scandir(folder):
        try:
            os.link(entry.path, os.path.join(copy, entry.name), follow_symlinks=False)
        except OSError:
            shutil.copy2(entry.path, os.path.join(copy, entry.name), follow_symlinks=False)


def remove(path: str) -> None:
    """Delete `path`: a folder with what it holds, or a file or link (never what a link points to)."""
    if os.path.isdir(path) and not os.path.islink(path):
        shutil.rmtree(path)
    else:
        os.unlink(path)


def _sync_folder(directory: str) -> None:
    """fsync a folder, so the renames in it survive a power cut."""
    folder = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(folder)
    finally:
        os.close(folder)


def main(argv: Sequence[str] | None = None) -> int:
    """`write FILE [--executable]`: standard input becomes FILE (its folders created), as `replacing` writes
    it; bad input is one line on stderr and exit 2, a failed write one line and exit 1."""
    args = list(sys.argv[1:] if argv is None else argv)
    executable = "--executable" in args
    args = [arg for arg in args if arg != "--executable"]
    if len(args) != 2 or args[0] != "write":
        print("usage: python -m multigpu.safe_files write FILE [--executable] < TEXT", file=sys.stderr)
        return 2
    path = args[1]
    try:
        make_folder(os.path.dirname(os.path.abspath(path)))
        write_atomically(path, sys.stdin.buffer.read(), ordinary_mode(executable))
    except UsageError as error:
        print(error, file=sys.stderr)
        return error.exit_code
    except OSError as error:
        print(f"cannot write {path}: {error.strerror or error}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
