"""Who may read what nemoflow writes on shared storage: one umask, optionally one group.

Work directories, datasets, checkpoints and the model registry usually live on storage that other
accounts can reach (a cluster file system, a ReadWriteMany volume). What a file's mode would be
otherwise depends on whatever umask the process inherited: a container runtime or a batch system
may hand out ``000``, which makes every dataset and checkpoint world-writable. Here the mode is
explicit:

* ``NEMOFLOW_UMASK`` (default ``027``): files ``0640``, directories ``0750`` (owner writes,
  group reads, others nothing). It must keep files not world-writable and owner-writable; a team
  sharing one work directory sets ``007`` (group members read *and* write).
* ``NEMOFLOW_GROUP`` (unset by default): the group of the directories nemoflow creates, with the
  setgid bit, so every file any writer creates below them (AutoModel's checkpoint writer, Prefect's
  result store, megatron's index cache) belongs to the team too.

Every job entry point is ``python -m workloads.MODULE``, and ``workloads/__init__.py`` calls
:func:`apply_umask` first, so third-party writers inside jobs follow the setting (so does every
process that imports the pipeline: the flow run, the CLI). nemoflow's own writers do not rely on
the umask: infra.storage, the checkpoint and indexed-dataset writers set the mode explicitly
(:func:`secure_file`, :func:`makedirs`), which also covers files that start private (``mkstemp``
creates ``0600``). On ``gs://`` there are no modes: access is the bucket's IAM.

The two settings are parsed and checked in infra/settings.py (parse_umask, group_id).
"""

from __future__ import annotations

import os
import stat
from dataclasses import dataclass

from infra.settings import DEFAULT_UMASK, PermissionPolicyError, get_settings, group_id


@dataclass(frozen=True)
class Policy:
    umask: int = DEFAULT_UMASK
    gid: int | None = None

    @property
    def file_mode(self) -> int:
        return 0o666 & ~self.umask

    @property
    def dir_mode(self) -> int:
        return (0o777 & ~self.umask) | (stat.S_ISGID if self.gid is not None else 0)


def policy() -> Policy:
    """The policy from the settings (NEMOFLOW_UMASK, NEMOFLOW_GROUP; environment or .env)."""
    settings = get_settings()
    return Policy(settings.umask_value, group_id(settings.group) if settings.group else None)


def apply_umask(current: Policy | None = None) -> int:
    """Set this process's umask from the policy; returns the previous one."""
    return os.umask((current or policy()).umask)


def apply_umask_at_start() -> None:
    """:func:`apply_umask` for a process that is starting (``workloads/__init__.py``): never raises.

    Invalid settings are reported, in one line, where the settings are read; until then the
    process gets the default umask rather than whatever it inherited.
    """
    try:
        apply_umask()
    except ValueError:  # SettingsError, PermissionPolicyError
        os.umask(DEFAULT_UMASK)


def _own(path: str, current: Policy, st: os.stat_result) -> None:
    if current.gid is not None and st.st_gid != current.gid:
        try:
            os.chown(path, -1, current.gid)
        except PermissionError:
            raise PermissionPolicyError(
                f"cannot give {path} to group {current.gid} (NEMOFLOW_GROUP): the owner must be a member of it"
            ) from None


def secure_file(path: str | os.PathLike, current: Policy | None = None) -> None:
    """Give a file the policy's mode (execute bits kept) and group."""
    current = current or policy()
    path = os.fspath(path)
    st = os.stat(path)
    mode = current.file_mode | (stat.S_IMODE(st.st_mode) & 0o111 & ~current.umask)
    if stat.S_IMODE(st.st_mode) != mode:
        os.chmod(path, mode)
    _own(path, current, st)


def secure_dir(path: str | os.PathLike, current: Policy | None = None) -> None:
    """Give a directory the policy's mode and group (the setgid bit with a group, so files below inherit it)."""
    current = current or policy()
    path = os.fspath(path)
    st = os.stat(path)
    _own(path, current, st)
    # chmod clears an inherited setgid bit unless it is asked for: keep it.
    mode = current.dir_mode | (stat.S_IMODE(st.st_mode) & stat.S_ISGID)
    if stat.S_IMODE(st.st_mode) != mode:
        os.chmod(path, mode)


def makedirs(path: str | os.PathLike, current: Policy | None = None) -> None:
    """``os.makedirs(path, exist_ok=True)``; the directories it creates get the policy's mode and group.

    Directories that already existed are left as they are: their owner chose their mode.
    """
    path = os.path.abspath(os.fspath(path))
    missing = []
    head = path
    while not os.path.isdir(head):
        missing.append(head)
        parent = os.path.dirname(head)
        if parent == head:
            break
        head = parent
    if not missing:
        return
    current = current or policy()
    for directory in reversed(missing):
        try:
            os.mkdir(directory, 0o700)  # nobody else can use it before it has its mode
        except FileExistsError:
            if not os.path.isdir(directory):
                raise
            continue  # created meanwhile by another process: theirs to set
        secure_dir(directory, current)


def secure_tree(path: str | os.PathLike, current: Policy | None = None) -> None:
    """:func:`secure_dir` / :func:`secure_file` for ``path`` and everything below it (symlinks skipped).

    For trees that a library wrote with modes of its own choosing (AutoModel makes its
    checkpoint's consolidate.sh 0755 whatever the umask).
    """
    current = current or policy()
    for root, _dirs, files in os.walk(os.fspath(path)):
        if not os.path.islink(root):
            secure_dir(root, current)
        for name in files:
            file = os.path.join(root, name)
            if not os.path.islink(file):
                secure_file(file, current)
