"""``python -m polyak``: runs, ranks and push status, snapshots, downloads,
compare, resume, finish, post-hoc EMA, evaluations and the TensorBoard
export, for scripts and terminals.

Every command takes ``--url`` (default ``$POLYAK_URL`` or
``http://127.0.0.1:8080``) and ``--token`` (default ``$POLYAK_TOKEN``);
``--json`` prints the server's JSON instead of a table. These three go
before or after the subcommand. Exit status: 0 on success, 1 when the
server refused the request, 2 on a usage error, 141 when the reader of the
output went away (``| head``; nothing is printed about it).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from .client import Client
from .contract import WRITTEN_LAYOUTS, DownloadLayout
from .errors import PolyakError
from .views import plain


def _table(rows: list[list[str]], header: list[str]) -> str:
    widths = [max(len(str(c)) for c in col) for col in zip(header, *rows, strict=False)]
    lines = ["  ".join(str(c).ljust(w) for c, w in zip(header, widths, strict=True)).rstrip()]
    for row in rows:
        lines.append("  ".join(str(c).ljust(w) for c, w in zip(row, widths, strict=True)).rstrip())
    return "\n".join(lines)


def _age(ms: Any) -> str:
    if ms is None:
        return "-"
    seconds = max(0.0, time.time() - float(ms) / 1000)
    if seconds < 120:
        return f"{seconds:.0f}s ago"
    if seconds < 7200:
        return f"{seconds / 60:.0f}m ago"
    return f"{seconds / 3600:.1f}h ago"


def _bytes(n: Any) -> str:
    value = float(n or 0)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if value < 1024 or unit == "TiB":
            return f"{value:.0f} {unit}" if unit == "B" else f"{value:.1f} {unit}"
        value /= 1024
    return f"{value:.1f} TiB"  # pragma: no cover


def _dash(v: Any) -> str:
    return "-" if v is None else str(v)


def _print_json(data: Any) -> None:
    print(json.dumps(plain(data), indent=2, sort_keys=True))


def cmd_runs(client: Client, args: argparse.Namespace) -> None:
    runs = client.runs()
    if args.json:
        _print_json(runs)
        return
    rows = [
        [
            r["name"],
            str(r["config"]["world_size"]),
            f"{r['ranks_seen']}/{r['config']['world_size']}",
            _dash(r.get("last_step")),
            r.get("health", "-"),
            ",".join(p["name"] for p in r["config"].get("profiles", [])),
            _bytes(r.get("resident_bytes")),
        ]
        for r in runs
    ]
    print(_table(rows, ["RUN", "WORLD", "SEEN", "LAST STEP", "HEALTH", "PROFILES", "RESIDENT"]))


def cmd_status(client: Client, args: argparse.Namespace) -> None:
    run = client.run(args.run)
    info = run.refresh()
    if args.json:
        _print_json(info)
        return
    cfg = info["config"]
    profiles = ", ".join(f"{p['name']} ({p['kind']})" for p in cfg.get("profiles", []))
    print(
        f"run {info['name']}: {info.get('health', '-')}, world_size {cfg['world_size']}, "
        f"update_every {cfg.get('update_every', 1)}, last step {_dash(info.get('last_step'))}, "
        f"min step {_dash(info.get('min_step'))}"
    )
    print(f"profiles: {profiles}")
    rows = [
        [
            str(r["rank"]),
            r["status"],
            _dash(r.get("last_step")),
            str(r.get("pushes", 0)),
            str(r.get("duplicates", 0)),
            str(r.get("rejections", 0)),
            _bytes(r.get("bytes_received")),
            _age(r.get("last_push_at_ms")),
        ]
        for r in info.get("ranks") or []
    ]
    print(
        _table(
            rows,
            ["RANK", "STATUS", "LAST STEP", "PUSHES", "DUPS", "REJECTED", "RECEIVED", "LAST PUSH"],
        )
    )


def cmd_ema(client: Client, args: argparse.Namespace) -> None:
    """One rank's live EMA to a safetensors file."""
    run = client.run(args.run)
    r = client.request(
        "GET",
        f"{run.path}/ranks/{args.rank}/ema",
        params={"profile": args.profile, "dtype": args.dtype},
        token=run.read_token,
    )
    out = Path(args.output)
    out.write_bytes(r.content)
    print(out if not args.json else json.dumps({"path": str(out), "bytes": len(r.content)}))


