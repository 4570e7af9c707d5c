"""The serving benchmark's deployments: a model, vLLM OpenAI servers and what sits beneath them.

One :class:`Deployment` per configuration: the L2 it needs (a kvfabric pool
of ``kvfabric serve`` processes, waited on until each prints its listening
line, which it prints only once it can answer; or nothing), then
``instances`` vLLM OpenAI servers (``ENGINE_PYTHON -m
vllm.entrypoints.openai.api_server``, each its own process group) started
together and waited on until ``/health`` answers 200 (a server that exits
first fails the deployment with the tail of its log). Each engine runs on
its own share of the CPUs with ``--engine-cpus split``, the command's
default (``Options.engine_cpus``: :func:`engine_cpu_sets`), as each instance of a real
deployment has its own accelerator: two engines whose compute threads
share every CPU spin against each other (on 2 CPUs, 4 sessions in flight
took ~3x the engine CPU of 1). The pool servers, the router and the load
generator are not bound. The engines run with
``PYTHONPATH`` = this checkout and its ``connectors/`` first, so the
connector the benchmark measures is this checkout's.

Configurations (:data:`CONFIGS`), at the same memory: every instance gets
``kv_bytes`` of vLLM KV cache (the "HBM"); ``dram_bytes`` in all is the
L2's, split as each L2 splits it (vLLM's CPU offload is per instance,
``dram_bytes / instances`` each; a kvfabric pool ``dram_bytes /
pool_servers`` per server):

* ``vllm``: vLLM alone, its prefix cache on, nothing beneath;
* ``vllm-offload``: vLLM's own CPU offload (``--kv-offloading-size``, the
  ``native`` backend: vLLM's ``OffloadingConnector``; :data:`OFFLOAD_VARIANTS`
  lists the environments tried in turn, the second selecting its
  ``SimpleCPUOffloadConnector``);
* ``kvfabric``: the kvfabric connector over a DRAM-only pool, vLLM's
  prefix cache on above it;
* ``kvfabric-ssd``: the same pool with an SSD tier of ``ssd_bytes`` in all;
* ``lmcache``: LMCache's vLLM connector over an LMCache remote server
  (``lm://``), when an LMCache installation is named (``lmcache_site``);
  the benchmark reports why it could not run otherwise;
* ``mooncake``: vLLM's own ``MooncakeStoreConnector`` over a Mooncake Store
  on loopback TCP whose one holder has ``dram_bytes``
  (:class:`~kvfabric.bench.mooncake_store.MooncakeStore`), the engines'
  store clients named 127.0.0.1.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path

from ..testing.ports import PortTaken, free_port, http_ready, process_tree
from ..testing.servers import ServerPool, start_server, stop_process_group
from . import proc_cpu_s
from .mooncake_store import MooncakeStore, NotAvailable

ROOT = Path(__file__).resolve().parents[2]
CONNECTORS = ROOT / "connectors"
CHUNK_TOKENS = 128          # the kvfabric connector's chunk: vLLM's CPU block size

CONFIGS = ("vllm", "vllm-offload", "lmcache", "mooncake", "kvfabric", "kvfabric-ssd", "route-rr", "route", "vllm-route")
# the RL workload's (``--workload rl``, _serve_rl): vLLM alone and the DRAM pool as above, plus the pool with
# ``weights_retire`` and a control whose driver never tells the connector (stale KV is served: the detector works)
RL_CONFIGS = ("vllm", "kvfabric", "kvfabric-retire", "kvfabric-unversioned")
LABELS = {"vllm": "(a) vLLM alone, prefix cache, KV limited",
          "vllm-offload": "(b) vLLM + its CPU OffloadingConnector",
          "lmcache": "(c) vLLM + LMCache remote server (peer L2)",
          "mooncake": "(c') vLLM + Mooncake Store, TCP (peer L2)",
          "kvfabric": "(d) vLLM + kvfabric pool, DRAM",
          "kvfabric-ssd": "(e) vLLM + kvfabric pool, DRAM + SSD",
          "route-rr": "(f) (d) behind kvfabric route, round robin",
          "route": "(g) (d) behind kvfabric route, KV-aware",
          "vllm-route": "(h) (a) behind kvfabric route, KV-aware",
          "kvfabric-retire": "(d') (d) with weights_retire",
          "kvfabric-unversioned": "(x) (d), connector never told: CONTROL"}
# pool configurations and the connector settings each adds
POOL_CONFIGS = {"kvfabric": {}, "kvfabric-ssd": {}, "route-rr": {}, "route": {},
                "kvfabric-retire": {"weights_retire": True}, "kvfabric-unversioned": {}}
# the router's policy per configuration that has one (the same deployment otherwise: (d), or (a) for
# vllm-route, plus each engine's KV events)
ROUTE_POLICY = {"route-rr": "rr", "route": "kv", "vllm-route": "kv"}


# vllm-offload is tried with each of these environments until one starts
OFFLOAD_VARIANTS = ({}, {"VLLM_USE_SIMPLE_KV_OFFLOAD": "1"})


class NotRunnable(RuntimeError):
    """A configuration that cannot run here; the message says exactly what failed."""


@dataclass
class Shape:
    """The random-weight Llama's shape (``kvfabric_vllm.tinymodel``'s, with these fields replaced)."""

    layers: int = 4
    heads: int = 8
    kv_heads: int = 8
    head_dim: int = 128
    hidden: int = 256
    vocab: int = 2048

    @property
    def kv_bytes_per_token(self) -> int:
        """K and V, every layer, float32."""
        return 2 * self.layers * self.kv_heads * self.head_dim * 4

    def overrides(self) -> dict:
        return {"num_hidden_layers": self.layers, "num_attention_heads": self.heads,
                "num_key_value_heads": self.kv_heads, "head_dim": self.head_dim, "hidden_size": self.hidden,
                "intermediate_size": 2 * self.hidden, "vocab_size": self.vocab}


def engine_env(python: str, extra_path: list[str] = ()) -> dict[str, str]:
    """The environment of an engine process: this checkout first on the path, one engine process."""
    env = dict(os.environ)
    path = [str(ROOT), str(CONNECTORS), *extra_path]
    if env.get("PYTHONPATH"):
        path.append(env["PYTHONPATH"])
    env["PYTHONPATH"] = os.pathsep.join(path)
    env["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    env.setdefault("PYTHONUNBUFFERED", "1")
    return env


def build_model(python: str, out: Path, shape: Shape, timeout_s: float = 600, seed: int = 0) -> Path:
    """Build the random-weight Llama of ``shape`` in ``out`` with the engine's interpreter (it has torch and
    transformers), its weights drawn with ``seed`` (another seed: the same architecture, other weights, what an
    RL trainer pushes); RuntimeError with the builder's output when it fails."""
    code = ("import sys, kvfabric_vllm.tinymodel as t; "
            f"t.TINY_LLAMA = dict(t.TINY_LLAMA, **{shape.overrides()!r}); "
            f"print(t.build_tiny_llama(sys.argv[1], seed={int(seed)}))")
    proc = subprocess.run([python, "-c", code, str(out)], env=engine_env(python), capture_output=True, text=True,
                          timeout=timeout_s)
    if proc.returncode != 0:
        raise RuntimeError(f"building the model with {python} failed ({proc.returncode}):\n{proc.stderr[-3000:]}")
    return out


