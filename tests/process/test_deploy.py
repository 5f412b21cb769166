"""What an operator deploys (deploy/, docs/deploy.md) stays true to the code.

Each file is parsed and checked against what it names: the command lines against
`narwhal serve`'s own parser and `--help`, ports against the command line, probe and scrape
paths against a running router, grace periods against the drain the fleet file asks for,
the Kubernetes objects against each other and against the fleet file's `[[discover]]`
blocks, and every metric of the alert rules against a real scrape. The real `promtool`
checks the rules, their unit tests and a scrape; `systemd-analyze verify` checks the unit.
Both are skipped where they are not installed, except promtool in CI (`.ci/run` installs
it), so a green CI cannot hide a missing install step.
"""

from __future__ import annotations

import functools
import json
import os
import re
import shlex
import shutil
import socket
import subprocess
import sys
import tomllib
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import msgspec
import pytest
import trio
import yaml
from prometheus_client.parser import text_string_to_metric_families

from narwhal.core.config import ConfigError, EngineSpec, FleetConfig, ServingConfig
from narwhal.process import cli, startup
from narwhal.process.config_files import load_config
from narwhal.router.serving import hypercorn_config

try:  # the parent of --workers N (narwhal.process.workers) waits this long past hypercorn's bound
    from narwhal.process.workers import STOP_MARGIN_S as WORKERS_STOP_MARGIN_S
except ImportError:
    WORKERS_STOP_MARGIN_S = 0.0
from tests.support.deploy import (
    ALERTS,
    DEPLOY,
    ROOT,
    alert_job,
    alert_rules,
    lint_exposition,
    promtool,
)
from tests.support.fleet import MODEL, finish, start_fleet

K8S = DEPLOY / "k8s"
CONTAINERFILE = DEPLOY / "Containerfile"
IGNOREFILE = DEPLOY / "Containerfile.dockerignore"
PYPROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())
UNIT = DEPLOY / "narwhal.service"
ALERT_TESTS = DEPLOY / "alerts.test.yml"
PROMETHEUS = DEPLOY / "prometheus.yml"
EXAMPLE_FLEET = ROOT / "examples" / "fleet.toml"
GUIDE = ROOT / "docs" / "deploy.md"
PROBE_PATHS = {"/health", "/ready", "/metrics"}
# metrics an alert may name that Prometheus makes, not the router
PROMETHEUS_OWN = {"up"}
# labels whose values appear with traffic, not at start: what a matcher's value must look like
OPEN_LABELS = {"status": r"[1-5]\d\d", "engine": r".+"}
PROMQL_WORDS = {
    # aggregations, keywords and the functions the rules use; a new function shows up as
    # "not exported" until it is added here
    *("sum", "max", "min", "avg", "count", "by", "without", "on", "ignoring"),
    *("group", "group_left", "group_right", "and", "or", "unless", "bool", "offset"),
    *("rate", "increase", "irate", "delta", "histogram_quantile", "vector", "absent"),
    *("min_over_time", "max_over_time", "avg_over_time", "le"),
}


# --- the command lines ----------------------------------------------------------------


@functools.cache
def serve_help_flags() -> frozenset[str]:
    """Every option `narwhal serve --help` lists, from the installed command itself."""
    out = subprocess.run(
        [sys.executable, "-m", "narwhal", "serve", "--help"],
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    ).stdout
    return frozenset(re.findall(r"(?<![\w-])--[a-z][a-z-]*", out))


def parse_serve(argv: list[str], where: str) -> Any:
    """``argv`` (from ``serve`` on) through narwhal's own parser, after checking that every
    flag it uses is one `narwhal serve --help` shows."""
    assert argv[0] == "serve", f"{where}: runs {argv[0]!r}, not `narwhal serve`"
    flags = {arg.split("=", 1)[0] for arg in argv if arg.startswith("--")}
    unknown = flags - serve_help_flags()
    assert not unknown, f"{where}: {sorted(unknown)} not in `narwhal serve --help`"
    try:
        return cli.build_parser().parse_args(argv)
    except SystemExit:
        pytest.fail(f"{where}: `narwhal {shlex.join(argv)}` is refused by its parser")