def cmd_delete(client: Client, args: argparse.Namespace) -> None:
    client.delete_run(args.run)


def cmd_snapshot(client: Client, args: argparse.Namespace) -> None:
    run = client.run(args.run)
    profiles = args.profiles.split(",") if args.profiles else None
    snap = run.snapshot(args.step, profiles=profiles, label=args.label, wait=not args.no_wait)
    if args.json:
        _print_json(snap)
    else:
        cut = (snap.get("detail") or {}).get("cut")
        how = {"current": " (the current step)", "next_update": " (the next update step)"}
        print(
            f"snapshot {snap.get('id')} at step {_dash(snap.get('step'))}"
            f"{how.get(cut, '')}: {snap.get('status')}"
        )


def cmd_snapshots(client: Client, args: argparse.Namespace) -> None:
    snaps = client.run(args.run).snapshots()
    if args.json:
        _print_json(snaps)
        return
    rows = [
        [
            str(s.get("id")),
            _dash(s.get("step")),
            str(s.get("kind", "-")),
            str(s.get("status", "-")),
            str(s.get("label") or ""),
        ]
        for s in snaps
    ]
    print(_table(rows, ["ID", "STEP", "KIND", "STATUS", "LABEL"]))


def cmd_download(client: Client, args: argparse.Namespace) -> None:
    run = client.run(args.run)
    snapshot, profile = args.snapshot, args.profile
    if args.best is not None:
        if snapshot is not None:
            raise SystemExit("polyak download: give a snapshot id or --best, not both")
        chosen = run.best(args.best, args.mode, kind=args.kind, profile=profile)
        snapshot = chosen["evaluation"]["snapshot"]
        profile = chosen["evaluation"]["profile"]
        print(
            f"best {args.best} ({args.mode}): {chosen['value']:.6g} at step "
            f"{chosen['evaluation']['step']}, {chosen['evaluation']['kind']} {profile} "
            f"of {snapshot}",
            file=sys.stderr,
        )
    elif snapshot is None:
        raise SystemExit("polyak download: give a snapshot id or --best METRIC")
    path = run.download_to(
        snapshot,
        args.output,
        profile,
        layout=args.layout,
        dtype=args.dtype,
        progress=not args.no_progress,
        connections=args.connections,
    )
    print(path if not args.json else json.dumps({"path": str(path)}))


def cmd_compare(client: Client, args: argparse.Namespace) -> None:
    result = client.run(args.run).compare(args.a, args.b, args.profile, profile_b=args.profile_b)
    if args.json:
        _print_json(result)
        return
    rows = [
        [
            t["name"],
            "x".join(str(d) for d in t.get("shape", [])),
            f"{t['norm_a']:.6g}",
            f"{t['norm_b']:.6g}",
            f"{t['rel_diff']:.3e}",
            "-" if t.get("cosine") is None else f"{t['cosine']:.6f}",
            f"{t['max_abs_diff']:.3e}",
        ]
        for t in result["tensors"]
    ]
    print(_table(rows, ["TENSOR", "SHAPE", "NORM A", "NORM B", "REL DIFF", "COSINE", "MAX ABS"]))
    summary = result.get("summary") or {}
    if summary:
        print(
            f"{result['a']} ({result['profile']}) vs {result['b']} ({result['profile_b']}): "
            f"rel_diff {float(summary.get('rel_diff', 0.0)):.3e}, "
            f"max_abs_diff {float(summary.get('max_abs_diff', 0.0)):.3e}"
        )


