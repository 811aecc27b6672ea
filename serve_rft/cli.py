"""``serve-rft``: the command line (typer + rich).

Every command that takes a config accepts ``--config FILE`` (YAML) and any number of
``--set section.field=value`` overrides, e.g. ``--set explorer.num_replicas=3
--set trainer.lr=5e-4``, layered over the environment (`serve_rft.config.load_config`). See
``configs/default.yaml`` for every field. Help text is what users read: commands carry it in
``help=``, their docstrings stay for developers.
"""

from __future__ import annotations

import contextlib

import json
import logging
import sys
import time
from enum import Enum
from pathlib import Path
from typing import Optional

import typer
from rich.console import Console
from rich.markup import escape

import serve_rft
from serve_rft.config import Config, ServiceConfig, explain, load_config, schema_text

# show_locals off: a traceback's locals would print the config (Redis password, API keys); older
# typer releases (pyproject allows >=0.12) default it to True
cli = typer.Typer(add_completion=False, no_args_is_help=True, pretty_exceptions_show_locals=False,
                  help="Serve an LLM with vLLM on Ray Serve and improve it online with RL.")
console = Console(stderr=True)

ConfigOpt = typer.Option(None, "--config", "-c", metavar="FILE",
                         help="YAML run config (configs/*.yaml); settings from SERVE_RFT_<SECTION>__<FIELD> "
                         "environment variables and --set go over it.")
SetOpt = typer.Option([], "--set", "-s", metavar="SECTION.FIELD=VALUE",
                      help="Set a config field, e.g. trainer.lr=5e-4 (repeatable; wins over the file "
                      "and the environment).")
ModelOpt = typer.Option(None, "--model", "-m", help="A Hugging Face model directory or hub id "
                        "(owner/name, from the Hugging Face cache or downloaded; default: the embedded model).")
PortOpt = typer.Option(None, "--port", "-p", help="HTTP port (0: pick a free one).")
HostOpt = typer.Option(None, "--host", help="Address to bind (service.host). Other than loopback it needs "
                       "API keys or service.allow_unauthenticated=true.")


class Mode(str, Enum):
    both = "both"
    serve = "serve"
    train = "train"


class Ingress(str, Enum):
    haproxy = "haproxy"
    proxy = "proxy"


def _config(config: Optional[Path], sets: list[str], model: Optional[str] = None,
            port: Optional[int] = None, host: Optional[str] = None) -> Config:
    overrides = list(sets)
    if model:
        overrides.append(f"model.path={model}")
    if port is not None:
        overrides.append(f"service.port={port}")
    if host is not None:
        overrides.append(f"service.host={host}")
    try:
        return load_config(config, overrides)
    except Exception as e:  # a config error is the user's: one line, no traceback, no value given
        console.print(f"[red]config error:[/red] {escape(explain(e))}", highlight=False, soft_wrap=True)
        raise typer.Exit(2) from None


def _service_log() -> None:
    """Show the service's lifecycle log (``serve_rft.service``, INFO: each stop phase's seconds,
    leftovers the keeper ended) on stderr, once."""
    logger = logging.getLogger("serve_rft.service")
    if not logger.handlers:
        handler = logging.StreamHandler(sys.stderr)
        handler.setFormatter(logging.Formatter("[serve-rft] %(message)s"))
        logger.addHandler(handler)
        logger.setLevel(logging.INFO)


def _kept(cfg: Config) -> None:
    """Unless this is already the service process, run this same command as one under a keeper
    (`serve_rft.service.keeper`: the service in a session of its own, every process it starts
    ended on exit) and exit with the keeper's status."""
    from serve_rft.service import keeper

    _service_log()
    if keeper.inside():
        return
    raise typer.Exit(keeper.keep([sys.executable, "-m", "serve_rft.cli", *sys.argv[1:]],
                                 cfg.service.shutdown_grace_s))


