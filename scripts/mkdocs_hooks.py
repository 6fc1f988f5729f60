"""mkdocs hooks: the guide's tour and the quick reference live at the checkout's top, where the card names them
(MULTI_GPU_GUIDE.md, QUICK_REFERENCE.md); the site takes them from there. Their links, and the pages' links to
files of the checkout that are no page (code, result tables), are written for the checkout; the site keeps the
ones to pages, shows the others as the file's path, and leaves a link to a file that does not exist for mkdocs
to report. The API reference's TrainConfig page gets every field (mkdocstrings lists only what has a docstring,
and a field's help is its metadata): TrainConfig's own table, at FIELDS_MARK."""

from __future__ import annotations

import os
import re
import sys
from typing import Any

from mkdocs.structure.files import File, Files

TOP_PAGES = ("MULTI_GPU_GUIDE.md", "QUICK_REFERENCE.md")
FIELDS_MARK = "<!-- every TrainConfig field, from multigpu/config.py (scripts/mkdocs_hooks.py) -->"
LINK = re.compile(r"\[([^\]]*)\]\((?!https?:|mailto:|#)([^)#\s]*)(#[^)\s]*)?\)")


def on_files(files: Files, config: Any) -> Files:
    top = os.path.dirname(config["config_file_path"])
    for name in TOP_PAGES:  # the guide's tour is the site's first page
        dest = "index.html" if name == TOP_PAGES[0] else None
        files.append(File(name, top, config["site_dir"], config["use_directory_urls"], dest_uri=dest))
    return files


def with_fields(markdown: str, top: str) -> str:
    """`markdown` with FIELDS_MARK replaced by TrainConfig's fields (`reference_table`) of the checkout at `top`."""
    if FIELDS_MARK not in markdown:
        return markdown
    if top not in sys.path:
        sys.path.insert(0, top)
    from multigpu.config import reference_table

    return markdown.replace(FIELDS_MARK, reference_table())


def on_page_markdown(markdown: str, page: Any, config: Any, files: Files) -> str:
    at_top, top = page.file.src_uri in TOP_PAGES, os.path.dirname(config["config_file_path"])
    markdown = with_fields(markdown, top)
    pages = {file.src_uri for file in files.documentation_pages()}

    def link(match: re.Match) -> str:
        text, target, anchor = match.group(1), match.group(2), match.group(3) or ""
        in_checkout = os.path.normpath(
            target if at_top else os.path.join("docs", os.path.dirname(page.file.src_uri), target)
        )
        in_site = in_checkout.removeprefix("docs/") if in_checkout.startswith("docs/") else in_checkout
        if in_site in pages:
            here = os.path.dirname(page.file.src_uri)
            return f"[{text}]({os.path.relpath(in_site, here or '.')}{anchor})"
        if os.path.exists(os.path.join(top, in_checkout)):  # a file of the checkout, no page: its path
            return f"{text} (`{in_checkout}`)"
        return match.group(0)  # a file that does not exist: mkdocs says so (and --strict fails)

    return LINK.sub(link, markdown)
