"""python tools/make_demo_corpus.py --output data/demo/corpus.jsonl [--max-bytes 5000000]

Build the demo pretraining corpus without downloading anything.

The text is English prose that ships with every Python installation: the
docstrings of the standard library, plus the language-reference topics behind
``help('keyword')`` (``pydoc_data.topics``). The stdlib is walked with
``pkgutil.iter_modules``:

* pure-Python modules are read with ``ast`` rather than imported, so there are
  no import side effects and nested and private definitions are included;
* built-in and extension (C) modules have no source, so they are imported
  (warnings and output silenced, failures skipped) and introspected.

Each document is one JSON line ``{"text": ...}``: one per module (its
docstring, then the docstrings of its classes, functions and methods in source
order, each under its qualified name) and one per pydoc topic. Docstrings
already seen are dropped (re-exports, C accelerators with a Python twin,
inherited boilerplate), documents under ``--min-chars`` are dropped, and
documents are sorted by module name, so two runs on the same Python produce
byte-identical output. Writing stops before the document that would push the
file past ``--max-bytes``.

On CPython 3.11 this yields about 600 documents, 2.9 MB: the whole supply, so
the default --max-bytes does not cut anything there.
"""

import argparse
import ast
import contextlib
import importlib
import inspect
import io
import json
import os
import pkgutil
import sys
import sysconfig
import time
import warnings

# Never read: test suites, trivial or obfuscated modules, topics (added apart),
# and readline, whose import can write terminal escapes straight to stdout.
SKIP_TOP_LEVEL = {"__main__", "antigravity", "this", "test", "pydoc_data", "readline"}
# Module-name components skipped anywhere in a package tree.
SKIP_COMPONENTS = {"__main__", "test", "tests", "idle_test"}


def stdlib_dir():
    """The standard library directory (not a virtualenv's lib/)."""
    return os.path.realpath(sysconfig.get_path("stdlib"))


def is_skipped(name):
    """True for modules left out of the corpus."""
    parts = name.split(".")
    top = parts[0]
    if top in SKIP_TOP_LEVEL or top.startswith(("_test", "_xx", "xx", "__")) \
            or top.endswith("_test"):
        return True
    if top == "encodings" and len(parts) > 1:
        return True  # one generated codec per charset, near-identical docs
    return any(p in SKIP_COMPONENTS or p.startswith("test_") for p in parts[1:])


def walk_stdlib():
    """Return sorted (dotted name, source path or None) for the stdlib.

    The source path is None for extension modules, which must be imported.
    """
    root = stdlib_dir()
    found = [(name, None) for name in sys.builtin_module_names]
    pending = [("", [root, os.path.join(root, "lib-dynload")])]
    while pending:
        prefix, paths = pending.pop()
        for info in pkgutil.iter_modules(paths, prefix=prefix):
            if is_skipped(info.name):
                continue
            leaf = info.name.rpartition(".")[2]
            base = os.path.join(info.module_finder.path, leaf)
            if info.ispkg:
                pending.append((info.name + ".", [base]))
                found.append((info.name, os.path.join(base, "__init__.py")))
            elif os.path.isfile(base + ".py"):
                found.append((info.name, base + ".py"))
            else:
                found.append((info.name, None))
    return sorted((n, p) for n, p in found if not is_skipped(n))


# ---------------------------------------------------------------- source files

