"""Loading policy files: YAML with line numbers, every error as `file:line: field: what`.

    policy = load_policy("python-tool")               # a built-in (policies/builtin/NAME.yaml)
    policy = load_policy("./team/tool.yaml")          # a file
    errors, warnings = check("tool.yaml")             # everything, for `dsec policy check`

A NAME without '/' and without a .yaml/.yml/.json suffix is a built-in; anything
else is a file path. Errors look like

    p.yaml:7: spec.syscalls.allow[3]: unknown syscall 'opne' (did you mean 'open'?)

load_policy raises PolicyError (a PoliciesError, exit code 2) whose message is the
first error by line; `check` returns all errors and warnings. Input is bounded
(MAX_BYTES), must be UTF-8, a single YAML document, a mapping at the top; YAML
anchors/aliases, merge keys, duplicate keys and non-string keys are rejected.
"""
from __future__ import annotations

import os
import stat
import typing

import yaml
from pydantic import BaseModel, ValidationError

from policies import model as m
from policies.model import Issue, Policy, PolicyError, format_path, semantic_issues

MAX_BYTES = 1 << 20
BUILTIN_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "builtin")
_SUFFIXES = (".yaml", ".yml", ".json")


def _display(s: str) -> str:
    """A path or value that can always be printed (non-UTF-8 bytes shown as \\xNN)."""
    if isinstance(s, bytes):
        return s.decode("utf-8", "backslashreplace")
    return s.encode("utf-8", "surrogateescape").decode("utf-8", "backslashreplace")


# ---------------------------------------------------------------- built-ins

def builtin_names() -> list[str]:
    try:
        return sorted(f[:-5] for f in os.listdir(BUILTIN_DIR) if f.endswith(".yaml"))
    except OSError:
        return []


def builtin_path(name: str) -> str | None:
    """The file of built-in policy `name` (one of builtin_names()), or None. One stat, not a
    listing of the directory: the agent resolves the policy of every request."""
    if not name or "/" in name or name.startswith("."):
        return None                       # never a file of BUILTIN_DIR's own
    path = os.path.join(BUILTIN_DIR, name + ".yaml")
    return path if os.path.isfile(path) else None


def is_builtin_ref(ref: str) -> bool:
    return "/" not in ref and not ref.endswith(_SUFFIXES)


def resolve(ref: str) -> tuple[str, str]:
    """(path, display source) for a file path or a built-in name."""
    if not ref:
        raise PolicyError("empty policy name")
    if is_builtin_ref(ref):
        path = builtin_path(ref)
        if path is None:
            raise PolicyError(f"no built-in policy {_display(ref)!r} (built-ins: {', '.join(builtin_names())}; "
                              "a file path needs a '/' or a .yaml suffix)")
        return path, f"builtin:{ref}"
    return ref, _display(ref)


# ---------------------------------------------------------------- reading

