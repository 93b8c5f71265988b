"""How long the inspector's Trajectories page takes to show a run's first 1,000 trajectories, in Chromium.

    python -m benchmarks.inspector_load RUN [--repeat 5]

Uses the ledger at LOOPLINE_DATABASE_URL (or the embedded one) and a run with at least 1,000
trajectories (a quickstart run has 2,048). Starts `loopline inspect`, opens the page in headless
Chromium (Debian's `chromium`, driven by Playwright) and times navigation until the table is drawn
(its caption and its canvas); the first load (cold caches, tokenizer) is reported apart. Beside it, in
the same browser and alternating with it, a bare Streamlit app showing only a caption and a 1,000-row
table: Streamlit's own floor on this machine, so the ratio says what the inspector adds.
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
import tempfile
import urllib.request
from pathlib import Path


BARE_APP = """
import pandas as pd
import streamlit as st
st.caption("1000 of 1000 trajectories")
st.dataframe(pd.DataFrame({"id": [f"{i:036d}" for i in range(1000)], "reward": [0.0] * 1000}), hide_index=True)
"""


def _serve(command: list[str]) -> tuple[subprocess.Popen, int]:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    server = subprocess.Popen([*command, "--port" if command[-1] == "inspect" else "--server.port", str(port)],
                              stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
    while True:
        try:
            urllib.request.urlopen(f"http://127.0.0.1:{port}/_stcore/health", timeout=2)
            return server, port
        except OSError:
            time.sleep(0.3)


def _loads(browser, url: str, repeat: int) -> tuple[list[float], str]:
    """Seconds from navigation until the caption and the table's canvas are drawn, `repeat` + 1 times."""
    times, shown = [], ""
    for _ in range(repeat + 1):
        page = browser.new_page(viewport={"width": 1400, "height": 1000})
        started = time.perf_counter()
        page.goto(url)
        caption = page.get_by_text(re.compile(r"^\d+ of \d+ trajectories"))
        caption.first.wait_for(timeout=60_000)
        page.locator('[data-testid="stDataFrame"] canvas').first.wait_for(timeout=60_000)  # the table drawn
        times.append(time.perf_counter() - started)
        shown = caption.first.inner_text().split(";")[0]
        page.close()
    return times, shown


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("run")
    parser.add_argument("--repeat", type=int, default=5)
    args = parser.parse_args()
    from playwright.sync_api import sync_playwright

    bare = Path(tempfile.mkdtemp()) / "bare.py"
    bare.write_text(BARE_APP)
    servers = [
        _serve([sys.executable, "-m", "loopline.cli", "inspect"]),
        _serve([sys.executable, "-m", "streamlit", "run", str(bare), "--server.headless", "true", "--browser.gatherUsageStats", "false"]),
    ]
    try:
        with sync_playwright() as p:
            browser = p.chromium.launch(executable_path=shutil.which("chromium"), args=["--no-sandbox"])
            ours, floor = [], []
            for _ in range(2):  # alternated, so machine noise hits both alike
                times, shown = _loads(browser, f"http://127.0.0.1:{servers[0][1]}/?page=trajectories&run={args.run}", args.repeat)
                ours += times[1:] if ours else times
                floor += _loads(browser, f"http://127.0.0.1:{servers[1][1]}/", args.repeat)[0][1:]
            browser.close()
    finally:
        for server, _ in servers:
            os.killpg(server.pid, signal.SIGKILL)
    mine, base = statistics.median(ours[1:]), statistics.median(floor)
    print(f"{shown}: first load {ours[0]:.2f} s; then median {mine:.2f} s ({', '.join(f'{t:.2f}' for t in ours[1:])})")
    print(f"a bare Streamlit page with a 1,000-row table, same browser: median {base:.2f} s; inspector / bare = {mine / base:.2f}")


if __name__ == "__main__":
    main()
