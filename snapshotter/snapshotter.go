package main

// The snapshotter: containerd's own overlayfs snapshotter, with one difference. A layer
// whose descriptor names a btrfs-ublk-image bundle (the placeholder layer of an image
// pushed with `btrfs-ublk-image push --image`) is not unpacked: its committed snapshot's
// directory becomes an `ublkd mount` of the bundle, and containerd is told the snapshot
// already exists, so it never fetches the layer blob. Containers on that image get
// overlayfs with the mount as their lower directory (one shared read-only mount and page
// cache per image on the host). Every other layer is an ordinary overlayfs layer, so the
// snapshotter can be containerd's default.

import (
	"context"
	"errors"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"sync"
	"syscall"
	"time"

	"github.com/containerd/containerd/v2/core/mount"
	"github.com/containerd/containerd/v2/core/snapshots"
	"github.com/containerd/containerd/v2/core/snapshots/storage"
	"github.com/containerd/containerd/v2/plugins/snapshots/overlay"
	"github.com/containerd/errdefs"
	"github.com/containerd/log"
)

// Labels containerd passes from the placeholder layer's annotations (runnable.py).
const (
	labelPrefix   = "containerd.io/snapshot/btrfs-ublk-image."
	labelBundle   = labelPrefix + "bundle"   // sha256 digest of the bundle artifact manifest
	labelImageID  = labelPrefix + "image-id" // sha256 of the bundle's manifest.json
	labelLocation = labelPrefix + "location" // oci://REG/REPO@sha256:… where it was pushed
	labelImageRef = "containerd.io/snapshot/cri.image-ref"
	labelManifest = "containerd.io/snapshot/cri.manifest-digest" // the image manifest being unpacked
	labelLayer    = "containerd.io/snapshot/cri.layer-digest"
)

// mountTimeout bounds one `ublkd mount`: it fetches manifest.json, meta.img and the
// blockmap before it returns.
const mountTimeout = 5 * time.Minute

type snapshotter struct {
	snapshots.Snapshotter // containerd's overlayfs snapshotter over root
	ms                    *storage.MetaStore
	root                  string
	ublkd                 ublkdArgv
	status                *statusFile
	mu                    sync.Mutex // serialises bundle mounts and umounts
}

func newSnapshotter(root string, ublkd ublkdArgv) (*snapshotter, error) {
	if err := os.MkdirAll(root, 0o700); err != nil {
		return nil, err
	}
	ms, err := storage.NewMetaStore(filepath.Join(root, "metadata.db"))
	if err != nil {
		return nil, fmt.Errorf("%s: %w", root, err)
	}
	ov, err := overlay.NewSnapshotter(root, overlay.WithMetaStore(ms))
	if err != nil {
		ms.Close()
		return nil, err
	}
	return &snapshotter{Snapshotter: ov, ms: ms, root: root, ublkd: ublkd, status: &statusFile{path: filepath.Join(root, "status.json")}}, nil
}

// bundleRef is what the labels of a bundle layer say.
type bundleRef struct {
	location string // oci://REG/REPO@sha256:… passed to ublkd mount: the image or its bundle
	imageID  string
}

func isDigest(s string) bool { return strings.HasPrefix(s, "sha256:") && len(s) == 71 }

func bundleOf(labels map[string]string) (bundleRef, bool, error) {
	digest, ok := labels[labelBundle]
	if !ok {
		return bundleRef{}, false, nil
	}
	if !isDigest(digest) {
		return bundleRef{}, true, fmt.Errorf("label %s: %q is not a sha256 digest", labelBundle, digest)
	}
	loc := labels[labelLocation]
	// an image pulled through a mirror names the mirror in the CRI's image ref: the bundle
	// artifact is in the same repository there
	if ref, ok := labels[labelImageRef]; ok && ref != "" {
		loc = "oci://" + repository(ref) + "@" + digest
		// the image manifest containerd unpacks, when it says which: ublkd follows it to
		// the bundle it names (these labels come from it), so a signature policy checks
		// the image containerd runs, its config included, not only the bundle
		// (docs/signatures.md)
		if m := labels[labelManifest]; isDigest(m) {
			return bundleRef{location: "oci://" + repository(ref) + "@" + m, imageID: labels[labelImageID]}, true, nil
		}
	}
	if !strings.HasPrefix(loc, "oci://") || !strings.HasSuffix(loc, "@"+digest) {
		return bundleRef{}, true, fmt.Errorf("bundle %s: no location (label %s is %q)", digest, labelLocation, loc)
	}
	return bundleRef{location: loc, imageID: labels[labelImageID]}, true, nil
}

