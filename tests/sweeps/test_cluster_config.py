"""The cluster-launcher configs (ray_cluster.yaml, ray_cluster_local.yaml) are valid for Ray.

Validation goes through Ray's own code, the way `ray up` does it, as far as that works
offline:

* AWS: ``ray up`` runs ``commands._bootstrap_config``, which is ``util.prepare_config``
  (merge with ``aws/defaults.yaml``, merge setup commands, check docker, fill per-type
  min/max workers), then ``util.validate_config`` (JSON schema ``ray-schema.json`` plus
  Ray's cross-field checks), then the AWS bootstrap (IAM, key pair, subnets: needs AWS, not
  called here). We call the first two.
* local: the whole ``_bootstrap_config`` runs offline (the local provider's bootstrap only
  rewrites the config), so we call exactly what ``ray up`` calls.

Each config is also checked directly with ``jsonschema.validate`` against the schema file,
as written and after default filling; negative tests make sure each check rejects a broken
copy. The project-specific properties (GPU workers, installs of the mounted project,
dashboard on localhost, ...) are functions returning a list of problems, each tested on
the real file (no problems) and on a corrupted copy (the problem is found).
"""
from __future__ import annotations

import copy
import ipaddress
import json
import os
import posixpath
import re
import shlex
from pathlib import Path

import jsonschema
import pytest
import yaml

import ray.autoscaler
from ray.autoscaler._private.commands import _bootstrap_config
from ray.autoscaler._private.util import prepare_config, validate_config

REPO = Path(__file__).resolve().parents[2]
AWS_FILE = REPO / "ray_cluster.yaml"
LOCAL_FILE = REPO / "ray_cluster_local.yaml"
SCHEMA_FILE = Path(ray.autoscaler.__file__).parent / "ray-schema.json"

# vCPUs and GPUs of the instance types a config may use: a node type must not advertise
# more than the machine has (Ray would schedule work that never starts). Add a row when
# you use another type (from the EC2 instance-type page).
KNOWN_INSTANCE_SPECS = {
    "m5.xlarge": (4, 0), "m5.2xlarge": (8, 0), "m5.4xlarge": (16, 0), "m5.8xlarge": (32, 0),
    "g5.xlarge": (4, 1), "g5.2xlarge": (8, 1), "g5.4xlarge": (16, 1), "g5.8xlarge": (32, 1),
    "g5.12xlarge": (48, 4), "g5.16xlarge": (64, 1), "g5.24xlarge": (96, 4), "g5.48xlarge": (192, 8),
    "g6.xlarge": (4, 1), "g6.12xlarge": (48, 4), "g4dn.xlarge": (4, 1), "g4dn.12xlarge": (48, 4),
    "p3.2xlarge": (8, 1), "p3.8xlarge": (32, 4),
}
# RFC 5737 documentation ranges: placeholders that belong to no real machine.
DOC_NETS = [ipaddress.ip_network(n) for n in ("192.0.2.0/24", "198.51.100.0/24", "203.0.113.0/24")]


def load(path: Path) -> dict:
    # the same loader `ray up` uses (yaml.safe_load in commands.create_or_update_cluster)
    with open(path) as f:
        return yaml.safe_load(f)


@pytest.fixture(scope="module")
def schema() -> dict:
    with open(SCHEMA_FILE) as f:
        return json.load(f)


@pytest.fixture()
def aws() -> dict:
    return load(AWS_FILE)


@pytest.fixture()
def local() -> dict:
    return load(LOCAL_FILE)


def ray_up_offline(config: dict) -> dict:
    """What `ray up` does to a config before it launches anything, minus cloud calls."""
    config = copy.deepcopy(config)
    if config["provider"]["type"] == "local":
        return _bootstrap_config(config, no_config_cache=True)
    filled = prepare_config(config)
    validate_config(filled)
    return filled


# ----------------------------------------------------------------------------- Ray's checks


