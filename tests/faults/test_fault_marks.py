"""Every test that injects a fault on purpose is marked ``faults`` (so `-m faults` and the fault table see it).

A static check of the test sources (no test is run): a test function "injects" when its own code, its
decorators or a module-level helper it calls (transitively) kills a process (``os.kill``, ``killpg``,
``.send_signal``, ``.kill()``, SIGKILL/SIGTERM), fills or shrinks a disk (a ``tmpfs`` mount, ENOSPC,
``is_full``), corrupts something (a lower-case ``*corrupt*`` call), cuts a connection (``SO_LINGER`` resets,
a fault server's status/truncate/reset/stall/bad-checksum ``Fault``), makes a host unresolvable, arms a
crashing failpoint (``crash``/``oom``/``kill``/``fail`` in a ``failpoints.env`` name), or raises an error
labelled ``(injected)``. Clean-up in ``finally:`` / ``except`` blocks is not an injection. A test that
injects without the marker is listed; the list must be empty. EXEMPT names the few that match these patterns
without injecting a fault, each with its reason.
"""

from __future__ import annotations

import ast
import textwrap

from tests.conftest import REPO

KILLS = {"kill", "killpg", "send_signal"}
NAMES = {"SIGKILL", "SIGTERM", "ENOSPC", "SO_LINGER", "is_full", "does_not_resolve"}
FAULT_FIELDS = {"status", "truncate_at", "reset_at", "stall_at", "bad_checksum"}  # not delay/redirect/etag/before
FAILPOINT_WORDS = ("crash", "oom", "kill", "fail", "corrupt", "enospc")
KILL_TEXT = ("os.kill(", "SIGKILL", "killpg(")

EXEMPT = {
    "tests/fetch/test_fault_server.py": "tests the fault server itself (the tool the fault tests use)",
    "tests/faults/test_fault_ledger.py": "the fault tests it runs are an inner session's source, marked there",
    "tests/faults/test_fault_marks.py": "this check and its own examples",
    "tests/image/test_images.py::test_local_source_cache_survives_touch_but_not_edit": "an edit of a source, "
    "seen as a new version: the feature under test, not a corruption",
    "tests/tokenize/test_tokenize.py::test_fingerprint_is_content_based": "an edited input gets a new fingerprint: "
    "the feature under test, not a corruption",
    "tests/image/test_images.py::test_destination_not_writable": "a read-only destination refused before any byte "
    "is fetched: a bad input, nothing fails mid-way",
    "tests/image/test_images.py::test_disk_too_small_is_refused_before_copying": "a small disk refused before "
    "copying: a bad input, nothing is filled",
    "tests/foundation/test_foundation.py::test_unwritable_directory_is_named": "a read-only mount named in an "
    "error: a bad input, nothing fails mid-way",
    "tests/devtools/test_processes.py::test_stop_escalates_to_sigkill": "the SIGKILL is stop()'s own escalation, "
    "the behaviour under test, not a fault",
    "tests/devtools/test_processes.py::test_stop_collects_the_exit_status_of_a_leader_that_exits_during_the_group_scan": (
        "the signals are stop()'s own, the behaviour under test"
    ),
}


HARMLESS = {"SIGUSR1", "SIGUSR2", "SIGHUP", "SIGCONT", "SIGWINCH", 0, 10, 12}  # told, not killed


def _harmless_signal(call: ast.Call) -> bool:
    """``os.kill(pid, signal.SIGUSR1)``, ``proc.send_signal(10)``: a message to a process, not a fault."""
    if not call.args:
        return False
    sig = call.args[-1]
    value = sig.attr if isinstance(sig, ast.Attribute) else sig.value if isinstance(sig, ast.Constant) else None
    return (len(call.args) == 2 or getattr(call.func, "attr", "") == "send_signal") and value in HARMLESS


