"""islands.backend: "local" never touches pathwaysutils; "pathways" is refused in one line without its extra or its
environment, and with both it registers the Pathways proxy backend that JAX then dials.

The `island` command runs in a child process (the exit code and stderr a user sees). pathwaysutils is in the dev
extra, so "not installed" is made the way Python itself spells it: `sys.modules["pathwaysutils"] = None`, which
makes every import of it fail and `importlib.util.find_spec` answer None, exactly as when it is absent.
"""

from __future__ import annotations

import importlib.util
import socket
import subprocess
import sys

import pytest

from diloco.config import ConfigError, load_config
from islands.backend import BackendError, check_backend
from tests.conftest import REPO, child_env

ISLAND = ["island", "configs/two-region.toml", "--name", "us-east", "--coordinator", "127.0.0.1:1"]
HAS_PATHWAYSUTILS = importlib.util.find_spec("pathwaysutils") is not None


def run(code: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-c", code], cwd=REPO, env=env or child_env(), capture_output=True, text=True, timeout=120
    )


def island(*extra: str, hide_pathwaysutils: bool = False, env: dict[str, str] | None = None) -> tuple[int, str]:
    """`diloco island ... EXTRA` in a child: (exit code, stderr)."""
    hide = "sys.modules['pathwaysutils'] = None\n" if hide_pathwaysutils else ""
    done = run(f"import sys\n{hide}from diloco.cli import main\nsys.exit(main({[*ISLAND, *extra]!r}))\n", env)
    return done.returncode, done.stderr.strip()


@pytest.mark.multiprocess
def test_pathways_without_the_extra_is_one_line() -> None:
    code, err = island("islands.backend=pathways", hide_pathwaysutils=True)
    assert code == 2, err
    assert err == (
        "diloco: error: islands.backend = 'pathways' needs the pathways extra (pathwaysutils is not "
        "installed): pip install 'diloco[pathways]'"
    )


@pytest.mark.multiprocess
@pytest.mark.skipif(not HAS_PATHWAYSUTILS, reason="pathwaysutils (the pathways extra, in dev) is not installed")
def test_pathways_without_the_proxy_environment_is_one_line() -> None:
    """Without JAX_PLATFORMS=proxy pathwaysutils would change nothing and the island would train on the host's CPU:
    refused instead."""
    env = {**child_env(), "JAX_PLATFORMS": "cpu"}
    env.pop("JAX_BACKEND_TARGET", None)
    code, err = island("islands.backend=pathways", env=env)
    assert code == 2, err
    assert "\n" not in err and "needs JAX_PLATFORMS=proxy and JAX_BACKEND_TARGET=grpc://HOST:PORT" in err


@pytest.mark.multiprocess
def test_the_default_backend_never_imports_pathwaysutils() -> None:
    code = (
        "import sys\n"
        "from diloco.cli import build_parser\n"
        "import diloco.worker.island_worker\n"
        "from diloco.config import load_config\n"
        "from islands.backend import initialize_backend\n"
        "cfg = load_config('configs/two-region.toml')\n"
        "initialize_backend(cfg.islands.backend)\n"
        "print(cfg.islands.backend, 'pathwaysutils' in sys.modules)\n"
    )
    done = run(code)
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == ["local", "False"]


@pytest.mark.multiprocess
@pytest.mark.skipif(not HAS_PATHWAYSUTILS, reason="pathwaysutils (the pathways extra, in dev) is not installed")
def test_pathways_registers_the_proxy_backend() -> None:
    """With the environment a PathwaysJob sets, initialize_backend makes JAX dial the proxy: here nothing listens at
    JAX_BACKEND_TARGET, so the first device query fails saying it could not reach that address. Without the
    initialization JAX does not even know the backend."""
    with socket.socket() as s:  # a port nobody listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = {
        **child_env(),
        "JAX_PLATFORMS": "proxy",
        "JAX_BACKEND_TARGET": f"grpc://127.0.0.1:{port}",
        "PATHWAYS_PROXY_CONNECTION_TIMEOUT_SECS": "1",
    }
    query = "import jax\ntry:\n    jax.devices()\nexcept RuntimeError as exc:\n    print(exc)\n"
    plain = run(query, env)
    assert "not in the list of known backends" in plain.stdout, plain.stdout + plain.stderr
    done = run("from islands.backend import initialize_backend\ninitialize_backend('pathways')\n" + query, env)
    assert "ifrt_proxy" in done.stdout and f"127.0.0.1:{port}" in done.stdout, done.stdout + done.stderr


def test_backend_key_is_checked() -> None:
    with pytest.raises(ConfigError, match=r"islands.backend must be one of local, pathways \(got 'tpu'\)"):
        load_config(REPO / "configs/two-region.toml", ["islands.backend=tpu"])
    assert load_config(REPO / "configs/two-region.toml", ["islands.backend=pathways"]).islands.backend == "pathways"
    with pytest.raises(BackendError, match="must be one of local, pathways"):
        check_backend("gpu")
    check_backend("local", environ={})


@pytest.mark.skipif(not HAS_PATHWAYSUTILS, reason="pathwaysutils (the pathways extra, in dev) is not installed")
def test_check_backend_reads_the_environment() -> None:
    ok = {"JAX_PLATFORMS": "proxy", "JAX_BACKEND_TARGET": "grpc://pathways-head:29000"}
    check_backend("pathways", environ=ok)
    check_backend("pathways", environ={**ok, "JAX_PLATFORMS": "proxy,cpu"})
    for broken in ({**ok, "JAX_PLATFORMS": "cpu"}, {"JAX_PLATFORMS": "proxy"}):
        with pytest.raises(BackendError, match="needs JAX_PLATFORMS=proxy"):
            check_backend("pathways", environ=broken)