def cmd_resume(client: Client, args: argparse.Namespace) -> None:
    answer = client.run(args.run).resume(args.step, allow_older=args.allow_older)
    if args.json:
        _print_json(answer)
    else:
        older = " (older than the step asked for)" if answer.get("older") else ""
        print(f"resumed from snapshot {answer['snapshot']} at step {answer['step']}{older}")


def cmd_finish(client: Client, args: argparse.Namespace) -> None:
    answer = client.run(args.run).finish(label=args.label, wait=not args.no_wait)
    if args.json:
        _print_json(answer)
        return
    snap = answer.get("snapshot")
    if snap is None:
        print(f"run {args.run} finished (nothing was pushed: no final snapshot)")
    else:
        print(
            f"run {args.run} finished at step {_dash(snap.get('step'))}: "
            f"final snapshot {snap.get('id')} {snap.get('status')}"
        )


def _sigma_list(text: str) -> list[float]:
    try:
        return [float(v) for v in text.split(",") if v.strip()]
    except ValueError as e:
        raise argparse.ArgumentTypeError(f"not a list of numbers: {text!r}") from e


def cmd_posthoc(client: Client, args: argparse.Namespace) -> None:
    profiles = args.profiles.split(",") if args.profiles else None
    run = client.run(args.run)
    sigmas = args.sigma_rel
    if args.plan:
        plan = run.posthoc_plan(sigmas, step=args.step, profiles=profiles)
        if args.json:
            _print_json(plan)
            return
        print(f"step {plan['step']}; {len(plan['sources'])} sources")
        for t in plan["targets"]:
            print(f"sigma_rel {t['sigma_rel']:g}: residual {t['residual']:.3g}")
            for src, w in zip(plan["sources"], t["weights"], strict=True):
                print(
                    f"  {src['snapshot']:>24} {src['profile']:>12} step {src['step']:>8} {w:+.6f}"
                )
        return
    snaps = run.posthoc(
        sigmas if len(sigmas) > 1 else sigmas[0],
        step=args.step,
        profiles=profiles,
        name=args.name,
        wait=not args.no_wait,
        progress=not args.no_wait and not args.json,
    )
    snaps = snaps if isinstance(snaps, list) else [snaps]
    _warn_poor_fits(snaps)
    if args.json:
        _print_json(snaps if len(snaps) > 1 else snaps[0])
        return
    for snap in snaps:
        detail = snap.get("detail") or {}
        residual = detail.get("residual")
        print(
            f"snapshot {snap.get('id')} (posthoc, sigma_rel {detail.get('sigma_rel', 0):g}) at "
            f"step {_dash(snap.get('step'))}: {snap.get('status')}"
            + (f", fit residual {residual:.3g}" if residual is not None else "")
        )


def _warn_poor_fits(snaps: list[dict[str, Any]]) -> None:
    """Names on stderr the lengths whose fit residual is above the client's
    threshold (the stored power snapshots cannot synthesise them well)."""
    from .evals import POORLY_FITTED

    for snap in snaps:
        detail = snap.get("detail") or {}
        residual = detail.get("residual")
        if residual is not None and residual > POORLY_FITTED:
            print(
                f"polyak: warning: sigma_rel {detail.get('sigma_rel', 0):g} is poorly fitted "
                f"(residual {residual:.3g} > {POORLY_FITTED})",
                file=sys.stderr,
            )


def cmd_merge(client: Client, args: argparse.Namespace) -> None:
    snap = client.run(args.run).merge(
        args.snapshots.split(",") if args.snapshots else None,
        last=args.last,
        weights=args.weights,
        alpha=args.alpha,
        name=args.name,
        wait=not args.no_wait,
        progress=not args.no_wait and not args.json,
    )
    if args.json:
        _print_json(snap)
    else:
        print(
            f"snapshot {snap.get('id')} (merge, {args.weights}) at step "
            f"{_dash(snap.get('step'))}: {snap.get('status')}"
        )


