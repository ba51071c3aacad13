"""Trim a NIXL wheel to the files its UCX backend loads, so the GPU machine's one call carries it.

`python bench/nixl_trim.py --out DIR SOURCE...` writes one trimmed wheel per NIXL
distribution found in the sources: a `.whl` (nixl-cuN or the `nixl` meta-package), or a
site-packages folder where they are installed (`nixl_cuN`, `nixl_cuN.libs`,
`.nixl_cuN.mesonpy.libs`, `nixl`). Standard library only (Python 3.11 and 3.12).

What is kept: the Python packages `nixl_cuN` (with its `_bindings`/`_utils` extension
modules) and `nixl` (with `nixl_meta_utils.py`), the dist-info (RECORD rewritten), and the
ELF files reachable through DT_NEEDED from the roots below; everything else is dropped
(the other NIXL plugins, nixl_ep, the headers, the scripts, and the libraries only they
need). The roots are what is dlopen'ed rather than linked, so no DT_NEEDED names them:

    the extension modules           imported by Python
    libplugin_UCX*.so               NIXL's UCX plugin (found next to libnixl.so/plugins)
    <libs>/ucx/libuct_cma, libuct_xpmem, libuct_knem, libuct_cuda*, libucm_cuda
                                    UCX's modules for sm (cma...), cuda_copy, cuda_ipc
                                    and the CUDA memory hooks; tcp, self and sm's posix
                                    and sysv are inside libuct itself

libnixl.so links gRPC and etcd-cpp (with protobuf, abseil, upb, re2), so those stay.

The output is a wheel rather than a tarball: bench/device_check.sh already pip-installs
every carried wheel into its site folder, pip keeps the layout the libraries' $ORIGIN
run paths expect, and the installed copy is a normal distribution (RECORD and metadata).
"""

from __future__ import annotations

import argparse
import base64
import csv
import hashlib
import io
import os
import posixpath
import re
import struct
import sys
import zipfile
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path

DIST_NAME = re.compile(r"nixl(_cu\d+)?")
# Files kept whole: the package folders (not their __pycache__) and the meta's helper.
PACKAGE_FILE = re.compile(r"(nixl|nixl_cu\d+)/[^/]+|nixl_meta_utils\.py")
UCX_PLUGIN = re.compile(r"(.*/)?libplugin_UCX[^/]*\.so")
UCX_MODULE = re.compile(r"(.*/)?ucx/lib(uct_(cma|xpmem|knem|cuda(_\w+)?)|ucm_cuda)\.so[.\d]*")
# Written by the installer, not part of a wheel; RECORD is written anew.
INSTALLER_FILES = frozenset({"RECORD", "INSTALLER", "REQUESTED", "direct_url.json"})
# One fixed time for every member: the same input gives the same bytes.
ZIP_TIME = (2020, 1, 1, 0, 0, 0)
MIB = 1024 * 1024
REPORT_MIN_SIZE = MIB // 4


class TrimError(Exception):
    """The sources hold no NIXL distribution, or one lacks what the UCX path loads."""


@dataclass(frozen=True)
class Dynamic:
    """What an ELF file's dynamic section asks of the loader."""

    needed: tuple[str, ...]
    search_path: tuple[str, ...]  # DT_RUNPATH, else DT_RPATH, still holding $ORIGIN


