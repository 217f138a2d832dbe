"""The README and docs/ stay a user's documents (issue 32): README.md short, every relative link resolving to a file
in the repository (and an anchor to a heading of it), every page of docs/ reachable from the README, and the image
tag the docs build equal to the one the Kubernetes overlay deploys. No processes: text only."""

from __future__ import annotations

import glob
import os
import re

import pytest
import yaml

from tests.conftest import ROOT

README = os.path.join(ROOT, "README.md")
PAGES = [README, *sorted(glob.glob(os.path.join(ROOT, "docs", "*.md")))]
MAX_README_LINES = 200

FENCE = re.compile(r"^(```|~~~)")
INLINE_CODE = re.compile(r"(`+)(.+?)\1")
LINK = re.compile(r"!?\[(?:[^\[\]]|\[[^\]]*\])*\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)")
HEADING = re.compile(r"^(#{1,6})\s+(.*?)\s*#*\s*$")


def prose_lines(path: str) -> list[str]:
    """The file's lines outside fenced code blocks."""
    out, fenced = [], False
    with open(path, encoding="utf-8") as f:
        for line in f:
            if FENCE.match(line.lstrip()):
                fenced = not fenced
                continue
            if not fenced:
                out.append(line.rstrip("\n"))
    return out


def links(path: str) -> list[str]:
    """Every link and image target of a markdown file, outside code blocks and code spans."""
    found = []
    for line in prose_lines(path):
        found += LINK.findall(INLINE_CODE.sub(lambda m: "x" * len(m.group(2)), line))
    return found


def slug(heading: str) -> str:
    """GitHub's anchor for a heading: its text (links as their text, code as its content) lower-cased, everything but
    letters, digits, spaces, hyphens and underscores dropped, spaces made hyphens."""
    text = re.sub(r"!?\[([^\]]*)\]\([^)]*\)", r"\1", heading)
    text = re.sub(r"[^\w\- ]", "", text.lower())
    return text.replace(" ", "-")


def anchors(path: str) -> set[str]:
    seen: dict[str, int] = {}
    out = set()
    for line in prose_lines(path):
        m = HEADING.match(line)
        if not m:
            continue
        base = slug(m.group(2))
        n = seen.get(base, 0)
        seen[base] = n + 1
        out.add(base if n == 0 else f"{base}-{n}")  # GitHub numbers repeated headings
    return out


def test_slug_matches_github():
    assert slug("What each type runs as (`--weights`)") == "what-each-type-runs-as---weights"
    assert slug("Memory: `auto` and `lean`") == "memory-auto-and-lean"
    assert slug("Websocket protocol (`/v1/stream`)") == "websocket-protocol-v1stream"


def test_readme_is_short():
    with open(README, encoding="utf-8") as f:
        n = sum(1 for _ in f)
    assert n <= MAX_README_LINES, f"README.md has {n} lines; move detail into docs/ (at most {MAX_README_LINES})"


@pytest.mark.parametrize("page", PAGES, ids=lambda p: os.path.relpath(p, ROOT))
def test_relative_links_resolve(page):
    problems = []
    for target in links(page):
        if re.match(r"^[a-z][a-z0-9+.-]*:", target):  # http:, https:, mailto: ... not checked here
            continue
        path, _, anchor = target.partition("#")
        dest = os.path.normpath(os.path.join(os.path.dirname(page), path)) if path else page
        if os.path.commonpath([dest, ROOT]) != ROOT:
            problems.append(f"{target}: outside the repository")
        elif not os.path.exists(dest):
            problems.append(f"{target}: no such file")
        elif anchor:
            if not dest.endswith(".md"):
                problems.append(f"{target}: an anchor into a file that is not markdown")
            elif anchor not in anchors(dest):
                problems.append(f"{target}: no heading '{anchor}' in {os.path.relpath(dest, ROOT)}")
    assert not problems, f"{os.path.relpath(page, ROOT)}:\n" + "\n".join(problems)


def test_every_doc_page_is_linked_from_the_readme():
    linked = {os.path.normpath(os.path.join(ROOT, t.partition("#")[0])) for t in links(README)}
    orphans = [os.path.relpath(p, ROOT) for p in PAGES[1:] if p not in linked]
    assert not orphans, f"not linked from README.md: {orphans}"


