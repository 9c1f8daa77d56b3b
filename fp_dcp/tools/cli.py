"""fp-dcp: look into, check and convert fp_dcp checkpoints (also python -m fp_dcp).

commands:
  fp-dcp inspect CKPT [--json]            format, tensors, chunks, files
  fp-dcp verify CKPT [--json]             read every byte, check every checksum
  fp-dcp convert CKPT model.pt            one consolidated torch.save file
  fp-dcp convert CKPT model.safetensors   one safetensors file (tensors only)
  fp-dcp convert --to-dcp CKPT OUT_DIR    a stock torch.distributed.checkpoint
  fp-dcp convert --from-dcp DCP_DIR OUT   a stock DCP checkpoint into fp_dcp
  fp-dcp export-hf CKPT OUT_DIR           Hugging Face layout: safetensors shards + index
  fp-dcp tune DIR [--dry-run] [--json]    measure the disk under DIR, record request sizes for it
  fp-dcp COMMAND --help                   the options of one command

CKPT is the directory a save wrote into (it holds .fp_dcp.meta).

exit codes:
  0    success (verify: every byte read and every checksum matched)
  1    failure: a path that is not what the command needs, a damaged
       checkpoint, an I/O error (the message names the file and the fix)
  2    usage error (unknown command or option, missing argument)
  130  interrupted (Ctrl-C)

Progress of long operations goes to stderr; -q (any command) turns it off.
"""

from __future__ import annotations

import argparse
import datetime as _dt
import json
import logging
import os
import re
import sys
from typing import Any, Sequence

from fp_dcp.options import format_size, plural

# torch (and the modules that import it) are imported by the commands that
# need them, never at start-up: `fp-dcp --help` and usage errors answer at
# once.

__all__ = ["main", "PathProblem", "checkpoint_kind"]

# = fp_dcp.format.METADATA_NAME / STOCK_METADATA_NAME / DATA_SUFFIX, spelled
# here so that telling what a path is needs no torch (tests check they agree)
META_NAME = ".fp_dcp.meta"
STOCK_META_NAME = ".metadata"
DATA_SUFFIX = ".fpd"

_SUFFIXES = {".pt": "torch", ".pth": "torch", ".bin": "torch", ".ckpt": "torch", ".safetensors": "safetensors"}
_TARGETS = ("torch", "safetensors", "dcp", "fp_dcp")
_LIST_MAX = 8


class PathProblem(Exception):
    """A path that is not what a command needs; the message says what was
    expected, what is there, and what to do."""



# ------------------------------------------------------------------ what is this path


def checkpoint_kind(path: str) -> str:
    """``"fp_dcp"`` (a committed fp_dcp checkpoint directory), ``"dcp"`` (a
    stock DCP checkpoint directory) or ``"file"``; anything else raises
    :class:`PathProblem` saying what the path is."""
    if os.path.isdir(path):
        if os.path.isfile(os.path.join(path, META_NAME)):
            return "fp_dcp"
        if os.path.isfile(os.path.join(path, STOCK_META_NAME)):
            return "dcp"
        raise PathProblem(_not_a_checkpoint(path))
    if os.path.isfile(path):
        return "file"
    if os.path.lexists(path):
        raise PathProblem(f"{path}: neither a directory nor a regular file; expected a checkpoint directory")
    parent = os.path.dirname(os.path.abspath(path))
    hint = ""
    if os.path.isdir(parent):
        near = _checkpoints_in(parent)
        if near:
            hint = f"; checkpoints in {parent}: " + _names(near)
    raise PathProblem(f"{path}: no checkpoint directory here (nothing exists at this path){hint}")


def _checkpoints_in(directory: str) -> list[tuple[str, str]]:
    """(name, kind) of the checkpoint directories directly inside ``directory``."""
    found = []
    try:
        entries = sorted(os.scandir(directory), key=lambda e: _natural(e.name))
    except OSError:
        return []
    for e in entries:
        try:
            if not e.is_dir():
                continue
        except OSError:
            continue
        if os.path.isfile(os.path.join(e.path, META_NAME)):
            found.append((e.name, "fp_dcp"))
        elif os.path.isfile(os.path.join(e.path, STOCK_META_NAME)):
            found.append((e.name, "dcp"))
    return found


