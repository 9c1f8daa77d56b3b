"""fp-dcp: the command line for people (also python -m fp_dcp).

    fp-dcp inspect CKPT [--json]            format, tensors, chunks, files
    fp-dcp verify CKPT [--json]             read every byte, check every checksum
    fp-dcp convert CKPT model.pt            one consolidated torch.save file
    fp-dcp convert CKPT model.safetensors   one safetensors file (tensors only)
    fp-dcp convert --to-dcp CKPT OUT_DIR    a stock torch.distributed.checkpoint
    fp-dcp convert --from-dcp DCP_DIR OUT   a stock DCP checkpoint (or a
                                            torch.save file) into fp_dcp

Exit codes: 0 success, 1 failure (the message names the file and the fix),
2 usage error.  Progress of long operations goes to stderr (``-q``: none).
"""

from __future__ import annotations

import argparse
import datetime as _dt
import json
import os
import sys
from typing import Sequence

from fp_dcp.options import format_size

__all__ = ["main"]

_SUFFIXES = {".pt": "torch", ".pth": "torch", ".bin": "torch", ".ckpt": "torch", ".safetensors": "safetensors"}
_TARGETS = ("torch", "safetensors", "dcp", "fp_dcp")


# ------------------------------------------------------------------ inspect


def _inspect(args: argparse.Namespace) -> int:
    from fp_dcp import convert

    kind = convert.checkpoint_kind(args.path)
    if kind != "fp_dcp":
        what = "a stock DCP checkpoint" if kind == "dcp" else "a file, not a checkpoint directory"
        raise convert.ConvertError(
            f"{args.path}: {what}; fp-dcp inspect reads fp_dcp checkpoints"
            + (f" (convert it: fp-dcp convert --from-dcp {args.path} OUT)" if kind == "dcp" else "")
        )
    d = convert.describe(args.path)
    if args.json:
        print(json.dumps(d, indent=1))
        return 0
    created = _dt.datetime.fromtimestamp(d["created"]).isoformat(" ", "seconds") if d["created"] else "?"
    print(f"{d['path']}")
    print(f"  format {d['format']} version {d['format_version']}, written by {d['writer']} "
          f"(torch {d['torch_version']}) on {d['world_size']} rank(s) at {created}; save {d['save_id']}")
    ck = d["checksum_block_bytes"]
    print(f"  alignment {d['alignment']} B; checksums: "
          + (f"CRC-32C per {format_size(ck)} block" if ck else "none"))
    print(f"  {len(d['tensors'])} tensors ({format_size(d['tensor_bytes'])}), {len(d['objects'])} other items, "
          f"{len(d['files'])} data files ({format_size(d['file_bytes'])})")
    print()
    rows = [("tensor", "dtype", "shape", "chunks", "bytes", "files")]
    for t in d["tensors"]:
        rows.append((t["name"], t["dtype"], "x".join(map(str, t["shape"])) or "()", str(len(t["chunks"])),
                     format_size(t["bytes"]), ",".join(map(str, t["files"]))))
    for o in d["objects"]:
        rows.append((o["name"], "object", "-", "1", format_size(o["bytes"]), ",".join(map(str, o["files"]))))
    _table(rows)
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


# ------------------------------------------------------------------ convert


def _convert(args: argparse.Namespace) -> int:
    from fp_dcp import convert

    target = args.to
    if args.to_dcp:
        if target not in (None, "dcp"):
            raise convert.ConvertError("--to-dcp and --to disagree; give one of them")
        target = "dcp"
    if args.from_dcp and target is None:
        target = "fp_dcp"
    if target is None:
        target = _SUFFIXES.get(os.path.splitext(args.output)[1].lower())
    if target is None:
        raise convert.ConvertError(
            f"{args.output}: cannot tell the output format from its name; pass --to "
            f"{{{','.join(_TARGETS)}}} (or name it .pt / .safetensors)"
        )
    kind = convert.checkpoint_kind(args.source)
    if args.from_dcp and kind != "dcp":
        raise convert.ConvertError(
            f"{args.source}: --from-dcp needs a stock DCP checkpoint (a directory with .metadata); "
            f"this is {'an fp_dcp checkpoint' if kind == 'fp_dcp' else 'a file'}"
        )
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


# ------------------------------------------------------------------ main


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="fp-dcp", description=__doc__.split("\n\n")[0],
                                epilog=__doc__.split("\n\n", 1)[1], formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="command", metavar="COMMAND")
    sub.required = True

    q = sub.add_parser("inspect", help="what a checkpoint holds: format, tensors, chunks, files")
    q.add_argument("path", help="fp_dcp checkpoint directory")
    q.add_argument("--json", action="store_true", help="print JSON instead of tables")
    q.add_argument("--chunks", action="store_true", help="also list every stored chunk")
    q.set_defaults(func=_inspect)

    c = sub.add_parser("convert", help="to torch.save / safetensors / stock DCP, or from stock DCP",
                       description="Convert a checkpoint. The output format comes from --to, --to-dcp, "
                                   "--from-dcp (fp_dcp), or the output's suffix (.pt, .safetensors).")
    c.add_argument("source", help="fp_dcp or stock DCP checkpoint directory (or a torch.save file with --from-dcp)")
    c.add_argument("output", help="output file (torch.save, safetensors) or directory (DCP, fp_dcp)")
    c.add_argument("--to", choices=_TARGETS, help="output format")
    c.add_argument("--to-dcp", action="store_true", help="write a stock torch.distributed.checkpoint directory")
    c.add_argument("--from-dcp", action="store_true", help="read a stock DCP checkpoint, write fp_dcp (default)")
    c.add_argument("--force", action="store_true", help="replace an existing output")
    c.add_argument("--skip-unsupported", action="store_true",
                   help="safetensors: leave out tensors of dtypes it cannot hold (listed on stderr)")
    c.add_argument("-q", "--quiet", action="store_true", help="no progress on stderr")
    c.set_defaults(func=_convert)

    try:  # fp-dcp verify, where that module is installed
        from fp_dcp import verify
    except ImportError:
        verify = None
    if verify is not None:
        v = sub.add_parser("verify", help="read every byte of a checkpoint and check its checksums")
        verify.add_arguments(v)
        v.set_defaults(func=verify.run, passthrough=True)
    return p


def main(argv: Sequence[str] | None = None) -> int:
    import warnings

    from fp_dcp import convert
    from fp_dcp import format as fmt

    args = _parser().parse_args(argv)
    if getattr(args, "passthrough", False):
        return args.func(args)
    warnings.filterwarnings("ignore", message="torch.distributed is disabled")
    try:
        return args.func(args)
    except (convert.ConvertError, fmt.CheckpointFormatError) as e:
        print(f"fp-dcp {args.command}: {e}", file=sys.stderr)
        return 1
    except OSError as e:
        where = f"{e.filename}: " if e.filename else ""
        print(f"fp-dcp {args.command}: {where}{e.strerror or e}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print(f"fp-dcp {args.command}: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
