"""The ``sparkcache`` command line. Library code logs; this module prints."""

from __future__ import annotations

import functools
import inspect
import json
from collections.abc import Callable
from typing import Any

import typer

from sparkcache import config, store_cli
from sparkcache.store.fsck import DEFAULT_FSCK_GRACE_SECONDS

app = typer.Typer(add_completion=False, no_args_is_help=True)


@app.callback()
def _root() -> None:
    """SparkCache: a KV-cache page store beside vLLM. Settings come from SPARKCACHE_*
    variables or the matching --flags."""


def with_config_flags(fn: Callable[..., Any]) -> Callable[..., Any]:
    """Give a command one ``--flag`` per Config field (help from the field) and pass it
    the validated Config as ``cfg``. Flags override ``SPARKCACHE_*`` variables."""
    params = [p for p in inspect.signature(fn).parameters.values() if p.name != "cfg"]
    for name, f in config.FIELDS.items():
        params.append(
            inspect.Parameter(
                name,
                inspect.Parameter.KEYWORD_ONLY,
                default=typer.Option(
                    None,
                    config.flag_name(name),
                    help=f"{f.metadata['help']} [env {config.env_name(name)}]",
                    show_default=False,
                ),
                annotation=str | None,
            )
        )

    @functools.wraps(fn)
    def wrapper(**kwargs: Any) -> Any:
        overrides = {name: kwargs.pop(name) for name in config.FIELDS}
        try:
            cfg = config.load(overrides=overrides)
        except config.ConfigError as e:
            for problem in e.problems:
                typer.echo(f"sparkcache: {problem}", err=True)
            raise typer.Exit(2) from None
        return fn(cfg=cfg, **kwargs)

    wrapper.__signature__ = inspect.Signature(params)  # type: ignore[attr-defined]
    return wrapper


@app.command("config")
@with_config_flags
def show_config(
    cfg: config.Config,
    json_out: bool = typer.Option(False, "--json", help="Print one JSON object."),
) -> None:
    """Validate the configuration (environment and flags) and print it."""
    values = config.describe(cfg)
    if json_out:
        typer.echo(json.dumps(values))
        return
    for name, value in values.items():
        typer.echo(f"{config.env_name(name):34s} {value}")


@app.command("status")
@with_config_flags
def status(
    cfg: config.Config,
    json_out: bool = typer.Option(False, "--json", help="Print one JSON object."),
) -> None:
    """Capacity line: ranks, entries, used/capacity GiB, healthy (exit 1 if not)."""
    raise typer.Exit(store_cli.status(cfg.store_dir, json_out, cfg.max_bytes))


@app.command("fsck")
@with_config_flags
def fsck(
    cfg: config.Config,
    json_out: bool = typer.Option(False, "--json", help="Print one JSON object."),
    repair: bool = typer.Option(False, "--repair", help="Reconcile and quarantine, then check."),
    grace_seconds: float = typer.Option(
        DEFAULT_FSCK_GRACE_SECONDS, "--grace-seconds", help="Ignore files younger than this."
    ),
) -> None:
    """Check every store invariant; exit 1 if any is violated."""
    raise typer.Exit(store_cli.fsck_command(cfg.store_dir, json_out, repair, grace_seconds))