def drain_bound_s(serving: dict[str, Any], workers: int) -> float:
    """How long a router with this ``[serving]`` section may take to stop after SIGTERM:
    hypercorn's own graceful timeout, which the router sets above graceful_timeout_s, and
    with ``--workers N`` the margin the parent gives its workers past it."""
    fleet = FleetConfig(
        model="m",
        engines=(EngineSpec("e", "http://127.0.0.1:1"),),
        serving=msgspec.convert(serving, ServingConfig),
    )
    bound = float(hypercorn_config(fleet, "127.0.0.1", 0).graceful_timeout)
    assert bound >= fleet.serving.graceful_timeout_s
    return bound + (WORKERS_STOP_MARGIN_S if workers > 1 else 0.0)


def example_serving() -> dict[str, Any]:
    serving: dict[str, Any] = tomllib.loads(EXAMPLE_FLEET.read_text()).get("serving", {})
    return serving


# --- the Containerfile ------------------------------------------------------------------


def containerfile() -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments), continuation lines joined, comments dropped."""
    joined, pending = [], ""
    for line in CONTAINERFILE.read_text().splitlines():
        if not pending and (not line.strip() or line.lstrip().startswith("#")):
            continue
        if line.rstrip().endswith("\\"):
            pending += line.rstrip()[:-1] + " "
            continue
        joined.append(pending + line)
        pending = ""
    assert not pending, "the Containerfile ends inside a continued line"
    out = []
    for line in joined:
        word, _, rest = line.strip().partition(" ")
        out.append((word.upper(), rest.strip()))
    return out


def final_stage() -> list[tuple[str, str]]:
    steps = containerfile()
    last = max(i for i, (word, _) in enumerate(steps) if word == "FROM")
    return steps[last:]


def exec_form(text: str, what: str) -> list[str]:
    try:
        argv = json.loads(text)
    except json.JSONDecodeError:
        pytest.fail(f"Containerfile {what} is not in exec (JSON) form: {text}")
    assert isinstance(argv, list), text
    assert all(isinstance(a, str) for a in argv), text
    return argv


def image_command() -> list[str]:
    """ENTRYPOINT plus CMD of the final stage: what `docker run IMAGE` runs."""
    stage = dict(final_stage())
    return exec_form(stage["ENTRYPOINT"], "ENTRYPOINT") + exec_form(stage.get("CMD", "[]"), "CMD")


def healthcheck_command() -> list[str]:
    stage = dict(final_stage())
    assert "HEALTHCHECK" in stage, "the image has no HEALTHCHECK"
    options, _, command = stage["HEALTHCHECK"].partition("CMD ")
    assert all(o.startswith("--") for o in options.split()), options
    return exec_form(command, "HEALTHCHECK CMD")


def global_args() -> dict[str, str]:
    """The ARGs before the first FROM (what FROM lines may use), defaults expanded."""
    out: dict[str, str] = {}
    for word, rest in containerfile():
        if word == "FROM":
            break
        if word == "ARG" and "=" in rest:
            name, value = rest.split("=", 1)
            out[name] = re.sub(r"\$\{(\w+)\}", lambda m: out[m.group(1)], value)
    return out


def test_containerfile_builds_a_wheel_then_a_slim_non_root_runtime() -> None:
    steps = containerfile()
    froms = [args for word, args in steps if word == "FROM"]
    assert len(froms) >= 2, "not a multi-stage build"
    build = re.fullmatch(r"(\S+)\s+AS\s+(\w+)", froms[0], re.IGNORECASE)
    assert build, f"the first stage has no name: FROM {froms[0]}"
    stage_name = build.group(2)
    assert any("pip wheel" in args for word, args in steps if word == "RUN"), "no wheel built"
    final = final_stage()
    runtime = final[0][1]
    # one base for both stages, a build argument (make image passes its Debian base): the
    # venv built in the first finds its Python at the same path in the second
    assert runtime == build.group(1) == "${BASE}", (froms[0], runtime)
    base = global_args().get("BASE", "")
    assert "slim" in base, f"the default base is not a slim image: {base}"
    uses_build = [
        args
        for word, args in final
        if f"from={stage_name}" in args or f"--from={stage_name}" in args
    ]
    assert uses_build, "the runtime stage takes nothing from the build stage"
    assert not any(word == "COPY" and "narwhal" in args.split()[:1] for word, args in final)
    assert not any("apt-get install" in args for word, args in final if word == "RUN")
    # the Python of the default base is one the package supports
    version = re.fullmatch(r"python:(\d+\.\d+)-slim\S*", base)
    assert version, f"the default base is not the python image: {base}"
    required = PYPROJECT["project"]["requires-python"]
    floor = tuple(int(x) for x in required.removeprefix(">=").split("."))
    assert tuple(int(x) for x in version.group(1).split(".")) >= floor, (base, required)
    # what the build stage copies exists and is not excluded from the build context
    ignore = IGNOREFILE.read_text().splitlines()
    for word, rest in steps:
        if word == "COPY" and not rest.startswith("--from"):
            for source in rest.split()[:-1]:
                assert (ROOT / source).exists(), f"COPY {source}: not in the repository"
                assert f"!{source.rstrip('/')}" in {i.rstrip("/") for i in ignore}, source
    # never root at run time
    users = [a for word, a in final if word == "USER"]
    assert users, "the runtime stage runs as root (no USER)"
    assert users[-1].split(":")[0] not in ("root", "0"), users[-1]
    assert dict(final).get("STOPSIGNAL") == "SIGTERM"


def test_containerfile_command_port_and_healthcheck_agree() -> None:
    argv = image_command()
    assert argv[0] == "narwhal", argv
    args = parse_serve(argv[1:], "Containerfile ENTRYPOINT + CMD")
    assert args.host == "0.0.0.0", "a container must listen beyond its loopback"
    assert Path(args.config).is_absolute()
    assert Path(args.config).parent != Path("/"), "mount a directory, not the root"
    exposed = [a for word, a in final_stage() if word == "EXPOSE"]
    assert exposed == [str(args.port)], f"EXPOSE {exposed} but --port {args.port}"
    health = healthcheck_command()
    # python3: the python image has both names, a Debian base only python3
    assert health[0] == "python3", health
    assert "urllib.request" in " ".join(health), "the slim image has no curl"
    urls = re.findall(r"https?://[^'\"\s]+", " ".join(health))
    assert [urlsplit(u)[1:3] for u in urls] == [(f"127.0.0.1:{args.port}", "/health")], urls


def test_containerfile_labels_name_the_version_and_the_source() -> None:
    """OCI labels from build arguments; the version's default is pyproject's (make image
    passes it, a plain `docker build` gets the default)."""
    final = final_stage()
    defaults = dict(a.split("=", 1) for word, a in final if word == "ARG" and "=" in a)
    assert defaults.get("VERSION") == PYPROJECT["project"]["version"], defaults
    assert defaults.get("SOURCE", "").startswith("https://"), defaults
    labels = " ".join(a for word, a in final if word == "LABEL")
    assert 'org.opencontainers.image.version="${VERSION}"' in labels, labels
    assert 'org.opencontainers.image.source="${SOURCE}"' in labels, labels


async def test_the_image_healthcheck_command_reads_a_router(nursery: trio.Nursery) -> None:
    """The HEALTHCHECK's own command line, run here: 0 against a router, not 0 without."""
    harness = await start_fleet(nursery, {"p0": "prefill", "d0": "decode"})
    argv = [sys.executable, *healthcheck_command()[1:]]
    env = {**os.environ, "NARWHAL_HEALTH_URL": harness.url + "/health"}
    done = await trio.run_process(argv, env=env, capture_stderr=True, check=False)
    assert done.returncode == 0, done.stderr
    with trio.socket.socket() as sock:  # a port nobody listens on
        await sock.bind(("127.0.0.1", 0))
        free = sock.getsockname()[1]
    env["NARWHAL_HEALTH_URL"] = f"http://127.0.0.1:{free}/health"
    done = await trio.run_process(argv, env=env, capture_stderr=True, check=False)
    assert done.returncode != 0
    env["NARWHAL_HEALTH_URL"] = harness.url + "/no-such-path"  # a 404 is unhealthy too
    done = await trio.run_process(argv, env=env, capture_stderr=True, check=False)
    assert done.returncode != 0
    await finish(harness)


