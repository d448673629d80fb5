"""Offline topic corpora: text that is on this machine already, nothing downloaded.

- man pages (`/usr/share/man/man[1-8]`): a command, file format, concept or C function with its
  one-line NAME description (`ls`: "list directory contents"); machine-generated families such as
  the hundreds of `gcloud_*` pages are capped at a few entries each;
- Debian packages (`/var/lib/dpkg/status`): a package and its one-line description;
- Python's standard library: module names with the first line of their docstring, public
  functions, classes and methods with `inspect.signature` and their docstrings, and the
  language topics of `help()` (`pydoc_data.topics`, `pydoc.Helper.keywords`);
- English words: the target tokenizer's whole-word tokens (`Ġword`) that also occur in the
  corpora's text, which keeps real words and drops sub-word fragments.

`Corpora.build` gathers all of it (a few seconds); `to_json` / `from_json` snapshot it, so a run
resumed in a later session (or on another machine) draws from exactly the same corpora.
"""

from __future__ import annotations

import contextlib
import gzip
import importlib
import inspect
import io
import os
import pydoc
import pydoc_data.topics
import re
import sys
import warnings
from collections import Counter
from dataclasses import asdict, dataclass, field
from pathlib import Path

MAN_ROOT = Path("/usr/share/man")
DPKG_STATUS = Path("/var/lib/dpkg/status")
MAN_SECTIONS = {"1": "command", "8": "command", "5": "file format", "7": "concept", "2": "cfunc", "3": "cfunc"}
MAX_PER_FAMILY = 12  # man pages sharing a first name component (gcloud_*, git-*) kept at most
# modules that act on import (open a browser, print), need a display, or are not for users
_MODULE_DENY = {"antigravity", "this", "idlelib", "tkinter", "turtle", "turtledemo", "lib2to3", "ensurepip",
                "pydoc_data", "__main__", "__phello__", "msilib", "msvcrt", "nt", "winreg", "winsound"}
# well-known submodules, reached as written (os.path.join, not posixpath.join)
_SUBMODULES = ("os.path", "urllib.parse", "urllib.request", "collections.abc", "email.utils", "json.decoder",
               "xml.etree.ElementTree", "concurrent.futures", "importlib.resources", "importlib.metadata",
               "http.client", "http.server", "logging.handlers", "unittest.mock", "multiprocessing.pool",
               "email.message", "xml.dom.minidom", "dbm.dumb", "sqlite3.dbapi2", "asyncio.subprocess")
_ROFF = re.compile(r"\\f[BIRPC]|\\f\(..|\\\*\(..|\\\(..|\\[&|^%]|\\s[-+]?\d")


@dataclass(frozen=True)
class Topic:
    """A named thing with an optional one-line description; `category` picks its templates."""

    name: str
    category: str  # word | command | file format | concept | package | pymodule | pytopic | pykeyword
    description: str = ""


@dataclass(frozen=True)
class CodeItem:
    """A standard-library (or C library) callable for the code tasks."""

    qualname: str     # "os.path.join", "str.split", "printf"
    signature: str    # "(a, *p)"; "" when inspect cannot tell
    summary: str      # first docstring line (or man page description)
    doc: str = ""     # first docstring paragraph, for completion prompts
    language: str = "python"


