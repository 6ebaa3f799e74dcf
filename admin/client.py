"""The admin's client side: one HTTP call to a running kvtier admin, its JSON answer, or one
readable line. Every command that talks to the admin goes through here (`kvtier status` in
`cli.py`, `kvtier lookup | warm | pin | clear | tenants` in `steering_cli.py`).

Standard library only: `kvtier --help` and `kvtier status` load this module, and their
module graph stays light (README of this folder).

    call_json(url, path, token, ...) -> the answer's JSON
        HTTP error    -> AdminCallError(code, detail: the admin's one-line `detail`)
        no answer     -> AdminCallError(code None: refused, timed out, DNS)
        not JSON      -> AdminCallError(code None)
"""

from __future__ import annotations

import json
import urllib.error
import urllib.request
from typing import Any

from kvtier.manager.errors import KvtierError


class AdminCallError(KvtierError, RuntimeError):
    """A call the admin refused or did not answer: `str()` is one line. `code`: the HTTP
    status (None: no answer, or no JSON); `detail`: the admin's one-line reason, if it gave
    one."""

    def __init__(self, line: str, code: int | None = None, detail: str = "") -> None:
        super().__init__(line)
        self.code = code
        self.detail = detail


def admin_request(url: str, path: str, *, token: str | None, method: str = "GET",
                  data: bytes | None = None) -> urllib.request.Request:
    """A request to the admin at `url`, carrying the bearer token when there is one."""
    headers = {"Authorization": f"Bearer {token}"} if token else {}
    if data is not None:
        headers["Content-Type"] = "application/json"
    return urllib.request.Request(url.rstrip("/") + path, data=data, headers=headers,
                                  method=method)


def call_json(url: str, path: str, *, token: str | None, timeout: float, method: str = "GET",
              body: dict[str, Any] | None = None) -> Any:
    """`method` `path` on the admin at `url` (a JSON `body` when given), its answer's JSON.
    Raises AdminCallError with one line (see the module docstring)."""
    request = admin_request(url, path, token=token, method=method,
                            data=None if body is None else json.dumps(body).encode())
    target = request.full_url
    try:
        with urllib.request.urlopen(request, timeout=timeout) as response:
            return json.loads(response.read())
    except urllib.error.HTTPError as e:
        try:
            detail = str(json.loads(e.read()).get("detail", ""))
        except (ValueError, AttributeError):
            detail = ""
        raise AdminCallError(f"{target} answered {e.code} {e.reason}"
                             + (f": {detail}" if detail else ""), e.code, detail) from None
    except urllib.error.URLError as e:
        raise AdminCallError(f"cannot reach the admin at {url}: {e.reason}") from None
    except (OSError, TimeoutError) as e:
        raise AdminCallError(f"cannot reach the admin at {url}: {e}") from None
    except ValueError as e:
        raise AdminCallError(f"{target} did not answer JSON: {e}") from None
