"""A bounded soak of the real server: what a long run does to its resources.

Several ranks push shards as fast as they can for a fixed time, with
everything a long run turns on at once: periodic snapshots with retention,
crash-recovery state every few seconds, drift samples, trainer metrics, and
a download of the newest snapshot every sampling interval. Every interval
the script samples the server's anonymous and file-backed RSS, threads,
open descriptors and the size of its data directory. It prints the samples
and a summary (errors, pushes, the medians of the first and second halves
of the anonymous RSS: a leak shows as a second half above the first), and
plots the samples to ``benches/soak.png`` unless ``--no-plot``.

    .venv/bin/python benches/soak.py --seconds 420

Exits non-zero when a push or a download failed. Nothing is timed.
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
sys.path.insert(0, str(ROOT / "clients" / "python"))
sys.path.insert(0, str(ROOT / "clients" / "python-testing"))
sys.path.insert(0, str(HERE))

from e2e import MB, Http, safetensors_body  # noqa: E402
from polyak import Client  # noqa: E402
from polyak_testing import PolyakServer  # noqa: E402


def resources(pid: int, data: Path) -> dict[str, int]:
    def field(text: str, key: str) -> int:
        line = next(x for x in text.splitlines() if x.startswith(key))
        return int(line.split()[1])

    rollup = Path(f"/proc/{pid}/smaps_rollup").read_text()
    status = Path(f"/proc/{pid}/status").read_text()
    anon = field(rollup, "Anonymous:")
    return {
        "anon_mib": anon >> 10,
        "file_mib": (field(rollup, "Rss:") - anon) >> 10,
        "threads": field(status, "Threads:"),
        "fds": len(os.listdir(f"/proc/{pid}/fd")),
        "data_mib": sum(f.stat().st_size for f in data.rglob("*") if f.is_file()) >> 20,
    }


def pusher(url: str, rank: int, body: bytes, deadline: float, state: dict) -> None:
    h = Http(url)
    step = 0
    while time.monotonic() < deadline:
        status, out = h.put(f"/v1/runs/soak/ranks/{rank}/steps/{step}", body)
        if status != 200:
            state["errors"].append((rank, step, status, out))
            time.sleep(0.2)
            continue
        step += 1
        state["steps"][rank] = step
    h.close()


def plot(samples: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    t = [s["t"] for s in samples]
    fig, (a, b) = plt.subplots(1, 2, figsize=(11, 3.8))
    a.plot(t, [s["anon_mib"] for s in samples], "o-", label="anonymous RSS")
    a.plot(t, [s["file_mib"] for s in samples], "s--", label="file-backed RSS")
    a.set(xlabel="seconds", ylabel="MiB", title="server memory")
    a.set_ylim(bottom=0)
    a.legend()
    b.plot(t, [s["data_mib"] for s in samples], "o-", label="data directory (MiB)")
    b.plot(t, [s["fds"] * 10 for s in samples], "s--", label="open descriptors x 10")
    b.set(xlabel="seconds", title="disk and descriptors")
    b.set_ylim(bottom=0)
    b.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--bin", default=str(ROOT / "target" / "release" / "polyak"))
    ap.add_argument("--seconds", type=float, default=420)
    ap.add_argument("--ranks", type=int, default=4)
    ap.add_argument("--shard-mb", type=int, default=16, help="fp32 megabytes per rank")
    ap.add_argument("--interval", type=float, default=10)
    ap.add_argument("--no-plot", action="store_true")
    args = ap.parse_args()

    tmp = Path(tempfile.mkdtemp(prefix="polyak-soak-"))
    try:
        with PolyakServer(tmp / "data", binary=args.bin) as srv:
            client = Client(srv.url)
            client.create_run(
                "soak",
                world_size=args.ranks,
                profiles=[
                    {"name": "ema", "kind": "constant", "beta": 0.999},
                    {"name": "edm", "kind": "power", "sigma_rel": 0.05},
                ],
                snapshot_every=25,
                retention={"keep_last": 3},
                persist_every_secs=5,
                mirror=True,
                drift_every=10,
            )
            run = client.run("soak")
            numel = args.shard_mb * MB // 4
            bodies = [safetensors_body(numel, seed=r) for r in range(args.ranks)]
            deadline = time.monotonic() + args.seconds
            state: dict = {"errors": [], "steps": [0] * args.ranks}
            threads = [
                threading.Thread(target=pusher, args=(srv.url, r, bodies[r], deadline, state))
                for r in range(args.ranks)
            ]
            for t in threads:
                t.start()
            samples: list[dict] = []
            downloads, download_errors = 0, []
            start = time.monotonic()
            while time.monotonic() + args.interval < deadline:
                time.sleep(args.interval)
                step = min(state["steps"])
                run.log(step, loss=1.0 / (1 + step))
                done = [s for s in run.snapshots() if s["status"] == "complete"]
                periodic = [s for s in done if s["kind"] == "periodic"]
                if periodic:
                    try:
                        path = run.download_to(
                            periodic[-1], str(tmp / "dl"), profile="ema", progress=False
                        )
                        path.unlink()
                        downloads += 1
                    except Exception as e:  # reported, counted as a failure
                        download_errors.append(repr(e))
                sample = {"t": round(time.monotonic() - start), "step": step}
                sample.update(resources(srv.pid, tmp / "data"))
                sample["snapshots"] = len(done)
                samples.append(sample)
                print(
                    "t={t:4d}s step={step:6d} anon={anon_mib:5d} MiB file={file_mib:4d} MiB "
                    "threads={threads:3d} fds={fds:3d} data={data_mib:5d} MiB "
                    "snapshots={snapshots}".format(**sample),
                    flush=True,
                )
            for t in threads:
                t.join()
            skipped = sum(
                float(line.rsplit(" ", 1)[1])
                for line in client.request("GET", "/metrics").text.splitlines()
                if line.startswith('polyak_periodic_snapshots_skipped_total{run="soak"}')
            )
            client.close()
    finally:
        shutil.rmtree(tmp, ignore_errors=True)

    if not samples:
        print("no samples: --seconds must exceed --interval")
        return 2
    half = max(1, len(samples) // 2)
    first = statistics.median(s["anon_mib"] for s in samples[:half])
    second = statistics.median(s["anon_mib"] for s in samples[half:] or samples[-1:])
    print(
        f"\n{sum(state['steps'])} pushes from {args.ranks} ranks, {len(state['errors'])} errors; "
        f"{downloads} downloads, {len(download_errors)} failed; "
        f"{skipped:.0f} periodic snapshots skipped (backlog full)"
    )
    print(
        f"anonymous RSS median: first half {first:.0f} MiB, second half {second:.0f} MiB "
        f"(ratio {second / first:.3f}); descriptors {min(s['fds'] for s in samples)}"
        f"..{max(s['fds'] for s in samples)}; data directory at most "
        f"{max(s['data_mib'] for s in samples)} MiB"
    )
    for e in state["errors"][:3] + download_errors[:3]:
        print("error:", e)
    if not args.no_plot:
        plot(samples, HERE / "soak.png")
    return 1 if state["errors"] or download_errors else 0


if __name__ == "__main__":
    sys.exit(main())
