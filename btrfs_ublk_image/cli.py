"""Command line: ``btrfs-ublk-image build | schema | inspect | ls | manifest | diff | push |
push-trace | convert``."""

from __future__ import annotations

import argparse
import atexit
import gc
import json
import os
import signal
import sys
import threading
import types
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, NoReturn

from btrfs_ublk_image import __version__
from btrfs_ublk_image.errors import ImageError
from btrfs_ublk_image.manifest import read_manifest
from btrfs_ublk_image.progress import Progress, human_bytes

if TYPE_CHECKING:
    from btrfs_ublk_image.early import EarlyRead
    from btrfs_ublk_image.push import Pushed, PushedImage
    from btrfs_ublk_image.specyaml import SpecYaml

PROG = "btrfs-ublk-image"
# how long a thread waiting for the GIL lets the holder run before asking for it (the
# default is 5 ms). A build's parsing thread holds the GIL nearly all the time (its writes
# are buffered); the inflate and hash threads need it for a moment between C calls that
# each release it, and with the default they waited up to 5 ms each time, hundreds of times
SWITCH_INTERVAL = 250e-6


# "0": every layer read after the spec's validation (no ``early.EarlyRead``; measurements)
EARLY_READ_ENV = "BUI_EARLY_READ"


def cmd_build(args: argparse.Namespace) -> int:
    from btrfs_ublk_image import native
    from btrfs_ublk_image.specyaml import read_spec_yaml

    sys.setswitchinterval(SWITCH_INTERVAL)
    spec_path = Path(args.spec)
    text = read_spec_yaml(spec_path)
    progress = Progress("reading sources", force=args.progress)
    early: EarlyRead | None = None
    try:
        _start_prehashes(text, spec_path)
        early = _start_early_read(args, spec_path, text, progress)
        return _build(args, spec_path, text, progress, early)
    finally:
        if early is not None:
            early.discard()  # unless the build took it over: an invalid spec, an early error
        native.close_prehashes()  # those no layer took: an invalid spec, an early error


def _start_prehashes(text: SpecYaml, spec_path: Path) -> None:
    """Start the sha256 of each plain tar layer's file (``native.start_prehash``) before
    pydantic and the spec's models are imported (~0.1 s of one core that the digest fills
    with the other). The data is not validated yet: what does not fit is skipped (the
    validation reports it)."""
    from btrfs_ublk_image import native
    from btrfs_ublk_image.specyaml import PLAIN_TAR_KEYS, source_path

    layers = text.data.get("layers") if isinstance(text.data, dict) else None
    for layer in layers if isinstance(layers, list) else ():
        src = layer.get("tar") if isinstance(layer, dict) and len(layer) == 1 else None
        path = src.get("path") if isinstance(src, dict) else None
        if isinstance(src, dict) and isinstance(path, str) and src.keys() <= PLAIN_TAR_KEYS:
            native.start_prehash(source_path(spec_path.parent, path))


def _start_early_read(
    args: argparse.Namespace, spec_path: Path, text: SpecYaml, progress: Progress
) -> EarlyRead | None:
    """The first tar layer's read begun while pydantic and the spec's models import
    (``early.EarlyRead``), unless ``BUI_EARLY_READ=0``."""
    if os.environ.get(EARLY_READ_ENV, "1") == "0":
        return None
    from btrfs_ublk_image.early import EarlyRead

    return EarlyRead.start(text, spec_path, args.output, args.base, progress)


