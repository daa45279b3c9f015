#!/usr/bin/env python3
"""Static check of deploy/graphpoold.toml, the example configuration "with every key", against
the keys src/config.rs parses (its File* structs, `deny_unknown_fields`).

Every key the daemon reads must appear in the example, set or commented out (`# key = ...`),
in its section; every key the example sets or shows in a comment must be one the daemon reads
(a misspelt key that is set also fails the daemon's start in e2e_prometheus.py; a stale
commented-out one would only fail the user who uncomments it). Standard library only.
"""
import pathlib
import re
import sys
import tomllib

ROOT = pathlib.Path(__file__).resolve().parents[2]
EXAMPLE = ROOT / "deploy/graphpoold.toml"
failures = []


def check(cond, msg):
    print(("ok   " if cond else "FAIL ") + msg)
    if not cond:
        failures.append(msg)


def rust_structs(text):
    """{struct name: [(field, type)]} of the `struct File...` definitions."""
    out = {}
    for m in re.finditer(r"struct (File\w*) \{(.*?)\n\}", text, re.S):
        fields = re.findall(r"^\s*(\w+): ([^,\n]+),", m.group(2), re.M)
        out[m.group(1)] = fields
    return out


def daemon_keys():
    """{section ('' for the top level): set of keys} the daemon parses."""
    structs = rust_structs((ROOT / "src/config.rs").read_text())
    if "FileConfig" not in structs:
        check(False, "src/config.rs defines struct FileConfig")
        return {}
    keys = {"": set()}
    for name, ty in structs["FileConfig"]:
        if ty.strip() in structs:
            keys[name] = {f for f, _ in structs[ty.strip()]}
        else:
            keys[""].add(name)
    return keys


def example_keys():
    """{section: {key: 'set' or 'commented'}} of the example file."""
    text = EXAMPLE.read_text()
    out = {"": {}}
    parsed = tomllib.loads(text)
    for k, v in parsed.items():
        if isinstance(v, dict):
            out.setdefault(k, {}).update({kk: "set" for kk in v})
        else:
            out[""][k] = "set"
    section = ""
    for line in text.splitlines():
        m = re.match(r"^\[(\w+)\]\s*$", line)
        if m:
            section = m.group(1)
            out.setdefault(section, {})
            continue
        m = re.match(r"^#\s*(\w+)\s*=\s*\S", line)
        if m:
            out.setdefault(section, {}).setdefault(m.group(1), "commented")
    return out


def main():
    want = daemon_keys()
    have = example_keys()
    for section, keys in sorted(want.items()):
        where = f"[{section}]" if section else "top level"
        for key in sorted(keys):
            check(key in have.get(section, {}), f"deploy/graphpoold.toml shows {where} {key}")
    for section, keys in sorted(have.items()):
        where = f"[{section}]" if section else "top level"
        check(section in want, f"the daemon reads the section {where}")
        for key, how in sorted(keys.items()):
            check(key in want.get(section, set()), f"the daemon reads {where} {key} ({how} in the example)")
    print(f"config keys: {sum(map(len, want.values()))} read by the daemon")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
