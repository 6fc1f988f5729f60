"""mkdocs hooks: the guide's tour and the quick reference live at the checkout's top, where the card names them
(MULTI_GPU_GUIDE.md, QUICK_REFERENCE.md); the site takes them from there. Their links, and the pages' links to
files of the checkout that are no page (code, result tables), are written for the checkout; the site keeps the
ones to pages, shows the others as the file's path, and leaves a link to a file that does not exist for mkdocs
to report."""

from __future__ import annotations

import os
import re
from typing import Any

from mkdocs.structure.files import File, Files

TOP_PAGES = ("MULTI_GPU_GUIDE.md", "QUICK_REFERENCE.md")
LINK = re.compile(r"\[([^\]]*)\]\((?!https?:|mailto:|#)([^)#\s]*)(#[^)\s]*)?\)")


def on_files(files: Files, config: Any) -> Files:
    top = os.path.dirname(config["config_file_path"])
    for name in TOP_PAGES:  # the guide's tour is the site's first page
        dest = "index.html" if name == TOP_PAGES[0] else None
        files.append(File(name, top, config["site_dir"], config["use_directory_urls"], dest_uri=dest))
    return files


def on_page_markdown(markdown: str, page: Any, config: Any, files: Files) -> str:
    at_top, top = page.file.src_uri in TOP_PAGES, os.path.dirname(config["config_file_path"])
    pages = {file.src_uri for file in files.documentation_pages()}

    def link(match: re.Match) -> str:
        text, target, anchor = match.group(1), match.group(2), match.group(3) or ""
        in_checkout = os.path.normpath(target if at_top else os.path.join("docs", os.path.dirname(page.file.src_uri),
                                                                          target))
        in_site = in_checkout.removeprefix("docs/") if in_checkout.startswith("docs/") else in_checkout
        if in_site in pages:
            here = os.path.dirname(page.file.src_uri)
            return f"[{text}]({os.path.relpath(in_site, here or '.')}{anchor})"
        if os.path.exists(os.path.join(top, in_checkout)):  # a file of the checkout, no page: its path
            return f"{text} (`{in_checkout}`)"
        return match.group(0)  # a file that does not exist: mkdocs says so (and --strict fails)

    return LINK.sub(link, markdown)
