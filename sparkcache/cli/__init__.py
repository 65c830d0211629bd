"""The ``sparkcache`` command line. Library code logs; this module prints."""

from __future__ import annotations

import functools
import inspect
import json
import logging
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import typer

from sparkcache import __version__, config, supervisor
from sparkcache.cli import store_commands
from sparkcache.soak import params as soak_params
from sparkcache.store.fsck import DEFAULT_FSCK_GRACE_SECONDS

# --help prints a command's docstring with its line breaks as they are: the first line is
# what the command list shows, and the lines after it stay short enough for 80 columns.
app = typer.Typer(add_completion=False, no_args_is_help=True)


def _print_version(asked: bool) -> None:
    if asked:
        typer.echo(f"sparkcache {__version__}")
        raise typer.Exit()


@app.callback()
def _root(
    version: bool = typer.Option(False, "--version", is_eager=True, callback=_print_version,
                                 help="Print the version and exit."),
) -> None:
    """SparkCache: a KV-cache page store beside vLLM.

    Settings come from SPARKCACHE_* variables or the matching --flags.
    """


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
    """Capacity line: ranks, entries, used/capacity GiB, healthy.

    Exits 1 if the instance is not healthy.
    """
    raise typer.Exit(store_commands.status(cfg.store_dir, json_out, cfg.max_bytes))


@app.command("top")
@with_config_flags
def top(
    cfg: config.Config,
    once: bool = typer.Option(False, "--once", help="Print one frame and exit."),
    json_out: bool = typer.Option(False, "--json", help="Print one frame as JSON and exit."),
    interval: float = typer.Option(
        2.0, "--interval", help="Seconds between refreshes (and over which rates are taken)."
    ),
    sort: str = typer.Option(
        "rank", "--sort", help="Worker order: rank, role, cpu, mem or io (keys r o c m i)."
    ),
) -> None:
    """Live view of the running instance on the store dir. q quits.

    Every worker's process (cores, CPU, RSS, I/O, switches, state,
    heartbeat) and every rank's rings, slots, pending publications,
    restores, maintenance and used bytes.
    """
    # Imported here: spawn re-imports this module in every worker, which needs no rich.
    from sparkcache.top import command

    raise typer.Exit(command.main(cfg.store_dir, cfg, once_=once, json_out=json_out,
                                  interval=interval, sort=sort))


@app.command("sizing")
@with_config_flags
def sizing(
    cfg: config.Config,
    json_out: bool = typer.Option(False, "--json", help="Print one JSON object."),
    window: float = typer.Option(
        10.0, "--window", help="Seconds over which to measure the running instance."
    ),
    target_interval: float = typer.Option(
        3600.0, "--target-interval", help="Wanted seconds between pressure episodes."
    ),
    net_growth_bytes_per_s: str | None = typer.Option(
        None, "--net-growth-bytes-per-s",
        help="Plan with this growth a second (e.g. 50MiB) instead of measuring."),
    reclaim_bytes_per_s: str | None = typer.Option(
        None, "--reclaim-bytes-per-s", help="Eviction's reclaim rate a second."),
    largest_publication_bytes: str | None = typer.Option(
        None, "--largest-publication-bytes", help="The largest publication's bytes."),
    working_set_bytes: str | None = typer.Option(
        None, "--working-set-bytes", help="Bytes that must stay resident to be hit."),
    mean_root_bytes: str | None = typer.Option(
        None, "--mean-root-bytes", help="A conversation's mean bytes (roots per episode)."),
) -> None:
    """Advice on max_bytes and the low watermark from the store's rates.

    The growth and reclaim rates are measured on the running instance or
    given as flags; each figure says where it came from.
    """
    from sparkcache.cli import sizing_command

    given = {
        "net_growth_bytes_per_s": net_growth_bytes_per_s,
        "reclaim_bytes_per_s": reclaim_bytes_per_s,
        "largest_publication_bytes": largest_publication_bytes,
        "working_set_bytes": working_set_bytes, "mean_root_bytes": mean_root_bytes,
    }
    raise typer.Exit(sizing_command.main(cfg, json_out=json_out, window_s=window,
                                         target_interval_s=target_interval, given=given))


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
    raise typer.Exit(store_commands.fsck_command(cfg.store_dir, json_out, repair, grace_seconds))