# --- the systemd unit -------------------------------------------------------------------


def unit() -> dict[str, dict[str, list[str]]]:
    """section -> key -> every value given (systemd keys may repeat)."""
    sections: dict[str, dict[str, list[str]]] = {}
    current: dict[str, list[str]] | None = None
    for line in UNIT.read_text().splitlines():
        line = line.strip()
        if not line or line[0] in "#;":
            continue
        if line.startswith("["):
            current = sections.setdefault(line.strip("[]"), {})
            continue
        assert current is not None, f"a key before any section: {line}"
        key, sep, value = line.partition("=")
        assert sep, f"not key=value: {line}"
        current.setdefault(key.strip(), []).append(value.strip())
    return sections


def unit_value(key: str) -> str:
    (value,) = unit()["Service"][key]
    return value


def test_systemd_unit_runs_the_router_and_drains_it() -> None:
    service = unit()["Service"]
    argv = shlex.split(unit_value("ExecStart"))
    assert Path(argv[0]).is_absolute(), argv[0]
    assert Path(argv[0]).name == "narwhal", argv[0]
    args = parse_serve(argv[1:], "narwhal.service ExecStart")
    assert unit_value("Restart") == "on-failure"
    assert unit_value("KillSignal") == "SIGTERM"
    # only the main process gets SIGTERM: it drains the workers, which would die at once
    assert unit_value("KillMode") == "mixed"
    assert unit_value("ExecReload") == "/bin/kill -HUP $MAINPID"
    stop = float(unit_value("TimeoutStopSec").removesuffix("s"))
    bound = drain_bound_s(example_serving(), args.workers)
    assert stop > bound, f"TimeoutStopSec={stop} kills a drain that may take {bound} s"
    assert unit_value("User") not in ("root", "0")
    # a status no restart can fix stops the restarts; each is a startup failure of serve
    fatal = {int(s) for s in unit_value("RestartPreventExitStatus").split()}
    from_startup = {
        startup.EXIT_INVALID_FLEET,
        startup.EXIT_NO_FLEET_FILE,
        startup.EXIT_TLS,
        startup.EXIT_VERSIONS,
    }
    assert fatal, "RestartPreventExitStatus names no status"
    assert fatal <= from_startup, fatal
    # the journal's and the fleet file's directories are the ones systemd makes and opens
    # up under ProtectSystem=strict
    assert args.journal, "the unit keeps no journal"
    assert Path(args.journal).parent == Path("/var/log") / unit_value("LogsDirectory")
    assert Path(args.config).parent == Path("/etc") / unit_value("ConfigurationDirectory")
    for key, value in {
        "NoNewPrivileges": "yes",
        "ProtectSystem": "strict",
        "ProtectHome": "yes",
        "PrivateTmp": "yes",
        "CapabilityBoundingSet": "",
    }.items():
        assert service.get(key) == [value], f"{key}={service.get(key)}"
    assert args.port > 1023, "a port below 1024 needs a capability the unit does not grant"