@pytest.mark.parametrize("path", [AWS_FILE, LOCAL_FILE], ids=lambda p: p.name)
def test_config_passes_rays_own_bootstrap_and_schema(path, schema):
    raw = load(path)
    jsonschema.validate(raw, schema)  # as written
    filled = ray_up_offline(raw)
    jsonschema.validate(filled, schema)  # as `ray up` hands it on
    validate_config(filled)  # schema + Ray's cross-field checks, again on the final form
    assert filled["head_node_type"] in filled["available_node_types"]
    assert filled["cluster_synced_files"] == []  # defaults were merged in


def test_aws_config_filled_with_aws_defaults(aws):
    filled = ray_up_offline(aws)
    # the user's values win over aws/defaults.yaml, and per-type bounds are filled in
    assert filled["provider"]["region"] == aws["provider"]["region"]
    head = filled["available_node_types"][filled["head_node_type"]]
    assert head["min_workers"] == 0 and head["max_workers"] == 0
    # merge_setup_commands: head/worker setup = common setup + their own
    n = len(aws["setup_commands"])
    assert filled["head_setup_commands"][:n] == aws["setup_commands"]
    assert filled["worker_setup_commands"][:n] == aws["setup_commands"]


def test_local_config_becomes_one_node_type_over_the_listed_machines(local):
    filled = ray_up_offline(local)
    (name,) = filled["available_node_types"]
    node_type = filled["available_node_types"][name]
    n_ips = len(local["provider"]["worker_ips"])
    assert filled["head_node_type"] == name
    assert node_type["min_workers"] == node_type["max_workers"] == filled["max_workers"] == n_ips


@pytest.mark.parametrize(
    "corrupt, exc",
    [
        (lambda c: c.__setitem__("max_nodes", 4), jsonschema.ValidationError),  # unknown top-level key
        (lambda c: c.__setitem__("max_workers", "many"), jsonschema.ValidationError),
        (lambda c: c["available_node_types"]["ray.worker.a10g_x1"]["resources"].__setitem__("GPU", 0.5),
         jsonschema.ValidationError),  # resources must be integers
        (lambda c: c["available_node_types"]["ray.worker.a10g_x1"].pop("node_config"), jsonschema.ValidationError),
        (lambda c: c["available_node_types"]["ray.worker.a10g_x1"].__setitem__("gpus", 1), jsonschema.ValidationError),
        (lambda c: c.__setitem__("head_node_type", "ray.head.nope"), ValueError),
        (lambda c: c["available_node_types"]["ray.worker.a10g_x1"].__setitem__("min_workers", 9), ValueError),
    ],
    ids=["unknown-key", "max_workers-str", "fractional-gpu", "no-node_config", "unknown-node-key",
         "bad-head-type", "min-above-global-max"],
)
def test_ray_rejects_a_corrupted_aws_config(aws, corrupt, exc):
    corrupt(aws)
    with pytest.raises(exc):
        ray_up_offline(aws)


@pytest.mark.parametrize(
    "key, value",
    [("max_nodes", 4), ("max_workers", "many"), ("setup_commands", "pip install -e ."),
     ("file_mounts_sync_continuously", "yes"), ("rsync_exclude", ".git")],
)
def test_schema_rejects_a_corrupted_config_directly(aws, local, schema, key, value):
    # (a string where Ray wants a list of commands crashes prepare_config with a
    # TypeError before its schema check: the schema alone catches it)
    for config in (aws, local):
        config[key] = value
        with pytest.raises(jsonschema.ValidationError):
            jsonschema.validate(config, schema)


def test_ray_rejects_node_types_in_a_local_config(local):
    # the local provider builds its own node type; `ray up` aborts when one is given
    import click

    local["available_node_types"] = {"x": {"resources": {}, "node_config": {}}}
    with pytest.raises(click.ClickException):
        ray_up_offline(local)


# ---------------------------------------------------------------- project-specific checks


def worker_types(filled: dict) -> dict:
    return {k: v for k, v in filled["available_node_types"].items() if k != filled["head_node_type"]}


