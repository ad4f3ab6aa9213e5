"""A real one-machine Slurm cluster for tests, demos and CI (``nemoflow local-slurm up``).

It runs Debian's Slurm 22.05 daemons without systemd, as root: ``munged``, a
private MariaDB (so ``sacct`` works through ``slurmdbd``), ``slurmdbd``,
``slurmctld`` and ``slurmd``. Everything it writes lives under one state dir
(``/var/lib/nemoflow-slurm`` by default, ``NEMOFLOW_SLURM_STATE_DIR`` to move
it): configs in ``etc/``, pid files in ``run/``, logs in ``log/``, the database
in ``mysql/``, fake GPU devices in ``dev/``. ``/etc/slurm/*.conf`` become
symlinks into ``etc/`` so plain ``sinfo``/``sbatch`` find the cluster, but
only where no Slurm config exists yet: a real cluster's config is never
replaced.

Two partitions share the node: ``cpu`` (default) and ``gpu``, whose GPUs are
GRES backed by dummy character devices (``mknod c 1 3``, i.e. /dev/null), so
``--gpus-per-node`` requests are scheduled and get ``CUDA_VISIBLE_DEVICES``.

``up`` is idempotent: daemons already running (by their pid files) are left
alone, so a second ``up`` returns in well under a second. ``down`` stops only
the daemons whose pid files it wrote.
"""

from __future__ import annotations

import dataclasses
import os
import secrets
import shutil
import socket
import subprocess
import sys
import time
from pathlib import Path

from infra.processes import read_pidfile, stop

DEFAULT_STATE_DIR = "/var/lib/nemoflow-slurm"
CLUSTER_NAME = "nemoflow"
DEBIAN_PACKAGES = ["slurmctld", "slurmd", "slurm-client", "slurmdbd", "munge", "mariadb-server"]
MARKER = "# managed by nemoflow local-slurm"
FAKE_GPUS = 4
CPU_MAX_TIME = "04:00:00"
GPU_MAX_TIME = "02:00:00"
DB_PORT = 13306  # a private port: never collides with a system MariaDB on 3306
CONF_FILES = ("slurm.conf", "slurmdbd.conf", "gres.conf", "cgroup.conf")
# Start order matters: munge authenticates everything, slurmdbd needs the
# database, slurmctld registers with slurmdbd, slurmd registers with slurmctld.
DAEMONS = ("munged", "mariadbd", "slurmdbd", "slurmctld", "slurmd")


class LocalSlurmError(RuntimeError):
    """The local cluster cannot be installed or started; the message says why."""


def state_dir() -> Path:
    return Path(os.environ.get("NEMOFLOW_SLURM_STATE_DIR", DEFAULT_STATE_DIR))


@dataclasses.dataclass
class Layout:
    root: Path

    @property
    def etc(self) -> Path:
        return self.root / "etc"

    @property
    def run(self) -> Path:
        return self.root / "run"

    @property
    def log(self) -> Path:
        return self.root / "log"

    @property
    def dev(self) -> Path:
        return self.root / "dev"

    @property
    def mysql(self) -> Path:
        return self.root / "mysql"

    def pidfile(self, daemon: str) -> Path:
        # MariaDB drops to the mysql user before writing its pid file and socket.
        return self.mysql_run / "mariadbd.pid" if daemon == "mariadbd" else self.run / f"{daemon}.pid"

    @property
    def mysql_run(self) -> Path:
        return self.run / "mysqld"

    @property
    def slurm_conf(self) -> Path:
        return self.etc / "slurm.conf"


def _node_hardware() -> tuple[str, int, int]:
    """This machine's hostname, CPU count and memory (MB) as slurmd sees them."""
    out = subprocess.run(["slurmd", "-C"], capture_output=True, text=True, check=True).stdout
    fields = dict(tok.split("=", 1) for tok in out.split() if "=" in tok)
    return fields["NodeName"], int(fields["CPUs"]), int(fields["RealMemory"])


