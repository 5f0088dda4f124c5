"""The classes of the security findings cannot come back: a scan of the package's syntax trees.

- Every file trainguard creates or writes goes through trainguard.core.atomicfile
  (write_atomic / atomic_open: an exclusive random temporary opened without following a
  symlink, then a rename; open_append: O_NOFOLLOW): no plain ``open(..., "w"/"a"/"x")``, no
  ``Path.write_text`` / ``write_bytes`` / ``touch`` / ``open("w")``, no ``json.dump`` to a
  file, no
  ``os.open`` that creates a file following a symlink, no library writer that opens a path
  itself (safetensors' ``save_file``, ``torch.save`` to a path, ``sqlite3.connect``), unless
  listed below with the reason it is safe.
- Nothing under trainguard/runtime/etcd_v3 parses JSON but the guarded parsers of its codec:
  whatever a writer of the key prefix put there reaches a parser whose every exception is the
  designed refusal.
"""

from __future__ import annotations

import ast
from collections.abc import Iterator
from pathlib import Path

PKG = Path(__file__).resolve().parent.parent / "trainguard"

# (file relative to the package, enclosing function) -> why the write there is safe
ALLOWED_WRITES: dict[tuple[str, str], str] = {
    ("chaos/ops.py", "corrupt_checkpoint"): "fault injection: corrupts a committed shard in place",
    ("fleet/db.py", "_connect"): "the fleet database in the runs root, outside any run dir",
    (
        "chaos/throttle.py",
        "_make_group",
    ): "fault injection: a cgroup's control files (the kernel's, written in place by design)",
    ("chaos/throttle.py", "throttle"): "fault injection: moves a process between cgroups "
    "(cgroup.procs, the kernel's)",
    ("rl/engines/_vllm_server.py", "bad_shape_dir"): "fault injection: a damaged weight file in a "
    "private directory of the drill's",
    # trainguard.testing: what the tests and benchmarks start, in their own scratch directories
    # (the product never imports it: import-linter's "testing" contract)
    ("testing/etcd.py", "start"): "the test etcd's log, in its scratch directory",
    ("testing/etcd.py", "make_certs"): "a throwaway CA's config, in the test's scratch directory",
    ("testing/postgres.py", "start"): "the test PostgreSQL's log, in its scratch directory",
    ("testing/ft.py", "run_kills"): "the kill harness's logs and stop file, in its work directory",
    ("testing/ports.py", "free_port"): "the tests' shared port counter (a lock file in /tmp)",
}

# (file, function) allowed to call json.loads on what was read from etcd
ETCD_PARSERS = {
    ("runtime/etcd_v3/codec.py", "_decode"),
    ("runtime/etcd_v3/codec.py", "parse_json"),
    ("runtime/etcd_v3/codec.py", "gateway_json"),
}

_WRITE_MODES = set("wa+")  # "x" (O_CREAT|O_EXCL) fails on any existing name, a symlink too
_CREATE_SAFE = {"O_EXCL", "O_NOFOLLOW", "_NOFOLLOW"}


def _functions(tree: ast.AST) -> Iterator[tuple[str, ast.Call]]:
    """Every call with the name of its innermost enclosing function ('' at module level)."""

    def walk(node: ast.AST, fn: str) -> Iterator[tuple[str, ast.Call]]:
        for child in ast.iter_child_nodes(node):
            name = fn
            if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef)):
                name = child.name
            if isinstance(child, ast.Call):
                yield name, child
            yield from walk(child, name)

    yield from walk(tree, "")


def _dotted(f: ast.expr) -> str:
    if isinstance(f, ast.Name):
        return f.id
    if isinstance(f, ast.Attribute):
        inner = _dotted(f.value)
        return f"{inner}.{f.attr}" if inner else f".{f.attr}"
    return ""


def _mode(call: ast.Call, position: int) -> str | None:
    args = [a for a in call.args[position : position + 1]]
    args += [k.value for k in call.keywords if k.arg == "mode"]
    for a in args:
        if isinstance(a, ast.Constant) and isinstance(a.value, str):
            return a.value
    return None


