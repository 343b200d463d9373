"""The pages under docs/ stay in sync with the code they quote, and the README stays a short tour.

- every ```python block of a page runs, in order, in one namespace per page, with the README's stand-in
  inputs (`test_readme._inputs`); a block that is not meant to run is fenced as ```text instead;
- every `safeformer` name that a Python block imports, and every dotted `safeformer.x` name quoted in
  the prose, exists;
- every relative link of the README and of docs/*.md points to a file that exists (and, for a link
  to a heading of a Markdown page, to a heading that exists);
- the README is under 15,000 characters and starts with the two commands, the second being the line
  that `.ci/run` runs.
"""

from __future__ import annotations

import ast
import importlib
import re
from pathlib import Path

import pytest
from test_readme import README, ROOT, python_blocks, run_blocks

DOCS = ROOT / "docs"
PAGES = sorted(DOCS.glob("*.md"))
ALL_PAGES = [README, *PAGES]

MAY_BE_MISSING: set[Path] = set()  # every linked page exists

README_LIMIT = 15_000

LINK = re.compile(r"!?\[[^\]\n]*\]\(([^)\s]+)(?:\s+\"[^\"]*\")?\)")
FENCED = re.compile(r"^```.*?^```[ \t]*$", flags=re.S | re.M)
INLINE_CODE = re.compile(r"`[^`\n]*`")
HEADING = re.compile(r"^#{1,6}[ \t]+(.+?)[ \t]*#*[ \t]*$", flags=re.M)
DOTTED = re.compile(r"`(safeformer(?:\.[A-Za-z_]\w*)+)")


def _rel(path: Path) -> str:
    return str(path.relative_to(ROOT))


def _prose(text: str) -> str:
    """The text outside fenced blocks and inline code, where links live."""
    return INLINE_CODE.sub("", FENCED.sub("", text))


