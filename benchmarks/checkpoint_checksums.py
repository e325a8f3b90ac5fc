"""What proving a checkpoint's files costs: the checksums this machine can take, and a save with and without them.

1. Throughput of each candidate checksum (standard library and installed) over 256 MiB in memory, 1 MiB at a time.
2. Each of Nanotron's writers of a checkpoint file (a weight through safetensors' ``save_file``, an optimizer state
   through ``torch.save``), writing about ``--mib`` MiB: alone; hashed as written, the way the launcher saves
   (:class:`nanotron_ext.integration.checkpoint_io.SaveRecorder`); and written, then read back and hashed (what
   hashing afterwards would cost; the read comes from the page cache here, so on storage it costs more). Each
   variant runs in a fresh process: wall time (median of ``--repeats``) and the process's peak resident memory
   above that of the same process before it wrote. safetensors writes from Rust straight to the path, so no byte
   of ``save_file`` can be hashed on its way: the launcher streams the same format from the tensor's memory
   (:mod:`nanotron_ext.checkpoint.safetensors_writer`); the other way, safetensors' own ``save``, which returns the
   file as bytes that are then hashed as written, is measured beside it.
3. Verification: :func:`nanotron_ext.checkpoint.digest.file_checksum` of the written file (page cache warm).

``--dir /dev/shm`` writes to memory (tmpfs), leaving out the disk: what the hashing itself costs.

Usage: ``python benchmarks/checkpoint_checksums.py [--mib 256] [--repeats 5] [--dir DIR]``
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
import zlib
from collections.abc import Callable
from pathlib import Path

from _common import print_command

from nanotron_ext.report import table

CHUNK = 1 << 20


def _throughputs(total: int) -> list[list[str]]:
    import xxhash

    data = os.urandom(total)
    view = memoryview(data)

    def running(new: Callable[[], object]) -> Callable[[], None]:
        def run() -> None:
            h = new()
            for i in range(0, total, CHUNK):
                h.update(view[i : i + CHUNK])  # type: ignore[attr-defined]

        return run

    def crc32() -> None:
        c = 0
        for i in range(0, total, CHUNK):
            c = zlib.crc32(view[i : i + CHUNK], c)

    candidates = {
        "sha256 (hashlib)": running(hashlib.sha256),
        "blake2b (hashlib)": running(hashlib.blake2b),
        "md5 (hashlib)": running(hashlib.md5),
        "crc32 (zlib)": crc32,
        "xxh3_128 (xxhash)": running(xxhash.xxh3_128),
        "xxh3_64 (xxhash)": running(xxhash.xxh3_64),
    }
    rows = []
    for name, run in candidates.items():
        best = min(_timed(run) for _ in range(3))
        rows.append([name, f"{total / best / 1e9:.2f}"])
    return rows


def _timed(run: Callable[[], None]) -> float:
    start = time.perf_counter()
    run()
    return time.perf_counter() - start


#: One variant, run in a fresh process: prints {"seconds": ..., "extra_rss_mib": ...}.
CHILD = r"""
import json, resource, sys, time, io
from pathlib import Path
import torch
from nanotron_ext.checkpoint.digest import file_checksum
from nanotron_ext.integration.checkpoint_io import SaveRecorder
from safetensors.torch import save_file
kind, how, path, mib = sys.argv[1], sys.argv[2], Path(sys.argv[3]), int(sys.argv[4])
n = mib * 2**20 // 4
if kind == "weight":
    obj = {"data": torch.randn(n)}
else:
    obj = {"state": {0: {"exp_avg": torch.randn(n // 2), "exp_avg_sq": torch.randn(n // 2)}}, "names": {0: "w"}}
before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
start = time.perf_counter()
if how == "alone":
    save_file(obj, str(path)) if kind == "weight" else torch.save(obj, path)
elif how == "safetensors save(), its bytes hashed as written":
    from safetensors.torch import save
    with SaveRecorder(path.parent).writer(path) as out:
        out.write(save(obj))
elif how == "hashed as written":
    recorder = SaveRecorder(path.parent)
    recorder.save_safetensors(obj, path, None) if kind == "weight" else recorder._torch_save(torch.save)(obj, path)
else:
    save_file(obj, str(path)) if kind == "weight" else torch.save(obj, path)
    file_checksum(path, "xxh3_64:")
seconds = time.perf_counter() - start
extra = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before
start = time.perf_counter()
file_checksum(path, "xxh3_64:")
verify = time.perf_counter() - start
print(json.dumps({"seconds": seconds, "extra_rss_mib": extra / 1024, "size": path.stat().st_size,
                  "verify": verify}))
"""


def _variant(kind: str, how: str, folder: Path, mib: int) -> dict[str, float]:
    path = folder / ("w.safetensors" if kind == "weight" else "o.pt")
    path.unlink(missing_ok=True)
    out = subprocess.run(
        [sys.executable, "-c", CHILD, kind, how, str(path), str(mib)], check=True, capture_output=True, text=True
    )
    return json.loads(out.stdout)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--mib", type=int, default=256, help="size of each file written (MiB)")
    parser.add_argument("--repeats", type=int, default=5, help="runs of each variant (the median is printed)")
    parser.add_argument("--dir", default=None, help="where the files are written (default: a temporary folder)")
    args = parser.parse_args(argv)
    print_command(argv)
    print(f"\n## Checksums over {args.mib} MiB in memory (best of 3)\n")
    print(table(["checksum", "GB/s"], _throughputs(args.mib * 2**20)))
    where = args.dir or tempfile.gettempdir()
    print(f"\n## Writing one {args.mib} MiB file into {where} (median of {args.repeats} fresh processes)\n")
    rows = []
    with tempfile.TemporaryDirectory(dir=args.dir) as tmp:
        for kind, writer in (("weight", "safetensors save_file"), ("optimizer state", "torch.save")):
            base = None
            hows = ["alone", "hashed as written", "written, then read back and hashed"]
            if kind == "weight":
                hows.insert(2, "safetensors save(), its bytes hashed as written")
            for how in hows:
                runs = [_variant(kind, how, Path(tmp), args.mib) for _ in range(args.repeats)]
                seconds = statistics.median(r["seconds"] for r in runs)
                base = seconds if base is None else base
                rows.append(
                    [
                        writer,
                        how,
                        f"{seconds:.3f}",
                        f"{seconds / base:.2f}",
                        f"{statistics.median(r['extra_rss_mib'] for r in runs):.0f}",
                        f"{runs[0]['size'] / 2**20 / statistics.median(r['verify'] for r in runs):.0f}",
                    ]
                )
    print(table(["writer", "how", "seconds", "÷ alone", "extra peak RSS (MiB)", "verify (MiB/s)"], rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
