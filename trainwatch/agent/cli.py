"""``trainwatch agent``: the per-node daemon (see docs/agent.md)."""

from __future__ import annotations

import json
import sys
from typing import Any

import click

from trainwatch.agent.config import load_config
from trainwatch.agent.config_child import settings_in_child
from trainwatch.config.clitypes import RUN_DIR_PATH
from trainwatch.contract.ports import AGENT_LISTEN


@click.command("agent")
@click.argument("run_dir_args", nargs=-1, metavar="[RUN_DIR]...",
                type=RUN_DIR_PATH)
@click.option("--run-dir", "run_dirs", multiple=True, type=RUN_DIR_PATH,
              help="Run directory to watch (repeatable; or give them as RUN_DIR...).")
@click.option("--discover", "discover", multiple=True, type=RUN_DIR_PATH,
              help="Folder whose sub-folders are run directories (re-scanned; repeatable).")
@click.option("--config", "config_file", type=click.Path(dir_okay=False),
              help="Agent YAML config (see deploy/agent.yaml). SIGHUP reloads it.")
@click.option("--listen", default=None, metavar="HOST:PORT",
              help=f"Where to serve /metrics, /status, /healthz [{AGENT_LISTEN}].")
@click.option("--check-config", is_flag=True,
              help="Validate the config, print it as JSON and exit (0 ok, 2 invalid).")
def agent(run_dir_args, run_dirs, discover, config_file, listen, check_config) -> None:
    """Run the node agent: collectors, stall and straggler detection, HTTP endpoints.

    Binds 127.0.0.1 unless --listen says otherwise. SIGHUP reloads --config;
    SIGTERM stops cleanly.
    """
    run_dirs = tuple(dict.fromkeys((*run_dir_args, *run_dirs)))
    if check_config:
        config = load_config(config_file, run_dirs=run_dirs, discover=discover, listen=listen)
        click.echo(json.dumps({k: v for k, v in vars(config).items()}, indent=1, default=str))
        return
    # The daemon validates its file (at start and on SIGHUP) in a child process: pydantic
    # and the config models would stay in its memory for its whole life.
    reload_args: dict[str, Any] = {"run_dirs": run_dirs, "discover": discover, "listen": listen,
                   "read": settings_in_child}
    config = load_config(config_file, **reload_args)
    from trainwatch.agent.daemon import Agent
    from trainwatch.agent.malloc import tune_malloc
    tune_malloc()  # this process is the agent's own: before its threads start
    Agent(config, reload_args=reload_args, say=click.echo).run_forever()
    sys.stdout.flush()
