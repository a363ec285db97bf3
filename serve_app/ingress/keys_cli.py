"""Manage API keys from a shell (the same store the service reads; see serve_app.ingress.auth).

    python -m serve_app.ingress.keys_cli create --user alice --user bob [--label app]   # prints the key once
    python -m serve_app.ingress.keys_cli create --admin                                  # every user: say so
    python -m serve_app.ingress.keys_cli list
    python -m serve_app.ingress.keys_cli revoke key_0123456789ab

A key is either `--admin` or bound to at least one `--user`; anything else is refused before Redis
is asked (as POST /v1/admin/keys refuses it). Redis and the key prefix come from the service
settings (REDIS_URL, REDIS_PASSWORD, KVMEM_MEMORY__REDIS_PREFIX).
"""

from __future__ import annotations

import argparse
import asyncio
import json

from memory.key_store import SETTINGS_COPY_LABEL, KeyStore
from serve_app.settings import ServiceSettings


async def run(args: argparse.Namespace) -> None:
    settings = ServiceSettings()
    if not settings.redis_url:
        raise SystemExit("set REDIS_URL (the Redis the service uses)")
    store = KeyStore.from_url(settings.redis_url, settings.memory.redis_prefix, password=settings.redis_password_value())
    try:
        if args.command == "create":
            key, record = await store.create(args.user, admin=args.admin, label=args.label)
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


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    commands = parser.add_subparsers(dest="command", required=True)
    create = commands.add_parser("create", help="a new key, printed once")
    create.add_argument("--user", action="append", default=[], help="a user id the key may act for (repeatable)")
    create.add_argument("--admin", action="store_true", help="a key that may act for every user")
    create.add_argument("--label", default="", help="a note to recognise the key by")
    commands.add_parser("list", help="keys (ids, labels, users; never the keys themselves)")
    revoke = commands.add_parser("revoke", help="revoke a key by its id")
    revoke.add_argument("key_id")
    args = parser.parse_args(argv)
    if args.command == "create":
        if args.admin and args.user:
            parser.error("--admin makes a key for every user: give --admin or --user, not both")
        if any(not user for user in args.user):
            parser.error("--user: a user id is never empty")
        if not args.admin and not args.user:
            parser.error("give --admin or at least one --user (a key bound to no user is refused)")
        if args.label == SETTINGS_COPY_LABEL:
            parser.error(f"the label {SETTINGS_COPY_LABEL!r} is reserved")
    asyncio.run(run(args))


if __name__ == "__main__":
    main()