def _injections(fn: ast.FunctionDef, helpers: dict, strings: dict, seen: set) -> list[str]:
    found: list[str] = []

    def visit(node: ast.AST) -> None:
        if isinstance(node, ast.Try):
            for child in [*node.body, *node.orelse]:
                visit(child)
            return  # except handlers and finally: clean-up
        if isinstance(node, ast.Call):
            func = node.func
            name = func.attr if isinstance(func, ast.Attribute) else getattr(func, "id", "")
            owner = getattr(func.value, "id", "") if isinstance(func, ast.Attribute) else ""
            if name in KILLS and isinstance(func, ast.Attribute) and not _harmless_signal(node):
                found.append(f"{name}()")
            if "corrupt" in name and name[:1].islower():
                found.append(f"{name}()")
            if name == "tmpfs":
                found.append("tmpfs()")
            if name == "Fault" and any(k.arg in FAULT_FIELDS for k in node.keywords):
                found.append("Fault(" + ", ".join(k.arg for k in node.keywords if k.arg in FAULT_FIELDS) + ")")
            if name == "env" and owner == "failpoints":
                found.extend(
                    f"failpoint {k.arg}" for k in node.keywords if any(w in (k.arg or "") for w in FAILPOINT_WORDS)
                )
            if isinstance(func, ast.Name) and func.id in helpers and func.id not in seen:
                seen.add(func.id)
                found.extend(f"{func.id}: {what}" for what in _injections(helpers[func.id], helpers, strings, seen))
        elif isinstance(node, ast.Name):
            if node.id in NAMES:
                found.append(node.id)
            if node.id in strings and any(t in strings[node.id] for t in KILL_TEXT):
                found.append(f"{node.id} (a program that kills)")
        elif isinstance(node, ast.Attribute) and node.attr in NAMES:
            found.append(node.attr)
        elif isinstance(node, ast.Constant) and isinstance(node.value, str) and "(injected)" in node.value:
            found.append("an '(injected)' error")
        elif isinstance(node, ast.AugAssign) and isinstance(node.op, ast.BitXor):
            found.append("a flipped byte (^=)")
        for child in ast.iter_child_nodes(node):
            visit(child)

    for part in [*fn.decorator_list, *fn.body]:
        visit(part)
    return found


def _marked(node: ast.AST) -> bool:
    return "mark.faults" in ast.unparse(node)


def unmarked_injections(source: str, path: str) -> dict[str, list[str]]:
    """{nodeid: what it injects} for the test functions of ``source`` that inject without the faults marker."""
    tree = ast.parse(source)
    helpers = {n.name: n for n in tree.body if isinstance(n, ast.FunctionDef) and not n.name.startswith("test_")}
    strings = {
        t.id: n.value.value
        for n in tree.body
        if isinstance(n, ast.Assign) and isinstance(n.value, ast.Constant) and isinstance(n.value.value, str)
        for t in n.targets
        if isinstance(t, ast.Name)
    }
    strings.update(
        {
            t.id: ast.unparse(n.value)
            for n in tree.body
            if isinstance(n, ast.Assign) and isinstance(n.value, ast.Call)  # textwrap.dedent("""...""")
            for t in n.targets
            if isinstance(t, ast.Name)
        }
    )
    module_marked = any(
        isinstance(n, ast.Assign) and any(getattr(t, "id", "") == "pytestmark" for t in n.targets) and _marked(n.value)
        for n in tree.body
    )
    tests: list[tuple[str, ast.FunctionDef, bool]] = []
    for node in tree.body:
        if isinstance(node, ast.FunctionDef) and node.name.startswith("test_"):
            tests.append((node.name, node, module_marked))
        elif isinstance(node, ast.ClassDef):
            class_marked = module_marked or any(_marked(d) for d in node.decorator_list)
            tests += [
                (f"{node.name}::{n.name}", n, class_marked)
                for n in node.body
                if isinstance(n, ast.FunctionDef) and n.name.startswith("test_")
            ]
    found = {}
    for name, fn, inherited in tests:
        if inherited or any(_marked(d) for d in fn.decorator_list):
            continue
        what = _injections(fn, helpers, strings, set())
        if what:
            found[f"{path}::{name}"] = sorted(set(what))
    return found


def test_every_test_that_injects_a_fault_is_marked():
    found = {}
    for path in sorted((REPO / "tests").rglob("test_*.py")):
        rel = str(path.relative_to(REPO))
        if rel in EXEMPT:
            continue
        for nodeid, what in unmarked_injections(path.read_text(), rel).items():
            if nodeid not in EXEMPT:
                found[nodeid] = what
    listing = "\n".join(f"{nodeid}: {', '.join(what)}" for nodeid, what in found.items())
    assert not found, f"{len(found)} tests inject faults without @pytest.mark.faults:\n{listing}"