def render_configs(layout: Layout, node: str, cpus: int, memory_mb: int, db_password: str) -> dict[str, str]:
    """The four config files, as text. Kept pure so tests can read what ``up`` writes."""
    # Leave headroom for the OS so slurmd never reports less memory than configured.
    real_memory = max(1024, memory_mb - 1024)
    gpu_files = f"{layout.dev}/nvidia[0-{FAKE_GPUS - 1}]"
    slurm_conf = f"""{MARKER}
ClusterName={CLUSTER_NAME}
SlurmctldHost={node}(127.0.0.1)
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
# Short credential lifetime: a requeued job restarts in ~20 s instead of ~140 s.
AuthInfo=cred_expire=10
StateSaveLocation={layout.root}/ctld
SlurmdSpoolDir={layout.root}/spool
SlurmctldPidFile={layout.pidfile("slurmctld")}
SlurmdPidFile={layout.pidfile("slurmd")}
SlurmctldLogFile={layout.log}/slurmctld.log
SlurmdLogFile={layout.log}/slurmd.log
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
MpiDefault=none
SchedulerType=sched/backfill
SelectType=select/cons_tres
SelectTypeParameters=CR_Core_Memory
# Without a default, a job would take the whole node's memory and run alone.
DefMemPerCPU=512
GresTypes=gpu
# Impossible requests fail at submit instead of pending forever.
EnforcePartLimits=ALL
DependencyParameters=kill_invalid_depend
# Finished jobs stay visible to scontrol while sacct catches up.
MinJobAge=3600
KillWait=5
ReturnToService=2
SlurmctldTimeout=30
SlurmdTimeout=60
InactiveLimit=0
AccountingStorageType=accounting_storage/slurmdbd
AccountingStorageHost=127.0.0.1
AccountingStorageTRES=gres/gpu
JobAcctGatherType=jobacct_gather/none
JobCompType=jobcomp/none
NodeName={node} NodeAddr=127.0.0.1 CPUs={cpus} RealMemory={real_memory} Gres=gpu:{FAKE_GPUS} State=UNKNOWN
PartitionName=cpu Nodes={node} Default=YES MaxTime={CPU_MAX_TIME} State=UP
PartitionName=gpu Nodes={node} MaxTime={GPU_MAX_TIME} State=UP
"""
    slurmdbd_conf = f"""{MARKER}
AuthType=auth/munge
DbdHost=localhost
DbdAddr=127.0.0.1
SlurmUser=root
PidFile={layout.pidfile("slurmdbd")}
LogFile={layout.log}/slurmdbd.log
StorageType=accounting_storage/mysql
StorageHost=127.0.0.1
StoragePort={DB_PORT}
StorageUser=slurm
StoragePass={db_password}
StorageLoc=slurm_acct_db
"""
    gres_conf = f"{MARKER}\nNodeName={node} Name=gpu File={gpu_files}\n"
    cgroup_conf = f"{MARKER}\nCgroupPlugin=autodetect\n"
    return {
        "slurm.conf": slurm_conf,
        "slurmdbd.conf": slurmdbd_conf,
        "gres.conf": gres_conf,
        "cgroup.conf": cgroup_conf,
    }


def _wait(predicate, timeout: float, what: str, log: Path | None = None) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return
        time.sleep(0.1)
    detail = ""
    if log is not None and log.exists():
        detail = "\n" + "\n".join(log.read_text(errors="replace").splitlines()[-15:])
    raise LocalSlurmError(f"{what} not ready after {timeout:.0f}s{detail}")


def _port_open(port: int) -> bool:
    with socket.socket() as sock:
        sock.settimeout(0.2)
        return sock.connect_ex(("127.0.0.1", port)) == 0