def read_dynamic(data: bytes) -> Dynamic | None:
    """DT_NEEDED and the run path of an ELF file; None when `data` is no dynamic ELF."""
    if len(data) < 52 or data[:4] != b"\x7fELF" or data[4] not in (1, 2) or data[5] not in (1, 2):
        return None
    is_64 = data[4] == 2
    end = "<" if data[5] == 1 else ">"
    if is_64:
        (phoff,) = struct.unpack_from(end + "Q", data, 0x20)
        phentsize, phnum = struct.unpack_from(end + "HH", data, 0x36)
        phdr, dyn = end + "IIQQQQQQ", end + "qQ"
    else:
        (phoff,) = struct.unpack_from(end + "I", data, 0x1C)
        phentsize, phnum = struct.unpack_from(end + "HH", data, 0x2A)
        phdr, dyn = end + "IIIIIIII", end + "iI"
    loads: list[tuple[int, int, int]] = []  # (vaddr, filesz, offset)
    dynamic: tuple[int, int] | None = None  # (offset, filesz)
    for i in range(phnum):
        fields = struct.unpack_from(phdr, data, phoff + i * phentsize)
        if is_64:
            p_type, _, p_offset, p_vaddr, _, p_filesz = fields[:6]
        else:
            p_type, p_offset, p_vaddr, _, p_filesz = fields[:5]
        if p_type == 1:  # PT_LOAD
            loads.append((p_vaddr, p_filesz, p_offset))
        elif p_type == 2:  # PT_DYNAMIC
            dynamic = (p_offset, p_filesz)
    if dynamic is None:
        return None
    tags: dict[int, list[int]] = {}
    step = struct.calcsize(dyn)
    for at in range(dynamic[0], dynamic[0] + dynamic[1] - step + 1, step):
        tag, value = struct.unpack_from(dyn, data, at)
        if tag == 0:  # DT_NULL
            break
        tags.setdefault(tag, []).append(value)
    base = _file_offset(loads, tags[5][0]) if 5 in tags else None  # DT_STRTAB, an address
    if base is None:
        return Dynamic((), ())

    def string(offset: int) -> str:
        stop = data.index(b"\0", base + offset)
        return data[base + offset : stop].decode("utf-8", "replace")

    paths = tags.get(29) or tags.get(15) or []  # DT_RUNPATH wins over DT_RPATH
    search = tuple(p for v in paths for p in string(v).split(":") if p)
    return Dynamic(tuple(string(v) for v in tags.get(1, [])), search)


def _file_offset(loads: list[tuple[int, int, int]], address: int) -> int | None:
    """Where the byte the loader maps at `address` lies in the file (PT_LOAD segments)."""
    for vaddr, filesz, offset in loads:
        if vaddr <= address < vaddr + filesz:
            return offset + address - vaddr
    return None


@dataclass(frozen=True)
class Member:
    """One file of a distribution: its path inside the wheel, size, mode and reader."""

    path: str
    size: int
    mode: int
    read: Callable[[], bytes]


@dataclass(frozen=True)
class Dist:
    """A distribution to trim: its files by wheel path, and the wheel name it came as."""

    name: str
    dist_info: str
    wheel_name: str
    source_size: int
    members: dict[str, Member]


def _wheel_tag(wheel_text: str) -> str:
    """The compressed tag set of a WHEEL file's Tag lines (py3-none-any, cp312-cp312-...)."""
    tags = [
        line.split(":", 1)[1].strip().split("-")
        for line in wheel_text.splitlines()
        if line.startswith("Tag:")
    ]
    if not tags:
        raise TrimError("WHEEL names no Tag")
    parts = [list(dict.fromkeys(t[i] for t in tags)) for i in range(3)]
    return "-".join(".".join(p) for p in parts)


def read_wheel(path: Path) -> Dist:
    """A distribution from its wheel file; members are read from the zip when needed."""
    with zipfile.ZipFile(path) as wheel:
        infos = [i for i in wheel.infolist() if not i.is_dir()]
    dist_info = next(
        (
            i.filename.split("/")[0]
            for i in infos
            if re.fullmatch(r"[^/]+\.dist-info/WHEEL", i.filename)
        ),
        None,
    )
    if dist_info is None:
        raise TrimError(f"{path}: no *.dist-info/WHEEL, not a wheel")

    def reader(name: str) -> Callable[[], bytes]:
        def read() -> bytes:
            with zipfile.ZipFile(path) as wheel:
                return wheel.read(name)

        return read

    members = {
        i.filename: Member(
            i.filename, i.file_size, (i.external_attr >> 16) & 0o777 or 0o644, reader(i.filename)
        )
        for i in infos
    }
    name = dist_info.split("-")[0]
    return Dist(name, dist_info, path.name, path.stat().st_size, members)


