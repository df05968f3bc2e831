"""JupyterHub for a class taught from dmlbook on one server (README, "For instructors").

Each learner signs in with their Unix account and gets a Jupyter server of their own, started as a
local process running as that learner, with the book copied into ~/book on start
(``learner_server.py``). Run it as root from the folder that keeps the hub's state (its SQLite
database and cookie secret are written to the working folder)::

    cd /srv/jupyterhub
    /opt/dmlbook/.venv/bin/jupyterhub -f /opt/dmlbook/jupyterhub/jupyterhub_config.py

The tests load this file and override only what a test must (sign-in, spawner, ports, folders):
tests/system/test_hub.py.
"""

import sys
from pathlib import Path

c = get_config()  # noqa: F821 (JupyterHub defines it when it loads this file)

HERE = Path(__file__).resolve().parent

# -- where the hub listens. Learners reach the hub through the proxy at bind_url. Behind a TLS
# reverse proxy keep 127.0.0.1; to serve the network directly, give the proxy a certificate:
# c.JupyterHub.bind_url = "https://0.0.0.0:443"; c.JupyterHub.ssl_cert / ssl_key.
c.JupyterHub.bind_url = "http://127.0.0.1:8000"
c.JupyterHub.hub_bind_url = "http://127.0.0.1:8081"  # the hub's own API, for the proxy and servers

# -- the proxy: configurable-http-proxy from npm, installed into jupyterhub/node_modules by
# `make jupyterhub-proxy` (not global); the hub starts and stops it.
_proxy = HERE / "node_modules" / ".bin" / "configurable-http-proxy"
if _proxy.exists():
    c.ConfigurableHTTPProxy.command = [str(_proxy)]

# -- who may sign in: Unix accounts (PAM, JupyterHub's default authenticator) in group `dmlbook`;
# instructors, in group `dmlbook-staff`, are the hub's admins. Create them with
#   groupadd dmlbook; useradd -m -G dmlbook alice
c.PAMAuthenticator.allowed_groups = {"dmlbook"}
c.PAMAuthenticator.admin_groups = {"dmlbook-staff"}

# -- each learner's server: a local process, as the learner, in their home.
# learner_server.py copies the book (`python -m dmlbook.classroom copy-book ~/book`, which never
# writes over a notebook the learner has edited) and then becomes jupyterhub-singleuser, so the
# copy runs as the learner and within the learner's limits. It runs with this hub's Python:
# install the project where every learner can read it (e.g. /opt/dmlbook).
c.Spawner.cmd = [sys.executable, str(HERE / "learner_server.py")]
c.Spawner.notebook_dir = "~"
c.Spawner.default_url = "/lab/tree/book"
# nbgrader finds the course's configuration (course id, exchange) through JUPYTER_CONFIG_PATH.
c.Spawner.environment = {"JUPYTER_CONFIG_PATH": str(HERE)}
# A chapter starts up to 8 ranks (each a forked process with torch's pages shared); starting a
# learner's server takes a few seconds on a loaded machine.
c.Spawner.start_timeout = 120
c.Spawner.http_timeout = 60

# -- limits per learner. Only a spawner that runs servers in cgroups can enforce them:
# * SystemdSpawner (jupyterhub-systemdspawner, in the `jupyterhub` extra) runs each server as a
#   transient systemd unit and enforces mem_limit as MemoryMax= (the cgroup's hard limit: the
#   kernel's OOM killer ends the learner's biggest process, usually a kernel or a rank, beyond it)
#   and cpu_limit as CPUQuota= (cpu_limit x 100 %: 2.0 means at most two cores' time, shared
#   fairly between learners however many ranks they start). It needs systemd as PID 1.
# * LocalProcessSpawner (the fallback, and SimpleLocalProcessSpawner in the tests) enforces
#   neither: it only passes them to the server as $MEM_LIMIT and $CPU_LIMIT, for display.
# Sizing (README, "For instructors"): a chapter is made for 2 cores; memory per learner is the
# kernel plus its live ranks (PSS, measured there).
c.Spawner.cpu_limit = 2.0
c.Spawner.mem_limit = "3G"  # a ceiling: the README measures about 0.43 GiB (PSS) per learner


def _systemd_is_init() -> bool:
    return Path("/run/systemd/system").is_dir()


try:
    import systemdspawner  # noqa: F401
except ImportError:
    systemdspawner = None

if systemdspawner is not None and _systemd_is_init():
    c.JupyterHub.spawner_class = "systemdspawner.SystemdSpawner"
    c.SystemdSpawner.isolate_tmp = True  # each learner a private /tmp: no name in it is shared
    c.SystemdSpawner.isolate_devices = True
    c.SystemdSpawner.disable_user_sudo = True
else:
    c.JupyterHub.spawner_class = "jupyterhub.spawner.LocalProcessSpawner"

# -- stop servers nobody used for an hour, so that their kernels and ranks give memory back (the
# learner's files stay).
c.JupyterHub.services = [
    {
        "name": "idle-culler",
        "command": [sys.executable, "-m", "jupyterhub_idle_culler", "--timeout=3600"],
    }
]
c.JupyterHub.load_roles = [
    {
        "name": "idle-culler",
        "scopes": ["list:users", "read:users:activity", "read:servers", "delete:servers"],
        "services": ["idle-culler"],
    }
]