// repository strips the tag or digest of REGISTRY/REPO[:TAG][@DIGEST].
func repository(ref string) string {
	ref, _, _ = strings.Cut(ref, "@")
	slash := strings.LastIndex(ref, "/")
	if colon := strings.LastIndex(ref, ":"); colon > slash {
		ref = ref[:colon]
	}
	return ref
}

func (s *snapshotter) Prepare(ctx context.Context, key, parent string, opts ...snapshots.Opt) ([]mount.Mount, error) {
	var base snapshots.Info
	for _, o := range opts {
		if err := o(&base); err != nil {
			return nil, err
		}
	}
	target, unpacking := base.Labels[snapshots.LabelSnapshotRef]
	bundle, ours, err := bundleOf(base.Labels)
	if err != nil {
		return nil, err
	}
	if unpacking && ours {
		return nil, s.prepareBundle(ctx, key, parent, target, bundle, opts)
	}
	if unpacking {
		log.G(ctx).WithField("layer", base.Labels[labelLayer]).WithField("chain", target).
			Info("ordinary layer: containerd downloads and unpacks it into an overlayfs directory (not lazy)")
	}
	if err := s.ensureMounted(ctx, parent); err != nil {
		return nil, err
	}
	m, err := s.Snapshotter.Prepare(ctx, key, parent, opts...)
	s.status.refresh(ctx, s)
	return m, err
}

func (s *snapshotter) View(ctx context.Context, key, parent string, opts ...snapshots.Opt) ([]mount.Mount, error) {
	if err := s.ensureMounted(ctx, parent); err != nil {
		return nil, err
	}
	return s.Snapshotter.View(ctx, key, parent, opts...)
}

func (s *snapshotter) Mounts(ctx context.Context, key string) ([]mount.Mount, error) {
	info, err := s.Snapshotter.Stat(ctx, key)
	if err != nil {
		return nil, err
	}
	if err := s.ensureMounted(ctx, info.Parent); err != nil {
		return nil, err
	}
	return s.Snapshotter.Mounts(ctx, key)
}

func (s *snapshotter) Commit(ctx context.Context, name, key string, opts ...snapshots.Opt) error {
	if err := s.refusePlaceholder(ctx, key); err != nil {
		return err
	}
	err := s.Snapshotter.Commit(ctx, name, key, opts...)
	s.status.refresh(ctx, s)
	return err
}

// placeholderName is the one file of a runnable image's placeholder layer (runnable.py).
const placeholderName = ".btrfs-ublk-image"

// refusePlaceholder fails the commit of a placeholder layer that a client unpacked as
// an ordinary layer because it passed no layer annotations (containerd 1.6's `ctr image
// pull`): the container would see that one file instead of the image.
func (s *snapshotter) refusePlaceholder(ctx context.Context, key string) error {
	info, err := s.Snapshotter.Stat(ctx, key)
	if err != nil || info.Parent != "" {
		return nil // the commit itself reports a missing snapshot
	}
	dir, err := s.fsDir(ctx, key)
	if err != nil {
		return nil
	}
	entries, err := os.ReadDir(dir)
	if err != nil || len(entries) != 1 || entries[0].Name() != placeholderName {
		return nil
	}
	text, _ := os.ReadFile(filepath.Join(dir, placeholderName))
	id, _, _ := strings.Cut(string(text), "\n")
	log.G(ctx).WithField("image_id", id).Error("placeholder layer unpacked without its annotations: refused")
	return fmt.Errorf("layer is the placeholder of btrfs-ublk-image bundle %s, unpacked as an ordinary layer"+
		" because the client passed no layer annotations (containerd 1.6's `ctr image pull` does that):"+
		" pull with `btrfs-ublk-snapshotter pull`, containerd 2.x's ctr, nerdctl or the CRI: %w", id, errdefs.ErrFailedPrecondition)
}

