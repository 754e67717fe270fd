"""Pin a GPU runtime: the wheels pip resolves for a CUDA build of torch, less what the bundle carries.

    .venv/bin/python installers/pin_gpu_runtime.py --name torch-2.13.0-cu130 torch==2.13.0 \
        [--index-url https://pypi.org/simple] [--find-links DIR] [--out resources/gpu_runtime.json]

pip resolves the requirement for this Python and machine (``pip install --dry-run --report``: the
metadata only, no wheel downloaded), and every wheel it picks is pinned with its URL, size and
SHA-256, except the packages the bundle already has at the same version (numpy, sympy, ...). The
runtime is added to (or replaces its namesake in) the list that the app installs from
(``dedloc_core/gpu_runtime.py``). Run it where the index is complete (the release machine).
"""

from __future__ import annotations

import argparse
import importlib.metadata
import json
import os
import platform
import subprocess
import sys
import tempfile
import urllib.parse
import urllib.request
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
# what the bundle carries anyway: pinned packages at the version installed here are left out
BUNDLED = {"filelock", "typing-extensions", "setuptools", "sympy", "mpmath", "networkx", "jinja2", "markupsafe",
           "fsspec", "numpy"}
# the wheel tags a volunteer's Linux takes (pip expands none of them when --platform is given); glibc 2.28
# and newer: the bundle's own floor is higher (a build on Debian 12 needs 2.36)
PLATFORMS = (*(f"manylinux_2_{minor}" for minor in range(36, 16, -1)), "manylinux2014", "linux")


def resolve(requirement: str, index_url: str | None, find_links: str | None, extra: list[str]) -> list[dict]:
    """pip's install report for ``requirement`` on this Python and machine (nothing installed)."""
    with tempfile.TemporaryDirectory() as scratch:
        report = Path(scratch) / "report.json"
        command = [sys.executable, "-m", "pip", "install", "--isolated", "--dry-run", "--ignore-installed",
                   "--quiet", "--only-binary=:all:", "--report", str(report), "--target", str(Path(scratch) / "t"),
                   "--python-version", f"{sys.version_info.major}.{sys.version_info.minor}",
                   "--implementation", "cp"]
        for tag in PLATFORMS:
            command += ["--platform", f"{tag}_{platform.machine()}"]
        if index_url:
            command += ["--index-url", index_url]
        if find_links:
            command += ["--find-links", find_links]
        for url in extra:
            command += ["--extra-index-url", url]
        subprocess.run([*command, requirement], check=True, env={**os.environ, "PIP_CONFIG_FILE": os.devnull})
        return json.loads(report.read_text())["install"]


def public_url(project: str, file: str, sha256: str, index: str) -> str:
    """The public index's URL of ``file`` (a wheel pip found in a local mirror), checked to be the same
    file: the index's SHA-256 for it must be ours."""
    import re

    page = urllib.request.urlopen(f"{index.rstrip('/')}/{project}/", timeout=60).read().decode()
    for href in re.findall(r'href="([^"]+)"', page):
        url, _, fragment = href.partition("#")
        if urllib.parse.unquote(url.rsplit("/", 1)[1]) == file:
            if fragment != f"sha256={sha256}":
                raise SystemExit(f"{file}: the public index has another file ({fragment})")
            return urllib.parse.urljoin(f"{index.rstrip('/')}/{project}/", url)
    raise SystemExit(f"{file} is not on {index}")


def installed_version(name: str) -> str | None:
    try:
        return importlib.metadata.version(name)
    except importlib.metadata.PackageNotFoundError:
        return None


def size_of(url: str) -> int:
    if url.startswith("file://"):
        return Path(urllib.request.url2pathname(url[len("file://"):])).stat().st_size
    with urllib.request.urlopen(urllib.request.Request(url, method="HEAD"), timeout=60) as answer:
        return int(answer.headers["Content-Length"])


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("requirement")
    parser.add_argument("--name", required=True, help="the runtime's folder name, e.g. torch-2.13.0-cu130")
    parser.add_argument("--index-url")
    parser.add_argument("--find-links")
    parser.add_argument("--extra-index-url", action="append", default=[])
    parser.add_argument("--public-index", default="https://pypi.org/simple",
                        help="where volunteers download from: a wheel found in a local mirror (a file: URL) is "
                             "pinned with this index's URL for the same file")
    parser.add_argument("--out", type=Path, default=ROOT / "resources" / "gpu_runtime.json")
    args = parser.parse_args()
    wheels = []
    for item in resolve(args.requirement, args.index_url, args.find_links, args.extra_index_url):
        name, version = item["metadata"]["name"].lower().replace("_", "-"), item["metadata"]["version"]
        if name in BUNDLED and installed_version(name) == version:
            continue
        info = item["download_info"]
        sha256 = info.get("archive_info", {}).get("hashes", {}).get("sha256")
        if not sha256:
            raise SystemExit(f"pip gave no SHA-256 for {info['url']}")
        file, url = urllib.parse.unquote(info["url"].rsplit("/", 1)[1]), info["url"]
        size = size_of(url)
        if url.startswith("file:"):
            url = public_url(name, file, sha256, args.public_index)
        wheels.append({"file": file, "url": url, "sha256": sha256, "size": size})
    listing = json.loads(args.out.read_text()) if args.out.exists() else {"format": 1, "runtimes": []}
    runtime = {"name": args.name, "python": f"cp{sys.version_info.major}{sys.version_info.minor}",
               "machine": platform.machine(), "wheels": wheels}
    listing["runtimes"] = [r for r in listing["runtimes"] if r["name"] != args.name] + [runtime]
    args.out.write_text(json.dumps(listing, indent=1) + "\n")
    print(f"{args.name}: {len(wheels)} wheels, {sum(w['size'] for w in wheels) / 1e9:.2f} GB -> {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
