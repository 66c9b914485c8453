"""The docs as an operator uses them: every command marked runnable runs and does what the page
says, every other `nvhook` command line names commands and options that exist, every relative
link resolves, and the README links every page (docs/testing.md, "The docs are tested").

A runnable block is a fenced block whose info string is `sh test`. It runs with `bash -e` in a
fresh directory holding links to the repository's tests/, config/, packaging/ and oci-hooks.d/
(so `tests/fixtures/rootfs/host-gpu8` is a fixture host), with this venv's nvhook first on PATH
and a config whose caches and log are in that directory. `# expect: TEXT` lines in the block
name text its output must contain; `# exit: N` the status it must end with (default 0).
"""

from __future__ import annotations

import fcntl
import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
PAGES = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]
LINKED_INTO_RUN_DIR = ("tests", "config", "packaging", "oci-hooks.d")

# Pages other helpers are writing while the README already lists them: a link to one of these
# may dangle until it lands. The lead empties this set once they are all in.
PENDING_PAGES: set[str] = set()
# Commands and options the docs describe that land with another branch (issue 23, item 5).
PENDING_COMMANDS: set[str] = set()
PENDING_OPTIONS: set[tuple[str, str]] = set()

FENCE = re.compile(r"^(?P<indent> *)(?P<fence>```+)(?P<info>[^`\n]*)$")


def fenced_blocks(path: Path) -> list[dict]:
    """Every fenced block of a Markdown file: info string, first line number, body."""
    blocks, cur = [], None
    for n, line in enumerate(path.read_text().split("\n"), 1):
        m = FENCE.match(line)
        if cur is None:
            if m:
                cur = {"path": path, "line": n, "info": m["info"].strip(), "fence": m["fence"],
                       "indent": len(m["indent"]), "body": []}
        elif m and m["fence"] == cur["fence"] and not m["info"].strip():
            cur["body"] = "\n".join(cur["body"])
            blocks.append(cur)
            cur = None
        else:
            cur["body"].append(line[cur["indent"]:] if line.startswith(" " * cur["indent"]) else line)
    assert cur is None, f"{path.name}:{cur['line']}: code block never closed" if cur else ""
    return blocks


def rel(path: Path) -> str:
    return str(path.relative_to(REPO))


BLOCKS = [b for p in PAGES for b in fenced_blocks(p)]
RUNNABLE = [b for b in BLOCKS if b["info"] == "sh test"]


def test_pages_have_runnable_blocks():
    """The marker is in use (a renamed marker would silently test nothing)."""
    assert len(RUNNABLE) >= 20, [f"{rel(b['path'])}:{b['line']}" for b in RUNNABLE]
    assert {rel(b["path"]) for b in RUNNABLE} >= {"README.md", "docs/troubleshooting.md", "docs/cdi.md",
                                                  "docs/configuration.md", "docs/migrating-from-nvidia-toolkit.md"}


@pytest.fixture
def run_dir(tmp_path, fixtures_root):
    for name in LINKED_INTO_RUN_DIR:
        (tmp_path / name).symlink_to(REPO / name)
    for name in ("cache", "run"):
        (tmp_path / name).mkdir(mode=0o700)
    cfg = tmp_path / "docs-test.toml"
    cfg.write_text(f'cache_dir = "{tmp_path}/cache"\nlog_file = "{tmp_path}/nvhook.log"\n')
    env = {k: v for k, v in os.environ.items() if not k.startswith("NVHOOK_")}
    env.update(PATH=f"{Path(sys.executable).parent}:{os.environ.get('PATH', '/usr/bin:/bin')}",
               NVHOOK_CONFIG=str(cfg), NVHOOK_RUN_DIR=str(tmp_path / "run"), NO_COLOR="1",
               NVHOOK_STATE_DIR=str(tmp_path / "state"))  # `runtime configure`'s record, not /var/lib
    return tmp_path, env