def gpu_problems(filled: dict) -> list[str]:
    """Every worker type offers whole GPUs, within what its instance has; the head none."""
    problems = []
    if not worker_types(filled):
        problems.append("no worker node types")
    for name, nt in filled["available_node_types"].items():
        res = nt["resources"]
        is_head = name == filled["head_node_type"]
        if is_head and res.get("GPU", 0) != 0:
            problems.append(f"{name}: the head should offer no GPU (GPU work goes to workers)")
        if not is_head and res.get("GPU", 0) < 1:
            problems.append(f"{name}: worker without GPU resources")
        itype = nt["node_config"].get("InstanceType")
        if itype not in KNOWN_INSTANCE_SPECS:
            problems.append(f"{name}: unknown instance type {itype!r}; add it to KNOWN_INSTANCE_SPECS")
            continue
        cpus, gpus = KNOWN_INSTANCE_SPECS[itype]
        if res.get("CPU", 0) > cpus or res.get("GPU", 0) > gpus:
            problems.append(f"{name}: resources {res} exceed {itype} ({cpus} vCPU, {gpus} GPU)")
        if not nt["node_config"].get("ImageId"):
            problems.append(f"{name}: no ImageId (Ray would fall back to an old Ubuntu 18.04 DLAMI)")
    return problems


def worker_count_problems(filled: dict) -> list[str]:
    problems = []
    for name, nt in filled["available_node_types"].items():
        if not 0 <= nt["min_workers"] <= nt["max_workers"]:
            problems.append(f"{name}: min_workers {nt['min_workers']} > max_workers {nt['max_workers']}")
        if nt["max_workers"] > filled["max_workers"]:
            problems.append(f"{name}: max_workers above the global max_workers")
    if sum(nt["min_workers"] for nt in filled["available_node_types"].values()) > filled["max_workers"]:
        problems.append("sum of min_workers above the global max_workers")
    return problems


def project_mount(config: dict) -> str | None:
    """Remote path of the file mount that carries the repository ("." when run from its root)."""
    for remote, local_path in config.get("file_mounts", {}).items():
        if (REPO / local_path).resolve() == REPO:
            return remote
    return None


def install_problems(config: dict) -> list[str]:
    """The repository is mounted, and the setup commands pip-install that mounted path."""
    remote = project_mount(config)
    if remote is None:
        return ["no file mount carries the repository (expected `~/fedsap_ray: .`)"]
    if not (REPO / "pyproject.toml").is_file():
        return [f"mount source {REPO} has no pyproject.toml"]
    home_forms = {remote, remote.replace("~", "$HOME", 1), remote.replace("~", "/home/ubuntu", 1)}
    for cmd in config.get("setup_commands", []):
        if not re.search(r"\bpip install\b", cmd):
            continue
        words = [w for part in re.split(r"\|\||&&|;", cmd) for w in shlex.split(part)]
        for i, w in enumerate(words):
            target = words[i + 1] if w in ("-e", "--editable") and i + 1 < len(words) else w
            if target.rstrip("/") in home_forms:
                return []
    return [f"no setup command pip-installs the mounted project {remote}"]


def data_mount_problems(config: dict) -> list[str]:
    """The data folder keeps its place relative to the repository, and the loaders are told where it is."""
    remote_project = project_mount(config)
    mounts = {r: loc for r, loc in config.get("file_mounts", {}).items() if r != remote_project}
    data = [(r, loc) for r, loc in mounts.items() if Path(loc).parts[-2:] == ("shared", "data")]
    if not data:
        return ["no file mount for the data folder ../shared/data"]
    (remote, local_path), = data
    problems = []
    if remote_project and posixpath.relpath(remote, remote_project) != os.path.relpath(local_path, "."):
        problems.append(f"{remote} <- {local_path}: not at the same place relative to the repository")
    exported = [c for c in config["setup_commands"] if "FEDSAP_SHARED_DATA" in c]
    if not any(remote.replace("~", "$HOME", 1) in c for c in exported):
        problems.append(f"FEDSAP_SHARED_DATA is not exported as {remote}")
    return problems


