"""Build examples/data/stdlib_docstrings.txt: the small training corpus of examples/pretrain_gdn.py.

The corpus is the docstrings (module, class, function) of a fixed list of pure-Python modules of
CPython's standard library, read from their source files with ``ast`` (nothing is imported or
executed), in a fixed order, as plain ASCII text with a blank line between documents, cut at
MAX_BYTES. It was built once with CPython 3.12 and committed; rebuilding with another Python
version gives slightly different text (the docstrings change between releases).

Origin and licence: the text is taken from CPython's standard library, Copyright (c) 2001-2024
Python Software Foundation, distributed under the Python Software Foundation License Version 2
(https://docs.python.org/3/license.html), which permits copying and redistribution of derived
works provided the PSF copyright notice is retained (it is, here and in README.md of this folder).

    python examples/data/build_corpus.py --out /tmp/corpus.txt   # build it elsewhere
    python examples/data/build_corpus.py --overwrite             # rewrite stdlib_docstrings.txt
"""

from __future__ import annotations

import argparse
import ast
import os
import sys
import sysconfig

MAX_BYTES = 256 * 1024
OUT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "stdlib_docstrings.txt")

# Pure-Python stdlib modules with rich prose docstrings, in corpus order.
MODULES = [
    "argparse", "collections/__init__", "functools", "itertools", "textwrap", "string",
    "re/__init__",
    "difflib", "heapq", "bisect", "fractions", "decimal", "_pydecimal", "statistics", "random",
    "datetime", "_pydatetime", "calendar", "pathlib", "shutil", "tempfile", "glob", "fnmatch",
    "csv", "json/__init__", "json/decoder", "json/encoder", "configparser", "logging/__init__",
    "threading", "queue", "subprocess", "inspect", "dataclasses", "typing", "enum", "abc",
    "contextlib", "copy", "pickle", "shelve", "zipfile/__init__", "tarfile", "gzip", "base64",
    "hashlib", "hmac", "secrets", "uuid", "ipaddress", "urllib/parse", "http/client",
    "email/message", "smtplib", "ftplib", "socketserver", "unittest/case", "doctest", "pdb",
    "trace", "timeit", "pprint", "reprlib", "weakref", "types", "operator", "numbers", "codecs",
    "locale", "gettext", "optparse", "getopt", "cmd", "shlex", "sched", "selectors",
    "asyncio/tasks", "asyncio/events", "concurrent/futures/_base", "multiprocessing/pool",
    "graphlib", "zoneinfo/_zoneinfo",
]


def docstrings(path: str):
    with open(path, encoding="utf-8") as f:
        tree = ast.parse(f.read(), filename=path)
    nodes = [tree] + [n for n in ast.walk(tree)
                      if isinstance(n, (ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef))]
    for node in nodes:
        doc = ast.get_docstring(node, clean=True)
        if doc and len(doc) >= 80:
            yield doc


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", default=OUT, help="where to write the corpus (default: the "
                        "committed examples/data/stdlib_docstrings.txt)")
    parser.add_argument("--overwrite", action="store_true",
                        help="replace --out when it exists (the committed corpus by default)")
    args = parser.parse_args()
    if os.path.exists(args.out) and not args.overwrite:
        parser.error(f"{args.out} exists: pass --overwrite to replace it, or another --out")
    stdlib = sysconfig.get_paths()["stdlib"]
    seen, parts, size = set(), [], 0
    for mod in MODULES:
        path = os.path.join(stdlib, mod + ".py")
        if not os.path.exists(path):
            continue
        for doc in docstrings(path):
            text = doc.encode("ascii", "ignore").decode("ascii").strip()
            if text in seen:
                continue
            seen.add(text)
            chunk = text + "\n\n"
            if size + len(chunk) > MAX_BYTES:
                break
            parts.append(chunk)
            size += len(chunk)
        if size >= MAX_BYTES - 1024:
            break
    with open(args.out, "w", encoding="ascii", newline="\n") as f:
        f.write("".join(parts))
    print(f"wrote {args.out}: {size} bytes, {len(parts)} documents, "
          f"Python {sys.version.split()[0]}")


if __name__ == "__main__":
    main()