// prepareBundle makes `target` a committed snapshot whose directory is the bundle's
// mount and answers AlreadyExists, which tells containerd the layer is unpacked.
func (s *snapshotter) prepareBundle(ctx context.Context, key, parent, target string, b bundleRef, opts []snapshots.Opt) error {
	exists := fmt.Errorf("target snapshot %q: %w", target, errdefs.ErrAlreadyExists)
	if parent != "" {
		return fmt.Errorf("bundle %s: its layer must be the image's only layer (it has parent %s)", b.location, parent)
	}
	s.mu.Lock()
	defer s.mu.Unlock()
	if _, err := s.Snapshotter.Stat(ctx, target); err == nil {
		return exists
	}
	start := time.Now()
	if _, err := s.Snapshotter.Prepare(ctx, key, "", opts...); err != nil {
		return err
	}
	if err := s.Snapshotter.Commit(ctx, target, key, opts...); err != nil {
		_ = s.Snapshotter.Remove(ctx, key)
		return err
	}
	dir, err := s.fsDir(ctx, target)
	if err == nil {
		err = s.mountBundle(ctx, b, dir)
	}
	if err != nil {
		if rerr := s.Snapshotter.Remove(ctx, target); rerr != nil {
			log.G(ctx).WithError(rerr).WithField("snapshot", target).Error("cannot remove the snapshot of a failed bundle mount")
		}
		return err
	}
	log.G(ctx).WithField("image_id", b.imageID).WithField("bundle", b.location).WithField("mountpoint", dir).
		WithField("ms", time.Since(start).Milliseconds()).
		Info("bundle layer served lazily: ublkd mounted it, containerd skips the layer download")
	s.status.refresh(ctx, s)
	return exists
}

// fsDir is the directory overlayfs uses for snapshot `key` (lowerdir of its children).
func (s *snapshotter) fsDir(ctx context.Context, key string) (string, error) {
	var id string
	err := s.ms.WithTransaction(ctx, false, func(ctx context.Context) error {
		var err error
		id, _, _, err = storage.GetInfo(ctx, key)
		return err
	})
	if err != nil {
		return "", err
	}
	return filepath.Join(s.root, "snapshots", id, "fs"), nil
}

// ublkdArgv: how ublkd is run: its binary, options before the verb, options of `mount`.
type ublkdArgv struct {
	bin           string
	global, mount []string
}

func (u ublkdArgv) args(verb string, rest ...string) []string {
	out := append(append([]string{}, u.global...), verb)
	if verb == "mount" {
		out = append(out, u.mount...)
	}
	return append(out, rest...)
}

func (s *snapshotter) mountBundle(ctx context.Context, b bundleRef, dir string) error {
	var rest []string
	if b.imageID != "" {
		rest = append(rest, "--expect-id", b.imageID)
	}
	rest = append(rest, b.location, dir)
	if err := runUblkd(ctx, s.ublkd.bin, s.ublkd.args("mount", rest...)); err != nil {
		return fmt.Errorf("bundle %s (image %s): %w", b.location, b.imageID, err)
	}
	return nil
}

func (s *snapshotter) umountBundle(ctx context.Context, dir string) error {
	if !isMountpoint(dir) {
		return nil
	}
	return runUblkd(ctx, s.ublkd.bin, s.ublkd.args("umount", dir))
}

func runUblkd(ctx context.Context, bin string, args []string) error {
	ctx, cancel := context.WithTimeout(ctx, mountTimeout)
	defer cancel()
	cmd := exec.CommandContext(ctx, bin, args...)
	// the server ublkd starts must outlive us: its own session, no pipes of ours kept open
	cmd.SysProcAttr = &syscall.SysProcAttr{Setsid: true}
	var out strings.Builder
	cmd.Stdout, cmd.Stderr = &out, &out
	if err := cmd.Run(); err != nil {
		return fmt.Errorf("ublkd %s: %v: %s", strings.Join(args, " "), err, strings.TrimSpace(out.String()))
	}
	return nil
}

// ensureMounted remounts the bundle of snapshot `key` (a parent about to be used) when
// it is a bundle snapshot whose mount is gone (host reboot, ublkd umount by hand): an
// overlay over its empty directory would silently show an empty image.
func (s *snapshotter) ensureMounted(ctx context.Context, key string) error {
	if key == "" {
		return nil
	}
	info, err := s.Snapshotter.Stat(ctx, key)
	if err != nil {
		return err
	}
	b, ours, err := bundleOf(info.Labels)
	if !ours {
		return nil
	}
	if err != nil {
		return err
	}
	dir, err := s.fsDir(ctx, key)
	if err != nil {
		return err
	}
	s.mu.Lock()
	defer s.mu.Unlock()
	if isMountpoint(dir) {
		return nil
	}
	log.G(ctx).WithField("bundle", b.location).WithField("mountpoint", dir).Warn("bundle mount missing: mounting it again")
	return s.mountBundle(ctx, b, dir)
}