def dashboard_problems(config: dict) -> list[str]:
    """The head's dashboard / job API is bound to localhost; nothing binds to all interfaces."""
    problems = []
    starts = [c for c in config.get("head_start_ray_commands", []) if "ray start" in c and "--head" in c]
    if len(starts) != 1:
        return [f"expected one `ray start --head`, found {len(starts)}"]
    hosts = re.findall(r"--dashboard-host[= ](\S+)", starts[0])
    if hosts not in (["127.0.0.1"], ["localhost"]):
        problems.append(f"dashboard bound to {hosts or 'the default'}, want --dashboard-host=127.0.0.1")
    if "--autoscaling-config=~/ray_bootstrap_config.yaml" not in starts[0]:
        problems.append("the head does not start the autoscaler with ~/ray_bootstrap_config.yaml")
    for cmd in config.get("head_start_ray_commands", []) + config.get("worker_start_ray_commands", []):
        if "0.0.0.0" in cmd or "::" in cmd:
            problems.append(f"binds to all interfaces: {cmd}")
    return problems


def test_aws_gpu_workers_and_instance_limits(aws):
    assert gpu_problems(ray_up_offline(aws)) == []


def test_gpu_check_finds_a_cpu_only_worker_and_oversized_resources(aws):
    workers = aws["available_node_types"]
    workers["ray.worker.a10g_x1"]["resources"] = {"CPU": 4, "GPU": 0}
    workers["ray.worker.a10g_x4"]["resources"] = {"CPU": 48, "GPU": 8}
    problems = gpu_problems(ray_up_offline(aws))
    assert any("ray.worker.a10g_x1: worker without GPU" in p for p in problems)
    assert any("ray.worker.a10g_x4: resources" in p and "exceed g5.12xlarge" in p for p in problems)


@pytest.mark.parametrize("path", [AWS_FILE, LOCAL_FILE], ids=lambda p: p.name)
def test_min_workers_not_above_max_workers(path):
    assert worker_count_problems(ray_up_offline(load(path))) == []


def test_worker_count_check_finds_min_above_max(aws):
    filled = ray_up_offline(aws)
    filled["available_node_types"]["ray.worker.a10g_x4"]["min_workers"] = 3
    assert any("min_workers 3 > max_workers 2" in p for p in worker_count_problems(filled))


@pytest.mark.parametrize("path", [AWS_FILE, LOCAL_FILE], ids=lambda p: p.name)
def test_setup_installs_the_mounted_project(path):
    config = load(path)
    assert project_mount(config) == "~/fedsap_ray"
    assert install_problems(config) == []
    # ...and the filled config that reaches the nodes keeps it on both head and workers
    filled = ray_up_offline(config)
    for key in ("head_setup_commands", "worker_setup_commands"):
        assert install_problems({**filled, "setup_commands": filled[key]}) == []


def test_install_check_finds_a_missing_install_or_mount(aws):
    no_install = {**aws, "setup_commands": [c for c in aws["setup_commands"] if "pip install" not in c]}
    assert install_problems(no_install) == ["no setup command pip-installs the mounted project ~/fedsap_ray"]
    other = {**aws, "setup_commands": [c.replace("$HOME/fedsap_ray", "$HOME/elsewhere") for c in aws["setup_commands"]]}
    assert install_problems(other) != []
    no_mount = {**aws, "file_mounts": {"~/data": "../shared/data"}}
    assert "no file mount carries the repository" in install_problems(no_mount)[0]


@pytest.mark.parametrize("path", [AWS_FILE, LOCAL_FILE], ids=lambda p: p.name)
def test_data_mount_mirrors_the_local_layout(path):
    assert data_mount_problems(load(path)) == []


def test_data_mount_check_finds_a_moved_mount(aws):
    aws["file_mounts"] = {"~/fedsap_ray": ".", "~/data/shared/data": "../shared/data"}
    problems = data_mount_problems(aws)
    assert any("not at the same place" in p for p in problems)
    assert any("FEDSAP_SHARED_DATA is not exported as ~/data/shared/data" in p for p in problems)


def test_the_data_env_var_is_the_one_the_loaders_read():
    sources = "".join(p.read_text() for p in (REPO / "fedsap_ray").rglob("*.py"))
    assert "FEDSAP_SHARED_DATA" in sources


