"""``python -m sparkcache``: the CLI (spawned workers import this as ``__mp_main__``)."""

from sparkcache.cli import app

if __name__ == "__main__":
    app()