def read_installed(site: Path, dist_info: str) -> Dist:
    """A distribution installed in `site`, from its RECORD; files outside `site` are left."""
    record = (site / dist_info / "RECORD").read_text()
    members: dict[str, Member] = {}
    for row in csv.reader(io.StringIO(record)):
        if not row or row[0].startswith("../") or "__pycache__/" in row[0]:
            continue
        file = site / row[0]
        if not file.is_file():
            continue
        stat = file.stat()
        members[row[0]] = Member(row[0], stat.st_size, stat.st_mode & 0o777, file.read_bytes)
    name, version = dist_info.removesuffix(".dist-info").split("-")[:2]
    tag = _wheel_tag((site / dist_info / "WHEEL").read_text())
    size = sum(m.size for m in members.values())
    return Dist(name, dist_info, f"{name}-{version}-{tag}.whl", size, members)


def find_dists(source: Path) -> list[Dist]:
    """The NIXL distributions in a wheel file or a site-packages folder."""
    if source.is_file():
        dists = [read_wheel(source)]
    elif source.is_dir():
        infos = sorted(p.name for p in source.glob("*.dist-info") if (p / "RECORD").is_file())
        dists = [read_installed(source, d) for d in infos]
    else:
        raise TrimError(f"{source}: no such wheel or folder")
    return [d for d in dists if DIST_NAME.fullmatch(d.name)]


def _is_root(path: str) -> bool:
    return bool(UCX_PLUGIN.fullmatch(path) or UCX_MODULE.fullmatch(path))


def _resolve(name: str, origin: str, search: Iterable[str], paths: set[str]) -> str | None:
    """The member the loader finds for DT_NEEDED `name` of the member at `origin`, if any.

    The run path first ($ORIGIN is the member's folder); then any member of that file name,
    as the loader reuses a library of that name already loaded by another (a plugin
    needing libnixl_common.so, which libnixl.so brought in from its own folder).
    """
    folder = posixpath.dirname(origin)
    for entry in search:
        expanded = entry.replace("${ORIGIN}", folder).replace("$ORIGIN", folder)
        candidate = posixpath.normpath(posixpath.join(expanded, name))
        if candidate in paths:
            return candidate
    return next((p for p in sorted(paths) if posixpath.basename(p) == name), None)


def select(dist: Dist) -> set[str]:
    """The members to keep: package files, dist-info, the roots and their DT_NEEDED closure."""
    paths = set(dist.members)
    keep = {p for p in paths if PACKAGE_FILE.fullmatch(p)}
    keep |= {
        p
        for p in paths
        if p.startswith(dist.dist_info + "/") and posixpath.basename(p) not in INSTALLER_FILES
    }
    todo = sorted(p for p in paths if _is_root(p) or (p in keep and ".so" in posixpath.basename(p)))
    keep |= set(todo)
    while todo:
        path = todo.pop()
        dynamic = read_dynamic(dist.members[path].read())
        if dynamic is None:
            continue
        for name in dynamic.needed:
            found = _resolve(name, path, dynamic.search_path, paths)
            if found is not None and found not in keep:
                keep.add(found)
                todo.append(found)
    if dist.name != "nixl":
        _check_roots(dist, keep)
    return keep


def _check_roots(dist: Dist, keep: set[str]) -> None:
    missing = [
        what
        for what, pattern in (
            ("the _bindings module", r".*/_bindings[^/]*\.so"),
            ("libplugin_UCX", UCX_PLUGIN.pattern),
        )
        if not any(re.fullmatch(pattern, p) for p in keep)
    ]
    if missing:
        raise TrimError(f"{dist.wheel_name}: no {' or '.join(missing)} in the source")


def _record_hash(data: bytes) -> str:
    digest = base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=")
    return "sha256=" + digest.decode()


def write_wheel(dist: Dist, keep: set[str], out_dir: Path) -> Path:
    """Write the kept members as a wheel in `out_dir` (RECORD rewritten); return its path."""
    out_dir.mkdir(parents=True, exist_ok=True)
    target = out_dir / dist.wheel_name
    partial = target.with_suffix(".whl.part")
    record = io.StringIO()
    rows = csv.writer(record, lineterminator="\n")
    # The dist-info goes last, as wheels order it; RECORD is its last member.
    order = sorted(keep, key=lambda p: (p.startswith(dist.dist_info + "/"), p))
    with zipfile.ZipFile(partial, "w", zipfile.ZIP_DEFLATED) as wheel:
        for path in order:
            data = dist.members[path].read()
            info = zipfile.ZipInfo(path, ZIP_TIME)
            info.external_attr = (0o100000 | dist.members[path].mode) << 16
            info.compress_type = zipfile.ZIP_DEFLATED
            wheel.writestr(info, data)
            rows.writerow([path, _record_hash(data), len(data)])
        rows.writerow([f"{dist.dist_info}/RECORD", "", ""])
        info = zipfile.ZipInfo(f"{dist.dist_info}/RECORD", ZIP_TIME)
        info.external_attr = 0o100644 << 16
        wheel.writestr(info, record.getvalue(), zipfile.ZIP_DEFLATED)
    os.replace(partial, target)
    return target