def marked_without_a_row(source: str, path: str) -> list[str]:
    """The tests of ``source`` marked ``faults`` whose code (or a module helper it calls) never opens a row."""
    tree = ast.parse(source)
    helpers = {n.name: n for n in tree.body if isinstance(n, ast.FunctionDef) and not n.name.startswith("test_")}
    module_marked = any(
        isinstance(n, ast.Assign) and any(getattr(t, "id", "") == "pytestmark" for t in n.targets) and _marked(n.value)
        for n in tree.body
    )

    def opens(fn: ast.FunctionDef, seen: set) -> bool:
        for node in ast.walk(fn):
            if isinstance(node, ast.Attribute) and node.attr == "open_row":
                return True
            if isinstance(node, ast.Name) and node.id in helpers and node.id not in seen:
                seen.add(node.id)
                if opens(helpers[node.id], seen):
                    return True
        return False

    return [
        f"{path}::{n.name}"
        for n in ast.walk(tree)
        if isinstance(n, ast.FunctionDef)
        and n.name.startswith("test_")
        and (module_marked or any(_marked(d) for d in n.decorator_list))
        and not opens(n, set())
    ]


def test_every_marked_test_opens_a_row():
    """A faults test with no row would show only as a stand-in (and error if it passes): found here first."""
    found = []
    for path in sorted((REPO / "tests").rglob("test_*.py")):
        rel = str(path.relative_to(REPO))
        if rel not in EXEMPT:
            found += marked_without_a_row(path.read_text(), rel)
    assert not found, f"{len(found)} faults tests open no row:\n" + "\n".join(found)


def test_the_check_finds_each_kind_of_injection():
    """The detector itself: each kind it names is found in an unmarked test, and none in marked or clean-up code."""
    source = textwrap.dedent(
        """
        import os, signal, socket, pytest
        from tests.support import failpoints
        KILLER = "import os, signal; os.kill(os.getpid(), signal.SIGKILL)"

        def corrupt_shard(p):
            p.write_bytes(b"x")

        def test_kill(proc):
            os.kill(proc.pid, signal.SIGKILL)

        def test_term(proc):
            proc.send_signal(signal.SIGTERM)

        def test_disk(tmp_path):
            with tmpfs(tmp_path, "size=1m"):
                pass

        def test_corrupt(tmp_path):
            corrupt_shard(tmp_path)

        def test_cut(server):
            server.add_faults("/a", Fault(reset_at=10))

        def test_reset(conn):
            conn.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, b"")

        def test_oom(spec):
            spec.env.update(failpoints.env(train__oom_at_step=1))

        def test_program(port):
            run(KILLER)

        def test_raised():
            raise OSError("disk full (injected)")

        def test_cleanup_only(proc):
            try:
                proc.wait()
            finally:
                proc.kill()

        def test_slow_but_no_fault(server):
            server.add_faults("/a", Fault(delay=0.5), Fault(redirect="http://x"))

        def test_pause(spec):
            failpoints.env(train__pause_after_step=3)

        @pytest.mark.faults
        def test_marked(proc):
            os.kill(proc.pid, signal.SIGKILL)
        """
    )
    found = unmarked_injections(source, "t.py")
    assert set(found) == {
        f"t.py::test_{n}" for n in ("kill", "term", "disk", "corrupt", "cut", "reset", "oom", "program", "raised")
    }
    assert found["t.py::test_cut"] == ["Fault(reset_at)"]
    assert found["t.py::test_corrupt"] == ["corrupt_shard()"]
    assert "pytestmark = pytest.mark.faults\n" not in source
    assert unmarked_injections("import pytest\npytestmark = [pytest.mark.faults]\n" + source, "t.py") == {}
    rowless = (
        "import pytest\n@pytest.mark.faults\ndef test_x():\n    pass\n@pytest.mark.faults\ndef test_y():\n    h()\n"
    )
    helper = "def h():\n    fault_ledger.open_row('y')\n"
    assert marked_without_a_row(rowless + helper, "t.py") == ["t.py::test_x"]