func (s *snapshotter) Remove(ctx context.Context, key string) error {
	info, err := s.Snapshotter.Stat(ctx, key)
	if err != nil {
		return err
	}
	if _, ours, _ := bundleOf(info.Labels); ours && info.Kind == snapshots.KindCommitted {
		if err := s.removeBundle(ctx, key); err != nil {
			return err
		}
	}
	err = s.Snapshotter.Remove(ctx, key)
	s.status.refresh(ctx, s)
	return err
}

// removeBundle unmounts a bundle snapshot's directory, unless it still has children
// (then the overlay snapshotter's Remove refuses, and the mount must stay).
func (s *snapshotter) removeBundle(ctx context.Context, key string) error {
	children := 0
	if err := s.Snapshotter.Walk(ctx, func(context.Context, snapshots.Info) error {
		children++
		return nil
	}, fmt.Sprintf(`parent==%q`, key)); err != nil {
		return err
	}
	if children > 0 {
		return fmt.Errorf("snapshot %s has %d children: %w", key, children, errdefs.ErrFailedPrecondition)
	}
	dir, err := s.fsDir(ctx, key)
	if err != nil {
		return err
	}
	s.mu.Lock()
	defer s.mu.Unlock()
	if err := s.umountBundle(ctx, dir); err != nil {
		return err
	}
	log.G(ctx).WithField("snapshot", key).WithField("mountpoint", dir).Info("bundle unmounted")
	return nil
}

// Cleanup unmounts bundles left in directories the metadata no longer knows (a crash
// between Remove's metadata update and its unmount), then lets the overlay snapshotter
// delete those directories.
func (s *snapshotter) Cleanup(ctx context.Context) error {
	known := map[string]bool{}
	if err := s.ms.WithTransaction(ctx, false, func(ctx context.Context) error {
		ids, err := storage.IDMap(ctx)
		for id := range ids {
			known[id] = true
		}
		return err
	}); err != nil && !errdefs.IsNotFound(err) {
		return err
	}
	entries, err := os.ReadDir(filepath.Join(s.root, "snapshots"))
	if err != nil {
		return err
	}
	for _, e := range entries {
		dir := filepath.Join(s.root, "snapshots", e.Name(), "fs")
		if !known[e.Name()] && isMountpoint(dir) {
			if err := s.umountBundle(ctx, dir); err != nil {
				return err
			}
		}
	}
	c, ok := s.Snapshotter.(snapshots.Cleaner)
	if !ok {
		return nil
	}
	return c.Cleanup(ctx)
}

// restore runs at start: every bundle snapshot gets its mount back if it lost it (the
// mounts normally outlive a snapshotter restart: ublkd's servers are not our children).
func (s *snapshotter) restore(ctx context.Context) error {
	var keys []string
	if err := s.Snapshotter.Walk(ctx, func(_ context.Context, info snapshots.Info) error {
		if _, ours, _ := bundleOf(info.Labels); ours && info.Kind == snapshots.KindCommitted {
			keys = append(keys, info.Name)
		}
		return nil
	}); err != nil && !errdefs.IsNotFound(err) { // not found: an empty database
		return err
	}
	var errs []error
	for _, k := range keys {
		if err := s.ensureMounted(ctx, k); err != nil {
			errs = append(errs, err)
		}
	}
	log.G(ctx).WithField("bundles", len(keys)).Info("snapshots restored")
	s.status.refresh(ctx, s)
	return errors.Join(errs...)
}

func (s *snapshotter) Close() error {
	err := s.Snapshotter.Close()
	return errors.Join(err, s.ms.Close())
}

// isMountpoint: dir is on another filesystem than its parent (the bundle mount is
// btrfs over the snapshotter's own filesystem), or the same one bound onto itself.
func isMountpoint(dir string) bool {
	var st, pst syscall.Stat_t
	if syscall.Stat(dir, &st) != nil || syscall.Stat(filepath.Dir(dir), &pst) != nil {
		return false
	}
	if st.Dev != pst.Dev {
		return true
	}
	mounted, err := mount.Lookup(dir)
	return err == nil && mounted.Mountpoint == dir
}