@pytest.mark.parametrize("block", RUNNABLE, ids=[f"{rel(b['path'])}:{b['line']}" for b in RUNNABLE])
def test_runnable_block(block, run_dir, fixtures_root):
    cwd, env = run_dir
    body = block["body"]
    expects = re.findall(r"^\s*# expect: (.+?)\s*$", body, re.M)
    codes = re.findall(r"^\s*# exit: (\d+)\s*$", body, re.M)
    want = int(codes[-1]) if codes else 0
    with open(fixtures_root / ".lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_SH)  # not while conftest regenerates the fixture hosts
        proc = subprocess.run(["bash", "-e", "-c", body], cwd=cwd, env=env, capture_output=True, text=True,
                              timeout=300)
    out = proc.stdout + proc.stderr
    where = f"{rel(block['path'])}:{block['line']}"
    assert proc.returncode == want, f"{where}: exit {proc.returncode}, wanted {want}\n{body}\n--- output:\n{out[-4000:]}"
    for text in expects:
        assert text in out, f"{where}: {text!r} not in the output\n--- output:\n{out[-4000:]}"
    assert not (cwd / "nvhook.log").exists() or "--log-file" in body, "an interactive command wrote the config's log"


# --- Commands in blocks that cannot run here (a GPU, root on a real host, a live engine) ------

def _click_tree():
    from nvhook.commands.cli import cli

    return cli


def _split_commands(line: str) -> list[list[str]]:
    """The simple commands of a shell line, as token lists (comments dropped)."""
    try:
        lexer = shlex.shlex(line, posix=True, punctuation_chars=";&|")
        lexer.whitespace_split = True
        lexer.commenters = "#"
        tokens = list(lexer)
    except ValueError:
        return []
    cmds, cur = [], []
    for t in tokens:
        if set(t) <= set(";&|"):
            cmds.append(cur)
            cur = []
        else:
            cur.append(t)
    cmds.append(cur)
    return [c for c in cmds if c]


def nvhook_invocations() -> list[tuple[str, list[str]]]:
    """(where, argv after `nvhook`) for every nvhook command line in a shell block."""
    found = []
    for b in BLOCKS:
        if b["info"].split(" ")[0] not in ("sh", "bash", "console"):
            continue
        for k, line in enumerate(b["body"].split("\n")):
            for cmd in _split_commands(line):
                while cmd and ("=" in cmd[0] and not cmd[0].startswith("-") or cmd[0] in ("sudo", "exec")):
                    cmd = cmd[1:]  # VAR=value prefixes
                if cmd and os.path.basename(cmd[0]) == "nvhook":
                    found.append((f"{rel(b['path'])}:{b['line'] + 1 + k}", cmd[1:]))
    return found


def resolve(argv: list[str]) -> tuple[str, list[str]]:
    """The click command path an argv names, and each option it gives that the command at that
    position does not take (an option before a subcommand belongs to the group)."""
    import click

    cmd, path, unknown = _click_tree(), [], []
    args = list(argv)
    while args:
        a = args.pop(0)
        if re.match(r"\d*[<>]", a):  # a redirection, and its file when apart
            if re.fullmatch(r"\d*[<>]+", a) and args:
                args.pop(0)
            continue
        if a.startswith("-"):
            name = a.split("=", 1)[0]
            opt = next((p for p in cmd.params if isinstance(p, click.Option) and name in (*p.opts, *p.secondary_opts)),
                       None)
            if opt is None:
                if name.startswith("--") and name != "--help":
                    unknown.append(name)
            elif not opt.is_flag and "=" not in a and args:
                args.pop(0)  # its value
        elif isinstance(cmd, click.Group):
            if a not in cmd.commands:
                unknown.append(f"subcommand {a!r}")
                break
            path.append(a)
            cmd = cmd.commands[a]
    return " ".join(path), unknown


def test_unrunnable_commands_exist():
    """Each nvhook command line the docs show names a real subcommand and real options."""
    problems, paths = [], set()
    invocations = nvhook_invocations()
    assert len(invocations) > 30
    for where, argv in invocations:
        if argv and argv[0] in ("prestart", "createRuntime") or "--cdi" in argv:
            continue  # hook mode: parsed without click (nvhook.start.client)
        words = [a for a in argv if not a.startswith("-")]
        pending = next((c for c in PENDING_COMMANDS if " ".join(words).startswith(c)), None)
        name, unknown = resolve(argv)
        if pending and name != pending:
            continue
        paths.add(name)
        for opt in unknown:
            if (name, opt) not in PENDING_OPTIONS:
                problems.append(f"{where}: nvhook {' '.join(argv)}: {opt} is not known there")
    assert not problems, "\n".join(problems)
    # and each named command answers --help as an operator would run it
    env = {k: v for k, v in os.environ.items() if k != "NVHOOK_CONFIG"}
    for name in sorted(paths):
        proc = subprocess.run([str(Path(sys.executable).with_name("nvhook")), *name.split(), "--help"],
                              capture_output=True, text=True, env=env, timeout=60)
        assert proc.returncode == 0 and "Usage:" in proc.stdout, f"nvhook {name} --help: {proc.stderr}"


# --- Links ---------------------------------------------------------------------------------

LINK = re.compile(r"\[[^\]\n]*\]\(([^)\s]+)\)")


def _prose(path: Path) -> str:
    """The page without its code blocks and code spans (a link there is an example, not a link)."""
    text = re.sub(r"^ *```.*?^ *```[^\n]*$", "", path.read_text(), flags=re.M | re.S)
    return re.sub(r"`[^`\n]*`", "", text)


def slug(heading: str) -> str:
    """The anchor GitHub gives a heading: lower case, punctuation dropped, spaces to hyphens."""
    text = heading.strip().lower()
    text = re.sub(r"[^\w\- ]", "", text)
    return text.replace(" ", "-")


def anchors(path: Path) -> set[str]:
    seen: dict[str, int] = {}
    out = set()
    text = re.sub(r"^ *```.*?^ *```[^\n]*$", "", path.read_text(), flags=re.M | re.S)
    for m in re.finditer(r"^#{1,6} +(.+?) *#*$", text, re.M):
        s = slug(m[1])
        n = seen.get(s, 0)
        seen[s] = n + 1
        out.add(s if n == 0 else f"{s}-{n}")
    return out


def test_slug_rule():
    assert slug("Docker `--gpus`") == "docker---gpus"
    assert slug('"unknown device \'9\' in NVIDIA_VISIBLE_DEVICES"') == "unknown-device-9-in-nvidia_visible_devices"
    assert slug("The container's ld.so.cache") == "the-containers-ldsocache"


def test_links_resolve():
    problems = []
    for page in PAGES:
        for m in LINK.finditer(_prose(page)):
            target = m[1]
            if re.match(r"[a-z]+:", target):
                continue  # https:, mailto:
            file_part, _, anchor = target.partition("#")
            dest = (page.parent / file_part).resolve() if file_part else page
            if not dest.exists():
                if rel(dest) not in PENDING_PAGES:
                    problems.append(f"{rel(page)}: {target}: no such file")
                continue
            if anchor and dest.suffix == ".md" and anchor not in anchors(dest):
                problems.append(f"{rel(page)}: {target}: no heading with anchor #{anchor} in {rel(dest)}")
    assert not problems, "\n".join(problems)


def test_readme_links_every_page():
    linked = {(REPO / m[1].partition("#")[0]).resolve() for m in LINK.finditer(_prose(REPO / "README.md"))}
    missing = [rel(p) for p in PAGES[1:] if p.resolve() not in linked]
    assert not missing, f"README.md has no link to {missing}"
    for name in PENDING_PAGES:  # the pages others are writing are listed already
        assert (REPO / name).resolve() in linked, f"README.md has no link to {name}"


def test_first_two_commands_unchanged():
    """CI and newcomers run these two exactly as written."""
    text = (REPO / "README.md").read_text()
    head = text.split("## First two commands", 1)
    assert len(head) == 2 and head[0].count("\n## ") == 0, "First two commands must be the README's first section"
    assert "sh .ci/deps demo && make demo" in head[1].split("\n## ")[0]
    assert "sh .ci/deps test && make test" in head[1].split("\n## ")[0]


def test_named_paths_exist():
    """Every repository path a page names in a code span (`nvhook/start/hook.py`,
    `tests/test_e2e_cdi.py`, `packaging/systemd/`) exists: moved code leaves no stale pointer."""
    named = re.compile(r"`((?:nvhook|tests|bench|packaging|config|bin|oci-hooks\.d|\.ci)/[^`]*)`")
    missing = []
    for page in PAGES:
        for m in named.finditer(page.read_text()):
            path = m[1].split(" ")[0].rstrip("/")
            if "<" not in path and "*" not in path and not (REPO / path).exists():
                missing.append(f"{rel(page)}: {m[1]}")
    assert not missing, "\n".join(missing)
