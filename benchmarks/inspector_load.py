"""How long the inspector's Trajectories page takes to show a run's first 1,000 trajectories, in Chromium.

    python -m benchmarks.inspector_load RUN [--repeat 5]

Uses the ledger at LOOPLINE_DATABASE_URL (or the embedded one) and a run with at least 1,000
trajectories (a quickstart run has 2,048). Starts `loopline inspect`, opens the page in headless
Chromium (Debian's `chromium`, driven by Playwright) and times navigation until the table is drawn
(its caption and its canvas); the first load (cold caches, tokenizer) is reported apart.
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import time
import urllib.request


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("run")
    parser.add_argument("--repeat", type=int, default=5)
    args = parser.parse_args()
    from playwright.sync_api import sync_playwright

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    server = subprocess.Popen(
        [sys.executable, "-m", "loopline.cli", "inspect", "--port", str(port)],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True,
    )
    try:
        while True:
            try:
                urllib.request.urlopen(f"http://127.0.0.1:{port}/_stcore/health", timeout=2)
                break
            except OSError:
                time.sleep(0.3)
        url = f"http://127.0.0.1:{port}/?page=trajectories&run={args.run}"
        with sync_playwright() as p:
            browser = p.chromium.launch(executable_path=shutil.which("chromium"), args=["--no-sandbox"])
            times = []
            for _ in range(args.repeat + 1):
                page = browser.new_page(viewport={"width": 1400, "height": 1000})
                started = time.perf_counter()
                page.goto(url)
                caption = page.get_by_text(re.compile(r"^\d+ of \d+ trajectories"))
                caption.first.wait_for(timeout=60_000)
                page.locator('[data-testid="stDataFrame"] canvas').first.wait_for(timeout=60_000)  # the table drawn
                times.append(time.perf_counter() - started)
                shown = caption.first.inner_text().split(";")[0]
                page.close()
            browser.close()
    finally:
        os.killpg(server.pid, signal.SIGKILL)
    print(f"{shown}: first load {times[0]:.2f} s; then median {statistics.median(times[1:]):.2f} s "
          f"({', '.join(f'{t:.2f}' for t in times[1:])})")


if __name__ == "__main__":
    main()
