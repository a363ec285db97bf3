"""Manage API keys from a shell (the same store the service reads; see serve_app.ingress.auth).

    python -m serve_app.ingress.keys_cli create --user alice --user bob [--label app]   # prints the key once
    python -m serve_app.ingress.keys_cli create --admin
    python -m serve_app.ingress.keys_cli list
    python -m serve_app.ingress.keys_cli revoke key_0123456789ab

Redis and the key prefix come from the service settings (REDIS_URL, KVMEM_MEMORY__REDIS_PREFIX).
"""

from __future__ import annotations

import argparse
import asyncio
import json

from memory.key_store import KeyStore
from serve_app.settings import ServiceSettings


async def run(args: argparse.Namespace) -> None:
    settings = ServiceSettings()
    if not settings.redis_url:
        raise SystemExit("set REDIS_URL (the Redis the service uses)")
    store = KeyStore.from_url(settings.redis_url, settings.memory.redis_prefix)
    try:
        if args.command == "create":
            if args.admin == bool(args.user):
                raise SystemExit("give --admin or at least one --user")
            key, record = await store.create(None if args.admin else args.user, label=args.label)
            print(json.dumps({"key": key, **record.model_dump()}))
        elif args.command == "list":
            for record in await store.list():
                print(record.model_dump_json())
        elif args.command == "revoke":
            if not await store.revoke(args.key_id):
                raise SystemExit(f"no key {args.key_id!r}")
            print(f"revoked {args.key_id}")
    finally:
        await store.close()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    commands = parser.add_subparsers(dest="command", required=True)
    create = commands.add_parser("create", help="a new key, printed once")
    create.add_argument("--user", action="append", default=[], help="a user id the key may act for (repeatable)")
    create.add_argument("--admin", action="store_true", help="a key that may act for every user")
    create.add_argument("--label", default="", help="a note to recognise the key by")
    commands.add_parser("list", help="keys (ids, labels, users; never the keys themselves)")
    revoke = commands.add_parser("revoke", help="revoke a key by its id")
    revoke.add_argument("key_id")
    asyncio.run(run(parser.parse_args()))


if __name__ == "__main__":
    main()