def test_systemd_analyze_verify_accepts_the_unit(tmp_path: Path) -> None:
    analyze = shutil.which("systemd-analyze")
    if analyze is None:
        pytest.skip("systemd-analyze not installed")
    # verify wants ExecStart's binary to exist: the one this checkout installed
    narwhal = Path(sys.executable).parent / "narwhal"
    assert narwhal.exists(), narwhal
    installed = shlex.split(unit_value("ExecStart"))[0]
    copy = tmp_path / UNIT.name
    copy.write_text(UNIT.read_text().replace(installed, str(narwhal)))
    done = subprocess.run(
        [analyze, "verify", "--man=no", str(copy)], capture_output=True, text=True, timeout=60
    )
    complaints = [line for line in (done.stdout + done.stderr).splitlines() if UNIT.name in line]
    assert done.returncode == 0, done.stdout + done.stderr
    assert not complaints, complaints


# --- Kubernetes -------------------------------------------------------------------------


@functools.cache
def k8s_objects() -> tuple[tuple[str, dict[str, Any]], ...]:
    """(file name, object) for every document of deploy/k8s but the kustomization."""
    out = []
    for path in sorted(K8S.glob("*.yaml")):
        if path.name == "kustomization.yaml":
            continue
        for doc in yaml.safe_load_all(path.read_text()):
            if doc is not None:
                out.append((path.name, doc))
    return tuple(out)


