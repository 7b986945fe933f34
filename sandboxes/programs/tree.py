"""agentrl: place a repository in a sandbox, or say how it differs from the one placed there.

Standard library only, python3 >= 3.9, run with `python3 -I` as the sandbox user. One JSON request on stdin, whose
"answer" names the file to write the answer to, created anew (the answers of earlier requests, `agentrl-tree-*.json`
beside it, removed first): a program's output is capped, and a diff's texts may be far larger:

    {"op": "place", "root": DIR, "clear": [DIR, ...], "tar": PATH}
        remove the `clear` folders, then unpack the tar file at PATH (written by the host) into `root`, and delete it
    {"op": "diff", "root": DIR, "known": {path: sha256}, "max_file_bytes": N, "max_total_bytes": N}
        walk `root` (no symlink followed) and report the files whose bytes differ from `known` (or are new), as
        text, and the known ones that are gone

A diff answers {"changed": {path: text}, "deleted": [path], "skipped": {path: why}}: a path is skipped (never read)
when it is a symlink, not a regular file, not UTF-8 text, or too large; paths are relative, `/`-separated.
"""

import contextlib
import glob
import hashlib
import json
import os
import shutil
import stat
import sys
import tarfile

SKIP_DIRS = {"__pycache__", ".pytest_cache", ".git"}


def place(req):
    for folder in req["clear"]:
        shutil.rmtree(folder, ignore_errors=True)
    os.makedirs(req["root"], exist_ok=True)
    with tarfile.open(req["tar"]) as tar:
        tar.extractall(req["root"])  # our own tar (the host made it), so no member filter is needed
    os.unlink(req["tar"])
    return {"ok": True}


def diff(req):
    root, known = req["root"], req["known"]
    changed, skipped, seen, total = {}, {}, set(), 0
    for folder, dirs, files in os.walk(root, onerror=lambda e: skipped.setdefault(rel(root, e.filename), str(e))):
        dirs[:] = sorted(d for d in dirs if d not in SKIP_DIRS)
        for name in sorted(files) + [d for d in dirs if os.path.islink(os.path.join(folder, d))]:
            full = os.path.join(folder, name)
            path = rel(root, full)
            seen.add(path)
            st = os.lstat(full)
            if stat.S_ISLNK(st.st_mode):
                skipped[path] = "a symlink"
                continue
            if not stat.S_ISREG(st.st_mode):
                skipped[path] = "not a regular file"
                continue
            if st.st_size > req["max_file_bytes"] or total + st.st_size > req["max_total_bytes"]:
                skipped[path] = f"too large ({st.st_size} bytes)"
                continue
            try:
                with open(full, "rb") as f:
                    data = f.read()
            except OSError as e:
                skipped[path] = f"unreadable: {e.strerror}"
                continue
            if hashlib.sha256(data).hexdigest() == known.get(path):
                continue
            try:
                changed[path] = data.decode("utf-8")
            except UnicodeDecodeError:
                skipped[path] = "not UTF-8 text"
                continue
            total += len(data)
    deleted = sorted(p for p in known if p not in seen)
    return {"changed": changed, "deleted": deleted, "skipped": skipped}


def rel(root, full):
    return os.path.relpath(full, root).replace(os.sep, "/")


if __name__ == "__main__":
    request = json.loads(sys.stdin.read())
    answer = request["answer"]
    for old in glob.glob(os.path.join(os.path.dirname(answer), "agentrl-tree-*.json")):
        with contextlib.suppress(OSError):
            os.unlink(old)
    result = {"place": place, "diff": diff}[request["op"]](request)
    with open(answer, "x", encoding="utf-8") as f:  # a new file: nothing the agent left stands in for it
        json.dump(result, f)