def _slug(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, punctuation dropped, spaces to hyphens."""
    heading = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", heading)  # a link in a heading keeps its text
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def _anchors(path: Path) -> set[str]:
    seen: dict[str, int] = {}
    anchors = set()
    for heading in HEADING.findall(FENCED.sub("", path.read_text())):
        slug = _slug(heading)
        n = seen.get(slug, 0)
        seen[slug] = n + 1
        anchors.add(slug if n == 0 else f"{slug}-{n}")
    return anchors


def _resolve(dotted: str) -> object:
    """Import the longest importable module prefix of `dotted`, then get the rest as attributes."""
    parts = dotted.split(".")
    for cut in range(len(parts), 0, -1):
        try:
            obj = importlib.import_module(".".join(parts[:cut]))
        except ModuleNotFoundError:
            continue
        for attr in parts[cut:]:
            obj = getattr(obj, attr)  # AttributeError names what is missing
        return obj
    raise ModuleNotFoundError(dotted)


def _quoted_names(code: str) -> set[str]:
    """The dotted safeformer names a block imports or reaches through an imported module."""
    names: set[str] = set()
    aliases: dict[str, str] = {}
    tree = ast.parse(code)
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module and node.module.split(".")[0] == "safeformer":
            for alias in node.names:
                names.add(f"{node.module}.{alias.name}")
        elif isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name.split(".")[0] == "safeformer":
                    names.add(alias.name)
                    if alias.asname:  # import safeformer as sf, import safeformer.core.masks as m
                        aliases[alias.asname] = alias.name
                    else:  # import safeformer.core.masks binds `safeformer`
                        aliases["safeformer"] = "safeformer"
    for node in ast.walk(tree):  # sf.attend, safeformer.core.masks.padding_mask, ...
        if isinstance(node, ast.Attribute):
            chain = []
            inner = node
            while isinstance(inner, ast.Attribute):
                chain.append(inner.attr)
                inner = inner.value
            if isinstance(inner, ast.Name) and inner.id in aliases:
                names.add(".".join([aliases[inner.id], *reversed(chain)]))
    return names


def test_docs_pages_exist():
    for name in ("reference.md", "moving_from_x_transformers.md", "performance.md", "testing.md"):
        assert (DOCS / name).is_file(), name


@pytest.mark.parametrize("page", [p for p in PAGES if python_blocks(p)], ids=lambda p: p.name)
def test_docs_examples_run(page, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    run_blocks(page)


@pytest.mark.parametrize("page", ALL_PAGES, ids=lambda p: p.name)
def test_quoted_safeformer_names_exist(page):
    text = page.read_text()
    names = {name for code in python_blocks(page) for name in _quoted_names(code)}
    names |= set(DOTTED.findall(FENCED.sub("", text)))  # `safeformer.core.masks`, `safeformer.check_finite(...)`
    missing = []
    for name in sorted(names):
        try:
            _resolve(name)
        except (ImportError, AttributeError) as err:
            missing.append(f"{name} ({type(err).__name__}: {err})")
    assert not missing, f"{_rel(page)} quotes names that do not exist: {missing}"


@pytest.mark.parametrize("page", ALL_PAGES, ids=lambda p: p.name)
def test_relative_links_resolve(page):
    broken = []
    for target in LINK.findall(_prose(page.read_text())):
        if re.match(r"[a-z][a-z0-9+.-]*:", target):  # https:, mailto:, ...
            continue
        file_part, _, anchor = target.partition("#")
        path = (page.parent / file_part).resolve() if file_part else page
        if not path.exists():
            if path in MAY_BE_MISSING:
                continue
            broken.append(f"{target} (no such file)")
        elif anchor and path.suffix == ".md" and anchor not in _anchors(path):
            broken.append(f"{target} (no heading with that anchor)")
    assert not broken, f"{_rel(page)} has broken links: {broken}"


def test_readme_links_every_docs_page():
    text = README.read_text()
    for page in [*PAGES, *(p for p in MAY_BE_MISSING if not p.exists())]:
        assert f"]({_rel(page)})" in text, f"README does not link {_rel(page)}"


def test_readme_is_a_short_tour():
    text = README.read_text()
    assert len(text) < README_LIMIT, f"README.md has {len(text)} characters; move reference material to docs/"
    ci = (ROOT / ".ci" / "run").read_text().splitlines()
    command = [line for line in ci if line.strip() and not line.startswith(("#", "set ", "cd "))]
    assert len(command) == 1, command
    assert text.startswith("# safeformer\n\n```bash\n")
    first_bash = re.search(r"^```bash\n(.*?)^```", text, flags=re.S | re.M).group(1).splitlines()
    assert len(first_bash) == 2, first_bash
    assert first_bash[0].endswith("&& python train.py")
    assert first_bash[1] == command[0], "the README's second command must be the line .ci/run runs"


QUALIFIED = re.compile(r"`((?:[a-z_]+)\.[A-Za-z_]\w*(?:\.[A-Za-z_]\w*)?)")


def test_architecture_names_exist():
    """Every ``module.name`` (or ``module.Class.attr``, or ``layer.module.name``) that docs/architecture.md quotes is in
    the package: ``module`` is a file of any layer (``stack.layers``, or ``layers`` alone when the name is unique)."""
    import importlib

    text = (DOCS / "architecture.md").read_text()
    package = ROOT / "safeformer"
    found = 0
    for ref in QUALIFIED.findall(text):
        parts = ref.split(".")
        if parts[0] in {p.name for p in package.iterdir() if p.is_dir()} and len(parts) > 1:
            parts = [f"{parts[0]}.{parts[1]}", *parts[2:]]
        module, *attrs = parts
        if attrs == ["py"]:  # a file name
            continue
        files = sorted(package.rglob(module.replace(".", "/") + ".py"))
        if not files:  # not ours
            continue
        candidates = [importlib.import_module(".".join(("safeformer",) + f.relative_to(package).with_suffix("").parts))
                      for f in files]

        def resolves(obj, attrs=tuple(attrs)) -> bool:
            for attr in attrs:
                if not hasattr(obj, attr):
                    return False
                obj = getattr(obj, attr)
            return True

        assert any(resolves(c) for c in candidates), \
            f"docs/architecture.md quotes `{ref}`, which no module {module}.py of safeformer defines"
        found += 1
    assert found >= 10, f"only {found} qualified names found: the pattern no longer matches the page"


# a repository path quoted in code spans (`tests/test_x.py`, `benchmarks/results/`): it must exist
QUOTED_PATH = re.compile(r"`((?:tests|safeformer|benchmarks|examples|docs|\.ci)/[A-Za-z0-9_./-]*)`")
# folders a script looks for that are not part of the repository
NOT_IN_THE_REPOSITORY = {"benchmarks/wheels/": "where benchmarks/gpu_proof.sh looks for wheels a GPU machine cannot download"}


@pytest.mark.parametrize("page", [*ALL_PAGES, ROOT / "benchmarks" / "NOTES.md"], ids=lambda p: _rel(p))
def test_quoted_repository_paths_exist(page):
    """Every repository path a page quotes exists (a renamed or deleted test file is caught here)."""
    dead = [p for p in QUOTED_PATH.findall(page.read_text())
            if p not in NOT_IN_THE_REPOSITORY and not (ROOT / p.rstrip("/")).exists()]
    assert not dead, f"{_rel(page)} quotes paths that do not exist: {sorted(set(dead))}"
