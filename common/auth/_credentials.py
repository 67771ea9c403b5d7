"""The client's side: where a process finds its token (``rpc.bearer`` sends it).

A token is read from a file (``security.auth.token-file``, or the file named by
``KEYEDSTATE_TOKEN_FILE``) or from ``KEYEDSTATE_TOKEN``; never from the command line, where
every user of the host can read it (``ps``). It travels as gRPC metadata
``authorization: Bearer <token>``.
"""

from __future__ import annotations

import logging
import os
import stat
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

from keyedstate.common.errors import ConfigError
from keyedstate.common.rpc.bearer import check_token

logger = logging.getLogger(__name__)

TOKEN_ENV = "KEYEDSTATE_TOKEN"
TOKEN_FILE_ENV = "KEYEDSTATE_TOKEN_FILE"


def read_token_file(path: str | Path, what: str = "security.auth.token-file") -> str:
    """The token in ``path`` (surrounding whitespace ignored); a ConfigError naming the fix otherwise."""
    p = Path(path)
    try:
        text = p.read_text(encoding="utf-8")
        mode = p.stat().st_mode
    except FileNotFoundError:
        raise ConfigError(f"{what} {p} does not exist; write the token into that file (chmod 600)") from None
    except (OSError, UnicodeDecodeError) as exc:
        raise ConfigError(f"cannot read {what} {p}: {exc}") from None
    if mode & (stat.S_IRWXG | stat.S_IRWXO):
        logger.warning(
            "token file %s can be read by other users (mode %o); restrict it with chmod 600", p, mode & 0o777
        )
    return check_token(text.strip(), f"{what} {p}")


def resolve_token(
    token_file: str | None = None,
    environ: Mapping[str, str] | None = None,
    resolve_path: Callable[[str], str] | None = None,
) -> str | None:
    """This process's token: ``token_file``, else ``$KEYEDSTATE_TOKEN_FILE``, else ``$KEYEDSTATE_TOKEN``; None without one.

    ``resolve_path`` maps a relative file name to a path (on a Spark executor: ``SparkFiles.get``).
    """
    env = os.environ if environ is None else environ
    path = token_file or env.get(TOKEN_FILE_ENV)
    if path:
        if resolve_path is not None and not os.path.isabs(path) and not os.path.exists(path):
            path = resolve_path(path)
        what = "security.auth.token-file" if token_file else TOKEN_FILE_ENV
        return read_token_file(path, what)
    token = env.get(TOKEN_ENV)
    if token is not None:
        return check_token(token.strip(), TOKEN_ENV)
    return None


def token_from_config(conf: Any, environ: Mapping[str, str] | None = None) -> str | None:
    """The token a Configuration points to (``security.auth.token-file``), else one from the environment."""
    from keyedstate.common.config import options as o

    return resolve_token(conf.get(o.AUTH_TOKEN_FILE) if conf is not None else None, environ)