def _build(
    args: argparse.Namespace,
    spec_path: Path,
    text: SpecYaml,
    progress: Progress,
    early: EarlyRead | None,
) -> int:
    from btrfs_ublk_image.bundle import build_spec
    from btrfs_ublk_image.spec import OciLayer, load_spec

    pins: dict[str, str] = {}
    try:
        spec = load_spec(spec_path, text=text)
        out = args.output or f"{spec.name}.bundle"
        if any(isinstance(x, OciLayer) and x.oci.path is None for x in spec.layers):
            from btrfs_ublk_image import pull

            spec, pins = pull.pin_spec(
                spec,
                spec_path,
                update_lock=args.update_lock,
                plain_http=args.plain_http,
                auth=args.auth,
                progress=progress,
            )
            progress.phase("reading sources")
        res = build_spec(
            spec,
            spec_path,
            out,
            progress,
            base=args.base,
            plain_http=args.plain_http,
            auth=args.auth,
            early=early,
        )
    finally:
        progress.done()
    if pins:
        from btrfs_ublk_image import pull

        lock = pull.lock_path(spec_path)
        if pull.write_lock(lock, pins):
            print(f"{lock}: {len(pins)} registry image(s) pinned", file=sys.stderr)
    s = res.manifest["stats"]
    print(
        f"{res.path}: {res.image_id}: {s['files']} files, {s['directories']} dirs,"
        f" {s['symlinks']} symlinks, {human_bytes(s['content_bytes'])} content,"
        f" {human_bytes(s['unique_bytes'])} in packs"
        + (
            f" ({human_bytes(s['base_reused_bytes'])} reused from the base)"
            if "base_reused_bytes" in s
            else ""
        )
        + f", meta.img {human_bytes(res.layout.meta_size)},"
        f" {progress.elapsed():.1f} s"
    )
    return 0


def cmd_schema(args: argparse.Namespace) -> int:
    from btrfs_ublk_image.spec import json_schema_text

    sys.stdout.write(json_schema_text())
    return 0


def cmd_inspect(args: argparse.Namespace) -> int:
    manifest, image_id = read_manifest(args.bundle)
    if args.json:
        json.dump({"image_id": image_id, **manifest}, sys.stdout, indent=2, sort_keys=True)
        sys.stdout.write("\n")
        return 0
    s = manifest["stats"]
    dev = {d["devid"]: d for d in manifest["devices"]}
    print(f"image id:   {image_id}")
    print(f"name:       {manifest['name']}")
    print(f"fsid:       {manifest['fsid']}")
    print(f"meta.img:   {human_bytes(dev[1]['size'])}")
    print(f"data dev:   {human_bytes(dev[2]['size'])}")
    print(
        f"packs:      {len(manifest['packs'])}, {human_bytes(sum(p['size'] for p in manifest['packs']))}"
    )
    print(
        f"contents:   {s['files']} files, {s['directories']} dirs, {s['symlinks']} symlinks,"
        f" {s['devices']} special, {s['hardlinks']} extra hardlinks"
    )
    for src in manifest["sources"]:
        where = f"{src['ref']}@{src['digest']}" if src.get("ref") else src["path"]
        print(f"source:     {src['kind']} {where} {src['sha256']}")
    if manifest.get("image_config"):
        print(f"config:     {json.dumps(manifest['image_config'], sort_keys=True)}")
    return 0


def cmd_ls(args: argparse.Namespace) -> int:
    from btrfs_ublk_image.listing import ls_lines

    for line in ls_lines(args.bundle, args.path, recursive=args.recursive):
        print(line)
    return 0


def cmd_manifest(args: argparse.Namespace) -> int:
    from btrfs_ublk_image.listing import format_listing, load

    text = format_listing(load(args.source))
    if args.output:
        Path(args.output).write_text(text)
    else:
        sys.stdout.write(text)
    return 0


def cmd_diff(args: argparse.Namespace) -> int:
    from btrfs_ublk_image.listing import diff, load

    try:
        lines = diff(load(args.a), load(args.b))
        summary = _delta_summary(args.a, args.b, lines) if args.delta else None
    except ImageError as e:
        print(f"{PROG}: error: {e}", file=sys.stderr)
        return 2
    if summary is not None:
        sys.stdout.write(summary)
    else:
        for line in lines:
            print(line)
    if lines:
        print(f"{PROG}: {len(lines)} difference(s)", file=sys.stderr)
    return 1 if lines else 0


def _delta_summary(old: str, new: str, lines: list[str]) -> str:
    """``diff --delta``: files changed, added, removed, and what moving OLD -> NEW moves."""
    from btrfs_ublk_image.base import transfer
    from btrfs_ublk_image.manifest import MANIFEST

    for b in (old, new):
        if not os.path.isfile(os.path.join(b, MANIFEST)):
            raise ImageError(f"{b}: not a bundle directory (--delta compares two bundles)")
    changed = {line.split(" ", 2)[1] for line in lines if line.startswith("~ ")}
    t = transfer(old, new)
    rows = {
        "changed": len(changed),
        "added": sum(line.startswith("+ ") for line in lines),
        "removed": sum(line.startswith("- ") for line in lines),
        "fetch_bytes": t.fetch_bytes,
        "fetch_chunks": t.fetch_chunks,
        "push_bytes": t.push_bytes,
        "push_packs": t.push_packs,
        "image_bytes": t.new_bytes,
        "meta_bytes": t.meta_bytes,
    }
    return "".join(f"{k}: {v}\n" for k, v in rows.items())


