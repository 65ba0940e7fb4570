#!/usr/bin/env python3
"""Group ``plugins/`` by role (issue 34, "a layout that shows the architecture").

    python scripts/relayout.py            # move and rewrite (git mv; prints what it did)
    python scripts/relayout.py --check    # exit 1 if the tree is not grouped yet (changes nothing)
    python scripts/relayout.py --also NAME=GROUP ...   # a plugin not in GROUPS below

The groups (:data:`GROUPS`):

* ``plugins/frontends/``  how requests reach a runtime: ``server``, ``dynamo``, ``comfyui``;
* ``plugins/execution/``  how a runtime runs them: ``scheduler``, ``parallel``;
* ``plugins/compute/``    libraries families import for their math: ``policies``, ``attention``, ``quant``.

What it does, from the repository root of a clean checkout (any branch; it never commits):

1. ``git mv plugins/<name> plugins/<group>/<name>`` for every plugin still at the old place
   (untracked leftovers such as ``*.egg-info`` are moved with it); files at the old place of a
   plugin already grouped (another branch merged after the grouping) are moved file by file;
2. in the files it moved this run: relative Markdown links are recomputed from their old place,
   and ``"$here/../.."`` (a script finding the repo root) climbs one level more;
3. in every tracked text file except ``bench/results/`` (records keep the commands as they ran; the
   files of :data:`PROTECTED_PREFIXES` changed are listed, ``--skip-protected`` leaves them alone):
   ``plugins/<name>`` -> ``plugins/<group>/<name>`` (also ``"plugins" / "<name>"`` path parts), the
   package globs (``plugins/*/pyproject.toml`` and ``"plugins/*/omniloop_*/**/*.py"`` gain their
   ``plugins/*/*/`` twin: a plugin not grouped yet is still installed and scanned);
4. writes ``plugins/README.md`` (the groups) and the marked block in CONTRIBUTING.md.

Idempotent: a second run finds nothing to move and nothing to rewrite. Re-runnable on a newer
main: a plugin another branch edited at the old place is moved then, and new references to old
paths are rewritten. A plugin folder it does not know is reported (and left in place) so that the
mapping can be extended with ``--also``. After it: ``make setup`` (the package paths changed, so the
Makefile reinstalls everything editable), then the tests.
"""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]  # --root overrides it (the tests run the script on a scratch repo)

#: group -> (one line on what the group is, its plugins)
GROUPS: dict[str, tuple[str, tuple[str, ...]]] = {
    "frontends": ("front ends: how requests reach a runtime (HTTP, Dynamo, ComfyUI) and the files and JSON "
                  "Schema they exchange", ("server", "dynamo", "comfyui", "io")),
    "execution": ("execution: how a runtime runs requests (schedulers, worker pools, transports, composed "
                  "pipelines, offload)", ("scheduler", "parallel", "compose", "offload")),
    "compute": ("compute libraries: what families import for their math (samplers and CFG, attention kernels, "
                "FP8 linears, the paged KV cache, LoRA adapters, post-training)",
                ("policies", "attention", "quant", "kvcache", "adapters", "rl")),
}

#: text files rewritten (by suffix, or by name)
TEXT_SUFFIXES = {".py", ".md", ".toml", ".sh", ".yaml", ".yml", ".json", ".cfg", ".ini", ".txt", ".rst", ".in"}
TEXT_NAMES = {"Makefile", "run", ".gitignore", "Dockerfile"}
#: never rewritten: recorded results keep the command as it ran; this script and its test hold the
#: old paths as data
SKIP_PREFIXES = ("bench/results/", "scripts/relayout.py", "tests/layout/test_relayout.py")
#: other work owns these folders (the core, the kit and the kit-based families): only paths change
#: there, and each file changed is listed; --skip-protected leaves them alone
PROTECTED_PREFIXES = ("core/omniloop/", "families/kit/", "families/wan/", "families/flux/", "families/sd3/")

MARK_BEGIN = "<!-- relayout: plugin groups (scripts/relayout.py writes this block) -->"
MARK_END = "<!-- /relayout -->"


def plugin_groups(extra: dict[str, str]) -> dict[str, str]:
    """plugin name -> group."""
    out = {name: group for group, (_, names) in GROUPS.items() for name in names}
    out.update(extra)
    return out


def git(*args: str) -> str:
    return subprocess.run(["git", *args], cwd=ROOT, check=True, capture_output=True, text=True).stdout


