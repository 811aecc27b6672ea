"""The embedded redis-server's password and the URLs that carry it.

One password per data directory (`run_password`), kept there in ``password`` with mode 0600 and
handed to redis-server in ``redis.conf`` (mode 0600, ``requirepass``; Redis docs, "AUTH" and
"ACL": it sets the ``default`` user's password), never on the command line, which every local
user can read in ``/proc/PID/cmdline``. Clients get it inside the URL
(``redis://:PASSWORD@127.0.0.1:PORT/0``, as redis-py's ``from_url`` reads it); anything printed or
logged shows `redacted` URLs.
"""

from __future__ import annotations

import os
import secrets
from pathlib import Path
from urllib.parse import parse_qsl, quote, urlencode, urlsplit, urlunsplit


PASSWORD_FILE = "password"
"""The data directory's password file (`run_password`)."""

CONFIG_FILE = "redis.conf"
"""The config file each start writes in the data directory (``port``, ``requirepass``)."""


def read_private(path: Path) -> str:
    """The stripped text of ``path``, which must be this user's and closed to others.

    Raises:
        PermissionError: another user owns it, or group/others may read or write it.
        ValueError: it is empty (a start that died while writing it: remove it).
    """
    st = os.stat(path)
    if st.st_uid != os.getuid() or st.st_mode & 0o077:
        raise PermissionError(f"{path} must be owned by this user with mode 0600 "
                              f"(it is {oct(st.st_mode & 0o777)}, uid {st.st_uid})")
    text = path.read_text().strip()
    if not text:
        raise ValueError(f"{path} is empty; remove it and start again")
    return text


def write_private(path: Path, text: str, replace: bool = False) -> None:
    """Write ``text`` to a new file created with mode 0600 (``O_EXCL``: never an existing file, and
    no chmod after the write). ``replace``: remove an existing ``path`` first.

    Raises:
        FileExistsError: ``path`` exists (and not ``replace``).
    """
    if replace:
        path.unlink(missing_ok=True)
    fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o600)
    try:
        os.write(fd, text.encode())
        os.fsync(fd)
    finally:
        os.close(fd)


def private_dir(path: str | Path) -> Path:
    """Create ``path`` (and missing parents) if absent and make it mode 0700, created or existing:
    the redis data directory holds the AOF (every tenant's prompts, completions and rewards).

    Raises:
        PermissionError: ``path`` is another user's (it cannot be chmodded).
    """
    path = Path(path)
    path.mkdir(mode=0o700, parents=True, exist_ok=True)
    os.chmod(path, 0o700)
    return path


def run_password(data_dir: str | Path) -> str:
    """The data directory's Redis password: read from ``data_dir/password``, or created there once
    (``secrets.token_urlsafe(32)``: 256 random bits, URL-safe characters) and kept for every later
    start on the same directory (its AOF belongs to the same store).

    Raises:
        PermissionError / ValueError: the file exists but is open to others or empty (`read_private`).
    """
    data = private_dir(data_dir)
    path = data / PASSWORD_FILE
    try:
        write_private(path, secrets.token_urlsafe(32) + "\n")
    except FileExistsError:
        pass
    return read_private(path)


def redacted(url: str | None) -> str | None:
    """``url`` without its password (userinfo ``:PASSWORD@`` or a ``password=`` query field), for
    anything printed or logged: ``redis://:pw@127.0.0.1:6379/0`` -> ``redis://127.0.0.1:6379/0``;
    a user name stays. None and "" pass through."""
    if not url:
        return url
    parts = urlsplit(url)
    user, at, host = parts.netloc.rpartition("@")
    name = user.partition(":")[0]
    netloc = f"{name}@{host}" if at and name else host
    query = urlencode([(k, v) for k, v in parse_qsl(parts.query, keep_blank_values=True)
                       if k.lower() != "password"])
    return urlunsplit((parts.scheme, netloc, parts.path, query, parts.fragment))


def with_password(url: str, password: str) -> str:
    """``url`` with ``password`` as its userinfo password (``redis://:PASSWORD@host:port/db``),
    the form redis-py's ``from_url`` reads; a user name in ``url`` stays as it is written."""
    parts = urlsplit(url)
    user, at, host = parts.netloc.rpartition("@")
    name = user.partition(":")[0] if at else ""
    netloc = f"{name}:{quote(password, safe='')}@{host}"
    return urlunsplit((parts.scheme, netloc, parts.path, parts.query, parts.fragment))


def embedded_url(url: str, data_dir: str | Path) -> str:
    """``url`` with the password of the embedded redis-server on ``data_dir`` when ``url`` names
    that server and carries no password (the redacted URL a ``serve-rft up`` printed): a
    loopback host and the port the last start on ``data_dir`` wrote in its ``redis.conf``.
    Any other URL (an operator's Redis, with or without a password) is returned as it is.

    Raises:
        PermissionError / ValueError: the password file is open to others or empty.
    """
    parts = urlsplit(url)
    conf = Path(data_dir) / CONFIG_FILE
    try:
        port = parts.port
    except ValueError:
        return url
    if parts.password or "password=" in parts.query or parts.hostname not in ("127.0.0.1", "localhost") \
            or not conf.is_file() or not (Path(data_dir) / PASSWORD_FILE).is_file():
        return url
    if f"port {port}" not in read_private(conf).splitlines():
        return url
    return with_password(url, read_private(Path(data_dir) / PASSWORD_FILE))
