"""The server's list of accepted tokens: hashes only, each with a name, a role and a job scope.

The file (``security.auth.tokens-file``) is YAML::

    tokens:
      - name: ops                 # shows in logs and refusal messages, never the token
        sha256: 5e884898da28...   # hex SHA-256 of the token (statectl auth token prints it)
        role: admin               # admin | writer | reader | taskmanager | jobmanager
        jobs: ["*"]               # the jobs it may touch; "*" for all

Only hashes are stored, so the file reveals no token. It is re-read when it changes (checked on
each call: one ``stat``), so tokens are added and revoked without a restart; a file that no
longer parses keeps the previous tokens in force and logs an error naming the problem.
"""

from __future__ import annotations

import hashlib
import logging
import re
import secrets
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from keyedstate.common.auth._roles import ALL_JOBS, Principal, Role
from keyedstate.common.errors import ConfigError, InvalidArgumentError
from keyedstate.common.filestamp import FileStamp, file_stamp
from keyedstate.common.ids import validate_name

logger = logging.getLogger(__name__)

_SHA256 = re.compile(r"^[0-9a-f]{64}$")
TOKEN_BYTES = 32


def hash_token(token: str) -> str:
    """The hex SHA-256 of a token, as the tokens file stores it."""
    return hashlib.sha256(token.encode("utf-8")).hexdigest()


def fingerprint(token: str) -> str:
    """A short, non-reversible tag of a token for logs (``sha256:1a2b3c4d``)."""
    return "sha256:" + hash_token(token)[:8]


def new_token() -> str:
    """A fresh random token (256 bits, URL-safe)."""
    return secrets.token_urlsafe(TOKEN_BYTES)


@dataclass(frozen=True)
class TokenEntry:
    name: str
    sha256: str
    role: Role
    jobs: frozenset[str] | None

    def principal(self) -> Principal:
        """The Principal that a call carrying this token acts as."""
        return Principal(self.name, self.role, self.jobs, "token")

    def to_dict(self) -> dict[str, Any]:
        """The entry as the token file stores it: the token's sha256, never the token itself."""
        return {
            "name": self.name,
            "sha256": self.sha256,
            "role": self.role.value,
            "jobs": [ALL_JOBS] if self.jobs is None else sorted(self.jobs),
        }


def parse_entry(raw: Any, where: str) -> TokenEntry:
    if not isinstance(raw, dict):
        raise ConfigError(f"{where}: each token is a mapping with name, sha256, role and jobs")
    if "token" in raw:
        raise ConfigError(f"{where}: store the token's sha256 (statectl auth token prints it), never the token")
    unknown = set(raw) - {"name", "sha256", "role", "jobs"}
    if unknown:
        raise ConfigError(
            f"{where}: unknown field(s) {', '.join(sorted(map(str, unknown)))}; use name, sha256, role, jobs"
        )
    try:
        name = validate_name("token name", raw.get("name"))
    except InvalidArgumentError as exc:
        raise ConfigError(f"{where}: {exc.message}") from None
    digest = str(raw.get("sha256", "")).strip().lower()
    if not _SHA256.match(digest):
        raise ConfigError(f"{where} ({name}): sha256 must be 64 hex digits (statectl auth token prints it)")
    role_text = str(raw.get("role", "")).strip().lower()
    try:
        role = Role(role_text)
    except ValueError:
        raise ConfigError(
            f"{where} ({name}): role {raw.get('role')!r} is not one of {', '.join(r.value for r in Role)}"
        ) from None
    jobs_raw = raw.get("jobs")
    if jobs_raw is None or jobs_raw == [] or not isinstance(jobs_raw, (list, str)):
        raise ConfigError(f'{where} ({name}): jobs must list the job ids it may touch, or ["*"] for all')
    jobs_list = [jobs_raw] if isinstance(jobs_raw, str) else list(jobs_raw)
    if ALL_JOBS in jobs_list:
        jobs = None
    else:
        try:
            jobs = frozenset(validate_name("job id", str(j)) for j in jobs_list)
        except InvalidArgumentError as exc:
            raise ConfigError(f"{where} ({name}): {exc.message}") from None
    return TokenEntry(name, digest, role, jobs)


def parse_tokens(text: str, source: str) -> dict[str, TokenEntry]:
    """Entries by hash; raises ConfigError naming the file and the entry."""
    try:
        data = yaml.safe_load(text) or {}
    except yaml.YAMLError as exc:
        raise ConfigError(f"tokens file {source} is not valid YAML: {str(exc).splitlines()[0]}") from None
    if not isinstance(data, dict) or not isinstance(data.get("tokens", []), list):
        raise ConfigError(f"tokens file {source} must be a mapping with a list under 'tokens'")
    by_hash: dict[str, TokenEntry] = {}
    names: set[str] = set()
    for i, raw in enumerate(data.get("tokens") or []):
        entry = parse_entry(raw, f"tokens file {source}, entry {i + 1}")
        if entry.sha256 in by_hash:
            raise ConfigError(
                f"tokens file {source}: {entry.name!r} and {by_hash[entry.sha256].name!r} have the same hash"
            )
        if entry.name in names:
            raise ConfigError(f"tokens file {source}: the name {entry.name!r} is used twice; names must be unique")
        names.add(entry.name)
        by_hash[entry.sha256] = entry
    return by_hash


class TokenStore:
    """The accepted tokens, re-read from ``path`` whenever the file changes."""

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        self._lock = threading.Lock()
        self._stamp: FileStamp | None = None
        self._entries: dict[str, TokenEntry] = {}
        self.reloads = 0
        stamp = self._stat()
        if stamp is None:
            raise ConfigError(f"security.auth.tokens-file {self.path} does not exist; create it (statectl auth token)")
        self._entries = self._read()
        self._stamp = stamp
        logger.info("auth: %d token(s) loaded from %s", len(self._entries), self.path)

    def _stat(self) -> FileStamp | None:
        return file_stamp(self.path)

    def _read(self) -> dict[str, TokenEntry]:
        try:
            text = self.path.read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError) as exc:
            raise ConfigError(f"cannot read security.auth.tokens-file {self.path}: {exc}") from exc
        return parse_tokens(text, str(self.path))

    def _refresh(self) -> None:
        stamp = self._stat()
        if stamp == self._stamp:
            return
        with self._lock:
            if stamp == self._stamp:
                return
            self._stamp = stamp
            if stamp is None:
                logger.error(
                    "auth: tokens file %s disappeared; keeping the %d token(s) loaded before",
                    self.path,
                    len(self._entries),
                )
                return
            try:
                entries = self._read()
            except ConfigError as exc:
                logger.error("auth: %s; keeping the %d token(s) loaded before", exc.message, len(self._entries))
                return
            self._entries = entries
            self.reloads += 1
            logger.info("auth: tokens file %s changed; %d token(s) now accepted", self.path, len(entries))

    def lookup(self, token: str) -> Principal | None:
        """The identity of ``token``, or None if it is not accepted."""
        self._refresh()
        entry = self._entries.get(hash_token(token))
        return entry.principal() if entry is not None else None

    def __len__(self) -> int:
        self._refresh()
        return len(self._entries)