@dataclass
class Options:
    """What every configuration shares."""

    python: str
    model: str
    instances: int
    kv_bytes: int
    dram_bytes: int
    ssd_bytes: int
    ssd_dir: str
    pool_servers: int
    max_model_len: int
    max_batched_tokens: int
    workdir: Path
    server_transports: str = "tcp,native"
    lmcache_site: str = ""           # site-packages of an LMCache installation ("" = none)
    lmcache_python: str = ""         # its interpreter, for its remote server
    mooncake_bin: str = ""           # the directory with mooncake_master and mooncake_client ("" = none)
    pool_args: tuple[str, ...] = ()  # more ``kvfabric serve`` arguments for every pool server
    start_timeout_s: float = 900.0
    engine_extra: tuple[str, ...] = ()   # more arguments for every vLLM server (the RL workload's extension)
    engine_cpus: tuple[tuple[int, ...], ...] = ()   # instance i runs on engine_cpus[i] (() = where it likes)


@dataclass
class Deployment:
    """A running configuration: its engines' URLs, its pool (if any), and how to stop it all."""

    config: str
    urls: list[str]
    procs: list[subprocess.Popen]
    logs: list[Path]
    pool: ServerPool | None = None
    l2_procs: list[subprocess.Popen] = field(default_factory=list)
    settings: dict = field(default_factory=dict)
    router: subprocess.Popen | None = None     # kvfabric route in front of the engines (route configs)
    router_url: str | None = None
    events_dir: str | None = None              # the engines' KV-event sockets (route configs)

    @property
    def entry(self) -> list[str]:
        """Where the load generator sends requests: the router, or the engines round robin."""
        return [self.router_url] if self.router_url else self.urls

    def stop(self) -> None:
        """Stop the router, the engines, then the L2; remove the SSD tier directories the pool had and the
        engines' KV-event sockets."""
        for p in [*([self.router] if self.router else []), *self.procs, *self.l2_procs]:
            if p.poll() is None:
                stop_process_group(p)
        if self.pool is not None:
            self.pool.stop()
            for d in self.settings.get("ssd_paths", []):
                shutil.rmtree(d, ignore_errors=True)
        if self.events_dir:
            shutil.rmtree(self.events_dir, ignore_errors=True)

    def cpu_s(self) -> dict[str, float]:
        """CPU seconds used so far by the engines (each with the processes it started: vLLM's engine core)
        and by the L2 servers."""
        l2 = [p.pid for p in self.l2_procs] + ([s.pid for s in self.pool] if self.pool is not None else [])
        return {"engines": sum(tree_cpu_s(p.pid) for p in self.procs), "l2": sum(tree_cpu_s(pid) for pid in l2),
                "router": tree_cpu_s(self.router.pid) if self.router else 0.0}

    def dead(self) -> list[str]:
        """One line per engine that exited, with its log's tail."""
        return [f"{u} exited {p.returncode}:\n{log.read_text(errors='replace')[-3000:]}"
                for u, p, log in zip(self.urls, self.procs, self.logs) if p.poll() is not None]