def _runnable(cfg: Config, mode: Mode = Mode.both) -> Config:
    """Exit 2 with a plain message if ``cfg`` would serve openly on a non-loopback address
    (any mode but train binds HTTP; `serve_rft.config.service.check_exposure`, the warning printed
    when that is allowed), this machine cannot run it (e.g. nccl without CUDA;
    `serve_rft.control.preflight`) or ``mode`` cannot work with it
    (`serve_rft.service.launcher.check_mode`). Starts nothing."""
    from serve_rft.config.service import check_exposure
    from serve_rft.control import preflight
    from serve_rft.service.launcher import check_mode

    try:
        warning = check_exposure(cfg.service, cfg.service.host) if mode is not Mode.train else None
        if warning:
            console.print(f"[bold yellow]warning:[/bold yellow] {warning}", highlight=False)
        preflight(cfg)
        check_mode(cfg, mode.value)
    except ValueError as e:
        console.print(f"[red]config error:[/red] {escape(str(e))}", highlight=False, soft_wrap=True)
        raise typer.Exit(2) from None
    return cfg


def _print_version(value: bool) -> None:
    if value:
        print(f"serve-rft {serve_rft.__version__}")
        raise typer.Exit()


@cli.callback()
def _options(version: bool = typer.Option(False, "--version", callback=_print_version, is_eager=True,
                                           help="Print the version and exit.")) -> None:
    # the program's own options (--version); its help text is the Typer's
    pass


config_cli = typer.Typer(no_args_is_help=True, help="Print, check or describe a run config; starts nothing.")
cli.add_typer(config_cli, name="config")

SECRET = "<redacted>"


def _hidden(value):
    """A secret's stand-in: a URL without its password (`serve_rft.buffer.redis_auth.redacted`), a
    list of keys its length, anything else `SECRET`; None stays None."""
    from serve_rft.buffer.redis_auth import redacted

    if isinstance(value, str) and "://" in value:
        return redacted(value)
    if isinstance(value, list):
        return [SECRET] * len(value)
    return None if value is None else SECRET


def shown(cfg: Config) -> dict:
    """``cfg`` as plain data to print, every field kept out of reprs (``repr=False``: API keys,
    tenants' keys, the Redis URL) replaced by its stand-in (`_hidden`)."""
    from pydantic import BaseModel

    def walk(model: BaseModel, data: dict) -> None:
        for name, field in type(model).model_fields.items():
            value = getattr(model, name)
            if not field.repr:
                data[name] = _hidden(value)
            elif isinstance(value, BaseModel):
                walk(value, data[name])
            elif isinstance(value, dict):
                for key, item in value.items():
                    if isinstance(item, BaseModel):
                        walk(item, data[name][key])

    data = cfg.model_dump(mode="json")
    walk(cfg, data)
    return data


@config_cli.command("show", help="Print the resolved run config as YAML, API keys and passwords redacted. "
                    "Layers, each over the one before: defaults, --config file, SERVE_RFT_<SECTION>__<FIELD> "
                    "environment variables, --set.")
def config_show(config: Optional[Path] = ConfigOpt, sets: list[str] = SetOpt) -> None:
    import yaml

    print(yaml.safe_dump(shown(_config(config, sets)), sort_keys=False), end="")


@config_cli.command("validate", help="Load the run config and run the checks of serve-rft up before it "
                    "starts anything (every field and rule, exposure without keys, CUDA for "
                    "trainer.device=cuda or nccl, explorer.engine_args). Exit 0: valid; 2: not, with the reason.")
def config_validate(config: Optional[Path] = ConfigOpt, sets: list[str] = SetOpt, model: Optional[str] = ModelOpt,
                    mode: Mode = typer.Option(Mode.both, help="The --mode of serve-rft up to check.")) -> None:
    _runnable(_config(config, sets, model), mode)
    console.print("config valid", highlight=False)


@config_cli.command("schema", help="Print the run config's JSON Schema, for editors that complete and check "
                    "YAML (docs/reference/config.schema.json is this output).")
def config_schema(output: Optional[Path] = typer.Option(None, "--output", "-o", metavar="FILE",
                                                        help="Write it here instead of printing it.")) -> None:
    if output is None:
        print(schema_text(), end="")
    else:
        output.write_text(schema_text())


@config_cli.command("serve", help="Print the shipped Ray Serve config (the application builder, its args, the explorer's "
                    "deployment options) for serve run / serve deploy; set its overrides (Redis URL, model, ...) "
                    "before deploying.")
def config_serve(autoscaling: bool = typer.Option(False, "--autoscaling", help="The config with an "
                                                  "autoscaling_config instead of a fixed replica count."),
                 output: Optional[Path] = typer.Option(None, "--output", "-o", metavar="FILE",
                                                       help="Write it here instead of printing it.")) -> None:
    from serve_rft.deploy import SERVE_CONFIGS

    text = SERVE_CONFIGS["serve_config_autoscaling" if autoscaling else "serve_config"].read_text()
    if output is None:
        print(text, end="")
    else:
        output.write_text(text)