def niceness_problems(config: dict) -> list[str]:
    """Every ``ray start`` runs Ray's workers at niceness 0, as the project's own local Ray does
    (fedsap_ray.runtime.ray.SYSTEM_CONFIG: at Ray's default 15 anything else on a node takes the cores)."""
    cmds = [c for c in config.get("head_start_ray_commands", []) + config.get("worker_start_ray_commands", [])
            if "ray start" in c]
    return [f"ray start without RAY_worker_niceness=0: {c}" for c in cmds
            if not re.search(r"(^|[;\s])RAY_worker_niceness=0\s+ray start", c)] or ([] if cmds else ["no ray start"])


@pytest.mark.parametrize("path", [AWS_FILE, LOCAL_FILE], ids=lambda p: p.name)
def test_ray_workers_start_at_niceness_zero(path):
    assert niceness_problems(load(path)) == []


def test_niceness_check_finds_a_start_at_rays_default(aws):
    aws["worker_start_ray_commands"] = [c.replace("RAY_worker_niceness=0 ", "") for c in aws["worker_start_ray_commands"]]
    assert any("without RAY_worker_niceness=0" in p for p in niceness_problems(aws))


@pytest.mark.parametrize("path", [AWS_FILE, LOCAL_FILE], ids=lambda p: p.name)
def test_dashboard_bound_to_localhost(path):
    assert dashboard_problems(load(path)) == []


def test_dashboard_check_finds_a_public_dashboard(aws):
    aws["head_start_ray_commands"] = [c.replace("127.0.0.1", "0.0.0.0") for c in aws["head_start_ray_commands"]]
    problems = dashboard_problems(aws)
    assert any("dashboard bound to ['0.0.0.0']" in p for p in problems)
    assert any("binds to all interfaces" in p for p in problems)


# ------------------------------------------------------------------------------ consistency


def test_both_configs_install_the_same_way(aws, local):
    assert aws["setup_commands"] == local["setup_commands"]
    assert aws["file_mounts"] == local["file_mounts"]
    assert aws["cluster_name"] != local["cluster_name"]


def test_ray_is_pinned_to_a_version_the_project_accepts(aws):
    from packaging.requirements import Requirement
    from packaging.version import Version

    pins = {m for c in aws["setup_commands"] for m in re.findall(r"ray\[[\w,]+\]==([\d.]+)", c)}
    assert len(pins) == 1, f"expected one pinned Ray version in setup_commands, found {pins}"
    pyproject = (REPO / "pyproject.toml").read_text()
    (spec,) = [Requirement(r) for r in re.findall(r'"(ray\[[^"]*)"', pyproject)]
    assert Version(pins.pop()) in spec.specifier


def test_image_is_the_same_for_every_node_type(aws):
    images = {nt["node_config"].get("ImageId") for nt in aws["available_node_types"].values()}
    assert len(images) == 1 and None not in images


def test_local_placeholders_are_documentation_addresses(local):
    # never a real machine in the committed file; users replace them
    ips = [local["provider"]["head_ip"], *local["provider"]["worker_ips"]]
    for ip in ips:
        assert any(ipaddress.ip_address(ip) in net for net in DOC_NETS), ip
    assert len(set(ips)) == len(ips)
    assert local["max_workers"] <= len(local["provider"]["worker_ips"])


# ---------------------------------------------------------------------------------------------
# Supply chain and network exposure (issue 25): installs come from the package registry, never a
# script piped into a shell; Ray requires its token; the ports the guide's firewall rules name are pinned
# ---------------------------------------------------------------------------------------------
COMMAND_KEYS = ("initialization_commands", "setup_commands", "head_setup_commands", "worker_setup_commands",
                "head_start_ray_commands", "worker_start_ray_commands")
PIPE_TO_SHELL = re.compile(
    r"(?:curl|wget|fetch)\b[^|;&]*\|\s*(?:env\b[^|;&]*?\s)?(?:sudo\s+(?:-\S+\s+)*)?(?:ba|z|da|k)?sh\b"  # curl .. | sh
    r"|(?:ba|z|da|k)?sh\s+(?:-\S+\s+)*(?:<\(|-c\s+[\"']?\$\()\s*(?:curl|wget)"  # sh <(curl ..), sh -c "$(curl ..)"
    r"|(?:curl|wget)\b[^|;&]*\|\s*(?:sudo\s+)?python3?\b")  # curl .. | python