def _registry_credentials(args: argparse.Namespace, reference: str) -> tuple[str, str] | None:
    """--auth, else $BUI_REGISTRY_AUTH, else docker's config.json entry of the registry."""
    from btrfs_ublk_image.registry import credentials_for

    return credentials_for(reference.removeprefix("oci://").partition("/")[0], args.auth)


def cmd_push(args: argparse.Namespace) -> int:
    from btrfs_ublk_image.push import PushedImage, push_bundle, push_image, summary

    progress = Progress("verifying", force=args.progress)
    try:
        push = push_image if args.image else push_bundle
        result = push(
            args.bundle,
            args.reference,
            plain_http=args.plain_http,
            credentials=_registry_credentials(args, args.reference),
            trace=args.trace,
            progress=progress,
        )
    finally:
        progress.done()
    if isinstance(result, PushedImage):
        pushed = result.bundle
        print(f"{args.reference}: image {result.image_digest}")
        print(f"bundle: manifest {pushed.manifest_digest}")
    else:
        pushed = result
        print(f"{args.reference}: manifest {pushed.manifest_digest}")
    print(f"image id: {pushed.image_id}")
    if pushed.trace_digest is not None:
        print(f"trace: {pushed.trace_digest}")
    print(f"{summary(pushed)}, {progress.elapsed():.1f} s", file=sys.stderr)
    if args.sign_by:
        _sign(args, result)
    return 0


def _sign(args: argparse.Namespace, result: Pushed | PushedImage) -> None:
    """push --sign-by: skopeo signs each manifest push tagged (docs/signatures.md)."""
    from btrfs_ublk_image.push import PushedImage
    from btrfs_ublk_image.registry import Reference, parse_reference
    from btrfs_ublk_image.runnable import bundle_tag
    from btrfs_ublk_image.sign import sign_pushed

    ref = parse_reference(args.reference)
    if isinstance(result, PushedImage):
        bundle_ref = Reference(ref.registry, ref.repo, bundle_tag(ref.tag))
        tagged = [(ref, result.image_digest), (bundle_ref, result.bundle.manifest_digest)]
    else:
        tagged = [(ref, result.manifest_digest)]
    for r, digest in tagged:
        sign_pushed(
            r,
            digest,
            args.sign_by,
            plain_http=args.plain_http,
            credentials=_registry_credentials(args, args.reference),
            registries_d=args.registries_d,
        )
        print(f"signed: {r} ({digest}) by {args.sign_by}")


def cmd_push_trace(args: argparse.Namespace) -> int:
    from btrfs_ublk_image.push import push_trace

    trace_digest, manifest_digest, image_id = push_trace(
        args.trace,
        args.reference,
        plain_http=args.plain_http,
        credentials=_registry_credentials(args, args.reference),
    )
    print(f"{args.reference}: trace {trace_digest} attached to manifest {manifest_digest}")
    print(f"image id: {image_id}")
    return 0


def cmd_convert(args: argparse.Namespace) -> int:
    from btrfs_ublk_image.convert import CONTAINER_CHUNK_SIZE, convert

    sys.setswitchinterval(SWITCH_INTERVAL)
    progress = Progress("converting", force=args.progress)
    try:
        result = convert(
            args.source,
            args.destination,
            output=args.output,
            platform=args.platform,
            all_platforms=args.all_platforms,
            name=args.name,
            chunk_size=args.pack_chunk_size or CONTAINER_CHUNK_SIZE,
            plain_http=args.plain_http,
            auth=args.auth,
            progress=progress,
        )
    finally:
        progress.done()
    for image in result.images:
        plat = f" ({image.platform})" if image.platform else ""
        print(f"{image.reference}: image {image.pushed.image_digest}{plat}")
        print(f"bundle: manifest {image.pushed.bundle.manifest_digest}")
        print(f"image id: {image.image_id}")
        if image.bundle is not None:
            print(f"kept: {image.bundle}")
    if result.index_digest is not None:
        print(f"{args.destination}: index {result.index_digest}")
    print(f"converted in {progress.elapsed():.1f} s", file=sys.stderr)
    return 0


