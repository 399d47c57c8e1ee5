"""``Client`` (the server) and ``Run`` (one training run): the control plane.

Everything here is a small synchronous JSON call over the client's
:class:`~polyak._transport.Transport` (one keep-alive session); the data
plane (pushes) lives in :mod:`polyak.pusher`, which sends from its own
thread over connections of the same transport.

The methods under "Snapshots, downloads, metrics" follow the server's
``/snapshots``, ``/compare``, ``/resume``, ``/posthoc`` and ``/metrics``
endpoints; downloads stream (:mod:`polyak.downloads`).
"""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import IO, Any
from urllib.parse import quote

import httpx
import torch

from . import downloads, evals
from ._progress import progress_bar
from ._transport import Transport
from .contract import BestMode, snapshot_done, snapshot_id
from .errors import PolyakError
from .pusher import Pusher
from .shards import assemble
from .sysmetrics import SystemSampler
from .views import Best, Evaluation, PosthocResult, RankInfo, RunInfo, SnapshotInfo
from .wire import RankEma, read_safetensors

__all__ = ["DEFAULT_URL", "Client", "RankEma", "Run"]

#: Where ``polyak serve`` listens by default; ``$POLYAK_URL`` overrides it.
DEFAULT_URL = "http://127.0.0.1:8080"


class Client:
    """A polyak server.

    ``token`` is the admin token (``polyak serve --token``) or a run's token;
    without auth on the server leave it ``None``.
    """

    def __init__(
        self,
        url: str | None = None,
        token: str | None = None,
        *,
        timeout: float = 60.0,
    ) -> None:
        self.transport = Transport(
            url or os.environ.get("POLYAK_URL") or DEFAULT_URL,
            token if token is not None else os.environ.get("POLYAK_TOKEN") or None,
            timeout,
        )

    @property
    def url(self) -> str:
        return self.transport.url

    @property
    def token(self) -> str | None:
        """The default token of every call (``None``: no ``Authorization``)."""
        return self.transport.token

    @token.setter
    def token(self, value: str | None) -> None:
        self.transport.token = value

    @property
    def timeout(self) -> float:
        return self.transport.timeout

    # -- plumbing ---------------------------------------------------------

    def request(
        self,
        method: str,
        path: str,
        *,
        json: Any = None,
        params: Mapping[str, Any] | None = None,
        token: str | None = None,
        what: str = "",
    ) -> httpx.Response:
        """One call; a non-2xx answer raises :class:`PolyakError`."""
        return self.transport.request(
            method, path, json=json, params=params, token=token, what=what
        )

    def stream(
        self,
        path: str,
        *,
        params: Mapping[str, Any] | None = None,
        token: str | None = None,
    ) -> httpx.Response:
        """A streamed GET (the caller closes it); errors raise as ``request``."""
        return self.transport.stream(path, params=params, token=token)

    def close(self) -> None:
        self.transport.close()

    def __enter__(self) -> Client:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- runs -------------------------------------------------------------

    def create_run(
        self,
        name: str,
        world_size: int = 1,
        update_every: int = 1,
        profiles: Sequence[Mapping[str, Any]] | None = None,
        *,
        mirror: bool | None = None,
        copy_patterns: Sequence[str] | None = None,
        nonfinite: str | None = None,
        ema_dtype: str | None = None,
        device: str | None = None,
        snapshot_every: int | None = None,
        exist_ok: bool = False,
        tags: Sequence[str] | None = None,
        note: str | None = None,
        alerts: Mapping[str, Any] | None = None,
        **extra: Any,
    ) -> Run:
        """Creates a run (``POST /v1/runs``).

        With ``exist_ok`` an existing run of the same name is attached to
        instead (so every rank may call this), when its whole configuration
        (every field, defaults resolved by the server) is the one asked for;
        a different one raises ``run_exists`` with the differences
        (``profiles[0].beta: 0.9 != 0.5``, existing first).
        """
        body: dict[str, Any] = {
            "name": name,
            "world_size": world_size,
            "update_every": update_every,
        }
        if profiles is not None:
            body["profiles"] = [dict(p) for p in profiles]
        for key, value in (
            ("mirror", mirror),
            ("copy_patterns", list(copy_patterns) if copy_patterns is not None else None),
            ("nonfinite", nonfinite),
            ("ema_dtype", ema_dtype),
            ("device", device),
            ("snapshot_every", snapshot_every),
            ("tags", list(tags) if tags is not None else None),
            ("note", note),
            ("alerts", dict(alerts) if alerts is not None else None),
        ):
            if value is not None:
                body[key] = value
        body.update(extra)
        info = self.request(
            "POST",
            "/v1/runs",
            json=body,
            params={"exist_ok": "true"} if exist_ok else None,
            what=f"create run `{name}`",
        ).json()
        return Run(
            self,
            info,
            write_token=info.get("write_token"),
            read_token=info.get("read_token"),
        )

    def run(self, name: str, *, token: str | None = None) -> Run:
        """Attaches to an existing run (``GET /v1/runs/{run}``)."""
        info = self.request("GET", f"/v1/runs/{quote(name, safe='')}", token=token).json()
        return Run(self, info, write_token=token, read_token=token)

    def runs(self) -> list[RunInfo]:
        """Every run the caller may read."""
        return [RunInfo.from_json(r) for r in self.request("GET", "/v1/runs").json()["runs"]]

    def delete_run(self, name: str) -> None:
        self.request("DELETE", f"/v1/runs/{quote(name, safe='')}")

    def health(self) -> bool:
        """``GET /readyz`` answered 200."""
        return self.transport.ready()


