"""Whether directories on a shared host are this user's to trust: nobody else can replace what
is in them, nor swap them for another (the file store's directory, the calibration cache)."""

from __future__ import annotations

import os
import stat


def user_name(uid: int) -> str:
    try:
        import pwd

        return f"{pwd.getpwuid(uid).pw_name} (uid {uid})"
    except (ImportError, KeyError):
        return f"uid {uid}"


def kind(mode: int) -> str:
    for test, name in ((stat.S_ISLNK, "a symbolic link"), (stat.S_ISFIFO, "a FIFO"),
                       (stat.S_ISSOCK, "a socket"), (stat.S_ISDIR, "a directory"),
                       (stat.S_ISCHR, "a device"), (stat.S_ISBLK, "a device")):
        if test(mode):
            return name
    return "a regular file"


def untrusted(directory: str) -> tuple[str, str] | None:
    """(path, what is wrong) for the first directory from / down to `directory` (which must
    exist) that others could use to replace what lies below it: not this user's or root's, or
    writable by its group or others without the sticky bit (as /tmp has); a symbolic link on the
    way is followed only if this user or root made it. None where all are trusted. OSError where
    one cannot be looked at."""
    me = os.geteuid()
    path = os.sep
    for part in directory.split(os.sep)[1:]:
        path = os.path.join(path, part)
        st = os.lstat(path)
        if stat.S_ISLNK(st.st_mode) and st.st_uid not in (me, 0):
            return path, f"is a symbolic link of {user_name(st.st_uid)}"
    path = os.sep
    for part in os.path.realpath(directory).split(os.sep)[1:]:
        path = os.path.join(path, part)
        st = os.stat(path)
        if not stat.S_ISDIR(st.st_mode):
            return path, f"is {kind(st.st_mode)} of {user_name(st.st_uid)}, not a directory"
        if st.st_uid not in (me, 0):
            return path, f"belongs to {user_name(st.st_uid)}, not to this user ({user_name(me)}) or root"
        if st.st_mode & 0o022 and not st.st_mode & stat.S_ISVTX:
            return path, (f"is writable by its group or others (mode {st.st_mode & 0o7777:o}) without the "
                          f"sticky bit, so they could replace what is in it")
    return None