def k8s(kind: str) -> list[dict[str, Any]]:
    return [obj for _, obj in k8s_objects() if obj["kind"] == kind]


def router_deployment() -> dict[str, Any]:
    (deployment,) = k8s("Deployment")
    return deployment


def router_container() -> dict[str, Any]:
    (container,) = router_deployment()["spec"]["template"]["spec"]["containers"]
    return container


def router_service() -> dict[str, Any]:
    pod_labels = router_deployment()["spec"]["template"]["metadata"]["labels"]
    services = [
        s for s in k8s("Service") if s["spec"].get("selector", {}).items() <= pod_labels.items()
    ]
    assert len(services) == 1, "one Service selects the router's pods"
    return services[0]


def fleet_text() -> str:
    (configmap,) = k8s("ConfigMap")
    args = router_args()
    key = Path(args.config).name
    assert key in configmap["data"], f"the ConfigMap has no {key}"
    text: str = configmap["data"][key]
    return text


def router_args() -> Any:
    container = router_container()
    argv = [*container.get("command", []), *container.get("args", [])]
    assert argv[:1] == ["narwhal"], "the Deployment names its command (narwhal serve ...)"
    return parse_serve(argv[1:], "router.yaml command + args")


def test_kustomization_lists_every_manifest_in_one_namespace() -> None:
    kustomization = yaml.safe_load((K8S / "kustomization.yaml").read_text())
    files = {p.name for p in K8S.glob("*.yaml")} - {"kustomization.yaml"}
    assert set(kustomization["resources"]) == files
    namespace = kustomization["namespace"]
    for name, obj in k8s_objects():
        assert obj["metadata"].get("namespace") == namespace, f"{name}: {obj['kind']}"
    kinds = {obj["kind"] for _, obj in k8s_objects()}
    assert {
        "Deployment",
        "Service",
        "PodDisruptionBudget",
        "ServiceMonitor",
        "ConfigMap",
    } <= kinds


def test_router_deployment_matches_the_command_line_and_the_fleet() -> None:
    deployment = router_deployment()
    pod = deployment["spec"]["template"]["spec"]
    container = router_container()
    args = router_args()
    assert args.host == "0.0.0.0"
    ports = {p["name"]: p["containerPort"] for p in container["ports"]}
    assert list(ports.values()) == [args.port], f"containerPort {ports} but --port {args.port}"
    # probes: readiness on /ready, liveness (and startup) on /health, on the serving port
    expected = {"readinessProbe": "/ready", "livenessProbe": "/health", "startupProbe": "/health"}
    for probe, path in expected.items():
        get = container[probe]["httpGet"]
        assert get["path"] == path, f"{probe} on {get['path']}"
        assert get["port"] in (args.port, *[n for n, p in ports.items() if p == args.port])
    # the grace period covers the preStop pause and the whole drain of this fleet file
    pause = container["lifecycle"]["preStop"]["exec"]["command"]
    assert pause[0] == "sleep", pause
    serving = tomllib.loads(fleet_text()).get("serving", {})
    need = float(pause[1]) + drain_bound_s(serving, args.workers)
    grace = pod["terminationGracePeriodSeconds"]
    assert grace > need, f"terminationGracePeriodSeconds {grace} <= {need} (preStop + drain)"
    # one worker per core
    requests = container["resources"]["requests"]
    assert float(requests["cpu"]) == args.workers, (requests, args.workers)
    assert container["resources"]["limits"]["memory"]
    # rolling updates add a ready replica before one drains
    assert deployment["spec"]["strategy"]["rollingUpdate"]["maxUnavailable"] == 0
    assert deployment["spec"]["replicas"] >= 2
    # non-root, as the image's user
    image_user = next(a for w, a in reversed(final_stage()) if w == "USER").split(":")[0]
    assert pod["securityContext"]["runAsNonRoot"] is True
    assert str(pod["securityContext"]["runAsUser"]) == image_user != "0"
    security = container["securityContext"]
    assert security["allowPrivilegeEscalation"] is False
    assert security["capabilities"]["drop"] == ["ALL"]
    # the fleet ConfigMap is mounted where --config reads it; /tmp is writable (workers'
    # metrics) under a read-only root
    mounts = {m["mountPath"]: m["name"] for m in container["volumeMounts"]}
    volumes = {v["name"]: v for v in pod["volumes"]}
    fleet_volume = volumes[mounts[str(Path(args.config).parent)]]
    (configmap,) = k8s("ConfigMap")
    assert fleet_volume["configMap"]["name"] == configmap["metadata"]["name"]
    if security.get("readOnlyRootFilesystem"):
        assert "emptyDir" in volumes[mounts["/tmp"]]