@dataclass
class Corpora:
    topics: list[Topic] = field(default_factory=list)
    callables: list[CodeItem] = field(default_factory=list)

    @classmethod
    def build(cls, tokenizer=None, man_root: Path = MAN_ROOT, dpkg_status: Path = DPKG_STATUS) -> Corpora:
        man = man_pages(man_root)
        topics = [Topic(n, MAN_SECTIONS[s[0]], d) for n, s, d in man if MAN_SECTIONS[s[0]] != "cfunc"]
        topics += [Topic(n, "package", d) for n, d in dpkg_packages(dpkg_status)]
        modules = stdlib_modules()
        topics += [Topic(name, "pymodule", summary) for name, summary in module_summaries(modules)]
        topics += [Topic(t, "pytopic") for t in python_topics()]
        topics += [Topic(k, "pykeyword") for k in sorted(pydoc.Helper.keywords)]
        callables = python_callables(modules)
        callables += [CodeItem(n, "", d, language="c") for n, s, d in man if MAN_SECTIONS[s[0]] == "cfunc" and d]
        if tokenizer is not None:
            text = " ".join([t.description for t in topics] + [c.doc or c.summary for c in callables]
                            + [inspect.getdoc(m) or "" for m in modules.values()]
                            + list(pydoc_data.topics.topics.values()))
            topics += [Topic(w, "word") for w in vocab_words(tokenizer, text)]
        return cls(_unique(topics), _unique(callables))

    def to_json(self) -> dict:
        return {"topics": [asdict(t) for t in self.topics], "callables": [asdict(c) for c in self.callables]}

    @classmethod
    def from_json(cls, data: dict) -> Corpora:
        return cls([Topic(**t) for t in data["topics"]], [CodeItem(**c) for c in data["callables"]])

    def by_category(self) -> dict[str, list[Topic]]:
        out: dict[str, list[Topic]] = {}
        for t in self.topics:
            out.setdefault(t.category, []).append(t)
        return out


def _unique(items: list) -> list:
    return list(dict.fromkeys(items))


def _clean_roff(text: str) -> str:
    text = _ROFF.sub("", text).replace("\\-", "-").replace("\\e", "\\").replace('"', "")
    return re.sub(r"\s+", " ", text).strip()


def man_pages(root: Path = MAN_ROOT, max_per_family: int = MAX_PER_FAMILY) -> list[tuple[str, str, str]]:
    """(name, section, NAME-line description) of the English man pages, sorted by path."""
    out, families = [], Counter()
    for section in sorted(MAN_SECTIONS):
        folder = root / f"man{section}"
        if not folder.is_dir():
            continue
        for fname in sorted(os.listdir(folder)):
            m = re.match(r"^(.+)\.(\d)([a-z]*)\.gz$", fname)
            if not m or (MAN_SECTIONS[m.group(2)] == "cfunc" and m.group(3)):  # 3pm, 3ssl: not libc
                continue
            name, family = m.group(1), re.split(r"[_\-.]", m.group(1))[0]
            if families[family] >= max_per_family:
                continue
            try:
                with gzip.open(folder / fname, "rb") as fh:
                    head = fh.read(8000).decode("utf-8", "replace")
            except (OSError, EOFError):
                continue
            body = re.search(r'^\.S[Hh]\s+"?NAME"?\s*\n(.*?)(?=^\.S[Hh]\b)', head, re.MULTILINE | re.DOTALL)
            if not body:
                continue
            nd = re.search(r"^\.Nd\s+(.*)$", body.group(1), re.MULTILINE)
            if nd:
                desc = nd.group(1)
            else:
                text = " ".join(line for line in body.group(1).splitlines() if not line.startswith((".", "'")))
                desc = re.split(r"\s\\-\s|\s\\\(em\s|\s-\s", text, maxsplit=1)[-1] if "-" in text else ""
            desc = _clean_roff(desc)
            if 2 <= len(desc.split()) <= 20:
                families[family] += 1
                out.append((name, m.group(2) + m.group(3), desc))
    return out


def dpkg_packages(status: Path = DPKG_STATUS) -> list[tuple[str, str]]:
    """(package, one-line description) of the installed Debian packages, sorted by name."""
    if not status.is_file():
        return []
    out = {}
    for block in status.read_text(errors="replace").split("\n\n"):
        pkg = re.search(r"^Package: (\S+)", block, re.MULTILINE)
        desc = re.search(r"^Description: (.+)$", block, re.MULTILINE)
        if pkg and desc and not pkg.group(1).startswith("lib"):
            out[pkg.group(1)] = desc.group(1).strip()
    return sorted(out.items())