def tracked_files() -> list[str]:
    return [f for f in git("ls-files", "-z").split("\0") if f]


def is_text(path: str) -> bool:
    p = Path(path)
    return (p.suffix in TEXT_SUFFIXES or p.name in TEXT_NAMES) and not path.startswith(SKIP_PREFIXES)


# ------------------------------------------------------------------------------------------------
# 1. moves
# ------------------------------------------------------------------------------------------------


def tracked_under(folder: str) -> list[str]:
    return [f for f in git("ls-files", "-z", "--", folder).split("\0") if f]


def pending_moves(groups: dict[str, str]) -> list[tuple[str, str]]:
    """(old, new) folder pairs with tracked files still at the old place: a whole plugin, or files
    another branch added or kept at the old place after the grouping (merged into the new folder)."""
    out = []
    for name, group in sorted(groups.items()):
        old, new = f"plugins/{name}", f"plugins/{group}/{name}"
        if not tracked_under(old):
            continue
        if (ROOT / new).exists() and not tracked_under(new):
            sys.exit(f"relayout: {new} exists but holds no tracked file; remove its untracked leftovers "
                     f"(__pycache__, *.egg-info: git clean -fdX {new}) and run again")
        clashes = [f for f in tracked_under(old) if (ROOT / (new + f[len(old):])).exists()]
        if clashes:
            sys.exit(f"relayout: {clashes[0]} exists at both {old} and {new}"
                     f"{f' (and {len(clashes) - 1} more)' if len(clashes) > 1 else ''}; merge them by hand first")
        out.append((old, new))
    return out


def unknown_plugins(groups: dict[str, str]) -> list[str]:
    """Plugin folders at the old place that no group names."""
    plugins = ROOT / "plugins"
    if not plugins.is_dir():
        return []
    return sorted(p.name for p in plugins.iterdir()
                  if (p / "pyproject.toml").exists() and p.name not in groups and p.name not in GROUPS)


def move(old: str, new: str) -> list[str]:
    """git mv old new (the whole folder, or file by file into an existing new folder); returns the
    tracked files moved (new paths)."""
    files = tracked_under(old)
    if not (ROOT / new).exists():
        (ROOT / new).parent.mkdir(parents=True, exist_ok=True)
        git("mv", old, new)
    else:
        for f in files:
            (ROOT / (new + f[len(old):])).parent.mkdir(parents=True, exist_ok=True)
            git("mv", f, new + f[len(old):])
    leftover = ROOT / old  # untracked files (egg-info, __pycache__) stay behind a git mv
    if leftover.exists():
        for p in sorted(leftover.rglob("*"), reverse=True):
            dest = ROOT / new / p.relative_to(leftover)
            if p.is_file() and not dest.exists():
                dest.parent.mkdir(parents=True, exist_ok=True)
                p.rename(dest)
            elif p.is_file():
                p.unlink()
            elif p.is_dir() and not any(p.iterdir()):
                p.rmdir()
        if not any(leftover.iterdir()):
            leftover.rmdir()
    return [new + f[len(old):] for f in files]


# ------------------------------------------------------------------------------------------------
# 2. fix-ups in moved files
# ------------------------------------------------------------------------------------------------

_LINK = re.compile(r"(\]\()([^)\s#]+)((?:#[^)\s]*)?\))")


def moved_path(path: str, groups: dict[str, str]) -> str:
    """Where a repository path is after the grouping."""
    parts = path.split("/")
    if len(parts) >= 2 and parts[0] == "plugins" and parts[1] in groups:
        return "/".join(["plugins", groups[parts[1]], *parts[1:]])
    return path


def fix_links(text: str, old_file: str, new_file: str, groups: dict[str, str]) -> str:
    """Relative Markdown links of a file that moved from old_file to new_file."""

    def one(m: re.Match[str]) -> str:
        target = m.group(2)
        if re.match(r"^[a-z][a-z0-9+.-]*:", target) or target.startswith("/"):
            return m.group(0)  # a URL, mailto:, or an absolute path
        repo_path = os.path.normpath(os.path.join(os.path.dirname(old_file), target))
        if repo_path.startswith(".."):
            return m.group(0)
        repo_path = moved_path(repo_path, groups)
        rel = os.path.relpath(repo_path, os.path.dirname(new_file) or ".")
        if target.endswith("/") and not rel.endswith("/"):
            rel += "/"
        return m.group(1) + rel + m.group(3)

    return _LINK.sub(one, text)