def test_service_pdb_and_servicemonitor_select_the_router() -> None:
    deployment = router_deployment()
    pod_labels = deployment["spec"]["template"]["metadata"]["labels"]
    assert deployment["spec"]["selector"]["matchLabels"].items() <= pod_labels.items()
    service = router_service()
    container_ports = {p["name"]: p["containerPort"] for p in router_container()["ports"]}
    (port,) = service["spec"]["ports"]
    assert port["targetPort"] in container_ports or port["targetPort"] in container_ports.values()
    (pdb,) = k8s("PodDisruptionBudget")
    assert pdb["spec"]["selector"]["matchLabels"].items() <= pod_labels.items()
    assert pdb["spec"]["maxUnavailable"] < deployment["spec"]["replicas"]
    (monitor,) = k8s("ServiceMonitor")
    assert monitor["apiVersion"] == "monitoring.coreos.com/v1"
    assert (
        monitor["spec"]["selector"]["matchLabels"].items() <= service["metadata"]["labels"].items()
    )
    namespace = service["metadata"]["namespace"]
    assert namespace in monitor["spec"]["namespaceSelector"]["matchNames"]
    (endpoint,) = monitor["spec"]["endpoints"]
    assert endpoint["port"] == port["name"]
    assert endpoint["path"] == "/metrics"
    # the alert rules' job is the Service's name (prometheus-operator's default job label)
    assert service["metadata"]["name"] == alert_job()


def discover_blocks() -> list[dict[str, Any]]:
    blocks: list[dict[str, Any]] = tomllib.loads(fleet_text()).get("discover", [])
    assert blocks, "the fleet ConfigMap discovers no engines"
    return blocks


def test_discover_blocks_name_the_headless_engine_services() -> None:
    services = {s["metadata"]["name"]: s for s in k8s("Service")}
    roles = set()
    for block in discover_blocks():
        host, _, domain = block["dns"].partition(".")
        service = services.get(host)
        assert service is not None, f"[[discover]] {block['name']}: no Service {host}"
        namespace = service["metadata"]["namespace"]
        assert domain == f"{namespace}.svc.cluster.local", block["dns"]
        assert service["spec"].get("clusterIP") == "None", f"{host} is not headless"
        assert block["port"] in [p["port"] for p in service["spec"]["ports"]]
        assert service["spec"]["selector"]["app.kubernetes.io/component"] == block["role"]
        assert block.get("scheme", "http") in ("http", "https")
        roles.add(block["role"])
    assert roles >= {"prefill", "decode"} or "both" in roles


def test_the_fleet_configmap_loads_with_narwhals_loader(tmp_path: Path) -> None:
    path = tmp_path / "fleet.toml"
    path.write_text(fleet_text())
    try:
        fleet = load_config(path)
    except ConfigError as exc:
        if any(re.match(r"discover(y)?\b", p) for p in exc.problems):
            pytest.fail(
                "narwhal/core/config.py does not know the [[discover]] and [discovery] sections of "
                "contract section 2 yet, which deploy/k8s/fleet-configmap.yaml uses; rerun once "
                "it does. The loader said:\n" + exc.render()
            )
        pytest.fail("deploy/k8s/fleet-configmap.yaml's fleet file is refused:\n" + exc.render())
    assert (
        fleet.serving.graceful_timeout_s
        == tomllib.loads(fleet_text())["serving"]["graceful_timeout_s"]
    )


