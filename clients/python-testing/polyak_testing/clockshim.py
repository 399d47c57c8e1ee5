"""A wall clock the test controls: an ``LD_PRELOAD`` shim over
``clock_gettime(CLOCK_REALTIME)`` (what Rust's ``SystemTime::now`` reads)
that adds the offset, in milliseconds, written in a file the test owns.

The monotonic clock is left alone, so timeouts and intervals inside the
server keep their meaning: only what it believes the date is moves, as
after an NTP step or a VM restored from an image.
"""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

SOURCE = r"""
#define _GNU_SOURCE
#include <dlfcn.h>
#include <stdio.h>
#include <stdlib.h>
#include <time.h>

typedef int (*clock_gettime_fn)(clockid_t, struct timespec *);

static long long offset_ms(void) {
    const char *path = getenv("POLYAK_TEST_CLOCK_OFFSET_FILE");
    if (!path) return 0;
    FILE *f = fopen(path, "r");
    if (!f) return 0;
    long long ms = 0;
    if (fscanf(f, "%lld", &ms) != 1) ms = 0;
    fclose(f);
    return ms;
}

int clock_gettime(clockid_t id, struct timespec *ts) {
    static clock_gettime_fn real;
    if (!real) real = (clock_gettime_fn)dlsym(RTLD_NEXT, "clock_gettime");
    int rc = real(id, ts);
    if (rc == 0 && id == CLOCK_REALTIME) {
        long long ns = (long long)ts->tv_sec * 1000000000LL + ts->tv_nsec
            + offset_ms() * 1000000LL;
        ts->tv_sec = ns / 1000000000LL;
        ts->tv_nsec = ns % 1000000000LL;
    }
    return rc;
}
"""


class Clock:
    """The shim built in ``directory``; ``env`` starts a process under it,
    ``step(ms)`` moves its wall clock by ``ms`` (negative: back)."""

    def __init__(self, directory: Path):
        cc = shutil.which("cc") or shutil.which("gcc")
        if cc is None:
            raise RuntimeError("no C compiler for the clock shim")
        directory.mkdir(parents=True, exist_ok=True)
        src = directory / "clockshim.c"
        src.write_text(SOURCE)
        self.library = directory / "libclockshim.so"
        subprocess.run(
            [cc, "-shared", "-fPIC", "-O2", "-o", str(self.library), str(src), "-ldl"],
            check=True,
            capture_output=True,
        )
        self.offset_file = directory / "offset_ms"
        self.offset_ms = 0
        self.offset_file.write_text("0")

    @property
    def env(self) -> dict[str, str]:
        return {
            "LD_PRELOAD": str(self.library),
            "POLYAK_TEST_CLOCK_OFFSET_FILE": str(self.offset_file),
        }

    def step(self, ms: int) -> None:
        self.offset_ms += ms
        tmp = self.offset_file.with_suffix(".tmp")
        tmp.write_text(str(self.offset_ms))
        tmp.replace(self.offset_file)