def fix_moved_file(path: str, old_path: str, groups: dict[str, str]) -> bool:
    f = ROOT / path
    if not is_text(path) or not f.is_file():
        return False
    text = f.read_text(encoding="utf-8")
    new = text
    if path.endswith(".md"):
        new = fix_links(new, old_path, path, groups)
    if path.endswith(".sh"):
        new = new.replace('"$here/../.."', '"$here/../../.."')
    if new != text:
        f.write_text(new, encoding="utf-8")
        return True
    return False


# ------------------------------------------------------------------------------------------------
# 3. references everywhere
# ------------------------------------------------------------------------------------------------


def rewrite_text(text: str, groups: dict[str, str]) -> str:
    names = "|".join(sorted(map(re.escape, groups), key=len, reverse=True))
    # plugins/<name> as a path (not plugins/<group>/..., not plugins/<name>_x or plugins/<name>-x)
    text = re.sub(rf"(?<![\w-])plugins/({names})(?![\w-])", lambda m: f"plugins/{groups[m.group(1)]}/{m.group(1)}", text)
    # "plugins" / "<name>" path parts (pathlib)
    text = re.sub(rf'(["\'])plugins\1(\s*/\s*)(["\'])({names})\3',
                  lambda m: f'{m.group(1)}plugins{m.group(1)}{m.group(2)}{m.group(3)}{groups[m.group(4)]}{m.group(3)}'
                            f'{m.group(2)}{m.group(3)}{m.group(4)}{m.group(3)}', text)
    # package globs: keep the old level (a plugin not grouped yet) and add the grouped one
    text = re.sub(r"(?<![\w*/-])plugins/\*/pyproject\.toml(?! plugins/\*/\*/pyproject\.toml)",
                  "plugins/*/pyproject.toml plugins/*/*/pyproject.toml", text)
    text = re.sub(r'"plugins/\*/(omniloop_\*[^"]*)"(?!, "plugins/\*/\*/)',
                  lambda m: f'"plugins/*/{m.group(1)}", "plugins/*/*/{m.group(1)}"', text)
    return text


# ------------------------------------------------------------------------------------------------
# 4. the group docs
# ------------------------------------------------------------------------------------------------


def groups_markdown(groups: dict[str, str], link_prefix: str) -> str:
    rows = ["| group | what | plugins |", "|---|---|---|"]
    for group, (what, _) in GROUPS.items():
        members = sorted(n for n, g in groups.items() if g == group)
        rows.append(f"| [`plugins/{group}/`]({link_prefix}{group}) | {what} | "
                    + ", ".join(f"[`{n}`]({link_prefix}{group}/{n})" for n in members) + " |")
    return "\n".join(rows)


def plugins_readme(groups: dict[str, str]) -> str:
    return f"""# plugins/

Plugins grouped by role (CONTRIBUTING.md, "Layout, and why"). Each leaf folder is its own
distribution (`omniloop-<name>`, module `omniloop_<name>`) registering itself in the
`omniloop.plugins` entry-point group; the group folders are only folders. Read-only plugins are in
`observers/`, plugins that alter computation in `interceptors/`, model families in `families/`.

{groups_markdown(groups, "")}

A new plugin goes into the group of its role; a package that fits none stays at `plugins/<name>/`
(still installed: the Makefile globs both levels). This layout is produced by `scripts/relayout.py`.
"""


def contributing_block(groups: dict[str, str]) -> str:
    return f"""{MARK_BEGIN}
`plugins/` is grouped by role (`plugins/README.md`; `scripts/relayout.py` made the move):

{groups_markdown(groups, "plugins/")}
{MARK_END}"""


#: sentences of CONTRIBUTING.md about the old layout -> the grouped one
CONTRIBUTING_TEXT = (
    ("(`core`, `cli`, `plugins/*`,", "(`core`, `cli`, `plugins/<group>/*` and `plugins/*`,"),
    ("| `plugins/<other>/` | `omniloop-<other>` | omniloop (+ their stack) | transports, integrations |",
     "| `plugins/<group>/<other>/` | `omniloop-<other>` | omniloop (+ their stack) | further plugins, in the group "
     "of their role (`plugins/README.md`) |"),
)


def update_contributing(text: str, groups: dict[str, str]) -> str:
    for old, new in CONTRIBUTING_TEXT:
        text = text.replace(old, new)
    block = contributing_block(groups)
    if MARK_BEGIN in text:
        a = text.index(MARK_BEGIN)
        b = text.index(MARK_END, a) + len(MARK_END)
        return text[:a] + block + text[b:]
    anchor = "| folder | distribution / import | depends on | holds |"
    if anchor not in text:
        sys.exit("relayout: CONTRIBUTING.md has no layout table header to put the groups before")
    return text.replace(anchor, block + "\n\n" + anchor, 1)