# --- what the router serves: probe paths, metric names ---------------------------------


def served_paths() -> dict[str, str]:
    """Every path a deploy/ file asks the router for, with where it asks."""
    paths = {
        "Containerfile HEALTHCHECK": urlsplit(
            re.findall(r"https?://[^'\"\s]+", " ".join(healthcheck_command()))[0]
        ).path
    }
    container = router_container()
    for probe in ("readinessProbe", "livenessProbe", "startupProbe"):
        paths[f"router.yaml {probe}"] = container[probe]["httpGet"]["path"]
    (monitor,) = k8s("ServiceMonitor")
    paths["servicemonitor.yaml"] = monitor["spec"]["endpoints"][0]["path"]
    scrape = yaml.safe_load(PROMETHEUS.read_text())["scrape_configs"][0]
    paths["prometheus.yml"] = scrape.get("metrics_path", "/metrics")
    return paths


async def scrape_after_traffic(nursery: trio.Nursery) -> tuple[str, dict[str, int]]:
    """A router over fake engines after a few requests: its /metrics text, and the status
    of every path deploy/ asks it for. A ``[[discover]]`` block whose nameserver never
    answers puts the discovery series in the scrape (the listed engines serve)."""
    sections: dict[str, Any] = {}
    try:
        from narwhal.core.config import DiscoverBlock, DiscoveryConfig
    except ImportError:  # before [[discover]]: the alert test names what is missing
        pass
    else:
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as udp:
            udp.bind(("127.0.0.1", 0))
            silent = udp.getsockname()[1]  # closed again: queries to it are refused
        sections["discover"] = (DiscoverBlock("prefill", "vllm-prefill.test", role="prefill"),)
        sections["discovery"] = DiscoveryConfig(interval_s=0.5, nameserver=f"127.0.0.1:{silent}")
    harness = await start_fleet(nursery, {"p0": "prefill", "d0": "decode"}, **sections)
    for stream in (True, False):
        body = {"model": MODEL, "prompt": "hello", "max_tokens": 3, "stream": stream}
        assert (await harness.post("/v1/completions", body)).status == 200
    assert (await harness.post("/v1/completions", {"model": "nope", "prompt": "x"})).status == 404
    statuses = {path: (await harness.get(path)).status for path in set(served_paths().values())}
    reply = await harness.get("/metrics")
    assert reply.status == 200
    await finish(harness)
    return reply.body.decode(), statuses


async def test_every_path_deploy_asks_for_is_served(nursery: trio.Nursery) -> None:
    _, statuses = await scrape_after_traffic(nursery)
    for where, path in served_paths().items():
        assert path in PROBE_PATHS, f"{where}: {path} is not one of {sorted(PROBE_PATHS)}"
        assert statuses[path] == 200, f"{where}: GET {path} -> {statuses[path]}"


def selectors(expr: str) -> list[tuple[str, list[tuple[str, str, str]]]]:
    """(metric, [(label, op, value)]) of every metric a PromQL expression names."""
    expr = re.sub(r"\b(by|without|on|ignoring)\s*\([^)]*\)", "", expr)
    expr = re.sub(r"\[[^\]]*\]", "", expr)  # ranges
    out = []
    for match in re.finditer(r"([a-zA-Z_:][a-zA-Z0-9_:]*)\s*(\{[^}]*\})?", expr):
        name, matchers = match.group(1), match.group(2) or ""
        if name in PROMQL_WORDS or re.fullmatch(r"\d.*", name):
            continue
        found = re.findall(r'(\w+)\s*(=~|!~|!=|=)\s*"([^"]*)"', matchers)
        out.append((name, found))
    return out