def _registry_options(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--plain-http",
        action="store_true",
        help="speak plain HTTP to the registry (default: HTTPS, except for loopback hosts)",
    )
    p.add_argument(
        "--auth",
        metavar="USER:PASS",
        help="registry credentials (Basic, or for the Bearer token service); default: env"
        " BUI_REGISTRY_AUTH, else the registry's entry in docker's config.json"
        " ($DOCKER_CONFIG/config.json or ~/.docker/config.json), else anonymous",
    )


def parser(first: str | None = None) -> argparse.ArgumentParser:
    """The command line's parser. ``first``: the command line's first word; ``build`` gets a
    parser of that command alone (the same result and messages for its command lines): a
    build's first layer is read from start-up on (``early``), after the parse, and the
    other commands' arguments took ~5 ms of CPU to declare."""
    p = argparse.ArgumentParser(
        prog=PROG,
        description="Build btrfs seed images that mount in O(metadata) time (see README.md).",
    )
    p.add_argument("--version", action="version", version=f"%(prog)s {__version__}")
    sub = p.add_subparsers(dest="command", required=True, metavar="COMMAND")

    b = sub.add_parser(
        "build", help="build a bundle from a spec", description="Build a bundle from SPEC."
    )
    b.add_argument("spec", metavar="SPEC", help="spec file (YAML)")
    b.add_argument(
        "-o", "--output", metavar="DIR", help="bundle directory to create (default: NAME.bundle)"
    )
    b.add_argument(
        "--progress", action="store_true", help="show progress even when stderr is not a terminal"
    )
    b.add_argument(
        "--update-lock",
        action="store_true",
        help="resolve the tags of registry images again (oci: {ref: ...}) instead of using"
        " the digests in SPEC.lock, and rewrite it",
    )
    b.add_argument(
        "--base",
        metavar="BUNDLE",
        help="an earlier bundle (a directory, oci://REGISTRY/REPO:TAG as push made it, or"
        " http(s)://HOST/PATH/manifest.json of a bundle on a web server) whose packs to reuse:"
        " content already there is not written again, and push and lazy fetch move only the"
        " new packs and metadata patches (overrides the spec's base)",
    )
    _registry_options(b)
    b.set_defaults(func=cmd_build)
    if first == "build":
        return p

    s = sub.add_parser("schema", help="print the spec's JSON schema")
    s.set_defaults(func=cmd_schema)

    i = sub.add_parser("inspect", help="print a bundle's manifest summary")
    i.add_argument("bundle", metavar="BUNDLE")
    i.add_argument("--json", action="store_true", help="the whole manifest and image id as JSON")
    i.set_defaults(func=cmd_inspect)

    ls = sub.add_parser(
        "ls",
        help="list a directory or file of a bundle (like ls -l), read without mounting",
    )
    ls.add_argument("bundle", metavar="BUNDLE")
    ls.add_argument("path", metavar="PATH", nargs="?", default="/", help="default: /")
    ls.add_argument("-R", "--recursive", action="store_true", help="list subdirectories too")
    ls.set_defaults(func=cmd_ls)

    m = sub.add_parser(
        "manifest",
        help="print the listing of every path (docs/listing-format.md)",
        description="Print the sorted listing of SOURCE: a bundle (read without mounting), a"
        " listing file, or a directory tree such as a mounted image.",
    )
    m.add_argument("source", metavar="SOURCE", help="bundle, listing file or directory")
    m.add_argument("-o", "--output", metavar="FILE", help="write the listing to FILE")
    m.set_defaults(func=cmd_manifest)

    df = sub.add_parser(
        "diff",
        help="compare two bundles / listings / directory trees; exit 1 if they differ",
        description="Print every difference between A and B (each a bundle, a listing file or"
        " a directory tree): '- PATH' only in A, '+ PATH' only in B, '~ PATH FIELD: A -> B'."
        " Exit status: 0 identical, 1 different, 2 trouble.",
    )
    df.add_argument("a", metavar="A")
    df.add_argument("b", metavar="B")
    df.add_argument(
        "--delta",
        action="store_true",
        help="A and B are bundles: print, instead of the differences, how many paths are"
        " changed / added / removed, the bytes (and chunks) a host that read all of A fetches"
        " to read all of B (fetch_bytes), the bytes (and packs) a push of B uploads to a"
        " registry holding A (push_bytes), and B's mapped bytes (image_bytes)",
    )
    df.set_defaults(func=cmd_diff)

    pu = sub.add_parser(
        "push",
        help="upload a bundle to an OCI registry as an artifact (docs/remote.md)",
        description="Verify BUNDLE (every file against manifest.json, every pack chunk against"
        " the blockmap), then upload it to an OCI distribution registry as the artifact"
        " described in docs/remote.md, skipping blobs the registry already has, and tag it."
        " A trace (--trace, or prefetch.trace in BUNDLE) is attached as a referrer. Prints the"
        " manifest digest and the image id. Mount it with `ublkd mount oci://REFERENCE ...`.",
    )
    pu.add_argument("bundle", metavar="BUNDLE")
    pu.add_argument(
        "reference", metavar="REGISTRY/REPO[:TAG]", help="e.g. registry.example:5000/images/app:v1"
    )
    pu.add_argument("--trace", metavar="TRACE", help="prefetch trace to attach (see push-trace)")
    pu.add_argument(
        "--image",
        action="store_true",
        help="push a runnable image for containerd at TAG (btrfs-ublk-snapshotter pulls it"
        " lazily) and the bundle artifact at TAG-bundle (docs/containerd.md)",
    )
    _registry_options(pu)
    pu.add_argument(
        "--progress", action="store_true", help="show progress even when stderr is not a terminal"
    )
    pu.add_argument(
        "--sign-by",
        metavar="KEY",
        help="sign what was tagged (with --image: both tags) with this GnuPG key of $GNUPGHOME:"
        " `skopeo copy --sign-by`, stored where containers-registries.d says (docs/signatures.md)",
    )
    pu.add_argument(
        "--registries-d",
        metavar="DIR",
        help="the containers-registries.d directory skopeo reads for --sign-by"
        " (default: skopeo's, /etc/containers/registries.d)",
    )
    pu.set_defaults(func=cmd_push)

    cv = sub.add_parser(
        "convert",
        help="convert an OCI image into a bundle and push it as a runnable image (docs/convert.md)",
        description="Read the OCI image SRC, build its bundle (the image config kept:"
        " entrypoint, env, user, workdir) and push it to DST as `push --image` does: the"
        " runnable image at DST's tag, the bundle artifact at TAG-bundle. SRC:"
        " REGISTRY[:PORT]/REPO[:TAG|@sha256:HEX], oci-layout:PATH[:REF],"
        " oci-archive:PATH[:REF] or docker-archive:PATH[:REF]. With --all-platforms and an"
        " image index: one bundle and runnable image per platform (tags TAG-OS-ARCH), DST's"
        " tag an index of them.",
    )
    cv.add_argument("source", metavar="SRC")
    cv.add_argument("destination", metavar="DST", help="REGISTRY[:PORT]/REPO[:TAG]")
    cv.add_argument(
        "-o",
        "--output",
        metavar="DIR",
        help="keep the bundle in DIR (several platforms: DIR/OS-ARCH.bundle); default: a"
        " temporary directory, removed",
    )
    cv.add_argument(
        "--platform", metavar="OS/ARCH[/VARIANT]", help="from an image index; default: the host's"
    )
    cv.add_argument("--all-platforms", action="store_true", help="every platform of an image index")
    cv.add_argument("--name", help="the bundle's name (default: from SRC)")
    cv.add_argument(
        "--pack-chunk-size",
        type=int,
        metavar="BYTES",
        help="the spec's pack_chunk_size: what a lazy mount fetches per miss (default 262144,"
        " for containers' scattered small reads; a power of two, 65536..16777216)",
    )
    _registry_options(cv)
    cv.add_argument(
        "--progress", action="store_true", help="show progress even when stderr is not a terminal"
    )
    cv.set_defaults(func=cmd_convert)

    pt = sub.add_parser(
        "push-trace",
        help="attach a prefetch trace to a pushed bundle (OCI referrer)",
        description="Attach TRACE to the bundle pushed as REGISTRY/REPO:TAG: an artifact whose"
        " subject is the bundle's manifest, listed under the referrers tag sha256-<hex>"
        " (other referrers are kept). The image id stays the same. A trace made for"
        " another image is refused.",
    )
    pt.add_argument("trace", metavar="TRACE", help="trace file (btrfs-ublk-image.trace)")
    pt.add_argument("reference", metavar="REGISTRY/REPO[:TAG]")
    _registry_options(pt)
    pt.set_defaults(func=cmd_push_trace)
    return p