PINNED_PORTS = ("--port=6379", "--object-manager-port=8076", "--node-manager-port=8077", "--runtime-env-agent-port=8078",
                "--dashboard-agent-grpc-port=8079", "--dashboard-agent-listen-port=52365", "--metrics-export-port=8080",
                "--min-worker-port=10002", "--max-worker-port=10999")


def pipe_to_shell_problems(config: dict) -> list[str]:
    """Commands that run a downloaded script (``curl ... | sh`` and its spellings)."""
    return [f"{key}: runs a downloaded script: {cmd}" for key in COMMAND_KEYS for cmd in config.get(key) or []
            if PIPE_TO_SHELL.search(cmd)]


def auth_problems(config: dict) -> list[str]:
    """Every node runs Ray with token authentication and gets the token from the machine running `ray up`."""
    problems = []
    if not any(re.search(r"export RAY_AUTH_MODE=token\b", c) for c in config.get("setup_commands", [])):
        problems.append("setup_commands do not export RAY_AUTH_MODE=token (Ray would accept anyone who reaches it)")
    if config.get("file_mounts", {}).get("~/.ray/auth_token") != "~/.ray/auth_token":
        problems.append("no file mount `~/.ray/auth_token: ~/.ray/auth_token` (nodes would lack the token)")
    return problems


def port_problems(config: dict) -> list[str]:
    """Each `ray start` pins the ports docs/guides/cluster.md names, so a firewall can allow exactly those."""
    problems = []
    for key in ("head_start_ray_commands", "worker_start_ray_commands"):
        for cmd in [c for c in config.get(key, []) if "ray start" in c]:
            wanted = PINNED_PORTS if "--head" in cmd else PINNED_PORTS[1:]
            problems += [f"{key}: {flag} not pinned" for flag in wanted if flag not in cmd.split()]
    return problems


@pytest.mark.parametrize("path", [AWS_FILE, LOCAL_FILE], ids=lambda p: p.name)
def test_no_downloaded_script_runs_and_ray_needs_its_token_on_pinned_ports(path):
    config = load(path)
    assert pipe_to_shell_problems(config) == []
    assert auth_problems(config) == []
    assert port_problems(config) == []
    installs = [c for c in config["setup_commands"] if re.search(r"\bpip install\b", c)]
    assert any('"uv==' in c for c in installs)  # uv itself comes from PyPI, pinned


@pytest.mark.parametrize("cmd", [
    'command -v uv >/dev/null 2>&1 || curl -LsSf https://astral.sh/uv/install.sh | env UV_INSTALL_DIR="$HOME/.local/bin" sh',
    "wget -qO- https://example.com/install | sudo -E bash",
    'sh -c "$(curl -fsSL https://example.com/install.sh)"',
    "bash <(curl -s https://example.com/x.sh)",
    "curl -s https://bootstrap.pypa.io/get-pip.py | python3",
])
def test_pipe_to_shell_check_finds_every_spelling(aws, cmd):
    broken = {**aws, "setup_commands": [*aws["setup_commands"], cmd]}
    assert pipe_to_shell_problems(broken) == [f"setup_commands: runs a downloaded script: {cmd}"]


def test_auth_and_port_checks_find_a_cluster_open_to_anyone(local):
    no_token = {**local, "setup_commands": [c for c in local["setup_commands"] if "RAY_AUTH_MODE" not in c],
                "file_mounts": {k: v for k, v in local["file_mounts"].items() if "auth_token" not in k}}
    assert len(auth_problems(no_token)) == 2
    random_ports = {**local, "worker_start_ray_commands": ["ray stop", "ray start --address=$RAY_HEAD_IP:6379"]}
    assert "worker_start_ray_commands: --min-worker-port=10002 not pinned" in port_problems(random_ports)


def test_the_cluster_guide_names_every_pinned_port():
    guide = (REPO / "docs" / "guides" / "cluster.md").read_text()
    for flag in PINNED_PORTS:
        port = flag.split("=")[1]
        assert port in guide, f"docs/guides/cluster.md does not name port {port} ({flag})"
    assert "RAY_AUTH_MODE=token" in guide and "ray get-auth-token --generate" in guide
