"""A build's first tar layer read while the program still starts (``build`` only).

``build`` reads the spec's YAML before pydantic and the spec's models are imported
(``specyaml``). When the first layer is a plain ``tar: {path, uid, gid, sha256}`` layer
that the native reader reads, and nothing asks for what this read does not do (a base
bundle, compressed packs, an output that exists), ``EarlyRead.start`` makes the bundle's
temporary directory and pack (``staging.start_bundle``, ``staging.new_pack_writer``) and
reads that layer into them on a thread of its own, from the YAML's values, while the main
thread imports pydantic, validates the spec and imports the writer: the native reader
parses, hashes and writes the pack on its own threads with the GIL released, and its
placement of the members takes turns with the imports.

The spec is still what decides: ``matches`` compares the validated spec with every value
the read took from the YAML (``build_spec`` discards the read when one differs, and reads
the layer as usual); an invalid spec, an error, Ctrl-C: ``discard`` stops the read at its
next segment (``LayerContext.cancelled``), waits for its thread and removes the
directory. Warnings of the read are held until the build takes it over (``result``), so an
invalid spec's errors come alone, as before.

Everything before the read starts runs on one core while the other waits, and the pack's
disk writes wait with it: the modules imported up to here (``cli``, ``specyaml``, this one
and what they import) define their records as ``NamedTuple`` rather than dataclasses, so
``dataclasses`` and ``inspect`` (~10 ms of imports) load later, with pydantic, while the
read runs (tests/test_startup.py checks it).
"""

from __future__ import annotations

import os
import shutil
import stat
import threading
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

from btrfs_ublk_image import native
from btrfs_ublk_image.errors import ImageError
from btrfs_ublk_image.packs import PackWriter
from btrfs_ublk_image.progress import Progress
from btrfs_ublk_image.sources import Started
from btrfs_ublk_image.sources.base import LayerContext
from btrfs_ublk_image.sources.tar import apply_source
from btrfs_ublk_image.specyaml import (
    DEFAULT_CHUNK_SIZE,
    DEFAULT_INLINE_LIMIT,
    MAX_INLINE_LIMIT,
    PLAIN_TAR_KEYS,
    SpecYaml,
    check_chunk_size,
    source_path,
)
from btrfs_ublk_image.staging import new_pack_writer, start_bundle
from btrfs_ublk_image.tree import Tree

if TYPE_CHECKING:
    from btrfs_ublk_image.spec import Spec

_MAX_OWNER = 0xFFFFFFFF


# larger tarballs are read after the validation: the ~0.1-0.15 s of imports the early
# read hides are a few percent of their read, and with it the synthetic set's peak RSS
# (2.79 GB, 101,116 entries) exceeded 1 KiB per entry in 2 of 10 builds (100,576 and
# 102,892 KiB; main at most 95,808 in the same pairs; bench/results/issue23-log.md)
MAX_BYTES = 1 << 30


class _TarFields:
    """A first layer's ``tar:`` options as ``sources.tar.apply_source`` reads them."""

    __slots__ = ("gid", "path", "sha256", "uid")
    dest = "/"
    include = None
    exclude: list[str] = []  # noqa: RUF012 - read only
    strip_components = 0
    in_place = False

    def __init__(self, path: str, uid: int | None, gid: int | None, sha256: str | None) -> None:
        self.path, self.uid, self.gid, self.sha256 = path, uid, gid, sha256


class _Epoch:
    """What ``LayerContext`` reads of the spec: ``source_date_epoch``."""

    __slots__ = ("source_date_epoch",)

    def __init__(self, epoch: int | None) -> None:
        self.source_date_epoch = epoch


class _HeldContext(LayerContext):
    """A layer context whose warnings wait for ``release`` (the spec may still be invalid)."""

    __slots__ = ("held",)

    def __init__(self, *args: Any) -> None:
        super().__init__(*args)
        self.held: list[str] = []

    def warn(self, message: str) -> None:
        if self._held_warnings is not None:  # the native read's own hold, until it commits
            self._held_warnings.append(message)
        else:
            self.held.append(message)

    def release(self) -> None:
        held, self.held = self.held, []
        for message in held:
            super().warn(message)


def _int(value: object, low: int, high: int) -> int | None:
    """``value`` if it is an int (not a bool) in ``low..high``, else None."""
    if type(value) is int and low <= value <= high:
        return value
    return None


