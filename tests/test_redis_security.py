"""Redis with an ACL user and password, and Redis over TLS, against a real redis-server
(issue 11 item 9: "support Redis AUTH/ACL users and TLS in the URL").

The ACL server has its `default` user switched off and one user, `kvtier`, limited to the keys
kvtier writes (`kvtier:*`): pages go through it with the password in the URL, and a wrong or
missing password is one start-up line that names storage.url and hides the password. The TLS
server listens with TLS only, with a certificate signed by a private CA made here with the
openssl CLI (the local redis-server 7.0 is built with TLS): a `rediss://` URL naming that CA
round-trips pages, the same URL without the CA is refused at start (the certificate cannot be
verified), and bad TLS options in the URL are one clear line naming the option.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterator

import numpy as np
import pytest
from kvtier.manager.config import ConfigError, check_storage_reachable, load_config
from kvtier.worker.storage.redis_backend import RedisBackend
from redis_server import RedisServer, TlsFiles, make_tls_files

pytestmark = pytest.mark.fast

PAGE = 4096
NS = "sec-model/r0"
SECRET = b"kvtier-test-redis-security-0001"
PASSWORD = "acl-pass-7f3e9c"


def _cfg(url: str):
    return load_config(None, {"KVTIER_STORAGE__BACKEND": "redis", "KVTIER_STORAGE__URL": url},
                       check_resources=False)


def _round_trip(url: str) -> None:
    """Pages written through `url` come back byte for byte through a second backend."""
    keys = [hashlib.sha256(f"sec/{i}".encode()).digest() for i in range(4)]
    pages = np.random.default_rng(3).integers(0, 256, size=(4, PAGE), dtype=np.uint8)
    writer = RedisBackend(url, NS, secret=SECRET, page_bytes=PAGE, timeout_s=2.0)
    reader = RedisBackend(url, NS, secret=SECRET, page_bytes=PAGE, timeout_s=2.0)
    try:
        assert writer.set(keys, list(pages)) == 4, writer.stats()
        dest = np.zeros_like(pages)
        assert reader.get_into(keys, list(dest)) == [True] * 4, reader.stats()
        assert np.array_equal(dest, pages)
        assert reader.stats()["errors_get"] == 0
    finally:
        writer.close()
        reader.close()


@pytest.fixture(scope="module")
def acl_server() -> Iterator[RedisServer]:
    args = ["--user", "default", "off",
            "--user", "kvtier", "on", f">{PASSWORD}", "~kvtier:*", "+@all"]
    with RedisServer(extra_args=args) as server:
        yield server


def _acl_url(server: RedisServer, user: str = "kvtier", password: str = PASSWORD) -> str:
    return f"redis://{user}:{password}@127.0.0.1:{server.port}/0"


def test_acl_user_and_password_in_the_url(acl_server: RedisServer) -> None:
    url = _acl_url(acl_server)
    check_storage_reachable(_cfg(url), timeout=2.0)
    _round_trip(url)


@pytest.mark.parametrize("url_of", [
    lambda s: _acl_url(s, password="wrong-password-1"),
    lambda s: f"redis://127.0.0.1:{s.port}/0",  # no user: the default user is off
])
def test_a_refused_login_is_one_line_at_start(acl_server: RedisServer, url_of) -> None:
    url = url_of(acl_server)
    with pytest.raises(ConfigError) as caught:
        check_storage_reachable(_cfg(url), timeout=2.0)
    message = str(caught.value)
    assert "\n" not in message and message.startswith("storage.url = ")
    assert "cannot reach Redis" in message
    assert "wrong-password-1" not in message and PASSWORD not in message


def test_the_acl_really_restricts_the_user(acl_server: RedisServer) -> None:
    """The server enforces the key pattern (the test is not passing because ACLs are off):
    the user may not touch a key outside kvtier:*."""
    import redis

    client = redis.Redis.from_url(_acl_url(acl_server), socket_timeout=2.0)
    try:
        with pytest.raises(redis.exceptions.NoPermissionError):
            client.set("not-kvtier", b"x")
    finally:
        client.close()


@pytest.fixture(scope="module")
def tls_files(tmp_path_factory: pytest.TempPathFactory) -> TlsFiles:
    return make_tls_files(tmp_path_factory.mktemp("tls"))


@pytest.fixture(scope="module")
def tls_server(tls_files: TlsFiles) -> Iterator[RedisServer]:
    with RedisServer(tls=tls_files, extra_args=["--requirepass", PASSWORD]) as server:
        yield server


def test_tls_with_a_private_ca_in_the_url(tls_server: RedisServer, tls_files: TlsFiles) -> None:
    url = (f"rediss://:{PASSWORD}@127.0.0.1:{tls_server.port}/0?ssl_ca_certs={tls_files.ca}"
           "&ssl_cert_reqs=required&ssl_check_hostname=true")
    check_storage_reachable(_cfg(url), timeout=3.0)
    _round_trip(url)


def test_tls_server_refuses_an_unverified_or_plain_connection(
        tls_server: RedisServer, tls_files: TlsFiles) -> None:
    """Without the CA the server's certificate cannot be verified; a plain redis:// URL on the
    TLS port gets no Redis answer. Both are one line at start."""
    for url in (f"rediss://:{PASSWORD}@127.0.0.1:{tls_server.port}/0",
                f"redis://:{PASSWORD}@127.0.0.1:{tls_server.port}/0"):
        with pytest.raises(ConfigError) as caught:
            check_storage_reachable(_cfg(url), timeout=2.0)
        message = str(caught.value)
        assert "\n" not in message and message.startswith("storage.url = ")
        assert PASSWORD not in message


@pytest.mark.parametrize(("query", "expected"), [
    ("ssl_cert_reqs=maybe", "ssl_cert_reqs = 'maybe': expected one of none, optional, "
                            "required"),
    ("ssl_check_hostname=yes", "ssl_check_hostname = 'yes': expected one of true, false"),
    ("ssl_ca_certs=/nonexistent/ca.pem", "ssl_ca_certs = '/nonexistent/ca.pem': not a readable "
                                         "file"),
    ("ssl_ca_certs=ca.pem", "ssl_ca_certs = 'ca.pem': expected an absolute path"),
    ("ssl_ca_path=/nonexistent", "ssl_ca_path = '/nonexistent': not a readable directory"),
    ("ssl_ca_certs=", "ssl_ca_certs is empty: expected the path of a file"),
    ("socket_timeout=60", "unknown URL option 'socket_timeout'; a Redis URL takes only the TLS "
                          "options ssl_ca_certs, ssl_ca_path, ssl_cert_reqs, ssl_certfile, "
                          "ssl_check_hostname, ssl_keyfile"),
    ("ssl_cert_reqs=none&ssl_cert_reqs=required", "the URL option 'ssl_cert_reqs' is given twice"),
])
def test_bad_tls_options_are_one_clear_line(query: str, expected: str) -> None:
    url = f"rediss://kvtier:{PASSWORD}@127.0.0.1:6380/0?{query}"
    with pytest.raises(ConfigError) as caught:
        _cfg(url)
    message = str(caught.value)
    assert "\n" not in message and expected in message, message
    assert "storage.url" in message and PASSWORD not in message


def test_tls_options_need_a_tls_url(tls_files: TlsFiles) -> None:
    with pytest.raises(ConfigError) as caught:
        _cfg(f"redis://127.0.0.1:6379/0?ssl_ca_certs={tls_files.ca}")
    assert "the TLS option 'ssl_ca_certs' needs a rediss:// URL" in str(caught.value)
    # and the same options on a rediss:// URL (a cluster too) are accepted
    for scheme in ("rediss", "rediss+cluster"):
        cfg = _cfg(f"{scheme}://127.0.0.1:6379/0?ssl_ca_certs={tls_files.ca}&ssl_cert_reqs=none")
        assert cfg.storage.url.startswith(scheme)


def test_a_tls_url_without_options_loads() -> None:
    """The checks are on the URL's options only: a rediss:// URL without options loads."""
    assert _cfg("rediss://127.0.0.1:6380/0").storage.url == "rediss://127.0.0.1:6380/0"