@app.command("supervise")
@with_config_flags
def supervise(
    cfg: config.Config,
    avoid: str = typer.Option(
        "", "--avoid", help="PID[,PID]: keep workers off these processes' cores (default --cpus)."
    ),
    startsecs: float = typer.Option(1.0, "--startsecs", help="Exiting sooner is a failed start."),
    startretries: int = typer.Option(
        3, "--startretries", help="Failed starts in a row before a worker is FATAL."
    ),
    ready_timeout: float = typer.Option(
        supervisor.Policy.ready_timeout_s, "--ready-timeout", min=1.0,
        help="Seconds a starting worker may take to report READY before it is killed "
        "(commit redoes held slots and maintenance reconciles the store first: raise it "
        "for a store of millions of objects on a slow disk).",
    ),
) -> None:
    """Run the workers of every rank until SIGTERM/SIGINT.

    Creates the segments, starts, pins and watches the workers; on
    SIGTERM/SIGINT drains them, stops them and unlinks every segment.
    """
    logging.basicConfig(
        level=logging.INFO, format="%(asctime)s supervisor %(levelname)s %(message)s"
    )
    try:
        pids = [int(p) for p in avoid.split(",") if p.strip()]
        if any(pid <= 0 for pid in pids):
            raise ValueError  # psutil refuses them with a ValueError of its own
    except ValueError:
        typer.echo(f"sparkcache: --avoid={avoid!r} is invalid: expected PID[,PID] "
                   "(process ids, each above 0)", err=True)
        raise typer.Exit(2) from None
    policy = supervisor.Policy(
        startsecs, startretries, ready_timeout_s=ready_timeout,
        heartbeat_timeout_s=cfg.heartbeat_timeout_s,
    )
    sup = supervisor.Supervisor(cfg, avoid=pids, policy=policy)
    try:
        sup.start()
    except supervisor.SupervisorError as exc:
        typer.echo(f"sparkcache: {exc}", err=True)
        raise typer.Exit(1) from None
    typer.echo(
        f"sparkcache: supervising instance={cfg.instance} ranks={cfg.ranks} cores={sup.cpus}"
    )
    raise typer.Exit(sup.run())