class EarlyRead:
    """The first layer's read into a new bundle's pack, on a thread (module docstring)."""

    def __init__(
        self,
        out_dir: str,
        tmp: str,
        packs: PackWriter,
        fields: _TarFields,
        epoch: int | None,
        keep_inline: int,
        ctx: _HeldContext,
    ) -> None:
        self.out_dir, self.tmp, self.packs = out_dir, tmp, packs
        self.fields, self.epoch, self.keep_inline, self._ctx = fields, epoch, keep_inline, ctx
        self._started: Started | None = None
        self._error: BaseException | None = None
        self._claimed = False
        self._thread = threading.Thread(target=self._run, name="early-read")

    @classmethod
    def start(
        cls,
        text: SpecYaml,
        spec_path: Path,
        output: str | None,
        base: str | None,
        progress: Progress | None,
        environ: Mapping[str, str] | None = None,
    ) -> EarlyRead | None:
        """The read of the spec's first layer, begun; None where it does not apply (the
        build then reads every layer after the validation, as always)."""
        nat = native.module()
        data = text.data
        if base is not None or nat is None or not hasattr(nat, "Placer"):
            return None
        if not isinstance(data, dict) or data.get("base") is not None:
            return None
        if data.get("pack_compression", "none") != "none":
            return None
        layers = data.get("layers")
        first = layers[0] if isinstance(layers, list) and layers else None
        src = first.get("tar") if isinstance(first, dict) and len(first) == 1 else None
        if not isinstance(src, dict) or not src.keys() <= PLAIN_TAR_KEYS:
            return None
        path, sha256 = src.get("path"), src.get("sha256")
        uid, gid = src.get("uid"), src.get("gid")
        if not isinstance(path, str) or not path or not isinstance(sha256, str | None):
            return None
        if any(v is not None and _int(v, 0, _MAX_OWNER) is None for v in (uid, gid)):
            return None
        btrfs = data.get("btrfs", {})
        limit = btrfs.get("inline_limit", DEFAULT_INLINE_LIMIT) if isinstance(btrfs, dict) else None
        # the writer's inline_max of a valid limit is the limit: matches() checks it
        keep_inline = _int(limit, 0, MAX_INLINE_LIMIT)
        chunk_size = _int(data.get("pack_chunk_size", DEFAULT_CHUNK_SIZE), 0, 1 << 62)
        try:
            chunk_size = None if chunk_size is None else check_chunk_size(chunk_size)
        except ValueError:
            chunk_size = None
        if keep_inline is None or chunk_size is None:
            return None
        epoch = data.get("source_date_epoch")
        if epoch is None:  # load_spec's SOURCE_DATE_EPOCH
            env = (os.environ if environ is None else environ).get("SOURCE_DATE_EPOCH", "")
            if env.strip() and not env.strip().isdigit():
                return None
            epoch = int(env) if env.strip() else None
        elif _int(epoch, 0, 1 << 62) is None:
            return None
        try:  # a FIFO or device could block the thread's read where no signal stops it
            st = os.stat(source_path(spec_path.parent, path))
        except (OSError, ValueError):
            return None  # the layer's read reports it, after the validation
        if not stat.S_ISREG(st.st_mode) or st.st_size > MAX_BYTES:
            return None
        name = data.get("name")
        if output is None and not isinstance(name, str):
            return None
        try:
            out_dir, tmp = start_bundle(output if output is not None else f"{name}.bundle")
        except (ImageError, OSError, ValueError):
            return None  # the build reports it after the validation, as always
        packs = None
        try:
            packs = new_pack_writer(tmp, keep_inline, chunk_size, progress)
            tree = Tree()
            if epoch is not None:
                tree.root.mtime_ns = epoch * 1_000_000_000
            ctx = _HeldContext(tree, _Epoch(epoch), spec_path.parent, packs, progress, 0)
        except BaseException as e:
            if packs is not None:
                packs.abort()
            shutil.rmtree(tmp, ignore_errors=True)
            if isinstance(e, Exception):  # a full disk...: the build meets it again after
                return None  # the validation, and reports it then, as always
            raise
        read = cls(out_dir, tmp, packs, _TarFields(path, uid, gid, sha256), epoch, keep_inline, ctx)
        read._thread.start()
        return read

    def _run(self) -> None:
        try:
            record = apply_source(self.fields, self._ctx)
            self._started = Started(self._ctx.tree, [record])
        except BaseException as e:  # the build's thread raises it (result), or drops it
            self._error = e

    def matches(self, spec: Spec, output: str, keep_inline: int, base: str | None) -> bool:
        """Whether this read read the first layer as ``spec`` says (and into ``output``,
        with the pack options the build takes: ``keep_inline``, no ``base``)."""
        from btrfs_ublk_image.spec import TarLayer, TarSource

        first = spec.layers[0] if spec.layers else None
        if base is not None or not isinstance(first, TarLayer):
            return False
        missing = object()  # a field this read does not know: not read as the spec says
        return (
            os.path.abspath(output) == self.out_dir
            and keep_inline == self.keep_inline
            and spec.pack_chunk_size == self.packs.chunk_size
            and spec.pack_compression == "none"
            and spec.source_date_epoch == self.epoch
            and all(
                getattr(first.tar, k) == getattr(self.fields, k, missing)
                for k in TarSource.model_fields
            )
        )

    def claim(self) -> tuple[str, str]:
        """(the output directory, the temporary directory): the build's from now on."""
        self._claimed = True
        return self.out_dir, self.tmp

    def result(self) -> Started:
        """The first layer applied (the read's error raised; its held warnings given)."""
        self._thread.join()
        if self._error is not None:
            raise self._error
        assert self._started is not None
        self._ctx.release()
        return self._started

    def stop(self) -> None:
        """Stop the read (at its next segment) and wait for its thread."""
        self._ctx.cancelled = True
        self._thread.join()

    def discard(self) -> None:
        """The read stopped and its bundle removed, unless the build took it over."""
        if self._claimed:
            return
        self._claimed = True
        self.stop()
        self.packs.abort()
        shutil.rmtree(self.tmp, ignore_errors=True)