def stdlib_modules() -> dict[str, object]:
    """The importable public standard-library modules (and well-known submodules), by name."""
    out = {}
    names = sorted(n for n in sys.stdlib_module_names if not n.startswith("_") and n not in _MODULE_DENY)
    with warnings.catch_warnings(), contextlib.redirect_stdout(io.StringIO()), \
            contextlib.redirect_stderr(io.StringIO()):
        warnings.simplefilter("ignore")
        for name in [*names, *_SUBMODULES]:
            try:
                out[name] = importlib.import_module(name)
            except Exception:  # noqa: BLE001, S112 - platform modules (winreg, ...), optional C parts
                continue
    return out


def _summary(obj) -> tuple[str, str]:
    """(first docstring line, first paragraph) with signature-looking first lines skipped."""
    doc = inspect.getdoc(obj) or ""
    paragraphs = [p.strip() for p in doc.split("\n\n") if p.strip()]
    while paragraphs and re.match(r"^[\w.]+\(.*\)(\s*->.*)?$", paragraphs[0].splitlines()[0]):
        paragraphs.pop(0)  # builtins start with their signature
    if not paragraphs:
        return "", ""
    para = re.sub(r"\s+", " ", paragraphs[0])
    if "<==>" in para:  # slot wrappers ("x.__contains__(y) <==> y in x")
        return "", ""
    return re.split(r"(?<=[.!?])\s", para, maxsplit=1)[0], para


def module_summaries(modules: dict[str, object]) -> list[tuple[str, str]]:
    return [(name, _summary(mod)[0]) for name, mod in modules.items()]


def python_topics() -> list[str]:
    """`help()`'s language topics as phrases ("augmented assignment", "with statement")."""
    return sorted({k.replace("-", " ") for k in pydoc_data.topics.topics})


def _signature(obj) -> str:
    try:
        sig = str(inspect.signature(obj))
    except (TypeError, ValueError):
        return ""
    # reprs with addresses differ per process (the corpora must not), long ones read badly
    return "" if " at 0x" in sig or len(sig) > 160 else sig


def _from_stdlib(obj) -> bool:
    module = getattr(obj, "__module__", None)
    return module is None or module.split(".")[0] in sys.stdlib_module_names or module == "builtins"


def python_callables(modules: dict[str, object]) -> list[CodeItem]:
    """Public functions, classes and their public methods with a real docstring, by module order."""
    out, seen = [], set()

    def add(qualname: str, obj) -> None:
        summary, doc = _summary(obj)
        if id(obj) in seen or len(summary.split()) < 3 or summary.endswith(":"):
            return
        seen.add(id(obj))
        out.append(CodeItem(qualname, _signature(obj), summary, doc))

    for mod_name, mod in modules.items():
        for attr in sorted(getattr(mod, "__all__", None) or dir(mod)):
            if attr.startswith("_") or attr.endswith("hook"):  # hooks (sys.excepthook) get replaced at run time
                continue
            obj = getattr(mod, attr, None)
            if not _from_stdlib(obj):  # monkeypatched in by a third-party package (pytest, ...)
                continue
            prefix = "" if mod_name == "builtins" else f"{mod_name}."
            if inspect.isclass(obj) and obj.__module__.split(".")[0] in (mod_name.split(".")[0], "builtins"):
                add(prefix + attr, obj)
                for meth in sorted(vars(obj)):
                    if not meth.startswith("_") and callable(vars(obj)[meth]):
                        add(f"{prefix}{attr}.{meth}", vars(obj)[meth])
            elif inspect.isfunction(obj) or inspect.isbuiltin(obj):
                add(prefix + attr, obj)
    return out


def vocab_words(tokenizer, text: str, min_len: int = 4) -> list[str]:
    """Whole-word lowercase tokens of `tokenizer` ("Ġword") that occur as words in `text`."""
    in_text = set(re.findall(rf"\b[a-z]{{{min_len},}}\b", text))
    vocab = tokenizer.get_vocab()
    return sorted(w[1:] for w in vocab if w.startswith("Ġ") and w[1:].isalpha() and w[1:].islower()
                  and len(w) > min_len and w[1:] in in_text)