def test_docker_tag_is_the_one_the_overlays_deploy():
    """A `docker build -t stagemesh:TAG` in the docs builds the image an overlay's `images:` names."""
    deployed = set()
    for overlay in glob.glob(os.path.join(ROOT, "k8s", "overlays", "*", "kustomization.yaml")):
        with open(overlay, encoding="utf-8") as f:
            for image in yaml.safe_load(f).get("images", []):
                deployed.add(f"{image.get('newName', image['name'])}:{image['newTag']}")
    built = set()
    for page in PAGES:
        with open(page, encoding="utf-8") as f:
            built |= set(re.findall(r"docker build -t (\S+)", f.read()))
    assert built, "no `docker build -t` in README.md or docs/"
    assert built <= deployed, f"docs build {sorted(built - deployed)}; the overlays deploy {sorted(deployed)}"


# ---- pages that describe the code: current with it ----------------------------------------------------------------

GATEWAY = os.path.join(ROOT, "services", "gateway")
ROUTE = re.compile(r"\.add_(?:get|post|put|patch|delete)\(\s*(?:\"([^\"]+)\"|MESSAGES_PATH(?:\s*\+\s*\"([^\"]*)\")?)")


def _page(name: str) -> str:
    with open(os.path.join(ROOT, "docs", name), encoding="utf-8") as f:
        return f.read()


def test_protocol_md_is_at_the_wire_version():
    from shared.wire.protocol import PROTOCOL_VERSION

    text = _page("protocol.md")
    assert f"protocol version {PROTOCOL_VERSION}" in text.lower(), (
        f"docs/protocol.md does not say the wire is at protocol version {PROTOCOL_VERSION} (shared/wire/protocol.py): "
        "describe what that version added")
    newer = sorted({int(v) for v in re.findall(r"protocol version (\d+)", text.lower())} - set(range(PROTOCOL_VERSION + 1)))
    assert not newer, f"docs/protocol.md describes protocol version(s) {newer}, past PROTOCOL_VERSION {PROTOCOL_VERSION}"


def test_every_gateway_route_is_in_protocol_mds_endpoint_table():
    from services.gateway.api.anthropic import MESSAGES_PATH

    routes = set()
    for path in glob.glob(os.path.join(GATEWAY, "**", "*.py"), recursive=True):
        with open(path, encoding="utf-8") as f:
            for literal, below_messages in ROUTE.findall(f.read()):
                routes.add(literal or MESSAGES_PATH + below_messages)
    assert {"/v1/chat/completions", "/v1/mesh/resplit", "/v1/messages/count_tokens"} <= routes, routes
    text = _page("protocol.md")
    table = text[text.index("| endpoint |"):text.index("\n\n", text.index("| endpoint |"))]
    missing = sorted(r for r in routes if f"{r}`" not in table)
    assert not missing, f"docs/protocol.md's endpoint table lacks {missing}: add a row saying what each does"


def test_operations_md_code_map_names_every_gateway_module():
    text = _page("operations.md")
    rows = {m.group(1): m.group(2) for m in re.finditer(r"^\| &nbsp;&nbsp;`(\w+)/` \| (.*) \|$", text, re.M)}
    assert set(rows) == {"api", "frontend", "engine"}, f"docs/operations.md's code map has gateway rows {sorted(rows)}"
    for layer, row in rows.items():
        modules = {os.path.basename(p) for p in glob.glob(os.path.join(GATEWAY, layer, "*.py"))} - {"__init__.py"}
        named = set(re.findall(r"`(\w+\.py)`", row))
        assert modules <= named, (f"docs/operations.md's code map row for services/gateway/{layer}/ does not name "
                                  f"{sorted(modules - named)}: say in a few words what each holds")
        assert named <= modules, f"docs/operations.md names {sorted(named - modules)} in {layer}/, which has none"


def test_the_readme_has_one_performance_table():
    lines = prose_lines(README)
    start = lines.index("## Performance")
    end = next(i for i in range(start + 1, len(lines)) if lines[i].startswith("## "))
    tables = [i for i in range(start, end) if re.match(r"^\| *-{3}", lines[i])]
    assert len(tables) == 1, ("README.md's Performance section holds one table (stagemesh against llama-server); "
                              f"it has {len(tables)}: move the others to docs/performance.md")
