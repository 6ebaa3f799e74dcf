"""`kvtier lookup | warm | pin | clear | tenants`: the operator's side of the admin's steering
routes (`kvtier.admin.steering`, issue 36). Each command is one HTTP call to a running
`kvtier serve`; its answer is printed as JSON; a refusal is the admin's one-line detail and
exit status 1.

Token ids come from `--tokens` (comma separated, or @FILE with a JSON list)."""

from __future__ import annotations

import argparse
import json
import os
import urllib.parse
from pathlib import Path
from typing import Any

EXIT_OK, EXIT_FAILURE = 0, 1


def _tokens(spec: str) -> list[int]:
    if spec.startswith("@"):
        data = json.loads(Path(spec[1:]).read_text())
        if not isinstance(data, list):
            raise ValueError(f"{spec[1:]}: a JSON list of token ids")
        return [int(t) for t in data]
    return [int(t) for t in spec.split(",") if t.strip()]


def _call(args: argparse.Namespace, method: str, path: str,
          body: dict[str, Any] | None = None) -> int:
    from kvtier.admin.auth import client_token
    from kvtier.admin.client import AdminCallError, call_json

    try:
        answer = call_json(args.url, path, token=client_token(args.deployment_id),
                           timeout=args.timeout, method=method, body=body)
    except AdminCallError as e:
        said = f"{e.code} {e.detail}" if e.code is not None and e.detail else str(e)
        print(f"kvtier {args.command}: {said}")
        return EXIT_FAILURE
    print(json.dumps(answer, indent=2, sort_keys=True))
    return EXIT_OK


def _prompt(args: argparse.Namespace) -> dict[str, Any]:
    return {"namespace": args.namespace, "token_ids": _tokens(args.tokens),
            "cache_salt": args.salt}


def cmd_lookup(args: argparse.Namespace) -> int:
    return _call(args, "POST", "/lookup", _prompt(args))


def cmd_warm(args: argparse.Namespace) -> int:
    return _call(args, "POST", "/warm", _prompt(args))


def cmd_pin(args: argparse.Namespace) -> int:
    if args.unpin:
        return _call(args, "POST", "/retain/unpin", _prompt(args))
    body = {**_prompt(args), "tenant": args.tenant,
            "retention": {"pin": not args.no_pin, "ttl_s": args.ttl, "priority": args.priority}}
    return _call(args, "POST", "/retain", body)


def cmd_clear(args: argparse.Namespace) -> int:
    body: dict[str, Any] = {"namespace": args.namespace}
    if args.tenant is not None:
        body["tenant"] = args.tenant
    if args.tokens is not None:
        body["token_ids"] = _tokens(args.tokens)
        body["cache_salt"] = args.salt
    if args.all:
        body["all"] = True
    if args.storage:
        body["storage"] = True
    return _call(args, "POST", "/clear", body)


def cmd_tenants(args: argparse.Namespace) -> int:
    if args.set_quota is not None:
        blocks = None if args.set_quota < 0 else args.set_quota
        return _call(args, "POST", "/tenants/quota",
                     {"namespace": args.namespace, "tenant": args.tenant,
                      "quota_blocks": blocks})
    path = "/tenants" + (f"?namespace={urllib.parse.quote(args.namespace)}"
                         if args.namespace else "")
    return _call(args, "GET", path)


def add_steering_commands(sub: Any, default_url: str) -> None:
    """The five subcommands on the `kvtier` parser's subparsers `sub`."""

    def common(p: argparse.ArgumentParser, *, prompt: bool) -> None:
        p.add_argument("--url", default=default_url, help=f"admin base URL ({default_url})")
        p.add_argument("--deployment-id",
                       default=os.environ.get("KVTIER_DEPLOYMENT_ID", "default"), metavar="ID",
                       help="whose generated admin token to present")
        p.add_argument("--timeout", type=float, default=10.0, metavar="SECONDS")
        p.add_argument("--namespace", default=None,
                       help="the engines' namespace (kvtier status lists them); omit where "
                            "the admin serves one (an embedded kvtier)")
        if prompt:
            p.add_argument("--tokens", required=True,
                           help="token ids: comma separated, or @FILE (a JSON list)")
            p.add_argument("--salt", default=None, help="vLLM's cache_salt (the tenant)")

    p = sub.add_parser("lookup", help="matched tokens of a prompt per tier on this node")
    common(p, prompt=True)
    p.set_defaults(func=cmd_lookup)
    p = sub.add_parser("warm", help="bring a prompt's blocks from storage into the host tier")
    common(p, prompt=True)
    p.set_defaults(func=cmd_warm)
    p = sub.add_parser("pin", help="pin (or TTL / priority, or unpin) a prompt's blocks")
    common(p, prompt=True)
    p.add_argument("--ttl", type=float, default=0.0, help="seconds kept at least")
    p.add_argument("--priority", type=int, default=0, help="-8..8, lower goes first")
    p.add_argument("--no-pin", action="store_true", help="TTL / priority only")
    p.add_argument("--tenant", default=None, help="book the blocks to this tenant")
    p.add_argument("--unpin", action="store_true", help="undo the pin")
    p.set_defaults(func=cmd_pin)
    p = sub.add_parser("clear", help="remove a tenant's, a prompt's or every block")
    common(p, prompt=False)
    p.add_argument("--tenant", default=None)
    p.add_argument("--tokens", default=None)
    p.add_argument("--salt", default=None)
    p.add_argument("--all", action="store_true")
    p.add_argument("--storage", action="store_true", help="delete the storage pages too")
    p.set_defaults(func=cmd_clear)
    p = sub.add_parser("tenants", help="per-tenant figures, or set a tenant's quota")
    common(p, prompt=False)
    p.add_argument("--tenant", default=None, help="with --set-quota: the tenant (none: the "
                                                  "default quota)")
    p.add_argument("--set-quota", type=int, default=None, metavar="BLOCKS",
                   help="host blocks (-1: back to the default)")
    p.set_defaults(func=cmd_tenants)
