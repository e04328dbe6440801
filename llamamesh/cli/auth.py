"""``llamamesh auth create-key | revoke-key | list-keys``: the API keys of the tenants file."""

from __future__ import annotations

import argparse
import json
import sys

from llamamesh import tenants
from llamamesh.cli import flags


def add_parsers(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = sub.add_parser("auth", help="API keys in the tenants file (LLAMAMESH_AUTH_FILE)")
    acts = p.add_subparsers(dest="action", required=True)
    a = acts.add_parser("create-key", help="add a key for TENANT and print it once")
    a.add_argument("tenant")
    a.add_argument("--admin", action="store_true", help="the key may call AdminService")
    b = acts.add_parser("revoke-key", help="revoke a key by its id")
    b.add_argument("key_id")
    acts.add_parser("list-keys", help="every key's id, tenant, admin flag, creation and revocation")
    for q in acts.choices.values():
        q.add_argument("--file", help="the tenants file (default: LLAMAMESH_AUTH_FILE)")
    p.set_defaults(func=cmd_auth)


def cmd_auth(args: argparse.Namespace) -> int:
    """The tenants file: add a key (printed once: only its hash is kept), revoke one, list them."""
    path = args.file or flags.settings(args).auth.file
    if not path:
        print("llamamesh auth: give --file or set LLAMAMESH_AUTH_FILE", file=sys.stderr)
        return 2
    try:
        if args.action == "create-key":
            key_id, key = tenants.create_key(path, args.tenant, admin=args.admin)
            print(key)
            print(
                f"key id {key_id} for tenant {args.tenant}{' (admin)' if args.admin else ''} added to {path}; "
                "the key is shown only now",
                file=sys.stderr,
            )
        elif args.action == "revoke-key":
            tenants.revoke_key(path, args.key_id)
            print(f"key {args.key_id} revoked in {path}", file=sys.stderr)
        else:
            for k in tenants.list_keys(path):
                print(json.dumps(k))
    except KeyError as exc:
        print(f"llamamesh auth: no key {exc.args[0]!r} in {path}", file=sys.stderr)
        return 1
    except (ValueError, OSError) as exc:
        print(f"llamamesh auth: {exc}", file=sys.stderr)
        return 1
    return 0