@app.command("soak")
def soak(
    quick: bool = typer.Option(False, "--quick", help="Small sizes: every lane in < 3 min."),
    lanes: str = typer.Option(",".join(soak_params.LANES), "--lanes",
                              help="Comma-separated lanes to run, in order."),
    duration: float | None = typer.Option(None, "--duration", help="Seconds of soak per lane."),
    conversations: int | None = typer.Option(None, "--conversations",
                                             help="Concurrent conversations."),
    context_min: int | None = typer.Option(None, "--context-min",
                                           help="Tokens of a conversation's first turn."),
    context_max: int | None = typer.Option(None, "--context-max",
                                           help="A conversation past this starts over."),
    tail_tokens: int | None = typer.Option(None, "--tail-tokens",
                                           help="New prompt tokens (prefilled) each turn."),
    decode_tokens: int | None = typer.Option(None, "--decode-tokens",
                                             help="Tokens generated each turn."),
    page_tokens: int | None = typer.Option(None, "--page-tokens", help="Tokens per page."),
    max_bytes: str | None = typer.Option(None, "--max-bytes",
                                         help="Store cap (high watermark), e.g. 48MiB."),
    low_watermark_bytes: str | None = typer.Option(None, "--low-watermark-bytes",
                                                   help="Eviction stops here, e.g. 32MiB."),
    lease_seconds: float | None = typer.Option(None, "--lease-seconds",
                                               help="Seconds a new root cannot be evicted."),
    lookup_lease_seconds: float | None = typer.Option(
        None, "--lookup-lease-seconds", help="Seconds a lookup protects what it counted."),
    probes: int | None = typer.Option(None, "--probes", help="Idle probes before and after."),
    probe_tokens: int | None = typer.Option(None, "--probe-tokens",
                                            help="Prompt tokens of a probe."),
    probe_decode_tokens: int | None = typer.Option(None, "--probe-decode-tokens",
                                                   help="Tokens a probe generates."),
    engine_core: int | None = typer.Option(None, "--engine-core",
                                           help="Core the engine is pinned to (default 0)."),
    seed: int | None = typer.Option(None, "--seed", help="Seed of every token stream."),
    json_out: bool = typer.Option(False, "--json", help="Print one JSON object."),
    csv_dir: str | None = typer.Option(None, "--csv-dir", help="Write <lane>.csv here."),
    plot_file: str | None = typer.Option(None, "--plot", help="Draw the lanes to FILE.png."),
    work_dir: str | None = typer.Option(None, "--work-dir",
                                         help="Where the lanes' stores live (default: TMPDIR)."),
) -> None:
    """The slowdown experiment, lane by lane (docs/soak.md).

    Each lane: idle probes, a soak of long conversations at the store's
    cap, the probes again.
    """
    from sparkcache.soak import report
    from sparkcache.soak.run import check, run

    logging.basicConfig(level=logging.WARNING, format="%(asctime)s soak %(levelname)s %(message)s")
    if plot_file is not None and not report.plot_available():
        typer.echo(f"sparkcache: {report.PLOT_EXTRA_HINT}", err=True)
        raise typer.Exit(2)
    given: dict[str, Any] = {
        "lanes": tuple(n.strip() for n in lanes.split(",") if n.strip()),
        "duration_s": duration, "conversations": conversations, "context_min": context_min,
        "context_max": context_max, "tail_tokens": tail_tokens,
        "turn_decode_tokens": decode_tokens, "page_tokens": page_tokens,
        "lease_seconds": lease_seconds, "lookup_lease_seconds": lookup_lease_seconds,
        "probes": probes, "probe_tokens": probe_tokens,
        "probe_decode_tokens": probe_decode_tokens, "engine_core": engine_core, "seed": seed,
    }
    for name, text in (("max_bytes", max_bytes), ("low_watermark_bytes", low_watermark_bytes)):
        if text is not None:
            try:
                given[name] = config.parse_size(text)
            except ValueError as e:
                typer.echo(f"sparkcache: --{name.replace('_', '-')}={text!r} is invalid: "
                           f"expected {e}", err=True)
                raise typer.Exit(2) from None
    given = {k: v for k, v in given.items() if v is not None}
    params = (soak_params.SoakParams.quick(**given) if quick
              else soak_params.SoakParams(**given))
    work_path = Path(work_dir) if work_dir else None
    try:
        check(params, work_path)
        # Written after every lane ran: a path that cannot be written would lose minutes
        # of results to a traceback.
        if csv_dir is not None and Path(csv_dir).exists() and not Path(csv_dir).is_dir():
            raise soak_params.SoakParamError(f"--csv-dir={csv_dir!r}: expected a directory "
                                             "(this path is a file)")
        if plot_file is not None and not Path(plot_file).parent.is_dir():
            raise soak_params.SoakParamError(f"--plot={plot_file!r}: expected a file in an "
                                             "existing directory")
    except soak_params.SoakParamError as e:
        typer.echo(f"sparkcache: {e}", err=True)
        raise typer.Exit(2) from None
    results = _run_with_progress(run, params, work_path)
    if csv_dir is not None:
        report.write_csvs(results, Path(csv_dir))
    if plot_file is not None:
        report.plot(results, Path(plot_file))
    if json_out:
        typer.echo(json.dumps(report.as_json(results)))
    else:
        typer.echo(report.table(results))
    bad = [n for n, r in results.items() if r.figures["restore_mismatches"]]
    if bad:
        typer.echo(f"sparkcache: restored pages differed in {', '.join(bad)}", err=True)
        raise typer.Exit(1)


def _progress_lines() -> Callable[[str, str, float], None]:
    """A soak's progress as plain lines on stderr, one each time a lane's step changes
    (and at each quarter of its soak), written at once."""
    shown: dict[str, tuple[str, int]] = {}

    def progress(lane: str, what: str, share: float) -> None:
        step = (what, int(share * 4))
        if shown.get(lane) == step:
            return
        shown[lane] = step
        share_text = f" {share:.0%}" if 0 < share < 1 else ""
        typer.echo(f"{time.strftime('%H:%M:%S')} soak {lane}: {what}{share_text}", err=True)

    return progress


def _run_with_progress(run: Callable[..., Any], params: Any, work_dir: Path | None) -> Any:
    """``run`` under a rich progress bar on stderr: a bar per lane."""
    from rich.console import Console
    from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn

    console = Console(stderr=True)
    if not console.is_terminal:
        # Into a file or a pipe a bar is drawn only at the end: a line per step instead.
        return run(params, _progress_lines(), work_dir)
    with Progress(TextColumn("{task.fields[lane]:<20}"), BarColumn(),
                  TextColumn("{task.description}"), TimeElapsedColumn(),
                  console=console, transient=False) as bar:
        tasks = {name: bar.add_task("waiting", total=1.0, lane=name, start=False)
                 for name in params.lanes}

        def progress(lane: str, what: str, share: float) -> None:
            task = tasks[lane]
            bar.start_task(task)
            bar.update(task, description=what, completed=share)

        return run(params, progress, work_dir)