def read_bounded(path: str, source: str, limit: int = MAX_BYTES) -> bytes:
    """A regular file's bytes, at most `limit` (a PolicyError otherwise)."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC | os.O_NONBLOCK)
    except OSError as e:
        raise PolicyError(f"{source}: cannot open: {e.strerror}") from None
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise PolicyError(f"{source}: not a regular file")
        if st.st_size > limit:
            raise PolicyError(f"{source}: too large ({st.st_size} bytes; a policy is at most {limit} bytes)")
        chunks, total = [], 0
        while True:
            b = os.read(fd, 1 << 16)
            if not b:
                break
            chunks.append(b)
            total += len(b)
            if total > limit:
                raise PolicyError(f"{source}: too large (more than {limit} bytes)")
        return b"".join(chunks)
    except OSError as e:
        raise PolicyError(f"{source}: cannot read: {e.strerror}") from None
    finally:
        os.close(fd)


def decode_utf8(data: bytes, source: str) -> str:
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as e:
        line = data.count(b"\n", 0, e.start) + 1
        raise PolicyError(f"{source}:{line}: not UTF-8 (byte 0x{data[e.start]:02x} at offset {e.start})") from None


# ---------------------------------------------------------------- YAML -> data with line numbers

class _Located:
    """Plain data from a YAML node tree, with the line of every path."""

    def __init__(self, source: str):
        self.source = source
        self.lines: dict[tuple, int] = {}
        self.errors: list[tuple[int, str]] = []
        self._seen: set[int] = set()
        self._ctor = yaml.constructor.SafeConstructor()

    def line(self, path: tuple) -> int | None:
        path = tuple(path)
        while True:
            if path in self.lines:
                return self.lines[path]
            if not path:
                return None
            path = path[:-1]

    def convert(self, node, path: tuple):
        if id(node) in self._seen:
            raise PolicyError(f"{self.source}:{node.start_mark.line + 1}: {format_path(path)}: "
                              "YAML anchors and aliases are not supported")
        self._seen.add(id(node))
        ln = node.start_mark.line + 1
        self.lines.setdefault(path, ln)
        if isinstance(node, yaml.ScalarNode):
            return self._ctor.construct_object(node, deep=True)
        if isinstance(node, yaml.SequenceNode):
            if node.tag != "tag:yaml.org,2002:seq":
                raise PolicyError(f"{self.source}:{ln}: {format_path(path) or 'document'}: "
                                  f"unsupported YAML tag {node.tag}")
            return [self.convert(item, path + (i,)) for i, item in enumerate(node.value)]
        if isinstance(node, yaml.MappingNode):
            if node.tag != "tag:yaml.org,2002:map":
                raise PolicyError(f"{self.source}:{ln}: {format_path(path) or 'document'}: "
                                  f"unsupported YAML tag {node.tag}")
            out: dict = {}
            for knode, vnode in node.value:
                kl = knode.start_mark.line + 1
                if not isinstance(knode, yaml.ScalarNode) or knode.tag != "tag:yaml.org,2002:str":
                    if isinstance(knode, yaml.ScalarNode) and knode.tag == "tag:yaml.org,2002:merge":
                        raise PolicyError(f"{self.source}:{kl}: {format_path(path) or 'document'}: "
                                          "YAML merge keys (<<) are not supported")
                    what = knode.value if isinstance(knode, yaml.ScalarNode) else "a " + knode.id
                    raise PolicyError(f"{self.source}:{kl}: {format_path(path) or 'document'}: "
                                      f"keys must be strings, got {_display(str(what))!r}")
                key = knode.value
                if key in out:
                    self.errors.append((kl, f"{format_path(path + (key,))}: duplicate key {key!r} "
                                            f"(first at line {self.lines.get(path + (key,))})"))
                    continue
                self.lines[path + (key,)] = kl
                out[key] = self.convert(vnode, path + (key,))
            return out
        raise PolicyError(f"{self.source}:{ln}: unsupported YAML node")


class _NoAliasLoader(yaml.SafeLoader):
    """Refuses aliases where they occur (a billion-laughs document never expands)."""

    def compose_node(self, parent, index):
        if self.check_event(yaml.AliasEvent):
            ev = self.peek_event()
            raise yaml.composer.ComposerError(None, None, f"YAML aliases are not supported (*{ev.anchor})",
                                              ev.start_mark)
        return super().compose_node(parent, index)


def parse_yaml(text: str, source: str) -> tuple[object, _Located]:
    loc = _Located(source)
    try:
        node = yaml.compose(text, Loader=_NoAliasLoader)
    except yaml.MarkedYAMLError as e:
        mark = e.problem_mark or e.context_mark
        where = f"{source}:{mark.line + 1}" if mark else source
        what = e.problem or e.context or "syntax error"
        if e.context and e.problem:
            what = f"{e.context}, {e.problem}"
        raise PolicyError(f"{where}: invalid YAML: {what}") from None
    except yaml.YAMLError as e:
        raise PolicyError(f"{source}: invalid YAML: {e}") from None
    except RecursionError:
        raise PolicyError(f"{source}: invalid YAML: nested too deeply") from None
    if node is None:
        raise PolicyError(f"{source}: empty policy (expected a mapping with apiVersion, kind, metadata, spec)")
    if not isinstance(node, yaml.MappingNode):
        got = {"ScalarNode": "a scalar", "SequenceNode": "a list"}.get(type(node).__name__, "something else")
        raise PolicyError(f"{source}:{node.start_mark.line + 1}: expected a mapping at the top level, got {got}")
    try:
        data = loc.convert(node, ())
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        where = f"{source}:{mark.line + 1}" if mark else source
        raise PolicyError(f"{where}: invalid YAML: {getattr(e, 'problem', None) or e}") from None
    except RecursionError:
        raise PolicyError(f"{source}: invalid YAML: nested too deeply") from None
    return data, loc


# ---------------------------------------------------------------- pydantic errors -> messages

def _unwrap(tp):
    """The model class (or None) a field annotation leads to, and whether it is a list/dict."""
    origin = typing.get_origin(tp)
    if origin is typing.Annotated:
        return _unwrap(typing.get_args(tp)[0])
    if origin in (typing.Union, getattr(__import__("types"), "UnionType", None)):
        for a in typing.get_args(tp):
            if a is not type(None):
                r = _unwrap(a)
                if r[0] is not None:
                    return r
        return (None, None)
    if origin in (list, dict):
        inner = typing.get_args(tp)[-1]
        return (_unwrap(inner)[0], origin)
    if isinstance(tp, type) and issubclass(tp, BaseModel):
        return (tp, None)
    return (None, None)


def _model_at(path: tuple):
    cls = Policy
    i = 0
    while i < len(path):
        key = path[i]
        if cls is None or not isinstance(key, str) or key not in cls.model_fields:
            return None
        nxt, container = _unwrap(cls.model_fields[key].annotation)
        i += 1
        if container is list and i < len(path) and isinstance(path[i], int):
            i += 1
        elif container is dict and i < len(path):
            i += 1
        cls = nxt
    return cls


def _did_you_mean(word, choices) -> str:
    import difflib
    if not isinstance(word, str):
        return ""
    close = difflib.get_close_matches(word, list(choices), n=1, cutoff=0.6)
    return f" (did you mean {close[0]!r}?)" if close else ""


def _translate(err: dict) -> tuple[tuple, str]:
    loc = tuple(x for x in err["loc"] if x != "[key]")
    t = err["type"]
    inp = err.get("input")
    if t == "dsec":
        return loc, err["ctx"]["msg"]
    if t == "extra_forbidden":
        parent = _model_at(loc[:-1])
        allowed = list(parent.model_fields) if parent else []
        msg = f"unknown key {loc[-1]!r}"
        hint = _did_you_mean(loc[-1], allowed)
        if hint:
            msg += hint
        elif allowed:
            msg += f" (expected one of: {', '.join(allowed)})"
        return loc, msg
    if t == "missing":
        return loc[:-1], f"missing required key {loc[-1]!r}"
    if t == "literal_error":
        expected = err.get("ctx", {}).get("expected", "")
        choices = [c.strip().strip("'") for c in expected.replace(" or ", ",").split(",") if c.strip()]
        got = repr(inp) if isinstance(inp, str) else m._type_name(inp)
        return loc, f"must be one of {', '.join(choices)} (got {got})" + _did_you_mean(inp, choices)
    if t in ("string_type", "str_type"):
        return loc, f"expected a string, got {m._type_name(inp)}"
    if t == "list_type":
        return loc, f"expected a list, got {m._type_name(inp)}"
    if t in ("dict_type", "model_type", "model_attributes_type"):
        return loc, f"expected a mapping, got {m._type_name(inp)}"
    if t.startswith("int_") or t == "int_type":
        return loc, f"expected an integer, got {m._type_name(inp)}"
    if t in ("too_long", "too_short"):
        return loc, err["msg"].replace("Dictionary", "mapping").lower()
    return loc, err["msg"]


# ---------------------------------------------------------------- the entry points

def _analyse(data, source: str, lines: _Located | None) -> tuple[Policy | None, list[str], list[str]]:
    """(raw policy or None, errors, warnings), each message as 'source:line: path: what'."""
    def fmt(path, msg):
        ln = lines.line(path) if lines else None
        p = format_path(path)
        where = f"{source}:{ln}" if ln else source
        return (ln or 0, f"{where}: {p}: {msg}" if p else f"{where}: {msg}")

    errors: list[tuple[int, str]] = list(lines.errors) if lines else []
    errors = [(ln, f"{source}:{ln}: {msg}") for ln, msg in errors]
    warnings: list[tuple[int, str]] = []
    if not m.sc.available():
        raise PolicyError(f"{source}: cannot check syscall names: libseccomp's Python bindings are missing "
                          "(apt-get install python3-seccomp)")
    if not isinstance(data, dict):
        raise PolicyError(f"{source}: expected a mapping at the top level, got {m._type_name(data)}")
    raw = None
    try:
        raw = Policy.model_validate(data, context={"raw": True})
    except ValidationError as e:
        errs = e.errors(include_url=False)
        # a misspelt key is reported once, as unknown (with its suggestion), not also as missing
        unknown = {}
        for err in errs:
            if err["type"] == "extra_forbidden":
                unknown.setdefault(tuple(err["loc"][:-1]), []).append(err["loc"][-1])
        for err in errs:
            if err["type"] == "missing":
                import difflib
                sib = [k for k in unknown.get(tuple(err["loc"][:-1]), []) if isinstance(k, str)]
                if difflib.get_close_matches(str(err["loc"][-1]), sib, n=1, cutoff=0.6):
                    continue
            path, msg = _translate(err)
            errors.append(fmt(path, msg))
    if raw is not None:
        for issue in semantic_issues(raw):
            (errors if issue.severity == "error" else warnings).append(fmt(issue.path, issue.message))
    key = lambda x: x[0]                                                  # noqa: E731
    return raw, [s for _, s in sorted(errors, key=key)], [s for _, s in sorted(warnings, key=key)]


def _finish(raw: Policy | None, errors: list[str], warnings: list[str], source: str) -> Policy:
    if errors:
        raise PolicyError(errors[0], errors, warnings)
    p = m.normalize(raw)
    p._source = source
    p._warnings = warnings
    return p


def load_policy_text(text: str, source: str = "<text>") -> Policy:
    """Parse and validate a policy from YAML text; returns the normalized Policy
    (warnings in .warnings) or raises PolicyError."""
    if len(text.encode("utf-8", "surrogatepass")) > MAX_BYTES:
        raise PolicyError(f"{source}: too large (a policy is at most {MAX_BYTES} bytes)")
    data, lines = parse_yaml(text, source)
    raw, errors, warnings = _analyse(data, source, lines)
    return _finish(raw, errors, warnings, source)


def policy_from_data(data, source: str = "<data>") -> Policy:
    """Validate plain data (e.g. a policy derived by learning mode); no line numbers."""
    raw, errors, warnings = _analyse(data, source, None)
    return _finish(raw, errors, warnings, source)


def load_policy(ref: str) -> Policy:
    """A policy from a file path or a built-in name (see module docstring)."""
    path, source = resolve(ref)
    text = decode_utf8(read_bounded(path, source), source)
    return load_policy_text(text, source)


def check(ref: str) -> tuple[list[str], list[str]]:
    """(errors, warnings) for a file path or built-in name; never raises for bad input."""
    try:
        path, source = resolve(ref)
        text = decode_utf8(read_bounded(path, source), source)
        if len(text) > MAX_BYTES:
            raise PolicyError(f"{source}: too large")
        data, lines = parse_yaml(text, source)
        _, errors, warnings = _analyse(data, source, lines)
        return errors, warnings
    except PolicyError as e:
        return e.errors, e.warnings


class _FlowList(list):
    pass


class _FlowDict(dict):
    pass


class _Dumper(yaml.SafeDumper):
    pass


_Dumper.add_representer(_FlowList, lambda d, v: d.represent_sequence("tag:yaml.org,2002:seq", v, flow_style=True))
_Dumper.add_representer(_FlowDict, lambda d, v: d.represent_mapping("tag:yaml.org,2002:map", v.items(),
                                                                    flow_style=True))


def _styled(d, path=()):
    """Block style everywhere (one syscall per line: policies are reviewed as diffs),
    except egress rules, ports and dns, which read better inline."""
    if isinstance(d, dict):
        items = {k: _styled(v, path + (k,)) for k, v in d.items()}
        return _FlowDict(items) if path[-2:-1] in (("allow",), ("deny",)) and "egress" in path else items
    if isinstance(d, list):
        items = [_styled(v, path + (i,)) for i, v in enumerate(d)]
        if path and path[-1] in ("ports", "dns"):
            return _FlowList(items)
        return items
    return d


def to_yaml(data: dict, header: list[str] | None = None) -> str:
    head = "".join(f"# {h}\n" for h in (header or []))
    return head + yaml.dump(_styled(data), Dumper=_Dumper, sort_keys=False, default_flow_style=False,
                            width=100, allow_unicode=True)


def dump_yaml(p: Policy, header: list[str] | None = None) -> str:
    """The normalized policy as YAML (loadable again), with optional '# ' header lines.
    A sealed policy (Policy.seal) keeps its YAML after the first call."""
    sealed = p.sealed()
    if sealed is not None and not header:
        text = sealed.get("yaml")
        if text is None:
            text = sealed["yaml"] = to_yaml(m.canonical(p))
        return text
    return to_yaml(m.canonical(p), header)


__all__ = ["load_policy", "load_policy_text", "policy_from_data", "check", "dump_yaml", "builtin_names",
           "builtin_path", "resolve", "PolicyError", "Issue", "MAX_BYTES"]