@dataclass(frozen=True)
class TrimResult:
    """One trimmed distribution: where it went, the sizes, and what was left out."""

    wheel: Path
    source_size: int  # the input wheel's bytes, or the installed files' for a folder
    trimmed_size: int  # the trimmed wheel's bytes
    kept: tuple[Member, ...]
    dropped: tuple[Member, ...]


def trim(sources: Iterable[Path], out_dir: Path) -> list[TrimResult]:
    """Trim every NIXL distribution in `sources` into wheels in `out_dir`."""
    results = []
    for source in sources:
        for dist in find_dists(source):
            keep = select(dist)
            wheel = write_wheel(dist, keep, out_dir)
            members = sorted(dist.members.items())
            kept = tuple(m for p, m in members if p in keep)
            # The installer's own files are not dropped content (RECORD is written anew).
            dropped = tuple(
                m
                for p, m in members
                if p not in keep
                and not (
                    p.startswith(dist.dist_info + "/") and posixpath.basename(p) in INSTALLER_FILES
                )
            )
            results.append(TrimResult(wheel, dist.source_size, wheel.stat().st_size, kept, dropped))
    if not results:
        raise TrimError("no NIXL distribution (nixl, nixl_cuN) in " + ", ".join(map(str, sources)))
    return results


def _mib(size: int) -> str:
    return f"{size / MIB:7.2f} MiB"


def report(result: TrimResult) -> str:
    """What a trim did, for a person: sizes, then the dropped files by size."""
    kept = sum(m.size for m in result.kept)
    lines = [
        f"{result.wheel.name}: {_mib(result.source_size)} -> {_mib(result.trimmed_size)} "
        f"({len(result.kept)} files kept, {_mib(kept).strip()} unpacked; "
        f"{len(result.dropped)} dropped)"
    ]
    # Libraries one by one; other files (headers, scripts) by their top folder, `.data/x` by
    # its second; what weighs under REPORT_MIN_SIZE in all as one line.
    groups: dict[str, list[Member]] = {}
    for member in result.dropped:
        parts = member.path.split("/")
        depth = 2 if parts[0].endswith(".data") else 1
        is_single = ".so" in parts[-1] or len(parts) <= depth
        key = member.path if is_single else "/".join(parts[:depth]) + "/"
        groups.setdefault(key, []).append(member)
    small: list[Member] = []
    for name, members in sorted(groups.items(), key=lambda g: -sum(m.size for m in g[1])):
        size = sum(m.size for m in members)
        if size < REPORT_MIN_SIZE:
            small += members
            continue
        count = f" ({len(members)} files)" if len(members) > 1 else ""
        lines.append(f"  dropped {_mib(size)}  {name}{count}")
    if small:
        size = sum(m.size for m in small)
        lines.append(f"  dropped {_mib(size)}  {len(small)} smaller files")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="nixl_trim.py", description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True, help="folder for the trimmed wheels")
    parser.add_argument("--quiet", action="store_true", help="print only the size lines")
    parser.add_argument(
        "sources", type=Path, nargs="+", help="NIXL wheels or site-packages folders"
    )
    args = parser.parse_args(argv)
    try:
        results = trim(args.sources, args.out)
    except (TrimError, OSError, zipfile.BadZipFile) as exc:
        print(f"nixl_trim.py: error: {exc}", file=sys.stderr)
        return 2
    for result in results:
        text = report(result)
        print(text.splitlines()[0] if args.quiet else text)
    before = sum(r.source_size for r in results)
    after = sum(r.trimmed_size for r in results)
    print(f"total: {_mib(before)} -> {_mib(after)} in {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