def cmd_log(client: Client, args: argparse.Namespace) -> None:
    values = {}
    for item in args.values:
        name, sep, value = item.partition("=")
        if not sep:
            raise SystemExit(f"metric {item!r}: expected name=value")
        values[name] = float(value)
    client.run(args.run).log(args.step, rank=args.rank, **values)


def _common(parser: argparse.ArgumentParser, *, default: Any) -> None:
    """``--url``, ``--token`` and ``--json``, accepted before the subcommand
    and after it (``default`` is ``argparse.SUPPRESS`` on the subcommands,
    so a value given before is not reset)."""
    parser.add_argument(
        "--url",
        default=default,
        help="server URL (default $POLYAK_URL or http://127.0.0.1:8080)",
    )
    parser.add_argument(
        "--token", default=default, help="admin or run token (default $POLYAK_TOKEN)"
    )
    parser.add_argument(
        "--json",
        action="store_true",
        default=default if default is argparse.SUPPRESS else False,
        help="print the server's JSON instead of a table",
    )


Command = Callable[..., argparse.ArgumentParser]
RUN_HELP = "run name"


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m polyak", description="polyak: runs, push status, snapshots and downloads."
    )
    _common(parser, default=None)
    common = argparse.ArgumentParser(add_help=False)
    _common(common, default=argparse.SUPPRESS)
    sub = parser.add_subparsers(dest="command", required=True)

    def command(name: str, help: str, **kw: Any) -> argparse.ArgumentParser:
        return sub.add_parser(name, help=help, description=help, parents=[common], **kw)

    _run_commands(command)
    _snapshot_commands(command)
    _derived_commands(command)
    _log_command(command)
    _eval_command(command)
    _export_command(command)
    return parser


def _run_commands(command: Command) -> None:
    """runs, status, ema, delete."""
    command("runs", "list runs").set_defaults(func=cmd_runs)

    p = command("status", "a run and the push status of each rank", aliases=["ranks"])
    p.add_argument("run", help=RUN_HELP)
    p.set_defaults(func=cmd_status)

    p = command("ema", "save one rank's live EMA as safetensors")
    p.add_argument("run", help=RUN_HELP)
    p.add_argument("--rank", type=int, default=0, help="which rank's EMA (default 0)")
    p.add_argument("--profile", default=None, help="profile (default the run's first)")
    p.add_argument(
        "--dtype", default=None, help="cast averaged tensors: float32, bfloat16, float16, float64"
    )
    p.add_argument("-o", "--output", required=True, help="the .safetensors file to write")
    p.set_defaults(func=cmd_ema)

    p = command("delete", "delete a run")
    p.add_argument("run", help=RUN_HELP)
    p.set_defaults(func=cmd_delete)


