"""Tokens files and token files for the security tests."""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

from keyedstate.common.auth import hash_token, new_token


@dataclass
class Tokens:
    """Named tokens (role and jobs each), their files (mode 600) and the server's tokens file."""

    dir: Path
    tokens_file: Path
    tokens: dict[str, str]
    grants: dict[str, tuple[str, list[str]]]

    def file(self, name: str) -> str:
        return str(self.dir / f"{name}.token")

    def grant(self, name: str, role: str, jobs: list[str]) -> str:
        """Add (or replace) a token and rewrite the tokens file; returns the new token."""
        token = new_token()
        self.tokens[name] = token
        self.grants[name] = (role, jobs)
        path = Path(self.file(name))
        path.write_text(token + "\n")
        os.chmod(path, 0o600)
        self.write()
        return token

    def revoke(self, name: str) -> None:
        self.grants.pop(name)
        self.write()

    def write(self) -> None:
        lines = ["tokens:"]
        for name, (role, jobs) in self.grants.items():
            lines += [
                f"  - name: {name}",
                f"    sha256: {hash_token(self.tokens[name])}",
                f"    role: {role}",
                f"    jobs: [{', '.join(repr(j) for j in jobs)}]",
            ]
        tmp = self.tokens_file.with_suffix(".tmp")
        tmp.write_text("\n".join(lines) + "\n")
        os.replace(tmp, self.tokens_file)  # atomic, as an operator's tooling would


def make_tokens(directory: Path, grants: dict[str, tuple[str, list[str]]]) -> Tokens:
    directory.mkdir(parents=True, exist_ok=True)
    tokens = Tokens(directory, directory / "tokens.yaml", {}, {})
    for name, (role, jobs) in grants.items():
        tokens.grant(name, role, jobs)
    return tokens
