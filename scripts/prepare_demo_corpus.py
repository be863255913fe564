#!/usr/bin/env python3
"""Build the demo model's training corpus from Debian's Python documentation package.

    python scripts/prepare_demo_corpus.py            # apt-get download python3.11-doc, then convert
    python scripts/prepare_demo_corpus.py --deb FILE # convert a .deb already on disk

Writes ``data/demo_corpus/{train,val}.txt.gz`` and ``data/demo_corpus/SOURCE.md`` (package, version,
sha256 of the .deb, licence). The HTML pages of the package (Sphinx output) are reduced to their prose:
the main body of each page, one paragraph per block element (headings, paragraphs, list items,
definition terms and bodies), whitespace collapsed, typographic quotes made ASCII. Code blocks
(``<pre>``), tables, navigation, index pages, the changelog and the licence pages are dropped. Each
page is one document; documents are separated by a line holding only :data:`DOC_SEPARATOR`. About 2.5%
of the pages, picked by a hash of their path, form the validation split. Deterministic: the same .deb
gives the same bytes (gzip without timestamps).
"""

from __future__ import annotations

import argparse
import gzip
import hashlib
import html
import html.parser
import re
import shutil
import subprocess
import sys
import tempfile
import zlib
from pathlib import Path

DEFAULT_PACKAGE = "python3.11-doc"
DOC_SEPARATOR = "<|end_of_text|>"
VAL_MODULUS = 40  # a page is held out when crc32(path) % VAL_MODULUS == 0 (about 2.5%)
MIN_DOC_CHARS = 200  # pages with less prose than this (stubs, redirects) are skipped

# Pages that are not prose: indices, search, tables of contents, licences, the changelog (bug titles).
SKIP_PAGES = re.compile(
    r"(genindex.*|py-modindex|search|contents|index|download|copyright|license|about|bugs"
    r"|whatsnew/changelog|whatsnew/index|.*/index)\.html"
)
BLOCK_TAGS = {
    "p",
    "h1",
    "h2",
    "h3",
    "h4",
    "h5",
    "h6",
    "li",
    "dt",
    "dd",
    "dl",
    "ul",
    "ol",
    "div",
    "section",
    "blockquote",
    "figure",
    "figcaption",
    "caption",
    "aside",
    "br",
    "hr",
}
SKIP_TAGS = {"pre", "table", "script", "style", "nav", "form", "img", "svg", "button"}
# Elements dropped by class: the pilcrow links, section numbers, footnote markers, "Note"/"See also".
SKIP_CLASSES = {
    "headerlink",
    "section-number",
    "footnote-reference",
    "admonition-title",
    "linenos",
    "fn-bracket",
    "sphinxsidebar",
    "related",
    "footer",
    "highlight",
}
VOID_TAGS = {"br", "hr", "img", "meta", "link", "input", "wbr", "col", "area", "base", "source"}
ASCII_FOLD = str.maketrans(
    {
        "\u2018": "'",
        "\u2019": "'",
        "\u201c": '"',
        "\u201d": '"',
        "\u00a0": " ",
        "\u2026": "...",
        "\u200b": "",
        "\u00b6": "",
    }
)


class ProseExtractor(html.parser.HTMLParser):
    """Paragraphs of text inside ``<div role="main">`` of a Sphinx page."""

    def __init__(self) -> None:
        super().__init__(convert_charrefs=True)
        self.paragraphs: list[str] = []
        self._stack: list[tuple[str, bool, bool]] = []  # (tag, starts main body, skipped)
        self._in_main = 0
        self._skip = 0
        self._buf: list[str] = []

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        if tag in VOID_TAGS:
            if tag in BLOCK_TAGS:
                self._flush()
            return
        a = dict(attrs)
        classes = set((a.get("class") or "").split())
        main = a.get("role") == "main"
        skipped = tag in SKIP_TAGS or bool(classes & SKIP_CLASSES)
        self._stack.append((tag, main, skipped))
        self._in_main += main
        self._skip += skipped
        if tag in BLOCK_TAGS:
            self._flush()

    def handle_endtag(self, tag: str) -> None:
        if tag in VOID_TAGS or not any(t == tag for t, _, _ in self._stack):
            return
        while self._stack:  # close unclosed children too (HTML is forgiving)
            t, main, skipped = self._stack.pop()
            self._in_main -= main
            self._skip -= skipped
            if t in BLOCK_TAGS:
                self._flush()
            if t == tag:
                break

    def handle_data(self, data: str) -> None:
        if self._in_main and not self._skip:
            self._buf.append(data)

    def _flush(self) -> None:
        text = " ".join("".join(self._buf).translate(ASCII_FOLD).split())
        self._buf.clear()
        if text:
            self.paragraphs.append(text)

    def close(self) -> None:
        super().close()
        self._flush()


def page_text(html_text: str) -> str:
    parser = ProseExtractor()
    parser.feed(html_text)
    parser.close()
    return "\n\n".join(parser.paragraphs)


def find_html_root(root: Path) -> Path:
    candidates = sorted(p.parent for p in root.glob("usr/share/doc/python3*/html/glossary.html"))
    if not candidates:
        raise SystemExit(f"no Sphinx HTML (…/html/glossary.html) under {root}")
    return candidates[0]


def documents(html_root: Path) -> list[tuple[str, str]]:
    """(relative path, prose) of every kept page, sorted by path."""
    docs = []
    for path in sorted(html_root.rglob("*.html")):
        rel = path.relative_to(html_root).as_posix()
        if rel.startswith("_") or SKIP_PAGES.fullmatch(rel):
            continue
        text = page_text(path.read_text(encoding="utf-8"))
        if len(text) >= MIN_DOC_CHARS:
            docs.append((rel, text))
    return docs


