"""Triton's compiled kernels, carried from one device call to the next.

A fresh device machine compiles every kernel that the tests and benchmarks launch, minutes
of a 10-minute call. gpu_run.sh points Triton's cache at a fixed folder (Triton's group
files name their members by absolute path) with TRITON_STORE_BINARY_ONLY=1 (binaries
and metadata, no IR), restores the last call's archive there before the stages and saves
the cache into $OUT/ARCHIVE after them. Copy that file into .gpu_cache/ (ignored by git)
and carry the folder with the next call. A changed kernel has a new key and compiles
again; the archive only saves the compile. A compile's IR (the `.source` Triton stores
whatever that setting says, 38% of the bytes, and the stages' IR of compiles run without
it) stays out of the archive, and the group file that lists the compile's files is
rewritten to match: a cache hit loads the binary and its metadata only, and xz's time
goes with the bytes (~70 s for a 310 MB cache on one core).

  python -m benchmarks.kernel_cache restore .gpu_cache/triton_cache.tar.xz /tmp/dir
  python -m benchmarks.kernel_cache save /tmp/dir $OUT/triton_cache.tar.xz [--max-mib 15]
"""

import argparse
import io
import json
import os
import tarfile

ARCHIVE = "triton_cache.tar.xz"
MAX_MIB = 15  # a file back from the device may hold 16 MiB
KEPT = (".cubin", ".hsaco", ".json")  # what a cache hit reads of a compile's files
GROUP = "__grp__"  # the prefix of the file naming a compile's files (Triton's FileCacheManager)


def _entries_newest_first(cache_dir: str) -> list[str]:
    """Triton's cache entries (a folder per compile key), the most recently written first."""
    def newest(entry: str) -> float:
        folder = os.path.join(cache_dir, entry)
        return max((os.path.getmtime(os.path.join(folder, f)) for f in os.listdir(folder)),
                   default=os.path.getmtime(folder))

    entries = [e for e in os.listdir(cache_dir) if os.path.isdir(os.path.join(cache_dir, e))]
    return sorted(entries, key=newest, reverse=True)


def _archive(cache_dir: str, entries: list[str]) -> bytes:
    buffer = io.BytesIO()
    with tarfile.open(fileobj=buffer, mode="w:xz") as tar:
        for entry in entries:
            _add_entry(tar, os.path.join(cache_dir, entry), entry)
    return buffer.getvalue()


def _add_entry(tar: tarfile.TarFile, folder: str, entry: str) -> None:
    """One cache entry: a compile's binary and metadata (its IR left out, its group file
    rewritten to list what is kept); an entry without a group file (a launcher's build)
    whole."""
    names = sorted(os.listdir(folder))
    tar.add(folder, arcname=entry, recursive=False)
    dropped = set()
    for name in filter(_is_group, names):
        with open(os.path.join(folder, name)) as f:
            group = json.load(f)
        children = group.get("child_paths", {})
        dropped |= {child for child in children if not child.endswith(KEPT)}
        group["child_paths"] = {child: path for child, path in children.items() if child not in dropped}
        data = json.dumps(group).encode()
        info = tar.gettarinfo(os.path.join(folder, name), arcname=f"{entry}/{name}")
        info.size = len(data)
        tar.addfile(info, io.BytesIO(data))
    for name in names:
        if name not in dropped and not _is_group(name):
            tar.add(os.path.join(folder, name), arcname=f"{entry}/{name}")


def _is_group(name: str) -> bool:
    return name.startswith(GROUP) and name.endswith(".json")


def save(cache_dir: str, archive: str, max_mib: float = MAX_MIB) -> list[str]:
    """Write the newest entries of `cache_dir` that fit in `max_mib` compressed into
    `archive` (each try drops the oldest quarter). Returns the entries written."""
    entries = _entries_newest_first(cache_dir)
    while entries:
        data = _archive(cache_dir, entries)
        if len(data) <= max_mib * 2**20:
            with open(archive, "wb") as f:
                f.write(data)
            return entries
        entries = entries[:len(entries) * 3 // 4]
    return []


def restore(archive: str, cache_dir: str) -> int:
    """Unpack `archive` into `cache_dir`; returns the entries it held."""
    os.makedirs(cache_dir, exist_ok=True)
    with tarfile.open(archive, mode="r:xz") as tar:
        tar.extractall(cache_dir, filter="data")
        return len({member.name.split("/")[0] for member in tar.getmembers()})


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    commands = parser.add_subparsers(dest="command", required=True)
    restoring = commands.add_parser("restore", help="unpack an archive into a cache folder")
    restoring.add_argument("archive")
    restoring.add_argument("cache_dir")
    saving = commands.add_parser("save", help="pack a cache folder's newest entries")
    saving.add_argument("cache_dir")
    saving.add_argument("archive")
    saving.add_argument("--max-mib", type=float, default=MAX_MIB)
    args = parser.parse_args(argv)
    if args.command == "restore":
        print(f"kernel cache: {restore(args.archive, args.cache_dir)} entries restored into {args.cache_dir}")
        return
    total = len(_entries_newest_first(args.cache_dir))
    kept = save(args.cache_dir, args.archive, args.max_mib)
    print(f"kernel cache: {len(kept)} of {total} entries saved into {args.archive}")


if __name__ == "__main__":
    main()