async def test_alert_rules_name_what_the_router_exports(nursery: trio.Nursery) -> None:
    text, _ = await scrape_after_traffic(nursery)
    samples: dict[str, list[dict[str, str]]] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            samples.setdefault(sample.name, []).append(sample.labels)
    rules = alert_rules()
    assert len(rules) >= 8
    for rule in rules:
        assert rule["alert"].startswith("Narwhal"), rule["alert"]
        assert rule["labels"]["severity"] in ("critical", "warning"), rule["alert"]
        named = selectors(rule["expr"])
        assert named, rule["expr"]
        for metric, matchers in named:
            if metric in PROMETHEUS_OWN:
                continue
            assert metric in samples, f"{rule['alert']}: {metric} is not exported"
            for label, op, value in matchers:
                values = {s.get(label) for s in samples[metric]}
                assert values - {None}, f"{rule['alert']}: {metric} has no label {label}"
                if op != "=":
                    continue
                if label in OPEN_LABELS:  # values that appear with traffic only
                    assert re.fullmatch(OPEN_LABELS[label], value), (rule["alert"], value)
                else:  # values the router creates at start (fates, reasons, phases)
                    assert value in values, f"{rule['alert']}: no {metric}{{{label}={value!r}}}"


def test_role_alerts_follow_the_discover_blocks() -> None:
    """The per-role alerts pick engines by the id prefix discovery gives them
    ("<name>/<ip>:<port>"): each prefix is a [[discover]] block of that role."""
    blocks = {b["name"]: b["role"] for b in discover_blocks()}
    roles = {"NarwhalNoProducerUp": "prefill", "NarwhalNoConsumerUp": "decode"}
    for rule in alert_rules():
        prefixes = re.findall(r'engine=~"([\w-]+)/\.\+"', rule["expr"])
        if rule["alert"] in roles:
            assert prefixes, rule["alert"]
        for prefix in prefixes:
            assert prefix in blocks, f"{rule['alert']}: no [[discover]] block named {prefix}"
            assert blocks[prefix] in (roles[rule["alert"]], "both"), rule["alert"]


def test_prometheus_example_scrapes_the_alerts_job() -> None:
    config = yaml.safe_load(PROMETHEUS.read_text())
    (scrape,) = config["scrape_configs"]
    assert scrape["job_name"] == alert_job()
    assert "alerts.yml" in config["rule_files"]
    (target,) = scrape["static_configs"][0]["targets"]
    argv = shlex.split(unit_value("ExecStart"))
    assert target.rsplit(":", 1)[1] == str(parse_serve(argv[1:], "narwhal.service").port)


# --- promtool ---------------------------------------------------------------------------


def run_promtool(*args: str, stdin: str | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [promtool(), *args], input=stdin, capture_output=True, text=True, timeout=120, cwd=DEPLOY
    )


def test_promtool_checks_the_rules_and_the_scrape_config() -> None:
    done = run_promtool("check", "rules", ALERTS.name)
    assert done.returncode == 0, done.stdout + done.stderr
    assert f"SUCCESS: {len(alert_rules())} rules found" in done.stdout
    done = run_promtool("check", "config", PROMETHEUS.name)
    assert done.returncode == 0, done.stdout + done.stderr


def test_promtool_unit_tests_of_the_alerts_pass() -> None:
    done = run_promtool("test", "rules", ALERT_TESTS.name)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "SUCCESS" in done.stdout
    tested = set(re.findall(r"alertname: (\w+)", ALERT_TESTS.read_text()))
    assert len(tested & {rule["alert"] for rule in alert_rules()}) >= 4, tested


async def test_promtool_finds_no_lint_in_a_real_scrape(nursery: trio.Nursery) -> None:
    text, _ = await scrape_after_traffic(nursery)
    assert await lint_exposition(text.encode()) == (0, "")


# --- the guide ----------------------------------------------------------------------------


def test_the_deploy_guide_names_every_deploy_file() -> None:
    guide = GUIDE.read_text()
    for path in sorted(DEPLOY.rglob("*")):
        if path.is_file():
            name = path.relative_to(ROOT).as_posix()
            assert name in guide, f"docs/deploy.md does not mention {name}"
    for named in set(re.findall(r"`((?:deploy|docs|examples)/[\w./-]+)`", guide)):
        assert (ROOT / named).exists(), f"docs/deploy.md names {named}, which does not exist"