def _names(node: ast.AST) -> set[str]:
    out = {n.attr for n in ast.walk(node) if isinstance(n, ast.Attribute)}
    out |= {
        n.value for n in ast.walk(node) if isinstance(n, ast.Constant) and isinstance(n.value, str)
    }
    return out | {n.id for n in ast.walk(node) if isinstance(n, ast.Name)}


def _unsafe_write(call: ast.Call) -> str | None:
    name = _dotted(call.func)
    last = name.rsplit(".", 1)[-1]
    if name == "open":
        mode = _mode(call, 1)
        return f"open(..., {mode!r})" if mode and _WRITE_MODES & set(mode) else None
    if name.endswith(".open") and name not in ("os.open",) and "fdopen" not in name:
        mode = _mode(call, 0)
        return f"{name}({mode!r})" if mode and _WRITE_MODES & set(mode) else None
    if last in ("write_text", "write_bytes", "touch") and name != "touch":
        return name
    if name == "json.dump":
        return "json.dump to a file"
    if name == "os.open" and len(call.args) > 1:
        flags = _names(call.args[1])
        if "O_CREAT" in flags and not _CREATE_SAFE & flags:
            return "os.open(O_CREAT) following a symlink"
    if last in ("save_file", "connect") and name in ("save_file", "sqlite3.connect"):
        return name
    if name == "torch.save" and len(call.args) > 1 and not isinstance(call.args[1], ast.Name):
        return "torch.save to a path"
    return None


def _files() -> Iterator[tuple[str, ast.AST]]:
    for path in sorted(PKG.rglob("*.py")):
        yield path.relative_to(PKG).as_posix(), ast.parse(path.read_text(), str(path))


def test_every_file_is_written_through_the_atomicfile_helpers() -> None:
    found, used = [], set()
    for rel, tree in _files():
        for fn, call in _functions(tree):
            what = _unsafe_write(call)
            if what is None:
                continue
            if (rel, fn) in ALLOWED_WRITES:
                used.add((rel, fn))
                continue
            found.append(f"trainguard/{rel}:{call.lineno} in {fn or '<module>'}: {what}")
    assert not found, "write through trainguard.core.atomicfile instead:\n" + "\n".join(found)
    assert used == set(ALLOWED_WRITES), f"stale exceptions: {set(ALLOWED_WRITES) - used}"


def test_etcd_data_is_parsed_only_by_the_guarded_parsers() -> None:
    found, used = [], set()
    for rel, tree in _files():
        if not rel.startswith("runtime/etcd_v3/"):
            continue
        for fn, call in _functions(tree):
            name = _dotted(call.func)
            if name not in ("json.loads", "json.load", "pickle.loads", "loads"):
                continue
            if (rel, fn) in ETCD_PARSERS:
                used.add((rel, fn))
                continue
            found.append(f"trainguard/{rel}:{call.lineno} in {fn}: {name}")
    assert not found, "parse etcd data through codec.parse_json / decode_state:\n" + "\n".join(
        found
    )
    assert used == ETCD_PARSERS


def test_the_scan_sees_what_it_must_refuse() -> None:
    """The scan itself: each refused form is caught, the helpers' forms are not."""
    bad = [
        'open(p, "w")', 'open(p, mode="ab")', 'p.open("w")', "p.write_text(s)",
        "p.write_bytes(b)", "p.touch()", "json.dump(d, f)", "os.open(p, os.O_WRONLY | os.O_CREAT)",
        "save_file(t, p)", "sqlite3.connect(p)", "torch.save(obj, path / 'x')",
    ]  # fmt: skip
    good = [
        "open(p)", 'open(p, "rb")', "write_atomic(p, s)", "json.dumps(d)",
        "os.open(p, os.O_WRONLY | os.O_CREAT | os.O_EXCL)", "os.fdopen(fd, 'w')",
        "os.open(p, os.O_RDONLY)", "torch.save(obj, buf)", 'open(p, "xb")',
        'os.open(p, os.O_CREAT | getattr(os, "O_NOFOLLOW", 0))',
    ]  # fmt: skip
    for src in bad:
        call = ast.parse(src).body[0].value  # type: ignore[attr-defined]
        assert _unsafe_write(call), src
    for src in good:
        call = ast.parse(src).body[0].value  # type: ignore[attr-defined]
        assert _unsafe_write(call) is None, src