def _snapshot_commands(command: Command) -> None:
    """snapshot, snapshots, download, compare, resume, finish."""
    p = command(
        "snapshot",
        "take a snapshot: of the EMA as it is now when every rank applied the same step, "
        "else at the next update step (waits until it is complete)",
    )
    p.add_argument("run", help=RUN_HELP)
    p.add_argument("--step", type=int, default=None, help="cut at this step instead")
    p.add_argument("--profiles", default=None, help="comma-separated profile names (default all)")
    p.add_argument("--label", default=None, help="a label shown in listings and the dashboard")
    p.add_argument("--no-wait", action="store_true", help="return the pending snapshot at once")
    p.set_defaults(func=cmd_snapshot)

    p = command("snapshots", "list a run's snapshots")
    p.add_argument("run", help=RUN_HELP)
    p.set_defaults(func=cmd_snapshots)

    p = command("download", "download a snapshot with a progress bar")
    p.add_argument("run", help=RUN_HELP)
    p.add_argument("snapshot", nargs="?", default=None, help="snapshot id (or --best)")
    p.add_argument(
        "--best",
        metavar="METRIC",
        default=None,
        help="download the best evaluated candidate of METRIC instead",
    )
    p.add_argument("--mode", choices=["min", "max"], default="min", help="with --best")
    p.add_argument(
        "--kind", default=None, help="with --best: only ema, online, posthoc or merge candidates"
    )
    p.add_argument("--profile", default=None, help="profile (default the snapshot's first)")
    p.add_argument(
        "--layout",
        choices=[layout.value for layout in DownloadLayout if layout in WRITTEN_LAYOUTS],
        default="full",
        help="full: one safetensors file; sharded: one file per rank (torch DCP); "
        "hf: HF-style shards and index",
    )
    p.add_argument("--dtype", default=None, help="cast floating point tensors: fp32, bf16, fp16")
    p.add_argument(
        "-o",
        "--output",
        default=".",
        help="a directory (default .), or with --layout full a file name ending in .safetensors",
    )
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    p.add_argument(
        "-n",
        "--connections",
        type=int,
        default=None,
        help="ranged requests side by side (default 4); an interrupted download "
        "run again fetches only what is missing, and every block is checked "
        "against the server's digests",
    )
    p.set_defaults(func=cmd_download)

    p = command("compare", "per-tensor differences between two snapshots")
    p.add_argument("run", help=RUN_HELP)
    p.add_argument("a", help="snapshot id")
    p.add_argument("b", nargs="?", default="live", help="snapshot id or `live` (default)")
    p.add_argument("--profile", default=None, help="profile of A (default the run's first)")
    p.add_argument("--profile-b", default=None, help="profile of B (default --profile)")
    p.set_defaults(func=cmd_compare)

    p = command("resume", "restore the EMA from the snapshot of STEP (refused when older)")
    p.add_argument("run", help=RUN_HELP)
    p.add_argument(
        "step",
        type=int,
        help="the last step the trainer's checkpoint pushed (optimizer steps taken minus one)",
    )
    p.add_argument(
        "--allow-older",
        action="store_true",
        help="restore the newest snapshot before STEP even if it misses updates",
    )
    p.set_defaults(func=cmd_resume)

    p = command("finish", "take the final snapshot and mark the run finished")
    p.add_argument("run", help=RUN_HELP)
    p.add_argument("--label", default=None, help="label of the final snapshot (default final)")
    p.add_argument("--no-wait", action="store_true", help="do not wait for the final snapshot")
    p.set_defaults(func=cmd_finish)


def _derived_commands(command: Command) -> None:
    """posthoc, merge."""
    p = command("posthoc", "synthesise post-hoc EMAs (EDM2) as snapshots")
    p.add_argument("run", help=RUN_HELP)
    p.add_argument(
        "--sigma-rel",
        type=_sigma_list,
        required=True,
        help="target EMA length(s): one value, or a comma-separated sweep of up to 32",
    )
    p.add_argument(
        "--step", type=int, default=None, help="a step with a stored power-profile snapshot"
    )
    p.add_argument("--profiles", default=None, help="comma-separated power profiles to combine")
    p.add_argument("--name", default=None, help="profile name of the result (default posthoc)")
    p.add_argument("--plan", action="store_true", help="only print the weights and fit residual")
    p.add_argument("--no-wait", action="store_true", help="return while it is being written")
    p.set_defaults(func=cmd_posthoc)

    p = command("merge", "average the online weights of stored snapshots")
    p.add_argument("run", help=RUN_HELP)
    p.add_argument("--snapshots", default=None, help="comma-separated snapshot ids")
    p.add_argument("--last", type=int, default=None, help="or: the newest N snapshots")
    p.add_argument(
        "--weights",
        choices=["uniform", "linear", "exp"],
        default="uniform",
        help="uniform, linear (newest heaviest) or exp (alpha ** age)",
    )
    p.add_argument("--alpha", type=float, default=None, help="exp: ratio per step of age")
    p.add_argument("--name", default=None, help="profile name of the result (default merged)")
    p.add_argument("--no-wait", action="store_true", help="return while it is being written")
    p.set_defaults(func=cmd_merge)