@cli.command("cluster-env", help="Print the environment every node of a ray start cluster needs, as export "
             "lines for bash: the settings serve-rft up gives the Ray it starts itself (HAProxy ingress, "
             "its retries, draining periods, Ray's task events), for Ray's processes to read when they start.")
def cluster_env(ingress: Ingress = typer.Option(Ingress.haproxy, help="The cluster's front door, as "
                                                "service.ingress.")) -> None:
    from serve_rft.service.cluster_env import cluster_env as env_of, shell_lines

    try:
        print(shell_lines(env_of(ingress.value)), end="")
    except RuntimeError as e:  # no HAProxy binary
        console.print(f"[red]error:[/red] {escape(str(e))}", highlight=False)
        raise typer.Exit(2) from None


@cli.command("init-model", help="Build (once) and cache the embedded default model; print its directory.")
def init_model(config: Optional[Path] = ConfigOpt, sets: list[str] = SetOpt) -> None:
    from serve_rft.model.embedded import ensure_embedded_model

    cfg = _config(config, sets)
    print(ensure_embedded_model(cfg.model.cache_dir))


def _progress(status):
    """Start-up progress: the spinner's text on a terminal, one line per new step elsewhere."""
    said: list[str] = []

    def show(msg: str) -> None:
        status.update(msg)
        if not console.is_terminal and (not said or said[-1] != msg):
            console.print(f"[serve-rft] {msg}", highlight=False)
            said.append(msg)
    return show


def ready_line(stack, mode: str) -> str:
    """The JSON line `up` prints once up, from a started `serve_rft.service.launcher.ServiceStack`:
    url, startup_seconds, ray_address, redis_url (redacted: never the password), mode,
    metrics_url, redis_pid (the embedded redis-server's, else null)."""
    from serve_rft.buffer.redis_auth import redacted

    return json.dumps({"url": stack.url, "startup_seconds": stack.startup_seconds,
                       "ray_address": stack.ray_address, "redis_url": redacted(stack.cfg.buffer.redis_url),
                       "mode": mode, "metrics_url": stack.metrics_url,
                       "redis_pid": stack.redis.pid if stack.redis is not None else None})


@cli.command(help="Run the service (or one role of it) in the foreground until Ctrl-C, SIGTERM or SIGHUP; "
             "then it stops within service.shutdown_grace_s seconds and leaves no process behind. Once up it "
             "prints one JSON line: url, redis_url (without its password), ray_address, mode, metrics_url.")
def up(config: Optional[Path] = ConfigOpt, sets: list[str] = SetOpt, model: Optional[str] = ModelOpt,
       port: Optional[int] = PortOpt, host: Optional[str] = HostOpt,
       mode: Mode = typer.Option(Mode.both, help="both: serve and train; serve: explorers + store, no "
                                 "training; train: trainer + synchronizer against an existing store "
                                 "(buffer.redis_url or run_dir/redis), joining service.ray_address if set."),
       max_steps: int = typer.Option(0, help="train mode: exit after this many trainer steps, once "
                                     "what they trained is saved and acknowledged (0: run until a signal).")
       ) -> None:
    """Run the service (or one role of it) in the foreground until SIGINT/SIGTERM/SIGHUP; then
    it stops within ``service.shutdown_grace_s`` and leaves no process behind (a keeper process
    runs it: `serve_rft.service.keeper`).

    Prints one JSON line once up (`ready_line`): url (empty in train mode), redis_url (without
    its password), ray_address, mode, metrics_url (Ray's Prometheus endpoint; empty when joining
    a cluster).
    """
    from serve_rft.buffer.redis_server import DataDirInUse
    from serve_rft.service.launcher import ServiceStack, quiet_env, trainer_status, wait_for_signal

    quiet_env()
    cfg = _runnable(_config(config, sets, model, port, host), mode)
    _kept(cfg)
    with contextlib.ExitStack() as running:
        with console.status("starting serve_rft") as status:  # says what start-up waits for
            try:
                stack = running.enter_context(ServiceStack(cfg, mode.value, progress=_progress(status)))
            except DataDirInUse as e:
                console.print(f"[red]error:[/red] {e}")
                raise typer.Exit(2) from None
        what = f"at {stack.url}" if stack.url else "(training)"
        console.print(f"[green]serve_rft up --mode {mode.value}[/green] {what} "
                      f"(model {stack.model_path}, started in {stack.startup_seconds:.1f} s)")
        print(ready_line(stack, mode.value), flush=True)
        done = None
        if mode is Mode.train and max_steps > 0:
            def done() -> bool:
                st = trainer_status()
                if st["error"]:
                    raise RuntimeError(f"trainer stopped: {st['error']}")
                return st["steps_done"] >= max_steps and st["unacked"] == 0
        wait_for_signal(done)
        if mode is not Mode.serve:
            st = trainer_status()
            console.print(f"trainer: {st['steps_done']} steps, policy version {st['policy_version']}")
        console.print("shutting down")