def is_validation(rel_path: str) -> bool:
    return zlib.crc32(rel_path.encode()) % VAL_MODULUS == 0


def write_gz(path: Path, docs: list[str]) -> None:
    data = f"\n{DOC_SEPARATOR}\n".join(docs).encode("utf-8") + b"\n"
    with open(path, "wb") as raw, gzip.GzipFile(fileobj=raw, mode="wb", compresslevel=9, mtime=0, filename="") as f:
        f.write(data)


def read_documents(path: Path) -> list[str]:
    """The documents of a ``{train,val}.txt.gz`` file written by this script."""
    with gzip.open(path, "rt", encoding="utf-8") as f:
        text = f.read()
    return [d.strip("\n") for d in text.split(f"\n{DOC_SEPARATOR}\n") if d.strip()]


def download(package: str, into: Path) -> Path:
    subprocess.run(["apt-get", "download", package], cwd=into, check=True)
    (deb,) = into.glob(f"{package}_*.deb")
    return deb


def deb_field(deb: Path, name: str) -> str:
    return subprocess.run(["dpkg-deb", "-f", str(deb), name], check=True, capture_output=True, text=True).stdout.strip()


SOURCE_TEMPLATE = """\
# Demo corpus: source and licence

Written by `scripts/prepare_demo_corpus.py`; do not edit by hand.

- Debian package: `{package}` version `{version}` (Debian 12 "bookworm", section doc),
  obtained with `apt-get download {package}`.
- `.deb` sha256: `{sha256}`
- Pages: {n_train} training, {n_val} validation (held out: `crc32(path) % {modulus} == 0`).
- Characters: {c_train:,} training, {c_val:,} validation. Documents in each file are separated by a
  line holding only `{sep}`.

## What was taken and what was changed

The HTML pages of the Python {py_version} documentation under `{html_dir}`, reduced to prose: the
main body of each page, one paragraph per block element, whitespace collapsed, typographic quotes
turned into ASCII quotes; code blocks, tables, navigation, the index pages, the changelog and the
licence pages were dropped. Validation pages: {val_pages}.

## Licence

The Python documentation is Copyright (c) 2001-2023 Python Software Foundation; All Rights
Reserved. The pages state: "This page is licensed under the Python Software Foundation License
Version 2. Examples, recipes, and other code in the documentation are additionally licensed under the
Zero Clause BSD License." The corpus here is a derivative work of it (changes summarised above), and
so are the demo model's weights trained on it; both are redistributed under the PSF License
Agreement, whose text is in `LICENSE-PSF.txt` beside this file (taken from the package's
`license.html`). Debian's copyright file for the package: `/usr/share/doc/{package}/copyright`.
"""


def license_texts(html_root: Path) -> str:
    """The PSF License Agreement and the Zero-Clause BSD licence, as plain text from license.html."""
    page = (html_root / "license.html").read_text(encoding="utf-8")
    parts = []
    for section_id, title in (
        ("psf-license-agreement-for-python", "PSF LICENSE AGREEMENT FOR PYTHON"),
        ("zero-clause-bsd-license-for-code", "ZERO-CLAUSE BSD LICENSE FOR CODE IN THE PYTHON DOCUMENTATION"),
    ):
        start = page.index(f'id="{section_id}')
        body = re.search(r"<pre[^>]*>(.*?)</pre>", page[start:], re.S).group(1)
        parts.append(f"{title}\n\n" + html.unescape(re.sub(r"<[^>]+>", "", body)).strip() + "\n")
    return "\n\n".join(parts)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--deb", type=Path, default=None, help="a python3.X-doc .deb (default: apt-get download it)")
    ap.add_argument("--package", default=DEFAULT_PACKAGE)
    ap.add_argument("--out", type=Path, default=Path(__file__).resolve().parents[1] / "data" / "demo_corpus")
    args = ap.parse_args(argv)

    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        deb = args.deb or download(args.package, tmp)
        package, version = deb_field(deb, "Package"), deb_field(deb, "Version")
        sha256 = hashlib.sha256(deb.read_bytes()).hexdigest()
        subprocess.run(["dpkg-deb", "-x", str(deb), str(tmp / "root")], check=True)
        html_root = find_html_root(tmp / "root")
        docs = documents(html_root)
        train = [text for rel, text in docs if not is_validation(rel)]
        val = [text for rel, text in docs if is_validation(rel)]
        val_pages = [rel for rel, _ in docs if is_validation(rel)]
        args.out.mkdir(parents=True, exist_ok=True)
        write_gz(args.out / "train.txt.gz", train)
        write_gz(args.out / "val.txt.gz", val)
        (args.out / "LICENSE-PSF.txt").write_text(license_texts(html_root), encoding="utf-8")
        py_version = re.search(r"python(3\.\d+)", package)
        (args.out / "SOURCE.md").write_text(
            SOURCE_TEMPLATE.format(
                package=package,
                version=version,
                sha256=sha256,
                n_train=len(train),
                n_val=len(val),
                modulus=VAL_MODULUS,
                c_train=sum(map(len, train)),
                c_val=sum(map(len, val)),
                sep=DOC_SEPARATOR,
                py_version=py_version.group(1) if py_version else "3",
                val_pages=", ".join(f"`{p}`" for p in val_pages),
                html_dir="/" + html_root.relative_to(tmp / "root").as_posix(),
            ),
            encoding="utf-8",
        )
    for name in ("train.txt.gz", "val.txt.gz"):
        print(f"{args.out / name}: {(args.out / name).stat().st_size / 1e6:.2f} MB")
    return 0


if __name__ == "__main__":
    shutil.which("dpkg-deb") or sys.exit("dpkg-deb not found: run this on Debian or Ubuntu")
    sys.exit(main())