def _log_command(command: Command) -> None:
    p = command("log", "send trainer scalars: log RUN STEP loss=0.1 lr=3e-4")
    p.add_argument("run", help=RUN_HELP)
    p.add_argument("step", type=int, help="the trainer's step")
    p.add_argument("values", nargs="+", help="name=value pairs")
    p.add_argument("--rank", type=int, default=None, help="a rank's series (default the run's)")
    p.set_defaults(func=cmd_log)


def cmd_eval(client: Client, args: argparse.Namespace) -> None:
    import runpy

    from .evals import EvalWorker

    script = runpy.run_path(args.script)
    missing = [f for f in ("build_model", "evaluate") if not callable(script.get(f))]
    if missing:
        raise SystemExit(f"polyak eval: {args.script} defines no {' or '.join(missing)}()")
    log_to = None
    if args.tensorboard is not None:
        log_to = _summary_writer("eval", args.tensorboard)
    worker = EvalWorker(
        _run_when_reachable(client, args.run, None if args.follow else 60.0),
        script["build_model"],
        script["evaluate"],
        profiles=args.profiles.split(",") if args.profiles else None,
        include_online=not args.no_online,
        device=args.device,
        evaluator=args.evaluator,
        progress=False if args.no_progress else None,
        log_to=log_to,
    )
    try:
        done = worker.run(follow=args.follow, until_finished=args.until_finished)
    finally:
        if log_to is not None:
            log_to.close()
    if args.json:
        _print_json({"evaluated": done})
    else:
        print(f"{done} evaluation(s) posted", file=sys.stderr)


def _run_when_reachable(client: Client, name: str, patience: float | None):
    """``client.run(name)``, tried again with backoff while the server is
    away (restarting, say) — ``patience`` seconds at most, ``None``: until
    it answers; what it refuses (an unknown run, a bad token) raises."""
    from .errors import PolyakError
    from .evals import _server_away

    delay, since, warned = 0.5, time.monotonic(), False
    while True:
        try:
            run = client.run(name)
        except PolyakError as e:
            if not _server_away(e) or (
                patience is not None and time.monotonic() - since >= patience
            ):
                raise
            if not warned:
                warned = True
                print(f"polyak eval: the server is away ({e}); trying again", file=sys.stderr)
            time.sleep(delay)
            delay = min(delay * 2, 10.0)
            continue
        if warned:
            print("polyak eval: the server answers again", file=sys.stderr)
        return run


def _eval_command(command: Command) -> None:
    p = command(
        "eval",
        "evaluate every snapshot's candidates with a script defining build_model() and "
        "evaluate(model) -> {metric: value}",
    )
    p.add_argument("run", help=RUN_HELP)
    p.add_argument("--script", required=True, help="a Python file with build_model and evaluate")
    p.add_argument(
        "--follow", action="store_true", help="keep evaluating new snapshots until stopped"
    )
    p.add_argument(
        "--until-finished",
        action="store_true",
        help="with --follow: stop once the run is finished and every snapshot evaluated",
    )
    p.add_argument("--profiles", default=None, help="comma-separated profiles (default all)")
    p.add_argument("--no-online", action="store_true", help="skip the online weights")
    p.add_argument("--device", default=None, help="where to evaluate (e.g. cuda:0)")
    p.add_argument(
        "--evaluator",
        default=None,
        help="name stored with each evaluation (one evaluation per candidate and evaluator)",
    )
    p.add_argument(
        "--tensorboard",
        metavar="DIR",
        default=None,
        help="also write each evaluation to TensorBoard scalars in DIR",
    )
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    p.set_defaults(func=cmd_eval)


#: Points asked for per series (the server's most): the whole series.
EXPORT_POINTS = 1_000_000
#: Sampled steps of per-tensor drift asked for (the server's most).
TENSOR_DRIFT_STEPS = 2000


def series_tag(series: dict[str, Any]) -> str:
    """A metric series' TensorBoard tag: its name, and ``/rank<r>`` for a
    rank's own series."""
    return (
        series["name"] if series.get("rank") is None else f"{series['name']}/rank{series['rank']}"
    )