class Terminated(BaseException):
    """SIGTERM: unwinds like Ctrl-C, so every cleanup (temporary bundle, pull cache) runs."""


def _terminate(signum: int, frame: object) -> None:
    raise Terminated


def _without_pydantic_plugins() -> None:
    """The program's spec models take no pydantic plugins. pydantic (2.14, pinned) looks
    for them when it builds the first model, through ``pydantic.plugin._loader``, whose
    import loads ``importlib.metadata`` (with ``email``, ``zipfile``, ``csv``...: ~12 ms of
    CPU, and its lookup lists every ``sys.path`` directory: ~2 ms) even where
    ``PYDANTIC_DISABLE_PLUGINS`` turns the lookup off; this loader finds none. Only in the
    program (``run``): a process that imports this package keeps pydantic's own."""
    loader = types.ModuleType("pydantic.plugin._loader")
    loader.get_plugins = tuple  # type: ignore[attr-defined] # no plugins: ()
    sys.modules.setdefault(loader.__name__, loader)


def run() -> NoReturn:
    """The program (``btrfs-ublk-image``, ``python -m btrfs_ublk_image``): ``main``, with
    what only a process that ends after one command can skip (bench/results/issue23-log.md,
    "The program's start and end"): pydantic's plugin lookup; for ``build``, the other
    commands' arguments (``parser``), the cyclic garbage collector from the start (the
    build turns it off for its own part, ``bundle``; before that the imports, the spec's
    models and the sources ran ~60 collections) and, once
    the bundle is written and reported, the interpreter's teardown, which frees every
    module and object one by one: the process ends when nothing is left to do (output
    flushed, atexit handlers run, no other non-daemon thread alive, no profiler or tracer
    that writes its data after; else the ordinary exit). A build closes every file it
    writes itself; the other commands keep the ordinary exit, which flushes what they
    may leave open."""
    _without_pydantic_plugins()
    gc.disable()
    argv = sys.argv[1:]
    args = parser(argv[0] if argv else None).parse_args(argv)
    if args.func is not cmd_build:
        gc.enable()
        sys.exit(_main(args))
    rc = _main(args)
    if sys.getprofile() is not None or sys.gettrace() is not None:
        sys.exit(rc)  # a profiler or tracer (python -m cProfile -o FILE) writes its data after
    others = [t for t in threading.enumerate() if t is not threading.main_thread()]
    if any(t.is_alive() and not t.daemon for t in others):
        sys.exit(rc)
    try:
        sys.stdout.flush()
        sys.stderr.flush()
    except OSError:
        sys.exit(rc)  # the ordinary exit reports it (a closed pipe: status 120)
    atexit._run_exitfuncs()
    os._exit(rc)


def main(argv: Sequence[str] | None = None) -> int:
    return _main(parser().parse_args(argv))


def _main(args: argparse.Namespace) -> int:
    on_main = threading.current_thread() is threading.main_thread()
    previous = signal.signal(signal.SIGTERM, _terminate) if on_main else None
    try:
        return _run(args)
    finally:
        if on_main:
            signal.signal(signal.SIGTERM, previous)


def _run(args: argparse.Namespace) -> int:
    try:
        rc: int = args.func(args)
        return rc
    except ImageError as e:
        print(f"{PROG}: error: {e}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print(f"{PROG}: interrupted", file=sys.stderr)
        return 130
    except Terminated:
        print(f"{PROG}: terminated", file=sys.stderr)
        return 143