class LocalSlurm:
    """Install, configure, start, stop and inspect the one-machine cluster."""

    def __init__(self, root: str | Path | None = None):
        self.layout = Layout(Path(root) if root else state_dir())

    # ------------------------------------------------------------------ install

    @staticmethod
    def missing_packages() -> list[str]:
        return [
            pkg for pkg in DEBIAN_PACKAGES if subprocess.run(["dpkg", "-s", pkg], capture_output=True).returncode != 0
        ]

    def install(self) -> None:
        missing = self.missing_packages() if shutil.which("dpkg") else DEBIAN_PACKAGES
        if not missing:
            return
        if os.geteuid() != 0:
            raise LocalSlurmError(f"Debian packages missing ({' '.join(missing)}); run as root to install them")
        if not shutil.which("apt-get"):
            raise LocalSlurmError(f"packages {' '.join(missing)} are missing and apt-get is not available")
        env = dict(os.environ, DEBIAN_FRONTEND="noninteractive")
        for cmd in (["apt-get", "update", "-qq"], ["apt-get", "install", "-y", "-qq", *missing]):
            proc = subprocess.run(cmd, env=env, capture_output=True, text=True)
            if proc.returncode != 0:
                raise LocalSlurmError(f"{' '.join(cmd)} failed:\n{proc.stderr[-2000:]}")

    # ------------------------------------------------------------------ status

    def running(self) -> dict[str, int | None]:
        return {d: read_pidfile(self.layout.pidfile(d), d) for d in DAEMONS}

    def is_up(self) -> bool:
        if not all(self.running().values()):
            return False
        proc = subprocess.run(["sinfo", "-h", "-o", "%T"], capture_output=True, text=True, env=self.env(), timeout=10)
        states = proc.stdout.split()
        return (
            proc.returncode == 0
            and bool(states)
            and all(s.rstrip("*~#") in ("idle", "mixed", "allocated") for s in states)
        )

    def env(self) -> dict[str, str]:
        return dict(os.environ, SLURM_CONF=str(self.layout.slurm_conf))

    # ------------------------------------------------------------------ up

    def up(self, timeout: float = 60) -> None:
        if os.geteuid() != 0:
            raise LocalSlurmError("the local Slurm runs its daemons as root; run `nemoflow local-slurm up` as root")
        if self.layout.slurm_conf.exists() and self.is_up():
            return
        self.install()
        lay = self.layout
        for d in (lay.etc, lay.run, lay.log, lay.dev, lay.root / "ctld", lay.root / "spool"):
            d.mkdir(parents=True, exist_ok=True)
        self._write_configs()
        self._fake_gpus()
        self._link_etc()
        env = self.env()
        running = self.running()
        if not running["munged"]:
            self._start_munged()
        if not running["mariadbd"]:
            self._start_mariadb(timeout)
        if not running["slurmdbd"]:
            self._spawn("slurmdbd", ["slurmdbd"], env)
            _wait(lambda: _port_open(6819), timeout, "slurmdbd", lay.log / "slurmdbd.log")
        if not running["slurmctld"]:
            self._spawn("slurmctld", ["slurmctld"], env)
            _wait(lambda: _port_open(6817), timeout, "slurmctld", lay.log / "slurmctld.log")
        if not running["slurmd"]:
            self._spawn("slurmd", ["slurmd"], env)
        node = self._node_name()
        _wait(lambda: self._node_ready(node), timeout, f"node {node}", lay.log / "slurmd.log")

    def _write_configs(self) -> None:
        lay = self.layout
        password_file = lay.etc / ".dbpass"
        if not password_file.exists():
            password_file.write_text(secrets.token_hex(16))
            password_file.chmod(0o600)
        node, cpus, memory = _node_hardware()
        for name, text in render_configs(lay, node, cpus, memory, password_file.read_text().strip()).items():
            path = lay.etc / name
            if not path.exists() or path.read_text() != text:
                tmp = path.with_suffix(".tmp")
                tmp.write_text(text)
                # slurmdbd refuses a config other users can read (it holds the DB password).
                tmp.chmod(0o600 if name == "slurmdbd.conf" else 0o644)
                tmp.replace(path)

    def _fake_gpus(self) -> None:
        for i in range(FAKE_GPUS):
            dev = self.layout.dev / f"nvidia{i}"
            if not dev.exists():
                os.mknod(dev, 0o666 | 0o020000, os.makedev(1, 3))

    def _link_etc(self) -> None:
        """Point /etc/slurm/*.conf at our configs, unless someone else's Slurm config is there."""
        etc = Path("/etc/slurm")
        etc.mkdir(exist_ok=True)
        current = etc / "slurm.conf"
        ours = current.is_symlink() and Path(os.readlink(current)).parent == self.layout.etc
        if current.exists() and not ours and MARKER not in current.read_text(errors="replace"):
            return  # a real cluster's config: leave it; our daemons use SLURM_CONF
        for name in CONF_FILES:
            link = etc / name
            if link.is_symlink() or link.exists():
                link.unlink()
            link.symlink_to(self.layout.etc / name)

    def _spawn(self, name: str, argv: list[str], env: dict[str, str]) -> None:
        log = (self.layout.log / f"{name}.out").open("ab")
        # Daemons fork and write their own pid files; -D would keep them attached to us.
        proc = subprocess.run(argv, env=env, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
        if proc.returncode != 0:
            raise LocalSlurmError(f"{name} failed to start (exit {proc.returncode}); see {self.layout.log}/{name}.out")
        _wait(
            lambda: read_pidfile(self.layout.pidfile(name), name) is not None,
            20,
            f"{name} pid file",
            self.layout.log / f"{name}.log",
        )

    def _start_munged(self) -> None:
        key = Path("/etc/munge/munge.key")
        if not key.exists():
            subprocess.run(["mungekey", "--create"], check=True)
            shutil.chown(key, "munge", "munge")
        Path("/run/munge").mkdir(exist_ok=True)
        shutil.chown("/run/munge", "munge", "munge")
        pidfile = self.layout.pidfile("munged")
        tmp_pid = Path("/run/munge/nemoflow-munged.pid")
        proc = subprocess.run(
            ["runuser", "-u", "munge", "--", "munged", f"--pid-file={tmp_pid}"],
            capture_output=True,
            text=True,
        )
        if proc.returncode != 0 and "already running" not in proc.stderr.lower():
            raise LocalSlurmError(f"munged failed to start: {proc.stderr.strip()}")
        _wait(tmp_pid.exists, 10, "munged pid file")
        shutil.copyfile(tmp_pid, pidfile)

    def _start_mariadb(self, timeout: float) -> None:
        lay = self.layout
        datadir = lay.mysql
        fresh = not (datadir / "mysql").exists()
        if fresh:
            datadir.mkdir(parents=True, exist_ok=True)
            shutil.chown(datadir, "mysql", "mysql")
            proc = subprocess.run(
                [
                    "mariadb-install-db",
                    f"--datadir={datadir}",
                    "--user=mysql",
                    "--auth-root-authentication-method=socket",
                    "--skip-test-db",
                ],
                capture_output=True,
                text=True,
            )
            if proc.returncode != 0:
                raise LocalSlurmError(f"mariadb-install-db failed:\n{proc.stderr[-2000:]}")
        lay.mysql_run.mkdir(parents=True, exist_ok=True)
        shutil.chown(lay.mysql_run, "mysql", "mysql")
        sock = lay.mysql_run / "mysqld.sock"
        log = (lay.log / "mariadbd.log").open("ab")
        server = subprocess.Popen(
            [
                "mariadbd",
                "--no-defaults",
                f"--datadir={datadir}",
                "--user=mysql",
                f"--socket={sock}",
                f"--pid-file={lay.pidfile('mariadbd')}",
                "--bind-address=127.0.0.1",
                f"--port={DB_PORT}",
                "--innodb-buffer-pool-size=64M",
                "--skip-name-resolve",
            ],
            stdout=log,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            start_new_session=True,
        )
        _wait(
            lambda: server.poll() is not None or (sock.exists() and _port_open(DB_PORT)),
            timeout,
            "MariaDB",
            lay.log / "mariadbd.log",
        )
        if server.poll() is not None:
            tail = "\n".join((lay.log / "mariadbd.log").read_text(errors="replace").splitlines()[-10:])
            raise LocalSlurmError(f"MariaDB exited ({server.returncode}):\n{tail}")
        password = (lay.etc / ".dbpass").read_text().strip()
        sql = (
            "CREATE DATABASE IF NOT EXISTS slurm_acct_db;"
            f"CREATE USER IF NOT EXISTS 'slurm'@'127.0.0.1' IDENTIFIED BY '{password}';"
            f"CREATE USER IF NOT EXISTS 'slurm'@'localhost' IDENTIFIED BY '{password}';"
            "GRANT ALL ON slurm_acct_db.* TO 'slurm'@'127.0.0.1';"
            "GRANT ALL ON slurm_acct_db.* TO 'slurm'@'localhost';"
        )
        proc = subprocess.run(["mariadb", f"--socket={sock}", "-u", "root", "-e", sql], capture_output=True, text=True)
        if proc.returncode != 0:
            raise LocalSlurmError(f"creating the accounting database failed: {proc.stderr.strip()}")

    def _node_name(self) -> str:
        return _node_hardware()[0]

    def _node_ready(self, node: str) -> bool:
        proc = subprocess.run(
            ["sinfo", "-h", "-N", "-n", node, "-o", "%T"], capture_output=True, text=True, env=self.env()
        )
        state = proc.stdout.strip().split("\n")[0].rstrip("*~#") if proc.returncode == 0 else ""
        if state in ("down", "drained", "draining", "drain"):
            # A node that was down when slurmctld stopped stays down: bring it back.
            subprocess.run(
                ["scontrol", "update", f"nodename={node}", "state=resume"], capture_output=True, env=self.env()
            )
        return state in ("idle", "mixed", "allocated")

    # ------------------------------------------------------------------ down

    def down(self, timeout: float = 30) -> list[str]:
        """Stop the daemons this state dir started, newest first; returns their names."""
        stopped = []
        for name in reversed(DAEMONS):
            pid = read_pidfile(self.layout.pidfile(name), name)
            if pid is None:
                continue
            # Daemons are not our children and own no process group of ours: stop the pid alone.
            stop(pid, grace_s=timeout)
            self.layout.pidfile(name).unlink(missing_ok=True)
            stopped.append(name)
        return stopped

    def status(self) -> str:
        lines = []
        for name, pid in self.running().items():
            lines.append(f"{name:<10} {'running, pid ' + str(pid) if pid else 'stopped'}")
        lines.append(f"state dir  {self.layout.root}")
        if self.running()["slurmctld"]:
            proc = subprocess.run(["sinfo"], capture_output=True, text=True, env=self.env())
            lines.append(proc.stdout.rstrip() or proc.stderr.rstrip())
        return "\n".join(lines)


DESCRIPTION = """\
Run a real Slurm 22.05 cluster on this machine (Debian, as root): munged, a
private MariaDB + slurmdbd (so sacct works), slurmctld and slurmd, with two
partitions: cpu (default) and gpu (fake GPUs as GRES, so GPU requests are
scheduled). Configs, logs, pid files and the database live in the state dir
(NEMOFLOW_SLURM_STATE_DIR, default /var/lib/nemoflow-slurm); /etc/slurm/*.conf
link there unless another Slurm config is already installed.

  up      install missing Debian packages (apt-get), write configs, start the
          daemons that are not running; quick when already up
  down    stop the daemons this state dir started (by their pid files)
  status  show which daemons run and `sinfo`

Then: sbatch/squeue/sacct work as on any cluster, and
`get_backend("slurm")` runs nemoflow jobs there."""


def add_arguments(parser) -> None:
    """The command line of ``nemoflow local-slurm`` and ``python -m devtools.slurm_cluster``."""
    parser.add_argument("action", choices=["up", "down", "status"])
    parser.add_argument("--state-dir", default=None, help="where configs, logs and the database live")
    parser.add_argument("--timeout", type=float, default=60, help="seconds to wait for each daemon (up)")


def run(args, prog: str = "nemoflow local-slurm") -> int:
    """Do ``args.action``; print the outcome; the exit code (1 on a cluster error, 3: status finds a daemon down)."""
    cluster = LocalSlurm(args.state_dir)
    try:
        if args.action == "up":
            cluster.up(timeout=args.timeout)
            print(cluster.status())
        elif args.action == "down":
            stopped = cluster.down()
            print("stopped: " + (", ".join(stopped) if stopped else "nothing was running"))
        else:
            print(cluster.status())
            return 0 if all(cluster.running().values()) else 3
    except LocalSlurmError as exc:
        print(f"{prog} {args.action}: error: {exc}", file=sys.stderr)
        return 1
    return 0


def main(argv: list[str] | None = None) -> int:
    """``python -m devtools.slurm_cluster up|down|status`` (what scripts/services-up.sh runs)."""
    import argparse

    prog = "python -m devtools.slurm_cluster"
    parser = argparse.ArgumentParser(
        prog=prog, description=DESCRIPTION, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    add_arguments(parser)
    return run(parser.parse_args(argv), prog=prog)


if __name__ == "__main__":
    raise SystemExit(main())
