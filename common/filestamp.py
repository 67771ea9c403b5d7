"""Whether a file changed since it was read: the stamp that reloading configuration files compare."""

from __future__ import annotations

import os
from pathlib import Path

FileStamp = tuple[int, int, int]


def file_stamp(path: str | Path) -> FileStamp | None:
    """(mtime ns, size, inode) of ``path``, or None when it cannot be stat'ed.

    Size and inode as well as the mtime: an editor's atomic replace (or a Kubernetes Secret's
    symlink swap) within one mtime tick still shows.
    """
    try:
        st = os.stat(path)
    except OSError:
        return None
    return (st.st_mtime_ns, st.st_size, st.st_ino)