def engine_cpu_sets(spec: str, instances: int) -> tuple[tuple[int, ...], ...]:
    """The CPUs each of ``instances`` engines may run on, from ``--engine-cpus``: ``none`` (every engine
    where the kernel likes: their compute threads share all CPUs), ``split`` (the CPUs this process may use,
    cut into one contiguous share per engine, as each instance of a real deployment has its own
    accelerator; with fewer CPUs than engines, engine i gets CPU i modulo their number), or explicit sets
    ``0|1`` / ``0-3|4-7`` (one per instance). ValueError for anything else, a CPU this process may not use,
    or a count that does not match."""
    allowed = sorted(os.sched_getaffinity(0))
    if spec == "none":
        return ()
    if spec == "split":
        n = len(allowed) // instances
        return tuple(tuple(allowed[i * n:(i + 1) * n]) if n else (allowed[i % len(allowed)],)
                     for i in range(instances))
    sets = []
    for part in spec.split("|"):
        cpus: list[int] = []
        for item in part.split(","):
            lo, _, hi = item.strip().partition("-")
            if not lo.isdigit() or (hi and not hi.isdigit()):
                raise ValueError(f"--engine-cpus {spec!r}: {item!r} is not a CPU or a range (none, split, or "
                                 "sets such as 0|1 or 0-3|4-7)")
            cpus += range(int(lo), int(hi or lo) + 1)
        if not cpus or not set(cpus) <= set(allowed):
            raise ValueError(f"--engine-cpus {spec!r}: {part!r} names CPUs this process may not use "
                             f"(allowed: {allowed})")
        sets.append(tuple(cpus))
    if len(sets) != instances:
        raise ValueError(f"--engine-cpus {spec!r}: {len(sets)} CPU sets for {instances} instances")
    return tuple(sets)


def _pinned(cpus: tuple[int, ...]):
    """A ``preexec_fn`` that binds the child (and so every thread and process it starts: vLLM's engine core
    and the OpenMP threads vLLM binds inside the CPUs the process may use) to ``cpus``; None for no set."""
    if not cpus:
        return None
    return lambda: os.sched_setaffinity(0, cpus)