def iter_defs(body):
    """Class/function definitions in a statement list, looking inside
    if/try/with/for/while blocks but not inside other definitions."""
    for node in body:
        if isinstance(node, (ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
            yield node
        else:
            for field in ("body", "orelse", "finalbody", "handlers"):
                inner = getattr(node, field, None)
                if isinstance(inner, list):
                    yield from iter_defs(inner)


def def_sections(node, qualname, seen):
    """'qualname' + docstring sections for a definition and its nested ones."""
    sections = []
    doc = ast.get_docstring(node, clean=True)
    if doc and doc not in seen:
        seen.add(doc)
        kind = "class " if isinstance(node, ast.ClassDef) else ""
        sections.append(f"{kind}{qualname}\n\n{doc}")
    for child in iter_defs(node.body):
        sections.extend(def_sections(child, f"{qualname}.{child.name}", seen))
    return sections


def source_document(name, path, seen):
    """The document of one pure-Python module, read with ast (never imported)."""
    try:
        with open(path, "rb") as f:
            tree = ast.parse(f.read(), filename=path)
    except (OSError, SyntaxError, ValueError):
        return ""
    sections = []
    doc = ast.get_docstring(tree, clean=True)
    if doc and doc not in seen:
        seen.add(doc)
        sections.append(f"Module {name}\n\n{doc}")
    for node in iter_defs(tree.body):
        sections.extend(def_sections(node, f"{name}.{node.name}", seen))
    return "\n\n".join(sections)


# ------------------------------------------------------------ extension modules

def quiet_import(name):
    """Import a module with warnings and output silenced; None if it fails."""
    with warnings.catch_warnings(), contextlib.redirect_stdout(io.StringIO()), \
            contextlib.redirect_stderr(io.StringIO()):
        warnings.simplefilter("ignore")
        try:
            return importlib.import_module(name)
        except (Exception, SystemExit):
            return None


def clean_doc(obj):
    """The object's own docstring, dedented and stripped ('' if none)."""
    doc = getattr(obj, "__doc__", None)
    return inspect.cleandoc(doc).strip() if isinstance(doc, str) else ""


def add_section(sections, header, obj, seen):
    doc = clean_doc(obj)
    if doc and doc not in seen:
        seen.add(doc)
        sections.append(f"{header}\n\n{doc}")


def class_sections(name, cls, seen):
    """A class docstring followed by its own methods' docstrings."""
    sections = []
    add_section(sections, f"class {name}.{cls.__name__}", cls, seen)
    for attr_name, attr in sorted(vars(cls).items()):
        if isinstance(attr, (classmethod, staticmethod)):
            attr = attr.__func__
        if inspect.isroutine(attr) or isinstance(attr, property):
            add_section(sections, f"{name}.{cls.__name__}.{attr_name}", attr, seen)
    return sections


def extension_document(name, seen):
    """The document of a built-in or extension module, by introspection."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # deprecated aliases warn on attribute access
        module = quiet_import(name)
        path = getattr(module, "__file__", None)  # None: built into the interpreter
        if module is None or (path and not os.path.realpath(path).startswith(stdlib_dir())):
            return ""  # failed, or shadowed by a module outside the stdlib
        sections = []
        add_section(sections, f"Module {name}", module, seen)
        for _, obj in sorted(vars(module).items()):
            if getattr(obj, "__module__", None) != name:
                continue  # imported from elsewhere
            if inspect.isclass(obj):
                sections.extend(class_sections(name, obj, seen))
            elif inspect.isroutine(obj):
                add_section(sections, f"{name}.{obj.__name__}", obj, seen)
        return "\n\n".join(sections)


# ---------------------------------------------------------------------- corpus

def topic_documents(seen):
    """The language-reference topics that back help('keyword') in pydoc."""
    topics = quiet_import("pydoc_data.topics")
    docs = []
    for _, text in sorted(getattr(topics, "topics", {}).items()):
        text = text.strip()
        if text and text not in seen:
            seen.add(text)
            docs.append(text)
    return docs


def build_documents(min_chars):
    """All corpus documents, in deterministic order."""
    seen = set()
    docs = []
    for name, path in walk_stdlib():
        if path is None:
            docs.append(extension_document(name, seen))
        else:
            docs.append(source_document(name, path, seen))
    docs.extend(topic_documents(seen))
    return [d for d in docs if len(d) >= min_chars]


def write_jsonl(docs, path, max_bytes):
    """Write documents until max_bytes; return (documents, bytes) written."""
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    count = size = 0
    with open(path, "wb") as out:
        for doc in docs:
            line = (json.dumps({"text": doc}, ensure_ascii=False) + "\n").encode("utf-8")
            if size + len(line) > max_bytes:
                break
            out.write(line)
            count += 1
            size += len(line)
    return count, size


def parse_args(argv=None):
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--output", required=True, help="output .jsonl file")
    parser.add_argument("--max-bytes", type=int, default=5_000_000,
                        help="stop before the file exceeds this size (default: 5 MB)")
    parser.add_argument("--min-chars", type=int, default=200,
                        help="drop documents shorter than this (default: 200)")
    return parser.parse_args(argv)


def main(argv=None):
    args = parse_args(argv)
    start = time.time()
    docs = build_documents(args.min_chars)
    count, size = write_jsonl(docs, args.output, args.max_bytes)
    print(f"wrote {count} of {len(docs)} documents, {size} bytes ({size / 1e6:.2f} MB) "
          f"to {args.output} in {time.time() - start:.1f}s (Python {sys.version.split()[0]})")


if __name__ == "__main__":
    main()