# ------------------------------------------------------------------------------------------------


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--check", action="store_true", help="exit 1 if anything would change; change nothing")
    ap.add_argument("--skip-protected", action="store_true",
                    help="leave references in " + ", ".join(PROTECTED_PREFIXES) + " as they are (listed)")
    ap.add_argument("--root", type=Path, default=None, help="the repository (default: this script's)")
    ap.add_argument("--also", action="append", default=[], metavar="NAME=GROUP",
                    help="group a plugin that GROUPS does not name (repeatable)")
    a = ap.parse_args(argv)
    global ROOT
    if a.root is not None:
        ROOT = a.root.resolve()
    extra = {}
    for item in a.also:
        name, sep, group = item.partition("=")
        if not sep or group not in GROUPS or not re.fullmatch(r"[a-z][a-z0-9_-]*", name):
            ap.error(f"--also {item!r}: expected NAME=GROUP with GROUP one of {', '.join(GROUPS)}")
        extra[name] = group
    groups = plugin_groups(extra)

    moves = pending_moves(groups)
    unknown = unknown_plugins(groups)
    files = [f for f in tracked_files() if is_text(f)]
    protected = [f for f in files if f.startswith(PROTECTED_PREFIXES)]
    if a.skip_protected:
        files = [f for f in files if not f.startswith(PROTECTED_PREFIXES)]
    rewrites = []
    for f in files:
        p = ROOT / f
        if p.is_file():
            text = p.read_text(encoding="utf-8", errors="surrogateescape")
            new = rewrite_text(text, groups)
            if f == "CONTRIBUTING.md":
                new = update_contributing(new, groups)
            if new != text:
                rewrites.append(f)
    readme = ROOT / "plugins" / "README.md"
    if not readme.is_file() or readme.read_text(encoding="utf-8") != plugins_readme(groups):
        rewrites.append("plugins/README.md")
    if a.check:
        for old, new in moves:
            print(f"would move {old} -> {new}")
        for f in rewrites:
            print(f"would rewrite {f}")
        for u in unknown:
            print(f"not grouped: plugins/{u} (use --also {u}=GROUP)")
        return 1 if moves or rewrites or unknown else 0

    if git("status", "--porcelain", "--untracked-files=no").strip():
        print("relayout: the work tree has uncommitted changes; commit or stash them first", file=sys.stderr)
        return 2
    moved_files: list[tuple[str, str]] = []  # (new path, old path)
    for old, new in moves:
        merged = (ROOT / new).exists()
        for nf in move(old, new):
            moved_files.append((nf, old + nf[len(new):]))
        print(f"moved {old} -> {new}" + (" (files merged into the grouped folder)" if merged else ""))
    for nf, of in moved_files:
        if fix_moved_file(nf, of, groups):
            print(f"fixed relative paths in {nf}")
    changed = 0
    rewritten: set[str] = set()
    for f in (f for f in tracked_files() if is_text(f)):
        if f.startswith(PROTECTED_PREFIXES) and a.skip_protected:
            continue
        p = ROOT / f
        if not p.is_file():
            continue
        text = p.read_text(encoding="utf-8", errors="surrogateescape")
        new = rewrite_text(text, groups)
        if f == "CONTRIBUTING.md":
            new = update_contributing(new, groups)
        if new != text:
            p.write_text(new, encoding="utf-8", errors="surrogateescape")
            changed += 1
            rewritten.add(f)
    (ROOT / "plugins" / "README.md").write_text(plugins_readme(groups), encoding="utf-8")
    print(f"rewrote references in {changed} files; wrote plugins/README.md")
    for u in unknown:
        print(f"warning: plugins/{u} is in no group (left in place); re-run with --also {u}=GROUP", file=sys.stderr)
    for f in protected:
        if a.skip_protected:
            text = (ROOT / f).read_text(encoding="utf-8", errors="surrogateescape")
            if rewrite_text(text, groups) != text:
                print(f"left as is (--skip-protected): {f}")
        elif f in rewritten:
            print(f"paths rewritten in a folder other work owns: {f}")
    print("next: git add -A && git commit; make setup (editable installs point at the new folders); the tests")
    return 0


if __name__ == "__main__":
    sys.exit(main())