@cli.command(help="Start the service on the embedded model and drive it like real users, with rewards.")
def demo(config: Optional[Path] = ConfigOpt, sets: list[str] = SetOpt, model: Optional[str] = ModelOpt,
         port: Optional[int] = PortOpt,
         duration: float = typer.Option(300.0, help="Seconds of simulated traffic."),
         users: int = typer.Option(8, help="Concurrent simulated users."),
         report: Optional[Path] = typer.Option(None, help="Write a JSON summary here."),
         url: Optional[str] = typer.Option(None, help="Drive an already running service instead."),
         live: bool = typer.Option(True, help="Show the live terminal view."),
         api_key: Optional[str] = typer.Option(
             None, envvar="SERVE_RFT_API_KEY",
             help="Admin key to send (default: the first of service.admin_keys, if any)."),
         max_steps: Optional[int] = typer.Option(
             None, help="Stop once the trainer has taken this many steps (or at --duration)."),
         task: str = typer.Option("vowels", help="What the simulated users reward: vowels (the share of vowels "
                                  "in an answer), letter (the share of the letter the prompt asks for) or "
                                  "letters (the share of the answer in the prompt's set of three letters)."),
         seed: int = typer.Option(0, help="Seed of the simulated users' choices.")) -> None:
    """Start the service on the embedded model and drive it like real users, with rewards."""
    from serve_rft.demo.driver import run_demo
    from serve_rft.service.launcher import ServiceStack, quiet_env

    quiet_env()
    cfg = _config(config, sets, model, port if port is not None else 0)
    if cfg.service.run_dir == ServiceConfig().run_dir:  # a demo starts from the base model,
        cfg.service.run_dir = f"runs/demo-{time.strftime('%Y%m%d-%H%M%S')}"  # not a resumed state
    key = api_key or (cfg.service.admin_keys[0] if cfg.service.admin_keys else None)
    if url:
        summary = run_demo(url, duration, users, live=live, api_key=key, max_steps=max_steps, task=task, seed=seed)
    else:
        _kept(_runnable(cfg))
        with ServiceStack(cfg) as stack:
            console.print(f"service up at {stack.url} in {stack.startup_seconds:.1f} s")
            summary = run_demo(stack.url, duration, users, live=live, api_key=key, max_steps=max_steps,
                               task=task, seed=seed)
            summary["startup_seconds"] = stack.startup_seconds
    text = json.dumps(summary, indent=2)
    if report:
        report.parent.mkdir(parents=True, exist_ok=True)
        report.write_text(text)
    print(text)
    if summary["requests"]["failed"]:
        raise typer.Exit(1)


@cli.command(help="Run a tool-using agent through the openai SDK against a running service and reward each "
             "conversation; prints one JSON line per episode.")