class Run:
    """One training run on a server."""

    def __init__(
        self,
        client: Client,
        info: Mapping[str, Any],
        *,
        write_token: str | None = None,
        read_token: str | None = None,
    ) -> None:
        self.client = client
        self.info: dict[str, Any] = dict(info)
        self.name: str = str(info["name"])
        self.config: dict[str, Any] = dict(info["config"])
        self.write_token = write_token
        self.read_token = read_token
        self._system: tuple[SystemSampler, int | None] | None = None
        self._placement: dict[int, dict[str, Any]] | None = None
        self._placement_lock = threading.Lock()

    def __repr__(self) -> str:
        return f"Run({self.name!r}, world_size={self.world_size}, update_every={self.update_every}, profiles={self.profiles})"

    @property
    def path(self) -> str:
        return f"/v1/runs/{quote(self.name, safe='')}"

    @property
    def url(self) -> str:
        return self.client.url

    @property
    def transport(self) -> Transport:
        """The client's way to the server (pushers and downloads use it)."""
        return self.client.transport

    @property
    def world_size(self) -> int:
        return int(self.config["world_size"])

    @property
    def update_every(self) -> int:
        return int(self.config.get("update_every", 1))

    @property
    def profiles(self) -> list[str]:
        return [str(p["name"]) for p in self.config.get("profiles", [])]

    @property
    def keyframe_every(self) -> int:
        """Delta pushers send a full push every this many pushes."""
        return int(self.config.get("keyframe_every", 100))

    @property
    def copy_patterns(self) -> list[str]:
        return [str(p) for p in self.config.get("copy_patterns", [])]

    def _get(self, path: str = "", **params: Any) -> Any:
        return self.client.request(
            "GET", self.path + path, params=params, token=self.read_token
        ).json()

    def refresh(self) -> RunInfo:
        """The run as the server sees it now (ranks, last steps, health)."""
        self.info = self._get()
        self.config = dict(self.info["config"])
        return RunInfo.from_json(self.info)

    def ranks(self) -> list[RankInfo]:
        return [RankInfo.from_json(r) for r in self._get("/ranks")]

    def placement(self) -> dict[int, dict[str, Any]]:
        """Where each rank is held: ``{rank: {node, url, device, engine, epoch}}``."""
        return {int(r): dict(p) for r, p in self._get("/placement").items()}

    def owner_url(self, rank: int, *, refresh: bool = False) -> str:
        """The URL of the node holding ``rank``, where its pushes go: from the
        run's placement, read once and again with ``refresh`` (through any
        node of the last placement that answers, when this client's own
        server does not). A run held by one node is reached at this
        client's URL: the URL a node advertises may not be reachable from
        here (a port mapping, a proxy), and a push that reaches the wrong
        node is redirected anyway."""
        with self._placement_lock:
            if refresh or self._placement is None:
                self._placement = self._read_placement(self._placement)
            placement = self._placement
        if len({p.get("node") for p in placement.values()}) <= 1:
            return self.client.url
        url = placement.get(int(rank), {}).get("url")
        return str(url).rstrip("/") if url else self.client.url

    def _read_placement(self, last: dict[int, dict[str, Any]] | None) -> dict[int, dict[str, Any]]:
        try:
            return self.placement()
        except PolyakError as e:
            if e.code != "unavailable" or not last:
                raise
            failure = e
        others = sorted({str(p["url"]) for p in last.values() if p.get("url")} - {self.client.url})
        headers = self.transport.auth(self.read_token)
        for url in others:
            try:
                r = httpx.get(
                    f"{url.rstrip('/')}{self.path}/placement",
                    headers=headers,
                    timeout=self.client.timeout,
                )
            except httpx.HTTPError:
                continue
            if r.status_code == 200:
                return {int(k): dict(v) for k, v in r.json().items()}
        raise failure

    def rank(self, rank: int, *, layout: bool = False) -> RankInfo:
        """One rank; with ``layout`` its registered layout is in ``raw["layout"]``."""
        return RankInfo.from_json(
            self._get(f"/ranks/{int(rank)}", layout=str(layout).lower() if layout else None)
        )

    def delete(self) -> None:
        self.client.delete_run(self.name)

    # -- EMA of the live run ---------------------------------------------

    def rank_ema(
        self, rank: int, profile: str | None = None, *, dtype: str | None = None
    ) -> RankEma:
        """One rank's live EMA (``GET .../ranks/{rank}/ema``): the names,
        shapes and chunk metadata it pushed; averaged tensors in float32
        unless ``dtype`` asks for another float type."""
        r = self.client.request(
            "GET",
            f"{self.path}/ranks/{int(rank)}/ema",
            params={"profile": profile, "dtype": dtype},
            token=self.read_token,
        )
        return RankEma.read(r.content, rank, profile)

    def fetch_ema(
        self, profile: str | None = None, *, dtype: str | None = None
    ) -> dict[str, torch.Tensor]:
        """Whole tensors of the live EMA, joined from every rank's chunks
        (for a consistent cut at one step use :meth:`snapshot`)."""
        files = [self.rank_ema(r, profile, dtype=dtype) for r in range(self.world_size)]
        return assemble((f.tensors, f.chunks) for f in files)

    # -- pushing ----------------------------------------------------------

    def pusher(self, rank: int | None = None, **options: Any) -> Pusher:
        """A :class:`~polyak.Pusher` for ``rank`` (default: the
        ``torch.distributed`` rank, else 0). See ``Pusher`` for options."""
        if rank is None:
            import torch.distributed as dist

            rank = dist.get_rank() if dist.is_available() and dist.is_initialized() else 0
        return Pusher(self, rank, **options)

    def should_push(self, step: int) -> bool:
        """``step`` is an update step of this run (``step % update_every == 0``)."""
        return int(step) % self.update_every == 0

    # -- Snapshots, downloads, metrics (contract endpoints) ---------------

    def log(self, step: int, *, rank: int | None = None, **scalars: float) -> None:
        """Trainer scalars for the dashboard (``POST .../metrics``):
        ``run.log(step, loss=loss.item(), lr=lr)``."""
        body: dict[str, Any] = {
            "step": int(step),
            "values": {k: float(v) for k, v in scalars.items()},
        }
        if rank is not None:
            body["rank"] = int(rank)
        payload: Any = body
        if self._system is not None:
            sampler, sys_rank = self._system
            figures = sampler.maybe_sample()
            if figures:
                post: dict[str, Any] = {"step": int(step), "values": figures}
                if sys_rank is not None:
                    post["rank"] = sys_rank
                payload = [body, post]
        self.client.request("POST", f"{self.path}/metrics", json=payload, token=self.write_token)

    def enable_system_metrics(
        self, rank: int | None = None, *, min_interval: float = 10.0
    ) -> SystemSampler:
        """Posts this process's system figures (``sys/...``: CPU, memory,
        CUDA memory and utilisation) with :meth:`log`, at most once every
        ``min_interval`` seconds, as ``rank``'s series (default: this
        torch.distributed rank, or run-level without one)."""
        if rank is None and torch.distributed.is_available() and torch.distributed.is_initialized():
            rank = torch.distributed.get_rank()
        sampler = SystemSampler(min_interval)
        self._system = (sampler, None if rank is None else int(rank))
        return sampler

    def disable_system_metrics(self) -> None:
        self._system = None

    # Tags, note, alerts and what only an EMA service shows.

    def annotate(
        self,
        *,
        tags: Sequence[str] | None = None,
        note: str | None = None,
        alerts: Mapping[str, Any] | None = None,
        model_config: Mapping[str, Any] | None = None,
    ) -> dict[str, Any]:
        """Changes the run's tags, note, alert rules or model configuration
        (``PATCH /v1/runs/{run}``); returns them. ``model_config`` (a
        transformers ``config.to_dict()``) is written as ``config.json``
        into every ``layout="hf"`` download; a pusher sends it by itself at
        its first push of a model that has a ``config``."""
        body: dict[str, Any] = {}
        if model_config is not None:
            body["model_config"] = dict(model_config)
        if tags is not None:
            body["tags"] = list(tags)
        if note is not None:
            body["note"] = note
        if alerts is not None:
            body["alerts"] = dict(alerts)
        return self.client.request("PATCH", self.path, json=body, token=self.write_token).json()

    def alerts(self) -> dict[str, Any]:
        """``{firing, alerts: [...], rules}`` (``GET .../alerts``), newest first."""
        return self._get("/alerts")

    def ack_alert(self, alert_id: int) -> dict[str, Any]:
        return self.client.request(
            "POST", f"{self.path}/alerts/{int(alert_id)}/ack", token=self.write_token
        ).json()

    def tensor_drift(
        self, profile: str | None = None, *, limit: int | None = None
    ) -> dict[str, Any]:
        """Per-tensor EMA drift: ``{profile, tensors, steps, values}`` with
        ``values[i][j]`` the drift of ``tensors[i]`` at ``steps[j]``."""
        return self._get("/drift/tensors", profile=profile, limit=limit)

    def window(self, points: int | None = None) -> dict[str, Any]:
        """Each profile's beta and half-life in steps over the run."""
        return self._get("/window", points=points)

    def metrics(
        self,
        names: Sequence[str] | None = None,
        *,
        since_step: int | None = None,
        rank: int | str | None = None,
    ) -> dict[str, list[tuple[int, float]]]:
        """Metric series (``GET .../metrics``): ``{name: [(step, value), ...]}``
        for the trainer's scalars and the server's own (``ema_drift/<profile>``,
        ``ingest/...``). ``rank``: one rank's series, or ``"run"`` for the
        run-level ones; by default every series, a rank's named
        ``name@rank``."""
        data = self._get(
            "/metrics",
            names=",".join(names) if names is not None else None,
            since_step=since_step,
            rank=rank,
        )
        out: dict[str, list[tuple[int, float]]] = {}
        for series in data["series"]:
            key = (
                series["name"]
                if series.get("rank") is None
                else f"{series['name']}@{series['rank']}"
            )
            out[key] = [(int(p[0]), float(p[1])) for p in series["points"]]
        return out

    def snapshot(
        self,
        step: int | None = None,
        *,
        profiles: Sequence[str] | None = None,
        label: str | None = None,
        wait: bool = True,
        timeout: float = 600.0,
        poll: float = 0.5,
    ) -> SnapshotInfo:
        """Asks for a consistent cut (``POST .../snapshots``): every rank's
        EMA right after it applied ``step``. Without ``step``: the EMA as it
        is now, when every rank has applied the same step (after training,
        or between steps: complete at once); while ranks are mid-step, the
        next update step after the furthest rank. The row's
        ``detail["cut"]`` says which (``current`` or ``next_update``). A step
        some rank has passed is refused with 409. With ``wait`` polls it
        until it is complete, and raises if it failed; else returns the
        pending row (``id``, ``step``, ``status``)."""
        body: dict[str, Any] = {}
        if step is not None:
            body["step"] = int(step)
        if profiles is not None:
            body["profiles"] = list(profiles)
        if label is not None:
            body["label"] = label
        return self._start_snapshot("snapshots", body, wait=wait, timeout=timeout, poll=poll)

    def wait_snapshot(
        self,
        snapshot: str | int | Mapping[str, Any],
        *,
        timeout: float = 600.0,
        poll: float = 0.5,
    ) -> SnapshotInfo:
        """Polls a snapshot until it is ``complete`` (returned, with its
        files) or ``failed`` (raises ``snapshot_failed`` with the server's
        reason); ``snapshot_timeout`` after ``timeout`` seconds."""
        sid = snapshot_id(snapshot)
        deadline = time.monotonic() + timeout
        delay = min(0.05, poll)
        while True:
            snap = self.get_snapshot(sid)
            if snapshot_done(snap):
                return snap
            if time.monotonic() > deadline:
                raise PolyakError(
                    f"snapshot {sid} still `{snap.get('status')}` after {timeout:g}s",
                    code="snapshot_timeout",
                )
            time.sleep(delay)
            delay = min(poll, delay * 2)

    def snapshots(
        self, *, kind: str | None = None, status: str | None = None
    ) -> list[SnapshotInfo]:
        """The run's snapshots, oldest first (optionally one ``kind``:
        ``manual``, ``periodic``, ``state``, ``posthoc``, ``merge``; or one
        ``status``)."""
        data = self._get("/snapshots", kind=kind, status=status)
        rows = data["snapshots"] if isinstance(data, dict) else data
        return [SnapshotInfo.from_json(r) for r in rows]

    def get_snapshot(self, snapshot: str | int | Mapping[str, Any]) -> SnapshotInfo:
        """One snapshot with its files (rank, part, sha256, bytes, step)."""
        return SnapshotInfo.from_json(self._get(f"/snapshots/{snapshot_id(snapshot)}"))

    def delete_snapshot(self, snapshot: str | int | Mapping[str, Any]) -> None:
        self.client.request(
            "DELETE",
            f"{self.path}/snapshots/{snapshot_id(snapshot)}",
            token=self.write_token,
        )

    def download(
        self,
        snapshot: str | int | Mapping[str, Any],
        profile: str | None = None,
        *,
        dtype: str | None = None,
        progress: bool | IO[str] = True,
        on_progress: Callable[[int, int | None], None] | None = None,
        connections: int | None = None,
    ) -> dict[str, torch.Tensor]:
        """Whole tensors of a snapshot (``layout=full``), loadable with
        ``model.load_state_dict`` of the unsharded model. ``profile``:
        default the snapshot's first; ``dtype``: ``bf16``, ``fp16``,
        ``fp32`` casts floating point tensors on the server.
        ``connections``: ranged requests side by side (default 4); every
        8 MiB block is checked against the digests the server states, and
        a block that differs is fetched again or raises
        ``download_corrupt``."""
        data = downloads.fetch_bytes(
            self,
            snapshot,
            profile,
            layout="full",
            dtype=dtype,
            progress=progress,
            on_progress=on_progress,
            connections=connections,
        )
        tensors, _ = read_safetensors(data)
        return tensors

    def download_to(
        self,
        snapshot: str | int | Mapping[str, Any],
        directory: str | os.PathLike[str],
        profile: str | None = None,
        *,
        layout: str = "full",
        dtype: str | None = None,
        progress: bool | IO[str] = True,
        on_progress: Callable[[int, int | None], None] | None = None,
        fsync: bool = True,
        connections: int | None = None,
    ) -> Path:
        """Streams a snapshot to ``directory``, through a temporary file
        (or directory) renamed into place (``fsync``: made durable before
        the rename, so a crash leaves the old file or the whole new one).
        ``layout="full"`` writes one ``.safetensors``
        file of whole tensors (named ``RUN-ID[-PROFILE][-DTYPE].safetensors``,
        or the path given when it ends in ``.safetensors``) and returns its path; ``"sharded"`` unpacks
        one file per rank (``rank-0000k.safetensors`` with
        ``DCP_SHARDING_INFO``, for ``torch.distributed.checkpoint.load``
        with ``HuggingFaceStorageReader``) and ``"hf"`` HF-style shards with
        their index, both into a directory whose path is returned.

        ``progress``: on stderr (``False``: none; a text stream: there), a
        tqdm bar where that is a terminal, else a line per 10 %. ``on_progress(bytes_done, bytes_total)`` is
        called as the bytes arrive.

        The file is fetched by byte ranges over ``connections`` (default 4)
        and every 8 MiB block of it checked against the digests the server
        states before it is renamed into place: a block that differs is
        fetched again, and if it still differs ``download_corrupt`` is
        raised. A download that fails leaves its temporary file
        (``NAME.part``, with ``NAME.part.json`` saying which blocks it
        holds); the next ``download_to`` of the same file fetches only the
        missing blocks (``If-Range``: if the server's file changed, all of
        it)."""
        return downloads.download_to(
            self,
            snapshot,
            Path(directory),
            profile,
            layout=layout,
            dtype=dtype,
            progress=progress,
            on_progress=on_progress,
            fsync=fsync,
            connections=connections,
        )

    def compare(
        self,
        a: str | int | Mapping[str, Any],
        b: str | int | Mapping[str, Any] = "live",
        profile: str | None = None,
        *,
        profile_b: str | None = None,
    ) -> dict[str, Any]:
        """Per-tensor norms, differences and cosines between two snapshots
        (or a snapshot and the live EMA)."""
        return dict(
            self._get(
                "/compare",
                a=snapshot_id(a),
                b=snapshot_id(b),
                profile=profile,
                profile_b=profile_b,
            )
        )

    def resume(
        self,
        step: int | None = None,
        *,
        steps_taken: int | None = None,
        allow_older: bool = False,
    ) -> dict[str, Any]:
        """Restores every rank's EMA from the newest complete snapshot at or
        before ``step`` (``POST .../resume``), for a trainer restarting
        from its own checkpoint.

        ``step`` is the *last step the checkpoint pushed*: the 0-based index
        of its last optimizer step, i.e. the number of optimizer steps taken
        minus one. Frameworks count steps taken (Lightning's and HF's
        ``global_step``, a checkpoint's ``step`` counter): pass that as
        ``steps_taken=N`` instead (``step = N - 1``). Give one of the two.

        When the newest snapshot is older than that step (the EMA would miss
        updates the trainer will not push again, e.g. a step off by one) the
        server refuses with ``snapshot_older``; ``allow_older=True`` restores
        it anyway, logs a warning and answers ``older: True``.

        Answers ``{snapshot, step, rank_steps, requested_step, older}``: the
        trainer goes on with ``attach(..., start_step=requested_step + 1)``
        and the EMA is exactly that of a run that never stopped."""
        if (step is None) == (steps_taken is None):
            raise ValueError("give `step` (the last step pushed) or `steps_taken`, not both")
        last = int(step) if step is not None else int(steps_taken) - 1  # type: ignore[arg-type]
        if last < 0:
            raise ValueError(
                f"step {last}: nothing was pushed before it (steps_taken counts from 1)"
            )
        body: dict[str, Any] = {"step": last}
        if allow_older:
            body["allow_older"] = True
        answer = dict(
            self.client.request(
                "POST", f"{self.path}/resume", json=body, token=self.write_token
            ).json()
        )
        if answer.get("older"):
            import logging

            logging.getLogger("polyak").warning(
                "polyak: run %s resumed from snapshot %s at step %s, older than step %s "
                "(allow_older): the EMA misses the updates in between",
                self.name,
                answer.get("snapshot"),
                answer.get("step"),
                last,
            )
        return answer

    def finish(
        self,
        *,
        label: str | None = None,
        wait: bool = True,
        timeout: float = 600.0,
        poll: float = 0.5,
    ) -> dict[str, Any]:
        """Ends the run (``POST .../finish``): takes the final snapshot at the
        furthest rank's last step (``label`` default ``final``) and marks the
        run finished, so that its health and ranks say ``finished`` rather
        than going stale, and pushes past that step are refused
        (``run_finished``). Call it once every rank has flushed its pushes.
        With ``wait`` the final snapshot is polled until complete. Answers
        ``{run, snapshot}`` (a :class:`RunInfo` and a :class:`SnapshotInfo`,
        or ``None`` when nothing was pushed); finishing again answers the
        same."""
        answer = dict(
            self.client.request(
                "POST",
                f"{self.path}/finish",
                json={"label": label} if label is not None else {},
                token=self.write_token,
            ).json()
        )
        self.info = dict(answer["run"])
        answer["run"] = RunInfo.from_json(answer["run"])
        snap = answer.get("snapshot")
        if snap is not None:
            answer["snapshot"] = (
                self.wait_snapshot(snap, timeout=timeout, poll=poll)
                if wait
                else SnapshotInfo.from_json(snap)
            )
        return answer

    def posthoc_plan(
        self,
        sigma_rel: float | Sequence[float],
        *,
        step: int | None = None,
        profiles: Sequence[str] | None = None,
        method: str | None = None,
    ) -> dict[str, Any]:
        """What a post-hoc synthesis would use, without writing anything
        (``GET .../posthoc/plan``): ``step``, ``usable_steps`` (the steps a
        synthesis can target: those with a stored power-profile snapshot),
        ``sources`` (oldest first) and per ``sigma_rel`` its ``weights``
        (one per source, summing to 1) and the fit ``residual`` (the
        relative L2 distance between the synthesised and the requested
        averaging profile: large when the snapshots are too sparse)."""
        sigmas = [sigma_rel] if isinstance(sigma_rel, (int, float)) else list(sigma_rel)
        return dict(
            self._get(
                "/posthoc/plan",
                sigma_rel=",".join(repr(float(s)) for s in sigmas),
                step=step,
                profiles=",".join(profiles) if profiles is not None else None,
                method=method,
            )
        )

    def posthoc(
        self,
        sigma_rel: float | Sequence[float],
        *,
        step: int | None = None,
        profiles: Sequence[str] | None = None,
        name: str | None = None,
        method: str | None = None,
        source_dtype: str | None = None,
        wait: bool = True,
        timeout: float = 600.0,
        poll: float = 0.5,
        progress: bool | IO[str] = False,
    ) -> SnapshotInfo | list[SnapshotInfo]:
        """Synthesises the EMA of another length after training (EDM2
        post-hoc EMA, ``POST .../posthoc``) from the stored snapshots of the
        run's ``power`` profiles (``profiles``: which; default all), at
        ``step``: a step where such a snapshot was stored (default the
        newest; any other is refused with the usable steps). The result is a
        snapshot of kind ``posthoc`` holding one profile, ``name`` (default
        ``posthoc``), whose ``detail`` has the sources, their weights and
        the fit ``residual``.

        ``sigma_rel`` may be a list (up to 32): one snapshot per value, all
        written in one pass over the sources; a list is answered with a
        list. ``method="ema_pytorch"`` solves as ema-pytorch's
        ``PostHocEMA.synthesize_ema_model`` (every source, any step up to the
        newest, float32 exponents, weights not scaled to sum to 1);
        ``source_dtype`` (``"fp16"``, ``"bf16"``) rounds each source to that
        dtype first. With ``wait`` polls until every result is complete
        (``progress``: a tqdm bar of the source bytes read)."""
        sweep = not isinstance(sigma_rel, (int, float))
        body: dict[str, Any] = {
            "sigma_rel": [float(s) for s in sigma_rel] if sweep else float(sigma_rel)  # type: ignore[union-attr]
        }
        if step is not None:
            body["step"] = int(step)
        if profiles is not None:
            body["profiles"] = list(profiles)
        if name is not None:
            body["name"] = name
        if method is not None:
            body["method"] = method
        if source_dtype is not None:
            body["source_dtype"] = source_dtype
        answer = self._post("posthoc", body)
        rows = [SnapshotInfo.from_json(r) for r in (answer["snapshots"] if sweep else [answer])]
        if wait:
            rows = self._wait_derived(rows, timeout=timeout, poll=poll, progress=progress)
        return rows if sweep else rows[0]

    def merge(
        self,
        snapshots: Sequence[str | int | Mapping[str, Any]] | None = None,
        *,
        last: int | None = None,
        weights: str = "uniform",
        alpha: float | None = None,
        name: str | None = None,
        wait: bool = True,
        timeout: float = 600.0,
        poll: float = 0.5,
        progress: bool | IO[str] = False,
    ) -> SnapshotInfo:
        """Averages the online weights of stored snapshots (checkpoint
        merging, ``POST .../merge``; the run needs ``mirror: true``):
        ``snapshots`` (ids or rows) or the ``last`` K complete ones, with
        ``weights`` ``"uniform"``, ``"linear"`` (1, 2, ..., K, newest
        heaviest) or ``"exp"`` (``alpha ** age``, newest age 0; default
        ``alpha`` 0.5). The result is a snapshot of kind ``merge`` holding
        one profile, ``name`` (default ``merged``), downloadable like any
        other."""
        body: dict[str, Any] = {"weights": weights}
        if snapshots is not None:
            body["snapshots"] = [snapshot_id(s) for s in snapshots]
        if last is not None:
            body["last"] = int(last)
        if alpha is not None:
            body["alpha"] = float(alpha)
        if name is not None:
            body["name"] = name
        row = SnapshotInfo.from_json(self._post("merge", body))
        if not wait:
            return row
        return self._wait_derived([row], timeout=timeout, poll=poll, progress=progress)[0]

    # -- evaluations (the worker and the sweep: polyak.evals) ---------------

    def post_eval(
        self,
        snapshot: str | int | Mapping[str, Any],
        profile: str,
        metrics: Mapping[str, float],
        *,
        evaluator: str | None = None,
    ) -> Evaluation:
        """Stores an evaluation of one candidate: a ``profile`` of a complete
        ``snapshot``, or ``"online"`` (its mirror). Posting the same numbers
        again is accepted; other numbers raise ``eval_conflict``. Answers the
        stored evaluation with its candidate's ``step``, ``kind``,
        ``sigma_rel`` and ``residual``."""
        body: dict[str, Any] = {
            "snapshot": snapshot_id(snapshot),
            "profile": profile,
            "metrics": {str(k): float(v) for k, v in metrics.items()},
        }
        if evaluator:
            body["evaluator"] = evaluator
        return Evaluation.from_json(
            self.client.request(
                "POST", f"{self.path}/evals", json=body, token=self.write_token
            ).json()
        )

    def evals(
        self,
        *,
        metric: str | None = None,
        profile: str | None = None,
        kind: str | None = None,
        evaluator: str | None = None,
        page_size: int | None = None,
    ) -> list[Evaluation]:
        """The run's evaluations by step, each with its candidate's ``step``,
        ``kind``, ``sigma_rel``, ``residual`` and ``sources``. The server
        answers in pages (``page_size`` each, its default when ``None``);
        this follows their ``next`` cursors and returns them all."""
        params = {
            "metric": metric,
            "profile": profile,
            "kind": kind,
            "evaluator": evaluator,
            "limit": page_size,
        }
        out: list[Evaluation] = []
        after: str | None = None
        while True:
            data = self.client.request(
                "GET",
                f"{self.path}/evals",
                params={**params, "after": after},
                token=self.read_token,
            ).json()
            out.extend(Evaluation.from_json(e) for e in data["evals"])
            after = data.get("next")
            if after is None:
                return out

    def best(
        self,
        metric: str,
        mode: str = "min",
        *,
        kind: str | None = None,
        profile: str | None = None,
        evaluator: str | None = None,
    ) -> Best:
        """The best evaluated candidate of ``metric``: ``{metric, mode,
        value, evaluation, download}`` (``download``: the path of its
        weights)."""
        return Best.from_json(
            self.client.request(
                "GET",
                f"{self.path}/best",
                params={
                    "metric": metric,
                    "mode": BestMode(mode).value,
                    "kind": kind,
                    "profile": profile,
                    "evaluator": evaluator,
                },
                token=self.read_token,
            ).json()
        )

    def posthoc_search(
        self,
        sigma_rel: Sequence[float],
        evaluate: Callable[[torch.nn.Module], Any],
        model: torch.nn.Module,
        step: int | None = None,
        profiles: Sequence[str] | None = None,
        **options: Any,
    ) -> list[PosthocResult]:
        """Evaluates a post-hoc sweep and returns its rows best first (see
        :func:`polyak.evals.posthoc_search`)."""
        return evals.posthoc_search(
            self, sigma_rel, evaluate, model, step=step, profiles=profiles, **options
        )

    def post_live_eval(
        self,
        metrics: Mapping[str, float],
        profile: str | None = None,
        *,
        step: int,
        evaluator: str | None = None,
        timeout: float = 600.0,
    ) -> Evaluation:
        """Posts metrics computed on the live EMA after ``step`` as an
        evaluation of that step's snapshot (a periodic one, or one taken
        for it; see :func:`polyak.evals.post_live_eval`). In a training
        loop, :meth:`polyak.Pusher.post_ema_eval` gives the step."""
        return evals.post_live_eval(
            self, metrics, profile, step=step, evaluator=evaluator, timeout=timeout
        )

    def _wait_derived(
        self,
        rows: list[SnapshotInfo],
        *,
        timeout: float,
        poll: float,
        progress: bool | IO[str],
    ) -> list[SnapshotInfo]:
        """Polls derived snapshots (written together) until all are complete,
        showing the server's progress (source bytes read) on a tqdm bar."""
        ids = [snapshot_id(r) for r in rows]
        # The server answers a derived snapshot with its job's total.
        total = next((r["progress"]["total"] for r in rows if r.get("progress")), None)
        deadline = time.monotonic() + timeout
        delay = min(0.05, poll)
        done: dict[str, SnapshotInfo] = {}
        with progress_bar(
            progress, total=total, desc=f"{self.name} {rows[0].get('kind', 'derived')} x{len(ids)}"
        ) as bar:
            while True:
                for sid in ids:
                    if sid in done:
                        continue
                    snap = self.get_snapshot(sid)
                    if snapshot_done(snap):
                        done[sid] = snap
                    elif snap.get("progress"):
                        p = snap["progress"]
                        bar.total = p["total"]
                        bar.n = p["done"]
                        bar.refresh()
                if len(done) == len(ids):
                    if bar.total:
                        bar.n = bar.total
                        bar.refresh()
                    return [done[sid] for sid in ids]
                if time.monotonic() > deadline:
                    raise PolyakError(
                        f"snapshots {ids} not complete after {timeout:g}s",
                        code="snapshot_timeout",
                    )
                time.sleep(delay)
                delay = min(poll, delay * 2)

    def _post(self, endpoint: str, body: dict[str, Any]) -> Any:
        """``POST .../{endpoint}`` with the run's write token; the JSON answer."""
        return self.client.request(
            "POST", f"{self.path}/{endpoint}", json=body, token=self.write_token
        ).json()

    def _start_snapshot(
        self, endpoint: str, body: dict[str, Any], *, wait: bool, timeout: float, poll: float
    ) -> SnapshotInfo:
        """POSTs ``body`` to ``.../{endpoint}``; with ``wait`` polls the
        snapshot it created until it is complete."""
        snap = SnapshotInfo.from_json(self._post(endpoint, body))
        if not wait:
            return snap
        return self.wait_snapshot(snap, timeout=timeout, poll=poll)