def _engine_args(opt: Options, port: int) -> list[str]:
    return [opt.python, "-m", "vllm.entrypoints.openai.api_server", "--model", opt.model, "--served-model-name",
            "tiny", "--host", "127.0.0.1", "--port", str(port), "--dtype", "float32", "--enforce-eager",
            "--kv-cache-memory-bytes", str(opt.kv_bytes), "--max-model-len", str(opt.max_model_len),
            "--max-num-batched-tokens", str(opt.max_batched_tokens), "--seed", "0",
            "--enable-prompt-tokens-details", "--enable-prefix-caching", *opt.engine_extra]


def _kvfabric_flag(servers: list[str], extra: dict | None = None) -> list[str]:
    flag = {"kv_connector": "KVFabricConnector", "kv_connector_module_path": "kvfabric_vllm.connector",
            "kv_role": "kv_both",
            "kv_connector_extra_config": {"servers": servers, "chunk_tokens": CHUNK_TOKENS, **(extra or {})}}
    return ["--kv-transfer-config", json.dumps(flag)]


def _start_pool(opt: Options, ssd: bool) -> ServerPool:
    """``opt.pool_servers`` servers sharing ``opt.dram_bytes`` (and ``opt.ssd_bytes`` of SSD tier, one fresh
    directory each under ``opt.ssd_dir``: a tier file belongs to one server); all or none."""
    pool = ServerPool()
    pool.ssd_paths = []
    try:
        for i in range(opt.pool_servers):
            args = ["--transports", opt.server_transports, *opt.pool_args]
            if ssd:
                d = Path(opt.ssd_dir) / f"kvf-serve-bench-{os.getpid()}-{i}"
                shutil.rmtree(d, ignore_errors=True)
                d.mkdir(parents=True)
                pool.ssd_paths.append(str(d))
                args += ["--ssd-path", str(d), "--ssd-capacity", str(opt.ssd_bytes // opt.pool_servers)]
            pool.append(start_server(capacity=opt.dram_bytes // opt.pool_servers, extra_args=args, timeout_s=120))
    except BaseException:
        pool.stop()
        for d in pool.ssd_paths:
            shutil.rmtree(d, ignore_errors=True)
        raise
    return pool


def _start_lmcache_server(opt: Options) -> tuple[subprocess.Popen, str, Path]:
    """LMCache's remote server (``python -m lmcache.v1.server HOST PORT cpu``) from its own installation."""
    if not opt.lmcache_python or not opt.lmcache_site:
        raise NotRunnable("no LMCache installation given (--lmcache-python / --lmcache-site)")
    port = free_port()
    log = opt.workdir / "lmcache-server.log"
    with open(log, "w") as f:
        proc = subprocess.Popen([opt.lmcache_python, "-m", "lmcache.v1.server", "127.0.0.1", str(port), "cpu"],
                                stdout=f, stderr=subprocess.STDOUT, start_new_session=True)
    return proc, f"lm://127.0.0.1:{port}", log


#: how many times :func:`start` picks fresh ports when an engine found one of its ports taken
PORT_RACE_TRIES = 3


def start(config: str, opt: Options, env_extra: dict[str, str] | None = None) -> Deployment:
    """Start ``config``'s L2 and engines (``env_extra`` added to their environment) and wait until all
    answer; :class:`NotRunnable` (with the engine's own error) when the configuration cannot run here,
    RuntimeError for anything else.

    The engines' HTTP ports are free when picked (:func:`free_port`, outside the kernel's ephemeral range)
    but bound later by the engine: another process may take one in between (seen in CI, the suite's other
    parts starting servers beside it: a pool server answering the engine's /health; and "ZMQError: Address
    already in use" when the KV events went over TCP too: they use Unix sockets now). An engine that exits
    with "Address already in use", or whose HTTP port another process listens on
    (:class:`~kvfabric.testing.ports.PortTaken`), is started again, everything with fresh ports, up to
    :data:`PORT_RACE_TRIES` times."""
    for attempt in range(1, PORT_RACE_TRIES + 1):
        try:
            return _start_once(config, opt, env_extra)
        except (NotRunnable, PortTaken) as e:
            taken = isinstance(e, PortTaken) or "Address already in use" in str(e)
            if not taken or attempt == PORT_RACE_TRIES:
                raise
            print(f"{config}: a port was taken before its engine bound it ({str(e).splitlines()[0]}); "
                  "starting again with fresh ports", file=sys.stderr)
    raise AssertionError("unreachable")


def _start_once(config: str, opt: Options, env_extra: dict[str, str] | None) -> Deployment:
    pool = None
    l2: list[subprocess.Popen] = []
    extra: list[str] = []
    env_extra = dict(env_extra or {})
    path_extra: list[str] = []
    settings: dict = {"kv_bytes_per_instance": opt.kv_bytes, "engine_cpus": [list(c) for c in opt.engine_cpus]}
    events: list[list[str]] = [[] for _ in range(opt.instances)]
    events_dir = None
    try:
        if config in ROUTE_POLICY:
            # each engine publishes its KV events on a Unix socket (vLLM binds ipc:// endpoints; tcp ones only
            # on every address, "tcp://*"); the router finds them at /kv_event_sources. A short directory:
            # a socket's path holds at most 107 bytes.
            events_dir = tempfile.mkdtemp(prefix="kvf-ev-", dir="/tmp" if os.path.isdir("/tmp") else None)
            events = [["--kv-events-config", json.dumps({"enable_kv_cache_events": True, "publisher": "zmq",
                                                         "endpoint": f"ipc://{events_dir}/{i}"})]
                      for i in range(opt.instances)]
        if config in POOL_CONFIGS:
            pool = _start_pool(opt, ssd=config == "kvfabric-ssd")
            if config == "kvfabric-ssd":
                settings.update(ssd_bytes=opt.ssd_bytes, ssd_paths=pool.ssd_paths)
            extra = _kvfabric_flag(pool.addresses, POOL_CONFIGS[config])
            if POOL_CONFIGS[config]:
                settings.update(connector_extra=POOL_CONFIGS[config])
            settings.update(pool=pool.addresses, dram_bytes=opt.dram_bytes, server_transports=opt.server_transports,
                            pool_args=list(opt.pool_args))
        elif config == "vllm-offload":
            gib = opt.dram_bytes / opt.instances / (1 << 30)
            extra = ["--kv-offloading-size", f"{gib:.6f}", "--kv-offloading-backend", "native"]
            settings.update(dram_bytes=opt.dram_bytes, offload_gib_per_instance=gib)
        elif config == "lmcache":
            proc, url, _ = _start_lmcache_server(opt)
            l2.append(proc)
            path_extra = [opt.lmcache_site]
            env_extra |= {"LMCACHE_CHUNK_SIZE": str(CHUNK_TOKENS), "LMCACHE_LOCAL_CPU": "False",
                         "LMCACHE_MAX_LOCAL_CPU_SIZE": "1", "LMCACHE_REMOTE_URL": url, "LMCACHE_REMOTE_SERDE": "naive"}
            extra = ["--kv-transfer-config", json.dumps({"kv_connector": "LMCacheConnectorV1", "kv_role": "kv_both"})]
            settings.update(remote=url, dram_bytes=opt.dram_bytes)
        elif config == "mooncake":
            try:
                store = MooncakeStore(opt.mooncake_bin, opt.dram_bytes, opt.workdir)
            except NotAvailable as e:
                raise NotRunnable(str(e)) from None
            l2 += store.procs
            cfg = store.vllm_config(opt.workdir / "mooncake.json")
            # the engines' store clients name themselves 127.0.0.1 (vLLM would use the host's address)
            env_extra |= {"MOONCAKE_CONFIG_PATH": str(cfg), "MOONCAKE_REQUESTER_LOCAL_HOSTNAME": "127.0.0.1",
                          "VLLM_HOST_IP": "127.0.0.1"}
            extra = ["--kv-transfer-config", json.dumps({"kv_connector": "MooncakeStoreConnector",
                                                         "kv_role": "kv_both"})]
            settings.update(mooncake={"master": store.rpc, "master_admin": store.admin_url,
                                      "segment_bytes": opt.dram_bytes}, dram_bytes=opt.dram_bytes)
        elif config not in ("vllm", "vllm-route"):
            raise ValueError(f"unknown configuration {config!r} (known: {', '.join(CONFIGS)})")
        env = dict(engine_env(opt.python, path_extra), **env_extra)
        urls, procs, logs = [], [], []
        for i in range(opt.instances):
            port = free_port()
            log = opt.workdir / f"{config}-{i}.log"
            with open(log, "w") as f:
                cpus = opt.engine_cpus[i] if opt.engine_cpus else ()
                procs.append(subprocess.Popen([*_engine_args(opt, port), *extra, *events[i]], env=env, stdout=f,
                                              stderr=subprocess.STDOUT, start_new_session=True,
                                              preexec_fn=_pinned(cpus)))
            urls.append(f"http://127.0.0.1:{port}")
            logs.append(log)
        dep = Deployment(config, urls, procs, logs, pool, l2, dict(settings, env=env_extra), events_dir=events_dir)
    except BaseException:
        for p in l2:
            stop_process_group(p)
        if pool is not None:
            pool.stop()
        if events_dir:
            shutil.rmtree(events_dir, ignore_errors=True)
        raise
    try:
        _wait_healthy(dep, opt.start_timeout_s)
        _check_connector_started(dep)
        # where each engine's threads (vLLM's engine core and OpenMP threads included) may run, as the kernel says
        dep.settings["engine_cpus_seen"] = [tree_cpus(p.pid) for p in dep.procs]
        if config in ROUTE_POLICY:
            _start_router(dep, opt, ROUTE_POLICY[config])
    except BaseException:
        dep.stop()
        raise
    return dep


def _start_router(dep: Deployment, opt: Options, policy: str, timeout_s: float = 120.0) -> None:
    """``kvfabric route`` (this interpreter: it needs pyzmq, the 'route' extra) in front of ``dep``'s
    engines with ``policy``, asking the pool (if any) with the connector's keys; waits for its listening
    line."""
    import importlib.util

    if importlib.util.find_spec("zmq") is None:
        raise NotRunnable("kvfabric route needs pyzmq in the benchmark's interpreter (pip install 'kvfabric[route]')")
    log = opt.workdir / f"{dep.config}-router.log"
    cmd = [sys.executable, "-m", "kvfabric", "route", "--port", "0", "--policy", policy, "--max-connections", "1024"]
    if dep.pool is not None:
        cmd += ["--pool-config", json.dumps({"servers": dep.pool.addresses, "chunk_tokens": CHUNK_TOKENS}),
                "--model", opt.model]
    for u in dep.urls:
        cmd += ["--instance", u]
    with open(log, "w") as err:
        dep.router = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=err, text=True, start_new_session=True,
                                      env=engine_env(sys.executable))
    line = dep.router.stdout.readline()       # printed once it answers; "" if it exits first
    if not line.startswith("kvfabric route listening on "):
        raise NotRunnable(f"{dep.config}: kvfabric route did not start: {line!r}\n"
                          f"{log.read_text(errors='replace')[-3000:]}")
    dep.router_url = "http://" + line.split()[-1]
    dep.settings.update(router=dep.router_url, policy=policy)


def route_stats(dep: Deployment) -> dict | None:
    """The router's ``/stats`` (as ``counts``) and ``/route`` (as ``route``: its choices, per-instance
    index and rates), None without a router."""
    if not dep.router_url:
        return None
    out = {}
    for path, key in (("/stats", "counts"), ("/route", "route")):
        with urllib.request.urlopen(dep.router_url + path, timeout=60) as r:
            out[key] = json.loads(r.read())
    return out


# A connector that logs one of these at start and lets vLLM run on without it: the engine answers, but the
# configuration would be vLLM alone under another name.
_CONNECTOR_FAILED = {"lmcache": "LMCache ERROR"}


def _check_connector_started(dep: Deployment) -> None:
    """:class:`NotRunnable` when the configuration's connector logged that it failed to start."""
    mark = _CONNECTOR_FAILED.get(dep.config)
    for url, log in zip(dep.urls, dep.logs):
        text = log.read_text(errors="replace")
        at = text.find(mark) if mark else -1
        if at >= 0:
            raise NotRunnable(f"{dep.config}: the vLLM server at {url} started, but its connector did not (vLLM "
                              f"runs on without it): {root_cause(text[at:])}\nits log from there:\n"
                              f"{text[at:at + 4000]}")


def _wait_healthy(dep: Deployment, timeout_s: float) -> None:
    """Until every engine answers /health with 200 on a port its own process listens on
    (:func:`~kvfabric.testing.ports.http_ready`); an engine that exits first ends the wait with its log, a
    port another process listens on with :class:`~kvfabric.testing.ports.PortTaken`."""
    deadline = time.monotonic() + timeout_s
    pending = list(zip(dep.urls, dep.procs, dep.logs))
    while pending:
        for item in list(pending):
            url, proc, log = item
            if proc.poll() is not None:
                text = log.read_text(errors="replace")
                raise NotRunnable(f"{dep.config}: the vLLM server at {url} exited with status {proc.returncode} "
                                  f"before it answered /health: {root_cause(text)}\nits log ends:\n{text[-4000:]}")
            try:
                if http_ready(url, proc.pid):
                    pending.remove(item)
            except PortTaken as e:
                raise PortTaken(f"{dep.config}: {e}") from None
        for p in dep.l2_procs:
            if p.poll() is not None:
                raise NotRunnable(f"{dep.config}: the L2 server exited with status {p.returncode}")
        if pending and time.monotonic() > deadline:
            raise RuntimeError(f"{dep.config}: {[u for u, _, _ in pending]} did not answer /health in {timeout_s} s")
        if pending:
            time.sleep(1.0)


def tree_cpu_s(pid: int) -> float:
    """CPU seconds (user + system) of process ``pid`` and its live descendants, from /proc (0 for a process
    that is gone)."""
    total = 0.0
    for p in process_tree(pid):
        try:
            total += proc_cpu_s(p)
        except (OSError, ValueError, IndexError):
            continue
    return total


def tree_cpus(pid: int) -> list[int]:
    """The CPUs any thread of process ``pid`` or of its live descendants may run on (empty if all are gone)."""
    cpus: set[int] = set()
    for p in process_tree(pid):
        try:
            tids = os.listdir(f"/proc/{p}/task")
        except OSError:
            continue
        for tid in tids:
            try:
                cpus |= os.sched_getaffinity(int(tid))
            except OSError:
                continue
    return sorted(cpus)


def machine_busy_s() -> float:
    """CPU seconds every process on this machine has used since boot (all CPUs: /proc/stat, not idle)."""
    with open("/proc/stat") as f:
        v = [int(x) for x in f.readline().split()[1:]]
    idle = v[3] + (v[4] if len(v) > 4 else 0)
    return (sum(v[:8]) - idle) / os.sysconf("SC_CLK_TCK")


_ERROR_LINE = re.compile(r"\b(\w*(?:Error|Exception)): (.+)")


def root_cause(log: str) -> str:
    """The first ``SomethingError: message`` line of an engine's log (vLLM logs the root cause before the
    tracebacks that wrap it), else its last line."""
    for line in log.splitlines():
        if "WARNING" in line:
            continue
        m = _ERROR_LINE.search(line)
        if m:
            return f"{m.group(1)}: {m.group(2)}"[:600]
    lines = log.strip().splitlines()
    return lines[-1][:600] if lines else "(empty log)"


def lmcache_installation(venv: str) -> tuple[str, str]:
    """(interpreter, site-packages) of an LMCache virtualenv, or ("", "") when it has no lmcache."""
    py = Path(venv) / "bin" / "python"
    sites = sorted(Path(venv).glob("lib/python*/site-packages"))
    if not py.exists() or not sites or not (sites[0] / "lmcache").is_dir():
        return "", ""
    return str(py), str(sites[0])


__all__ = ["CONFIGS", "LABELS", "POOL_CONFIGS", "RL_CONFIGS", "OFFLOAD_VARIANTS", "ROUTE_POLICY", "Deployment",
           "NotRunnable", "Options", "Shape",
           "build_model", "engine_env", "lmcache_installation", "machine_busy_s", "route_stats", "start",
           "tree_cpu_s"]