def agent(url: str = typer.Option("http://127.0.0.1:8000", help="The running service's base URL."),
          episodes: int = typer.Option(4, min=1, help="Conversations to run."),
          stream: bool = typer.Option(False, help="Stream every turn (async client)."),
          api_key: Optional[str] = typer.Option(None, envvar="SERVE_RFT_API_KEY",
                                                help="Key to send (inference and rewards: an admin key).")) -> None:
    """Run a tool-using agent through the openai SDK against a running service and reward each
    conversation (serve_rft/demo/agent.py); prints one JSON line per episode."""
    import asyncio
    import uuid

    import httpx
    import openai

    from serve_rft.demo.agent import post_reward, run_episode, run_episode_async

    failed = 0
    for _ in range(episodes):
        cid = f"agent-{uuid.uuid4().hex}"
        try:
            if stream:
                async def one():
                    client = openai.AsyncOpenAI(base_url=f"{url}/v1", api_key=api_key or "none")
                    try:
                        return await run_episode_async(client, cid, stream=True)
                    finally:
                        await client.close()
                ep = asyncio.run(one())
            else:
                ep = run_episode(openai.OpenAI(base_url=f"{url}/v1", api_key=api_key or "none"), cid)
            post_reward(url, ep, api_key)
        except (openai.APIError, httpx.HTTPError, ValueError) as e:
            failed += 1
            console.print(f"[red]episode {cid} failed:[/red] {e}")
            continue
        print(json.dumps({"conversation_id": cid, "turns": [t.completion_id for t in ep.turns],
                          "tool_call": ep.tool_call, "answer": ep.answer,
                          "follow_up_answer": ep.follow_up_answer, "reward": ep.reward,
                          "policy_versions": [t.policy_version for t in ep.turns]}))
    if failed:
        raise typer.Exit(1)


@cli.command(help="Render the reward and policy-version timeline of a run as a PNG and a table.")
def report(path: Path = typer.Argument(..., help="The JSON that serve-rft demo --report wrote, or a "
                                       "benchmark file with runs (e.g. benchmarks/results/learning.json)."),
           png: Optional[Path] = typer.Option(None, help="Write the figure here (default: PATH with .png)."),
           window: int = typer.Option(10, help="Policy versions per point of the reward-per-version curve.")
           ) -> None:
    """Render the reward and policy-version timeline of a run as a PNG and a table."""
    from rich.table import Table

    from serve_rft.demo.report import load_runs, render_png, table_rows

    try:
        runs = load_runs(path)
    except (ValueError, OSError, json.JSONDecodeError) as e:
        console.print(f"[red]error:[/red] {e}")
        raise typer.Exit(2) from None
    out = render_png(runs, png or path.with_suffix(".png"), window)
    for label, rep in runs.items():
        t = Table(title=f"{label}: mean reward", show_header=True)
        for col in ("when", "mean reward", "answers"):
            t.add_column(col)
        for row in table_rows(rep):
            t.add_row(*row)
        Console().print(t)
    console.print(f"figure: {out}")


@cli.command(help="Live table of a running service from /v1/status: replicas (state, policy version, last "
             "sync), experience counts and rates, trainer step and staleness. Ctrl-C ends it.")
def status(url: str = typer.Option("http://127.0.0.1:8000", help="The service's base URL."),
           interval: float = typer.Option(2.0, help="Seconds between refreshes."),
           once: bool = typer.Option(False, "--once", help="Print one snapshot and exit."),
           api_key: Optional[str] = typer.Option(None, envvar="SERVE_RFT_API_KEY",
                                                 help="Bearer key for a service with API keys on.")) -> None:
    """Live table of a running service from /v1/status: replicas (state, policy version, last
    sync), experience counts and rates, trainer step and staleness. Ctrl-C ends it."""
    import httpx
    from rich.live import Live

    from serve_rft.service.status_view import rates, render

    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}

    def fetch() -> dict:
        try:
            # the service bounds each part (explorer.peer_wait_s, buffer.store_wait_s): never a hang
            r = httpx.get(f"{url.rstrip('/')}/v1/status", headers=headers, timeout=60)
        except httpx.HTTPError as e:
            console.print(f"[red]cannot reach {url}:[/red] {e}")
            raise typer.Exit(1) from None
        if r.status_code != 200:
            console.print(f"[red]{url}/v1/status answered {r.status_code}:[/red] {r.text[:300]}")
            raise typer.Exit(1)
        return r.json()

    prev, t_prev = None, 0.0
    cur = fetch()
    t_cur = time.monotonic()
    if once:
        Console().print(render(cur, rates(None, cur, 0.0)))
        return
    with Live(render(cur, rates(None, cur, 0.0)), console=Console(), refresh_per_second=4) as live:
        try:
            while True:
                time.sleep(interval)
                prev, t_prev = cur, t_cur
                cur, t_cur = fetch(), time.monotonic()
                live.update(render(cur, rates(prev, cur, t_cur - t_prev)))
        except KeyboardInterrupt:
            pass


def main() -> None:
    cli(sys.argv[1:])


if __name__ == "__main__":
    main()