def _summary_writer(command: str, directory: str | Path) -> Any:
    """torch's ``SummaryWriter`` into ``directory`` (TensorBoard is optional)."""
    try:
        from torch.utils.tensorboard import SummaryWriter
    except ImportError as e:
        raise SystemExit(
            f"polyak {command}: TensorBoard is not installed ({e}): pip install tensorboard"
        ) from e
    return SummaryWriter(log_dir=str(directory))


def cmd_export(client: Client, args: argparse.Namespace) -> None:
    """A run's metric series (the trainer's, ``ema_drift/<profile>``,
    ``ingest/...``), evaluations and, with ``--tensor-drift``, each
    tensor's drift as TensorBoard scalars in a directory."""
    from tqdm.auto import tqdm

    from .trackers import TensorBoardLog

    out = Path(args.tensorboard)
    if out.is_dir() and any(out.glob("events.out.tfevents.*")):
        raise SystemExit(
            f"polyak export: {out} already holds TensorBoard event files "
            "(a second export would draw every point twice): give a new directory"
        )
    run = client.run(args.run)
    series = client.request(
        "GET", f"{run.path}/metrics", params={"limit": EXPORT_POINTS}, token=run.read_token
    ).json()["series"]
    evaluations = run.evals()
    drift = (
        [run.tensor_drift(profile, limit=TENSOR_DRIFT_STEPS) for profile in run.profiles]
        if args.tensor_drift
        else []
    )
    total = (
        sum(len(s["points"]) for s in series)
        + sum(len(e["metrics"]) for e in evaluations)
        + sum(v is not None for d in drift for row in d["values"] for v in row)
    )
    writer = _summary_writer("export", out)
    tensorboard = TensorBoardLog(writer, with_evaluator=True)
    bar = tqdm(
        total=total,
        unit="scalar",
        desc=f"{run.name} export",
        disable=args.no_progress or not sys.stderr.isatty(),
    )
    try:
        for s in series:
            tag = series_tag(s)
            for step, value, at_ms in s["points"]:
                tensorboard.scalar(tag, value, step, at_ms / 1000.0)
            bar.update(len(s["points"]))
        for e in evaluations:
            tensorboard.evaluation(e)
            bar.update(len(e["metrics"]))
        for d in drift:
            for tensor, row in zip(d["tensors"], d["values"], strict=True):
                tag = f"tensor_drift/{d['profile']}/{tensor}"
                points = [
                    (step, v) for step, v in zip(d["steps"], row, strict=True) if v is not None
                ]
                for step, value in points:
                    tensorboard.scalar(tag, value, step)
                bar.update(len(points))
    finally:
        bar.close()
        writer.close()
    summary = {
        "directory": str(out),
        "series": len(series),
        "evaluations": len(evaluations),
        "scalars": total,
    }
    if args.json:
        _print_json(summary)
    else:
        print(
            f"{total} scalars ({len(series)} series, {len(evaluations)} evaluations) "
            f"written to {out}"
        )


def _export_command(command: Command) -> None:
    p = command(
        "export",
        "write a run's metrics, EMA drift and evaluations as TensorBoard scalars",
    )
    p.add_argument("run", help=RUN_HELP)
    p.add_argument(
        "--tensorboard",
        required=True,
        metavar="DIR",
        help="the directory to write the event file into (tensorboard --logdir DIR)",
    )
    p.add_argument(
        "--tensor-drift",
        action="store_true",
        help="also each tensor's EMA drift (tensor_drift/<profile>/<tensor>; newest 2000 samples)",
    )
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    p.set_defaults(func=cmd_export)


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        with Client(args.url, args.token) as client:
            try:
                args.func(client, args)
            except PolyakError as e:
                print(f"polyak: {e}", file=sys.stderr)
                return 1
        sys.stdout.flush()
    except BrokenPipeError:
        # The reader went away (`... | head`): stop quietly, as a command
        # killed by SIGPIPE would; Python would print a traceback at exit
        # while flushing stdout into the closed pipe.
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        os.close(devnull)
        return 141
    return 0
