"""User-facing errors: one line that names the file and the problem."""


class ImageError(Exception):
    """A problem with the user's input (spec, source, bundle) or environment.

    The CLI prints ``str(err)`` as ``btrfs-ublk-image: error: ...`` and exits 1,
    without a traceback. Messages start with the file they are about.
    """


class SpecError(ImageError):
    """The spec file is malformed: names the file, line and field."""


class SourceError(ImageError):
    """A source (tarball, directory, OCI image) is unreadable or hostile."""