def _natural(name: str) -> list[Any]:
    """step9 before step10."""
    return [int(p) if p.isdigit() else p for p in re.split(r"(\d+)", name)]


def _names(found: list[tuple[str, str]]) -> str:
    shown = [n + ("" if k == "fp_dcp" else " (stock DCP)") for n, k in found[:_LIST_MAX]]
    more = f" and {len(found) - _LIST_MAX} more" if len(found) > _LIST_MAX else ""
    return ", ".join(shown) + more


def _not_a_checkpoint(path: str) -> str:
    found = _checkpoints_in(path)
    if found:
        own = [n for n, k in found if k == "fp_dcp"]
        last = os.path.join(path, (own or [found[-1][0]])[-1])
        return (f"{path}: not a checkpoint itself, but a directory holding {plural(len(found), 'checkpoint')} "
                f"one level down: {_names(found)}; give one of them, e.g. {last}")
    try:
        names = os.listdir(path)
    except OSError as e:
        return f"{path}: cannot list the directory ({e.strerror})"
    if any(n.endswith(DATA_SUFFIX) for n in names):
        return (f"{path}: fp_dcp data files but no {META_NAME}: a save was interrupted before its commit, "
                f"so this is not a checkpoint (the previous one, if any, is intact where it was)")
    what = "an empty directory" if not names else f"a directory of {plural(len(names), 'entry', 'entries')}"
    return (f"{path}: {what}, not a checkpoint: expected {META_NAME} (fp_dcp) or {STOCK_META_NAME} "
            f"(stock DCP) in it, or checkpoint directories one level down")


def _fp_dcp_checkpoint(path: str, command: str) -> None:
    """Raise :class:`PathProblem` unless ``path`` is an fp_dcp checkpoint."""
    kind = checkpoint_kind(path)
    if kind == "dcp":
        raise PathProblem(
            f"{path}: a stock torch.distributed.checkpoint checkpoint ({STOCK_META_NAME}), not an fp_dcp one; "
            f"fp-dcp {command} reads fp_dcp checkpoints: convert it once with "
            f"fp-dcp convert --from-dcp {path} OUT (or load it with FileSystemReader)"
        )
    if kind == "file":
        hint = ""
        if os.path.splitext(path)[1].lower() in _SUFFIXES:
            hint = f" (to turn a torch.save file into a checkpoint: fp-dcp convert {path} OUT --to fp_dcp)"
        raise PathProblem(
            f"{path}: a plain file, not a checkpoint directory; fp-dcp {command} expects the directory "
            f"a save wrote into (it holds {META_NAME}){hint}"
        )


# ------------------------------------------------------------------ inspect


def _inspect(args: argparse.Namespace) -> int:
    _fp_dcp_checkpoint(args.path, "inspect")
    from fp_dcp.tools import convert

    d = convert.describe(args.path)
    if args.json:
        print(json.dumps(d, indent=1))
        return 0
    created = _dt.datetime.fromtimestamp(d["created"]).isoformat(" ", "seconds") if d["created"] else "?"
    print(f"{d['path']}")
    print(f"  format {d['format']} version {d['format_version']}, written by {d['writer']} "
          f"(torch {d['torch_version']}) on {plural(d['world_size'] or 0, 'rank')} at {created}; "
          f"save {d['save_id']}")
    ck = d["checksum_block_bytes"]
    print(f"  alignment {d['alignment']} B; checksums: "
          + (f"CRC-32C per {format_size(ck)} block" if ck else "none"))
    print(f"  {plural(len(d['tensors']), 'tensor')} ({format_size(d['tensor_bytes'])}), "
          f"{plural(len(d['objects']), 'other item')}, "
          f"{plural(len(d['files']), 'data file')} ({format_size(d['file_bytes'])})")
    if d["tensors"]:
        print()
        rows: list[tuple[str, ...]] = [("tensor", "dtype", "shape", "chunks", "bytes", "files")]
        for t in d["tensors"]:
            rows.append((t["name"], t["dtype"], "x".join(map(str, t["shape"])) or "()", str(len(t["chunks"])),
                         format_size(t["bytes"]), ",".join(map(str, t["files"]))))
        _table(rows)
    if d["objects"]:
        print()
        _table([("other item", "bytes", "files")]
               + [(o["name"], format_size(o["bytes"]), ",".join(map(str, o["files"]))) for o in d["objects"]])
    if args.chunks:
        print()
        for t in d["tensors"]:
            for c in t["chunks"]:
                print(f"  {t['name']} chunk at {c['offsets']} size {c['sizes']}")
    print()
    _table([("file", "name", "size")] + [(str(f["index"]), f["name"], format_size(f["size"])) for f in d["files"]])
    return 0


