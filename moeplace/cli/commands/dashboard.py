"""``place dashboard [RUN_DIR] [--port P]``: explore a run directory (what ``place demo --out`` writes) in
the browser. Runs ``streamlit run`` on ``dashboard/app.py`` with the run directory passed in
``$MOEPLACE_RUN_DIR``; Ctrl-C stops it."""
from __future__ import annotations

import importlib.util
import os
import signal
import subprocess
import sys
from pathlib import Path

from moeplace import dashboard
from moeplace.cli import flags
from moeplace.foundation.errors import InputError
from moeplace.foundation.files import STOP_SIGNALS


def register(sub) -> None:
    p = sub.add_parser("dashboard", help="explore a run directory in the browser (Streamlit)",
                       description="Pages: Overview (what the run directory holds), Traces, Placement (scores, launch "
                                   "commands and engine exports), Plan, Simulate, Sweep (frontier in GPUs and in "
                                   "cost). Serves until Ctrl-C.")
    p.add_argument("run_dir", nargs="?", default="run", metavar="RUN_DIR",
                   help="directory written by `place demo --out` (default: run)")
    p.add_argument("--port", type=flags.port, default=8501, help="port to serve on (default 8501)")
    p.add_argument("--address", default="localhost",
                   help="address to listen on (default localhost; 0.0.0.0 serves other machines)")
    p.add_argument("--headless", action="store_true", help="do not open a browser window")
    p.set_defaults(func=run)


def streamlit_command(run_dir: Path, port: int, address: str, headless: bool) -> tuple[list[str], dict[str, str]]:
    """The ``streamlit run`` command line and environment that serve the dashboard for ``run_dir``."""
    app = Path(next(iter(dashboard.__path__))) / "app.py"
    cmd = [sys.executable, "-m", "streamlit", "run", str(app), "--server.port", str(port),
           "--server.address", address, "--server.headless", "true" if headless else "false",
           "--browser.gatherUsageStats", "false", "--global.developmentMode", "false",
           "--client.toolbarMode", "viewer"]
    env = {**os.environ, "MOEPLACE_RUN_DIR": str(run_dir.resolve())}
    return cmd, env


def run(args) -> int:
    run_dir = Path(args.run_dir).expanduser()
    if not run_dir.is_dir():
        raise InputError(f"{run_dir}: no such run directory (make one with `place demo --out {run_dir}`)")
    if not 0 < args.port < 65536:
        raise InputError(f"--port must be in 1..65535, got {args.port}")
    if importlib.util.find_spec("streamlit") is None:
        raise InputError("the dashboard needs streamlit: pip install 'moeplace[dashboard]'")
    cmd, env = streamlit_command(run_dir, args.port, args.address, args.headless)
    print(f"place dashboard: serving {run_dir} at http://{args.address}:{args.port}/ (Ctrl-C stops it)", flush=True)
    proc = subprocess.Popen(cmd, env=env)
    # A SIGTERM or SIGHUP to `place` (a service manager, a test, a closed terminal) stops the server too, not
    # only this wrapper (a SIGHUP that nohup ignores stays ignored).
    previous = {sig: signal.signal(sig, lambda signum, frame: proc.send_signal(signum)) for sig in STOP_SIGNALS
                if sig == signal.SIGTERM or signal.getsignal(sig) is not signal.SIG_IGN}
    try:
        return proc.wait()
    except KeyboardInterrupt:  # Ctrl-C reached both; let streamlit finish shutting down
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            proc.kill()
        raise
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