def _table(rows: list[tuple[str, ...]]) -> None:
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    for k, r in enumerate(rows):
        print("  " + "  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip())
        if k == 0:
            print("  " + "  ".join("-" * w for w in widths))


# ------------------------------------------------------------------ verify


def _verify(args: argparse.Namespace) -> int:
    _fp_dcp_checkpoint(args.path, "verify")
    from fp_dcp.tools import verify
    from fp_dcp.tools.convert import Progress

    progress = Progress("verifying", 0, enabled=not args.quiet)
    try:
        report = verify.verify_checkpoint(args.path, workers=args.workers, progress=progress.update)
    finally:
        progress.close()
    return verify.print_report(report, as_json=args.json)


# ------------------------------------------------------------------ convert


def _convert(args: argparse.Namespace) -> int:
    target = args.to
    if args.to_dcp:
        if target not in (None, "dcp"):
            raise PathProblem("--to-dcp and --to disagree; give one of them")
        target = "dcp"
    if args.from_dcp and target is None:
        target = "fp_dcp"
    if target is None:
        target = _SUFFIXES.get(os.path.splitext(args.output)[1].lower())
    if target is None:
        raise PathProblem(
            f"{args.output}: cannot tell the output format from its name; pass --to "
            f"{{{','.join(_TARGETS)}}} (or name it .pt / .safetensors)"
        )
    kind = checkpoint_kind(args.source)
    if args.from_dcp and kind != "dcp":
        raise PathProblem(
            f"{args.source}: --from-dcp needs a stock DCP checkpoint (a directory with {STOCK_META_NAME}); "
            f"this is {'an fp_dcp checkpoint' if kind == 'fp_dcp' else 'a plain file'}"
        )
    from fp_dcp.tools import convert

    kw = {"force": args.force, "progress": not args.quiet}
    if target == "torch":
        r = convert.to_torch_save(args.source, args.output, **kw)
    elif target == "safetensors":
        r = convert.to_safetensors(args.source, args.output, skip_unsupported=args.skip_unsupported, **kw)
        if r["skipped"]:
            print(f"note: safetensors holds tensors of its dtypes only; skipped {len(r['skipped'])} item(s): "
                  + ", ".join(r["skipped"][:8]) + (" ..." if len(r["skipped"]) > 8 else ""), file=sys.stderr)
    elif target == "dcp":
        r = convert.fp_dcp_to_dcp(args.source, args.output, **kw)
    else:
        r = convert.dcp_to_fp_dcp(args.source, args.output, **kw)
    if not args.quiet:
        print(f"wrote {r['output']} ({target}) in {r['seconds']:.2f} s", file=sys.stderr)
    return 0


# ------------------------------------------------------------------ export-hf


def _export_hf(args: argparse.Namespace) -> int:
    kind = checkpoint_kind(args.source)
    if kind == "file":
        raise PathProblem(f"{args.source}: a plain file; export-hf reads a checkpoint directory (fp_dcp or stock "
                          f"DCP): make one first with fp-dcp convert {args.source} DIR --to fp_dcp")
    from fp_dcp.tools import export_hf

    r = export_hf.export_hf(args.source, args.output, max_shard_size=args.max_shard_size, dtype=args.dtype,
                            strip_prefix=args.strip_prefix, overwrite=args.overwrite, progress=not args.quiet)
    if r["skipped"]:
        print(f"note: only tensors are exported; skipped {len(r['skipped'])} item(s): "
              + ", ".join(r["skipped"][:8]) + (" ..." if len(r["skipped"]) > 8 else ""), file=sys.stderr)
    if args.json:
        print(json.dumps(r, indent=1))
    elif not args.quiet:
        print(f"wrote {r['output']}: {plural(len(r['written']), 'file')}, {plural(r['tensors'], 'tensor')}, "
              f"{format_size(r['total_size'])} in {r['seconds']:.2f} s", file=sys.stderr)
    return 0


# ------------------------------------------------------------------ tune


def _tune(args: argparse.Namespace) -> int:
    from fp_dcp import tuning
    from fp_dcp.options import parse_size
    from fp_dcp.tools import tune
    from fp_dcp.tools.convert import Progress

    sizes, depths = tune.parse_grid(args.sizes, args.depths, args.quick)
    try:
        file_bytes = parse_size(args.file_size) if args.file_size else (
            tune.QUICK_FILE_BYTES if args.quick else tune.DEFAULT_FILE_BYTES)
        max_in_flight = parse_size(args.max_in_flight) if args.max_in_flight else tune.DEFAULT_MAX_IN_FLIGHT
    except ValueError as e:
        raise tune.TuneError(f"--file-size / --max-in-flight: {e}") from None
    repeat = args.repeat if args.repeat is not None else 1 if args.quick else tune.DEFAULT_REPEAT
    if file_bytes <= 0 or repeat < 1:
        raise tune.TuneError("--file-size and --repeat must be positive, e.g. --file-size 512MiB --repeat 3")
    target = None if args.dry_run else tuning.record_path()
    if not args.dry_run and target is None:
        raise tune.TuneError(f"{tuning.ENV}=none turns tuning records off: unset it (or set it to a file), "
                             f"or pass --dry-run to measure only")
    progress = Progress("measuring", 0, enabled=not args.quiet)
    try:
        result = tune.run(args.path, sizes=sizes, depths=depths, file_bytes=file_bytes, max_in_flight=max_in_flight,
                          repeat=repeat,
                          progress=progress.update)
    finally:
        progress.close()
    result["recorded"] = None if target is None else tune.record(args.path, result, target)
    if args.json:
        print(json.dumps(result, indent=1))
        return 0
    dev = result["device"]
    disk = ", ".join(f"{k} {dev[k]}" for k in ("disk", "model", "serial") if k in dev)
    print(f"{result['path']}: device {dev['dev']}" + (f" ({disk})" if disk else "")
          + f", {result['machine']['cpu']}, measured in {result['seconds']:.0f} s\n")
    print(tune.format_tables(result))
    if target is None:
        print("\n  --dry-run: nothing recorded")
    else:
        print(f"\n  recorded in {target}: saves and loads on this device use it unless queue_depth or "
              f"block_size_bytes are set ({tuning.ENV}=none turns records off)")
    return 0


# ------------------------------------------------------------------ main


def _parser() -> argparse.ArgumentParser:
    doc = __doc__ or ""
    p = argparse.ArgumentParser(prog="fp-dcp", description=doc.split("\n\n")[0],
                                epilog=doc.split("\n\n", 1)[1], formatter_class=argparse.RawDescriptionHelpFormatter)
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument("-q", "--quiet", action="store_true", help="no progress on stderr")
    sub = p.add_subparsers(dest="command", metavar="COMMAND")
    sub.required = True

    q = sub.add_parser("inspect", parents=[common], help="what a checkpoint holds: format, tensors, chunks, files",
                       description="Show what an fp_dcp checkpoint holds: its format, tensors, other items, "
                                   "stored chunks and data files. Reads the metadata only.")
    q.add_argument("path", help="fp_dcp checkpoint directory (the one holding .fp_dcp.meta)")
    q.add_argument("--json", action="store_true", help="print JSON instead of tables")
    q.add_argument("--chunks", action="store_true", help="also list every stored chunk")
    q.set_defaults(func=_inspect)

    v = sub.add_parser("verify", parents=[common], help="read every byte of a checkpoint and check its checksums",
                       description="Read every byte of an fp_dcp checkpoint and check every CRC-32C block "
                                   "against the checksums stored at save time. Lists every bad extent "
                                   "(tensor, file, offset) and every missing or truncated file. "
                                   "Exit code 0 when all is good, 1 otherwise.")
    v.add_argument("path", help="fp_dcp checkpoint directory (the one holding .fp_dcp.meta)")
    v.add_argument("--workers", type=int, default=None, help="reader threads (default: min(4, CPUs, files))")
    v.add_argument("--json", action="store_true", help="print the report as JSON")
    v.set_defaults(func=_verify)

    c = sub.add_parser("convert", parents=[common], help="to torch.save / safetensors / stock DCP, or from stock DCP",
                       description="Convert a checkpoint. The output format comes from --to, --to-dcp, "
                                   "--from-dcp (fp_dcp), or the output's suffix (.pt, .safetensors).")
    c.add_argument("source", help="fp_dcp or stock DCP checkpoint directory (or a torch.save file with --to fp_dcp)")
    c.add_argument("output", help="output file (torch.save, safetensors) or directory (DCP, fp_dcp)")
    c.add_argument("--to", choices=_TARGETS, help="output format")
    c.add_argument("--to-dcp", action="store_true", help="write a stock torch.distributed.checkpoint directory")
    c.add_argument("--from-dcp", action="store_true", help="read a stock DCP checkpoint, write fp_dcp (default)")
    c.add_argument("--force", action="store_true", help="replace an existing output")
    c.add_argument("--skip-unsupported", action="store_true",
                   help="safetensors: leave out tensors of dtypes it cannot hold (listed on stderr)")
    c.set_defaults(func=_convert)

    e = sub.add_parser("export-hf", parents=[common], help="Hugging Face layout: safetensors shards and their index",
                       description="Write a checkpoint's tensors (fp_dcp or stock DCP) as Hugging Face does: "
                                   "model-0000i-of-0000n.safetensors shards and model.safetensors.index.json "
                                   "(one model.safetensors when all fits in one shard), loadable by safetensors "
                                   "and transformers' from_pretrained. Items that are not tensors are skipped "
                                   "(listed on stderr). Parallel export across ranks: fp_dcp.export_hf(..., "
                                   "process_group=...).")
    e.add_argument("source", help="fp_dcp or stock DCP checkpoint directory")
    e.add_argument("output", help="output directory (created; an existing one must be empty unless --overwrite)")
    e.add_argument("--max-shard-size", default="5GB",
                   help="largest shard, as Hugging Face spells it: 5GB (10**9 bytes, the default), 500MB, 2GiB")
    e.add_argument("--dtype", choices=("bf16", "fp16", "fp32"), help="cast floating-point tensors (default: keep)")
    e.add_argument("--strip-prefix", help="remove this prefix from the keys that start with it (e.g. model.)")
    e.add_argument("--overwrite", action="store_true", help="replace the model files of an existing directory")
    e.add_argument("--json", action="store_true", help="print the result as JSON")
    e.set_defaults(func=_export_hf)

    t = sub.add_parser("tune", parents=[common], help="measure the disk under a directory, record request sizes for it",
                       description="Measure the file system under PATH with fp_dcp's engine (O_DIRECT write and "
                                   "cold read of a scratch file, a grid of request sizes x queue depths; about a "
                                   "minute by default), print the grid and the request size and depth chosen for "
                                   "writes and for reads, and record them for PATH's device in the per-user "
                                   "tuning file ($FP_DCP_TUNING_FILE, else ~/.cache/fp_dcp/tuning.json), where "
                                   "fp_dcp's writer and reader pick them up unless queue_depth or "
                                   "block_size_bytes are set.")
    t.add_argument("path", help="a directory on the file system to measure (the checkpoints' parent directory)")
    t.add_argument("--sizes", help="request sizes, comma-separated (default 256K,1M,4M,16M)")
    t.add_argument("--depths", help="queue depths, comma-separated (default 4,8,16,32)")
    t.add_argument("--file-size", help="bytes written and read per cell and round (default 512MiB)")
    t.add_argument("--repeat", type=int, default=None, help="rounds over the grid (default 3; --quick 1)")
    t.add_argument("--max-in-flight",
                   help="leave out cells with more bytes in flight than this (default 64MiB)")
    t.add_argument("--quick", action="store_true", help="a few seconds: 1M,4M requests x 8, 64 MiB, one round")
    t.add_argument("--dry-run", action="store_true", help="measure and print only; record nothing")
    t.add_argument("--json", action="store_true", help="print the measurements and the choice as JSON")
    t.set_defaults(func=_tune)
    return p


def _is_known(e: BaseException) -> bool:
    """An error whose message is written for people (printed alone)."""
    if isinstance(e, PathProblem):
        return True
    for module, name in (("fp_dcp.tools.convert", "ConvertError"), ("fp_dcp.format", "CheckpointFormatError"),
                         ("fp_dcp.tools.tune", "TuneError")):
        m = sys.modules.get(module)
        if m is not None and isinstance(e, getattr(m, name)):
            return True
    return False


def _one_line(e: BaseException) -> str:
    """What went wrong, as one line: an fp_dcp error's own message, an
    ``OSError``'s file and reason, DCP's ``CheckpointException`` (a
    ``BaseException`` carrying each rank's error and traceback) as the first
    failed rank's error, anything else as its type and message."""
    failures = getattr(e, "failures", None)
    if type(e).__name__ == "CheckpointException" and isinstance(failures, dict) and failures:
        rank = min(failures)
        inner = failures[rank][0] if isinstance(failures[rank], tuple) else failures[rank]
        more = f" ({plural(len(failures), 'rank')} failed)" if len(failures) > 1 else ""
        return f"{_one_line(inner)}{more}" if isinstance(inner, BaseException) else f"rank {rank} failed{more}"
    if _is_known(e) or isinstance(e, ImportError):  # ImportError: fp_dcp's own names the fix
        message = str(e)
    elif isinstance(e, OSError):
        where = f"{e.filename}: " if e.filename else ""
        message = f"{where}{e.strerror or e}"
    else:
        message = f"{type(e).__name__}: {e}" if str(e) else type(e).__name__
        # DCP's load repeats the storage reader's metadata error twice
        # (global, then rank-local): the reader's own message says it all
        m = re.fullmatch(r"AssertionError: metadata is None; global metadata read failed: (.*?)"
                         r"(?:; rank local metadata read failed: .*)?", message, re.S)
        if m:
            message = m.group(1)
    return " ".join(message.split())


class _DropDcpTracebacks(logging.Filter):
    """DCP logs, with its traceback, each metadata read it falls back from
    (on the root logger), and the reader logs its metadata error for torch
    releases that swallow it; the error reaches the user as fp-dcp's one line."""

    def filter(self, record: logging.LogRecord) -> bool:
        if record.name == "fp_dcp" and str(record.msg).startswith(_READER_ERROR):
            return False
        return not (record.exc_info and "torch/distributed/checkpoint" in record.pathname.replace(os.sep, "/"))


# what fp_dcp._dcp_hooks.logged_metadata_errors logs (not imported here: --help stays torch-free)
_READER_ERROR = "fp_dcp cannot load the checkpoint at"


def _quiet_logs() -> None:
    root = logging.getLogger()
    if not root.handlers:  # otherwise the application configured logging itself
        handler = logging.StreamHandler(sys.stderr)
        handler.setLevel(logging.WARNING)
        handler.addFilter(_DropDcpTracebacks())
        root.addHandler(handler)


def main(argv: Sequence[str] | None = None) -> int:
    """Run one command; every command's errors end here (DCP's
    ``CheckpointException`` included): one line on stderr naming the
    command, exit 1 (130 on Ctrl-C); with --json also a JSON document
    ``{"path", "ok": false, "errors"}`` on stdout."""
    args = _parser().parse_args(argv)
    import warnings

    warnings.filterwarnings("ignore", message="torch.distributed is disabled")
    _quiet_logs()
    try:
        return args.func(args)
    except KeyboardInterrupt:
        print(f"\nfp-dcp {args.command}: interrupted", file=sys.stderr)
        return 130
    except SystemExit:
        raise
    except BaseException as e:  # noqa: BLE001 - every failure is one line and exit 1
        message = _one_line(e)
        if getattr(args, "json", False):
            print(json.dumps({"path": getattr(args, "path", None) or getattr(args, "source", None),
                              "ok": False, "errors": [message]}))
        print(f"fp-dcp {args.command}: {message}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
